"""Budget allocators: their pure decisions by hand, and per-head budgets freeing real bytes."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.cache.cache import KVCache
from kvstack.generate import Runner
from kvstack.methods.allocate.adakv import adaptive_split
from kvstack.methods.allocate.base import distribute
from kvstack.methods.allocate.pyramid import pyramid_shares
from kvstack.stack import Stack


def test_pyramid_shares_fall_linearly_from_bottom_to_top_with_mean_one():
    # beta 4: top keeps budget / 4, bottom 2 - 1/4 = 1.75; 4 layers step (1.75 - 0.25) / 3 = 0.5
    assert pyramid_shares(4, 4.0).tolist() == [1.75, 1.25, 0.75, 0.25]
    assert abs(float(pyramid_shares(30, 20.0).mean()) - 1.0) < 1e-12


def test_distribute_shares_the_total_and_refills_what_a_capped_head_cannot_hold():
    # 2 layers x 1 head, uniform 10 each (total 20); weights 3:1 want 15 / 5
    base = torch.full((2, 1, 1), 10)
    assert distribute(torch.tensor([3.0, 1.0]).view(2, 1, 1), base, torch.full((2, 1, 1), 40)).flatten().tolist() == [
        15,
        5,
    ]
    # the first layer holds only 12: the 3 it cannot use go to the second
    room = torch.tensor([12, 40]).view(2, 1, 1)
    assert distribute(torch.tensor([3.0, 1.0]).view(2, 1, 1), base, room).flatten().tolist() == [12, 8]
    # a floor comes first: weights 1:0 still leave the second layer its 4
    least = distribute(torch.tensor([1.0, 0.0]).view(2, 1, 1), base, torch.full((2, 1, 1), 40), least=4)
    assert least.flatten().tolist() == [16, 4]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.0, 5.0), min_size=6, max_size=6),
    st.lists(st.integers(0, 50), min_size=6, max_size=6),
    st.integers(0, 30),
    st.integers(0, 3),
)
def test_distribute_never_exceeds_the_total_or_a_head_s_room(weights, rooms, base, least):
    w = torch.tensor(weights).view(3, 1, 2)
    room = torch.tensor(rooms).view(3, 1, 2)
    b = torch.minimum(torch.full_like(room, base), room)
    out = distribute(w, b, room, least)
    assert bool((out <= room).all()) and bool((out >= 0).all())
    assert int(out.sum()) <= max(int(b.sum()), int(torch.minimum(room, torch.tensor(least)).sum()))
    if bool((w > 0).all()) and least == 0:  # every head wants some: the whole total is spent
        assert int(out.sum()) >= int(b.sum()) - 6  # within flooring, one token per head


def test_adakv_gives_the_layer_budget_to_the_best_tokens_of_any_head_after_the_safeguard():
    scores = torch.tensor([[[9.0, 8.0, 7.0, 6.0], [5.0, 1.0, 0.5, 0.1]]])  # head 0 concentrated above head 1
    valid = torch.ones_like(scores, dtype=torch.bool)
    keep = torch.tensor([[2, 2]])
    # alpha 0.5: each head keeps 1 first (9 and 5); the other 2 go to 8 and 7, both in head 0
    assert adaptive_split(scores, valid, keep, 0.5).tolist() == [[3, 1]]
    # alpha 1: uniform
    assert adaptive_split(scores, valid, keep, 1.0).tolist() == [[2, 2]]
    # alpha 0: pure flattened top-4 -> 9, 8, 7, 6
    assert adaptive_split(scores, valid, keep, 0.0).tolist() == [[4, 0]]


def test_compositions_parse_and_print_back():
    stack = Stack.parse("pyramid(adakv(snapkv(window_size=8), alpha=0.1), beta=10)")
    assert stack.evictor.name == "snapkv" and [a.name for a in stack.allocators] == ["pyramid", "adakv"]
    assert stack.label == "pyramid(adakv(snapkv(window_size=8), alpha=0.1), beta=10)"
    assert Stack.parse(stack.label) == stack
    assert Stack.parse("pyramid").label == "pyramid(snapkv)"


def test_head_budgets_differ_and_the_bytes_held_follow_them(llama):
    ids = torch.randint(3, 90, (1, 80), generator=torch.Generator().manual_seed(0)).to(llama.device)
    cache = KVCache(llama, "pyramid(adakv(snapkv(window_size=4, every=4), alpha=0.0), beta=4)", 0.5)
    Runner(llama, cache).forward(ids, torch.ones_like(ids))
    rows = cache.stats()
    tokens = [r["tokens"][0] for r in rows]
    assert len(set(tokens)) > 2  # layers and heads keep different counts
    per_layer = [sum(t for r, t in zip(rows, tokens, strict=True) if r["layer"] == i) for i in range(4)]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]  # the pyramid
    token_bytes = cache.layers[0].token_bytes()
    assert [r["bytes"] for r in rows] == [t * token_bytes for t in tokens]  # measured: ragged heads, no padding
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()


def test_the_issue_s_compositions_run_within_budget_and_equal_the_full_cache_at_budget_one(llama):
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(2)).to(llama.device)
    mask = torch.ones_like(ids)
    full = Runner(llama, KVCache(llama)).forward(ids, mask)
    for spec in ("pyramid(snapkv(window_size=4))", "adakv(keydiff)", "graphkv(snapkv(window_size=4))", "razor(knorm)"):
        cache = KVCache(llama, spec, 0.5)
        Runner(llama, cache).forward(ids, mask)
        assert cache.compressions > 0 and cache.nbytes() <= 0.5 * cache.full_nbytes(), spec
        assert torch.equal(Runner(llama, KVCache(llama, spec, 1.0)).forward(ids, mask), full), spec
