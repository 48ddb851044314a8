"""`d2o`: D2O's layer-level budgets (Wan et al., 2024): layers with denser attention keep more."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvstack.methods.allocate.base import Allocator, Plan, default_scorer
from kvstack.methods.base import Observation, Stage
from kvstack.methods.merge.base import Merge, Merger, nearest_kept
from kvstack.methods.registry import register


def attention_spread(attention_sum: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b,) one layer's e: the variance over tokens of the attention each token received (b, h, t),
    per head and over the real tokens `valid` (b, h, t) (unbiased, 0 with under 2 tokens),
    min-max normalised across the layer's heads (+1e-6 in the denominator, as the reference
    code), then averaged over the heads. Low e: attention spread evenly (dense)."""
    s = attention_sum.double().masked_fill(~valid, 0.0)
    n = valid.sum(-1).to(s.dtype)  # (b, h)
    mean = s.sum(-1) / n.clamp(min=1)
    var = ((s - mean[..., None]).pow(2) * valid).sum(-1) / (n - 1).clamp(min=1)
    var = torch.where(n >= 2, var, torch.zeros_like(var))
    low, high = var.amin(-1, keepdim=True), var.amax(-1, keepdim=True)
    return ((var - low) / (high - low + 1e-6)).mean(-1)


def d2o_weights(spread: torch.Tensor) -> torch.Tensor:
    """(L, b) budget weights softmax(-e) x L over the layers, from e (L, b): mean 1, lower e keeps more."""
    return torch.softmax(-spread.double(), dim=0) * spread.shape[0]


def recall_weights(similarity: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """(b, h, t) D2O's merge weights: a token left out whose nearest kept key has cosine
    similarity s >= threshold (b, h, 1) joins it with weight exp(s) / e, the kept token keeping
    weight 1 (that is e / (e + sum exp(s)) after normalising, as in the reference); 0 otherwise."""
    joins = torch.isfinite(similarity) & (similarity >= threshold)
    return torch.where(joins, torch.exp(similarity - 1.0), torch.zeros_like(similarity))


@register
@dataclass
class D2O(Allocator, Merger):
    """Dynamic Discriminative Operations, layer level: a layer whose attention is spread evenly
    over the prompt (low variance of the attention each token received, summed over the prompt's
    queries) needs many tokens; a layer that attends to a few tokens can give some up. Per layer
    e = mean over heads of the min-max normalised variance; weights = softmax(-e) x L
    (`LlamaAttention3_D2O` in AIoT-MLSys-Lab/D2O LLM_merge_new/LMEval_kv_token_merge/
    modeling_llama3_7b_13b_d2o.py computes e during prefill). Default scorer h2o: D2O keeps
    H2O's heavy hitters (accumulated attention) plus a recent window inside each layer's budget.

    Token level (`recall`, on by default): every token the scorer leaves out is compared with
    the kept ones by key cosine similarity; if its nearest kept key is at least as similar as
    the threshold, it is recalled and merged into it with weight exp(s) / e (`recall_weights`),
    keys and values alike, after RoPE as the cache holds them (a merged entry keeps its kept token's
    slot and position). Merged entries carry no extra attention weight (`log_count=False`,
    as in the paper); `d2o(recall=False)` is the allocator alone.

    Deviations: the attention sums are per KV head (summed over its query group), not per query
    head, and per batch row; the reference never compresses layers 0, 1 and L-1, we keep the
    budget honest and weigh every layer. The reference keeps the threshold as an exponential
    moving average of the similarities over decoding steps; here a method holds no state, so
    the threshold is the mean nearest similarity of the tokens left out at each compression.

    Shapes: attention_sum (b, h, t) per layer -> e (L, b) -> weights (L, b, h); merge target
    and weight (b, h, t).
    """

    name = "d2o"
    paper = "D2O: Dynamic Discriminative Operations for Efficient Generative Inference of LLMs (arXiv 2406.13035)"
    needs = frozenset({"attention_sum"})
    whole_prompt: ClassVar[bool] = True
    scorer: Stage = field(default_factory=lambda: default_scorer("h2o"))
    recall: bool = True
    log_count: bool = False

    @property
    def roles(self) -> frozenset[str]:
        """A merger only while it recalls (recall=True); else it evicts what it leaves out."""
        return super().roles if self.recall else super().roles - {"merger"}

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        target, similarity = nearest_kept(obs.keys, kept, obs.valid)
        left_out = obs.valid & ~kept & torch.isfinite(similarity)
        n = left_out.sum(-1, keepdim=True).clamp(min=1)
        threshold = torch.where(left_out, similarity, torch.zeros_like(similarity)).sum(-1, keepdim=True) / n
        weight = torch.where(left_out, recall_weights(similarity, threshold), torch.zeros_like(similarity))
        return Merge(torch.where(weight > 0, target, -1), weight)

    def weights(self, plan: Plan) -> torch.Tensor:
        L, b, h = plan.shape
        spread = []
        for layer_idx in range(L):
            obs = plan.observation(layer_idx)
            spread.append(attention_spread(obs.attention_sum, obs.valid))
        w = d2o_weights(torch.stack(spread))  # (L, b)
        return w[:, :, None].expand(L, b, h)
