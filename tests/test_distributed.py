"""`kvstack bench --ray`: a sweep on a local Ray cluster of two workers stores the same rows as
one job, resumes like one, and a cluster that cannot be reached is one line."""

import pytest

pytest.importorskip("ray")

from kvstack import load  # noqa: E402
from kvstack.bench.distributed import Relay, run_ray  # noqa: E402
from kvstack.bench.jobs import run_sweep  # noqa: E402
from kvstack.bench.runner import Sweep  # noqa: E402
from kvstack.bench.store import Cell, Row, Store  # noqa: E402
from kvstack.errors import UserError  # noqa: E402


def test_a_two_worker_ray_sweep_stores_the_rows_of_one_job(tiny_folder, tmp_path, monkeypatch):
    import torch

    lm = load(str(tiny_folder))
    sweep = Sweep(str(tiny_folder), ("knorm", "snapkv"), ("0.5",), ("niah_single", "fidelity"), (300,), samples=2)
    one, ray = Store(tmp_path / "one.sqlite"), Store(tmp_path / "ray.sqlite")
    assert run_sweep(lm, sweep, one) == 3 * 2 * 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two workers need two cores
    assert run_ray(lm, sweep, ray, console=None_console(), address="local", jobs=2) == 3 * 2 * 2
    assert run_ray(lm, sweep, ray, console=None_console(), address="local", jobs=2) == 0  # resumes

    def rows(store):
        return {
            (r["method"], r["task"], r["sample"], r["question"]): (r["answer"], r["score"], r["kv_bytes"])
            for r in store.rows()
        }

    assert rows(one) == rows(ray)


def test_a_relay_skips_what_the_driver_stored_and_what_it_holds():
    cell = Cell("m", "knorm", "0.5", "agnostic", "niah_single", 300)
    relay = Relay({cell: {(0, 0)}})
    assert relay.add(Row(cell, 1, 0, 1.0, "a", ("a",)))
    assert relay.done(cell) == {(0, 0), (1, 0)} and relay.done(Cell("m", "tova", "0.5", "agnostic", "vt", 300)) == set()


def test_an_unreachable_cluster_is_one_line(tiny_folder, tmp_path):
    lm = load(str(tiny_folder))
    sweep = Sweep(str(tiny_folder), ("knorm",), ("0.5",), ("niah_single",), (300,), samples=1)
    with pytest.raises(UserError, match="cannot reach the Ray cluster"):
        run_ray(lm, sweep, Store(tmp_path / "r.sqlite"), None_console(), "127.0.0.1:1", 1)


def None_console():  # noqa: N802
    from rich.console import Console

    return Console(stderr=True, quiet=True)
