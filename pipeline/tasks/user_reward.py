"""A reward function of the user's own, loaded and called in a process of its own.

`grpo.reward` (or an eval task's `reward`) may name `module:function` or `file.py:function`: code kiln did not
write, run thousands of times a stage. In the stage's own process such code could end it (`sys.exit`,
`os._exit`, a crash in a C extension), leave processes behind, ignore the SIGALRM that was its time limit, hang
inside C code that never returns to Python, or take the machine's memory. So it runs in a worker, under a
supervisor (`python -m kiln.pipeline.tasks.user_reward`, in a session of its own):

- The supervisor makes itself a child subreaper (PR_SET_CHILD_SUBREAPER) and forks the worker, so every process
  the reward starts stays below it, even one that called setsid() or double-forked away from its parent. It
  kills the whole tree (SIGKILL to each descendant found by walking /proc's parent links, in rounds until none
  is left) when the stage closes its control pipe (`close`, a timeout, or the stage's process ending, which
  closes the pipe too), when the worker dies, or when the tree holds more than `Limits.processes` processes.
  Why this: a process group is left by setsid(); a cgroup would hold the tree too, but creating one needs root
  or a delegated subtree; a subreaper needs no privilege (Linux 3.4+), and /proc's task/*/children lists need a
  kernel option that is not always built in.
- The worker bounds itself before the user's module is imported: address space (RLIMIT_AS, `Limits.memory`,
  soft and hard, inherited by its children; a MemoryError is reported naming the limit), no core files, and no
  privilege gained through exec (PR_SET_NO_NEW_PRIVS: every process of the tree stays killable). RLIMIT_NPROC is
  not used: it counts every process of the user id (a shell, other stages) and root ignores it; the supervisor
  counts the tree instead (walking /proc when the machine's task total, read ten times a second, grew by more
  than the limit, and once a second), so a fork bomb is stopped within about a second. RLIMIT_CPU is not used
  either: it bounds a process's CPU time over its whole life, which a healthy worker serving a long stage passes;
  each row's wall-clock `timeout` bounds what a reward may spend.
- The project is read-only to the worker where the kernel has Landlock (Linux 5.13+, no privilege needed): the
  folder the stage runs in (the project, as pipeline/protected.py defines it) and the folders above it cannot
  be written, anything else can. Landlock also keeps the worker from ptrace or /proc/<pid>/mem on processes
  outside its sandbox, and from Linux 6.12 from signalling them (the supervisor and the stage). Without Landlock,
  nothing stops a write by absolute path; either way the stage warns when the worker ends, in one line naming
  the project's files (git-tracked or named in dvc.yaml, the running DVC stage's own outputs aside) that changed
  while it lived. The worker runs in a private temp folder, its cwd and TMPDIR (a relative path written lands
  there and is removed with it; a `file.py:function` is resolved against the stage's folder first), with an
  environment of a few variables (PATH, HOME, locale, PYTHONPATH...): nothing of the stage's DVC, torchrun or
  other settings.
- One request and one reply a row, as JSON lines over a pipe pair at private, close-on-exec descriptors. The
  worker's stdin is /dev/null (a reward, or a program it runs, reading stdin gets nothing, never a request) and
  its stdout is its stderr (a print never reaches the replies). Each request is numbered, and each reply carries
  the number and a MAC (keyed BLAKE2b) over it and the outcome, with a key the stage makes per worker and sends
  before the user's code runs. A line the worker did not sign (a reward that found the reply descriptor in
  /proc/self/fd, or a forked child writing to it), another request's number, a second line, an outcome of
  another form: each is the row's failure, naming it, and the worker is stopped; nothing but the worker's own
  reply to that request is taken as a value. What that buys, honestly: the key is in the worker's memory, which
  code in its process can read, so a reward written to forge on purpose can sign a reply; the number check still
  refuses the reply of the worker's that trails the forgery (at the next row: only the last row's forgery goes
  unseen). A reward that wants to lie about a row can just return the lie: the guarantee is that no value is
  ever paired with the wrong row by accident. Reading the request descriptor gets a reward nothing either: a row's
  request is sent only after the last reply, so a reward that reads it waits, and its row times out.

The stage waits `timeout` seconds for each reply; past that the tree is killed and the row named in a one-line
error. A worker that dies is named with its exit code or signal.

`judge` is the one way a reward is called, in the worker and for kiln's built-in rewards in the stage's process:
it turns whatever the call did into an outcome (a value, a non-number, an exception) that `rewards.score` checks
and reports.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import importlib
import importlib.util
import inspect
import json
import numbers
import os
import resource
import secrets
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from kiln.pipeline.errors import UserError, shown
from kiln.pipeline.stage_inputs import check_declared, check_declared_module

Reward = Callable[[str, str, str], object]
IMPORT_SECONDS = 120.0  # for the worker to start and import the user's module (a heavy import takes seconds)
SUPERVISOR_SECONDS = 60.0  # for the supervisor to kill the tree and end, once asked (a fork bomb takes rounds)
ENDING_SECONDS = 10.0  # for the supervisor to end once the replies closed (the worker's tree is then all but gone)
POLL_SECONDS = 0.1  # how often the supervisor looks at the machine's task count
SCAN_SECONDS = 1.0  # and at most how long between two counts of the tree itself
MAX_REPLY = 1 << 20  # bytes: a reply is a few hundred; more is something else writing into the channel
ENV_KEPT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONHASHSEED",
            "PYTHONUTF8", "PYTHONIOENCODING", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME")

# The outcomes a worker may reply with, as (keys): types; anything else is not a reply of the worker's.
OUTCOMES = {("value",): (float,), ("returned", "type"): (str, str), ("raised", "message"): (str, str),
            ("user_error",): (str,), ("limit",): (str,)}
STARTED = {("ready",): ((str, type(None)),), ("user_error",): (str,), ("limit",): (str,)}


@dataclass(frozen=True)
class Limits:
    """What a reward's processes may take: far above what a reward that scores text needs."""

    memory: int = 16 << 30  # bytes of address space per process (RLIMIT_AS): a larger allocation is a MemoryError
    processes: int = 1024  # processes at once, the worker and all it started: past it the tree is killed

    def memory_text(self) -> str:
        return f"ran out of its {self.memory / (1 << 30):g} GiB address-space limit (MemoryError)"


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


def check_spec(spec: str, key: str) -> tuple[str, str]:
    """(target, function name) of `module:function`; a file target must exist (checked in the stage's process,
    before a worker starts)."""
    where = f"params: {key}.reward={spec!r}"
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise UserError(f"{where}: expected module:function (a module on sys.path or a .py file, then a name)")
    if is_file(target) and not Path(target).is_file():
        raise UserError(f"{where}: no such file {target!r}")
    return target, name


def is_file(target: str) -> bool:
    """Whether a spec's target is a file (loaded from its path) rather than a module (imported by name)."""
    return target.endswith(".py") or "/" in target or "\\" in target


def load_function(spec: str, key: str, path: str | None) -> tuple[Reward, str | None]:
    """The function `spec` names and, for a module imported by name, its file (for the stage to check against
    the DVC stage's deps). `path` is the spec's file, made absolute by the stage (the worker runs elsewhere), or
    None for a module on sys.path. A MemoryError is raised as it is, for the caller to name the limit."""
    where = f"params: {key}.reward={spec!r}"
    target, name = check_spec(spec, key) if path is None else (spec.rpartition(":")[0], spec.rpartition(":")[2])
    try:
        module = _load_file(Path(path)) if path is not None else importlib.import_module(target)
    except MemoryError:
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
    return fn, None if path is not None else getattr(module, "__file__", None)


def _load_file(path: Path) -> object:
    # A name of its own per file, registered in sys.modules because dataclasses and pickling look modules up there.
    name = "kiln_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
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
    """The worker running `spec` under its supervisor, started (and the function loaded and checked) on
    construction: UserError if it cannot be. `judge(row)` is `judge` run there, within `timeout` seconds (None:
    no limit). `close()` (or the object's collection, or the interpreter's exit) ends the worker's whole tree and
    warns when the project's files changed meanwhile."""

    def __init__(self, spec: str, key: str, timeout: float | None, label: str, limits: Limits = Limits()):
        target, _ = check_spec(spec, key)
        path = None
        if is_file(target):
            check_declared(Path(target), f"{key}.reward")  # before any of its code runs, from the stage's folder
            path = os.path.abspath(target)
        self.timeout = timeout
        self.key, self.n, self.buffer = secrets.token_bytes(32), 0, b""
        root = Path.cwd().resolve()  # the project: the folder the stage runs in (pipeline/protected.py)
        watch = watched(root)
        before = snapshot(root, watch)
        private = tempfile.mkdtemp(prefix="kiln-reward-")
        requests, self.requests = os.pipe()
        self.replies, replies = os.pipe()
        env = {k: v for k, v in os.environ.items() if k in ENV_KEPT or k.startswith("LC_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(requests), str(replies), str(limits.processes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(requests, replies), cwd=private,
            env=env | {"TMPDIR": private}, start_new_session=True)
        os.close(requests)
        os.close(replies)
        self._close = weakref.finalize(self, _shut, self.proc, (self.requests, self.replies), private, root,
                                       watch, before, label)
        started = self._ask({"key": self.key.hex(), "spec": spec, "reward_key": key, "path": path,
                             "sys_path": [os.path.abspath(p) for p in sys.path], "root": str(root),
                             "private": private, "memory": limits.memory}, IMPORT_SECONDS, STARTED)
        if started is None:
            raise UserError(f"params: {label}: importing it took more than {IMPORT_SECONDS:g} s; stopped")
        if "ready" not in started:
            self.close()
            if "user_error" in started:
                raise UserError(started["user_error"])
            raise UserError(f"params: {label}: " + (f"its process {started['died']} while importing it"
                                                     if "died" in started else
                                                     f"importing it, its process {started['limit']}"
                                                     if "limit" in started else started["broken"]))
        if started["ready"] is not None:
            try:  # a module imported by name is checked against the DVC stage's deps by its file, like a file
                check_declared_module(types.SimpleNamespace(__file__=started["ready"]), f"{key}.reward")
            except UserError:
                self.close()
                raise

    def judge(self, row: tuple[str, str, str]) -> dict:
        """The outcome of one row, or {"timeout": seconds} when the reply did not come in time, {"died": how}
        when the worker ended, {"limit": which} when it passed one, {"broken": why} when the reply was not the
        worker's own (in each of these the worker's tree is killed)."""
        reply = self._ask(list(row), self.timeout, OUTCOMES)
        return {"timeout": self.timeout} if reply is None else reply

    def _ask(self, request, seconds: float | None, shapes: dict) -> dict | None:
        if not self._close.alive:  # its descriptors are closed, and their numbers may be another file's by now
            return {"died": "had been stopped before this row"}
        data = memoryview(json.dumps([self.n, request]).encode() + b"\n")
        try:
            while data:  # a signal can cut a write to a pipe short
                data = data[os.write(self.requests, data):]
        except OSError:  # the worker's read end is gone: it died
            return self._death()
        deadline = None if seconds is None else time.monotonic() + seconds
        while b"\n" not in self.buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or not select.select([self.replies], [], [], left)[0]:
                self.close()
                return None
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                return self._death()
            self.buffer += chunk
            if len(self.buffer) > MAX_REPLY:
                return self._broken(f"held over {MAX_REPLY:,} bytes with no line end")
        line, _, self.buffer = self.buffer.partition(b"\n")
        mac, _, body = line.partition(b" ")
        if not hmac.compare_digest(mac, sign(self.key, body)):
            return self._broken(f"held a line its worker did not sign: {shown(line.decode(errors='replace'))}")
        try:
            n, outcome = json.loads(body)
        except (ValueError, TypeError):  # signed, so only with the key from the worker's memory: a wrong form
            n, outcome = self.n, None
        if n != self.n:
            return self._broken(f"held the reply to request {n}, not to {self.n}")
        if self.buffer or not well_formed(outcome, shapes):
            return self._broken("held more than one line, or one of the wrong form: "
                                f"{shown(line.decode(errors='replace'))}")
        self.n += 1
        return outcome

    def _broken(self, what: str) -> dict:
        self.close()
        return {"broken": f"its worker's reply channel {what}, so no reply of it can be trusted (something in the "
                          "reward wrote into kiln's channel, or closed it); the worker was stopped"}

    def _death(self) -> dict:
        """What ended the worker, as its supervisor (which kills the tree, then says, then ends) tells it."""
        said = _said(self.proc, ENDING_SECONDS)
        if said is None:
            return self._broken("was closed while its worker lived")
        self.close()
        if "processes" in said:
            return {"limit": f"ran more than {said['processes']:,} processes at once (its limit); all were killed"}
        if "signal" in said:
            try:
                return {"died": f"was killed by {signal.Signals(said['signal']).name}"}
            except ValueError:
                return {"died": f"was killed by signal {said['signal']}"}
        if "exit" in said:
            return {"died": f"exited with code {said['exit']}"}
        return {"died": "ended, and so did its supervisor"}

    def close(self) -> None:
        """Kill the worker and everything it started, at once (again: nothing)."""
        self._close()


def sign(key: bytes, body: bytes) -> bytes:
    # keyed BLAKE2b is a MAC by design (no HMAC construction needed), and 3-4 times cheaper than HMAC-SHA256 on
    # lines this short: a few microseconds a row on each side
    return hashlib.blake2b(body, key=key, digest_size=16).hexdigest().encode()


def well_formed(outcome: object, shapes: dict) -> bool:
    kinds = isinstance(outcome, dict) and shapes.get(tuple(outcome))
    return bool(kinds) and all(map(isinstance, outcome.values(), kinds))


def _shut(proc: subprocess.Popen, fds: tuple[int, ...], private: str, root: Path, watch: tuple, before: dict,
          label: str) -> None:
    proc.stdin.close()  # the supervisor's signal to kill the tree and end
    # Stopped (SIGSTOP) or stuck, or killed before it could kill the tree: what is left in its session is killed.
    _said(proc, SUPERVISOR_SECONDS)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()
    for fd in fds:
        os.close(fd)
    shutil.rmtree(private, ignore_errors=True)
    after = snapshot(root, watch)
    changed = sorted(str(p.relative_to(root)) for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        from kiln.pipeline.progress import console  # the stage's console; the worker never needs it

        more = f" and {len(changed) - 5:,} more" if len(changed) > 5 else ""
        console.print(f"warning: {label}: the project's files changed while the reward's process ran: "
                      f"{', '.join(changed[:5])}{more} (a reward must not write into the project; `git status` and "
                      "`dvc status` show what changed)")


def _said(proc: subprocess.Popen, seconds: float) -> dict | None:
    """What the supervisor said before it ended ({} if nothing), or None when it did not end within `seconds`.
    Its stdout closes when it ends (nothing else holds it), which select sees at once; Popen.wait(timeout)
    polls with sleeps, adding up to 50 ms to each worker's end."""
    deadline, said, fd = time.monotonic() + seconds, b"", proc.stdout.fileno()
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 1 << 12)
        if not chunk:
            proc.wait()
            try:
                return json.loads(said or b"{}")
            except ValueError:
                return {}
        said += chunk
    return None


def watched(root: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """The project's files that no reward may change, as (files, folders whose every file counts, the outputs of
    the DVC stage running, left out since it writes them while its reward runs): each file git tracks under
    `root`, params.yaml and dvc.yaml, and what dvc.yaml names. Found once a worker, as reading dvc.yaml takes a
    while (a tenth of a second)."""
    from kiln.pipeline import protected  # the stage's, not the worker's: it would slow every worker's start

    try:
        named = [root / p for p in protected.dag_paths(root / protected.DVC_YAML)]
    except UserError:  # an unreadable dvc.yaml has already been refused by whatever needed it
        named = []
    tracked, _ = protected.tracked_files(root)  # none when git cannot list them: then the rest is watched
    files = [*tracked, root / "params.yaml", root / protected.DVC_YAML, *(p for p in named if not p.is_dir())]
    return files, [p for p in named if p.is_dir()], _stage_outs(root)


def snapshot(root: Path, watch: tuple[list[Path], list[Path], list[Path]]) -> dict[Path, tuple[int, int]]:
    """(mtime, size) of each file `watched` names that exists."""
    files, folders, outs = watch
    paths = {*files, *(Path(top, f) for folder in folders for top, _, names in os.walk(folder) for f in names)}
    found = {}
    for path in paths:
        if root in path.parents and not any(out == path or out in path.parents for out in outs):
            try:
                info = path.stat()
            except OSError:
                continue
            found[path] = (info.st_mtime_ns, info.st_size)
    return found


def _stage_outs(root: Path) -> list[Path]:
    import yaml

    # as pipeline/stage_inputs.py finds the running stage's deps
    dvc_file, _, name = os.environ.get("DVC_STAGE", "").rpartition(":")
    if not name:
        return []
    dvc_file = Path(os.environ.get("DVC_ROOT", root)) / (dvc_file or "dvc.yaml")
    try:
        spec = yaml.load(dvc_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        outs = spec["stages"][name].get("outs") or []
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return []
    return [(dvc_file.parent / (next(iter(out)) if isinstance(out, dict) else str(out))).resolve() for out in outs]


# The supervisor and the worker: what runs in `python -m kiln.pipeline.tasks.user_reward`.

PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 38, 36
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every arch
LANDLOCK_RULE_PATH_BENEATH, LANDLOCK_CREATE_RULESET_VERSION = 1, 1
# Landlock's write rights: write, truncate (ABI 3), remove, make (a file, folder, link, device...), and link or
# rename across folders (ABI 2, which a ruleset denies everywhere once the ABI has it, unless granted).
WRITE_FILE, TRUNCATE, REFER = 1 << 1, 1 << 14, 1 << 13
REMOVE_AND_MAKE = sum(1 << bit for bit in range(4, 13))
SCOPE_SIGNAL = 1 << 1  # ABI 6: no signals to processes outside the sandbox


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or it is disabled)."""
    return max(0, _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION))


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _supervise(requests: int, replies: int, processes: int) -> None:
    _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler of its own, so a child's end wakes the select
    worker = os.fork()
    if worker == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            _work(requests, replies)
            code = 0
        except OSError:  # its pipes closed under it (the stage ended, or the reward closed them): nothing to say
            pass
        except BaseException:
            traceback.print_exc()  # a bug of kiln's: where it is
        finally:
            os._exit(code)
    os.close(requests)  # the worker's alone: the stage sees the pipes close when the worker's tree is gone
    os.close(replies)
    said = _watch(worker, processes, wake_r)
    _kill_tree()
    try:
        os.write(1, json.dumps(said).encode())
    except BrokenPipeError:  # the stage ended first
        pass
    os._exit(0)  # nothing left to tidy: an interpreter's teardown would take longer than all the above


def _watch(worker: int, processes: int, wake: int) -> dict:
    """Until the stage closes the control pipe ({}), the worker ends ({"exit": code} or {"signal": number}) or the
    tree passes `processes` ({"processes": limit})."""
    others, scanned = _tasks() - 1, time.monotonic()  # what the machine runs besides the tree
    while True:
        ready = select.select([0, wake], [], [], POLL_SECONDS)[0]
        if 0 in ready:
            return {}
        if wake in ready:
            while os.read(wake, 64) == 64:
                pass
        while (ended := os.waitpid(-1, os.WNOHANG))[0]:  # the worker's, or an orphan's, adopted
            if ended[0] == worker:
                code = os.waitstatus_to_exitcode(ended[1])
                return {"exit": code} if code >= 0 else {"signal": -code}
        # Reading the machine's total is cheap; walking /proc is not (milliseconds on a busy machine), so it is
        # walked when the total grew by more than the limit, and every SCAN_SECONDS in case other processes
        # ended while the tree grew, hiding its growth from the total.
        if _tasks() - others > processes or time.monotonic() - scanned > SCAN_SECONDS:
            mine = len(_descendants(os.getpid()))
            if mine > processes:
                return {"processes": processes}
            others, scanned = _tasks() - mine, time.monotonic()


def _tasks() -> int:
    """How many threads the machine runs (the fourth field of /proc/loadavg, "running/total")."""
    with open("/proc/loadavg", "rb") as f:
        return int(f.read().split()[3].split(b"/")[1])


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    info = f.read()
            except OSError:  # ended meanwhile
                continue
            parent = int(info[info.rindex(b")") + 2:].split(None, 2)[1])  # "pid (name) state ppid ..."
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree() -> None:
    """SIGKILL every descendant, in rounds, until none is left: one forked between a round's walk and its kills
    has a parent that was killed, and is adopted by this subreaper and found by the next round."""
    while True:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # ended, or not a process of the tree's any more
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _work(requests: int, replies: int) -> None:
    """The worker: the first request sets it up and names the function, each next one is a row."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the supervisor's control pipe was stdin: a reward reading stdin gets nothing
    os.close(null)
    os.dup2(2, 1)  # and its stdout the supervisor's reply to the stage: the user's prints go to stderr
    sys.stdout = sys.stderr
    os.set_inheritable(requests, False)  # pass_fds made them inheritable; no program the reward runs gets them
    os.set_inheritable(replies, False)
    channel = os.fdopen(replies, "wb")
    incoming = os.fdopen(requests, "rb")
    first = incoming.readline()
    if not first:  # the stage ended before it asked anything
        return
    n, setup = json.loads(first)
    key = bytes.fromhex(setup.pop("key"))

    def reply(outcome: dict) -> None:
        body = json.dumps([n, outcome]).encode()
        channel.write(sign(key, body) + b" " + body + b"\n")
        channel.flush()

    limits = Limits(memory=setup["memory"])
    _limit(limits)
    _landlock(Path(setup["root"]), Path(setup["private"]))
    sys.dont_write_bytecode = True  # no __pycache__ beside the user's file: the project is not the worker's
    sys.path[:] = setup["sys_path"]
    try:
        fn, file = load_function(setup["spec"], setup["reward_key"], setup["path"])
    except UserError as e:
        reply({"user_error": str(e)})
        return
    except MemoryError:
        reply({"limit": limits.memory_text()})
        return
    reply({"ready": file})
    for line in incoming:
        n, row = json.loads(line)
        outcome = judge(fn, tuple(row))
        reply({"limit": limits.memory_text()} if outcome.get("raised") == "MemoryError" else outcome)


def _limit(limits: Limits) -> None:
    for which, most in ((resource.RLIMIT_AS, limits.memory), (resource.RLIMIT_CORE, 0)):
        _, hard = resource.getrlimit(which)
        most = most if hard == resource.RLIM_INFINITY else min(most, hard)
        # the hard limit too, or the reward could raise it back (root still can: these bound accidents, not root)
        resource.setrlimit(which, (most, most))
    # No privilege gained through exec (a setuid program): every process of the tree stays the supervisor's to kill.
    _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _landlock(root: Path, private: Path) -> None:
    """Make `root` and the folders above it read-only to this process and its children: Landlock only grants,
    so write is granted on everything beside them (every other entry of each folder from / down to the root's
    parent) and on `private`. All or nothing: nothing is restricted when the kernel has no Landlock or a step
    fails. Read-only besides: an entry made later directly in a folder above the root. A symlink there is given
    no rule: a write through it is checked where it points."""
    abi = landlock_abi()
    if abi < 1:
        return
    libc = _libc()
    folder = REMOVE_AND_MAKE | WRITE_FILE | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    file = WRITE_FILE | (TRUNCATE if abi >= 3 else 0)
    attr = struct.pack("QQQ", folder, 0, SCOPE_SIGNAL) if abi >= 6 else struct.pack("Q", folder)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, len(attr), 0)
    if ruleset < 0:
        return
    try:
        writable = [private]
        for above, below in zip(root.parents, [root, *root.parents]):
            writable += [Path(e.path) for e in os.scandir(above) if e.name != below.name]
        for path in writable:
            try:
                fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # gone since the listing
                continue
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISLNK(mode):
                    continue
                rule = struct.pack("=Qi", folder if stat.S_ISDIR(mode) else file, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0) < 0:
                    return
            finally:
                os.close(fd)
        libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0)  # needs no_new_privs, which `_limit` set
    except OSError:  # a folder above the root that cannot be listed: no sandbox rather than a partial one
        return
    finally:
        os.close(ruleset)


if __name__ == "__main__":
    _supervise(*map(int, sys.argv[1:4]))
