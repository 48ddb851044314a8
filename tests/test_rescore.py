"""Re-scorers that wrap another scorer (vatp, graphkv, kvcrush), against hand-computed cases."""

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


def with_attention(keys, values, attention):
    """A one-head layer whose accumulated attention is set by hand, one row per head."""
    layer = layer_with(keys, values)
    for h, row in enumerate(attention):
        layer.add_stat("attention_sum", h, torch.tensor([row], dtype=torch.float32), accumulate=False)
    return layer


# ---- vatp -------------------------------------------------------------------------------------


def test_vatp_multiplies_attention_by_the_value_l1_norm_and_keeps_sinks():
    keys = torch.randn(1, 1, 6, 2)
    values = torch.zeros(1, 1, 6, 2)
    values[0, 0, :, 0] = torch.tensor([0.01, 0.2, 2.0, -1.0, 2.0, 1.0])
    values[0, 0, :, 1] = torch.tensor([0.0, 0.0, 0.0, 0.0, -0.5, 0.0])  # L1 norms 0.01, 0.2, 2, 1, 2.5, 1
    layer = with_attention(keys, values, [[0.1, 0.5, 0.3, 0.4, 0.2, 0.0]])
    method = Stack.parse("vatp(h2o(recent=0.25), sinks=1)").evictor
    scores = method.score(observe(layer, 4))[0, 0]
    # keep 4: h2o's window is floor(4 * 0.25) = 1 token (5, +inf); token 0 is the sink (+inf)
    # the rest: 0.5 * 0.2 = 0.1, 0.3 * 2 = 0.6, 0.4 * 1 = 0.4, 0.2 * 2.5 = 0.5
    assert scores[0] == scores[5] == float("inf")
    assert torch.allclose(scores[1:5], torch.tensor([0.1, 0.6, 0.4, 0.5]))
    assert kept(layer, method, 4) == [[0, 2, 4, 5]]
    assert kept(layer, Stack.parse("h2o(recent=0.25)").evictor, 4) == [[1, 2, 3, 5]]  # attention alone


def test_vatp_keeps_inner_infinities_even_on_zero_values():
    layer = with_attention(torch.randn(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), [[1.0, 2.0, 3.0, 4.0]])
    scores = Stack.parse("vatp(h2o, sinks=0)").evictor.score(observe(layer, 4))[0, 0]
    assert scores.tolist() == [0.0, 0.0, float("inf"), float("inf")]  # h2o's window, 4 * 0.5: never inf x 0 = nan


def test_vatp_composes_with_snapkv():
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]]])
    values = torch.tensor([[[[1.0, 0.0], [1.0, 1.0], [0.1, 0.0], [1.0, 0.0]]]])  # L1 norms 1, 2, 0.1, 1
    layer = layer_with(keys, values, queries=torch.tensor([[[[2.0, 0.0]]]]))
    stack = Stack.parse("vatp(snapkv(window_size=1, kernel_size=1), sinks=0)")
    assert stack.query_window == 1 and stack.needs == frozenset({"attention_sum"})
    # snapkv's votes: softmax([2, 0, 4] / sqrt(2)) over tokens 0..3 (3 = the window, +inf)
    votes = torch.softmax(torch.tensor([2.0, 0.0, 4.0, 0.0]) * 2**-0.5, 0)  # 0.179, 0.043, 0.735, 0.043
    scores = stack.evictor.score(observe(layer, 2))[0, 0]
    assert torch.allclose(scores[:3], votes[:3] * torch.tensor([1.0, 2.0, 0.1]))  # 0.179, 0.087, 0.074
    assert scores[3] == float("inf")
    assert kept(layer, stack.evictor, 2) == [[0, 3]]  # snapkv alone keeps [2, 3]


# ---- graphkv ----------------------------------------------------------------------------------


def graph_layer():
    # keys: 0 = (1, 0); 1 = (1, 0.1), a near-duplicate of 0 (cos 0.995); 2 = (0, 1) (cos 0); 3 = (0.6, 0.8) (cos 0.6)
    keys = torch.tensor([[[[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.6, 0.8]]]])
    return with_attention(keys, None, [[0.5, 0.4, 0.3, 0.1]])


def test_graphkv_decays_the_duplicate_of_the_top_token_below_a_distinct_one():
    layer = graph_layer()
    method = Stack.parse("graphkv(h2o(recent=0), sources=1)").evictor
    scores = method.score(observe(layer, 2))[0, 0]
    # the source is token 0 (0.5, kept); others times (1 - cos): 0.4 * 0.005, 0.3 * 1, 0.1 * 0.4
    cos1 = 1 / 1.01**0.5
    assert torch.allclose(scores, torch.tensor([0.5, 0.4 * (1 - cos1), 0.3, 0.04]), atol=1e-6)
    assert kept(layer, method, 2) == [[0, 2]]
    assert kept(layer, Stack.parse("h2o(recent=0)").evictor, 2) == [[0, 1]]  # the duplicate, without the graph


def test_graphkv_second_round_takes_the_next_sources():
    layer = graph_layer()
    scores = Stack.parse("graphkv(h2o(recent=0), sources=1, rounds=2)").evictor.score(observe(layer, 2))[0, 0]
    # round 2: the source is token 2 (0.3, best non-source); it decays 1 by (1 - 0.0995) and 3 by (1 - 0.8)
    cos1 = 1 / 1.01**0.5
    expected = torch.tensor([0.5, 0.4 * (1 - cos1) * (1 - 0.1 / 1.01**0.5), 0.3, 0.04 * 0.2])
    assert torch.allclose(scores, expected, atol=1e-6)


def test_graphkv_keeps_infinities_and_they_spread_no_decay():
    layer = graph_layer()
    # keep 2, h2o's window = 1: token 3 is +inf; the source is token 0 as before
    scores = Stack.parse("graphkv(h2o, sources=1)").evictor.score(observe(layer, 2))[0, 0]
    assert scores[3] == float("inf") and scores[2] == pytest.approx(0.3)  # (0, 1) is not decayed by (0.6, 0.8)


def test_graphkv_negative_inner_scores_still_decay_downwards():
    keys = torch.tensor([[[[3.0, 0.0], [3.0, 0.3], [0.0, 4.0]]]])  # knorm: -||k|| = -3, -3.015, -4
    scores = Stack.parse("graphkv(knorm, sources=1)").evictor.score(observe(layer_with(keys), 2))[0, 0]
    # shifted by the lowest (-4): 1, 0.985, 0; token 1 decays to 0.985 * (1 - 0.995) -> -4 + 0.0049
    assert scores[0] == pytest.approx(-3.0) and scores[2] == pytest.approx(-4.0)
    assert -4.0 < scores[1] < -3.99


# ---- kvcrush ----------------------------------------------------------------------------------


def test_kvcrush_keeps_top_tokens_and_evenly_spaced_representatives():
    keys = torch.randn(1, 2, 8, 2)
    layer = with_attention(keys, None, [[8, 7, 6, 5, 4, 3, 2, 1], [1, 8, 2, 7, 3, 6, 4, 5]])
    method = Stack.parse("kvcrush(h2o(recent=0), ratio=0.5)").evictor
    # top halves: head 0 -> tokens 0-3, head 1 -> tokens 1, 3, 5, 7; signatures (bit head 0, bit head 1):
    # 0 (1,0) 1 (1,1) 2 (1,0) 3 (1,1) 4 (0,0) 5 (0,1) 6 (0,0) 7 (0,1); Hamming to anchor (0,1):
    # 0: 2, 1: 1, 2: 2, 3: 1, 4: 1, 5: 0, 6: 1, 7: 0
    # keep 4, ratio 0.5: 2 importance picks + 2 representatives
    # head 0: picks 0, 1; the rest by distance 5, 7, 3, 4, 6, 2 -> linspace(0, 5, 2) = ends: 5 and 2
    # head 1: picks 1, 3; the rest by distance 5, 7, 4, 6, 0, 2 -> 5 and 2
    assert kept(layer, method, 4) == [[0, 1, 2, 5], [1, 2, 3, 5]]
    scores = method.score(observe(layer, 4))[0, 0]
    # importance picks 2t + (t - rank), representatives t + (t - rank), the rest t - rank (t = 8)
    assert scores.tolist() == [24.0, 23.0, 14.0, 5.0, 4.0, 11.0, 2.0, 1.0]


def test_kvcrush_spreads_three_representatives():
    layer = with_attention(torch.randn(1, 2, 8, 2), None, [[8, 7, 6, 5, 4, 3, 2, 1], [1, 8, 2, 7, 3, 6, 4, 5]])
    # keep 6, ratio 0.5: head 0 picks 0, 1, 2; the rest sorted 5, 7, 3, 4, 6 -> positions 0, 2, 4 = 5, 3, 6
    assert kept(layer, Stack.parse("kvcrush(h2o(recent=0), ratio=0.5)").evictor, 6)[0] == [0, 1, 2, 3, 5, 6]


def test_kvcrush_signature_meets_heads_by_slot_when_they_hold_different_tokens():
    from kvstack.methods.evict.kvcrush import head_signature

    slots = torch.tensor([[[0, 2, 3], [1, 2, -1]]])  # head 0 holds slots 0, 2, 3; head 1 holds 1, 2
    valid = slots >= 0
    top = torch.tensor([[[True, True, False], [True, False, False]]])
    sig = head_signature(top, slots, valid, 4)
    # slot 0: (1, 0); slot 2: (1, 0); slot 3: (0, 0); slot 1: (0, 1)
    assert sig[0, 0].tolist() == [[1, 0], [1, 0], [0, 0]]
    assert sig[0, 1, :2].tolist() == [[0, 1], [1, 0]]


# ---- specs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "vatp(sinks=-1)",
        "vatp(pyramid(snapkv))",
        "graphkv(sources=0)",
        "graphkv(rounds=0)",
        "graphkv(decay=2)",
        "kvcrush(ratio=1)",
        "kvcrush(anchor='random')",
        "kvcrush(full)",
    ],
)
def test_bad_rescorer_specs_are_one_line_errors(spec):
    with pytest.raises(UserError) as e:
        Stack.parse(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "spec", ["vatp(snapkv(window_size=4))", "graphkv(snapkv(window_size=32), rounds=2)", "kvcrush(h2o, ratio=0.5)"]
)
def test_rescorer_specs_round_trip_and_delegate(spec):
    stack = Stack.parse(spec)
    assert Stack.parse(str(stack)) == stack
    assert stack.query_window == stack.evictor.scorer.query_window
    assert stack.min_tokens >= stack.evictor.scorer.min_tokens
