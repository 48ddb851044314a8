"""What every layer of a cache shares about its sequences: padding, exempt slots, where the prompt ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceState:
    """What all layers share about the sequences: padding, which slots are exempt, where the prompt ends.

    padding: (b, slots) True for real tokens, None when nothing is padded; exempt: slot ranges
    [start, end) appended uncompressed (e.g. a question after a query-agnostic compression).
    """

    padding: torch.Tensor | None = None
    exempt: list[tuple[int, int]] = field(default_factory=list)
    prompt_end: int = 0  # slots before this arrived in multi-token (prefill) chunks
    ends: torch.Tensor | None = None  # (b, slots) True where a token ends a sentence (kept for `sentence`)
    ids: torch.Tensor | None = None  # (b, slots) int32 each slot's token id, -1 unknown (kept for `s3`)

    def real_counts(self, seen: int, batch: int, since: int = 0, device: torch.device | None = None) -> torch.Tensor:
        """(b,) real tokens among slots [since, seen); slots past the padding's width are tokens
        still to come, all real."""
        if self.padding is None:
            return torch.full((batch,), max(seen - since, 0), dtype=torch.long, device=device)
        to_come = max(0, seen - max(since, self.padding.shape[1]))
        return self.padding[:, since:seen].sum(-1).long() + to_come

    def token_index(self) -> torch.Tensor | None:
        """(b, slots) position of each slot among its sequence's real tokens, or None."""
        if self.padding is None:
            return None
        return (self.padding.long().cumsum(-1) - 1).clamp(min=0)

    def copy(self) -> SequenceState:
        """An independent copy (tensors are replaced, never written in place, so they are shared)."""
        return SequenceState(self.padding, list(self.exempt), self.prompt_end, self.ends, self.ids)

    def mark_ends(self, ends: torch.Tensor, seen: int) -> None:
        """Record which of the next tokens (b, q) end a sentence, after `seen` slots (slots whose
        tokens were never marked, e.g. before a saved cache was loaded, end none)."""
        self.ends = _extend(self.ends, ends, seen, False)

    def record_ids(self, ids: torch.Tensor, seen: int) -> None:
        """Record the next tokens' ids (b, q) after `seen` slots (slots never recorded: -1)."""
        self.ids = _extend(self.ids, ids.to(torch.int32), seen, -1)

    def sentence_index(self) -> torch.Tensor | None:
        """(b, slots) the sentence each slot belongs to: how many sentence ends came before it."""
        if self.ends is None:
            return None
        ends = self.ends.long()
        return ends.cumsum(-1) - ends

    def is_exempt(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor like slots: True for slots inside an exempt range."""
        out = torch.zeros_like(slots, dtype=torch.bool)
        for start, end in self.exempt:
            out |= (slots >= start) & (slots < end)
        return out


def _extend(old: torch.Tensor | None, new: torch.Tensor, seen: int, fill: bool | int) -> torch.Tensor:
    """(b, seen + q) what `old` (b, <= seen) holds for slots before `seen` (`fill` where it holds
    nothing), then `new` (b, q): a per-slot record that stays aligned with the cache's slots."""
    have = 0 if old is None else old.shape[1]
    gap = new.new_full((new.shape[0], max(seen - have, 0)), fill)
    kept = new.new_zeros(new.shape[0], 0) if old is None else old[:, :seen]
    return torch.cat([kept, gap, new], dim=1)
