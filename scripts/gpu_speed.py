"""Speed and bytes of kvstack on a GPU with random weights (speed does not depend on them): no model download.

    python scripts/gpu_speed.py --lengths 8192,32768 --out speed.json

SmolLM2-135M's architecture (random init, bf16): transformers' sdpa + DynamicCache, kvstack's full
cache, and kvstack SnapKV at 25% of the bytes; prefill seconds, decode tokens/s over 64 greedy
steps, KV bytes held after the prompt. Each point after a warm-up run at the same length.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvstack  # noqa: F401  (registers the kvstack attention)
from kvstack.generate import Prompt, generate_ids

NEW = 64


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def smollm2_like(max_len: int, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=max_len + NEW + 8,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, torch.bfloat16).eval()


def hf_sdpa(model: LlamaForCausalLM, ids: torch.Tensor) -> dict[str, float]:
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        sync(ids.device.type)
        t0 = time.perf_counter()
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        sync(ids.device.type)
        t1 = time.perf_counter()
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        for _ in range(NEW - 1):
            nxt = logits.argmax(-1, keepdim=True)
            logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        sync(ids.device.type)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_tokens_per_s": (NEW - 1) / (t2 - t1), "kv_bytes": kv}


def kvstack_run(model: LlamaForCausalLM, ids: list[int], method: str, budget: float) -> dict[str, float]:
    model.set_attn_implementation("kvstack")
    _, m = generate_ids(model, [Prompt(ids, [])], method, budget, False, NEW)
    return {k: m[k] for k in ("prefill_s", "compress_s", "decode_tokens_per_s", "kv_bytes", "kv_bytes_full")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--out", default="speed.json")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model = smollm2_like(max(lengths), args.device)
    results = []
    for length in lengths:
        ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(length))
        for warm in (True, False):
            row = {
                "length": length,
                "sdpa+DynamicCache": hf_sdpa(model, ids.to(args.device)),
                "kvstack full": kvstack_run(model, ids[0].tolist(), "full", 1.0),
                "kvstack snapkv 0.25": kvstack_run(model, ids[0].tolist(), "snapkv", 0.25),
                "kvstack streaming 0.25": kvstack_run(model, ids[0].tolist(), "streaming", 0.25),
            }
            if not warm:
                results.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        json.dump({"device": name, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
