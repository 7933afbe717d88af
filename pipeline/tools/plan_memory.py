"""`kiln plan memory`: the bytes a training configuration will hold, before it is launched, and the largest
micro-batch that fits a device.

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
backward, and its gradient, with the logits' own gradient beside it, at the start of the backward.
DyT and LayerNorm on llama are counted as RMSNorm, a few bytes per token off.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from kiln.model.config import ModelConfig, memory_available
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.runtime import pick_device

ADAMW_BYTES = 8  # two fp32 moments


@dataclass
class Shape:
    """What the counts depend on: the model, its precision and kernels, activation checkpointing."""

    config: ModelConfig
    precision: str = "fp32"  # fp32 | bf16 | fp16
    fused: bool = False  # kiln's Triton kernels
    checkpointing: bool = False
    LOGIT_GRADIENTS = 8  # bytes per token and vocabulary entry: log-softmax's output gradient, the logits'

    @property
    def half(self) -> bool:
        return self.precision != "fp32"

    def layer_matrix_params(self) -> int:
        c = self.config
        d, kv, f = c.d_model, c.n_kv_head * c.head_dim, c.ffn_dim
        return 2 * d * d + 2 * d * kv + (3 if c.arch == "llama" else 2) * d * f

    def layer_bytes_per_token(self) -> int:
        """Bytes one block saves for the backward per token (d_model, kv width, heads, MLP width)."""
        c = self.config
        d, kv, h, f = c.d_model, c.n_kv_head * c.head_dim, c.n_head, c.ffn_dim
        if c.arch == "gpt2":  # LayerNorm (mean and 1/std), GELU; fused: flash attention on the torch path's terms
            return 24 * d + 16 + 4 * h + 4 * f if self.half else 32 * d + 16 + 4 * h + 8 * f
        if self.fused:
            return 22 * d + 8 + 4 * kv + 4 * h + 6 * f if self.half else 24 * d + 8 + 8 * kv + 4 * h + 12 * f
        return 36 * d + 8 + 4 * h + 8 * f if self.half else 44 * d + 8 + 4 * h + 16 * f

    def layer_constant_bytes(self) -> int:
        """Per layer, whatever the batch: autocast's 16-bit copies of the block's matrices."""
        return 2 * self.layer_matrix_params() if self.half else 0

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
        saved = weight_copy + tokens * ((10 if self.half else 12) * d + 12 + 4 * v)
        return saved, tokens * self.LOGIT_GRADIENTS * v

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


def state_bytes(config: ModelConfig) -> dict[str, int]:
    n = config.num_params()
    return {"weights": 4 * n, "gradients": 4 * n, "optimizer": ADAMW_BYTES * n}


def plan(shape: Shape, batch_size: int, seq_len: int, device_bytes: int | None) -> dict:
    """The plan's numbers: state, activations for `batch_size` x `seq_len`, KV cache, and the largest
    micro-batch (in sequences) that fits `device_bytes`."""
    c = shape.config
    state = state_bytes(c)
    tokens = batch_size * seq_len
    activations = shape.activation_bytes(tokens)
    # The gradients fill in during the backward as the activations are freed: the peak is at its start (no
    # gradients yet: zero_grad sets them to None) or at its end (every gradient, no activations).
    total = state["weights"] + state["optimizer"] + max(activations, state["gradients"])
    kv_bytes = 2 * c.n_layer * c.n_kv_head * c.head_dim * (2 if shape.half else 4)
    result = {"params": c.num_params(), "precision": shape.precision, "kernels": "triton" if shape.fused else "torch",
              "activation_checkpointing": shape.checkpointing, "batch_size": batch_size, "seq_len": seq_len,
              **{f"{k}_bytes": v for k, v in state.items()}, "activation_bytes": activations, "total_bytes": total,
              "activation_bytes_per_token_per_layer": shape.layer_bytes_per_token(),
              "activation_bytes_per_token_per_layer_checkpointed": shape.checkpointed_bytes_per_token(),
              "kv_cache_bytes_per_token": kv_bytes, "kv_cache_bytes_full_context": kv_bytes * c.max_seq_len,
              "device_bytes": device_bytes, "largest_batch_size": None}
    if device_bytes is not None:
        fixed = state["weights"] + state["optimizer"]

        def fits(sequences: int) -> bool:
            return fixed + max(shape.activation_bytes(sequences * seq_len), state["gradients"]) <= device_bytes

        low, high = 0, 1  # fits(low); find a high that does not, then bisect
        while high < 1 << 24 and fits(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        result["largest_batch_size"] = low
    return result


def show(result: dict, config: ModelConfig) -> None:
    gb = 1e9
    n = result["params"]
    table = Table(title=f"memory plan: {config.arch} {config.n_layer}x{config.d_model}, {n / 1e6:.2f}M params, "
                        f"{result['precision']}, kernels {result['kernels']}, batch {result['batch_size']}x"
                        f"{result['seq_len']}" + (", activation checkpointing" if result["activation_checkpointing"]
                                                   else ""))
    table.add_column("what")
    table.add_column("GB", justify="right")
    table.add_column("rule")
    table.add_row("weights", f"{result['weights_bytes'] / gb:.3f}", "fp32: 4 B/param")
    table.add_row("gradients", f"{result['gradients_bytes'] / gb:.3f}", "fp32: 4 B/param")
    table.add_row("AdamW state", f"{result['optimizer_bytes'] / gb:.3f}",
                  "2 fp32 moments: 8 B/param (16 B/param in all; mixed precision's rule: 2 + 2 + 12)")
    table.add_row("activations", f"{result['activation_bytes'] / gb:.3f}",
                  f"{result['activation_bytes_per_token_per_layer']:,} B/token/layer "
                  f"({result['activation_bytes_per_token_per_layer_checkpointed']:,} checkpointed) + head and loss")
    table.add_row("total (peak)", f"{result['total_bytes'] / gb:.3f}", "")
    table.add_row("KV cache (generation)", f"{result['kv_cache_bytes_full_context'] / gb:.4f}",
                  f"{result['kv_cache_bytes_per_token']:,} B/token, per sequence of max_seq_len")
    console.print(table)
    if result["device_bytes"] is not None:
        console.print(f"largest micro-batch in {result['device_bytes'] / gb:.3g} GB: "
                      f"{result['largest_batch_size']} sequences of {result['seq_len']} tokens", highlight=False)


def measure_cpu_peak(shape: Shape, batch_size: int, seq_len: int, steps: int = 2) -> int:
    """The peak of tensor bytes allocated on the CPU while a model of `shape` is built and trains `steps` steps
    through the loop's own Step (the AdamW state exists from the first): torch.profiler's memory events, whose
    running total counts every tensor allocated since it started, so the count starts before the model exists."""
    from torch.profiler import ProfilerActivity, profile

    from kiln.model.gpt import GPT
    from kiln.pipeline.train.lm import lm_loss
    from kiln.pipeline.train.loop import Step, build_optimizer
    from kiln.pipeline.train.params import TrainParams

    params = TrainParams(precision=shape.precision, kernels="triton" if shape.fused else "torch")
    device = torch.device("cpu")
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = GPT(shape.config).set_kernels(params.kernels).set_checkpointing(shape.checkpointing)
        step = Step(model, model, build_optimizer(model, params, device), torch.amp.GradScaler("cpu", enabled=False),
                    lm_loss, 1, params, device)
        batch = [torch.randint(shape.config.vocab_size, (batch_size, seq_len)) for _ in range(2)]
        for _ in range(steps):
            step(iter([batch]), params.lr, lambda loss: None)
        del model, step
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def plan_memory(model_config: ModelConfig, precision: str, kernels: str, checkpointing: bool, batch_size: int,
                seq_len: int, device_gb: float | None, measure: bool, out: Path | None) -> dict:
    """`device_gb` None: this machine's free memory (its GPU's, else its RAM). `measure`: also train two steps on
    this CPU and report the measured peak beside the estimate."""
    if batch_size < 1 or not 1 <= seq_len <= model_config.max_seq_len:
        raise UserError(f"--batch-size {batch_size}, --seq-len {seq_len}: expected a positive batch and a length in "
                        f"1..{model_config.max_seq_len} (model.max_seq_len)")
    if device_gb is not None and not device_gb > 0:
        raise UserError(f"--device-gb {device_gb}: expected a positive number of GB")
    if measure and kernels != "torch":
        raise UserError(f"--measure with --kernels {kernels}: the Triton kernels run on a CPU only in the interpreter, "
                        "whose allocations are not the GPU's; measure with --kernels torch")
    shape = Shape(model_config, precision, kernels != "torch", checkpointing)
    result = plan(shape, batch_size, seq_len, memory_available(pick_device("auto")) if device_gb is None
                  else int(device_gb * 1e9))
    result["model"] = dataclasses.asdict(model_config)
    show(result, model_config)
    if measure:
        result["measured_cpu_peak_bytes"] = measure_cpu_peak(shape, batch_size, seq_len)
        console.print(f"measured on this CPU (tensor bytes allocated, peak over 2 steps): "
                      f"{result['measured_cpu_peak_bytes'] / 1e9:.3f} GB; the estimate is "
                      f"{result['total_bytes'] / result['measured_cpu_peak_bytes']:.3f}x that", highlight=False)
    if out is not None:
        write_json(out, result)
        console.print(f"wrote {out}", highlight=False)
    return result
