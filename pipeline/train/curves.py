"""Training curves: DVCLive writes them (one TSV per metric, `step` column, for `dvc plots`), and a PNG of
them is drawn at the end, to look at without DVC (and on the GPU machine, which has no dvc).

A run logs into a folder of its own (`staging`), never into the curves' folders, and only when it ends
replaces each folder with what it logged (temp, then rename: `atomic_dir`): a run that fails (a full disk) or is
stopped leaves the curves of the run before it byte for byte. DVCLive writes in place (a fresh run deletes the
old TSVs first; its summary is truncated, then rewritten), so it is never pointed at the folders themselves.
What a run has logged is resume state, kept when it stops: a run stopped by a kill goes on from its rows, as from
its checkpoint. It sits beside the stage's timings, out of git and of what DVC hashes (DVCLive `git add`s what it
logs under `dvc exp run` when it is neither git-ignored nor an output).

DVCLive is imported when a run starts, not with this module: the GPU machine that runs the benchmarks has
no dvc.
"""

from __future__ import annotations

import contextlib
import csv
import io
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln.pipeline import layout
from kiln.pipeline.outputs import TIMING_KEYS, atomic_dir, atomic_write_bytes, writing

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
    the stage's outputs byte-identical.

    Both are logged into their `staging` folders and replace `directory` and its timings folder at `end()`; a
    write the system refuses is a one-line StageError naming the folder, whose curves stay as they were."""

    def __init__(self, directory: Path, resume_step: int, write: bool = True):
        self.lives = {}
        # A run resumed at its last step from curves already in place (no stopped run's rows staged) logs nothing:
        # rewriting them (DVCLive redoes its summary) would only open a window in which they are new and the model
        # saved after them is not.
        self.unchanged = bool(resume_step)
        if not write:
            return
        from dvclive import Live

        for kind, folder in (("results", Path(directory)), ("timings", layout.timings(directory))):
            self.unchanged = self.unchanged and not staging(directory, kind).is_dir()
            staged = _staged(folder, staging(directory, kind), resume_step)
            with writing(folder):
                self.lives[kind] = (folder, Live(str(staged), resume=bool(resume_step), save_dvc_exp=False,
                                                 dvcyaml=None, report=None))

    def add(self, step: int, values: dict[str, float]) -> None:
        for kind, (folder, live) in self.lives.items():
            logged = {k: v for k, v in values.items() if (k in TIMING_KEYS) == (kind == "timings")}
            if logged:
                self.unchanged = False
                with writing(folder):
                    live.step = step
                    for name, value in logged.items():
                        live.log_metric(name, value)
                    live.make_summary()

    def end(self) -> None:
        """Finish both DVCLive runs, then put what each logged in place of its folder (the previous run's
        curves.png goes with the rest: the stage draws its own next)."""
        for folder, live in self.lives.values():
            with writing(folder):
                live.end()
        for folder, live in self.lives.values():
            if not self.unchanged:
                with atomic_dir(folder) as tmp:
                    _copy(Path(live.dir), tmp)
            shutil.rmtree(live.dir)  # in place now: no resume state
            for parent in Path(live.dir).parents[:2]:  # the stage's staging folder, then `.partial`, once empty
                with contextlib.suppress(OSError):
                    parent.rmdir()


def curves_kept(directory: Path) -> bool:
    """Whether a run resuming into `directory` has the rows logged before it: a stopped run's, staged, or the
    curves themselves in place (DVC deletes a stage's curves before it reruns the stage: `dvc repro -f`)."""
    return staging(directory, "results").is_dir() or (Path(directory) / "metrics.json").is_file()


def staging(directory: Path, kind: str) -> Path:
    """Where a run logs the `kind` (results or timings) of the curves in `directory` until it ends."""
    return layout.timings(directory).parent / ".partial" / Path(directory).name / kind


# What of a curves folder a resumed run goes on from: DVCLive's TSVs and its summary (which holds the last step).
DVCLIVE_FILES = ("plots", "metrics.json")


def _staged(folder: Path, staged: Path, resume_step: int) -> Path:
    """`staged`, the folder a run logs the curves of `folder` into: a stopped run's, kept when this one resumes
    (its rows after `resume_step` dropped); otherwise made anew, holding `folder`'s curves when resuming and none
    when not."""
    if not (resume_step and staged.is_dir()):
        with atomic_dir(staged) as tmp:
            for name in DVCLIVE_FILES if resume_step else ():
                if (folder / name).exists():
                    _copy(folder / name, tmp / name)
    for path in metric_files(staged).values() if resume_step else ():
        _drop_rows_after(path, resume_step)
    return staged


def _copy(source: Path, target: Path) -> None:
    """A file, or a folder's files, copied to `target`. Not shutil.copytree: it gathers every failed copy into
    one shutil.Error with no errno, and a full disk must stay the OSError `writing` reports in one line."""
    for path in [source] if source.is_file() else sorted(source.rglob("*")):
        dest = target / path.relative_to(source) if path != source else target
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)


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
