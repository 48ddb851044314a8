"""kvstack as an lm-eval model: at budget 1.0 its loglikelihoods and greedy answers equal lm-eval's
own `hf` model on the same weights; compressed, the bytes it measured follow the budget; `kvstack
eval` runs a local task and refuses an unknown one in one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvstack import load  # noqa: E402
from kvstack.harness import KVStackLM  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = {
    "kvstack_choice": """
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
""",
    "kvstack_answer": """
output_type: generate_until
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
""",
}


def write_tasks(folder: Path) -> Path:
    """The local tasks as lm-eval YAML, their data files named by absolute path."""
    for name, body in TASKS.items():
        data = DATA / ("choice.jsonl" if "choice" in name else "answer.jsonl")
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        head += 'doc_to_text: "{{context}}\\nQuestion: {{question}}\\nAnswer:"\n'
        (folder / f"{name}.yaml").write_text(head + body)
    return folder


def samples(model, folder, task):
    result = simple_evaluate(
        model=model, tasks=[task], task_manager=TaskManager(include_path=str(folder)), log_samples=True
    )
    return result["results"][task], [s["resps"] for s in result["samples"][task]]


def leaves(nested):
    """The numbers and booleans of nested lists and tuples, in order."""
    if isinstance(nested, (list, tuple)):
        return [x for item in nested for x in leaves(item)]
    return [nested]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def test_at_full_budget_scores_equal_lm_evals_hf_model(tiny_folder, tasks):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(tiny_folder), device="cpu", batch_size=1, dtype="float32", prefix_token_id=0)
    ours = KVStackLM(load(str(tiny_folder), dtype=torch.float32), "full", 1.0)  # as lm-eval's hf loads it
    (theirs_metrics, theirs), (our_metrics, mine) = (
        samples(hf, tasks, "kvstack_choice"),
        samples(ours, tasks, "kvstack_choice"),
    )
    assert our_metrics == theirs_metrics
    got, expected = leaves(mine), leaves(theirs)  # (loglikelihood, greedy) per choice, nested per document
    assert [g for g in got if isinstance(g, bool)] == [e for e in expected if isinstance(e, bool)]
    pairs = [(g, e) for g, e in zip(got, expected, strict=True) if not isinstance(g, bool)]
    assert pairs and all(abs(g - e) < 1e-3 for g, e in pairs)
    assert ours.kv_ratios and all(r == 1.0 for r in ours.kv_ratios)


def test_at_full_budget_answers_equal_transformers_greedy_generation(tiny_folder, tasks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    _, mine = samples(KVStackLM(load(str(tiny_folder), dtype=torch.float32), "full", 1.0), tasks, "kvstack_answer")
    rows = [json.loads(line) for line in (DATA / "answer.jsonl").read_text().splitlines()]
    for row, answer in zip(rows, leaves(mine), strict=True):
        ids = torch.tensor([tok.encode(f"{row['context']}\nQuestion: {row['question']}\nAnswer:")])
        new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
        assert answer == tok.decode(new.tolist(), skip_special_tokens=True).split("\n")[0]


def test_a_compressed_cache_holds_the_budgets_bytes(tiny_folder, tasks):
    lm = load(str(tiny_folder))
    ours = KVStackLM(lm, "snapkv(window_size=4)", 0.5)
    metrics, _ = samples(ours, tasks, "kvstack_choice")
    assert "acc,none" in metrics
    assert 0.3 < sum(ours.kv_ratios) / len(ours.kv_ratios) <= 0.6
    rolling = KVStackLM(lm, "snapkv(window_size=4)", 0.5, chunk=16)
    full = KVStackLM(lm, "full", 1.0, chunk=16)

    class Request:
        args = ("The key is 4711. Blue whales sing at dawn. " * 3,)

    assert rolling.loglikelihood_rolling([Request()])[0] != full.loglikelihood_rolling([Request()])[0]
    assert rolling.kv_ratios[0] <= 0.6 and full.kv_ratios[0] == 1.0


def test_the_command_runs_a_local_task_and_refuses_unknown_ones(tiny_folder, tasks, tmp_path):
    base = [sys.executable, "-m", "kvstack.cli", "eval", "--model", str(tiny_folder), "--include-path", str(tasks)]
    out = tmp_path / "eval.json"
    done = subprocess.run(
        [*base, "--tasks", "kvstack_choice", "--method", "snapkv(window_size=4)", "--budget", "0.5", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    saved = json.loads(out.read_text())
    assert "kvstack_choice" in done.stdout and saved["results"]["kvstack_choice"]["acc,none"] >= 0
    assert 0.3 < saved["kv_ratio"] <= 0.6
    bad = subprocess.run([*base, "--tasks", "kvstack_choise"], capture_output=True, text=True)
    assert bad.returncode == 2 and "kvstack_choice" in bad.stderr and "Traceback" not in bad.stderr


def test_lm_eval_builds_it_by_name_from_a_model_args_string(tiny_folder, tasks):
    result = simple_evaluate(
        model="kvstack",
        model_args=f"model={tiny_folder},method=knorm,budget=0.5,max_gen_toks=4",
        tasks=["kvstack_answer"],
        task_manager=TaskManager(include_path=str(tasks)),
    )
    assert "exact_match,none" in result["results"]["kvstack_answer"]
