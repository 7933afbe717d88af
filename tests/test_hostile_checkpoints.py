"""Hostile checkpoints and model folders (issue 18, classes 11, 13, 14): every file kiln reads back from a
training run is checked by type, and every refusal is one line naming the file and the field, exit 2, with the
previous outputs untouched. The readers are property-tested: any bytes give a valid object or the one error
their layer raises (UserError in the pipeline, ValueError in `model/`, which the commands turn into UserError).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kiln.model.checkpoint import load_config, load_model
from kiln.model.gpt import GPT
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.train.checkpoints import STATE_FIELDS, Checkpoints, read_state
from kiln.pipeline.train.loop import build_optimizer
from kiln.pipeline.train.params import ModelParams, TrainParams
from kiln.pipeline.train.pretrain import pretrain
from tests.conftest import fails_in_one_line, tree_bytes, write_params

MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TRAIN = {"batch_size": 4, "batch_tokens": 128, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1, "eval_every": 2,
         "eval_tokens": 128, "checkpoint_every": 2, "log_every": 1, "device": "cpu", "max_steps": 2}


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> Path:
    """A folder where `kiln train` ran two steps: params.yaml, base/ and ckpt/<run>/step_00000002/."""
    root = tmp_path_factory.mktemp("trained")
    write_params(root / "params.yaml", {"model": MODEL, "train": TRAIN})
    with contextlib.chdir(root):
        pretrain(build_section(ModelParams, MODEL), build_section(TrainParams, TRAIN), tiny.shards, tiny.tokenizer,
                 root / "base", root / "ckpt")
    return root


@pytest.fixture
def project(trained, tmp_path, monkeypatch) -> Path:
    """A copy of `trained` to spoil, as the working directory."""
    copy = tmp_path / "project"
    shutil.copytree(trained, copy)
    monkeypatch.chdir(copy)
    return copy


def checkpoint(project: Path) -> Path:
    """The checkpoint, relative to the project (the working directory), as `kiln train` names it."""
    (found,) = project.glob("ckpt/*/step_00000002")
    return found.relative_to(project)


def train_args(tiny) -> list[str]:
    return ["train", "--shards", str(tiny.shards), "--tokenizer", str(tiny.tokenizer), "--out", "run",
            "--checkpoints", "ckpt"]


def outputs(project: Path) -> dict[str, bytes]:
    return {**tree_bytes(project / "base"), **{f"ckpt/{k}": v for k, v in tree_bytes(project / "ckpt").items()}}


def good_state(project: Path) -> dict:
    return json.loads((checkpoint(project) / "state.json").read_text())


# --- state.json, as `kiln train` resumes from it ---------------------------------------------------------------

STATE_CASES = {
    "an array": (b"[]", "expected a JSON object"),
    "an empty object": (b"{}", "step"),
    "not UTF-8": (b'{"step": "\xff\xfe"}', "not JSON"),
    "random bytes": (bytes(range(7, 200, 3)), "not JSON"),
    "truncated": (b'{"step": 2, "fingerprint": {', "not JSON"),
}
FIELD_CASES = [("step", "2"), ("step", -1), ("step", True), ("step", None), ("fingerprint", []),
               ("param_groups", {}), ("param_groups", [{"params": [1.5]}]), ("scaler", 3), ("loader", None),
               ("rng_python", "seed"), ("rng_python", [3, [1, 2], "x"]), ("rng_numpy", [1, 2]),
               ("train_loss", float("nan")), ("train_seconds", -5.0), ("train_seconds", float("inf"))]


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_a_broken_state_json_is_one_line(tiny, project, case):
    data, words = STATE_CASES[case]
    state = checkpoint(project) / "state.json"
    state.write_bytes(data)
    before = outputs(project)
    fails_in_one_line(train_args(tiny), 2, state, words)
    assert outputs(project) == before


@pytest.mark.parametrize("field, value", FIELD_CASES, ids=[f"{k}={v!r}" for k, v in FIELD_CASES])
def test_a_wrong_typed_state_field_is_named(tiny, project, field, value):
    state = good_state(project)
    state[field] = value
    path = checkpoint(project) / "state.json"
    path.write_text(json.dumps(state))  # Python writes NaN and Infinity, as a hand edit or another tool might
    before = outputs(project)
    fails_in_one_line(train_args(tiny), 2, path, field)
    assert outputs(project) == before


def test_a_state_of_another_run_in_this_runs_folder_is_refused(tiny, project):
    state = good_state(project)
    state["fingerprint"]["train"]["lr"] = 1.0
    path = checkpoint(project) / "state.json"
    path.write_text(json.dumps(state))
    fails_in_one_line(train_args(tiny), 2, path, "fingerprint")


def test_spoiled_checkpoint_tensors_are_one_line(tiny, project):
    folder = checkpoint(project)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:len(good) // 2])  # truncated
    fails_in_one_line(train_args(tiny), 2, folder, "corrupt checkpoint")

    weights.write_bytes(good)
    tensors = load_file(weights)
    tensors["tok_emb.weight"][0, 0] = float("nan")
    save_file(tensors, weights)
    fails_in_one_line(train_args(tiny), 2, weights, "tok_emb.weight", "NaN")


def test_optimizer_moments_that_fit_no_parameter_are_refused(project):
    """Shapes are checked against the live model, so after the run's first line; the error is one line too."""
    folder = checkpoint(project)
    tensors = load_file(folder / "optimizer.safetensors")
    key = next(k for k in tensors if k.endswith("exp_avg"))
    tensors[key] = torch.zeros(3, 5)
    save_file(tensors, folder / "optimizer.safetensors")
    checkpoints = Checkpoints(Path("ckpt"), good_state(project)["fingerprint"], 2)
    config, _ = load_config(project / "base")
    model = GPT(config)
    optimizer = build_optimizer(model, build_section(TrainParams, TRAIN), torch.device("cpu"))
    with pytest.raises(UserError, match=rf"^{folder / 'optimizer.safetensors'}: {key}: shape \(3, 5\)[^\n]*$"):
        checkpoints.load(checkpoints.newest(), model, optimizer, torch.amp.GradScaler("cpu", enabled=False))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_state_reader_on_any_bytes(tmp_path, data):
    (tmp_path / "state.json").write_bytes(data)
    try:
        assert isinstance(read_state(tmp_path), dict)
    except UserError as e:
        assert "\n" not in str(e) and str(tmp_path / "state.json") in str(e)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 700) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(sorted(STATE_FIELDS)), JSON))
def test_state_reader_on_any_fields(tmp_path, fields):
    (tmp_path / "state.json").write_text(json.dumps(fields))
    try:
        state = read_state(tmp_path)
    except UserError as e:
        assert "\n" not in str(e) and str(tmp_path / "state.json") in str(e)
        return
    assert isinstance(state["step"], int) and state["step"] >= 0 and isinstance(state["loader"], dict)


# --- model folders, as `kiln generate`, `kiln chat` and `kiln eval` read them -------------------------------------

CONFIG_CASES = [("n_layer", "1"), ("n_layer", None), ("n_layer", [1]), ("n_layer", -1), ("d_model", 32.0),
                ("rope_theta", float("nan")), ("rope_theta", float("inf")), ("norm_eps", -1e-5), ("arch", 3),
                ("tie_embeddings", "yes"), ("dropout", 2.0), ("tokenizer_sha256", 123), ("chat_format", ["chatml"]),
                ("init", "base")]


def spoil_config(model: Path, key: str, value) -> Path:
    path = model / "config.json"
    config = json.loads(path.read_text())
    (config["model"] if key in config["model"] else config)[key] = value
    path.write_text(json.dumps(config))
    return path


def model_commands(tiny, model: Path) -> dict[str, list[str]]:
    tok = ["--tokenizer", str(tiny.tokenizer)]
    return {"generate": ["generate", "--prompt", "the king", "--model", str(model), *tok, "--device", "cpu"],
            "chat": ["chat", "--model", str(model), *tok, "--device", "cpu"],
            "eval": ["eval", "--models", str(model.parent), "--shards", str(tiny.shards), *tok, "--corpus",
                     str(tiny.corpus), "--set", f"eval.models=[{model.name}]", "--set", "train.device=cpu"]}


@pytest.mark.parametrize("key, value", CONFIG_CASES, ids=[f"{k}={v!r}" for k, v in CONFIG_CASES])
def test_a_wrong_typed_model_config_is_named(tiny, project, key, value):
    path = spoil_config(project / "base", key, value)
    before = outputs(project)
    for args in model_commands(tiny, project / "base").values():
        fails_in_one_line(args, 2, path, key)
    assert outputs(project) == before and not (project / "metrics" / "eval.json").exists()


@pytest.mark.parametrize("spoil", ["truncated", "not safetensors", "NaN weight", "integer weight"])
def test_a_spoiled_model_safetensors_is_one_line(tiny, project, spoil):
    path = project / "base" / "model.safetensors"
    data = path.read_bytes()
    if spoil == "truncated":
        path.write_bytes(data[:-100])
    elif spoil == "not safetensors":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    else:
        tensors = load_file(path)
        if spoil == "NaN weight":
            tensors["tok_emb.weight"][3, 1] = float("nan")
        else:
            tensors["tok_emb.weight"] = tensors["tok_emb.weight"].to(torch.int32)
        save_file(tensors, path)
    for args in model_commands(tiny, project / "base").values():
        fails_in_one_line(args, 2, path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200) | st.dictionaries(st.sampled_from(["model", "tokenizer_sha256", "init"]), JSON)
       .map(lambda d: json.dumps(d).encode()))
def test_model_config_reader_on_any_bytes(tmp_path, data):
    (tmp_path / "config.json").write_bytes(data)
    try:
        load_config(tmp_path)
    except ValueError as e:
        assert "\n" not in str(e) and str(tmp_path / "config.json") in str(e)


MODEL_FIELDS = st.dictionaries(st.sampled_from(["vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff",
                                                "max_seq_len", "arch", "rope_theta", "norm_eps", "tie_embeddings",
                                                "dropout"]), JSON)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MODEL_FIELDS)
def test_model_config_reader_on_any_fields(tmp_path, fields):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"vocab_size": 300, **fields}}))
    try:
        config, _ = load_config(tmp_path)
    except ValueError as e:
        assert "\n" not in str(e) and str(tmp_path / "config.json") in str(e)
        return
    assert all(getattr(config, k) > 0 for k in ("n_layer", "n_head", "d_model", "max_seq_len"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=16))
def test_model_weights_reader_on_cut_and_spoiled_files(trained, tmp_path, cut, junk):
    model = tmp_path / "m"
    shutil.copytree(trained / "base", model, dirs_exist_ok=True)
    data = (trained / "base" / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:cut % len(data)] + junk)
    with pytest.raises(ValueError, match=str(model / "model.safetensors").replace(".", r"\.")):
        load_model(model)
