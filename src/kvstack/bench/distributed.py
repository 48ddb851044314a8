"""`kvstack bench --ray ADDRESS`: the same sweep on a Ray cluster (`local` starts one here).

Each of `jobs` Ray actors loads the model once, with its share of a node's cores, and pulls the
sweep's units (a question under every config, or a fidelity window) as it frees up. An actor
never writes the store: it returns the unit's rows, and the driver writes them to the one SQLite
file as each unit comes back, so a killed sweep resumes like a local one and workers on other
machines need no shared disk. What is stored already is read once by the driver and sent to the
actors, which skip it.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from dataclasses import dataclass, field

from rich.console import Console

from kvstack.bench.jobs import JobModel, calibrate, report_failed, threads_per_job
from kvstack.bench.runner import Share, Sweep, Unit, progress_bar
from kvstack.bench.store import CELL, Cell, Row, Store
from kvstack.errors import UserError
from kvstack.models.loading import LoadedModel


@dataclass
class Relay:
    """A worker's stand-in for the store: `done` from the driver's snapshot and the rows of the
    unit in hand, `add` keeps a row to send back."""

    stored: dict[Cell, set[tuple[int, int]]]
    rows: list[Row] = field(default_factory=list)

    def done(self, cell: Cell) -> set[tuple[int, int]]:
        return self.stored.get(cell, set()) | {(r.sample, r.question) for r in self.rows if r.cell == cell}

    def add(self, row: Row) -> bool:
        self.rows.append(row)
        return True


class Worker:
    """One Ray actor: the model loaded once with `threads` cores, then units on request."""

    def __init__(self, model: JobModel, sweep: Sweep, stored: dict[Cell, set[tuple[int, int]]], threads: int) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the rival's worker process too
        import torch

        from kvstack.generate import warm_up

        torch.set_num_threads(threads)
        self.relay = Relay(stored)
        self.share = Share(model.load(), sweep, self.relay)  # type: ignore[arg-type]
        warm_up(self.share.lm.model)

    def run(self, unit: Unit) -> tuple[list[Row], int, dict[str, str]]:
        """(rows, progress steps, methods that failed) of one unit."""
        self.relay.rows = []
        done = [0]

        def advance(rows: int = 0, steps: int = 1) -> None:
            done[0] += steps

        self.share.run(unit, advance)
        return list(self.relay.rows), done[0], dict(self.share.failed)


def run_ray(lm: LoadedModel, sweep: Sweep, store: Store, console: Console, address: str, jobs: int) -> int:
    """Run the sweep's missing units on `jobs` actors of the Ray cluster at `address` (`local`:
    a cluster started here with this machine's cores); how many rows were written."""
    try:
        import ray
        from ray.util import ActorPool
    except ImportError:
        raise UserError("Ray is not installed: pip install 'kvstack[ray]'") from None
    share = Share(lm, sweep, None)  # the driver plans and counts; the actors skip what is stored
    if not share.units:
        return 0
    calibrate(lm, share)  # measured once here, read from disk by actors on this machine
    local = address == "local"
    cores = threads_per_job(1)
    if local:
        threads_per_job(jobs)  # more local workers than cores would thrash
    try:
        if local:
            ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            _check_reachable(address)
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot reach the Ray cluster at {address}: {str(e).splitlines()[0]}") from None
    try:
        threads = max(1, int(ray.cluster_resources().get("CPU", cores)) // jobs)
        actor = ray.remote(num_cpus=threads)(Worker)
        model = JobModel.of(lm, sweep.model)
        stored = _stored(store)
        pool = ActorPool([actor.remote(model, sweep, stored, threads) for _ in range(jobs)])
        failed: dict[str, str] = {}
        written = 0
        with progress_bar(console) as bar:
            task_bar = bar.add_task(f"sweep (Ray: {jobs} workers x {threads} threads)", total=share.steps)
            for rows, steps, failures in pool.map_unordered(lambda a, unit: a.run.remote(unit), share.units):
                written += sum(store.add(row) for row in rows)
                failed.update(failures)
                bar.advance(task_bar, steps)
        report_failed(console, failed)
        return written
    finally:
        if local:
            ray.shutdown()


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A `host:port` (or `ray://host:port`) nobody answers on is refused at once (Ray itself retries
    for minutes); `auto` and other forms are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers on {host}:{port} ({e.strerror or e})") from None


def _stored(store: Store) -> dict[Cell, set[tuple[int, int]]]:
    """Every (sample, question) stored, per cell."""
    found: dict[Cell, set[tuple[int, int]]] = defaultdict(set)
    for row in store.rows():
        found[Cell(*(row[k] for k in CELL))].add((row["sample"], row["question"]))
    return dict(found)
