"""A reward function of the user's own, loaded and called in a process of its own.

`grpo.reward` (or an eval task's `reward`) may name `module:function` or `file.py:function`: code kiln did not
write, run thousands of times a stage. In the stage's own process such code could end it (`sys.exit`,
`os._exit`, a crash in a C extension), leave forks behind, ignore the SIGALRM that was its time limit, or hang
inside C code that never returns to Python. So the module is imported, checked and called in a worker process
(`python -m kiln.pipeline.tasks.user_reward`, a session of its own): one request and one reply a row, as JSON
lines over its stdin and stdout (the user's prints go to stderr). The stage waits `timeout` seconds for each
reply; past that the worker's whole process group is killed (SIGKILL, which no handler can ignore) and the row
is named in a one-line error. A worker that dies is named with its exit code or signal.

`judge` is the one way a reward is called, here and for kiln's built-in rewards in the stage's process: it turns
whatever the call did into an outcome (a value, a non-number, an exception) that `rewards.score` checks and
reports.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import numbers
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

from kiln.pipeline.errors import UserError, shown
from kiln.pipeline.stage_inputs import check_declared, check_declared_module

Reward = Callable[[str, str, str], object]
IMPORT_SECONDS = 120.0  # for the worker to start and import the user's module (a heavy import takes seconds)


def judge(fn: Reward, row: tuple[str, str, str]) -> dict:
    """Call `fn` on one (prompt, completion, answer) row: {"value": float} for a real number (a bool is 1.0 or
    0.0; nan, inf and an overflow as themselves, for the caller to refuse), {"returned": shown, "type": name}
    for anything else, {"raised": name, "message": text} for an exception (`sys.exit` included), {"user_error":
    text} for a kiln UserError."""
    try:
        value = fn(*row)
    except UserError as e:
        return {"user_error": one_line(e)}
    except (Exception, SystemExit) as e:
        return {"raised": type(e).__name__, "message": one_line(e)}
    if not isinstance(value, (numbers.Real, Decimal)):
        return {"returned": shown(value), "type": type(value).__name__}
    try:
        return {"value": float(value)}
    except OverflowError:  # a Decimal or an int beyond float's range
        return {"value": float("inf")}


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "(no message)"


def load_function(spec: str, key: str = "grpo") -> Reward:
    """`module:function` or `file.py:function`: a module on sys.path is imported by name; a target ending in
    .py or holding a path separator is loaded from that file (relative to the working directory)."""
    where = f"params: {key}.reward={spec!r}"
    target, name = check_spec(spec, key)
    try:
        if target.endswith(".py") or "/" in target or "\\" in target:
            module = _load_file(Path(target), where, key)
        else:
            module = importlib.import_module(target)
            check_declared_module(module, f"{key}.reward")
    except UserError:
        raise
    except (Exception, SystemExit) as e:  # a module body may raise anything, sys.exit() included
        raise UserError(f"{where}: cannot import {target!r}: {type(e).__name__}: {one_line(e)}") from None
    if not hasattr(module, name):
        raise UserError(f"{where}: module {target!r} has no attribute {name!r}; expected a function "
                        "(prompt, completion, answer) -> number")
    fn = getattr(module, name)
    if not callable(fn):
        raise UserError(f"{where}: {target}:{name} is a {type(fn).__name__}, not callable; expected a function "
                        "(prompt, completion, answer) -> number")
    try:
        inspect.signature(fn).bind("", "", "")
    except TypeError:
        raise UserError(f"{where}: {target}:{name}{inspect.signature(fn)} cannot be called with three arguments; "
                        "expected a function (prompt, completion, answer) -> number") from None
    except ValueError:
        pass  # some builtins have no signature to check; a wrong one fails at the first row, naming it
    return fn


def check_spec(spec: str, key: str) -> tuple[str, str]:
    """(target, function name) of `module:function`; a file target must exist (checked in the stage's process,
    before a worker starts)."""
    where = f"params: {key}.reward={spec!r}"
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise UserError(f"{where}: expected module:function (a module on sys.path or a .py file, then a name)")
    if (target.endswith(".py") or "/" in target or "\\" in target) and not Path(target).is_file():
        raise UserError(f"{where}: no such file {target!r}")
    return target, name


def _load_file(path: Path, where: str, key: str) -> object:
    check_declared(path, f"{key}.reward")
    # A name of its own per file, registered in sys.modules because dataclasses and pickling look modules up there.
    name = "kiln_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class RewardProcess:
    """The worker process running `spec`, started (and the function loaded and checked) on construction:
    UserError if it cannot be. `judge(row)` is `judge` run there, within `timeout` seconds (None: no limit)."""

    def __init__(self, spec: str, key: str, timeout: float | None, label: str):
        check_spec(spec, key)
        self.label, self.timeout = label, timeout
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.buffer = b""
        reply = self._ask({"sys_path": sys.path, "spec": spec, "key": key}, IMPORT_SECONDS)
        if reply is None:
            raise UserError(f"params: {label}: importing it took more than {IMPORT_SECONDS:g} s; stopped")
        if "died" in reply:
            raise UserError(f"params: {label}: its process {reply['died']} while importing it")
        if "user_error" in reply:
            self.close()
            raise UserError(reply["user_error"])

    def judge(self, row: tuple[str, str, str]) -> dict:
        """The outcome of one row, or {"timeout": seconds} when the reply did not come in time (the worker is
        killed), or {"died": how} when the worker ended."""
        reply = self._ask({"row": list(row)}, self.timeout)
        return {"timeout": self.timeout} if reply is None else reply

    def _ask(self, request: dict, seconds: float | None) -> dict | None:
        if self.proc.poll() is not None:
            return {"died": self._death()}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"died": self._death()}
        deadline = None if seconds is None else time.monotonic() + seconds
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return {"died": self._death()}
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def _death(self) -> str:
        code = self.proc.wait()
        self.close()
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def close(self) -> None:
        """Kill the worker and everything it started (its process group), at once."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def __del__(self):
        if getattr(self, "proc", None) is not None and self.proc.returncode is None:
            self.close()


def main() -> None:
    """The worker: the first request names the function (and the stage's sys.path), each next one a row."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the user's prints go to stderr, never into the replies
    sys.stdout = sys.stderr

    def reply(message: dict) -> None:
        channel.write(json.dumps(message).encode() + b"\n")
        channel.flush()

    first = json.loads(sys.stdin.buffer.readline())
    sys.path[:] = first["sys_path"]
    try:
        fn = load_function(first["spec"], first["key"])
    except UserError as e:
        reply({"user_error": str(e)})
        return
    reply({"ready": True})
    for line in sys.stdin.buffer:
        reply(judge(fn, tuple(json.loads(line)["row"])))


if __name__ == "__main__":
    main()
