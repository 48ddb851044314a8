"""Cross-layer stages (MiniCache, xKV): definitions by hand, the full cache at full size, bytes
counted once for shared storage, positions, decoding, and composition with eviction and KIVI."""

import math

import pytest
import torch

from helpers import ids_of
from kvstack.cache.cache import KVCache
from kvstack.cache.layer import CompressedLayer, storage_bytes
from kvstack.cache.sequence import SequenceState
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.crosslayer.base import JOINED, layer_groups
from kvstack.methods.crosslayer.minicache import MiniCache, angular_distance, disentangle, retention, slerp
from kvstack.methods.crosslayer.xkv import group_rank, shared_subspace
from kvstack.stack import Stack

SNAP = "snapkv(window_size=4, every=4)"
FULL_SIZE = ["minicache(retain=1.0)", "minicache(start=1.0)", "xkv(k=1.0, v=1.0)"]


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def run(model, spec, budget=1.0, n=48, steps=0):
    """A cache after a prompt of n tokens and `steps` decoded ones; logits (1 + steps, vocab)."""
    cache = KVCache(model, spec, budget)
    runner = Runner(model, cache)
    out = [runner.forward(torch.tensor([prompt(n)]), torch.ones(1, n, dtype=torch.long))]
    for t in prompt(steps, seed=1):
        out.append(runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long)))
    return cache, torch.cat(out)


def kl(logits, ref):
    return float((ref.log_softmax(-1).exp() * (ref.log_softmax(-1) - logits.log_softmax(-1))).sum(-1).max())


# ---- definitions by hand ----------------------------------------------------------------------
def test_slerp_keeps_each_layers_magnitude_by_hand():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 2.0])
    (ma, da), (mb, db) = disentangle(a), disentangle(b)
    assert ma.item() == 3.0 and mb.item() == 2.0 and da.tolist() == [1.0, 0.0] and db.tolist() == [0.0, 1.0]
    assert angular_distance(da, db).item() == pytest.approx(0.5)  # 90 degrees of 180
    # W = pi/2, t = 0.6: sin(0.4 W) a + sin(0.6 W) b = (cos 0.3 pi, sin 0.3 pi), on the unit circle
    e = slerp(da, db, 0.6)
    torch.testing.assert_close(e, torch.tensor([math.sin(0.2 * math.pi), math.sin(0.3 * math.pi)]))
    torch.testing.assert_close(e, torch.tensor([math.cos(0.3 * math.pi), math.sin(0.3 * math.pi)]))
    torch.testing.assert_close(ma * e, torch.tensor([1.7634, 2.4271]), atol=1e-4, rtol=0)  # layer l reads |x_l| e
    assert torch.equal(slerp(da, da, 0.6), da)  # parallel: no 0/0
    assert slerp(da, db, 0.0).tolist() == pytest.approx([1.0, 0.0], abs=1e-7)


def test_retention_keeps_the_most_distant_pairs():
    distance = torch.tensor([[0.1, 0.5, 0.3, 0.9]])
    everything, real = torch.ones(1, 4, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)
    # ceil(0.25 x 4) = 1 retained: the farthest (0.9); the other three merge
    assert retention(distance, everything, real, 0.25).tolist() == [[0, 1, 2]]
    assert retention(distance, everything, real, 0.5).tolist() == [[0, 2]]
    assert retention(distance, everything, real, 1.0).tolist() == [[]]
    # offset 1 is no candidate: 3 candidates, ceil(0.75) = 1 retained
    assert retention(distance, torch.tensor([[True, False, True, True]]), real, 0.25).tolist() == [[0, 2]]
    # padding merges first, however distant
    assert retention(distance, everything, torch.tensor([[True, True, True, False]]), 0.5).tolist() == [[0, 3]]
    # rows merge the same count: the row with fewer candidates sets it
    two = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.8, 0.2, 0.6, 0.4]])
    cand = torch.tensor([[True, True, True, True], [True, True, True, False]])
    assert retention(two, cand, torch.ones(2, 4, dtype=torch.bool), 0.0).tolist() == [[0, 1, 2], [0, 1, 2]]
    # 0.34: row 0 retains ceil(1.36) = 2 of 4, row 1 ceil(1.02) = 2 of 3: both merge one, their closest
    assert retention(two, cand, torch.ones(2, 4, dtype=torch.bool), 0.34).tolist() == [[0], [1]]


def pair_of_layers(keys_a, keys_b):
    """Two layers of one head sharing a sequence, keys (t, d) each, values equal to the keys."""
    seq = SequenceState()
    layers = []
    for i, k in enumerate((keys_a, keys_b)):
        layer = CompressedLayer(i, 2, 1, 1, 1.0, None, seq)
        x = k.reshape(1, 1, *k.shape)
        layer.append(x, x.clone(), torch.arange(k.shape[0]))
        layers.append(layer)
    seq.prompt_end = keys_a.shape[0]
    return layers


def test_a_pair_merges_into_one_direction_and_retains_the_most_distant_token():
    keys_a = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, 2.0], [1.0, 0.0]])
    keys_b = torch.tensor([[0.0, 2.0], [-1.0, -1.0], [0.0, 1.0], [2.0, 0.0]])  # token 1: opposite
    a, b = pair_of_layers(keys_a, keys_b)
    MiniCache(start=0.0, retain=0.25).join_group([a, b], 0, 4)
    e = torch.tensor([math.cos(0.3 * math.pi), math.sin(0.3 * math.pi)])
    want_a = torch.stack([3 * e, keys_a[1], keys_a[2], keys_a[3]])  # token 1 retained as it was
    want_b = torch.stack([2 * e, keys_b[1], keys_b[2], keys_b[3]])
    for layer, want in ((a, want_a), (b, want_b)):
        assert layer.keys[0].shape[1] == 1 and layer.coded[0][0].n == 3  # one plain, three merged
        assert layer.storage_order(0) is not None  # storage: merged 0, 2, 3, then retained 1
        assert layer.dense_slots().tolist() == [[[0, 1, 2, 3]]]
        torch.testing.assert_close(layer.dense([layer.head_keys(0)])[0, 0], want)
        torch.testing.assert_close(layer.dense([layer.head_values(0)])[0, 0], want)
    assert a.coded[0][0].keys.shared["direction"] is b.coded[0][0].keys.shared["direction"]
    together = storage_bytes(a.tensors() + b.tensors())
    shared = 2 * 3 * 2 * 4 + 3 * 2  # directions of keys and values (3 tokens, 2 channels, float32), int16 rows
    assert together == a.nbytes() + b.nbytes() - shared  # (at d = 2 magnitudes and slots outweigh the saving)
    MiniCache(start=0.0, retain=0.0).join_group([a, b], 0, 4)  # the retained token is no longer plain in
    assert a.keys[0].shape[1] == 0 and len(a.coded[0]) == 2  # both: it is joined by itself


def test_shared_subspace_reconstructs_exactly_at_full_rank_and_optimally_below():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 10, 6, generator=g)
    latent, factor = shared_subspace(x, 6)
    assert latent.shape == (2, 10, 6) and factor.shape == (2, 6, 6)
    torch.testing.assert_close(latent @ factor, x, atol=1e-5, rtol=0)
    latent, factor = shared_subspace(x, 2)
    s = torch.linalg.svdvals(x)
    torch.testing.assert_close((x - latent @ factor).pow(2).sum((1, 2)), s[:, 2:].pow(2).sum(-1), atol=1e-4, rtol=1e-4)
    # fewer tokens than features: every fitted row exact; a row left out of the fit is not used to fit
    wide = torch.randn(1, 4, 12, generator=g)
    fit = torch.tensor([[True, True, True, False]])
    latent, factor = shared_subspace(wide, 12, fit)
    assert factor.shape == (1, 4, 12)
    torch.testing.assert_close((latent @ factor)[:, :3], wide[:, :3], atol=1e-5, rtol=0)
    assert group_rank(0.09375, 4 * 8 * 128) == 384 and group_rank(0.140625, 4096) == 576  # xKV-4 on Llama-3.1-8B
    assert group_rank(1e-9, 64) == 1 and group_rank(1.0, 64) == 64


def test_a_group_shares_one_latent_and_factors_keys_before_rope():
    from kvstack.methods.crosslayer.xkv import XKV
    from kvstack.models.rope import rotate

    g = torch.Generator().manual_seed(1)
    keys_a, keys_b = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    a, b = pair_of_layers(keys_a, keys_b)
    XKV(k=0.25, v=0.25).join_group([a, b], 0, 5)  # rank round(0.25 x 8) = 2 of the 8 features side by side
    x = torch.cat([keys_a, keys_b], -1)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    best = (u[:, :2] * s[:2]) @ vh[:2]  # the best rank-2 fit of both layers together
    torch.testing.assert_close(a.head_keys(0)[0], best[:, :4], atol=1e-5, rtol=0)
    torch.testing.assert_close(b.head_values(0)[0], best[:, 4:], atol=1e-5, rtol=0)
    assert a.coded[0][0].keys.shared["latent"] is b.coded[0][0].keys.shared["latent"]
    assert a.coded[0][0].keys.shared["factor"].untyped_storage().data_ptr() == (
        b.coded[0][0].keys.shared["factor"].untyped_storage().data_ptr()
    )
    # keys that are one vector rotated by RoPE to each position: rank 1 before RoPE, not after
    inv_freq = torch.tensor([1.0, 0.1])
    c = torch.tensor([1.0, -2.0, 0.5, 3.0])
    roped = rotate(c.expand(6, 4), torch.arange(6.0), inv_freq)
    errors = {}
    for pre_rope in (True, False):
        a, b = pair_of_layers(roped, 2 * roped)
        a.inv_freq = b.inv_freq = inv_freq
        XKV(k=0.125, v=1.0, pre_rope=pre_rope).join_group([a, b], 0, 6)  # keys at rank 1
        errors[pre_rope] = float((a.head_keys(0)[0] - roped).abs().max())
    assert errors[True] < 1e-5 < 0.1 < errors[False]


def test_layer_groups_pair_layers_of_the_same_kind_from_the_start():
    llama, gemma = [False] * 4, [True] * 5 + [False]
    assert layer_groups(llama, 0.5, 2) == [[2, 3]]
    assert layer_groups(gemma, 0.5, 2) == [[3, 4], [5]]  # sliding with sliding; the lone global layer alone
    assert layer_groups(gemma, 0.0, 4) == [[0, 1, 2, 3], [4], [5]]
    assert MiniCache().groups(gemma) == [[3, 4]]


def test_specs_parse_and_invalid_values_name_the_range():
    stack = Stack.parse(f"{SNAP}+minicache")
    assert type(stack.joiner).__name__ == "MiniCache" and stack.quantizer is None
    assert Stack.parse("minicache+kivi(bits=2)").quantizer.name == "kivi"
    with pytest.raises(UserError, match="two cross-layer"):
        Stack.parse("minicache+xkv")
    with pytest.raises(UserError, match=r"t must be in \[0, 1\]"):
        Stack.parse("minicache(t=2)")
    with pytest.raises(UserError, match=r"k must be in \(0, 1\]"):
        Stack.parse("xkv(k=0)")
    with pytest.raises(UserError, match="group=0 is out of range: give an integer from 1"):
        Stack.parse("xkv(group=0)")


# ---- on the tiny models -----------------------------------------------------------------------
@pytest.mark.parametrize("spec", FULL_SIZE)
def test_full_size_reproduces_the_full_cache(tiny, spec):
    full_cache, full = run(tiny, "full", steps=6)
    cache, same = run(tiny, spec, steps=6)
    torch.testing.assert_close(same, full, atol=1e-4, rtol=1e-4)
    if spec.startswith("xkv"):  # something really was factored: every layer holds its prompt in parts
        assert all(layer.coded[0] for layer in cache.layers)
    rows = [(prompt(40, seed=4), prompt(5, seed=5)), (prompt(27, seed=6), prompt(3, seed=7))]  # batch 2, padded
    assert ids_of(tiny, rows, spec, 1.0, new=8)[0] == ids_of(tiny, rows, "full", 1.0, new=8)[0]


def test_merging_and_lower_rank_hold_fewer_bytes_and_shared_storage_counts_once(llama):
    held = [run(llama, f"minicache(retain={r})", n=64)[0].nbytes() for r in (1.0, 0.5, 0.0)]
    assert held[0] == run(llama, "full", n=64)[0].nbytes() and held[0] > held[1] > held[2]
    ranks = [run(llama, f"xkv(k={k}, v={k})", n=100)[0].nbytes() for k in (1.0, 0.5, 0.25, 0.1)]
    assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == 4
    # xKV: one group of the 4 layers; its latents, positions and factor tables are one storage each,
    # held by every layer: each layer's nbytes counts them, the cache once
    xkv, _ = run(llama, "xkv(k=0.25, v=0.25)", n=64)
    group = storage_bytes(xkv.layers[0].coded[0][0].tensors())
    latent = xkv.layers[0].coded[1][0].keys.shared["latent"]
    assert all(layer.coded[0][0].keys.shared["latent"] is latent for layer in xkv.layers)
    assert xkv.nbytes() == sum(layer.nbytes() for layer in xkv.layers) - 3 * group
    minicache, _ = run(llama, "minicache(retain=0.0)", n=64)
    pair = minicache.layers[2:]
    for h in range(2):
        assert pair[0].coded[h][0].keys.shared["direction"] is pair[1].coded[h][0].keys.shared["direction"]
    shared = sum(
        storage_bytes([c.keys.shared["direction"], c.values.shared["direction"], c.keys.tokens["row"]])
        for c in (parts[0] for parts in pair[1].coded)
    )
    assert minicache.nbytes() == sum(layer.nbytes() for layer in minicache.layers) - shared


def test_positions_stay_and_mild_settings_stay_close(tiny):
    full_cache, full = run(tiny, "full", n=64, steps=1)
    errors = {}
    for spec in ("minicache(retain=0.5)", "minicache(retain=0.0)", "xkv(k=0.4, v=0.4)", "xkv(k=0.1, v=0.1)"):
        cache, logits = run(tiny, spec, n=64, steps=1)
        for layer, ref in zip(cache.layers, full_cache.layers, strict=True):
            assert torch.equal(layer.dense_slots(), ref.dense_slots())  # slots reported as the full cache's
            assert torch.equal(layer.counts(), ref.counts())
        errors[spec] = kl(logits[-1:], full[-1:])
    assert errors["minicache(retain=0.5)"] < errors["minicache(retain=0.0)"] < 5e-3
    assert errors["minicache(retain=0.5)"] < 1e-3
    assert errors["xkv(k=0.4, v=0.4)"] < errors["xkv(k=0.1, v=0.1)"] < 5e-4
    assert errors["xkv(k=0.4, v=0.4)"] < 1e-4


@pytest.mark.parametrize("spec", ["minicache(retain=0.2)", "xkv(k=0.25, v=0.25)"])
def test_decoding_a_padded_batch_of_two(tiny, spec):
    rows = [(prompt(50, seed=4), prompt(6, seed=5)), (prompt(31, seed=6), prompt(9, seed=7))]
    for method, budget in ((spec, 1.0), (f"{SNAP}+{spec}", 0.5)):
        ids, measures = ids_of(tiny, rows, method, budget, new=10)
        assert [len(r) for r in ids] == [10, 10]
        assert 0 < measures["kv_bytes"]
    cache, logits = run(tiny, spec, n=40, steps=8)  # tokens decoded stay plain beside the joined ones
    assert torch.isfinite(logits).all() and cache.layers[-1].keys[0].shape[1] >= 8
    assert any(layer.coded[0] for layer in cache.layers)


def test_sliding_layers_merge_and_keep_sharing_through_window_trims():
    from tiny import tiny_gemma3

    gemma = tiny_gemma3()
    cache, _ = run(gemma, "minicache(retain=0.0)", n=40)
    third, fourth = cache.layers[3], cache.layers[4]
    assert third.is_sliding and fourth.is_sliding and not cache.layers[5].coded[0]  # the lone global layer
    assert third.coded[0][0].n == 15  # the window's 15 tokens, merged
    runner = Runner(gemma, cache)
    runner.mask = torch.ones(1, 40, dtype=torch.long)
    for step, t in enumerate(prompt(16, seed=1)):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        if step < 14:  # each trim drops the oldest merged token from both layers' rows, not the table
            part = third.coded[0][0]
            assert part.n == 14 - step and part.keys.shared["direction"] is fourth.coded[0][0].keys.shared["direction"]
            assert part.keys.shared["direction"].shape[1] <= max(part.n / 0.75, 1) + 1  # dead rows freed
    assert not third.coded[0] and not fourth.coded[0]  # every merged token has left the window
    # xKV: the group's four sliding layers keep reading one latent table
    cache, _ = run(gemma, "xkv", n=40, steps=3)
    latents = {id(layer.coded[0][0].keys.shared["latent"]) for layer in cache.layers[:4]}
    assert len(latents) == 1 and cache.layers[0].coded[0][0].n == 12


def test_stacked_after_eviction_full_size_equals_the_eviction_alone(llama):
    evicted, alone = run(llama, SNAP, 0.5, n=64, steps=4)
    for spec in ("minicache(retain=1.0)", "xkv(k=1.0, v=1.0)"):
        _, logits = run(llama, f"{SNAP}+{spec}", 0.5, n=64, steps=4)
        torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)
    merged, _ = run(llama, f"{SNAP}+minicache(retain=0.0)", 0.5, n=64, steps=4)
    assert merged.nbytes() < evicted.nbytes() <= 0.5 * evicted.full_nbytes()  # decode evictions kept the sharing
    # after the prompt: the slots both layers of the pair kept were merged, the others stay plain
    merged, _ = run(llama, f"{SNAP}+minicache(retain=0.0)", 0.5, n=64)
    a, b = merged.layers[2], merged.layers[3]
    for h in range(2):
        slots_a = set(a.head_slots(h)[0, : a.coded[h][0].n].tolist())
        slots_b = set(b.head_slots(h)[0, : b.coded[h][0].n].tolist())
        plain_a = set(a.head_slots(h)[0, a.coded[h][0].n :].tolist())
        plain_b = set(b.head_slots(h)[0, b.coded[h][0].n :].tolist())
        assert slots_a == slots_b and not (plain_a & plain_b & set(range(64)))


def test_minicache_with_kivi_merges_what_kivi_left_plain(llama):
    kivi = "kivi(bits=2, group=8, residual=16)"
    quantized, _ = run(llama, kivi, n=48)
    both, _ = run(llama, f"minicache(retain=0.0)+{kivi}", n=48)
    assert both.nbytes() < quantized.nbytes()
    alone = quantized.layers[2]
    plain = set(alone.head_slots(0).expand(1, -1)[0, -alone.keys[0].shape[1] :].tolist())
    layer = both.layers[2]
    kivi_n, merged_n = (part.n for part in layer.coded[0])
    assert set(layer.head_slots(0).expand(1, -1)[0, kivi_n : kivi_n + merged_n].tolist()) == plain == set(range(32, 48))
    cache, logits = run(llama, f"minicache+{kivi}", n=48, steps=24)  # decoding: kivi encodes what arrives
    assert torch.isfinite(logits).all() and cache.layers[2].keys[0].shape[1] <= 16 + 7


def test_tokens_are_joined_once_and_forks_equal_joining_during_prefill(tiny):
    from kvstack.generate import Prompt, generate_forks, generate_ids

    cache, _ = run(tiny, "minicache(retain=0.3)", n=48)
    before = cache.nbytes()
    again = cache.fork("minicache(retain=0.3)", 1.0)  # the copy is maintained and joined again
    for layer in cache.layers:
        cache.policy.maintain(layer, decoding=False)
    assert again.nbytes() == cache.nbytes() == before
    joined = [cache.layers[i] for group in MiniCache().groups([x.is_sliding for x in cache.layers]) for i in group]
    assert joined and all(getattr(layer, JOINED) == 48 for layer in joined)
    prompts = [Prompt(prompt(60, seed=12), prompt(7, seed=13)), Prompt(prompt(41, seed=14), prompt(5, seed=15))]
    configs = [("minicache(retain=0.3)", 1.0), ("xkv(k=0.5, v=0.5, group=2)", 1.0), (f"{SNAP}+minicache", 0.5)]
    forked = list(generate_forks(tiny, prompts, configs, max_new_tokens=6))
    for (spec, budget), (ids, measures) in zip(configs, forked, strict=True):
        direct, m = generate_ids(tiny, prompts, spec, budget, query_agnostic=True, max_new_tokens=6)
        assert ids == direct and measures["kv_bytes"] == m["kv_bytes"]


def test_a_whole_prompt_allocator_compresses_before_the_pair_joins(llama):
    cache, logits = run(llama, "d2o(snapkv(window_size=4))+minicache(retain=0.0)", 0.5, n=64)
    a, b = cache.layers[2], cache.layers[3]
    assert getattr(a, JOINED) == 64 and a.coded[0] and a.coded[0][0].n == b.coded[0][0].n > 0
    assert a.coded[0][0].keys.shared["direction"].shape[1] == a.coded[0][0].n  # joined after the eviction


def test_alone_below_budget_one_is_a_user_error(llama):
    with pytest.raises(UserError, match="use budget 1.0 or add an eviction stage"):
        run(llama, "minicache", 0.5, n=8)
