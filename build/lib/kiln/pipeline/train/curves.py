"""Training curves: DVCLive writes them (one TSV per metric, `step` column, for `dvc plots`), and a PNG of
them is drawn at the end because the HTML that `dvc plots show` writes loads Vega from a CDN and is blank
offline.

DVCLive is imported when a run starts, not with this module: the GPU machine that runs the benchmarks has
no dvc.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from kiln.pipeline.outputs import atomic_write_bytes

PLOTS = Path("plots/metrics")


def metric_files(directory: Path) -> dict[str, Path]:
    """metric name -> its TSV under a DVCLive directory; DVCLive keeps a name such as `val/rewards/chosen` as
    folders, with the last part as the column."""
    folder = Path(directory) / PLOTS
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).with_suffix("").as_posix(): p for p in sorted(folder.rglob("*.tsv"))}


def read_metric(path: Path) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        return [(int(row["step"]), float(row[path.stem])) for row in csv.DictReader(f, delimiter="\t")]


class Curves:
    """A DVCLive run in `directory`. Resuming from step S first drops rows logged after S (they belong to
    the steps that will be trained again), so no step appears twice in a curve. A run's other ranks pass
    `write=False`: one process logs."""

    def __init__(self, directory: Path, resume_step: int, write: bool = True):
        self.live = None
        if not write:
            return
        from dvclive import Live

        if resume_step:
            for path in metric_files(directory).values():
                _drop_rows_after(path, resume_step)
        self.live = Live(str(directory), resume=bool(resume_step), save_dvc_exp=False, dvcyaml=None, report=None)

    def add(self, step: int, values: dict[str, float]) -> None:
        if self.live is None:
            return
        self.live.step = step
        for name, value in values.items():
            self.live.log_metric(name, value)
        self.live.make_summary()

    def end(self) -> None:
        if self.live is not None:
            self.live.end()


def _drop_rows_after(path: Path, step: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split("\t")
    at = header.index("step")
    kept = [lines[0], *(line for line in lines[1:] if int(line.split("\t")[at]) <= step)]
    path.write_text("".join(kept))


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on a server or under DVC), imported on use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> Path:
    """Render `fig` to `path` atomically (temp file, then rename) and free it."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def plot_png(directory: Path, out: Path, panels: list[list[str]], title: str) -> Path | None:
    """One panel per group of metric names (drawn on shared axes), side by side; None if nothing was logged."""
    plt = pyplot()
    files = metric_files(directory)
    panels = [[n for n in names if n in files] for names in panels]
    panels = [names for names in panels if names]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, names in zip(axes[0], panels):
        for name in names:
            points = read_metric(files[name])
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 30 else None,
                    label=name)
        ax.set_xlabel("step")
        ax.set_title(", ".join(names))
        if len(names) > 1:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return save_png(fig, out)
