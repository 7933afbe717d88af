"""Quantized inference: a loaded model's linear layers stored in fewer bits (`kiln serve/generate/chat --quantize`,
`eval.quantize`, `kiln bench generate/serve --quantize`).

What is quantized are the transformer blocks' linear layers (attention and MLP projections): the token
embedding, the LM head and the norms keep their precision, as vLLM's and TorchAO's recipes usually keep them,
since the head's errors land directly on every logit. The kinds:

- `int8`: kiln's `Int8Linear`, any device: int8 weights with one fp32 scale per output channel (absmax / 127),
  activations as they are; a quarter of fp32's weight bytes. Off a CPU every call casts the weight to the
  activations' dtype, as TorchAO's eager path does (not timed on a GPU yet);
- `int4`: TorchAO's int4 weight-only in groups of 128, in tinygemm's tile-packed layout (`aten._weight_int4pack_mm`),
  on a CUDA GPU of compute capability 8.0 or more; the quantized weights are bf16 underneath, so each layer
  casts its input to bf16 and its output back. A layer whose input width is not a multiple of 128 stays as it
  was. (TorchAO 0.18's default int4 layout calls the `mslk` package's kernels, which kiln does not install.)
- `fp8`: TorchAO's fp8 (e4m3) weights and dynamically quantized activations, on a GPU of compute capability 8.9
  or more.

Why int8 is not TorchAO's `Int8WeightOnlyConfig`: its weight-only linear casts the whole int8 weight to the
activations' dtype on every call behind a tensor subclass's dispatch: the default 1.4M model's decode step ran
at 0.73-0.79x fp32's on a 2-core CPU. TorchAO's answer is `torch.compile` after `quantize_`; the serving engine
calls the model's forward itself (pipeline/serve/runner.py), so what can be compiled from here is submodules,
and compiling the quantized linear layers cost 20 s and ran the step at 0.35x. `Int8Linear` ran it at
0.85-0.93x, and at 1.3-1.6x on a 6 x 512 model (kernels/BENCHMARKS.md): it calls a fused int8 matmul where one
is fast, and there only.

The model's forward is unchanged otherwise, so the engine's paged attention and CUDA graphs work on it as on
the original.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.nn import functional as F

from kiln.model.errors import UserError

KINDS = ("int8", "int4", "fp8")
FP8_DEVICES = "a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell)"  # fp8 tensor cores
INT4_DEVICES = "a CUDA GPU of compute capability 8.0 or more"  # tinygemm's int4 kernels use bf16 tensor cores
INT4_GROUP = 128  # weights sharing one scale and zero point, along the input width

# Where `aten._weight_int8pack_mm` runs `Int8Linear` on a CPU. Its kernel is vectorised (AVX2, AVX-512) for bf16
# activations only: fp32 ones take a scalar loop, 5-20x slower than fp32's own matmul. It reads 16 input values at a
# time with aligned loads (an input width that is not a multiple of 16 reads past each row) and converts the
# weight afresh for every 4 rows. Measured on a 2-core AVX2 EPYC, one thread, layers in a stack too large for the
# cache (us per layer, fp32 / kernel / int8 cast then fp32 matmul): 1 row of 512x512 144 / 69 / 97, 1024x1024
# 407 / 296 / 337, 2048x2048 1267 / 1082 / 2813, 256x256 39 / 26 / 33, but 128x128 19 / 20 / 19, where the
# kernel's two casts cost what its narrower reads save; 4 rows of 1024x1024 951 / 447 / 844, 16 rows 1372 / 1469
# / 1313, so prefill widths take the cast, once for all their rows.
KERNEL_ALIGNMENT = 16
KERNEL_MAX_ROWS = 8
KERNEL_MIN_WEIGHTS = 2**16


class Int8Linear(nn.Module):
    """A linear layer with int8 weights, one fp32 scale per output channel (symmetric: absmax / 127, so a row's
    largest weight is exact and every other is within half a step), built from a trained `nn.Linear`.

    On a CPU, a call of up to KERNEL_MAX_ROWS rows (decoding) on a layer of KERNEL_MIN_WEIGHTS or more runs
    `aten._weight_int8pack_mm` on a bf16 copy of its input and scales the bf16 result in fp32; every other call
    casts the int8 weight to the input's dtype and multiplies as fp32 does (a prefill's rows share that cast)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale)
        # the kernel's own scales: ones, so that the true scales multiply in fp32, not rounded to bf16
        self.register_buffer("unit", torch.ones_like(scale, dtype=torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.kernel = (weight.device.type == "cpu" and self.in_features % KERNEL_ALIGNMENT == 0
                       and self.in_features * self.out_features >= KERNEL_MIN_WEIGHTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernel and rows <= KERNEL_MAX_ROWS:
            # a fresh contiguous copy: the kernel's aligned loads need its rows to start on 32-byte boundaries
            flat = x.reshape(rows, self.in_features).to(torch.bfloat16, memory_format=torch.contiguous_format,
                                                        copy=True)
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.unit) * self.scale
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def runs_fp8(device: torch.device) -> bool:
    """Whether `device` has fp8 matmuls (torch._scaled_mm)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def runs_int4(device: torch.device) -> bool:
    """Whether `device` runs tinygemm's int4 kernels (`aten._weight_int4pack_mm` on CUDA)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@contextlib.contextmanager
def quiet_torchao():
    """Import TorchAO without its messages: it says at import what its CUDA extensions cannot load on this
    machine, and torch warns about one of its enums; neither concerns a run that uses neither."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def check_quantize(kind: str | None, device: torch.device) -> None:
    """Refuse (UserError, one line) a kind that is not known or that `device` cannot run, before loading."""
    if kind is None:
        return
    if kind not in KINDS:
        raise UserError(f"--quantize {kind}: expected one of {', '.join(KINDS)}")
    device = torch.device(device)
    if kind == "int4" and not runs_int4(device):
        raise UserError(f"--quantize int4: TorchAO's int4 weight kernels need {INT4_DEVICES}; this is "
                        f"{_named(device)}. int8 runs on any device")
    if kind == "fp8" and not runs_fp8(device):
        raise UserError(f"--quantize fp8: fp8 matmuls need {FP8_DEVICES}; this is {_named(device)}. int8 runs on "
                        "any device")


def _named(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def quantize(model: torch.nn.Module, kind: str | None) -> torch.nn.Module:
    """`model` with its blocks' linear layers quantized as `kind` (in place; None: as it is)."""
    if kind is None:
        return model
    if kind == "int8":
        for parent in list(model.blocks.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
        return model
    with quiet_torchao():
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig, quantize_
    if kind == "fp8":
        quantize_(model.blocks, Float8DynamicActivationFloat8WeightConfig(),
                  filter_fn=lambda module, _: isinstance(module, nn.Linear))
        return model
    chosen = int4_layers(model)
    if not chosen:
        raise UserError(f"--quantize int4: no linear layer in the model's blocks has an input width that is a multiple "
                        f"of {INT4_GROUP} (TorchAO's int4 groups); int8 quantizes any")
    for module in chosen:  # tinygemm's layout is built from bf16 weights
        module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    ids = {id(module) for module in chosen}
    # set_inductor_config would change torch.compile's settings for the whole process; kiln compiles none of this
    config = Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                  set_inductor_config=False)
    quantize_(model.blocks, config, filter_fn=lambda module, _: id(module) in ids)
    return model


def int4_layers(model: torch.nn.Module) -> list[nn.Linear]:
    """The blocks' linear layers that int4 quantizes: those whose input width is a multiple of INT4_GROUP."""
    return [m for m in model.blocks.modules() if isinstance(m, nn.Linear) and m.in_features % INT4_GROUP == 0]


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the blocks' linear layers' weights (with their scales) and of the whole model's tensors."""
    blocks = {id(t): t for m in model.blocks.modules() if isinstance(m, (nn.Linear, Int8Linear))
              for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)] if name != "bias"}
    every = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return {"linear_bytes": sum(_nbytes(t) for t in blocks.values()),
            "model_bytes": sum(_nbytes(t) for t in every.values())}


def _nbytes(t: torch.Tensor) -> int:
    """A tensor's storage bytes; for TorchAO's subclasses, the sum of the plain tensors inside."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_nbytes(getattr(t, name)) for name in names if getattr(t, name) is not None)
