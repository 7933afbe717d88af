"""The `model` and `train` sections: the model's shape, and the one training loop's settings, which every
training stage (pretrain, the scaling sweep, sft, dpo) shares."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kiln.pipeline.config import Section
from kiln.pipeline.errors import UserError

if TYPE_CHECKING:
    from kiln.model.config import ModelConfig


MAX_PROCESSES = 1024
# torch.compile's modes (null: its default): how much it tunes (max-autotune benchmarks matmul and fusion choices
# while compiling, minutes on a GPU) and whether it replays the step as CUDA graphs (reduce-overhead, max-autotune).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SHAPE_FIELDS = ("n_layer", "d_model", "d_ff", "max_seq_len")  # the model section's keys that set its size


# DyT never left the unigram plateau at any width measured, 8 to 128 (lr 3e-4 to 3e-3, alpha 0.1 and 0.5, tied
# or untied embeddings, 400 to 1,600 steps): docs/stages.md, model.norm. Wider models are not refused, untested.
DYT_UNTRAINABLE_WIDTH = 128


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
    tie_embeddings: bool = False
    dropout: float = 0.0
    norm: str = "auto"  # auto (llama: rmsnorm, gpt2: layernorm) | rmsnorm | layernorm | dyt
    # the record runs' knobs (model/config.py): QK-norm on (docs/stages.md: the recipe), the rest off
    qk_norm: bool = True
    mlp: str = "auto"  # auto | relu2
    logit_softcap: float = 0.0
    zero_init: bool = False

    def config(self, vocab_size: int, **shape) -> ModelConfig:
        """The model package's config for this section, with `shape` (n_layer=..., ...) overriding it."""
        from kiln.model.config import ModelConfig

        values = {k: v for k, v in dataclasses.asdict(self).items() if k != "size"}
        return ModelConfig(vocab_size=vocab_size, **(values | shape))

    def check(self) -> None:
        """The model package owns the shape rules; they are reported here under their params key. A shape that
        cannot train in this machine's memory, even with the smallest vocabulary, is refused now rather than
        when building it hangs or asks for petabytes."""
        if self.size not in ("fixed", "auto"):
            raise self.bad("size", "'fixed' or 'auto'")
        if self.norm == "dyt" and self.d_model <= DYT_UNTRAINABLE_WIDTH:
            raise self.bad("norm", f"rmsnorm, layernorm or auto at model.d_model={self.d_model}: DyT was measured not "
                           f"to leave the unigram loss at widths up to {DYT_UNTRAINABLE_WIDTH} (docs/stages.md)")
        try:
            self.config(256).check().check_fits("cpu", "to train", names=SHAPE_FIELDS)
        except ValueError as e:
            raise UserError(f"params: model.{e}") from None


FP8_RECIPES = ("tensorwise", "rowwise")
BATCHINGS = ("windows", "documents")  # TorchAO's float8 scaling: one scale per tensor, or per row


@dataclass
class TrainParams(Section):
    SECTION: ClassVar[str] = "train"
    seed: int = 1337
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8 (the blocks' linear layers in fp8, the rest bf16)
    fp8_recipe: str = "tensorwise"  # precision fp8: tensorwise | rowwise scales (pipeline/train/float8.py)
    kernels: str = "torch"  # auto | triton | torch: kiln's Triton kernels in the model (GPT.set_kernels)
    compile: bool = False
    compile_mode: str | None = None  # torch.compile's mode (COMPILE_MODES); null: its default
    batch_size: int = 32  # sequences per micro-step on one device
    batch_tokens: int = 4096  # tokens per optimizer step, reached by gradient accumulation
    max_steps: int | None = 400
    tokens: int | None = None  # run length in tokens; used when max_steps is null
    lr: float = 1e-2
    min_lr: float = 1e-3
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd (warmup, stable, then linear decay)
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    # AdamW's lr for the embeddings and for an untied head (null: lr); like muon_lr, the schedule scales them
    embed_lr: float | None = None
    head_lr: float | None = None
    # adamw | muon: Muon on the transformer blocks' matrices, AdamW (lr, betas, weight_decay) on the rest
    optimizer: str = "muon"
    muon_lr: float = 0.02  # the peak lr of the Muon group; the schedule scales it as it scales lr
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85  # warmed up linearly to muon_momentum over muon_momentum_warmup steps
    muon_momentum_warmup: int = 300
    muon_weight_decay: float = 0.0
    # windows: random windows of the token stream | documents: every row starts at a document (pipeline/text/loader)
    batching: str = "windows"
    doc_mask: bool = False  # documents only: attention stops at document boundaries, positions restarting
    eval_every: int = 50
    eval_tokens: int = 32768
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 20
    # Processes on this node: > 1 makes `kiln pretrain` (sft, dpo, grpo) start itself under torchrun (one per GPU,
    # or CPU processes).
    nproc_per_node: int = 1
    parallel: str = "ddp"  # ddp (replicated model) | fsdp (FSDP2: parameters, gradients, optimizer state sharded)
    zero1: bool = False  # ddp only: shard AdamW's state across processes (ZeroRedundancyOptimizer)
    # the global batch grows from one micro-batch per process to batch_tokens over this many tokens (0: off)
    batch_ramp_tokens: int = 0
    activation_checkpointing: bool = False  # recompute each block in the backward instead of keeping its activations
    stats_every: int = 0  # per-layer statistics every this many steps (pipeline/train/stats.py); 0: off, no hooks

    def check(self) -> None:
        if self.parallel not in ("ddp", "fsdp"):
            raise self.bad("parallel", "ddp or fsdp")
        if self.stats_every and self.parallel == "fsdp" and self.nproc_per_node > 1:
            raise self.bad("stats_every", "0 with train.parallel=fsdp (statistics read whole gradients, which FSDP "
                                          "shards)")
        if self.zero1 and self.parallel != "ddp":
            raise self.bad("zero1", "false with train.parallel=fsdp (FSDP shards the optimizer state already)")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            raise self.bad("device", "auto, cpu, cuda, cuda:N or mps")
        if self.precision not in ("fp32", "bf16", "fp16", "fp8"):
            raise self.bad("precision", "fp32, bf16, fp16 or fp8")
        if self.fp8_recipe not in FP8_RECIPES:
            raise self.bad("fp8_recipe", " or ".join(FP8_RECIPES))
        if self.kernels not in ("auto", "triton", "torch"):
            raise self.bad("kernels", "auto, triton or torch")
        if self.compile_mode not in COMPILE_MODES:
            raise self.bad("compile_mode", "null, " + ", ".join(COMPILE_MODES[1:]))
        if self.compile_mode not in (None, "default") and not self.compile:
            raise self.bad("compile_mode", "null or default with train.compile=false (a mode is how torch.compile "
                                           "compiles)")
        if self.batching not in BATCHINGS:
            raise self.bad("batching", " or ".join(BATCHINGS))
        if self.doc_mask and self.batching != "documents":
            raise self.bad("doc_mask", "false with train.batching=windows (a window's documents are not marked; "
                                       "batching: documents packs them)")
        if self.schedule not in ("cosine", "wsd"):
            raise self.bad("schedule", "cosine or wsd")
        if (self.max_steps is None) == (self.tokens is None):
            raise self.bad("max_steps", "exactly one of train.max_steps and train.tokens to be set")
        for name in ("batch_size", "batch_tokens", "eval_every", "eval_tokens", "checkpoint_every",
                     "keep_checkpoints", "log_every", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        if self.nproc_per_node > MAX_PROCESSES:  # torchrun would start every one of them
            raise self.bad("nproc_per_node", f"at most {MAX_PROCESSES} processes on one node")
        for name in ("max_steps", "tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise self.bad(name, "a positive integer or null")
        if not self.lr > 0:
            raise self.bad("lr", "a positive number")
        if not 0 <= self.min_lr <= self.lr:
            raise self.bad("min_lr", f"a number in [0, lr={self.lr:g}]")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "batch_ramp_tokens", "stats_every"):
            if getattr(self, name) < 0:
                raise self.bad(name, "a number >= 0")
        if not 0 < self.decay_fraction <= 1:
            raise self.bad("decay_fraction", "a number in (0, 1]")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise self.bad(name, "a number in [0, 1)")
        self.check_muon()

    def check_muon(self) -> None:
        if self.optimizer not in ("adamw", "muon"):
            raise self.bad("optimizer", "adamw or muon")
        for name in ("embed_lr", "head_lr"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise self.bad(name, "a positive number or null")
        if not self.muon_lr > 0:
            raise self.bad("muon_lr", "a positive number")
        if not 0 <= self.muon_momentum_start <= self.muon_momentum:
            raise self.bad("muon_momentum_start", f"a number in [0, muon_momentum={self.muon_momentum:g}]")
        for name in ("muon_momentum_warmup", "muon_weight_decay"):
            if getattr(self, name) < 0:
                raise self.bad(name, "a number >= 0")



def loop_keys(section: Section) -> dict:
    """The keys a training section shares with `train` (lr, min_lr, weight_decay, ...) and their values: a
    section declares its own as fields of the same name, with its own defaults, and they reach the loop's
    TrainParams by that name, so no list of them is kept anywhere else."""
    shared = {f.name for f in dataclasses.fields(TrainParams)}
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name in shared}


# The train keys that change the cadence of logging and saving, or only how the same math is computed (device,
# compile, kernels, recomputing activations, how the global batch is split into micro-batches and processes),
# not what is trained: outside a run's identity, so a run may resume across them.
OUTSIDE_IDENTITY = ("eval_every", "eval_tokens", "checkpoint_every", "keep_checkpoints", "log_every", "device",
                    "compile", "compile_mode", "kernels", "batch_size", "nproc_per_node", "parallel", "zero1",
                    "activation_checkpointing", "stats_every")


# With AdamW these change nothing, so they are part of a run's identity only with Muon (every AdamW checkpoint
# written before they existed still resumes).
MUON_KEYS = ("optimizer", "muon_lr", "muon_momentum", "muon_momentum_start", "muon_momentum_warmup",
             "muon_weight_decay")


def run_identity(params: TrainParams, keep: tuple[str, ...] = ()) -> dict:
    """The train keys that make two runs the same run (a checkpoint's fingerprint holds them), with the keys of
    `keep` put back from OUTSIDE_IDENTITY where a stage's runs depend on them. fp8_recipe is part of it only
    when the precision is fp8, the optimizer's keys only with Muon, batching only with documents: other runs compute
    the same without them (and every checkpoint written before they existed still resumes)."""
    outside = OUTSIDE_IDENTITY + (("fp8_recipe",) if params.precision != "fp8" else ()) + \
        (MUON_KEYS if params.optimizer == "adamw" else ()) + (("batching",) if params.batching == "windows" else ()) + \
        (("doc_mask",) if not params.doc_mask else ()) + \
        tuple(k for k in ("embed_lr", "head_lr") if getattr(params, k) is None)
    return {k: v for k, v in dataclasses.asdict(params).items() if k not in outside or k in keep}
