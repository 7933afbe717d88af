"""`kiln`: one typer app, one command per stage (what dvc.yaml runs) plus tools around them.

Every stage command reads its section of params.yaml (`--params`), takes `--set key=value` overrides, and
exits 0 on success, 1 when the work fails, 2 on bad input, with one line saying what was wrong. The commands
live in pipeline/commands/, one module per group; each imports its stage's code inside the command, so that
`kiln --help` loads no torch.
"""

from __future__ import annotations

import typer

from kiln.pipeline.commands import bench, data, evaluate, params_check, scaling, serving, tokenizer, tools, training

app = typer.Typer(help="kiln: an LLM training pipeline, one command per DVC stage.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"kiln {version('kiln')}")
        raise typer.Exit()


@app.callback()
def options(_version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                         help="Print kiln's version and exit.")) -> None:
    """kiln: an LLM training pipeline, one command per DVC stage."""


app.add_typer(params_check.app, name="params")
app.add_typer(data.app, name="data")
app.add_typer(tokenizer.app, name="tokenizer")
app.add_typer(scaling.app, name="scaling")
app.add_typer(training.app)
app.add_typer(evaluate.app)
app.add_typer(serving.app)
app.add_typer(bench.app, name="bench")
app.add_typer(tools.convert_app, name="convert")
app.add_typer(tools.debug_app, name="debug")
app.add_typer(tools.plan_app, name="plan")
app.add_typer(tools.compare_app)


def main() -> None:
    app()


if __name__ == "__main__":  # `python -m kiln.pipeline.cli`, as torchrun starts it
    main()
