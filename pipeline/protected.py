"""Where a command run by hand may write: anywhere but a project.

A project is a folder holding a .git or a dvc.yaml; so are the folder kiln runs in (layout's relative paths start
there) and kiln's own source tree (the installed package's folder). A check looks at every project a run could
reach: the working folder, kiln's source, every project at or above the output path and every one at or above the
--params file (`kiln pretrain --params P/params.yaml --out P --force` run from elsewhere once deleted P/model/*.py).
Protected in each: the folder and every folder above it; everything git tracks (the source tree, params.yaml,
tasks/) and every folder holding a tracked file; every path dvc.yaml names (each stage's deps and outs, the metrics
and plots files, the model artifacts) and every folder holding one (data/, metrics/, data/models/); layout's DAG
folders (data/, metrics/, params.yaml, tasks/) even without a dvc.yaml; and .git/ and .dvc/. When git cannot list
a project's files (another owner's checkout, "dubious ownership"; no git; a tarball of the project), everything that
exists in it but runs/ is protected instead: an empty list protected nothing, and `kiln convert to-hf MODEL docs
--force` deleted every docs/*.md.

A hand run's --out (and convert's OUT, `kiln seeds`' --out, --checkpoints, a benchmark's outputs, an optional
output file) may be none of these, nor inside one: such an output could only replace or mix with what the DAG or
git owns, which is how `--out .` once deleted model/*.py and `--out data` the DAG's corpus. The check runs before
any work, so a refusal leaves nothing behind.

Paths are compared as files, not as spellings: the output path is resolved (symlinks followed) and it and each of
its existing folders is matched by identity (device and inode) against the protected paths, so a bind mount, a
symlinked alias or a case variant reaches nothing its plain name could not. The check returns the resolved path,
and the run writes there: re-pointing a symlink while it runs changes nothing. `refuse_links` keeps a run's own
folder free of symlinks, through which what it writes would land where no check looked.

The DAG's own stages, as dvc.yaml runs them (every path at its default), write their outputs there: that is
what they are for, and DVC tracks what they change.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln.pipeline import layout
from kiln.pipeline.errors import UserError

DVC_YAML = Path("dvc.yaml")
SOURCE = Path(__file__).resolve().parents[1]  # kiln's own package folder: a project wherever kiln runs
# What points git at another repository or index than the folder's own (a hook, a wrapper): the protected files
# are those of the repository the project lies in
GIT_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY")


@dataclass(frozen=True, eq=False)
class Project:
    root: Path  # resolved
    # protected path -> why, for every protected path and every folder (below the root) holding one
    zones: dict[Path, str]
    # why git could not list the files of a project (one with a .git or a dvc.yaml, or kiln's source), "" when it
    # could: then everything that exists in it but runs/ is protected
    unlisted: str


@functools.lru_cache(maxsize=16)
def _project(root: Path) -> Project:
    """The project at the resolved folder `root`, read once per process: its git-tracked files and the paths its
    dvc.yaml names."""
    zones: dict[Path, str] = {}

    def protect(path: Path, why: str) -> None:
        path = (root / path).resolve()
        if path == root or root not in path.parents:
            return
        zones.setdefault(path, why)
        for parent in path.parents:
            if parent == root:
                break
            zones.setdefault(parent, f"a folder holding {path.relative_to(root)} ({why})")

    for name in (".git", ".dvc"):
        protect(Path(name), f"the project's {name}/")
    for path in (layout.DATA, layout.METRICS, layout.PARAMS, layout.TASKS, DVC_YAML):
        protect(path, "one of the DAG's paths (pipeline/layout.py)")
    for path in dag_paths(root / DVC_YAML):
        protect(path, "a path dvc.yaml names")
    tracked, why = tracked_files(root)
    for path in tracked:
        protect(path, "tracked by git")
    return Project(root, zones, why if is_project(root) or root == SOURCE else "")


def is_project(folder: Path) -> bool:
    return os.path.lexists(folder / ".git") or (folder / DVC_YAML).is_file()


def dag_paths(dvc_yaml: Path) -> list[Path]:
    """Every path dvc.yaml names: stage deps, outs, metrics and plots, top-level metrics and plot data files, and
    model artifacts. A path with a `${...}` part counts up to that part (data/models/${grpo.init}: data/models)."""
    try:
        spec = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) if dvc_yaml.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"{dvc_yaml}: cannot read it ({type(e).__name__}); the paths it names are protected from "
                        "hand runs, so kiln will not run one without knowing them") from None
    if not isinstance(spec, dict):
        return []
    names: list[str] = []

    def entries(items) -> None:  # a list of paths, each a string or a one-key {path: options} mapping
        for item in items if isinstance(items, list) else []:
            names.extend([item] if isinstance(item, str) else list(item) if isinstance(item, dict) else [])

    for stage in (spec.get("stages") or {}).values():
        if isinstance(stage, dict):
            for key in ("deps", "outs", "metrics", "plots"):
                entries(stage.get(key))
    entries(spec.get("metrics"))
    for plot in spec.get("plots") or []:
        if isinstance(plot, str):
            names.append(plot)
        elif isinstance(plot, dict):
            for definition in plot.values():
                y = definition.get("y") if isinstance(definition, dict) else None
                names.extend(y if isinstance(y, dict) else [])
    for artifact in (spec.get("artifacts") or {}).values():
        if isinstance(artifact, dict) and isinstance(artifact.get("path"), str):
            names.append(artifact["path"])
    paths = []
    for name in names:
        parts = Path(name).parts
        kept = parts[:next((i for i, p in enumerate(parts) if "${" in p), len(parts))]
        if kept:
            paths.append(Path(*kept))
    return paths


def tracked_files(root: Path) -> tuple[list[Path], str]:
    """What git tracks in the repository holding `root`, as absolute paths, and ""; or no paths and why git
    cannot list them (no repository, no git, a repository git refuses to read)."""
    if not any(os.path.lexists(place / ".git") for place in (root, *root.parents)):
        return [], "no git repository holds it"
    env = {k: v for k, v in os.environ.items() if k not in GIT_REDIRECTS}
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             env=env, timeout=30)
        base = Path(top.stdout.decode("utf-8", "surrogateescape").rstrip("\n"))
        done = top if top.returncode else subprocess.run(["git", "-C", str(base), "ls-files", "-z"],
                                                         capture_output=True, env=env, timeout=60)
    except OSError as e:
        return [], f"git did not run: {e.strerror}"
    except subprocess.TimeoutExpired:
        return [], "git did not answer in time"
    if done.returncode:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return [], said[0] if said else f"git exited with {done.returncode}"
    return [base / name for name in done.stdout.decode("utf-8", "surrogateescape").split("\0") if name], ""


def check_output(target: Path, option: str, folder: bool = True, params: Path | None = None,
                 area: Path | None = None) -> Path:
    """Refuse (UserError, before any work) an output `target` that is a project, above one, or protected or
    inside something protected in one (`params`: the --params file, whose project counts too); also a `folder`
    output that is an existing file, and a file output that is an existing folder. Inside `area` (a folder of
    the working folder's project that the command owns: `kiln bench`'s metrics/bench/) the working folder's
    project allows it. Returns the path to write: `target` resolved, relative to the working folder when inside
    it."""
    shown = f"{option} {target}"
    try:
        path = Path(target).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise UserError(f"{shown}: cannot resolve it ({e}); expected a path to write") from None
    cwd = Path.cwd().resolve()
    roots = {cwd, SOURCE}
    for anchor in (path, SOURCE, *([Path(params).resolve().parent] if params is not None else [])):
        roots.update(place for place in (anchor, *anchor.parents) if is_project(place))
    for root in sorted(roots):
        _check(_project(root), path, shown, None if area is None or root != cwd else cwd / area)
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{shown}: a file; expected a folder (or a path that does not exist yet)")
    if not folder and path.is_dir():
        raise UserError(f"{shown}: a folder; expected a file path")
    return path.relative_to(cwd) if cwd in path.parents else path


def _check(p: Project, path: Path, shown: str, area: Path | None) -> None:
    real = _canonical(p, path)
    if area is not None and area in real.parents:
        return
    shown += "" if real == path else f" (that is {real})"
    if real == p.root or real in p.root.parents:
        raise UserError(f"{shown}: the project folder {p.root}{'' if real == p.root else ' or one above it'}; a "
                        "run by hand writes into a folder of its own: choose another --out (by default runs/...)")
    for place in (real, *real.parents):
        if place == p.root:
            break
        if place in p.zones:
            where = "" if place == real else f" (inside {place.relative_to(p.root)})"
            raise UserError(f"{shown}: {p.zones[place]}{where}; a run by hand never writes into the project's "
                            "source, its git-tracked files or the DAG's inputs and outputs: choose a folder "
                            "outside them, e.g. under runs/")
    runs = p.root / layout.RUNS
    if not p.unlisted or p.root not in real.parents or real == runs or runs in real.parents:
        return
    for place in (real, *real.parents):
        if place == p.root:
            break
        if os.path.lexists(place):
            raise UserError(f"{shown}: {place.relative_to(p.root)} exists in the project {p.root}, whose files "
                            f"git cannot list ({p.unlisted}), so everything in it but {layout.RUNS}/ is "
                            f"protected: choose a folder outside it, or under its {layout.RUNS}/")


def _canonical(p: Project, path: Path) -> Path:
    """`path` as the project spells what it reaches: the deepest of it and its existing folders that is, by
    device and inode, a protected path, the project folder or one above it, with the rest of `path` after it."""
    known = _identities(p)
    for place in (path, *path.parents):
        try:
            found = os.stat(place)
        except OSError:
            continue
        if (spelled := known.get((found.st_dev, found.st_ino))) is not None:
            return spelled / path.relative_to(place)
    return path


@functools.lru_cache(maxsize=16)
def _identities(p: Project) -> dict[tuple[int, int], Path]:
    """(device, inode) -> path of the project folder, every folder above it and every protected path that
    exists; in a project git cannot list, of every folder in it but runs/ too (symlinks not followed)."""
    known: dict[tuple[int, int], Path] = {}
    for place in (*p.root.parents, p.root, *p.zones):
        try:
            found = os.stat(place)
        except OSError:
            continue
        known.setdefault((found.st_dev, found.st_ino), place)
    folders, runs = [str(p.root)] if p.unlisted else [], str(p.root / layout.RUNS)
    while folders:
        with contextlib.suppress(OSError), os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and entry.path != runs:
                    found = entry.stat(follow_symlinks=False)
                    known.setdefault((found.st_dev, found.st_ino), Path(entry.path))
                    folders.append(entry.path)
    return known


def refuse_links(folder: Path, shown: str, holds: tuple[str, ...] | None = None) -> None:
    """Refuse (UserError) an existing `folder` holding a symbolic link among its entries (those matching one of
    the `holds` glob patterns, when given) or anywhere below them: a run writes, and replaces, through them, so
    `X/metrics` linking to the project's metrics/ would have a run on `--out X` overwrite those."""
    if not Path(folder).is_dir():
        return
    for entry in sorted(Path(folder).iterdir()):
        if holds is not None and not any(fnmatch.fnmatch(entry.name, h) for h in holds):
            continue
        below = (Path(place, name) for place, dirs, files in os.walk(entry) for name in (*dirs, *files))
        if link := entry if entry.is_symlink() else next((p for p in below if p.is_symlink()), None):
            raise UserError(f"{shown}: {link} is a symbolic link (to {os.readlink(link)}), through which the run "
                            "would write where no check looked; remove it, or choose another folder")
