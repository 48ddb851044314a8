"""Runs inside kvpress's own virtual environment (it never imports kvstack): JSON lines in, JSON lines out.

One request per line: {"model", "dtype", "press", "ratio", "context", "question", "answer_prefix",
"max_new_tokens", "aware", "quantized"?}; with "quantized": {"nbits", "group", "residual"} the
press runs over transformers' `QuantizedCache` (optimum-quanto backend) instead of a
`DynamicCache`, and its packed tensors, scales and shifts are counted. The model runs in kvstack's
dtype ("float32" on CPUs without bf16), so a fraction of the full cache is the same bytes on both
sides. kvpress's own pipeline pieces do the work (chat template, prefill under the press, greedy
answer); bytes are read off the cache's tensors after the prompt, as kvstack measures its own, so
head-wise presses that mask instead of evicting show it.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

PRESSES = {
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "observed_attention": "ObservedAttentionPress",
    "expected_attention": "ExpectedAttentionPress",
    "keydiff": "KeyDiffPress",
    "lagkv": "LagKVPress",
    "pyramidkv": "PyramidKVPress",
    "adakv": "AdaKVPress",  # over SnapKVPress, as kvstack's adakv defaults to snapkv
    "kvzip": "KVzipPress",
    # kvpress's merge-on-evict wrapper (values of evicted tokens folded into their most similar
    # survivor, keys kept) over a scorer press: `merging_<scorer>`
    "merging_snapkv": "MergingPress",
    "merging_observed_attention": "MergingPress",
    "merging_keydiff": "MergingPress",
}
EAGER = {
    "observed_attention",
    "merging_observed_attention",
}  # needs attention weights, so the model runs eager attention
_pipes: dict[tuple[str, str, str], Any] = {}


def pipeline_for(model: str, attn: str, dtype: str) -> Any:
    import kvpress  # noqa: F401  (registers the pipeline)
    import torch
    from transformers import pipeline

    if (model, attn, dtype) not in _pipes:
        _pipes[(model, attn, dtype)] = pipeline(
            "kv-press-text-generation",
            model=model,
            dtype=getattr(torch, dtype),
            model_kwargs={"attn_implementation": attn},
        )
    return _pipes[(model, attn, dtype)]


def tensor_bytes(x: Any) -> int:
    """Bytes of a plain tensor or of a quanto quantized tensor (its packed data, scale and shift)."""
    if x is None:
        return 0
    if hasattr(x, "__tensor_flatten__"):
        return sum(tensor_bytes(getattr(x, name)) for name in x.__tensor_flatten__()[0])
    return int(x.nbytes)


def cache_bytes(cache: Any) -> int:
    """Bytes the cache holds: full-precision keys and values, plus a quantized cache's codes."""
    return sum(
        tensor_bytes(layer.keys)
        + tensor_bytes(layer.values)
        + tensor_bytes(getattr(layer, "_quantized_keys", None))
        + tensor_bytes(getattr(layer, "_quantized_values", None))
        for layer in cache.layers
    )


def run(req: dict[str, Any]) -> dict[str, Any]:
    import kvpress
    import torch
    from transformers import DynamicCache

    name = req["press"]
    pipe = pipeline_for(req["model"], "eager" if name in EAGER else "sdpa", req["dtype"])
    model, tok = pipe.model, pipe.tokenizer
    if name == "adakv":
        press = kvpress.AdaKVPress(press=kvpress.SnapKVPress(compression_ratio=req["ratio"]))
    elif name.startswith("merging_"):
        scorer = getattr(kvpress, PRESSES[name.removeprefix("merging_")])(compression_ratio=req["ratio"])
        press = kvpress.MergingPress(press=scorer)
    else:
        press = getattr(kvpress, PRESSES[name])(compression_ratio=req["ratio"])
    spent = {"compress": 0.0}
    compress = press.compress

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = compress(*args, **kwargs)
        spent["compress"] += time.perf_counter() - start
        return out

    press.compress = timed
    context = req["context"] + ("\n\n" + req["question"] if req["aware"] else "")
    question = "" if req["aware"] else req["question"]
    inputs = pipe.preprocess(context, [question], req["answer_prefix"], max_context_length=10**9)
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    quantized = req.get("quantized")
    if quantized:
        from transformers import QuantizedCache

        cache = QuantizedCache(
            backend="quanto",
            config=model.config,
            nbits=quantized["nbits"],
            q_group_size=quantized["group"],
            residual_length=quantized["residual"],
        )
    else:
        cache = DynamicCache()
    with torch.inference_mode():
        start = time.perf_counter()
        with press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
            prefill = time.perf_counter() - start
            prefill -= spent["compress"]  # presses that compress inside the forward (hooks)
        spent["compress"] = time.perf_counter() - start - prefill  # + KVzip, which scores and prunes on exit
        n = context_ids.shape[1]
        positions = torch.arange(n, n + question_ids.shape[1]).unsqueeze(0)
        out = model(input_ids=question_ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        kv_bytes = cache_bytes(cache)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        item = model.dtype.itemsize
        kv_full = (
            config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * item * (n + question_ids.shape[1])
        )
        stop = model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop])
        ids = [int(out.logits[0, -1].argmax())]
        start = time.perf_counter()
        position = n + question_ids.shape[1]
        for i in range(req["max_new_tokens"] - 1):
            if ids[-1] in stop:
                break
            out = model(
                input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=torch.tensor([[position + i]])
            )
            ids.append(int(out.logits[0, -1].argmax()))
        decode = time.perf_counter() - start
    steps = len(ids) - 1
    return {
        "answer": tok.decode(ids, skip_special_tokens=True).strip(),
        "kv_bytes": kv_bytes,
        "kv_bytes_full": kv_full,
        "prefill_s": prefill,
        "compress_s": spent["compress"],
        "decode_tokens_per_s": steps / decode if steps and decode > 0 else 0.0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # this (kvpress's) process
    }


def main() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    for line in sys.stdin:
        try:
            result = run(json.loads(line))
        except Exception as err:  # report to the parent, keep serving
            result = {"error": f"{err.__class__.__name__}: {err}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
