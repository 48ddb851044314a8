"""Random orthogonal rotations for quantizers: the randomized Hadamard transform (QuaRot, TurboQuant).

One orthogonal matrix applied to every key (or value) of a head leaves every inner product
unchanged, q . k = (q R) . (k R), but spreads a few large channels over all of them, so a
quantizer's range is set by typical values, not by outliers. R = diag(s) H: random signs s,
then the orthonormal Walsh-Hadamard matrix H (Sylvester's construction; block-diagonal, one
block per power-of-two run of channels, when d is not a power of two). H is symmetric and its
own inverse, so undoing R costs the same as applying it. Pure functions of (d, seed).
"""

from __future__ import annotations

from functools import cache

import torch


def block_size(d: int) -> int:
    """The largest power of two dividing d: the size of each Hadamard block."""
    return d & -d


@cache
def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, n) float32 orthonormal Walsh-Hadamard matrix (n a power of two): symmetric, H @ H = I."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard matrix of Sylvester's kind needs a power of two, not {n}")
    key = (n, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = _hadamard(n).to(key[1])
    return _ON_DEVICE[key]


@cache
def random_signs(d: int, seed: int) -> torch.Tensor:
    """(d,) float32 of +1 / -1, the same for the same (d, seed); memoised (codecs ask at every read),
    so callers must not write into it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    n = block_size(d)
    return x.reshape(*x.shape[:-1], d // n, n), hadamard(n, x.device)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x (..., d) float32 times R = diag(signs) H: (..., d) float32."""
    blocks, h = _blocks(x.float() * signs.float().to(x.device))
    return (blocks @ h).reshape(x.shape)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The inverse of `rotate`: y (..., d) times R^T = H diag(signs), float32."""
    blocks, h = _blocks(y.float())
    return (blocks @ h).reshape(y.shape) * signs.float().to(y.device)


def matrix(signs: torch.Tensor) -> torch.Tensor:
    """(d, d) float32 R with rotate(x) = x @ R (orthogonal: x = rotate(x) @ R^T)."""
    d = signs.shape[0]
    return rotate(torch.eye(d, device=signs.device), signs)


_MATRICES: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def seeded_matrix(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """`matrix(random_signs(d, seed))` on `device`, built once per (d, seed, device): a rotated-basis
    read asks for it at every decoding step of every head."""
    key = (d, seed, torch.device(device))
    if key not in _MATRICES:
        _MATRICES[key] = matrix(random_signs(d, seed).to(device))
    return _MATRICES[key]
