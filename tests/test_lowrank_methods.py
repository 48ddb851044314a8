"""Keys-only low-rank storage: `rotatek` (rotated, head-wise pruned key channels) and `shadowkv`
(pre-RoPE keys as per-chunk SVD factors), alone, after eviction and under a quantizer."""

import math

import pytest
import torch

from helpers import ids_of
from kvstack.cache.cache import KVCache
from kvstack.cache.encoded import Where
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.lowrank.rotatek import AsIs, RotateK, headwise_mask, kept_axes, second_moment
from kvstack.methods.lowrank.shadowkv import ShadowKeys
from kvstack.models.rope import rotate
from kvstack.stack import Stack


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def run(model, spec, budget, n=96, steps=4, rows=1, check=None, pad=0):
    """Prefill `rows` prompts of n tokens (row 1 left-padded by `pad`), then decode `steps`
    tokens; `check(cache)` after each step."""
    cache = KVCache(model, spec, budget)
    runner = Runner(model, cache)
    ids = torch.tensor([prompt(n, seed=r) for r in range(rows)])
    mask = torch.ones_like(ids)
    if pad:
        ids[1, :pad], mask[1, :pad] = 0, 0
    logits = runner.forward(ids, mask)
    for t in prompt(steps, seed=9):
        if check is not None:
            check(cache)
        logits = runner.forward(torch.full((rows, 1), t), torch.ones(rows, 1, dtype=torch.long))
    return cache, logits


_FULL: dict[int, tuple] = {}


def full_run(model):
    """The full cache's (cache, logits, greedy ids) on the rows the comparisons use, once per model."""
    if id(model) not in _FULL:
        cache, logits = run(model, "full", 1.0, rows=2, pad=7)
        _FULL[id(model)] = cache, logits, ids_of(model, ROWS, "full", 1.0)[0]
    return _FULL[id(model)]


ROWS = [(prompt(60), prompt(3, seed=1)), (prompt(40, seed=2), prompt(2, seed=3))]


def inv_freq(d):
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()


# ---- by hand --------------------------------------------------------------------------------
def test_headwise_mask_keeps_each_heads_most_energetic_rotated_channels():
    assert headwise_mask(torch.tensor([[1.0, 5.0, 2.0, 0.1], [0.0, 0.0, 4.0, 3.0]]), 2).tolist() == [[1, 2], [2, 3]]
    m = second_moment(torch.eye(2), torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]))
    assert m.tolist() == [[4.0, 2.0], [2.0, 4.0]]  # diag(3, 0) + [1, 2] [1, 2]^T


def test_a_four_dim_key_is_rotated_then_pruned_to_each_heads_kept_channels():
    d, s = 4, 2**-0.5
    table = torch.zeros(1, 2, 2, d + 2, d)  # one layer, two heads: (axes rows, mean, variances) of keys
    table[0, 0, 0, :d] = torch.eye(d)  # head 0: the standard axes, energies 1, 5, 2, 0.1
    table[0, 0, 0, d + 1] = torch.tensor([1.0, 5.0, 2.0, 0.1])
    table[0, 1, 0, :d] = torch.tensor([[s, s, 0, 0], [s, -s, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    table[0, 1, 0, d] = torch.tensor([0.0, 0.0, 2.0, 0.0])  # head 1: energy 4 along e2 (mean) ...
    table[0, 1, 0, d + 1] = torch.tensor([3.0, 0.0, 0.0, 0.0])  # ... and 3 along (e0 + e1) / sqrt 2
    axes = kept_axes(table, 2)
    assert axes[0][0].abs().tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]
    key = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    codec, values = RotateK(fraction=0.5).codecs(table)
    head0, head1 = codec.encode(key, Where(0, 0, "key")), codec.encode(key, Where(0, 1, "key"))
    assert head0.tokens["coeff"].abs().tolist() == [[[2.0, 3.0]]]  # channels 1 and 2 kept, others pruned
    assert head0.decode().tolist() == [[[0.0, 2.0, 3.0, 0.0]]]
    assert sorted(head1.tokens["coeff"].abs().flatten().tolist()) == pytest.approx([1.5 * 2**0.5, 3.0])
    assert head1.decode()[0, 0].tolist() == pytest.approx([1.5, 1.5, 3.0, 0.0], abs=1e-6)
    assert isinstance(values, AsIs) and values.encode(key, Where(0, 0, "value")).decode().equal(key)
    assert codec.token_bytes(d) == 2 * 4 and values.token_bytes(d) == 4 * 4 and values.fixed_bytes(d) == 0


def rope_rank_r(b=2, n=32, d=16, r=2, seed=0):
    """Keys that are exactly rank r before RoPE, rotated at per-row positions: (post-RoPE keys, positions)."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(b, n, r, generator=g) @ torch.randn(b, r, d, generator=g)
    positions = torch.arange(n).expand(b, n) + torch.tensor([[5], [40]])[:b]
    return rotate(pre, positions, inv_freq(d)), positions


def test_pre_rope_svd_rebuilds_rank_r_keys_exactly_where_post_rope_svd_cannot():
    keys, positions = rope_rank_r()
    codec = ShadowKeys(rank=2, chunk=32, dtype=torch.float32)
    where = Where(0, 0, "key", positions=lambda: positions, inv_freq=inv_freq(16))
    enc = codec.encode(keys, where)
    assert enc.tokens["coeff"].shape == (2, 32, 2) and enc.groups["basis"].shape == (2, 1, 2, 16)
    assert enc.tokens["pos"].dtype == torch.int32 and enc.tokens["pos"].equal(positions.int())
    assert torch.allclose(enc.decode(), keys, atol=1e-5)
    post = codec.encode(keys, Where(0, 0, "key", positions=lambda: positions))  # no RoPE undone
    assert (post.decode() - keys).abs().max() > 0.1
    assert codec.token_bytes(16) == 2 * 4 + 4 + 2 * 16 * 4 / (0.75 * 32)


@pytest.mark.parametrize("kept, reencoded", [(5, True), (30, False)])
def test_evicting_shadowkv_keys_keeps_the_rest_with_their_positions(kept, reencoded):
    keys, positions = rope_rank_r()
    codec = ShadowKeys(rank=2, chunk=32, dtype=torch.float32)
    enc = codec.encode(keys, Where(0, 0, "key", positions=lambda: positions, inv_freq=inv_freq(16)))
    index = torch.stack(
        [torch.randperm(32, generator=torch.Generator().manual_seed(i))[:kept].sort().values for i in (0, 1)]
    )
    left = enc.take(index)
    assert ("count" not in left.groups) == reencoded  # too sparse: a new SVD of the survivors, RoPE undone again
    assert left.tokens["pos"].equal(torch.gather(positions, 1, index).int())
    want = torch.gather(keys, 1, index.unsqueeze(-1).expand(-1, -1, 16))
    assert torch.allclose(left.decode(), want, atol=1e-5)


# ---- against the full cache -----------------------------------------------------------------
# a chunk of 8 tokens spans at most 8 dimensions, so rank 8 is exact too; on Gemma 3 the sliding
# layers then evict from encoded chunks every step (thinned chunks, and new SVDs of the survivors)
SPECS = ["rotatek(fraction=1.0)", "shadowkv(r={d}, chunk={d}, residual=0)", "shadowkv(r=8, chunk=8, residual=0)"]


@pytest.mark.parametrize("spec", SPECS)
def test_full_rank_reproduces_the_full_cache(tiny, spec):
    spec = spec.format(d=tiny.config.head_dim)
    cache, logits = run(tiny, spec, 1.0, rows=2, pad=7)
    full_cache, full, full_ids = full_run(tiny)
    assert any(layer.is_coded for layer in cache.layers)
    assert torch.allclose(logits, full, atol=1e-4)
    for layer, ref in zip(cache.layers, full_cache.layers, strict=True):  # the same tokens at the same slots
        assert layer.dense_slots().equal(ref.dense_slots())
    assert ids_of(tiny, ROWS, spec, 1.0)[0] == full_ids


@pytest.mark.parametrize(
    "spec, tol", [("rotatek(fraction=0.75)", 0.01), ("shadowkv(r=12, chunk=16, residual=0)", 0.01)]
)
def test_mild_compression_keeps_the_next_token_logits_close(llama, spec, tol):
    _, logits = run(llama, spec, 1.0, rows=2, pad=7)
    _, full, _ = full_run(llama)
    assert (logits - full).abs().max() < tol
    assert logits.argmax(-1).equal(full.argmax(-1))


def test_shadowkv_undoes_rope_at_each_tokens_position_in_its_own_row(llama):
    cache, _ = run(llama, "shadowkv(r=4, chunk=16, residual=0)", 1.0, n=48, steps=0, rows=2, pad=7)
    stored = cache.layers[0].coded[0][0].keys.tokens["pos"]  # the 48 prompt tokens, 3 chunks
    assert stored[0].tolist() == list(range(48))
    assert stored[1].tolist() == [0] * 8 + list(range(1, 41))  # 7 padding slots, then positions 0..40


def test_bytes_fall_with_the_rank_exactly_as_stored(llama):
    n, d = 100, 16  # 96 prompt tokens + 4 decoded; per layer 2 KV heads, one row, float32
    held = {"rotatek": [], "shadowkv": []}
    for r in (16, 8, 4, 2):
        cache, _ = run(llama, f"rotatek(fraction={r / d})", 1.0)
        assert cache.nbytes() == 4 * 2 * (n * (r + d) * 4 + (r + 1) * d * 4)  # kept channels, values; axes + zero mean
        held["rotatek"].append(cache.nbytes())
        cache, _ = run(llama, f"shadowkv(r={r}, chunk=16, residual=0)", 1.0)
        coded = 96 * (r * 4 + 4 + d * 4) + 6 * r * d * 4  # coefficients, position, value; a basis per chunk
        assert cache.nbytes() == 4 * 2 * (coded + 4 * 2 * d * 4)  # + the 4 decoded tokens waiting for a chunk
        held["shadowkv"].append(cache.nbytes())
    for sizes in held.values():
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 0.75 * sizes[0]


# ---- stacked --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stack",
    [
        "snapkv(window_size=4)+rotatek(fraction=0.25)",
        "snapkv(window_size=4)+shadowkv(r=2, chunk=16, residual=0)",
        "snapkv(window_size=4)+rotatek(fraction=0.5)+kivi(bits=4, group=8, residual=16)",
    ],
)
def test_stacked_with_eviction_holds_the_byte_budget_and_keeps_more_tokens(llama, stack):
    def within(cache):
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()

    snap = "snapkv(window_size=4)"
    counts = {}
    for spec in (snap, stack):
        cache, logits = run(llama, spec, 0.25, n=300, steps=20, rows=2, check=within)
        within(cache)
        assert torch.isfinite(logits).all()
        counts[spec] = int(cache.layers[0].counts().sum())
    assert counts[stack] > 1.15 * counts[snap]


def test_a_quantizer_after_shadowkv_is_a_one_line_error_not_a_crash(llama):
    with pytest.raises(UserError, match="no quantizer can code them") as err:
        run(llama, "snapkv(window_size=4)+shadowkv(r=8, chunk=16, residual=0)+kivi(bits=4, group=8)", 0.5, steps=0)
    assert "\n" not in str(err.value)


def test_the_stacks_parse_and_print_back():
    for spec in ("snapkv+rotatek(fraction=0.25)", "snapkv+shadowkv(r=16, chunk=128)", "rotatek+kivi(bits=4)"):
        assert Stack.parse(str(Stack.parse(spec))) == Stack.parse(spec)
    assert math.isclose(RotateK().fraction, 0.5) and Stack.parse("shadowkv").stages[0].residual == 32
