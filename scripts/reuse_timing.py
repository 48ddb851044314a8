"""Ten questions about one document, with a prefix store: the first compresses, the next nine load.

Prints one JSON line per question (hit or miss, seconds to the first decoded token's logits, answer
found) and a summary; run from the repository root: python scripts/reuse_timing.py [--method kvzip]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from kvstack import PrefixStore, answer, answer_cached, load
from kvstack.bench.runner import _essays
from kvstack.bench.tasks.ruler import niah
from kvstack.generate import warm_up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--budget", default="0.125")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    lm = load(args.model)
    warm_up(lm.model)
    count = lambda text: len(lm.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    sample = niah("reuse", 0, args.length, count, 0, "prose", _essays(), keys=args.questions, queries=args.questions)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = PrefixStore(folder, "1GB")
        for i, q in enumerate(sample.questions):
            started = time.perf_counter()
            cache, hit = store.cache_for(lm, sample.context, args.method, args.budget)
            ready = time.perf_counter() - started
            result = answer_cached(lm, cache, [q.question], q.max_new_tokens, q.answer_prefix)
            total = time.perf_counter() - started
            row = {
                "question": i,
                "hit": hit,
                "cache_ready_s": round(ready, 3),
                "first_token_s": round(ready + result.prefill_s, 3),
                "total_s": round(total, 3),
                "found": all(a in result.answers[0] for a in q.answers),
                "kv_bytes": result.kv_bytes,
                "kv_ratio": round(result.kv_ratio, 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        file_bytes = store.nbytes()
    started = time.perf_counter()
    plain = answer(
        lm,
        [sample.context],
        [sample.questions[0].question],
        "full",
        1.0,
        query_agnostic=True,
        max_new_tokens=1,
        answer_prefix=sample.questions[0].answer_prefix,
    )
    prefill_s = time.perf_counter() - started
    full = [
        all(
            a
            in answer(lm, [sample.context], [q.question], "full", 1.0, True, q.max_new_tokens, q.answer_prefix).answers[
                0
            ]
            for a in q.answers
        )
        for q in sample.questions
    ]
    later = [r["first_token_s"] for r in rows[1:]]
    print(
        json.dumps(
            {
                "model": args.model,
                "method": args.method,
                "budget": args.budget,
                "context_tokens": plain.context_tokens[0],
                "first_question_first_token_s": rows[0]["first_token_s"],
                "next_first_token_s_mean": round(sum(later) / len(later), 3),
                "next_first_token_s_max": max(later),
                "full_prefill_first_token_s": round(prefill_s, 3),
                "found": sum(r["found"] for r in rows),
                "found_full_cache": sum(full),
                "file_bytes": file_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
