"""Decoding-time policies (treekv, scope, conf_kv) against hand-computed cases, and every method's
budget over a long generation."""

import pytest
import torch

from helpers import layer_with, observe
from kvstack.cache.cache import KVCache
from kvstack.generate import Runner
from kvstack.methods.base import Observation
from kvstack.methods.evict.conf_kv import composite_score, confident_keep
from kvstack.methods.evict.treekv import growth_ratio, tree_segments
from kvstack.methods.registry import all_methods
from kvstack.methods.select import select
from kvstack.stack import Stack
from test_cache import SPECS, prompt

INF = float("inf")


def kept(obs, method):
    decision = select(method.score(obs), obs.valid, obs.slots, obs.keep)
    return [decision.index[0, h, : decision.count[0, h]].tolist() for h in range(obs.keep.shape[1])]


def with_stat(layer, name, rows):
    for h, row in enumerate(rows):
        layer.add_stat(name, h, torch.tensor([row], dtype=torch.float32), accumulate=False)
    return layer


# ---- treekv -------------------------------------------------------------------------------


def test_tree_segments_grow_geometrically_from_the_recent_window():
    # 7 positions, 3 segments: 1 + r + r^2 = 7 gives r = 2, sizes 1, 2, 4 (one tree level each)
    ages = torch.arange(7).view(1, 1, 7)
    assert growth_ratio(torch.tensor([[7]]), torch.tensor([[3]])).item() == pytest.approx(1.0)
    assert tree_segments(ages, torch.tensor([[7]]), torch.tensor([[3]]))[0, 0].tolist() == [0, 1, 1, 2, 2, 2, 2]
    # 12 positions, 4 segments: 1 + r + r^2 + r^3 = 12 gives r = 1.8089; segment j starts at
    # round(1 + r + ... + r^(j-1)): round(1) = 1, round(2.81) = 3, round(6.08) = 6 -> sizes 1, 2, 3, 6
    assert growth_ratio(torch.tensor([[12]]), torch.tensor([[4]])).item() == pytest.approx(0.8089, abs=1e-4)
    got = tree_segments(torch.arange(12).view(1, 1, 12), torch.tensor([[12]]), torch.tensor([[4]]))
    assert got[0, 0].tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    # as many segments as positions: every position its own segment; one segment: all in it
    assert tree_segments(ages, torch.tensor([[7]]), torch.tensor([[9]]))[0, 0].tolist() == list(range(7))
    assert tree_segments(ages, torch.tensor([[7]]), torch.tensor([[1]]))[0, 0].tolist() == [0] * 7


def test_treekv_keeps_sinks_recent_and_the_best_token_of_each_tree_segment():
    # 16 tokens, keep 8, sinks=2, recent=0.25: sinks 0, 1; recent window floor(8 * 0.25) = 2 -> 14, 15;
    # the tree keeps 8 - 2 - 2 = 4 of positions 2..13 (span 12, newest tree position 13): segments
    # by age 13 - p as above -> {13}, {11, 12}, {8, 9, 10}, {2..7}
    importance = [0, 0, 0.1, 0.5, 0.2, 0.3, 0.05, 0.4, 0.3, 0.7, 0.8, 0.2, 0.9, 0.01, 0, 0]
    # running importance = attention_sum / queries that saw the token (16 - p): store importance * (16 - p)
    attention = [v * (16 - p) for p, v in enumerate(importance)]
    layer = with_stat(layer_with(torch.randn(1, 1, 16, 4)), "attention_sum", [attention])
    method = Stack.parse("treekv(sinks=2, recent=0.25)").evictor
    # best of {2..7} is 3 (0.5), of {8, 9, 10} is 10 (0.8), of {11, 12} is 12 (0.9), {13} alone
    # (0.01); 9 (0.7) loses to its neighbour 10 although it outranks 3 and 13 (h2o would keep it)
    assert kept(observe(layer, 8), method) == [[0, 1, 3, 10, 12, 13, 14, 15]]
    scores = method.score(observe(layer, 8))[0, 0]
    assert scores[[0, 1, 14, 15]].tolist() == [INF] * 4
    # survivors 2 + importance / 0.9 (the tree's peak); the others importance / 0.9
    assert scores[3].item() == pytest.approx(2 + 0.5 / 0.9, rel=1e-5)
    assert scores[9].item() == pytest.approx(0.7 / 0.9, rel=1e-5)


def test_treekv_with_its_defaults_on_a_small_budget_is_sinks_and_recent():
    # keep 8: sinks 4 + recent floor(8 * 0.5) = 4 leave the tree nothing
    layer = with_stat(layer_with(torch.randn(1, 1, 16, 4)), "attention_sum", [torch.rand(16).tolist()])
    assert kept(observe(layer, 8), Stack.parse("treekv").evictor) == [[0, 1, 2, 3, 12, 13, 14, 15]]


def test_treekv_fills_its_tree_exactly_and_gets_sparser_with_age():
    torch.manual_seed(0)
    layer = with_stat(layer_with(torch.randn(1, 2, 200, 4)), "attention_sum", torch.rand(2, 200).tolist())
    method = Stack.parse("treekv(sinks=4, recent=0.25)").evictor
    for keep in (20, 40, 64):
        for head in kept(observe(layer, keep), method):
            assert len(head) == keep and head[:4] == [0, 1, 2, 3]
            tree = [p for p in head if 4 <= p < 200 - keep // 4]
            assert len(tree) == keep - 4 - keep // 4  # one survivor per segment, every segment
            old, new = tree[: len(tree) // 2], tree[len(tree) // 2 :]
            assert old[-1] - old[0] > new[-1] - new[0]  # the older half of the survivors is spread wider


# ---- scope --------------------------------------------------------------------------------


def decoding_obs(layer, keep, prompt_end):
    layer.seq.prompt_end = prompt_end
    keep = torch.full((layer.batch, layer.n_kv_heads), keep)
    return Observation(layer, keep, layer.seq.token_index(), decoding=True)


def test_scope_freezes_the_prompt_and_ranks_decoded_tokens_by_the_current_query():
    # 9 tokens, the prompt is slots 0..4 (compressed at prefill), 5..8 were generated
    layer = with_stat(
        layer_with(torch.randn(1, 1, 9, 4)), "last_attention", [[0.3, 0.01, 0.2, 0.0, 0.1, 0.05, 0.2, 0.04, 0.09]]
    )
    method = Stack.parse("scope(recent=1)").evictor
    scores = method.score(decoding_obs(layer, 7, 5))[0, 0]
    # prompt slots +inf however little attention they get now; the newest (slot 8) is the recent
    # window: 2 + its position 8 = 10, above any attention
    assert scores.tolist() == pytest.approx([INF] * 5 + [0.05, 0.2, 0.04, 10.0])
    # keep 7 of 9: the two decoded tokens the current query looks at least (5: 0.05, 7: 0.04) go
    assert kept(decoding_obs(layer, 7, 5), method) == [[0, 1, 2, 3, 4, 6, 8]]
    # keep 6: the budget has room for one decoding token beside the frozen prompt: the newest
    assert kept(decoding_obs(layer, 6, 5), method) == [[0, 1, 2, 3, 4, 8]]
    # recent=2 (slots 7, 8: scores 9, 10) and keep 6: still the newest, never a prompt token
    assert kept(decoding_obs(layer, 6, 5), Stack.parse("scope(recent=2)").evictor) == [[0, 1, 2, 3, 4, 8]]


def test_scope_at_prefill_is_its_inner_scorer():
    layer = with_stat(layer_with(torch.randn(1, 1, 8, 4)), "attention_sum", [[5.0, 0.1, 4.0, 0.2, 3.0, 0.3, 0, 0]])
    scope, h2o = Stack.parse("scope(h2o)").evictor, Stack.parse("h2o").evictor
    assert torch.equal(scope.score(observe(layer, 4)), h2o.score(observe(layer, 4)))
    assert Stack.parse("scope(h2o)").needs == frozenset({"attention_sum", "last_attention"})
    assert Stack.parse("scope").needs == frozenset({"last_attention"}) and Stack.parse("scope").query_window == 64
    with pytest.raises(Exception, match="scorer must be an eviction scorer"):
        Stack.parse("scope(full)")


def test_scope_decoding_never_evicts_the_compressed_prompt(llama):
    cache = KVCache(llama, "scope(snapkv(window_size=4))", 0.5)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(40)]), torch.ones(1, 40, dtype=torch.long))
    after_prefill = [set(layer.head_slots(h).flatten().tolist()) for layer in cache.layers for h in range(2)]
    for t in prompt(30, seed=1):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
    held = [set(layer.head_slots(h).flatten().tolist()) for layer in cache.layers for h in range(2)]
    assert all(before <= now for before, now in zip(after_prefill, held, strict=True))
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()


# ---- conf_kv ------------------------------------------------------------------------------


def test_conf_kv_composite_score_by_hand():
    attention = torch.tensor([[[4.0, 1.0, 2.0, 0.0, 8.0]]])
    pos = torch.arange(5).view(1, 1, 5)
    # mass = a / 8 = 0.5, 0.125, 0.25, 0, 1; recency = p / 4 = 0, 0.25, 0.5, 0.75, 1
    # 0.7 * mass + 0.3 * recency = 0.35, 0.1625, 0.325, 0.225, 1.0
    got = composite_score(attention, pos, torch.ones(1, 1, 5, dtype=torch.bool), 0.7)
    assert got[0, 0].tolist() == pytest.approx([0.35, 0.1625, 0.325, 0.225, 1.0])
    layer = with_stat(layer_with(torch.randn(1, 1, 5, 4)), "attention_sum", [attention[0, 0].tolist()])
    method = Stack.parse("conf_kv(sinks=1, protect=1)").evictor
    assert method.score(observe(layer, 3))[0, 0].tolist() == pytest.approx([INF, 0.1625, 0.325, 0.225, INF])
    assert kept(observe(layer, 3), method) == [[0, 2, 4]]


def test_conf_kv_limit_holds_less_when_confident():
    method = Stack.parse("conf_kv").evictor  # floor_share 0.5, min_tokens = sinks + 1 = 5
    keep = torch.tensor([[100, 7]])
    # share = 0.5 + 0.5 * (1 - c): c = 0 -> 1 (100, 7); c = 1 -> 0.5 (50, floor 3.5 = 3 -> at least 5);
    # c = 0.5 -> 0.75 (75, floor 5.25 = 5)
    assert method.limit(keep, True, torch.tensor([0.0])).tolist() == [[100, 7]]
    assert method.limit(keep, True, torch.tensor([1.0])).tolist() == [[50, 5]]
    assert method.limit(keep, True, torch.tensor([0.5])).tolist() == [[75, 5]]
    assert method.limit(keep, False, torch.tensor([1.0])).tolist() == [[100, 7]]  # the prefill keeps the budget
    assert method.limit(keep, True, None).tolist() == [[100, 7]]
    assert confident_keep(torch.tensor([[3]]), torch.tensor([1.0]), 0.5, 5).tolist() == [[3]]  # never above keep
    assert Stack.parse("conf_kv").needs == frozenset({"attention_sum", "confidence"})
    with pytest.raises(Exception, match="floor_share must be in"):
        Stack.parse("conf_kv(floor_share=1.5)")


def test_conf_kv_a_confident_step_halves_the_cache(llama):
    cache = KVCache(llama, "conf_kv", 0.5)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(64)]), torch.ones(1, 64, dtype=torch.long))
    assert cache.confidence is not None and cache.confidence.shape == (1,)  # the loop computed it
    cache.confidence = torch.ones(1)  # what the next step's compression reads
    runner.forward(torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long))
    for layer in cache.layers:
        # half the bytes of 65 tokens at 128 bytes (full) over 132 (compressed, with the slot):
        # floor(65 * 0.5 * 128 / 132) = 31 per head; confidence 1 keeps floor(31 * 0.5) = 15
        allowed = cache.policy.shares.keep_allowed(layer)
        assert allowed.tolist() == [[31, 31]]
        assert layer.counts().tolist() == confident_keep(allowed, torch.ones(1), 0.5, 5).tolist() == [[15, 15]]


# ---- every method over a long generation ----------------------------------------------------

LONG = [m for m, cls in all_methods().items() if m != "full" and not cls.declared_roles() & {"storer", "joiner"}]


@pytest.mark.parametrize("method", LONG)
def test_decoding_time_compression_keeps_the_cache_within_budget_over_512_tokens(llama, method):
    """Prefill 64 tokens at budget 0.5, then decode 512 one at a time: after every step each layer
    holds no more tokens than its heads' shares together, and the cache no more than half the
    full cache's bytes (methods that compress every N > 1 steps evict ahead, so they hold too)."""
    cache = KVCache(llama, SPECS[method], 0.5)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(64)]), torch.ones(1, 64, dtype=torch.long))
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()
    for t in prompt(512, seed=3):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        for layer in cache.layers:  # per layer: head allocators (adakv) may move tokens between heads
            held, allowed = layer.counts().sum(-1), cache.policy.shares.keep_allowed(layer).sum(-1)
            assert bool((held <= allowed).all()), f"layer {layer.layer_idx}"
        assert cache.nbytes() <= 0.5 * cache.full_nbytes()
    assert cache.layers[0].seen == 64 + 512
