"""RoPE-aware scorers (dapq, triattention) against hand-computed cases, and the rotation they rely on."""

import math

import pytest
import torch

from helpers import layer_with, observe
from kvstack.methods.evict.dapq import pseudo_queries
from kvstack.methods.evict.triattention import as_complex, trig_scores, zscore
from kvstack.methods.select import select
from kvstack.models.rope import rotate
from kvstack.stack import Stack

QUARTER = torch.tensor([math.pi / 2])  # one frequency: a quarter turn per position


def kept(layer, method, keep):
    obs = observe(layer, keep)
    decision = select(method.score(obs), obs.valid, obs.slots, obs.keep)
    return [decision.index[0, h, : decision.count[0, h]].tolist() for h in range(layer.n_kv_heads)]


def with_rope(keys, queries, inv_freq):
    layer = layer_with(keys, queries=queries)
    layer.inv_freq = inv_freq
    return layer


def test_rotate_round_trips_and_adds_shifts():
    torch.manual_seed(0)
    x, inv_freq = torch.randn(3, 8), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    assert torch.allclose(rotate(rotate(x, 7.0, inv_freq), -7.0, inv_freq), x, atol=1e-5)
    assert torch.allclose(rotate(rotate(x, 3.0, inv_freq), 4.0, inv_freq), rotate(x, 7.0, inv_freq), atol=1e-5)
    # a quarter turn on the pair (0, 1): (1, 0) -> (0, 1)
    assert torch.allclose(rotate(torch.tensor([1.0, 0.0]), 1.0, QUARTER), torch.tensor([0.0, 1.0]), atol=1e-6)


def test_pseudo_queries_sit_at_the_next_positions():
    torch.manual_seed(1)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    pre = torch.randn(1, 2, 3, 8)  # pre-RoPE queries at positions 4, 5, 6; the next token is at 7
    post = rotate(pre, torch.tensor([4.0, 5.0, 6.0]), inv_freq)
    moved = pseudo_queries(post, torch.tensor([3.0, 2.0, 1.0]), inv_freq)
    assert torch.allclose(moved, rotate(pre, torch.tensor([7.0, 8.0, 9.0]), inv_freq), atol=1e-5)


def test_dapq_moving_queries_ahead_changes_the_winner():
    # d = 4, frequencies (pi/2, 0): pair (0, 2) turns a quarter per position, pair (1, 3) never.
    # window of 2 queries at slots 4, 5, both (4, 0, 0, 0); the next token is at 6, so each moves
    # to 6 + i: a shift of 2 positions = a half turn, (4, 0, 0, 0) -> (-4, 0, 0, 0).
    keys = torch.zeros(1, 1, 6, 4)
    keys[0, 0, 0, 0], keys[0, 0, 1, 0] = 1.0, -1.0  # token 0 along the query, token 1 against it
    q = torch.zeros(1, 1, 2, 4)
    q[..., 0] = 4.0
    layer = with_rope(keys, q, torch.tensor([math.pi / 2, 0.0]))
    dapq = Stack.parse("dapq(window_size=2, kernel_size=1)").evictor
    scores = dapq.score(observe(layer, 3))[0, 0]
    # logits of a moved query (scaling 1/2): token 0: -2, token 1: +2, tokens 2..5: 0, all 6 visible;
    # softmax: e^-2 / (e^-2 + e^2 + 4) = 0.01174, e^2 / ... = 0.64115, 1 / ... = 0.08677; two queries vote
    assert torch.allclose(scores[:4], torch.tensor([0.02348, 1.28230, 0.17354, 0.17354]), atol=1e-4)
    assert (scores[4:] == float("inf")).all()  # the real window is kept
    assert kept(layer, dapq, 3) == [[1, 4, 5]]
    # unmoved (snapkv) the same queries prefer token 0
    assert kept(layer, Stack.parse("snapkv(window_size=2, kernel_size=1)").evictor, 3) == [[0, 4, 5]]


def test_triattention_keeps_the_key_in_phase_with_the_next_queries():
    # d = 2, w = pi/2. One query at slot 4 with pre-RoPE (2, 0): post-RoPE turned 4 quarters = (2, 0).
    # Next position T = 5. Only offset o = 1 (max_offset=1): the query sits at 6, phase 6 pi/2 = pi,
    # so a key scores Re(2 e^{i pi} conj(k)) = -2 k_x: the key pointing at phase pi wins.
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [1.0, 0.0]]]])  # (1, 1, 5, 2)
    layer = with_rope(keys, torch.tensor([[[[2.0, 0.0]]]]), QUARTER)
    method = Stack.parse("triattention(window_size=1, recent=1, max_offset=1)").evictor
    obs = observe(layer, 2)
    scores = method.score(obs)[0, 0]
    # raw [-2, 0, 2, 0, -2]: mean -0.4, std sqrt(11.2 / 5) = 1.4967; norm term 0 (one query: m = |centre|)
    assert torch.allclose(scores[:4], torch.tensor([-1.0690, 0.2673, 1.6036, 0.2673]), atol=1e-4)
    assert scores[4] == float("inf")
    assert kept(layer, method, 2) == [[2, 4]]
    # offsets 1, 2, 4, ..., 2^16: c = (e^{i pi/2} + e^{i pi} + 15) / 17 = (14 + i) / 17; at T = 5 the
    # centre is 2 e^{i 5 pi/2} = 2i, so a = 2i (14 + i) / 17 = (-2 + 28i) / 17 and a key scores
    # a_x k_x + a_y k_y: (0, 1) wins with 28/17, as most future distances are whole turns from T
    default = Stack.parse("triattention(window_size=1, recent=1)").evictor
    centre, magnitude = torch.tensor([[0.0 + 2.0j]]), torch.tensor([[2.0]])
    phases = torch.tensor([complex(14, 1) / 17], dtype=torch.complex64)
    raw = trig_scores(centre, magnitude, keys, phases, groups=1)[0, 0, 0]
    assert torch.allclose(raw, torch.tensor([-2.0, 28.0, 2.0, -28.0, -2.0]) / 17, atol=1e-6)
    assert kept(layer, default, 2) == [[1, 4]]


def test_triattention_norm_term_when_the_queries_cancel():
    # pre-RoPE queries (1, 0) and (-1, 0) at positions 3, 4 (w = pi/2: post-RoPE (0, -1) and (-1, 0)):
    # centre 0, mean magnitude 1, so the score is (1 - 0) |k| = |k| and the trig term vanishes
    keys = torch.tensor([[[[3.0, 0.0], [0.0, 1.0], [0.0, -2.0], [0.5, 0.0], [1.0, 1.0]]]])
    q = torch.tensor([[[[0.0, -1.0], [-1.0, 0.0]]]])
    assert torch.allclose(
        rotate(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), torch.tensor([3.0, 4.0]), QUARTER), q[0, 0], atol=1e-6
    )
    layer = with_rope(keys, q, QUARTER)
    centre = torch.zeros(1, 1, 1, dtype=torch.complex64)
    raw = trig_scores(centre, torch.ones(1, 1, 1), keys, torch.ones(1, dtype=torch.complex64), groups=1)[0, 0, 0]
    assert torch.allclose(raw, torch.tensor([3.0, 1.0, 2.0, 0.5, math.sqrt(2)]))
    method = Stack.parse("triattention(window_size=2, recent=0)").evictor
    assert kept(layer, method, 2) == [[0, 2]]  # the two longest keys


def test_triattention_group_takes_the_max_of_z_scores():
    # query head A: [1, 2, 3] -> z [-1.2247, 0, 1.2247]; head B: [30, 10, 20] -> z [1.2247, -1.2247, 0]
    scores = torch.tensor([[[[1.0, 2.0, 3.0], [30.0, 10.0, 20.0]]]])  # (b, h, g, t)
    z = zscore(scores, torch.ones(1, 1, 1, 3, dtype=torch.bool))
    assert torch.allclose(z.amax(dim=2)[0, 0], torch.tensor([1.2247, 0.0, 1.2247]), atol=1e-4)
    # invalid tokens take no part: head A over tokens 0, 1 only -> [-1, 1]
    z = zscore(scores[:, :, :1], torch.tensor([[[[True, True, False]]]]))
    assert torch.allclose(z[0, 0, 0, :2], torch.tensor([-1.0, 1.0]))


def test_triattention_matches_the_reference_formula_with_absolute_positions():
    # the definition: pre-RoPE queries and keys (un-rotated by their positions), amplitude and phase per
    # frequency, cos((T + o - p) w + phi) averaged over offsets, plus the norm term, per query head
    torch.manual_seed(2)
    b, h, g, t, w, d = 1, 2, 2, 12, 4, 8
    inv_freq = 1.0 / 100 ** (torch.arange(0, d, 2) / d)
    keys, q = torch.randn(b, h, t, d), torch.randn(b, h * g, w, d)
    layer = layer_with(keys, queries=q, groups=g)
    layer.inv_freq = inv_freq
    obs = observe(layer, 6)
    method = Stack.parse(f"triattention(window_size={w}, recent=0, max_offset=64)").evictor
    got = method.score(obs)
    q_pre = as_complex(rotate(q, -torch.arange(t - w, t).float(), inv_freq))  # (b, h*g, w, F)
    k_pre = as_complex(rotate(keys, -torch.arange(t).float(), inv_freq))  # (b, h, t, F)
    centre, m = q_pre.mean(2).reshape(b, h, g, 1, -1), q_pre.abs().mean(2).reshape(b, h, g, 1, -1)
    rel = centre * k_pre.conj()[:, :, None]  # (b, h, g, t, F)
    offsets = torch.tensor([1.0, 2, 4, 8, 16, 32, 64])
    dist = t + offsets[:, None] - torch.arange(t).float()[None, :]  # (o, t): T + o - p
    cos = torch.cos(dist[..., None] * inv_freq + rel.angle()[..., None, :, :])  # (b, h, g, o, t, F)
    raw = (rel.abs()[..., None, :, :] * cos).sum(-1).mean(-2) + ((m - centre.abs()) * k_pre.abs()[:, :, None]).sum(-1)
    expected = ((raw - raw.mean(-1, keepdim=True)) / raw.std(-1, unbiased=False, keepdim=True)).amax(2)
    assert torch.allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("spec", ["dapq(window_size=1)", "triattention(window_size=1)"])
def test_unknown_rope_frequencies_are_a_clear_error(spec):
    layer = layer_with(torch.randn(1, 1, 4, 2), queries=torch.randn(1, 1, 1, 2))
    with pytest.raises(ValueError, match="RoPE frequencies are unknown"):
        Stack.parse(spec).evictor.score(observe(layer, 2))


@pytest.mark.parametrize("spec", ["dapq(window_size=0)", "dapq(kernel_size=2)", "triattention(recent=-1)"])
def test_bad_parameters_are_refused(spec):
    with pytest.raises(Exception, match=r"dapq|triattention"):
        Stack.parse(spec)
