import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstack.cache.budget import Budget, Cost, tokens_at_fraction, tokens_to_keep
from kvstack.errors import UserError


def test_parse_fraction_and_tokens():
    assert Budget.parse("0.25") == Budget(fraction=0.25)
    assert Budget.parse("512t") == Budget(tokens=512)
    assert Budget.parse(1).is_full


@pytest.mark.parametrize("bad", ["0", "-0.1", "1.5", "nan", "abc", "0t", "xt", ""])
def test_bad_budgets_are_one_line_errors(bad):
    with pytest.raises(UserError) as e:
        Budget.parse(bad)
    assert "\n" not in str(e.value)


def test_fraction_pays_for_the_position_index():
    # 100 tokens, 256 bytes per token in a full cache, 260 once slots are stored:
    # 0.25 * 100 * 256 / 260 = 24.6 -> 24 tokens fit in a quarter of the bytes
    keep = tokens_to_keep(Budget(fraction=0.25), torch.tensor([100]), Cost(256, 260))
    assert keep.tolist() == [24]
    assert 24 * 260 <= 0.25 * 100 * 256 < 25 * 260


def test_token_budget_is_capped_by_the_sequence():
    assert tokens_to_keep(Budget(tokens=64), torch.tensor([10, 100]), Cost(256, 260)).tolist() == [10, 64]


@given(st.floats(0.001, 1.0), st.integers(0, 100_000))
def test_kept_bytes_never_exceed_the_budget(fraction, n):
    keep = int(tokens_to_keep(Budget(fraction=fraction), torch.tensor([n]), Cost(256, 260))[0])
    assert keep <= n
    if fraction < 1.0:
        assert keep * 260 <= fraction * n * 256 + 1e-6
        assert (keep + 1) * 260 > fraction * n * 256 - 1e-6 or keep == n
    else:
        assert keep == n
    assert not math.isnan(keep)


costs = st.builds(
    Cost,
    st.just(256),
    st.floats(20.0, 300.0),
    st.integers(0, 64),
    st.floats(256.0, 300.0),
    st.sampled_from([0.0, 40.0]),
    st.sampled_from([0.0, 512.0]),
)


@given(st.lists(st.tuples(st.floats(1e-4, 1.0 - 1e-9), st.integers(0, 20_000), costs), min_size=1, max_size=6))
def test_shares_per_head_are_each_heads_own_budget(heads):
    """`auto` turns every head's share into tokens at once, each head at its own storage's cost:
    the same count, bit for bit, as a fraction budget of that share for that head alone."""
    table = Cost.table([c for _, _, c in heads])
    shares = torch.tensor([s for s, _, _ in heads], dtype=torch.float64)
    n = torch.tensor([n for _, n, _ in heads])
    alone = [int(tokens_to_keep(Budget(fraction=s), torch.tensor([k]), c)[0]) for s, k, c in heads]
    assert tokens_at_fraction(shares, n, table).tolist() == alone
