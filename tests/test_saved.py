"""Saved caches: save -> load gives a cache that goes on exactly like the original (same logits at
every step, same bytes), for one stack of each family; bad files are refused with one line."""

import json
import struct

import pytest
import torch

from kvstack.cache.cache import KVCache
from kvstack.cache.saved import FORMAT, load, read_header
from kvstack.errors import UserError
from kvstack.generate import Prompt, Runner, generate_from, generate_ids, left_pad, resume
from kvstack.stack import Stack
from tiny import tiny_llama

# one stack of each family (and the special cases of the core: prompt passes, allocators' weights,
# byte budgets, demoted tokens, per-token bit widths, compensation tokens, `auto`'s plan)
FAMILIES = {
    "eviction": ("snapkv(window_size=4, every=4)", 0.5),
    "attention statistics": ("h2o", 0.5),
    "prompt pass": ("kvzip", 0.5),
    "allocator": ("adakv(snapkv(window_size=4, every=4))", 0.5),
    "byte budget": ("pyramid(snapkv(window_size=4, every=4))", "20KB"),
    "quantized": ("kivi(bits=2, group=8, residual=8)", 1.0),
    "evict+quantize": ("snapkv(window_size=4, every=4)+adaquant(group=4, residual=0)", 0.5),
    "demoted": ("mikv(snapkv(window_size=4, every=4), group=8, residual=0)", 0.5),
    "per-token bits": ("snapkv(window_size=4, every=4)+qaq(residual=0)", 0.5),
    "query-aware codes": ("snapkv(window_size=4, every=4)+squat(group=4, block=4, residual=0, queries=8)", 0.5),
    "low-rank error": ("gear(group=8, chunk=16, residual=8)", 1.0),
    "codebooks": ("cq(bits=2, channels=2, residual=8, tokens=128)", 1.0),
    "quantiles": ("quantile(group=16, residual=8)", 1.0),
    "rotated": ("hadamard+kivi(bits=2, group=8, residual=8)", 1.0),
    "sphere levels": ("turboquant(bits=3, qjl=True, residual=8)", 1.0),
    "run means": ("turboquant(bits=2, center=8, residual=8)", 1.0),
    "pre-RoPE levels": ("kvquant(tokens=64, residual=8)", 1.0),
    "merged": ("chelsea(chunk_size=4)", 0.5),
    "compensation": ("razor(snapkv(window_size=4, every=4))", 0.5),
    "low-rank": ("pca(r=8, residual=8)", 1.0),
    "pre-RoPE low-rank": ("snapkv(window_size=4)+shadowkv(r=4, chunk=4, residual=0)", 0.5),
    "cross-layer": ("minicache", 1.0),
    "cross-layer tables": ("xkv", 1.0),
    "auto": ("auto(tokens=256, samples=1, least=2, validate=1)", 0.25),
}
ROWS = [(40, 5), (29, 8)]  # (context, question) lengths: two rows of a batch, the second padded


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def prompts():
    return [Prompt(tokens(c, 2 * i), tokens(q, 2 * i + 1)) for i, (c, q) in enumerate(ROWS)]


def compressed(model, spec, budget):
    """A runner whose cache holds the batch's contexts, compressed query-agnostically."""
    runner = Runner(model, KVCache(model, spec, budget))
    runner.prefill(*left_pad([p.context for p in prompts()], 0))
    return runner


def go_on(runner, steps=10):
    """The questions (exempt), then `steps` greedy tokens: logits and bytes at every step."""
    logits, held = [], []
    with runner.cache.exempt():
        out = runner.forward(*left_pad([p.question for p in prompts()], 0))
    for _ in range(steps):
        logits.append(out)
        held.append(runner.cache.nbytes())
        out = runner.forward(out.argmax(-1, keepdim=True).cpu(), torch.ones(out.shape[0], 1, dtype=torch.long))
    return torch.stack(logits), held


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_loaded_cache_goes_on_like_the_one_saved(tiny, family, tmp_path):
    spec, budget = FAMILIES[family]
    runner = compressed(tiny, spec, budget)
    before = runner.cache.nbytes()
    header = runner.cache.save(tmp_path / "c.kvc", last_logits=runner.last_logits)
    cache, last, loaded_header = load(tiny, tmp_path / "c.kvc")
    assert header == loaded_header and header["kv_bytes"] == before
    assert cache.nbytes() == before and cache.aux_nbytes() == runner.cache.aux_nbytes()
    assert torch.equal(last, runner.last_logits)
    reference, held = go_on(runner)
    resumed, held_loaded = go_on(resume(tiny, cache, last))
    assert torch.equal(resumed, reference)
    assert held_loaded == held


def test_generate_from_a_file_answers_like_generate_ids(llama, tmp_path):
    spec = "snapkv(window_size=4, every=4)+kivi(bits=2, group=8, residual=0)"
    expected, measured = generate_ids(llama, prompts(), spec, 0.5, query_agnostic=True, max_new_tokens=8)
    runner = compressed(llama, spec, 0.5)
    runner.cache.save(tmp_path / "c.kvc", last_logits=runner.last_logits)
    cache, last, _ = load(llama, tmp_path / "c.kvc")
    ids, loaded = generate_from(llama, cache, [p.question for p in prompts()], last, max_new_tokens=8)
    assert ids == expected
    assert (loaded["kv_bytes"], loaded["kv_bytes_end"]) == (measured["kv_bytes"], measured["kv_bytes_end"])


def test_a_cache_and_its_file_are_independent(llama, tmp_path):
    runner = compressed(llama, "snapkv(window_size=4, every=4)", 0.5)
    runner.cache.save(tmp_path / "c.kvc", last_logits=runner.last_logits)
    first, last, _ = load(llama, tmp_path / "c.kvc")
    go_on(resume(llama, first, last))  # the first loaded copy decodes and evicts
    second, last, _ = load(llama, tmp_path / "c.kvc")
    assert second.nbytes() == runner.cache.nbytes()
    assert torch.equal(go_on(resume(llama, second, last))[0], go_on(runner)[0])


# ---- bad files -------------------------------------------------------------------------------------
@pytest.fixture
def saved(llama, tmp_path):
    runner = compressed(llama, "snapkv(window_size=4, every=4)", 0.5)
    path = tmp_path / "c.kvc"
    runner.cache.save(path, last_logits=runner.last_logits)
    return path


def refused(model, path, words):
    with pytest.raises(UserError, match=words) as err:
        load(model, path)
    assert "\n" not in str(err.value)


def test_another_models_cache_is_refused(saved):
    refused(tiny_llama(seed=1), saved, "holds a cache of model")


def test_a_truncated_file_is_refused(saved):
    blob = saved.read_bytes()
    for cut in (4, 100, len(blob) // 2, len(blob) - 1):
        saved.write_bytes(blob[:cut])
        with pytest.raises(UserError, match="truncated|damaged|not a kvstack"):
            load(tiny_llama(), saved)


def test_a_flipped_byte_is_refused(saved):
    blob = bytearray(saved.read_bytes())
    for at in (len(blob) - 10, len(blob) // 2, 8 + 40):  # in a storage, in the middle, in the JSON header
        flipped = bytearray(blob)
        flipped[at] ^= 0x01
        saved.write_bytes(bytes(flipped))
        with pytest.raises(UserError, match="damaged|not a kvstack|cannot be read"):
            load(tiny_llama(), saved)


def test_a_format_from_the_future_is_refused(saved):
    blob = saved.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    head = json.loads(blob[8 : 8 + n])
    header = json.loads(head["__metadata__"]["kvstack"])
    header["format"] = FORMAT + 1
    head["__metadata__"]["kvstack"] = json.dumps(header)
    raw = json.dumps(head).encode()
    raw += b" " * ((-len(raw)) % 8)
    saved.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])
    refused(tiny_llama(), saved, f"format {FORMAT + 1}, newer")
    with pytest.raises(UserError, match="newer"):
        read_header(saved)


def test_other_files_are_refused(tmp_path, llama):
    refused(llama, tmp_path / "missing.kvc", "no cache file")
    (tmp_path / "text.kvc").write_text("hello")
    refused(llama, tmp_path / "text.kvc", "not a kvstack cache")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "weights.safetensors")
    refused(llama, tmp_path / "weights.safetensors", "not a kvstack cache")


def test_the_header_reads_without_the_tensors(saved):
    header = read_header(saved)
    assert header["stack"] == Stack.parse("snapkv(window_size=4, every=4)").label and header["budget"] == "0.5"
    assert header["tokens"] == [40, 29] and header["slots"] == 40
    assert header["kv_bytes"] < header["kv_bytes_full"] and header["file_bytes"] == saved.stat().st_size
