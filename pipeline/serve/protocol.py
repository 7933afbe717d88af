"""The OpenAI API's request side as kiln serve reads it: the limits, the typed request of each route (pydantic
models: every field the server reads, with its bounds; FastAPI serves them as /openapi.json), the error a bad
request gets (OpenAI's shape, {"error": {"message", "type", "param", "code"}}, 400 naming the field), and the
checks every value passes before it costs anything.

A field the models do not declare is refused as OpenAI's API refuses it ("Unrecognized request argument
supplied: X"): a misspelt key must not be answered as if it had been honoured. A field OpenAI or vLLM define
that kiln does not implement (tools, min_p, beam search, ...) is declared `unsupported`: accepted with a value
that asks for nothing (null, false, an empty list: what clients send as defaults), a 400 naming it otherwise.

A body is read and bounded by http.py first (size, nesting, surrogates), then validated against its model in
strict mode (no "1" for 1, no true for 1, no NaN); what depends on the model served (the context's room, the
vocabulary, the chat template) is checked by service.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.pipeline.errors import shown
from kiln.pipeline.serve.request import MAX_TEMPERATURE

MAX_CHOICES = 128  # `n`: choices of one request, each an engine request
MAX_BODY_BYTES = 1_000_000  # a request body's default limit (`--max-request-bytes`): 413 beyond it
MAX_STOP_CHARS = 256  # a stop string's length: each is looked for in the text after every token
INT64 = 2**63  # integer fields beyond int64 are refused (numpy and torch take nothing wider)
MAX_LOGPROBS = 20  # alternatives a token's log-probabilities may list (`logprobs`, `top_logprobs`), as vLLM's
MAX_PROMPTS = 128  # prompts of one /v1/completions request (a list: a choice block each)
MAX_TOKEN_LIST = 1024  # entries of `logit_bias` and `stop_token_ids`
MAX_BIAS = 100.0  # a logit_bias value's bound, OpenAI's: -100 bans a token in effect, 100 all but forces it
# Token entries one answer may hold: every choice's tokens (its echoed prompt's too), each with its alternatives.
# A small body can ask for a huge answer (128 prompts x n=128 x echo x 20 alternatives: 35M entries, 67 s and
# 1.1 GB before this bound); 2M entries are about 35 MB of JSON, seconds to build.
MAX_WORK = 2_000_000
UNSUPPORTED = "x-kiln-unsupported"  # the schema key of an `unsupported` field: the values it accepts


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


def unsupported(*harmless) -> Any:
    """A field OpenAI or vLLM define that kiln does not implement: null or one of `harmless` (values that ask for
    nothing) accepted, anything else refused by `validated`."""
    accepted = [None, *harmless]
    return Field(None, description="Not supported by kiln serve; accepted only as "
                                   + " or ".join(json.dumps(v) for v in accepted),
                 json_schema_extra={UNSUPPORTED: accepted})


Int64 = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Request(BaseModel):
    """What both routes read. `max_completion_tokens` is read before `max_tokens`; `top_k` is vLLM's extension
    (-1 or null: none), sent by the openai client through `extra_body`."""

    model_config = STRICT
    model: str = Field(description="The served model's name (GET /v1/models)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices, each its own draw of one prompt")
    max_tokens: int | None = Field(None, ge=0, le=INT64 - 1)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64 - 1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int64 | None = None
    seed: Int64 | None = Field(None, description="Choice i draws with seed + i")
    stop: str | list[str] | None = Field(None, description=f"Up to 4 strings of 1 to {MAX_STOP_CHARS} characters")
    user: str | None = Field(None, description="The end user's id: accepted, not used")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Less each token already in the "
                                                                               "output (null: 0)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                            description="Less each token times its count in the output (null: 0)")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = Field(
        None, max_length=MAX_TOKEN_LIST, description="Token id (a string) -> a value added to its logit")
    response_format: ResponseFormat | None = Field(None, discriminator="type")
    # vLLM's sampling extensions
    structured_outputs: StructuredOutputs | None = None
    min_p: Any = unsupported(0)
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM's: a seen token's logit divided by it "
                                                                       "where positive, multiplied where negative")
    min_tokens: int | None = Field(None, ge=0, le=INT64 - 1, description="The stop ids held back until this many "
                                                                         "tokens")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_LIST, description="Token ids that end a choice")
    ignore_eos: Any = unsupported(False)
    include_stop_str_in_output: Any = unsupported(False)
    use_beam_search: Any = unsupported(False)
    length_penalty: Any = unsupported(1)
    bad_words: Any = unsupported([])
    allowed_token_ids: Any = unsupported()
    skip_special_tokens: Any = unsupported(True)
    spaces_between_special_tokens: Any = unsupported(True)
    truncate_prompt_tokens: Any = unsupported()
    prompt_logprobs: Any = unsupported()
    return_tokens_as_token_ids: Any = unsupported(False)
    priority: Any = unsupported(0)
    logits_processors: Any = unsupported()
    # OpenAI's: what the request is for, never what it answers
    safety_identifier: str | None = Field(None, description="The end user's id: accepted, not used")
    prompt_cache_key: str | None = Field(None, description="A caching hint: accepted, not needed (kiln caches "
                                                           "every prompt's blocks by their tokens)")
    metadata: Any = unsupported({})
    service_tier: Any = unsupported("auto", "default")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JSONSchema(BaseModel):
    model_config = STRICT
    name: str = Field(max_length=64)
    description: str | None = None
    # `schema` is a BaseModel method: the field's own name is its alias
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema; none: any JSON object")
    strict: bool | None = Field(None, description="Always: the output follows the schema")


class JSONSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (through the openai client's extra_body): exactly one of these."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON Schema (or its text)")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_TOKEN_LIST)
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's dialect)")
    json_object: bool | None = None
    disable_fallback: Any = unsupported(False)
    disable_any_whitespace: Any = unsupported(True, False)  # kiln's JSON has no free whitespace either way
    disable_additional_properties: Any = unsupported(False)
    whitespace_pattern: Any = unsupported()
    structural_tag: Any = unsupported()


class CompletionRequest(Request):
    prompt: str | list = Field(
        description=f"A string, a list of token ids, or a list of up to {MAX_PROMPTS} of either (a choice block "
                    "each). Token ids are used exactly as sent; a string starts a document: it is read after "
                    "<|endoftext|>, which the usage counts and echo lists first")
    echo: bool = Field(False, description="The prompt's text (and log-probabilities) before the completion")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Log-probabilities of each token, with this many alternatives")
    best_of: Any = unsupported(1)
    suffix: Any = unsupported("")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str = ""


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: Any = unsupported()  # the chat template has no place for a participant's name
    # what the openai client's assistant message carries back into a conversation, empty
    refusal: Any = unsupported()
    tool_calls: Any = unsupported([])
    function_call: Any = unsupported()
    audio: Any = unsupported()
    annotations: Any = unsupported([])


class ChatCompletionRequest(Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(False, description="Log-probabilities of each token of the answer")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token, with logprobs")
    tools: Any = unsupported([])
    tool_choice: Any = unsupported("none")
    parallel_tool_calls: Any = unsupported(True, False)  # with no tools it asks for nothing
    functions: Any = unsupported([])
    function_call: Any = unsupported("none")
    modalities: Any = unsupported(["text"])
    audio: Any = unsupported()
    prediction: Any = unsupported()
    reasoning_effort: Any = unsupported()
    verbosity: Any = unsupported()
    web_search_options: Any = unsupported()
    store: Any = unsupported(False)
    # vLLM's: the template is always applied with the assistant's turn opened, never continuing the last message
    echo: Any = unsupported(False)
    add_generation_prompt: Any = unsupported(True)
    continue_final_message: Any = unsupported(False)
    chat_template: Any = unsupported()
    chat_template_kwargs: Any = unsupported({})
    documents: Any = unsupported([])


Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
FIELDS = {info.alias or name
          for kind in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, TextFormat,
                       JSONObjectFormat, JSONSchemaFormat, JSONSchema, StructuredOutputs)
          for name, info in kind.model_fields.items()}


def validated(kind: type[BaseModel], body: dict) -> dict:
    """`body` checked against the route's model: the fields the client sent, as it sent them; a BadRequest naming
    the first field that does not fit, is not the route's, or asks for what kiln does not implement."""
    try:
        request = kind.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        where = ""
        loc = error["loc"][:-1] if error["type"] == "extra_forbidden" else error["loc"]
        for i, part in enumerate(loc):
            if isinstance(part, int):  # a union's member names (`str`, `list[int]`) are not part of the path
                where += f"[{part}]"
            elif i and loc[i - 1] == "response_format":  # the format's type, which picked the member
                continue
            elif i and loc[i - 1] == "logit_bias":  # a token id, as the client wrote it
                where += f"[{json.dumps(part)}]"
            elif part in FIELDS:
                where += f".{part}" if where else part
        if error["type"] == "extra_forbidden":
            key = shown(error["loc"][-1], 60).strip("'")
            where = f"{where}.{key}" if where else key
            raise BadRequest(f"Unrecognized request argument supplied: {where}", where) from None
        given = f"={shown(error['input'])}" if error["type"] != "missing" else ""
        raise BadRequest(f"{where or 'the request body'}{given}: {error['msg']}", where or None) from None
    refuse_unsupported(request, "")
    return request.model_dump(exclude_unset=True, by_alias=True)


def refuse_unsupported(model: BaseModel, where: str) -> None:
    """A BadRequest naming the first `unsupported` field of `model` (or of a model it holds) set to a value that
    asks for something."""
    for name, info in type(model).model_fields.items():
        value, path = getattr(model, name), f"{where}.{name}" if where else name
        accepted = (info.json_schema_extra or {}).get(UNSUPPORTED)
        if accepted is not None and not any(asks_nothing(value, a) for a in accepted):
            raise BadRequest(f"{path}={shown(value)}: not supported by kiln serve (accepted only as "
                             f"{' or '.join(json.dumps(a) for a in accepted)})", path)
        if isinstance(value, BaseModel):
            refuse_unsupported(value, path)
        for i, item in enumerate(value if isinstance(value, list) else []):
            if isinstance(item, BaseModel):
                refuse_unsupported(item, f"{path}[{i}]")


def asks_nothing(value, accepted) -> bool:
    """Whether `value` is `accepted`: equal, and a number only where a number is (JSON's false is not 0)."""
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)
