"""`wgkv` (Write-Gated KV, #38): the gate's inputs by hand, a gate that never changes once written,
the local window and sinks always held, the rest admitted by gate, `kvstack train wgkv`."""

import pytest
import torch

from kvstack.cache.cache import KVCache
from kvstack.calibrate.store import model_key
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.base import Observation
from kvstack.methods.learned.features import features
from kvstack.methods.learned.files import find
from kvstack.methods.learned.predictor import load
from kvstack.methods.learned.wgkv import WGKV
from kvstack.training.teachers import prefill, student_inputs
from kvstack.training.train import train
from test_cache import prompt
from tiny import tiny_llama


def test_the_gate_reads_the_key_and_the_value_each_over_its_rms():
    keys = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    values = torch.tensor([[1.0, 1.0], [6.0, 8.0]])
    x = features(keys, values, None, None, "gate")  # no ages, no neighbours, no head statistics
    rms = 12.5**0.5  # sqrt((9 + 16) / 2); the second key's: sqrt(4 / 2); the second value's: sqrt(50)
    expected = torch.tensor([[3 / rms, 4 / rms, 1.0, 1.0], [0.0, -(2**0.5), 6 / 50**0.5, 8 / 50**0.5]])
    assert torch.allclose(x, expected, atol=1e-5)
    # a token's inputs are its own: the same whoever stands beside it
    assert torch.equal(features(keys[:1], values[:1], None, None, "gate"), x[:1])


@pytest.fixture(scope="module")
def gated():
    """The tiny Llama and the wgkv predictor the session trained for it (conftest)."""
    model = tiny_llama()
    return model, load(find(model_key(model), "wgkv"), model_key(model), "wgkv")


def test_train_writes_a_gate_predictor_that_reads_the_token_alone(gated):
    model, predictor = gated
    assert predictor.meta["method"] == "wgkv" and predictor.meta["teacher"] == "kvzip"
    assert predictor.features == "gate" and predictor.w1.shape[2] == 2 * 16  # key and value, head dim 16
    with pytest.raises(UserError, match="wgkv learns 1 output"):
        train(model, "wgkv", "decay", texts=1, held=1, tokens=64)


def test_a_tokens_gate_never_changes_once_written(gated):
    """Scores of the same tokens in a cache of 40 and of 70 tokens, and after half of them were
    evicted: the gate reads nothing but the token."""
    model, predictor = gated
    ids = prompt(70, seed=3)
    short, long = prefill(model, torch.tensor(ids[:40])), prefill(model, torch.tensor(ids))
    method = WGKV(window=0, sinks=0)
    tables = {"wgkv": predictor}
    for i in (0, 2):
        a = method.score(Observation(short.layers[i], short.layers[i].counts(), None, tables=tables))
        b = method.score(Observation(long.layers[i], long.layers[i].counts(), None, tables=tables))
        assert torch.allclose(a, b[..., :40], atol=1e-5)
        by_hand = predictor.predict(i, student_inputs(long, "gate")[i][None])
        assert torch.allclose(b, by_hand, atol=1e-4)
    cache = KVCache(model, "wgkv(window=0,sinks=0)", 0.5)
    Runner(model, cache).forward(torch.tensor([ids]), torch.ones(1, 70, dtype=torch.long))
    layer = cache.layers[2]
    kept = layer.dense_slots()  # (1, h, t) the slots each head admitted
    again = method.score(Observation(layer, layer.counts(), None, tables=tables))
    full = method.score(Observation(long.layers[2], long.layers[2].counts(), None, tables=tables))
    assert torch.allclose(again, torch.gather(full, -1, kept), atol=1e-4)


def test_the_window_and_sinks_are_held_and_the_rest_admitted_by_gate(gated):
    """At prefill, each head holds its 4 sinks, its 8 newest tokens (the local cache) and, of the
    others, those of highest gate: the definition, with gates computed from a full cache. A token
    repeated in the prompt has the same gate at layer 0, so ties are taken either way."""
    model, predictor = gated
    ids, keep = prompt(64, seed=5), 32
    full = prefill(model, torch.tensor(ids))
    cache = KVCache(model, "wgkv(window=8)", f"{keep}t")  # a token budget: keep tokens per head
    Runner(model, cache).forward(torch.tensor([ids]), torch.ones(1, 64, dtype=torch.long))
    for i, layer in enumerate(cache.layers):
        gates = predictor.predict(i, student_inputs(full, "gate")[i][None])[0]  # (h, 64)
        for h in range(layer.n_kv_heads):
            held = set(layer.dense_slots()[0, h].tolist())
            always = set(range(4)) | set(range(56, 64))
            admitted = sorted(held - always)
            left = sorted(set(range(4, 56)) - held)
            assert always <= held and len(admitted) == keep - len(always), (i, h)
            assert float(gates[h, admitted].min()) >= float(gates[h, left].max()) - 1e-6, (i, h)


def test_a_window_larger_than_the_budget_keeps_the_newest_that_fit(gated):
    model, _ = gated
    cache = KVCache(model, "wgkv(window=40,sinks=0)", "16t")
    Runner(model, cache).forward(torch.tensor([prompt(64, seed=6)]), torch.ones(1, 64, dtype=torch.long))
    for layer in cache.layers:
        counts = layer.counts()
        assert int(counts.max()) <= 16
        slots = layer.dense_slots()[0]
        assert bool((slots >= 64 - 40).all())  # only window tokens: no gated token beats the local cache


def test_a_negative_window_is_refused_in_one_line():
    with pytest.raises(UserError, match="window") as err:
        KVCache(tiny_llama(), "wgkv(window=-1)", 0.5)
    assert "\n" not in str(err.value)
