"""`PrefixStore`: compressed contexts on disk, keyed by (model, stack, budget, text), so a document
asked about again is loaded instead of prefilled and compressed again (KVzip's re-reading pass,
5-13x a prefill, is then paid once per document, not once per question).

Files are written whole under a temporary name and renamed into place, and read whole with one
`read_bytes`: a reader sees a complete file or none, even while another process writes or evicts
(an unlinked file stays readable through an open handle). Writers take a lock file for the
put-and-evict step. Least recently used files go first once the folder holds more than `max_bytes`
(a load touches its file's time).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstack.api import compress, context_ids, text_sha256
from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.cache.saved import fingerprint, load
from kvstack.errors import UserError
from kvstack.models.loading import LoadedModel
from kvstack.stack import Stack

SUFFIX = ".kvc"


def _same_file(path: Path, seen: os.stat_result) -> bool:
    """True while `path` is still the file `seen` was taken of (not replaced by a writer since)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns)


def _stamp(path: Path) -> None:
    """Mark `path` used now by the process clock in nanoseconds: the filesystem's own stamp comes
    from a coarse kernel clock (a few ms), so two uses in a row could tie and evict the wrong file."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class PrefixStore:
    """Compressed contexts in folder `root`, at most `max_bytes` of files (see module docstring)."""

    def __init__(self, root: str | Path, max_bytes: int | str) -> None:
        self.root = Path(root)
        self.max_bytes = Budget.parse(max_bytes).nbytes if isinstance(max_bytes, str) else int(max_bytes)
        if not self.max_bytes or self.max_bytes <= 0:
            raise UserError(f"prefix store size {max_bytes!r}: give a positive size such as 2GB")
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def path(self, model: Any, stack: Stack | str, budget: Budget | str | float, ids: list[int]) -> Path:
        """The file a context's cache has (or would have) in this store."""
        stack = stack if isinstance(stack, Stack) else Stack.parse(stack)
        key = "\0".join([fingerprint(model), stack.label, str(Budget.parse(budget)), text_sha256(ids)])
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}{SUFFIX}"

    def get(self, model: Any, stack: Stack | str, budget: Budget | str | float, ids: list[int]) -> KVCache | None:
        """The stored cache of this context, loaded (a fresh copy each call), or None."""
        path = self.path(model, stack, budget, ids)
        try:
            seen = path.stat()
            cache = load(model, path)[0]
        except (FileNotFoundError, UserError) as e:  # not stored, evicted meanwhile, or damaged
            if isinstance(e, UserError) and _same_file(path, seen):  # damaged: drop it, unless replaced since
                path.unlink(missing_ok=True)
            self.misses += 1
            return None
        try:
            _stamp(path)  # most recently used
        except FileNotFoundError:
            pass  # evicted by another process after we read it: the copy we hold is complete
        self.hits += 1
        return cache

    def put(self, cache: KVCache, ids: list[int]) -> Path | None:
        """Store `cache` (holding context `ids`, before any question) and evict the least recently
        used files beyond `max_bytes`; None when the file alone is larger than the store."""
        path = self.path(cache.source, cache.stack, cache.budget, ids)
        with self._locked():
            cache.save(path, text_sha256(ids), cache.last_logits)
            _stamp(path)
            if os.stat(path).st_size > self.max_bytes:
                path.unlink()
                return None
            self._evict(keep=path)
        return path

    def cache_for(
        self,
        lm: LoadedModel,
        context: str,
        method: str | Stack,
        budget: str | float | Budget,
        prefill_chunk: int | None = None,
    ) -> tuple[KVCache, bool]:
        """(a cache holding `context` compressed by `method` at `budget`, whether it came from the
        store): loaded when stored, else compressed now and stored for next time."""
        ids = context_ids(lm, context)
        found = self.get(lm.model, method, budget, ids)
        if found is not None:
            return found, True
        cache = compress(lm, context, method, budget, prefill_chunk)
        self.put(cache, ids)
        return cache, False

    def files(self) -> list[Path]:
        """Stored files, least recently used first."""
        found = []
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                found.append((path.stat().st_mtime_ns, path))
            except FileNotFoundError:
                continue
        return [p for _, p in sorted(found)]

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.files() if p.exists())

    def _evict(self, keep: Path) -> None:
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                break
            if path != keep:
                total -= path.stat().st_size
                path.unlink(missing_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with (self.root / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
