"""Prompt layout for base models (plain text); chat models are checked on SmolLM2 in test_real_models."""

from kvstack.models.prompts import build_prompt
from tiny import tiny_loaded


def test_a_base_models_answer_starts_on_its_own_line():
    lm = tiny_loaded()
    p = build_prompt(lm, "The sky is green.", "What colour is the sky?", "The sky is")
    enc = lm.tokenizer.encode  # (the test tokenizer spells a newline <unk>)
    assert p.context == enc("The sky is green.\n\n")
    assert p.question == enc("What colour is the sky?\nThe sky is")
    assert build_prompt(lm, "The sky is green.", "What colour is the sky?").question == enc("What colour is the sky?")
    assert build_prompt(lm, "The sky is green.", "").question == []


def test_a_base_model_gets_the_bos_it_asks_for():
    lm = tiny_loaded()
    lm.tokenizer.bos_token = "<unk>"
    lm.add_bos = True
    assert build_prompt(lm, "sky", "?").context[0] == lm.tokenizer.bos_token_id


def test_earlier_turns_come_before_the_question():
    lm = tiny_loaded()
    p = build_prompt(lm, "Ada is 3. Bo is 5.", "How old is Bo?", "Bo is", history=(("How old is Ada?", "Ada is 3."),))
    enc = lm.tokenizer.encode
    assert p.context == enc("Ada is 3. Bo is 5.\n\n")  # the context a query-agnostic cache compresses
    assert p.question == enc("How old is Ada?\nAda is 3.\nHow old is Bo?\nBo is")
