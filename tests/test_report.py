"""metrics/report.md (pipeline/evaluate/report.py) on constructed results: the table, its intervals and deltas,
the bootstraps (evaluate/intervals.py) against a plain resampling loop written here, and the samples section."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.pipeline.evaluate.generative import GenResult, GenTask, GenTaskSpec
from kiln.pipeline.evaluate.intervals import RESAMPLES, Intervals, bootstrap, paired_bootstrap
from kiln.pipeline.evaluate.report import report_markdown
from kiln.pipeline.tasks.rewards import make_reward


def loop_bootstrap(model, start, seed: int, resamples: int) -> tuple[float, float, float]:
    """The paired percentile bootstrap, one resample at a time and the percentiles interpolated by hand (numpy's
    default: the q-quantile sits at position q * (R - 1) of the sorted means)."""
    diff = [float(a) - float(b) for a, b in zip(model, start)]
    n, rng = len(diff), np.random.default_rng(seed)
    means = sorted(sum(diff[int(j)] for j in rng.integers(0, n, size=n)) / n for _ in range(resamples))

    def quantile(q):
        pos = q * (resamples - 1)
        lo = int(pos)
        return means[lo] + (pos - lo) * (means[min(lo + 1, resamples - 1)] - means[lo])

    return sum(diff) / n, quantile(0.025), quantile(0.975)


def test_bootstrap_matches_a_resampling_loop():
    rng = np.random.default_rng(7)
    model, start = rng.random(40) < 0.6, rng.random(40) < 0.4
    got = paired_bootstrap(model, start, seed=3, resamples=2000)
    want = loop_bootstrap(model, start, seed=3, resamples=2000)
    assert (got.mean, got.low, got.high) == pytest.approx(want, abs=1e-12)
    assert got.low < got.mean < got.high
    one = bootstrap(model, seed=4, resamples=2000)  # one model's interval: the loop against a start of zeros
    assert (one.mean, one.low, one.high) == pytest.approx(loop_bootstrap(model, [0] * 40, 4, 2000), abs=1e-12)


def test_a_bootstrap_interval_covers_the_true_rate_about_95_times_in_100():
    """Coverage on fresh draws of 300 items at a known rate: a percentile interval's is close to its level."""
    rng = np.random.default_rng(11)
    covered = sum(ci.low <= 0.3 <= ci.high for ci in (bootstrap(rng.random(300) < 0.3, seed=s, resamples=2000)
                                                      for s in range(400)))
    assert 0.91 <= covered / 400 <= 0.98
    width = bootstrap(rng.random(300) < 0.3, seed=0)
    assert 0.09 < width.high - width.low < 0.115  # 2 x 1.96 x sqrt(0.3 x 0.7 / 300) = 0.104
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap([1, 0], [1, 0, 1], seed=0)


def test_bootstrap_excludes_zero_for_a_real_gain_and_not_for_noise():
    rng = np.random.default_rng(0)
    start = rng.random(300) < 0.3
    better = start | (rng.random(300) < 0.4)  # right wherever the start was, and on ~40% more
    gain = paired_bootstrap(better, start, seed=0)
    assert gain.mean > 0.2 and gain.low > 0.15 and gain.excludes_zero
    same = rng.random(300) < 0.3  # another draw of the same skill: a difference of noise only
    noise = paired_bootstrap(same, start, seed=0)
    assert noise.low < 0 < noise.high and not noise.excludes_zero
    worse = paired_bootstrap(start, better, seed=0)
    assert worse.high < 0 and worse.excludes_zero


def task_and_results(models, correct: dict[str, list[int]]) -> tuple[GenTask, dict[str, GenResult]]:
    n = len(next(iter(correct.values())))
    spec = GenTaskSpec("speaker", "builtin", "exact", limit=n, samples=0)
    texts = [f"Who speaks first?\n\nQ{i}." for i in range(n)]
    task = GenTask(spec, "eval.tasks[1]", make_reward("exact"), texts, [f"Q{i}" for i in range(n)], [], [], [], 0)
    results = {m: GenResult({"pass@1": float(np.mean(correct[m]))}, [float(c) for c in correct[m]],
                            [f"Q{i}" if c else f"say | `x`\nmore {i}" for i, c in enumerate(correct[m])],
                            {"pass@1": np.array(correct[m], dtype=float)})
               for m in models}
    return task, results


def intervals_of(results: dict[str, GenResult], starts: dict[str, str | None], seed: int = 0) -> Intervals:
    return Intervals({m: {f"speaker/{k}": v for k, v in r.per_item.items()} for m, r in results.items()}, starts,
                     seed)


METRICS = {"val_loss": {"base": 4.0, "sft": 4.25, "dpo": 4.5, "grpo": 4.125},
           "speaker/pass@1": {"base": 0.0, "sft": 0.5, "dpo": 0.4, "grpo": 0.75},
           "posttrain/reward_accuracy": {"sft": 0.7, "dpo": 0.75},
           "items": {"speaker": 4, "speaker/too_long": 0}}
MODELS = ["base", "sft", "dpo", "grpo"]
STARTS = {"base": None, "sft": "base", "dpo": "sft", "grpo": "sft"}


def test_report_table_has_every_model_and_metric_with_its_delta():
    task, results = task_and_results(MODELS, {"base": [0, 0, 0, 0], "sft": [1, 1, 0, 0], "dpo": [1, 0, 0, 0],
                                              "grpo": [1, 1, 1, 0]})
    page = report_markdown(METRICS, MODELS, STARTS, [(task, results)], intervals_of(results, STARTS))
    lines = page.splitlines()
    assert lines[0] == "# Evaluation report"
    assert "(sft from base, dpo from sft, grpo from sft)" in page
    assert "| metric | better | chance | base | sft (vs base) | dpo (vs sft) | grpo (vs sft) |" in lines
    assert "| val_loss | lower | - | 4.0000 | 4.2500 (+0.2500) | 4.5000 (+0.2500) | 4.1250 (-0.1250) |" in lines
    # A mean over items has its 95% interval; a loss has none.
    assert ("| speaker/pass@1 | higher | - | 0.0000 [0.000, 0.000] | 0.5000 [0.000, 1.000] (+0.5000) | "
            "0.4000 [0.000, 0.750] (-0.1000) | 0.7500 [0.250, 1.000] (+0.2500) |") in lines
    # No value for base: sft's reward accuracy has nothing to be compared with.
    assert "| posttrain/reward_accuracy | higher | - | - | 0.7000 | 0.7500 (+0.0500) | - |" in lines
    assert "Items scored (the same for every model): speaker 4, speaker/too_long 0." in lines
    assert not any(line.startswith("| items") for line in lines)
    assert report_markdown(METRICS, MODELS, STARTS, [(task, results)], intervals_of(results, STARTS)) == page


def test_report_gives_chance_levels_and_provenance_where_known():
    task, results = task_and_results(MODELS, {m: [0, 1, 0, 1] for m in MODELS})
    lines = report_markdown(METRICS, MODELS, STARTS, [(task, results)], intervals_of(results, STARTS),
                            chance={"val_loss": 6.9315, "posttrain/reward_accuracy": 0.5},
                            provenance="Made with params digest `abc`.").splitlines()
    assert lines[lines.index("# Evaluation report") + 4] == "Made with params digest `abc`."
    assert "| val_loss | lower | 6.9315 | 4.0000 | 4.2500 (+0.2500) | 4.5000 (+0.2500) | 4.1250 (-0.1250) |" in lines
    assert "| posttrain/reward_accuracy | higher | 0.5000 | - | 0.7000 | 0.7500 (+0.0500) | - |" in lines
    assert any(line.startswith("| speaker/pass@1 | higher | - | ") for line in lines)  # a reward: no level


def test_report_bootstrap_rows_compare_each_model_with_its_start():
    rng = np.random.default_rng(1)
    start = (rng.random(300) < 0.3).astype(int)
    grpo = (start | (rng.random(300) < 0.4)).astype(int)
    dpo = (rng.random(300) < 0.3).astype(int)
    correct = {"base": [0] * 300, "sft": list(start), "dpo": list(dpo), "grpo": list(grpo)}
    task, results = task_and_results(MODELS, correct)
    metrics = {**METRICS, "speaker/pass@1": {m: float(np.mean(c)) for m, c in correct.items()}}
    lines = report_markdown(metrics, MODELS, STARTS, [(task, results)], intervals_of(results, STARTS, seed=5)
                            ).splitlines()
    assert (f"Paired bootstrap over the items both models answered (the per-item changes resampled, {RESAMPLES:,} "
            "times, seed 5): the mean change and its 95% interval. A change whose interval holds 0 is within what "
            "another draw of items of this size could give.") in lines
    head = lines.index("| metric | model | start | value | start's value | change | 95% interval | excludes 0 |")
    rows = {line.split(" | ")[1]: line for line in lines[head + 2:lines.index("", head)]}
    assert list(rows) == ["sft", "dpo", "grpo"]  # every model with a start, in eval.models order
    assert rows["sft"].startswith("| speaker/pass@1 | sft | base | 0.3") and rows["sft"].endswith("| yes |")
    for model in ("dpo", "grpo"):
        mean, low, high = loop_bootstrap(correct[model], start, seed=5, resamples=RESAMPLES)
        assert rows[model] == (f"| speaker/pass@1 | {model} | sft | {np.mean(correct[model]):.4f} | "
                               f"{np.mean(start):.4f} | {mean:+.4f} | [{low:+.4f}, {high:+.4f}] | "
                               f"{'yes' if low > 0 or high < 0 else 'no: within noise'} |")
    # The value's own interval in the first table is the one-sample bootstrap of the same items.
    _, low, high = loop_bootstrap(correct["grpo"], [0] * 300, seed=5, resamples=RESAMPLES)
    assert any(line.startswith("| speaker/pass@1 |") and f"{np.mean(grpo):.4f} [{low:.3f}, {high:.3f}] (+" in line
               for line in lines)
    assert rows["grpo"].endswith("| yes |") and rows["dpo"].endswith("| no: within noise |")


def test_report_samples_show_each_models_answer_safely_in_a_table():
    task, results = task_and_results(["base", "sft"], {"base": [0, 0, 1, 0], "sft": [1, 0, 1, 1]})
    starts = {"base": None, "sft": "base"}
    page = report_markdown({"x": {"base": 1.0, "sft": 2.0}}, ["base", "sft"], starts, [(task, results)],
                           intervals_of(results, starts))
    lines = page.splitlines()
    assert "## speaker: the first 3 prompts, each model's greedy answer" in lines
    assert "### speaker 4" not in lines
    first = lines.index("### speaker 1")
    # The prompt in a fence, the answer and one row per model; a newline and a pipe cannot break the table.
    assert lines[first + 2:first + 10] == [
        "```text", "Who speaks first?", "", "Q0.", "```", "", 'Answer: ` "Q0" `', ""]
    assert '| base | `` "say \\| `x`\\nmore 0" `` | 0 |' in lines
    assert '| sft | ` "Q0" ` | 1 |' in lines
    assert page.endswith(".md).\n") and lines[-1] == ("Each model's generations of the `eval.samples` prompts: "
                         "[samples/base.md](samples/base.md), [samples/sft.md](samples/sft.md).")


def test_report_without_starting_models_says_there_is_nothing_to_compare():
    task, results = task_and_results(["a", "b"], {"a": [1, 0], "b": [0, 1]})
    starts = {"a": None, "b": None}
    page = report_markdown({"val_loss": {"a": 1.0, "b": 2.0}}, ["a", "b"], starts, [(task, results)],
                           intervals_of(results, starts))
    assert "| metric | better | chance | a | b |" in page and "| val_loss | lower | - | 1.0000 | 2.0000 |" in page
    assert "No model started from another evaluated model: no changes to show." in page
    assert "No model has a start scored on the same items: nothing to compare." in page
    assert "Paired bootstrap" not in page


def test_the_params_the_report_digests_are_those_dvc_yaml_gives_evaluate():
    """report.md's params digest covers what evaluate reads; dvc.yaml reruns it on exactly those keys."""
    import yaml

    from kiln.pipeline.evaluate.evaluate import READS
    from kiln.pipeline.post.held_out import READS as HELD_OUT_READS

    stages = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]
    digested = {"eval"} | {f"{section}.{key}" for section, keys in (READS | HELD_OUT_READS).items() for key in keys}
    assert set(stages["evaluate"]["params"]) == digested
