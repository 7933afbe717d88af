"""Files of the user's own that a stage reads because a param names them (a reward function, a task or dataset
file) are inputs DVC must know, or editing one reruns nothing and the committed results stop being what the
files make. DVC cannot take a dep from a param's value (dvc.yaml interpolates strings, not lists, and
`grpo.reward` holds `file.py:function` or a built-in name), so each training stage depends on its own folder,
`tasks/<stage>/`, and evaluate on `tasks/`. When DVC runs a stage (it sets DVC_STAGE), a named file that lies
under none of that stage's deps is refused, saying where to put it; run by hand, any file is read."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from kiln.pipeline.errors import UserError
from kiln.pipeline.layout import TASKS


def check_declared(path: Path, key: str) -> None:
    """Under `dvc repro`/`dvc exp run`: `path` (named by the param `key`) must lie under one of the running
    stage's deps."""
    stage = os.environ.get("DVC_STAGE")
    if not stage:
        return
    dvc_file, _, name = stage.rpartition(":")
    # DVC runs a stage in its dvc.yaml's folder. Not DVC_ROOT: in a queued or `--temp` experiment it names the
    # repository the experiment came from, not the copy under .dvc/tmp/exps/ that the stage runs (and reads) in.
    dvc_file = Path.cwd() / Path(dvc_file or "dvc.yaml").name
    deps = _deps(dvc_file, name)
    if deps is None:  # not a stage kiln can read back (another dvc.yaml layout): DVC's business, not checked
        return
    target = path.resolve()
    if any(target == dep or dep in target.parents for dep in deps):
        return
    folders = [dep for dep in deps if TASKS.resolve() in (dep, *dep.parents)]
    where = f"{os.path.relpath(folders[0])}/" if folders else f"a path dvc.yaml lists as {name}'s dep"
    raise UserError(f"params: {key}: {path} is not among the {name} stage's deps in {dvc_file.name}, so DVC would not "
                    f"rerun {name} when it changes; expected it under {where} (or add it to the stage's deps)")


def check_declared_module(module: object, key: str) -> None:
    """A `module:function` reward imported from the project (not an installed package) is a file like any other."""
    file = getattr(module, "__file__", None)
    if not file or not os.environ.get("DVC_STAGE"):
        return
    path = Path(file).resolve()
    root = Path.cwd().resolve()  # the running stage's folder (check_declared says why not DVC_ROOT)
    installed = Path(sys.prefix).resolve() in path.parents or "site-packages" in path.parts
    if root in path.parents and not installed:
        check_declared(path, key)


def _deps(dvc_file: Path, stage: str) -> list[Path] | None:
    try:
        spec = yaml.safe_load(dvc_file.read_text())["stages"][stage]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    # An interpolated dep (${grpo.init}) names a model folder, never a file of the user's: skipped, not resolved.
    return [(dvc_file.parent / dep).resolve() for dep in spec.get("deps", []) if "${" not in str(dep)]
