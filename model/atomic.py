"""The one way kiln writes an output or a checkpoint: a stage leaves all of it or none of it, and a kill at any
moment loses neither the new result nor the old one.

It lives in `model/` because that is the lowest layer that writes (model folders); every pipeline output and
checkpoint goes through it too.

A folder is written into `NAME.tmp-*` beside its target, every file and folder in it fsynced, then renamed
`NAME.new-*`: from that moment a complete new version exists on disk. An old `NAME` is renamed `NAME.old-*`,
the new one renamed `NAME`, and only then is the old one deleted. POSIX cannot swap two folders in one step, so
a kill between those renames leaves no `NAME`; `recover(NAME)` finishes the replace from `.new-*` (complete by
construction) or, if the kill came before it existed, puts `.old-*` back. A file is replaced with one atomic
rename after an fsync. Stages call `recover` on their outputs when they start, which also removes the temp
folders a killed run left.

A write the system refuses (disk full, quota, read-only filesystem, permission) is a `StageError` naming the
target and the system's reason, raised after the temp files are removed and with the previous version in place:
one line and exit 1 from the CLI, not a traceback from wherever the disk filled up.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from safetensors import SafetensorError

from kiln.model.errors import StageError, UserError


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (the names renamed into it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def publish_modes(root: Path) -> None:
    """Folders 0755 and files 0644, as a plain write under umask 022 makes them: mkdtemp makes the folder 0700
    and safetensors' save_file writes its file 0600, so an output would otherwise be private to its writer."""
    for folder, _, files in os.walk(root):
        Path(folder).chmod(0o755)
        for name in files:
            (Path(folder) / name).chmod(0o644)


def _leftovers(final: Path, kind: str) -> list[Path]:
    """`final`'s leftovers of one kind (tmp, new, old), oldest first."""
    found = final.parent.glob(f"{glob.escape(final.name)}.{kind}-*")
    return sorted(found, key=lambda p: p.lstat().st_mtime)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sibling(final: Path, kind: str) -> Path:
    return final.with_name(f"{final.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


# What the system says when it will not store what a run writes. Other OS errors (a missing file) are not the
# disk's doing and keep their own report.
REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO,
           errno.EMFILE, errno.ENFILE}


def _reason(error: BaseException) -> str | None:
    """The system's reason for a refused write ("No space left on device [ENOSPC]"), or None if `error` is not
    one. safetensors writes from Rust and reports the OS error only in its message ("... (os error 28)")."""
    code = None
    if isinstance(error, OSError):
        code = error.errno
    elif isinstance(error, SafetensorError) and (found := re.search(r"os error (\d+)", str(error))):
        code = int(found.group(1))
    return f"{os.strerror(code)} [{errno.errorcode[code]}]" if code in REFUSED else None


@contextmanager
def writing(target: Path) -> Iterator[None]:
    """Turn a write the system refuses inside the block into a StageError naming `target`."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = _reason(e)
        if reason is None:
            raise
        raise StageError(f"{target}: cannot write it: {reason}; the previous version, if any, is unchanged") from e


def recover(final: Path) -> None:
    """Finish or undo a replace of `final` that a kill interrupted, and delete its temp leftovers."""
    final = Path(final)
    if not final.parent.is_dir():
        return
    with writing(final):
        _recover(final)


def _recover(final: Path) -> None:
    news, olds = _leftovers(final, "new"), _leftovers(final, "old")
    if not final.exists() and news:
        news.pop().rename(final)
    elif not final.exists() and olds:
        olds.pop().rename(final)
    for path in [*news, *olds, *_leftovers(final, "tmp")]:
        _remove(path)
    fsync_path(final.parent)


def replace_dir(complete: Path, final: Path) -> None:
    """Move the complete, synced `complete` into `final`'s place, keeping the old `final` until it is there; if
    a rename fails, the old `final` is put back and the new version removed."""
    new = _sibling(final, "new")
    complete.rename(new)
    old = None
    try:
        fsync_path(final.parent)
        if final.exists():
            old = _sibling(final, "old")
            final.rename(old)
        new.rename(final)
    except BaseException:
        if old is not None and not final.exists():
            old.rename(final)
        _remove(new)
        raise
    fsync_path(final.parent)
    if old is not None:
        _remove(old)


# Whether an output folder may replace one holding files kiln would not write there: `kiln ... --force`.
_replace_foreign: ContextVar[bool] = ContextVar("kiln_replace_foreign", default=False)


@contextmanager
def replacing(force: bool) -> Iterator[None]:
    """Within the block, `atomic_dir` replaces whatever is in the way (`--force`)."""
    token = _replace_foreign.set(force)
    try:
        yield
    finally:
        _replace_foreign.reset(token)


def forced() -> bool:
    """Whether outputs may replace whatever is in the way here (`replacing`, `--force`)."""
    return _replace_foreign.get()


def check_replaceable(final: Path, holds: tuple[str, ...], what: str) -> None:
    """Refuse (UserError) to replace `final` if it is a file, or a folder with an entry none of the `holds`
    patterns match: what this kind of output holds. Such a folder is the user's, not an earlier run's (`kiln
    convert to-hf ... p` replaced a folder `p` that held someone's notes.txt)."""
    if forced() or not os.path.lexists(final):
        return
    if not final.is_dir() or final.is_symlink():
        raise UserError(f"{final}: a file, not a {what} folder; choose another --out, or pass --force to replace it")
    if names := foreign(final, holds):
        raise UserError(f"{final}: holds {names}, which no {what} folder kiln writes holds; choose another --out, "
                        "or pass --force to replace the folder")


def foreign(folder: Path, holds: tuple[str, ...]) -> str:
    """The entries of `folder` that none of the `holds` glob patterns match, for a one-line refusal: the first,
    quoted, and how many more; "" when there are none."""
    names = sorted(p.name for p in folder.iterdir() if not any(fnmatch.fnmatch(p.name, h) for h in holds))
    return f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") if names else ""


@contextmanager
def atomic_dir(final: Path, holds: tuple[str, ...] | None = None, what: str = "output") -> Iterator[Path]:
    """Yield an empty temp folder beside `final`; on success it replaces `final`, on error it is removed. With
    `holds` (the names, as glob patterns, this kind of output holds; None for kiln's own folders such as resume
    state), a `final` in the way that holds anything else is refused first (`check_replaceable`)."""
    final = Path(final)
    if holds is not None:
        check_replaceable(final, holds, what)
    with writing(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        recover(final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        try:
            yield tmp
            publish_modes(tmp)
            fsync_tree(tmp)
            replace_dir(tmp, final)
        except BaseException:
            _remove(tmp)
            raise


def atomic_write_files(files: dict[Path, bytes]) -> None:
    """Write several files all or none (a stage's outputs spread over folders: evaluate's samples, report and
    metrics): every one to a synced temp file beside its target first, and only when all are written are they
    renamed into place. A write the system refuses (a full disk) leaves every old file as it was. A rename needs
    no space, so what can split them is a kill in the microseconds between renames."""
    done: dict[Path, Path] = {}
    try:
        for path, data in files.items():
            path = Path(path)
            if path.is_dir():
                raise UserError(f"{path}: a folder; expected the path of a file to write")
            with writing(path):
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp-", dir=path.parent)
                done[path] = Path(tmp)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o644)
    except BaseException:
        for tmp in done.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in done.items():
        os.replace(tmp, path)
    for folder in {path.parent for path in done}:
        fsync_path(folder)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a synced temp file beside it, renamed over it in one step. A folder at
    `path` is bad input (an `--out` that names one), refused before anything is written."""
    atomic_write_files({Path(path): data})
