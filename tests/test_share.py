"""Results that travel (README, "Share results"): a project's outputs, experiments and run cache pushed to a DVC
remote, and a teammate's clone that pulls them and serves the models without training, with DVC's and git's own
commands only. The remote is a directory and `origin` a bare git repository, both on this machine."""

import shutil

import pytest
import yaml
from test_dvc import project, ran_stages, run  # noqa: F401  (project is a fixture)

PROMPT = ["kiln", "generate", "--model", "data/models/sft", "--prompt", "doc 1:", "--max-new-tokens", "6",
          "--temperature", "0"]


@pytest.mark.slow  # the whole small DAG and two clones' worth of DVC, ~5 min on 2 cores: `make test-slow`
def test_a_teammate_pulls_the_models_experiments_and_run_cache_without_training(project, tmp_path):  # noqa: F811
    origin, remote = tmp_path / "origin.git", tmp_path / "remote"
    run(tmp_path, "git", "init", "-q", "--bare", "--initial-branch", "main", str(origin))  # HEAD: main, as a host
    run(project, "git", "remote", "add", "origin", str(origin))
    run(project, "dvc", "remote", "add", "-d", "store", str(remote))
    assert ran_stages(run(project, "dvc", "repro")) >= {"pretrain", "sft", "evaluate"}
    run(project, "git", "add", "-A")
    run(project, "git", "commit", "-qm", "results")
    first_answer = run(project, *PROMPT)
    models = {name: (project / "data/models" / name / "model.safetensors").read_bytes() for name in ("sft", "dpo")}
    # the sft model's first version, as GTO (DVC's model registry) tags one: `dvc artifacts get` finds it by it
    run(project, "git", "tag", "-a", "sft@v1.0.0", "-m", "sft, the first version")
    run(project, "git", "push", "-q", "origin", "HEAD:refs/heads/main", "sft@v1.0.0")
    run(project, "dvc", "push")
    # two experiments, each from the pushed commit (the workspace put back between them), then one of them and the
    # run cache (which now holds the scaling_size run of the other) pushed
    experiment = run(project, "dvc", "exp", "run", "sft", "-S", "sft.max_steps=2", "--name", "short-sft")
    assert ran_stages(experiment) == {"params_check", "sft"}
    run(project, "git", "checkout", "-q", "--", ".")
    run(project, "dvc", "checkout", "-q")
    sized = run(project, "dvc", "exp", "run", "scaling_size", "-S", "scaling.approach=parametric")
    assert ran_stages(sized) == {"params_check", "scaling_size"}
    run(project, "dvc", "exp", "push", "origin", "short-sft")
    run(project, "dvc", "push", "--run-cache")
    # checkpoints are not outputs (they are what varies between runs): nothing of theirs is in the remote
    pushed = {p.name for p in remote.rglob("*") if p.is_file()}
    checkpoint = next((project / "data/checkpoints/sft").rglob("model.safetensors"))
    assert checkpoint.read_bytes() and run(project, "dvc", "cache", "dir")  # it exists here...
    assert not any(name.endswith(".safetensors") for name in pushed)  # ...and the cache names files by hash

    teammate = tmp_path / "teammate"
    run(tmp_path, "git", "clone", "-q", "--branch", "main", str(origin), str(teammate))
    pulled = run(teammate, "dvc", "pull")
    assert "data/models/sft" in pulled or "files added" in pulled or "fetched" in pulled.lower()
    assert "up to date" in run(teammate, "dvc", "status")
    assert run(teammate, *PROMPT) == first_answer  # the first clone's model
    assert (teammate / "data/models/sft/model.safetensors").read_bytes() == models["sft"]
    assert ran_stages(run(teammate, "dvc", "repro")) == set()  # nothing trains
    assert not (teammate / "data/checkpoints").exists()  # no training step ran: no resume state was written

    # a model alone, from the repository's URL, without a clone: the artifact's tagged version, or the path
    run(tmp_path, "dvc", "artifacts", "get", str(origin), "sft", "-o", str(tmp_path / "sft-artifact"))
    run(tmp_path, "dvc", "get", str(origin), "data/models/dpo", "-o", str(tmp_path / "dpo-model"))
    for got, name in ((tmp_path / "sft-artifact", "sft"), (tmp_path / "dpo-model", "dpo")):
        assert (got / "model.safetensors").read_bytes() == models[name]

    run(teammate, "dvc", "exp", "pull", "origin", "short-sft")
    assert "short-sft" in run(teammate, "dvc", "exp", "show", "--json")
    # The run cache: a params change to a value run in the first clone restores that stage's outputs instead of
    # running it. DVC keeps it only for stages whose every output is in its cache: here params_check and
    # scaling_size. The training and evaluate stages write git-tracked metrics (cache: false) and persistent
    # curves, which DVC never run-caches; their models travel by dvc push/pull, as above.
    run(teammate, "dvc", "pull", "--run-cache")
    params = yaml.safe_load((teammate / "params.yaml").read_text())
    params["scaling"]["approach"] = "parametric"
    (teammate / "params.yaml").write_text(yaml.safe_dump(params))
    restored = run(teammate, "dvc", "repro")
    assert ran_stages(restored) == set() and "Stage 'scaling_size' is cached" in restored, restored
    assert not (teammate / "data/checkpoints").exists()

    # A long run's checkpoints travel only when asked: a tracked copy, pushed and pulled like any output
    shutil.copytree(project / "data/checkpoints/sft", project / "resume-sft")
    run(project, "dvc", "add", "resume-sft")
    run(project, "git", "add", "resume-sft.dvc", ".gitignore")
    run(project, "git", "commit", "-qm", "sft's checkpoints for a teammate")
    run(project, "dvc", "push", "resume-sft.dvc")
    run(project, "git", "push", "-q", "origin", "HEAD:refs/heads/main")
    run(teammate, "git", "checkout", "-q", "params.yaml")
    run(teammate, "git", "pull", "-q", "origin", "main")
    run(teammate, "dvc", "pull", "resume-sft.dvc")
    mine = sorted(p.relative_to(project / "resume-sft") for p in (project / "resume-sft").rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(teammate / "resume-sft") for p in (teammate / "resume-sft").rglob("*")
                    if p.is_file())
    assert mine == theirs and all((project / "resume-sft" / p).read_bytes() == (teammate / "resume-sft" / p)
                                  .read_bytes() for p in mine)
