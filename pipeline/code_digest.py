"""The digest of a training stage's code, part of its checkpoints' fingerprint: when a fix to the code makes DVC
rerun a stage, the run must not resume the final checkpoint the old code wrote and hand back the old model.

The stage's code is what kiln's own dvc.yaml (beside this package, in the source root: not the project a run is
started in) lists as the stage's deps under kernels/, model/ and pipeline/, which tests/test_layout.py holds to
exactly the modules the stage's command imports. Not the modules this process has loaded (sys.modules): those
depend on what was imported before, so one process could fingerprint one run two ways and never resume it. An
installed wheel ships no dvc.yaml; there every module of kiln counts, so another release starts afresh.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from kiln.pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kernels", "model", "pipeline")
# libyaml's loader reads dvc.yaml in a tenth of the pure-Python one's time (a sweep fingerprints every run)
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def stage_code_sha256(stage: str) -> str:
    """sha256 over the path and bytes of each module of `stage` (a dvc.yaml stage name)."""
    digest = hashlib.sha256()
    for path in sorted(code_files(stage)):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read it to fingerprint the {stage} stage's code ({e.strerror})") from None
        digest.update(f"{path.relative_to(ROOT).as_posix()}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def code_files(stage: str) -> list[Path]:
    dvc_file = ROOT / "dvc.yaml"
    if not dvc_file.is_file():
        return [path for folder in CODE for path in (ROOT / folder).rglob("*.py")]
    try:
        deps = yaml.load(dvc_file.read_text(encoding="utf-8"), Loader=LOADER)["stages"][stage]["deps"]  # noqa: S506
        paths = [ROOT / dep for dep in deps if dep.split("/")[0] in CODE]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{dvc_file}: cannot read the {stage} stage's deps ({type(e).__name__}), which fingerprint "
                        "its code") from None
    return [module for path in paths for module in (path.rglob("*.py") if path.is_dir() else [path])]
