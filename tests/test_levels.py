"""Attention read off codes of a table of levels (`LevelCodes`, kernels/levels.c: TurboQuant's
tokens): the kernel against its definition (a hand-computed case, then the codec's own decoding
over random shapes and every width), the model's logits with the kernel against those without it,
and the parts it declines."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import coded_heads, decoded_logits
from kvstack.cache import kernels
from kvstack.cache.encoded import Where
from kvstack.cache.levels import LevelCodes
from kvstack.cache.packed import packed
from kvstack.cache.packing import chunk_table, pack
from kvstack.methods.quantize.turboquant import TurboCodec

needs_kernel = pytest.mark.skipif(
    kernels.library("levels") is None and shutil.which("cc") is None, reason="no C compiler on this machine"
)


@needs_kernel
@pytest.mark.parametrize("bits", [2, 3])
def test_levels_by_hand(bits):
    """One head of 16 channels on the identity basis, levels [-3, -1, 1, 3] (their first four at 3
    bits): token 0 codes 0 1 2 3 then 3s, norm 2; token 1 codes 3 2 1 0 then 0s, norm 0.5."""
    levels = torch.tensor([-3.0, -1.0, 1.0, 3.0, 5.0, 7.0, 9.0, 11.0][: 2**bits])
    codes = torch.tensor([[[0, 1, 2, 3, *[3] * 12], [3, 2, 1, 0, *[0] * 12]]])
    norm = torch.tensor([[2.0, 0.5]], dtype=torch.float16)
    part = LevelCodes(pack(codes, bits), norm, bits, chunk_table(levels, bits), torch.eye(16), dim=16, b=1, h=1)
    # tokens: 2 * [-3, -1, 1, 3, 3...] and 0.5 * [3, 1, -1, -3, -3...]
    query = torch.cat([torch.ones(1, 1, 4), torch.full((1, 1, 12), 0.5)], dim=-1)
    assert torch.equal(part.logits(query), torch.tensor([[[36.0, -9.0]]]))  # 2 * (0 + 18), 0.5 * (0 - 18)
    mixed = part.mix(
        torch.tensor([[[0.25, 0.5]]])
    )  # [-1.5, -0.5, 0.5, 1.5, 1.5...] + [0.75, 0.25, -0.25, -0.75, -0.75...]
    assert torch.equal(mixed[..., :4], torch.tensor([[[-0.75, -0.25, 0.25, 0.75]]]))
    assert torch.equal(mixed[..., 4:], torch.full((1, 1, 12), 0.75))


def encoded_heads(b, h, n, d, bits, keep, seed):
    """h heads' parts of n random tokens each, coded by `TurboCodec`, thinned to `keep` tokens when given."""
    return coded_heads(TurboCodec(bits), b, h, n, d, keep, seed)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    n=st.integers(1, 70),
    d=st.sampled_from([16, 32, 64, 128]),
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    queries=st.integers(1, 6),
    thin=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_the_kernel_reads_what_the_codes_stand_for(b, h, n, d, bits, queries, thin, seed):
    keep = max(1, n // 2) if thin and n > 1 else 0
    parts = encoded_heads(b, h, n, d, bits, keep, seed)
    part = packed(parts)
    assert isinstance(part, LevelCodes)
    x = part.decode()  # (b, h, n', d)
    for head, enc in enumerate(parts):  # the reference agrees with the codec's own decoding
        torch.testing.assert_close(x[:, head], enc.codec.decode_as(enc, torch.float32), rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(b * h, queries, d, generator=g)
    tokens = x.reshape(b * h, -1, d)
    spread = float(tokens.abs().amax()) * d
    logits = part.logits(query)
    torch.testing.assert_close(logits, query @ tokens.transpose(1, 2), rtol=1e-4, atol=1e-5 * spread)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(part.mix(probs), probs @ tokens, rtol=1e-4, atol=1e-5 * float(tokens.abs().amax()))


@needs_kernel
def test_one_heads_part_is_read_in_place_and_kept_for_the_next_step():
    (enc,) = encoded_heads(1, 1, 64, 64, 3, 40, 0)
    part = packed([enc], one_head=True)
    assert isinstance(part, LevelCodes) and part.norm.dtype == torch.float16
    assert part.codes.data_ptr() == enc.tokens["codes"].data_ptr()
    assert part.norm.data_ptr() == enc.tokens["norm"].data_ptr()
    assert packed([enc], one_head=True) is part and packed([enc]).shape == (1, 1, 40, 64)


def test_parts_it_does_not_read_are_decoded():
    """QJL's residual estimate and a run's mean are not levels; heads narrower than 16 lanes are
    not read by the kernel: None, and attention decodes them."""
    x = torch.randn(1, 8, 64)
    for codec in (TurboCodec(3, qjl=True), TurboCodec(3, center=4)):
        assert packed([codec.encode(x, Where(0, 0, "key"))]) is None
    assert packed([TurboCodec(3).encode(torch.randn(1, 8, 8), Where(0, 0, "key"))]) is None


@needs_kernel
@pytest.mark.parametrize(
    "spec, budget",
    [
        ("turboquant(residual=16)", 1.0),
        ("turboquant(bits=2, residual=16)", 1.0),
        ("turboquant(bits=4, residual=16)", 1.0),
        ("keydiff+turboquant(residual=16)", 0.5),
    ],
)
def test_the_model_decodes_the_same_with_and_without_the_kernel(wide, spec, budget, monkeypatch):
    """16 steps after a prefill of 90: the tokens coded while decoding left the 16-token window
    before decoding began, so both runs code the same values (a token coded from values a rounding apart may take
    another level, and the runs part ways: seen at 4 bits with no window)."""
    with_kernel, used = decoded_logits(wide, spec, budget, True, monkeypatch)
    without, unused = decoded_logits(wide, spec, budget, False, monkeypatch)
    assert used and not unused  # the kernel read some layer's codes, and only when allowed
    torch.testing.assert_close(with_kernel, without, rtol=1e-4, atol=1e-5)
