"""Admission's arithmetic, by hand: what a request reserves before and after its prefill."""

from hypothesis import given
from hypothesis import strategies as st

from kvstack import Budget
from kvstack.serve.admission import Ledger, final_bytes, first_bytes


def test_a_fraction_keeps_its_ratio_as_the_sequence_grows():
    # 100 tokens held in 1000 bytes; 50 more at a fixed ratio: 1500 bytes
    assert final_bytes(Budget.parse(0.25), 1000, 100, 50, token_bytes=40) == 1500
    # the full cache and a token budget may hold every new token (40 bytes each)
    assert final_bytes(Budget.parse(1.0), 4000, 100, 50, token_bytes=40) == 6000
    assert final_bytes(Budget.parse("64t"), 1000, 100, 50, token_bytes=40) == 3000
    # a size caps it (and never below what is held)
    assert final_bytes(Budget.parse("2000B"), 1000, 100, 50, token_bytes=40) == 2000
    assert final_bytes(Budget.parse("900B"), 1000, 100, 50, token_bytes=40) == 1000


def test_before_its_prefill_a_request_reserves_its_prompt_as_a_full_cache():
    # 100 tokens x 40 bytes = 4000 while the prompt goes in; at 0.25, 1000 then 1500 after 50 tokens
    assert first_bytes(Budget.parse(0.25), 100, 50, 40, stored=False) == 4000
    assert first_bytes(Budget.parse(0.25), 100, 50, 40, stored=True) == 1500  # loaded compressed: no prefill
    assert first_bytes(Budget.parse(1.0), 100, 50, 40, stored=False) == 6000


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 5000))
def test_the_ledger_never_admits_past_its_capacity(needs, capacity):
    ledger = Ledger(capacity)
    for key, need in enumerate(needs):
        if ledger.fits(need):
            ledger.reserve(key, need)
    assert sum(ledger.reserved.values()) <= capacity and ledger.peak_reserved <= capacity
    for key in list(ledger.reserved):
        ledger.release(key)
    assert ledger.totals() == (0, 0, 0)
