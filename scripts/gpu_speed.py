"""Speed and bytes of kvstack on a GPU with random weights (speed does not depend on them): no model download.

    python scripts/gpu_speed.py --lengths 8192,32768 --out speed.json [--profile]

SmolLM2-135M's architecture (random init, bf16), measured by `kvstack speed`'s own `measure`:
transformers' sdpa with its DynamicCache and StaticCache, kvstack's full cache and stacks at their
budgets; prefill seconds, decode tokens/s, KV bytes held after the prompt; one process, a
warm-up pass first, repeats interleaved, medians. `--profile` adds, per decoding step at the
shortest length, the CUDA kernels launched and the host's milliseconds (a launch-bound GPU waits
on those), for the baseline and each engine.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvstack  # noqa: F401  (registers the kvstack attention)
from kvstack.bench.speed import Engine, measure, prompt_ids

ENGINES = (
    "sdpa+DynamicCache,sdpa+StaticCache,full,snapkv@0.25,streaming@0.25,keydiff@0.125,kivi(bits=2),"
    "keydiff+adaquant(residual=32)@0.125,full:compiled,snapkv@0.25:compiled,"
    "quest@0.0625,quest(store=disk)@0.0625"  # the slow tier pinned in host memory (the GPU default) and on disk
)


def smollm2_like(max_len: int, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=max_len + 256,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(model: Any, engine: Engine, length: int, steps: int = 8) -> dict[str, float]:
    """CUDA kernels launched and host milliseconds per decoding step, after a prompt of `length`."""
    from kvstack.cache.cache import KVCache
    from kvstack.generate import Runner

    ids = prompt_ids(length, model.config.vocab_size).to(model.device)
    with torch.inference_mode():
        if engine.stack is None:
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

            def step(i: int) -> torch.Tensor:
                at = torch.tensor([length + i], device=model.device)
                out = model(logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True, cache_position=at)
                return out.logits[:, -1]
        else:
            model.set_attn_implementation("kvstack")
            runner = Runner(model, KVCache(model, engine.stack, engine.budget))
            logits = runner.prefill(ids.cpu(), torch.ones_like(ids.cpu()))
            one = torch.ones(1, 1, dtype=torch.long)

            def step(i: int) -> torch.Tensor:
                return runner.forward(logits.argmax(-1, keepdim=True), one)

        for i in range(2):
            logits = step(i)
        sync()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            for i in range(steps):
                logits = step(2 + i)
            host = time.perf_counter() - start
            sync()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    model.set_attn_implementation("kvstack")
    return {"kernels_per_step": kernels / steps, "host_ms_per_step": 1000 * host / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--engines", default=ENGINES, help="comma-separated, as `kvstack speed --stacks`")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="speed.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    engines = [Engine.parse(e) for e in args.engines.split(",")]
    model = smollm2_like(max(lengths) + args.new_tokens, args.device)
    rows = measure(model, engines, lengths, args.new_tokens, args.repeats, progress=lambda m: print(m, flush=True))
    base = {r.length: r for r in rows if r.engine == "sdpa+DynamicCache"}
    for r in rows:
        ref = base.get(r.length)
        vs = f"{r.decode_tokens_per_s / ref.decode_tokens_per_s:.2f}x sdpa" if ref else ""
        print(
            f"{r.length:>6} {r.engine:40s} prefill {r.prefill_s:7.3f} s  decode {r.decode_tokens_per_s:7.1f} tok/s "
            f"{vs}  KV {r.kv_bytes / 2**20:8.2f} MiB",
            flush=True,
        )
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "rows": [r.to_json() for r in rows],
    }
    if args.profile:
        profiled = [e for e in engines if e.label != "sdpa+StaticCache"]
        out["profile"] = {e.label: profile_steps(model, e, min(lengths)) for e in profiled}
        for label, p in out["profile"].items():
            kernels, host = p["kernels_per_step"], p["host_ms_per_step"]
            print(f"profile {label:40s} {kernels:7.1f} kernels/step  {host:6.2f} host ms/step")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
