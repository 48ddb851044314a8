"""Where a slow tier's bytes live: a file on disk, or host memory (pinned when a GPU reads it).

Both are flat byte spaces addressed by offset, written and read in place: `write(data, offset)`,
`readv(parts, offset)` (scatter one run into several buffers, as `preadv` does), `read`, and
`clone` (a store that evolves on its own); a host store also gathers whole records at once
(`records`). The tier decides the layout (`kvstack.cache.tier`).
- `FileStore`: an unlinked temporary file. The bytes leave the process's memory (the operating
  system may keep them in its file cache) and are freed when the store goes; the default on CPU.
- `HostStore`: one growing uint8 tensor in host memory, page-locked (pinned) when CUDA is
  there, so a GPU reads it by DMA without a staging copy; the default when the cache is on a GPU
  (ShadowKV keeps its offloaded values in pinned CPU memory). On CPU it is plain memory, read
  by one gather instead of a system call per page: as fast as the file, but the bytes stay in RAM.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

STORES = ("auto", "disk", "host")  # what a retriever's `store=` may name (auto: host on a GPU, else disk)


class FileStore:
    """A slow tier's bytes in an unlinked temporary file."""

    pinned = False

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(prefix="kvstack-tier-")

    def write(self, data: bytes, offset: int) -> None:
        os.pwrite(self.file.fileno(), data, offset)

    def readv(self, parts: list[memoryview], offset: int) -> int:
        """Fill parts in turn from the bytes at `offset`; the bytes read (short past the end)."""
        return os.preadv(self.file.fileno(), parts, offset)

    def read(self, n: int, offset: int) -> bytes:
        return os.pread(self.file.fileno(), n, offset)

    def clone(self) -> FileStore:
        new = FileStore()
        self.file.seek(0)
        while chunk := self.file.read(1 << 24):
            new.file.write(chunk)
        new.file.flush()
        return new


class HostStore:
    """A slow tier's bytes in one host-memory tensor that doubles as it fills, pinned if asked."""

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self.buffer = self._empty(1 << 20)
        self.size = 0  # bytes written up to (the highest end of any write)

    def _empty(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, pin_memory=self.pinned)

    def _array(self) -> np.ndarray:
        return self.buffer.numpy()

    def write(self, data: bytes, offset: int) -> None:
        end = offset + len(data)
        if end > len(self.buffer):
            grown = self._empty(max(end, 2 * len(self.buffer)))
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self._array()[offset:end] = np.frombuffer(data, dtype=np.uint8)
        self.size = max(self.size, end)

    def readv(self, parts: list[memoryview], offset: int) -> int:
        source, read = self._array(), 0
        for part in parts:
            n = max(0, min(len(part), self.size - offset - read))
            np.frombuffer(part, dtype=np.uint8)[:n] = source[offset + read : offset + read + n]
            read += n
        return read

    def read(self, n: int, offset: int) -> bytes:
        return self._array()[offset : min(offset + n, self.size)].tobytes()

    def records(self, index: torch.Tensor, size: int) -> torch.Tensor:
        """(n, size) uint8 the records of `size` bytes numbered index (n,) (record i at i * size),
        zeros past what was written; page-locked where the store is."""
        count = len(self.buffer) // size
        table = self.buffer[: count * size].view(count, size)
        inside = index < count
        out = torch.zeros(len(index), size, dtype=torch.uint8, pin_memory=self.pinned)
        torch.index_select(table, 0, torch.where(inside, index, 0), out=out)
        out.index_fill_(0, (~inside).nonzero().squeeze(-1), 0)  # (masked assignments cost 10-30x more)
        return out

    def clone(self) -> HostStore:
        new = HostStore(self.pinned)
        new.buffer, new.size = new._empty(len(self.buffer)), self.size
        new.buffer.copy_(self.buffer)
        return new


def open_store(store: str, device: torch.device) -> FileStore | HostStore:
    """A new store of kind `store` (STORES) for a cache on `device`."""
    if store == "auto":
        store = "host" if device.type == "cuda" else "disk"
    return HostStore(pinned=device.type == "cuda") if store == "host" else FileStore()
