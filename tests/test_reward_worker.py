"""The worker that runs a reward of the user's own (pipeline/tasks/user_reward.py), against rewards that attack
it (issue 68): its replies cannot be forged into another row's value, it takes no request and leaks no
descriptor or variable to what the reward runs, its memory and processes are bounded, and the project is not
the reward's to write (read-only where the kernel has Landlock; a change is named in a warning either way)."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.rewards import NamedReward, make_reward, score
from kiln.pipeline.tasks.user_reward import Limits, landlock_abi
from tests.test_rewards import alive

WORKER_MODULE = '''
import fcntl, json, os, stat, subprocess, sys, time

def channel():
    """The worker's reply descriptor, found as any code in its process can: the pipe open for writing that is
    neither stdout nor stderr."""
    for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
        try:
            fifo = stat.S_ISFIFO(os.fstat(fd).st_mode)
        except OSError:
            continue
        if fd > 2 and fifo and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
            return fd

def forge_bare(prompt, completion, answer):  # the line the worker once sent, unnumbered and unsigned
    os.write(channel(), b'{"value": 1000}\\n')
    return 0.5

def forge_unsigned(prompt, completion, answer):  # today's form, with a made-up signature
    os.write(channel(), b"0" * 32 + b' [0, {"value": 1000}]\\n')
    return 0.5

def flood(prompt, completion, answer):
    os.write(channel(), b"x" * (2 << 20))
    return 0.5

def forge_signed(prompt, completion, answer):
    """What only a reward written to forge can do: take the key from the worker's memory (its frame) and sign.
    The prompt holds [offset of the row number, outcome]."""
    from kiln.pipeline.tasks.user_reward import sign
    frame = sys._getframe()
    while "key" not in frame.f_locals:
        frame = frame.f_back
    offset, outcome = json.loads(prompt)
    body = json.dumps([frame.f_locals["n"] + offset, outcome]).encode()
    os.write(channel(), sign(frame.f_locals["key"], body) + b" " + body + b"\\n")
    return 0.5

def reads_stdin(prompt, completion, answer):
    child = subprocess.run(["cat"], stdout=subprocess.PIPE, timeout=5).stdout  # inherits the worker's stdin
    return float(len(sys.stdin.read()) + len(child))

def inherited(prompt, completion, answer):
    """Descriptors a program the reward runs inherits beyond 0, 1, 2 (and its own listing's), and whether the
    stage's variable reached it."""
    code = "import os; print(len(os.listdir('/proc/self/fd')) - 4, int('KILN_TEST_STAGE_ONLY' in os.environ))"
    out = subprocess.run([sys.executable, "-c", code], close_fds=False, capture_output=True, text=True).stdout
    fds, variable = map(int, out.split())
    return float(fds + 10 * variable + 100 * ("KILN_TEST_STAGE_ONLY" in os.environ))

def writes_here(prompt, completion, answer):
    with open("scratch.txt", "w") as f:
        f.write("x")
    return float(os.path.exists("scratch.txt"))

def writes_to(prompt, completion, answer):
    with open(prompt, "a") as f:
        f.write("x")
    return 1.0

def signals_its_supervisor(prompt, completion, answer):
    os.kill(os.getppid(), 0)
    return 1.0

def hungry(prompt, completion, answer):
    return float(len(bytearray(2 << 30)))

def fork_bomb(prompt, completion, answer):
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        with open(prompt, "a") as f:
            f.write(f"{pid}\\n")
    time.sleep(60)
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The stage's folder (the project), holding the reward module `worker.py`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "worker.py").write_text(WORKER_MODULE, encoding="utf-8")
    (tmp_path / "params.yaml").write_text("grpo: {}\n", encoding="utf-8")
    return tmp_path


@pytest.fixture
def outside(tmp_path_factory):
    """A folder beside the project, which a reward may write."""
    return tmp_path_factory.mktemp("outside")


def user(fn: str, timeout: float = 10, limits: Limits = Limits()) -> NamedReward:
    return make_reward(f"worker.py:{fn}", timeout=timeout, limits=limits)


def failure(reward: NamedReward, rows: list) -> str:
    with pytest.raises(UserError) as info:
        score(reward, rows, "rollouts")
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("fn, said", [
    ("forge_bare", "its worker's reply channel held a line its worker did not sign: '{\"value\": 1000}'"),
    ("forge_unsigned", "its worker's reply channel held a line its worker did not sign: '00000000"),
    ("flood", "its worker's reply channel held over 1,048,576 bytes with no line end"),
])
def test_a_reply_written_into_the_worker_s_channel_is_refused_naming_the_row(project, fn, said):
    reward = user(fn)
    message = failure(reward, [("p", "c", "a"), ("p", "c", "a")])
    assert message.startswith(f"rollouts: grpo.reward='worker.py:{fn}': row 0: {said}"), message
    assert message.endswith("so no reply of it can be trusted (something in the reward wrote into kiln's channel, "
                            "or closed it); the worker was stopped")
    assert reward.process.proc.poll() is not None


@pytest.mark.parametrize("forged, said", [
    ([1, {"value": 1000.0}], "row 0: its worker's reply channel held the reply to request 2, not to 1"),
    ([0, {"value": 1000.0, "bonus": 1}], "row 0: its worker's reply channel held more than one line, or one of "
                                         "the wrong form"),
    ([0, {"value": "1000"}], "row 0: its worker's reply channel held more than one line, or one of the wrong form"),
])
def test_even_a_signed_forgery_is_refused_when_it_is_not_the_row_s_reply(project, forged, said):
    """A reward can read the key in its own process (the check's honest limit), but a signed reply still has to
    be this row's, in the worker's own form."""
    message = failure(user("forge_signed"), [(json.dumps(forged), "c", "a")] * 2)
    assert said in message, message


def test_a_signed_forgery_of_the_row_s_own_reply_is_caught_by_the_reply_that_follows_it(project):
    # The forged line comes first and may pass for row 0; the worker's own reply to row 0 then trails it, and is
    # refused (as a second line, or as row 0's reply where row 1's was due): never a shifted value.
    message = failure(user("forge_signed"), [(json.dumps([0, {"value": 1000.0}]), "c", "a")] * 2)
    assert ("row 0: its worker's reply channel held more than one line" in message or
            "row 1: its worker's reply channel held the reply to request 1, not to 2" in message), message


def test_a_reward_reading_stdin_gets_nothing_and_takes_no_request(project):
    assert score(user("reads_stdin", timeout=5), [("p", "c", "a")] * 3, "rollouts") == [0.0, 0.0, 0.0]


def test_a_program_the_reward_runs_inherits_no_channel_and_the_worker_not_the_stage_s_environment(project,
                                                                                                   monkeypatch):
    monkeypatch.setenv("KILN_TEST_STAGE_ONLY", "1")
    assert score(user("inherited"), [("p", "c", "a")], "rollouts") == [0.0]


def test_a_relative_write_lands_in_the_worker_s_own_folder(project):
    assert score(user("writes_here"), [("p", "c", "a")], "rollouts") == [1.0]
    assert not (project / "scratch.txt").exists()


@pytest.mark.skipif(landlock_abi() < 1, reason="the kernel has no Landlock: the project is not read-only to the "
                                               "worker (the warning test covers that case)")
def test_the_project_is_read_only_to_the_reward(project, outside):
    before = (project / "params.yaml").read_bytes()
    reward = user("writes_to")
    for target in (project / "params.yaml", project / "data" / "new.txt", project / "new.txt"):
        (project / "data").mkdir(exist_ok=True)
        message = failure(reward, [(str(target), "c", "a")])
        assert message == (f"rollouts: grpo.reward='worker.py:writes_to': row 0 raised PermissionError: [Errno 13] "
                           f"Permission denied: '{target}'")
        reward = user("writes_to")
    assert (project / "params.yaml").read_bytes() == before and not (project / "data/new.txt").exists()
    assert score(reward, [(str(outside / "mine.txt"), "c", "a")], "rollouts") == [1.0]  # elsewhere, it may
    assert (outside / "mine.txt").read_text() == "x"


@pytest.mark.skipif(landlock_abi() < 6, reason="Landlock scopes signals from ABI 6 (Linux 6.12)")
def test_the_reward_cannot_signal_its_supervisor(project):
    message = failure(user("signals_its_supervisor"), [("p", "c", "a")])
    assert "row 0 raised PermissionError: [Errno 1] Operation not permitted" in message, message


def test_a_change_to_the_project_s_files_while_the_reward_ran_is_named_in_a_warning(project, monkeypatch, capsys):
    """However the file changed (here by the test, standing for a reward on a kernel without Landlock): one
    warning line at the end, naming what git tracks or dvc.yaml names, not the running stage's own outputs."""
    stages = {"grpo": {"cmd": "kiln grpo", "deps": ["worker.py"], "outs": ["data/models/grpo"]},
              "prepare": {"cmd": "kiln data prepare", "outs": ["data/corpus"]}}
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    for name in ("data/models/grpo/model.bin", "data/corpus/train.parquet", "src/a.py", "untracked.txt"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("before")
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(["git", "add", "params.yaml", "src/a.py"], check=True)
    monkeypatch.setenv("DVC_STAGE", "grpo")
    monkeypatch.setenv("DVC_ROOT", str(project))
    reward = make_reward("worker.py:writes_here")
    assert score(reward, [("p", "c", "a")], "rollouts") == [1.0]
    capsys.readouterr()
    for name in ("params.yaml", "data/corpus/train.parquet", "data/models/grpo/model.bin", "untracked.txt"):
        (project / name).write_text("after, longer")
    (project / "src/a.py").unlink()
    reward.process.close()
    err = capsys.readouterr().err.strip()
    assert err == ("warning: grpo.reward='worker.py:writes_here': the project's files changed while the reward's "
                   "process ran: data/corpus/train.parquet, params.yaml, src/a.py (a reward must not write into the "
                   "project; `git status` and `dvc status` show what changed)")
    reward.process.close()  # once is all: no second warning
    assert capsys.readouterr().err == ""


def test_a_reward_past_its_memory_limit_is_one_line_naming_it(project):
    message = failure(user("hungry", limits=Limits(memory=1 << 30)), [("p", "c", "a")])
    assert message == ("rollouts: grpo.reward='worker.py:hungry': row 0: the reward's process ran out of its 1 GiB "
                       "address-space limit (MemoryError)")
    (project / "hoard.py").write_text("HOARD = bytearray(2 << 30)\ndef score(p, c, a):\n    return 1.0\n")
    with pytest.raises(UserError) as info:
        make_reward("hoard.py:score", limits=Limits(memory=1 << 30))
    assert str(info.value) == ("params: grpo.reward='hoard.py:score': importing it, its process ran out of its 1 GiB "
                               "address-space limit (MemoryError)")


def test_a_fork_bomb_is_stopped_at_the_process_limit_and_all_of_it_killed(project, outside):
    pids = outside / "pids"
    pids.touch()
    start = time.monotonic()
    message = failure(user("fork_bomb", timeout=30, limits=Limits(processes=16)), [(str(pids), "c", "a")])
    assert message == ("rollouts: grpo.reward='worker.py:fork_bomb': row 0: the reward's process ran more than 16 "
                       "processes at once (its limit); all were killed")
    assert time.monotonic() - start < 15
    children = [int(pid) for pid in pids.read_text().split()]
    assert len(children) >= 16 and not any(map(alive, children))


def test_the_worker_s_private_folder_is_removed_with_it(project):
    reward = user("writes_here")
    score(reward, [("p", "c", "a")], "rollouts")
    folder = Path(os.readlink(f"/proc/{reward.process.proc.pid}/cwd"))
    assert (folder / "scratch.txt").is_file()
    reward.process.close()
    assert not folder.exists()
