"""How a planned head stores its kept tokens: plain, or keys and values at given bit widths
after a full-precision residual window, on KIVI's layout (uniform levels, scales per group) or
TurboQuant's (a rotation, Lloyd-Max levels, a norm per token: `t3`, `t4/2`). Pure functions
give what each option costs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvstack.cache.budget import Cost
from kvstack.cache.encoded import Codec, Uniform
from kvstack.cache.packing import check_bits, packed_size
from kvstack.cache.window import plain_window, to_encode
from kvstack.errors import UserError
from kvstack.methods.quantize.turboquant import TurboCodec

PLAIN = 16  # bits of a token held in the model's dtype (bf16 / fp16)
GROUP = 32  # tokens sharing a key scale per channel, as KIVI groups them


@dataclass(frozen=True)
class Storage:
    """Keys at `key_bits`, values at `value_bits` (16: the model's dtype), the newest `residual`
    kept tokens in the model's dtype; `rule` "kivi" (keys per channel, values per token) or
    "turbo" (TurboQuant's codes)."""

    key_bits: int = PLAIN
    value_bits: int = PLAIN
    residual: int = 0
    rule: str = "kivi"

    @classmethod
    def parse(cls, bits: str, residual: int = 0) -> Storage:
        """`16` (plain), `4` (keys and values at 4 bits), `4/2` (keys 4, values 2); a leading `t`
        (`t3`, `t4/2`) for TurboQuant's codes."""
        text = str(bits)
        rule = "turbo" if text.startswith("t") else "kivi"
        parts = text.removeprefix("t").split("/")
        try:
            k, v = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
        except ValueError:
            k = v = 0
        if k == v == PLAIN and rule == "kivi":
            return cls()
        if not k or PLAIN in (k, v):
            raise UserError(f"auto: bits '{bits}' is not understood: write 16 (plain), 4 or 4/2 (keys/values), t3")
        check_bits(k, "auto"), check_bits(v, "auto")
        return cls(k, v, residual, rule)

    @property
    def plain(self) -> bool:
        return self.key_bits == PLAIN

    def __str__(self) -> str:
        if self.plain:
            return "16"
        bits = f"{self.key_bits}" if self.key_bits == self.value_bits else f"{self.key_bits}/{self.value_bits}"
        return f"{'t' if self.rule == 'turbo' else ''}{bits}+r{self.residual}"

    @classmethod
    def from_text(cls, text: str) -> Storage:
        """The inverse of `str`: `16`, `4/2+r32`, `t3+r0`."""
        bits, _, residual = text.partition("+r")
        return cls.parse(bits, int(residual or 0))


@cache
def codecs(storage: Storage, head_dim: int) -> tuple[Codec, Codec] | None:
    """The key and value codecs of a storage (one instance per storage, so the cache joins parts
    coded alike), or None when it is plain."""
    if storage.plain:
        return None
    if storage.rule == "turbo":
        return TurboCodec(storage.key_bits), TurboCodec(storage.value_bits)
    group = max(g for g in (32, 16, 8, 4, 2, 1) if head_dim % g == 0)
    return Uniform(storage.key_bits, "channel", GROUP), Uniform(storage.value_bits, "token", group)


@cache  # read per head at every decoding step under a plan
def group_of(storage: Storage) -> tuple[int, bool]:
    """Tokens a head encodes together under `storage` and whether the group only batches calls
    (KIVI's key groups share scales; TurboQuant's batches share nothing: `kvstack.cache.window`)."""
    if storage.rule == "kivi":
        return GROUP, False
    codec = TurboCodec(storage.key_bits)
    return codec.token_group, codec.batches_only


def cost(storage: Storage, head_dim: int, full: int, slot: int) -> Cost:
    """What a token costs one head under `storage` (the cache's `Cost`): `full` bytes a plain
    token's key and value take, `slot` its position index once compressed."""
    pair = codecs(storage, head_dim)
    if pair is None:
        return Cost(full, full + slot)
    kept = sum(c.token_bytes(head_dim) for c in pair) + slot
    return Cost(full, kept, plain_window(storage.residual, *group_of(storage)), full + slot)


def coded_count(kept: int, storage: Storage, decoding: bool = False) -> int:
    """Tokens of `kept` held encoded once the head is coded (right after a compression unless
    `decoding`): the oldest, beyond the residual window, as `kvstack.cache.window` says."""
    if storage.plain:
        return 0
    return to_encode(kept, storage.residual, *group_of(storage), decoding)


def held_bytes(kept: int, storage: Storage, head_dim: int, full: int, slot: int) -> float:
    """Bytes a head holds right after keeping `kept` tokens under `storage` (slots included): its
    coded tokens in freshly encoded whole groups (`cost` plans groups thinned by later evictions)."""
    coded = coded_count(kept, storage)
    pair = codecs(storage, head_dim)
    if pair is None or coded == 0:
        return kept * (full + slot)
    keys, values = pair
    if storage.rule == "turbo":  # nothing shared between tokens: the planned cost is exact
        per_token = keys.token_bytes(head_dim) + values.token_bytes(head_dim) + slot
        return coded * per_token + (kept - coded) * (full + slot)
    meta = 2 * 2  # a float16 scale and zero
    key_bytes = packed_size(head_dim, keys.bits) + head_dim * meta / GROUP
    value_bytes = packed_size(head_dim, values.bits) + head_dim // values.group * meta
    return coded * (key_bytes + value_bytes + slot) + (kept - coded) * (full + slot)
