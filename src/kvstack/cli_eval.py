"""`kvstack eval`: lm-evaluation-harness tasks run with the KV cache compressed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstack.errors import UserError, unknown_name
from kvstack.terminal import DEFAULT, err, fail, out, parse_method


def evaluate(
    tasks: Annotated[str, typer.Option(help="lm-eval task names, comma-separated")],
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    method: Annotated[str, typer.Option(help="method spec")] = "full",
    budget: Annotated[
        str, typer.Option(help="fraction of full-cache bytes (0.25), tokens per head, or a size")
    ] = "1.0",
    include_path: Annotated[
        Path | None, typer.Option(help="a folder of your own task YAML files (local data, no download)")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="at most this many documents per task")] = None,
    output: Annotated[Path | None, typer.Option("--out", "-o", help="write the results as JSON here")] = None,
) -> None:
    """Run lm-eval tasks on a model whose KV cache is compressed by METHOD at BUDGET (each context
    compressed before its continuation or answer is seen)."""
    try:
        stack, parsed = parse_method(method, budget)
        try:
            from lm_eval import simple_evaluate
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise UserError("lm-eval is not installed: pip install 'kvstack[eval]'") from None
        if include_path is not None and not include_path.is_dir():
            raise UserError(f"--include-path {include_path} is not a folder of task YAML files")
        logging.getLogger("lm-eval").setLevel(logging.ERROR)
        manager = TaskManager(include_path=str(include_path) if include_path else None, verbosity="ERROR")
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        for name in names:
            if name not in manager.all_tasks:
                raise unknown_name("lm-eval task", name, list(manager.all_tasks))
        from kvstack.harness import KVStackLM
        from kvstack.models import load

        with err.status(f"loading {model}"):
            lm = KVStackLM(load(model), str(stack), str(parsed))
        result = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=False)
    except UserError as e:
        fail(str(e))
        return
    ratio = sum(lm.kv_ratios) / len(lm.kv_ratios) if lm.kv_ratios else 1.0
    table = Table(title=f"{lm.lm.name}, {stack} at {parsed}: measured KV ratio {ratio:.3f}")
    for column in ("task", "metric", "value", "stderr"):
        table.add_column(column)
    for task, metrics in result["results"].items():
        for key, value in metrics.items():
            if key == "alias" or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(key.replace(",", "_stderr,"))
            table.add_row(task, key, f"{value:.4f}", f"{stderr:.4f}" if isinstance(stderr, float) else "-")
    out.print(table)
    if output is not None:
        output.write_text(
            json.dumps({"results": result["results"], "method": str(stack), "budget": str(parsed), "kv_ratio": ratio})
        )
