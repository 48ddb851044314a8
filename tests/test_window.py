"""The window of tokens held in the model's dtype beside a quantizer's codes (`kvstack.cache.window`):
by hand, as a property over prompts and decoding steps, and as the bytes a real cache then holds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.cache.cache import KVCache
from kvstack.cache.window import plain_window, to_encode
from kvstack.generate import Runner
from kvstack.planning.options import Storage, coded_count
from kvstack.planning.options import cost as storage_cost
from test_cache import prompt


def test_windows_and_codings_by_hand():
    # KIVI's groups share scales: whole groups beyond the residual, up to R + G - 1 waiting
    assert plain_window(8, 32, batches_only=False) == 39
    assert to_encode(70, 8, 32, False, decoding=False) == 32  # 62 beyond the window: one whole group
    assert to_encode(70, 8, 32, False, decoding=True) == 32
    # TurboQuant's batches share nothing: the window fills to max(R, G - 1)
    assert plain_window(8, 8, batches_only=True) == 8
    assert plain_window(0, 8, batches_only=True) == 7
    assert plain_window(128, 8, batches_only=True) == 128
    assert to_encode(70, 8, 8, True, decoding=False) == 62  # after a prompt: exactly the overflow
    assert to_encode(8, 8, 8, True, decoding=True) == 0
    assert to_encode(9, 8, 8, True, decoding=True) == 8  # one past the window: a whole batch, 1 left
    assert to_encode(12, 8, 8, True, decoding=True) == 8
    assert to_encode(5, 0, 8, True, decoding=False) == 0 and to_encode(8, 0, 8, True, decoding=True) == 8


@settings(max_examples=200, deadline=None)
@given(
    residual=st.integers(0, 40),
    group=st.integers(1, 16),
    batched=st.booleans(),
    n=st.integers(0, 120),
    steps=st.integers(0, 60),
)
def test_the_window_never_overflows_and_is_full_after_a_prompt(residual, group, batched, n, steps):
    window = plain_window(residual, group, batched)
    plain = n - to_encode(n, residual, group, batched, decoding=False)
    assert plain <= window
    if batched:
        assert plain == min(n, window)  # the bytes the budget counts for the window are held
    least = residual if not batched else window - group + 1  # the newest always held in full
    for total in range(n + 1, n + steps + 1):
        coded = to_encode(plain + 1, residual, group, batched, decoding=True)
        assert coded % group == 0  # one call codes a whole group while decoding
        plain += 1 - coded
        assert min(least, total) <= plain <= window


def test_auto_counts_turboquant_storage_by_the_same_window():
    storage = Storage.parse("t4", residual=8)
    assert storage_cost(storage, 64, 512, 4).residual == 8  # not 8 + 7 waiting
    assert coded_count(100, storage) == 92 and coded_count(9, storage, decoding=True) == 8
    kivi = Storage.parse("4", residual=8)
    assert storage_cost(kivi, 64, 512, 4).residual == 39 and coded_count(100, kivi) == 64


@pytest.mark.parametrize("budget", [0.1, 0.05])
@pytest.mark.parametrize("residual", [8, 0])
def test_a_turboquant_stack_holds_its_budget_to_one_percent_after_the_prompt(llama, budget, residual):
    """After the prompt the cache holds the bytes the budget allows (within 1%: one coded token
    is 0.3% of it here), never more while decoding, and the newest tokens wait in the model's
    dtype: `residual` of them after the prompt, between residual - 7 and residual while decoding."""
    spec = f"snapkv(window_size=4)+turboquant(bits=4, residual={residual})"
    cache = KVCache(llama, spec, budget)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(400)]), torch.ones(1, 400, dtype=torch.long))
    allowed = budget * cache.full_nbytes()
    assert 0.99 * allowed <= cache.nbytes() <= allowed
    window = max(residual, 7)
    assert {layer.keys[h].shape[1] for layer in cache.layers for h in range(layer.n_kv_heads)} == {window}
    waiting = set()
    for t in prompt(24, seed=3):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        assert cache.nbytes() <= budget * cache.full_nbytes()
        waiting |= {layer.keys[h].shape[1] for layer in cache.layers for h in range(layer.n_kv_heads)}
    assert waiting == set(range(window - 7, window + 1))
