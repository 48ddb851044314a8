"""Learned scorers: the predictor by hand, its fit, its file's refusals, `kvzap` in the cache, `kvstack train`."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvstack.cache.cache import KVCache
from kvstack.calibrate.store import model_key
from kvstack.cli import app
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.base import Observation
from kvstack.methods.learned.features import features
from kvstack.methods.learned.files import FORMAT, SHIPPED, find
from kvstack.methods.learned.predictor import Predictor, forward, load
from kvstack.models.rope import rotate
from kvstack.training.fit import fit, kept_overlap
from kvstack.training.teachers import prefill, student_inputs, teacher_scores
from kvstack.training.train import train
from test_cache import prompt, step_logits
from tiny import tiny_llama


def test_a_linear_head_is_a_dot_product_and_an_mlp_head_is_gelu_between_two():
    z = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]])  # (h=1, t=2, F=2)
    w1, b2 = torch.tensor([[[0.5], [-1.0]]]), torch.tensor([0.25])  # linear: (h, F, 1), (h,)
    out = forward(z, w1, torch.zeros(1, 0), torch.zeros(1, 0), b2)
    assert torch.allclose(out, torch.tensor([[0.5 - 2.0 + 0.25, 1.5 + 1.0 + 0.25]]))
    w1 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # MLP of width 2: identity, then GELU, then weights
    b1, w2 = torch.tensor([[0.0, 1.0]]), torch.tensor([[2.0, -1.0]])
    gelu = torch.nn.functional.gelu
    expected = 2 * gelu(z[..., 0]) - gelu(z[..., 1] + 1.0) + 0.25
    assert torch.allclose(forward(z, w1, b1, w2, b2), expected)


def test_the_predictor_standardises_features_with_its_training_statistics():
    mean, std = torch.full((1, 1, 2), 1.0), torch.full((1, 1, 2), 2.0)
    p = Predictor(torch.ones(1, 1, 2, 1), torch.zeros(1, 1, 0), torch.zeros(1, 1, 0), torch.zeros(1, 1), mean, std)
    x = torch.tensor([[[[3.0, 5.0]]]])  # (b, h, t, F)
    assert torch.allclose(p.predict(0, x), torch.tensor([[[(3 - 1) / 2 + (5 - 1) / 2]]]))


def test_kept_overlap_by_hand():
    teacher = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert kept_overlap(teacher, teacher, 0.5) == 1.0
    assert kept_overlap(torch.tensor([[4.0, 0.0, 3.0, 1.0]]), teacher, 0.5) == 0.5  # keeps 0 and 2; teacher 0 and 1
    assert kept_overlap(-teacher, teacher, 0.5) == 0.0


def test_a_linear_fit_recovers_a_planted_linear_score_and_an_mlp_a_nonlinear_one():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2000, 8, generator=g) * 3 + 1  # (L, h, N, F), not standardised
    w = torch.randn(2, 3, 8, generator=g)
    linear = fit(x, (x * w[:, :, None]).sum(-1), hidden=0)
    assert kept_overlap(linear.predict(0, x[0][None])[0], (x[0] * w[0][:, None]).sum(-1), 0.125) > 0.99
    bump = -(x[..., 0] - 1).abs()  # a score no linear function orders: near the mean of feature 0
    mlp = fit(x, bump, hidden=16, steps=300, batch=1000)
    lin = fit(x, bump, hidden=0)
    kept_mlp = kept_overlap(mlp.predict(1, x[1][None])[0], bump[1], 0.25)
    kept_linear = kept_overlap(lin.predict(1, x[1][None])[0], bump[1], 0.25)
    assert kept_mlp > 0.7 and kept_linear < 0.45, (kept_mlp, kept_linear)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A kvzap predictor trained for the tiny Llama (random ids: it has no tokenizer)."""
    model = tiny_llama()
    return model, train(model, texts=3, held=1, tokens=96, hidden=8, steps=60)


def test_train_writes_a_predictor_the_method_finds_with_its_header(trained):
    model, result = trained
    assert result.path == find(model_key(model), "kvzap")
    predictor = load(result.path, model_key(model), "kvzap")
    assert predictor.meta["format"] == FORMAT and predictor.meta["teacher"] == "kvzip"
    assert set(json.loads(predictor.meta["held_out"])) == {"kept@0.125", "kept@0.25"}
    assert predictor.features == "local"  # 4 layers, 2 KV heads; key + value of head dim 16, 4 more, 7 local, squares
    assert predictor.w1.shape == (4, 2, 4 * 16 + 11, 8)


def test_a_predictor_trained_on_the_kv_features_scores_with_them(tmp_path):
    """Files written before the "local" set (no "features" entry, as Qwen2.5-Coder's first kvzap file)
    and files trained with `--features kv` read the key, the value and the four numbers only."""
    from kvstack.methods.learned.kvzap import KVzap

    model = tiny_llama()
    result = train(model, texts=2, held=1, tokens=64, features="kv", out=tmp_path / "kv.safetensors")
    predictor = load(result.path, model_key(model), "kvzap")
    assert predictor.features == "kv" and predictor.w1.shape[2] == 2 * 16 + 4
    assert Predictor(*predictor.tensors().values()).features == "kv"  # no entry: the first set
    cache = prefill(model, torch.tensor(prompt(50, seed=2)))
    layer = cache.layers[1]
    obs = Observation(layer, layer.counts(), None, tables={"kvzap": predictor})
    expected = predictor.predict(1, student_inputs(cache, "kv")[1][None])[0]
    assert torch.allclose(KVzap(sinks=0).score(obs)[0], expected, atol=1e-4)
    with pytest.raises(UserError, match="did you mean local"):
        train(model, texts=2, held=1, tokens=64, features="locale", out=tmp_path / "x.safetensors")


def test_teacher_scores_are_kvzips_reconstruction_scores(trained):
    model, _ = trained
    ids = torch.tensor(prompt(64, seed=4))
    log_scores = teacher_scores(model, ids, "kvzip")
    runner = Runner(model, KVCache(model, "kvzip", 0.5))
    seen = {}
    original = runner.cache.policy.compress_all

    def spy():  # the scores KVzip compresses by, read before the eviction
        for i, layer in enumerate(runner.cache.layers):
            seen[i] = torch.stack([s[0] for s in layer.stats["reconstruction"]])
        original()

    runner.cache.policy.compress_all = spy
    runner.forward(ids[None], torch.ones(1, 64, dtype=torch.long))
    for i, scores in enumerate(log_scores):
        assert torch.allclose(scores, seen[i].clamp(min=1e-6).log(), atol=1e-5)


def test_kvzap_scores_each_token_from_its_key_before_rope_and_its_value(trained):
    model, result = trained
    ids = torch.tensor(prompt(50, seed=2))
    cache = prefill(model, ids)
    inputs = student_inputs(cache)
    predictor = load(result.path, model_key(model), "kvzap")
    layer = cache.layers[1]
    obs = Observation(layer, layer.counts(), None, tables={"kvzap": predictor})
    from kvstack.methods.learned.kvzap import KVzap

    scores = KVzap(sinks=0).score(obs)[0]  # (h, t)
    assert torch.allclose(scores, predictor.predict(1, inputs[1][None])[0], atol=1e-4)
    # the features are the keys RoPE rotated back: rotating them forward again gives the cache's keys
    d = layer.head_keys(0).shape[-1]
    again = rotate(inputs[1][..., :d], torch.arange(50.0).expand(2, -1), layer.inv_freq)
    assert torch.allclose(again, torch.stack([layer.head_keys(h)[0] for h in range(2)]), atol=1e-4)


@pytest.mark.parametrize("name", ["kvzap", "retention", "wgkv", "sinkgate"])
def test_learned_scorers_at_budget_one_are_the_full_cache_and_evict_to_their_budget(trained, name):
    model, _ = trained
    ids, follow = prompt(60, seed=1), prompt(12, seed=5)
    full = step_logits(model, KVCache(model, "full", 1.0), ids, follow)
    assert torch.equal(step_logits(model, KVCache(model, name, 1.0), ids, follow), full)
    for spec in (name, f"adakv({name})", f"chunk({name},size=4)", f"sentence({name})"):
        cache = KVCache(model, spec, 0.25)
        step_logits(model, cache, ids, follow)
        counts, per_head = cache.layers[0].counts(), 0.25 * (60 + 12) + 1  # counts (b, h)
        if spec.startswith("adakv"):  # it moves tokens between a layer's heads
            assert int(counts.sum()) <= counts.shape[1] * per_head, spec
        else:
            assert int(counts.max()) <= per_head, spec


def test_kvzap_without_a_predictor_names_the_command_that_trains_one():
    other = tiny_llama(seed=7)  # another model: nothing trained for it
    with pytest.raises(UserError, match=r"kvstack train kvzap --model") as err:
        KVCache(other, "kvzap", 0.5)
    assert "\n" not in str(err.value)


def test_a_predictor_file_for_another_model_a_newer_format_or_a_flipped_byte_is_refused(trained, tmp_path):
    model, result = trained
    key = model_key(model)
    with pytest.raises(UserError, match="trained for model"):
        load(result.path, "llama-000000000000", "kvzap")
    predictor = load(result.path, key, "kvzap")
    future = tmp_path / "future.safetensors"
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in predictor.tensors().items()}
    save_file(tensors, str(future), metadata={**predictor.meta, "format": "99"})
    with pytest.raises(UserError, match="format '99'"):
        load(future, key, "kvzap")
    data = bytearray(result.path.read_bytes())
    data[-5] ^= 0x40  # a weight's byte
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(data))
    with pytest.raises(UserError, match="damaged"):
        load(flipped, key, "kvzap")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(result.path.read_bytes()[:100])
    with pytest.raises(UserError, match="not a readable predictor"):
        load(cut, key, "kvzap")
    with pytest.raises(UserError, match="not 'other'"):
        load(result.path, key, "other")


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.safetensors")), ids=lambda p: p.stem)
def test_every_shipped_predictor_loads_for_the_model_and_method_its_name_gives(path):
    """Each predictor that ships is the one its name says (model key, method), in this format,
    with tensors matching their recorded hash, reading as many features as its feature set gives."""
    key, method = path.stem.rsplit("-", 1)
    predictor = load(path, key, method)
    assert predictor.meta["model_key"] == key and predictor.meta["method"] == method
    width = predictor.width  # the features it reads, for 64-wide heads (SmolLM2, Qwen2.5-Coder-0.5B)
    assert width == {"kv": 2 * 64 + 4, "local": 4 * 64 + 11, "gate": 2 * 64}[predictor.features]
    if isinstance(predictor, Predictor):  # an MLP standardises what it reads (sink attention RMS-norms it)
        assert predictor.mean.shape[-1] == predictor.std.shape[-1] == width


def test_kvstack_train_cli_trains_resumes_and_refuses_bad_names(tiny_folder, tmp_path):
    runner = CliRunner()
    args = ["train", "kvzap", "--model", str(tiny_folder), "--texts", "2", "--held", "1", "--tokens", "64"]
    args += ["--hidden", "4", "--steps", "5", "--out", str(tmp_path / "p.safetensors")]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "held-out rows" in first.output and (tmp_path / "p.safetensors").exists()
    second = runner.invoke(app, args)  # the teacher's scores are kept: the second run scores nothing again
    assert second.exit_code == 0, second.output
    bad = runner.invoke(app, ["train", "kvzapp", "--model", str(tiny_folder)])
    assert bad.exit_code == 2 and "did you mean kvzap" in bad.output
    bad = runner.invoke(app, ["train", "kvzap", "--model", str(tiny_folder), "--teacher", "kvzipp"])
    assert bad.exit_code == 2 and "did you mean kvzip" in bad.output


def test_context_features_by_hand():
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    x = features(keys, keys)  # (3, 2 + 2 + 4)
    assert torch.allclose(x[:, :2], keys) and torch.allclose(x[:, 2:4], keys)
    s5 = 5**0.5  # anchor (2/3, 1/3): cosines 2/sqrt(5), 2/sqrt(5), 1/sqrt(5); norms over their mean 4/3
    assert torch.allclose(x[:, 4], torch.tensor([2 / s5, 2 / s5, 1 / s5]))
    assert torch.allclose(x[:, 5], torch.tensor([0.75, 0.75, 1.5]).log())
    masked = features(keys, keys, torch.tensor([True, True, False]))  # the anchor and mean norm of the first two
    assert torch.allclose(masked[:, 4], torch.tensor([1.0, 1.0, 0.0]), atol=1e-6)
    assert torch.allclose(masked[:, 5], torch.tensor([1.0, 1.0, 2.0]).log())


def test_local_features_by_hand():
    """The "local" set: "kv", then for the keys and for the values the cosine with the previous
    token, the cosine with the mean of the window before it and the log distance to that mean,
    then the log age, then the squares."""
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    values = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    ages = torch.tensor([3.0, 2.0, 1.0])
    x = features(keys, values, None, ages, "local")  # (3, 4d + 11) with d = 2
    assert x.shape == (3, 4 * 2 + 11) and torch.equal(x[:, :8], features(keys, values))
    # keys: token 0 is its own previous (cosine 1) and has no window (mean 0: cosine 0, distance its norm);
    # token 1 follows [1, 0] (cosine 1, distance 0); token 2 follows [1, 0] twice: mean [1, 0]
    assert torch.allclose(x[:, 8], torch.tensor([1.0, 1.0, 0.0]), atol=1e-6)
    assert torch.allclose(x[:, 9], torch.tensor([0.0, 1.0, 0.0]), atol=1e-6)
    assert torch.allclose(x[:, 10], torch.tensor([1.0, 1e-6, 5**0.5]).log(), atol=1e-5)
    # values: previous of token 1 is [0, 1] (cosine 1/sqrt 2); token 2's window mean is [0.5, 1]
    r2, mean = 2**0.5, torch.tensor([0.5, 1.0])
    assert torch.allclose(x[:, 11], torch.tensor([1.0, 1 / r2, 1 / r2]), atol=1e-6)
    assert torch.allclose(x[2, 12], torch.nn.functional.cosine_similarity(values[2], mean, dim=0))
    assert torch.allclose(x[2, 13], (values[2] - mean).norm().log())
    assert torch.allclose(x[:, 14], ages.log())
    assert torch.equal(x[:, 15:17], keys * keys) and torch.equal(x[:, 17:], values * values)
    # a padded token counts in no window: masking token 1 leaves token 2 with token 0's mean
    masked = features(keys, values, torch.tensor([True, False, True]), ages, "local")
    assert torch.allclose(masked[2, 12], torch.nn.functional.cosine_similarity(values[2], values[0], dim=0))
    with pytest.raises(UserError, match="unknown predictor features"):
        features(keys, values, None, ages, "kvv")


@pytest.mark.slow
def test_training_text_never_appears_in_a_benchmark_haystack():
    """The addresses `kvstack train` learns on (the newest State of the Union rows) share no run of
    12 words with any text a benchmark task draws its contexts from."""
    from kvstack.bench.data import disfl_qa, paul_graham_essays, state_of_the_union
    from kvstack.bench.tasks.needle import python_docs_words
    from kvstack.bench.tasks.ruler import NOISE

    def shingles(words: list[str], n: int = 12) -> set[tuple[str, ...]]:
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    bench = shingles(python_docs_words()) | shingles(NOISE.split())
    for text in paul_graham_essays() + [row["context"] for row in disfl_qa()]:
        bench |= shingles(text.split())
    training = state_of_the_union()[-(16 + 2) :]  # `kvstack train`'s default texts and held-out rows
    shared = [s for text in training for s in shingles(text.split()) if s in bench]
    assert not shared, shared[:3]
    assert len(bench) > 100_000  # the corpora were read
