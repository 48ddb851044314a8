"""The OpenAI-compatible request bodies, with kvstack's extras, and their turn into token ids."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvstack.api import question_ids
from kvstack.errors import UserError
from kvstack.generate import Prompt
from kvstack.models.loading import LoadedModel
from kvstack.models.prompts import build_prompt


class Extras(BaseModel):
    """Fields OpenAI's API lacks: `kv_method` and `kv_budget` override the server's for this request;
    `kv_context` is a document compressed before the question (query-agnostic) and kept in the
    prefix store, so the next request naming the same text loads it instead of compressing again."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    kv_method: str | None = None
    kv_budget: str | float | None = None
    kv_context: str | None = None
    kv_answer_prefix: str = ""  # with kv_context: the answer's first words, after the chat turn

    def stops(self) -> tuple[str, ...]:
        found = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(found) > 4 or any(not s for s in found):
            raise UserError("stop: give at most 4 non-empty strings")
        return tuple(found)


class CompletionRequest(Extras):
    prompt: str | list[str]

    def prompt_ids(self, lm: LoadedModel) -> Prompt:
        """(compressed part, question): the prompt alone, or the question after `kv_context`."""
        texts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(texts) != 1 or not texts[0]:
            raise UserError("prompt: give one non-empty string (batches of prompts are separate requests)")
        if self.kv_context is not None:
            asked = question_ids(lm, texts[0], self.kv_answer_prefix)
            return Prompt(build_prompt(lm, self.kv_context, "?").context, asked)
        ids = lm.tokenizer.encode(texts[0], add_special_tokens=False)
        bos = lm.tokenizer.bos_token_id
        return Prompt([bos, *ids] if lm.add_bos and bos is not None else ids, [])


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Extras):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def prompt_ids(self, lm: LoadedModel) -> Prompt:
        """The conversation in the model's chat template; with `kv_context`, the document and then
        the one user message asking about it (as `kvstack.answer` builds them)."""
        if self.kv_context is not None:
            if len(self.messages) != 1 or self.messages[0].role != "user":
                raise UserError("kv_context goes with one user message (the question about the document)")
            question = question_ids(lm, self.messages[0].content, self.kv_answer_prefix)
            return Prompt(build_prompt(lm, self.kv_context, "?").context, question)
        tok = lm.tokenizer
        messages = [m.model_dump() for m in self.messages]
        if lm.chat:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        ids = tok.encode(text, add_special_tokens=False)
        return Prompt([tok.bos_token_id, *ids] if lm.add_bos and tok.bos_token_id is not None else ids, [])
