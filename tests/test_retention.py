"""Learned retention and the future-attention teachers: the statistics by their definition, the
line fit by hand, a fit in the targets' units, `retention`'s scores (in the cache and while
decoding: test_learned.py, with every learned scorer)."""

import pytest
import torch

from kvstack.cache.cache import KVCache
from kvstack.cache.statistics import FLOOR, FUTURE, HORIZON
from kvstack.calibrate.store import model_key
from kvstack.errors import UserError
from kvstack.methods.base import Observation
from kvstack.methods.learned.files import find
from kvstack.methods.learned.predictor import load
from kvstack.methods.learned.retention import Retention, retained
from kvstack.models.rope import rotate
from kvstack.training.fit import fit
from kvstack.training.teachers import future_mean, log_line, prefill, student_inputs, teacher_scores
from kvstack.training.train import train
from test_cache import prompt
from tiny import tiny_gemma3, tiny_llama


def test_log_line_by_hand():
    # token 0: 3 queries with log p = -1 - 0.5 * age; token 1: one query (flat); token 2: none
    ages = torch.tensor([1.0, 2.0, 3.0])
    logs = -1 - 0.5 * ages
    count = torch.tensor([[3.0, 1.0, 0.0]])
    total = torch.tensor([[logs.sum(), -2.0, 0.0]])
    weighted = torch.tensor([[(logs * ages).sum(), -2.0, 0.0]])
    intercept, slope = log_line(count, total, weighted)
    assert torch.allclose(intercept, torch.tensor([[-1.0, -2.0, -2.0]]))  # none: the head's lowest
    assert torch.allclose(slope, torch.tensor([[-0.5, 0.0, 0.0]]))
    mean = future_mean({"future_count": count, "future_log": total})
    assert torch.allclose(mean, torch.tensor([[-2.0, -2.0, -2.0]]))


def test_retained_utility_by_hand_decays_at_its_own_rate_and_never_grows():
    scale, decay = torch.tensor([0.0, -1.0, 0.0]), torch.tensor([-0.5, -0.1, 0.3])
    assert torch.allclose(retained(scale, decay, torch.tensor(2.0)), torch.tensor([-1.0, -1.2, 0.0]))
    # ten tokens later the slow-decaying second token outranks the first
    later = retained(scale, decay, torch.tensor(12.0))
    assert later[1] > later[0]


def test_future_statistics_are_the_attention_of_the_next_queries_by_their_definition():
    model = tiny_llama()
    n = 40
    assert n <= HORIZON
    ids = torch.tensor(prompt(n, seed=3))
    cache = KVCache(model, "full", 1.0, observe=FUTURE, query_window=n)
    from kvstack.generate import Runner

    Runner(model, cache).forward(ids[None], torch.ones(1, n, dtype=torch.long))
    layer = cache.layers[2]
    g = layer.groups
    for h in range(layer.n_kv_heads):
        q, k = layer.queries[0, h * g : (h + 1) * g].float(), layer.head_keys(h)[0].float()  # (g, n, d), (n, d)
        logits = (q @ k.T) * layer.scaling
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(0)  # (query, key)
        log_p = p.clamp(min=FLOOR).log()
        age = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        near = (age >= 1).float()
        assert torch.allclose(layer.stats["future_count"][h][0], near.sum(0))
        assert torch.allclose(layer.stats["future_log"][h][0], (log_p * near).sum(0), atol=1e-3)
        assert torch.allclose(layer.stats["future_log_age"][h][0], (log_p * near * age).sum(0), rtol=1e-4, atol=1e-2)


def test_a_fit_in_the_targets_units_predicts_them_and_a_standardised_one_only_their_order():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 500, 3, generator=gen)
    y = 3.0 + 2.0 * x[..., 0] - 0.5 * x[..., 2]  # (1, 2, 500)
    own = fit(x, y, hidden=0, units=True)
    assert torch.allclose(own.predict(0, x[0][None])[0], y[0], atol=0.02)
    plain = fit(x, y, hidden=0)
    z = plain.predict(0, x[0][None])[0]
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = tiny_llama()
    return model, train(model, "retention", texts=3, held=1, tokens=96, steps=5)


def test_retention_trains_two_outputs_per_head_on_the_decay_teacher(trained):
    model, result = trained
    assert result.path == find(model_key(model), "retention")
    predictor = load(result.path, model_key(model), "retention")
    assert predictor.meta["teacher"] == "decay" and predictor.meta["horizon"] == str(HORIZON)
    assert predictor.w1.shape == (4, 4, 36, 1)  # 2 KV heads x (scale, decay)
    with pytest.raises(UserError, match="use decay"):
        train(model, "retention", "kvzip", texts=1, held=1, tokens=64)
    with pytest.raises(UserError, match="use kvzip, future"):
        train(model, "kvzap", "decay", texts=1, held=1, tokens=64)
    ids = torch.tensor(prompt(50, seed=2))
    decay = teacher_scores(model, ids, "decay")
    assert [t.shape for t in decay] == [(4, 50)] * 4
    future = teacher_scores(model, ids, "future")
    assert [t.shape for t in future] == [(2, 50)] * 4


def test_retention_scores_scale_plus_age_times_decay(trained):
    model, result = trained
    ids = torch.tensor(prompt(50, seed=2))
    cache = prefill(model, ids)
    predictor = load(result.path, model_key(model), "retention")
    layer = cache.layers[1]
    obs = Observation(layer, layer.counts(), None, tables={"retention": predictor})
    scores = Retention(sinks=0).score(obs)[0]  # (h, t)
    outputs = Retention(sinks=0).predicted(obs, outputs=2)[0]  # (2h, t)
    age = 50 - torch.arange(50.0)
    assert torch.allclose(scores, outputs[:2] + age * outputs[2:].clamp(max=0), atol=1e-4)
    assert torch.isinf(Retention().score(obs)[0, :, :4]).all()  # sinks kept
    one_output = load(find(model_key(model), "kvzap"), model_key(model), "kvzap")
    obs = Observation(layer, layer.counts(), None, tables={"retention": one_output})
    with pytest.raises(UserError, match="kvstack train retention"):
        Retention().score(obs)


def test_retention_counts_age_in_real_tokens_so_padding_inside_a_batch_changes_no_score(trained):
    """Row 0 is A, then 3 pads, then B (a chunk left-padded inside the batch); alone it is A B.
    Its tokens' ages, and so their scores, are the same both ways."""
    model, result = trained
    from kvstack.generate import Runner

    predictor = load(result.path, model_key(model), "retention")
    a, b, other = prompt(20, seed=1), prompt(9, seed=2), prompt(12, seed=3)

    def scores(runner: Runner, row: int) -> torch.Tensor:
        layer = runner.cache.layers[1]
        obs = Observation(layer, layer.counts(), runner.cache.seq.token_index(), tables={"retention": predictor})
        return Retention(sinks=0).score(obs)[row][:, obs.valid[row, 0]]  # (h, real tokens)

    alone = Runner(model, KVCache(model, "full", 1.0))
    alone.forward(torch.tensor([a + b]), torch.ones(1, 29, dtype=torch.long))
    batch = Runner(model, KVCache(model, "full", 1.0))
    batch.forward(torch.tensor([a, prompt(20, seed=4)]), torch.ones(2, 20, dtype=torch.long))
    chunk = torch.tensor([[0, 0, 0, *b], other])
    batch.forward(chunk, torch.tensor([[0, 0, 0] + [1] * 9, [1] * 12]))
    assert torch.allclose(scores(batch, 0), scores(alone, 0), atol=1e-4)


def test_student_inputs_of_a_sliding_layer_turn_its_last_tokens_back_by_their_own_positions():
    model = tiny_gemma3()
    cache = prefill(model, torch.tensor(prompt(50, seed=2)))
    inputs = student_inputs(cache)
    sliding = next(i for i, layer in enumerate(cache.layers) if layer.is_sliding)
    layer, x = cache.layers[sliding], inputs[sliding]
    held = x.shape[1]
    assert held < 50  # the window holds the row's last tokens only
    d = layer.head_keys(0).shape[-1]
    positions = torch.arange(50.0 - held, 50.0).expand(x.shape[0], -1)
    again = rotate(x[..., :d], positions, layer.inv_freq)
    assert torch.allclose(again, torch.stack([layer.head_keys(h)[0] for h in range(x.shape[0])]), atol=1e-4)
    assert torch.allclose(x[..., 2 * d + 10], (50.0 - positions).log())  # their ages up to the next query
