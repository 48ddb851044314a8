"""Quantized storage: packing, codecs against their definitions, bytes, budgets, stacking, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import layer_with
from kvstack.cache.cache import KVCache
from kvstack.cache.encoded import Uniform, Where, gather_rows, minmax
from kvstack.cache.packing import BIT_WIDTHS, chunk_table, lookup, pack, packed_size, unpack, unpack_float
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.quantize.cq import CodebookCodec
from kvstack.methods.quantize.gear import GearCodec
from kvstack.methods.quantize.quantile import QuantileCodec
from kvstack.methods.quantize.squat import SquatCodec
from kvstack.methods.quantize.turboquant import TurboCodec
from kvstack.methods.registry import all_methods
from kvstack.stack import Stack

HERE = Where(0, 0, "key")
SNAP = "snapkv(window_size=4, every=4)"
# every quantizer at small groups (the tiny models' heads are 16 wide)
QUANTIZERS = {
    "kivi": "kivi(group=8, residual=16)",
    "int": "int(group=8)",
    "adaquant": "adaquant(group=8, residual=16)",
    "qaq": "qaq(residual=16)",
    "squat": "squat(group=8, block=4, residual=16, queries=8)",
    "gear": "gear(group=8, chunk=16, residual=16)",
    "cq": "cq(bits=2, channels=2, residual=16, tokens=128)",
    "quantile": "quantile(group=16, residual=16)",
    "hadamard": "hadamard+kivi(group=8, residual=16)",
    "turboquant": "turboquant(bits=3, qjl=True, center=8, residual=16)",
    "kvquant": "kvquant(tokens=64, residual=16)",
}
STACKED = {name: f"{SNAP}+{spec}" for name, spec in QUANTIZERS.items()} | {"mikv": f"mikv({SNAP}, group=8, residual=4)"}


def test_every_quantizer_is_covered():
    storers = {m for m, cls in all_methods().items() if "storer" in cls.declared_roles()}
    assert set(STACKED) == {m for m in storers if all_methods()[m].family != "lowrank"}


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


# ---- packing ----------------------------------------------------------------------------------
def test_three_bit_codes_are_a_little_endian_bit_stream_by_hand():
    # codes 1..7, 0 at bits 3i..3i+2: 1 + 2<<3 + 3<<6 + 4<<9 + 5<<12 + 6<<15 + 7<<18 = 2054353 = 0x1F58D1
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    assert pack(codes, 3).tolist() == [0xD1, 0x58, 0x1F]
    assert unpack(torch.tensor([0xD1, 0x58, 0x1F], dtype=torch.uint8), 3, 8).tolist() == codes.tolist()
    assert unpack(torch.tensor([0xD1, 0x58], dtype=torch.uint8), 3, 5).tolist() == [1, 2, 3, 4, 5]  # a row cut short


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BIT_WIDTHS), st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_a_table_lookup_of_packed_codes_reads_their_levels(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g)
    levels = torch.randn(2**bits, generator=g)
    out = lookup(pack(codes, bits), bits, n, chunk_table(levels, bits))
    assert out.shape == (rows, n) and torch.equal(out, levels[codes])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BIT_WIDTHS), st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trips_exactly(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, packed_size(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BIT_WIDTHS), st.integers(1, 3), st.integers(1, 140), st.integers(0, 5), st.integers(0, 2**31))
def test_unpack_float_reads_the_codes_whatever_the_row_width_and_offset(bits, rows, n, skip, seed):
    # rows whose bytes come in fours take the word-shift path, others the table; a slice that
    # starts off a word boundary must read the same codes
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows + 6, n), generator=g).to(torch.uint8)
    packed = pack(codes, bits).reshape(-1)[skip:]
    width = packed_size(n, bits)
    rows_left = packed.numel() // width
    packed = packed[: rows_left * width].reshape(rows_left, width)
    out = unpack_float(packed, bits, n)
    assert out.dtype == torch.float32 and torch.equal(out, unpack(packed, bits, n).float())
    out.add_(1)  # a fresh tensor: writing it leaves the codes alone
    assert torch.equal(unpack(packed, bits, n).float() + 1, out)


def test_packed_bytes_fall_with_bits():
    sizes = [packed_size(64, b) for b in sorted(BIT_WIDTHS, reverse=True)]
    assert sizes == [64, 32, 24, 16, 8]


# ---- codecs against their definitions ---------------------------------------------------------
def test_two_bit_codes_of_a_ramp_are_exact():
    # min 0, max 3, 2 bits: scale (3 - 0) / 3 = 1, zero 0, codes 0..3 reproduce the ramp exactly
    x = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])
    enc = Uniform(2, "token", 4).encode(x, HERE)
    assert enc.tokens["scale"].item() == 1.0 and enc.tokens["zero"].item() == 0.0
    assert torch.equal(unpack(enc.tokens["codes"], 2, 4), torch.tensor([[[0, 1, 2, 3]]], dtype=torch.uint8))
    assert torch.equal(enc.decode(), x)


def test_kivi_keys_share_a_scale_per_channel_over_a_token_group():
    # channel 0 spans [0, 3] over the 4 tokens, channel 1 spans [10, 40]: one (scale, zero) each
    x = torch.tensor([[[0.0, 10.0], [1.0, 20.0], [2.0, 30.0], [3.0, 40.0]]])
    enc = Uniform(2, "channel", 4).encode(x, HERE)
    assert enc.groups["scale"].tolist() == [[[1.0, 10.0]]] and enc.groups["zero"].tolist() == [[[0.0, 10.0]]]
    assert torch.equal(enc.decode(), x)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(BIT_WIDTHS), st.sampled_from(["token", "channel"]), st.integers(0, 2**31 - 1))
def test_uniform_error_is_within_half_a_step(bits, axis, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, 16, generator=g) * 3
    enc = Uniform(bits, axis, 8).encode(x, HERE)
    err = (enc.decode() - x).abs()
    if axis == "token":
        step = enc.tokens["scale"].float().repeat_interleave(8, dim=-1)
    else:
        step = enc.groups["scale"].float().repeat_interleave(8, dim=1)[:, :24]
    spread = x.abs().max()
    assert bool((err <= step / 2 + 2e-3 * spread).all())  # half a step, plus float16 metadata rounding


@pytest.mark.parametrize(
    "codec",
    [Uniform(2, "channel", 8), QuantileCodec(1, 8), GearCodec(2, "channel", 8, rank=2, outliers=0.1, chunk=8)],
    ids=["kivi-keys", "quantile", "gear"],
)
def test_evicting_from_a_group_keeps_the_other_tokens_bit_for_bit(codec):
    """A group that loses tokens keeps its metadata and counts what it holds: the survivors read
    back exactly as before (no rounding again), across batch rows that keep different tokens,
    and after joining a later part; a part thinned below 3/4 full is encoded again."""
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(3))
    enc = codec.encode(x, HERE)
    before = enc.decode()
    index = torch.tensor([[0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 22]] * 2)
    index[1, 3:] += 1  # the second row keeps another set, still sorted
    kept = enc.take(index)
    assert kept.groups["count"].tolist() == [[7, 6, 7], [6, 6, 8]] and kept.n == 20
    torch.testing.assert_close(kept.decode(), gather_rows(before, index), rtol=0, atol=0)
    for name in set(kept.groups) - {"count"}:  # each token reads its own group's row
        assert torch.equal(kept.per_token(name), gather_rows(kept.groups[name], kept.rows()))
    more = codec.encode(x[:, :8], HERE)
    joined = kept.cat(more)
    torch.testing.assert_close(joined.decode()[:, :20], kept.decode(), rtol=0, atol=0)
    torch.testing.assert_close(joined.decode()[:, 20:], more.decode(), rtol=0, atol=0)
    sparse = enc.take(torch.tensor([[0, 8, 16]] * 2))  # 3 tokens left in 3 groups of 8
    assert "count" not in sparse.groups and sparse.n == 3


def test_minmax_of_a_constant_group_is_exact():
    codes, scale, zero = minmax(torch.full((1, 1, 8), 2.5), 2, dim=-1)
    assert scale.item() == 0.0 and codes.sum() == 0 and zero.item() == 2.5


def test_quantile_levels_sit_at_the_quartiles():
    # one channel, 8 tokens 0..7: the 1-bit levels are the 0.25 and 0.75 quantiles, 1.75 and 5.25
    x = torch.arange(8.0).reshape(1, 8, 1)
    enc = QuantileCodec(1, 8).encode(x, HERE)
    assert enc.groups["levels"].flatten().tolist() == [1.75, 5.25]
    assert enc.decode().flatten().tolist() == [1.75] * 4 + [5.25] * 4


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_quantile_levels_match_torch_quantile(levels_log2, g, seed):
    from kvstack.methods.quantize.quantile import quantiles

    chunks = torch.randn(2, 3, g, 4, generator=torch.Generator().manual_seed(seed))
    n = 2**levels_log2
    q = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    expected = torch.quantile(chunks.transpose(2, 3), q, dim=-1).permute(1, 2, 3, 0)
    torch.testing.assert_close(quantiles(chunks, n), expected)


def test_gear_with_full_rank_recovers_what_quantization_lost():
    x = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(0))
    coarse = GearCodec(1, "token", 8, rank=0, outliers=0.0, chunk=16).encode(x, HERE).decode()
    full_rank = GearCodec(1, "token", 8, rank=8, outliers=0.0, chunk=16).encode(x, HERE).decode()
    assert (coarse - x).abs().max() > 0.3
    torch.testing.assert_close(full_rank, x, atol=5e-3, rtol=5e-3)  # the factors are float16


def test_gear_outliers_come_back_exactly():
    x = torch.zeros(1, 4, 8)
    x[0, :, 3] = 100.0  # one huge entry per token
    out = GearCodec(2, "token", 8, rank=0, outliers=0.125, chunk=4).encode(x, HERE).decode()
    assert torch.equal(out[0, :, 3], x[0, :, 3]) and out.abs()[..., :3].max() < 1e-3


def test_codebook_codes_pick_the_nearest_centroid():
    book = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [5.0, -5.0], [9.0, 9.0]]], dtype=torch.float16)  # (1 group, 4, 2)
    codec = CodebookCodec(1, 2, [[book]], "key")
    x = torch.tensor([[[0.9, 1.2], [4.0, -4.0], [0.1, -0.1]]])
    enc = codec.encode(x, HERE)
    assert unpack(enc.tokens["codes"], 2, 1).flatten().tolist() == [1, 2, 0]
    assert enc.decode().tolist() == [[[1.0, 1.0], [5.0, -5.0], [0.0, 0.0]]]


def test_squat_error_leaves_the_query_span_more_than_kivi():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 64, 16, generator=g)
    direction = torch.randn(16, generator=g)
    queries = (torch.randn(1, 1, 32, 1, generator=g) * direction).expand(1, 1, 32, 16)  # one query direction
    where = Where(0, 0, "key", lambda: queries)
    plain = SquatCodec(2, 16, 4, 4, lam=0.0).encode(keys, where).decode()
    kivi = Uniform(2, "channel", 16).encode(keys, HERE).decode()
    assert torch.equal(plain, kivi)  # lam = 0: no feedback, KIVI's codes
    squat = SquatCodec(2, 16, 4, 4, lam=100.0).encode(keys, where).decode()
    along = lambda out: ((out - keys) @ direction).abs().mean()  # noqa: E731
    assert along(squat) < 0.8 * along(kivi)


# ---- in the cache -------------------------------------------------------------------------------
def stored_tensors(cache):
    out = []
    for layer in cache.layers:
        out += [*layer.keys, *layer.values, *(layer.slots or [])]
        out += [t for parts in layer.coded for c in parts for t in c.tensors()]
    return out


def test_nbytes_is_the_sum_of_the_stored_tensors_and_falls_with_bits(llama):
    held = []
    for bits in (8, 4, 3, 2, 1):
        cache = KVCache(llama, f"kivi(bits={bits}, group=8, residual=8)", 1.0)
        Runner(llama, cache).forward(torch.tensor([prompt(96)]), torch.ones(1, 96, dtype=torch.long))
        tensors = stored_tensors(cache)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}  # each once
        assert cache.nbytes() == sum(storages.values())
        assert any(t.dtype == torch.uint8 for t in tensors)
        held.append(cache.nbytes())
    assert held == sorted(held, reverse=True) and len(set(held)) == 5
    assert held[-1] < 0.25 * cache.full_nbytes()


@pytest.mark.parametrize("method", list(QUANTIZERS))
def test_quantizer_alone_keeps_every_token_in_fewer_bytes(tiny, method):
    cache = KVCache(tiny, QUANTIZERS[method], 1.0)
    runner = Runner(tiny, cache)
    runner.forward(torch.tensor([prompt(80)]), torch.ones(1, 80, dtype=torch.long))
    for t in prompt(24, seed=1):
        logits = runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
    assert torch.isfinite(logits).all()
    assert any(layer.is_coded for layer in cache.layers)
    for layer in cache.layers:
        held = min(104, layer.sliding_window - 1) if layer.sliding_window else 104
        assert bool((layer.counts() == held).all())
    assert cache.nbytes() < cache.full_nbytes()


ISSUE_STACK = {"pyramid(knorm)+adaquant": "pyramid(knorm)+adaquant(k=4, v=2, group=8, residual=16)"}


@pytest.mark.parametrize("method", [*STACKED, *ISSUE_STACK])
def test_stacked_with_eviction_holds_the_byte_budget_while_decoding(llama, method):
    cache = KVCache(llama, (STACKED | ISSUE_STACK)[method], 0.25)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(200)]), torch.ones(1, 200, dtype=torch.long))
    assert cache.nbytes() <= 0.25 * cache.full_nbytes()
    for t in prompt(64, seed=2):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()
    assert any(layer.is_coded for layer in cache.layers)


def test_two_bits_keep_more_tokens_than_eviction_alone_at_the_same_bytes(llama):
    counts = {}
    for spec in (SNAP, f"{SNAP}+kivi(bits=2, group=8, residual=16)"):
        cache = KVCache(llama, spec, 0.125)
        Runner(llama, cache).forward(torch.tensor([prompt(400)]), torch.ones(1, 400, dtype=torch.long))
        counts[spec] = int(cache.layers[0].counts().sum())
        assert cache.nbytes() <= 0.125 * cache.full_nbytes()
    assert counts[f"{SNAP}+kivi(bits=2, group=8, residual=16)"] > 2.5 * counts[SNAP]


def test_mikv_demotes_instead_of_evicting(llama):
    cache = KVCache(llama, f"mikv({SNAP}, hi=8, lo=2, group=8, residual=4)", 0.25)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(200)]), torch.ones(1, 200, dtype=torch.long))
    for t in prompt(8, seed=4):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
    layer = cache.layers[0]
    assert layer.counts().tolist() == [[208, 208]]  # no token left behind
    low = [c for c in layer.coded[0] if c.demoted]
    high = [c for c in layer.coded[0] if not c.demoted]
    assert low and low[0].keys.codec.bits == 2 and all(c.keys.codec.bits == 8 for c in high)
    demoted = layer.dense_demoted()[0, 0]
    assert 0 < int(demoted.sum()) < 208
    assert cache.nbytes() <= 0.25 * cache.full_nbytes()


def test_mikv_keeps_the_scorers_choice_at_high_precision(llama):
    """The tokens kept at high precision are the ones the scorer alone would keep."""
    ids = torch.tensor([prompt(120)])
    plain = KVCache(llama, SNAP, 0.5)
    Runner(llama, plain).forward(ids, torch.ones(1, 120, dtype=torch.long))
    mixed = KVCache(llama, f"mikv({SNAP}, hi=8, lo=1, group=8, residual=0)", 1.0)
    mixed.budget = mixed.policy.budget = mixed.policy.shares.budget = plain.budget
    mixed.policy.shares.uniform = plain.policy.shares.uniform  # same token count at high precision as eviction keeps
    Runner(llama, mixed).forward(ids, torch.ones(1, 120, dtype=torch.long))
    kept = set(plain.layers[1].dense_slots()[0, 0].tolist())
    layer = mixed.layers[1]
    slots, demoted = layer.dense_slots()[0, 0], layer.dense_demoted()[0, 0]
    assert set(slots[~demoted].tolist()) == kept


# ---- stacks and bad input ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", ["snapkv+kivi(bits=2)", "pyramid(knorm)+adaquant(k=4, v=2)", "mikv(snapkv, hi=8, lo=2)"]
)
def test_the_issue_stacks_parse_and_print_back(spec):
    stack = Stack.parse(spec)
    assert Stack.parse(str(stack)) == stack and stack.quantizer is not None and stack.evictor is not None


@pytest.mark.parametrize(
    "spec, budget, fix",
    [
        ("kivi(bits=5)", 1.0, "use one of 1, 2, 3, 4, 8"),
        ("snapkv+kivi+int", 0.25, "keep one"),
        ("int(group=6)", 1.0, "int(group=4)"),
        ("kivi(group=32)", 1.0, "kivi(group=16)"),
        ("kivi(bits=2, group=8)", 0.0625, "add an eviction stage"),
        ("mikv(snapkv, lo=2, group=8)", 0.125, "lower lo or raise the budget"),
        ("razor(snapkv)+kivi(group=8)", 0.25, "compensate=False"),
        ("mikv(snapkv, hi=16, group=8)", 0.5, "use one of 1, 2, 3, 4, 8"),
        ("squat(block=0, group=8)", 1.0, "block >= 1"),
        ("cq(samples=0)", 1.0, "samples=0 is out of range: give an integer from 1"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(llama, spec, budget, fix):
    with pytest.raises(UserError) as err:
        KVCache(llama, spec, budget)
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_a_residual_window_or_codebooks_larger_than_a_fraction_budget_are_refused(llama):
    ids = torch.tensor([prompt(200)])
    # 0.0625 of 200 tokens pays for 12 at full precision: a 16-token window (+7 for a group) does not fit
    with pytest.raises(UserError, match=r"residual window .* use kivi\(residual=0\)"):
        Runner(llama, KVCache(llama, f"{SNAP}+kivi(group=8, residual=16)", 0.0625)).forward(ids, torch.ones_like(ids))
    # 256 centroids x 16 dims in float16, for keys and values: 16 KiB per head, above 0.125 of 200 tokens (3.2 KiB)
    with pytest.raises(UserError, match=r"tables take 16384 bytes per head"):
        Runner(llama, KVCache(llama, f"{SNAP}+cq(bits=2, channels=4, tokens=64)", 0.125)).forward(
            ids, torch.ones_like(ids)
        )
    # a prompt shorter than the window is simply held at full precision
    short = torch.tensor([prompt(12)])
    Runner(llama, KVCache(llama, f"{SNAP}+kivi(group=8, residual=16)", 0.0625)).forward(short, torch.ones_like(short))


def test_a_residual_window_larger_than_a_token_budget_is_refused():
    from kvstack.cache.budget import Budget

    with pytest.raises(UserError, match=r"kivi\(residual=64\)"):
        Stack.parse("snapkv+kivi").check_budget(Budget.parse("64t"))


@pytest.mark.parametrize(
    "spec, budget",
    [("qaq(residual=8, t_k=1, t_v=0.01)", 1.0), (f"mikv({SNAP}, hi=8, lo=4, group=8, residual=8)", 0.37)],
)
def test_tokens_held_at_several_precisions_keep_their_slots(llama, spec, budget):
    """Each held key, read back through the slot-sorted view, is close to the full cache's key at
    that slot: parts of different precisions never shuffle which token a slot names. (Keys of
    generated tokens match only in layer 0: deeper ones already saw a quantized cache.)"""
    ids, follow = prompt(160), prompt(40, seed=5)
    caches = [KVCache(llama, "full"), KVCache(llama, spec, budget)]
    for cache in caches:
        runner = Runner(llama, cache)
        runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        for t in follow:
            runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
    full, mixed = caches
    widths = set()
    for ref, layer in zip(full.layers, mixed.layers, strict=True):
        widths |= {(c.keys.codec.bits, c.demoted) for parts in layer.coded for c in parts}
        slots = layer.dense_slots()  # (1, h, t)
        assert bool((slots[..., 1:] > slots[..., :-1]).all())  # sorted, each slot once
        keys = layer.dense([layer.head_keys(h) for h in range(layer.n_kv_heads)])
        truth = torch.gather(torch.stack(ref.keys, 1), 2, slots.unsqueeze(-1).expand_as(keys))
        # per-token codes of 2 bits or more miss by at most a sixth of the token's range (+ an outlier kept exact)
        spread = truth.amax(-1, keepdim=True) - truth.amin(-1, keepdim=True)
        same_input = (slots < len(ids)) | (layer.layer_idx == 0)
        assert bool((((keys - truth).abs() <= spread / 5 + 1e-3) | ~same_input.unsqueeze(-1)).all())
    assert len(widths) > 1  # the case this test is about: several precisions at once


def test_a_padded_batch_under_mikv_holds_its_budget_and_carries_no_empty_places(llama):
    """Rows of a batch demote different counts; the demoted part keeps no column that is empty in
    every row, and the bytes stay within budget at every step."""
    short, long = prompt(150), prompt(220, seed=7)
    ids = torch.tensor([[0] * 70 + short, long])
    mask = torch.tensor([[0] * 70 + [1] * 150, [1] * 220])
    cache = KVCache(llama, f"mikv({SNAP}, hi=8, lo=2, group=8, residual=4)", 0.3)
    runner = Runner(llama, cache)
    runner.forward(ids, mask)
    for t in prompt(24, seed=8):
        runner.forward(torch.tensor([[t], [t]]), torch.ones(2, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.3 * cache.full_nbytes()
    for layer in cache.layers:
        for h in range(layer.n_kv_heads):
            slots, at = layer.slots[h], 0
            for part in layer.coded[h]:
                if part.demoted:
                    assert bool((slots[:, at : at + part.n] >= 0).any(0).all())
                at += part.n


@pytest.mark.parametrize("codec", ["kivi", "turbo", "squat"])
def test_heads_encoded_in_one_call_hold_what_each_head_encoded_alone_holds(codec):
    """`encode_heads` lays the heads' rows along the batch for codecs that code rows on their own
    (KIVI's groups, TurboQuant's tokens): the same codes, scales and storage as head by head.
    SQuat's codes read each head's queries: it goes head by head, and says so."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 70, 16, generator=g), torch.randn(2, 3, 70, 16, generator=g)
    queries = torch.randn(2, 3, 4, 16, generator=g)
    pair = {
        "kivi": (Uniform(4, "channel", 32), Uniform(2, "token", 16)),
        "turbo": (TurboCodec(3), TurboCodec(2)),
        "squat": (SquatCodec(2, 32, 8, 4, 1.0), Uniform(2, "token", 16)),
    }[codec]
    assert all(c.rows_alike for c in pair) == (codec != "squat")
    together, alone = layer_with(keys, values, queries=queries), layer_with(keys, values, queries=queries)
    together.encode_heads([(0, 64, pair), (1, 64, pair), (2, 32, pair)], Quantizer(), together.queries)
    for h, count in ((0, 64), (1, 64), (2, 32)):
        alone.encode_oldest(h, count, Quantizer(), pair, alone.queries[:, h : h + 1])
    for h in range(3):
        assert torch.equal(together.keys[h], alone.keys[h]) and torch.equal(together.values[h], alone.values[h])
        (a,), (b,) = together.coded[h], alone.coded[h]
        assert a.n == b.n and a.keys.where.head == b.keys.where.head == h
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            for name in x.tokens:
                assert torch.equal(x.tokens[name], y.tokens[name]), name
            for name in x.groups:
                assert torch.equal(x.groups[name], y.groups[name]), name
        assert torch.equal(together.head_keys(h), alone.head_keys(h))
    assert together.nbytes() == alone.nbytes()
