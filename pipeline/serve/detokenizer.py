"""A choice's text as its tokens arrive: decoded as they come, a character split across tokens held back, and
`stop` strings ending the text where they begin (the string itself left out, as OpenAI does)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kiln.pipeline.serve.request import Request


@dataclass
class Job:
    """One HTTP request's generation: its engine request, the text so far and where it ends."""

    request: Request
    stops: list[str]
    decode: object  # ids -> text
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)  # generated so far, as this side received them
    text: str = ""  # released so far
    finish_reason: str | None = None
    echo: bool = False  # the prompt's text (and log-probabilities) come first in the choice
    hidden: bool = False  # `max_tokens: 0` with echo: the one token the engine generates is not the answer's
    reported: int = 0  # generated tokens whose log-probabilities a stream has sent
    fork: bool = False  # a further choice of a prompt another job already computes

    def advance(self, last: bool = False) -> str:
        """The new text to release for the tokens so far; sets finish_reason "stop" when a stop string appears.
        Until the `last` call, text that may still change is held back: a character whose bytes are not all
        there yet, and an ending that may be the start of a stop string."""
        text = self.decode(self.ids)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                self.finish_reason = "stop"
                text = text[:at]
        if self.finish_reason is None and not last:
            if text.endswith("\ufffd"):
                return ""
            hold = max((len(s) - 1 for s in self.stops), default=0)
            held = next((n for n in range(hold, 0, -1) if any(s.startswith(text[-n:]) for s in self.stops)), 0)
            text = text[:len(text) - held]
        new = text[len(self.text):]
        self.text += new
        return new
