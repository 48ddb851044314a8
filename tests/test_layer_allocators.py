"""Whole-prompt layer allocators (squeeze, prefix, d2o): their pure decisions by hand, and the
hidden-state hooks SqueezeAttention measures with, on the tiny Llama."""

import math

import pytest
import torch
from transformers import DynamicCache

from kvstack.cache import hidden
from kvstack.cache.cache import KVCache
from kvstack.generate import Runner
from kvstack.methods.allocate.base import Plan
from kvstack.methods.allocate.d2o import attention_spread, d2o_weights
from kvstack.methods.allocate.prefix import importance_cdf, prefix_counts, token_importance
from kvstack.methods.allocate.squeeze import kmeans_1d, squeeze_weights
from kvstack.policy.policy import Policy
from kvstack.stack import Stack


def ids(n, seed=0):
    return torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(seed))


# ---- prefix ---------------------------------------------------------------------------------
def test_prefix_counts_give_the_peaked_layer_fewer_tokens_at_one_shared_mass():
    # layer 0 peaked: importance 0.7, 0.1, 0.1, 0.1 -> cdf 0.7, 0.8, 0.9, 1.0
    # layer 1 flat:   0.25 x 4                      -> cdf 0.25, 0.5, 0.75, 1.0
    cdfs = torch.tensor([[[0.7, 0.8, 0.9, 1.0]], [[0.25, 0.5, 0.75, 1.0]]], dtype=torch.float64)
    # uniform 2 + 2 = 4: any mass m in (0.5, 0.7] needs 1 token in layer 0 and 3 in layer 1
    assert prefix_counts(cdfs, 4).flatten().tolist() == [1, 3]
    # 5: m in (0.7, 0.75] -> 2 + 3;  3: m in (0.25, 0.5] -> 1 + 2
    assert prefix_counts(cdfs, 5).flatten().tolist() == [2, 3]
    assert prefix_counts(cdfs, 3).flatten().tolist() == [1, 2]
    # every token (8) at m = 1; at least one token per layer even for a total of 1
    assert prefix_counts(cdfs, 8).flatten().tolist() == [4, 4]
    assert prefix_counts(cdfs, 1).flatten().tolist() == [1, 1]


def test_prefix_counts_treat_each_sequence_on_its_own():
    # (L=2, b=2, t=4): row 0 as above, row 1 with the layers swapped
    peaked, flat = [0.7, 0.8, 0.9, 1.0], [0.25, 0.5, 0.75, 1.0]
    cdfs = torch.tensor([[peaked, flat], [flat, peaked]], dtype=torch.float64)
    assert prefix_counts(cdfs, torch.tensor([4, 4])).tolist() == [[1, 3], [3, 1]]


def test_importance_is_averaged_over_heads_by_slot_and_its_cdf_sorted_and_normalised():
    # heads hold slots 0, 1, 2; +inf (must keep) counts as the largest finite score, 3
    scores = torch.tensor([[[1.0, float("inf"), 3.0], [3.0, 1.0, float("inf")]]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    slots = torch.arange(3).expand(1, 2, 3)
    importance, real = token_importance(scores, valid, slots)
    # head 0: 1, 3, 3; head 1: 3, 1, 3 -> mean 2, 2, 3
    assert importance.tolist() == [[2.0, 2.0, 3.0]] and real.all()
    # sorted 3, 2, 2 over 7 -> 3/7, 5/7, 1
    assert torch.allclose(importance_cdf(importance, real), torch.tensor([[3 / 7, 5 / 7, 1.0]], dtype=torch.float64))
    # a padded slot 0 is left out; 3, 1, 0 over 4 -> 0.75, 1, then 1 to the end
    cdf = importance_cdf(torch.tensor([[9.0, 1.0, 3.0, 0.0]]), torch.tensor([[False, True, True, True]]))
    assert cdf.tolist() == [[0.75, 1.0, 1.0, 1.0]]
    # heads holding different slots: head 0 slots 0, 2 (scores 4, 2), head 1 slots 1, 2 (6, 4)
    two = torch.ones(1, 2, 2, dtype=torch.bool)
    importance, real = token_importance(torch.tensor([[[4.0, 2.0], [6.0, 4.0]]]), two, torch.tensor([[[0, 2], [1, 2]]]))
    assert importance.tolist() == [[4.0, 6.0, 3.0]]


# ---- squeeze --------------------------------------------------------------------------------
def test_kmeans_1d_starts_at_min_median_max_and_breaks_ties_low():
    # init 0, 2 (lower median), 10; 1 is as close to 0 as to 2 -> the lower cluster
    # centers 0.5, 2.5, 10, and nothing moves again
    labels, centers = kmeans_1d(torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0]))
    assert labels.tolist() == [0, 0, 1, 1, 2]
    assert centers.tolist() == [0.5, 2.5, 10.0]


def test_squeeze_gives_the_highest_cosine_cluster_p_and_shares_the_rest():
    # clusters {0.5, 0.52}, {0.7, 0.72}, {0.95, 0.97}: the last two layers change least
    # they keep 0.3 each; the other four share 6 - 0.6 = 5.4 -> 1.35 each
    w = squeeze_weights([0.5, 0.52, 0.7, 0.72, 0.95, 0.97], p=0.3)
    assert torch.allclose(w, torch.tensor([1.35, 1.35, 1.35, 1.35, 0.3, 0.3], dtype=torch.float64))
    assert math.isclose(float(w.sum()), 6.0)
    # all equal, or a single layer: uniform
    assert squeeze_weights([0.9, 0.9, 0.9], p=0.3).tolist() == [1.0, 1.0, 1.0]
    assert squeeze_weights([0.4], p=0.3).tolist() == [1.0]
    # two layers: init 0.2, 0.2, 0.8 -> the 0.8 layer keeps 0.5, the other 2 - 0.5 = 1.5
    assert squeeze_weights([0.2, 0.8], p=0.5).tolist() == [1.5, 0.5]


def test_squeeze_refuses_a_share_outside_zero_one():
    with pytest.raises(Exception, match="p must be in"):
        Stack.parse("squeeze(p=1.5)")


def test_hooks_record_one_cosine_per_layer_and_sequence_then_the_allocation_follows(llama):
    cache = KVCache(llama, "squeeze(snapkv(window_size=4, every=4))", 0.5)
    Runner(llama, cache).forward(ids(48), torch.ones(1, 48, dtype=torch.long))
    cos = cache.signals["hidden_cosine"]
    assert sorted(cos) == [0, 1, 2, 3]
    assert all(v.shape == (1,) and -1.0 <= float(v) <= 1.0 for v in cos.values())
    assert cache.signals["hidden_cosine_tokens"][3].tolist() == [48.0]
    assert not cache.pending_signals
    # the weights were decided from every layer's value, the last one included
    expected = squeeze_weights(torch.stack([cos[i][0] for i in range(4)]), 0.3)
    assert torch.allclose(cache.policy.shares.weights[:, 0, 0], expected)
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()


def test_the_cosine_is_the_residual_stream_before_and_after_attention(tiny):
    # independent of the hooks: the layer's input, and the residual stream that enters the
    # pre-MLP norm (Llama: post_attention_layernorm; Gemma 3: pre_feedforward_layernorm, its
    # attention output already normalised by post_attention_layernorm)
    layer = tiny.model.layers[1]
    norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    seen = {}
    first = layer.register_forward_pre_hook(
        lambda m, a, k: seen.update(x=a[0] if a else k["hidden_states"]), with_kwargs=True
    )
    second = norm.register_forward_pre_hook(lambda m, a: seen.update(y=a[0]))
    cache = KVCache(tiny, "full", 1.0, observe=frozenset({"hidden_cosine"}))
    try:
        Runner(tiny, cache).forward(ids(20, 1), torch.ones(1, 20, dtype=torch.long))
    finally:
        first.remove()
        second.remove()
    expected = torch.nn.functional.cosine_similarity(seen["x"], seen["y"], dim=-1).mean()
    assert torch.allclose(cache.signals["hidden_cosine"][1], expected.reshape(1), atol=1e-6)


def test_padding_is_left_out_and_chunks_average_like_one_prompt(llama):
    alone = KVCache(llama, "full", 1.0, observe=frozenset({"hidden_cosine"}))
    Runner(llama, alone).forward(ids(30, 2), torch.ones(1, 30, dtype=torch.long))
    # the same prompt left-padded by 10 in a batch with another one
    batch = torch.cat([torch.cat([torch.zeros(1, 10, dtype=torch.long), ids(30, 2)], 1), ids(40, 3)])
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :10] = 0
    padded = KVCache(llama, "full", 1.0, observe=frozenset({"hidden_cosine"}))
    Runner(llama, padded).forward(batch, mask)
    # the prompt in two chunks: 12 then 18 tokens (a token-weighted running mean)
    chunked = KVCache(llama, "full", 1.0, observe=frozenset({"hidden_cosine"}))
    runner = Runner(llama, chunked)
    runner.forward(ids(30, 2)[:, :12], torch.ones(1, 12, dtype=torch.long))
    runner.forward(ids(30, 2)[:, 12:], torch.ones(1, 18, dtype=torch.long))
    for i in range(4):
        one = alone.signals["hidden_cosine"][i]
        assert torch.allclose(padded.signals["hidden_cosine"][i][:1], one, atol=1e-5)
        assert torch.allclose(chunked.signals["hidden_cosine"][i], one, atol=1e-5)
    assert padded.signals["hidden_cosine_tokens"][0].tolist() == [30.0, 40.0]


def test_hooks_install_once_and_record_nothing_when_no_cache_needs_them(llama):
    hidden.install(llama)
    before = [len(layer._forward_pre_hooks) for layer in llama.model.layers]
    hidden.install(llama)
    KVCache(llama, "squeeze", 0.5)  # installs again through the cache: still once
    assert [len(layer._forward_pre_hooks) for layer in llama.model.layers] == before
    cache = KVCache(llama, "snapkv(window_size=4)", 0.5)
    Runner(llama, cache).forward(ids(24), torch.ones(1, 24, dtype=torch.long))
    assert cache.signals == {} and not cache.pending_signals
    with torch.no_grad():  # a transformers cache goes through untouched
        llama(ids(10), past_key_values=DynamicCache(config=llama.config))


# ---- d2o ------------------------------------------------------------------------------------
def test_d2o_weighs_denser_layers_up_by_softmax_of_minus_the_normalised_variance():
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    # layer A: head 0 receives 1, 1, 1 (variance 0), head 1 receives 0, 0, 3 (mean 1, variance
    # (1 + 1 + 4) / 2 = 3); min-max over heads -> 0 and 3 / (3 + 1e-6); e = their mean ~ 0.5
    a = attention_spread(torch.tensor([[[1.0, 1.0, 1.0], [0.0, 0.0, 3.0]]]), valid)
    assert math.isclose(float(a), 0.5 * 3 / (3 + 1e-6), rel_tol=1e-9)
    # layer B: both heads variance 1 -> normalised 0 and 0 -> e = 0
    b = attention_spread(torch.tensor([[[2.0, 0.0, 1.0], [0.0, 2.0, 1.0]]]), valid)
    assert float(b) == 0.0
    # weights 2 softmax(-0.5, 0) = 2 e^-0.5 / (e^-0.5 + 1), 2 / (e^-0.5 + 1) = 0.7551, 1.2449
    w = d2o_weights(torch.stack([a, b]))
    assert torch.allclose(w.flatten(), torch.tensor([0.75508, 1.24492], dtype=torch.float64), atol=1e-4)
    assert math.isclose(float(w.sum()), 2.0)
    # a padded token does not count: head 1 of layer A with a fourth, invalid token
    padded = torch.tensor([[[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 3.0, 99.0]]])
    mask = torch.tensor([[[True, True, True, False], [True, True, True, False]]])
    assert torch.allclose(attention_spread(padded, mask), a)


def test_d2o_defaults_to_h2o_and_records_attention():
    stack = Stack.parse("d2o")
    assert stack.evictor.name == "h2o" and "attention_sum" in stack.needs
    assert Stack.parse("d2o(snapkv)").needs >= {"attention_sum"}
    assert Stack.parse("prefix").evictor.name == "snapkv" and Stack.parse("squeeze").needs == {"hidden_cosine"}


def test_global_counts_keep_the_best_scores_over_every_layer_and_head_by_hand():
    """Two layers (the second holding 3 tokens, the first 4), one sequence, two heads; keep 5 of
    the 14: the scores 9, 8, 7, 6, 5 sit in layer 0 head 0 (9, 7), layer 1 head 1 (8, 6) and
    layer 0 head 1 (5). Padding (-inf, not valid) never counts, whatever its score."""
    from kvstack.methods.allocate.globalk import global_counts

    first = torch.tensor([[[9.0, 1.0, 7.0, 0.0], [5.0, 2.0, 3.0, 100.0]]])  # (b, h, t): the 100 is padding
    second = torch.tensor([[[4.0, 1.0, 0.5], [8.0, 6.0, 2.5]]])
    valid = [torch.tensor([[[True] * 4, [True, True, True, False]]]), torch.ones(1, 2, 3, dtype=torch.bool)]
    counts = global_counts([first, second], valid, torch.tensor([5]))
    assert counts.tolist() == [[[2, 1]], [[0, 2]]]


def test_globalk_holds_the_budget_and_moves_it_to_where_the_scores_are(llama):
    """After the prompt, `globalk(snapkv)` holds no more than a uniform split's total, split
    unevenly over the layers and heads; at budget 1 it reproduces the full cache's logits."""
    from test_cache import prompt, step_logits

    counts = {}
    for spec in ("snapkv(window_size=8)", "globalk(snapkv(window_size=8))"):
        cache = KVCache(llama, spec, 0.25)
        step_logits(llama, cache, prompt(64, seed=2), [])
        counts[spec.split("(")[0]] = torch.stack([layer.counts()[0] for layer in cache.layers])  # (L, h)
    assert int(counts["globalk"].sum()) <= int(counts["snapkv"].sum()) < 64 * counts["snapkv"].numel()
    assert len(set(counts["globalk"].flatten().tolist())) > 1  # not a uniform split
    follow = prompt(8, seed=3)
    full = step_logits(llama, KVCache(llama, "full", 1.0), prompt(40, seed=4), follow)
    assert torch.equal(step_logits(llama, KVCache(llama, "globalk(snapkv)", 1.0), prompt(40, seed=4), follow), full)


@pytest.mark.parametrize(("spec", "reused"), [("globalk(keydiff)", True), ("globalk(h2o)", False)])
def test_a_whole_prompt_plan_scores_each_layer_once_and_keeps_the_same_tokens(llama, monkeypatch, spec, reused):
    """After the prompt, a whole-prompt allocator's plan scores every layer; the layer's
    compression reuses those scores (one scoring a layer, not two) unless its scorer read the
    plan's uniform split (`h2o`'s recent window is a share of it), and the cache keeps exactly the
    tokens it keeps when every layer is scored again."""
    from test_cache import prompt, step_logits

    scorer = type(Stack.parse(spec).evictor)  # the allocator hands its scorer the evictor role
    real_score, calls = scorer.score, []

    def counted(self, obs):
        calls.append(obs.layer_idx)
        return real_score(self, obs)

    def held(cache: KVCache) -> list[torch.Tensor]:
        return [layer.dense_slots() for layer in cache.layers]

    monkeypatch.setattr(scorer, "score", counted)
    ids = prompt(64, seed=2)
    once = KVCache(llama, spec, 0.25)
    step_logits(llama, once, ids, [])
    n_layers = len(once.layers)
    assert sorted(calls) == sorted(list(range(n_layers)) * (1 if reused else 2))

    real_plan_scores = Plan.scores

    def forgetful(self, layer_idx):  # the plan's scores are never handed on: every layer is scored again
        out = real_plan_scores(self, layer_idx)
        self.unsplit.clear()
        return out

    monkeypatch.setattr(Plan, "scores", forgetful)
    calls.clear()
    twice = KVCache(llama, spec, 0.25)
    step_logits(llama, twice, ids, [])
    assert len(calls) == 2 * n_layers
    assert all(torch.equal(a, b) for a, b in zip(held(once), held(twice), strict=True))


def test_uneven_shares_evict_on_one_cadence_while_decoding(llama, monkeypatch):
    """While decoding under an allocator's uneven shares, every head evicts the block of the
    uniform share ahead (1/16 of it), at most half its own share: a layer globalk left few tokens
    compresses about once a block, not at every few steps, and each head holds its share at each step."""
    from test_cache import prompt

    cache = KVCache(llama, "globalk(keydiff)", 0.25)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(512, seed=2)]), torch.ones(1, 512, dtype=torch.long))
    shares = torch.stack([cache.policy.shares.keep_allowed(layer)[0] for layer in cache.layers])  # (L, h)
    assert int(shares.min()) <= 64 and int(shares.max()) > 128  # uneven: a head at half the uniform 128
    real, compressed = Policy.compress_layer, [0] * len(cache.layers)

    def counted(self, layer, keep, decoding=False):
        compressed[layer.layer_idx] += 1
        return real(self, layer, keep, decoding)

    monkeypatch.setattr(Policy, "compress_layer", counted)
    steps = 40
    for t in prompt(steps, seed=3):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        for layer in cache.layers:
            assert bool((layer.counts()[0] <= cache.policy.shares.keep_allowed(layer)[0]).all())
    block = 128 // 16  # the uniform share's block, at least 8 tokens (a head's own 64 would give 4)
    assert max(compressed) <= steps // block + 1, compressed
