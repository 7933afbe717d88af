"""Where a command run by hand may write: anywhere but the project itself.

The project is the folder kiln runs in (layout's relative paths start there). Protected in it: the folder and
every folder above it; everything git tracks (the source tree, params.yaml, tasks/) and every folder holding a
tracked file; every path dvc.yaml names (each stage's deps and outs, the metrics and plots files, the model
artifacts) and every folder holding one (data/, metrics/, data/models/); layout's DAG folders (data/, metrics/,
params.yaml, tasks/) even without a dvc.yaml; and .git/ and .dvc/. A hand run's --out (and convert's OUT,
`kiln seeds`' --out, an optional output file) may be none of these, nor inside one: such an output could only
replace or mix with what the DAG or git owns, which is how `--out .` once deleted model/*.py and `--out data`
the DAG's corpus. The check runs before any work, so a refusal leaves nothing behind.

The DAG's own stages, as dvc.yaml runs them (every path at its default), write their outputs there: that is
what they are for, and DVC tracks what they change.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln.pipeline import layout
from kiln.pipeline.errors import UserError

DVC_YAML = Path("dvc.yaml")


@dataclass(frozen=True, eq=False)
class Project:
    root: Path  # resolved
    # protected path -> why, for every protected path and every folder (below the root) holding one
    zones: dict[Path, str]


def project(root: Path | None = None) -> Project:
    """The project kiln runs in (the working folder), read once per folder: its git-tracked files and the paths
    its dvc.yaml names."""
    return _project((root or Path.cwd()).resolve())


@functools.lru_cache(maxsize=4)
def _project(root: Path) -> Project:
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
    for path in tracked_files(root):
        protect(path, "tracked by git")
    return Project(root, zones)


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


def tracked_files(root: Path) -> list[Path]:
    """What git tracks in the repository holding `root`, as absolute paths; none without git or a repository."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=30)
        if top.returncode:
            return []
        listed = subprocess.run(["git", "-C", top.stdout.strip(), "ls-files", "-z"], capture_output=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    base = Path(top.stdout.strip())
    return [base / name for name in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if name]


def check_output(target: Path, option: str, folder: bool = True) -> None:
    """Refuse (UserError, before any work) an output `target` that is the project, above it, or protected or
    inside something protected; also a `folder` output that is an existing file, and a file output that is an
    existing folder."""
    path = Path(target).resolve()
    for p in {project(), *_enclosing(path)}:
        _check(p, path, f"{option} {target}")
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{option} {target}: a file; expected a folder (or a path that does not exist yet)")
    if not folder and path.is_dir():
        raise UserError(f"{option} {target}: a folder; expected a file path")


def _enclosing(path: Path) -> list[Project]:
    """The project `path` lies in, when it is not the working folder's: the nearest folder above it with a
    dvc.yaml or a .git (another checkout's DAG is just as protected)."""
    for place in path.parents:
        if (place / DVC_YAML).is_file() or (place / ".git").exists():
            return [project(place)]
    return []


def _check(p: Project, path: Path, shown: str) -> None:
    if path == p.root or path in p.root.parents:
        raise UserError(f"{shown}: the project folder{'' if path == p.root else ' or one above it'}; a run by "
                        "hand writes into a folder of its own: choose another --out (by default runs/...)")
    for place in (path, *path.parents):
        if place in p.zones:
            where = "" if place == path else f" (inside {place.relative_to(p.root)})"
            raise UserError(f"{shown}: {p.zones[place]}{where}; a run by hand never writes into the project's "
                            "source, its git-tracked files or the DAG's inputs and outputs: choose a folder "
                            "outside them, e.g. under runs/")
        if place == p.root:
            break
