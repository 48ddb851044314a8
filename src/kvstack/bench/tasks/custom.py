"""Your own task: a JSONL file of {context, question, answer, answer_prefix?, max_new_tokens?} rows.

Rows sharing a context become one sample with several questions (the context is prefilled and
compressed once per method in query-agnostic mode). `answer` is a string or a list of strings,
all of which must appear in the prediction (RULER string match). Contexts are used as given:
their cells carry length 0 ("own length").
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstack.bench.tasks.ruler import Question, Sample
from kvstack.errors import UserError

OWN_LENGTH = 0  # the cell length of task-file samples: each context keeps its own length
REQUIRED = ("context", "question", "answer")


def task_name(path: Path) -> str:
    """The task's name in results and reports: `file:<stem>`."""
    return f"file:{path.stem}"


def load_task_file(path: Path) -> list[Sample]:
    """Samples in file order (one per distinct context); one-line errors name the bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"task file {path} does not exist") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read task file {path}: {e.__class__.__name__}") from None
    by_context: dict[str, list[Question]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} is not JSON ({e.msg}): write one object per line") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: each line must be a JSON object with {', '.join(REQUIRED)}")
        missing = [k for k in REQUIRED if not row.get(k)]
        if missing:
            raise UserError(f"{where} lacks {', '.join(missing)}: each row needs {', '.join(REQUIRED)}")
        answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
        if not all(isinstance(a, str) and a.strip() for a in answers):
            raise UserError(f"{where}: answer must be a non-empty string or a list of them")
        new = row.get("max_new_tokens", 32)
        if not isinstance(new, int) or new < 1:
            raise UserError(f"{where}: max_new_tokens must be a positive integer")
        question = Question(row["question"], str(row.get("answer_prefix", "")), tuple(answers), new)
        by_context.setdefault(row["context"], []).append(question)
    if not by_context:
        raise UserError(f"task file {path} has no rows")
    name = task_name(path)
    return [Sample(name, i, context, tuple(qs)) for i, (context, qs) in enumerate(by_context.items())]
