"""Head measurements for the head-level allocators, on synthetic random-token prompts.

No data set and no tokenizer: every prompt is random token ids, and the tasks are copy tasks
any causal LM can do in context (repeat a random segment, recall a random "needle" span).

- `razor_scores` (RazorAttention, arXiv 2407.15891): a random segment repeated 4 times; echo
  score = attention from each token to its earlier copy, induction score = attention to the
  token that followed the earlier copy. (2, L, h_kv): echo, induction.
- `headkv_scores` (HeadKV-R2, arXiv 2410.19258, FYYFU/HeadKV retrieval_head_detection_r2.py):
  a random haystack with a random needle span; the needle's first ids are repeated and the rest
  teacher-forced; a head scores the attention its top-k positions put inside the needle span.
  (L, h_kv), summing to 1.
- `cokv_ssv` (CoKV, arXiv 2502.17501, nawei1010/CoKV cal_global_sv.py): Sliced Shapley values of
  the KV heads as players of a game whose value is the log-probability of the needle's rest when
  only the heads of a coalition keep their whole cache. (L, h_kv).

The attention measurements run the model with transformers' eager attention and read each
layer's attention weights (b, H, T, T) from a forward hook, reducing them at once, so only one
layer's weights are alive at a time; the kvstack attention is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvstack.cache.factory import full_cache
from kvstack.calibrate.store import Ticker
from kvstack.models.config import text_config

SPAN = 16  # needle length in ids
CUE = 4  # needle ids given before the teacher-forced rest
DEPTHS = (0.25, 0.5, 0.75)  # where the needle sits in the haystack (one batch row each)
RECENT = 8  # tokens a head outside a CoKV coalition keeps (its last ones; CoKV's window 8)
SLICES = (1 / 8, 1 / 4, 3 / 8, 1 / 2)  # CoKV's coalition sizes, as fractions of the players
SEED = 0


# ---- prompts ------------------------------------------------------------------------------
def token_range(vocab: int) -> tuple[int, int]:
    """[low, high) ids for random prompts: clear of the special ids that most vocabularies put
    first (the lowest 1%) or last (the top 10%, also config padding)."""
    low = min(3 + vocab // 100, vocab - 1)
    return low, max(low + 1, int(vocab * 0.9))


def random_ids(vocab: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    low, high = token_range(vocab)
    return torch.randint(low, high, shape, generator=generator)


def needle_prompts(vocab: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(context (b, length), needle (b, SPAN)): one row per depth in DEPTHS, a random needle span
    inside a random haystack. The needle of row i starts at `needle_starts(length)[i]`."""
    rows = len(DEPTHS)
    hay = random_ids(vocab, (rows, length - SPAN), generator)
    needle = random_ids(vocab, (rows, SPAN), generator)
    starts = needle_starts(length)
    context = torch.stack([torch.cat([hay[i, :s], needle[i], hay[i, s:]]) for i, s in enumerate(starts.tolist())])
    return context, needle


def needle_starts(length: int) -> torch.Tensor:
    """(b,) where each row's needle starts in a context of `length` ids."""
    return torch.tensor([round(d * (length - SPAN)) for d in DEPTHS])


def max_positions(model: Any) -> int:
    return int(getattr(text_config(model.config), "max_position_embeddings", 0) or 4096)


# ---- eager attention, one layer at a time -------------------------------------------------
def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The decoder's attention modules in layer order (`*.self_attn` with a `layer_idx`)."""
    n_layers = text_config(model.config).num_hidden_layers
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if name.endswith("self_attn") and isinstance(idx, int):
            found.setdefault(idx, module)
    if sorted(found) != list(range(n_layers)):
        raise RuntimeError(
            f"calibration cannot find the {n_layers} attention modules of {type(model).__name__} "
            "(it looks for '*.self_attn' modules with a layer_idx)"
        )
    return [found[i] for i in range(n_layers)]


@contextmanager
def eager_attention(model: Any, reduce: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Run the model with eager attention inside the block; `reduce(layer_idx, weights)` gets each
    layer's attention weights (b, H, T, T) as soon as the layer has run. Restores the previous
    attention implementation and training mode on the way out."""
    previous = text_config(model.config)._attn_implementation
    training = model.training
    handles = []

    def hook(layer_idx: int) -> Callable[..., None]:
        def read(module: torch.nn.Module, args: Any, output: Any) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(f"layer {layer_idx} returned no attention weights under eager attention")
            reduce(layer_idx, weights)

        return read

    model.set_attn_implementation("eager")
    model.eval()
    try:
        for i, module in enumerate(attention_modules(model)):
            handles.append(module.register_forward_hook(hook(i)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
        model.train(training)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def query_groups(model: Any) -> int:
    """Query heads per KV head (GQA group size) of `model`."""
    config = text_config(model.config)
    return config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def per_kv_head(scores: torch.Tensor, groups: int, how: str) -> torch.Tensor:
    """(..., H) query-head scores -> (..., H / groups): max or mean over each KV head's group."""
    grouped = scores.unflatten(-1, (scores.shape[-1] // groups, groups))
    return grouped.amax(-1) if how == "max" else grouped.mean(-1)


# ---- RazorAttention ------------------------------------------------------------------------
def echo_induction(weights: torch.Tensor, segment: int) -> torch.Tensor:
    """(2, H) mean echo and induction attention over rows i >= segment of a prompt made of one
    segment repeated: echo = weights[i, i - segment] (the earlier copy of the same token),
    induction = weights[i, i - segment + 1] (what followed that copy). weights: (b, H, T, T)."""
    rows = torch.arange(segment, weights.shape[-1], device=weights.device)
    echo = weights[:, :, rows, rows - segment].float().mean(dim=(0, 2))
    induction = weights[:, :, rows, rows - segment + 1].float().mean(dim=(0, 2))
    return torch.stack([echo, induction])


def razor_scores(model: Any, segment: int | None = None, repeats: int = 4) -> torch.Tensor:
    """(2, L, h_kv) echo and induction scores, each KV head the max over its query group, on a
    random segment of min(256, max_position_embeddings // 8) ids repeated `repeats` times."""
    seg = segment or min(256, max_positions(model) // 8)
    vocab = text_config(model.config).vocab_size
    ids = random_ids(vocab, (1, seg), torch.Generator().manual_seed(SEED)).repeat(1, repeats)
    n_layers = text_config(model.config).num_hidden_layers
    out: dict[int, torch.Tensor] = {}
    with Ticker("calibrating razor (echo and induction heads)", n_layers) as ticker:

        def reduce(layer_idx: int, weights: torch.Tensor) -> None:
            out[layer_idx] = echo_induction(weights, seg).cpu()
            ticker.advance()

        with eager_attention(model, reduce), torch.inference_mode():
            model(input_ids=ids.to(_device(model)), use_cache=False)
    table = torch.stack([out[i] for i in range(n_layers)], dim=1)  # (2, L, H)
    return per_kv_head(table, query_groups(model), "max")


# ---- HeadKV ----------------------------------------------------------------------------------
def needle_hits(weights: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, span: int) -> torch.Tensor:
    """(H,) HeadKV's retrieval score: for each answer row and head, the top-`span` attended
    positions; each one inside the needle [start, start + span) adds its attention / span.
    Mean over rows and batch. weights: (b, H, T, T); rows: (R,); starts: (b,)."""
    values, index = weights[:, :, rows].float().topk(span, dim=-1)  # (b, H, R, span)
    start = starts.to(index.device).view(-1, 1, 1, 1)
    inside = (index >= start) & (index < start + span)
    return (values * inside).sum(-1).div(span).mean(dim=(0, 2))


def headkv_scores(model: Any, length: int | None = None) -> torch.Tensor:
    """(L, h_kv) HeadKV retrieval scores normalised to sum 1 (uniform if no head ever hits):
    contexts of `length` ids (default min(1024, max_position_embeddings // 2)) with a needle at
    each depth, followed by the needle's ids; rows predicting needle ids CUE.. are scored."""
    length = length or min(1024, max_positions(model) // 2)
    config = text_config(model.config)
    context, needle = needle_prompts(config.vocab_size, length, torch.Generator().manual_seed(SEED))
    ids = torch.cat([context, needle[:, :-1]], dim=1)
    rows = torch.arange(length + CUE - 1, length + SPAN - 1)  # each predicts needle[CUE:]
    starts = needle_starts(length)
    out: dict[int, torch.Tensor] = {}
    with Ticker("calibrating headkv (retrieval heads)", config.num_hidden_layers) as ticker:

        def reduce(layer_idx: int, weights: torch.Tensor) -> None:
            out[layer_idx] = needle_hits(weights, rows.to(weights.device), starts, SPAN).cpu()
            ticker.advance()

        with eager_attention(model, reduce), torch.inference_mode():
            model(input_ids=ids.to(_device(model)), use_cache=False)
    scores = per_kv_head(torch.stack([out[i] for i in range(config.num_hidden_layers)]), query_groups(model), "mean")
    total = scores.sum()
    return scores / total if total > 0 else torch.full_like(scores, 1.0 / scores.numel())


# ---- CoKV --------------------------------------------------------------------------------------
def slice_sizes(n: int) -> list[int]:
    """CoKV's coalition sizes for n players: n/8, n/4, 3n/8, n/2 rounded, at least 1, distinct."""
    return sorted({max(1, int(n * f + 0.5)) for f in SLICES})


def sliced_shapley(
    value: Callable[[torch.Tensor], float],
    n: int,
    samples: int,
    generator: torch.Generator,
    ticker: Ticker | None = None,
) -> torch.Tensor:
    """(n,) Sliced Shapley values from complementary contributions.

    For each slice size s and each of `samples` draws, a coalition S of s players and its
    complement N \\ S are valued; every player of S is credited u(S) - u(N \\ S), every other
    player u(N \\ S) - u(S). A player's value is the sum over slices of its mean credit. S is
    the next s players of a random permutation (a fresh one when it runs out), so every player
    lands in S about equally often. value: (n,) bool membership -> float.
    """
    ssv = torch.zeros(n, dtype=torch.float64)
    for size in slice_sizes(n):
        credit = torch.zeros(n, dtype=torch.float64)
        order, cursor = torch.randperm(n, generator=generator), 0
        for _ in range(samples):
            if cursor + size > n:
                order, cursor = torch.randperm(n, generator=generator), 0
            inside = torch.zeros(n, dtype=torch.bool)
            inside[order[cursor : cursor + size]] = True
            cursor += size
            gain = value(inside) - value(~inside)
            credit += torch.where(inside, gain, -gain)
            if ticker is not None:
                ticker.advance(2)
        ssv += credit / samples
    return ssv


def coalition_logprob(model: Any, full: Any, inside: torch.Tensor, query: torch.Tensor, answer: torch.Tensor) -> float:
    """Mean log-probability of `answer` (b, a) after `query` (b, q) (its last a - 1 ids are the
    answer's first ones, teacher-forced) when the KV heads marked in `inside` (L, h) keep the
    whole prefilled context of `full` and the others only its last RECENT tokens."""
    cache = full.fork("streaming(sinks=0)", 1.0)  # budget 1.0: nothing evicts but what we ask
    for layer, keeps_all in zip(cache.layers, inside, strict=True):
        counts = layer.counts()  # (b, h)
        keep = torch.where(keeps_all.to(counts.device), counts, counts.clamp(max=RECENT))
        if bool((keep < counts).any()):
            cache.policy.compress_layer(layer, keep)
    logits = model(input_ids=query, past_key_values=cache, use_cache=True).logits
    logp = torch.log_softmax(logits[:, -answer.shape[1] :].float(), dim=-1)
    return float(logp.gather(-1, answer.unsqueeze(-1)).mean())


def cokv_ssv(model: Any, samples: int = 16, length: int | None = None) -> torch.Tensor:
    """(L, h_kv) Sliced Shapley values of the KV heads: u(S) is `coalition_logprob` of the needle's
    rest after its first CUE ids, on contexts of `length` ids (default min(256, max_position_embeddings
    // 4)) with a needle at each depth of DEPTHS (one batch row each)."""
    config = text_config(model.config)
    length = length or min(256, max_positions(model) // 4)
    generator = torch.Generator().manual_seed(SEED)
    context, needle = needle_prompts(config.vocab_size, length, generator)
    device = _device(model)
    query, answer = needle[:, :-1].to(device), needle[:, CUE:].to(device)
    n_layers = config.num_hidden_layers
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    n = n_layers * n_kv
    with Ticker("calibrating cokv (Shapley values of heads)", 2 * samples * len(slice_sizes(n))) as ticker:
        with torch.inference_mode():
            full = full_cache(model)
            model(input_ids=context.to(device), past_key_values=full, use_cache=True)

            def value(inside: torch.Tensor) -> float:
                return coalition_logprob(model, full, inside.view(n_layers, n_kv), query, answer)

            ssv = sliced_shapley(value, n, samples, generator, ticker)
    return ssv.view(n_layers, n_kv).float()
