"""The OpenAI API's request side as kiln serve reads it: the limits, the error a bad request gets (OpenAI's
shape, {"error": {"message", "type", "param", "code"}}, 400 naming the field), and the checks every value
passes before it costs anything (numbers within bounds, no lone surrogates).
"""

from __future__ import annotations

from kiln.pipeline.errors import shown

MAX_CHOICES = 128  # `n`: choices of one request, each an engine request
MAX_BODY_BYTES = 1_000_000  # a request body's default limit (`--max-request-bytes`): 413 beyond it
MAX_STOP_CHARS = 256  # a stop string's length: each is looked for in the text after every token
DECODE_ON_LOOP = 256  # outputs up to this many tokens are decoded on the event loop, longer ones on a thread
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


def number(value, name: str, kind: type, low: float | None = None, high: float | None = None,
           open_low: bool = False):
    """`value` as `kind`, within [low, high] ((low, high] with open_low), or a BadRequest naming the field."""
    given = value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or
                                                                                float(value).is_integer())
    if ok:
        value = kind(value)
        ok = value == value and abs(value) != float("inf") and (kind is float or abs(value) <= INT64)
        if low is not None:
            ok = ok and (value > low if open_low else value >= low)
        if high is not None:
            ok = ok and value <= high
    if not ok:
        bounds = "" if low is None else f" in {'(' if open_low else '['}{low}, {high if high is not None else 'inf'}]"
        raise BadRequest(f"{name}={shown(given)}: expected {'an integer' if kind is int else 'a number'}{bounds}",
                         name)
    return value


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
