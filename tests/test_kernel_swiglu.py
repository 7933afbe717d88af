"""SwiGLU kernel: output and both gradients against the float64 reference, on shapes whose element counts are
not multiples of the block (including one that spans several blocks), strided inputs, and gates large enough
to saturate the sigmoid at both ends; plus backend selection and the model's own F.silu(gate) * up. On a GPU
the main test also runs an MLP's real activations (4096 tokens x d_ff 2048 and 11008).

The op is elementwise with no reduction, so every comparison, at any size, uses the unscaled per-dtype tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln.kernels.swiglu
from kiln.kernels.swiglu import reference, swiglu

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations, record_launches

DTYPES = [torch.float32, torch.bfloat16]


def inputs(shape, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    # Gates spread over ±12 reach the flat tails of the sigmoid, where silu' has its extremes and sign change.
    gate = (torch.randn(shape, generator=g) * 4).to(device, dtype)
    up = torch.randn(shape, generator=g).to(device, dtype)
    dh = torch.randn(shape, generator=g).to(device, dtype)
    return gate, up, dh


def check(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> None:
    """Run the Triton path under poisoned allocations and compare h, dgate, dup with float64 autograd."""
    dtype = gate.dtype
    gate64 = gate.detach().double().requires_grad_()
    up64 = up.detach().double().requires_grad_()
    h64 = reference(gate64, up64)
    dgate64, dup64 = torch.autograd.grad(h64, (gate64, up64), dh.double())

    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    with poisoned_allocations():
        h = swiglu(gate, up, backend="triton")
        dgate, dup = torch.autograd.grad(h, (gate, up), dh)
    assert (h.dtype, dgate.dtype, dup.dtype) == (dtype, dtype, dtype)
    assert_close(h, h64, dtype, "h")
    assert_close(dgate, dgate64, dtype, "dgate")
    assert_close(dup, dup64, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 37), (1, 123), (2, 5, 257), (3, 1531),
                                   *on_gpu((4096, 2048), (4096, 11008), single=True)])
def test_shapes(shape, dtype):
    # (3, 1531) is 4593 elements: one full block of 4096 and a partial second one.
    check(*inputs(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(dtype):
    # gate and up as the two halves of one fused (tokens, 2·d_ff) projection: neither half is contiguous.
    gate_up, _, dh = inputs((7, 2 * 123), dtype)
    gate, up = gate_up[:, :123], gate_up[:, 123:]
    assert not gate.is_contiguous()
    check(gate, up, dh[:, :123].contiguous())


def test_reference_matches_model_activation():
    gate, up, _ = inputs((3, 37), torch.float64)
    assert_close(reference(gate, up), F.silu(gate) * up, torch.float32, "reference vs F.silu")


def test_torch_backend_is_reference():
    gate, up, _ = inputs((3, 37), torch.bfloat16)
    assert torch.equal(swiglu(gate, up, backend="torch"), reference(gate, up))


@pytest.mark.parametrize("device", ["cpu", *on_gpu("cuda")])
def test_auto_uses_kernels_only_on_cuda(monkeypatch, device):
    launched = record_launches(monkeypatch, kiln.kernels.swiglu, "swiglu_op")
    gate, up, _ = inputs((3, 37), torch.float32, device=device)
    assert_close(swiglu(gate, up, backend="auto"), reference(gate.double(), up.double()), torch.float32)
    assert bool(launched) == (device == "cuda")


def test_mismatched_inputs_rejected():
    gate, up, _ = inputs((3, 37), torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(gate, up[:, :36], backend="triton")
