"""No command run by hand writes into the project: its source, its git-tracked files, the DAG's paths.

Attacks from the third hostile round: `kiln pretrain --out . --force` deleted model/*.py; `kiln data prepare --out
data` replaced the DAG's corpus; `kiln convert to-hf data/models/dpo data/models/sft` replaced the SFT model; an
--out holding a user's files was refused only after the whole run. Every such --out is refused now, before any
work, with one line, and nothing in the project changes: a property over every command that writes, each given
every protected target of a small project (and random paths inside them).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
from click.testing import CliRunner

from kiln.pipeline.cli import app as typer_app
from kiln.pipeline.protected import dag_paths

REPO = Path(__file__).resolve().parents[1]
app = typer.main.get_command(typer_app)  # built once: typer's runner rebuilds it for every call, ~50 ms each

# Every command that writes an output, and the default output it writes as the DAG's stage (run with that
# default it is the stage itself, which DVC runs: left out of the property).
COMMANDS = {
    "prepare": (["data", "prepare"], "data/corpus"),
    "tokenizer": (["tokenizer", "train"], "data/tokenizer"),
    "shard": (["data", "shard"], "data/shards"),
    "scaling sweep": (["scaling", "sweep"], "data/scaling"),
    "scaling size": (["scaling", "size"], "data/scaling/size.json"),
    "scaling fit": (["scaling", "fit", "--runs", "data/scaling/runs.csv"], None),
    "pretrain": (["pretrain"], "data/models/base"),
    "sft": (["sft"], "data/models/sft"),
    "dpo": (["dpo"], "data/models/dpo"),
    "grpo": (["grpo"], "data/models/grpo"),
    "evaluate": (["evaluate"], "metrics"),
    "seeds": (["seeds", "pretrain"], None),
    "plan memory": (["plan", "memory"], None),
    "debug overfit": (["debug", "overfit"], None),
}
FORCED = {"prepare", "tokenizer", "shard", "pretrain", "sft", "dpo", "grpo"}  # the commands with --force


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(root), *args], check=True,
                   capture_output=True)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A small kiln project: this repo's dvc.yaml and params.yaml, a few source files committed to git, and DAG
    outputs on disk (git-ignored, as DVC's are)."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    for name in ("model/gpt.py", "pipeline/cli.py", "tasks/grpo/rewards.py", "README.md", ".dvc/config"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    for name in ("data/corpus/train.parquet", "data/models/sft/config.json", "data/scaling/runs.csv",
                 "metrics/eval.json", "metrics/pretrain/curves.png"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("dag output\n")
    (root / "link").symlink_to("data/models")  # a path outside every zone by name, inside one by target
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    monkeypatch.chdir(root)
    return root


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `root` (not .git's internals): its modification time and bytes."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (Path(folder) == root and d == ".git")]
        for name in files:
            path = Path(folder) / name
            out[str(path.relative_to(root))] = (path.lstat().st_mtime_ns, path.read_bytes())
    return out


def targets(root: Path, rng: random.Random) -> list[str]:
    """Every protected place of `project`, by the names a user would type, and random paths below them."""
    tracked = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True).stdout.split()
    found = {".", "..", "./", str(root), str(root.parent), "data", "metrics", "params.yaml", "tasks", ".git/x",
             ".dvc", "link", "link/x", *tracked, *(str(p) for p in dag_paths(root / "dvc.yaml"))}
    found |= {str(Path(t).parent) for t in tracked if Path(t).parent != Path(".")}
    deeper = ["/".join([rng.choice(sorted(found - {".", "..", "./"})), *(rng.choice("abcxyz") * 3
                                                                          for _ in range(rng.randint(1, 3)))])
              for _ in range(12)]
    return sorted(found | set(deeper))


def test_no_command_writes_into_the_project(project):
    rng = random.Random(0)
    places = [t for t in targets(project, rng) if not t.startswith(("link", str(project.parent)))] + \
        ["link", "link/x"]
    before = snapshot(project)
    tried = 0
    for name, (args, default) in COMMANDS.items():
        for target in places:
            if default is not None and Path(target) == Path(default):
                continue  # the DAG's own stage
            for force in ([], ["--force"]) if name in FORCED else ([],):
                result = CliRunner().invoke(app, [*args, "--out", target, *force])
                output = result.output.strip()
                assert result.exit_code == 2 and output.startswith("error: --out ") and \
                    len(output.splitlines()) == 1, f"kiln {' '.join(args)} --out {target} {force}: {output}"
                tried += 1
    for args in (["convert", "to-hf", "data/models/sft"], ["convert", "from-hf", "data/models/sft"]):
        for target in places:
            result = CliRunner().invoke(app, [*args, target])
            assert result.exit_code == 2 and result.output.startswith("error: OUT "), result.output
            tried += 1
    assert tried > 500
    assert snapshot(project) == before


@pytest.mark.parametrize("target", ["runs/mine", "elsewhere"])
def test_a_place_outside_every_zone_is_allowed(project, target, tmp_path):
    """The check lets a hand run write where nothing is the project's: a new folder of its own (it then fails
    for want of the DAG's inputs, which this project does not have, but past the check)."""
    result = CliRunner().invoke(app, ["data", "prepare", "--set", "source=nothing.txt", "--out", target])
    assert result.exit_code == 2 and "nothing.txt" in result.output, result.output
    assert result.output.startswith(f"prepare: a hand run (--set source=nothing.txt; --out {target}), writing "
                                    f"under {target}/"), result.output


def test_a_folder_holding_user_files_is_refused_before_any_work(project):
    """An --out holding a user's notes was refused only after the whole run, which left checkpoints and curves
    beside them. Now: refused at once, the folder as it was; with --force the run writes beside the notes."""
    mine = project.parent / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["data", "prepare", "--set", "source=nothing.txt", "--out", str(mine)])
    assert result.exit_code == 2 and "holds 'notes.txt', which no kiln hand run writes there" in result.output
    assert "nothing.txt" not in result.output  # refused before the source was looked at
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    forced = CliRunner().invoke(app, ["data", "prepare", "--set", "source=nothing.txt", "--out", str(mine),
                                      "--force"])
    assert "nothing.txt" in forced.output and (mine / "notes.txt").read_text() == "mine"


def test_an_existing_file_as_out_is_one_line(project, tmp_path):
    """`--out <an existing file>` gave NotADirectoryError / FileExistsError tracebacks."""
    file = tmp_path / "a-file"
    file.write_text("mine")
    for args in (["pretrain"], ["data", "prepare"], ["evaluate"]):
        result = CliRunner().invoke(app, [*args, "--out", str(file)])
        assert result.exit_code == 2 and result.output.strip() == f"error: --out {file}: a file; expected a " \
            "folder (or a path that does not exist yet)", result.output
    assert file.read_text() == "mine"


def test_the_same_hand_run_comes_back_to_its_folder(project):
    """A hand run without --out killed with -9 could not be resumed: the next one went to a new runs/ folder.
    The folder is named for the command and the params' bytes, printed at the start."""
    def folder(*args: str) -> str:
        out = CliRunner().invoke(app, ["data", "prepare", *args]).output
        return out.split("writing under ", 1)[1].split("/ ", 1)[0]

    first = folder("--set", "source=a.txt")
    assert first.startswith("runs/prepare-") and first == folder("--set", "source=a.txt")
    assert folder("--set", "source=b.txt") != first
    params = Path("params.yaml")
    params.write_text(params.read_text() + "\n# changed\n")
    assert folder("--set", "source=a.txt") != first  # other params, another run


def test_the_dvc_yaml_paths_are_read(project):
    paths = set(map(str, dag_paths(project / "dvc.yaml")))
    assert {"data/corpus", "data/models", "metrics/eval.json", "metrics/pretrain/plots/metrics/loss.tsv",
            "metrics/grpo/curves.png", "data/models/base", "pipeline/outputs.py"} <= paths
    assert not any("${" in p for p in paths)
