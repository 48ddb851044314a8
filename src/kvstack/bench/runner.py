"""Run a sweep: every (task, length, sample) x (mode, method, budget), resumably, one row per answer.

Query-agnostic cells share one prefill per sample (`generate_forks`); query-aware cells each
prefill context and question together. Rows already in the store are skipped, so a re-run
after Ctrl-C or kill -9 finishes the sweep without recomputing or double-counting anything.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvstack.bench.joins import is_join, join_arguments, join_name
from kvstack.bench.score import digit_partial, string_match_all
from kvstack.bench.store import Cell, Row, Store
from kvstack.bench.tasks.custom import OWN_LENGTH, load_task_file
from kvstack.bench.tasks.multiturn import multiturn
from kvstack.bench.tasks.needle import python_docs_words
from kvstack.bench.tasks.reuse import reuse
from kvstack.bench.tasks.ruler import (
    CountTokens,
    Question,
    Sample,
    common_words,
    niah,
    rng_for,
    variable_tracking,
)
from kvstack.cache.budget import Budget
from kvstack.errors import UserError, unknown_name
from kvstack.generate import compress_ids, fidelity_forks, generate_forks, generate_from, generate_ids
from kvstack.models.loading import LoadedModel
from kvstack.models.prompts import build_prompt, eos_ids
from kvstack.progress import LogProgress
from kvstack.reuse import kvcomm
from kvstack.reuse.kvlink import join, segments, sink_prefix
from kvstack.stack import Stack
from kvstack.timing import now

if TYPE_CHECKING:
    from kvstack.bench.rivals.kvpress_rival import KvpressRival

RIVALS = ("kvpress",)
PROMPT_ROOM = 96  # tokens of a target length left for the question, chat template and answer prefix


def _prose() -> list[str]:
    return [s.strip() + "." for s in " ".join(python_docs_words()).split(". ") if s.strip()]


def _essays() -> list[str]:
    from kvstack.bench.data import paul_graham_essays

    text = " ".join(" ".join(e.split()) for e in paul_graham_essays())
    return [s.strip() + "." for s in text.split(". ") if s.strip()]


def _qa(index: int, length: int, count: CountTokens, seed: int) -> Sample:
    from kvstack.bench.data import disfl_qa
    from kvstack.bench.tasks.qa import qa

    return qa(index, length, count, seed, disfl_qa())


TaskFn = Callable[[int, int, CountTokens, int], Sample]
TASKS: dict[str, TaskFn] = {
    "niah_single": partial(niah, "niah_single"),
    "niah_single_prose": lambda i, n, count, seed: niah("niah_single_prose", i, n, count, seed, "prose", _prose()),
    "niah_single_essays": lambda i, n, count, seed: niah("niah_single_essays", i, n, count, seed, "prose", _essays()),
    "niah_multikey": partial(niah, "niah_multikey", keys=4),
    "niah_multivalue": partial(niah, "niah_multivalue", values=4),
    "niah_multiquery": partial(niah, "niah_multiquery", keys=4, queries=2),
    "niah_multiturn": lambda i, n, count, seed: multiturn(i, n, count, seed, _prose()),
    "vt": variable_tracking,
    "cwe": common_words,
    "qa": _qa,
    "reuse": lambda i, n, count, seed: reuse(i, n, count, seed, _essays()),
}
ALL_TASKS = (*TASKS, "fidelity")


@dataclass(frozen=True)
class Sweep:
    """What to run; `full` at budget 1 is always added as the reference."""

    model: str
    methods: tuple[str, ...]
    budgets: tuple[str, ...]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    modes: tuple[str, ...] = ("agnostic",)
    samples: int = 20
    seed: int = 0
    rivals: tuple[str, ...] = ()
    task_file: str | None = None  # a JSONL file of the user's own questions (see tasks/custom.py)

    def __post_init__(self) -> None:
        if not self.methods:
            raise UserError("no methods: give --methods, e.g. snapkv,knorm (the full cache always runs as reference)")
        if not self.tasks and self.task_file is None:
            raise UserError("no tasks: give --tasks (e.g. niah_single,vt) or --task-file F.jsonl")
        for task in self.tasks:
            if task not in ALL_TASKS:
                raise unknown_name("task", task, list(ALL_TASKS))
        joined = [mode for mode in self.modes if is_join(mode)]  # a malformed mode is one line here
        if joined and "reuse" not in self.tasks:
            raise UserError(f"modes {', '.join(joined)} join documents cached apart: add --tasks reuse")
        if self.samples < 1:
            raise UserError("--samples must be at least 1")
        for rival in self.rivals:
            if rival.partition(":")[0] not in RIVALS:
                raise unknown_name("rival", rival, list(RIVALS))
        if self.rivals and any(Budget.parse(b).tokens is not None for b in self.budgets):
            raise UserError("rival toolkits take fraction budgets (kvpress's compression ratio); drop the NNNt ones")
        self.rival_configs()  # unknown presses fail here, before anything is loaded
        for length in self.lengths:
            if length <= PROMPT_ROOM * 2:
                raise UserError(f"length {length} is too short: use at least {PROMPT_ROOM * 2 + 1} tokens")

    def rival_configs(self) -> list[tuple[str, str, str]]:
        """(cell method, press, budget) for every rival press at every budget.

        `kvpress` runs the presses that implement the sweep's methods; `kvpress:all` every press;
        `kvpress:tova` one press.
        """
        from kvstack.bench.rivals.kvpress_rival import presses_for

        presses = dict.fromkeys(p for r in self.rivals for p in presses_for(r, self.methods))
        return [(f"kvpress:{p}", p, str(Budget.parse(b))) for p in presses for b in self.budgets]

    def configs(self) -> list[tuple[Stack, Budget]]:
        """(stack, budget) pairs, the full-cache reference first; specs are parsed (errors early).
        A storage stage without eviction (a quantizer, a projection, a cross-layer stage) runs
        once, at budget 1: its bytes are what its bits, rank or sharing make them."""
        out = [(Stack.parse("full"), Budget.parse(1.0))]
        for spec in self.methods:
            stack = Stack.parse(spec)
            if stack.evictor is None:
                if stack.quantizer is not None or stack.joiner is not None:
                    out.append((stack, Budget.parse(1.0)))
                continue
            out += [(stack, Budget.parse(b)) for b in self.budgets]
        return out


@dataclass(frozen=True)
class FidelityWork:
    """Compress `context`, teacher-force `continuation` (token ids of real prose); score = top-1 agreement."""

    index: int
    length: int
    context: tuple[int, ...]
    continuation: tuple[int, ...]


FIDELITY_TOKENS = 32  # continuation tokens teacher-forced after the compressed context


def fidelity_work(lm: LoadedModel, lengths: tuple[int, ...], samples: int, seed: int) -> list[FidelityWork]:
    """Windows of the prose corpus at seeded offsets: context of `length` tokens, then its continuation."""
    ids = lm.tokenizer.encode(" ".join(python_docs_words()), add_special_tokens=False)
    out = []
    for length in lengths:
        for index in range(samples):
            rng = rng_for("fidelity", index * 1_000_003 + length, seed)
            start = rng.randrange(0, len(ids) - length - FIDELITY_TOKENS)
            window = ids[start : start + length + FIDELITY_TOKENS]
            out.append(FidelityWork(index, length, tuple(window[:length]), tuple(window[length:])))
    return out


@dataclass(frozen=True)
class Work:
    """One question of one sample, to be answered in one mode under every config."""

    sample: Sample
    question_index: int
    question: Question
    length: int
    mode: str


def plan(lm: LoadedModel, sweep: Sweep) -> list[Work]:
    """Every (sample, question, mode) of the sweep, samples generated from their seeds."""

    def count(text: str) -> int:
        return len(lm.tokenizer.encode(text, add_special_tokens=False))

    work = []
    if sweep.task_file is not None:
        for sample in load_task_file(Path(sweep.task_file))[: sweep.samples]:
            if lm.max_context and count(sample.context) + PROMPT_ROOM > lm.max_context:
                raise UserError(
                    f"{sweep.task_file}: context {sample.index + 1} is longer than {lm.name}'s "
                    f"{lm.max_context} tokens: shorten it or use a model with a longer context"
                )
            for qi, q in enumerate(sample.questions):
                work += [Work(sample, qi, q, OWN_LENGTH, mode) for mode in sweep.modes]
    for task in (t for t in sweep.tasks if t != "fidelity"):
        for length in sweep.lengths:
            for index in range(sweep.samples):
                sample = TASKS[task](index, length - PROMPT_ROOM, count, sweep.seed)
                modes = [m for m in sweep.modes if not is_join(m) or sample.documents]
                for qi, q in enumerate(sample.questions):
                    work += [Work(sample, qi, q, length, mode) for mode in modes]
    return work


def score(answer: str, refs: tuple[str, ...]) -> tuple[float, float | None]:
    """RULER string match, and the digit-level partial score when there is one numeric reference."""
    partial_score = digit_partial(answer, refs[0]) if len(refs) == 1 and refs[0].isdigit() else None
    return string_match_all(answer, refs), partial_score


Advance = Callable[..., None]  # advance(rows written, progress steps)
Unit = tuple[str, int]  # ("fidelity" | "work", index into fidelity_work / plan): what one job does at a time


def progress_bar(console: Console | None) -> Progress | LogProgress:
    """A sweep's progress: rich's bar on a terminal; in a log, where rich would print the bar only
    when the sweep ends, plain lines (`LogProgress`)."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        return LogProgress()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console, transient=False)


class Share:
    """One process's view of a sweep: its plan, its rival worker, and how to run one unit."""

    def __init__(self, lm: LoadedModel, sweep: Sweep, store: Store | None) -> None:
        self.lm, self.sweep, self.store = lm, sweep, store
        self.configs, self.rivals = sweep.configs(), sweep.rival_configs()
        self.work = plan(lm, sweep)
        self.fidelity = fidelity_work(lm, sweep.lengths, sweep.samples, sweep.seed) if "fidelity" in sweep.tasks else []
        self.rival: KvpressRival | None = None  # started on first use
        # rival presses that raised (skipped for the rest of the run, retried next run), and kvstack
        # configs the cache refused ("kvzip+kivi at 0.0625": its residual window does not fit)
        self.failed: dict[str, str] = {}
        # the current sample's documents, each cached alone under each config: every question and
        # join of the sample reuses them (what a prefix store does across requests)
        self.documents: dict[tuple[Any, ...], Any] = {}  # (cache, seconds) per document; KVCOMM's anchors

    @property
    def units(self) -> list[Unit]:
        return [("fidelity", i) for i in range(len(self.fidelity))] + [("work", i) for i in range(len(self.work))]

    @property
    def steps(self) -> int:
        """Progress steps of the whole sweep: one per (config, answer)."""
        return (len(self.work) + len(self.fidelity)) * len(self.configs) + len(self.work) * len(self.rivals)

    def describe(self, unit: Unit) -> str:
        kind, i = unit
        if kind == "fidelity":
            return f"fidelity {self.fidelity[i].length} #{self.fidelity[i].index}"
        item = self.work[i]
        return f"{item.sample.task} {item.length} #{item.sample.index} {item.mode}"

    def run(self, unit: Unit, advance: Advance) -> None:
        assert self.store is not None, "a planning-only share runs nothing"
        kind, i = unit
        if kind == "fidelity":
            _run_fidelity(self.lm, self.fidelity[i], self.configs, self.store, advance, self.failed)
            return
        if is_join(self.work[i].mode):
            _run_joined(self.lm, self.work[i], self.configs, self.store, advance, self.failed, self.documents)
            return
        _run_kvstack(self.lm, self.work[i], self.configs, self.store, advance, self.failed)
        if self.rivals:
            self.rival = self.rival or _rival(self.lm)
            _run_rivals(self.lm, self.rival, self.work[i], self.rivals, self.store, advance, self.failed)

    def close(self) -> None:
        if self.rival is not None:
            self.rival.close()


def _cell(lm: LoadedModel, method: str, budget: str, mode: str, task: str, length: int) -> Cell:
    return Cell(lm.name, method, budget, mode, task, length)


def _run_kvstack(
    lm: LoadedModel,
    item: Work,
    configs: list[tuple[Stack, Budget]],
    store: Store,
    advance: Advance,
    refused: dict[str, str],
) -> None:
    """kvstack's configs for one question: forks of one prefill (agnostic) or one run each (aware).
    A config the cache refuses is noted in `refused` and stores no row."""
    cells = {
        (s.label, str(b)): _cell(lm, s.label, str(b), item.mode, item.sample.task, item.length) for s, b in configs
    }
    key = (item.sample.index, item.question_index)
    todo = [(s, b) for s, b in configs if key not in store.done(cells[(s.label, str(b))])]
    advance(steps=len(configs) - len(todo))
    if not todo:
        return
    q = item.question
    prompt = build_prompt(lm, item.sample.context, q.question, q.answer_prefix, q.history)
    eos, new = eos_ids(lm), item.question.max_new_tokens
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    if item.mode == "agnostic":
        results = generate_forks(lm.model, [prompt], todo, new, eos, pad)
    else:
        results = (_aware(lm, prompt, s, b, new, eos, pad) for s, b in todo)
    for (stack, budget), (ids, m) in zip(todo, results, strict=True):
        if _refused(m, stack, budget, refused):
            advance()
            continue
        advance(store.add(_answer_row(lm, cells[(stack.label, str(budget))], item, ids[0], m)))


def _run_joined(
    lm: LoadedModel,
    item: Work,
    configs: list[tuple[Stack, Budget]],
    store: Store,
    advance: Advance,
    refused: dict[str, str],
    documents: dict[tuple[Any, ...], Any],
) -> None:
    """kvstack's configs for one question of the reuse task: the sample's documents cached alone
    (once per config, kept in `documents` for the sample's other questions and joins), joined as
    `item.mode` says, then asked. compress_s: the documents' compression; prefill_s: join + question."""
    cells = {(s.label, str(b)): _cell(lm, s.label, str(b), item.mode, "reuse", item.length) for s, b in configs}
    key = (item.sample.index, item.question_index)
    todo = [(s, b) for s, b in configs if key not in store.done(cells[(s.label, str(b))])]
    advance(steps=len(configs) - len(todo))
    sample_key = (item.sample.task, item.sample.index, item.length)
    for stale in [k for k in documents if k[:3] != sample_key]:
        del documents[stale]
    tokenize = partial(lm.tokenizer.encode, add_special_tokens=False)
    docs = item.sample.documents
    ids = segments(tokenize, build_prompt(lm, docs[0], "?").context, list(docs[1:]))
    sink = join_arguments(item.mode).get("sink", 0)
    ids = sink_prefix(ids, sink) if sink else ids
    question = build_prompt(lm, "?", item.question.question, item.question.answer_prefix).question
    eos, pad = eos_ids(lm), lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    for stack, budget in todo:
        try:
            caches = []
            for d, doc in enumerate(ids):
                memo = (*sample_key, stack.label, str(budget), d, sink if d else 0)  # the first: no sink ahead
                if memo not in documents:
                    cache = compress_ids(lm.model, doc, stack, budget)
                    documents[memo] = (cache, cache.compress_clock.seconds)
                caches.append(documents[memo])
            pairs = [(d, c) for d, (c, _) in zip(ids, caches, strict=True)]
            started = now(lm.model.device)
            if join_name(item.mode) == "kvcomm":
                anchors, anchor_s = _anchors(lm.model, ids, documents, sample_key)
                joined = kvcomm.join(lm.model, pairs, anchors)
            else:
                anchor_s, joined = 0.0, join(lm.model, pairs, **join_arguments(item.mode))
            join_s = now(lm.model.device) - started - anchor_s
            out, m = generate_from(lm.model, joined, [question], None, item.question.max_new_tokens, eos, pad)
        except UserError as err:
            _refused({"refused": str(err)}, stack, budget, refused)
            advance()
            continue
        m["prefill_s"] += join_s
        m["compress_s"] += sum(seconds for _, seconds in caches) + anchor_s
        advance(store.add(_answer_row(lm, cells[(stack.label, str(budget))], item, out[0], m)))


def _anchors(
    model: Any, ids: list[list[int]], documents: dict[tuple[Any, ...], Any], sample_key: tuple[Any, ...]
) -> tuple[list[Any], float]:
    """KVCOMM's anchors for a sample's later documents, each observed after another prefix than
    the one it is asked after (the first segment, then the other later documents in reverse
    order); computed once per sample (billed to the first join that needs them: 0 s after)."""
    memo = (*sample_key, "anchors")
    if memo in documents:
        return documents[memo], 0.0
    started = now(model.device)
    anchors: list[Any] = [None]
    for i in range(1, len(ids)):
        prefix = ids[0] + [t for j in reversed(range(1, len(ids))) if j != i for t in ids[j]]
        anchors.append(kvcomm.anchor(model, prefix, ids[i]))
    documents[memo] = anchors
    return anchors, now(model.device) - started


def _answer_row(lm: LoadedModel, cell: Cell, item: Work, ids: list[int], m: dict[str, Any]) -> Row:
    """The scored row of one answer (new token ids) with the measurements of its run."""
    answer = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    s, p = score(answer, item.question.answers)
    return Row(
        cell,
        item.sample.index,
        item.question_index,
        s,
        answer,
        item.question.answers,
        p,
        m["kv_bytes"],
        m["kv_bytes_full"],
        m["kv_ratio"],
        m["prefill_s"],
        m["compress_s"],
        m["decode_tokens_per_s"],
        _peak_rss_mb(),
    )


def _refused(m: dict[str, Any], stack: Stack, budget: Budget, refused: dict[str, str]) -> bool:
    """True (and noted in `refused`) when the cache refused this config: no row to store."""
    if "refused" in m:
        refused[f"{stack.label} at {budget}"] = m["refused"]
    return "refused" in m


def _aware(
    lm: LoadedModel, prompt: Any, stack: Stack, budget: Budget, new: int, eos: set[int], pad: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """One query-aware run, or ([], {"refused": reason}) when the cache refuses the config."""
    try:
        return generate_ids(lm.model, [prompt], stack, budget, False, new, eos, pad)
    except UserError as err:
        return [], {"refused": str(err)}


def _run_fidelity(
    lm: LoadedModel,
    fw: FidelityWork,
    configs: list[tuple[Stack, Budget]],
    store: Store,
    advance: Advance,
    refused: dict[str, str],
) -> None:
    """Fidelity of every missing config for one window of real text."""
    cells = {(s.label, str(b)): _cell(lm, s.label, str(b), "agnostic", "fidelity", fw.length) for s, b in configs}
    todo = [(s, b) for s, b in configs if (fw.index, 0) not in store.done(cells[(s.label, str(b))])]
    advance(steps=len(configs) - len(todo))
    if not todo:
        return
    for (stack, budget), m in zip(
        todo, fidelity_forks(lm.model, list(fw.context), list(fw.continuation), todo), strict=True
    ):
        if _refused(m, stack, budget, refused):
            advance()
            continue
        row = Row(
            cells[(stack.label, str(budget))],
            fw.index,
            0,
            m["top1"],
            "",
            (),
            None,
            m["kv_bytes"],
            m["kv_bytes_full"],
            m["kv_ratio"],
            None,
            m["compress_s"],
            None,
            _peak_rss_mb(),
            m["kl"],
            m["ppl"],
        )
        advance(store.add(row))


def _rival(lm: LoadedModel) -> KvpressRival:
    from kvstack.bench.rivals.kvpress_rival import KvpressRival

    if lm.folder is None:
        raise UserError("rival toolkits load a transformers folder: use a registered model or a local folder")
    return KvpressRival()


def _run_rivals(
    lm: LoadedModel,
    rival: KvpressRival,
    item: Work,
    rivals: list[tuple[str, str, str]],
    store: Store,
    advance: Advance,
    failed: dict[str, str],
) -> None:
    """The rival's presses on the same question, budget mapped to its compression ratio.

    A press that raises is skipped for the rest of the run (and retried by the next run).
    """
    from kvstack.bench.rivals.kvpress_rival import request_for

    key = (item.sample.index, item.question_index)
    for method, press, budget in rivals:
        cell = _cell(lm, method, budget, item.mode, item.sample.task, item.length)
        if key in store.done(cell) or method in failed:
            advance()
            continue
        request = {
            "model": str(lm.folder),
            **request_for(press, float(budget), str(lm.model.dtype).removeprefix("torch.")),
            "context": item.sample.context,
            "question": item.question.question,
            "answer_prefix": item.question.answer_prefix,
            "max_new_tokens": item.question.max_new_tokens,
            "aware": item.mode == "aware",
        }
        try:
            r = rival.ask(request)
        except RuntimeError as err:  # the rival itself broke (kvpress's pyramidkv does on transformers 5.2)
            failed[method] = str(err)
            advance()
            continue
        s, p = score(r["answer"], item.question.answers)
        ratio = r["kv_bytes"] / r["kv_bytes_full"]
        row = Row(
            cell,
            *key,
            s,
            r["answer"],
            item.question.answers,
            p,
            r["kv_bytes"],
            r["kv_bytes_full"],
            ratio,
            r["prefill_s"],
            r["compress_s"],
            r["decode_tokens_per_s"],
            r["peak_rss_mb"],  # the kvpress process's own
        )
        advance(store.add(row))


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
