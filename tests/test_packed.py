"""Attention read off packed codes (`Packed`, kernels/packed.c): the kernel against its definition
(a hand-computed case, then `Packed.decode` in torch over random shapes), the model's logits with
the kernel against those without it, and the build falling back to torch when it cannot compile."""

import logging
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import coded_heads, decoded_logits
from kvstack.cache import attention, kernels
from kvstack.cache.encoded import Uniform
from kvstack.cache.packed import Packed, attend_head, packed
from kvstack.cache.packing import pack, packed_size
from tiny import tiny_llama

needs_kernel = pytest.mark.skipif(
    kernels.library("packed") is None and shutil.which("cc") is None, reason="no C compiler on this machine"
)


@needs_kernel
def test_the_kernel_builds_where_there_is_a_compiler():
    assert kernels.library("packed") is not None


@needs_kernel
def test_two_bit_keys_and_values_by_hand():
    """One head of 64 channels; the first 4 coded [0 1 2 3] and [3 2 1 0] in two tokens sharing one
    scale row per channel, the other 60 coded 3 with scale and zero 0 (they hold zeros)."""
    rest = [3] * 60
    codes = pack(torch.tensor([[[0, 1, 2, 3, *rest], [3, 2, 1, 0, *rest]]]), 2)  # (1, 2, 16): bytes 228 and 27 first
    scale = torch.tensor([[[0.5, 1.0, 2.0, 4.0, *[0.0] * 60]]], dtype=torch.float16)
    zero = torch.tensor([[[-1.0, 0.0, 1.0, 0.0, *[0.0] * 60]]], dtype=torch.float16)
    part = Packed(codes, scale, zero, None, bits=2, tg=2, dg=1, dim=64, b=1, h=1)
    # tokens: [-1, 1, 5, 12, 0...] and [0.5, 2, 3, 0, 0...]
    query = torch.cat([torch.ones(1, 1, 4), torch.full((1, 1, 60), 7.0)], dim=-1)
    assert torch.equal(part.logits(query), torch.tensor([[[17.0, 5.5]]]))
    mixed = part.mix(torch.tensor([[[0.25, 0.75]]]))
    assert torch.equal(mixed[..., :4], torch.tensor([[[0.125, 1.75, 3.5, 3.0]]]))
    assert torch.equal(mixed[..., 4:], torch.zeros(1, 1, 60))


def encoded_heads(b, h, n, d, bits, axis, group, keep, seed):
    """h heads' parts of n random tokens each, coded by `Uniform`, thinned to `keep` tokens when given."""
    return coded_heads(Uniform(bits, axis, group), b, h, n, d, keep, seed)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    n=st.integers(1, 70),
    d=st.sampled_from([32, 64, 128]),
    bits=st.sampled_from([1, 2, 4, 8]),
    axis=st.sampled_from(["token", "channel"]),
    group=st.sampled_from([4, 8, 32]),
    queries=st.integers(1, 6),
    thin=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_the_kernel_reads_what_the_codes_stand_for(b, h, n, d, bits, axis, group, queries, thin, seed):
    keep = max(1, n // 2) if thin and n > 1 else 0
    parts = encoded_heads(b, h, n, d, bits, axis, group, keep, seed)
    part = packed(parts)
    per = 8 // bits  # the kernel's shapes: a token's bytes in 16s, a channel group in whole bytes
    if packed_size(d, bits) % 16 or axis == "token" and group % per:
        assert part is None  # decoded by torch instead
        return
    assert part is not None
    x = part.decode()  # (b, h, n', d)
    for head, enc in enumerate(parts):  # the reference agrees with the codec's own decoding
        assert torch.equal(x[:, head].to(torch.bfloat16), enc.decode())
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(b * h, queries, d, generator=g)
    tokens = x.reshape(b * h, -1, d)
    spread = tokens.abs().amax() * d
    logits = part.logits(query)
    torch.testing.assert_close(logits, query @ tokens.transpose(1, 2), rtol=1e-5, atol=1e-5 * float(spread))
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(part.mix(probs), probs @ tokens, rtol=1e-5, atol=1e-5 * float(tokens.abs().amax()))


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    n=st.integers(1, 70),
    m=st.integers(0, 12),
    d=st.sampled_from([64, 128]),
    key_bits=st.sampled_from([2, 4, 8]),
    value_bits=st.sampled_from([2, 4, 8]),
    key_axis=st.sampled_from(["token", "channel"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    queries=st.integers(1, 6),
    thin=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_one_call_attends_a_heads_codes_and_newest_tokens(
    b, n, m, d, key_bits, value_bits, key_axis, dtype, queries, thin, seed
):
    """`attend_head` (packed_attend: logits, softmax and mix in one call) equals softmax attention
    over the tokens the codes stand for followed by the plain ones, read where they lie (a head's
    slice of a layer's stacked tensor: strided rows)."""
    keep = max(1, n // 2) if thin and n > 1 else 0
    (kenc,) = encoded_heads(b, 1, n, d, key_bits, key_axis, 32, keep, seed)
    (venc,) = encoded_heads(b, 1, n, d, value_bits, "token", 32, keep, seed + 7)
    keys, values = packed([kenc], one_head=True), packed([venc], one_head=True)
    assert keys is not None and values is not None
    g = torch.Generator().manual_seed(seed + 1)
    stacked = (torch.randn(b, 3, m, d, generator=g) * 2).to(dtype)  # plain keys of 3 heads, this head's in the middle
    plain_keys, plain_values = stacked[:, 1], (torch.randn(b, m, d, generator=g)).to(dtype)
    query = torch.randn(b, 3, queries, d, generator=g)  # 3 query heads share the KV head
    scale = d**-0.5
    out = attend_head(query, [keys, plain_keys], [values, plain_values], scale)
    assert out is not None and out.shape == (b, 3, queries, d)
    k = torch.cat([keys.decode(), plain_keys.float()], dim=1)  # (b, n + m, d)
    v = torch.cat([values.decode(), plain_values.float()], dim=1)
    probs = torch.softmax((query @ k.unsqueeze(1).transpose(-1, -2)) * scale, dim=-1)
    torch.testing.assert_close(out, probs @ v.unsqueeze(1), rtol=1e-4, atol=1e-4 * float(v.abs().amax()))


def test_one_call_declines_what_it_does_not_read():
    """Parts other than one coded part then plain tokens go to `few_queries` (None)."""
    plain = torch.randn(1, 4, 64)
    assert attend_head(torch.randn(1, 2, 1, 64), [plain], [plain], 0.125) is None
    if kernels.library("packed") is not None:
        (enc,) = encoded_heads(1, 1, 8, 64, 4, "channel", 4, 0, 0)
        part = packed([enc], one_head=True)
        assert attend_head(torch.randn(1, 2, 1, 64), [part, plain], [plain, plain], 0.125) is None
        assert attend_head(torch.randn(1, 2, 1, 64), [part, plain.long()], [part, plain.long()], 0.125) is None


@needs_kernel
def test_one_heads_part_is_read_in_place_and_kept_for_the_next_step():
    """The kernel reads a head's own codes, float16 scales and group counts (no copy is made, so
    no byte is held beyond what the cache counts), and the next step reuses the part as it is."""
    (enc,) = encoded_heads(1, 1, 64, 64, 2, "channel", 32, 60, 0)  # thinned: groups count what they hold
    part = packed([enc], one_head=True)
    assert part is not None and part.counts is not None and part.scale.dtype == torch.float16
    own = (enc.tokens["codes"], enc.groups["scale"], enc.groups["zero"], enc.groups["count"])
    assert [x.data_ptr() for x in (part.codes, part.scale, part.zero, part.counts)] == [x.data_ptr() for x in own]
    assert packed([enc], one_head=True) is part and packed([enc]).shape == (1, 1, 60, 64)
    assert packed([enc.take(torch.arange(50)[None])], one_head=True) is not part  # another part, read anew


@needs_kernel
@pytest.mark.parametrize(
    "spec, budget",
    [
        ("kivi(bits=2, group=8, residual=8)", 1.0),
        ("kivi(bits=4, group=8, residual=8)", 1.0),
        ("int(bits=4, group=8)", 1.0),
        ("keydiff+adaquant(group=8, residual=8)", 0.5),  # eviction thins key groups: their counts walked
    ],
)
def test_the_model_decodes_the_same_with_and_without_the_kernel(wide, spec, budget, monkeypatch):
    with_kernel, used = decoded_logits(wide, spec, budget, True, monkeypatch)
    without, unused = decoded_logits(wide, spec, budget, False, monkeypatch)
    assert used and not unused  # the kernel read some layer's codes, and only when allowed
    torch.testing.assert_close(with_kernel, without, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_heads_of_their_own_lengths_decode_in_one_call_each(monkeypatch):
    """No mask while decoding (no padding, no sliding window) and heads of different lengths
    (adakv): each head attends in one `attend_head` call, and the logits match torch's reading
    of the same caches."""
    model = tiny_llama(head_dim=64)
    calls = []

    def spy(*args):
        out = attend_head(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention, "attend_head", spy)
    spec = "adakv(keydiff)+adaquant(group=8, residual=8)"
    with_kernel, _ = decoded_logits(model, spec, 0.3, True, monkeypatch, padded=False)
    assert sum(calls) >= 16
    without, _ = decoded_logits(model, spec, 0.3, False, monkeypatch, padded=False)
    torch.testing.assert_close(with_kernel, without, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_the_cache_decodes_through_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSTACK_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.library("packed") is None
        assert "using torch" in caplog.text
        assert packed(encoded_heads(1, 2, 16, 64, 2, "channel", 4, 0, 0)) is None
    finally:
        kernels._load.cache_clear()


def test_a_cache_folder_that_cannot_be_written_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("KVSTACK_CACHE", str(blocked))
    kernels._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.library("packed") is None
        assert "using torch" in caplog.text
    finally:
        kernels._load.cache_clear()
