"""A file a param names must be among its stage's DVC deps when DVC runs the stage (pipeline/stage_inputs.py)."""

import json
import sys

import pytest
import yaml

from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.chat_data import read_rows
from kiln.pipeline.tasks.rewards import make_reward, score
from kiln.pipeline.tasks.tasks import TaskSpec, load_task


@pytest.fixture
def dag(tmp_path, monkeypatch):
    """A project whose dvc.yaml gives grpo the deps tasks/grpo and an interpolated model folder; DVC running
    its grpo stage (DVC sets DVC_STAGE and DVC_ROOT)."""
    (tmp_path / "tasks/grpo").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    stages = {"grpo": {"cmd": "kiln grpo", "deps": ["data/models/${grpo.init}", "tasks/grpo", "extra.jsonl"]},
              "evaluate": {"cmd": "kiln evaluate", "deps": ["tasks"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    reward = "def score(prompt, completion, answer):\n    return float(answer in completion)\n"
    for where in ("tasks/grpo/mine.py", "elsewhere/mine.py", "root_reward.py"):
        (tmp_path / where).write_text(reward)
    rows = json.dumps({"prompt": "p", "answer": "a", "query": "q", "choices": ["x", "y"], "gold": 0}) + "\n"
    for where in ("tasks/grpo/rows.jsonl", "elsewhere/rows.jsonl", "extra.jsonl"):
        (tmp_path / where).write_text(rows)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "grpo")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("root_reward", None)


def test_files_under_the_stages_deps_are_read(dag):
    assert score(make_reward("tasks/grpo/mine.py:score"), [("", "an a", "a")], "t") == [1.0]
    assert list(read_rows("tasks/grpo/rows.jsonl", "train", "grpo.data"))[0]["answer"] == "a"
    assert list(read_rows("extra.jsonl", "train", "grpo.data"))  # a file dvc.yaml lists by name


def test_a_file_outside_them_is_refused_naming_the_param_and_the_folder(dag):
    expected = ("is not among the grpo stage's deps in dvc.yaml, so DVC would not rerun grpo when it changes; "
                "expected it under tasks/grpo/ (or add it to the stage's deps)")
    with pytest.raises(UserError) as e:
        make_reward("elsewhere/mine.py:score")
    assert str(e.value) == f"params: grpo.reward: elsewhere/mine.py {expected}"
    with pytest.raises(UserError, match=r"^params: grpo.data: elsewhere/rows.jsonl is not among"):
        read_rows("elsewhere/rows.jsonl", "train", "grpo.data")
    # A module of the project's own, imported by name, is a file like any other; an installed one is not checked.
    with pytest.raises(UserError, match=r"^params: eval.tasks\[1\].reward: .*root_reward.py is not among"):
        make_reward("root_reward:score", key="eval.tasks[1]")
    assert make_reward("posixpath:join")  # a module of the standard library: not the project's


def test_a_temp_or_queued_experiment_reads_the_deps_of_the_copy_it_runs_in(dag, monkeypatch, tmp_path_factory):
    """`dvc exp run --temp` and queued experiments run the stage in a copy of the project (cwd) while DVC_ROOT
    names the repository they came from, whose dvc.yaml may differ: the copy's deps decide."""
    origin = tmp_path_factory.mktemp("origin")
    (origin / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"grpo": {"cmd": "kiln grpo", "deps": ["other"]}}}))
    monkeypatch.setenv("DVC_ROOT", str(origin))
    assert list(read_rows("tasks/grpo/rows.jsonl", "train", "grpo.data"))[0]["answer"] == "a"
    with pytest.raises(UserError, match=r"^params: grpo.data: elsewhere/rows.jsonl is not among .* under tasks/grpo/"):
        read_rows("elsewhere/rows.jsonl", "train", "grpo.data")


def test_evaluate_takes_anything_under_tasks_and_a_hand_run_anything(dag, monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "evaluate")
    assert len(load_task(TaskSpec(name="t", data="tasks/grpo/rows.jsonl"), "eval.tasks[0]").items) == 1
    with pytest.raises(UserError, match=r"^params: eval.tasks\[0\].data: elsewhere/rows.jsonl is not among the "
                                        r"evaluate stage's deps in dvc.yaml.*expected it under tasks/ "):
        load_task(TaskSpec(name="t", data="elsewhere/rows.jsonl"), "eval.tasks[0]")
    monkeypatch.delenv("DVC_STAGE")
    assert score(make_reward("elsewhere/mine.py:score"), [("", "a", "a")], "t") == [1.0]
    assert len(load_task(TaskSpec(name="t", data="elsewhere/rows.jsonl"), "eval.tasks[0]").items) == 1


def test_a_stage_kiln_cannot_find_in_dvc_yaml_is_not_checked(dag, monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "other/dvc.yaml:train")
    assert score(make_reward("elsewhere/mine.py:score"), [("", "a", "a")], "t") == [1.0]


def test_a_corpus_of_the_user_s_own_must_be_a_dep_of_prepare(tmp_path, monkeypatch):
    from kiln.pipeline.text.sources import local_units

    (tmp_path / "tasks/data").mkdir(parents=True)
    (tmp_path / "books").mkdir()
    for where in ("tasks/data/a.txt", "books/b.txt"):
        (tmp_path / where).write_text("to be or not to be\n")
    stages = {"prepare": {"cmd": "kiln data prepare", "deps": ["tasks/data"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "prepare")
    assert len(list(local_units("tasks/data/*.txt", "text"))) == 1
    with pytest.raises(UserError, match=r"^params: data.source: books/b.txt is not among the prepare stage's deps in "
                                        r"dvc.yaml, so DVC would not rerun prepare when it changes; expected it "
                                        r"under tasks/data/"):
        local_units("books/*.txt", "text")
    monkeypatch.delenv("DVC_STAGE")  # by hand, any file
    assert len(list(local_units("books/*.txt", "text"))) == 1
