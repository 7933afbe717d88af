"""The two kinds of failure a kiln command reports, and their exit codes.

A `UserError` is bad input (params, files, arguments): exit 2 with one line naming what was wrong.
A `StageError` is a failure while doing the work (a diverged run, a disk that filled up): exit 1.
Anything else is a bug and keeps its traceback.

They live in the lowest layer that raises them: the one writer (`model/atomic.py`) turns a full disk into a
`StageError`, and `model/` may not import `pipeline/`. `kiln.pipeline.errors` is where the pipeline takes them.
"""


class KilnError(Exception):
    exit_code = 1


class UserError(KilnError):
    exit_code = 2


class StageError(KilnError):
    exit_code = 1
