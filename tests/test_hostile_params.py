"""Hostile params (issue 18, classes 10, 12 and 14): non-finite, absurd and mistyped values, files that are not
UTF-8 or not YAML, and model sizes that cannot fit in memory. Each must stop at load time with one line naming the
file or the dotted key, exit 2, and leave what an earlier run wrote as it was."""

from __future__ import annotations

import json
import math
import time
import types
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import fails_in_one_line, tree_bytes, write_params
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.config import SECTIONS, build_section, load_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.evaluate.params import EvalParams
from kiln.pipeline.post.grpo_params import GRPOParams
from kiln.pipeline.post.params import DPOParams, SFTParams
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.text.bpe import load_tokenizer
from kiln.pipeline.text.shard import ShardParams
from kiln.pipeline.text.sources import DataParams
from kiln.pipeline.text.tokenizer import TokenizerParams
from kiln.pipeline.train.params import ModelParams, TrainParams

ALL_SECTIONS = (DataParams, TokenizerParams, ShardParams, ModelParams, TrainParams, ScalingParams, SFTParams,
                DPOParams, GRPOParams, EvalParams)
TINY = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 16, "max_seq_len": 16}


def test_every_section_is_covered():
    assert {cls.SECTION for cls in ALL_SECTIONS} == set(SECTIONS)


def raises_naming(*names: str):
    return pytest.raises(UserError, match=".*".join(n.replace(".", r"\.").replace("[", r"\[") for n in names))


# --- class 10: every float field, generated from the dataclasses --------------------------------------------


def float_fields() -> list[tuple[type, str, bool]]:
    """(section class, key, is a list) for every field typed float, float | None or list[float]."""
    out = []
    for cls in ALL_SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            tp = hints[f.name]
            options = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
            if float in options:
                out.append((cls, f.name, False))
            elif any(typing.get_args(o) == (float,) for o in options if typing.get_origin(o) is list):
                out.append((cls, f.name, True))
    return out


FLOAT_FIELDS = float_fields()


def test_float_fields_found():
    """The generated list is not empty by accident: the keys issue 18 names are in it."""
    names = {f"{cls.SECTION}.{key}" for cls, key, _ in FLOAT_FIELDS}
    assert {"train.lr", "train.weight_decay", "train.grad_clip", "scaling.budgets", "scaling.target_flops",
            "model.rope_theta", "eval.temperature", "dpo.beta", "data.val_fraction"} <= names


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("cls, key, is_list", FLOAT_FIELDS, ids=[f"{c.SECTION}.{k}" for c, k, _ in FLOAT_FIELDS])
def test_non_finite_float_refused_naming_its_key(cls, key, is_list, bad):
    value = [1e11, bad] if is_list else bad
    with raises_naming(f"{cls.SECTION}.{key}", "finite"):
        build_section(cls, {key: value})


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", "1e999", str(10**400)])
def test_non_finite_in_file_and_set(tmp_path, text):
    """As YAML writes them, in the file and in --set; 1e999 and 10**400 are finite text but not finite floats."""
    path = tmp_path / "params.yaml"
    path.write_text(f"train:\n  lr: {text}\n", encoding="utf-8")
    with raises_naming("train.lr"):
        load_section(TrainParams, path)
    with raises_naming("train.weight_decay"):
        load_section(TrainParams, write_params(tmp_path / "empty.yaml", {}), [f"train.weight_decay={text}"])


def test_nan_lr_is_reported_as_lr_not_min_lr():
    """Finiteness is checked before the range checks, which NaN would pass (every comparison is false)."""
    with pytest.raises(UserError) as e:
        build_section(TrainParams, {"lr": math.nan})
    assert "train.lr=" in str(e.value) and "min_lr" not in str(e.value)


@pytest.mark.parametrize(
    "cls, key, value",
    [
        (TrainParams, "lr", 0.0),
        (TrainParams, "lr", -1e-3),
        (TrainParams, "weight_decay", -0.1),
        (TrainParams, "grad_clip", -1.0),
        (TrainParams, "beta1", 1.0),
        (TrainParams, "beta2", -0.1),
        (TrainParams, "nproc_per_node", 10**6),
        (ScalingParams, "budgets", [1e11, 1e31]),
        (ScalingParams, "budgets", [1e11, -1.0]),
        (ScalingParams, "target_flops", 1e31),
        (ScalingParams, "bootstrap", 10**9),
        (ScalingParams, "lr", 0.0),
        (ShardParams, "threads", 10**6),
        (SFTParams, "lr", -1.0),
        (DPOParams, "weight_decay", -1.0),
    ],
)
def test_absurd_value_refused_naming_its_key(cls, key, value):
    with raises_naming(f"{cls.SECTION}.{key}"):
        build_section(cls, {key: value})


def test_lr_range_names_lr():
    with raises_naming("train.lr"):
        build_section(TrainParams, {"lr": -1.0, "min_lr": 0.0})
    with raises_naming("train.min_lr"):
        build_section(TrainParams, {"lr": 1e-3, "min_lr": 1e-2})


@pytest.mark.parametrize(
    "text, name",
    [
        ("train: [1, 2]\n", "train"),
        ("train:\n  lr: fast\n", "train.lr"),
        ("model:\n  n_layer: 4.5\n", "model.n_layer"),
        ("model:\n  n_layer: true\n", "model.n_layer"),  # bool is not an int
        ("scaling:\n  budgets: 1e11\n", "scaling.budgets"),
        ("scaling:\n  budgets: [1e11, fast]\n", "scaling.budgets[1]"),
        ("eval:\n  models: base\n", "eval.models"),
    ],
)
def test_wrong_type_in_file(tmp_path, text, name):
    path = tmp_path / "params.yaml"
    path.write_text(text, encoding="utf-8")
    section = name.split(".")[0]
    cls = next(c for c in ALL_SECTIONS if c.SECTION == section)
    with raises_naming(str(path) if name == section else name):
        load_section(cls, path)


def test_params_file_not_utf8(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_bytes(b"train:\n  lr: 0.1\xff\n")
    with raises_naming(str(path), "UTF-8"):
        load_section(TrainParams, path)


# a billion laughs as the value of train.lr: 9**9 strings once expanded, which printing the value did
BOMB = "train:\n  lr: [&l0 [" + ", ".join(["lol"] * 9) + "], " + ", ".join(
    f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)) + "]\n"


@pytest.mark.parametrize(("text", "said"), [
    (BOMB, "expand it to more than 100,000 values"),
    # within the limit, a nested value is quoted cut short, never whole
    ("train:\n  lr: [&a [" + ", ".join(["x"] * 50) + "], *a, *a, *a, *a, *a, *a, *a]\n", "... (list): expected a number"),
])
def test_a_yaml_bomb_is_refused_quickly_in_one_short_line(tmp_path, text, said):
    path = tmp_path / "params.yaml"
    path.write_text(text, encoding="utf-8")
    started = time.perf_counter()
    with pytest.raises(UserError) as raised:
        load_section(TrainParams, path)
    assert said in str(raised.value) and len(str(raised.value)) < 300 and time.perf_counter() - started < 5


def test_a_params_file_past_a_megabyte_is_refused(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  lr: 0.1\n" + "#" * 1_000_001, encoding="utf-8")
    with raises_naming(str(path), "at most 1,000,000"):
        load_section(TrainParams, path)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_as_params_file(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "params.yaml"
    path.write_bytes(data)
    for cls in ALL_SECTIONS:
        try:
            assert isinstance(load_section(cls, path), cls)
        except UserError as e:  # one line naming the file, or the section's key
            assert str(e).startswith((f"{path}: ", f"params: {cls.SECTION}.")) and "\n" not in str(e), str(e)


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                                             inner, max_size=3),
                      max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL_SECTIONS), st.data())
def test_any_values_for_a_section(cls, data):
    """Past the YAML parser: real keys of the section with any values give the section or a UserError."""
    keys = [f.name for f in fields(cls)]
    values = data.draw(st.dictionaries(st.sampled_from(keys) | st.text(max_size=5), VALUES, max_size=4))
    try:
        obj = build_section(cls, values)
    except UserError as e:  # one line naming the key
        assert str(e).startswith(f"params: {cls.SECTION}.") or str(e).startswith("params: unknown key "), str(e)
        assert "\n" not in str(e), str(e)
        return
    for f in fields(obj):
        value = getattr(obj, f.name)
        numbers = value if isinstance(value, list) else [value]
        assert all(math.isfinite(v) for v in numbers if isinstance(v, float)), (f.name, value)


# --- class 10 at the command line ---------------------------------------------------------------------------


def test_cli_inf_lr_exits_2_and_keeps_the_previous_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {})
    out = tmp_path / "data" / "models" / "base"
    out.mkdir(parents=True)
    (out / "config.json").write_text('{"earlier": "run"}\n')
    before = tree_bytes(tmp_path)
    fails_in_one_line(["pretrain", "--set", "train.lr=.inf"], 2, "train.lr", "finite")
    fails_in_one_line(["pretrain", "--set", "train.grad_clip=.nan"], 2, "train.grad_clip")
    assert tree_bytes(tmp_path) == before


def test_cli_float_option_must_be_finite(tmp_path):
    out = tmp_path / "fit.json"
    fails_in_one_line(["scaling", "fit", "--runs", str(tmp_path / "runs.csv"), "--out", str(out),
                       "--target-flops", "inf"], 2, "--target-flops", "finite")
    assert not out.exists()
    fails_in_one_line(["generate", "--prompt", "x", "--model", str(tmp_path), "--temperature", "nan"], 2,
                      "--temperature")


# --- class 12: sizes that cannot fit ------------------------------------------------------------------------


@pytest.mark.parametrize("arch, tie", [("llama", True), ("llama", False), ("gpt2", True)])
def test_memory_estimate_matches_a_built_model(arch, tie):
    """The estimate is computed from the shape; the reference is what torch allocates for the built model."""
    config = ModelConfig(vocab_size=300, arch=arch, tie_embeddings=tie, d_ff=40, **(TINY | {"n_layer": 3}))
    model = GPT(config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert config.num_params(embeddings=False) == model.num_params(embeddings=False)
    assert config.memory_bytes("for its weights") == weights + buffers
    assert config.memory_bytes("to train") == 4 * weights + buffers  # + gradients and AdamW's two moments


def test_default_model_builds():
    config = ModelParams().config(TokenizerParams().vocab_size)
    assert GPT(config).num_params() == config.num_params()


@pytest.mark.parametrize("key, value", [("n_layer", 10**9), ("d_model", 10**9), ("max_seq_len", 10**12)])
def test_params_size_that_cannot_fit(key, value):
    start = time.monotonic()
    with raises_naming(f"model.{key}={value}", "to train", "free"):
        build_section(ModelParams, {key: value})
    assert time.monotonic() - start < 2


def test_cli_pretrain_refuses_a_size_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {})
    start = time.monotonic()
    fails_in_one_line(["pretrain", "--set", "model.n_layer=1000000000"], 2, "model.n_layer=1000000000",
                      "PB to train", "this machine has")
    assert time.monotonic() - start < 2


def test_size_refused_on_a_small_device(monkeypatch):
    """The bound is the memory the machine has: a model 1 byte too large for it is refused, one that fits is not."""
    config = ModelConfig(vocab_size=300, **TINY)
    need = config.memory_bytes("for its weights")
    monkeypatch.setattr("kiln.model.config.memory_available", lambda device: need)
    GPT(config)
    monkeypatch.setattr("kiln.model.config.memory_available", lambda device: need - 1)
    with pytest.raises(ValueError, match="for its weights"):
        GPT(config)
    with pytest.raises(ValueError, match="for its weights"), torch.device("meta"):
        GPT(config)


@pytest.fixture
def model_folder(tmp_path) -> Path:
    config = ModelConfig(vocab_size=300, **TINY)
    return save_model(GPT(config), config, tmp_path / "model")


@pytest.mark.parametrize("key, value", [("n_layer", 10**9), ("d_model", 10**9), ("vocab_size", 10**12)])
def test_model_folder_size_that_cannot_fit(model_folder, key, value):
    path = model_folder / "config.json"
    meta = json.loads(path.read_text())
    shape = {"n_head": 1, "n_kv_head": 1} if key == "d_model" else {}
    meta["model"] |= {key: value, **shape}
    path.write_text(json.dumps(meta))
    before = tree_bytes(model_folder)
    start = time.monotonic()
    for args in (["generate", "--prompt", "x", "--model", str(model_folder), "--device", "cpu"],
                 ["convert", "to-hf", str(model_folder), str(model_folder.parent / "hf")]):
        fails_in_one_line(args, 2, str(path), f"{key}={value}", "free")
    assert time.monotonic() - start < 4
    assert tree_bytes(model_folder) == before
    assert not (model_folder.parent / "hf").exists()


def test_pretrain_refuses_the_tokenizers_vocabulary_when_it_cannot_fit(tiny, tmp_path, monkeypatch):
    """The model section is checked at load time with the smallest vocabulary; the tokenizer's, known only when
    training starts, is checked there, against a machine made just too small for it."""
    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    smallest, real = (ModelParams().config(v).memory_bytes("to train") for v in (256, vocab))
    assert smallest < real
    monkeypatch.setattr("kiln.model.config.memory_available", lambda device: smallest)
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {})
    fails_in_one_line(["pretrain", "--shards", str(tiny.shards), "--tokenizer", str(tiny.tokenizer), "--set",
                       "train.device=cpu"], 2, f"model.vocab_size={vocab}", "to train")
    assert not (tmp_path / "data").exists()


def test_a_mistyped_key_gets_a_suggestion(tmp_path):
    """`--set lora_rnk=4` and a section `trian:` name the key they most likely meant."""
    with pytest.raises(UserError, match=r"unknown key sft\.lora_rnk; did you mean 'sft\.lora_rank'\?"):
        build_section(SFTParams, {"lora_rnk": 4})
    path = tmp_path / "params.yaml"
    path.write_text("trian:\n  lr: 0.1\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"unknown section 'trian'; did you mean 'train'\?"):
        load_section(TrainParams, path)
    with pytest.raises(UserError) as far:  # nothing close: no guess
        build_section(SFTParams, {"zzz": 4})
    assert "did you mean" not in str(far.value)


@pytest.mark.parametrize("text, key, line", [
    ("train:\n  lr: 0.1\nmodel:\n  n_layer: 2\ntrain:\n  seed: 3\n", "train", 5),
    ("train:\n  lr: 0.1\n  lr: 0.2\n", "lr", 3),
])
def test_a_key_given_twice_is_refused_naming_it(tmp_path, text, key, line):
    """Duplicate keys were last-wins: a repeated `train:` section silently dropped the first one's keys."""
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_section(TrainParams, path)
    assert str(e.value) == f"{path}: not valid YAML (key '{key}' given twice in one mapping (line {line}); " \
        "expected each key once)"
    merged = tmp_path / "merged.yaml"  # a merge key overriding what it merges is YAML, not a repeat
    merged.write_text("model: &base {n_layer: 2}\ntrain:\n  <<: {lr: 0.1, seed: 3}\n  seed: 4\n")
    assert load_section(TrainParams, merged).seed == 4
