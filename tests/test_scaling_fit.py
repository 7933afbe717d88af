"""`kiln scaling fit`: parameter recovery on synthetic L(N, D), approach 2 on the CS336 IsoFLOP file, the CLI
end to end, and one clear exit-2 error per kind of bad input."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.scaling.fit import Runs, isoflop_fit, load_runs, natural, parametric_fit
from kiln.pipeline.scaling.laws import compute_optimal, predict
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.scaling.size import choose_size
from kiln.pipeline.train.params import ModelParams
from kiln.pipeline.train.size_choice import read_json

# Chinchilla's published fit (Hoffmann et al. 2022, eq. 10): realistic magnitudes for every parameter.
TRUE = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
CS336 = Path("scaling") / "cs336-a3" / "isoflops_curves.json"  # under ../shared/data
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def isoflop_runs(budgets=(1e18, 1e19, 1e20, 1e21), per_budget=9, noise=0.0, seed=0) -> Runs:
    """Runs on a log-N grid centred on each budget's true optimum, spanning e^-1.5..e^1.5 of it as real sweeps
    do, with multiplicative noise on the loss."""
    rng = np.random.default_rng(seed)
    n, c = [], []
    for flops in budgets:
        centre = compute_optimal(TRUE, flops)[0]
        n += list(centre * np.exp(np.linspace(-1.5, 1.5, per_budget)))
        c += [flops] * per_budget
    n, c = np.array(n), np.array(c)
    d = c / (6 * n)
    loss = predict(TRUE, n, d) * np.exp(rng.normal(0, noise, len(n)))
    return Runs(n, d, c, loss, "synthetic")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parametric_fit_recovers_known_law(seed):
    # Points spread over 3 decades of N and D (not only IsoFLOP valleys) so that E, the A/N and the B/D terms
    # are each pinned down; 0.3% noise is the run-to-run spread of small LM losses.
    rng = np.random.default_rng(seed)
    n = np.exp(rng.uniform(math.log(1e7), math.log(1e10), 80))
    d = np.exp(rng.uniform(math.log(1e9), math.log(1e12), 80))
    loss = predict(TRUE, n, d) * np.exp(rng.normal(0, 0.003, 80))
    theta, _ = parametric_fit(n, d, loss, starts=8)
    fit = natural(theta)
    assert abs(fit["alpha"] - TRUE["alpha"]) < 0.05 and abs(fit["beta"] - TRUE["beta"]) < 0.05
    # A and B trade off against the exponents (A/N^alpha is what the data sees), hence the wider bounds.
    assert abs(fit["E"] - TRUE["E"]) < 0.05
    assert 0.5 < fit["A"] / TRUE["A"] < 2 and 0.5 < fit["B"] / TRUE["B"] < 2
    # The compute-optimal split for a large budget is what the fit is for: within 30% of the truth.
    assert compute_optimal(fit, 1e23)[0] / compute_optimal(TRUE, 1e23)[0] == pytest.approx(1, abs=0.3)


def test_isoflop_exponents_match_the_law():
    iso = isoflop_fit(isoflop_runs(noise=0.001))
    s = TRUE["alpha"] + TRUE["beta"]
    assert iso["a"] == pytest.approx(TRUE["beta"] / s, abs=0.02)
    assert iso["b"] == pytest.approx(TRUE["alpha"] / s, abs=0.02)
    assert len(iso["minima"]) == 4


def test_budget_without_a_valley_is_skipped_not_fitted():
    # Two budgets whose grids bracket the optimum, and one whose grid lies wholly right of it.
    good = isoflop_runs(budgets=(1e18, 1e19), per_budget=5)
    c = 1e20
    n = compute_optimal(TRUE, c)[0] * np.exp(np.linspace(1.0, 3.0, 5))
    off = Runs(n, c / (6 * n), np.full(5, c), predict(TRUE, n, c / (6 * n)), "synthetic")
    runs = Runs(*(np.concatenate([getattr(good, k), getattr(off, k)]) for k in ("params", "tokens", "flops", "loss")),
                "synthetic")
    iso = isoflop_fit(runs)
    assert [m["flops"] for m in iso["minima"]] == [1e18, 1e19] and len(iso["profiles"]) == 3
    assert iso["skipped"] == ["1e+20 (no valley: the smallest model is best, the grid does not bracket the optimum)"]
    assert iso["a"] == pytest.approx(isoflop_fit(good)["a"])
    # With a single valley left there are no exponents, but still a parametric fit (not an error).
    one = Runs(*(np.concatenate([getattr(good, k)[:5], getattr(off, k)]) for k in ("params", "tokens", "flops",
                                                                                    "loss")), "synthetic")
    assert isoflop_fit(one)["a"] is None


def test_budget_column_groups_runs_that_miss_their_budget(tmp_path):
    # A sweep's runs overshoot or undershoot C by up to a step's worth of tokens: the `budget` column, not
    # the rounded flops, says which IsoFLOP profile a run belongs to.
    runs = isoflop_runs(budgets=(1e18, 1e19), per_budget=4)
    jitter = 1 + 0.03 * np.tile([-1, 1, -1, 1], 2)
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["params", "tokens", "flops", "loss", "budget"])
        for n, d, c, loss, j in zip(runs.params, runs.tokens, runs.flops, runs.loss, jitter):
            w.writerow([n, d * j, c * j, loss, c])
    loaded = load_runs(path)
    assert list(loaded.budget) == list(runs.flops)
    assert len(isoflop_fit(loaded)["minima"]) == 2


def test_isoflop_on_cs336_file(shared_data):
    path = shared_data / CS336
    runs = load_runs(path)
    iso = isoflop_fit(runs)
    assert len(runs.loss) == 72 and len(iso["minima"]) == 9
    assert 0.4 < iso["a"] < 0.6 and abs(iso["a"] + iso["b"] - 1) < 1e-9
    records = json.loads(path.read_text())
    for m in iso["minima"]:
        budget = sorted((r["parameters"], r["final_loss"]) for r in records if r["compute_budget"] == m["flops"])
        n = np.array([p for p, _ in budget], dtype=float)
        loss = np.array([l for _, l in budget])
        # Independently: the parabola's vertex in log N, and it lies within one grid step of the best run.
        c2, c1, _ = np.polyfit(np.log(n), loss, 2)
        assert m["n_opt"] == pytest.approx(math.exp(-c1 / (2 * c2)), rel=1e-9)
        best = int(np.argmin(loss))
        step = np.diff(np.log(n)).max()
        assert abs(math.log(m["n_opt"]) - math.log(n[best])) <= step
        assert m["d_opt"] == pytest.approx(m["flops"] / (6 * m["n_opt"]))
    smallest = iso["minima"][0]
    assert smallest["flops"] == 6e18 and 4e8 < smallest["n_opt"] < 8e8


def write_csv(path, runs: Runs, extra=True):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "params", "tokens", "loss"] + (["bpb"] if extra else []))
        for i, (n, d, l) in enumerate(zip(runs.params, runs.tokens, runs.loss)):
            w.writerow([f"r{i}", n, d, l] + ([l / 3] if extra else []))
    return path


@pytest.mark.slow  # ~10 s on 2 cores: `make test-slow`
def test_cli_end_to_end_on_csv(tmp_path):
    runs_csv = write_csv(tmp_path / "runs.csv", isoflop_runs(per_budget=6, noise=0.002))
    out, plots = tmp_path / "fit" / "fit.json", tmp_path / "plots"
    metrics = tmp_path / "metrics.json"
    result = CliRunner().invoke(app, ["scaling", "fit", "--runs", str(runs_csv), "--out", str(out),
                                      "--target-flops", "1e23", "--plots", str(plots), "--bootstrap", "5",
                                      "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    fit = json.loads(out.read_text())
    summary = json.loads(metrics.read_text())["scaling"]  # scalars only, for dvc metrics
    assert summary["alpha"] == pytest.approx(fit["alpha"], rel=1e-5) and summary["n_points"] == 24
    assert "budgets" not in summary and summary["ci"]["E"]["low"] <= summary["ci"]["E"]["high"]
    for key in ("E", "A", "B", "alpha", "beta", "a", "b", "n_opt", "d_opt", "predicted_loss", "n_points",
                "n_budgets", "ci", "budgets"):
        assert key in fit, key
    assert fit["n_points"] == 24 and fit["n_budgets"] == 4
    assert set(fit["ci"]) == {"E", "A", "B", "alpha", "beta"}
    assert all(lo <= hi for lo, hi in fit["ci"].values())
    assert fit["n_opt"] * fit["d_opt"] * 6 == pytest.approx(1e23, rel=1e-5)  # each written to 6 digits
    # every number to the 6 digits the fit supports, so L-BFGS's last bits on another CPU leave the file as it is
    def floats(value):
        if isinstance(value, float):
            yield value
        for child in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
            yield from floats(child)
    assert all(float(f"{x:.6g}") == x for x in floats(fit)) and len(list(floats(fit))) > 20
    for name in ("isoflops.png", "optimum.png", "parametric.png"):
        assert (plots / name).read_bytes().startswith(PNG_MAGIC)
    header = (plots / "isoflops.csv").read_text().splitlines()[0]
    assert header == "budget,params,loss,fit_loss"
    assert "N_opt" in result.output


def bad_csv(tmp_path, rows, header="params,tokens,loss"):
    path = tmp_path / "runs.csv"
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


GOOD = [(n, d, 3.0 + i * 0.01) for i, (n, d) in enumerate(
    [(1e6, 1e9), (2e6, 5e8), (4e6, 2.5e8), (1e7, 1e9), (2e7, 5e8), (4e7, 2.5e8)])]


@pytest.mark.parametrize("case, expected", [
    ("missing file", "no such file"),
    ("missing column", "missing column(s) loss"),
    ("negative params", "params = -5"),
    ("nan loss", "loss = NaN"),
    ("too few points", "fewer than the 5 parameters"),
    ("loss rises with N", "loss must fall with both N and D"),
    ("not json", "not valid JSON"),
    ("not a number", "'abc' is not a number"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, case, expected):
    if case == "missing file":
        path = tmp_path / "absent.csv"
    elif case == "missing column":
        path = bad_csv(tmp_path, [r[:2] for r in GOOD], header="params,tokens")
    elif case == "negative params":
        path = bad_csv(tmp_path, [(-5, 1e9, 3.0)] + GOOD)
    elif case == "nan loss":
        path = bad_csv(tmp_path, GOOD + [(1e6, 1e9, "nan")])
    elif case == "too few points":
        path = bad_csv(tmp_path, GOOD[:4])
    elif case == "loss rises with N":  # no compute-optimal split exists; before, a complex N_opt and a traceback
        rng = np.random.default_rng(0)
        n, d = np.exp(rng.uniform(14, 20, 12)), np.exp(rng.uniform(20, 25, 12))
        path = bad_csv(tmp_path, zip(n, d, 1 + 0.01 * n ** 0.2 + 0.01 * d ** 0.1))
    elif case == "not json":
        path = tmp_path / "runs.json"
        path.write_text("[{not json")
    else:
        path = bad_csv(tmp_path, GOOD + [("abc", 1e9, 3.0)])
    out = tmp_path / "fit.json"
    result = CliRunner().invoke(app, ["scaling", "fit", "--runs", str(path), "--out", str(out),
                                      "--plots", str(tmp_path / "plots"), "--bootstrap", "2"])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()), result.output
    assert not out.exists() and not (tmp_path / "plots").exists()


def test_scattered_runs_are_fitted_by_approach_3_alone_and_size_by_it(tmp_path):
    # A table from anywhere (here Chinchilla's law, Hoffmann et al. 2022 eq. 10, sampled at scattered N and D
    # with 0.3% noise): no two runs share a budget, so approach 2 has nothing to fit, and approach 3 must.
    rng = np.random.default_rng(7)
    n = np.exp(rng.uniform(math.log(1e7), math.log(1e10), 40))
    d = np.exp(rng.uniform(math.log(1e9), math.log(1e12), 40))
    runs_csv = write_csv(tmp_path / "runs.csv", Runs(n, d, 6 * n * d, predict(TRUE, n, d) *
                                                      np.exp(rng.normal(0, 0.003, 40)), "synthetic"))
    out = tmp_path / "fit.json"
    result = CliRunner().invoke(app, ["scaling", "fit", "--runs", str(runs_csv), "--out", str(out),
                                      "--target-flops", "1e21", "--bootstrap", "0"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "approach 2" in line]
    assert len(said) == 1 and "no IsoFLOP grid" in said[0] and "approach 3" in said[0], result.output
    assert "skipped budget" not in result.output
    fit = json.loads(out.read_text())
    assert fit["approaches"] == ["parametric"] and fit["a"] is None and fit["n_budgets"] == 0
    assert "no IsoFLOP grid" in fit["isoflop_unused"]
    assert abs(fit["alpha"] - TRUE["alpha"]) < 0.05 and abs(fit["beta"] - TRUE["beta"]) < 0.05
    assert abs(fit["E"] - TRUE["E"]) < 0.05
    assert fit["n_opt"] / compute_optimal(TRUE, 1e21)[0] == pytest.approx(1, abs=0.3)

    # `kiln scaling size` reads this fit: by the parametric law it sizes; asked for IsoFLOP it says it cannot.
    model = build_section(ModelParams, {"size": "auto"})
    parametric = build_section(ScalingParams, {"approach": "parametric", "target_flops": 1e15})
    choice = choose_size(fit, out, parametric, model, vocab_size=1024)
    assert choice["n_opt"] / compute_optimal(TRUE, 1e15)[0] == pytest.approx(1, abs=0.3)
    assert choice["n_opt_isoflop"] is None and choice["tokens"] == round(1e15 / (6 * choice["params"]))
    with pytest.raises(UserError, match="scaling.approach=parametric") as refused:
        choose_size(fit, out, build_section(ScalingParams, {"approach": "isoflop", "target_flops": 1e15}), model,
                    vocab_size=1024)
    assert "\n" not in str(refused.value) and str(out) in str(refused.value)


def test_grid_fit_says_both_approaches():
    runs = isoflop_runs(budgets=(1e18, 1e19), per_budget=5)
    iso = isoflop_fit(runs)
    assert iso["unused"] is None and iso["a"] is not None
    one = isoflop_fit(isoflop_runs(budgets=(1e18,), per_budget=5))
    assert one["a"] is None and "no IsoFLOP grid" in one["unused"] and "found 1 among 1 budgets" in one["unused"]


@pytest.mark.parametrize("flops", [1e15, 1e21, 1e25])
def test_compute_optimal_is_the_minimum_along_the_isoflop_line(flops):
    # Independently of the closed form: the smallest L(N, C/6N) on a fine grid of log N, in float64 numpy.
    n = np.exp(np.linspace(math.log(1e3), math.log(1e14), 200_001))
    loss = TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / (flops / (6 * n)) ** TRUE["beta"]
    n_opt, d_opt, loss_opt = compute_optimal(TRUE, flops)
    assert n_opt == pytest.approx(n[np.argmin(loss)], rel=1e-3)
    assert 6 * n_opt * d_opt == pytest.approx(flops) and loss_opt == pytest.approx(loss.min(), rel=1e-9)


@pytest.mark.parametrize("key, value, expected", [
    ("alpha", -0.3, "no compute-optimal size"), ("B", 0.0, "no compute-optimal size"),
    ("E", "1.69", "E is '1.69', expected a finite number"), ("A", None, "A is None"),
    ("beta", True, "beta is True"), ("k_n", float("nan"), "k_n is nan")])
def test_size_refuses_a_fit_json_it_cannot_size_from(tmp_path, key, value, expected):
    # A hand-edited or foreign fit.json: one error naming the file and the key, not a complex N_opt.
    fit = {**TRUE, "a": 0.5, "k_n": 0.1, key: value}
    path = tmp_path / "fit.json"
    with pytest.raises(UserError, match=expected) as refused:
        choose_size(fit, path, build_section(ScalingParams, {"approach": "parametric"}),
                    build_section(ModelParams, {"size": "auto"}), vocab_size=1024)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=300), st.sampled_from([b"[" * 50_000 + b"]" * 50_000, b"9" * 5000,
                                                            b'[{"params": 1e999}]', b"\xff\xfe{}"])),
       st.sampled_from(["runs.json", "runs.csv", "fit.json"]))
def test_scaling_readers_give_runs_or_one_line_on_any_bytes(tmp_path, data, name):
    path = tmp_path / name
    path.write_bytes(data)
    try:
        read_json(path, "scaling fit", "run it") if name == "fit.json" else load_runs(path)
    except UserError as e:
        assert "\n" not in str(e) and str(path) in str(e)


def test_a_law_run_off_to_overflow_is_dropped_from_the_bootstrap_and_refused_as_the_fit(tmp_path, monkeypatch):
    # The default sweep with model.norm=dyt (alpha 0.5) learned nothing (every loss 5.98-6.06, the unigram
    # entropy 6.07): one bootstrap refit ran A off to exp(1000+), an OverflowError traceback before the guard.
    import kiln.pipeline.scaling.fit as fit

    runs = isoflop_runs(per_budget=6, noise=0.002)
    theta, _ = parametric_fit(runs.params, runs.tokens, runs.loss)
    wild = theta.copy()
    wild[0] = 1500.0
    refits = iter([wild, theta * 1.001, theta * 0.999, wild])
    monkeypatch.setattr(fit, "_lbfgs", lambda start, *tensors: (next(refits), 0.0))
    ci = fit.bootstrap(runs, theta, 4, 0)
    assert set(ci) == {"E", "A", "B", "alpha", "beta"} and all(math.isfinite(v) for lo_hi in ci.values() for v in lo_hi)
    refits = iter([wild] * 3)
    assert fit.bootstrap(runs, theta, 3, 0) == {}  # no interval from nothing

    monkeypatch.setattr(fit, "parametric_fit", lambda *a: (wild, 0.0))
    runs_csv = write_csv(tmp_path / "runs.csv", runs)
    out = tmp_path / "fit.json"
    result = CliRunner().invoke(app, ["scaling", "fit", "--runs", str(runs_csv), "--out", str(out)])
    assert result.exit_code == 2 and "did the runs learn?" in result.output and not out.exists()
