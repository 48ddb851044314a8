"""Base of the allocators whose budgets come from a one-off calibration of the model's heads.

The cache cannot run the model from inside a forward pass, so `KVCache.__init__` calls
`prepare(model)` on every allocator of its stack: a head allocator then measures the model
(or reads the saved measurement, `kvstack.calibrate`) and the cache keeps the table (plain
data, per cache: one parsed stack may serve several models); `weights(plan)` turns it into
budget weights. The weights depend on the model only, never on the prompt, so
they are decided a priori (no whole-prompt deferral).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.errors import UserError
from kvstack.methods.allocate.base import Allocator, Plan


@dataclass
class Calibrated(Allocator):
    """A head allocator: `measure(model)` gives a table (..., L, h_kv) saved under `kind`,
    `head_weights(table)` (L, h_kv) budget weights relative to a uniform split."""

    @property
    def kind(self) -> str:
        """Name of the saved table: changes whenever what `measure` computes changes."""
        return f"{self.name}-v1"

    def measure(self, model: Any) -> torch.Tensor:
        raise NotImplementedError

    def head_weights(self, table: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, model: Any) -> torch.Tensor:
        """The table of `model`, measured or loaded from disk; called by KVCache.__init__."""
        from kvstack.calibrate import measured_on

        return measured_on(model, self.kind, self.measure, f"{self.name} calibrates the model's attention heads")

    def weights(self, plan: Plan) -> torch.Tensor:
        table = plan.calibration.get(self.kind)
        if table is None:
            raise UserError(f"{self.name} has no calibration: build the KVCache from the model (KVCache(model, ...))")
        w = self.head_weights(table)
        L, b, h = plan.shape
        if tuple(w.shape) != (L, h):
            raise UserError(
                f"{self.name} was calibrated on a model with {tuple(w.shape)} (layers, KV heads), this cache "
                f"has {(L, h)}: build the KVCache from the model it serves"
            )
        return w.double()[:, None, :].expand(L, b, h)
