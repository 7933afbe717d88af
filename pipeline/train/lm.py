"""Language-model training on token shards: the data, the loss, and one call that trains a model of a given
config. The pretrain stage and the scaling sweep both train through it; its evaluation in nats and bits per byte
is `lm_eval.py`'s, which evaluate measures every model with too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.packed import Packed
from kiln.pipeline.code_digest import stage_code_sha256
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.progress import console
from kiln.pipeline.runtime import from_env, prepare_device
from kiln.pipeline.text.loader import ShardSet, TokenBatches
from kiln.pipeline.text.shard_format import MANIFEST
from kiln.pipeline.train import distributed
from kiln.pipeline.train.checkpoints import Checkpoints
from kiln.pipeline.train.lm_eval import byte_lengths, evaluate_lm
from kiln.pipeline.train.loop import Run, train
from kiln.pipeline.train.params import TrainParams, run_identity
from kiln.pipeline.train.ramp import BatchRamp

# A batch ramp grows the batch a pass at a time, so there how the global batch is split sets each step's batch:
# these keys are then part of the run's identity.
RAMP_SHAPE = ("batch_size", "nproc_per_node")


def lm_loss(model, batch):
    """The mean next-token loss of a batch (x, y) or, packed documents, (x, y, segments)."""
    x, y, *segments = batch
    return model(x, y, packed=Packed(segments[0]) if segments else None)


@dataclass
class LMData:
    """Train and val shards checked against one tokenizer, and the bytes each token stands for (for bpb)."""

    train: ShardSet
    val: ShardSet
    bytes_per_token: torch.Tensor
    tokenizer_sha256: str
    # of the manifest both splits are read from, which holds every shard's sha256 (each checked as it opens)
    manifest_sha256: str

    @classmethod
    def load(cls, shards_dir: Path, tokenizer_path: Path) -> LMData:
        if not tokenizer_path.is_file():
            raise UserError(f"{tokenizer_path}: tokenizer not found (run `kiln tokenizer train` first)")
        sha = sha256_file(tokenizer_path)
        train, val = (ShardSet(shards_dir, split, tokenizer_sha256=sha) for split in ("train", "val"))
        return cls(train, val, byte_lengths(tokenizer_path), sha, sha256_file(shards_dir / MANIFEST))


def total_steps(params: TrainParams, per_pass: int) -> int:
    """train.max_steps, or the steps of train.tokens (through the batch ramp, if any; `per_pass`: the tokens
    of one micro-batch on every process)."""
    if params.max_steps is not None:
        return params.max_steps
    return BatchRamp(params.batch_tokens, per_pass, params.batch_ramp_tokens).steps_for(params.tokens)


def lm_fingerprint(config: ModelConfig, params: TrainParams, data: LMData, stage: str) -> dict:
    """What makes two runs of `stage` the same run: checkpoints of another fingerprint are another run's."""
    keep = RAMP_SHAPE if params.batch_ramp_tokens else ()
    return {"model": config.to_dict(), "tokenizer_sha256": data.tokenizer_sha256, "data": data.manifest_sha256,
            "code": stage_code_sha256(stage), "train": run_identity(params, keep)}


def train_lm(config: ModelConfig, params: TrainParams, data: LMData, checkpoint_dir: Path, curves_dir: Path,
             name: str, resume_from: Path | None = None, command: str | None = None,
             stage: str = "pretrain") -> tuple[GPT, dict]:
    """Next-token training of a fresh model on `data` with the one loop; the pretrain stage and every run of the
    scaling sweep go through here, so they share the data order, the schedule and the evaluation. Under
    torchrun every rank calls it; the model it returns is then wrapped (see `distributed.full_state_dict`).
    `resume_from` and `command`: see `Checkpoints`; `stage`: dvc.yaml's (pretrain or scaling_sweep)."""
    seq_len = config.max_seq_len
    world = from_env()
    torch.manual_seed(params.seed)  # every rank builds the same initial weights
    device = prepare_device(params, world)
    # The model section was checked with the smallest vocabulary: the tokenizer's, or size auto's shape, may not
    # fit. A sharded run needs less per device, but each rank builds and moves the whole model there first.
    try:
        config.check_fits(device, "to train" if world.size == 1 else "for its weights")
    except ValueError as e:
        raise UserError(f"model.{e}") from None
    model = GPT(config).to(device).set_kernels(params.kernels).set_checkpointing(params.activation_checkpointing)
    steps = total_steps(params, params.batch_size * seq_len * world.size)
    fingerprint = lm_fingerprint(config, params, data, stage)
    run = Run(
        params=params, total_steps=steps, micro_batch_tokens=params.batch_size * seq_len, loss_fn=lm_loss,
        batches=TokenBatches(data.train, params.batch_size, seq_len, seed=params.seed, rank=world.rank,
                             world_size=world.size, documents=params.batching == "documents",
                             segments=params.doc_mask),
        evaluate=lambda m: evaluate_lm(m, data.val, data.bytes_per_token, params.batch_size, seq_len,
                                       params.eval_tokens, world),
        checkpoints=Checkpoints(checkpoint_dir, fingerprint, params.keep_checkpoints, world, resume_from, command),
        curves_dir=curves_dir, flops_per_token=model.flops_per_token(seq_len), name=name, world=world,
        section="train" if stage == "pretrain" else "scaling",
    )
    console.print(f"{name}: {config.arch} {model.num_params() / 1e6:.3g}M params "
                  f"({model.num_params(embeddings=False) / 1e6:.3g}M non-embedding), {steps} steps x "
                  f"{params.batch_tokens} tokens on {device}{distributed.spread(world, params.parallel)} in "
                  f"{params.precision}", highlight=False)
    return model, train(model, run)
