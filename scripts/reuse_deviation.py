"""Where a document cached alone deviates from the same document prefilled after another.

For pairs of essay passages (A, B): the KV of B computed alone (positions re-encoded, KVLink) against
the KV of B inside a full prefill of A + B, per token of B and per layer: relative error of keys and
values. Prints JSON lines: the error by position bucket, by layer, and the share of the total error
in B's first r tokens. Run: python scripts/reuse_deviation.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from kvstack import load
from kvstack.bench.runner import _essays
from kvstack.cache.cache import KVCache
from kvstack.generate import Runner
from kvstack.reuse.kvlink import join


def cached(model: Any, ids: list[int]) -> KVCache:
    runner = Runner(model, KVCache(model))
    runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return runner.cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=400, help="tokens per passage")
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    lm = load(args.model)
    words = " ".join(_essays()).split(" ")
    encode = lambda text: lm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    passages = [encode(" ".join(words[i * 400 : (i + 1) * 400]))[: args.tokens] for i in range(2 * args.pairs)]
    per_position, per_layer = [], []
    for p in range(args.pairs):
        a, b = passages[2 * p], passages[2 * p + 1]
        full = cached(lm.model, a + b)
        joined = join(lm.model, [(a, cached(lm.model, a)), (b, cached(lm.model, b))])
        errors = []
        for mine, ref in zip(joined.layers, full.layers, strict=True):
            k, rk = mine.keys.stacked[0, :, len(a) :].float(), ref.keys.stacked[0, :, len(a) :].float()
            v, rv = mine.values.stacked[0, :, len(a) :].float(), ref.values.stacked[0, :, len(a) :].float()
            err_k = ((k - rk).norm(dim=-1) / rk.norm(dim=-1).clamp(min=1e-6)).mean(0)  # (n_b,)
            err_v = ((v - rv).norm(dim=-1) / rv.norm(dim=-1).clamp(min=1e-6)).mean(0)
            errors.append((err_k + err_v) / 2)
        errors = torch.stack(errors)  # (L, n_b)
        per_position.append(errors.mean(0))
        per_layer.append(errors.mean(1))
    position = torch.stack(per_position).mean(0)
    layer = torch.stack(per_layer).mean(0)
    total = float(position.sum())
    buckets = [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, args.tokens)]
    for lo, hi in buckets:
        print(
            json.dumps({"positions": f"{lo}-{hi - 1}", "mean_relative_error": round(float(position[lo:hi].mean()), 4)})
        )
    for r in (1, 4, 16, 32, 64):
        print(json.dumps({"first_tokens": r, "share_of_error": round(float(position[:r].sum()) / total, 4)}))
    print(json.dumps({"per_layer": [round(float(x), 4) for x in layer]}))
    top = torch.topk(position, 16).indices.sort().values.tolist()
    print(json.dumps({"model": args.model, "pairs": args.pairs, "tokens": args.tokens, "top16_positions": top}))


if __name__ == "__main__":
    main()
