"""Rotation-based quantizers: `hadamard` (QuaRot) and `turboquant` against their definitions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.cache.cache import KVCache
from kvstack.cache.coded import alike, decode_heads
from kvstack.cache.encoded import Turned, Where
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.quantize.rotation import block_size, hadamard, random_signs, rotate, unrotate
from kvstack.methods.quantize.turboquant import TurboCodec, lloyd_max, qjl_estimate, sphere_levels
from kvstack.methods.registry import method_class
from kvstack.stack import Stack
from test_cache import prompt, step_logits

HERE = Where(0, 0, "key")


@pytest.mark.parametrize("d", [16, 64, 80, 96, 128, 256])
def test_the_rotation_is_orthogonal_and_undone_exactly(d):
    signs = random_signs(d, seed=3)
    r = rotate(torch.eye(d), signs)  # rows: R's rows, x R for x the unit vectors
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-6)
    x = torch.randn(5, 7, d)
    assert torch.allclose(unrotate(rotate(x, signs), signs), x, atol=1e-5)
    q = torch.randn(5, 1, d)  # inner products are unchanged
    assert torch.allclose(rotate(q, signs) @ rotate(x, signs).transpose(1, 2), q @ x.transpose(1, 2), atol=1e-4)
    assert d % block_size(d) == 0 and block_size(d) & (block_size(d) - 1) == 0


def test_hadamard_of_two_is_the_butterfly_and_signs_are_seeded():
    assert torch.allclose(hadamard(2), torch.tensor([[1.0, 1.0], [1.0, -1.0]]) / 2**0.5)
    assert torch.equal(random_signs(64, 0), random_signs(64, 0))
    assert not torch.equal(random_signs(64, 0), random_signs(64, 1))
    assert set(random_signs(64, 0).tolist()) == {-1.0, 1.0}


def test_a_rotation_spreads_an_outlier_channel_over_every_channel():
    x = torch.randn(1, 100, 64) * 0.1
    x[..., 5] = 20.0  # one huge channel, as keys have
    y = rotate(x, random_signs(64, 0))
    assert x.abs().amax(-1).mean() / x.norm(dim=-1).mean() > 0.99  # before: one channel holds the norm
    assert y.abs().amax(-1).mean() / y.norm(dim=-1).mean() < 0.2  # after: about 1/sqrt(64) each


def test_hadamard_without_a_quantizer_attends_exactly_as_the_full_cache(llama):
    """Rotated tokens read back through the inverse rotation: the logits are the full cache's
    (float32 model: up to rounding, 1e-5)."""
    ids, follow = prompt(60), prompt(8, seed=1)
    full = step_logits(llama, KVCache(llama, "full", 1.0), ids, follow)
    cache = KVCache(llama, "hadamard(residual=0)", 1.0)
    rotated = step_logits(llama, cache, ids, follow)
    assert any(layer.is_coded for layer in cache.layers)
    assert (rotated - full).abs().max() < 1e-5
    signs = 16 * 4  # the table: one float32 sign per channel, one tensor for every layer and head
    assert cache.nbytes() == cache.full_nbytes() + signs


def test_a_rotation_helps_a_two_bit_quantizer_on_keys_with_outlier_channels():
    """Per-token 2-bit codes of keys with a large channel: after the rotation the error is smaller."""
    from kvstack.cache.encoded import Uniform

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, 64, generator=g)
    x[..., 3] *= 30
    codec = Uniform(2, "token", 64)
    plain = (codec.decode(codec.encode(x, HERE)) - x).pow(2).sum()
    signs = random_signs(64, 0)
    turned = (unrotate(codec.decode(codec.encode(rotate(x, signs), HERE)), signs) - x).pow(2).sum()
    assert turned < 0.5 * plain


# ---- Lloyd-Max levels -------------------------------------------------------------------------
def test_lloyd_max_levels_of_a_gaussian_are_max_1960s():
    """The optimal 1- and 2-bit quantizers of N(0, 1): +-sqrt(2/pi); +-0.4528, +-1.5104 (Max, 1960)."""
    x = torch.linspace(-8, 8, 64_000, dtype=torch.float64)
    density = torch.exp(-x * x / 2)
    one, two = lloyd_max(x, density, 2), lloyd_max(x, density, 4)
    assert torch.allclose(one, torch.tensor([-1.0, 1.0], dtype=torch.float64) * math.sqrt(2 / math.pi), atol=1e-3)
    assert torch.allclose(two, torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104], dtype=torch.float64), atol=2e-3)


def test_sphere_levels_by_hand():
    """d = 3: a coordinate of a random unit vector is uniform on [-1, 1] (Archimedes), so its
    levels are the cells' midpoints; large d: the law tends to N(0, 1/d), levels to Max's / sqrt(d)."""
    assert torch.allclose(sphere_levels(3, 1), torch.tensor([-0.5, 0.5]), atol=1e-3)
    assert torch.allclose(sphere_levels(3, 2), torch.tensor([-0.75, -0.25, 0.25, 0.75]), atol=1e-3)
    big = sphere_levels(4096, 2) * 4096**0.5
    assert torch.allclose(big, torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_the_nearest_level_by_comparisons_is_bucketize(bits):
    from kvstack.methods.quantize.turboquant import nearest_level

    y = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(bits)) / 8
    levels = sphere_levels(64, bits)
    expected = torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)
    assert torch.equal(nearest_level(y, levels), expected)
    assert torch.equal(nearest_level(levels, levels), torch.arange(2**bits))  # each level is its own nearest


@pytest.mark.parametrize("bits, paper", [(1, 0.36), (2, 0.117), (3, 0.03), (4, 0.009)])
def test_turboquant_error_is_the_papers(bits, paper):
    """TurboQuant_mse's distortion E|x - x'|^2 for unit x (the paper's Theorem 1 values at b = 1-4)."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4, 512, 128, generator=g)
    x = x / x.norm(dim=-1, keepdim=True)
    codec = TurboCodec(bits)
    error = (codec.decode(codec.encode(x, HERE)) - x).pow(2).sum(-1).mean()
    assert abs(float(error) - paper) < 0.15 * paper


def test_turboquant_keeps_the_norm_and_no_scale_per_group():
    codec = TurboCodec(3)
    x = torch.randn(2, 10, 64) * torch.linspace(0.1, 50, 10).view(1, 10, 1)  # tokens of any size
    enc = codec.encode(x, HERE)
    assert set(enc.tokens) == {"codes", "norm"} and not enc.groups
    assert torch.allclose(enc.tokens["norm"].float().squeeze(-1), x.norm(dim=-1), rtol=1e-3)
    assert codec.token_bytes(64) == 64 * 3 / 8 + 2
    assert codec.decode(enc).shape == x.shape


def test_values_may_take_their_own_bits():
    """`turboquant(bits=4, v=2)`: keys on 16 levels, values on 4 (K4V2, 3 bits a channel on
    average); a width it cannot pack is refused in one line."""
    keys, values = method_class("turboquant")(bits=4, v=2).codecs()
    assert (keys.bits, values.bits) == (4, 2) and keys.token_bytes(64) + values.token_bytes(64) == 32 + 16 + 4
    with pytest.raises(UserError, match="use one of"):
        method_class("turboquant")(v=5)


def test_centring_takes_a_shared_offset_out_of_the_codes():
    """Keys sharing a large offset (as real heads' keys do): with `center`, each run of tokens is
    coded less its mean (float16, counted per run), so the error falls to that of the spread."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, 32, generator=g) + 8 * torch.randn(32, generator=g)
    plain, centred = TurboCodec(3), TurboCodec(3, center=16)
    errors = [float((c.decode(c.encode(x, HERE)) - x).pow(2).mean()) for c in (plain, centred)]
    assert errors[1] < 0.2 * errors[0]
    enc = centred.encode(x, HERE)
    assert enc.groups["mean"].shape == (1, 4, 32) and enc.groups["mean"].dtype == torch.float16
    assert torch.allclose(enc.groups["mean"][0, 1].float(), x[0, 16:32].mean(0), atol=0.01)
    assert centred.token_bytes(32) == plain.token_bytes(32) + 32 * 2 / (0.75 * 16)
    survivors = [i for i in range(64) if i not in (3, 20, 21, 50)]
    kept = enc.take(torch.tensor([survivors]))  # evictions keep each token's run mean: no new rounding
    assert "count" in kept.groups and torch.equal(kept.decode(), centred.decode(enc)[:, survivors])


# ---- QJL ----------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 16, 32]))
def test_qjl_inner_products_are_unbiased(seed, d):
    """E_S[q . qjl(r)] = q . r: averaged over many Gaussian S the estimate meets the true inner
    product within 5 standard errors (the variance per draw is at most pi/2 / d |q|^2 |r|^2)."""
    g = torch.Generator().manual_seed(seed)
    r, q = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    draws = 4000
    s = torch.randn(draws, d, d, generator=g, dtype=torch.float64)
    signs = torch.where(s @ r >= 0, 1.0, -1.0).to(torch.float64)  # (draws, d)
    estimates = torch.stack([q @ qjl_estimate(signs[i], r.norm(), s[i]) for i in range(draws)])
    bound = math.sqrt(math.pi / 2 / d) * q.norm() * r.norm() / math.sqrt(draws)
    assert abs(float(estimates.mean() - q @ r)) < 5 * float(bound)


def test_qjl_keys_cost_one_bit_more_per_channel_and_undo_the_mse_codes_shrinkage():
    """MSE-optimal codes shrink inner products (slope 2/pi at one bit, the paper); QJL on the
    residual makes them unbiased: the estimates' slope against the exact products is 1."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2048, 64, generator=g)
    queries = torch.randn(64, 64, generator=g)
    exact = queries @ keys[0].T

    def slope(codec: TurboCodec) -> float:
        estimate = queries @ codec.decode(codec.encode(keys, HERE))[0].T
        return float((estimate * exact).sum() / (exact * exact).sum())

    mse, prod = TurboCodec(2), TurboCodec(3, qjl=True)
    assert prod.token_bytes(64) == mse.token_bytes(64) + 64 / 8 + 2  # 1-bit signs and the residual's norm
    assert abs(slope(TurboCodec(1)) - 2 / math.pi) < 0.02
    assert slope(mse) < 0.92
    assert abs(slope(prod) - 1) < 0.01


# ---- in the cache -------------------------------------------------------------------------------
def test_heads_coded_by_turboquant_decode_as_one_batch_on_the_rotated_basis():
    codec = TurboCodec(2)
    parts = [codec.encode(torch.randn(2, 40, 16), Where(0, h, "key")) for h in range(3)]
    assert alike(parts[0], parts[1])
    batched = decode_heads(parts, torch.float32)  # y (b, h, n, d) and the basis R
    assert isinstance(batched, Turned) and torch.allclose(batched.basis @ batched.basis.T, torch.eye(16), atol=1e-6)
    for h, part in enumerate(parts):
        assert torch.allclose(batched.y[:, h] @ batched.basis.T, part.decode(torch.float32), atol=1e-5)


@pytest.mark.parametrize("codec", [TurboCodec(3), TurboCodec(3, qjl=True)])
def test_attention_over_the_rotated_basis_equals_attention_over_decoded_tokens(codec):
    """few_queries turns the query (q R) and the output ((p y) R^T) for a `Turned` part: the same
    attention as over the decoded tokens, beside a part held in the model's dtype."""
    from kvstack.cache.attention import few_queries

    g = torch.Generator().manual_seed(0)
    b, h, group, d = 2, 3, 2, 16
    query = torch.randn(b, h * group, 1, d, generator=g)
    coded = [codec.encode(torch.randn(b, 30, d, generator=g), Where(0, i, "key")) for i in range(h)]
    recent = torch.randn(b, h, 5, d, generator=g)
    turned = decode_heads(coded, torch.float32)
    plain = turned.y @ turned.basis.T
    out_turned = few_queries(query, [turned, recent], [turned, recent], None, None, 0.25)
    out_plain = few_queries(query, [plain, recent], [plain, recent], None, None, 0.25)
    assert torch.allclose(out_turned, out_plain, atol=1e-5)


@pytest.mark.parametrize(
    "low, high",
    [
        ("turboquant(bits=2, residual=0)", "turboquant(bits=8, residual=0)"),
        ("turboquant(bits=2, qjl=True, residual=0)", "turboquant(bits=4, qjl=True, residual=0)"),
        ("hadamard+kivi(bits=2, group=8, residual=0)", "hadamard+kivi(bits=8, group=8, residual=0)"),
    ],
)
def test_more_bits_fewer_errors_against_the_full_cache(llama, low, high):
    ids, follow = prompt(60), prompt(8, seed=1)
    full = step_logits(llama, KVCache(llama, "full", 1.0), ids, follow)
    errors = [(step_logits(llama, KVCache(llama, spec, 1.0), ids, follow) - full).abs().max() for spec in (low, high)]
    assert errors[1] < errors[0]
    if "bits=8" in high:
        assert errors[1] < 0.01


def test_a_batch_of_two_decodes_as_each_row_alone(llama):
    spec = "snapkv(window_size=4)+hadamard+turboquant(bits=3, residual=8)"
    rows = [prompt(70, seed=4), prompt(70, seed=5)]
    together = KVCache(llama, spec, 0.5)
    runner = Runner(llama, together)
    out = runner.forward(torch.tensor(rows), torch.ones(2, 70, dtype=torch.long))
    for i, row in enumerate(rows):
        alone = Runner(llama, KVCache(llama, spec, 0.5))
        first = alone.forward(torch.tensor([row]), torch.ones(1, 70, dtype=torch.long))
        assert torch.allclose(out[i], first[0], atol=1e-4)


@pytest.mark.parametrize(
    "spec, fix",
    [
        ("turboquant(bits=5)", "use one of"),
        ("turboquant(bits=1, qjl=True)", "bits=2 or more"),
        ("turboquant(bits=8, qjl=True)", "use one of"),
        ("hadamard+pca(r=4)+kivi", "two projections"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(spec, fix):
    with pytest.raises((UserError, ValueError)) as err:
        Stack.parse(spec)
    assert fix in str(err.value) and "\n" not in str(err.value)


# ---- KVQuant ------------------------------------------------------------------------------------
def nuq_codecs(bits: int, outliers: float, d: int = 16, bound: float = 2.0):
    """Key and value codecs on a hand-made table: every channel's range [-bound, bound], uniform levels."""
    from kvstack.methods.lowrank.rotatek import AsIs
    from kvstack.methods.quantize.kvquant import NuqCodec

    table = torch.zeros(4, max(d, 2**bits))
    table[0, :d], table[1, :d] = -bound, bound
    table[2, : 2**bits] = table[3, : 2**bits] = torch.linspace(-1, 1, 2**bits)
    tables = [[table.half()] * 2]
    exact = AsIs(torch.float32)
    return tuple(NuqCodec(bits, outliers, tables, kind, exact, sinks=0) for kind in ("key", "value"))


def test_kvquant_keys_are_coded_before_rope_and_rotated_back():
    """A key read back at its position: 8-bit codes of the pre-RoPE key, RoPE applied again; the
    same key at another position codes the same pre-RoPE entries."""
    from kvstack.methods.lowrank.shadowkv import redo_rope

    keys, _ = nuq_codecs(8, 0.0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    pre = (torch.randn(1, 6, 16) * 0.5).clamp(-2, 2)
    codes = []
    for positions in (torch.arange(6).unsqueeze(0), torch.arange(100, 106).unsqueeze(0)):
        post = redo_rope(pre, positions, inv_freq)
        enc = keys.encode(post, Where(0, 0, "key", positions=lambda p=positions: p, inv_freq=inv_freq))
        assert torch.equal(enc.tokens["pos"], positions.to(torch.int32))
        assert (enc.decode(torch.float32) - post).abs().max() < 4 / 255  # a step of 8-bit levels on [-2, 2]
        codes.append(enc.tokens["codes"])
    assert torch.equal(codes[0], codes[1])


def test_kvquant_outliers_come_back_exactly():
    _, values = nuq_codecs(2, 0.125)  # 2 of 16 entries per token
    x = torch.randn(2, 9, 16) * 0.1
    x[:, :, 3], x[:, :, 11] = 40.0, -25.0
    enc = values.encode(x, Where(0, 1, "value"))
    out = enc.decode(torch.float32)
    assert torch.equal(out[..., 3], x[..., 3]) and torch.equal(out[..., 11], x[..., 11])
    assert (out - x).abs().max() < 0.2  # the range fits the rest, not the outliers
    assert values.token_bytes(16) == 16 * 2 / 8 + 2 * 3 + 4  # codes, 2 x (channel, float16), midpoint and half


def test_kvquant_levels_sit_where_the_entries_are():
    """Levels fitted on entries piled near 0 are denser there than uniform levels; on uniform
    entries they are the uniform quantizer's midpoints."""
    from kvstack.methods.quantize.kvquant import fit_levels

    g = torch.Generator().manual_seed(0)
    uniform = fit_levels(torch.rand(200_000, generator=g) * 2 - 1, 4)
    assert torch.allclose(uniform, torch.tensor([-0.75, -0.25, 0.25, 0.75]), atol=0.01)
    peaked = fit_levels((torch.randn(200_000, generator=g) * 0.2).clamp(-1, 1), 4)
    assert peaked[2] - peaked[1] < 0.5 * (uniform[2] - uniform[1])


def test_kvquant_is_fitted_once_and_counted_with_its_sink_exact(llama):
    """The first token of each sequence is held as it is (float32 here), the rest coded; the bytes
    are the tensors': per coded token its codes, outlier and position or range, per head a table
    and the tokens' slots."""
    cache = KVCache(llama, "kvquant(tokens=64, residual=0)", 1.0)
    ids = torch.tensor([prompt(40)])
    Runner(llama, cache).forward(ids, torch.ones(1, 40, dtype=torch.long))
    keys, values = cache.policy.shares.codecs
    coded = (keys.token_bytes(16) + values.token_bytes(16)) * 39 * 2 * len(cache.layers)
    sinks = 2 * 16 * 4 * 2 * len(cache.layers)  # key and value of one token per head, float32
    tables = 4 * 16 * 2 * 2 * len(cache.layers)  # a (4, 16) float16 table per layer and head
    slots = 40 * 4 * 2 * len(cache.layers)  # two parts per head: each token's slot (int32) is explicit
    assert cache.nbytes() == coded + sinks + tables + slots
    full = KVCache(llama, "full", 1.0)
    Runner(llama, full).forward(ids, torch.ones(1, 40, dtype=torch.long))
    for layer, reference in zip(cache.layers, full.layers, strict=True):
        first = layer.coded[0][0]
        assert first.n == 1 and torch.equal(first.keys.decode(), reference.keys[0][:, :1])
    assert keys.fixed_bytes(16) == 4 * 16 * 2 + 16 * 4 and values.fixed_bytes(16) == 16 * 4
