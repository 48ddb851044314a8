"""What a learned scorer's predictor reads of each token, and a linear predictor's scores summed
feature by feature.

`features` writes each token's numbers out, (..., t, F): what training fits and an MLP reads.
A compression pays for scoring every held token of every layer, so a linear predictor is
evaluated without that matrix: `linear_scores` in torch, or the C kernel `kernels/scores.c`
(the same sum in one pass over the keys and values) where it runs: about 20 times fewer
operations than the matrix and its product.
"""

from __future__ import annotations

import ctypes

import torch

from kvstack.cache.kernels import library, pointer
from kvstack.errors import UserError
from kvstack.models.rope import rotate, turns

FEATURE_SETS = ("kv", "local", "gate")  # what a predictor reads; files without the "features" entry read "kv"
WINDOW = 16  # the tokens before a token whose mean the "local" features compare it with


def check_features(kind: str, ages: torch.Tensor | None) -> None:
    """A one-line error for a feature set this kvstack does not read, or local features without ages."""
    if kind not in FEATURE_SETS:
        raise UserError(f"unknown predictor features {kind!r}: this kvstack reads {', '.join(FEATURE_SETS)}")
    if kind == "local" and ages is None:
        raise ValueError("the local features need each token's age")


def features(
    pre_rope_keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None = None,
    ages: torch.Tensor | None = None,
    kind: str = "kv",
) -> torch.Tensor:
    """(..., t, F) a token's features, keys before RoPE and values (..., t, d), `valid` (..., t)
    (default all). "kv" (F = 2d + 4): the key and the value, then how the token stands among the
    head's tokens: the cosine of its key and of its value with their mean directions (KeyDiff's
    anchor), and the log of their norms over the mean norms. A token alone cannot say it is rare;
    these can. "local" (F = 4d + 11) adds how it stands among its neighbours (`local_numbers`), the
    log of its age `ages` (..., t) (tokens from it to the next query, >= 1) and the squares of
    the key's and value's coordinates: on held-out prose they keep 65% of KVzip's kept set at
    1/8 against 57% ("kv"). "gate" (F = 2d): the key and the value alone, each over its RMS (WG-KV's
    write gate reads a token as it is written: nothing about its neighbours, the head or its age,
    so its score never changes once written)."""
    check_features(kind, ages)
    k, v = pre_rope_keys.float(), values.float()
    d = k.shape[-1]
    if kind == "gate":
        return torch.cat([rms_normed(k), rms_normed(v)], -1)
    mask = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device) if valid is None else valid
    out = k.new_empty(*k.shape[:-1], 2 * d + 4 if kind == "kv" else 4 * d + 11)  # filled in place: no concatenation
    out[..., :d], out[..., d : 2 * d] = k, v
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    for i, x in enumerate((k, v)):
        norm = x.norm(dim=-1).clamp(min=1e-6)  # (..., t)
        anchor = ((x / norm[..., None]) * mask[..., None]).sum(-2, keepdim=True) / count[..., None]
        out[..., 2 * d + 2 * i] = cosine(x, anchor, norm, anchor.norm(dim=-1))
        out[..., 2 * d + 2 * i + 1] = (norm / ((norm * mask).sum(-1, keepdim=True) / count)).log()
        if kind == "local":
            out[..., 2 * d + 4 + 3 * i : 2 * d + 7 + 3 * i] = local_numbers(x, mask, norm)
            out[..., 2 * d + 11 + i * d : 2 * d + 11 + (i + 1) * d] = x * x
    if kind == "local":
        out[..., 2 * d + 10] = ages.float().clamp(min=1).log()
    return out


def linear_scores(
    pre_rope_keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    ages: torch.Tensor | None,
    kind: str,
    weight: torch.Tensor,
) -> torch.Tensor:
    """(b, h, t, o) `features(...) @ weight` for weight (h, F, o), feature group by feature group:
    the key and the value (and their squares) by one product each, the few numbers per token
    (how the token stands among its head's tokens and its neighbours, its age) from dot products
    and norms, for the key and the value at once. About ten times fewer operations than the
    feature matrix, none of them (b, h, t, F) wide; equal to it up to float rounding (tested)."""
    check_features(kind, ages)
    d = pre_rope_keys.shape[-1]
    if kind == "gate":
        return rms_normed(pre_rope_keys.float()) @ weight[:, :d] + rms_normed(values.float()) @ weight[:, d:]
    x = torch.stack([pre_rope_keys, values]).float()  # (2, b, h, t, d): the key's and the value's numbers at once
    mask = valid.to(x.dtype)  # (b, h, t)
    count = mask.sum(-1, keepdim=True).clamp(min=1)  # (b, h, 1)
    squares = x * x
    norm = squares.sum(-1).sqrt().clamp(min=1e-6)  # (2, b, h, t)
    anchor = ((mask / norm)[..., None, :] @ x) / count[..., None]  # (2, b, h, 1, d): mean direction
    along = (x @ anchor.transpose(-1, -2))[..., 0]  # (2, b, h, t)
    numbers = [
        along / (norm * anchor.norm(dim=-1)).clamp(min=1e-8),
        (norm / ((norm * mask).sum(-1, keepdim=True) / count)).log(),
    ]  # per set, key then value: cosine with the mean direction, log norm over the mean norm
    w_k, w_v = weight[:, :d], weight[:, d : 2 * d]  # (h, d, o)
    out = x[0] @ w_k + x[1] @ w_v
    if kind == "kv":
        scalars = torch.stack([numbers[0][0], numbers[1][0], numbers[0][1], numbers[1][1]], -1)  # (b, h, t, 4)
        return out + scalars @ weight[:, 2 * d : 2 * d + 4]
    assert ages is not None
    near = local_numbers(x, mask, norm)  # (2, b, h, t, 3)
    scalars = torch.cat(
        [
            torch.stack([numbers[0][0], numbers[1][0], numbers[0][1], numbers[1][1]], -1),
            near[0],
            near[1],
            ages.float().clamp(min=1).log()[..., None],
        ],
        -1,
    )  # (b, h, t, 11) in the order `features` writes them
    out = out + scalars @ weight[:, 2 * d : 2 * d + 11]
    return out + squares[0] @ weight[:, 2 * d + 11 : 3 * d + 11] + squares[1] @ weight[:, 3 * d + 11 :]


def kernel_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    ages: torch.Tensor | None,
    kind: str,
    weight: torch.Tensor,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`linear_scores` by the C kernel (kernels/scores.c), or None where it does not run: no
    kernel (no compiler, `KVSTACK_KERNELS=0`), a GPU tensor, a head width that is not a multiple
    of 16 up to 256, the "gate" set (two products in torch already). With `inv_freq` (d/2,) the
    keys are after RoPE at `positions` (b, h, t) and the kernel turns them back as it reads them
    (no rotated copy in torch)."""
    b, h, t, d = keys.shape
    if t == 0 or d % 16 or d > 256 or keys.device.type != "cpu" or kind not in ("kv", "local"):
        return None
    lib = library("scores")
    if lib is None:
        return None
    o = weight.shape[-1]
    table = where = None
    if inv_freq is not None:
        assert positions is not None
        where = positions.expand(b, h, t).to(torch.int32).contiguous()
        table = turns(inv_freq, int(where.max()) + 1)
    keys = keys.float().contiguous()
    vals = values.float().contiguous()
    mask = valid.expand(b, h, t).to(torch.uint8).contiguous()
    age = (ages.expand(b, h, t) if ages is not None else mask).float().contiguous()
    w = weight.float().permute(0, 2, 1).contiguous()  # (h, o, F)
    out = keys.new_empty(b, h, t, o)
    i64 = ctypes.c_int64
    turned = (None, None) if where is None or table is None else (pointer(where), pointer(table))
    lib.linear_scores(
        i64(b * h), i64(t), i64(d), i64(h), i64(o), ctypes.c_int(kind == "local"), pointer(keys), *turned,
        pointer(vals), pointer(mask), pointer(age), pointer(w), pointer(out), ctypes.c_int(torch.get_num_threads()),
    )  # fmt: skip
    return out


def local_numbers(x: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """(..., t, 3) how each token of x (..., t, d), of norms `norm` (..., t), differs from the held
    tokens just before it (`mask` (..., t), broadcast over x's leading dims: the real ones): the
    cosine with the previous token, the cosine with the mean of the WINDOW before it, and the log
    of the distance to that mean. A fact in prose is where the text changes."""
    real = x * mask[..., None]
    t = x.shape[-2]
    first = (x[..., :1, :] * real[..., :1, :]).sum(-1)  # the first token's "previous" is itself
    previous_dot = torch.cat([first, (x[..., 1:, :] * real[..., :-1, :]).sum(-1)], -1)
    shifted = torch.cat([mask[..., :1], mask[..., :-1]], -1)
    previous_norm = torch.cat([norm[..., :1], norm[..., :-1]], -1) * shifted
    window = torch.zeros_like(x)  # the sum of the WINDOW real tokens before each token
    sums = real.cumsum(-2)
    window[..., 1:, :] = sums[..., :-1, :]
    lag = min(WINDOW, t)
    if t > lag:
        window[..., lag + 1 :, :] -= sums[..., : t - lag - 1, :]
    counts = torch.cat([torch.zeros_like(mask[..., :1]), mask.cumsum(-1)], -1)  # real tokens before each
    n = counts[..., :t] - torch.cat([counts[..., :1].expand(*counts.shape[:-1], lag), counts[..., : t - lag]], -1)
    mean = window / n.clamp(min=1)[..., None]
    mean_norm = mean.norm(dim=-1)
    distance = (x - mean).norm(dim=-1).clamp(min=1e-6).log()
    return torch.stack(
        [
            previous_dot / (norm * previous_norm).clamp(min=1e-8),
            (x * mean).sum(-1) / (norm * mean_norm).clamp(min=1e-8),
            distance,
        ],
        -1,
    )


def rms_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., d) over its root mean square (WG-KV's RMSNorm before the gate, its scale left to the
    predictor's weights): a token's direction and shape, not its size."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def cosine(x: torch.Tensor, y: torch.Tensor, x_norm: torch.Tensor, y_norm: torch.Tensor) -> torch.Tensor:
    """(...) the cosine of x and y (..., d) with their norms (...) given (0 where either is 0)."""
    return (x * y).sum(-1) / (x_norm * y_norm).clamp(min=1e-8)


def before_rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """keys (b, h, t, d) at `positions` turned back to before RoPE (float32); as they are without it."""
    return rotate(keys.float(), -positions.float(), inv_freq) if inv_freq is not None else keys
