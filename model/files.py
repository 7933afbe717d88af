"""Reading a file a user names: a regular file of a bounded size, checked before a byte is read.

A path can name something that never ends (/dev/zero, /dev/urandom), never answers (a FIFO nobody writes) or is
far larger than its kind ever is; reading it whole took 22.9 GB and the machine's out-of-memory killer, or hung.
Such a file is refused with one line naming it and what was expected.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kiln.model.errors import UserError


def check_regular(path: Path, limit: int, what: str) -> int:
    """The size of `path`, a regular file (a link to one counts) of at most `limit` bytes; UserError otherwise,
    naming it as `what` (e.g. "a JSON file")."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else \
            "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a regular file"
        raise UserError(f"{path}: {kind}; expected {what}")
    if info.st_size > limit:
        raise UserError(f"{path}: {info.st_size:,} bytes; expected {what} of at most {limit:,}")
    return info.st_size


def read_capped(path: Path, limit: int, what: str) -> bytes:
    """The bytes of `path`, checked by `check_regular` (and cut at `limit` + 1 should it grow meanwhile)."""
    check_regular(path, limit, what)
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{path}: more than {limit:,} bytes; expected {what} of at most {limit:,}")
    return data
