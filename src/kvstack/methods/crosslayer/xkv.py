"""`xkv`: xKV (Chang et al., 2025, #12): one SVD subspace shared by a group of adjacent layers.

On the prompt, the keys of a group of G adjacent layers, every KV head of every layer side by
side, form one matrix X (n tokens, G*h*d features); its top-r right singular vectors V (r, G*h*d)
span a subspace the whole group shares. A token is stored once for the group as its latent
X V^T (n, r), and each layer and head reads its keys back as latent @ V[:, its d columns]. Values
likewise, with their own rank. Keys are factored before RoPE (rotated back by each token's
position, rotated forward on reading), where they are low-rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvstack.cache.coded import Coded, compact
from kvstack.cache.encoded import Encoded, Where, gather_rows
from kvstack.methods.crosslayer.base import (
    CrossLayer,
    TableCodec,
    layer_groups,
    move_to_part,
    real_tokens,
    row_index,
    shared_plain,
    token_positions,
)
from kvstack.methods.registry import register
from kvstack.models.rope import rotate

if TYPE_CHECKING:
    from kvstack.cache.layer import CompressedLayer


def shared_subspace(x: torch.Tensor, rank: int, fit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent (b, n, r), factor (b, r, F)) with x (b, n, F) ~ latent @ factor, float32: factor
    holds the top-r right singular vectors of x's rows where `fit` (b, n) holds (all rows when
    None; padding is left out of the fit), latent the projection of every row on them.
    r = min(rank, n, F); at r = min(n, F) the fitted rows are reproduced exactly."""
    xf = x.float()
    fitted = xf if fit is None else xf * fit.unsqueeze(-1)
    _, _, vh = torch.linalg.svd(fitted, full_matrices=False)  # (b, min(n, F), F)
    factor = vh[:, : min(rank, vh.shape[1])].clone()  # not a view: the rest of vh is freed
    return xf @ factor.transpose(1, 2), factor


def group_rank(fraction: float, width: int) -> int:
    """The rank kept for a group whose states are `width` features wide: round(fraction x width), at least 1."""
    return max(1, min(width, round(fraction * width)))


class SharedLatent(TableCodec):
    """Tokens as a row `row` (b, n) of the group's latent table (b, N, r) times this member's
    factor (b, r, d), a slice of the group's (b, r, G*h*d) table; pre-RoPE keys also read their
    position (b, N) int32 and are rotated forward. Every layer and head of the group reads the
    same latent and position tables."""

    tables: ClassVar[tuple[str, ...]] = ("latent", "position")

    def __init__(self, rank: int, itemsize: int, members: int) -> None:
        self.rank, self.itemsize, self.members = rank, itemsize, members
        self.bits = 8 * itemsize

    def __repr__(self) -> str:
        return f"SharedLatent(r={self.rank})"

    def decode(self, enc: Encoded) -> torch.Tensor:
        x = self.rows(enc, "latent").float() @ enc.shared["factor"].float()
        if "position" in enc.shared and enc.where.inv_freq is not None:
            x = rotate(x, self.rows(enc, "position"), enc.where.inv_freq)
        return x.to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        return self.rank * self.itemsize / self.members + 2  # the shared latent, an int16 row

    def fixed_bytes(self, dim: int) -> int:
        return self.rank * dim * self.itemsize


@register
@dataclass
class XKV(CrossLayer):
    """Groups of `group` consecutive layers (same attention kind, from round(`start` x L) on, a
    kind's last group maybe smaller, as the reference's consecutive groups) share one subspace;
    keys keep rank round(`k` x G*h*d), values round(`v` x G*h*d). Defaults: xKV-4 with the
    reference's Llama-3.1-8B RULER ranks (384 and 576 of 4 x 8 x 128 = 4096 features); `k=1.0,
    v=1.0` keeps full rank and reproduces the cache to float rounding. `pre_rope=False` factors
    post-RoPE keys.

    Stored per group, for the tokens joined: the key latent table (b, N, r_k), the value latent
    table (b, N, r_v) and the positions (b, N) int32 once (read by every layer and head, counted
    once by `KVCache.nbytes()`), the factors (b, r, G*h*d) once per kind (each layer and head reads
    its d columns), in the model's dtype, and per layer and head a row (b, n) int16 per token.
    Short prompts gain little: the factors cost r x d per head whatever n.

    Alone it runs at budget 1.0 and compresses by its ranks. Stacked after an eviction stage
    (`snapkv+xkv`) the evictor keeps tokens as if each cost its full bytes and the factoring then
    shrinks them further (the cache holds less than the budget); since one latent serves all
    heads, only slots that every head of every layer of the group kept are factored, the others
    stay plain. With a quantizer (`xkv+kivi(bits=2)`) only the tokens it left plain (its residual
    window) are factored, as for MiniCache. Tokens that arrive while decoding stay plain (the
    reference factors the prompt only). Gemma 3's sliding layers form groups among themselves
    (their window holds the same positions in every layer): a window trim, like a later
    eviction, gathers each member's rows, never the shared tables, which are rebuilt once under
    3/4 of their rows are read.

    Deviations: the reference splits sqrt(S) between U and V (or stores U and S V^T); here the
    factor rows are orthonormal and the latent carries the singular values (the same product).
    Padding tokens are left out of the fit. Reference code read: abdelfattah-lab/xKV
    (fake_layer_merge_dynamic_cache.py `fake_svd`, xKV_SR kv_cache_xkv.py `svd`, configurations.py
    `generate_consecutive_layer_groups`, examples/xKV/eval_ruler_llama.sh for the ranks).
    """

    name = "xkv"
    paper = "#12"
    group: int = 4
    k: float = 0.09375
    v: float = 0.140625
    start: float = 0.0
    pre_rope: bool = True

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"{self.name}: group must be >= 1 (layers sharing a subspace), got {self.group}")
        for field_name in ("k", "v"):
            value = getattr(self, field_name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{self.name}: {field_name} must be in (0, 1] (rank / the group's width), got {value}")
        if not 0.0 <= self.start <= 1.0:
            raise ValueError(f"{self.name}: start must be in [0, 1] (fraction of the depth), got {self.start}")

    def groups(self, sliding: list[bool]) -> list[list[int]]:
        return layer_groups(sliding, self.start, self.group)

    def join_group(self, layers: list[CompressedLayer], lo: int, hi: int) -> None:
        first, seq = layers[0], layers[0].seq
        members = [(layer, h) for layer in layers for h in range(layer.n_kv_heads)]
        candidate, positions = shared_plain(members, lo, hi, seq)
        k = int(candidate.sum(1).min())
        if k == 0:
            return
        n = hi - lo
        picked, _ = compact(torch.arange(n, device=candidate.device).expand(first.batch, -1), candidate)
        chosen = picked[:, :k]  # the k oldest slots every member holds, per row
        slots = lo + chosen
        index = [torch.gather(p, 1, chosen) for p in positions]
        position = token_positions(seq, slots)
        rotated = self.pre_rope and first.inv_freq is not None
        keys, values = [], []
        for (layer, h), at in zip(members, index, strict=True):
            x = gather_rows(layer.keys[h], at).float()
            keys.append(rotate(x, -position, layer.inv_freq) if rotated and layer.inv_freq is not None else x)
            values.append(gather_rows(layer.values[h], at).float())
        fit = real_tokens(seq, slots)
        key_x, value_x = torch.cat(keys, -1), torch.cat(values, -1)
        latent_k, factor_k = shared_subspace(key_x, group_rank(self.k, key_x.shape[-1]), fit)
        latent_v, factor_v = shared_subspace(value_x, group_rank(self.v, value_x.shape[-1]), fit)
        dtype = first.keys[0].dtype
        latent_k, factor_k = latent_k.to(dtype), factor_k.to(dtype)
        latent_v, factor_v = latent_v.to(dtype), factor_v.to(dtype)
        itemsize = first.keys[0].element_size()
        key_codec = SharedLatent(latent_k.shape[-1], itemsize, len(members))
        value_codec = SharedLatent(latent_v.shape[-1], itemsize, len(members))
        key_tables = {"latent": latent_k, "position": position.to(torch.int32)} if rotated else {"latent": latent_k}
        row = row_index(k, first.batch, chosen.device)  # every member starts reading the same rows
        at_k = at_v = 0
        for (layer, h), at in zip(members, index, strict=True):
            dk, dv = layer.keys[h].shape[-1], layer.values[h].shape[-1]
            inv_freq = layer.inv_freq if rotated else None
            part = Coded(
                Encoded(
                    key_codec,
                    k,
                    dk,
                    dtype,
                    Where(layer.layer_idx, h, "key", inv_freq=inv_freq),
                    {"row": row},
                    {},
                    {**key_tables, "factor": factor_k[:, :, at_k : at_k + dk]},
                ),
                Encoded(
                    value_codec,
                    k,
                    dv,
                    dtype,
                    Where(layer.layer_idx, h, "value"),
                    {"row": row},
                    {},
                    {"latent": latent_v, "factor": factor_v[:, :, at_v : at_v + dv]},
                ),
            )
            move_to_part(layer, h, at, part)
            at_k, at_v = at_k + dk, at_v + dv
