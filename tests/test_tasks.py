"""Task generators plant their answers where they say, at the length asked; scorers follow RULER."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.bench.score import digit_partial, exact_all, string_match_all
from kvstack.bench.tasks.needle import insert_at_depth, python_docs_words
from kvstack.bench.tasks.ruler import build_context, common_words, niah, variable_tracking


def words(text: str) -> int:
    return len(text.split())


PROSE = [s + "." for s in " ".join(python_docs_words()[:3000]).split(". ") if s]


@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_single_needle_is_in_the_context_once_at_about_the_length(haystack):
    s = niah("niah_single", 3, 2000, words, haystack=haystack, prose=PROSE)
    (q,) = s.questions
    (value,) = q.answers
    assert s.context.count(value) == 1
    assert f"magic numbers for {q.question.split(' for ')[1].split(' mentioned')[0]} is: {value}" in s.context
    assert 1900 <= words(s.context) <= 2000
    assert len(s.depths) == 1 and 0.0 <= s.depths[0] <= 1.0


def test_samples_are_stable_and_differ_by_index_and_seed():
    a, b = niah("niah_single", 0, 500, words), niah("niah_single", 0, 500, words)
    assert a == b
    assert niah("niah_single", 1, 500, words) != a
    assert niah("niah_single", 0, 500, words, seed=1) != a


def test_multikey_asks_one_key_with_a_key_specific_prefix_and_plants_distractors():
    s = niah("niah_multikey", 5, 1500, words, keys=4)
    (q,) = s.questions
    key = q.question.split(" for ")[1].split(" mentioned")[0]
    assert key in q.answer_prefix
    assert s.context.count("One of the special magic numbers for") == 4
    assert s.context.count(q.answers[0]) == 1


def test_multivalue_asks_all_values_of_one_key():
    s = niah("niah_multivalue", 2, 1500, words, values=4)
    (q,) = s.questions
    assert len(q.answers) == 4 and all(v in s.context for v in q.answers)
    assert q.question.startswith("What are all")


def test_multiquery_carries_one_question_per_asked_key():
    s = niah("niah_multiquery", 2, 1500, words, keys=4, queries=2)
    assert len(s.questions) == 2
    assert len({q.answers[0] for q in s.questions}) == 2


def test_variable_tracking_chain_is_in_order_and_complete():
    s = variable_tracking(1, 1500, words, hops=4)
    (q,) = s.questions
    names = q.answers
    assert len(names) == 5
    positions = [s.context.index(f"VAR {n} =") for n in names]
    assert positions == sorted(positions)
    value = q.question.split("value ")[1].split(" ")[0]
    assert f"VAR {names[0]} = {value}." in s.context
    for a, b in zip(names, names[1:], strict=False):
        assert f"VAR {b} = {a}." in s.context


def test_common_words_are_the_most_frequent():
    s = common_words(0, 1200, words, top=10)
    (q,) = s.questions
    items = [w for w in s.context.split() if not w[0].isdigit()][7:]
    counts = {w: items.count(w) for w in set(items)}
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert set(top) == set(q.answers)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5))
@settings(max_examples=30, deadline=None)
def test_inserts_land_at_their_depth(depths):
    inserts = [(d, f"NEEDLE{i}.") for i, d in enumerate(depths)]
    context, realised = build_context(lambda i: f"s{i}.", inserts, 200, words)
    body = [w for w in context.split() if w.startswith("s")]
    for (d, text), r in zip(inserts, realised, strict=True):
        assert text in context
        assert abs(r - d) <= 1.5 / len(body)


def test_insert_at_depth_uses_sentence_boundaries():
    text = "One. Two. Three. Four."
    assert insert_at_depth(text, "X.", 0.0) == "One. X. Two. Three. Four."
    assert insert_at_depth(text, "X.", 1.0).endswith("X.")


def test_string_match_and_digit_partial():
    assert string_match_all("It is 7391524 and 42", ["7391524", "42"]) == 1.0
    assert string_match_all("It is 7391524", ["7391524", "42"]) == 0.5
    assert exact_all("it is Dolores PARK", ["dolores park"]) == 1.0
    assert digit_partial(" 73. It is used", "7391524") == pytest.approx(2 / 7)
    assert digit_partial("7391524.", "7391524") == 1.0
    assert digit_partial("no number", "7391524") == 0.0
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_a_task_file_groups_questions_by_context(tmp_path):
    from kvstack.bench.tasks.custom import load_task_file

    path = tmp_path / "mine.jsonl"
    rows = [
        {"context": "Ada keeps a red kite.", "question": "What does Ada keep?", "answer": "kite"},
        {"context": "Bo owns 3 cats.", "question": "How many cats?", "answer": ["3"], "max_new_tokens": 4},
        {"context": "Ada keeps a red kite.", "question": "Colour?", "answer": "red", "answer_prefix": "It is"},
    ]
    path.write_text("\n".join(__import__("json").dumps(r) for r in rows) + "\n\n")
    first, second = load_task_file(path)
    assert first.task == "file:mine" and first.context == "Ada keeps a red kite." and first.index == 0
    assert [(q.question, q.answers, q.answer_prefix) for q in first.questions] == [
        ("What does Ada keep?", ("kite",), ""),
        ("Colour?", ("red",), "It is"),
    ]
    assert second.questions[0].answers == ("3",) and second.questions[0].max_new_tokens == 4


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"context": "c", "question": "q"}', "mine.jsonl:1 lacks answer"),
        ("not json", "mine.jsonl:1 is not JSON"),
        ('{"context": "c", "question": "q", "answer": "a", "max_new_tokens": 0}', "max_new_tokens"),
        ("", "has no rows"),
    ],
)
def test_bad_task_files_name_the_line_and_the_fix(tmp_path, text, message):
    from kvstack.bench.tasks.custom import load_task_file
    from kvstack.errors import UserError

    path = tmp_path / "mine.jsonl"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_task_file(path)
    with pytest.raises(UserError, match="does not exist"):
        load_task_file(tmp_path / "nope.jsonl")


def test_multiturn_asks_each_fact_after_the_turns_before_it():
    from kvstack.bench.runner import _prose
    from kvstack.bench.tasks.multiturn import multiturn

    s = multiturn(1, 1200, words, 0, _prose(), turns=4)
    assert s.task == "niah_multiturn" and len(s.questions) == 4
    answers = [q.answers[0] for q in s.questions]
    assert len(set(answers)) == 4 and all(a in s.context for a in answers)  # four facts, all in the context
    for i, q in enumerate(s.questions):  # turn i comes after the earlier turns with their answers
        assert [a for _, a in q.history] == [f"{p.answer_prefix} {p.answers[0]}." for p in s.questions[:i]]
        assert [h for h, _ in q.history] == [p.question for p in s.questions[:i]]
