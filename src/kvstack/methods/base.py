"""The method interface: a method looks at one layer's cache and decides, the cache executes.

Every stage of a stack is a small dataclass whose fields are its hyper-parameters (`Stage`).
An eviction method (`Method`) maps an `Observation` of one layer to scores (b, h_kv, t):
higher means keep. Which tokens survive is then a pure function of the scores and the budget
(`select`). A stage may wrap another one (its `scorer` field): `vatp(h2o)` re-weights h2o's
scores, `pyramid(snapkv)` decides how many tokens each layer gives snapkv to keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvstack.errors import UserError

if TYPE_CHECKING:
    from kvstack.cache.layer import CompressedLayer


# families of stages that choose the tokens kept
SELECTION = ("evict", "retrieve", "reference", "allocate", "merge", "auto")
# what a stage does in a stack, declared by its classes' `role` (a stage may play several):
# scorer (scores tokens), allocator (splits the budget), storer (codes kept tokens), merger (folds
# the tokens a selection leaves out into kept ones), demoter (keeps them at low precision instead),
# folder (averages them into one compensation token), joiner (shares state across layers),
# planner (decides the whole stack per head from one byte budget), retriever (moves the tokens it
# does not keep resident to a slow tier and brings back, per attention call, what the queries need)
ROLES = ("scorer", "allocator", "storer", "merger", "demoter", "folder", "joiner", "planner", "retriever")
# ranges of the integer parameters many stages share, checked when a spec is parsed (`Stack.parse`);
# a stage checks its own parameters, and tighter ranges, in its __post_init__
RANGES = {
    "samples": (1, 256),  # calibration rows (cokv: coalitions per size)
    "tokens": (2, 65536),  # tokens per calibration row
    "residual": (0, 65536),  # newest tokens kept at full precision
    "group": (1, 4096),
    "every": (1, 65536),
    "decode_window": (0, 65536),
    "window_size": (1, 65536),
    "window": (0, 65536),
    "chunk_size": (1, 65536),
    "chunk": (1, 65536),
    "page": (1, 65536),
    "select": (1, 1 << 20),
    "sinks": (0, 65536),
}


class Observation:
    """What a method may see of one layer, as padded dense views built on first access.

    Shapes: b batch, h KV heads, g query heads per KV head, t tokens held (padded to the
    longest head), w observed queries, d head dim.
    """

    def __init__(
        self,
        layer: CompressedLayer,
        keep: torch.Tensor,
        token_index: torch.Tensor | None,
        decoding: bool = False,
        confidence: torch.Tensor | None = None,
        tables: dict[str, Any] | None = None,
    ) -> None:
        self._layer = layer
        self._keep = keep  # (b, h) tokens each head will keep
        self.read_keep = False  # True once a method read `keep` (its scores then depend on the split)
        self._token_index = token_index  # (b, slots) index of each slot among real tokens, or None
        self.layer_idx = layer.layer_idx
        self.n_layers = layer.n_layers
        self.groups = layer.groups
        self.scaling = layer.scaling
        self.decoding = decoding  # True when compressing between decoding steps
        self.seen = layer.seen  # slots appended so far (the next token's slot)
        self.prompt_end = layer.seq.prompt_end  # slots below this came with the prompt (prefill)
        self.inv_freq = layer.inv_freq  # (d/2,) RoPE inverse frequencies, or None
        self.confidence = confidence  # (b,) the model's confidence in its last prediction, or None
        self.tables = tables or {}  # scorer name -> what its `Method.load` loaded (a learned predictor)

    @property
    def keep(self) -> torch.Tensor:
        """(b, h) tokens each head will keep."""
        self.read_keep = True
        return self._keep

    @keep.setter
    def keep(self, keep: torch.Tensor) -> None:
        self._keep = keep

    @cached_property
    def slots(self) -> torch.Tensor:
        """(b, h, t) logical slot of each held token; -1 where a head has fewer tokens."""
        return self._layer.dense_slots()

    @cached_property
    def valid(self) -> torch.Tensor:
        """(b, h, t) True where a real (non-padding, non-empty) token is held."""
        return self._layer.valid_mask(self.slots)

    @cached_property
    def next_position(self) -> torch.Tensor:
        """(b,) position of each sequence's next token (its real tokens so far: padding not counted)."""
        layer = self._layer
        return layer.seq.real_counts(layer.seen, layer.batch, device=self.slots.device)

    @cached_property
    def positions(self) -> torch.Tensor:
        """(b, h, t) position of each held token in its sequence (padding not counted)."""
        slots = self.slots.clamp(min=0)
        if self._token_index is None:
            return slots
        b, h, t = slots.shape
        return torch.gather(self._token_index, 1, slots.reshape(b, h * t)).reshape(b, h, t)

    @cached_property
    def keys(self) -> torch.Tensor:
        """(b, h, t, d) keys after RoPE."""
        return self._layer.dense([self._layer.head_keys(h) for h in range(self._layer.n_kv_heads)])

    @cached_property
    def values(self) -> torch.Tensor:
        """(b, h, t, d) values."""
        return self._layer.dense([self._layer.head_values(h) for h in range(self._layer.n_kv_heads)])

    @property
    def queries(self) -> torch.Tensor:
        """(b, h*g, w, d) the last observed queries after RoPE (the observation window)."""
        if self._layer.queries is None:
            raise RuntimeError("this method needs queries but the cache recorded none")
        return self._layer.queries

    @property
    def query_slots(self) -> torch.Tensor:
        """(w,) logical slots of the observed queries."""
        assert self._layer.query_slots is not None
        return self._layer.query_slots

    @cached_property
    def query_valid(self) -> torch.Tensor:
        """(b, w) True where an observed query is a real token (False on padding)."""
        pad, slots = self._layer.seq.padding, self.query_slots
        if pad is None:
            return torch.ones(self._layer.batch, slots.shape[0], dtype=torch.bool, device=slots.device)
        return pad[:, slots].bool()

    @cached_property
    def exempt(self) -> torch.Tensor:
        """(b, h, t) True for held tokens that are never evicted (a question appended after a
        query-agnostic compression)."""
        seq = self._layer.seq
        return self.valid & seq.is_exempt(self.slots) if seq.exempt else torch.zeros_like(self.valid)

    @cached_property
    def log_count(self) -> torch.Tensor:
        """(b, h, t) log of how many tokens each held entry stands for (0 unless merged)."""
        from kvstack.cache.layer import WEIGHT

        if WEIGHT not in self._layer.stats:
            return self.slots.new_zeros(self.slots.shape, dtype=torch.float32)
        return self._layer.dense(self._layer.stats[WEIGHT], fill=0.0)

    @cached_property
    def plain(self) -> torch.Tensor:
        """(b, h, t) True where a token is held in the model's dtype (not encoded): what a merge may rewrite."""
        b = self._layer.batch
        flags = []
        for h in range(self._layer.n_kv_heads):
            coded = self._layer.head_len(h) - self._layer.keys[h].shape[1]
            flag = torch.arange(self._layer.head_len(h), device=self.slots.device) >= coded
            flags.append(flag.expand(b, -1))
        return self._layer.dense(flags, fill=False).bool() & self.valid

    @cached_property
    def attention_sum(self) -> torch.Tensor:
        """(b, h, t) attention each token received, summed over all queries and the head's group."""
        return self._layer.dense(self._layer.stats["attention_sum"], fill=0.0)

    def stat(self, name: str) -> torch.Tensor:
        """(b, h, t) a per-token statistic the cache holds under `name` (0 where a head has fewer tokens)."""
        if name not in self._layer.stats:
            raise RuntimeError(f"this method needs the statistic {name!r} but the cache recorded none")
        return self._layer.dense(self._layer.stats[name], fill=0.0)

    @cached_property
    def sentence(self) -> torch.Tensor:
        """(b, h, t) the sentence each held token belongs to (0, 1, ... along each sequence), from
        the ends the loop marked as tokens came in (`Stage.tokens_in`)."""
        index = self._layer.seq.sentence_index()
        if index is None:
            raise UserError(
                "sentence ends are marked by kvstack's own loop as tokens come in: use kvstack.generate / "
                "`kvstack generate` (model.generate cannot mark them)"
            )
        slots = self.slots.clamp(min=0)
        width = index.shape[1]
        b, h, t = slots.shape
        inside = slots < width  # slots appended after the last marking end no sentence
        found = torch.gather(index, 1, slots.clamp(max=max(width - 1, 0)).reshape(b, h * t)).reshape(b, h, t)
        return torch.where(inside, found, index[:, -1:, None].expand(b, h, t) if width else torch.zeros_like(slots))

    @cached_property
    def last_attention(self) -> torch.Tensor:
        """(b, h, t) attention from the most recent query, averaged over the head's group."""
        return self._layer.dense(self._layer.stats["last_attention"], fill=0.0)


@dataclass
class Stage:
    """Base of every stage of a stack: a name, a family, a paper, hyper-parameters as fields.

    `needs` names the statistics the attention pass must record ("attention_sum", "last_attention").
    """

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    role: ClassVar[str] = ""  # one of ROLES, declared by the class that gives a stage that role
    provides: ClassVar[frozenset[str]] = frozenset()  # statistics its `prompt_done` hook records

    @classmethod
    def declared_roles(cls) -> frozenset[str]:
        """The `role` of each of this class's classes: what its stages play unless their
        parameters turn a role off (`roles`)."""
        return frozenset(k.__dict__["role"] for k in cls.__mro__ if k.__dict__.get("role"))

    @property
    def roles(self) -> frozenset[str]:
        """Every role this stage plays (a stage whose parameters turn a role off overrides this)."""
        return self.declared_roles()

    def plays(self, role: str) -> bool:
        """True when this stage plays `role` (one of ROLES)."""
        assert role in ROLES, role
        return role in self.roles

    # ---- lifecycle hooks: the loop that runs the model calls them; most stages need none ----
    def prompt_done(self, runner: Any) -> None:
        """A prompt (or a prompt chunk) went through the model. `runner` is the loop's
        (`kvstack.generate.Runner`): its `cache`, `rows` (each sequence's tokens so far), `fork`
        and `forward_rows`, for a stage that runs the model again (KVzip's re-reading)."""

    def tokens_in(self, runner: Any, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The loop is about to feed `ids` (b, q) with padding mask (b, q) to the model (`sentence`
        marks which of them end a sentence here, before the forward pass compresses)."""

    def step_done(self, cache: Any, logits: torch.Tensor) -> None:
        """The model predicted the next token's logits (b, vocab) with `cache` (CONF-KV reads
        its confidence here)."""

    def params(self) -> dict[str, Any]:
        """Hyper-parameters and their values."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def inner(self) -> Stage | None:
        """The stage this one wraps (its `scorer`), or None."""
        inner = getattr(self, "scorer", None)
        return inner if isinstance(inner, Stage) else None

    def chain(self) -> list[Stage]:
        """This stage and every stage it wraps, outermost first."""
        out: list[Stage] = [self]
        while out[-1].inner is not None:
            out.append(out[-1].inner)  # type: ignore[arg-type]
        return out


@dataclass
class Method(Stage):
    """Base of every eviction method: hyper-parameters are dataclass fields.

    `every` is how often it compresses while decoding (1 = every step). The default, None, lets the
    cache choose a block (`decode_block`): a head evicts that many tokens at once, below its
    share so the budget holds at every step, instead of re-scoring and re-gathering the whole
    head at every token (which made keydiff at 1/8 decode at 0.28x the full cache's speed).
    `decode_window` how many of the newest tokens are never evicted while decoding (inside the
    budget): without it a scorer written for the prompt, such as knorm, drops the tokens just
    generated and the model loses its place mid-answer (measured: knorm at 0.5 on niah_single
    2k went from 0.3 to 0.7).
    """

    role: ClassVar[str] = "scorer"
    cadence_from_inner: ClassVar[bool] = False  # a re-scorer decodes at its wrapped scorer's cadence
    every: int | None = field(default=None, kw_only=True)
    decode_window: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"{self.name}: every must be >= 1 (decode steps between compressions), got {self.every}")
        if self.decode_window < 0:
            raise ValueError(f"{self.name}: decode_window must be >= 0 (newest tokens kept while decoding)")

    @property
    def query_window(self) -> int:
        """How many recent queries the cache must keep for this method (0 = none)."""
        return 0

    @property
    def min_tokens(self) -> int:
        """The fewest tokens per head this method can keep."""
        return 1

    @property
    def compresses(self) -> bool:
        """False for methods that never evict (`full`)."""
        return True

    def score(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) importance of each held token; higher is kept first."""
        raise NotImplementedError

    def load(self, model: Any) -> Any:
        """What scoring needs from the model, loaded once per cache and handed back in
        `Observation.tables[name]` (a learned predictor); None for scorers that need nothing."""
        return None

    def limit(self, keep: torch.Tensor, decoding: bool, confidence: torch.Tensor | None) -> torch.Tensor:
        """(b, h) tokens to keep now, at most the budget's `keep` (b, h): a method may hold fewer,
        e.g. when the model is confident (CONF-KV). confidence: (b,) in [0, 1] or None."""
        return keep


BLOCK_SHARE = 16  # a decoding block is at most 1/16 of a head's share ...
MAX_BLOCK = 32  # ... and at most 32 tokens


def decode_block(every: int | None, keep: torch.Tensor) -> torch.Tensor:
    """(b, h) tokens a head evicts at once while decoding, for `keep` (b, h) tokens it may hold:
    `every` when a method fixes its cadence, else 1/16 of the share, between 1 and 32 (small
    shares lose little to the slack, large ones evict rarely)."""
    if every is not None:
        return torch.full_like(keep, every)
    return (keep // BLOCK_SHARE).clamp(1, MAX_BLOCK)


def recent_mask(obs: Observation, window: int | torch.Tensor) -> torch.Tensor:
    """(b, h, t) True for the `window` most recent real tokens of each head (by position)."""
    pos = torch.where(obs.valid, obs.positions, torch.full_like(obs.positions, -1))
    newest = pos.amax(dim=-1, keepdim=True)
    w = window if isinstance(window, int) else window.unsqueeze(-1)
    return obs.valid & (pos > newest - w)
