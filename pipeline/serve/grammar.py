"""Structured outputs: a request's grammar, which says at each step which tokens may come next.

A grammar is compiled by llguidance (docs/tools.md says why that library) from what the request asks: a JSON
schema (OpenAI's `response_format` json_schema, vLLM's `structured_outputs.json`), any JSON object (json_object),
a regular expression, one of a list of strings (`choice`) or a Lark grammar. Compiling happens where the request
is read, off the engine's step, and is cached by what was asked (the tokenizer is the server's one): a repeated
schema compiles once, and each request gets its own copy of the compiled matcher, whose state is its own output
so far.

Each step, the runner asks every constrained row's matcher for its allowed tokens (`masks`: a bitmask, one bit per
token id, llguidance's layout), which cross to the device with the step's other arrays and keep the logits of
the other tokens out of the draw (serve/logits_processors.py). The scheduler feeds every token the request
gets back to its matcher (`advance`); the request ends when the grammar has ended (`is_stopped`: accepted, and
nothing more may follow), or at a stop id, which the grammar allows only where it accepts.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

CACHE_SIZE = 256  # compiled grammars kept (least recently used out)
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it by default (", " and ": "), no other whitespace: a model at temperature 1 could
# otherwise spend its max_tokens on whitespace the grammar allows between tokens (llguidance's default, flexible)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """What was asked cannot be compiled: the library's message."""


def mask_words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class Grammar:
    """One request's matcher: its state is the tokens fed so far."""

    def __init__(self, matcher):
        self.matcher = matcher

    def copy(self) -> Grammar:
        """Another request's matcher in this one's state (a choice of the same request)."""
        return Grammar(self.matcher.deep_copy())


    def advance(self, token: int) -> bool:
        """Feed the request's new token; whether the grammar has ended (nothing more may follow, or the token was
        not the grammar's, which the mask rules out)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()


def masks(grammars: list, words: int) -> np.ndarray:
    """The tokens each grammar allows next, as bitmasks (len(grammars), words) int32 (token t: bit t % 32 of word
    t // 32). One after the other on this thread: llguidance's thread pool (LLExecutor) measured no faster here,
    its threads taking cores from the forward that follows."""
    out = np.zeros((len(grammars), words), np.int32)
    for row, grammar in zip(out, grammars):
        grammar.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return out


class Grammars:
    """Compiles what requests ask for against one tokenizer, keeping the last CACHE_SIZE compiled.

    `stop_ids` are the tokens that end a request (the grammar allows them only where it accepts); `vocab_size`
    is the model's, which may exceed the tokenizer's: the ids beyond the tokenizer are never allowed."""

    def __init__(self, tokenizer_path: Path, stop_ids: list[int], vocab_size: int):
        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_path), n_vocab=vocab_size, eos_token=list(stop_ids))
        self.words = mask_words(vocab_size)
        self.cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.lock = threading.Lock()  # requests are read on several threads

    def compile(self, kind: str, spec) -> tuple[Grammar, bool]:
        """A fresh matcher for `spec` of `kind` (one of KINDS), and whether it came from the cache; GrammarError if
        it cannot be compiled."""
        key = (kind, json.dumps(spec, sort_keys=True))
        with self.lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.cache.move_to_end(key)
                return Grammar(compiled.deep_copy()), True
        compiled = self._matcher(kind, spec)
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return Grammar(compiled.deep_copy()), False

    def _matcher(self, kind: str, spec):
        matcher_class = self._llg.LLMatcher
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec
                grammar = matcher_class.grammar_from_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema), defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = matcher_class.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = matcher_class.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
            else:
                grammar = matcher_class.grammar_from_lark(spec)
        except ValueError as e:
            raise GrammarError(one_line(str(e))) from None
        error = matcher_class.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(one_line(error))
        matcher = matcher_class(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(one_line(matcher.get_error()))
        return matcher


def one_line(message: str) -> str:
    """The library's message (several lines for a regex: the pattern, a caret, the fault) as one line."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:300] or "cannot be compiled"
