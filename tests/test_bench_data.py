"""`kiln bench data` (pipeline/tools/bench_data.py): the measuring of a command checked against a process whose
memory and CPU time the test sets, and the whole command on a sliver of Shakespeare with its kiln commands run
in this process (each child would cost a Python start with torch)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.errors import StageError
from kiln.pipeline.tools import bench_data

from conftest import write_params

# A grandchild that holds 150 MB (bytes it wrote, so resident) and burns 0.4 s of CPU.
GRANDCHILD = """
import time
held = b"x" * 150_000_000
start = time.process_time()
while time.process_time() - start < 0.4:
    pass
"""


def test_run_measured_counts_a_grandchilds_memory_and_cpu(tmp_path):
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {GRANDCHILD!r}], check=True)"
    usage = bench_data.run_measured([sys.executable, "-c", code], tmp_path)
    assert usage.processes == 2
    assert 150 <= usage.peak_rss_mb < 400
    # Counted once, though the child waited for the grandchild; a busy machine may delay the last poll before
    # the grandchild ends (every 20 ms when idle), so its last moments can be missed.
    assert 0.25 <= usage.cpu_seconds < 1.5


def test_run_measured_reports_a_failure_in_one_line(tmp_path):
    with pytest.raises(StageError, match="boom"):
        bench_data.run_measured([sys.executable, "-c", "raise SystemExit('boom')"], tmp_path)


def test_bench_data_command(tmp_path, monkeypatch):
    def in_process(argv, cwd):
        if argv[1] == "-c":  # the import baseline
            return bench_data.Usage(cpu_seconds=0.5, peak_rss_mb=50.0, processes=1)
        with contextlib.chdir(cwd):
            result = CliRunner().invoke(app, argv[3:])
        assert result.exit_code == 0, result.output
        return bench_data.Usage(cpu_seconds=1.5, peak_rss_mb=80.0, processes=1)

    monkeypatch.setattr(bench_data, "run_measured", in_process)
    params = write_params(tmp_path / "params.yaml", {"data": {"workers": 1, "val_fraction": 0.4},
                                                     "tokenizer": {"vocab_size": 300}, "shard": {"shard_tokens": 1024}})
    out = tmp_path / "bench/data.json"
    result = CliRunner().invoke(app, ["bench", "data", "--params", str(params), "--scales", "1,2", "--max-mb", "0.05",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "x2 over x1: prepare peak RSS 1.00x" in result.output
    rows = json.loads(out.read_text())["results"]
    assert [(r["stage"], r["scale"]) for r in rows] == [(s, k) for k in (1, 2) for s in bench_data.STAGES]
    prepare = {r["scale"]: r for r in rows if r["stage"] == "prepare"}
    one, two = (int(prepare[k]["what"].split()[0].replace(",", "")) for k in (1, 2))
    assert two == 2 * one and prepare[1]["mb"] <= 0.05 < prepare[2]["mb"]  # a copy is no duplicate
    for r in rows:
        assert r["cpu_seconds"] == 1.0 and r["growth_mb"] == 30.0  # less the imports' share
        assert r["mb_per_cpu_s"] == pytest.approx(r["mb"], abs=1e-3)


def test_bench_data_refuses_bad_scales(tmp_path):
    result = CliRunner().invoke(app, ["bench", "data", "--scales", "1,x", "--out", str(tmp_path / "o.json")])
    assert result.exit_code == 2 and "--scales" in result.output and len(result.output.strip().splitlines()) == 1
