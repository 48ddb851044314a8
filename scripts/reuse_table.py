"""The reuse task's results as a markdown table: per method and join, the mean score (one-document
and two-document questions apart), KV ratio, seconds to the first answer token, compression.

Run: python scripts/reuse_table.py runs/reuse-smollm2-2k/results.sqlite
"""

from __future__ import annotations

import sqlite3
import sys

ORDER = ["agnostic", "concat", "kvlink", "kvlink+link", "kvlink+sink", "relay", "kvcomm"]
NAMES = {"agnostic": "full prefill of the concatenation", "concat": "joined, positions as cached"}


def main() -> None:
    db = sqlite3.connect(sys.argv[1])
    rows = db.execute(
        "select method, budget, mode, question, score, kv_ratio, prefill_s, compress_s from results where task='reuse'"
    ).fetchall()
    print(
        "| method, budget | how the documents are read | n | score | one document | two documents "
        "| KV ratio | to first token | compression |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    cells: dict[tuple[str, str, str], list[tuple]] = {}
    for method, budget, mode, question, *rest in rows:
        cells.setdefault((method, budget, mode), []).append((question, *rest))
    for method, budget in sorted({(m, b) for m, b, _ in cells}, key=lambda x: (x[0] != "full", x)):
        others = sorted({m for mb, bb, m in cells if (mb, bb) == (method, budget)} - set(ORDER))  # relay(tokens=64)
        for mode in ORDER + others:
            got = cells.get((method, budget, mode))
            if not got:
                continue
            mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
            one = [s for q, s, *_ in got if q == 0]
            two = [s for q, s, *_ in got if q == 1]
            print(
                f"| `{method}`, {budget} | {NAMES.get(mode, mode)} | {len(got)} | {mean([g[1] for g in got]):.2f} | "
                f"{mean(one):.2f} | {mean(two):.2f} | {mean([g[2] for g in got]):.3f} | "
                f"{mean([g[3] for g in got]):.2f} s | {mean([g[4] for g in got]):.2f} s |"
            )


if __name__ == "__main__":
    main()
