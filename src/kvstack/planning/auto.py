"""`auto`: one byte budget, the stack chosen per layer and head by rate-distortion allocation,
then checked end to end.

Per KV head how many tokens to keep and at what precision (plain, or keys/values at 8, 4, 2 or
1 bits after a residual window), by a Lagrangian over distortion curves measured once per
model on prose with recall probes (`kvstack.planning`); every head keeps at least `uniform`
(0.8) of a uniform split (measured on SmolLM2 at 2k, a free allocation lost multi-key needles
the uniform one kept). The curves judge heads one by one, so the decision is validated: the
plan with each scorer and every uniform stack (one scorer, one storage) are executed on
held-out text at budgets of 1/2 to 1/64, and the one that moved the model's predictions least
(its continuation, and keyed facts asked for by key in prose and in filler: top-1 agreement,
then KL) at the nearest budget is executed (`kvstack.planning.validate`). One plan does not mix
scorers across layers unless `mix=True`: measured on SmolLM2 and Qwen2.5-Coder, plans with
SnapKV in some layers won the validation and lost every needle in query-agnostic use. Rank is
not planned: low-rank storage lost to eviction plus quantization at equal bytes on the models
measured (docs/measurements). The plan is decided at the first compression;
`auto(plan='p.json')`, written `plan:p.json`, executes a plan saved by `kvstack plan --save`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import Any

import torch

from kvstack.cache.budget import Budget, Cost
from kvstack.cache.encoded import Codec
from kvstack.cache.layer import CompressedLayer
from kvstack.errors import UserError
from kvstack.methods.base import Method, Observation
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import method_class, register
from kvstack.planning import validate as validation
from kvstack.planning.curves import FRACTIONS
from kvstack.planning.options import Storage, codecs, coded_count
from kvstack.planning.plan import Plan, tokens_kept
from kvstack.planning.validate import Candidate, candidates, losses, nearest, ranking
from kvstack.stack import Stack


@register
@dataclass
class Auto(Method):
    """Candidates: `scorers` (eviction methods), `bits` (16 = plain, `4/2` = keys 4, values 2),
    each coded width with every window in `residuals`; `least` tokens per head at the fewest, and
    `uniform` of a uniform split of the budget (the distortion curves then move the rest).
    Calibration: `samples` rows of `tokens` tokens of State of the Union prose for the curves,
    `validate` other rows to choose among candidates (0: the first candidate, unchecked); `mix`
    lets one plan take a scorer per layer."""

    name = "auto"
    family = "auto"
    role = "planner"
    paper = "kvstack: rate-distortion allocation of one byte budget over its own stages"
    scorers: tuple[str, ...] = ("kvzip", "snapkv")
    bits: tuple[str, ...] = ("16", "8", "4", "4/2", "2", "2/1")
    residuals: tuple[int, ...] = (0, 32)
    least: int = 8
    uniform: float = 0.8
    samples: int = 2
    tokens: int = 2048
    validate: int = 8
    mix: bool = False
    plan: str = ""
    every: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.scorers, self.bits = tuple(self.scorers), tuple(str(b) for b in self.bits)
        self.residuals = tuple(self.residuals)
        if self.least < 1 or self.samples < 1 or self.tokens < 64 or self.validate < 0:
            raise ValueError("auto: least >= 1, samples >= 1, validate >= 0 and tokens >= 64 (calibration rows)")
        if not 0.0 <= self.uniform <= 1.0:
            raise ValueError(
                f"auto: uniform must be in [0, 1] (each head's least part of a uniform split), got {self.uniform}"
            )
        if any(r < 0 for r in self.residuals) or not self.residuals:
            raise ValueError("auto: residuals are windows of >= 0 tokens, e.g. residuals=(0, 32)")
        for name in self.candidates:
            cls = method_class(name)
            if cls.family != "evict":
                raise ValueError(f"auto: scorer {name} is not an eviction method: use e.g. kvzip, h2o, snapkv")
        _ = self.storages  # one-line errors for bad bit widths now

    @cached_property
    def saved(self) -> Plan | None:
        """The plan file this stage executes, or None when it plans for itself."""
        return Plan.load(self.plan) if self.plan else None

    @property
    def candidates(self) -> tuple[str, ...]:
        """Scorers this stage may use: the plan's, or the candidates to measure."""
        return tuple(dict.fromkeys(self.saved.scorers)) if self.saved else self.scorers

    @cached_property
    def storages(self) -> list[Storage]:
        """Every storage option: plain, and each coded width with each residual window."""
        out = [Storage()]
        for bits in self.bits:
            for residual in self.residuals:
                option = Storage.parse(bits, residual)
                if option not in out:
                    out.append(option)
        return out

    @cached_property
    def choices(self) -> list[Candidate]:
        """The candidate decisions validated end to end (`kvstack.planning.validate`); without
        validation, only the first: the rate-distortion plan (over every scorer with `mix`, else
        the first scorer's)."""
        found = candidates(self.scorers, tuple(str(s) for s in self.storages), self.uniform, self.mix)
        return found if self.validate else found[:1]

    @classmethod
    def executing(cls, plan: Plan) -> Auto:
        """A stage executing `plan`, held in memory (validation runs candidates without files)."""
        stage = cls()
        stage.__dict__["saved"] = plan
        stage.__dict__.pop("methods", None)
        return stage

    @cached_property
    def methods(self) -> dict[str, Method]:
        """The scorers by name, each with its defaults."""
        return {name: method_class(name)() for name in self.candidates}  # type: ignore[misc]

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset().union(*(m.needs for m in self.methods.values()))

    @property
    def query_window(self) -> int:
        return max((m.query_window for m in self.methods.values()), default=0)

    @property
    def min_tokens(self) -> int:
        return self.saved.least if self.saved is not None else self.least

    @property
    def kind(self) -> str:
        """Name of the saved distortion curves: changes with anything they depend on."""
        return self._kind()

    def kind_for(self, model: Any) -> str:
        """`kind`, with the hashes of the learned scorers' predictors for `model`: curves measured
        with a predictor since trained again are measured again, not read."""
        hashes = [getattr(m.load(model), "meta", {}).get("sha256", "") for m in self.methods.values()]
        return self._kind([h for h in hashes if h])

    def _kind(self, predictors: list[str] | None = None) -> str:
        what = f"{self.scorers}|{[str(s) for s in self.storages]}|{self.samples}x{self.tokens}|{self.least}"
        if predictors:
            what += f"|{predictors}"
        return f"auto-{_digest(what)}-v4"

    def prepare(self, model: Any) -> Calibration | None:
        """The distortion curves of `model` and its candidates' validation, measured once and
        saved; None with a plan file."""
        if self.saved is not None:
            return None
        if not hasattr(model, "config"):
            raise UserError("auto measures the model's heads: build the KVCache from the model, not its config")
        from kvstack.calibrate.store import Ticker, calibrated
        from kvstack.models.config import text_config
        from kvstack.planning.curves import measure

        config = text_config(model.config)
        heads = config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        tokens = self.reference_length(config)

        def run(m: Any) -> torch.Tensor:
            with Ticker("auto: measuring distortion per head", heads * self.samples, after=0.0) as ticker:
                methods = list(self.methods.values())
                return measure(m, methods, self.storages, self.samples, tokens, self.least, ticker=ticker)

        kind = self.kind_for(model)
        curves = calibrated(model, kind, run)
        if not self.validate:
            return Calibration(curves, None)

        def check(m: Any) -> torch.Tensor:
            decided: dict[str, Stack] = {}  # one stack per distinct decision: `losses` runs it once

            @cache  # the same decision for every validation row
            def stack_of(fraction: float, choice: Candidate) -> Stack:
                plan = self.solve(curves, choice, fraction, layout)
                same = json.dumps([fraction, plan.scorers, plan.storages, plan.shares, plan.uniform])
                return decided.setdefault(same, Stack((Auto.executing(plan),)))

            rows, total = self.validate, self.validate * (1 + len(validation.GRID) * len(self.choices))
            with Ticker("auto: validating candidate stacks", total, after=0.0) as ticker:
                return losses(
                    m, stack_of, self.choices, rows, self.samples, tokens, self.needs, self.query_window, ticker
                )

        layout = self.layout(model, model.dtype.itemsize, Budget.parse(1.0))
        return Calibration(curves, calibrated(model, self.validation_kind(model, layout), check))

    def validation_kind(self, model: Any, layout: dict[str, Any] | None = None) -> str:
        """The name of the validation table for `model` as loaded: its candidates, grid and the
        cache's layout, whose bytes per token follow the dtype the model was loaded in (a float32
        load plans other fractions than a bfloat16 one, so each has its own table)."""
        layout = layout or self.layout(model, model.dtype.itemsize, Budget.parse(1.0))
        grid = f"{validation.GRID}|{validation.FACTS}"
        shape = {k: v for k, v in layout.items() if k not in ("model", "budget")}  # the model is the file's key
        what = f"{self.kind_for(model)}|{[str(c) for c in self.choices]}|{self.uniform}|{self.validate}|{grid}|{shape}"
        return f"auto-valid-{_digest(what)}-v6"

    def reference_length(self, config: Any) -> int:
        """Tokens per calibration row, and the length the plan is solved at: `tokens`, or less when
        the model's positions stop sooner (room is left for the probes)."""
        limit = getattr(config, "max_position_embeddings", None) or self.tokens + 256
        return max(64, min(self.tokens, limit - 256))

    def decide(self, calibration: Calibration | None, n: torch.Tensor, fraction: float, layout: dict[str, Any]) -> Plan:
        """The plan executed for heads holding n (L,) tokens under `fraction` of the full bytes:
        the validated candidate's decision at the reference length (the calibration's, each
        sliding layer capped by its window), or the plan file's. layout: see `layout`."""
        from kvstack.planning.plan import check_fits

        heads, full = layout["heads"], layout["full"]
        check_fits(
            n, heads, full + layout["slot"], self.min_tokens, fraction * float(n.sum()) * heads * full, layout["budget"]
        )
        if self.saved is not None:
            saved = (len(self.saved.scorers), len(self.saved.storages[0]), self.saved.head_dim, self.saved.token_bytes)
            if saved != (len(n), heads, layout["head_dim"], full):
                raise UserError(
                    f"plan {self.plan} is for {saved[0]} layers x {saved[1]} KV heads of dim {saved[2]} at "
                    f"{saved[3]} bytes per token, this model has {len(n)} x {heads} of dim {layout['head_dim']} at "
                    f"{full}: plan for it with `kvstack plan`"
                )
            return self.saved.at(n, fraction * float(n.sum()) * heads * full)
        assert calibration is not None
        if tuple(calibration.curves.shape[1:3]) != (len(n), heads):
            raise UserError("auto's curves were measured on another model: build the KVCache from the model it serves")
        choice, why = self.choose(calibration, fraction)
        key = (self.kind, choice, fraction, json.dumps(layout, default=str))
        memo = _SOLVED.get(key)
        if memo is None or memo[0] is not calibration.curves:  # the decision at the reference length: pure
            if len(_SOLVED) >= 64:  # byte budgets give a fraction per length: keep the memo small
                _SOLVED.clear()
            memo = _SOLVED[key] = (calibration.curves, self.solve(calibration.curves, choice, fraction, layout))
        return replace(memo[1], chosen=why).at(n, fraction * float(n.sum()) * heads * full)

    def choose(self, calibration: Calibration, fraction: float) -> tuple[Candidate, str]:
        """The candidate executed at `fraction`: the one validated best at the nearest budget of
        the grid where any candidate fits, and why, in words (the first candidate when nothing
        was validated)."""
        first = self.choices[0]
        if calibration.losses is None:
            return first, f"{first} (not validated)"
        if fraction >= 1.0:
            return first, "the full cache (the budget pays for it)"
        table, grid = calibration.losses, validation.GRID
        fits = [g for g in range(len(grid)) if bool(torch.isfinite(table[g, :, :, 0]).all(-1).any())]
        if not fits:
            return first, f"{first} (no candidate fits the validated budgets)"
        g = fits[nearest(fraction, tuple(grid[i] for i in fits))]
        order = [int(c) for c in ranking(table[g]) if bool(torch.isfinite(table[g, c, :, 0]).all())]
        best = order[0]

        def said(c: int) -> str:
            kl, agree = validation.loss(table[g, c]).tolist()
            return f"KL {kl:.3f}, top-1 agreement {agree:.3f}"

        why = f"{self.choices[best]}: {said(best)} on held-out probes at {grid[g]:g} of the full bytes"
        runner = next((c for c in order[1:] if self.choices[c].is_uniform != self.choices[best].is_uniform), None)
        if runner is not None:
            kind = "uniform stack" if self.choices[runner].is_uniform else "plan"
            why += f"; best {kind}: {self.choices[runner]}, {said(runner)}"
        return self.choices[best], why

    def solve(self, curves: torch.Tensor, choice: Candidate, fraction: float, layout: dict[str, Any]) -> Plan:
        """`choice`'s decision under `fraction` of the full bytes at the reference length, from
        the curves (S, L, H, Q, F) of its scorers and storages."""
        from kvstack.planning.plan import decide

        length = layout["reference"]
        reference = torch.tensor([min(length, w - 1) if w else length for w in layout["windows"]])
        names = [str(s) for s in self.storages]
        scorers = torch.tensor([self.scorers.index(s) for s in choice.scorers])
        storages = torch.tensor([names.index(q) for q in choice.storages])
        return decide(
            curves.index_select(0, scorers).index_select(3, storages),
            torch.tensor(FRACTIONS),
            list(choice.scorers),
            [self.storages[int(q)] for q in storages],
            reference,
            layout["head_dim"],
            layout["full"],
            layout["slot"],
            fraction * float(reference.sum()) * layout["heads"] * layout["full"],
            self.least,
            model=layout.get("model", ""),
            budget=layout.get("budget", ""),
            check=False,  # checked at n by `decide`; the reference length may be shorter than the context
            uniform=choice.uniform,
        )

    def layout(self, source: Any, itemsize: int, budget: Budget) -> dict[str, Any]:
        """What `decide` needs of a model (or its config) whose cache holds `itemsize`-byte values:
        heads, head_dim, full (a plain token's key and value bytes), slot, windows (per layer, None
        for full attention), reference (the length decisions are solved at), model, budget."""
        from kvstack.cache.layer import SLOT_DTYPE
        from kvstack.models.config import text_config

        config = text_config(getattr(source, "config", source))
        n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        types = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
        return {
            "heads": getattr(config, "num_key_value_heads", None) or n_heads,
            "head_dim": head_dim,
            "full": 2 * head_dim * itemsize,
            "slot": torch.tensor([], dtype=SLOT_DTYPE).element_size(),
            "windows": [config.sliding_window if t == "sliding_attention" else None for t in types],
            "reference": self.reference_length(config),
            "model": str(getattr(getattr(source, "config", None), "name_or_path", "")),
            "budget": str(budget),
        }

    def plan_for(self, model: Any, budget: Budget, length: int) -> Plan:
        """The plan for a context of `length` tokens on `model`: what the cache decides and keeps
        at its first compression of such a context (sliding layers hold at most their window)."""
        from kvstack.models.config import text_config

        limit = getattr(text_config(model.config), "max_position_embeddings", None)
        if limit and length > limit:
            raise UserError(
                f"length {length} exceeds the model's maximum of {limit} tokens: plan for a shorter context"
            )
        layout = self.layout(model, model.dtype.itemsize, budget)
        n = torch.tensor([min(length, w - 1) if w else length for w in layout["windows"]])
        if budget.tokens is not None:
            raise UserError(f"auto plans bytes: give a fraction (0.25) or a size (64MB), not {budget}")
        fraction = budget.resolve(float(n.sum()) * layout["heads"] * layout["full"]).fraction
        assert fraction is not None
        return self.decide(self.prepare(model), n, fraction, layout)

    def score(self, obs: Observation) -> torch.Tensor:
        raise RuntimeError("auto scores through the cache's plan (Planner.scorer)")

    def prompt_done(self, runner: Any) -> None:
        for method in self.methods.values():  # its scorers' passes (KVzip re-reads the prompt)
            method.prompt_done(runner)

    def step_done(self, cache: Any, logits: torch.Tensor) -> None:
        for method in self.methods.values():
            method.step_done(cache, logits)

    def planner(self, source: Any) -> Planner:
        """This stage's policy for one cache of `source` (a model, or its config with a plan file)."""
        return Planner(self, source)


class Planner:
    """`auto` in one cache: measures the model once (`Auto.prepare`), decides the plan at the
    first compression, then tells the cache's policy each head's tokens, storage and scorer."""

    def __init__(self, stage: Auto, source: Any) -> None:
        self.stage, self.source = stage, source
        self.measured = stage.prepare(source)
        self.plan: Plan | None = None  # decided at the first compression
        self._shares: tuple[int, torch.Tensor] | None = None  # (seen, (b, L, h) byte shares) memo
        self._keep: torch.Tensor | None = None  # (b, L, h) tokens each head keeps, memoised with _shares
        self._costs: Cost | None = None  # (L, h) each head's token costs under the plan
        self._codecs: dict[int, list[tuple[Storage, tuple[Codec, Codec] | None]]] = {}  # layer -> each head's

    def forget(self) -> None:
        """Drop this step's memo (the batch's rows were reordered)."""
        self._shares = self._keep = None

    @cached_property
    def query_window(self) -> int:
        """Recent queries the plan's scorers read (once it is decided)."""
        assert self.plan is not None
        return max(self.stage.methods[name].query_window for name in set(self.plan.scorers))

    def scorer(self, layer_idx: int) -> Method:
        """The scorer the plan gives layer `layer_idx`."""
        assert self.plan is not None
        return self.stage.methods[self.plan.scorers[layer_idx]]

    def keep(self, shares: Any, layer: CompressedLayer) -> torch.Tensor:
        """(b, h) tokens each head of `layer` keeps under the plan (`shares`: the cache's
        `kvstack.policy.shares.Shares`): its byte share of its full bytes (rescaled per sequence as
        it grows, so each sequence holds its budget), at its storage, as `tokens_kept` counts;
        everything when the budget pays for the full cache. Every layer's at once, once per step."""
        self.shares(shares, layer)
        assert self._keep is not None
        return self._keep[:, layer.layer_idx].to(layer.keys[0].device)

    def shares(self, shares: Any, layer: CompressedLayer) -> torch.Tensor:
        """(b, L, h) each sequence's byte share per head now (all 1 when its budget pays for the
        full cache); the plan is decided at the first call, at the longest sequence's budget.
        Memoised per step, with the tokens each head keeps (`keep`)."""
        seen, budget = layer.seen, shares.budget
        if self._shares is not None and self._shares[0] == seen:
            return self._shares[1]
        layers = shares.cache.layers
        like = next(x for x in layers if x.is_initialized)
        if budget.tokens is not None:
            raise UserError(f"auto plans bytes: give a fraction (0.25) or a size (64MB), not {budget}")
        rooms = torch.stack([shares.room(x, seen, like)[0] for x in layers]).cpu()  # (L, b)
        full, heads = like.token_bytes(explicit_slots=False), like.n_kv_heads
        fractions = [float(b.fraction or 1.0) for b in shares.budgets_at(seen, like)]
        if self.plan is None:
            layout = self.stage.layout(self.source, like.keys[0].element_size(), budget)
            longest = int(rooms.sum(0).argmax())
            self.plan = self.stage.decide(self.measured, rooms[:, longest], fractions[longest], layout)
        per_sequence = [
            self.plan.shares_now(n, f * float(n.sum()) * heads * full) if f < 1.0 else torch.ones(len(n), heads)
            for n, f in zip(rooms.T, fractions, strict=True)
        ]
        self._shares = (seen, torch.stack([x.double() for x in per_sequence]))
        if self._costs is None:  # the plan's storages are fixed once decided
            self._costs = self.plan.costs()
        self._keep = tokens_kept(self._shares[1], rooms.T, self._costs, self.stage.min_tokens)
        return self._shares[1]

    def encode(self, policy: Any, layer: CompressedLayer, decoding: bool) -> None:
        """The policy's `encode` under the plan: each head by its own storage and residual window."""
        assert self.plan is not None
        heads = self._codecs.get(layer.layer_idx)
        if heads is None:  # the plan's storages are fixed once decided: each head's codecs, made once
            storages = [self.plan.storage(layer.layer_idx, h) for h in range(layer.n_kv_heads)]
            heads = [(st, codecs(st, layer.keys[h].shape[-1])) for h, st in enumerate(storages)]
            self._codecs[layer.layer_idx] = heads
        plain = [layer.keys[h].shape[1] for h in range(len(heads))]
        counts = [coded_count(n, st, decoding) if pair else 0 for n, (st, pair) in zip(plain, heads, strict=True)]
        if max(counts) <= 0:  # most decoding steps: no head has a whole group to encode
            return
        started = policy.clock.start(layer.keys[0].device)
        jobs = [(h, n, pair) for h, ((_, pair), n) in enumerate(zip(heads, counts, strict=True)) if pair and n > 0]
        layer.encode_heads(jobs, Quantizer(), None)
        policy.clock.stop(started)


@dataclass
class Calibration:
    """What `auto` measures once per model: curves (S, L, H, Q, F), the distortion of every head
    per scorer, storage and kept fraction; losses (G, C, P, 2), each candidate's validation per
    budget of the grid and probe: KL and top-1 agreement (None when not validated)."""

    curves: torch.Tensor
    losses: torch.Tensor | None


# (auto's kind, candidate, fraction, layout) -> (the curves it was solved on, the plan at the reference
# length): each cache of a run at one budget decides the same plan, rescaled to its own length
_SOLVED: dict[tuple[Any, ...], tuple[torch.Tensor, Plan]] = {}


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]
