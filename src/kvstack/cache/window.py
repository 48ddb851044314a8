"""How many tokens a head holds in the model's dtype beside its codes, and when the oldest are coded.

A quantizer keeps the newest `residual` tokens of a head in the model's dtype and codes the
older ones `group` at a time (its codec's `token_group`). Two kinds of group:

- shared: the group's tokens share metadata (KIVI's per-channel key scales), so only whole
  groups are coded; up to `residual + group - 1` tokens wait in the model's dtype.
- batched (`Codec.batches_only`): nothing is shared (TurboQuant codes each token alone and
  batches the calls for speed), so a group may be cut short. The window fills to
  `max(residual, group - 1)` and, while decoding, empties by a whole group when it overflows
  (KIVI's own residual, which fills to R and then is coded); at the end of a prompt exactly the
  overflow is coded, so the bytes the budget counts for the window are the bytes held.

The budget counts `plain_window` tokens at full size (`Cost.residual`); these pure functions are
what the policy executes, so the two cannot disagree.
"""

from __future__ import annotations


def plain_window(residual: int, group: int, batches_only: bool) -> int:
    """Most tokens a head holds in the model's dtype between two steps."""
    return max(residual, group - 1) if batches_only else residual + group - 1


def to_encode(plain: int, residual: int, group: int, batches_only: bool, decoding: bool) -> int:
    """How many of a head's `plain` tokens held in the model's dtype (its oldest) to code now:
    whole shared groups beyond `residual`; for batched groups, exactly the overflow of the window
    after a prompt, whole groups of it while decoding (one call per `group` steps)."""
    if not batches_only:
        return max(plain - residual, 0) // group * group
    over = plain - plain_window(residual, group, True)
    if over <= 0:
        return 0
    return over if not decoding else min(-(-over // group) * group, plain)
