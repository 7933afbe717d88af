"""`kiln params check`: every section of params.yaml loaded and checked by the very classes its stages load it
with, and what two sections must agree on, before any stage runs.

It is dvc.yaml's first stage, which every other stage follows (each lists its stamp as a dep): a bad value
(`dvc exp run -S train.precision=fp4`) stops DVC there, before it removes a later stage's outputs to run it. The
stamp is constant, so rewriting it reruns nothing after it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import ParamsOpt, SetOpt, reports_errors

app = typer.Typer(help="params.yaml: check every section.", no_args_is_help=True)

STAMP = layout.DATA / "params.checked"  # the `params` stage's output
STAMP_TEXT = b"every section of params.yaml checked by `kiln params check`\n"


@app.command("check")
@reports_errors
def params_check(params: ParamsOpt = layout.PARAMS, set_: SetOpt = []):
    """Check every section of the params file as its stages read it (stage `params`).

    One line when every section is good; else the first bad key in one line, exit 2. `--set section.key=value`
    checks the file with that change, as `dvc exp run -S` makes it. Run as dvc.yaml runs it (params.yaml, no
    --set), it also writes data/params.checked, the stage's output."""
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.evaluate.params import EvalParams
    from kiln.pipeline.outputs import atomic_write_bytes
    from kiln.pipeline.post.grpo_params import GRPOParams
    from kiln.pipeline.post.params import DPOParams, SFTParams
    from kiln.pipeline.scaling.params import ScalingParams
    from kiln.pipeline.text.shard import ShardParams
    from kiln.pipeline.text.sources import DataParams
    from kiln.pipeline.text.tokenizer import TokenizerParams
    from kiln.pipeline.train.params import ModelParams, TrainParams

    sections = load_sections((DataParams, TokenizerParams, ShardParams, ModelParams, TrainParams, ScalingParams,
                              SFTParams, DPOParams, GRPOParams, EvalParams), params, set_)
    train = next(s for s in sections if isinstance(s, TrainParams))
    for post in (s for s in sections if isinstance(s, (SFTParams, DPOParams, GRPOParams))):
        post.check_train(train)
    if not set_ and Path(params).resolve() == layout.PARAMS.resolve():
        atomic_write_bytes(STAMP, STAMP_TEXT)
    typer.echo(f"{params}: every section checked ({', '.join(s.SECTION for s in sections)})")
