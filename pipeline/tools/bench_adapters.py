"""`kiln bench adapters`: what full fine-tuning, LoRA and QLoRA hold in memory, measured on real models.

For each shape (the `model` section's, with the tokenizer's vocabulary, and GPT-2 124M's) and each method, the
model is built, adapted as a post-training stage adapts it (rank, alpha and targets from the `sft` section), and
one optimizer step is taken, so AdamW's state exists. Then the tensors are counted: the base's weights (every
frozen parameter and buffer, NF4 codes included, each storage once), the trainable parameters, their gradients
and AdamW's state. On a GPU the peak allocated memory of that step is recorded too. The goals (the LoRA/QLoRA
issue): QLoRA's base at most 0.57 bytes per base parameter (every shape), LoRA's optimizer state at most 2 % of
full's on the GPT-2 124M shape (a 1M-parameter model's adapters are a larger share of it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.table import Table

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.lora import apply_adapter
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.train.loop import build_optimizer
from kiln.pipeline.train.params import TrainParams

METHODS = ("full", "lora", "qlora")
GPT2_124M = ModelConfig(vocab_size=50257, arch="gpt2", n_layer=12, n_head=12, n_kv_head=12, d_model=768,
                        max_seq_len=1024)
GOALS = {"qlora_base_bytes_per_param": 0.57, "lora_optimizer_share_of_full": 0.02}
REFERENCE = "gpt2-124m"  # the shape the optimizer-state goal is stated for


def default_shapes(config: ModelConfig) -> dict[str, ModelConfig]:
    """The `model` section's shape and GPT-2 124M's."""
    return {"default": config, REFERENCE: GPT2_124M}


def _bytes(tensors) -> int:
    """Bytes of distinct storages (a tied matrix, or the NF4 codes a tied head shares, count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def measure(config: ModelConfig, method: str, rank: int, alpha: float, targets: list[str],
            device: torch.device, tokens: int) -> dict:
    torch.manual_seed(0)
    model = GPT(config).to(device)
    base_params = model.num_params()
    have = [t for t in targets if config.arch == "llama" or t != "gate_proj"]  # GPT-2's MLP has no gate
    apply_adapter(model, method, rank, alpha, 0.0, have)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [t for t in model.state_dict(keep_vars=True).values() if not t.requires_grad]  # RoPE tables: not saved
    optimizer = build_optimizer(model, TrainParams(optimizer="adamw"), device)  # fine-tuning's optimizer
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    x = torch.randint(0, config.vocab_size, (1, min(tokens, config.max_seq_len)), device=device)
    model(x, x).backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    row = {"method": method, "base_params": base_params, "base_bytes": _bytes(frozen) if method != "full" else 0,
           "trainable_params": sum(p.numel() for p in trainable),
           "trainable_bytes": _bytes(trainable), "grad_bytes": _bytes(p.grad for p in trainable if p.grad is not None),
           "optimizer_bytes": _bytes(state)}
    row["base_bytes_per_param"] = round((row["base_bytes"] or row["trainable_bytes"]) / base_params, 4)
    if device.type == "cuda":
        row["peak_step_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def bench_adapters(shapes: dict[str, ModelConfig], rank: int, alpha: float, targets: list[str], device_name: str,
                   tokens: int, out: Path) -> dict:
    if device_name not in ("auto", "cpu", "cuda") or device_name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device_name!r}: expected auto, cpu, or cuda on a machine that has it")
    if tokens < 1:
        raise UserError(f"--tokens {tokens}: expected a positive number of tokens")
    device = torch.device("cuda" if device_name == "auto" and torch.cuda.is_available() else
                          "cpu" if device_name == "auto" else device_name)
    results = []
    for shape, config in shapes.items():
        rows = [measure(config, method, rank, alpha, targets, device, tokens) | {"shape": shape}
                for method in METHODS]
        full = rows[0]["optimizer_bytes"]
        for row in rows:
            row["optimizer_share_of_full"] = round(row["optimizer_bytes"] / full, 5)
        results += rows
    table = Table(title=f"memory of full / LoRA (rank {rank}) / QLoRA fine-tuning, after one step on {device}")
    for col in ("shape", "method", "base params", "trainable", "base weights", "bytes/param", "grads",
                "AdamW state", "vs full", *(("peak step",) if device.type == "cuda" else ())):
        table.add_column(col, justify="left" if col in ("shape", "method") else "right")
    for r in results:
        mb = lambda n: f"{n / 1e6:,.2f} MB"  # noqa: E731
        table.add_row(r["shape"], r["method"], f"{r['base_params']:,}", f"{r['trainable_params']:,}",
                      mb(r["base_bytes"] or r["trainable_bytes"]), f"{r['base_bytes_per_param']:.3f}",
                      mb(r["grad_bytes"]), mb(r["optimizer_bytes"]), f"{r['optimizer_share_of_full']:.2%}",
                      *((mb(r["peak_step_bytes"]),) if device.type == "cuda" else ()))
    console.print(table)
    lora = [r for r in results if r["method"] == "lora"]
    lora = [r for r in lora if r["shape"] == REFERENCE] or lora  # the goal's shape when it was measured
    verdict = {
        "qlora_base_bytes_per_param": max(r["base_bytes_per_param"] for r in results if r["method"] == "qlora"),
        "lora_optimizer_share_of_full": max(r["optimizer_share_of_full"] for r in lora)}
    met = {k: verdict[k] <= GOALS[k] for k in GOALS}
    for key, ok in met.items():
        console.print(f"{key}: {verdict[key]:.4f} (goal <= {GOALS[key]}): {'met' if ok else 'NOT met'}",
                      highlight=False)
    result = {"benchmark": "adapters", "device": str(device), "rank": rank, "alpha": alpha, "targets": targets,
              "machine": machine(), "results": results, "worst": verdict, "goals": GOALS, "met": met,
              "shapes": {k: c.to_dict() for k, c in shapes.items()}}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result
