"""`auto`: one byte budget, the stack chosen per layer and head by rate-distortion allocation.

Per KV head how many tokens to keep and at what precision (plain, or keys/values at 8, 4, 2 or
1 bits after a residual window), and per layer which scorer picks the tokens, chosen by a
Lagrangian over distortion curves measured once per model on prose with recall probes
(`kvstack.planning`). Every head keeps at least `uniform` (0.8) of a uniform split: measured on
SmolLM2 at 2k, a free allocation (`uniform=0`) lost multi-key needles the uniform one kept. The
default candidate scorer is KVzip alone: with `scorers=('kvzip', 'snapkv')` the curves pick
SnapKV for a third of the layers and every needle is lost in query-agnostic use (the distortion
of the probes does not see it). Rank is not planned: low-rank storage lost to eviction plus
quantization at equal bytes on the models measured (docs/measurements). The plan is decided at
the first compression; `auto(plan='p.json')`, written `plan:p.json`, executes a plan saved by
`kvstack plan --save`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from kvstack.cache.budget import Budget
from kvstack.errors import UserError
from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import method_class, register
from kvstack.planning.curves import FRACTIONS
from kvstack.planning.options import Storage
from kvstack.planning.plan import Plan


@register
@dataclass
class Auto(Method):
    """Candidates: `scorers` (eviction methods), `bits` (16 = plain, `4/2` = keys 4, values 2),
    each coded width with every window in `residuals`; `least` tokens per head at the fewest, and
    `uniform` of a uniform split of the budget (the distortion curves then move the rest).
    Calibration: `samples` rows of `tokens` tokens of State of the Union prose."""

    name = "auto"
    family = "auto"
    paper = "kvstack: rate-distortion allocation of one byte budget over its own stages"
    scorers: tuple[str, ...] = ("kvzip",)
    bits: tuple[str, ...] = ("16", "8", "4", "4/2", "2", "2/1")
    residuals: tuple[int, ...] = (0, 32)
    least: int = 8
    uniform: float = 0.8
    samples: int = 2
    tokens: int = 2048
    plan: str = ""
    every: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.scorers, self.bits = tuple(self.scorers), tuple(str(b) for b in self.bits)
        self.residuals = tuple(self.residuals)
        if self.least < 1 or self.samples < 1 or self.tokens < 64:
            raise ValueError("auto: least >= 1, samples >= 1 and tokens >= 64 (calibration rows)")
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
        what = f"{self.scorers}|{[str(s) for s in self.storages]}|{self.samples}x{self.tokens}|{self.least}"
        return f"auto-{hashlib.sha1(what.encode()).hexdigest()[:10]}-v3"

    def prepare(self, model: Any) -> torch.Tensor | None:
        """The distortion curves (S, L, H, Q, F) of `model`, measured once and saved; None with a plan file."""
        if self.saved is not None:
            return None
        if not hasattr(model, "config"):
            raise UserError("auto measures the model's heads: build the KVCache from the model, not its config")
        from kvstack.cache.cache import text_config
        from kvstack.calibrate.store import Ticker, calibrated
        from kvstack.planning.curves import measure

        config = text_config(model.config)
        heads = config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        tokens = self.reference_length(config)

        def run(m: Any) -> torch.Tensor:
            with Ticker("auto: measuring distortion per head", heads * self.samples, after=0.0) as ticker:
                methods = list(self.methods.values())
                return measure(m, methods, self.storages, self.samples, tokens, self.least, ticker=ticker)

        return calibrated(model, self.kind, run)

    def reference_length(self, config: Any) -> int:
        """Tokens per calibration row, and the length the plan is solved at: `tokens`, or less when
        the model's positions stop sooner (room is left for the probes)."""
        limit = getattr(config, "max_position_embeddings", None) or self.tokens + 256
        return max(64, min(self.tokens, limit - 256))

    def decide(self, curves: torch.Tensor | None, n: torch.Tensor, fraction: float, layout: dict[str, Any]) -> Plan:
        """The plan executed for heads holding n (L,) tokens under `fraction` of the full bytes,
        decided at the reference length (the calibration's, each sliding layer capped by its
        window) or read from the plan file. layout: heads, head_dim, full (bytes of a plain
        token's key and value), slot, windows (per layer, None for full attention), model, budget."""
        from kvstack.planning.plan import check_fits, decide

        heads, full = layout["heads"], layout["full"]
        least = self.min_tokens
        check_fits(n, heads, full + layout["slot"], least, fraction * float(n.sum()) * heads * full, layout["budget"])
        if self.saved is not None:
            saved = (len(self.saved.scorers), len(self.saved.storages[0]), self.saved.head_dim, self.saved.token_bytes)
            if saved != (len(n), heads, layout["head_dim"], full):
                raise UserError(
                    f"plan {self.plan} is for {saved[0]} layers x {saved[1]} KV heads of dim {saved[2]} at "
                    f"{saved[3]} bytes per token, this model has {len(n)} x {heads} of dim {layout['head_dim']} at "
                    f"{full}: plan for it with `kvstack plan`"
                )
            return self.saved.at(n, fraction * float(n.sum()) * heads * full)
        assert curves is not None
        if tuple(curves.shape[1:3]) != (len(n), heads):
            raise UserError("auto's curves were measured on another model: build the KVCache from the model it serves")
        length = layout["reference"]
        reference = torch.tensor([min(length, w - 1) if w else length for w in layout["windows"]])
        decided = decide(
            curves,
            torch.tensor(FRACTIONS),
            list(self.scorers),
            self.storages,
            reference,
            layout["head_dim"],
            full,
            layout["slot"],
            fraction * float(reference.sum()) * heads * full,
            self.least,
            model=layout.get("model", ""),
            budget=layout.get("budget", ""),
            check=False,  # checked at n above; the reference length may be shorter than the context
            uniform=self.uniform,
        )
        return decided.at(n, fraction * float(n.sum()) * heads * full)

    def layout(self, source: Any, itemsize: int, budget: Budget) -> dict[str, Any]:
        """What `decide` needs of a model (or its config) whose cache holds `itemsize`-byte values:
        heads, head_dim, full (a plain token's key and value bytes), slot, windows (per layer, None
        for full attention), reference (the length decisions are solved at), model, budget."""
        from kvstack.cache.cache import text_config
        from kvstack.cache.layer import SLOT_DTYPE

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
        from kvstack.cache.cache import text_config

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
        raise RuntimeError("auto scores through the cache's plan (KVCache.scores)")
