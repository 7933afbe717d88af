"""The bytes a training run will hold, by the model `kiln plan memory` prints: fp32 weights and gradients, AdamW's two
moments, the activations autograd saves per token and layer, the logits. Here, below the training loop, so the
loop checks every run against its device before it allocates (`check_run_memory`); the command
(tools/plan_memory.py) prints and measures it, with the largest micro-batch that fits a device.

Training state per parameter: kiln keeps fp32 weights and fp32 gradients under every precision (autocast casts
the matmul inputs, not the weights), and AdamW two fp32 moments: 4 + 4 + 8 = 16 bytes. That is the ZeRO paper's
(Rajbhandari et al. 2020) mixed-precision count too, 2 + 2 bytes of 16-bit weights and gradients plus the
12 bytes of fp32 master weights and moments; the table shows both splits.

Activations are what autograd saves for the backward, per token and per layer, counted from what kiln's model
code saves (checked by `tests/test_plan_memory.py` against autograd's saved tensors at several shapes):

- torch kernels, fp32: the norms' inputs and 1/rms, the q/k/v projections' input, the rotated q and k, SDPA's
  q, k, v (GQA's k and v expanded to every query head) and output, the MLP's input, gate, up, their product.
- under bf16/fp16 autocast the matmul inputs and the MLP are 16-bit, the residual stream, the norms and RoPE
  stay fp32, and each layer holds a 16-bit copy of its matrices for the backward.
- kiln's Triton kernels: flash attention keeps k and v once per kv head and no attention matrix, RoPE keeps
  nothing, SwiGLU its two inputs; the fused LM head + cross-entropy keeps no logits but computes the head's
  weight gradient in the forward (V x d fp32, or 16-bit under autocast).
- activation checkpointing keeps each block's input (the fp32 residual stream) and recomputes one block at a
  time in the backward, so one block's activations are held at once on top.

The logits are the largest tensor of a small model: the torch path holds log-softmax's fp32 output for the
backward, and its gradient, with the logits' own gradient beside it, at the start of the backward. Under
torch.compile (`compiled`) inductor fuses the loss: it saves the logits in the head matmul's dtype and writes
the softmax-minus-target gradient into one buffer of that size, so the head holds one logits tensor (measured on
a CPU, torch 2.13, vocabularies 4,096 and 16,384: 4.0 bytes per token and entry in fp32, 2.25 in bf16, against
the eager path's 12; on the H200, GPT-2 124M bf16 at 16 x 1,024: 9.09 GB peak, where the eager count planned
17.8 and this one 9.6). Its blocks are counted as eager ones: inductor recomputes some pointwise outputs
instead of saving them, so the count is high by 5-20 % (fp32 / bf16 on CPU shapes; llama's norms, RoPE and
SwiGLU most). While its logits' gradient is alive, the compiled head's backward also allocates the head's fp32
weight gradient and its input's gradient (measured on a CPU: without them a batch the logits dominate was
planned 3-4 % under its peak). With activation
checkpointing as well, a compiled step was measured above that count (37.8 MB against 24.9 planned, GPT-2 shape
on a CPU) and below the eager one (41.7), so the eager count stands there.
DyT and LayerNorm on llama are counted as RMSNorm, a few bytes per token off.

The optimizer's step is the other candidate for the peak: every gradient exists then, and off CUDA (where
build_optimizer's AdamW is not fused) each parameter's update allocates temporaries, two fp32 copies of the
largest parameter at once; at small batches that is the peak (a third above weights, gradients and moments
on the CPU shapes of tests/test_plan_memory.py).

With `train.optimizer: muon` the blocks' matrices keep one fp32 momentum (4 bytes a parameter) instead of AdamW's
two moments, and its step orthogonalises each shape's matrices stacked together (pipeline/train/muon.py): the
stacked Nesterov momentum, the iterate, its two update terms and the next iterate, and their Gram matrices (the
narrow side squared), at most five copies of the largest stack and two of its Gram stack at once (measured on a
CPU: 0.98-1.03x the peak at shapes whose step is the peak); the rest (embeddings, head, norms) steps with AdamW as
above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.model.config import ModelConfig, memory_available
from kiln.pipeline.errors import UserError

ADAMW_BYTES = 8  # two fp32 moments
MUON_BYTES = 4  # one fp32 momentum
# The largest micro-batch is planned into all but this share of the device's free bytes: the count holds tensors
# only, not the allocator's fragmentation or cuBLAS's and inductor's workspaces. Planned to the last byte, the
# H200's 150 GB took a compiled GPT-2 124M micro-batch of 302 (149.4 GB counted) and it ran out of memory.
HEADROOM = 0.10


@dataclass
class Shape:
    """What the counts depend on: the model, its precision and kernels, activation checkpointing, compile."""

    config: ModelConfig
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8 (counted as bf16)
    fused: bool = False  # kiln's Triton kernels
    checkpointing: bool = False
    compiled: bool = False  # torch.compile: the torch path's loss fused (one logits tensor, above)
    fused_adamw: bool = False  # build_optimizer's choice on CUDA; elsewhere AdamW steps one tensor at a time
    optimizer: str = "adamw"  # adamw | muon (train.optimizer)
    LOGIT_GRADIENTS = 8  # bytes per token and vocabulary entry: log-softmax's output gradient, the logits'

    @property
    def half(self) -> bool:
        return self.precision != "fp32"

    def layer_matrix_params(self) -> int:
        c = self.config
        d, kv, f = c.d_model, c.n_kv_head * c.head_dim, c.ffn_dim
        return 2 * d * d + 2 * d * kv + (3 if c.gated else 2) * d * f

    def layer_bytes_per_token(self) -> int:
        """Bytes one block saves for the backward per token (d_model, kv width, heads, MLP width), with the
        knobs' terms (measured against autograd's saved tensors, tests/test_plan_memory.py)."""
        c = self.config
        d, kv, h, f = c.d_model, c.n_kv_head * c.head_dim, c.n_head, c.ffn_dim
        qk_norm = 0
        if c.qk_norm:  # the norms' inputs and 1/rms per head; torch's also keep their outputs for RoPE in fp32
            heads = 4 * (h + c.n_kv_head)
            qk_norm = heads + ((2 if self.half else 4) * (d + kv) if self.fused else 8 * (d + kv))
        if c.arch == "gpt2":  # LayerNorm (mean and 1/std), GELU; fused: flash attention on the torch path's terms
            return qk_norm + (24 * d + 16 + 4 * h + 4 * f if self.half else 32 * d + 16 + 4 * h + 8 * f)
        # relu2 instead of SwiGLU: one MLP activation fewer, and one 16-bit copy of its input (no gate matmul)
        per_f = 1 if self.fused else 2
        relu2 = 0 if c.gated else (2 * per_f * f + 2 * d if self.half else 4 * per_f * f)
        if self.fused:
            block = 22 * d + 8 + 4 * kv + 4 * h + 6 * f if self.half else 24 * d + 8 + 8 * kv + 4 * h + 12 * f
        else:
            block = 36 * d + 8 + 4 * h + 8 * f if self.half else 44 * d + 8 + 4 * h + 16 * f
        return block + qk_norm - relu2

    def layer_constant_bytes(self) -> int:
        """Per layer, whatever the batch: autocast's 16-bit copies of the block's matrices."""
        gains = 2 * 2 * self.config.head_dim if self.config.qk_norm and not self.fused else 0  # QK-norm's, cast
        return 2 * self.layer_matrix_params() + gains if self.half else 0

    def head_bytes(self, tokens: int) -> tuple[int, int]:
        """The final norm, LM head and loss: (bytes saved for the backward, bytes the backward adds at its start:
        the logits' gradients)."""
        c = self.config
        d, v = c.d_model, c.vocab_size
        weight_copy = 2 * c.padded_vocab_size * d if self.half else 0
        if self.fused:  # the head's weight gradient comes out of the forward; no logits beyond a chunk's
            grad_w = (2 if self.half else 4) * c.vocab_size * d
            chunk = min(tokens, 4 * d) * v * (2 if self.half else 4)  # at most 4 d rows (kernels/linear_cross_entropy)
            return grad_w + weight_copy + tokens * ((6 if self.half else 8) * d + 12), chunk + grad_w
        norm_and_head_inputs = (10 if self.half else 12) * d + 12
        if self.compiled and not self.checkpointing:  # the logits in the matmul's dtype, the gradient in place
            # and, while it is alive, the head's fp32 weight gradient and its input's gradient
            head_grads = 4 * c.padded_vocab_size * d + tokens * (2 if self.half else 4) * d
            return weight_copy + tokens * (norm_and_head_inputs + (2 if self.half else 4) * v), head_grads
        # logit_softcap: tanh's output, kept for its backward (measured: 4 B/token/entry in fp32, 6 under bf16)
        softcap = (6 if self.half else 4) * v if c.logit_softcap else 0
        return weight_copy + tokens * (norm_and_head_inputs + 4 * v + softcap), tokens * self.LOGIT_GRADIENTS * v

    def checkpointed_bytes_per_token(self) -> int:
        """What a block keeps per token under activation checkpointing: its fp32 input."""
        return 4 * self.config.d_model

    def activation_bytes(self, tokens: int) -> int:
        """The most the forward's saved tensors and the backward's own hold at once, for `tokens` tokens of one
        micro-batch: at the start of the backward (every layer's saved tensors and the logits' gradients), or,
        with checkpointing, while a block is recomputed (the block inputs and that one block's activations)."""
        c = self.config
        layer = self.layer_bytes_per_token() * tokens + self.layer_constant_bytes()
        head, head_backward = self.head_bytes(tokens)
        if not self.checkpointing:
            return c.n_layer * layer + head + head_backward
        inputs = c.n_layer * self.checkpointed_bytes_per_token() * tokens
        return inputs + max(head + head_backward, layer)


def muon_stacks(config: ModelConfig) -> dict[tuple[int, int], int]:
    """The blocks' matrices Muon updates, by shape: (rows, cols) -> how many (every layer's of that shape)."""
    d, inner, kv, f = config.d_model, config.n_head * config.head_dim, config.n_kv_head * config.head_dim, \
        config.ffn_dim
    stacks: dict[tuple[int, int], int] = {}
    for shape, count in (((inner, d), 1), ((kv, d), 2), ((d, inner), 1), ((f, d), 2 if config.gated else 1),
                         ((d, f), 1)):
        stacks[shape] = stacks.get(shape, 0) + count * config.n_layer
    return stacks


def state_bytes(config: ModelConfig, optimizer: str = "adamw") -> dict[str, int]:
    n = config.num_params()
    matrices = sum(r * c * k for (r, c), k in muon_stacks(config).items()) if optimizer == "muon" else 0
    return {"weights": 4 * n, "gradients": 4 * n, "optimizer": ADAMW_BYTES * (n - matrices) + MUON_BYTES * matrices}


def step_temporary_bytes(shape: Shape) -> int:
    """What the optimizer's step allocates beside every gradient and moment. AdamW fused: nothing; unfused, one
    tensor at a time, the denominator sqrt(v) / bias correction of the largest parameter, two fp32 temporaries at
    once (measured on a CPU: a small batch's peak is the step's, 32 % above weights, gradients and moments alone).
    Muon: five fp32 copies of a stack of same-shaped matrices and two of its Gram matrices, for the largest
    stack, or AdamW's for the rest if larger (they step one after the other)."""
    c = shape.config
    largest = max(c.padded_vocab_size, c.ffn_dim, c.n_head * c.head_dim, c.max_seq_len) * c.d_model
    adamw = 0 if shape.fused_adamw else 2 * 4 * largest
    if shape.optimizer != "muon":
        return adamw
    stack = max(5 * k * r * cols + 2 * k * min(r, cols) ** 2 for (r, cols), k in muon_stacks(c).items())
    return max(adamw, 4 * stack)


def plan(shape: Shape, batch_size: int, seq_len: int, device_bytes: int | None) -> dict:
    """The plan's numbers: state, activations for `batch_size` x `seq_len`, KV cache, and the largest
    micro-batch (in sequences) that fits `device_bytes` with HEADROOM of it left free."""
    c = shape.config
    state = state_bytes(c, shape.optimizer)
    tokens = batch_size * seq_len
    activations = shape.activation_bytes(tokens)
    # The gradients fill in during the backward as the activations are freed: the peak is at its start (no
    # gradients yet: zero_grad sets them to None) or in the optimizer's step (every gradient, no activations).
    temporaries = step_temporary_bytes(shape)
    step = state["gradients"] + temporaries
    total = state["weights"] + state["optimizer"] + max(activations, step)
    kv_bytes = 2 * c.n_layer * c.n_kv_head * c.head_dim * (2 if shape.half else 4)
    result = {"params": c.num_params(), "optimizer": shape.optimizer, "precision": shape.precision, "kernels": "triton" if shape.fused else "torch",
              "activation_checkpointing": shape.checkpointing, "compile": shape.compiled,
              "batch_size": batch_size, "seq_len": seq_len, **{f"{k}_bytes": v for k, v in state.items()},
              "activation_bytes": activations, "step_temporary_bytes": temporaries, "total_bytes": total,
              "activation_bytes_per_token_per_layer": shape.layer_bytes_per_token(),
              "activation_bytes_per_token_per_layer_checkpointed": shape.checkpointed_bytes_per_token(),
              "kv_cache_bytes_per_token": kv_bytes, "kv_cache_bytes_full_context": kv_bytes * c.max_seq_len,
              "device_bytes": device_bytes, "headroom": HEADROOM, "largest_batch_size": None}
    if device_bytes is not None:
        fixed = state["weights"] + state["optimizer"]
        room = device_bytes * (1 - HEADROOM)

        def fits(sequences: int) -> bool:
            return fixed + max(shape.activation_bytes(sequences * seq_len), step) <= room

        low, high = 0, 1  # fits(low); find a high that does not, then bisect
        while high < 1 << 24 and fits(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        result["largest_batch_size"] = low
    return result


def check_run_memory(model: torch.nn.Module, shape: Shape, micro_batch_tokens: int, device: torch.device,
                     section: str) -> None:
    """Refuse (UserError naming the key) a run whose gradients, AdamW state and activations for one micro-batch
    of `micro_batch_tokens` would not fit what `device` has free now that the weights are loaded: before the
    optimizer or the first batch allocates anything. The key named is the term that dominates: the batch for
    the activations, the adapter's rank for its state (a model with frozen weights trains adapters), else the
    model's size."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapter = trainable < sum(p.numel() for p in model.parameters())
    state = trainable * (4 + ADAMW_BYTES)  # fp32 gradients and two moments of what trains
    activations = shape.activation_bytes(micro_batch_tokens)
    need, have = state + activations, memory_available(device)
    if need <= have:
        return
    key = f"{section}.batch_size" if activations >= state else f"{section}.lora_rank" if adapter else "model size"
    raise UserError(f"{key}: this run needs ~{need / 1e9:.3g} GB beyond its weights ({state / 1e9:.3g} GB of "
                    f"gradients and AdamW state for {trainable:,} trained parameters, {activations / 1e9:.3g} GB of "
                    f"activations for {micro_batch_tokens:,} tokens a micro-batch); {device} has {have / 1e9:.3g} GB "
                    "free (kiln plan memory shows the estimate)")
