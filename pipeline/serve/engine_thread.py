"""The engine, stepped on a thread of its own.

One thread owns the engine and the model: it takes new requests and aborts from a queue, steps while anything
runs, and hands each request's new tokens to its listener (the HTTP side puts them on the asyncio loop with
`loop.call_soon_threadsafe`). So every client's tokens come from the same batched steps, and the event loop
stays free to accept connections while the model computes (torch releases the GIL inside its kernels).
"""

from __future__ import annotations

import queue
import threading

from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.request import Request, RequestStatus


class EngineThread:
    """The engine, stepped on a thread of its own; `submit` and `abort` may be called from any thread."""

    def __init__(self, engine: Engine, deliver=None):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self.failure: BaseException | None = None
        # how a step's notifications reach their listeners: `deliver([(on_token, request, token), ...])` is called
        # once a step on the engine thread (the server hands the whole list to its event loop in one call, not a
        # wakeup per token); by default each listener is called right here
        self.deliver = deliver or call_each

    def start(self) -> None:
        self.thread.start()

    def submit(self, request: Request, on_token, forks: list[tuple[Request, object]] = ()) -> None:
        """Queue `request`, and `forks` (more samples of its prompt, each with its own listener) as its forks;
        `on_token(request, token)` is called (by `deliver`) for each new token, and once more with token None
        when it has finished (or was refused: `request.status` says which)."""
        request.forks = [fork for fork, _ in forks]
        self.inbox.put(("add", request, [(request, on_token), *forks]))

    def abort(self, request: Request) -> None:
        self.inbox.put(("abort", request, None))

    def _run(self) -> None:
        listeners: dict[int, object] = {}
        while True:
            commands = [self.inbox.get()] if not self.engine.has_work() else []
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            out = []  # (listener, request, token) of this round, delivered together
            for kind, request, group in commands:
                if kind == "add":
                    try:
                        self.engine.add(request)
                    except ValueError as e:
                        for member, on_token in group:
                            member.status, member.error = RequestStatus.FINISHED_REFUSED, str(e)
                            out.append((on_token, member, None))
                        continue
                    listeners.update((id(member), on_token) for member, on_token in group)
                elif id(request) in listeners:
                    self.engine.abort(request)
                    out.append((listeners.pop(id(request)), request, None))
            if not self.engine.has_work():
                self.deliver(out)
                continue
            try:
                events = self.engine.step()
            except BaseException as e:  # a bug: every waiting client hears of it rather than hanging
                self.failure = e
                self.deliver(out + [(on_token, None, None) for on_token in listeners.values()])
                listeners.clear()
                raise
            for request, token in events:
                on_token = listeners.get(id(request))
                if on_token is None:
                    continue
                out.append((on_token, request, token))
                if request.finish_reason:
                    out.append((listeners.pop(id(request)), request, None))
            self.deliver(out)


def call_each(notifications: list) -> None:
    for on_token, request, token in notifications:
        on_token(request, token)
