"""quest_pages: Quest's page bound by hand, pages kept whole, and the full cache at budget 1.0."""

import torch

from helpers import ids_of, layer_with, observe
from kvstack.methods.evict.quest_pages import criticality, page_bounds
from kvstack.methods.select import select
from kvstack.stack import Stack


def test_the_page_bound_by_hand():
    # page 0: keys (1, 0), (3, -1) -> min (1, -1), max (3, 0); page 1: (0, 2), (-1, 1) -> min (-1, 1), max (0, 2)
    keys = torch.tensor([[[[1.0, 0.0], [3.0, -1.0], [0.0, 2.0], [-1.0, 1.0]]]])
    lo, hi = page_bounds(keys, torch.ones(1, 1, 4, dtype=torch.bool), torch.tensor([[[0, 0, 1, 1]]]))
    assert lo.tolist() == [[[[1.0, -1.0], [-1.0, 1.0]]]] and hi.tolist() == [[[[3.0, 0.0], [0.0, 2.0]]]]
    q = torch.tensor([[[[1.0, -1.0]]]])
    # page 0: 1 * 3 + (-1) * (-1) = 4 (its best key, (3, -1), reaches it); page 1: 1 * 0 + (-1) * 1 = -1 >= -2
    assert criticality(q, lo, hi).tolist() == [[[[4.0, -1.0]]]]


def test_a_page_without_real_tokens_bounds_nothing():
    keys = torch.randn(1, 1, 3, 2)
    lo, hi = page_bounds(keys, torch.tensor([[[True, False, False]]]), torch.tensor([[[0, 1, 1]]]))
    assert torch.equal(lo[0, 0, 0], keys[0, 0, 0]) and torch.equal(hi[0, 0, 1], torch.zeros(2))


def test_the_critical_pages_are_kept_whole_with_the_window():
    keys = torch.zeros(1, 1, 9, 2)
    keys[0, 0, 2:4, 0] = 5.0  # page 1 (slots 2, 3) aligns with the query
    keys[0, 0, 4:6, 0] = -5.0  # page 2 points away
    q = torch.tensor([[[[1.0, 0.0]]]])  # one window query, at slot 8
    layer = layer_with(keys, queries=q)
    method = Stack.parse("quest_pages(page=2, window_size=1)").evictor
    obs = observe(layer, 3)
    scores = method.score(obs)
    assert scores[0, 0, 2] == scores[0, 0, 3] == 5.0 and scores[0, 0, 8] == float("inf")
    decision = select(scores, obs.valid, obs.slots, obs.keep)
    assert decision.index[0, 0, : decision.count[0, 0]].tolist() == [2, 3, 8]


def test_budget_one_is_the_full_cache_and_a_small_budget_decodes(tiny):
    rows = [(torch.randint(3, 97, (60,)).tolist(), [5, 6, 7])]
    assert ids_of(tiny, rows, "quest_pages", 1.0)[0] == ids_of(tiny, rows)[0]
    assert len(ids_of(tiny, rows, "quest_pages(page=4)", 0.3)[0][0]) == 12
