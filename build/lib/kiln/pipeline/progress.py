"""Progress for long jobs: a live rich bar in a terminal, a plain line every few seconds in logs.

Under `dvc repro` or CI stderr is not a terminal and a live bar would print nothing until the end, so the
same numbers (count, rate, MB/s, ETA, and any extra fields such as loss) go out as periodic log lines.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

console = Console(stderr=True)


class Progress:
    def __init__(self, description: str, unit: str, total: int | None = None, interval: float = 10.0,
                 start: int = 0):
        """`start`: units already done before this process (a resumed run); rates and ETA count only new ones."""
        self.description, self.unit, self.total, self.interval = description, unit, total, interval
        self.done = self._start_done = start
        self.bytes = 0
        self.fields: dict[str, object] = {}
        self._bar: RichProgress | None = None

    def __enter__(self) -> Progress:
        self._start = self._last_log = time.perf_counter()
        if console.is_terminal:
            columns = [TextColumn("[bold]{task.description}")]
            if self.total:
                columns += [BarColumn(), TextColumn("{task.completed}/{task.total}")]
            columns += [TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
            if self.total:
                columns += [TextColumn("eta"), TimeRemainingColumn()]
            self._bar = RichProgress(*columns, console=console)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, status="", completed=self.done)
        return self

    def advance(self, n: int = 1, bytes: int = 0, **fields) -> None:
        self.done += n
        self.bytes += bytes
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, status=self.status())
        elif time.perf_counter() - self._last_log >= self.interval:
            self._last_log = time.perf_counter()
            console.print(f"{self.description}: {self.status()}", highlight=False)

    def status(self) -> str:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        new = self.done - self._start_done
        parts = [f"{self.done:,}{'/' + format(self.total, ',') if self.total else ''} {self.unit}",
                 f"{new / elapsed:,.1f} {self.unit}/s"]
        if self.bytes:
            parts.append(f"{self.bytes / elapsed / 1e6:.2f} MB/s")
        parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.fields.items()]
        if self.total and new:
            parts.append(f"eta {elapsed * (self.total - self.done) / new:.0f}s")
        return " | ".join(parts)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        if exc[0] is None:
            console.print(f"{self.description}: done, {self.status()} in {time.perf_counter() - self._start:.1f}s",
                          highlight=False)
