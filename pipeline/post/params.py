"""The `sft` and `dpo` sections, and what every post-training section shares (GRPO's: post/grpo_params.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from kiln.model.adapter_spec import ADAPTERS, TARGETS
from kiln.pipeline.config import Section, build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.train.params import TrainParams, loop_keys

if TYPE_CHECKING:
    from kiln.pipeline.tasks.chat_data import Pair
    from kiln.pipeline.tasks.chat_format import ChatFormat
    from kiln.pipeline.tasks.corpus_task import TaskItem


TRAINABLE_TOKENS = ("none", "chat", "all")  # lora_trainable_tokens' names; else a list of ids


@dataclass
class PostTrainParams(Section):
    """What SFT, DPO and GRPO share: their data and the optimisation that differs from pretraining.

    The device, precision, kernels, compile, Adam betas, gradient clipping and checkpoint retention come from
    the `train` section, so one `-S train.precision=bf16` changes every training stage alike.

    Each section declares its own data (`formats`, `loader`, `example`, `builtin`), so that the checks here and
    the loading in post/common.py serve every section without naming one."""

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
    optimizer: str = "adamw"  # fine-tuning keeps AdamW; muon takes train.muon_*
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
    # embedding rows trained beside the adapters (PEFT's trainable_token_indices): none | chat (the chat format's
    # <|im_start|> and <|im_end|>, which pretraining never saw) | all (every token of the tokenizer) | a list of ids
    lora_trainable_tokens: str | list[int] = "none"

    SEQUENCES: ClassVar[int] = 1  # sequences per example: a DPO pair is two

    # The readers live in pipeline/tasks/ and are imported when called, so importing a section loads no data code.
    def formats(self) -> tuple[str, ...]:
        """The dataset formats `format` may name besides auto."""
        raise NotImplementedError

    def loader(self) -> Callable[..., list]:
        """The pipeline/tasks/chat_data.py function that reads this section's examples from a dataset or file."""
        raise NotImplementedError

    def example(self, item: TaskItem) -> object:
        """A built-in task item as this section's example."""
        raise NotImplementedError

    def builtin(self, corpus_dir: Path, chat: ChatFormat, seq_len: int) -> tuple[list, list, list[TaskItem]]:
        """The built-in task: (train examples, held-out examples, the held-out multiple-choice items behind the
        accuracy)."""
        from kiln.pipeline.tasks.corpus_task import task_items

        train, val = task_items(corpus_dir, chat, seq_len, self.max_examples, self.val_examples, self.seed)
        return [self.example(i) for i in train], [self.example(i) for i in val], val

    def check(self) -> None:
        formats = self.formats()
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
        if self.data == "builtin" and self.max_examples is None:
            raise UserError(f"params: {self.SECTION}.max_examples=null: expected the number of items to derive when "
                            f"{self.SECTION}.data is builtin")
        tokens = self.lora_trainable_tokens
        if isinstance(tokens, str) and tokens not in TRAINABLE_TOKENS:
            raise self.bad("lora_trainable_tokens", f"{' | '.join(TRAINABLE_TOKENS)} or a list of token ids")
        if isinstance(tokens, list) and (not tokens or min(tokens) < 0 or len(set(tokens)) < len(tokens)):
            raise self.bad("lora_trainable_tokens", "distinct non-negative token ids (none: no rows)")
        try:
            self.loop_params(TrainParams(), 1)
        except UserError as e:
            raise UserError(str(e).replace("params: train.", f"params: {self.SECTION}.", 1)) from None

    def check_train(self, train: TrainParams) -> None:
        """What this section and `train` must agree on, checked as the params are loaded: the loop refused these
        only once the start model was loaded and the rows built (fp8 with an adapter after ~15 s, and holding
        the checkpoints' lock)."""
        if train.precision == "fp8" and self.adapter != "full":
            raise UserError(f"params: train.precision=fp8 trains every weight, and {self.SECTION}.adapter="
                            f"{self.adapter} freezes the base (its layers are not converted to fp8); use "
                            f"train.precision=bf16 with an adapter, or {self.SECTION}.adapter=full")
        per_step = self.batch_size * train.nproc_per_node  # every process takes batch_size examples a micro-step
        if self.batch_examples % per_step:
            raise self.bad("batch_examples", f"a multiple of {self.SECTION}.batch_size x train.nproc_per_node = "
                                             f"{per_step}")

    def loop_params(self, train: TrainParams, seq_len: int) -> TrainParams:
        """The one loop's params: this section's keys of the same name as `train`'s (its schedule, seed and
        cadence) over `train`'s engine settings, with its batch in sequences."""
        return build_section(TrainParams, {
            **dataclasses.asdict(train), **loop_keys(self), "tokens": None,
            "batch_ramp_tokens": 0,  # pretraining's: post-training starts from a trained model
            # this section counts examples, the loop sequences
            "batch_size": self.batch_size * self.SEQUENCES,
            "batch_tokens": self.batch_examples * self.SEQUENCES * seq_len})

    def adapter_spec(self, chat: ChatFormat) -> dict:
        """What shapes the adapted model: the run's fingerprint and the saved adapter's config (the trained token
        rows as ids, `chat` naming its own)."""
        if self.adapter == "full":
            return {"adapter": "full"}
        spec = {"adapter": self.adapter, "rank": self.lora_rank, "alpha": self.lora_alpha,
                "dropout": self.lora_dropout, "targets": list(self.lora_targets)}
        tokens = self.lora_trainable_tokens
        if tokens == "chat":
            tokens = [chat.im_start, chat.im_end]
        elif tokens == "all":
            tokens = list(range(chat.tokenizer.get_vocab_size()))
        if tokens != "none":
            spec["trainable_tokens"] = sorted(tokens)
        return spec


@dataclass
class SFTParams(PostTrainParams):
    SECTION: ClassVar[str] = "sft"
    lora_alpha: float = 128.0  # measured for SFT against 16 (docs/stages.md: adapters); DPO and GRPO keep 16
    # share of training rows that are windows of the corpus's train text (loss on every token): what keeps
    # pretraining's bits per byte while the examples teach the task
    text_share: float = 0.2
    # loss weight of each text token relative to an answer token: a text row has ~10x an answer's targets, and
    # at weight 1 the text drowns the task (measured: docs/stages.md)
    text_weight: float = 0.25
    # pack whole examples into rows best-fit, each attending to itself only (scoring/rows.py); batch_size and
    # batch_examples then count rows, and text_share is a share of rows
    packing: bool = True

    def check(self) -> None:
        super().check()
        if not 0 <= self.text_share < 1:
            raise self.bad("text_share", "a number in [0, 1)")
        if not self.text_weight > 0:
            raise self.bad("text_weight", "a positive number")

    def formats(self) -> tuple[str, ...]:
        from kiln.pipeline.tasks.chat_data import SFT_FORMATS

        return SFT_FORMATS

    def loader(self) -> Callable[..., list]:
        from kiln.pipeline.tasks.chat_data import load_conversations

        return load_conversations

    def example(self, item: TaskItem) -> list[dict]:
        return item.conversation()


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

    def formats(self) -> tuple[str, ...]:
        from kiln.pipeline.tasks.chat_data import PREFERENCE_FORMATS

        return PREFERENCE_FORMATS

    def loader(self) -> Callable[..., list]:
        from kiln.pipeline.tasks.chat_data import load_pairs

        return load_pairs

    def example(self, item: TaskItem) -> Pair:
        return item.pair()

