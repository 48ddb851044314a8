"""Merging in the cache: the log-count each merged entry carries, and D2O's recall-and-merge."""

import math

import pytest
import torch

from helpers import ids_of, layer_with
from kvstack.cache.attention import _attend
from kvstack.cache.cache import KVCache
from kvstack.cache.layer import WEIGHT
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.allocate.d2o import recall_weights
from kvstack.methods.merge.base import Merge, merge_states, nearest_kept
from kvstack.stack import Stack


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


# ---- the executor, by hand ------------------------------------------------------------------
def test_merge_states_takes_count_weighted_means_and_adds_up_counts():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).reshape(1, 1, 3, 2)
    values = torch.tensor([[2.0], [4.0], [8.0]]).reshape(1, 1, 3, 1)
    log_count = torch.tensor([0.0, 0.0, math.log(2)]).reshape(1, 1, 3)  # entry 2 already stands for 2 tokens
    plan = Merge(torch.tensor([[[-1, 2, -1]]]), torch.tensor([[[0.0, 0.5, 0.0]]]))  # half of token 1 joins 2
    k, v, c, changed = merge_states(keys, values, log_count, plan)
    assert changed.tolist() == [[[False, False, True]]]
    assert torch.allclose(k[0, 0, 2], torch.tensor([2 / 2.5, (2 + 0.5) / 2.5]))
    assert torch.allclose(v[0, 0, 2], torch.tensor([(16 + 2) / 2.5]))
    assert c[0, 0, 2].exp().item() == pytest.approx(2.5)
    assert torch.equal(k[0, 0, :2], keys[0, 0, :2]) and c[0, 0, 0].item() == 0.0


def test_nearest_kept_is_the_most_similar_kept_key_by_cosine():
    keys = torch.tensor([[1.0, 0.0], [10.0, 1.0], [0.0, 1.0], [-1.0, 0.1]]).reshape(1, 1, 4, 2)
    kept = torch.tensor([[[True, False, True, False]]])
    target, sim = nearest_kept(keys, kept, torch.ones_like(kept))
    assert target[0, 0, 1].item() == 0 and target[0, 0, 3].item() == 2
    assert sim[0, 0, 1].item() == pytest.approx(10 / math.sqrt(101))


def test_a_log_count_gives_one_entry_the_attention_of_the_tokens_it_stands_for():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 8, generator=g)  # 2 query heads over one KV head, 3 queries
    a, b = torch.randn(2, 8, generator=g)
    va, vb = torch.randn(2, 8, generator=g)

    def attend(keys, values, bias):
        k, v, slots = torch.stack(keys)[None], torch.stack(values)[None], torch.arange(len(keys))
        return _attend(q, 1, lambda h: k, lambda h: v, lambda h: slots, torch.tensor([5, 6, 7]), None, None, 0.3, bias)

    twice = attend([a, a, b], [va, va, vb], lambda h: None)
    merged = attend([a, b], [va, vb], lambda h: torch.tensor([[math.log(2), 0.0]]))
    plain = attend([a, b], [va, vb], lambda h: None)
    assert torch.allclose(twice, merged, atol=1e-6)
    assert not torch.allclose(twice, plain, atol=1e-3)


def test_rewrite_refuses_encoded_entries():
    layer = layer_with(torch.randn(1, 1, 6, 4))
    from kvstack.cache.encoded import Uniform
    from kvstack.methods.quantize.base import Quantizer

    codec = Uniform(8, group=4)
    layer.encode_oldest(0, 3, Quantizer(), (codec, codec), None)
    changed = torch.zeros(1, 1, 6, dtype=torch.bool)
    changed[0, 0, 1] = True
    with pytest.raises(ValueError, match="model's dtype"):
        layer.rewrite(changed, torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6))
    changed[0, 0, 1], changed[0, 0, 4] = False, True
    layer.rewrite(changed, torch.ones(1, 1, 6, 4), torch.ones(1, 1, 6, 4), torch.full((1, 1, 6), 0.5))
    assert torch.equal(layer.keys[0][0, 1], torch.ones(4)) and layer.stats[WEIGHT][0][0].tolist()[4] == 0.5


# ---- D2O ------------------------------------------------------------------------------------
def test_d2o_recalls_only_tokens_at_least_as_similar_as_the_threshold():
    sim = torch.tensor([[[0.9, 0.2, float("-inf"), 0.5]]])
    w = recall_weights(sim, torch.tensor([[[0.5]]]))
    assert torch.allclose(w, torch.tensor([[[math.exp(-0.1), 0.0, 0.0, math.exp(-0.5)]]]))


def test_d2o_merges_left_out_tokens_into_their_nearest_kept_one(llama):
    ids = torch.tensor([prompt(120)])
    caches = {}
    for spec in ("d2o", "d2o(recall=False)"):
        caches[spec] = KVCache(llama, spec, 0.5)
        Runner(llama, caches[spec]).forward(ids, torch.ones_like(ids))
    merged, plain = caches["d2o"].layers[1], caches["d2o(recall=False)"].layers[1]
    assert torch.equal(merged.head_slots(0), plain.head_slots(0))  # the same tokens kept
    same = (merged.keys[0] == plain.keys[0]).all(-1)
    assert 0 < int((~same).sum()) < same.numel()  # some kept entries absorbed others, not all
    assert WEIGHT not in merged.stats  # D2O does not re-weight attention


@pytest.mark.parametrize("spec", ["d2o", "d2o(log_count=True)"])
def test_d2o_reproduces_the_full_cache_at_budget_one(tiny, spec):
    rows = [(prompt(90), prompt(4, seed=1)), (prompt(70, seed=2), prompt(3, seed=3))]
    assert ids_of(tiny, rows, spec, 1.0)[0] == ids_of(tiny, rows, "full", 1.0)[0]


def test_merged_entries_hold_the_byte_budget_while_decoding_log_counts_included(tiny):
    cache = KVCache(tiny, "d2o(log_count=True)", 0.25)
    runner = Runner(tiny, cache)
    ids = torch.tensor([prompt(160), prompt(160, seed=1)])
    runner.forward(ids, torch.ones_like(ids))
    assert cache.nbytes() <= 0.25 * cache.full_nbytes()
    for t in prompt(24, seed=2):
        logits = runner.forward(torch.tensor([[t], [t]]), torch.ones(2, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()
    assert torch.isfinite(logits).all()
    full_layer = next(layer for layer in cache.layers if not layer.sliding_window)
    assert WEIGHT in full_layer.stats and float(full_layer.stats[WEIGHT][0].max()) > 0
    assert any(t is full_layer.stats[WEIGHT][0] for t in full_layer.tensors())  # counted as KV bytes


def test_merging_into_a_quantized_cache_rewrites_only_full_precision_tokens(llama):
    cache = KVCache(llama, "d2o(log_count=True)+kivi(bits=4, group=8, residual=16)", 0.25)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(200)]), torch.ones(1, 200, dtype=torch.long))
    for t in prompt(20, seed=3):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()
    assert any(layer.is_coded for layer in cache.layers)


def test_razor_compensation_and_merging_do_not_stack():
    with pytest.raises(UserError, match="keep one"):
        Stack.parse("razor(d2o)")
    assert Stack.parse("d2o(h2o)").merger is not None and Stack.parse("d2o(recall=False)").merger is None
