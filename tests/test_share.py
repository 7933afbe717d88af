"""Results that travel (README, "Share results"): a project's outputs, an experiment and the run cache pushed to a
DVC remote, and a teammate's clone that pulls them, serves the models and restores a training stage without
training, with DVC's and git's own commands only. The remote is a directory and `origin` a bare git repository,
both on this machine. The project is the DAG up to `sft`, on small shapes."""

import hashlib
import shutil

import pytest
import yaml
from test_dvc import project, ran_stages, run  # noqa: F401  (project is a fixture)

PROMPT = ["kiln", "generate", "--model", "data/models/sft", "--prompt", "doc 1:", "--max-new-tokens", "6",
          "--temperature", "0"]
KEPT = ("params_check", "prepare", "tokenizer", "shard", "scaling_sweep", "scaling_fit", "scaling_size", "pretrain",
        "sft")


@pytest.fixture
def small(project):  # noqa: F811
    """The project's DAG cut after sft: what `kiln generate --model data/models/sft` needs."""
    dag = yaml.safe_load((project / "dvc.yaml").read_text())
    dag["stages"] = {name: dag["stages"][name] for name in KEPT}
    written = {next(iter(out)) if isinstance(out, dict) else out for stage in dag["stages"].values()
               for out in stage["outs"]}
    dag["metrics"] = [path for path in dag["metrics"] if path in written]
    dag["plots"] = [p for p in dag["plots"] if any(path in str(p) for path in written)]
    dag["artifacts"] = {name: spec for name, spec in dag["artifacts"].items() if spec["path"] in written}
    (project / "dvc.yaml").write_text(yaml.safe_dump(dag, sort_keys=False))
    run(project, "git", "commit", "-qam", "the DAG up to sft")
    return project


def md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.slow  # a small DAG and two clones' worth of DVC commands (~2 s each): `make test-slow`
def test_a_teammate_pulls_the_models_experiments_and_run_cache_without_training(small, tmp_path):
    project = small  # noqa: F811
    origin, remote = tmp_path / "origin.git", tmp_path / "remote"
    run(tmp_path, "git", "init", "-q", "--bare", "--initial-branch", "main", str(origin))  # HEAD: main, as a host
    run(project, "git", "remote", "add", "origin", str(origin))
    run(project, "dvc", "remote", "add", "-d", "store", str(remote))
    assert ran_stages(run(project, "dvc", "repro")) == set(KEPT)
    run(project, "git", "add", "-A")
    run(project, "git", "commit", "-qm", "results")
    first_answer = run(project, *PROMPT)
    models = {name: (project / "data/models" / name / "model.safetensors").read_bytes() for name in ("base", "sft")}
    # the sft model's first version, as GTO (DVC's model registry) tags one: `dvc artifacts get` finds it by it
    run(project, "git", "tag", "-a", "sft@v1.0.0", "-m", "sft, the first version")
    run(project, "git", "push", "-q", "origin", "HEAD:refs/heads/main", "sft@v1.0.0")
    run(project, "dvc", "push")
    # an experiment (sft alone, fewer steps) in a copy of the project (`--temp`: the workspace stays as it is),
    # pushed with its outputs; then the run cache, which now holds sft's run at sft.max_steps=2 beside the baseline's
    experiment = run(project, "dvc", "exp", "run", "--temp", "sft", "-S", "sft.max_steps=2", "--name", "short-sft")
    assert ran_stages(experiment) == {"params_check", "sft"}
    assert (project / "data/models/sft/model.safetensors").read_bytes() == models["sft"]
    run(project, "dvc", "exp", "apply", "short-sft")
    short = {path: md5(project / path) for path in ("data/models/sft/model.safetensors", "metrics/sft.json",
                                                    "metrics/sft/plots/metrics/loss.tsv")}
    assert short["data/models/sft/model.safetensors"] != hashlib.md5(models["sft"]).hexdigest()  # another model
    run(project, "dvc", "exp", "push", "origin", "short-sft")
    run(project, "dvc", "push", "--run-cache")
    # checkpoints are not outputs (they are what varies between runs): none of their bytes is in the remote
    pushed = {p.parent.name + p.name for p in remote.rglob("*") if p.is_file()}
    assert md5(project / "data/models/sft/model.safetensors") in pushed  # the remote names files by md5...
    optimizer = next((project / "data/checkpoints/sft").rglob("optimizer.safetensors"))
    assert md5(optimizer) not in pushed  # ...and holds no checkpoint's

    teammate = tmp_path / "teammate"
    run(tmp_path, "git", "clone", "-q", "--branch", "main", str(origin), str(teammate))
    run(teammate, "dvc", "pull")
    assert "up to date" in run(teammate, "dvc", "status")
    assert run(teammate, *PROMPT) == first_answer  # the first clone's model
    assert (teammate / "data/models/sft/model.safetensors").read_bytes() == models["sft"]
    assert (teammate / "metrics/sft/curves.png").is_file()  # curves and summary travel with the model
    assert ran_stages(run(teammate, "dvc", "repro")) == set()  # nothing trains
    assert not (teammate / "data/checkpoints").exists()  # no training step ran: no resume state was written

    # a model alone, from the repository's URL, without a clone: the artifact's tagged version, or the path
    run(tmp_path, "dvc", "artifacts", "get", str(origin), "sft", "-o", str(tmp_path / "sft-artifact"))
    run(tmp_path, "dvc", "get", str(origin), "data/models/base", "-o", str(tmp_path / "base-model"))
    for got, name in ((tmp_path / "sft-artifact", "sft"), (tmp_path / "base-model", "base")):
        assert (got / "model.safetensors").read_bytes() == models[name]

    run(teammate, "dvc", "exp", "pull", "origin", "short-sft")
    assert "short-sft" in run(teammate, "dvc", "exp", "show", "--json")
    # The run cache: the params of a pushed run restore that run's outputs (model, summary, curves) instead of
    # training, params_check's and sft's alike.
    run(teammate, "dvc", "pull", "--run-cache")
    params = yaml.safe_load((teammate / "params.yaml").read_text())
    params["sft"]["max_steps"] = 2
    (teammate / "params.yaml").write_text(yaml.safe_dump(params))
    restored = run(teammate, "dvc", "repro")
    assert ran_stages(restored) == set() and "Stage 'sft' is cached" in restored, restored
    assert {path: md5(teammate / path) for path in short} == short
    assert not (teammate / "data/checkpoints").exists()
    assert "up to date" in run(teammate, "dvc", "status")

    # A long run's checkpoints travel only when asked: a tracked copy, pushed and pulled like any output
    shutil.copytree(project / "data/checkpoints/sft", project / "resume-sft")
    run(project, "dvc", "add", "resume-sft")
    run(project, "git", "add", "resume-sft.dvc", ".gitignore")
    run(project, "git", "commit", "-qm", "sft's checkpoints for a teammate")
    run(project, "dvc", "push", "resume-sft.dvc")
    run(project, "git", "push", "-q", "origin", "HEAD:refs/heads/main")
    run(teammate, "git", "checkout", "-q", "params.yaml", "dvc.lock")
    run(teammate, "git", "pull", "-q", "origin", "main")
    run(teammate, "dvc", "pull", "resume-sft.dvc")
    mine = sorted(p.relative_to(project / "resume-sft") for p in (project / "resume-sft").rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(teammate / "resume-sft") for p in (teammate / "resume-sft").rglob("*")
                    if p.is_file())
    assert mine == theirs and all((project / "resume-sft" / p).read_bytes() == (teammate / "resume-sft" / p)
                                  .read_bytes() for p in mine)
