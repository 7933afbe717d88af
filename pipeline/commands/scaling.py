"""`kiln scaling`: the IsoFLOP sweep, the fit of Chinchilla's approaches 2 and 3, and the model size they give
(stages `scaling_sweep`, `scaling_fit`, `scaling_size`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import (
    ParamsOpt,
    SetOpt,
    TokenizerOpt,
    hand_runs,
    params_help,
    print_metrics,
    reports_errors,
)
from kiln.pipeline.protected import check_output, refuse_links

app = typer.Typer(help="Scaling laws: an IsoFLOP sweep, Chinchilla's approaches 2 and 3 fitted to it, the model size "
                               "they give.",
                          no_args_is_help=True)


@app.command("sweep", epilog=params_help("scaling"))
@reports_errors
@hand_runs("scaling_sweep", "scaling")
def scaling_sweep_command(
        params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
        shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json.")] = layout.SHARDS,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        out: Annotated[Path, typer.Option(help="Folder for runs.csv and each run's curves (kept across runs); a hand "
                                               "run's own folder (see `kiln pretrain --help`).")] =
        layout.SCALING,
        checkpoints: Annotated[Path, typer.Option(help="Resume state of the run in progress.")] =
        layout.checkpoints("scaling")):
    """Train the IsoFLOP grid scaling.budgets x scaling.depths, skipping runs already in runs.csv (stage
    `scaling_sweep`).

    Reads the `scaling` section (the grid and the optimiser its runs train with) and `model` (arch, sequence
    length); bare `--set` keys mean scaling.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.scaling.params import ScalingParams
    from kiln.pipeline.scaling.sweep import sweep
    from kiln.pipeline.train.params import ModelParams

    scaling, model = load_sections((ScalingParams, ModelParams), params, set_)
    print_metrics("scaling sweep", sweep(scaling, model, shards, tokenizer, out, checkpoints))


@app.command("size")
@reports_errors
@hand_runs("scaling_size", "size.json", one_file=True)
def scaling_size_command(
        params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
        fit: Annotated[Path, typer.Option(help="The fit `kiln scaling fit` wrote.")] = layout.FIT,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        out: Annotated[Path, typer.Option(help="Where to write the choice (JSON); by default, a hand run's goes to "
                                               "runs/scaling_size-<digest>/size.json.")] = layout.SIZE):
    """With model.size=auto, pick the depth-dial model and token count for scaling.target_flops from the fit
    (stage `scaling_size`); with model.size=fixed, record just that.

    Reads the `scaling` and `model` sections; bare `--set` keys mean scaling.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.scaling.params import ScalingParams
    from kiln.pipeline.scaling.size import scaling_size
    from kiln.pipeline.train.params import ModelParams

    scaling, model = load_sections((ScalingParams, ModelParams), params, set_)
    scaling_size(scaling, model, fit, tokenizer, out)


@app.command("fit")
@reports_errors
def scaling_fit_command(
        runs: Annotated[Path, typer.Option(help="CSV with params,tokens,loss[,flops] columns, or the CS336 JSON list "
                                                "of {parameters, compute_budget, final_loss}.")],
        out: Annotated[Path, typer.Option(help="Where to write the fitted values (JSON).")],
        target_flops: Annotated[float | None, typer.Option(help="Give the compute-optimal N, D and loss for this "
                                                                "many FLOPs (default: scaling.target_flops).")] = None,
        plots: Annotated[Path | None, typer.Option(help="Folder for the PNGs and their CSV rows.")] = None,
        bootstrap: Annotated[int | None, typer.Option(help="Resamples for the confidence intervals (0: none; "
                                                           "default: scaling.bootstrap).")] = None,
        seed: Annotated[int, typer.Option(help="Seed of the bootstrap resampling.")] = 0,
        metrics: Annotated[Path | None, typer.Option(help="Also write the fitted scalars here, for dvc metrics.")]
        = None,
        params: ParamsOpt = layout.PARAMS, set_: SetOpt = []):
    """Fit IsoFLOP profiles (approach 2) and L(N, D) = E + A/N^alpha + B/D^beta (approach 3) to finished runs
    (stage `scaling_fit`). Reads scaling.target_flops and scaling.bootstrap unless the options give them."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.scaling.fit import print_summary, scaling_fit
    from kiln.pipeline.scaling.params import ScalingParams

    # the DAG's stage is this command as dvc.yaml's cmd gives it; any other is a hand run, kept out of the project
    dag = (layout.SCALING / "runs.csv", layout.FIT, layout.METRICS / "scaling", layout.METRICS / "scaling.json",
           None, None, 0, layout.PARAMS, [])
    if (runs, out, plots, metrics, target_flops, bootstrap, seed, params, set_) != dag:
        given = plots
        out, plots, metrics = (None if path is None else check_output(path, option, folder, params)
                               for option, path, folder in (("--out", out, False), ("--plots", plots, True),
                                                            ("--metrics", metrics, False)))
        if plots is not None:
            refuse_links(plots, f"--plots {given}")
    scaling = load_section(ScalingParams, params, set_)
    target_flops = scaling.target_flops if target_flops is None else target_flops
    bootstrap = scaling.bootstrap if bootstrap is None else bootstrap
    print_summary(scaling_fit(runs, out, target_flops, plots, bootstrap, seed, metrics), out)
