"""Decoding on a slab (`SlabCache`): fixed-shape storage that answers like the KVCache it came
from, traces once under `torch.compile(fullgraph=True)`, and refuses stacks it cannot hold."""

import math

import pytest
import torch
import torch._dynamo as dynamo

from kvstack.bench.speed import Engine
from kvstack.cache.cache import KVCache
from kvstack.cache.slab import ROOM, SlabLayer, SlabView, attend
from kvstack.cache.slab_cache import SlabCache, check_slab
from kvstack.errors import UserError
from kvstack.generate import Prompt, Runner, SlabRunner, generate_ids, left_pad
from kvstack.stack import Stack
from tiny import tiny_gemma3, tiny_llama

PROMPT, STEPS = 64, 40
EVICTING = [("full", 1.0), ("keydiff", 0.5), ("snapkv", 0.3), ("pyramid(keydiff)", 0.4), ("streaming", 0.25)]


def prompt(batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def decode(model, stack, budget, rows=None, slab=False, **kwargs):
    """Greedy ids (b, STEPS) and the logits of each step (STEPS, b, vocab), on the KVCache or a slab."""
    ids, mask = left_pad(rows, 0) if rows is not None else (prompt(), torch.ones(1, PROMPT, dtype=torch.long))
    runner = Runner(model, KVCache(model, stack, budget))
    logits = runner.prefill(ids, mask)
    on = SlabRunner(runner, STEPS, **kwargs) if slab else None
    out, seen = [], []
    for _ in range(STEPS):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        seen.append(logits)
        logits = on.forward(nxt) if on is not None else runner.forward(nxt, torch.ones_like(nxt))
    return torch.cat(out, 1), torch.stack(seen), on.slab if on is not None else runner.cache


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_llama() if request.param == "llama" else tiny_gemma3()


@pytest.mark.parametrize("stack,budget", EVICTING)
def test_a_slab_decodes_like_the_cache_it_came_from(model, stack, budget):
    ids, logits, cache = decode(model, stack, budget)
    slab_ids, slab_logits, slab = decode(model, stack, budget, slab=True)
    assert torch.equal(ids, slab_ids)
    torch.testing.assert_close(slab_logits, logits, atol=1e-5, rtol=0)
    assert slab.cache.compressions == cache.compressions  # the same policy decided at the same steps
    assert slab.grown == 0


def test_a_padded_batch_decodes_like_the_cache():
    model = tiny_llama()
    rows = [prompt(seed=2)[0].tolist(), prompt(seed=3)[0, :40].tolist()]
    ids, logits, _ = decode(model, "keydiff", 0.5, rows)
    slab_ids, slab_logits, _ = decode(model, "keydiff", 0.5, rows, slab=True)
    assert torch.equal(ids, slab_ids)
    torch.testing.assert_close(slab_logits, logits, atol=1e-5, rtol=0)


def test_the_slab_is_sized_by_the_budget_and_never_reallocated():
    """keydiff at 1/2 of a head's 128 bytes a token (+4 for its slot): by the last of 64 + 40
    tokens a head may hold floor(0.5 * 104 * 128 / 132) = 50, plus ROOM places."""
    model = tiny_llama()
    runner = Runner(model, KVCache(model, "keydiff", 0.5))
    runner.prefill(prompt(), torch.ones(1, PROMPT, dtype=torch.long))
    on = SlabRunner(runner, STEPS)
    share = math.floor(0.5 * (PROMPT + STEPS) * 128 / 132)
    assert all(slab.capacity == share + ROOM for slab in on.slab.slabs)
    layers, b, h, d = 4, 1, 2, 16
    places = layers * b * h * (share + ROOM)
    assert on.slab.nbytes() == places * (2 * d * 4 + 4) + layers * h * 8  # keys, values, slots; lengths
    pointers = [(s.keys.data_ptr(), s.values.data_ptr(), s.slots.data_ptr()) for s in on.slab.slabs]
    nxt = torch.tensor([[5]])
    for _ in range(STEPS - 1):
        on.forward(nxt)
    assert [(s.keys.data_ptr(), s.values.data_ptr(), s.slots.data_ptr()) for s in on.slab.slabs] == pointers
    assert max(max(s.used) for s in on.slab.slabs) <= share  # the policy evicted in place


def test_a_share_ahead_of_the_decode_is_the_share_the_decode_reaches():
    """`keep_allowed(layer, seen)` gives, without touching the layer, what a head may hold once
    the decode has reached `seen` slots (padded rows: the tokens to come are real)."""
    model = tiny_llama()
    rows = [prompt(seed=2)[0].tolist(), prompt(seed=3)[0, :40].tolist()]
    ids, mask = left_pad(rows, 0)
    runner = Runner(model, KVCache(model, "pyramid(keydiff)", 0.4))
    logits = runner.prefill(ids, mask)
    cache = runner.cache
    layer = cache.layers[1]
    seen = layer.seen
    ahead = cache.policy.shares.keep_allowed(layer, seen + 12)
    assert layer.seen == seen and cache.seq.padding.shape[1] == seen  # nothing moved
    for _ in range(12):
        nxt = logits.argmax(-1, keepdim=True)
        logits = runner.forward(nxt, torch.ones_like(nxt))
    assert layer.seen == seen + 12
    assert torch.equal(cache.policy.shares.keep_allowed(layer), ahead)


def test_a_compiled_step_traces_once_and_answers_alike():
    """fullgraph=True: no break anywhere in a step; one graph for all steps (no shape changes)."""
    model = tiny_llama()
    dynamo.reset()
    dynamo.utils.counters.clear()
    ids, logits, _ = decode(model, "keydiff", 0.5)
    slab_ids, slab_logits, slab = decode(model, "keydiff", 0.5, slab=True, compile=True, backend="eager")
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(ids, slab_ids) and slab.is_compileable
    torch.testing.assert_close(slab_logits, logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_inductor_compiles_a_slab_step_that_answers_alike():
    model = tiny_gemma3()
    dynamo.reset()
    ids, logits, _ = decode(model, "snapkv", 0.3)
    slab_ids, slab_logits, _ = decode(model, "snapkv", 0.3, slab=True, compile=True)
    assert torch.equal(ids, slab_ids)
    torch.testing.assert_close(slab_logits, logits, atol=1e-4, rtol=0)


def test_attention_over_a_slab_by_hand():
    """One KV head, two query heads, places holding slots -1 (empty), 0, 2, 5: a query at slot 3
    sees slots 0 and 2 only; with a window of 2 only slot 2."""
    torch.manual_seed(0)
    keys, values = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    slots = torch.tensor([[[-1, 0, 2, 5]]], dtype=torch.int32)
    query = torch.randn(1, 2, 1, 8)
    for window, seen in ((None, [1, 2]), (2, [2])):
        slab = SlabLayer(keys, values, slots, torch.tensor([4]), [4], window)
        out = attend(query, SlabView(slab, torch.tensor([3])), 0.5)  # (b, q, h*g, d)
        probs = torch.softmax(query[0, :, 0] @ keys[0, 0, seen].T * 0.5, dim=-1)  # (g, n)
        torch.testing.assert_close(out[0, 0], probs @ values[0, 0, seen])


@pytest.mark.parametrize(
    "spec,why",
    [
        ("kivi(bits=2)", "codes its tokens"),
        ("keydiff+adaquant(residual=32)", "codes its tokens"),
        ("h2o", "attention weights"),
        ("kvzip", "pass over the prompt"),
        ("auto", "plans storage"),
        ("d2o(h2o)", "merges"),
        ("sentence(keydiff)", "watches every decoding step"),
        ("adakv(keydiff)", "splits a layer's budget unevenly"),
    ],
)
def test_stacks_a_slab_cannot_hold_are_refused_in_one_line(spec, why):
    with pytest.raises(UserError, match=why) as error:
        check_slab(Stack.parse(spec))
    assert "\n" not in str(error.value)
    suggested = str(error.value).split("such as ")[1].replace(" or ", ", ").split(", ")
    assert all(check_slab(Stack.parse(spec)) is None for spec in suggested)  # what it suggests is held
    with pytest.raises(UserError, match=why):
        Engine.parse(f"{spec}@0.25:compiled")


def test_speed_rows_name_their_slab():
    assert Engine.parse("keydiff@0.125:compiled") == Engine("keydiff@0.125:compiled", "keydiff", "0.125", "compiled")
    assert Engine.parse("full:slab").label == "full:slab"


def test_a_slab_needs_a_prefilled_cache():
    with pytest.raises(UserError, match="prefilled"):
        SlabCache(KVCache(tiny_llama(), "keydiff", 0.5), 8)


def test_a_step_without_advance_is_refused():
    """The policy evicts between steps: a loop that skips `advance` (model.generate) is told so."""
    model = tiny_llama()
    runner = Runner(model, KVCache(model, "keydiff", 0.5))
    runner.prefill(prompt(), torch.ones(1, PROMPT, dtype=torch.long))
    slab = SlabCache(runner.cache, 8)
    step = {"past_key_values": slab, "use_cache": True, "cache_position": torch.tensor([PROMPT])}
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[PROMPT]]), **step)
        with pytest.raises(UserError, match="advance"):
            model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[PROMPT]]), **step)


@pytest.mark.parametrize("decode_on", ["slab", pytest.param("compiled", marks=pytest.mark.slow)])
def test_generation_on_a_slab_answers_like_the_cache(decode_on):
    """`generate_ids(decode_on=...)` (the CLI's --decode-on): the same ids; the end bytes are the slab's."""
    model = tiny_llama()
    prompts = [Prompt(prompt(seed=4)[0].tolist(), [7, 8, 9]), Prompt(prompt(seed=5)[0, :50].tolist(), [7, 8])]
    ids, measured = generate_ids(model, prompts, "keydiff", 0.5, max_new_tokens=24)
    slab_ids, slab_measured = generate_ids(model, prompts, "keydiff", 0.5, max_new_tokens=24, decode_on=decode_on)
    assert slab_ids == ids and slab_measured["decode_on"] == decode_on
    assert (slab_measured["compile_s"] > 0) == (decode_on == "compiled")  # the compiling step, timed apart
    assert slab_measured["kv_bytes"] == measured["kv_bytes"]
    assert [r["tokens"] for r in slab_measured["stats"]] == [r["tokens"] for r in measured["stats"]]
    with pytest.raises(UserError, match="use one of"):
        generate_ids(model, prompts, "keydiff", 0.5, decode_on="fast")


def test_speed_measures_a_slab_row():
    """`kvstack speed` rows on a slab: measured, with the slab's bytes (sized for the new tokens too)."""
    from kvstack.bench.speed import measure

    model = tiny_llama()
    engines = [Engine.parse("keydiff@0.25"), Engine.parse("keydiff@0.25:slab")]
    rows = {r.engine: r for r in measure(model, engines, [64], new_tokens=4)}
    cache, slab = rows["keydiff@0.25"], rows["keydiff@0.25:slab"]
    assert slab.decode_tokens_per_s > 0 and slab.kv_bytes == slab.kv_bytes_end  # allocated once
    assert cache.kv_bytes <= slab.kv_bytes <= 0.3 * rows_full_bytes(model)
    with pytest.raises(UserError, match="at least 3"):
        measure(model, [Engine.parse("keydiff@0.25:compiled")], [64], new_tokens=2)


def rows_full_bytes(model) -> int:
    """A full cache's bytes for 64 + 4 tokens of the tiny llama: 4 layers, 2 heads, 16 channels, float32."""
    return 4 * 2 * (64 + 4) * 2 * 16 * 4


@pytest.mark.parametrize(
    "stack,budget,length", [("snapkv", 0.5, 20), ("keydiff", "24KB", PROMPT), ("keydiff", "32t", PROMPT)]
)
def test_short_prompts_and_fixed_budgets_decode_like_the_cache(model, stack, budget, length):
    """A prompt shorter than SnapKV's window (the ring of observed queries fills while decoding,
    as the cache's does), a byte budget (shares that fall on sliding layers) and a token budget."""
    rows = [prompt()[0, :length].tolist()]
    ids, logits, cache = decode(model, stack, budget, rows)
    slab_ids, slab_logits, slab = decode(model, stack, budget, rows, slab=True)
    assert torch.equal(ids, slab_ids)
    torch.testing.assert_close(slab_logits, logits, atol=1e-5, rtol=0)
    assert slab.cache.compressions == cache.compressions and slab.grown == 0
