"""The cache against the full cache and against its budget, on tiny Llama (GQA) and Gemma 3 (sliding) models."""

import pytest
import torch
from transformers import DynamicCache

from helpers import ids_of
from kvstack.cache.cache import KVCache
from kvstack.generate import Runner
from kvstack.methods.registry import all_methods
from kvstack.methods.select import Keep

# eviction and allocation (quantizers are lossy by design: tests/test_quantize.py)
METHODS = [m for m, cls in all_methods().items() if m != "full" and not cls.declared_roles() & {"storer", "joiner"}]
# short windows and chunks, so the tiny prompts (40-100 tokens) exercise them
SHORT = {
    "snapkv": "snapkv(window_size=4, every=4)",
    "lagkv": "lagkv(sinks=2, lag=8)",
    "dapq": "dapq(window_size=4, every=4)",
    "triattention": "triattention(window_size=8, recent=4, every=4)",
    "graphkv": "graphkv(snapkv(window_size=4, every=4), sources=8)",
    "kvcrush": "kvcrush(snapkv(window_size=4, every=4))",
    "scope": "scope(snapkv(window_size=4))",
    "chunk": "chunk(snapkv(window_size=4, every=4), size=4)",
    "sentence": "sentence(snapkv(window_size=4, every=4), longest=4)",
    "quest": "quest(page=4, select=16, neighbors=1)",  # pages brought back even from tiny prompts
    "squeezed": "squeezed(page=4, select=16, bits=8)",  # (and its slow tier at 8 bits)
    "s3": "s3(page=4, select=16, window=8)",
    "hisa": "hisa(page=4, select=16, tokens=8)",
    "tokenselect": "tokenselect(page=4, select=16, tokens=8)",
    "louiskv": "louiskv(page=4, select=16)",
    "lycheedecode": "lycheedecode(page=4, select=16)",
    "shadowselect": "shadowselect(page=4, select=16, outliers=1)",
    # 8 tokens per head overflow tiny Gemma's 15-token windows: least=2
    "auto": "auto(tokens=256, samples=1, least=2, validate=1)",
}
SPECS = {m: m for m in ["full", *METHODS]} | SHORT
# allocators wrap the short snapkv unless given their own short spec
ALLOCATORS = [m for m, cls in all_methods().items() if cls.family == "allocate"]
SPECS |= {m: f"{m}({SHORT['snapkv']})" for m in ALLOCATORS if m not in SHORT}


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def step_logits(model, cache, ids, follow):
    """Prefill `ids`, then feed `follow` one token at a time; logits (steps, vocab) at every step."""
    runner = Runner(model, cache)
    out = [runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))]
    for t in follow:
        out.append(runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long)))
    return torch.cat(out)


def test_full_cache_matches_transformers_dynamic_cache(tiny):
    ids = torch.tensor([prompt(40)], device=tiny.device)
    with torch.no_grad():
        tiny.set_attn_implementation("sdpa")
        try:
            ref = tiny(ids, past_key_values=DynamicCache(config=tiny.config)).logits
            ref_gen = tiny.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False, pad_token_id=0
            )
        finally:  # the fixture is shared: never leave it on another attention
            tiny.set_attn_implementation("kvstack")
        cache = KVCache(tiny)
        out = tiny(ids, past_key_values=cache).logits
        gen = tiny.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=30,
            do_sample=False,
            pad_token_id=0,
            past_key_values=KVCache(tiny),
        )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(gen, ref_gen)
    assert cache.nbytes() == cache.full_nbytes()  # what a full transformers cache holds, byte for byte


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["prefill", "decoding"])
def test_budget_one_reproduces_the_full_cache(tiny, method, mode):
    ids, follow = prompt(48), prompt(24 if mode == "decoding" else 1, seed=1)
    full = step_logits(tiny, KVCache(tiny), ids, follow)
    same = step_logits(tiny, KVCache(tiny, SPECS[method], 1.0), ids, follow)
    torch.testing.assert_close(same, full, atol=1e-5, rtol=1e-5)
    assert ids_of(tiny, [(ids, [])], SPECS[method], 1.0)[0] == ids_of(tiny, [(ids, [])])[0]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["prefill", "decoding"])
def test_compression_frees_bytes_and_stays_within_budget(tiny, method, mode):
    cache = KVCache(tiny, SPECS[method], 0.5)
    runner = Runner(tiny, cache)
    runner.forward(torch.tensor([prompt(60)]), torch.ones(1, 60, dtype=torch.long))
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()
    assert cache.compressions > 0
    steps = 48 if mode == "decoding" else 0
    for t in prompt(steps, seed=2):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        for layer in cache.layers:  # per layer: allocators such as adakv move tokens between heads
            assert bool((layer.counts().sum(-1) <= cache.policy.shares.keep_allowed(layer).sum(-1)).all())
        assert cache.nbytes() <= 0.5 * cache.full_nbytes()


def test_budget_holds_over_a_512_token_generation(llama):
    for spec in ("streaming", "h2o"):
        cache = KVCache(llama, spec, "64t")
        runner = Runner(llama, cache)
        runner.forward(torch.tensor([prompt(100)]), torch.ones(1, 100, dtype=torch.long))
        for t in prompt(512, seed=3):
            runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
            assert max(int(layer.counts().max()) for layer in cache.layers) <= 64
        assert cache.layers[0].seen == 612


def test_lower_budgets_hold_fewer_bytes(tiny):
    held = []
    for budget in (1.0, 0.5, 0.25, 0.125):
        cache = KVCache(tiny, "knorm", budget)
        Runner(tiny, cache).forward(torch.tensor([prompt(80)]), torch.ones(1, 80, dtype=torch.long))
        held.append(cache.nbytes())
    assert held == sorted(held, reverse=True) and len(set(held)) == 4


def test_ragged_heads_free_memory_per_head(llama):
    cache = KVCache(llama)
    Runner(llama, cache).forward(torch.tensor([prompt(32)]), torch.ones(1, 32, dtype=torch.long))
    layer = cache.layers[0]
    before = cache.nbytes()
    index = torch.arange(32, device=llama.device).view(1, 1, 32).expand(1, 2, 32)
    # head 0 keeps 4, head 1 keeps 20
    layer.apply(Keep(index=index, count=torch.tensor([[4, 20]], device=llama.device)))
    assert [layer.head_len(h) for h in range(2)] == [4, 20]
    assert layer.head_nbytes(0) < layer.head_nbytes(1)
    d = layer.keys[0].shape[-1]
    # K and V at 4 bytes each per channel, plus the int32 slot: nothing padded to the longer head
    assert layer.nbytes() == (4 + 20) * (2 * d * 4 + 4)
    assert cache.nbytes() < before


@pytest.mark.parametrize("method", ["full", *METHODS])
@pytest.mark.parametrize("agnostic", [False, True])
def test_a_batch_answers_like_each_prompt_alone(tiny, method, agnostic):
    if method == "knorm" and tiny.config.model_type.startswith("gemma3"):
        pytest.skip("Gemma 3 RMS-normalises keys (QK-norm): key norms tie to 1e-7, so knorm's order is float noise")
    rows = [(prompt(50, seed=4), prompt(6, seed=5)), (prompt(31, seed=6), prompt(9, seed=7))]
    together, _ = ids_of(tiny, rows, SPECS[method], 0.5, agnostic)
    alone = [ids_of(tiny, [row], SPECS[method], 0.5, agnostic)[0][0] for row in rows]
    assert together == alone


def test_query_agnostic_never_evicts_the_question(llama):
    cache = KVCache(llama, "knorm", 0.25)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(64)]), torch.ones(1, 64, dtype=torch.long))
    with cache.exempt():
        runner.forward(torch.tensor([prompt(10, seed=8)]), torch.ones(1, 10, dtype=torch.long))
    for t in prompt(20, seed=9):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
    for layer in cache.layers:
        slots = layer.dense_slots()
        for s in range(64, 74):
            assert bool((slots == s).any(-1).all()), f"question slot {s} was evicted in layer {layer.layer_idx}"


def test_generate_with_transformers_keeps_the_budget(tiny):
    ids = torch.tensor([prompt(64)], device=tiny.device)
    cache = KVCache(tiny, "streaming(sinks=2)", 0.5)
    out = tiny.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
        past_key_values=cache,
    )
    assert out.shape[1] == 84
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()


@pytest.mark.parametrize("window", [0, 16])
def test_decoding_never_evicts_the_newest_tokens(llama, window):
    ids = torch.tensor([prompt(64)], device=llama.device)
    cache = KVCache(llama, f"knorm(decode_window={window})", 0.25)
    llama.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=40,
        do_sample=False,
        pad_token_id=0,
        past_key_values=cache,
    )
    newest = set(range(64 + 40 - 1 - 16, 64 + 40 - 1))  # the last generated token is never fed back
    held = [set(layer.head_slots(h).flatten().tolist()) for layer in cache.layers for h in range(layer.n_kv_heads)]
    if window:
        assert all(newest <= s for s in held)
    else:  # knorm alone drops some of what it just generated (why the window exists)
        assert not all(newest <= s for s in held)
    assert cache.nbytes() <= 0.25 * cache.full_nbytes() + 1  # still within budget


def test_stats_report_tokens_and_bytes_per_head(llama):
    cache = KVCache(llama, "snapkv(window_size=4)", 0.5)
    Runner(llama, cache).forward(torch.tensor([prompt(40)]), torch.ones(1, 40, dtype=torch.long))
    rows = cache.stats()
    assert len(rows) == 4 * 2
    assert sum(r["bytes"] for r in rows) == cache.nbytes()
    assert all(r["tokens"][0] < 40 for r in rows)


def test_a_fraction_too_small_for_the_method_is_refused_before_any_work(llama):
    from kvstack.errors import UserError
    from kvstack.generate import Prompt, generate_ids

    with pytest.raises(UserError, match=r"needs at least 64: use --budget >= 0\.640 or 64t"):
        generate_ids(llama, [Prompt(context=prompt(100), question=[])], "snapkv", 0.1)
    with pytest.raises(UserError, match="exceeds the model's maximum of 2048 tokens"):
        generate_ids(llama, [Prompt(context=prompt(2040), question=prompt(4))], "full", 1.0, max_new_tokens=8)


def test_transformers_generate_with_left_padding_matches_single_prompts(llama):
    rows = [prompt(40, seed=10), prompt(25, seed=11)]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 40 - len(r) :], mask[i, 40 - len(r) :] = torch.tensor(r), 1
    both = llama.generate(
        ids.to(llama.device),
        attention_mask=mask.to(llama.device),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        past_key_values=KVCache(llama, "tova", 0.5),
    )
    for i, r in enumerate(rows):
        one = llama.generate(
            torch.tensor([r], device=llama.device),
            attention_mask=torch.ones(1, len(r), dtype=torch.long, device=llama.device),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
            past_key_values=KVCache(llama, "tova", 0.5),
        )
        assert both[i, 40:].tolist() == one[0, len(r) :].tolist()


def test_a_model_on_another_attention_gets_a_clear_error():
    from tiny import tiny_llama

    with pytest.raises(ValueError, match=r"set_attn_implementation\('kvstack'\)"):
        KVCache(tiny_llama(attn="sdpa"), "snapkv", 0.5)


@pytest.mark.parametrize("method", ["full", *METHODS])
def test_one_prefill_forked_per_method_equals_compressing_during_prefill(tiny, method):
    from kvstack.generate import Prompt, generate_forks, generate_ids

    prompts = [Prompt(prompt(60, seed=12), prompt(7, seed=13)), Prompt(prompt(41, seed=14), prompt(5, seed=15))]
    configs = [(SPECS[method], 0.5), (SPECS[method], 0.25)]
    forked = list(generate_forks(tiny, prompts, configs, max_new_tokens=10))
    for (spec, budget), (ids, measures) in zip(configs, forked, strict=True):
        direct, m = generate_ids(tiny, prompts, spec, budget, query_agnostic=True, max_new_tokens=10)
        assert ids == direct
        assert measures["kv_bytes"] == m["kv_bytes"]


def test_fork_refuses_a_stack_whose_statistics_were_not_recorded(llama):
    cache = KVCache(llama)
    Runner(llama, cache).forward(torch.tensor([prompt(20)]), torch.ones(1, 20, dtype=torch.long))
    with pytest.raises(ValueError, match="did not record"):
        cache.fork("h2o", 0.5)
    assert cache.fork("knorm", 0.5).nbytes() < cache.nbytes()


def test_a_batch_row_without_a_question_continues_its_context(llama):
    rows = [(prompt(30, seed=16), prompt(5, seed=17)), (prompt(22, seed=18), [])]
    together, _ = ids_of(llama, rows, "knorm", 0.5, agnostic=True)
    assert together[1] == ids_of(llama, [rows[1]], "knorm", 0.5, agnostic=True)[0][0]


def test_fidelity_is_perfect_for_the_full_cache_and_degrades_with_budget(tiny):
    from kvstack.generate import fidelity_forks

    rows = list(
        fidelity_forks(
            tiny, prompt(80, seed=20), prompt(24, seed=21), [("full", 1.0), ("knorm", 0.5), ("knorm", 0.125)]
        )
    )
    full, half, eighth = rows
    assert full["kl"] == pytest.approx(0.0, abs=1e-6) and full["top1"] == 1.0
    assert full["ppl"] > 1.0 and full["kv_ratio"] == 1.0
    assert half["kl"] > 1e-6 and eighth["kl"] > 1e-6  # evicting context changes the continuation
    assert eighth["kv_ratio"] <= 0.125


@pytest.mark.parametrize(
    "spec", ["full", "keydiff", "adakv(snapkv(window_size=4, every=4))", "mikv(keydiff, group=8, residual=4)"]
)
def test_counts_per_head_are_the_real_tokens_of_the_dense_view(llama, spec):
    """The policy reads `counts` at every decoding step, per head in storage order; it must count
    what the dense view (sorted by slot, padded, demoted tokens flagged) holds as real."""
    rows = [prompt(60, seed=1), prompt(37, seed=2)]
    ids = torch.tensor([[0] * (60 - len(r)) + r for r in rows])
    cache = KVCache(llama, spec, 0.4)
    runner = Runner(llama, cache)
    logits = runner.forward(ids, (ids != 0).long())
    for _ in range(6):
        logits = runner.forward(logits.argmax(-1, keepdim=True), torch.ones(2, 1, dtype=torch.long))
        for layer in cache.layers:
            valid = layer.valid_mask(layer.dense_slots())
            assert layer.counts().tolist() == valid.sum(-1).tolist()
            kept = valid & ~layer.dense_demoted()
            assert layer.counts(exclude_demoted=True).tolist() == kept.sum(-1).tolist()
