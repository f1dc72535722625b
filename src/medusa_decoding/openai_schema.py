"""The OpenAI API's shapes as `medusa serve` takes and answers them: the request bodies (unknown fields refused, never
silently ignored), their fields as a GenerationConfig, OpenAI-style errors, and the response bodies and stream chunks of
/v1/chat/completions and /v1/completions."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .config import GenerationConfig
from .model import GenerationOutput

# request field -> GenerationConfig field; the later of two aliases wins
OPENAI_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
}


# ---- the request bodies ----


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MedusaOptions(Strict):
    """The `medusa` extra body: per-request decoding choices (defaults: GenerationConfig's)."""

    acceptance: str | None = None
    tree: list[list[int]] | list[int] | None = None  # paths or Cartesian sizes; [] = plain decoding
    top_k: int | None = None
    typical_epsilon: float | None = None
    typical_delta: float | None = None
    lookup: int | None = None  # lookup drafts: at most this many tokens a step (GenerationConfig.lookup)
    corpus: int | None = None  # corpus drafts: at most this many tokens a step (GenerationConfig.corpus)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]  # OpenAI's roles but tools' (no tools here)
    content: str | list[TextPart] | None = None
    name: str | None = None


class CommonRequest(Strict):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stream: bool = False
    stream_options: dict | None = None  # accepted: usage always rides on the final chunk
    n: Literal[1] = 1
    user: str | None = None
    medusa: MedusaOptions | None = None


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(CommonRequest):
    prompt: str | list[int]  # text (no chat template) or token ids


class RequestError(Exception):
    """Becomes an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.code, self.status, self.kind = param, code, status, kind


def error_body(message: str, param=None, code=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- a request's fields ----


def generation_config(body: CommonRequest) -> GenerationConfig:
    """The fields the request gives, over GenerationConfig's defaults; a rejected value blames its field."""
    sources = {name: field for field, name in OPENAI_FIELDS.items() if getattr(body, field) is not None}
    values = {name: getattr(body, field) for name, field in sources.items()}
    if isinstance(values.get("stop"), str):
        values["stop"] = (values["stop"],)
    if body.medusa is not None:
        values |= body.medusa.model_dump(exclude_none=True, exclude={"tree"})
        sources |= {name: f"medusa.{name}" for name in body.medusa.model_fields_set - {"tree"}}
    try:
        return GenerationConfig(**values)
    except ValueError as error:  # GenerationConfig's messages start with the field's name
        param = next((p for n, p in sources.items() if str(error).startswith(n)), None)
        raise RequestError(str(error), param) from None


def chat_message(message: Message) -> dict:
    """A message as the chat template takes it; OpenAI's "developer" is the "system" of models trained before it."""
    content = message.content if not isinstance(message.content, list) else "".join(p.text for p in message.content)
    return {"role": "system" if message.role == "developer" else message.role, "content": content or ""}


# ---- the response bodies ----


def usage(prompt_tokens: int, out: GenerationOutput) -> dict:
    completion = len(out.token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "medusa": {"acceleration_rate": out.acceleration_rate, "steps": out.steps, "tokens_per_s": out.tokens_per_s},
    }


def chat_choice(text: str, finish: str | None, stream: bool) -> dict:
    if stream:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def completion_choice(text: str, finish: str | None, stream: bool) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions and /v1/completions."""

    object: str
    chunk_object: str
    id_prefix: str
    choice: Callable[[str, str | None, bool], dict]
    opening_delta: dict | None  # the first chunk's delta (chat announces the role)


CHAT = Endpoint("chat.completion", "chat.completion.chunk", "chatcmpl-", chat_choice,
                {"role": "assistant", "content": ""})
COMPLETION = Endpoint("text_completion", "text_completion", "cmpl-", completion_choice, None)


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
