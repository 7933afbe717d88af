"""`kiln plan memory`: the bytes a training configuration will hold, before it is launched, and the largest
micro-batch that fits a device, by the model in train/memory.py (which says what it counts); `--measure` sets the
estimate beside the peak of two real steps on this CPU.
"""


from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from rich.table import Table

from kiln.model.config import ModelConfig, memory_available
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.runtime import pick_device, resolve_kernels
from kiln.pipeline.train.memory import Shape, plan

MAX_DEVICE_GB = 1_000_000  # a petabyte: beyond any one device, and far inside what the byte counts can hold


def show(result: dict, config: ModelConfig) -> None:
    gb = 1e9
    n = result["params"]
    table = Table(title=f"memory plan: {config.arch} {config.n_layer}x{config.d_model}, {n / 1e6:.2f}M params, "
                        f"{result['precision']}, kernels {result['kernels']}, batch {result['batch_size']}x"
                        f"{result['seq_len']}" + (", activation checkpointing" if result["activation_checkpointing"]
                                                   else "") + (", torch.compile" if result["compile"] else ""))
    table.add_column("what")
    table.add_column("GB", justify="right")
    table.add_column("rule")
    table.add_row("weights", f"{result['weights_bytes'] / gb:.3f}", "fp32: 4 B/param")
    table.add_row("gradients", f"{result['gradients_bytes'] / gb:.3f}", "fp32: 4 B/param")
    if result["optimizer"] == "muon":
        table.add_row("Muon + AdamW state", f"{result['optimizer_bytes'] / gb:.3f}",
                      "blocks' matrices: 1 fp32 momentum, 4 B/param; the rest AdamW's 2 moments, 8 B/param")
    else:
        table.add_row("AdamW state", f"{result['optimizer_bytes'] / gb:.3f}",
                      "2 fp32 moments: 8 B/param (16 B/param in all; mixed precision's rule: 2 + 2 + 12)")
    table.add_row("activations", f"{result['activation_bytes'] / gb:.3f}",
                  f"{result['activation_bytes_per_token_per_layer']:,} B/token/layer "
                  f"({result['activation_bytes_per_token_per_layer_checkpointed']:,} checkpointed) + head and loss")
    if result["step_temporary_bytes"] and result["optimizer"] == "muon":
        table.add_row("optimizer step temporaries", f"{result['step_temporary_bytes'] / gb:.3f}",
                      "Muon: fp32 copies of its largest stack of same-shaped matrices (or AdamW's, if more)")
    elif result["step_temporary_bytes"]:
        table.add_row("AdamW step temporaries", f"{result['step_temporary_bytes'] / gb:.3f}",
                      "unfused AdamW (off CUDA): two fp32 copies of the largest parameter")
    table.add_row("total (peak)", f"{result['total_bytes'] / gb:.3f}", "")
    table.add_row("KV cache (generation)", f"{result['kv_cache_bytes_full_context'] / gb:.4f}",
                  f"{result['kv_cache_bytes_per_token']:,} B/token, per sequence of max_seq_len")
    console.print(table)
    if result["device_bytes"] is not None:
        console.print(f"largest micro-batch in {result['device_bytes'] / gb:.3g} GB, {result['headroom']:.0%} left "
                      f"free: {result['largest_batch_size']} sequences of {result['seq_len']} tokens", highlight=False)


def measure_cpu_peak(shape: Shape, batch_size: int, seq_len: int, steps: int = 2) -> int:
    """The peak of tensor bytes allocated on the CPU while a model of `shape` is built and trains `steps` steps
    through the loop's own Step (the AdamW state exists from the first): torch.profiler's memory events, whose
    running total counts every tensor allocated since it started, so the count starts before the model exists."""
    from torch.profiler import ProfilerActivity, profile

    from kiln.model.gpt import GPT
    from kiln.pipeline.train.lm import lm_loss
    from kiln.pipeline.train.loop import Step, build_optimizer, compile_forward
    from kiln.pipeline.train.params import TrainParams

    params = TrainParams(precision=shape.precision, kernels="triton" if shape.fused else "torch",
                         compile=shape.compiled, optimizer=shape.optimizer)
    device = torch.device("cpu")
    torch.manual_seed(0)
    # A fresh compile: after another batch size dynamo would compile this one for any size (automatic dynamic
    # shapes), a graph that holds other buffers than a run of one size does.
    torch._dynamo.reset()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = GPT(shape.config).set_kernels(params.kernels).set_checkpointing(shape.checkpointing)
        step = Step(model, compile_forward(model, params), build_optimizer(model, params, device),
                    torch.amp.GradScaler("cpu", enabled=False), lm_loss, 1, params, device)
        batch = [torch.randint(shape.config.vocab_size, (batch_size, seq_len)) for _ in range(2)]
        for _ in range(steps):
            step(iter([batch]), params.lr, lambda loss: None)
        del model, step
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def plan_memory(model_config: ModelConfig, precision: str, kernels: str, checkpointing: bool, compiled: bool,
                batch_size: int, seq_len: int, device_gb: float | None, measure: bool, out: Path | None,
                optimizer: str = "adamw") -> dict:
    """`device_gb` None: this machine's free memory (its GPU's, else its RAM). `kernels` auto counts as what a run
    here would use (resolve_kernels). `measure`: also train two steps on this CPU and report the measured peak
    beside the estimate."""
    if batch_size < 1 or not 1 <= seq_len <= model_config.max_seq_len:
        raise UserError(f"--batch-size {batch_size}, --seq-len {seq_len}: expected a positive batch and a length in "
                        f"1..{model_config.max_seq_len} (model.max_seq_len)")
    if device_gb is not None and not 0 < device_gb <= MAX_DEVICE_GB:
        raise UserError(f"--device-gb {device_gb}: expected a positive number of GB, at most {MAX_DEVICE_GB:,}")
    device = pick_device("auto")
    kernels = resolve_kernels(kernels, device)
    if measure and kernels != "torch":
        raise UserError(f"--measure with --kernels {kernels}: the Triton kernels run on a CPU only in the interpreter, "
                        "whose allocations are not the GPU's; measure with --kernels torch")
    shape = Shape(model_config, precision, kernels != "torch", checkpointing, compiled, device.type == "cuda",
                  optimizer)
    result = plan(shape, batch_size, seq_len, memory_available(device) if device_gb is None else int(device_gb * 1e9))
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
