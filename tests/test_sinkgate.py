"""`sinkgate` (Fast KVzip, #44): the sink-attention gate by hand, its fit to a planted teacher, its
file, the definition at prefill (sinks, the newest share, the rest by gate), `kvstack train sinkgate`."""

import math

import pytest
import torch

from kvstack.cache.cache import KVCache
from kvstack.calibrate.store import model_key
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.base import Observation
from kvstack.methods.learned.files import find, write
from kvstack.methods.learned.predictor import load
from kvstack.methods.learned.sink_attention import NAMES, SinkAttention
from kvstack.methods.learned.sinkgate import SinkGate
from kvstack.training.fit import fit_sink_attention, kept_overlap
from kvstack.training.teachers import prefill, student_inputs
from kvstack.training.train import train
from test_cache import prompt
from tiny import tiny_llama


def one_gate(groups: int) -> SinkAttention:
    """One layer, one KV head, F = 2 inputs, rank 2, one sink key: hand-picked weights."""
    return SinkAttention(
        wq=torch.tensor([[[[1.0, 0.0, 0.0, 1.0][: 2 * groups], [0.0, 1.0, 1.0, 0.0][: 2 * groups]]]]),
        bq=torch.zeros(1, 1, 2 * groups),
        wk=torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]]),
        q_scale=torch.ones(1, 1, 2),
        k_scale=torch.full((1, 1, 2), 2.0),
        sinks=torch.tensor([[[[1.0, -1.0]]]]),
        bias=torch.full((1, 1, groups), 0.5),
    )


def test_the_gate_is_the_tokens_share_of_attention_against_the_sinks_by_hand():
    """x = (3, 4): the query RMS(x Wq) = (3, 4) / sqrt(12.5), the key 2 (3, 4) / sqrt(12.5); the
    token's logit k.q / sqrt(2) + 0.5, the sink's (1, -1).q / sqrt(2); p = sigmoid of their difference.
    A second query head (Wq's columns swapped: q = (4, 3) / rms) is averaged as a probability."""
    x = torch.tensor([[[[3.0, 4.0]]]])  # (b, h, t, F)
    rms = 12.5**0.5
    q, k = torch.tensor([3.0, 4.0]) / rms, 2 * torch.tensor([3.0, 4.0]) / rms
    own, sink = float(k @ q) / 2**0.5 + 0.5, float(torch.tensor([1.0, -1.0]) @ q) / 2**0.5
    p = 1 / (1 + math.exp(sink - own))
    keep, drop = one_gate(1).log_keep(0, x)
    assert keep.item() == pytest.approx(math.log(p), abs=1e-5)
    assert drop.item() == pytest.approx(math.log(1 - p), abs=1e-5)
    q2 = torch.tensor([4.0, 3.0]) / rms
    own2, sink2 = float(k @ q2) / 2**0.5 + 0.5, float(torch.tensor([1.0, -1.0]) @ q2) / 2**0.5
    p2 = 1 / (1 + math.exp(sink2 - own2))
    assert one_gate(2).predict(0, x).item() == pytest.approx(math.log((p + p2) / 2), abs=1e-5)


def test_the_fit_learns_a_planted_teacher():
    """A teacher whose score is sigmoid(3 x0 - 2) of a token's first input: the fitted gates rank
    held-out tokens as it does (KVzip's score is in (0, 1), fitted in log as kvstack stores it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 3000, 6, generator=gen)  # (L, h, N, F)
    y = torch.nn.functional.logsigmoid(3 * x[..., 0] - 2)
    gates = fit_sink_attention(x[:, :, :2000], y[:, :, :2000], rank=4, groups=2, sinks=2, steps=300, batch=512, lr=3e-2)
    for layer in range(2):
        predicted = gates.predict(layer, x[layer : layer + 1, :, 2000:])[0]
        assert kept_overlap(predicted, y[layer, :, 2000:], 0.125) > 0.9
        assert (predicted.exp() - y[layer, :, 2000:].exp()).abs().mean() < 0.05  # in the teacher's units


@pytest.fixture(scope="module")
def gated():
    """The tiny Llama and the sinkgate gates the session trained for it (conftest)."""
    model = tiny_llama()
    return model, load(find(model_key(model), "sinkgate"), model_key(model), "sinkgate")


def test_train_writes_sink_attention_the_method_finds_and_a_damaged_file_is_refused(gated, tmp_path):
    model, gates = gated
    assert isinstance(gates, SinkAttention) and gates.meta["teacher"] == "kvzip"
    assert gates.features == "gate" and gates.width == 2 * 16  # key and value, head dim 16
    assert gates.bias.shape[-1] == 2  # the tiny Llama's 4 query heads over 2 KV heads
    path = tmp_path / "gates.safetensors"
    gates.save(path)
    again = load(path, model_key(model), "sinkgate")
    assert all(torch.equal(getattr(again, name), getattr(gates, name)) for name in NAMES)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="damaged"):
        load(path, model_key(model), "sinkgate")
    write(gates.tensors(), {**gates.meta, "network": "gru"}, path, NAMES)
    with pytest.raises(UserError, match="'gru' network this kvstack does not know"):
        load(path, model_key(model), "sinkgate")


def test_the_sinks_and_the_newest_share_are_kept_and_the_rest_by_gate(gated):
    """At prefill each head keeps its 4 sinks, its newest ceil(0.1 x 64) = 7 tokens and, of the
    others, the highest-gated: the definition, with gates computed from a full cache; a token's
    gate is the same in a cache of 40 tokens as in one of 64 (it reads the token alone)."""
    model, gates = gated
    ids, keep = prompt(64, seed=5), 32
    full = prefill(model, torch.tensor(ids))
    cache = KVCache(model, "sinkgate(window=0.1)", f"{keep}t")
    Runner(model, cache).forward(torch.tensor([ids]), torch.ones(1, 64, dtype=torch.long))
    short = prefill(model, torch.tensor(ids[:40]))
    for i, layer in enumerate(cache.layers):
        scores = gates.predict(i, student_inputs(full, "gate")[i][None])[0]  # (h, 64)
        early = SinkGate(window=0, sinks=0).score(
            Observation(short.layers[i], short.layers[i].counts(), None, tables={"sinkgate": gates})
        )
        assert torch.allclose(early[0], scores[:, :40], atol=1e-4)
        for h in range(layer.n_kv_heads):
            held = set(layer.dense_slots()[0, h].tolist())
            always = set(range(4)) | set(range(64 - 7, 64))
            middle = torch.arange(4, 64 - 7)
            best = middle[scores[h, 4 : 64 - 7].argsort(descending=True)[: keep - len(always)]].tolist()
            assert held == always | set(best), (i, h)


def test_a_window_outside_zero_to_one_is_refused_in_one_line():
    for bad in ("sinkgate(window=1.5)", "sinkgate(window=-0.1)"):
        with pytest.raises(UserError, match="window") as err:
            KVCache(tiny_llama(), bad, 0.5)
        assert "\n" not in str(err.value)


def test_kvstack_train_defaults_rebuild_the_shipped_networks(tmp_path):
    """Without --hidden, `train` builds what ships: sinkgate's rank-16 gates, wgkv's 32-wide MLP;
    a sinkgate of rank 0 is refused in one line."""
    model = tiny_llama()
    gates = train(model, "sinkgate", texts=1, held=1, tokens=32, steps=2, out=tmp_path / "s.safetensors").predictor
    assert gates.wk.shape[-1] == 16 and gates.meta["hidden"] == "16"
    mlp = train(model, "wgkv", texts=1, held=1, tokens=32, steps=2, out=tmp_path / "w.safetensors").predictor
    assert mlp.w1.shape[-1] == 32
    with pytest.raises(UserError, match="sinkgate: >= 1") as err:
        train(model, "sinkgate", texts=1, held=1, tokens=32, hidden=0)
    assert "\n" not in str(err.value)
