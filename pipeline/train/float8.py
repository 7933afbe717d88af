"""fp8 training (`train.precision: fp8`): the blocks' linear layers run their three matmuls in fp8 with
TorchAO's float8 training (`convert_to_float8_training`), the way torchtitan trains in fp8.

What converts: the transformer blocks' linear layers (attention and MLP projections), which hold nearly all of
a step's matmul FLOPs at training shapes. The token embedding, the LM head (whose errors land on every logit,
and which kiln's fused head computes from its weight directly) and the norms stay as they are; everything
outside the converted layers computes under bf16 autocast, as `precision: bf16` does. A layer whose input or
output width is not a multiple of 16 (what fp8 GEMMs take) stays in bf16, said once. Weights, gradients and
AdamW's state stay fp32: the layers cast to fp8 on the fly with dynamic scales (tensorwise: one scale per
tensor; rowwise: one per row, more accurate, somewhat slower), so a checkpoint holds exactly what a bf16 run's
does and there is no scale state to save.

Under FSDP2 with tensorwise scales the converted weights are all-gathered in fp8, half a bf16 gather's bytes
(TorchAO's `enable_fsdp_float8_all_gather`, as torchtitan turns it on): each rank casts its shard with the scale
of the whole weight, so the gathered fp8 weight is the one an unsharded run computes. That scale needs the whole
weight's amax, an all-reduce per weight and gather (the forward's, and the backward's again), unless it is ready:
after every optimizer step `precompute_fp8_scales` computes every weight's scale from one all-reduce of all their
amaxes (TorchAO's `precompute_float8_dynamic_scale_for_fsdp`, which torchtitan calls after its optimizer step),
and the gathers until the next step use them. (torchtitan's other fp8 FSDP setting,
`force_recompute_fp8_weight_in_bwd`, does nothing in TorchAO 0.18, which says it is deprecated.) Rowwise scales
gather in bf16 (TorchAO gathers only tensorwise in fp8). fp8 matmuls need a GPU of compute capability 8.9 or
more; on a CPU TorchAO emulates them (the same casts and scales, the matmul in high precision), which is what
kiln's tests run; other devices are refused before any work (`runtime.setup_precision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kiln.model.quantize import quiet_torchao
from kiln.pipeline.errors import UserError
from kiln.pipeline.progress import console

ALIGNMENT = 16  # fp8 GEMMs (torch._scaled_mm) take widths that are multiples of 16


def to_float8_training(model: torch.nn.Module, recipe: str, device: torch.device, section: str = "train",
                       sharded: bool = False) -> int:
    """Convert `model`'s blocks' linear layers to TorchAO's Float8Linear in place; return how many converted.
    `sharded`: FSDP2 is applied next, and gathers tensorwise-scaled weights in fp8."""
    if not all(p.requires_grad for p in model.parameters()):  # a frozen base: LoRA's or QLoRA's
        raise UserError(f"params: train.precision=fp8 trains every weight ({section}.adapter=full): LoRA's and "
                        "QLoRA's frozen bases are not converted; use bf16 with an adapter")
    with quiet_torchao():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    # the fp8 all-gather wraps each converted weight in a tensor subclass (the sharded checkpoint saves the plain
    # tensor inside: train/checkpoints.py)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=device.type != "cuda",
                                 enable_fsdp_float8_all_gather=gathers_in_fp8(recipe, sharded))
    kept, converted = [], []

    def convertible(module: torch.nn.Module, name: str) -> bool:
        if not name.startswith("blocks."):
            return False
        if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
            kept.append(name)
            return False
        converted.append(name)
        return True

    convert_to_float8_training(model, module_filter_fn=convertible, config=config)
    if config.enable_fsdp_float8_all_gather:
        console.print(f"train.precision=fp8: FSDP gathers the {len(converted)} converted weights in fp8",
                      highlight=False)
    if kept:
        console.print(f"train.precision=fp8: {len(kept)} linear layers stay bf16, their widths not multiples of "
                      f"{ALIGNMENT} (first: {kept[0]})", highlight=False)
    return len(converted)


def gathers_in_fp8(recipe: str, sharded: bool) -> bool:
    """Whether FSDP2 all-gathers the converted weights in fp8: tensorwise scales only."""
    return sharded and recipe == "tensorwise"


def after_optimizer_step(precision: str, recipe: str, sharded: bool) -> Callable[[torch.nn.Module], None] | None:
    """What the loop runs on the model after each optimizer step: the fp8 gathers' scales where FSDP gathers in
    fp8, nothing otherwise."""
    return precompute_fp8_scales if precision == "fp8" and gathers_in_fp8(recipe, sharded) else None


def precompute_fp8_scales(model: torch.nn.Module) -> None:
    """Every fp8-gathered weight's scale for its next gathers, from the weights as the step left them: one
    all-reduce of all their amaxes. Every rank calls it (a collective)."""
    with quiet_torchao():
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    precompute_float8_dynamic_scale_for_fsdp(model)
