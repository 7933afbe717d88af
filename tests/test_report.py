"""metrics/report.md (pipeline/evaluate/report.py) on constructed results: the table and its deltas, the paired
bootstrap against a plain resampling loop written here, and the samples section."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.pipeline.evaluate.generative import GenResult, GenTask, GenTaskSpec
from kiln.pipeline.evaluate.report import RESAMPLES, paired_bootstrap, report_markdown
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
                            [f"Q{i}" if c else f"say | `x`\nmore {i}" for i, c in enumerate(correct[m])])
               for m in models}
    return task, results


METRICS = {"val_loss": {"base": 4.0, "sft": 4.25, "dpo": 4.5, "grpo": 4.125},
           "speaker/pass@1": {"base": 0.0, "sft": 0.5, "dpo": 0.4, "grpo": 0.75},
           "posttrain/reward_accuracy": {"sft": 0.7, "dpo": 0.75},
           "items": {"speaker": 4, "speaker/too_long": 0}}
MODELS = ["base", "sft", "dpo", "grpo"]
STARTS = {"base": None, "sft": "base", "dpo": "sft", "grpo": "sft"}


def test_report_table_has_every_model_and_metric_with_its_delta():
    task, results = task_and_results(MODELS, {"base": [0, 0, 0, 0], "sft": [1, 1, 0, 0], "dpo": [1, 0, 0, 0],
                                              "grpo": [1, 1, 1, 0]})
    page = report_markdown(METRICS, MODELS, STARTS, [(task, results)], seed=0)
    lines = page.splitlines()
    assert lines[0] == "# Evaluation report"
    assert "(sft from base, dpo from sft, grpo from sft)" in page
    assert "| metric | better | chance | base | sft (vs base) | dpo (vs sft) | grpo (vs sft) |" in lines
    assert "| val_loss | lower | - | 4.0000 | 4.2500 (+0.2500) | 4.5000 (+0.2500) | 4.1250 (-0.1250) |" in lines
    assert "| speaker/pass@1 | higher | - | 0.0000 | 0.5000 (+0.5000) | 0.4000 (-0.1000) | 0.7500 (+0.2500) |" in lines
    # No value for base: sft's reward accuracy has nothing to be compared with.
    assert "| posttrain/reward_accuracy | higher | - | - | 0.7000 | 0.7500 (+0.0500) | - |" in lines
    assert "Items scored (the same for every model): speaker 4, speaker/too_long 0." in lines
    assert not any(line.startswith("| items") for line in lines)
    assert report_markdown(METRICS, MODELS, STARTS, [(task, results)], seed=0) == page  # the same bytes


def test_report_gives_chance_levels_and_provenance_where_known():
    task, results = task_and_results(MODELS, {m: [0, 1, 0, 1] for m in MODELS})
    lines = report_markdown(METRICS, MODELS, STARTS, [(task, results)], seed=0,
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
    lines = report_markdown(METRICS, MODELS, STARTS, [(task, results)], seed=5).splitlines()
    assert f"Paired bootstrap over the same 300 prompts ({RESAMPLES:,} resamples, seed 5): the mean per-prompt " \
           "change in greedy pass@1 and its 95% interval." in lines
    head = lines.index("| model | start | pass@1 | start's pass@1 | change | 95% interval | excludes 0 |")
    rows = {line.split(" | ")[0][2:]: line for line in lines[head + 2:lines.index("", head)]}
    assert list(rows) == ["sft", "dpo", "grpo"]  # every model with a start, in eval.models order
    assert rows["sft"].startswith("| sft | base | 0.3") and rows["sft"].endswith("| yes |")  # base: 0 everywhere
    for model in ("dpo", "grpo"):
        mean, low, high = loop_bootstrap(correct[model], start, seed=5, resamples=RESAMPLES)
        assert rows[model] == (f"| {model} | sft | {np.mean(correct[model]):.4f} | {np.mean(start):.4f} | "
                               f"{mean:+.4f} | [{low:+.4f}, {high:+.4f}] | "
                               f"{'yes' if low > 0 or high < 0 else 'no: within noise'} |")
    assert rows["grpo"].endswith("| yes |") and rows["dpo"].endswith("| no: within noise |")


def test_report_samples_show_each_models_answer_safely_in_a_table():
    task, results = task_and_results(["base", "sft"], {"base": [0, 0, 1, 0], "sft": [1, 0, 1, 1]})
    page = report_markdown({"x": {"base": 1.0, "sft": 2.0}}, ["base", "sft"], {"base": None, "sft": "base"},
                           [(task, results)], seed=0)
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
    page = report_markdown({"val_loss": {"a": 1.0, "b": 2.0}}, ["a", "b"], {"a": None, "b": None},
                           [(task, results)], seed=0)
    assert "| metric | better | chance | a | b |" in page and "| val_loss | lower | - | 1.0000 | 2.0000 |" in page
    assert "No model started from another evaluated model: no changes to show." in page
    assert "No model started from another evaluated model: nothing to compare." in page
    assert "Paired bootstrap" not in page


def test_the_params_the_report_digests_are_those_dvc_yaml_gives_evaluate():
    """report.md's params digest covers what evaluate reads; dvc.yaml reruns it on exactly those keys."""
    import yaml

    from kiln.pipeline.evaluate.evaluate import READS

    stages = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]
    digested = {"eval"} | {f"{section}.{key}" for section, keys in READS.items() for key in keys}
    assert set(stages["evaluate"]["params"]) == digested
