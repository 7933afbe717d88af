"""`kiln scaling fit`: Chinchilla's approaches 2 and 3 (Hoffmann et al. 2022) on a table of finished runs.

Approach 2 (IsoFLOP profiles) needs no model of the loss: within one compute budget C the loss against log N is
a valley, a parabola through it puts the optimum N_opt(C), and straight lines through log N_opt and log D_opt
against log C give the exponents a and b. Since every run obeys D = C / 6N, b = 1 - a exactly.

Approach 3 (parametric) fits L(N, D) = E + A/N^alpha + B/D^beta to every run at once. As in the paper the
residual is taken in log space against a log-sum-exp of the three terms (so the fit weighs small and large losses
alike and stays finite for any parameters) under a Huber loss with delta 1e-3 summed over points, which makes a
few off-trend runs pull less than under least squares. The objective has many local minima, hence L-BFGS from a
grid of starting points; the paper's grid (4,500 points) is screened in one vectorised pass and L-BFGS starts
from the best few, which finds the same optimum for a fraction of the time.

Input is any CSV with `params,tokens,loss` (and optionally `flops`), or the CS336 assignment-3 JSON list of
`{parameters, compute_budget, final_loss}`. Approach 2 needs an IsoFLOP grid; a table of runs from anywhere
else (a paper's, scattered over N and D) is fitted by approach 3 alone, which the console and the output's
`approaches` say. Every bad input is reported as a one-line UserError before anything is written.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import atomic_write_bytes, write_json
from kiln.pipeline.scaling.laws import PARAM_NAMES, compute_optimal, has_optimum, predict
from kiln.pipeline.train.curves import pyplot, save_png

HUBER_DELTA = 1e-3
# Hoffmann et al.'s grid of initialisations over (a = log A, b = log B, e = log E, alpha, beta).
GRID = {"a": np.arange(0, 30, 5.0), "b": np.arange(0, 30, 5.0), "e": np.arange(-1, 1.5, 0.5),
        "alpha": np.arange(0, 2.5, 0.5), "beta": np.arange(0, 2.5, 0.5)}
# L-BFGS starts from this many of the grid's best points; more found no better optimum on the tests' data.
STARTS = 16
LOG_MAX = math.log(sys.float_info.max)  # exp() of more overflows a double
MIN_RUNS_PER_BUDGET = 3


@dataclass
class Runs:
    """One row per finished run: parameters N, tokens D, compute C and final loss."""

    params: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray
    source: str
    budget: np.ndarray | None = None  # the nominal budget of each run, when the table gives one


# ---------------------------------------------------------------- reading

def load_runs(path: Path) -> Runs:
    """Read a CSV or the CS336 JSON list, then check the values so the fits never see a bad number."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--runs {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    rows = _json_rows(path, text) if path.suffix == ".json" or text.lstrip().startswith("[") else _csv_rows(path, text)
    if not rows:
        raise UserError(f"{path}: no runs in the file")
    n, d, c, loss, budget = (np.array(col, dtype=np.float64) for col in zip(*rows))
    runs = Runs(n, d, c, loss, str(path), None if np.isnan(budget).any() else budget)
    _check_values(runs)
    return runs


def _csv_rows(path: Path, text: str) -> list[tuple[float, float, float, float, float]]:
    reader = csv.DictReader(io.StringIO(text))
    fields = reader.fieldnames or []
    missing = [c for c in ("params", "tokens", "loss") if c not in fields]
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(fields) or 'nothing'}); "
                        "expected a CSV with params,tokens,loss or the CS336 JSON list")
    rows = []
    for line, row in enumerate(reader, start=2):
        n, d, loss = (_number(path, line, col, row[col]) for col in ("params", "tokens", "loss"))
        c = _number(path, line, "flops", row["flops"]) if row.get("flops") not in (None, "") else 6 * n * d
        budget = _number(path, line, "budget", row["budget"]) if row.get("budget") not in (None, "") else math.nan
        rows.append((n, d, c, loss, budget))
    return rows


def _json_rows(path: Path, text: str) -> list[tuple[float, float, float, float, float]]:
    """The CS336 list gives N and C; D follows from C = 6ND."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (ValueError, RecursionError) as e:  # a 5,000-digit number, [[[[...
        raise UserError(f"{path}: not usable JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise UserError(f"{path}: expected a JSON list of objects with parameters, compute_budget, final_loss")
    rows = []
    for i, rec in enumerate(records):
        missing = [k for k in ("parameters", "compute_budget", "final_loss") if k not in rec]
        if missing:
            raise UserError(f"{path}: record {i} lacks {', '.join(missing)}")
        n, c, loss = (_number(path, f"record {i}", k, rec[k]) for k in ("parameters", "compute_budget", "final_loss"))
        rows.append((n, c / (6 * n) if n > 0 else float("nan"), c, loss, c))
    return rows


def _number(path: Path, where, column: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        where = f"line {where}" if isinstance(where, int) else where
        raise UserError(f"{path}: {where}, {column}: {value!r} is not a number") from None


def _check_values(runs: Runs) -> None:
    for name, col in (("params", runs.params), ("tokens", runs.tokens), ("flops", runs.flops),
                      ("loss", runs.loss)):
        bad = np.flatnonzero(~(col > 0) | ~np.isfinite(col))
        if bad.size:
            kind = "NaN" if math.isnan(col[bad[0]]) else f"{col[bad[0]]:g}"
            raise UserError(f"{runs.source}: run {bad[0]} has {name} = {kind}; every {name} must be a positive "
                            "finite number")
    if len(runs.loss) < len(PARAM_NAMES):
        raise UserError(f"{runs.source}: {len(runs.loss)} runs, fewer than the {len(PARAM_NAMES)} parameters of "
                        "L(N, D) = E + A/N^alpha + B/D^beta")


# ---------------------------------------------------------------- approach 2: IsoFLOP profiles

def budget_of(runs: Runs) -> np.ndarray:
    """The `budget` column when the table has one (a sweep's runs miss C a little, D being whole steps);
    otherwise C to three significant digits, which groups runs of one budget without merging budgets."""
    if runs.budget is not None:
        return runs.budget
    return np.array([float(f"{c:.3g}") for c in runs.flops])


def isoflop_fit(runs: Runs) -> dict:
    """A parabola per budget with enough runs; the vertices of those that form a valley; the power laws
    through the vertices. With fewer than 2 valleys a, b are None and `unused` says why: runs that are no
    IsoFLOP grid, or a grid that does not bracket the optimum, leave the parametric fit, not a failed stage."""
    budgets = budget_of(runs)
    minima, profiles, skipped = [], [], []
    for c in np.unique(budgets):
        at = budgets == c
        if at.sum() < MIN_RUNS_PER_BUDGET:
            skipped.append(f"{c:g} ({at.sum()} runs)")
            continue
        x, y = np.log(runs.params[at]), runs.loss[at]
        coef = np.polyfit(x, y, 2)
        profiles.append((float(c), runs.params[at], y, coef))
        x_opt = -coef[1] / (2 * coef[0]) if coef[0] > 0 else math.nan
        if not x.min() <= x_opt <= x.max():
            best = "largest" if coef[0] <= 0 or x_opt > x.max() else "smallest"
            skipped.append(f"{c:g} (no valley: the {best} model is best, the grid does not bracket the optimum)")
            continue
        n_opt = math.exp(x_opt)
        minima.append({"flops": float(c), "n_opt": n_opt, "d_opt": float(c) / (6 * n_opt),
                       "loss_opt": float(np.polyval(coef, x_opt)), "runs": int(at.sum())})
    fit = {"a": None, "b": None, "k_n": None, "k_d": None, "unused": None}
    if len(profiles) < 2:
        # Not a grid: one line for the whole table rather than one per stray budget.
        fit["unused"] = (f"the runs are no IsoFLOP grid (it needs at least 2 budgets with >= {MIN_RUNS_PER_BUDGET} "
                         f"runs each; found {len(profiles)} among {len(np.unique(budgets))} budgets)")
        profiles, minima, skipped = [], [], []
    elif len(minima) < 2:
        fit["unused"] = (f"fewer than 2 budgets form a valley ({len(minima)} of {len(profiles)}); widen the sizes "
                         "(scaling.depths) or move the budgets")
    else:
        log_c = np.log([m["flops"] for m in minima])
        a, log_kn = np.polyfit(log_c, np.log([m["n_opt"] for m in minima]), 1)
        b, log_kd = np.polyfit(log_c, np.log([m["d_opt"] for m in minima]), 1)
        fit |= {"a": float(a), "b": float(b), "k_n": math.exp(log_kn), "k_d": math.exp(log_kd)}
    return {**fit, "minima": minima, "profiles": profiles, "skipped": skipped}


# ---------------------------------------------------------------- approach 3: parametric fit

def _log_pred(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor) -> torch.Tensor:
    """log L for theta = (a, b, e, alpha, beta), rows of a batch of starting points or a single one."""
    a, b, e, alpha, beta = theta.unbind(-1)
    terms = torch.stack(torch.broadcast_tensors(a[..., None] - alpha[..., None] * log_n,
                                                b[..., None] - beta[..., None] * log_d,
                                                e[..., None].expand(*e.shape, log_n.shape[-1])), dim=0)
    return torch.logsumexp(terms, dim=0)


def _objective(theta, log_n, log_d, log_l) -> torch.Tensor:
    pred = _log_pred(theta, log_n, log_d)
    return torch.nn.functional.huber_loss(pred, log_l.expand_as(pred), delta=HUBER_DELTA,
                                          reduction="none").sum(-1)


def _lbfgs(start: np.ndarray, log_n, log_d, log_l) -> tuple[np.ndarray, float]:
    """One L-BFGS descent; the tolerances are far below the defaults because with delta 1e-3 the objective
    itself is of order 1e-6 and the default stopping rule would quit at the first step."""
    theta = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=400, tolerance_grad=1e-14, tolerance_change=1e-16,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = _objective(theta, log_n, log_d, log_l)
        value.backward()
        return value

    opt.step(closure)
    with torch.no_grad():
        value = float(_objective(theta, log_n, log_d, log_l))
    return theta.detach().numpy().copy(), value


def _tensors(n, d, loss):
    return (torch.tensor(np.log(n), dtype=torch.float64), torch.tensor(np.log(d), dtype=torch.float64),
            torch.tensor(np.log(loss), dtype=torch.float64))


def parametric_fit(n: np.ndarray, d: np.ndarray, loss: np.ndarray, starts: int = STARTS) -> tuple[np.ndarray, float]:
    """Best (a, b, e, alpha, beta) over L-BFGS runs from the `starts` best points of the grid."""
    log_n, log_d, log_l = _tensors(n, d, loss)
    grid = torch.tensor(list(itertools.product(*GRID.values())), dtype=torch.float64)
    with torch.no_grad():
        screened = _objective(grid, log_n, log_d, log_l)
    best = None
    for i in torch.argsort(screened)[:starts].tolist():
        theta, value = _lbfgs(grid[i].numpy(), log_n, log_d, log_l)
        if np.all(np.isfinite(theta)) and (best is None or value < best[1]):
            best = (theta, value)
    return best


def representable(theta: np.ndarray) -> bool:
    """Whether a fit's E, A and B (exp of its first three coordinates) are finite doubles: losses that barely
    fall with N or D (a sweep whose models did not learn) let L-BFGS run A or B off to exp(1000)."""
    return bool(np.all(np.isfinite(theta)) and max(theta[:3]) < LOG_MAX)


def natural(theta: np.ndarray) -> dict[str, float]:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": alpha, "beta": beta}


SIGNIFICANT = 6  # digits of every number fit.json holds


def bootstrap(runs: Runs, theta: np.ndarray, samples: int, seed: int) -> dict[str, list[float]]:
    """2.5/97.5 percentiles over refits on resampled runs. Each refit starts from the full-data optimum: a
    resample moves the optimum a little, and a full grid search per sample would cost `STARTS` times more."""
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(samples):
        pick = rng.integers(0, len(runs.loss), len(runs.loss))
        refit, _ = _lbfgs(theta, *_tensors(runs.params[pick], runs.tokens[pick], runs.loss[pick]))
        if representable(refit):
            fits.append(list(natural(refit).values()))
    if len(fits) < 2:  # no interval from fewer than two refits
        return {}
    fits = np.array(fits)
    return {name: [float(np.percentile(fits[:, j], 2.5)), float(np.percentile(fits[:, j], 97.5))]
            for j, name in enumerate(PARAM_NAMES)}


# ---------------------------------------------------------------- the command

def scaling_fit(runs_path: Path, out: Path, target_flops: float | None = None, plots: Path | None = None,
                samples: int = 100, seed: int = 0, metrics: Path | None = None) -> dict:
    """Fit both approaches (approach 3 alone when approach 2 has no exponents), then write plots and the JSON
    (last, so its presence means the rest is there)."""
    if target_flops is not None and not target_flops > 0:
        raise UserError(f"--target-flops: {target_flops:g} must be positive")
    if samples < 0:
        raise UserError(f"--bootstrap: {samples} must be >= 0")
    runs = load_runs(runs_path)
    iso = isoflop_fit(runs)
    theta, huber = parametric_fit(runs.params, runs.tokens, runs.loss)
    if not representable(theta):
        raise UserError(f"{runs.source}: L(N, D) = E + A/N^alpha + B/D^beta does not fit these losses (A or B runs "
                        f"off to exp({max(theta[:3]):.4g})): they hardly fall with N or D; did the runs learn? "
                        f"(losses {runs.loss.min():.4g} to {runs.loss.max():.4g})")
    fitted = natural(theta)
    result = {"approaches": ["parametric"] if iso["unused"] else ["isoflop", "parametric"], **fitted,
              "a": iso["a"], "b": iso["b"], "k_n": iso["k_n"], "k_d": iso["k_d"],
              "huber_loss": huber, "n_points": len(runs.loss), "n_budgets": len(iso["minima"])}
    if iso["unused"]:
        result["isoflop_unused"] = iso["unused"]
    if target_flops is not None:
        if not has_optimum(fitted):
            raise UserError(f"{runs.source}: the fitted law has " + ", ".join(f"{k} = {fitted[k]:.4g}" for k in
                            PARAM_NAMES) + "; loss must fall with both N and D (A, B, alpha, beta > 0) for a "
                            "compute-optimal split: are these the final losses of comparable runs?")
        n_opt, d_opt, loss_opt = compute_optimal(fitted, target_flops)
        result |= {"target_flops": target_flops, "n_opt": n_opt, "d_opt": d_opt, "predicted_loss": float(loss_opt)}
        if iso["a"] is not None:
            n_iso = iso["k_n"] * target_flops ** iso["a"]
            result |= {"n_opt_isoflop": n_iso, "d_opt_isoflop": iso["k_d"] * target_flops ** iso["b"],
                       "predicted_loss_isoflop": float(predict(fitted, n_iso, target_flops / (6 * n_iso)))}
    if samples:
        result["ci"] = bootstrap(runs, theta, samples, seed)  # {} when too few refits were representable
        result["bootstrap_samples"] = samples
    result["budgets"] = iso["minima"]
    if plots is not None:
        write_plots(Path(plots), runs, iso, fitted)
    # what is written is rounded to the digits the fit supports (its bootstrap intervals are far wider), so
    # L-BFGS's last-bit differences between CPUs do not change the file DVC hashes
    result = significant(result)
    if metrics is not None:
        write_json(metrics, {"scaling": summary_metrics(result)})
    write_json(out, result)
    return result | {"skipped_budgets": iso["skipped"]}


def significant(value, digits: int = SIGNIFICANT):
    """Every float in `value` (dicts and lists walked) rounded to `digits` significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: significant(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [significant(v, digits) for v in value]
    return value


def summary_metrics(result: dict) -> dict:
    """The scalars of a fit, for `dvc metrics`: no per-budget list, intervals as {low, high}."""
    scalars = {k: float(f"{v:.6g}") for k, v in result.items() if isinstance(v, float)}
    counts = {k: v for k, v in result.items() if isinstance(v, int)}
    ci = {name: {"low": float(f"{lo:.6g}"), "high": float(f"{hi:.6g}")} for name, (lo, hi) in
          result.get("ci", {}).items()}
    return {**scalars, **counts, **({"ci": ci} if ci else {})}


# ---------------------------------------------------------------- plots

def write_plots(folder: Path, runs: Runs, iso: dict, fitted: dict) -> None:
    """PNGs to look at, and the same points as CSV rows for `dvc plots`."""
    plt = pyplot()

    iso_rows = []
    fig, ax = plt.subplots(figsize=(7.4, 4.4))
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(iso["profiles"])))
    vertex = {m["flops"]: m for m in iso["minima"]}  # a budget without a valley has a profile but no vertex
    for (c, n, loss, coef), colour in zip(iso["profiles"], colours):
        iso_rows += [(c, ni, li, float(np.polyval(coef, math.log(ni)))) for ni, li in zip(n, loss)]
        xs = np.linspace(math.log(n.min()), math.log(n.max()), 100)
        ax.scatter(n, loss, color=colour, s=14)
        ax.plot(np.exp(xs), np.polyval(coef, xs), color=colour, label=f"{c:.2g}")
        if c in vertex:
            ax.scatter([vertex[c]["n_opt"]], [vertex[c]["loss_opt"]], color=colour, marker="*", s=120,
                       edgecolor="black", zorder=3)
    ax.set(xscale="log", xlabel="parameters N", ylabel="held-out loss (nats/token)",
           title="IsoFLOP profiles: loss at fixed compute (star: vertex)")
    if iso["profiles"]:
        ax.legend(title="budget C (FLOPs)", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    else:
        ax.text(0.5, 0.5, "no IsoFLOP grid in these runs", ha="center", transform=ax.transAxes)
    save_png(fig, folder / "isoflops.png")

    c = np.array([m["flops"] for m in iso["minima"]])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, k, e, label in ((axes[0], "n_opt", iso["k_n"], iso["a"], "N_opt (parameters)"),
                                 (axes[1], "d_opt", iso["k_d"], iso["b"], "D_opt (tokens)")):
        ax.set(xlabel="compute C (FLOPs)", ylabel=label)
        if not iso["minima"]:
            ax.text(0.5, 0.5, "no budget forms a valley", ha="center", transform=ax.transAxes)
            continue
        ax.scatter(c, [m[key] for m in iso["minima"]], label="IsoFLOP vertices")
        if e is not None:
            ax.plot(c, k * c ** e, label=f"fit {k:.3g} C^{e:.3f}")
        ax.set(xscale="log", yscale="log")
        ax.legend(loc="upper left")
    fig.suptitle("compute-optimal model size and tokens (IsoFLOP vertices)")
    save_png(fig, folder / "optimum.png")

    pred = predict(fitted, runs.params, runs.tokens)
    fig, ax = plt.subplots(figsize=(5.8, 5.4))
    ax.scatter(runs.loss, pred, s=14)
    lo, hi = min(runs.loss.min(), pred.min()), max(runs.loss.max(), pred.max())
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", label="y = x")
    ax.set(xlabel="observed held-out loss (nats/token)", ylabel="predicted loss (nats/token)",
           title="parametric fit L(N, D) = E + A/N^alpha + B/D^beta")
    ax.legend(loc="upper left")
    save_png(fig, folder / "parametric.png")

    _write_csv(folder / "isoflops.csv", ("budget", "params", "loss", "fit_loss"), iso_rows)
    _write_csv(folder / "optimum.csv", ("flops", "n_opt", "d_opt"),
               [(m["flops"], m["n_opt"], m["d_opt"]) for m in iso["minima"]])
    _write_csv(folder / "parametric.csv", ("params", "tokens", "loss", "predicted_loss"),
               zip(runs.params, runs.tokens, runs.loss, pred))


def _write_csv(path: Path, header: tuple[str, ...], rows) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([f"{float(v):.8g}" for v in row] for row in rows)
    atomic_write_bytes(path, buf.getvalue().encode())


def print_summary(result: dict, out: Path) -> None:
    """The fitted values with their intervals, then the target's compute-optimal size by both approaches."""
    from rich.table import Table

    from kiln.pipeline.progress import console

    iso_used = "isoflop" in result["approaches"]
    budgets = f", {result['n_budgets']} IsoFLOP budgets" if iso_used else ""
    table = Table(title=f"L(N, D) = E + A/N^alpha + B/D^beta on {result['n_points']} runs{budgets}")
    for col in ("parameter", "fit", "95% bootstrap CI"):
        table.add_column(col)
    ci = result.get("ci", {})
    for name in PARAM_NAMES:
        lo_hi = f"[{ci[name][0]:.4g}, {ci[name][1]:.4g}]" if name in ci else "-"
        table.add_row(name, f"{result[name]:.4g}", lo_hi)
    if iso_used:
        for name, quantity in (("a", "N_opt"), ("b", "D_opt")):
            table.add_row(f"{name} ({quantity} ~ C^{name})", f"{result[name]:.4f}", "IsoFLOP")
    console.print(table)
    for skipped in result["skipped_budgets"]:
        console.print(f"skipped budget {skipped}", highlight=False)
    if not iso_used:
        console.print(f"approach 2 (IsoFLOP) not used: {result['isoflop_unused']}; fitted by approach 3 "
                      "(parametric L(N, D)) alone", highlight=False, soft_wrap=True)
    if "target_flops" in result:
        iso = (f"; IsoFLOP N_opt {result['n_opt_isoflop']:.4g}, D_opt {result['d_opt_isoflop']:.4g}"
               if "n_opt_isoflop" in result else "")
        console.print(f"C = {result['target_flops']:.3g}: parametric N_opt {result['n_opt']:.4g}, "
                      f"D_opt {result['d_opt']:.4g}, loss {result['predicted_loss']:.4f}{iso}", highlight=False)
    console.print(f"wrote {out}", highlight=False)
