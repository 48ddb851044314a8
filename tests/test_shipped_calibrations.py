"""Calibration tables shipped with kvstack: read when nothing was measured here, checked (format,
model, kind, hash) and refused in one line, left out by `kvstack calibrate`, written by `--ship`."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kvstack import calibrate
from kvstack.calibrate import store
from kvstack.cli import app
from kvstack.errors import UserError


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """A fresh calibration folder and a fresh shipped folder, the memo empty before and after."""
    monkeypatch.setenv("KVSTACK_CALIBRATION", str(tmp_path / "here"))
    monkeypatch.setattr(store, "SHIPPED", tmp_path / "shipped")
    calibrate.forget()
    yield tmp_path / "here", tmp_path / "shipped"
    calibrate.forget()


def measured(value: float):
    def compute(model):
        return torch.full((2, 3), value)

    return compute


def never(model):
    raise AssertionError("the table was measured again")


def test_a_shipped_table_is_read_when_nothing_was_measured_here(llama, folders):
    here, shipped = folders
    table = calibrate.calibrated(llama, "t-v1", measured(1.5))
    assert store.ship_tables(llama) == [shipped / f"{calibrate.model_key(llama)}-t-v1.safetensors"]
    (here / f"{calibrate.model_key(llama)}-t-v1.pt").unlink()  # a fresh machine: nothing measured here
    calibrate.forget()
    assert torch.equal(calibrate.calibrated(llama, "t-v1", never), table)
    assert not list(here.glob("*.pt"))  # read in place, not copied into the user's folder
    calibrate.forget()
    assert torch.equal(calibrate.calibrated(llama, "t-v1", measured(2.0))[0, 0], torch.tensor(1.5))


def test_a_table_measured_here_comes_before_the_shipped_one(llama, folders):
    calibrate.calibrated(llama, "t-v1", measured(1.0))
    store.ship_tables(llama)
    calibrate.forget()
    (folders[0] / f"{calibrate.model_key(llama)}-t-v1.pt").unlink()
    torch.save(torch.full((2, 3), 7.0), folders[0] / f"{calibrate.model_key(llama)}-t-v1.pt")
    assert float(calibrate.calibrated(llama, "t-v1", never)[0, 0]) == 7.0


def test_without_shipped_tables_the_table_is_measured(llama, folders, monkeypatch):
    calibrate.calibrated(llama, "t-v1", measured(1.0))
    store.ship_tables(llama)
    (folders[0] / f"{calibrate.model_key(llama)}-t-v1.pt").unlink()
    calibrate.forget()
    monkeypatch.setenv("KVSTACK_SHIPPED", "1")
    with store.without_shipped():
        assert float(calibrate.calibrated(llama, "t-v1", measured(3.0))[0, 0]) == 3.0
    assert store.os.environ["KVSTACK_SHIPPED"] == "1"  # restored


@pytest.mark.parametrize("damage", ["flipped byte", "other model", "other kind", "future format", "truncated"])
def test_a_shipped_table_that_is_not_what_it_is_named_is_refused_in_one_line(llama, folders, damage):
    _, shipped = folders
    calibrate.calibrated(llama, "t-v1", measured(1.0))
    (path,) = store.ship_tables(llama)
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    if damage == "flipped byte":
        tensors["table"][0, 0] = 1.0000001
    elif damage == "other model":
        meta["model_key"] = "llama-000000000000"
    elif damage == "other kind":
        meta["kind"] = "t-v0"
    elif damage == "future format":
        meta["format"] = "99"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-5])
    else:
        save_file(tensors, str(path), metadata=meta)
    with pytest.raises(UserError) as e:
        store.shipped(calibrate.model_key(llama), "t-v1")
    message = str(e.value)
    assert "\n" not in message and str(path) in message and "kvstack calibrate --model" in message


def test_kvstack_calibrate_measures_a_stack_and_ships_its_tables(tiny_folder, folders):
    here, shipped = folders
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_folder), "--method", "razor", "--ship"])
    assert result.exit_code == 0, result.output
    (table,) = here.glob("*-razor-v1.pt")
    (copy,) = shipped.glob("*-razor-v1.safetensors")
    assert copy.name == table.name.replace(".pt", ".safetensors") and "shipped" in result.output
    assert torch.equal(load_file(str(copy))["table"], torch.load(table))
    bad = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_folder), "--method", "snapkvv"])
    assert bad.exit_code == 2 and "snapkv" in bad.output and "Traceback" not in bad.output


def test_a_ticker_writes_a_plain_line_per_tenth_where_stderr_is_not_a_terminal(capsys):
    """A log file gets "what: done/total, elapsed, time left" at each tenth of the work (a bar
    cannot redraw there); a quick calibration, under `after` seconds, prints nothing."""
    with store.Ticker("measuring", 20, after=0.0) as ticker:
        for _ in range(20):
            ticker.advance()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10, lines
    assert lines[0].startswith("measuring: 2/20, ") and lines[-1].startswith("measuring: 20/20, ")
    assert "min left" in lines[0]
    with store.Ticker("quick", 20, after=60.0) as ticker:
        for _ in range(20):
            ticker.advance()
    assert capsys.readouterr().err == ""
