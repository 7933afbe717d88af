"""The one writer (kiln.model.atomic) and the checkpoint lock: a kill at any moment leaves the old output or the
new one, never neither or half; stale temp folders go at the next start; two runs cannot share checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.model import atomic
from kiln.model.atomic import atomic_dir, atomic_write_bytes, recover
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import exclusive


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
