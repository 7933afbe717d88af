"""Dataset adapters for SFT, DPO and GRPO: rows read through `datasets`, turned into chat messages.

Public instruction, preference and prompt/answer sets each come in their own shape (Alpaca, Dolly, Anthropic HH
transcripts, stack-exchange pairs, chat-message lists, GSM8K), so there is one small adapter per real-world format
and everything downstream sees only `{"role", "content"}` messages. Real sets also hold a few broken rows (an
empty answer, a missing column, a field of the wrong type); those are counted by reason and skipped, and only a
set with no usable row at all is an error. A file that cannot be read as rows at all (a line that is not JSON, a
truncated gzip or Parquet file) is refused, naming the file and the line: that is a damaged file, not a broken row.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.pipeline.errors import UserError
from kiln.pipeline.progress import console
from kiln.pipeline.stage_inputs import check_declared
from kiln.pipeline.tasks.chat_format import ROLES
from kiln.pipeline.tasks.task_files import is_row_file, read_row_file
from kiln.pipeline.text.corpus import SURROGATE

SFT_FORMATS = ("messages", "alpaca", "dolly", "prompt_response")
PREFERENCE_FORMATS = ("pairs", "hh", "stack_exchange")
PROMPT_FORMATS = ("prompt_answer", "gsm8k")

# The columns that identify each format, tried in this order; "hh" and "pairs" are told apart by the first row.
SFT_COLUMNS = {"messages": ("messages",), "alpaca": ("instruction", "output"), "dolly": ("instruction", "response"),
               "prompt_response": ("prompt", "response")}
PREFERENCE_COLUMNS = {"stack_exchange": ("question", "response_j", "response_k"), "hh": ("chosen", "rejected"),
                      "pairs": ("chosen", "rejected")}
PROMPT_COLUMNS = {"prompt_answer": ("prompt", "answer"), "gsm8k": ("question", "answer")}
FORMAT_COLUMNS = {"sft": SFT_COLUMNS, "preference": PREFERENCE_COLUMNS, "prompt": PROMPT_COLUMNS}

HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


@dataclass(frozen=True)
class Pair:
    prompt: list[dict]    # the messages both answers follow (usually ends with a user turn)
    chosen: list[dict]    # the preferred continuation: assistant message(s), non-empty
    rejected: list[dict]  # the dispreferred one


@dataclass(frozen=True)
class PromptAnswer:
    """A GRPO row: the policy samples completions of `prompt`, a reward compares each with `answer`. The answer
    is kept whole (GSM8K's worked reasoning included), since a reward such as `numeric` finds its own part."""

    prompt: list[dict]  # chat messages ending with a user turn
    answer: str

    @property
    def question(self) -> str:
        """The last user turn's text: what a reward gets as the prompt."""
        return next(m["content"] for m in reversed(self.prompt) if m["role"] == "user")


class Skip(Exception):
    """A row that cannot be used; the message is the reason it is counted under."""


def read_rows(spec: str, split: str, key: str) -> Iterator[dict]:
    """`hf:<dataset>[:<config>]`, streamed so that nothing is copied into the Hugging Face cache, or a local
    .json/.jsonl/.parquet file (optionally .gz), read with the types it was written with."""
    where = f"params: {key}={spec!r}"
    if not spec.startswith("hf:"):
        path = Path(spec)
        if not is_row_file(path):
            raise UserError(f"{where}: unsupported file type (expected .json, .jsonl, .parquet, optionally .gz, "
                            "or hf:<dataset>[:<config>])")
        if not path.is_file():
            raise UserError(f"{where}: no such file")
        check_declared(path, key)
        return (row.values for row in read_row_file(path))
    import datasets

    name, _, config = spec[3:].partition(":")
    if not name:
        raise UserError(f"{where}: expected hf:<dataset>[:<config>]")
    where = f"{where} (split {split!r})"
    try:
        return _guarded(iter(datasets.load_dataset(name, config or None, split=split, streaming=True)), where)
    except Exception as e:  # datasets raises many types for "no such dataset / config / split"
        raise UserError(f"{where}: {_first_line(e)}") from None


def _guarded(rows: Iterator[dict], where: str) -> Iterator[dict]:
    """Rows are parsed lazily, so a malformed file can also fail part-way through."""
    try:
        yield from rows
    except Exception as e:
        raise UserError(f"{where}: {_first_line(e)}") from None


def convert_rows(rows: Iterator[dict], convert: Callable[[dict], object], limit: int | None,
                 where: str) -> tuple[list, Counter, int]:
    """(converted rows, skipped rows by reason, rows read): rows are converted until `limit` are usable; a row
    whose conversion raises `Skip` is counted under its reason. No usable row is an error."""
    used, skipped, read = [], Counter(), 0
    for row in rows:
        if len(used) == limit:
            break
        read += 1
        try:
            used.append(convert(row))
        except Skip as e:
            skipped[str(e)] += 1
    if not used:
        raise UserError(f"{where}: no usable row among {read:,}" + (f" ({reasons(skipped)})" if skipped else ""))
    return used, skipped, read


def reasons(skipped: Counter) -> str:
    return ", ".join(f"{reason}: {n:,}" for reason, n in skipped.most_common())


def _first_line(e: Exception) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def detect_format(row: dict, kind: str, where: str) -> str:
    """The format whose columns `row` (the first) has; `kind` is "sft", "preference" or "prompt"."""
    table = FORMAT_COLUMNS[kind]
    fmt = next((fmt for fmt, columns in table.items() if all(c in row for c in columns)), None)
    if fmt == "hh" and ("prompt" in row or not _is_transcript(row["chosen"])):
        return "pairs"
    if fmt is None:
        expected = "; ".join(f"{fmt}: {', '.join(columns)}" for fmt, columns in table.items())
        # A column name may hold a newline (any JSON key can): quoted, the error stays on one line.
        columns = ", ".join(c if c.isprintable() else repr(c) for c in row)
        raise UserError(f"{where}: cannot tell the format from the first row's columns "
                        f"{columns or '(none)'} (expected {expected})")
    return fmt


def _is_transcript(value: object) -> bool:
    return isinstance(value, str) and ("\n\nHuman:" in value or value.startswith("Human:"))


def load_conversations(spec: str, fmt: str, split: str = "train", max_rows: int | None = None,
                       key: str = "sft.data") -> list[list[dict]]:
    return _load(spec, fmt, split, max_rows, key, "sft")


def load_pairs(spec: str, fmt: str, split: str = "train", max_rows: int | None = None,
               key: str = "dpo.data") -> list[Pair]:
    return _load(spec, fmt, split, max_rows, key, "preference")


def load_prompts(spec: str, fmt: str, split: str = "train", max_rows: int | None = None,
                 key: str = "grpo.data") -> list[PromptAnswer]:
    return _load(spec, fmt, split, max_rows, key, "prompt")


def _load(spec: str, fmt: str, split: str, max_rows: int | None, key: str, kind: str) -> list:
    converters = {"sft": SFT_CONVERTERS, "preference": PREFERENCE_CONVERTERS, "prompt": PROMPT_CONVERTERS}[kind]
    where = f"params: {key}={spec!r}"
    if fmt != "auto" and fmt not in converters:
        raise UserError(f"{where}: unknown format {fmt!r} (expected auto, {', '.join(converters)})")
    rows = read_rows(spec, split, key)
    first = next(rows, None)
    if first is None:
        raise UserError(f"{where}: no rows")
    convert = converters[detect_format(first, kind, where) if fmt == "auto" else fmt]
    used, skipped, read = convert_rows(itertools.chain([first], rows), convert, max_rows, where)
    console.print(f"{key}: {read:,} rows read, {len(used):,} used, {read - len(used):,} skipped"
                  + (f" ({reasons(skipped)})" if skipped else ""), highlight=False)
    return used


def _field(row: dict, name: str) -> object:
    if row.get(name) is None:
        raise Skip("missing field")
    return row[name]


def _is_text(value: object) -> bool:
    """A string a tokenizer can encode: JSON can spell a lone surrogate ("\\ud800"), which none can."""
    return isinstance(value, str) and not SURROGATE.search(value)


def _text(row: dict, name: str) -> str:
    value = _field(row, name)
    if not _is_text(value):
        raise Skip("bad messages")
    return value


def _joined(row: dict, name: str, extra: str) -> str:
    """Alpaca's `input` and Dolly's `context` are optional and follow the instruction after a blank line."""
    more = row.get(extra) or ""
    if not _is_text(more):
        raise Skip("bad messages")
    return _text(row, name) + ("\n\n" + more if more.strip() else "")


def _messages(value: object) -> list[dict]:
    if not isinstance(value, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and _is_text(m.get("content")) for m in value):
        raise Skip("bad messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _as_messages(value: object, role: str) -> list[dict]:
    """A bare string is one message from `role`; anything else must already be a message list."""
    if isinstance(value, str):
        return _messages([{"role": role, "content": value}])
    return _messages(value)


def _has_answer(messages: list[dict]) -> bool:
    return any(m["role"] == "assistant" and m["content"].strip() for m in messages)


def _conversation(messages: list[dict]) -> list[dict]:
    """SFT trains on the final message, so it must be a non-blank assistant answer."""
    if not _has_answer(messages[-1:]):
        raise Skip("empty answer")
    return messages


def _exchange(user: str, assistant: str) -> list[dict]:
    return _conversation([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])


SFT_CONVERTERS: dict[str, Callable[[dict], list[dict]]] = {
    "messages": lambda row: _conversation(_messages(_field(row, "messages"))),
    "alpaca": lambda row: _exchange(_joined(row, "instruction", "input"), _text(row, "output")),
    "dolly": lambda row: _exchange(_joined(row, "instruction", "context"), _text(row, "response")),
    "prompt_response": lambda row: _exchange(_text(row, "prompt"), _text(row, "response")),
}


def _pair(prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> Pair:
    if chosen == rejected:
        raise Skip("chosen == rejected")
    if not (_has_answer(chosen) and _has_answer(rejected)):
        raise Skip("empty answer")
    return Pair(prompt, chosen, rejected)


def _split_shared(chosen: list[dict], rejected: list[dict]) -> Pair:
    """Both answers repeat the conversation so far: their longest common run of whole messages is the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return _pair(chosen[:n], chosen[n:], rejected[n:])


def _transcript(value: object) -> list[dict]:
    """An HH transcript, "\\n\\nHuman: ...\\n\\nAssistant: ...", as messages."""
    if not _is_text(value):
        raise Skip("bad messages")
    head, *turns = HH_TURN.split(value)
    if head.strip() or not turns:
        raise Skip("bad messages")
    return [{"role": HH_ROLES[who], "content": said.strip()} for who, said in zip(turns[::2], turns[1::2])]


def _pairs(row: dict) -> Pair:
    chosen, rejected = _field(row, "chosen"), _field(row, "rejected")
    answers = [_as_messages(answer, "assistant") for answer in (chosen, rejected)]
    if row.get("prompt") is None:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise Skip("missing field")  # a bare answer string with nothing to answer
        return _split_shared(*answers)
    prompt = _as_messages(row["prompt"], "user")
    # Some sets repeat the prompt at the start of each answer list.
    return _pair(prompt, *(a[len(prompt):] if a[:len(prompt)] == prompt else a for a in answers))


PREFERENCE_CONVERTERS: dict[str, Callable[[dict], Pair]] = {
    "pairs": _pairs,
    "hh": lambda row: _split_shared(_transcript(_field(row, "chosen")), _transcript(_field(row, "rejected"))),
    "stack_exchange": lambda row: _pair(_as_messages(_text(row, "question"), "user"),
                                        _as_messages(_text(row, "response_j"), "assistant"),
                                        _as_messages(_text(row, "response_k"), "assistant")),
}


def _prompt_answer(prompt: object, answer: str) -> PromptAnswer:
    """The policy answers the last user turn: a prompt that ends otherwise (or says nothing) has no question."""
    messages = _as_messages(prompt, "user")
    if messages and messages[-1]["role"] != "user":
        raise Skip("prompt not ending with a user turn")
    if not messages or not messages[-1]["content"].strip():
        raise Skip("empty prompt")
    if not answer.strip():
        raise Skip("empty answer")
    return PromptAnswer(messages, answer)


PROMPT_CONVERTERS: dict[str, Callable[[dict], PromptAnswer]] = {
    "prompt_answer": lambda row: _prompt_answer(_field(row, "prompt"), _text(row, "answer")),
    "gsm8k": lambda row: _prompt_answer(_text(row, "question"), _text(row, "answer")),
}
