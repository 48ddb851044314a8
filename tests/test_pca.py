"""Low-rank storage: projections fitted by PCA (`pca`, `dar`), alone and under a quantizer."""

import pytest
import torch

from helpers import ids_of
from kvstack.cache.cache import KVCache
from kvstack.cache.encoded import Where
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.lowrank.base import Projection, principal_axes
from kvstack.stack import Stack


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def run(model, spec, budget, n=96, steps=4, rows=1, check=None):
    """Prefill `rows` prompts of n tokens, then decode `steps` tokens; `check(cache)` after each step."""
    cache = KVCache(model, spec, budget)
    runner = Runner(model, cache)
    ids = torch.tensor([prompt(n, seed=r) for r in range(rows)])
    logits = runner.forward(ids, torch.ones_like(ids))
    for t in prompt(steps, seed=9):
        if check is not None:
            check(cache)
        logits = runner.forward(torch.full((rows, 1), t), torch.ones(rows, 1, dtype=torch.long))
    return cache, logits


# ---- by hand --------------------------------------------------------------------------------
def test_a_projection_keeps_the_coefficients_on_its_axes_around_the_mean():
    axes = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    codec = Projection([[axes]], [[torch.ones(4)]])
    where = Where(0, 0, "key")
    enc = codec.encode(torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]), where)
    assert enc.tokens["coeff"].tolist() == [[[0.0, 1.0]]]
    assert enc.decode().tolist() == [[[1.0, 2.0, 1.0, 1.0]]]
    assert codec.token_bytes(4) == 2 * 4 and codec.fixed_bytes(4) == 3 * 4 * 4  # 2 floats; axes + mean


def test_principal_axes_of_points_on_a_line_point_along_it():
    t = torch.linspace(-1, 1, 50)
    line = torch.stack([t, t], -1) / 2**0.5 + torch.tensor([3.0, -1.0])
    table = principal_axes([(line[None], line[None])])  # one layer, one head
    first, mean, variance = table[0, 0, 0, 0], table[0, 0, 0, 2], table[0, 0, 0, 3]
    assert abs(float(first @ torch.tensor([1.0, 1.0]) / 2**0.5)) == pytest.approx(1.0, abs=1e-5)
    assert mean.tolist() == pytest.approx([3.0, -1.0], abs=1e-5)
    assert variance[0] == pytest.approx(float(t.var()), rel=1e-4) and variance[1] == pytest.approx(0.0, abs=1e-6)


# ---- against the full cache -----------------------------------------------------------------
@pytest.mark.parametrize("spec", ["pca(r={d})", "dar(fraction=1.0, residual=8)"])
def test_full_rank_reproduces_the_full_cache(tiny, spec):
    d = tiny.config.head_dim
    spec = spec.format(d=d)
    cache, logits = run(tiny, spec, 1.0, rows=2)
    _, full = run(tiny, "full", 1.0, rows=2)
    assert any(layer.is_coded for layer in cache.layers)
    assert torch.allclose(logits, full, atol=1e-4)
    rows = [(prompt(60), prompt(3, seed=1)), (prompt(40, seed=2), prompt(2, seed=3))]
    assert ids_of(tiny, rows, spec, 1.0)[0] == ids_of(tiny, rows, "full", 1.0)[0]


def test_bytes_fall_with_the_rank_exactly_as_coefficients_plus_tables(llama):
    d, n = 16, 100  # 96 prompt tokens + 4 decoded, every one projected (residual 0)
    held = []
    for r in (16, 8, 4, 2):
        cache, _ = run(llama, f"pca(r={r})", 1.0)
        per_head = n * 2 * r * 4 + 2 * (r + 1) * d * 4  # float32 coefficients, axes and mean
        assert cache.nbytes() == 4 * 2 * per_head  # 4 layers x 2 KV heads
        held.append(cache.nbytes())
    assert held == sorted(held, reverse=True)


def test_dar_keeps_the_local_window_at_full_dimension(llama):
    cache, _ = run(llama, "dar(residual=32)", 1.0)
    layer = cache.layers[0]
    assert layer.keys[0].shape[1] == 32 and layer.keys[0].shape[-1] == 16
    part = layer.coded[0][0]
    assert part.n == 100 - 32 and part.keys.tokens["coeff"].shape[-1] == 4  # a quarter of 16


def test_a_projection_stacked_with_eviction_and_a_quantizer_holds_the_budget_and_keeps_more(llama):
    def within(cache):
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()

    snap, stack = "snapkv(window_size=4)", "snapkv(window_size=4)+pca(r=8)+kivi(bits=4, group=8, residual=16)"
    counts = {}
    for spec in (snap, stack):
        counts[spec] = int(run(llama, spec, 0.25, n=400, steps=0)[0].layers[0].counts().sum())
        cache, logits = run(llama, spec, 0.25, n=400, steps=24, check=within)
        within(cache)
        assert torch.isfinite(logits).all()
    assert counts[stack] > 3 * counts[snap]


@pytest.mark.parametrize(
    "spec, fix",
    [
        ("pca(r=0)", "use 1..16"),
        ("pca(r=32)", "use 1..16"),
        ("pca+dar", "two projections"),
        ("pca+squat", "cannot code pca's coefficients"),
        ("pca+cq", "cannot code pca's coefficients"),
        ("dar(fraction=2)", "fraction must be in (0, 1]"),
        ("pca(residual=-1)", "residual=-1 is out of range: give an integer from 0"),
        ("rotatek(fraction=0)", "fraction must be in (0, 1]"),
        ("shadowkv(r=32, chunk=64)", "use 1..16"),
        ("shadowkv(r=8, chunk=4)", "chunk >= r"),
        ("rotatek+shadowkv", "two projections"),
        ("rotatek+squat", "cannot code rotatek's coefficients"),
        ("shadowkv(residual=-1)", "residual=-1 is out of range: give an integer from 0"),
    ],
)
def test_bad_low_rank_specs_are_one_line_errors(llama, spec, fix):
    with pytest.raises(UserError, match=fix.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as err:
        KVCache(llama, Stack.parse(spec), 1.0)
    assert "\n" not in str(err.value)
