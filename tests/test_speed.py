"""`kvstack speed`: its rows, bytes and plot on a tiny model (no timing is asserted), and its errors."""

import json

import pytest
from typer.testing import CliRunner

from kvstack.bench.speed import HF_DYNAMIC, HF_STATIC, Engine, measure, plot, prompt_ids, ratios
from kvstack.cli import _transfer, app
from kvstack.errors import UserError


def test_engines_parse_from_the_command_line():
    assert Engine.parse("sdpa+dynamiccache") == Engine(HF_DYNAMIC)
    assert Engine.parse("full") == Engine("full", "full", "1.0")
    snap = Engine.parse("snapkv(window_size=8)@0.25")
    assert (snap.label, snap.budget) == ("snapkv(window_size=8)@0.25", "0.25")
    with pytest.raises(UserError, match="did you mean"):
        Engine.parse("keydif@0.1")
    with pytest.raises(UserError):
        Engine.parse("keydiff@1.5")
    with pytest.raises(UserError, match=r"unknown decoding mode ':compild'.*did you mean :compiled"):
        Engine.parse("keydiff@0.125:compild")  # a misspelt mode, not a bad budget
    with pytest.raises(UserError, match="use :slab or :compiled"):
        Engine.parse("full:eager")


def test_prompt_ids_are_seeded_and_in_the_vocabulary():
    a, b = prompt_ids(64, 97), prompt_ids(64, 97)
    assert a.tolist() == b.tolist() and a.shape == (1, 64)
    assert int(a.min()) >= 24 and int(a.max()) < 97


def test_every_engine_is_measured_at_every_length(llama, tmp_path):
    engines = [Engine.parse(x) for x in (HF_DYNAMIC, HF_STATIC, "full", "keydiff@0.25", "streaming@16t")]
    rows = measure(llama, engines, [64, 128], new_tokens=4, repeats=2)
    assert [(r.engine, r.length) for r in rows] == [(e.label, n) for n in (64, 128) for e in engines]
    by = {(r.engine, r.length): r for r in rows}
    for n in (64, 128):
        full, hf = by[("full", n)], by[(HF_DYNAMIC, n)]
        assert full.kv_bytes == hf.kv_bytes  # kvstack's full cache holds what transformers' does
        assert by[("keydiff@0.25", n)].kv_bytes <= 0.25 * full.kv_bytes
        assert by[("keydiff@0.25", n)].peak_kv_bytes >= by[("keydiff@0.25", n)].kv_bytes
        assert by[(HF_STATIC, n)].kv_bytes >= full.kv_bytes  # preallocated for the new tokens too
        assert all(r.prefill_s > 0 and r.decode_tokens_per_s > 0 for r in rows)
    assert ratios(rows, "full")[("full", 64)] == (1.0, 1.0)
    assert llama.config._attn_implementation == "kvstack"  # left as it was found
    plot(rows, tmp_path / "speed.png")
    assert (tmp_path / "speed.png").read_bytes()[:4] == b"\x89PNG"


def test_too_few_new_tokens_and_too_long_prompts_are_one_line_errors(llama):
    with pytest.raises(UserError, match="at least 2"):
        measure(llama, [Engine.parse("full")], [32], new_tokens=1)
    with pytest.raises(UserError, match="maximum of 2048"):
        measure(llama, [Engine.parse("full")], [2048], new_tokens=8)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--stacks", "snapkvv@0.25"], "did you mean snapkv"),
        (["--lengths", "2q"], "length '2q' is not understood"),
        (["--repeats", "0"], "give at least 1"),
        (["--model", "smollm2-135m", "--lengths", "8k"], "exceeds smollm2-135m's maximum of 8192 tokens"),
    ],
)
def test_bad_input_fails_in_one_line_before_the_model_loads(args, message):
    model = [] if "--model" in args else ["--model", "no-such-model"]
    result = CliRunner().invoke(app, ["speed", *model, *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_the_defaults_fit_the_default_model(monkeypatch):
    """`kvstack speed` with no options gets past its checks to loading SmolLM2 (8k = 8192 would not)."""
    import kvstack.models

    def load(name):
        raise UserError(f"would load {name}")

    monkeypatch.setattr(kvstack.models, "load", load)
    result = CliRunner().invoke(app, ["speed"])
    assert "would load smollm2-135m" in result.output, result.output


def test_the_command_writes_json_and_png(monkeypatch, tmp_path, llama):
    import kvstack.models

    class Loaded:
        model = llama

    monkeypatch.setattr(kvstack.models, "load", lambda name: Loaded)
    out = tmp_path / "speed"
    args = ["speed", "--stacks", "keydiff@0.5", "--lengths", "48", "--new-tokens", "3", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "speed.json").read_text())
    assert [r["engine"] for r in rows] == [HF_DYNAMIC, "full", "keydiff@0.5"]
    assert (out / "speed.png").exists()
    assert "decode vs full" in result.output


def test_a_retrievers_slow_tier_reads_are_reported(llama):
    engines = [Engine.parse("full"), Engine.parse("quest(page=8, select=32)@0.3")]
    rows = {r.engine: r for r in measure(llama, engines, [200], new_tokens=6)}
    tiered = rows[engines[1].label]
    assert tiered.fetched_bytes_per_step > 0 and tiered.fetch_s_per_step > 0
    assert rows["full"].fetched_bytes_per_step == 0 and "GB/s" in _transfer(tiered)
