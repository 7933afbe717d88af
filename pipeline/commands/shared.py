"""What every command shares: its common options, how it reports a failure, how it prints metrics."""

from __future__ import annotations

import functools
import glob
import hashlib
import inspect
import json
import math
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kiln.model.atomic import foreign
from kiln.pipeline import layout
from kiln.pipeline.config import check_seed
from kiln.pipeline.errors import KilnError, UserError
from kiln.pipeline.outputs import LOCK_SUFFIX, replacing
from kiln.pipeline.progress import console, print_columns
from kiln.pipeline.protected import check_output, refuse_links

ParamsOpt = Annotated[Path, typer.Option("--params", help="The params file to read.")]
SetOpt = Annotated[list[str], typer.Option("--set", help="Override a param: key=value (repeatable).")]
CorpusOpt = Annotated[Path, typer.Option(help="Corpus folder with train.parquet and val.parquet.")]
TokenizerOpt = Annotated[Path, typer.Option(help="The tokenizer.json to use.")]
OutOpt = Annotated[Path, typer.Option(help="Output folder (replaced whole, only when the stage succeeds). Given, or with "
                                           "--set, another --params or another input, the run is a hand run: "
                                           "everything it writes goes under this folder (default runs/<stage>-"
                                           "<digest>/, the same folder for the same command): model/ (or the stage's "
                                           "output), metrics/, checkpoints/; never inside the project's source, "
                                           "tracked files or the DAG's paths.")]
# read by `reports_errors`, which lets the command's output folders replace what is in the way
ForceOpt = Annotated[bool, typer.Option("--force", help="Let --out hold files that kiln's output of this kind does "
                                                        "not (by default such a folder is refused before any "
                                                        "work): a hand run writes beside them, an output folder "
                                                        "is replaced whole. Never inside the project's source, "
                                                        "tracked files or the DAG's paths.")]
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
    one folder, `--out` or `runs/<stage>-<digest>/` (named for the command's arguments and the params file's
    bytes, so the same command finds its run again and resumes it): `<run>/<output>`, `<run>/metrics/`,
    `<run>/checkpoints/<stage>` (a --checkpoints option left at its default is moved there too). A stage that
    writes `one_file` and nothing else takes a named --out as that file.

    Before any work the folder is checked: never in a project's source, its tracked files or the DAG's paths
    (pipeline/protected.py), nor a named --checkpoints; no symbolic link among what the run writes there; and,
    when it exists, holding only what such a run writes there (--force lets it hold other files, which the run
    leaves alone). The stage is handed the folder as resolved then."""

    def wrap(fn):
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}

        @functools.wraps(fn)
        def wrapper(**kwargs):
            why = [f"--set {' '.join(kwargs['set_'])}"] if kwargs.get("set_") else []
            why += [f"--{k.replace('_', '-')} {v}" for k, v in kwargs.items()
                    if k not in ("set_", "force") and not _same(v, defaults[k])]
            if not why:
                return fn(**kwargs)
            named, params = not _same(kwargs[out], defaults[out]), kwargs.get("params")
            if named and one_file:
                kwargs[out] = check_output(kwargs[out], "--out", folder=False, params=params)
                shown = kwargs[out].parent
            else:
                shown = kwargs[out] if named else run_folder(stage, why, params)
            root = check_output(shown, "--out" if named else "the hand run's folder", params=params)
            if not (named and one_file):  # a named file's folder may hold anything: only the file is replaced
                kwargs[out] = root / output
                _check_run_folder(root, bool(kwargs.get("force")), stage)
            if "checkpoints" in kwargs and not _same(kwargs["checkpoints"], defaults["checkpoints"]):
                checkpoints = kwargs["checkpoints"]
                kwargs["checkpoints"] = check_output(checkpoints, "--checkpoints", params=params)
                refuse_links(kwargs["checkpoints"].parent, f"--checkpoints {checkpoints}",
                             tuple(glob.escape(kwargs["checkpoints"].name) + end for end in ("", LOCK_SUFFIX)))
            main = os.environ.get("RANK", "0") == "0"
            if main:
                console.print(f"{stage}: a hand run ({'; '.join(why)}), writing under {shown}/ (the same command "
                              "goes on from its last checkpoint if stopped)", highlight=False, markup=False,
                              soft_wrap=True)
            with layout.hand_run(root):
                if "checkpoints" in kwargs and _same(kwargs["checkpoints"], defaults["checkpoints"]):
                    kwargs["checkpoints"] = layout.checkpoints(stage)
                result = fn(**kwargs)
            if main:  # said last, after the stage's own lines: what is there now, read back
                wrote = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(root).iterdir()
                               if p.name in RUN_FOLDER)
                console.print(f"{stage}: the hand run wrote {', '.join(wrote) or 'nothing'} under {shown}/",
                              highlight=False, markup=False, soft_wrap=True)
            return result

        return wrapper

    return wrap


def writes(area: Path | None = None, **outputs: bool):
    """Put every output path a command's user names (`outputs`: option name -> whether it is a folder; an
    option left at its default, or None, is the command's own) through the rule of pipeline/protected.py before
    any work, `area` allowed (`check_output`), and hand the command the paths as resolved then; a named folder
    may hold no symbolic link."""

    def wrap(fn):
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}

        @functools.wraps(fn)
        def wrapper(**kwargs):
            for name, folder in outputs.items():
                if kwargs[name] is None or _same(kwargs[name], defaults[name]):
                    continue
                option, given = f"--{name.replace('_', '-')}", kwargs[name]
                kwargs[name] = check_output(given, option, folder, kwargs.get("params"), area)
                if folder:
                    refuse_links(kwargs[name], f"{option} {given}")
            return fn(**kwargs)

        return wrapper

    return wrap


# What hand runs write into their folder: each stage's output (one folder can take a chain of them, the corpus
# of `kiln data prepare --out run` read by `kiln tokenizer train --corpus run/corpus --out run`), metrics/ and
# checkpoints/, and the writer's temp, leftover and lock files beside them (model/atomic.py, outputs.exclusive)
RUN_FOLDER = ("corpus", "tokenizer", "shards", "scaling", "size.json", "model", "metrics", "checkpoints")
RUN_FOLDER_HOLDS = tuple(f"{name}{end}" for name in RUN_FOLDER for end in ("", ".lock", ".tmp-*", ".new-*", ".old-*"))


def _check_run_folder(root: Path, force: bool, stage: str) -> None:
    """A hand run's existing folder: no symbolic link among what hand runs write there, and nothing else there
    unless --force."""
    if not root.is_dir():
        return
    refuse_links(root, f"--out {root}", RUN_FOLDER_HOLDS)
    if not force and (names := foreign(root, RUN_FOLDER_HOLDS)):
        raise UserError(f"--out {root}: holds {names}, which no kiln hand run writes there; choose another --out "
                        f"for this {stage} run, or pass --force to write beside them (they are left alone)")


def _same(value, default) -> bool:
    if isinstance(value, Path) and isinstance(default, Path):
        return value.resolve() == default.resolve()
    return value == default


def run_folder(name: str, words: list[str], params: Path | None = None) -> Path:
    """runs/<name>-<12 hex digits>: a digest of the command's arguments (`words`) and the params file's bytes,
    so that the same command on the same params comes back to the same folder (and resumes what it left)."""
    digest = hashlib.sha256(json.dumps([name, words]).encode())
    if params is not None and Path(params).is_file():
        digest.update(Path(params).read_bytes())
    return layout.RUNS / f"{name}-{digest.hexdigest()[:12]}"


def reports_errors(fn):
    """Turn a KilnError into its one-line message and exit code instead of a traceback; refuse a non-finite
    number in any float option (click parses `inf` and `nan`) and a --seed outside [0, 2**63) before the command
    sees them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            for name, value in kwargs.items():
                if isinstance(value, float) and not math.isfinite(value):
                    raise UserError(f"--{name.replace('_', '-')}={value}: expected a finite number")
                if name == "seed":
                    check_seed(value, "--seed")
            with replacing(bool(kwargs.get("force"))):
                return fn(*args, **kwargs)
        except KilnError as e:
            show_error(e)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            console.print("interrupted; no output was written", highlight=False)
            raise typer.Exit(130) from None

    return wrapper


def show_error(e: KilnError, after: str = "") -> None:
    """The one error line: "error: <message>" (escaped: a message quotes input, and "[/x]" in it would be read as
    rich markup)."""
    console.print(f"[bold red]error:[/] {escape(str(e))}{escape(after)}", markup=True, soft_wrap=True)


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


