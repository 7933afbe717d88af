"""The `sft` and `dpo` sections, and what every post-training section shares (GRPO's: post/grpo_params.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from kiln.model.lora import ADAPTERS, TARGETS
from kiln.pipeline.config import Section, build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.train.params import TrainParams


@dataclass
class PostTrainParams(Section):
    """What SFT, DPO and GRPO share: their data and the optimisation that differs from pretraining.

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
    max_steps: int = 500
    batch_size: int = 16  # examples (pairs for DPO) per micro-step
    batch_examples: int = 32  # examples (pairs for DPO) per optimizer step: gradient accumulation makes it up
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 50
    checkpoint_every: int = 50
    log_every: int = 10
    # full: every weight trains | lora: the base frozen, low-rank adapters on lora_targets train | qlora: lora
    # on a base whose block projections and embedding are stored in 4-bit NF4 (model/lora.py)
    adapter: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0  # the adapter's update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: list(TARGETS))

    SEQUENCES: ClassVar[int] = 1  # sequences per example: a DPO pair is two

    def check(self) -> None:
        from kiln.pipeline.tasks.chat_data import PREFERENCE_FORMATS, PROMPT_FORMATS, SFT_FORMATS

        formats = {"sft": SFT_FORMATS, "dpo": PREFERENCE_FORMATS, "grpo": PROMPT_FORMATS}[self.SECTION]
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
        if self.adapter not in ADAPTERS:
            raise self.bad("adapter", " | ".join(ADAPTERS))
        if self.lora_rank < 1:
            raise self.bad("lora_rank", "a positive integer")
        if not self.lora_alpha > 0:
            raise self.bad("lora_alpha", "a positive number")
        if not 0 <= self.lora_dropout < 1:
            raise self.bad("lora_dropout", "a number in [0, 1)")
        unknown = [t for t in self.lora_targets if t not in TARGETS]
        if unknown or not self.lora_targets or len(set(self.lora_targets)) < len(self.lora_targets):
            raise self.bad("lora_targets", f"distinct names among {', '.join(TARGETS)}"
                           + (f" ({unknown[0]!r} is none)" if unknown else ""))
        try:
            self.loop_params(TrainParams(), 1)
        except UserError as e:
            raise UserError(str(e).replace("params: train.", f"params: {self.SECTION}.", 1)) from None

    def loop_params(self, train: TrainParams, seq_len: int) -> TrainParams:
        """The one loop's params: this section's schedule and batch over `train`'s engine settings."""
        return build_section(TrainParams, {
            **dataclasses.asdict(train), "max_steps": self.max_steps, "tokens": None, "seed": self.seed,
            "batch_ramp_tokens": 0,  # pretraining's: post-training starts from a trained model
            "batch_size": self.batch_size * self.SEQUENCES,
            "batch_tokens": self.batch_examples * self.SEQUENCES * seq_len,
            "lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
            "weight_decay": self.weight_decay, "eval_every": self.eval_every,
            "checkpoint_every": self.checkpoint_every, "log_every": self.log_every})

    def adapter_spec(self) -> dict:
        """What shapes the adapted model: the run's fingerprint and the saved adapter's config."""
        if self.adapter == "full":
            return {"adapter": "full"}
        return {"adapter": self.adapter, "rank": self.lora_rank, "alpha": self.lora_alpha,
                "dropout": self.lora_dropout, "targets": list(self.lora_targets)}


@dataclass
class SFTParams(PostTrainParams):
    SECTION: ClassVar[str] = "sft"
    # share of training rows that are windows of the corpus's train text (loss on every token): what keeps
    # pretraining's bits per byte while the examples teach the task
    text_share: float = 0.2
    # loss weight of each text token relative to an answer token: a text row has ~10x an answer's targets, and
    # at weight 1 the text drowns the task (measured: docs/stages.md)
    text_weight: float = 0.25

    def check(self) -> None:
        super().check()
        if not 0 <= self.text_share < 1:
            raise self.bad("text_share", "a number in [0, 1)")
        if not self.text_weight > 0:
            raise self.bad("text_weight", "a positive number")


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
    # weight of the chosen answers' NLL added to the loss (RPO, Pang et al. 2024; TRL: loss_type [.., "sft"]),
    # which keeps DPO from lowering the likelihood of the answers it prefers
    sft_weight: float = 1.0
    SEQUENCES: ClassVar[int] = 2

    def check(self) -> None:
        super().check()
        if not self.beta > 0:
            raise self.bad("beta", "a positive number")
        if not 0 <= self.label_smoothing < 0.5:
            raise self.bad("label_smoothing", "a number in [0, 0.5)")
        if self.loss not in ("sigmoid", "ipo"):
            raise self.bad("loss", "sigmoid or ipo")
        if not self.sft_weight >= 0:
            raise self.bad("sft_weight", "a number >= 0")
        if self.loss == "ipo" and self.label_smoothing:
            raise self.bad("label_smoothing", "0 with dpo.loss=ipo (label smoothing is a sigmoid-loss variant)")

