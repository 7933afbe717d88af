"""A choice's text as its tokens arrive: decoded incrementally, a character split across tokens held back, and
`stop` strings ending the text where they begin (the string itself left out, as OpenAI does).

Each token costs the same however long the output is: a `tokenizers` DecodeStream per choice turns each new
token into the text it completes (none while a character's bytes are still coming: vLLM's detokenizer does the
same), and stop strings are searched only in the text not released yet (`pending`), short by construction:
what has been released never ends with the start of a stop string (that part is held back), so no stop can
begin before it. At the end, the whole output is decoded once, so bytes that never formed a character come
out as the full decode has them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kiln.pipeline.serve.request import Request


@dataclass
class Job:
    """One choice's generation: its engine request, the text so far and where it ends. `ends`: tokens after
    which nothing is text (a chat's <|im_end|>); `keep_special`: special tokens decode to their text (a chat's
    answer, as ChatFormat.parse_reply reads it) rather than to nothing (a completion)."""

    request: Request
    stops: list[str]
    tokenizer: Tokenizer
    ends: frozenset[int] = frozenset()
    keep_special: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)  # generated so far, as this side received them
    released: list[str] = field(default_factory=list)  # the text released so far, in pieces (no copy per token)
    finish_reason: str | None = None
    echo: bool = False  # the prompt's text (and log-probabilities) come first in the choice
    hidden: bool = False  # `max_tokens: 0` with echo: the one token the engine generates is not the answer's
    reported: int = 0  # generated tokens whose log-probabilities the answer has listed so far
    fork: bool = False  # a further choice of a prompt another job already computes
    started: float = field(default_factory=time.perf_counter)  # for its latencies (/metrics)
    last_token: float | None = None
    pending: str = ""  # decoded, not released yet: held back, or not looked at yet
    ended: bool = False  # an `ends` token came: no more text
    stream: DecodeStream | None = None

    def __post_init__(self):
        self.stream = DecodeStream(skip_special_tokens=not self.keep_special)

    def feed(self, token: int) -> None:
        """A new token: its text, once complete, joins `decoded`."""
        self.ids.append(token)
        if self.ended or token in self.ends:
            self.ended = True
            return
        if (piece := self.stream.step(self.tokenizer, token)) is not None:
            self.pending += piece

    @property
    def text(self) -> str:
        return "".join(self.released)

    def advance(self, last: bool = False) -> str:
        """The new text to release for the tokens so far; sets finish_reason "stop" when a stop string appears.
        Until the `last` call, an ending that may be the start of a stop string is held back."""
        if last:  # bytes that never formed a character: as the whole output decodes them
            end = next((i for i, t in enumerate(self.ids) if t in self.ends), len(self.ids))
            whole, so_far = self.tokenizer.decode(self.ids[:end], skip_special_tokens=not self.keep_special), self.text
            if whole.startswith(so_far + self.pending):
                self.pending = whole[len(so_far):]
        text = self.pending
        cut = min((at for stop in self.stops if (at := text.find(stop)) >= 0), default=-1)
        if cut >= 0:
            self.finish_reason = "stop"
            text = text[:cut]
        elif not last:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            held = next((n for n in range(min(hold, len(text)), 0, -1)
                         if any(s.startswith(text[-n:]) for s in self.stops)), 0)
            text = text[:len(text) - held]
        self.pending = self.pending[len(text):]
        if text:
            self.released.append(text)
        return text
