"""Training curves and a run that fails (issue 68, finding 11a): a run logs into its own staging folder and puts
its curves in place of the earlier run's only when it ends, so a full disk (or a kill) leaves the earlier
curves byte for byte, and says so in one line."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from conftest import tree_bytes

from kiln.pipeline.errors import StageError
from kiln.pipeline.train.curves import Curves, metric_files, read_metric, staging


def no_space_after(calls: int):
    """DVCLive's write of a row, refused by a full disk after `calls` rows have gone through."""
    from dvclive.plots.metric import Metric

    real, done = Metric.dump, []

    def dump(*args, **kwargs):
        done.append(1)
        if len(done) > calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    return dump


def logged(folder: Path, steps, loss=lambda s: 1.0 / s) -> Path:
    curves = Curves(folder, 0)
    for step in steps:
        curves.add(step, {"loss": loss(step), "tokens_per_s": 100.0 * step})
    curves.end()
    return folder


def test_a_finished_run_leaves_its_curves_in_place_and_no_staging(tmp_path):
    folder = logged(tmp_path / "metrics/pretrain", [1, 2])
    assert read_metric(metric_files(folder)["loss"]) == [(1, 1.0), (2, 0.5)]
    assert set(metric_files(tmp_path / "metrics/timings/pretrain")) == {"tokens_per_s"}
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_dir()) == [
        "metrics", "metrics/pretrain", "metrics/pretrain/plots", "metrics/pretrain/plots/metrics",
        "metrics/timings", "metrics/timings/pretrain", "metrics/timings/pretrain/plots",
        "metrics/timings/pretrain/plots/metrics"]


def test_a_full_disk_mid_run_keeps_the_earlier_curves(tmp_path, monkeypatch):
    folder = logged(tmp_path / "metrics/pretrain", [1, 2, 3])
    (folder / "curves.png").write_bytes(b"the earlier run's plot")
    before = tree_bytes(tmp_path / "metrics")
    monkeypatch.setattr("dvclive.plots.metric.Metric.dump", no_space_after(2))
    curves = Curves(folder, 0)  # a fresh run: DVCLive, pointed at the folder, deleted its TSVs here
    curves.add(1, {"loss": 9.0})
    with pytest.raises(StageError) as failed:
        curves.add(2, {"loss": 8.0, "lr": 0.1})
    assert str(failed.value) == (f"{folder}: cannot write it: No space left on device [ENOSPC]; the previous "
                                 "version, if any, is unchanged")
    assert tree_bytes(tmp_path / "metrics/pretrain") == {k.removeprefix("pretrain/"): v for k, v in before.items()
                                                         if k.startswith("pretrain/")}
    assert {k: v for k, v in tree_bytes(tmp_path / "metrics").items() if not k.startswith("timings/.partial/")} \
        == before


def test_a_full_disk_as_the_curves_are_put_in_place_keeps_the_earlier_ones_and_the_next_run_goes_on(tmp_path,
                                                                                                    monkeypatch):
    folder = logged(tmp_path / "metrics/pretrain", [2, 4])
    before = tree_bytes(folder)
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills up as the new curves are flushed, before they replace the old ones
        if "pretrain.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    curves = Curves(folder, 0)
    for step in (2, 4):
        curves.add(step, {"loss": 10.0 + step})
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StageError, match=f"^{folder}: cannot write it: No space left on device"):
        curves.end()
    assert tree_bytes(folder) == before
    assert not [p for p in folder.parent.iterdir() if p.name.startswith("pretrain.")]  # no temp folder left
    # What the failed run logged is resume state: resumed from its last step, the next run puts it in place.
    monkeypatch.setattr(os, "fsync", real_fsync)
    staged = tree_bytes(staging(folder, "results"))
    Curves(folder, 4).end()
    assert tree_bytes(folder) == staged
    assert read_metric(metric_files(folder)["loss"]) == [(2, 12.0), (4, 14.0)]


def test_a_run_stopped_before_its_end_is_resumed_from_its_own_rows(tmp_path):
    """Killed (no end()) after step 3, resumed from its checkpoint at step 2: the rows of steps 1 and 2 are the
    stopped run's, step 3 is logged again, and the finished run before them is gone only at the end."""
    folder = logged(tmp_path / "metrics/sft", [1, 2, 3], loss=lambda s: 5.0)
    stopped = Curves(folder, 0)
    for step in (1, 2, 3):
        stopped.add(step, {"loss": float(step)})
    assert read_metric(metric_files(folder)["loss"]) == [(1, 5.0), (2, 5.0), (3, 5.0)]
    resumed = Curves(folder, 2)
    resumed.add(3, {"loss": 30.0})
    resumed.end()
    assert read_metric(metric_files(folder)["loss"]) == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert json.loads((folder / "metrics.json").read_text())["step"] == 3


MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TRAIN = {"batch_size": 4, "batch_tokens": 128, "max_steps": 4, "warmup_steps": 1, "eval_every": 2,
         "eval_tokens": 256, "checkpoint_every": 2, "log_every": 2, "device": "cpu"}


def test_a_second_pretrain_into_the_same_out_on_a_full_disk_leaves_the_first_ones_curves(tiny, tmp_path,
                                                                                          monkeypatch):
    """The finding as it was met: `kiln pretrain --out run` twice, the second time with other params on a disk
    that fills up as the curves are logged."""
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(json.dumps({"model": MODEL, "train": TRAIN}))
    args = ["pretrain", "--shards", str(tiny.shards), "--tokenizer", str(tiny.tokenizer), "--out", "run"]
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    assert CliRunner().invoke(app, args).exit_code == 0
    before = tree_bytes(Path("run/metrics"))
    assert "pretrain/plots/metrics/loss.tsv" in before and "pretrain/curves.png" in before
    monkeypatch.setattr("dvclive.plots.metric.Metric.dump", no_space_after(1))
    failed = CliRunner().invoke(app, [*args, "--set", "train.lr=0.002"])
    # the run's progress lines, then the error in one line
    assert failed.exit_code == 1 and "Traceback" not in failed.output, failed.output
    assert failed.output.strip().splitlines()[-1] == ("error: run/metrics/pretrain: cannot write it: No space left "
                                                      "on device [ENOSPC]; the previous version, if any, is unchanged")
    assert {k: v for k, v in tree_bytes(Path("run/metrics")).items() if not k.startswith("timings/.partial/")} \
        == before
