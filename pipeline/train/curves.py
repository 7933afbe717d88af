"""Training curves: DVCLive writes them (one TSV per metric, `step` column, for `dvc plots`), and a PNG of
them is drawn at the end, to look at without DVC (and on the GPU machine, which has no dvc).

DVCLive is imported when a run starts, not with this module: the GPU machine that runs the benchmarks has
no dvc.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from kiln.pipeline import layout
from kiln.pipeline.outputs import TIMING_KEYS, atomic_write_bytes

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
    `write=False`: one process logs.

    Series that measure the machine rather than the model (tokens/s: `TIMING_KEYS`) go to a second DVCLive run
    in `layout.timings(directory)`, outside the folder DVC hashes, so a rerun that trains the same model leaves
    the stage's outputs byte-identical."""

    def __init__(self, directory: Path, resume_step: int, write: bool = True):
        self.lives = {}
        if not write:
            return
        from dvclive import Live

        for kind, folder in (("results", Path(directory)), ("timings", layout.timings(directory))):
            if resume_step:
                for path in metric_files(folder).values():
                    _drop_rows_after(path, resume_step)
            self.lives[kind] = Live(str(folder), resume=bool(resume_step), save_dvc_exp=False, dvcyaml=None,
                                    report=None)

    def add(self, step: int, values: dict[str, float]) -> None:
        if not self.lives:
            return
        for kind, live in self.lives.items():
            logged = {k: v for k, v in values.items() if (k in TIMING_KEYS) == (kind == "timings")}
            if logged:
                live.step = step
                for name, value in logged.items():
                    live.log_metric(name, value)
                live.make_summary()

    def end(self) -> None:
        for live in self.lives.values():
            live.end()


def _drop_rows_after(path: Path, step: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split("\t")
    at = header.index("step")
    kept = [lines[0], *(line for line in lines[1:] if int(line.split("\t")[at]) <= step)]
    atomic_write_bytes(path, "".join(kept).encode())  # a kill mid-write must not lose the curve


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on a server or under DVC), imported on use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> Path:
    """Render `fig` to `path` atomically (temp file, then rename) and free it. Constrained layout keeps titles,
    axis labels and the legends placed outside the axes from overlapping."""
    buf = io.BytesIO()
    fig.set_layout_engine("constrained")
    fig.savefig(buf, format="png", dpi=110)
    pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


@dataclass(frozen=True)
class Panel:
    """One axes of a curves figure: metric name -> legend label, drawn against step."""

    title: str
    ylabel: str
    series: dict[str, str]


def plot_png(directory: Path, out: Path, panels: list[Panel], title: str, columns: int = 3) -> Path | None:
    """The panels whose metrics were logged, `columns` to a row; None if nothing was logged. A legend sits
    under its axes, where it cannot hide a curve."""
    plt = pyplot()
    files = metric_files(directory)
    panels = [Panel(p.title, p.ylabel, {n: label for n, label in p.series.items() if n in files}) for p in panels]
    panels = [p for p in panels if p.series]
    if not panels:
        return None
    columns = min(columns, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 3.3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for name, label in panel.series.items():
            points = read_metric(files[name])
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 30 else None,
                    label=label)
        ax.set(xlabel="step", ylabel=panel.ylabel, title=panel.title)
        if len(panel.series) > 1:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(panel.series), frameon=False,
                      fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return save_png(fig, out)
