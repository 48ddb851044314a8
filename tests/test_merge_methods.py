"""The merging family (ems, chelsea, zeromerge, subgen): each decision by hand on a one-head
layer, what a merged entry does to attention, and the methods in the cache of the tiny models."""

import math

import pytest
import torch

from helpers import ids_of, layer_with
from kvstack.cache.attention import _attend
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.base import Observation
from kvstack.methods.merge.base import Merge, merge_states
from kvstack.methods.merge.chelsea import soft_matching
from kvstack.methods.merge.subgen import l2_sample, online_centres, uniform
from kvstack.methods.merge.zeromerge import nearest_slot, residual_slots
from kvstack.methods.select import select
from kvstack.stack import Stack

METHODS = ["ems", "chelsea", "zeromerge", "subgen"]


def compress(layer, method, keep, decoding=False):
    """What `Policy.compress_layer` does for one layer: score, select, merge, rewrite, gather.
    Returns (scores, kept, merge, merged keys, merged log-counts) on the dense view before it."""
    b, h = layer.batch, layer.n_kv_heads
    obs = Observation(layer, torch.full((b, h), keep), layer.seq.token_index(), decoding)
    scores = method.score(obs)
    decision = select(scores, obs.valid, obs.slots, obs.keep)
    kept = torch.zeros_like(obs.valid).scatter(
        -1, decision.index, torch.arange(decision.index.shape[-1]) < decision.count.unsqueeze(-1)
    )
    plan = method.merge(obs, kept).into(obs.plain & kept)
    keys, values, log_count, changed = merge_states(obs.keys, obs.values, obs.log_count, plan)
    layer.rewrite(changed, keys, values, log_count if method.log_count else None)
    layer.apply(decision)
    return scores, kept, plan, keys, log_count


def method(spec):
    return Stack.parse(spec).evictor


def row(x):
    return x[0, 0].tolist()


# ---- the pure decisions ------------------------------------------------------------------------
def test_ems_scores_global_local_then_evicts_and_merges():
    # keys: 1 is like kept 0; 3 like kept 2 but least important; 4 like no kept key (zero class)
    keys = torch.tensor([[[[1, 0], [1, 0.2], [0, 1], [0, 2], [-1, -1], [1, 1]]]])
    queries = torch.zeros(1, 1, 1, 2)  # one local query at slot 5: uniform attention, 1/6 each
    layer = layer_with(keys, keys * 10, queries=queries)
    layer.add_stat("attention_sum", 0, torch.tensor([[3.0, 0.5, 2.0, 0.3, 0.4, 0.5]]), accumulate=False)
    ems = method("ems(window_size=1, coverage=0.85)")
    scores, kept, plan, merged, log_count = compress(layer, ems, keep=3)
    # global: sums over the 6, 5, 4, 3, 2, 1 queries that saw each token; local: 1/6 from the window
    expected = torch.tensor([0.5, 0.1, 0.5, 0.1, 0.2, 0.5]) + 1 / 6
    assert torch.allclose(scores[0, 0], expected)
    assert row(kept) == [True, False, True, False, False, True]
    # by score 0, 2, 5 (0.667), 4 (0.367), 1, 3 (0.267) of 2.9: all but 3 hold 0.85 of it, so 3 is
    # evicted; 1 joins 0 (cosine 0.98); 4's best cosine is negative (zero class): evicted
    assert row(plan.target) == [-1, 0, -1, -1, -1, -1] and row(plan.weight) == [0, 1, 0, 0, 0, 0]
    assert merged[0, 0, 0].tolist() == pytest.approx([1.0, 0.1]) and log_count[0, 0, 0] == pytest.approx(math.log(2))
    torch.testing.assert_close(layer.head_keys(0)[0], torch.tensor([[1.0, 0.1], [0, 1], [1, 1]]))
    assert layer.head_values(0)[0, 0].tolist() == pytest.approx([10.0, 1.0])
    assert not method("ems(coverage=0)").plays("merger")  # the same selection, evicting only


def test_chelsea_merges_the_most_similar_pairs_of_each_chunk():
    # chunks of 4: (0 1 2 3) (4 5); set A = 0, 2 | 4, set B = 1, 3 | 5
    keys = torch.tensor([[[[1, 0], [1, 0.1], [0, 1], [0.1, 1], [1, 1], [-1, 1]]]])
    chelsea = method("chelsea(chunk_size=4)")
    scores, kept, plan, merged, log_count = compress(layer_with(keys), chelsea, keep=4)
    # 0 -> 1 and 2 -> 3 (cosine 0.995) beat 4 -> 5 (cosine 0): two merges in one round
    assert row(scores) == [0.5, 2, 0.5, 2, 2, 2]
    assert row(plan.target) == [1, -1, 3, -1, -1, -1] and row(plan.weight) == [1, 0, 1, 0, 0, 0]
    assert merged[0, 0, 1].tolist() == pytest.approx([1.0, 0.05]) and log_count[0, 0, 1] == pytest.approx(math.log(2))


def test_chelsea_repeats_rounds_until_the_budget_holds():
    keys = torch.tensor([[[[1, 0], [1, 0.1], [0, 1], [0.1, 1], [1, 1], [-1, 1]]]])
    # round 1: 0 -> 1, 2 -> 3, 4 -> 5; round 2 over 1, 3, 5 (A = 1, 5, B = 3): the centroid of
    # 4 and 5, (0, 1), is the closest to 3's, (0.05, 1): 5 -> 3
    root, merged_in = soft_matching(
        keys, torch.ones(1, 1, 6), torch.ones(1, 1, 6, dtype=torch.bool), torch.tensor([[4]]), 4
    )
    assert row(root) == [1, 1, 3, 3, 3, 3] and row(merged_in) == [1, 0, 1, 0, 1, 2]
    scores, kept, plan, merged, log_count = compress(layer_with(keys), method("chelsea(chunk_size=4)"), keep=2)
    assert row(scores) == pytest.approx([1 / 3, 2, 1 / 3, 2, 1 / 3, 2 / 3])
    assert row(plan.target) == [1, -1, 3, -1, 3, 3]
    # one centroid for 2, 3, 4, 5 whichever round each joined in
    assert merged[0, 0, 3].tolist() == pytest.approx([0.025, 1.0]) and log_count[0, 0, 3] == pytest.approx(math.log(4))


def test_zeromerge_folds_everything_left_out_into_a_residual_entry_that_stays():
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 8, 4)
    layer = layer_with(keys, keys + 1)
    layer.add_stat("attention_sum", 0, torch.tensor([[5.0, 1, 4, 0.5, 3, 2, 0, 0]]), accumulate=False)
    zm = method("zeromerge")
    scores, kept, plan, merged, log_count = compress(layer, zm, keep=5)
    # tail: max(2, 10% of 5) = slots 6, 7; heavy hitters 0, 2, 4; the lowest of them (4) becomes
    # the residual entry and takes in 1, 3, 5: the mean of 1, 3, 4, 5 with log-count log 4
    assert row(kept) == [True, False, True, False, True, False, True, True]
    assert row(plan.target) == [-1, 4, -1, 4, -1, 4, -1, -1]
    assert merged[0, 0, 4].tolist() == pytest.approx(keys[0, 0, [1, 3, 4, 5]].mean(0).tolist(), abs=1e-6)
    assert log_count[0, 0, 4] == pytest.approx(math.log(4))
    # next compression (held: slots 0, 2, 4, 6, 7 + 8, 9): the residual entry (now at dense 2)
    # is never evicted, and what is left out (the lowest: 8, 9's accumulated attention is 0) joins it
    more = torch.randn(1, 1, 2, 4)
    layer.append(more, more + 1, torch.arange(8, 10))
    scores, kept, plan, merged, log_count = compress(layer, zm, keep=5)
    assert scores[0, 0, 2] == float("inf")
    assert row(plan.target) == [-1, -1, -1, 2, 2, -1, -1]  # slots 6, 7 left the tail (now 8, 9)
    assert log_count[0, 0, 2] == pytest.approx(math.log(6))
    expected = (4 * keys[0, 0, [1, 3, 4, 5]].mean(0) + keys[0, 0, 6] + keys[0, 0, 7]) / 6
    assert merged[0, 0, 2].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert layer.head_slots(0).tolist() == [[0, 2, 4, 8, 9]]
    assert not method("zeromerge(residual=0)").plays("merger")


def test_zeromerge_sends_each_token_to_the_slot_of_largest_dot_product():
    keys = torch.tensor([[[[1.0, 0], [4, 4], [0, 1], [1, 0.9], [-1, 0]]]])
    slots = torch.tensor([[[True, False, True, False, False]]])
    # token 3 (1, 0.9): dot 1 with slot 0, 0.9 with slot 2; token 1 (4, 4) ties: the first; token 4 only
    # has non-positive dots (0 with 2, -1 with 0): still the largest, 2
    assert row(nearest_slot(keys, slots)) == [0, 0, 2, 0, 2]
    scores = torch.tensor([[[5.0, 1, 4, 3, 2]]])
    kept = torch.tensor([[[True, False, True, True, True]]])
    existing = torch.tensor([[[False, False, False, False, True]]])
    # one residual entry exists (4); a second comes from the lowest kept movable token, 3
    assert row(residual_slots(scores, kept, existing, torch.ones_like(kept), 2)) == [False, False, False, True, True]


@pytest.mark.parametrize("spec", ["chelsea(chunk_size=6, decode_window=2)", "subgen(decode_window=2)"])
def test_while_decoding_the_newest_tokens_stay_out_of_clusters(spec):
    torch.manual_seed(3)
    keys = torch.randn(1, 1, 6, 4)
    keys[0, 0, 5] = keys[0, 0, 4]  # the newest two are twins: the first pair either method would merge
    _, kept, plan, _, _ = compress(layer_with(keys), method(spec), keep=5)
    assert sorted(row(kept)[4:]) == [False, True] and sorted(row(plan.target)[4:]) == [-1, 4 + row(kept)[5]]
    _, kept, plan, _, _ = compress(layer_with(keys), method(spec), keep=5, decoding=True)
    assert row(kept)[4:] == [True, True] and row(plan.target)[4:] == [-1, -1] and sum(row(kept)) == 5


def test_subgen_clusters_with_the_smallest_radius_that_fits():
    # 0, 1 at distance 0.1; 2, 3 at 0.05; 4 far: below radius 0.1 four clusters, at 0.126 three
    keys = torch.tensor([[[[1, 0], [1.1, 0], [0, 1], [0, 1.05], [3, 0]]]])
    values = torch.tensor([[[[1.0, 0], [0, 3], [2, 0], [0, 2], [5, 5]]]])
    scores, kept, plan, merged, log_count = compress(layer_with(keys, values), method("subgen(values='mean')"), keep=3)
    assert row(kept) == [True, False, True, False, True]  # each cluster's first token is its centre
    assert row(plan.target) == [-1, 0, -1, 2, -1] and plan.value_weight is None
    assert merged[0, 0, 0].tolist() == pytest.approx([1.05, 0]) and log_count[0, 0, 0] == pytest.approx(math.log(2))
    # l2 sampling: each cluster keeps one member drawn by ||v||^2 (1 vs 9; 4 vs 4) and rescales it
    layer = layer_with(keys, values)
    scores, kept, plan, merged, log_count = compress(layer, method("subgen"), keep=3)
    u = uniform(torch.arange(5), torch.tensor(0), 0)
    energy = values[0, 0].pow(2).sum(-1)
    first = 0 if -math.log(u[0]) / 1 < -math.log(u[1]) / 9 else 1
    second = 2 if -math.log(u[2]) / 4 < -math.log(u[3]) / 4 else 3
    assert row(kept) == [i in (first, second, 4) for i in range(5)]
    assert plan.value_weight is not None and row(plan.value_weight) == [0] * 5
    for entry, members in ((first, [0, 1]), (second, [2, 3])):
        assert merged[0, 0, entry].tolist() == pytest.approx(keys[0, 0, members].mean(0).tolist())
        scale = energy[members].sum() / (2 * energy[entry])  # S / (n ||v_s||^2)
        assert layer.head_values(0)[0, int(kept[0, 0, :entry].sum())].tolist() == pytest.approx(
            (values[0, 0, entry] * scale).tolist()
        )


def test_l2_sampling_draws_in_proportion_and_its_rescaled_value_is_unbiased():
    n = 20000
    mass = torch.tensor([1.0, 2.0, 7.0]).repeat(n)  # n clusters of three members each
    centre = torch.arange(3 * n) // 3 * 3
    winner = l2_sample(centre.view(1, 1, -1), mass.view(1, 1, -1), torch.rand(1, 1, 3 * n, dtype=torch.float64))
    picked = (winner[0, 0, ::3] - centre[::3]).bincount(minlength=3).float() / n
    assert picked.tolist() == pytest.approx([0.1, 0.2, 0.7], abs=0.015)
    # the value s stands for the cluster as v_s S / (n ||v_s||^2): on average the mean value
    v = torch.tensor([[1.0, 0.0], [0.0, 1.4142], [2.6458, 0.0]])  # ||v||^2 = 1, 2, 7
    estimates = v[winner[0, 0, ::3] - centre[::3]] * (10 / (3 * mass[winner[0, 0, ::3]])).unsqueeze(-1)
    assert estimates.mean(0).tolist() == pytest.approx(v.mean(0).tolist(), abs=0.03)


def test_online_centres_in_rounds_equal_the_token_by_token_loop():
    torch.manual_seed(1)
    keys = torch.randn(2, 2, 30, 4).cumsum(2) * 0.4  # drifting keys: long chains of neighbours
    free, radius = torch.rand(2, 2, 30) > 0.1, torch.rand(2, 2) * 2
    dist = torch.cdist(keys, keys)
    expected = torch.zeros_like(free)
    for b in range(2):
        for h in range(2):
            centres = []
            for i in range(30):
                if free[b, h, i] and all(dist[b, h, i, j] > radius[b, h] for j in centres):
                    centres.append(i)
                    expected[b, h, i] = True
    assert torch.equal(online_centres(dist, free, radius), expected)


def test_merge_states_with_separate_value_weights_and_a_value_scale():
    keys = torch.tensor([[[[1.0], [3.0], [5.0]]]])
    values = torch.tensor([[[[2.0], [4.0], [8.0]]]])
    target, weight = torch.tensor([[[-1, 0, 0]]]), torch.tensor([[[0.0, 1.0, 0.5]]])
    k, v, lc, changed = merge_states(keys, values, torch.zeros(1, 1, 3), Merge(target, weight))
    assert k[0, 0, 0].item() == pytest.approx((1 + 3 + 2.5) / 2.5) and v[0, 0, 0].item() == pytest.approx(10 / 2.5)
    k, v, lc, changed = merge_states(
        keys, values, torch.zeros(1, 1, 3), Merge(target, weight, torch.zeros(1, 1, 3), torch.tensor([[[3.0, 1, 1]]]))
    )
    assert k[0, 0, 0].item() == pytest.approx(6.5 / 2.5) and v[0, 0, 0].item() == pytest.approx(6.0)
    assert lc[0, 0, 0].item() == pytest.approx(math.log(2.5)) and row(changed) == [True, False, False]


@pytest.mark.parametrize(
    "spec, twins, attention",
    [  # each leaves one token out and merges it into its twin, the kept token it duplicates
        ("chelsea(chunk_size=8)", (4, 3), None),  # the only cosine-1 pair: A token 4, B token 3
        ("subgen", (4, 3), None),  # at distance 0: one cluster at the smallest radius
        ("subgen(values='mean')", (4, 3), None),
        ("ems(window_size=1, coverage=1.0)", (4, 3), [9.0, 8, 7, 6, 0, 5]),  # 4 scores lowest; its twin is 3
        ("zeromerge", (1, 2), [9.0, 0, 1, 8, 7, 6]),  # 1 left out; 2, the lowest heavy hitter, is the residual
    ],
)
def test_a_merged_entry_attends_like_the_tokens_it_stands_for(spec, twins, attention):
    torch.manual_seed(2)
    keys, values = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    keys[0, 0, twins[0]], values[0, 0, twins[0]] = keys[0, 0, twins[1]], values[0, 0, twins[1]]
    layer = layer_with(keys, values, queries=torch.zeros(1, 1, 1, 8))
    if attention is not None:
        layer.add_stat("attention_sum", 0, torch.tensor([attention]), accumulate=False)
    query, slots = torch.randn(1, 1, 3, 8), torch.arange(6, 9)

    def attend():
        return _attend(
            query, 1, layer.head_keys, layer.head_values, layer.head_slots, slots, None, None, 0.3, layer.head_bias
        )

    before = attend()
    compress(layer, method(spec), keep=5)
    assert layer.head_len(0) == 5 and layer.head_bias(0) is not None
    assert sorted(layer.head_bias(0)[0].tolist())[-1] == pytest.approx(math.log(2))
    torch.testing.assert_close(attend(), before, atol=1e-5, rtol=1e-5)


def test_parameters_are_checked_with_one_line_errors():
    for spec in ("chelsea(chunk_size=3)", "ems(coverage=2)", "zeromerge(tail=-1)", "subgen(values='max')"):
        with pytest.raises(UserError):
            Stack.parse(spec)


# ---- in the cache, on the tiny models -------------------------------------------------------
def prompt(n, seed=0):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, cache, ids, follow, mask=None):
    """Logits (steps, b, vocab) after prefilling ids (b, n) and after each token of `follow`."""
    runner = Runner(model, cache)
    ids = torch.tensor(ids)
    out = [runner.forward(ids, torch.ones_like(ids) if mask is None else mask)]
    for t in follow:
        out.append(runner.forward(torch.full((ids.shape[0], 1), t), torch.ones(ids.shape[0], 1, dtype=torch.long)))
    return torch.stack(out)


def no_merge(spec):
    """The same selection with the tokens left out evicted."""
    stage = method(spec)
    roles = property(lambda self: type(stage).roles.fget(self) - {"merger"})  # the stage no longer merges
    return Stack((type(f"{type(stage).__name__}Evicting", (type(stage),), {"roles": roles})(**stage.params()),))


@pytest.mark.parametrize("spec", METHODS)
def test_budget_one_is_the_full_cache(tiny, spec):
    ids, follow = [prompt(40)], prompt(4, seed=1)
    torch.testing.assert_close(run(tiny, KVCache(tiny, spec, 1.0), ids, follow), run(tiny, KVCache(tiny), ids, follow))
    assert ids_of(tiny, [(ids[0], [])], spec, 1.0, new=6)[0] == ids_of(tiny, [(ids[0], [])], new=6)[0]


@pytest.mark.parametrize("spec", METHODS)
def test_half_budget_merges_within_its_bytes(tiny, spec):
    ids, follow = [prompt(60)], prompt(8, seed=1)
    cache = KVCache(tiny, spec, 0.5)
    merged = run(tiny, cache, ids, follow)
    layers = [layer for layer in cache.layers if layer.is_initialized]
    slack = sum(layer.batch * layer.n_kv_heads * (layer.token_bytes() + 4) for layer in layers)  # a token per head
    assert cache.nbytes() <= 0.5 * cache.full_nbytes() + slack
    assert any(layer.head_bias(0) is not None for layer in layers)  # some entry stands for several tokens
    evicted = run(tiny, KVCache(tiny, no_merge(spec), 0.5), ids, follow)
    assert not torch.allclose(merged, evicted)


@pytest.mark.parametrize("spec", METHODS)
def test_lower_budgets_hold_fewer_bytes(llama, spec):
    held = []
    for budget in (1.0, 0.5, 0.25):
        cache = KVCache(llama, spec, budget)
        run(llama, cache, [prompt(64)], [])
        held.append(cache.nbytes() / cache.full_nbytes())
    assert held[0] == 1.0 and held[1] <= 0.5 and held[2] <= 0.25 and held[2] < held[1]


# measured max |logit - full| at 0.75: ems 0.052, chelsea 0.001, zeromerge 0.002, subgen 0.12 (l2
# sampling is a noisy estimate), subgen with mean values 0.001; h2o 0.087 for comparison
@pytest.mark.parametrize(
    "spec, tolerance",
    [("ems", 0.08), ("chelsea", 0.01), ("zeromerge", 0.01), ("subgen", 0.3), ("subgen(values='mean')", 0.01)],
)
def test_a_padded_batch_decodes_with_its_slots_and_close_to_full(llama, spec, tolerance):
    ids = [prompt(48, seed=4), [0] * 12 + prompt(36, seed=5)]
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, :12] = 0
    follow = prompt(6, seed=6)
    cache = KVCache(llama, spec, 0.75)
    merged = run(llama, cache, ids, follow, mask)
    full = run(llama, KVCache(llama), ids, follow, mask)
    assert (merged - full).abs().max() < tolerance
    assert cache.get_seq_length() == 54 and cache.compressions > 0
    for layer in cache.layers:
        for h in range(layer.n_kv_heads):
            for slots in layer.head_slots(h).expand(2, -1):
                slots = slots[slots >= 0]  # a row holding fewer tokens ends in empty places
                assert bool((slots[1:] > slots[:-1]).all()) and int(slots[-1]) == 53  # in order, newest held


def test_an_allocator_shares_the_budget_of_a_merging_method(llama):
    stack = Stack.parse("pyramid(ems)")
    assert stack.merger is stack.evictor and stack.merger.name == "ems"
    cache = KVCache(llama, stack, 0.5)
    run(llama, cache, [prompt(64)], prompt(4, seed=1))
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()
    counts = [int(layer.counts().max()) for layer in cache.layers]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]  # pyramid: fewer up the layers
