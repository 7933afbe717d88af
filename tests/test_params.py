"""params.yaml loading and validation (pipeline/config.py and the dataclass beside each stage) and how the CLI
reports a bad value.

Every bad key or value must stop the command with a `UserError` naming the dotted key, before any work; the
CLI turns that into exit code 2 and one line on stderr.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_params
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.config import SECTIONS, build_section, load_section, read_params_file
from kiln.pipeline.errors import UserError
from kiln.pipeline.evaluate.params import EvalParams
from kiln.pipeline.post.grpo_params import GRPOParams
from kiln.pipeline.post.params import DPOParams, SFTParams
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.text.bpe import SPECIAL_TOKENS
from kiln.pipeline.text.shard import ShardParams
from kiln.pipeline.text.sources import DataParams
from kiln.pipeline.text.tokenizer import TokenizerParams
from kiln.pipeline.train.params import ModelParams, TrainParams

REPO = Path(__file__).resolve().parents[1]
KILN = Path(sys.executable).parent / "kiln"


def raises_naming(key: str):
    """`pytest.raises(UserError)` whose message must contain `key` (checked after the block)."""
    return pytest.raises(UserError, match=key.replace(".", r"\."))


# --- the repository's own params.yaml ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [DataParams, TokenizerParams, ShardParams])
def test_repo_params_yaml_loads(cls):
    path = REPO / "params.yaml"
    obj = load_section(cls, path)
    assert isinstance(obj, cls)
    # Every value in the file made it into the dataclass unchanged.
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))[cls.SECTION]
    for key, value in raw.items():
        assert getattr(obj, key) == value, key


ALL_SECTIONS = [DataParams, TokenizerParams, ShardParams, ModelParams, TrainParams, ScalingParams, SFTParams,
                DPOParams, GRPOParams, EvalParams]


@pytest.mark.parametrize("cls", ALL_SECTIONS, ids=lambda c: c.SECTION)
def test_dataclass_defaults_are_params_yaml(cls):
    """params.yaml is the one source of defaults: a command run outside DVC with no --set (a section missing
    from its params file) trains exactly what `dvc repro` trains."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    assert set(raw) == {c.SECTION for c in ALL_SECTIONS}
    assert set(raw[cls.SECTION]) == {f.name for f in dataclasses.fields(cls)}, "params.yaml lists every key"
    assert cls() == build_section(cls, raw[cls.SECTION])


def test_repo_params_yaml_has_only_known_sections():
    raw = read_params_file(REPO / "params.yaml")
    assert set(raw) <= set(SECTIONS)


def test_missing_section_gives_defaults(tmp_path):
    path = write_params(tmp_path / "params.yaml", {"data": {"max_docs": 3}})
    assert load_section(TokenizerParams, path) == TokenizerParams()
    assert load_section(DataParams, path) == DataParams(max_docs=3)


def test_int_accepted_for_float():
    obj = build_section(DataParams, {"val_fraction": 0.5})
    assert obj.val_fraction == 0.5
    # YAML `1` is an int; a float field takes it (the range check then decides).
    with raises_naming("data.val_fraction"):
        build_section(DataParams, {"val_fraction": 1})


# --- unknown keys, wrong types, out of range ------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, key",
    [(DataParams, "bogus"), (TokenizerParams, "vocab"), (ShardParams, "shard_token")],
)
def test_unknown_key(cls, key):
    with raises_naming(f"{cls.SECTION}.{key}"):
        build_section(cls, {key: 1})


def test_unknown_key_in_file(tmp_path):
    path = write_params(tmp_path / "params.yaml", {"data": {"bogus": 1}})
    with raises_naming("data.bogus"):
        load_section(DataParams, path)


@pytest.mark.parametrize(
    "cls, key, value",
    [
        (DataParams, "val_fraction", "abc"),
        (DataParams, "val_fraction", True),
        (DataParams, "val_fraction", None),
        (DataParams, "max_docs", 2.5),
        (DataParams, "max_docs", True),  # a bool is not an int here, although bool subclasses int
        (DataParams, "max_bytes", "10"),
        (DataParams, "source", 3),
        (DataParams, "source", None),
        (DataParams, "split", ["train"]),
        (TokenizerParams, "vocab_size", 1.5),
        (TokenizerParams, "vocab_size", False),
        (TokenizerParams, "vocab_size", "4096"),
        (TokenizerParams, "pattern", {"a": 1}),
        (TokenizerParams, "min_frequency", True),
        (ShardParams, "shard_tokens", 1e6),  # a float, even a whole one, is not an int
        (ShardParams, "threads", True),
        (ShardParams, "backend", 1),
    ],
)
def test_wrong_type(cls, key, value):
    with raises_naming(f"{cls.SECTION}.{key}"):
        build_section(cls, {key: value})


def test_wrong_type_in_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("tokenizer:\n  vocab_size: 1.5\n", encoding="utf-8")
    with raises_naming("tokenizer.vocab_size"):
        load_section(TokenizerParams, path)
    path.write_text("data:\n  max_docs: yes\n", encoding="utf-8")  # YAML 1.1: `yes` is a bool
    with raises_naming("data.max_docs"):
        load_section(DataParams, path)


VOCAB_FLOOR = 256 + len(SPECIAL_TOKENS)


@pytest.mark.parametrize(
    "cls, key, value",
    [
        (DataParams, "val_fraction", 0),
        (DataParams, "val_fraction", 0.0),
        (DataParams, "val_fraction", 1),
        (DataParams, "val_fraction", 1.0),
        (DataParams, "val_fraction", -0.1),
        (DataParams, "max_docs", 0),
        (DataParams, "max_docs", -5),
        (DataParams, "max_bytes", 0),
        (DataParams, "source", "   "),
        (DataParams, "decode_errors", "ignore"),
        (TokenizerParams, "vocab_size", VOCAB_FLOOR - 1),
        (TokenizerParams, "vocab_size", 256),
        (TokenizerParams, "vocab_size", 0),
        (TokenizerParams, "pattern", "(unclosed"),
        (TokenizerParams, "pattern", "[a-"),
        (TokenizerParams, "min_frequency", 0),
        (ShardParams, "backend", "sentencepiece"),
        (ShardParams, "shard_tokens", 1023),
        (ShardParams, "threads", -1),
    ],
)
def test_out_of_range(cls, key, value):
    with raises_naming(f"{cls.SECTION}.{key}"):
        build_section(cls, {key: value})


@pytest.mark.parametrize(
    "cls, values",
    [
        (DataParams, {"val_fraction": 1e-9, "max_docs": 1, "max_bytes": 1, "decode_errors": "replace"}),
        (DataParams, {"val_fraction": 0.999999}),
        (TokenizerParams, {"vocab_size": VOCAB_FLOOR}),
        (TokenizerParams, {"pattern": "gpt2"}),
        (TokenizerParams, {"pattern": r"\p{L}+|\s+|."}),
        (ShardParams, {"backend": "hf", "shard_tokens": 1024, "threads": 0}),
    ],
)
def test_edge_values_accepted(cls, values):
    obj = build_section(cls, values)
    for key, value in values.items():
        assert getattr(obj, key) == value


# --- --set overrides ------------------------------------------------------------------------------------------


@pytest.fixture
def params_file(tmp_path):
    return write_params(tmp_path / "params.yaml", {"data": {"max_docs": 5, "source": "corpus/"}})


@pytest.mark.parametrize("item", ["data.max_docs=10", "max_docs=10"])
def test_set_override(params_file, item):
    obj = load_section(DataParams, params_file, [item])
    assert obj.max_docs == 10
    assert obj.source == "corpus/"  # the rest of the file is kept


def test_set_null(params_file):
    assert load_section(DataParams, params_file, ["max_docs=null"]).max_docs is None
    assert load_section(DataParams, params_file, ["data.max_docs=~"]).max_docs is None


def test_set_parses_yaml_scalars(params_file):
    obj = load_section(DataParams, params_file, ["val_fraction=0.25", "data.source=hf:foo:bar"])
    assert obj.val_fraction == 0.25
    assert obj.source == "hf:foo:bar"
    # The last override of a key wins.
    assert load_section(DataParams, params_file, ["max_docs=3", "max_docs=7"]).max_docs == 7
    # A value that YAML reads as a number is refused where a string is expected, and named.
    with raises_naming("data.split"):
        load_section(DataParams, params_file, ["split=2023"])


def test_set_validates(params_file):
    with raises_naming("data.max_docs"):
        load_section(DataParams, params_file, ["max_docs=0"])
    with raises_naming("data.val_fraction"):
        load_section(DataParams, params_file, ["data.val_fraction=abc"])
    with raises_naming("data.bogus"):
        load_section(DataParams, params_file, ["bogus=1"])


def test_set_other_section_refused(params_file):
    with pytest.raises(UserError, match="tokenizer.vocab_size") as info:
        load_section(DataParams, params_file, ["tokenizer.vocab_size=1"])
    assert "'data'" in str(info.value)


@pytest.mark.parametrize("item", ["novalue", "=5"])
def test_set_without_key_value_refused(params_file, item):
    with pytest.raises(UserError, match="key=value"):
        load_section(DataParams, params_file, [item])


@pytest.mark.parametrize("value", ["[unclosed", "*.txt", "@x"])
def test_set_value_that_is_not_yaml(params_file, value):
    # `--set data.source=*.txt` is a natural thing to type; YAML reads `*` as an alias and `[` as a flow
    # sequence. Text that is not YAML is taken as it is, never a YAML traceback.
    obj = load_section(DataParams, params_file, [f"data.source={value}"])
    assert obj.source == value


def test_unknown_top_level_section(tmp_path):
    path = write_params(tmp_path / "params.yaml", {"data": {}, "datta": {"max_docs": 1}})
    with pytest.raises(UserError, match="datta"):
        load_section(DataParams, path)


def test_params_file_not_a_mapping(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- data\n- tokenizer\n", encoding="utf-8")
    with pytest.raises(UserError, match="params.yaml"):
        load_section(DataParams, path)
    path.write_text("data: [1, 2]\n", encoding="utf-8")
    with pytest.raises(UserError, match="'data'"):
        load_section(DataParams, path)


def test_params_file_invalid_yaml(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("data:\n  max_docs: [1\n", encoding="utf-8")
    with pytest.raises(UserError, match="not valid YAML"):
        load_section(DataParams, path)


def test_missing_params_file(tmp_path):
    path = tmp_path / "nowhere" / "params.yaml"
    with pytest.raises(UserError) as info:
        load_section(DataParams, path)
    assert str(path) in str(info.value)


def test_empty_params_file_gives_defaults(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("# nothing yet\n", encoding="utf-8")
    assert load_section(DataParams, path) == DataParams()


# --- the CLI --------------------------------------------------------------------------------------------------


def run_kiln(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert KILN.is_file(), f"console script not installed at {KILN}"
    return subprocess.run([str(KILN), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def assert_one_line_error(result: subprocess.CompletedProcess, key: str) -> None:
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    # a hand run says where it writes first; the error is the one line after it
    lines = [line for line in result.stderr.splitlines() if line.strip() and " a hand run (" not in line]
    assert len(lines) == 1, result.stderr
    assert len(lines[0]) < 400


def assert_no_outputs(cwd: Path) -> None:
    assert not (cwd / "data").exists()
    assert not (cwd / "metrics").exists()


@pytest.mark.parametrize(
    "sections, args, key",
    [
        ({"data": {"val_fraction": "abc"}}, ["data", "prepare"], "data.val_fraction"),
        ({"data": {"max_docs": 0}}, ["data", "prepare"], "data.max_docs"),
        ({"data": {}}, ["data", "prepare", "--set", "data.bogus=1"], "data.bogus"),
        ({"tokenizer": {"vocab_size": 1.5}}, ["tokenizer", "train"], "tokenizer.vocab_size"),
        ({"shard": {"backend": "nope"}}, ["data", "shard"], "shard.backend"),
    ],
)
def test_cli_bad_param_exits_2(tmp_path, sections, args, key):
    write_params(tmp_path / "params.yaml", sections)
    result = run_kiln(args, tmp_path)
    assert_one_line_error(result, key)
    assert_no_outputs(tmp_path)


def test_cli_missing_params_file_exits_2(tmp_path):
    result = run_kiln(["data", "prepare", "--params", "other.yaml"], tmp_path)
    assert_one_line_error(result, "other.yaml")
    assert_no_outputs(tmp_path)


COMMANDS = [
    ["data", "prepare"],
    ["data", "shard"],
    ["data", "inspect"],
    ["tokenizer", "train"],
    ["tokenizer", "encode"],
    ["tokenizer", "decode"],
    ["bench", "shard"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_cli_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
    assert "Traceback" not in result.output


DVC_STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_every_stage_command_is_named_as_its_stage_and_takes_params_and_set(stage):
    """A DVC stage and its command share the name (`kiln data prepare` for stage `prepare`, `kiln scaling fit`
    for `scaling_fit`), and each reads --params and takes --set."""
    words = [w for w in DVC_STAGES[stage]["cmd"].split()[1:] if not w.startswith("-")][:2]
    assert stage in {words[-1], "_".join(words), {"train": "tokenizer"}.get(words[-1])}, (stage, words)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*words, "--help"])
    assert result.exit_code == 0 and "--params" in result.output and "--set" in result.output, result.output


@pytest.mark.parametrize("alias, name", [("train", "pretrain"), ("eval", "evaluate")])
def test_old_command_names_stay_as_aliases(alias, name):
    import inspect

    import typer

    commands = typer.main.get_command(app).commands
    unwrap = lambda command: inspect.unwrap(command.callback)
    assert unwrap(commands[alias]) is unwrap(commands[name]) and commands[alias].hidden


# --- train.compile_mode and train.kernels=auto: what they do in the loop -----------------------------------------


@pytest.mark.parametrize("values, expected", [
    ({"compile": True, "compile_mode": "fast"}, "null, default, reduce-overhead, max-autotune"),
    ({"compile": False, "compile_mode": "reduce-overhead"}, "train.compile=false"),
])
def test_compile_mode_refused_with_one_line_naming_it(values, expected):
    with raises_naming("train.compile_mode") as e:
        build_section(TrainParams, values)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("mode, autotune, cudagraphs", [(None, False, False), ("default", False, False),
                                                        ("max-autotune-no-cudagraphs", True, False),
                                                        ("reduce-overhead", False, True), ("max-autotune", True, True)])
def test_compile_mode_reaches_torch_compile(mode, autotune, cudagraphs):
    """The loop's forward is torch.compile'd in the mode asked for (inductor's settings for it; nothing is
    compiled until a first call, so this costs no compile)."""
    from kiln.pipeline.train.loop import compile_forward

    model = torch.nn.Linear(2, 2)
    forward = compile_forward(model, build_section(TrainParams, {"compile": True, "compile_mode": mode}))
    config = forward.get_compiler_config()
    assert forward._orig_mod is model
    assert (config["max_autotune"], config["triton.cudagraphs"]) == (autotune, cudagraphs)
    assert compile_forward(model, build_section(TrainParams, {})) is model


def test_auto_kernels_are_torch_until_kiln_measures_faster_under_compile(monkeypatch, capsys):
    from kiln.pipeline import runtime

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    runtime._say_once.cache_clear()
    assert [runtime.resolve_kernels("auto", cuda) for _ in range(2)] == ["torch", "torch"]
    assert capsys.readouterr().err.count(runtime.AUTO_KERNELS_WHY) == 1  # said once, not per run
    assert runtime.resolve_kernels("triton", cuda) == "triton" and runtime.resolve_kernels("auto", cpu) == "torch"
    params = build_section(TrainParams, {"kernels": "auto", "device": "cpu"})
    assert runtime.prepare_device(params).type == "cpu" and params.kernels == "torch"
    monkeypatch.setattr(runtime, "KILN_KERNELS_FASTER_UNDER_COMPILE", True)  # what a GPU session's result flips
    assert runtime.resolve_kernels("auto", cuda) == "triton" and runtime.resolve_kernels("auto", cpu) == "torch"


@pytest.mark.parametrize(("command", "section"), [(["sft"], "sft"), (["grpo"], "grpo"), (["pretrain"], "train"),
                                                  (["evaluate"], "eval"), (["data", "shard"], "shard")])
def test_a_stage_help_lists_its_params_with_their_defaults(command, section):
    """`kiln <stage> --help` shows every key of its params section as params.yaml sets it, with its comment, so
    a user finds what --set can change without opening the file."""
    import yaml
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    shown = " ".join(CliRunner().invoke(app, [*command, "--help"], terminal_width=200).output.split())
    values = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())[section]
    for key, value in values.items():
        found = re.search(rf"(?<![\w.]){re.escape(key)}: (\S+)", shown)
        assert found, key
        if not isinstance(value, (list, dict)):
            assert yaml.safe_load(found.group(1)) == value, (key, found.group(1))


def test_dyt_is_refused_at_the_widths_it_was_measured_not_to_train(tmp_path):
    """docs/stages.md: DyT stayed at the unigram loss at every width from 8 to 128; wider is untested, allowed."""
    from kiln.pipeline.train.params import ModelParams

    with pytest.raises(UserError, match=r"^params: model.norm='dyt': expected rmsnorm, layernorm or auto at "
                                        r"model.d_model=128: DyT was measured not to leave the unigram loss"):
        build_section(ModelParams, {"norm": "dyt"})
    assert build_section(ModelParams, {"norm": "dyt", "d_model": 256, "n_head": 4}).norm == "dyt"
