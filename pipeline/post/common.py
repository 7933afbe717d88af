"""What SFT, DPO and GRPO share: the model they start from, their data and their batches.

Their examples become token rows and are scored in pipeline/scoring/ (padded rows, packed rows, prompts computed
once), which evaluate shares.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.model.checkpoint import load_model, save_model
from kiln.model.lora import adapter_state_dict, apply_adapter, merged_state_dict
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.post.params import PostTrainParams
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.runtime import World, from_env, prepare_device
from kiln.pipeline.scoring.rows import IGNORE, fits
from kiln.pipeline.tasks.chat_format import ChatFormat, Rendered
from kiln.pipeline.tasks.corpus_task import TaskItem
from kiln.pipeline.text.bpe import load_tokenizer
from kiln.pipeline.train import distributed
from kiln.pipeline.train.params import TrainParams



@dataclass
class Start:
    """What a post-training stage has before it trains: the model it starts from (on the training device), the
    loop's params, the chat format and the data."""

    model: torch.nn.Module
    model_dir: Path
    tokenizer_sha256: str | None
    sha256: str  # of the starting weights: part of the run's fingerprint
    loop: TrainParams
    chat: ChatFormat
    data: ChatData

    adapter: dict
    world: World
    stage: str  # sft, dpo or grpo: what its progress lines are headed with

    def identity(self) -> dict:
        """The start of a run's fingerprint: the starting weights and, when not full, the adapter on them."""
        return {"start": self.sha256, **({"adapter": self.adapter} if self.adapter["adapter"] != "full" else {})}

    def flops_per_token(self) -> int:
        """Training FLOPs per token for MFU; 0 (no MFU claimed) with an adapter, whose frozen base has no weight
        gradients to compute and whose 4-bit matrices are not parameters."""
        if self.adapter["adapter"] != "full":
            return 0
        return self.model.flops_per_token(self.model.config.max_seq_len)

    def save(self, out_dir: Path) -> None:
        """The model as a plain kiln model folder (adapters merged in); with an adapter, the adapter beside it.
        Under torchrun every rank calls it (FSDP gathers the shards) and rank 0 alone writes."""
        state = distributed.full_state_dict(self.model)
        if not self.world.main:
            return
        adapted = self.adapter["adapter"] != "full"
        save_model(merged_state_dict(self.model, state) if adapted else state, self.model.config, out_dir, {
            "tokenizer_sha256": self.tokenizer_sha256, "chat_format": "chatml",
            "init": {"model": str(self.model_dir), "sha256": self.sha256},
            **({"adapter": self.adapter} if adapted else {})},
            adapter=adapter_state_dict(state) if adapted else None)


def start(params: PostTrainParams, train: TrainParams, model_dir: Path, tokenizer_path: Path,
          corpus_dir: Path) -> Start:
    """Load the model a stage starts from, refusing a tokenizer other than the one it was trained with, and
    the stage's data rendered for its context length."""
    with Progress(f"{params.SECTION}: loading {model_dir} and the data"):
        return _start(params, train, model_dir, tokenizer_path, corpus_dir)


def _start(params: PostTrainParams, train: TrainParams, model_dir: Path, tokenizer_path: Path,
           corpus_dir: Path) -> Start:
    torch.manual_seed(params.seed)  # every rank draws the same adapter init
    world = from_env()
    device = prepare_device(train, world)
    try:
        model, meta = load_model(model_dir, device)
    except ValueError as e:
        raise UserError(f"{e} (run the stage that makes {model_dir} first)") from None
    want, got = meta.get("tokenizer_sha256"), sha256_file(tokenizer_path)
    if want is not None and want != got:
        raise UserError(f"{tokenizer_path}: not the tokenizer {model_dir} was trained with")
    seq_len = model.config.max_seq_len
    chat = ChatFormat(load_tokenizer(tokenizer_path, ordinary=True))
    spec = params.adapter_spec(chat)
    try:
        model.set_kernels(train.kernels).set_checkpointing(train.activation_checkpointing)
        apply_adapter(model, spec["adapter"], params.lora_rank, params.lora_alpha, params.lora_dropout,
                      params.lora_targets, spec.get("trainable_tokens", []))
    except ValueError as e:
        raise UserError(f"params: {params.SECTION}.{e}") from None
    return Start(model, Path(model_dir), want, sha256_file(Path(model_dir) / "model.safetensors"),
                 params.loop_params(train, seq_len), chat, load_chat_data(params, chat, seq_len, corpus_dir), spec,
                 world, params.SECTION)


def rendered_of(conversations: list[list[dict]], chat: ChatFormat, seq_len: int, what: str) -> list[Rendered]:
    """The conversations that keep an answer token within seq_len, rendered (the rest counted)."""
    rendered = [chat.render(c) for c in conversations]
    kept = [r for r in rendered if fits(r, seq_len)]
    if len(kept) < len(rendered):
        console.print(f"{what}: skipped {len(rendered) - len(kept):,} examples with no answer token within "
                      f"max_seq_len={seq_len}", highlight=False)
    if not kept and rendered:
        raise UserError(f"{what}: no example has an answer token within max_seq_len={seq_len}")
    return kept


def held_out(keys: list[str], n_val: int) -> tuple[list[int], list[int]]:
    """(train, val) indices: the n_val examples whose key hashes lowest are held out (at most a quarter), so the
    split does not depend on the order rows arrive in."""
    n_val = min(n_val, len(keys) // 4)
    order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(keys[i].encode()).digest())
    val = set(order[:n_val])
    return [i for i in range(len(keys)) if i not in val], sorted(val)


class ExampleBatches:
    """Micro-batches of examples (rows of `tensors`), reshuffled every epoch, forever.

    Global micro-batch k holds positions [kBW, (k+1)BW) of the stream "permutation of epoch 0, then of epoch 1,
    ...", each permutation seeded by (seed, epoch), for B = batch_size examples on each of W = world_size ranks;
    rank r takes [kBW + rB, kBW + (r+1)B). Its state is k alone, so a resumed run sees the batches an
    uninterrupted one would, and an optimizer step's examples are the same whatever B and W (only how they are
    split changes). With `per_token`, tensors are (x, y, row weights, then any others) and each micro-batch also
    carries (weighted targets in its whole optimizer step, every rank's) / (accum x W), so that weighted summed losses
    divided by it, averaged over ranks as DDP and FSDP average gradients, are the step's weighted mean over
    target tokens exactly, however they fall across micro-batches and ranks. `collate` lays each micro-batch out
    anew (DPO's pairs as rows of a shared prompt).
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int, accum: int, seed: int,
                 per_token: bool = False, rank: int = 0, world_size: int = 1,
                 collate: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None):
        self.tensors, self.batch_size, self.accum, self.seed, self.collate = tensors, batch_size, accum, seed, collate
        self.per_token, self.n, self.rank, self.world_size = per_token, len(tensors[0]), rank, world_size
        if per_token:
            x, y, weights = tensors[:3]
            self.targets = (y != IGNORE).sum(dim=1).double() * weights.double()
        self.step = 0

    def __iter__(self):
        return self

    def _indices(self, start: int, count: int) -> torch.Tensor:
        positions = np.arange(start, start + count)
        epochs = positions // self.n
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n)
            at = epochs == epoch
            out[at] = order[positions[at] % self.n]
        return torch.from_numpy(out)

    def __next__(self) -> list[torch.Tensor]:
        k, B, W = self.step, self.batch_size, self.world_size
        self.step += 1
        batch = [t[self._indices(k * B * W + self.rank * B, B)] for t in self.tensors]
        if self.per_token:
            first = k // self.accum * self.accum * B * W
            batch.append(self.targets[self._indices(first, self.accum * B * W)].sum() / (self.accum * W))
        return batch if self.collate is None else self.collate(batch)

    def state_dict(self) -> dict:
        # batch_size is the global micro-batch: a run resumes on any split of it into ranks
        return {"step": self.step, "seed": self.seed, "batch_size": self.batch_size * self.world_size,
                "examples": self.n}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size * self.world_size),
                          ("examples", self.n)):
            if state.get(key) != mine:
                what = " (batch_size x processes)" if key == "batch_size" else ""
                raise UserError(f"resume state: example batches {key}{what}={state.get(key)!r}, this run has "
                                f"{mine!r}")
        self.step = int(state["step"])


@dataclass
class ChatData:
    """A post-training stage's examples (conversations for SFT, `Pair`s for DPO, `PromptAnswer`s for GRPO),
    train and held out, and for SFT's and DPO's built-in task the held-out multiple-choice items behind its
    accuracy."""

    train: list
    val: list
    items: list[TaskItem]


def load_chat_data(params: PostTrainParams, chat: ChatFormat, seq_len: int, corpus_dir: Path) -> ChatData:
    """The section's examples: its built-in task's, or its dataset's rows split by hash (post/params.py has what
    each section's data is)."""
    if params.data == "builtin":
        return ChatData(*params.builtin(corpus_dir, chat, seq_len))
    cap = None if params.max_examples is None else params.max_examples + params.val_examples
    rows = params.loader()(params.data, params.format, params.split, cap, f"{params.SECTION}.data")
    keys = [json.dumps(row if isinstance(row, list) else vars(row), sort_keys=True) for row in rows]
    train, val = held_out(keys, params.val_examples)
    return ChatData([rows[i] for i in train[:params.max_examples]], [rows[i] for i in val], [])


def rows_sha256(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()
