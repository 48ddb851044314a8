"""Running a sweep: in this process, or with `--jobs N` in N spawned processes, each with its
share of the cores, pulling the sweep's units from one queue.

Every job loads the model, runs whole units (a question under every config, or a fidelity
window) and writes rows to the same SQLite store (WAL, one commit per row), so a killed
parallel sweep resumes like a single job. Progress comes back to the parent over a queue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstack.bench.runner import Share, Sweep, progress_bar
from kvstack.bench.store import Store
from kvstack.errors import UserError
from kvstack.generate import warm_up
from kvstack.models.loading import LoadedModel


def run_sweep(lm: LoadedModel, sweep: Sweep, store: Store, console: Console | None = None, jobs: int = 1) -> int:
    """Answer every missing (cell, sample, question); returns how many rows were written.

    `jobs` > 1 runs units (a sample's question under every config, or a fidelity window) in
    that many processes, each with its share of the cores, all writing to the same store
    (`kvstack.bench.distributed` runs them on a Ray cluster).
    """
    console = console or Console(stderr=True)
    if jobs > 1:
        failed, written = run_parallel(lm, sweep, store.path, console, jobs)
    else:
        share = Share(lm, sweep, store)
        warm_up(lm.model)
        written = 0
        with progress_bar(console) as bar:
            task_bar = bar.add_task("sweep", total=share.steps)

            def advance(rows: int = 0, steps: int = 1) -> None:
                nonlocal written
                written += rows
                bar.advance(task_bar, steps)

            for unit in share.units:
                bar.update(task_bar, description=share.describe(unit))
                share.run(unit, advance)
        share.close()
        failed = share.failed
    report_failed(console, failed)
    return written


def report_failed(console: Console, failed: dict[str, str]) -> None:
    """One line per method the cache refused or that failed (no rows were stored for it)."""
    for method, error in failed.items():
        what = "refused" if " at " in method else "failed"
        console.print(f"[yellow]{method} {what}, no rows stored:[/] {error}", highlight=False)


@dataclass(frozen=True)
class JobModel:
    """How a job loads the parent's model: same source and dtype, same prompt style (chat, BOS).

    The prompt style is the parent's, not what a reload infers: Gemma 3 reloaded from its
    converted folder would lose the BOS its registry entry adds, and every answer with it.
    """

    source: str
    dtype: str
    chat: bool
    add_bos: bool

    @classmethod
    def of(cls, lm: LoadedModel, source: str) -> JobModel:
        return cls(source, str(lm.model.dtype).removeprefix("torch."), lm.chat, lm.add_bos)

    def load(self) -> LoadedModel:
        import torch

        from kvstack.models import load

        return replace(load(self.source, dtype=getattr(torch, self.dtype)), chat=self.chat, add_bos=self.add_bos)


def threads_per_job(jobs: int) -> int:
    """Cores each of `jobs` processes gets; more jobs than cores is refused (they would thrash)."""
    import torch

    cores = torch.get_num_threads()
    if jobs < 1:
        raise UserError("--jobs must be at least 1")
    if jobs > cores:
        raise UserError(
            f"--jobs {jobs} is more than the {cores} cores torch uses here: each job needs a core of its own "
            f"(use --jobs {cores} or fewer)"
        )
    return cores // jobs


def calibrate(lm: LoadedModel, share: Share) -> None:
    """Measure here, once and with every core, what the sweep's stacks calibrate on the model
    (head scores, codebooks, auto's curves and validation); the jobs then read it from disk
    instead of each measuring the same table at once on its share of the cores."""
    from kvstack.cache.cache import KVCache

    for stack in {id(stack): stack for stack, _ in share.configs}.values():  # one per spec, not per budget
        try:
            KVCache(lm.model, stack, 1.0)  # a cache prepares its stack's calibrations when built
        except (UserError, ValueError):
            pass  # the sweep names a stack the cache refuses


def run_parallel(lm: LoadedModel, sweep: Sweep, path: Path, console: Console, jobs: int) -> tuple[dict[str, str], int]:
    """Spawn `jobs` workers pulling units from one queue; show their progress in one bar."""
    import multiprocessing as mp
    import queue

    threads = threads_per_job(jobs)
    share = Share(lm, sweep, None)  # the parent only plans, counts and calibrates
    if share.units:
        calibrate(lm, share)
    ctx = mp.get_context("spawn")
    todo, events = ctx.Queue(), ctx.Queue()
    for unit in share.units:
        todo.put(unit)
    for _ in range(jobs):
        todo.put(None)
    model = JobModel.of(lm, sweep.model)
    procs = [ctx.Process(target=_worker, args=(model, sweep, str(path), threads, todo, events)) for _ in range(jobs)]
    for proc in procs:
        proc.start()
    failed: dict[str, str] = {}
    written, finished = 0, 0
    with progress_bar(console) as bar:
        label = f"sweep ({jobs} jobs x {threads} thread{'s' if threads > 1 else ''})"
        task_bar = bar.add_task(label, total=share.steps)
        while finished < jobs:
            try:
                kind, *payload = events.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    raise UserError(
                        f"a benchmark job died (exit code {dead[0].exitcode}); finished rows are stored: "
                        "re-run the same command to resume"
                    ) from None
                continue
            if kind == "advance":
                written += payload[0]
                bar.advance(task_bar, payload[1])
            elif kind == "failed":
                failed[payload[0]] = payload[1]
            elif kind == "error":
                for p in procs:
                    p.kill()
                raise UserError(payload[0])
            elif kind == "done":
                finished += 1
    for proc in procs:
        proc.join()
    return failed, written


def _exit_with_parent() -> None:
    """End this job when the sweep that spawned it ends, even killed (SIGTERM, SIGKILL): an
    orphaned job would go on writing rows into a folder the user thinks is idle."""
    import multiprocessing as mp
    import os
    import threading

    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent process is gone
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(model: JobModel, sweep: Sweep, path: str, threads: int, todo: Any, events: Any) -> None:
    """One job: load the model with `threads` cores, run units until the queue says stop."""
    import os

    _exit_with_parent()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the rival's worker process too
    import torch

    torch.set_num_threads(threads)
    try:
        lm = model.load()
        store = Store(Path(path))
        share = Share(lm, sweep, store)
        warm_up(lm.model)

        def advance(rows: int = 0, steps: int = 1) -> None:
            events.put(("advance", rows, steps))

        while (unit := todo.get()) is not None:
            share.run(unit, advance)
        share.close()
        store.close()
        for method, error in share.failed.items():
            events.put(("failed", method, error))
    except UserError as err:
        events.put(("error", str(err)))
        return
    events.put(("done",))
