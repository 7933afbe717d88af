"""`kiln params check` (issue 68, finding 17): every section of params.yaml checked by the classes its stages load
it with, before any stage runs; dvc.yaml's first stage, whose constant stamp every other stage depends on, so
that a bad value stops DVC before it removes a later stage's outputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fails_in_one_line, write_params
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.commands.params_check import STAMP, STAMP_TEXT
from kiln.pipeline.config import SECTIONS


@pytest.fixture(autouse=True)
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {})
    return tmp_path


def test_a_good_file_is_said_in_one_line_naming_every_section_and_stamped():
    result = CliRunner().invoke(app, ["params", "check"])
    assert result.exit_code == 0, result.output
    line, = result.output.strip().splitlines()
    assert line == f"params.yaml: every section checked ({', '.join(SECTIONS)})"
    assert STAMP.read_bytes() == STAMP_TEXT


@pytest.mark.parametrize("section", SECTIONS)
def test_every_section_is_loaded_and_checked(section):
    fails_in_one_line(["params", "check", "--set", f"{section}.nope=1"], 2, f"unknown key {section}.nope")
    assert not STAMP.exists()


@pytest.mark.parametrize(("sets", "named"), [
    (["train.precision=fp4"], "train.precision='fp4': expected fp32, bf16, fp16 or fp8"),
    (["train.precision=fp8", "dpo.adapter=lora"], "dpo.adapter=lora"),  # what two sections must agree on
    (["train.nproc_per_node=3", "sft.batch_size=16"], "sft.batch_examples=32"),
    (["scaling.depths=[1, 2]"], "scaling.depths"),
])
def test_a_bad_value_or_pair_is_refused_in_one_line(sets, named):
    fails_in_one_line(["params", "check", *(part for item in sets for part in ("--set", item))], 2, named)


def test_a_refused_file_leaves_the_stamp_as_it_was(project):
    """As DVC runs it: a bad params.yaml fails and writes nothing (DVC has removed the stamp already; a run by
    hand that fails leaves one there); a --set run only checks, never stamps."""
    assert CliRunner().invoke(app, ["params", "check"]).exit_code == 0
    write_params(project / "params.yaml", {"train": {"precision": "fp4"}})
    STAMP.unlink()
    fails_in_one_line(["params", "check"], 2, "params: train.precision='fp4'")
    assert not STAMP.exists()
    write_params(project / "params.yaml", {})
    assert CliRunner().invoke(app, ["params", "check", "--set", "train.lr=0.01"]).exit_code == 0
    assert not STAMP.exists()


def test_it_answers_without_importing_torch(project):
    """It runs as DVC's first stage on every param change: the params modules alone, no torch (seconds)."""
    code = ("import sys\nfrom kiln.pipeline.cli import app\ntry:\n    app(['params', 'check'])\n"
            "except SystemExit as e:\n    print('exit', e.code)\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=project)
    assert done.stdout.strip().splitlines()[-2:] == ["exit 0", "False"], done.stdout + done.stderr
    assert Path(project / STAMP).is_file()


def test_the_projects_own_params_pass():
    repo_params = Path(__file__).resolve().parents[1] / "params.yaml"
    result = CliRunner().invoke(app, ["params", "check", "--params", str(repo_params)])
    assert result.exit_code == 0, result.output
    assert not STAMP.exists()  # another params file: checked, not stamped
