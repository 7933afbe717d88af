"""The one writer (kiln.model.atomic) and the checkpoint lock: a kill at any moment leaves the old output or the
new one, never neither or half; stale temp folders go at the next start; two runs cannot share checkpoints."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from typer.testing import CliRunner

from kiln.model import atomic, checkpoint
from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.atomic import atomic_dir, atomic_write_bytes, recover
from kiln.pipeline.cli import app
from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.outputs import exclusive, write_json
from kiln.pipeline.train import checkpoints
from kiln.pipeline.train.checkpoints import Checkpoints
from tests.conftest import tree_bytes

TINY_MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TINY_TRAIN = {"batch_size": 4, "batch_tokens": 128, "warmup_steps": 1, "eval_tokens": 128, "max_steps": 2,
              "checkpoint_every": 2, "eval_every": 2, "log_every": 1, "device": "cpu"}


def write_version(final: Path, text: str) -> None:
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text(text * 2)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_outputs_are_readable_by_others_like_a_plain_write(tmp_path):
    """A model folder is shared (DVC cache, other users, a serving process): a file its writer made 0600, as
    safetensors does, and the 0700 temp folder come out 0644 and 0755."""
    final = tmp_path / "model"
    with atomic_dir(final) as tmp:
        save_file({"w": torch.zeros(2)}, tmp / "model.safetensors")
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "c.json").write_text("{}")
        (tmp / "sub" / "c.json").chmod(0o600)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in [final, *final.rglob("*")]}
    assert modes == {"model": 0o755, "model/model.safetensors": 0o644, "model/sub": 0o755,
                     "model/sub/c.json": 0o644}


def test_replace_leaves_the_new_version_and_nothing_else(tmp_path):
    final = tmp_path / "out"
    write_version(final, "old")
    write_version(final, "new")
    assert (final / "a.txt").read_text() == "new" and (final / "sub" / "b.txt").read_text() == "newnew"
    assert listing(tmp_path) == ["out"]


def test_an_error_inside_keeps_the_old_version(tmp_path):
    final = tmp_path / "out"
    write_version(final, "old")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("disk full")
    assert (final / "a.txt").read_text() == "old" and listing(tmp_path) == ["out"]


def test_every_file_and_folder_is_synced_before_the_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    monkeypatch.setattr(atomic, "fsync_path", lambda p: synced.append(Path(p).name))
    real_rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, target: (renamed.append(list(synced)), real_rename(self, target))[1])
    write_version(tmp_path / "out", "x")
    assert {"a.txt", "b.txt", "sub"} <= set(renamed[0])  # the first rename (tmp -> new) came after every fsync


@pytest.mark.parametrize("killed_after", ["tmp written", "new complete", "old moved aside"])
def test_recover_after_a_kill_at_each_point(tmp_path, killed_after):
    """The states a kill -9 can leave between the steps of a replace, made by hand; `recover` (run when a stage
    starts) must end with exactly one complete version: the new one once it was complete, else the old."""
    final = tmp_path / "out"
    write_version(final, "old")
    staged = tmp_path / "staging"
    write_version(staged, "new")
    if killed_after == "tmp written":
        staged.rename(tmp_path / "out.tmp-abc")
    elif killed_after == "new complete":
        staged.rename(tmp_path / "out.new-1-abc")
    else:
        staged.rename(tmp_path / "out.new-1-abc")
        final.rename(tmp_path / "out.old-1-abc")
    recover(final)
    want = "new" if killed_after == "old moved aside" else "old"  # a complete new one replaces only a gone old one
    assert (final / "a.txt").read_text() == want and listing(tmp_path) == ["out"]


def test_recover_puts_the_old_version_back_when_no_new_one_was_complete(tmp_path):
    final = tmp_path / "out"
    write_version(final, "old")
    final.rename(tmp_path / "out.old-1-abc")
    (tmp_path / "out.tmp-xyz").mkdir()
    recover(final)
    assert (final / "a.txt").read_text() == "old" and listing(tmp_path) == ["out"]


def test_recover_leaves_other_names_alone(tmp_path):
    (tmp_path / "outer.tmp-1").mkdir()  # another output's leftovers: not this one's to delete
    (tmp_path / "notes.txt").write_text("mine")
    recover(tmp_path / "out")
    assert listing(tmp_path) == ["notes.txt", "outer.tmp-1"]


def test_file_write_is_whole_and_cleans_its_temps(tmp_path):
    path = tmp_path / "m.json"
    (tmp_path / "m.json.tmp-dead").write_text("{")  # a killed writer's leftover
    atomic_write_bytes(path, b"{}")
    recover(path)
    assert path.read_bytes() == b"{}" and listing(tmp_path) == ["m.json"]


def test_kill_9_during_a_write_keeps_the_old_output(tmp_path):
    """A real kill -9 in the middle of writing the new version: the old one survives, the next start cleans."""
    final = tmp_path / "out"
    write_version(final, "old")
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from kiln.model.atomic import atomic_dir
        with atomic_dir(Path({str(final)!r})) as tmp:
            (tmp / "a.txt").write_text("new")
            print("writing", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (final / "a.txt").read_text() == "old" and any(".tmp-" in n for n in listing(tmp_path))
    recover(final)
    assert listing(tmp_path) == ["out"]


def test_a_second_run_on_a_checkpoint_folder_refuses_naming_the_first(tmp_path):
    folder = tmp_path / "checkpoints"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from kiln.pipeline.outputs import exclusive
        with exclusive(Path({str(folder)!r})):
            print("holding", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        with pytest.raises(UserError, match=rf"in use by another kiln run \(pid {proc.pid}\)"):
            with exclusive(folder):
                pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel drops a dead owner's lock: the next run goes ahead
        try:
            with exclusive(folder):
                break
        except UserError:
            assert time.monotonic() < deadline, "a killed run kept its lock"
            time.sleep(0.1)


# --- a disk that refuses the write (issue 18, class 13) ------------------------------------------------------------

def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def tiny_gpt(d_model: int = 32) -> tuple[GPT, ModelConfig]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, d_model=d_model, max_seq_len=16)
    return GPT(config), config


def failing_rename(which: int):
    """Path.rename that refuses its `which`-th call (1: temp -> new, 2: old aside, 3: new -> final)."""
    real, calls = Path.rename, []

    def rename(self, target):
        calls.append(self)
        if len(calls) == which:
            enospc()
        return real(self, target)
    return rename


SAVE_FAILURES = {
    "write": lambda mp: mp.setattr(checkpoint, "save_file", enospc),
    "write in safetensors": lambda mp: mp.setattr(checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))),
    "fsync": lambda mp: mp.setattr(atomic, "fsync_path", enospc),
    **{f"rename {i}": (lambda i: lambda mp: mp.setattr(Path, "rename", failing_rename(i)))(i) for i in (1, 2, 3)},
}


@pytest.mark.parametrize("where", sorted(SAVE_FAILURES))
def test_a_full_disk_during_a_model_save_keeps_the_old_model(tmp_path, monkeypatch, where):
    model, config = tiny_gpt()
    out = tmp_path / "base"
    save_model(model, config, out)
    before = tree_bytes(tmp_path)
    torch.nn.init.ones_(model.tok_emb.weight)
    SAVE_FAILURES[where](monkeypatch)
    with pytest.raises(StageError, match=rf"^{out}: cannot write it: No space left on device \[ENOSPC\]"):
        save_model(model, config, out)
    monkeypatch.undo()
    assert tree_bytes(tmp_path) == before and listing(tmp_path) == ["base"]  # the old model, no temp left


@pytest.mark.parametrize("where", ["write", "fsync", "rename 1", "rename 2"])  # a new folder: 2 renames
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_ones(tmp_path, monkeypatch, where):
    model, _ = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    optimizer.step()
    ckpts = Checkpoints(tmp_path / "ckpt", {"run": 1}, keep=2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ckpts.save(2, model, optimizer, scaler, {"i": 2}, {})
    before = tree_bytes(tmp_path)
    failures = {**SAVE_FAILURES, "write": lambda mp: mp.setattr(checkpoints, "save_file", enospc)}
    failures[where](monkeypatch)
    final = ckpts.folder / "step_00000004"
    with pytest.raises(StageError, match=rf"^{final}: cannot write it: No space left on device \[ENOSPC\]"):
        ckpts.save(4, model, optimizer, scaler, {"i": 4}, {})
    monkeypatch.undo()
    assert tree_bytes(tmp_path) == before and listing(ckpts.folder) == ["step_00000002"]


def test_a_full_disk_ends_kiln_commands_in_one_error_line(tiny, tmp_path, monkeypatch):
    """Through the CLI: sharding and training stop with exit 1 and the error as their one last line; what the
    previous run wrote stays byte for byte."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(json.dumps({"model": TINY_MODEL, "train": TINY_TRAIN,
                                                      "shard": {"shard_tokens": 2048}}))
    train = ["train", "--shards", str(tiny.shards), "--tokenizer", str(tiny.tokenizer), "--out", "base",
             "--checkpoints", "ckpt"]
    assert CliRunner().invoke(app, train).exit_code == 0
    before = tree_bytes(tmp_path / "base")
    monkeypatch.setattr(checkpoint, "save_file", enospc)  # the rerun resumes at the end and saves the model again
    last = last_line_of_failure(train)
    assert last.startswith("error: base/model: cannot write it: No space left on device [ENOSPC]")
    assert tree_bytes(tmp_path / "base") == before

    shard = ["data", "shard", "--corpus", str(tiny.corpus), "--tokenizer", str(tiny.tokenizer), "--out", "shards"]
    assert CliRunner().invoke(app, shard).exit_code == 0
    written = lambda: {**tree_bytes(tmp_path / "shards/shards"), **tree_bytes(tmp_path / "shards/metrics")}  # noqa: E731
    before = written()  # the hand run's output and metrics (its resume state may change: it is for the next run)
    monkeypatch.setattr(os, "fsync", enospc)  # whatever file the stage writes first
    assert re.fullmatch(r"error: \S+: cannot write it: No space left on device \[ENOSPC\].*", last_line_of_failure(shard))
    monkeypatch.undo()
    assert written() == before


def last_line_of_failure(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.output.strip().splitlines()[-1]


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A real filesystem of `size` (tmpfs) at `path`, or a skip where this user may not mount one."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_really_full_disk_keeps_the_old_model_and_leaves_no_temp(tmp_path):
    with small_disk(tmp_path / "disk", "96k") as disk:
        small, small_config = tiny_gpt()
        save_model(small, small_config, disk / "base")  # ~30 kB
        before = tree_bytes(disk)
        big, big_config = tiny_gpt(d_model=64)  # ~100 kB: does not fit beside it
        with pytest.raises(StageError, match=rf"^{disk / 'base'}: cannot write it: No space left on device"):
            save_model(big, big_config, disk / "base")
        assert tree_bytes(disk) == before and listing(disk) == ["base"]
        with pytest.raises(StageError, match=rf"^{disk / 'm.json'}: cannot write it: No space left on device"):
            write_json(disk / "m.json", {"x": "y" * 200_000})
        assert listing(disk) == ["base"]


# --- strict JSON ----------------------------------------------------------------------------------------------------

def test_json_with_a_nan_is_not_written(tmp_path):
    write_json(tmp_path / "m.json", {"a": 1})
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(StageError, match=rf"^{tmp_path / 'm.json'}: not written: loss\.curve\.1 is not a finite"):
            write_json(tmp_path / "m.json", {"a": 2, "loss": {"curve": [1.0, value]}})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1} and listing(tmp_path) == ["m.json"]
    write_json(tmp_path / "m.json", {"a": [1.5, None, "NaN"]})  # the string is fine
    assert json.loads((tmp_path / "m.json").read_text(), parse_constant=lambda c: pytest.fail(c))["a"][2] == "NaN"


# --- non-finite weights are never written (issue 18, class 11) -----------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_model_with_non_finite_weights_is_not_saved(tmp_path, bad):
    model, config = tiny_gpt()
    save_model(model, config, tmp_path / "base")
    before = tree_bytes(tmp_path)
    with torch.no_grad():
        model.blocks[0].mlp.down_proj.weight[1, 2] = bad
    with pytest.raises(StageError, match=r"base: not saved: blocks\.0\.mlp\.down_proj\.weight holds NaN or infinite"):
        save_model(model, config, tmp_path / "base")
    assert tree_bytes(tmp_path) == before


def test_a_full_disk_halfway_through_a_stages_files_keeps_every_old_one(tmp_path, monkeypatch):
    """Evaluate's samples, report and metrics are written together (`atomic_write_files`): a full disk on the
    report, the second of three, left new samples beside an old report and no eval.json; now every old file stays
    and no temp is left."""
    from kiln.model.atomic import atomic_write_files

    files = {tmp_path / "samples/base.md": b"new samples", tmp_path / "report.md": b"new report",
             tmp_path / "eval.json": b"{}"}
    atomic_write_files({path: b"old " + path.name.encode() for path in files})
    before = tree_bytes(tmp_path)
    real_fdopen, calls = os.fdopen, []

    def fdopen(fd, *args, **kwargs):  # the second file's write finds the disk full
        calls.append(fd)
        if len(calls) == 2:
            os.close(fd)
            enospc()
        return real_fdopen(fd, *args, **kwargs)
    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(StageError, match=rf"^{tmp_path / 'report.md'}: cannot write it: No space left on device"):
        atomic_write_files(files)
    monkeypatch.undo()
    assert tree_bytes(tmp_path) == before and sorted(p.name for p in tmp_path.rglob("*")) == [
        "base.md", "eval.json", "report.md", "samples"]
    atomic_write_files(files)
    assert {path: path.read_bytes() for path in files} == files
