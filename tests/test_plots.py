"""Plots people can read: `dvc plots show` draws with no network, every plot dvc.yaml declares renders, and the
training-curve PNGs draw the panels whose metrics were logged."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.pipeline.tools import offline_plots
from kiln.pipeline.train.curves import Panel, plot_png

ROOT = Path(__file__).resolve().parents[1]
NETWORK_SCRIPT = re.compile(r"<script[^>]*\bsrc\s*=\s*[\"']?(https?:)?//", re.IGNORECASE)


def test_plots_page_carries_vega_inline():
    page = offline_plots.page()
    assert "{plot_divs}" in page and "{scripts}" not in page
    assert not NETWORK_SCRIPT.search(page)
    assert "window.vegaEmbed" in page and "window.vegaLite" in page


def test_dvc_plots_show_renders_every_plot_offline(tmp_path):
    """dvc.yaml's plots over the committed metrics, with rows standing in for the training curves (DVC-cached
    outputs: a clone has them after `dvc pull`, CI's has none): the HTML holds one chart or image per declared plot
    and loads nothing remote (the page comes from .dvc/config, as a user's plain `dvc plots show` gets it)."""
    project = tmp_path / "project"
    committed = subprocess.run(["git", "ls-files", "dvc.yaml", "params.yaml", ".dvcignore", ".dvc", "metrics"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in committed:
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, project / name)
    declared = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    charts = [next(iter(p)) for p in declared if isinstance(p, dict)]
    images = [p for p in declared if isinstance(p, str) and p.endswith(".png")]
    curves = [(path, column) for p in declared if isinstance(p, dict) for spec in p.values()
              if isinstance(spec.get("y"), dict) for path, column in spec["y"].items() if path not in committed]
    assert {path.split("/")[1] for path, _ in curves} == {"pretrain", "sft", "dpo", "grpo"}
    for path, column in curves:
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(f"step\t{column}\n0\t2.0\n10\t1.5\n")
    for image in images:
        if image not in committed:
            shutil.copyfile(ROOT / "metrics/scaling/isoflops.png", project / image)
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    template = project / ".dvc/plots/offline.html"
    template.write_text(offline_plots.page())
    out = tmp_path / "plots"
    run = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", str(out)], cwd=project,
                         capture_output=True, text=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert run.returncode == 0, run.stderr
    assert "failed" not in (run.stdout + run.stderr).lower()
    html = (out / "index.html").read_text()
    assert not NETWORK_SCRIPT.search(html)
    assert html.count("vegaEmbed(") == len(charts)
    for image in images:
        assert image in html
    config = (ROOT / ".dvc" / "config").read_text()
    assert re.search(r"html_template\s*=\s*plots/offline\.html", config)


def _log(directory: Path, name: str, rows: list[tuple[int, float]]) -> None:
    path = directory / "plots" / "metrics" / f"{name}.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    leaf = Path(name).name
    path.write_text("step\t" + leaf + "\n" + "".join(f"{s}\t{v}\n" for s, v in rows))


def test_curves_png_draws_logged_panels_only(tmp_path):
    _log(tmp_path, "loss", [(1, 3.0), (2, 2.5), (3, 2.0)])
    _log(tmp_path, "val/rewards/chosen", [(2, 0.1), (3, 0.2)])
    panels = [Panel("loss", "nats/token", {"loss": "train", "val_loss": "held-out"}),
              Panel("rewards", "nats", {"val/rewards/chosen": "chosen"}),
              Panel("never logged", "x", {"absent": "absent"})]
    out = plot_png(tmp_path, tmp_path / "curves.png", panels, "test")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(out).size
    assert (width, height) == (pytest.approx(2 * 4.4 * 110, abs=2), pytest.approx(3.3 * 110, abs=2))  # 1 row, 2 panels
    assert plot_png(tmp_path, tmp_path / "none.png", [Panel("x", "x", {"absent": "a"})], "t") is None
    assert not (tmp_path / "none.png").exists()
