"""`kiln compare`: tokens and seconds to a target val loss from groups of seed runs, on hand-made curves whose
crossings are worked out by hand below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app


def group(root: Path, name: str, runs: dict[int, tuple[list[tuple[int, float]], float]]) -> Path:
    """A `kiln seeds` folder of pretrain runs: each seed's val curve and a constant throughput (tokens/s logged
    every 50 steps), 200 steps of 1,000 tokens."""
    folder = root / name
    (folder).mkdir(parents=True)
    (folder / "command.json").write_text(json.dumps({"stage": "pretrain", "set": []}))
    for seed, (val, tps) in runs.items():
        metrics = folder / f"seed-{seed}" / "metrics"
        curves, timings = metrics / "pretrain/plots/metrics", metrics / "timings/pretrain/plots/metrics"
        curves.mkdir(parents=True)
        timings.mkdir(parents=True)
        (metrics / "pretrain.json").write_text(json.dumps({"pretrain": {"steps": 200, "tokens": 200_000}}))
        (curves / "val_loss.tsv").write_text("step\tval_loss\n" + "".join(f"{s}\t{v}\n" for s, v in val))
        (timings / "tokens_per_s.tsv").write_text("step\ttokens_per_s\n" +
                                                   "".join(f"{s}\t{tps}\n" for s in (50, 100, 150, 200)))
    return folder


def test_tokens_and_seconds_to_the_baselines_highest_final_loss(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = group(tmp_path, "adamw", {1: ([(100, 4.0), (200, 3.0)], 1000.0), 2: ([(100, 4.4), (200, 3.2)], 1000.0)})
    muon = group(tmp_path, "muon", {1: ([(100, 3.6), (200, 2.8)], 2000.0), 2: ([(100, 3.2), (200, 2.9)], 2000.0)})
    slow = group(tmp_path, "slow", {1: ([(100, 4.5), (200, 3.1)], 1000.0), 2: ([(100, 4.5), (200, 3.3)], 1000.0)})
    result = CliRunner().invoke(app, ["compare", str(base), str(muon), str(slow), "--out", "cmp"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "cmp/compare.json").read_text())
    assert report["target"] == 3.2  # the baseline's highest final loss: both its seeds reach it
    first, second, third = report["groups"]
    # adamw: seed 1 crosses 3.2 at step 100 + 0.8/1.0 x 100 = 180, seed 2 at its end, 200: 1,000 tokens a step
    assert [r["step"] for r in first["runs"].values()] == pytest.approx([180, 200])
    assert first["tokens"] == pytest.approx(190_000) and first["seconds"] == pytest.approx(190)
    # muon: seed 1 at 100 + 0.4/0.8 x 100 = 150, seed 2 at its first evaluation, 100; twice the throughput
    assert second["tokens"] == pytest.approx(125_000) and second["seconds"] == pytest.approx(62.5)
    assert second["tokens_ratio"] == pytest.approx(125 / 190) and second["seconds_ratio"] == pytest.approx(62.5 / 190)
    low, high = second["tokens_ratio_ci95"]
    assert 100 / 200 <= low <= 125 / 190 <= high <= 150 / 180  # within what any resample of the seeds can give
    assert third["runs"]["seed-2"] is None and "tokens" not in third  # never reached: no figure made up
    assert "not reached by seed-2" in result.output and "0.658" in result.output
    assert (tmp_path / "cmp/compare.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("make,named", [
    (lambda root: root / "nothing", "command.json"),
    (lambda root: group(root, "empty", {}), "seed-*"),
])
def test_a_folder_that_is_not_a_seeds_folder_is_one_line(tmp_path, monkeypatch, make, named):
    monkeypatch.chdir(tmp_path)
    good = group(tmp_path, "good", {1: ([(100, 4.0), (200, 3.0)], 1000.0)})
    bad = make(tmp_path)
    bad.mkdir(exist_ok=True)
    result = CliRunner().invoke(app, ["compare", str(good), str(bad), "--out", "cmp"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert named in result.output and str(bad) in result.output
    assert not (tmp_path / "cmp").exists()


def test_one_folder_is_not_a_comparison(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = group(tmp_path, "good", {1: ([(100, 4.0), (200, 3.0)], 1000.0)})
    result = CliRunner().invoke(app, ["compare", str(good), "--out", "cmp"])
    assert result.exit_code == 2 and "two or more" in result.output
