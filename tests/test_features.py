"""A linear predictor's scores without the feature matrix: `linear_scores` (torch) and the C kernel
(`kernel_scores`, keys turned back from RoPE as it reads them) equal `features(...) @ weight`."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.cache import kernels
from kvstack.methods.learned.features import features, kernel_scores, linear_scores
from kvstack.methods.learned.predictor import Predictor
from kvstack.models.rope import rotate, turns

needs_kernel = pytest.mark.skipif(
    kernels.library("scores") is None and shutil.which("cc") is None, reason="no C compiler on this machine"
)
WIDTH = {"kv": lambda d: 2 * d + 4, "local": lambda d: 4 * d + 11, "gate": lambda d: 2 * d}


def case(b: int, h: int, t: int, d: int, o: int, kind: str, seed: int, thin: bool):
    """Keys before RoPE, values, validity (some padding when `thin`), ages, positions and weights."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, h, t, d, generator=g) * 3, torch.randn(b, h, t, d, generator=g)
    valid = torch.rand(b, h, t, generator=g) > (0.3 if thin else 0.0)
    valid[..., 0] = True  # a head with no real token has no mean norm (its padding scores are not read)
    positions = torch.randint(0, 3000, (b, h, t), generator=g)
    weight = torch.randn(h, WIDTH[kind](d), o, generator=g)
    return keys, values, valid, 3000 - positions, positions, weight


def close(got: torch.Tensor, expected: torch.Tensor, valid: torch.Tensor) -> None:
    """Equal on the real tokens, up to float rounding of sums over ~4d features."""
    mask = valid[..., None].expand_as(expected)
    scale = float(expected[mask].abs().max())
    assert torch.allclose(got[mask], expected[mask], atol=2e-5 * scale + 1e-5), float(
        (got - expected)[mask].abs().max()
    )


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 300),
    d=st.sampled_from([2, 16, 64]),
    o=st.integers(1, 2),
    kind=st.sampled_from(["kv", "local", "gate"]),
    seed=st.integers(0, 10_000),
    thin=st.booleans(),
)
def test_linear_scores_are_the_feature_matrix_times_the_weights(b, h, t, d, o, kind, seed, thin):
    keys, values, valid, ages, _, weight = case(b, h, t, d, o, kind, seed, thin)
    expected = features(keys, values, valid, ages, kind) @ weight  # (b, h, t, o)
    close(linear_scores(keys, values, valid, ages, kind, weight), expected, valid)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 600),
    d=st.sampled_from([16, 64, 128, 256]),
    o=st.integers(1, 2),
    kind=st.sampled_from(["kv", "local"]),
    seed=st.integers(0, 10_000),
    thin=st.booleans(),
)
def test_the_kernel_turns_keys_back_from_rope_and_sums_the_same_features(b, h, t, d, o, kind, seed, thin):
    """Runs of 256 tokens start their window sum from the tokens before them: t up to 600 crosses two."""
    keys, values, valid, ages, positions, weight = case(b, h, t, d, o, kind, seed, thin)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    after_rope, values = rotate(keys, positions.float(), inv_freq), values.bfloat16()  # the cache's dtype
    expected = features(rotate(after_rope, -positions.float(), inv_freq), values, valid, ages, kind) @ weight
    got = kernel_scores(after_rope, values, valid, ages, kind, weight, positions, inv_freq)
    assert got is not None and got.shape == expected.shape
    close(got, expected, valid)
    before_rope = kernel_scores(keys, values, valid, ages, kind, weight)  # no frequencies: read as they are
    close(before_rope, features(keys, values, valid, ages, kind) @ weight, valid)


def test_the_kernel_declines_what_it_does_not_read(monkeypatch):
    keys, values, valid, ages, _, weight = case(1, 2, 10, 24, 1, "local", 0, False)  # 24 channels: not a multiple of 16
    assert kernel_scores(keys, values, valid, ages, "local", weight) is None
    monkeypatch.setenv("KVSTACK_KERNELS", "0")
    keys, values, valid, ages, _, weight = case(1, 2, 10, 16, 1, "local", 0, False)
    assert kernel_scores(keys, values, valid, ages, "local", weight) is None
    monkeypatch.delenv("KVSTACK_KERNELS")
    keys, values, valid, ages, _, weight = case(1, 2, 10, 16, 1, "gate", 0, False)  # two products: torch's
    assert kernel_scores(keys, values, valid, ages, "gate", weight) is None


@pytest.mark.parametrize("kernel", ["1", "0"])
@pytest.mark.parametrize("kind", ["kv", "local", "gate"])
def test_a_linear_predictor_scores_as_it_predicts_from_the_feature_matrix(monkeypatch, kernel, kind):
    """`Predictor.score` (kernel or torch, standardisation folded, two outputs per head in blocks
    of h) against `predict` on the written-out features of the keys turned back from RoPE."""
    monkeypatch.setenv("KVSTACK_KERNELS", kernel)
    b, h, t, d, o = 2, 2, 40, 16, 2
    keys, values, valid, ages, positions, _ = case(b, h, t, d, o, kind, 3, True)
    g = torch.Generator().manual_seed(1)
    F = WIDTH[kind](d)
    p = Predictor(
        torch.randn(3, o * h, F, 1, generator=g), torch.zeros(3, o * h, 0), torch.zeros(3, o * h, 0),
        torch.randn(3, o * h, generator=g), torch.randn(3, o * h, F, generator=g),
        torch.rand(3, o * h, F, generator=g) + 0.5,
        meta={"features": kind},
    )  # fmt: skip
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    after_rope = rotate(keys, positions.float(), inv_freq)
    x = features(keys, values, valid, ages, kind)
    expected = p.predict(2, torch.cat([x] * o, dim=1))  # (b, o*h, t)
    got = p.score(2, after_rope, values, valid, ages, positions, inv_freq)
    close(got[..., None], expected[..., None], valid.repeat(1, o, 1))


def test_the_turns_table_is_what_rotate_computes_and_grows_on_demand():
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    small = turns(inv_freq, 5)
    assert small.shape[0] >= 5 and small.shape[1] == 8
    x = torch.randn(300, 8)
    positions = torch.arange(300).float()
    table = turns(inv_freq, 300)
    assert table.shape[0] >= 300
    c, s = table[:300, :4], table[:300, 4:]
    by_table = torch.cat([x[:, :4] * c - x[:, 4:] * s, x[:, 4:] * c + x[:, :4] * s], -1)
    assert torch.allclose(by_table, rotate(x, positions, inv_freq), atol=1e-6)
