"""Turn (context, question) text into token ids split where query-agnostic compression happens."""

from __future__ import annotations

from kvstack.generate import Prompt
from kvstack.models.loading import LoadedModel

_MARK = "\u2063KVSTACK_SPLIT\u2063"


def build_prompt(
    lm: LoadedModel, context: str, question: str, answer_prefix: str = "", history: tuple[tuple[str, str], ...] = ()
) -> Prompt:
    """Chat models: one user turn `context + question`, then the assistant turn and `answer_prefix`.
    Base models: `context`, `question` and `answer_prefix` as plain text, the answer on a line of
    its own (glued to the question, "...text?The number is", Gemma 3 answered "?" or nothing).
    `history`: earlier (question, answer) turns of a conversation about the context, asked
    before `question` (chat models: user and assistant turns; base models: lines).
    """
    tok = lm.tokenizer
    sep = "\n\n" if context and question else ""
    turns = [*(q for turn in history for q in turn), question]  # user, assistant, ..., user
    if lm.chat:
        roles = ["user", "assistant"] * len(history) + ["user"]
        messages = [{"role": r, "content": t} for r, t in zip(roles, turns, strict=True)]
        messages[0]["content"] = f"{context}{sep}{_MARK}{messages[0]['content']}"
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ctx_text, _, q_text = text.partition(_MARK)
        q_text += answer_prefix
    else:
        ctx_text, q_text = f"{context}{sep}", "\n".join(t for t in (*turns, answer_prefix) if t)
    ctx = tok.encode(ctx_text, add_special_tokens=False)
    q = tok.encode(q_text, add_special_tokens=False) if q_text else []
    if lm.add_bos and tok.bos_token_id is not None:
        ctx = [tok.bos_token_id, *ctx]
    return Prompt(context=ctx, question=q)


def eos_ids(lm: LoadedModel) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS and the chat end-of-turn token."""
    tok = lm.tokenizer
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<eos>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids.add(tid)
    if lm.chat and tok.bos_token_id in ids and tok.bos_token_id != tok.eos_token_id:
        ids.discard(tok.bos_token_id)
    return ids
