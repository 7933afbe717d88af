"""The DAG as a user drives it: `dvc repro`, a no-op second repro, `dvc exp run -S`, `dvc metrics diff`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import make_documents, tree_bytes

REPO = Path(__file__).resolve().parents[1]


def run(cwd: Path, *cmd: str, fails: bool = False) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    said = f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert (result.returncode != 0) == fails, said
    return result.stdout + result.stderr


def ran_stages(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


def test_the_sweep_reads_its_own_training_keys_not_trains():
    """What reruns the sweep, read off dvc.yaml: its own scaling.* copy of the optimiser and precision, never a
    train.* key, so `dvc exp run -S train.precision=bf16` reruns pretrain and what follows, not the sweep (an
    experiment per key would cost minutes of DVC runs)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    sweep, pretrain = stages["scaling_sweep"]["params"], stages["pretrain"]["params"]
    assert {"scaling.lr", "scaling.precision", "scaling.batch_size", "model"} <= set(sweep)
    assert not [key for key in sweep if key.split(".")[0] == "train"]
    assert "train" in pretrain  # every train key, processes included, is pretrain's
    # `-S train.precision=fp8` (and its recipe) reaches every training stage after pretrain too
    for name in ("sft", "dpo", "grpo"):
        assert {"train.precision", "train.fp8_recipe"} <= set(stages[name]["params"]), name


@pytest.fixture
def project(tmp_path):
    """A copy of the project's DAG in a fresh git+dvc repo, pointed at a small local corpus."""
    shutil.which("git") or pytest.fail("git is needed for DVC")
    root = tmp_path / "project"
    root.mkdir()
    for name in ("dvc.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO / name, root / name)
    for package in ("pipeline", "model", "kernels", "tasks"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache", "config.local"))
    # a local corpus lies under tasks/data, prepare's dep, so that DVC reruns prepare when it changes
    corpus = root / "tasks/data/corpus"
    corpus.mkdir()
    for i, text in enumerate(make_documents(200)):
        (corpus / f"{i:03d}.txt").write_text(text)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["source"] = "tasks/data/corpus"
    params["data"]["val_fraction"] = 0.2
    params["tokenizer"]["vocab_size"] = 300
    params["shard"]["shard_tokens"] = 4096
    params["model"].update(n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=32)
    params["train"].update(batch_size=4, batch_tokens=256, max_steps=6, warmup_steps=2, eval_every=3,
                           eval_tokens=256, checkpoint_every=3, log_every=2)
    params["scaling"].update(budgets=[2e7, 4e7], depths=[1, 2, 3], aspect=8, head_dim=4, batch_tokens=128,
                             eval_tokens=256, bootstrap=5, target_flops=1e8)
    # Post-training on local files in two of the real formats (the built-in task needs longer contexts).
    chat = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
            for i in range(12)]
    (root / "tasks/sft/chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chat))
    pairs = [{"question": f"up {i}?", "response_j": f"yes {i}", "response_k": f"no {i}"} for i in range(12)]
    (root / "tasks/dpo/pairs.json").write_text(json.dumps(pairs))
    loop = dict(max_steps=4, batch_size=2, batch_examples=4, warmup_steps=1, eval_every=2, checkpoint_every=2,
                log_every=2, val_examples=3)
    params["sft"].update(data="tasks/sft/chat.jsonl", **loop)
    params["dpo"].update(data="tasks/dpo/pairs.json", **loop)
    # A reward of the user's own that differs between any two completions of unequal length, so that GRPO moves
    # the weights (with equal rewards in a group every advantage is 0, and the model stays its start).
    prompts = [{"prompt": f"up {i}?", "answer": "yes"} for i in range(12)]
    (root / "tasks/grpo/prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    (root / "tasks/grpo/length.py").write_text("def reward(prompt, completion, answer):\n    return len(completion)\n")
    params["grpo"].update(data="tasks/grpo/prompts.jsonl", reward="tasks/grpo/length.py:reward", group_size=4,
                          max_new_tokens=4, **{**loop, "batch_examples": 8})
    # The built-in cloze task needs scenes of several lines; these documents are one line each.
    task = [{"query": f"doc {i}: the", "choices": [" king", " queen", " night"], "gold": i % 3} for i in range(6)]
    (root / "tasks/eval/task.jsonl").write_text("".join(json.dumps(row) + "\n" for row in task))
    params["eval"].update(tokens=256, batch_size=4, samples=["doc 1:"], max_new_tokens=4,
                          tasks=[{"name": "mine", "data": "tasks/eval/task.jsonl"}])
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    run(root, "git", "init", "-q")
    run(root, "git", "add", "-A")
    run(root, "git", "commit", "-qm", "init")
    return root


@pytest.mark.slow  # the whole DAG under DVC, ~3 min on 2 cores: `make test-slow`
def test_repro_noop_clean_tree_and_hand_runs(project):
    first = run(project, "dvc", "repro")
    assert ran_stages(first) == {"params_check", "prepare", "tokenizer", "shard", "scaling_sweep", "scaling_fit",
                                 "scaling_size", "pretrain", "sft", "dpo", "grpo", "evaluate"}
    for out in ("data/corpus/train.parquet", "data/tokenizer/tokenizer.json", "data/shards/manifest.json",
                "data/models/base/model.safetensors", "metrics/pretrain/curves.png", "data/scaling/fit.json",
                "metrics/scaling/isoflops.png", "data/models/sft/model.safetensors",
                "data/models/dpo/model.safetensors", "metrics/dpo/curves.png", "data/models/grpo/model.safetensors",
                "metrics/grpo/curves.png"):
        assert (project / out).is_file()
    assert json.loads((project / "metrics/tokenizer.json").read_text())["tokenizer"]["vocab_size"] == 300
    assert len((project / "data/scaling/runs.csv").read_text().splitlines()) == 1 + 6
    scaling = json.loads((project / "metrics/scaling.json").read_text())["scaling"]
    assert scaling["n_points"] == 6 and {"E", "A", "B", "alpha", "beta", "n_opt", "d_opt"} <= set(scaling)
    assert json.loads((project / "data/scaling/size.json").read_text()) == {"size": "fixed"}
    shown = json.loads(run(project, "dvc", "plots", "show", "--json"))
    assert not shown.get("errors")
    declared = yaml.safe_load((project / "dvc.yaml").read_text())["plots"]
    assert {next(iter(p)) if isinstance(p, dict) else p for p in declared} <= set(shown["data"])
    sft = json.loads((project / "metrics/sft.json").read_text())["sft"]
    assert sft["examples"] == 9 and sft["val_examples"] == 3 and sft["val_loss"] < sft["base"]["val_loss"]
    dpo = json.loads((project / "metrics/dpo.json").read_text())["dpo"]
    assert dpo["pairs"] == 9 and {"val/rewards/accuracies", "train/rewards/margins", "val/logps/chosen"} <= set(dpo)
    report = json.loads((project / "metrics/eval.json").read_text())["eval"]
    for metric in ("val_bpb", "mine/acc", "posttrain/preference_accuracy"):
        assert list(report[metric]) == ["base", "sft", "dpo", "grpo"]
    assert report["items"] == {"mine": 6, "mine/too_long": 0, "posttrain": 0, "posttrain_pairs": 3}
    assert (project / "metrics/samples/dpo.md").is_file()

    second = run(project, "dvc", "repro")
    assert ran_stages(second) == set()

    # Outputs are DVC's, not git's: only metrics, params and dvc.lock are committed.
    status = run(project, "git", "status", "--porcelain")
    assert "data/" not in status and "dvc.lock" in status
    run(project, "git", "add", "-A")
    run(project, "git", "commit", "-qm", "baseline")

    # A forced rerun gives the same outputs in another time: `dvc metrics diff` shows nothing and git sees no
    # change, because what it measured anew (seconds, tokens/s) lives in metrics/timings/, neither DVC's nor
    # git's. Pretraining again from scratch (its resume state gone) writes the same model, curves and lock.
    assert ran_stages(run(project, "dvc", "repro", "-f", "-s", "tokenizer")) == {"tokenizer"}
    assert "train_seconds" in json.loads((project / "metrics/timings/tokenizer.json").read_text())
    shutil.rmtree(project / "data/checkpoints/pretrain")
    assert ran_stages(run(project, "dvc", "repro", "-f", "-s", "pretrain")) == {"pretrain"}
    assert (project / "metrics/timings/pretrain/plots/metrics/tokens_per_s.tsv").is_file()
    assert json.loads(run(project, "dvc", "metrics", "diff", "--json") or "{}") == {}
    assert run(project, "git", "status", "--porcelain") == ""

    # A stage run by hand with other params is not the stage: it writes its own run folder and leaves every file
    # of the DAG's as it was, so DVC sees nothing to do.
    dag = {name: tree_bytes(project / name) for name in ("data", "metrics")}
    hand = run(project, "kiln", "pretrain", "--set", "train.max_steps=2")
    folder = project / hand.split("writing under ")[1].split("/ ")[0]
    assert f"the hand run wrote checkpoints/, metrics/, model/ under {folder.relative_to(project)}/" in hand
    assert folder.parent == project / "runs" and (folder / "model/model.safetensors").is_file()
    assert json.loads((folder / "metrics/pretrain.json").read_text())["pretrain"]["steps"] == 2
    assert (folder / "checkpoints/pretrain").is_dir() and (folder / "metrics/timings/pretrain.json").is_file()
    assert {name: tree_bytes(project / name) for name in ("data", "metrics")} == dag
    assert "up to date" in run(project, "dvc", "status")
    assert run(project, "git", "status", "--porcelain") == ""  # runs/ is git-ignored

    # A file a param names is a dep: editing the reward makes grpo and evaluate stale, and nothing before them.
    with (project / "tasks/grpo/length.py").open("a") as f:
        f.write("# edited\n")
    assert set(json.loads(run(project, "dvc", "status", "--json"))) == {"grpo", "evaluate"}
    # One outside every dep of its stage is refused before any work, naming the param and where it belongs.
    (project / "tasks/grpo/length.py").rename(project / "length.py")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["grpo"]["reward"] = "length.py:reward"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    refused = run(project, "dvc", "repro", "-s", "grpo", fails=True)
    assert ("params: grpo.reward: length.py is not among the grpo stage's deps in dvc.yaml, so DVC would not rerun "
            "grpo when it changes; expected it under tasks/grpo/") in refused


@pytest.mark.slow  # ~3 min of DVC experiments on 2 cores: `make test-slow`, not `make test`
def test_experiments_rerun_only_what_they_change(project):
    run(project, "dvc", "repro")
    run(project, "git", "add", "-A")
    run(project, "git", "commit", "-qm", "baseline")

    # Another budget: the sweep trains only its 3 runs, and with model.size fixed pretrain is left alone.
    exp = run(project, "dvc", "exp", "run", "-S", "scaling.budgets=[2e7,4e7,8e7]")
    assert ran_stages(exp) == {"params_check", "scaling_sweep", "scaling_fit", "scaling_size"}
    assert json.loads((project / "metrics/timings/scaling_sweep.json").read_text())["trained"] == 3
    run(project, "dvc", "exp", "apply", "HEAD")

    # model.size=auto: pretrain takes the shape the fit gives for scaling.target_flops, and says so.
    exp = run(project, "dvc", "exp", "run", "-S", "model.size=auto", "-S", "scaling.approach=parametric")
    # the sweep's stage runs and finds every run done
    assert ran_stages(exp) == {"params_check", "scaling_sweep", "scaling_size", "pretrain", "sft", "dpo", "grpo",
                               "evaluate"}
    size = json.loads((project / "data/scaling/size.json").read_text())
    pretrained = json.loads((project / "metrics/pretrain.json").read_text())["pretrain"]
    assert pretrained["size_auto"]["n_layer"] == size["n_layer"] and pretrained["tokens"] <= size["tokens"]
    assert "model.size auto" in exp
    run(project, "dvc", "exp", "apply", "HEAD")

    exp = run(project, "dvc", "exp", "run", "-S", "tokenizer.vocab_size=330")
    assert ran_stages(exp) == {"params_check", "tokenizer", "shard", "scaling_sweep", "scaling_fit", "scaling_size",
                               "pretrain", "sft", "dpo", "grpo", "evaluate"}
    assert json.loads((project / "metrics/tokenizer.json").read_text())["tokenizer"]["vocab_size"] == 330
    diff = json.loads(run(project, "dvc", "metrics", "diff", "--json"))
    change = diff["metrics/tokenizer.json"]["tokenizer.vocab_size"]
    assert change["old"] == 300 and change["new"] == 330
    run(project, "dvc", "exp", "apply", "HEAD")  # back to the baseline's outputs

    exp = run(project, "dvc", "exp", "run", "-S", "train.precision=bf16")
    # pretraining and what follows; the sweep trains with its own scaling.* keys, so it is left alone
    assert ran_stages(exp) == {"params_check", "pretrain", "sft", "dpo", "grpo", "evaluate"}
    assert "bf16" in exp  # the run says what it trains in
    diff = json.loads(run(project, "dvc", "metrics", "diff", "--json"))["metrics/pretrain.json"]
    diff = diff["pretrain.val_loss"]
    assert diff["old"] != diff["new"]  # bf16 rounding moves the numbers, a little
    assert abs(diff["new"] - diff["old"]) < 0.1

    # On top of that experiment's workspace (no `exp apply` in between), a DPO knob reruns DPO alone.
    before = json.loads((project / "metrics/eval.json").read_text())["eval"]
    exp = run(project, "dvc", "exp", "run", "-S", "dpo.beta=0.3")
    assert ran_stages(exp) == {"params_check", "dpo", "evaluate"}
    diff = json.loads(run(project, "dvc", "metrics", "diff", "--json"))
    margins = diff["metrics/dpo.json"]["dpo.val/rewards/margins"]
    assert margins["old"] != margins["new"]
    assert {"eval.val_loss.base", "eval.val_loss.sft", "eval.val_loss.dpo"} <= set(diff["metrics/eval.json"])  # vs fp32
    # The re-evaluation moves the DPO model's numbers only.
    after = json.loads((project / "metrics/eval.json").read_text())["eval"]
    assert after["val_loss"]["dpo"] != before["val_loss"]["dpo"]
    assert {k: v for k, v in after["val_loss"].items() if k != "dpo"} == \
        {k: v for k, v in before["val_loss"].items() if k != "dpo"}

    # GRPO's KL to its start: the grpo stage and the evaluation rerun, nothing upstream; the KL is now logged.
    grpo_before = (project / "data/models/grpo/model.safetensors").read_bytes()
    exp = run(project, "dvc", "exp", "run", "-S", "grpo.beta=0.04")
    assert ran_stages(exp) == {"params_check", "grpo", "evaluate"}
    assert (project / "metrics/grpo/plots/metrics/kl.tsv").is_file()
    final = json.loads((project / "metrics/eval.json").read_text())["eval"]
    # another GRPO model (over 4 steps the KL pull moves its val loss by less than the 5 decimals kept)
    assert (project / "data/models/grpo/model.safetensors").read_bytes() != grpo_before
    assert {k: v for k, v in final["val_loss"].items() if k != "grpo"} == \
        {k: v for k, v in after["val_loss"].items() if k != "grpo"}
