"""Each method against a hand-computed case: scores and the tokens a budget keeps."""

import pytest
import torch

from helpers import layer_with, observe
from kvstack.errors import UserError
from kvstack.methods.select import select
from kvstack.stack import Stack


def kept(layer, method, keep):
    obs = observe(layer, keep)
    decision = select(method.score(obs), obs.valid, obs.slots, obs.keep)
    return [decision.index[0, h, : decision.count[0, h]].tolist() for h in range(layer.n_kv_heads)]


def test_streaming_keeps_sinks_and_the_recent_window():
    layer = layer_with(torch.randn(1, 1, 10, 4))
    assert kept(layer, Stack.parse("streaming(sinks=2)").evictor, 5) == [[0, 1, 7, 8, 9]]


def test_knorm_keeps_the_lowest_key_norms():
    norms = torch.tensor([3.0, 1.0, 5.0, 0.5, 2.0])
    keys = torch.zeros(1, 1, 5, 2)
    keys[0, 0, :, 0] = norms
    assert kept(layer_with(keys), Stack.parse("knorm").evictor, 2) == [[1, 3]]


def test_keydiff_keeps_the_keys_least_like_the_mean_direction():
    keys = torch.tensor([[[[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, 1.0], [-1.0, 1.0]]]])  # (1, 1, 5, 2)
    method = Stack.parse("keydiff").evictor
    unit = keys[0, 0] / keys[0, 0].norm(dim=-1, keepdim=True)
    anchor = unit.mean(0)  # by hand: (0.459, 0.341); cosines 0.80 (x-axis keys), 0.60 (y), -0.15 (anti-diagonal)
    expected = -(keys[0, 0] @ anchor) / (keys[0, 0].norm(dim=-1) * anchor.norm())
    assert torch.allclose(method.score(observe(layer_with(keys), 2))[0, 0], expected, atol=1e-6)
    assert torch.allclose(expected, torch.tensor([-0.802, -0.802, -0.802, -0.596, 0.146]), atol=2e-3)
    assert kept(layer_with(keys), method, 2) == [[3, 4]]  # the y-axis and anti-diagonal keys are distinctive


def test_lagkv_ranks_each_chunk_against_the_next_one():
    # sinks=1, lag=2: sink 0 | chunk 0 = 1, 2 | chunk 1 = 3, 4 | chunk 2 = 5, 6 (no reference: kept like the tail)
    keys = torch.tensor([[[[9.0, 9.0], [0.0, 1.0], [1.0, 0.5], [0.0, 0.0], [2.0, 1.0], [0.0, 0.0], [1.0, 1.0]]]])
    method = Stack.parse("lagkv(sinks=1, lag=2)").evictor
    scores = method.score(observe(layer_with(keys), 5))[0, 0]
    # chunk 0 by chunk 1's range (0..2, 0..1): token 1 -> (0, 1), std 0.71; token 2 -> (0.5, 0.5), std 0
    # chunk 1 by chunk 2's range (0..1, 0..1): token 3 -> (0, 0), std 0; token 4 -> (2, 1), std 0.71
    # values are all zero (no range): they add the same to every token of a chunk
    assert scores[0] == float("inf")
    assert scores[1:5].tolist() == [0.5, 0.0, 0.0, 0.5]  # rank within the chunk / lag
    assert scores[5] > 2 and scores[6] > scores[5]  # the unreferenced tail, newest first
    assert kept(layer_with(keys), method, 5) == [[0, 1, 4, 5, 6]]


def test_lagkv_vectorised_scores_equal_a_chunk_by_chunk_loop():
    torch.manual_seed(3)
    keys, values = torch.randn(2, 3, 31, 4), torch.randn(2, 3, 31, 4)
    method = Stack.parse("lagkv(sinks=2, lag=4)").evictor
    got = method.score(observe(layer_with(keys, values), 10))
    # the definition, one chunk at a time: chunk c (positions 2+4c .. 5+4c) against chunk c + 1
    expected = got.clone()
    for c in range(6):  # 29 tokens after the sinks: chunks 0..6 complete, 0..5 have a reference
        members, ref = slice(2 + 4 * c, 6 + 4 * c), slice(6 + 4 * c, 10 + 4 * c)
        score = 0
        for x in (keys, values):
            low, high = x[:, :, ref].amin(2, keepdim=True), x[:, :, ref].amax(2, keepdim=True)
            score = score + ((x[:, :, members] - low) / (high - low)).std(-1).softmax(-1) / 2
        expected[:, :, members] = score.argsort(-1).argsort(-1).float() / 4
    assert torch.equal(got[:, :, :26], expected[:, :, :26])
    assert (got[:, :, :2] == float("inf")).all() and (got[:, :, 26:] > 2).all()  # sinks; chunk 6 and the tail


def test_lagkv_on_a_short_sequence_is_streaming():
    keys = torch.randn(1, 1, 10, 4)
    lag, streaming = Stack.parse("lagkv(sinks=2, lag=8)").evictor, Stack.parse("streaming(sinks=2)").evictor
    assert kept(layer_with(keys), lag, 5) == kept(layer_with(keys), streaming, 5) == [[0, 1, 7, 8, 9]]


def test_h2o_keeps_heavy_hitters_and_recent_tokens():
    layer = layer_with(torch.randn(1, 1, 8, 4))
    layer.add_stat("attention_sum", 0, torch.tensor([[5.0, 0.1, 4.0, 0.2, 3.0, 0.3, 0.0, 0.0]]), accumulate=True)
    # keep 4: recent=0.5 -> the 2 newest (6, 7) plus the 2 heaviest of the rest (0, 2)
    assert kept(layer, Stack.parse("h2o").evictor, 4) == [[0, 2, 6, 7]]


def test_tova_keeps_what_the_last_query_attends_averaged_over_heads():
    layer = layer_with(torch.randn(1, 2, 4, 4))
    layer.add_stat("last_attention", 0, torch.tensor([[0.7, 0.1, 0.1, 0.1]]), accumulate=False)
    layer.add_stat("last_attention", 1, torch.tensor([[0.1, 0.1, 0.6, 0.2]]), accumulate=False)
    # mean over heads: [0.4, 0.1, 0.35, 0.15] -> keep 0 and 2 in both heads
    assert kept(layer, Stack.parse("tova").evictor, 2) == [[0, 2], [0, 2]]


def test_snapkv_scores_are_the_window_attention():
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]]])  # (1, 1, 4, 2)
    q = torch.tensor([[[[2.0, 0.0]]]])  # one window query at slot 3
    layer = layer_with(keys, queries=q)
    method = Stack.parse("snapkv(window_size=1, kernel_size=1)").evictor
    scores = method.score(observe(layer, 2))
    logits = torch.tensor([2.0, 0.0, 4.0, 0.0]) * 2**-0.5
    expected = torch.softmax(logits, 0)
    assert torch.allclose(scores[0, 0, :3], expected[:3], atol=1e-6)
    assert scores[0, 0, 3] == float("inf")  # the window itself is always kept
    assert kept(layer, method, 2) == [[2, 3]]


def test_snapkv_pooling_spreads_votes_to_neighbours():
    keys = torch.zeros(1, 1, 7, 2)
    keys[0, 0, 2, 0] = 10.0  # only slot 2 is attended
    layer = layer_with(keys, queries=torch.tensor([[[[1.0, 0.0]]]]))
    scores = Stack.parse("snapkv(window_size=1, kernel_size=3)").evictor.score(observe(layer, 3))
    assert scores[0, 0, 1] > scores[0, 0, 4] and scores[0, 0, 3] > scores[0, 0, 4]


def test_random_is_reproducible_and_seeded():
    layer = layer_with(torch.randn(1, 1, 20, 4))
    a = kept(layer, Stack.parse("random(seed=1)").evictor, 5)
    assert a == kept(layer, Stack.parse("random(seed=1)").evictor, 5)
    assert a != kept(layer, Stack.parse("random(seed=2)").evictor, 5)


@pytest.mark.parametrize(
    "spec",
    [
        "nope",
        "snapkv(window_size=0)",
        "streaming(sinks=-1)",
        "h2o(recent=2)",
        "snapkv+streaming",
        "streaming(",
        "knorm(every=0)",
        "",
        "tova(x=1)",
    ],
)
def test_bad_specs_are_one_line_errors(spec):
    with pytest.raises(UserError) as e:
        Stack.parse(spec)
    assert "\n" not in str(e.value)


def test_spec_round_trips():
    stack = Stack.parse("streaming(sinks=2, every=3)")
    assert Stack.parse(str(stack)) == stack


def test_labels_show_only_changed_parameters():
    assert Stack.parse("snapkv").label == "snapkv"
    assert Stack.parse("streaming(sinks=8, decode_window=16)").label == "streaming(sinks=8)"
    assert Stack.parse("streaming(every=1)").label == "streaming(every=1)"  # the paper's cadence, not the default
    assert Stack.parse(Stack.parse("h2o(recent=0.25)").label) == Stack.parse("h2o(recent=0.25)")
