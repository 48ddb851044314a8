"""`auto`: byte budgets, the rate-distortion solver by hand, plans executed exactly by the cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvstack.cache.budget import Budget, Cost, tokens_to_keep
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.planning.curves import FRACTIONS, head_errors
from kvstack.planning.options import Storage, cost, held_bytes
from kvstack.planning.plan import Plan, decide, rescale, tokens_kept
from kvstack.planning.solve import SHARES, interpolate, share_budget, solve
from kvstack.planning.validate import (
    GRID,
    TIE,
    candidates,
    fact_probes,
    look_alike_keys,
    loss,
    nearest,
    per_probe,
    ranking,
    scored_positions,
    validation_rows,
)
from kvstack.stack import Stack
from tiny import tiny_gemma3

TINY_AUTO = "auto(tokens=256, samples=1, validate=1)"


# ---- byte budgets ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("64MB", 64 * 2**20), ("512KB", 512 * 2**10), ("1.5GB", int(1.5 * 2**30)), ("64MiB", 64 * 2**20)],
)
def test_sizes_parse_in_powers_of_1024_and_print_back(text, nbytes):
    budget = Budget.parse(text)
    assert budget.nbytes == nbytes
    assert Budget.parse(str(budget)) == budget


def test_a_size_resolves_to_the_fraction_of_the_context_at_hand():
    assert Budget.parse("1MB").resolve(4 * 2**20).fraction == 0.25
    assert Budget.parse("1GB").resolve(2**20).fraction == 1.0  # more than the full cache: keep everything


@pytest.mark.parametrize("text", ["64XB", "MB", "-1MB"])
def test_bad_sizes_are_one_line_errors(text):
    with pytest.raises(UserError, match="64MB"):
        Budget.parse(text)


def test_a_byte_budget_holds_for_any_stack(llama):
    ids = torch.randint(0, 97, (1, 200))
    cache = KVCache(llama, "snapkv(window_size=4)", "20KB")
    Runner(llama, cache).forward(ids, torch.ones_like(ids))
    assert cache.nbytes() <= 20 * 1024
    assert cache.nbytes() > 0.9 * 20 * 1024 * cache.layers[0].token_bytes(False) / cache.layers[0].token_bytes()


def test_a_byte_budget_below_the_smallest_cache_names_the_minimum(llama):
    ids = torch.randint(0, 97, (1, 200))
    cache = KVCache(llama, "snapkv(window_size=4)", "1KB")
    with pytest.raises(UserError, match=r"below the smallest cache .* use a budget of at least 4.125KB"):
        Runner(llama, cache).forward(ids, torch.ones_like(ids))  # 4 layers x 2 heads x 4 tokens x 132 bytes


# ---- options and the solver by hand ------------------------------------------------------
def test_held_bytes_by_hand():
    # K4V2 at head_dim 64 in bf16: keys 32 bytes of codes + 64 channels x (scale, zero) fp16 / 32 tokens = 40;
    # values 16 + 2 channel groups x 4 bytes = 24; + a 4-byte slot. 100 kept, residual 0: 96 coded (3 groups)
    storage = Storage.from_text("4/2+r0")
    assert held_bytes(100, storage, 64, 256, 4) == 96 * (40 + 24 + 4) + 4 * (256 + 4)
    assert held_bytes(100, Storage.from_text("4/2+r32"), 64, 256, 4) == 64 * 68 + 36 * 260
    assert held_bytes(100, Storage(), 64, 256, 4) == 100 * 260
    assert str(Storage.parse("4", 32)) == "4+r32" and Storage.from_text("16").plain


def test_turboquant_storage_by_hand():
    """t3 at head_dim 64: 24 bytes of codes + a float16 norm, keys and values alike, + the slot; no
    groups. Tokens are coded 8 at a time while decoding, so the window holds max(residual, 7)
    plain tokens, all of them right after a compression (`kvstack.cache.window`)."""
    storage = Storage.from_text("t3+r0")
    assert storage.rule == "turbo" and str(storage) == "t3+r0" and str(Storage.parse("t4/2", 32)) == "t4/2+r32"
    assert held_bytes(100, storage, 64, 256, 4) == 93 * (26 + 26 + 4) + 7 * 260
    assert held_bytes(100, Storage.from_text("t3+r32"), 64, 256, 4) == 68 * 56 + 32 * 260
    assert cost(storage, 64, 256, 4).kept == 56 and cost(storage, 64, 256, 4).residual == 7
    assert cost(Storage.from_text("t3+r32"), 64, 256, 4).residual == 32
    with pytest.raises(UserError, match="t3"):
        Storage.parse("t16")


def test_interpolation_is_linear_in_log_fraction():
    fractions = torch.tensor([1.0, 0.5, 0.25])
    curve = torch.tensor([[0.0, 1.0, 3.0]])
    at = torch.tensor([[1.0, 0.5, 0.25, 2**-1.5, 2**-0.5, 0.01]])
    assert torch.allclose(interpolate(curve, fractions, at), torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.5, 3.0]]).double())


def _curves(steep: float, flat: float) -> torch.Tensor:
    """(1, 1, 2, 1, F) plain-storage distortion 1 - f, scaled per head."""
    f = torch.tensor(FRACTIONS)
    return torch.stack([steep * (1 - f), flat * (1 - f)])[None, None, :, None, :]


def test_the_lagrangian_gives_the_bytes_to_the_head_that_loses_most():
    n = torch.tensor([1000])
    plain = [Cost(256, 260)]
    half = 0.5 * 2 * 1000 * 256  # half of the two heads' full bytes
    choice = solve(_curves(1.0, 0.01), torch.tensor(FRACTIONS), n, plain, half, 8, torch.tensor([8 * 260 / 256e3]))
    steep, flat = choice.tokens[0].tolist()
    # shares come in steps of 2^(-1/4): the steep head takes the largest that leaves the flat one its
    # floor (2^(-1/4) -> 827 tokens at 260 bytes each with the slot), the flat head what is left (2^(-11/4))
    assert choice.share[0].tolist() == pytest.approx([2**-0.25, 2**-2.75], rel=1e-6)
    assert (steep, flat) == (827, 146)
    spent = float((choice.share.double() * 1000 * 256).sum())
    assert spent <= half and spent > 0.97 * half  # the bisection and the greedy fill spend the budget
    swapped = solve(_curves(0.01, 1.0), torch.tensor(FRACTIONS), n, plain, half, 8, torch.tensor([8 * 260 / 256e3]))
    assert swapped.tokens[0].tolist() == [flat, steep]


def test_each_layer_takes_the_scorer_with_less_distortion():
    good, bad = _curves(0.1, 0.1), _curves(1.0, 1.0)
    curves = torch.cat([torch.cat([bad, good], 1), torch.cat([good, bad], 1)], 0)  # (2 scorers, 2 layers, ...)
    n = torch.tensor([1000, 1000])
    choice = solve(curves, torch.tensor(FRACTIONS), n, [Cost(256, 260)], 0.25 * 4 * 1000 * 256, 8, torch.zeros(2))
    assert choice.scorer.tolist() == [1, 0]


def test_coarser_storage_is_chosen_when_it_loses_less_than_the_tokens_it_frees():
    f = torch.tensor(FRACTIONS)
    plain_curve = 1 - f  # a token dropped costs 1/n
    quantized = 0.001 + (1 - f)  # storing at 4 bits costs almost nothing
    curves = torch.stack([plain_curve, quantized])[None, None, None]  # (1, 1, 1, 2, F)
    costs = [Cost(256, 260), Cost(256, 64 + 4, 31, 260)]
    choice = solve(curves, f, torch.tensor([2048]), costs, 0.125 * 2048 * 256, 8, torch.zeros(1))
    assert choice.storage.item() == 1 and choice.tokens.item() > 2 * 0.125 * 2048


def test_rescaled_shares_hold_the_budget_between_floor_and_one():
    shares = torch.tensor([[0.5, 0.01], [0.2, 0.2]])
    n = torch.tensor([100, 10])
    out = rescale(shares, n, 0.5 * 100 * 2 * 8 + 0.5 * 10 * 2 * 8, 8, torch.tensor([0.05, 0.05]))
    assert float((out * n[:, None] * 8).sum()) == pytest.approx(0.5 * 110 * 2 * 8, rel=1e-6)
    assert float(out.min()) >= 0.05 and float(out.max()) <= 1.0


def test_head_errors_measure_the_attention_output_by_hand():
    # one query that attends to one of three tokens: keeping that token costs nothing, dropping it everything
    keys = torch.tensor([[10.0, 0.0], [0.0, 10.0], [0.0, -10.0]])
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    query = torch.tensor([[10.0, 0.0]])
    where = __import__("kvstack.cache.encoded", fromlist=["Where"]).Where(0, 0, "key")
    keep_first = torch.tensor([3.0, 1.0, 0.0])
    keep_last = torch.tensor([0.0, 1.0, 3.0])
    errors = head_errors(query, keys, values, [keep_first, keep_last], [Storage()], 1.0, 1, where)
    one_token = FRACTIONS.index(0.25)  # round(0.25 x 3) = 1 token
    errors = errors[..., 0]  # one probe
    assert errors[0, 0, one_token] < 1e-6
    assert errors[1, 0, one_token] == pytest.approx(1.0, abs=1e-4)  # output (1, 0) becomes (0, 0)
    assert errors[:, 0, 0].abs().max() < 1e-6  # everything kept at full precision


# ---- the plan, executed by the cache -----------------------------------------------------
def _prefill(model, spec, budget, n=600, batch=1):
    ids = torch.randint(0, 97, (batch, n), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model, spec, budget)
    runner = Runner(model, cache)
    runner.forward(ids, torch.ones_like(ids))
    return cache, runner


LEARNED_AUTO = "auto(tokens=256, samples=1, validate=1, scorers=('kvzap', 'retention'))"


@pytest.mark.parametrize("budget", [0.25, 0.125])
@pytest.mark.parametrize(
    "spec", [TINY_AUTO, "auto(tokens=256, samples=1, validate=1, bits=('16', 't3', 't2'))", LEARNED_AUTO]
)
def test_plan_bytes_equal_the_measured_bytes(tiny, budget, spec):
    cache, _ = _prefill(tiny, spec, budget)
    if spec == LEARNED_AUTO:  # the cache hands the learned scorers their predictors
        assert {"kvzap", "retention"} <= set(cache.policy.tables)
    assert cache.plan.total_bytes == cache.nbytes()
    assert cache.nbytes() <= budget * cache.full_nbytes()
    assert cache.plan.full_bytes == cache.full_nbytes()


def test_curves_over_learned_scorers_are_named_by_their_predictors(llama):
    learned, plain = Stack.parse(LEARNED_AUTO).stages[0], Stack.parse(TINY_AUTO).stages[0]
    assert plain.kind_for(llama) == plain.kind  # no predictor: the shipped curves' names stay
    assert learned.kind_for(llama) != learned.kind


def test_the_plan_for_a_length_is_what_the_cache_decides(tiny):
    cache, _ = _prefill(tiny, TINY_AUTO, 0.125)
    planned = Stack.parse(TINY_AUTO).stages[0].plan_for(tiny, Budget.parse(0.125), 600)
    assert planned.tokens == cache.plan.tokens and planned.storages == cache.plan.storages
    assert planned.total_bytes == cache.nbytes()


def test_a_plan_is_solved_once_per_budget_and_rescaled_to_each_context(tiny, monkeypatch):
    """The decision at the reference length is pure: caches of other lengths at the same budget
    reuse it (one solve), and hold what a fresh solve for their length gives."""
    from kvstack.planning import auto

    solved = []
    original = auto.Auto.solve
    monkeypatch.setattr(auto, "_SOLVED", {})
    monkeypatch.setattr(auto.Auto, "solve", lambda self, *args: solved.append(1) or original(self, *args))
    _prefill(tiny, TINY_AUTO, 0.125, n=600)  # measures the model (its validation solves too), then decides
    solved.clear()
    shorter, _ = _prefill(tiny, TINY_AUTO, 0.125, n=500)
    assert not solved
    monkeypatch.setattr(auto, "_SOLVED", {})
    fresh = Stack.parse(TINY_AUTO).stages[0].plan_for(tiny, Budget.parse(0.125), 500)
    assert len(solved) == 1 and fresh.tokens == shorter.plan.tokens and fresh.storages == shorter.plan.storages
    assert shorter.plan.chosen == fresh.chosen


def test_queries_are_kept_only_while_the_plan_may_read_them(tiny):
    """auto's candidates include snapkv, so the cache keeps the last queries; once the plan is
    decided without a scorer that reads them, decoding steps stop copying them."""
    from dataclasses import replace

    cache, runner = _prefill(tiny, TINY_AUTO, 0.125)
    planner = cache.policy.shares.planner
    for scorers, reads in ((["snapkv"], True), (["kvzip"], False)):
        planner.plan = replace(planner.plan, scorers=scorers * len(cache.layers))
        planner.__dict__.pop("query_window", None)
        before = [layer.query_slots.clone() for layer in cache.layers]
        runner.forward(torch.randint(0, 97, (1, 1)), torch.ones(1, 1, dtype=torch.long))
        moved = [not torch.equal(old, layer.query_slots) for old, layer in zip(before, cache.layers, strict=True)]
        assert cache.policy.reads_queries is reads and all(moved) is reads and any(moved) is reads


@pytest.mark.parametrize("spec", [TINY_AUTO, "auto(tokens=256, samples=1, validate=0, bits=('t4',), residuals=(0, 8))"])
def test_the_budget_holds_at_every_decoding_step(tiny, spec):
    """KIVI's groups wait whole; TurboQuant's window empties 8 at a time (`kvstack.cache.window`)."""
    cache, runner = _prefill(tiny, spec, 0.125)
    for _ in range(64):
        runner.forward(torch.randint(0, 97, (1, 1)), torch.ones(1, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.125 * cache.full_nbytes()


@pytest.mark.parametrize("budget", [0.0625, 0.125, 0.5])
def test_a_plans_tokens_per_head_only_grow_with_the_length(llama, budget):
    """What lets a cache under `auto` skip its checks while decoding (`shares_only_grow`): at a
    fraction, with every layer holding the whole context, each head's tokens under the plan never
    fall as the context grows."""
    cache, _ = _prefill(llama, TINY_AUTO, budget, n=1200)
    plan, layers = cache.plan, cache.layers
    per_token = len(layers) * layers[0].n_kv_heads * layers[0].token_bytes(explicit_slots=False)
    lengths = range(60, 2000)
    tokens = [torch.tensor(plan.at(torch.full((len(layers),), n), budget * n * per_token).tokens) for n in lengths]
    for before, after in zip(tokens, tokens[1:], strict=False):
        assert bool((after >= before).all())


def test_a_plan_over_sliding_layers_is_checked_at_every_step():
    """A sliding layer's room stops at its window while the budget grows with the context, so
    its share under the plan may fall (a tiny Gemma 3 at 0.125: 15 tokens, then 8 at 1,250)."""
    cache, _ = _prefill(tiny_gemma3(), TINY_AUTO, 0.125)
    assert not cache.policy.shares_only_grow


def test_skipping_the_checks_under_a_plan_changes_no_decision(llama):
    runs = []
    for look in (False, True):
        cache, runner = _prefill(llama, TINY_AUTO, 0.125)
        if look:
            cache.policy.__dict__["shares_only_grow"] = False  # look at every layer's counts at every step
        g, steps = torch.Generator().manual_seed(2), []
        for _ in range(48):
            logits = runner.forward(torch.randint(0, 97, (1, 1), generator=g), torch.ones(1, 1, dtype=torch.long))
            steps.append((logits, cache.nbytes(), [layer.dense_slots() for layer in cache.layers]))
        runs.append((cache, steps))
    (fast, fast_steps), (slow, slow_steps) = runs
    assert fast.policy.shares_only_grow and fast.compressions == slow.compressions
    for (a, bytes_a, slots_a), (b, bytes_b, slots_b) in zip(fast_steps, slow_steps, strict=True):
        assert torch.equal(a, b) and bytes_a == bytes_b
        assert all(torch.equal(x, y) for x, y in zip(slots_a, slots_b, strict=True))


def test_heads_are_stored_as_the_plan_says(llama, tmp_path):
    cache, _ = _prefill(llama, TINY_AUTO, 0.25)
    plan = cache.plan
    plan.storages = [["2/1+r0", "16"] for _ in plan.storages]  # head 0 coded at K2V1, head 1 plain
    plan.save(tmp_path / "p.json")
    forced, _ = _prefill(llama, f"plan:{tmp_path / 'p.json'}", 0.25)
    for layer in forced.layers:
        assert [p.keys.codec.bits for p in layer.coded[0]] == [2] and [p.values.codec.bits for p in layer.coded[0]] == [
            1
        ]
        assert layer.coded[1] == []
    assert forced.nbytes() <= 0.25 * forced.full_nbytes()


def test_a_saved_plan_reproduces_the_cache(tiny, tmp_path):
    cache, _ = _prefill(tiny, TINY_AUTO, 0.125)
    cache.plan.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["scorers"] == cache.plan.scorers
    again, _ = _prefill(tiny, f"plan:{tmp_path / 'p.json'}", 0.125)
    assert again.nbytes() == cache.nbytes()
    assert [layer.counts().tolist() for layer in again.layers] == [layer.counts().tolist() for layer in cache.layers]


@pytest.mark.parametrize("budget", [1.0, "1GB"])
def test_a_budget_that_pays_for_everything_reproduces_the_full_cache(tiny, budget):
    """At 1.0 the cache never plans; a byte budget above the full cache goes through the plan,
    which then keeps every token in the model's dtype (no slot, no code)."""
    ids = torch.randint(0, 97, (1, 120))
    full = tiny(ids, past_key_values=KVCache(tiny)).logits
    cache = KVCache(tiny, TINY_AUTO, budget)
    assert torch.equal(full, tiny(ids, past_key_values=cache).logits)
    assert cache.nbytes() == cache.full_nbytes()
    planned = Stack.parse(TINY_AUTO).stages[0].plan_for(tiny, Budget.parse("1GB"), 120)
    assert planned.total_bytes == planned.full_bytes
    assert {s for row in planned.storages for s in row} == {"16"}  # what the cache holds: nothing coded


@pytest.mark.parametrize(("spec", "budget"), [(TINY_AUTO, 0.125), ("snapkv(window_size=4)", "24KB")])
def test_a_padded_batch_keeps_each_row_as_alone(llama, spec, budget):
    """Rows of 300 and 200 tokens (left-padded): each keeps what it keeps alone; a byte budget is
    per sequence."""
    rows = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (300, 200)]
    alone = []
    for row in rows:
        cache = KVCache(llama, spec, budget)
        Runner(llama, cache).forward(row[None], torch.ones(1, len(row), dtype=torch.long))
        alone.append(([layer.counts()[0].tolist() for layer in cache.layers], cache.nbytes()))
    together = KVCache(llama, spec, budget)
    ids = torch.zeros(2, 300, dtype=torch.long)
    mask = torch.zeros(2, 300, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, 300 - len(row) :], mask[b, 300 - len(row) :] = row, 1
    Runner(llama, together).forward(ids, mask)
    for b in range(2):
        assert [layer.counts()[b].tolist() for layer in together.layers] == alone[b][0]
    if isinstance(budget, str):
        assert all(nbytes <= 24 * 1024 for _, nbytes in alone)


def test_sliding_layers_are_planned_over_their_window():
    from tiny import tiny_gemma3

    model = tiny_gemma3()
    cache, _ = _prefill(model, TINY_AUTO, 0.25)
    types = model.config.layer_types
    held = [15 if t == "sliding_attention" else 600 for t in types]  # window 16 holds 15 earlier tokens
    assert cache.plan.held == held


# ---- calibration and errors --------------------------------------------------------------
def test_curves_and_validation_are_measured_once_and_saved(llama, tmp_path, monkeypatch):
    from kvstack.calibrate import store

    monkeypatch.setenv("KVSTACK_CALIBRATION", str(tmp_path))
    store.forget()
    stage = Stack.parse("auto(tokens=128, samples=1, validate=1, scorers=('snapkv',), bits=('16', '4'))").stages[0]
    measured = stage.prepare(llama)
    curves, losses = measured.curves, measured.losses
    assert curves.shape == (1, 4, 2, len(stage.storages), len(FRACTIONS))
    assert losses.shape == (len(GRID), len(stage.choices), 2, 2)  # per probe (continuation, 1 fact): KL, agreement
    assert len(list(tmp_path.iterdir())) == 2  # the curves and the validation, apart
    assert torch.all(curves[..., 0, 0] == 0)  # everything kept in full precision: no distortion
    assert torch.isinf(losses[-1, ..., 0]).all()  # 1/64 of 128 tokens is under `least`: every candidate refused
    assert torch.isfinite(losses[0]).all() and bool((losses[0, ..., 0] > 0).all())
    assert bool(((losses[0, ..., 1] >= 0) & (losses[0, ..., 1] <= 1)).all())
    store.forget()
    again = stage.prepare(llama)  # read back from disk
    assert torch.equal(again.curves, curves) and torch.equal(again.losses, losses)


def test_candidates_are_every_scorer_subset_then_every_uniform_stack():
    found = candidates(("kvzip", "snapkv"), ("16", "4+r0"), 0.8)
    assert [str(c) for c in found] == [
        "rate-distortion over kvzip",
        "rate-distortion over snapkv",
        "kvzip at 16 in every head",
        "kvzip at 4+r0 in every head",
        "snapkv at 16 in every head",
        "snapkv at 4+r0 in every head",
    ]
    assert [c.uniform for c in found] == [0.8] * 2 + [1.0] * 4
    mixed = candidates(("kvzip", "snapkv"), ("16", "4+r0"), 0.8, mix=True)
    assert [str(c) for c in mixed[:3]] == [
        "rate-distortion over kvzip+snapkv",  # each layer its own scorer
        "rate-distortion over kvzip",
        "rate-distortion over snapkv",
    ]


@pytest.mark.parametrize(("fraction", "grid"), [(0.7, 0.5), (0.3, 0.25), (0.09, 0.125), (0.08, 0.0625), (1e-3, 1 / 64)])
def test_a_budget_is_validated_at_the_nearest_grid_point_in_log_scale(fraction, grid):
    assert GRID[nearest(fraction, GRID)] == grid


def test_candidates_rank_by_agreement_then_kl_within_a_tie_and_refused_ones_last():
    table = torch.tensor(  # (C=4, P=2, (KL, agreement)); loss: a quarter the first probe, the rest the second
        [
            [[0.2, 0.5], [0.2, 0.5]],  # the lowest KL, but the fewest answers agree: last of those that fit
            [[0.5, 0.8], [0.5, 0.8]],  # the best agreement
            [[0.3, 0.79], [0.3, 0.79]],  # within TIE of it: a tie, and the lower KL wins it
            [[math.inf, 1.0], [math.inf, 1.0]],  # refused
        ],
        dtype=torch.float64,
    )
    assert ranking(table).tolist() == [2, 1, 0, 3]
    table[2, :, 1] = 0.8 - TIE - 0.01  # no longer a tie: agreement decides
    assert ranking(table).tolist() == [1, 2, 0, 3]


def test_validation_scores_the_code_a_fact_probe_predicts():
    # a continuation of 5 ids scores its 4 next-token predictions; a fact probe of 7 ids
    # ending in a code of 3 scores the predictions of those 3 (positions 8, 9, 10 of 12)
    positions = scored_positions([torch.zeros(5), torch.zeros(7)], [4, 3])
    assert [p.tolist() for p in positions] == [[0, 1, 2, 3], [8, 9, 10]]


def test_fact_probes_write_keyed_facts_and_ask_for_them_by_key():
    def encode(text):  # one id per character
        return [ord(c) for c in text]

    row = torch.arange(1000, 1000 + 544)  # 512 context ids and a continuation of 32
    context, probes, answers = fact_probes(row, 512, encode, torch.Generator().manual_seed(0))
    assert probes[0].tolist() == row[512:].tolist() and answers[0] == 31
    assert len(probes) == 1 + 4  # one fact per 128 tokens, at even intervals
    text = "".join(chr(i) if i < 1000 else "_" for i in context.tolist())
    keys = []
    for at, probe, n in zip((102, 204, 307, 409), probes[1:], answers[1:], strict=True):
        asked = "".join(map(chr, probe.tolist()))
        name, what = asked.split("What is ")[1].split("?")[0].split("'s ")
        what = what.removesuffix(" code")
        code = asked[-n:]
        assert n == 7 and code[0] == " " and code[1:].isdigit()
        assert asked == f"\n\nWhat is {name}'s {what} code? {name}'s {what} code is{code}"
        assert text[at:].startswith(f" {name}'s {what} code is{code}.")
        keys.append((name, what))
    # every fact has its own key, and look-alikes: two owners, each with the same two things
    assert len(set(keys)) == 4
    assert len({k[0] for k in keys}) == 2 and len({k[1] for k in keys}) == 2
    assert context[:102].tolist() == row[:102].tolist()  # the prose around the facts is the row's

    # no tokenizer (tiny models): a fact is random key ids then code ids, asked by its key, and
    # keys share their halves as the words do
    context, probes, answers = fact_probes(row, 512, None, torch.Generator().manual_seed(0))
    assert answers[1:] == [6] * 4 and all(len(p) == 10 for p in probes[1:])
    for at, probe in zip((102, 204, 307, 409), probes[1:], strict=True):
        assert context[at : at + 10].tolist() == probe.tolist()
    keys = [tuple(p[:4].tolist()) for p in probes[1:]]
    assert len(set(keys)) == 4 and len({k[:2] for k in keys}) == 2 and len({k[2:] for k in keys}) == 2


def test_look_alike_keys_pair_each_owner_with_the_same_things():
    keys = look_alike_keys(8, torch.Generator().manual_seed(3))
    owners, things = {o for o, _ in keys}, {t for _, t in keys}
    assert len(set(keys)) == 8 and len(owners) == 4 and len(things) == 2
    assert set(keys) == {(o, t) for o in owners for t in things}
    assert len(look_alike_keys(3, torch.Generator().manual_seed(3))) == 3  # an odd count: one pair left out


def test_a_fact_agrees_up_to_its_first_wrong_token_the_continuation_token_by_token():
    kl = torch.tensor([0.1, 0.2, 0.3, 1.0, 1.0, 1.0, 2.0, 2.0])
    agree = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    at = (torch.arange(0, 3), torch.arange(3, 6), torch.arange(6, 8))  # continuation, two facts
    out = per_probe(kl, agree, at)
    assert out[:, 0].tolist() == pytest.approx([0.2, 1.0, 2.0])
    # the continuation: 2 of 3 agree; a fact right for 2 tokens then wrong: 2 of 3 (greedy stops
    # there); a fact wrong at its first token: 0, though teacher forcing agreed on its second
    assert out[:, 1].tolist() == pytest.approx([2 / 3, 2 / 3, 0.0])


def test_validation_rows_alternate_prose_and_filler_after_the_models_bos(llama, monkeypatch):
    from kvstack.bench.tasks.ruler import NOISE
    from kvstack.calibrate import prose

    def encode(text):  # one id per character
        return [ord(c) for c in text]

    monkeypatch.setattr(llama, "_kvstack_encode", encode, raising=False)
    monkeypatch.setattr(llama, "_kvstack_prefix", (2,), raising=False)
    monkeypatch.setattr("kvstack.bench.data.state_of_the_union", lambda: ["speech " * 60] * 5)
    rows = validation_rows(llama, 3, 300, skip=1)
    assert [len(r) for r in rows] == [300] * 3
    assert rows[0].tolist() == [2, *encode("speech " * 60)][:300] == rows[2].tolist()  # prose, after BOS
    filler = [2, *(encode(" " + NOISE) * 4)][:300]
    assert rows[1].tolist() == filler  # RULER's filler instead, after BOS too
    assert prose.calibration_ids(llama, 1, 10)[0].tolist() == [2, *encode("speech " * 60)][:10]  # the curves' rows


def test_a_candidates_loss_weighs_the_continuation_a_quarter():
    table = torch.tensor([[[4.0, 0.0], [1.0, 1.0], [3.0, 0.5]]])  # continuation, two facts
    assert loss(table).tolist() == [[0.25 * 4 + 0.75 * 2, 0.75 * 0.75]]


def test_a_candidate_that_keeps_the_full_cache_moves_nothing(llama, monkeypatch):
    from kvstack.planning import validate

    stage = Stack.parse("auto(tokens=128, samples=1, validate=1, scorers=('snapkv',), bits=('16', '4'))").stages[0]
    curves = stage.prepare(llama).curves
    monkeypatch.setattr(validate, "GRID", (1.0,))
    layout = stage.layout(llama, llama.dtype.itemsize, Budget.parse(1.0))

    def stack_of(fraction, choice):
        return Stack((type(stage).executing(stage.solve(curves, choice, fraction, layout)),))

    out = validate.losses(llama, stack_of, stage.choices, 1, 1, 128, stage.needs, stage.query_window)
    assert out.shape == (1, len(stage.choices), 2, 2)  # the continuation and one fact (a row of 128 tokens)
    assert bool((out[..., 0] == 0).all()) and bool((out[..., 1] == 1).all())  # no KL, every top-1 agrees


def test_candidates_executing_the_same_stack_are_run_once_with_the_same_result(llama, monkeypatch):
    from kvstack.planning import validate

    stage = Stack.parse("auto(tokens=128, samples=1, validate=1, scorers=('snapkv',), bits=('16', '4'))").stages[0]
    curves = stage.prepare(llama).curves
    monkeypatch.setattr(validate, "GRID", (0.5, 0.25))
    layout = stage.layout(llama, llama.dtype.itemsize, Budget.parse(1.0))
    first = stage.choices[0]

    def fresh(fraction, choice):  # a new stack per call: every candidate is run
        return Stack((type(stage).executing(stage.solve(curves, first, fraction, layout)),))

    shared = {fraction: fresh(fraction, first) for fraction in validate.GRID}
    runs = []
    probe_table = validate._probe_table
    monkeypatch.setattr(validate, "_probe_table", lambda *a: runs.append(a[1]) or probe_table(*a))
    apart = validate.losses(llama, fresh, stage.choices, 1, 1, 128, stage.needs, stage.query_window)
    assert len(runs) == 2 * len(stage.choices)
    runs.clear()
    once = validate.losses(llama, lambda f, c: shared[f], stage.choices, 1, 1, 128, stage.needs, stage.query_window)
    assert runs == [shared[0.5], shared[0.25]]  # one run per budget
    assert torch.equal(once, apart) and bool(torch.isfinite(once).all())


def test_auto_executes_the_candidate_validated_best_at_the_nearest_budget(llama):
    from kvstack.planning.auto import Calibration

    stage = Stack.parse("auto(tokens=128, samples=1, validate=1, bits=('16', '4'))").stages[0]
    curves = stage.prepare(llama).curves
    uniform = next(i for i, c in enumerate(stage.choices) if str(c) == "snapkv at 4+r32 in every head")
    losses = torch.ones(len(GRID), len(stage.choices), 4, 2, dtype=torch.float64)  # KL 1
    losses[..., 1] = 0.5  # top-1 agreement 0.5
    losses[GRID.index(0.125), uniform] = torch.tensor([0.5, 0.9])  # the uniform stack wins at 1/8 only
    losses[GRID.index(0.125), 0, :, 0] = math.inf  # a refused candidate is never chosen
    losses[GRID.index(0.125), 0, :, 1] = 1.0
    losses[-1, :, :, 0] = math.inf  # nothing fits 1/64: 1/32 is validated instead
    layout = stage.layout(llama, llama.dtype.itemsize, Budget.parse(0.1))
    n = torch.full((4,), 128)
    plan = stage.decide(Calibration(curves, losses), n, 0.1, layout)
    assert plan.scorers == ["snapkv"] * 4
    assert {s for row in plan.storages for s in row} == {"4+r32"}
    assert plan.chosen.startswith("snapkv at 4+r32 in every head: KL 0.500, top-1 agreement 0.900")
    best = "best plan: rate-distortion over snapkv, KL 1.000, top-1 agreement 0.500"  # kvzip's was refused
    assert best in plan.chosen
    at_quarter = stage.decide(Calibration(curves, losses), n, 0.25, layout)
    assert at_quarter.chosen.startswith("rate-distortion over kvzip:")  # ties: the first candidate
    tiny_budget = stage.decide(Calibration(curves, losses), torch.full((4,), 2048), 0.01, layout)
    assert "at 0.03125 of the full bytes" in tiny_budget.chosen


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("auto+kivi", "use it alone"),
        ("pyramid(auto)", "eviction method"),
        ("plan:/nowhere/p.json", "does not exist"),
        ("auto(bits=('3/5',))", "not supported"),
        ("auto(scorers=('kivi',))", "not an eviction method"),
        ("auto(residuals=(-1,))", "residuals"),
    ],
)
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message):
        Stack.parse(spec)


def test_auto_budgets_are_bytes_and_cannot_go_below_its_fewest_tokens(llama):
    with pytest.raises(UserError, match="auto plans bytes"):
        _prefill(llama, TINY_AUTO, "64t")
    with pytest.raises(UserError, match="use a budget of at least"):
        _prefill(llama, TINY_AUTO, "2KB")


def test_decide_refuses_a_budget_below_least_tokens_at_full_precision():
    curves = _curves(1.0, 1.0)
    n = torch.tensor([1000])
    with pytest.raises(UserError, match=r"8 tokens per head at full precision, 4.06\d?KB\): use a budget of at least"):
        decide(curves, torch.tensor(FRACTIONS), ["snapkv"], [Storage()], n, 64, 256, 4, 1000.0, 8, budget="1000B")


def test_a_quantizer_alone_cannot_hold_a_byte_budget(llama):
    with pytest.raises(UserError, match="evicts nothing, so it cannot hold a byte budget"):
        KVCache(llama, "kivi(group=16)", "64MB")


def test_a_saved_plan_keeps_its_own_fewest_tokens(llama, tmp_path):
    cache, _ = _prefill(llama, "auto(tokens=256, samples=1, least=2, validate=1)", 0.25)
    cache.plan.save(tmp_path / "p.json")
    assert Stack.parse(f"plan:{tmp_path / 'p.json'}").stages[0].min_tokens == 2


def test_floors_that_do_not_fit_drop_the_uniform_part():
    from kvstack.planning.plan import floor_shares

    n = torch.tensor([15, 15, 15, 15, 15, 2048])  # five short sliding layers and one global
    tight = floor_shares(n, 8, 256, 4, uniform=0.8, budget_bytes=0.02 * float(n.sum()) * 256, heads=1)
    assert torch.allclose(tight, torch.clamp(n, max=8).double() * 260 / (n.double() * 256))
    roomy = floor_shares(n, 8, 256, 4, uniform=0.8, budget_bytes=0.5 * float(n.sum()) * 256, heads=1)
    assert float(roomy[-1]) == pytest.approx(0.4)


def test_the_solver_at_the_whole_budget_keeps_almost_everything_plain():
    n = torch.tensor([1000])
    choice = solve(_curves(1.0, 1.0), torch.tensor(FRACTIONS), n, [Cost(256, 260)], 2 * 1000 * 256, 8, torch.zeros(1))
    assert choice.tokens.min() >= 980  # every share at 1 (the slots its evictions make explicit cost the rest)


def test_shares_grid_reaches_below_one_token_per_thousand():
    assert min(SHARES) < 1e-3 and max(SHARES) == 1.0


def test_a_plan_file_for_another_model_is_refused(llama, tmp_path):
    plan = Plan("x", "0.1", 10, ["snapkv"], [["16"]], [[0.1]], [[1]], [[1.0]], [10], 256, 4, 64, 8)
    plan.save(tmp_path / "p.json")
    with pytest.raises(UserError, match="plan for it with `kvstack plan`"):
        _prefill(llama, f"plan:{tmp_path / 'p.json'}", 0.25)


def test_uniform_one_gives_every_head_the_same_share():
    n = torch.tensor([1000, 1000])
    curves = torch.cat([_curves(1.0, 0.01), _curves(0.5, 0.0)], 1)  # (1, 2 layers, 2 heads, 1, F)
    budget = 0.25 * 4 * 1000 * 256
    plan = decide(curves, torch.tensor(FRACTIONS), ["snapkv"], [Storage()], n, 64, 256, 4, budget, 8, uniform=1.0)
    assert torch.allclose(torch.tensor(plan.shares, dtype=torch.float64), torch.full((2, 2), 0.25, dtype=torch.float64))
    free = decide(curves, torch.tensor(FRACTIONS), ["snapkv"], [Storage()], n, 64, 256, 4, budget, 8, uniform=0.5)
    assert min(map(min, free.shares)) >= 0.125 - 1e-9 and max(map(max, free.shares)) > 0.3


def keep_tokens(share: float, n: int, cost: Cost, least: int) -> int:
    """One head alone: the tokens a byte share pays for at its cost, at least `least`."""
    return max(int(tokens_to_keep(share_budget(share), torch.tensor([n]), cost)[0]), min(least, n))


def test_tokens_kept_per_step_are_each_heads_keep_tokens():
    """The cache asks every step for all heads' tokens at once (`tokens_kept`); it must be what
    `keep_tokens` gives each head alone, with a layer whose shares are all 1 kept whole (`Plan.at`)."""
    g = torch.Generator().manual_seed(0)
    storages = ["16", "4+r0", "2/1+r32", "8+r0"]
    rows = [[storages[(layer + h) % 4] for h in range(3)] for layer in range(5)]
    costs = [[cost(Storage.from_text(text), 64, 256, 4) for text in row] for row in rows]
    fractions = torch.rand(2, 5, 3, generator=g, dtype=torch.float64) * 0.3
    fractions[0, 1] = 1.0  # every head of layer 1 may hold all it has (sequence 0)
    fractions[1, 0, 0] = 1.0  # one plain head of layer 0 at its full share, the others below
    rooms = torch.tensor([[900, 900, 900, 15, 900], [300, 300, 300, 300, 6]])
    got = tokens_kept(fractions, rooms, Cost.table(costs), least=8)
    for b in range(2):
        for layer in range(5):
            n = int(rooms[b, layer])
            whole = float(fractions[b, layer].min()) >= 1.0
            alone = [
                n if whole else keep_tokens(float(fractions[b, layer, h]), n, costs[layer][h], 8) for h in range(3)
            ]
            assert got[b, layer].tolist() == alone
    assert got[0, 1].tolist() == [900] * 3 and got[1, 0, 0] < 300  # alone, a plain head pays for its slots
