"""The README and docs/ cannot rot silently: every command in their ```bash blocks is checked (`make
check-readme` runs this file alone).

Cheap commands run as written: `kiln --help`, `kiln tokenizer encode` (on the default pipeline's tokenizer),
`dvc exp show`, `dvc metrics diff`, `dvc plots show`; the tables must read in 120 columns. The rest are checked
against what they name: a `make` target exists, a `kiln` command exists and takes every option the line gives,
and every `-S` / `--set` key=value is accepted by its params section's validation.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import one_dvc_at_a_time
from typer.main import get_command

from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section, read_params_file
from kiln.pipeline.errors import UserError
from kiln.pipeline.evaluate.params import EvalParams
from kiln.pipeline.post.grpo_params import GRPOParams
from kiln.pipeline.post.params import DPOParams, SFTParams
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.text.shard import ShardParams
from kiln.pipeline.text.sources import DataParams
from kiln.pipeline.text.tokenizer import TokenizerParams
from kiln.pipeline.train.params import ModelParams, TrainParams

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = {cls.SECTION: cls for cls in (DataParams, TokenizerParams, ShardParams, ModelParams, TrainParams,
                                         ScalingParams, SFTParams, DPOParams, GRPOParams, EvalParams)}
# `kiln <command> --set bare_key=...` means the command's own section.
OWN_SECTION = {"data prepare": "data", "tokenizer train": "tokenizer", "data shard": "shard", "pretrain": "train",
               "scaling sweep": "scaling", "scaling fit": "scaling", "scaling size": "scaling", "sft": "sft",
               "dpo": "dpo", "grpo": "grpo", "evaluate": "eval"}
RUN = {("--help",), ("tokenizer", "encode")}  # kiln commands cheap enough to run as written
WIDTH = 120


def commands(page: Path) -> list[str]:
    """The command lines of a page's ```bash blocks: continuations joined, heredoc bodies left out."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.DOTALL):
        lines, heredoc = iter(block.replace("\\\n", " ").splitlines()), None
        for line in lines:
            if heredoc is not None:
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            if match := re.search(r"<<-?\s*'?(\w+)'?", line):
                heredoc = match.group(1)
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(line.strip())
    return found


def inline_dvc(page: Path) -> list[str]:
    """The `dvc ...` commands quoted in a page's prose (`dvc ls --type model` failed there once, unchecked)."""
    return [c for c in re.findall(r"`(dvc [^`]+)`", page.read_text()) if "\n" not in c]


ALL = [(page.relative_to(REPO).as_posix(), line) for page in PAGES for line in commands(page)]
# quoted in prose: often a fragment (`dvc exp run -S eval.*`), so checked for its options, not run
INLINE = sorted({(page.relative_to(REPO).as_posix(), line) for page in PAGES for line in inline_dvc(page)})


def test_pages_have_commands():
    assert len([1 for page, _ in ALL if page == "README.md"]) >= 15


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().split()) <= 2000


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_are_files_in_the_repo(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{page.name}: link {target} is not a file in the repo"


# --- checks by the program a line starts with ----------------------------------------------------------------


def check_settings(items: list[str], section: str | None = None) -> None:
    """`key=value` items of one command line (-S or --set): known keys, and values their sections accept
    together (model.n_head must divide the model.d_model set beside it)."""
    params = read_params_file(REPO / "params.yaml")
    changed = {}
    for item in items:
        key, sep, value = item.partition("=")
        assert sep, f"{item}: expected key=value"
        sec, _, name = key.rpartition(".")
        sec = sec or section
        assert sec in SECTIONS, f"{item}: no params section {sec!r}"
        values = changed.setdefault(sec, dict(params.get(sec) or {}))
        assert name in values, f"{item}: params.yaml has no {sec}.{name}"
        values[name] = yaml.safe_load(value)
    for sec, values in changed.items():
        try:
            build_section(SECTIONS[sec], values)
        except UserError as e:
            pytest.fail(f"{' '.join(items)}: {e}")


def check_kiln(args: list[str], cwd: Path) -> None:
    command, path = get_command(app), []
    while hasattr(command, "commands") and args and not args[0].startswith("-"):
        assert args[0] in command.commands, f"kiln {' '.join(path)}: no command {args[0]!r}"
        command, path, args = command.commands[args[0]], [*path, args[0]], args[1:]
    options = {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts)
               if p.param_type_name == "option"} | {"--help": None}
    for arg in args:
        if arg.startswith("-"):
            assert arg.split("=")[0] in options, f"kiln {' '.join(path)}: no option {arg}"
    check_settings([arg for i, arg in enumerate(args) if i and args[i - 1] == "--set"],
                   OWN_SECTION.get(" ".join(path)))
    if tuple(path) in RUN or (not path and args == ["--help"]):
        run = subprocess.run([sys.executable, "-m", "kiln.pipeline.cli", *path, *args], cwd=cwd,
                             capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"})
        assert run.returncode == 0, f"kiln {' '.join(path + args)}: {run.stderr}"
        assert run.stdout.strip()


def check_make(args: list[str]) -> None:
    targets = set(re.findall(r"(?m)^([\w-]+):", (REPO / "Makefile").read_text()))
    for arg in args:
        assert "=" in arg or arg in targets, f"make {arg}: no such target"


def check_dvc_options(args: list[str]) -> None:
    """Every option of a dvc command is one its --help lists (DVC 3 took `ls --type` away)."""
    path = [a for a in itertools.takewhile(lambda a: not a.startswith("-"), args)]
    shown = subprocess.run([sys.executable, "-m", "dvc", *path, "--help"], cwd=REPO, capture_output=True, text=True)
    assert shown.returncode == 0, f"dvc {' '.join(path)}: {shown.stderr.strip()[:200]}"
    known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", shown.stdout))
    for arg in args:
        if arg.startswith("-"):
            assert arg.split("=")[0] in known, f"dvc {' '.join(path)}: no option {arg}"


def check_dvc(args: list[str], tmp_path: Path) -> None:
    check_dvc_options(args)
    if args[:2] == ["exp", "run"]:
        return check_settings([arg for i, arg in enumerate(args) if i and args[i - 1] == "-S"])
    if args[:1] == ["repro"]:
        return  # the whole pipeline: `make repro` and tests/test_dvc.py run it
    if args[:1] in (["checkout"], ["status"]) or args[:2] == ["exp", "apply"]:
        return  # changes the workspace (its options are checked above)
    if args[:1] in (["push"], ["pull"], ["remote"], ["get"], ["artifacts"]) or args[:2] in (["exp", "push"],
                                                                                          ["exp", "pull"]):
        return  # a remote's: tests/test_share.py runs each with a directory remote and a bare git origin
    assert args[:2] in (["exp", "show"], ["metrics", "diff"], ["metrics", "show"], ["plots", "show"]), \
        f"dvc {' '.join(args)}: not a command this test knows how to check"
    if args[:2] == ["plots", "show"]:
        args = [*args, "-o", str(tmp_path / "plots")]
    with one_dvc_at_a_time():
        run = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "1000"})  # a wide terminal: the table's own width
    assert run.returncode == 0, f"dvc {' '.join(args)}: {run.stderr}"
    if args[0] != "plots":
        lines = run.stdout.splitlines()
        assert len(lines) >= 3, f"dvc {' '.join(args)} printed no table"
        assert max(map(len, lines)) <= WIDTH, f"dvc {' '.join(args)}: {max(map(len, lines))} columns"


def check_torchrun(args: list[str], tmp_path: Path) -> None:
    for at, arg in enumerate(args):
        if arg == "-m" and args[at + 1] == "kiln.pipeline.cli":
            return check_kiln(args[at + 2:], tmp_path)
        if arg == "$(which kiln)":
            return check_kiln(args[at + 1:], tmp_path)
    pytest.fail(f"torchrun {' '.join(args)}: runs no kiln command")


@pytest.mark.parametrize("page,line", ALL, ids=[f"{p}:{line[:60]}" for p, line in ALL])
def test_command(page, line, tmp_path, request):
    """A command of a page's code blocks, run or checked against what it names."""
    words = shlex.split(line.replace("$(which kiln)", "'$(which kiln)'"), comments=True)
    program, args = words[0], words[1:]
    if program == "kiln":
        cwd = request.getfixturevalue("shakespeare").root if tuple(args[:2]) in RUN else tmp_path
        check_kiln(args, cwd)
    elif program == "make":
        check_make(args)
    elif program == "dvc":
        check_dvc(args, tmp_path)
    elif program == "torchrun":
        check_torchrun(args, tmp_path)
    elif program == "python" and args[:1] == ["-"]:
        return  # a script shown for reading (docs/tools.md loads a converted model in transformers)
    else:
        pytest.fail(f"{page}: {line!r}: a command this test does not know how to check")


@pytest.mark.parametrize("page,line", INLINE, ids=[f"{p}:{line[:60]}" for p, line in INLINE])
def test_dvc_quoted_in_prose_has_the_options_it_names(page, line):
    check_dvc_options(shlex.split(line)[1:])


def test_the_figures_the_readme_quotes_are_the_committed_metrics():
    """What the README says the defaults produce is what metrics/ holds in git, to the digits it quotes: a rerun
    that moves a result fails here until the README moves with it. (A training stage's own summary is DVC-cached,
    absent from a clone until `dvc pull`: the pretrained model's figures are evaluate's.)"""
    text = " ".join((REPO / "README.md").read_text().split())
    metrics = {name: json.loads((REPO / "metrics" / f"{name}.json").read_text())[name]
               for name in ("tokenizer", "scaling", "eval")}
    ev = metrics["eval"]

    def quoted(pattern: str) -> list[float]:
        found = re.search(pattern, text)
        assert found, pattern
        return [float(g) for g in found.groups()]

    def same(said: list[float], values: list[float]) -> None:
        assert said == [round(v, 2) for v in values], (said, values)
    models = ("base", "sft", "dpo", "grpo")
    same(quoted(r"BPE, ([\d.]+) bytes/token"), [metrics["tokenizer"]["bytes_per_token_val"]])
    same(quoted(r"N_opt grows as C\^([\d.]+), D_opt as C\^([\d.]+)"), [metrics["scaling"][k] for k in "ab"])
    same(quoted(r"pretrain: held-out loss ([\d.]+) nats/token \(([\d.]+) bits/byte\) on evaluate's tokens"),
         [ev["val_loss"]["base"], ev["val_bpb"]["base"]])
    same(quoted(r"held-out accuracy ([\d.]+) base, ([\d.]+) SFT, ([\d.]+) DPO"),
         [ev["posttrain/accuracy"][m] for m in models[:3]])
    same(quoted(r"preference accuracy ([\d.]+) SFT, ([\d.]+) DPO"),
         [ev["posttrain/preference_accuracy"][m] for m in ("sft", "dpo")])
    passes = ev["speaker/pass@1"]
    same(quoted(r"passages ([\d.]+) base, ([\d.]+) SFT, ([\d.]+) DPO, ([\d.]+) GRPO \(\+([\d.]+) over"),
         [*(passes[m] for m in models), passes["grpo"] - passes["sft"]])
    interval = re.search(r"\| speaker/pass@1 \| grpo \| sft \|[^\n]*\[([+-][\d.]+), ([+-][\d.]+)\]",
                         (REPO / "metrics/report.md").read_text())
    same(quoted(r"interval \[([+-][\d.]+), ([+-][\d.]+)\]"), [float(g) for g in interval.groups()])
    same(quoted(r"val bits/byte ([\d.]+) base, ([\d.]+) SFT, ([\d.]+) DPO, ([\d.]+) GRPO"),
         [ev["val_bpb"][m] for m in models])
