"""Every path a command writes goes through the one rule (pipeline/protected.py), against the escapes of issue 68:
a checkout git cannot list (its protected set came back empty), `kiln bench`'s outputs (never checked), a bind
mount or another name of a protected path, the project of --params, another checkout and kiln's own source, symbolic
links inside a run folder, --checkpoints, `convert to-hf` over a kiln model folder, and a foreign model/ in --out
found only after training. Each attack runs on a small project (tests/test_protected.py's) and is refused before
any work, in one line, with nothing changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.pipeline import layout, protected
from kiln.pipeline.commands.shared import hand_runs
from tests.test_protected import app, git, project, snapshot  # noqa: F401  (project: the fixture)

# Every path a command takes, by its parameter's name: what it writes, the rest what it reads. A new path option
# must be put in one of them (test_every_path_option_is_known), and every output is tried against the rule.
OUTPUTS = {"out", "checkpoints", "profile", "work", "pack", "plots", "metrics"}
INPUTS = {"params", "shards", "tokenizer", "corpus", "path", "fit", "runs", "size", "base", "sft_model", "start",
          "resume_from", "models", "model", "draft", "folders", "json_schema"}
# What a command needs besides the option tried (its arguments, its required options)
NEEDS = {("seeds",): ["pretrain"], ("compare",): ["a", "b"], ("scaling", "fit"): ["--runs", "x.csv", "--out", "../fit.json"],
         ("convert", "to-hf"): ["data/models/sft"], ("convert", "from-hf"): ["data/models/sft"],
         ("bench", "post"): ["--data", "chat.jsonl"]}


def commands(group=app, path=()):
    """(words, click command) of every command of the CLI."""
    for name, command in getattr(group, "commands", {}).items():
        yield from commands(command, (*path, name)) if hasattr(command, "commands") else [((*path, name), command)]


def path_params(command) -> list:
    """The command's parameters that take a path (click's objects)."""
    def takes_path(hint) -> bool:  # Path, Path | None, Annotated[Path | None, ...]
        return hint is Path or any(takes_path(a) for a in typing.get_args(hint))

    hints = typing.get_type_hints(command.callback, include_extras=True)
    return [p for p in command.params if takes_path(hints[p.name])]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result, start: str) -> str:
    output = result.output.strip()
    assert result.exit_code == 2 and output.startswith(start) and len(output.splitlines()) == 1, output
    return output


@pytest.fixture
def forget():
    """The rule reads each project once per process; a test that breaks git must leave no project read without
    it to the tests after it (nor find one read before)."""
    protected._project.cache_clear()
    protected._identities.cache_clear()
    yield
    protected._project.cache_clear()
    protected._identities.cache_clear()


def test_every_path_option_is_known():
    names = {p.name for _, command in commands() for p in path_params(command)}
    assert names and names <= OUTPUTS | INPUTS, names - OUTPUTS - INPUTS


def test_every_output_a_user_names_is_checked(project):
    """`kiln bench shard --out model/gpt.py` overwrote kiln's source: bench's outputs were never checked. Every
    output option of every command, given a tracked file, a folder of tracked files or the project itself."""
    before, tried = snapshot(project), 0
    for words, command in commands():
        for param in path_params(command):
            if param.name not in OUTPUTS:
                continue
            for target in ("README.md", "pipeline", "."):
                if param.param_type_name == "argument":
                    refused(invoke(*words, *NEEDS[words], target, "--force"), f"error: OUT {target}:")
                else:
                    option = param.opts[0]
                    refused(invoke(*words, *NEEDS.get(words, []), option, target), f"error: {option} {target}")
                tried += 1
    assert tried > 80
    assert snapshot(project) == before


def test_bench_writes_under_metrics_bench(project):
    """metrics/bench/ is where the benchmarks' committed results go: a named output there passes the rule (this
    project has no corpus, so the benchmark then stops for want of one), anywhere else in metrics/ it does not."""
    refused(invoke("bench", "shard", "--out", "metrics/eval.json"), "error: --out metrics/eval.json: ")
    result = invoke("bench", "shard", "--out", "metrics/bench/shard-2.json")
    assert "--out" not in result.output and "corpus" in result.output, result.output


def commit_notes(project: Path) -> None:
    """A tracked file that neither dvc.yaml nor layout names, in a folder of its own: only git protects it."""
    (project / "notes").mkdir()
    (project / "notes/a.md").write_text("mine\n")
    git(project, "add", "notes")
    git(project, "commit", "-qm", "notes")


@pytest.fixture(params=["no git", "dubious ownership", "no repository"])
def unlisted(request, project, tmp_path, monkeypatch, forget) -> str:
    """The project with git unable to list it: no git on PATH, a checkout of another owner (without
    safe.directory), or no repository at all (a tarball of the project). Returns what the refusal says."""
    commit_notes(project)
    if request.param == "no git":
        (tmp_path / "bin").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
        return "git did not run"
    if request.param == "dubious ownership":
        if os.geteuid() != 0:
            pytest.skip("changing the repository's owner needs root")
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.gitconfig with a safe.directory
        monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
        for name in ("XDG_CONFIG_HOME", "GIT_CONFIG_GLOBAL"):
            monkeypatch.delenv(name, raising=False)
        for folder, _, files in os.walk(project / ".git"):
            for name in [folder, *(os.path.join(folder, f) for f in files)]:
                os.chown(name, 4321, 4321)
        return "dubious ownership"
    shutil.rmtree(project / ".git")
    return "no git repository holds it"


def test_a_project_git_cannot_list_is_protected_whole(project, unlisted):
    """`tracked_files` returned [] when git could not read the checkout: `kiln scaling size --out
    tests/conftest.py` overwrote a tracked file and `kiln convert to-hf MODEL docs --force` deleted docs/*.md.
    Now everything that exists in the project but runs/ is protected, and the refusal says why."""
    before = snapshot(project)
    for args in (["scaling", "size", "--out", "notes/a.md"], ["pretrain", "--out", "notes/new", "--force"],
                 ["convert", "to-hf", "data/models/sft", "notes", "--force"]):
        output = refused(invoke(*args), "error: ")
        assert "exists in the project" in output and unlisted in output, output
    assert snapshot(project) == before
    for target in ("runs/mine", "new-folder"):  # nothing there yet: past the rule
        result = invoke("data", "prepare", "--set", "source=nothing.txt", "--out", target)
        assert "nothing.txt" in result.output, result.output


def test_git_is_asked_about_the_projects_own_repository(project, monkeypatch, forget):
    """A GIT_DIR from the environment (a hook, a wrapper) pointed git elsewhere; the project's files are what its
    own repository tracks."""
    commit_notes(project)
    monkeypatch.setenv("GIT_DIR", str(project / "nowhere"))
    assert "tracked by git" in refused(invoke("scaling", "size", "--out", "notes/a.md"), "error: --out notes/a.md: ")


def test_another_name_of_a_protected_file_is_refused(project, tmp_path):
    """Paths were compared as spellings: a hard link (or a bind mount, or a case variant) of a tracked file was
    not it. Identities (device, inode) are compared now."""
    (tmp_path / "elsewhere").mkdir()
    os.link(project / "README.md", tmp_path / "elsewhere/README.md")
    output = refused(invoke("plan", "memory", "--out", tmp_path / "elsewhere/README.md"), "error: --out ")
    assert f"(that is {project / 'README.md'})" in output and "tracked by git" in output


def test_a_bind_mount_of_a_project_folder_is_the_folder(project, tmp_path):
    """`kiln plan memory --out M/gpt.py` with M a bind mount of the project's model/ overwrote model/gpt.py."""
    mount = tmp_path / "mount"
    mount.mkdir()
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace for a bind mount (unshare -rm)")
    before = (project / "model/gpt.py").read_bytes()
    run = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount --bind model "{mount}" && exec "{sys.executable}" '
                          f'-m kiln.pipeline.cli plan memory --out "{mount}/gpt.py"'], cwd=project,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and f"(that is {project / 'model/gpt.py'})" in run.stderr, run.stdout + run.stderr
    assert (project / "model/gpt.py").read_bytes() == before


def test_every_project_a_run_could_reach_is_protected(project, tmp_path_factory, monkeypatch):
    """Only the working folder was a project: `kiln pretrain --params P/params.yaml --out P --force` from elsewhere
    deleted P/model/*.py, `kiln convert to-hf MODEL <another checkout> --force` replaced it, .git and all. Now a
    folder holding a .git or a dvc.yaml at or above the output, the --params file's project (and the folders
    above it) and kiln's own source tree are projects too."""
    other = tmp_path_factory.mktemp("other") / "checkout"
    git(project.parent, "clone", "-q", str(project), str(other))
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    before, theirs = snapshot(project), sorted(p.name for p in other.iterdir())  # its link points into no data/
    params = project / "params.yaml"
    refused(invoke("pretrain", "--params", params, "--out", project, "--force"), f"error: --out {project}: the project")
    refused(invoke("data", "prepare", "--params", params, "--out", project.parent, "--force"),
            f"error: --out {project.parent}: the project folder {project} or one above it")
    refused(invoke("convert", "to-hf", project / "data/models/sft", other, "--force"),
            f"error: OUT {other}: the project")
    refused(invoke("data", "prepare", "--set", "source=nothing.txt", "--out", protected.SOURCE.parent, "--force"),
            f"error: --out {protected.SOURCE.parent}: the project folder {protected.SOURCE} or one above it")
    assert snapshot(project) == before and sorted(p.name for p in other.iterdir()) == theirs
    assert (other / ".git/HEAD").is_file()


@pytest.mark.parametrize("entry, link_to", [("metrics", "metrics"), ("checkpoints", "data"),
                                            ("checkpoints/pretrain.lock", "README.md")])
def test_a_symbolic_link_in_a_run_folder_is_refused(project, tmp_path, entry, link_to):
    """`--out X` with X/metrics linking to the project's metrics/ overwrote them (no --force needed), X/checkpoints
    linking into data/ wrote the DAG's resume state, a lock file linking to a tracked file would be truncated."""
    run = tmp_path / "run"
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    (run / entry).symlink_to(project / link_to)
    before = snapshot(project)
    output = refused(invoke("pretrain", "--out", run), f"error: --out {run}: {run / entry} is a symbolic link")
    assert str(project / link_to) in output
    assert snapshot(project) == before


def test_a_hand_run_writes_where_its_folder_was_at_the_start(project, tmp_path):
    """A --out that is a symlink re-pointed while the run goes on reached the project: the run folder is resolved
    once, before any work, and the stage is handed that path."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    seen = {}

    @hand_runs("prepare", "corpus")
    def stage(params: Path = layout.PARAMS, set_: list[str] = [], out: Path = layout.CORPUS,  # noqa: B006
              force: bool = False):
        link.unlink()
        link.symlink_to(project)  # re-pointed mid-run
        seen.update(out=out, root=layout.hand_run_root(), metrics=layout.metrics_dir())

    stage(params=layout.PARAMS, set_=[], out=link, force=False)
    assert seen == {"out": real / "corpus", "root": real, "metrics": real / "metrics"}


@pytest.mark.parametrize("command", [["pretrain"], ["data", "shard"], ["scaling", "sweep"]])
@pytest.mark.parametrize("target", ["data/models/base", "pipeline/ckpt", "model"])
def test_checkpoints_go_through_the_rule(project, tmp_path, command, target):
    """--checkpoints was outside the rule: into data/models/base, or pipeline/."""
    before = snapshot(project)
    refused(invoke(*command, "--checkpoints", target, "--out", tmp_path / "run"), f"error: --checkpoints {target}: ")
    assert snapshot(project) == before and not (tmp_path / "run").exists()


def test_checkpoints_lock_beside_them_may_not_be_a_link(project, tmp_path):
    (tmp_path / "ckpt.lock").symlink_to(project / "README.md")
    refused(invoke("pretrain", "--checkpoints", tmp_path / "ckpt", "--out", tmp_path / "run"),
            f"error: --checkpoints {tmp_path / 'ckpt'}: {tmp_path / 'ckpt.lock'} is a symbolic link")


def model_folder(folder: Path, config: dict) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"weights")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("direction, config", [("to-hf", {"model": {"n_layer": 1}, "tokenizer_sha256": None}),
                                               ("from-hf", {"architectures": ["GPT2LMHeadModel"]})])
def test_convert_replaces_the_other_kind_of_model_folder_only_with_force(project, tmp_path, direction, config):
    """`kiln convert to-hf MODEL OUT` replaced a kiln model folder OUT (its names are all names a transformers
    folder holds) without --force; likewise from-hf over a transformers folder. Refused before any work (MODEL
    is not even read)."""
    out = tmp_path / "mine"
    before = model_folder(out, config)
    output = refused(invoke("convert", direction, tmp_path / "no-such-model", out),
                     f"error: {out}: its config.json is ")
    assert "pass --force" in output
    forced = invoke("convert", direction, tmp_path / "no-such-model", out, "--force")
    assert forced.exit_code == 2 and "no-such-model" in forced.output, forced.output  # past the check, then the input
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_foreign_model_folder_in_out_is_refused_before_training(project, tmp_path):
    """`--out X` with X/model holding a user's file was refused only when the trained model was saved."""
    (tmp_path / "run/model").mkdir(parents=True)
    (tmp_path / "run/model/notes.txt").write_text("mine")
    result = invoke("pretrain", "--out", tmp_path / "run")
    said, error = result.output.strip().splitlines()  # the run's folder, then the refusal: no step was taken
    assert said.startswith("pretrain: a hand run") and result.exit_code == 2, result.output
    assert error.startswith(f"error: {tmp_path / 'run/model'}: holds 'notes.txt'"), result.output
    forced = invoke("pretrain", "--out", tmp_path / "run", "--force")  # past the check; this project has no tokenizer
    assert forced.exit_code == 2 and "notes.txt" not in forced.output and "tokenizer not found" in forced.output, \
        forced.output
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["model"]
    assert [p.name for p in (tmp_path / "run/model").iterdir()] == ["notes.txt"]
