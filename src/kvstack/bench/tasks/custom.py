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
MAX_NEW_TOKENS = 4096


def task_name(path: Path) -> str:
    """The task's name in results and reports: `file:<stem>`."""
    return f"file:{path.stem}"


def load_task_file(path: Path) -> list[Sample]:
    """Samples in file order (one per distinct context); one-line errors name the bad line.

    Each line is a JSON object: `context` and `question` non-empty strings, `answer` a non-empty
    string or a list of them, `answer_prefix` a string, `max_new_tokens` a positive integer. A
    UTF-8 byte-order mark is accepted; bytes that are not UTF-8 are an error naming the line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"task file {path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read task file {path}: {e.__class__.__name__}") from None
    by_context: dict[str, list[Question]] = {}
    for number, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: byte {e.start + 1} is not UTF-8: save the file as UTF-8") from None
        if not line.strip():
            continue
        context, question = _row(line, where)
        by_context.setdefault(context, []).append(question)
    if not by_context:
        raise UserError(f"task file {path} has no rows")
    name = task_name(path)
    return [Sample(name, i, context, tuple(qs)) for i, (context, qs) in enumerate(by_context.items())]


def _row(line: str, where: str) -> tuple[str, Question]:
    """(context, question) of one line, or a one-line error naming the field and the line."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
        raise UserError(f"{where} is not JSON ({why}): write one object per line") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: each line must be a JSON object with {', '.join(REQUIRED)}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}: each row needs {', '.join(REQUIRED)}")
    for field in ("context", "question"):
        if not isinstance(row[field], str) or not row[field].strip():
            raise UserError(f"{where}: {field} must be a non-empty string")
    answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
    if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise UserError(f"{where}: answer must be a non-empty string or a list of them")
    prefix = row.get("answer_prefix", "")
    if not isinstance(prefix, str):
        raise UserError(f"{where}: answer_prefix must be a string")
    new = row.get("max_new_tokens", 32)
    if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= MAX_NEW_TOKENS:
        raise UserError(f"{where}: max_new_tokens must be an integer from 1 to {MAX_NEW_TOKENS}")
    return row["context"], Question(row["question"], prefix, tuple(answers), new)
