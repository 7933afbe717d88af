"""What every command shares: its common options, how it reports a failure, how it prints metrics."""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kiln.pipeline import layout
from kiln.pipeline.errors import KilnError, UserError
from kiln.pipeline.outputs import replacing
from kiln.pipeline.progress import console, print_columns

ParamsOpt = Annotated[Path, typer.Option("--params", help="The params file to read.")]
SetOpt = Annotated[list[str], typer.Option("--set", help="Override a param: key=value (repeatable).")]
CorpusOpt = Annotated[Path, typer.Option(help="Corpus folder with train.parquet and val.parquet.")]
TokenizerOpt = Annotated[Path, typer.Option(help="The tokenizer.json to use.")]
OutOpt = Annotated[Path, typer.Option(help="Output folder (replaced whole, only when the stage succeeds). Given, or with "
                                           "--set, another --params or another input, the run is a hand run: "
                                           "everything it writes goes under this folder (default runs/<stage>-"
                                           "<time>/): model/ (or the stage's output), metrics/, checkpoints/.")]
# read by `reports_errors`, which lets the command's output folders replace what is in the way
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace --out even if it holds files that kiln's output "
                                                        "of this kind does not (by default such a folder is "
                                                        "refused).")]
ResumeOpt = Annotated[Path | None, typer.Option(help="A checkpoint (a step_NNNNNNNN folder, of any run) to go on from "
                                                     "with these params while this run has none of its own.")]


def SamplingOpt(help: str, default: object, kind: type = float):
    """A sampling option of `generate` and `chat`: unset means the one default both share (serve/request.py)."""
    return Annotated[kind | None, typer.Option(help=f"{help} (default: {'none' if default is None else default})")]




@functools.cache
def _params_lines() -> tuple[str, ...]:
    """kiln's own params.yaml, beside the package, read once however many commands quote it."""
    try:
        return tuple((Path(__file__).resolve().parents[2] / "params.yaml").read_text(encoding="utf-8").splitlines())
    except OSError:
        return ()


def params_help(*sections: str) -> str:
    """The keys of params.yaml's `sections` with their defaults and comments, as a command's help epilog: what
    `--set key=value` can change, without opening the file (kiln's own params.yaml, beside the package)."""
    out, inside = [], None
    for line in _params_lines():
        if line and not line.startswith((" ", "#")):
            inside = line.rstrip(":") if line.rstrip(":") in sections else None
            if inside:
                out.append(f"[bold]{inside}[/]:")
        elif inside and line.startswith("  ") and not line.startswith("   ") and not line.lstrip().startswith("#") \
                and ":" in line:  # a key of the section (not an item of a nested list)
            key_value, _, comment = line.strip().partition("  #")
            out.append(f"  {escape(key_value.strip())}" + (f"  [dim]{escape(comment.strip())}[/]" if comment else ""))
    if not out:
        return ""
    return "Params (params.yaml's defaults; change one with --set section.key=value):\n\n" + "\n".join(out)


def hand_runs(stage: str, output: str, out: str = "out", one_file: bool = False):
    """Keep a stage command run by hand away from the DAG's outputs.

    The command is the DAG's stage only as dvc.yaml runs it: params.yaml, no --set, every path at its default.
    Otherwise it is a hand run: what it writes (its `output`, metrics, curves, timings, checkpoints) goes under
    one folder, `--out` or `runs/<stage>-<time>/`: `<run>/<output>`, `<run>/metrics/`, `<run>/checkpoints/<stage>`
    (a --checkpoints option left at its default is moved there too). A stage that writes `one_file` and nothing
    else takes a named --out as that file."""

    def wrap(fn):
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}

        @functools.wraps(fn)
        def wrapper(**kwargs):
            why = [f"--set {' '.join(kwargs['set_'])}"] if kwargs.get("set_") else []
            why += [f"--{k.replace('_', '-')} {v}" for k, v in kwargs.items()
                    if k not in ("set_", "force") and not _same(v, defaults[k])]
            if not why:
                return fn(**kwargs)
            named = not _same(kwargs[out], defaults[out])
            root = (kwargs[out].parent if one_file else kwargs[out]) if named else new_run(stage)
            if not (named and one_file):
                kwargs[out] = root / output
            with layout.hand_run(root):
                if "checkpoints" in kwargs and _same(kwargs["checkpoints"], defaults["checkpoints"]):
                    kwargs["checkpoints"] = layout.checkpoints(stage)
                try:
                    result = fn(**kwargs)
                except KeyboardInterrupt:
                    if not named:
                        console.print(f"to go on from its last checkpoint: the same command with --out {root}",
                                      highlight=False, soft_wrap=True)
                    raise
            if os.environ.get("RANK", "0") == "0":  # said last, after the stage's own lines, on one rank
                console.print(f"{stage}: a hand run ({'; '.join(why)}): what it wrote is under {root}/, none of the "
                              "DAG's outputs", highlight=False, soft_wrap=True)
            return result

        return wrapper

    return wrap


def _same(value, default) -> bool:
    if isinstance(value, Path) and isinstance(default, Path):
        return value.resolve() == default.resolve()
    return value == default


def new_run(stage: str) -> Path:
    """runs/<stage>-<local time>, with -2, -3... for a second run in the same second."""
    base = layout.RUNS / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def reports_errors(fn):
    """Turn a KilnError into its one-line message and exit code instead of a traceback; refuse a non-finite
    number in any float option (click parses `inf` and `nan`) before the command sees it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            for name, value in kwargs.items():
                if isinstance(value, float) and not math.isfinite(value):
                    raise UserError(f"--{name.replace('_', '-')}={value}: expected a finite number")
            with replacing(bool(kwargs.get("force"))):
                return fn(*args, **kwargs)
        except KilnError as e:
            # escape: a message quotes input, and "[/x]" in it would be read as rich markup
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            console.print("interrupted; no output was written", highlight=False)
            raise typer.Exit(130) from None

    return wrapper


# Rates a stage reports over its whole run, unlike the progress line's "now" (since the last log line).
_AVERAGES = frozenset({"tokens_per_s", "rollout_tokens_per_s", "mb_per_s", "mfu"})


def print_metrics(stage: str, metrics: dict) -> None:
    """The stage's summary as an aligned table of plain lines (nested values under dotted keys), never wrapped."""
    print_columns(f"{stage}:", [[k, f"{_value(v)}{'  (stage average)' if k in _AVERAGES else ''}"]
                                for k, v in _flat(metrics)], indent="  ")


def _flat(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _value(value) -> str:
    if isinstance(value, float):  # every digit the metrics file has (stages round what they report)
        return f"{value:,}" if abs(value) < 1e15 else f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


