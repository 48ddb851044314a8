"""Head allocators (razor, headkv, cokv): their budget formulas and measurements by hand, and the
calibration on tiny models (memoised, saved on disk, specific to each model)."""

import pytest
import torch

from kvstack import calibrate
from kvstack.cache.cache import KVCache
from kvstack.cache.compensation import fold
from kvstack.calibrate import heads
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.allocate.base import distribute
from kvstack.methods.allocate.cokv import cokv_weights
from kvstack.methods.allocate.headkv import headkv_weights
from kvstack.methods.allocate.razor import RETRIEVAL_WEIGHT, Razor, retrieval_heads
from kvstack.stack import Stack


@pytest.fixture
def calibration_dir(tmp_path, monkeypatch):
    """Calibrations saved under a fresh folder, the in-process memo empty before and after."""
    monkeypatch.setenv("KVSTACK_CALIBRATION", str(tmp_path / "calibration"))
    calibrate.forget()
    yield tmp_path / "calibration"
    calibrate.forget()


# ---- budget formulas ---------------------------------------------------------------------------
def test_headkv_weights_follow_the_reference_capacity_formula():
    # 2 layers x 2 heads, scores 3, 1, 0, 0: p = 0.75, 0.25, 0, 0; beta 2 -> every head keeps B/2,
    # the pool (B/2) x 4 heads goes 3/4 and 1/4: caps 0.5 + 0.75 x 2 = 2, 0.5 + 0.25 x 2 = 1, 0.5, 0.5
    scores = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    assert headkv_weights(scores, beta=2.0).tolist() == [[2.0, 1.0], [0.5, 0.5]]
    # beta 1.5 (default): weight = p x 4 / 1.5 + 1/3 -> 2.3333, 1.0, 0.3333, 0.3333 (mean 1)
    w = headkv_weights(scores, beta=1.5)
    torch.testing.assert_close(w, torch.tensor([[7 / 3, 1.0], [1 / 3, 1 / 3]], dtype=torch.float64))
    # temp 2 squares the scores first: p = 9/10, 1/10 -> 0.5 + 1.8, 0.5 + 0.2
    torch.testing.assert_close(
        headkv_weights(scores, beta=2.0, temp=2.0), torch.tensor([[2.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    )
    assert headkv_weights(torch.zeros(2, 2), beta=1.5).tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_cokv_weights_shift_by_the_border_value_and_normalise_to_mean_one():
    ssv = torch.tensor([[5.0, -1.0], [1.0, 3.0]])
    # border 1: the smallest (-1) is the zero: c = 6, 0, 2, 4, mean 3 -> 2, 0, 2/3, 4/3
    torch.testing.assert_close(cokv_weights(ssv, 1), torch.tensor([[2.0, 0.0], [2 / 3, 4 / 3]], dtype=torch.float64))
    # border 2: the second smallest (1): c = 4, 0, 0, 2, mean 1.5 -> 8/3, 0, 0, 4/3
    torch.testing.assert_close(cokv_weights(ssv, 2), torch.tensor([[8 / 3, 0.0], [0.0, 4 / 3]], dtype=torch.float64))
    assert cokv_weights(torch.full((2, 2), 0.7), 1).tolist() == [[1.0, 1.0], [1.0, 1.0]]  # all equal: uniform


def test_razor_picks_the_top_induction_heads_and_the_top_echo_heads():
    # 4 layers x 2 heads = 8 heads: induction 0.25 -> 2 heads, echo 0.125 -> 1 head
    induction = torch.tensor([[0.1, 0.9], [0.2, 0.0], [0.7, 0.3], [0.0, 0.1]])  # best: (0,1) 0.9, (2,0) 0.7
    echo = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.5]])  # best: (3,1)
    chosen = retrieval_heads(echo, induction, 0.25, 0.125)
    assert chosen.tolist() == [[False, True], [False, False], [True, False], [False, True]]
    # the echo head already among the induction heads: only 2 retrieval heads
    echo = torch.tensor([[0.0, 0.5], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert int(retrieval_heads(echo, induction, 0.25, 0.125).sum()) == 2
    # the defaults round like the reference: 8 x 0.14 = 1.12 -> 1 induction head, 8 x 0.01 -> no echo head
    assert retrieval_heads(echo, induction, 0.14, 0.01).nonzero().tolist() == [[0, 1]]
    assert int(retrieval_heads(echo, induction, 0.0, 0.0).sum()) == 0


def test_razor_retrieval_heads_get_their_whole_room_and_the_others_share_the_rest():
    # 2 layers x 2 heads, uniform 10 tokens each (total 40), every head holds 30
    table = torch.zeros(2, 2, 2)
    table[1] = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # induction: only head (0, 0) scores
    razor = Razor(induction=0.25, echo=0.0)
    w = razor.head_weights(table)
    assert w.tolist() == [[RETRIEVAL_WEIGHT, 1.0], [1.0, 1.0]]
    counts = distribute(w.view(2, 1, 2), torch.full((2, 1, 2), 10), torch.full((2, 1, 2), 30))
    # the retrieval head keeps its 30; the 10 left go 10/3 each, floored: 3
    assert counts.flatten().tolist() == [30, 3, 3, 3]
    # it cannot have more than the budget: with rooms of 50, after every head's floor of 1 token the
    # retrieval head takes 36 x 1e4 / (1e4 + 3) = 35.99 of the 36 left (floored: 35), the others 0.004
    counts = distribute(w.view(2, 1, 2), torch.full((2, 1, 2), 10), torch.full((2, 1, 2), 50), least=1)
    assert counts.flatten().tolist() == [36, 1, 1, 1]


# ---- measurements by hand ------------------------------------------------------------------------
def test_echo_and_induction_scores_read_the_earlier_copy_and_its_successor():
    # segment 2 repeated: T = 4, rows 2 and 3; row i's echo is column i - 2, induction column i - 1
    w = torch.zeros(1, 1, 4, 4)
    w[0, 0, 2] = torch.tensor([0.6, 0.3, 0.1, 0.0])  # echo 0.6, induction 0.3
    w[0, 0, 3] = torch.tensor([0.1, 0.2, 0.5, 0.2])  # echo 0.2, induction 0.5
    assert heads.echo_induction(w, 2).flatten().tolist() == pytest.approx([0.4, 0.4])  # (0.6+0.2)/2, (0.3+0.5)/2


def test_needle_hits_count_the_top_k_attention_inside_the_needle():
    # one row (5) of T = 6, needle [2, 4), k = 2
    w = torch.zeros(1, 2, 6, 6)
    w[0, 0, 5] = torch.tensor([0.1, 0.05, 0.4, 0.3, 0.1, 0.05])  # top 2: positions 2, 3, both inside
    w[0, 1, 5] = torch.tensor([0.5, 0.05, 0.3, 0.05, 0.05, 0.05])  # top 2: positions 0, 2; only 2 inside
    hits = heads.needle_hits(w, torch.tensor([5]), torch.tensor([2]), 2)
    assert hits.tolist() == pytest.approx([(0.4 + 0.3) / 2, 0.3 / 2])


def test_query_heads_fold_into_their_kv_head():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])  # 4 query heads over 2 KV heads
    assert heads.per_kv_head(scores, 2, "max").tolist() == [3.0, 2.0]
    assert heads.per_kv_head(scores, 2, "mean").tolist() == [2.0, 2.0]


def test_sliced_shapley_of_two_players_is_their_difference():
    # n = 2: every slice size rounds to 1, S = {i}: i gets phi_i - phi_j every time
    phi = torch.tensor([1.0, 3.0], dtype=torch.float64)
    ssv = heads.sliced_shapley(lambda s: float(phi[s].sum()), 2, 4, torch.Generator().manual_seed(0))
    assert heads.slice_sizes(2) == [1]
    assert ssv.tolist() == [-2.0, 2.0]


def test_sliced_shapley_recovers_the_order_of_an_additive_game():
    phi = torch.tensor([0.3, 2.0, -1.0, 0.9, 1.5, 0.0, 2.6, -0.4], dtype=torch.float64)
    ssv = heads.sliced_shapley(lambda s: float(phi[s].sum()), 8, 64, torch.Generator().manual_seed(0))
    assert heads.slice_sizes(8) == [1, 2, 3, 4]
    assert torch.argsort(ssv).tolist() == torch.argsort(phi).tolist()


# ---- calibration on tiny models --------------------------------------------------------------------
def test_calibration_runs_once_and_is_read_back_from_disk(llama, calibration_dir, monkeypatch):
    razor = Razor()
    table = razor.prepare(llama)
    assert table.shape == (2, 4, 2)  # echo and induction per layer and KV head
    saved = list(calibration_dir.glob("*-razor-v1.pt"))
    assert len(saved) == 1 and saved[0].name.startswith(f"{calibrate.model_key(llama)}-")

    def fail(model):
        raise AssertionError("the calibration ran again")

    monkeypatch.setattr(heads, "razor_scores", fail)
    razor.prepare(llama)  # memoised in this process
    calibrate.forget()
    assert torch.equal(Razor().prepare(llama), table)  # read back from disk


def test_calibrations_differ_between_models(calibration_dir):
    from tiny import tiny_llama

    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    assert calibrate.model_key(a) != calibrate.model_key(b)
    assert calibrate.model_key(a) == calibrate.model_key(tiny_llama(seed=0))
    scores = [calibrate.calibrated(m, "headkv-v1", heads.headkv_scores) for m in (a, b)]
    assert scores[0].shape == (4, 2) and not torch.equal(scores[0], scores[1])
    assert float(scores[0].sum()) == pytest.approx(1.0)
    assert len(list(calibration_dir.glob("*-headkv-v1.pt"))) == 2


def test_a_models_calibrations_do_not_depend_on_where_it_was_loaded_from():
    # a packaged model's first load comes from its GGUF, every later one from the converted
    # folder: the same weights must find the same tables (auto's took 20 minutes to measure twice)
    from tiny import tiny_llama

    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    a.config.name_or_path, b.config.name_or_path = "/root/.cache/kvstack/gguf", "/root/.cache/kvstack/models/x"
    assert calibrate.model_key(a) == calibrate.model_key(b)  # b's key is memoised from here on
    with torch.no_grad():
        next(p for n, p in b.named_parameters() if "layers.1.self_attn.q_proj" in n).add_(1e-3)
    assert calibrate.model_key(a) != calibrate.model_key(b)  # a later layer's queries tell models apart too


def test_a_models_key_is_hashed_once_until_its_weights_change(monkeypatch):
    from kvstack.calibrate import store
    from tiny import tiny_llama

    model, hashed = tiny_llama(seed=0), []
    real = store.weights_ident
    monkeypatch.setattr(store, "weights_ident", lambda probes: hashed.append(1) or real(probes))
    first = calibrate.model_key(model)
    assert calibrate.model_key(model) == first and len(hashed) == 1
    with torch.no_grad():  # an in-place change moves the tensor's version: hashed again
        next(p for n, p in model.named_parameters() if "q_proj" in n).mul_(2)
    assert calibrate.model_key(model) != first and len(hashed) == 2
    model._kvstack_prefix = (2,)  # so does a prompt prefix
    assert calibrate.model_key(model) != first and len(hashed) == 3


def test_a_models_calibrations_do_not_depend_on_its_dtype():
    # a CPU without bf16 loads the packaged models in float32: the tables and predictors shipped
    # for the bf16 load must still be found (they were not: `kvzap` had no predictor, `auto` measured)
    from tiny import tiny_llama

    a = tiny_llama(seed=0)
    b = tiny_llama(seed=0).to(torch.bfloat16)
    assert next(a.parameters()).dtype == torch.float32
    assert calibrate.model_key(a) == calibrate.model_key(b)


def test_a_model_read_after_its_bos_has_its_own_calibrations():
    # calibration rows start with the prefix the model's prompts have (Gemma 3's BOS): tables
    # measured without it (garbage for Gemma 3) are not reused
    from tiny import tiny_llama

    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    b._kvstack_prefix = (2,)
    assert calibrate.model_key(a) != calibrate.model_key(b)


def test_calibration_restores_the_kvstack_attention(tiny, calibration_dir):
    heads.razor_scores(tiny, segment=8)
    assert tiny.config._attn_implementation == "kvstack"
    with pytest.raises(RuntimeError, match="boom"):
        with heads.eager_attention(tiny, lambda i, w: (_ for _ in ()).throw(RuntimeError("boom"))):
            tiny(input_ids=torch.tensor([[5, 6, 7]], device=tiny.device), use_cache=False)
    assert tiny.config._attn_implementation == "kvstack"


def test_a_coalition_of_every_head_scores_like_the_full_model(llama):
    # u(N): no head evicts anything, so the log-probability is the plain model's
    g = torch.Generator().manual_seed(0)
    context, needle = heads.needle_prompts(97, 48, g)
    query, answer = needle[:, :-1], needle[:, heads.CUE :]
    with torch.inference_mode():
        full = KVCache(llama)
        llama(input_ids=context, past_key_values=full, use_cache=True)
        everyone = heads.coalition_logprob(llama, full, torch.ones(4, 2, dtype=torch.bool), query, answer)
        nobody = heads.coalition_logprob(llama, full, torch.zeros(4, 2, dtype=torch.bool), query, answer)
        logits = llama(input_ids=torch.cat([context, query], dim=1), use_cache=False).logits
    logp = torch.log_softmax(logits[:, -answer.shape[1] :].float(), dim=-1).gather(-1, answer.unsqueeze(-1))
    assert everyone == pytest.approx(float(logp.mean()), abs=1e-5)
    assert nobody != pytest.approx(everyone, abs=1e-6)
    assert full.layers[0].counts().min() == 48  # the prefilled cache is untouched by the forks


def test_cokv_values_every_kv_head(llama, calibration_dir):
    ssv = heads.cokv_ssv(llama, samples=2, length=48)
    assert ssv.shape == (4, 2) and bool(torch.isfinite(ssv).all()) and len(set(ssv.flatten().tolist())) > 1


def test_a_bare_config_is_refused_with_the_fix(llama):
    for spec in ("razor", "headkv", "cokv"):
        with pytest.raises(UserError, match=r"build the KVCache from the model"):
            KVCache(llama.config, spec, 0.5)


def test_razor_retrieval_heads_keep_the_whole_prompt(llama, calibration_dir):
    cache = KVCache(llama, "razor(induction=0.25, echo=0.0)", 0.5)
    table = cache.policy.calibration[Stack.parse("razor").allocators[0].kind]
    chosen = retrieval_heads(table[0], table[1], 0.25, 0.0)  # 2 of 8 heads
    ids = torch.randint(3, 90, (1, 80), generator=torch.Generator().manual_seed(0)).to(llama.device)
    Runner(llama, cache).forward(ids, torch.ones_like(ids))
    counts = torch.stack([layer.counts()[0] for layer in cache.layers])  # (L, h)
    assert int(chosen.sum()) == 2
    assert bool((counts[chosen] == 80).all()) and bool((counts[~chosen] < 80).all())
    assert cache.nbytes() <= 0.5 * cache.full_nbytes()


def test_headkv_and_cokv_give_heads_different_budgets(llama, calibration_dir):
    ids = torch.randint(3, 90, (1, 80), generator=torch.Generator().manual_seed(0)).to(llama.device)
    for spec in ("headkv(snapkv(window_size=4), beta=1.1)", "cokv(snapkv(window_size=4), samples=2)"):
        cache = KVCache(llama, spec, 0.5)
        Runner(llama, cache).forward(ids, torch.ones_like(ids))
        counts = [r["tokens"][0] for r in cache.stats()]
        assert len(set(counts)) > 2, spec
        assert cache.nbytes() <= 0.5 * cache.full_nbytes()


def test_parameters_are_checked():
    for spec, fix in [
        ("razor(induction=1.5)", "induction must be in"),
        ("headkv(beta=0.5)", "beta must be >= 1"),
        ("cokv(samples=0)", "samples=0 is out of range: give an integer from 1"),
        ("cokv(border=0)", "border must be >= 1"),
    ]:
        with pytest.raises(UserError, match=fix):
            Stack.parse(spec)
    assert Stack.parse("razor").label == "razor(streaming)"
    assert Stack.parse("razor(knorm)").evictor.name == "knorm"


def test_razor_folds_what_a_head_evicts_into_one_compensation_token():
    from helpers import layer_with

    keys = torch.arange(8.0).view(1, 1, 8, 1).expand(1, 1, 8, 2).clone()  # token i has key (i, i)
    values = 10 * keys
    layer = layer_with(keys, values)
    slots = torch.arange(8).view(1, 1, 8)
    dropped = torch.tensor([[[False, True, True, True, True, False, False, False]]])
    keep = torch.tensor([[0, 5, 6, 7]])
    from kvstack.methods.select import Keep

    layer.apply(Keep(index=keep.view(1, 1, 4), count=torch.tensor([[4]])))
    fold(layer, dropped, keys, values, slots)
    # by hand: tokens 1..4 averaged -> key (2.5, 2.5), value 25, at slot 1 between the sink and the recent ones
    assert layer.slots[0][0].tolist() == [0, 1, 5, 6, 7]
    assert layer.keys[0][0, :, 0].tolist() == [0.0, 2.5, 5.0, 6.0, 7.0] and layer.values[0][0, 1, 0] == 25.0
    assert layer.comp_count.tolist() == [[4.0]]
    # evicting 5 and 6 later: the running mean over the six tokens it now stands for, (1+2+3+4+5+6)/6
    dense = layer.dense(layer.keys), layer.dense(layer.values), layer.dense_slots()
    layer.apply(Keep(index=torch.tensor([[[0, 1, 4]]]), count=torch.tensor([[3]])))
    fold(layer, torch.tensor([[[False, False, True, True, False]]]), *dense)
    assert (
        layer.slots[0][0].tolist() == [0, 1, 7]
        and layer.keys[0][0, 1, 0] == 3.5
        and layer.comp_count.tolist() == [[6.0]]
    )


def test_razor_holds_its_budget_with_the_compensation_tokens(llama, calibration_dir):
    ids = torch.randint(3, 90, (1, 80), generator=torch.Generator().manual_seed(0)).to(llama.device)
    cache = KVCache(llama, "razor(induction=0.25, echo=0.0)", 0.25)
    runner = Runner(llama, cache)
    runner.forward(ids, torch.ones_like(ids))
    for t in range(20):
        runner.forward(torch.tensor([[5 + t]]), torch.ones(1, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()  # compensation tokens and their bookkeeping included
    folded = [layer.comp_count for layer in cache.layers if layer.comp_count is not None]
    assert folded and any(bool((c > 0).any()) for c in folded)  # non-retrieval heads folded what they evicted
