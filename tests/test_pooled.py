"""`chunk` and `sentence`: scores pooled over groups of tokens, so facts are kept whole."""

import pytest
import torch

from kvstack.cache.cache import KVCache
from kvstack.generate import Runner, left_pad
from kvstack.methods.base import Observation
from kvstack.methods.evict.chunk import pool
from kvstack.methods.evict.sentence import TABLE, ends_sentence
from kvstack.stack import Stack
from test_cache import prompt, step_logits
from tiny import tiny_llama

PERIOD = 3  # in these tests the token 3 ends a sentence


def test_pooling_scores_keeps_groups_whole_and_infinite_scores_infinite():
    scores = torch.tensor([[[1.0, 5.0, 0.0, 0.0, float("inf"), 2.0]]])
    groups = torch.tensor([[[0, 0, 1, 1, 2, 2]]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    pooled = pool(scores, groups, valid)
    assert torch.isposinf(pooled[0, 0, 4])
    assert torch.allclose(pooled[0, 0, :4], torch.tensor([3.0 - 2e-3, 3.0 + 2e-3, 0.0, 0.0]))
    assert pooled[0, 0, 5] == 2.0  # the group's only finite score is its mean
    assert pooled[0, 0, :2].min() > pooled[0, 0, 2:4].max()  # group order is the means' order


ENDS = [(".", True), (' said."', True), ("?", True), ("\n", True), (" Mr", False), ("3", False)]


@pytest.mark.parametrize("text, ends", ENDS)
def test_sentence_ends_by_hand(text, ends):
    assert ends_sentence(text) is ends


@pytest.fixture
def marked():
    model = tiny_llama()
    table = torch.zeros(97, dtype=torch.bool)
    table[PERIOD] = True
    setattr(model, TABLE, table)
    return model


def held(cache, layer=0, head=0):
    layer = cache.layers[layer]
    return sorted(layer.head_slots(head)[0].tolist())


def test_the_loop_marks_sentence_ends_and_each_token_knows_its_sentence(marked):
    ids = [5, 6, PERIOD, 7, 8, 9, PERIOD, 10, 11]
    cache = KVCache(marked, "sentence(knorm)", 1.0)
    runner = Runner(marked, cache)
    runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    runner.forward(torch.tensor([[PERIOD]]), torch.ones(1, 1, dtype=torch.long))
    runner.forward(torch.tensor([[12]]), torch.ones(1, 1, dtype=torch.long))
    layer = cache.layers[0]
    obs = Observation(layer, layer.counts(), None)
    assert obs.sentence[0, 0].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3]


def test_sentence_keeps_whole_sentences_best_first(marked):
    # sentences of 4 tokens; knorm keeps low-norm keys: pooled, whole sentences go or stay
    ids = prompt(3, seed=1) + [PERIOD]
    for s in range(2, 9):
        ids += prompt(3, seed=s) + [PERIOD]
    cache = KVCache(marked, "sentence(knorm,longest=64)", 0.5)
    runner = Runner(marked, cache)
    runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    for h in range(2):
        kept = held(cache, head=h)
        sentences = {slot // 4 for slot in kept}
        whole = [s for s in sentences if all(s * 4 + i in kept for i in range(4))]
        assert len(whole) >= len(sentences) - 1, kept  # at most one sentence cut by the budget


def test_sentence_and_chunk_at_budget_one_are_the_full_cache(marked):
    ids, follow = prompt(50, seed=3), [PERIOD, *prompt(8, seed=4)]
    full = step_logits(marked, KVCache(marked, "full", 1.0), ids, follow)
    for spec in ("sentence(knorm)", "chunk(knorm,size=4)", "sentence(kvzip)"):
        assert torch.equal(step_logits(marked, KVCache(marked, spec, 1.0), ids, follow), full), spec


def test_sentence_in_a_padded_batch_counts_each_rows_own_sentences(marked):
    rows = [[5, PERIOD, 6, 7, PERIOD, 8], [9, PERIOD, 10]]
    ids, mask = left_pad(rows, 0)
    cache = KVCache(marked, "sentence(knorm)", 1.0)
    Runner(marked, cache).forward(ids, mask)
    assert cache.seq.sentence_index().tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1]]  # left padding ends nothing


def test_a_long_sentence_is_cut_into_pieces_of_longest(marked):
    stage = Stack.parse("sentence(knorm,longest=4)").evictor
    cache = KVCache(marked, "sentence(knorm,longest=4)", 1.0)
    Runner(marked, cache).forward(torch.tensor([prompt(10, seed=9)]), torch.ones(1, 10, dtype=torch.long))
    layer = cache.layers[0]
    obs = Observation(layer, layer.counts(), None)
    pooled = stage.score(obs)[0, 0]
    # no period: one sentence, pieces [0-3], [4-7], [8-9]: within a piece the scores are one mean (+ tie)
    for piece in (pooled[:4], pooled[4:8], pooled[8:]):
        assert float(piece.max() - piece.min()) < 0.01 * float(pooled.abs().max())


def test_sentence_under_model_generate_says_to_use_kvstacks_loop(marked):
    from kvstack.errors import UserError

    cache = KVCache(marked, "sentence(knorm)", 0.5)
    ids = torch.tensor([prompt(40)])
    with pytest.raises(UserError, match="kvstack generate"):
        marked.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2)


def test_a_saved_cache_keeps_its_sentence_ends(marked, tmp_path):
    from kvstack.cache.saved import load, save

    cache = KVCache(marked, "sentence(knorm)", 0.5)
    Runner(marked, cache).forward(torch.tensor([[5, PERIOD, 6, 7, PERIOD, 8]]), torch.ones(1, 6, dtype=torch.long))
    save(cache, tmp_path / "c.kvc")
    again, _, _ = load(marked, tmp_path / "c.kvc")
    assert torch.equal(again.seq.ends, cache.seq.ends)
