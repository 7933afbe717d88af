"""The OpenAI API's request side as kiln serve reads it: the limits, the typed request of each route (pydantic
models: every field the server reads, with its bounds; unknown fields ignored, as OpenAI does; FastAPI serves
them as /openapi.json), the error a bad request gets (OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, 400 naming the field), and the checks every value passes before it costs anything.

A body is read and bounded by http.py first (size, nesting, surrogates), then validated against its model in
strict mode (no "1" for 1, no true for 1, no NaN); what depends on the model served (the context's room, the
vocabulary, the chat template) is checked by service.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.pipeline.errors import shown

MAX_CHOICES = 128  # `n`: choices of one request, each an engine request
MAX_BODY_BYTES = 1_000_000  # a request body's default limit (`--max-request-bytes`): 413 beyond it
MAX_STOP_CHARS = 256  # a stop string's length: each is looked for in the text after every token
INT64 = 2**63  # integer fields beyond int64 are refused (numpy and torch take nothing wider)
MAX_LOGPROBS = 20  # alternatives a token's log-probabilities may list (`logprobs`, `top_logprobs`), as vLLM's
MAX_PROMPTS = 128  # prompts of one /v1/completions request (a list: a choice block each)
# OpenAI options kiln does not implement, and the values of each that ask for nothing (clients send defaults)
UNSUPPORTED = {"best_of": (None, False, 1)}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unpaired_surrogate(body: dict) -> str | None:
    """Where in `body` a string (or key) holds a lone UTF-16 surrogate, which JSON's \\u escapes can spell but no
    tokenizer can encode: its path ("messages[0].content"), or None."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the request body"
        elif isinstance(value, dict):
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
            stack += [(k, path or "the request body") for k in value]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return None


Int64 = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]


class Request(BaseModel):
    """What both routes read. `max_completion_tokens` is read before `max_tokens`; `top_k` is vLLM's extension
    (-1 or null: none), sent by the openai client through `extra_body`."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str = Field(description="The served model's name (GET /v1/models)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices, each its own draw of one prompt")
    max_tokens: int | None = Field(None, ge=0, le=INT64 - 1)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64 - 1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int64 | None = None
    seed: Int64 | None = Field(None, description="Choice i draws with seed + i")
    stop: str | list[str] | None = Field(None, description=f"Up to 4 strings of 1 to {MAX_STOP_CHARS} characters")
    best_of: int | None = Field(None, description="Not supported: only null or 1")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class CompletionRequest(Request):
    prompt: str | list = Field(
        description=f"A string, a list of token ids, or a list of up to {MAX_PROMPTS} of either (a choice block "
                    "each); each starts a document, after <|endoftext|>")
    echo: bool = Field(False, description="The prompt's text (and log-probabilities) before the completion")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Log-probabilities of each token, with this many alternatives")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class ChatCompletionRequest(Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(False, description="Log-probabilities of each token of the answer")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token, with logprobs")


Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
FIELDS = {name for kind in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
          for name in kind.model_fields}


def validated(kind: type[BaseModel], body: dict) -> dict:
    """`body` checked against the route's model: the fields the client sent, as it sent them (unknown ones
    dropped); a BadRequest naming the first field that does not fit."""
    try:
        return kind.model_validate(body).model_dump(exclude_unset=True)
    except ValidationError as e:
        error = e.errors()[0]
        where = ""
        for part in error["loc"]:  # a union's member names (`str`, `list[int]`) are not part of the path
            if isinstance(part, int):
                where += f"[{part}]"
            elif part in FIELDS:
                where += f".{part}" if where else part
        given = f"={shown(error['input'])}" if error["type"] != "missing" else ""
        raise BadRequest(f"{where or 'the request body'}{given}: {error['msg']}", where or None) from None
