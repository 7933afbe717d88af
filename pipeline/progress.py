"""Progress for long jobs: live in a terminal, plain complete lines at a steady rate everywhere else.

One counter and one ETA, however the job is shown. In a terminal the first line is the bar (what, how far,
elapsed, eta) and the second its fields (loss, lr, tokens/s now...), wrapped rather than cut when the window is
narrow. Under `dvc repro`, a pipe or CI a live display would print nothing until the end, so one line goes out
every `interval` seconds whether or not a unit finished (a slow first step still shows it is alive), never
wrapped by the console's guess at a width; the first comes after 3 s. A job with no count
(`Progress(description)`: loading, scoring, saving) is a spinner with its elapsed time, and in a log the same
timed lines and one when it ends.
"""

from __future__ import annotations

import os
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, ProgressColumn, SpinnerColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.table import Column
from rich.text import Text

# soft_wrap: a line is never broken by rich at its guess of a width (80 columns under DVC or a pipe, where a
# field split across two lines cannot be read or grepped); a terminal wraps what does not fit. No markup, emoji
# codes or highlighting unless a call asks: the lines quote user text (paths, task names, a "[sft]" in a --set
# value, ":x:" in a document) that must print as it is.
console = Console(stderr=True, soft_wrap=True, markup=False, emoji=False, highlight=False)


FIRST_LINE_S = 3.0


def print_columns(title: str, rows: list[list[str]], indent: str = "") -> None:
    """A title line, then `rows` of cells in aligned columns: plain whole lines that a log keeps as they are
    (never cut to the terminal's width, wrapped, or read as rich markup: an interval's "[low, high]" stays)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    lines = [title] + [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    console.print("\n".join(lines), highlight=False, soft_wrap=True, markup=False)


def clock(seconds: float) -> str:
    """H:MM:SS, the one way elapsed and remaining time are written."""
    seconds = int(max(seconds, 0) + 0.5)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, description: str, unit: str | None = None, total: int | None = None, interval: float = 10.0,
                 start: int = 0):
        """`unit` None: a phase without a count. `start`: units done before this process (a resumed run); rates
        and the ETA count only new ones."""
        self.description, self.unit, self.total, self.interval = description, unit, total, interval
        self.done = self._start_done = start
        self.bytes = 0
        self.fields: dict[str, object] = {}
        self._bar: _TwoLines | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        if os.environ.get("RANK", "0") != "0":  # under torchrun one process speaks for all
            return self
        if console.is_terminal:
            columns = [SpinnerColumn()] if self.unit is None else []
            columns.append(TextColumn("[bold]{task.description}"))
            if self.total:  # the bar takes what the words leave, from 30 columns down to none
                room = console.width - len(self.description) - 42
                columns += [BarColumn(bar_width=min(room, 30))] if room >= 6 else []
            columns.append(_Where(self))
            self._bar = _TwoLines(self, *columns, console=console, transient=self.unit is None)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, completed=self.done)
        else:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def advance(self, n: int = 1, bytes: int = 0, **fields) -> None:
        self.done += n
        self.bytes += bytes
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def _tick(self) -> None:
        # The first line after FIRST_LINE_S: a job that ends (or fails on bad input, in one line) sooner says
        # nothing until its end.
        wait = min(FIRST_LINE_S, self.interval)
        while not self._stop.wait(wait):
            console.print(self.line(), highlight=False, soft_wrap=True)
            wait = self.interval

    def elapsed(self) -> float:
        return max(time.perf_counter() - self._start, 1e-9)

    def count(self) -> str:
        if self.unit is None:
            return ""
        return f"{self.done:,}{'/' + format(self.total, ',') if self.total else ''} {self.unit}"

    def where(self) -> str:
        """How far, how long, how long to go: `5/30 steps  0:01:19  eta 0:08:03`."""
        parts = [self.count()] if self.unit is not None else []
        parts.append(clock(self.elapsed()))
        new = self.done - self._start_done
        if self.total and new:
            parts.append(f"eta {clock(self.elapsed() * (self.total - self.done) / new)}")
        return "  ".join(parts)

    def details(self) -> str:
        """The rate and the fields: `12.3 steps/s | loss 4.12 | lr 0.0003`."""
        parts = []
        if self.unit is not None and self.done > self._start_done:
            parts.append(f"{(self.done - self._start_done) / self.elapsed():,.1f} {self.unit}/s")
        if self.bytes:
            parts.append(f"{self.bytes / self.elapsed() / 1e6:.2f} MB/s")
        parts += [f"{k} {_shown(v)}" for k, v in dict(self.fields).items()]
        return " | ".join(parts)

    def line(self) -> str:
        return " | ".join(p for p in (f"{self.description}: {self.where()}", self.details()) if p)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            self._bar.stop()
        if exc[0] is None and os.environ.get("RANK", "0") == "0":
            parts = [f"{self.description}: done in {clock(self.elapsed())}", self.count(), self.details()]
            console.print(" | ".join(p for p in parts if p), highlight=False, soft_wrap=True)


def _shown(value) -> str:
    if isinstance(value, bool):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value)


class _Where(ProgressColumn):
    """The count, elapsed time and ETA, computed when drawn: the clock moves during a long step too."""

    def __init__(self, owner: Progress):
        super().__init__(table_column=Column(no_wrap=True))
        self.owner = owner

    def render(self, task) -> Text:
        return Text(self.owner.where())


class _TwoLines(RichProgress):
    """rich's live progress with the job's fields on a line of their own under the bar, folded when too long:
    in one row a narrow window squeezed the bar to nothing and cut the times to `0:0…`."""

    def __init__(self, owner: Progress, *columns, **kwargs):
        self.owner = owner  # first: drawing may start inside rich's __init__
        super().__init__(*columns, **kwargs)

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if details := self.owner.details():
            yield Text("  " + details, overflow="fold")
