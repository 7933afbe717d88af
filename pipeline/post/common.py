"""What SFT, DPO and GRPO share: the model they start from, examples as padded tensors, their batches, and
the summed log-probability of an answer that the SFT and DPO losses (and every multiple-choice score) are made of.

Padding by default: each example is one row of `max_seq_len` tokens, padded on the right with `<|pad|>` and
targets of -100. With causal attention a right pad never affects the tokens before it, so no attention mask is
needed. The price is compute on pad positions, small for the built-in task (most examples fill most of the row)
and large on chat data of mixed lengths: `sft.packing` packs whole examples into rows instead (post/packing.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.model.checkpoint import load_model, save_model
from kiln.model.lora import adapter_state_dict, apply_adapter, merged_state_dict
from kiln.model.modes import evaluating
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.post.packing import IGNORE, example_tokens, packed_rows
from kiln.pipeline.post.params import PostTrainParams
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.runtime import World, autocast, from_env, prepare_device
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


def to_rows(rendered: list[Rendered], seq_len: int, pad: int, what: str,
            packing: bool = False) -> tuple[torch.Tensor, ...]:
    """Inputs x and targets y, (N, seq_len) each: y is x shifted by one, -100 where the mask is 0 or padded.
    Longer examples are cut at seq_len + 1 tokens (counted); an example left with no target is an error the
    caller prevents (they are dropped before this). With `packing`, whole examples share rows (fewer than N)
    and a third tensor gives each token's example (post/packing.py)."""
    if packing:
        *rows, cut = packed_rows(rendered, seq_len, pad)
    else:
        rows = [torch.full((len(rendered), seq_len), pad, dtype=torch.long),
                torch.full((len(rendered), seq_len), IGNORE, dtype=torch.long)]
        cut = 0
        for i, r in enumerate(rendered):
            inputs, targets, was_cut = example_tokens(r, seq_len)
            cut += was_cut
            rows[0][i, :len(inputs)] = torch.tensor(inputs)
            rows[1][i, :len(inputs)] = torch.tensor(targets)
    if cut:
        console.print(f"{what}: {cut:,} of {len(rendered):,} examples cut to max_seq_len={seq_len}", highlight=False)
    return tuple(rows)


def fits(r: Rendered, seq_len: int) -> bool:
    """At least one target survives the cut to seq_len + 1 tokens."""
    return any(r.mask[1:seq_len + 1])


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
    target tokens exactly, however they fall across micro-batches and ranks.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int, accum: int, seed: int,
                 per_token: bool = False, rank: int = 0, world_size: int = 1):
        self.tensors, self.batch_size, self.accum, self.seed = tensors, batch_size, accum, seed
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
        return batch

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


def answer_logps(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's targets (N,), in float32, with gradients."""
    return -model(x, y, reduction="none").sum(dim=-1)


def answer_tokens(y: torch.Tensor) -> torch.Tensor:
    """How many targets each row has (N,): the length of its answer."""
    return (y != IGNORE).sum(dim=-1)


@torch.no_grad()
def score_rows(model, x: torch.Tensor, y: torch.Tensor, batch_size: int, precision: str) -> torch.Tensor:
    """answer_logps of every row, on CPU in float64, batch by batch in eval mode."""
    device = next(model.parameters()).device
    out = []
    with evaluating(model):
        for i in range(0, len(x), batch_size):
            with autocast(device, precision):
                out.append(answer_logps(model, x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)))
    return torch.cat(out).double().cpu() if out else torch.zeros(0, dtype=torch.float64)


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


class ChoiceScorer:
    """Accuracy on multiple-choice items: the answer counts as picked when its summed log-probability (after
    the prompt, <|im_end|> included) beats every wrong choice's strictly, so a tie is never a hit."""

    def __init__(self, items: list[TaskItem], chat: ChatFormat, seq_len: int):
        self.kinds = [item.kind for item in items]
        self.n_choices = len(items[0].choices) if items else 0
        rendered = [chat.render(item.conversation(choice), first_trained=len(item.prompt))
                    for item in items for choice in item.choices]
        self.x, self.y = to_rows(rendered, seq_len, chat.pad, "held-out choices")

    def accuracy(self, model, batch_size: int, precision: str) -> dict[str, float]:
        return {k: float(v.mean()) for k, v in self.hits(model, batch_size, precision).items()}

    def hits(self, model, batch_size: int, precision: str) -> dict[str, np.ndarray]:
        """Each item's outcome (1.0 picked, 0.0 not) behind `val_accuracy` and each kind's `val_accuracy_<kind>`."""
        if not self.kinds:
            return {}
        scores = score_rows(model, self.x, self.y, batch_size, precision).view(-1, self.n_choices)
        hits = (scores[:, 0] > scores[:, 1:].max(dim=1).values).double().numpy()
        kinds = np.array(self.kinds)
        return {"val_accuracy": hits} | {f"val_accuracy_{kind}": hits[kinds == kind]
                                         for kind in sorted(set(self.kinds))}


def rows_sha256(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()
