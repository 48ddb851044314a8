import torch

from kvstack.methods.select import select


def test_keeps_top_scores_sorted_by_slot_with_protected_first():
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.2]]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    slots = torch.arange(5).view(1, 1, 5)
    protected = torch.tensor([[[True, False, False, False, False]]])
    keep = select(scores, valid, slots, torch.tensor([[3]]), protected)
    assert keep.index[0, 0].tolist() == [0, 1, 3]  # slot 0 protected, then 0.9 and 0.8, in slot order
    assert keep.count.tolist() == [[3]]


def test_invalid_tokens_are_never_kept_and_count_is_capped():
    scores = torch.tensor([[[5.0, 4.0, 3.0]], [[1.0, 2.0, 3.0]]])
    valid = torch.tensor([[[False, True, True]], [[True, True, True]]])
    slots = torch.arange(3).expand(2, 1, 3)
    keep = select(scores, valid, slots, torch.tensor([[3], [2]]))
    assert keep.count.tolist() == [[2], [2]]
    assert keep.index[0, 0, :2].tolist() == [1, 2]
    assert keep.index[1, 0, :2].tolist() == [1, 2]


def test_heads_may_keep_different_counts():
    scores = torch.rand(1, 2, 6)
    valid = torch.ones_like(scores, dtype=torch.bool)
    keep = select(scores, valid, torch.arange(6).expand(1, 2, 6), torch.tensor([[2, 5]]))
    assert keep.count.tolist() == [[2, 5]]
    assert keep.index.shape[-1] == 5
