"""What every command shares: its common options, how it reports a failure, how it prints metrics."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kiln.pipeline.errors import KilnError, UserError
from kiln.pipeline.outputs import replacing
from kiln.pipeline.progress import console

ParamsOpt = Annotated[Path, typer.Option("--params", help="The params file to read.")]
SetOpt = Annotated[list[str], typer.Option("--set", help="Override a param: key=value (repeatable).")]
CorpusOpt = Annotated[Path, typer.Option(help="Corpus folder with train.parquet and val.parquet.")]
TokenizerOpt = Annotated[Path, typer.Option(help="The tokenizer.json to use.")]
OutOpt = Annotated[Path, typer.Option(help="Output folder (replaced whole, only when the stage succeeds).")]
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


def print_metrics(stage: str, metrics: dict) -> None:
    console.print(f"{stage}: " + ", ".join(f"{k}={v}" for k, v in metrics.items()), highlight=False)


