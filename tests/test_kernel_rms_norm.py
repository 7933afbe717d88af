"""RMSNorm kernel: output, dx and dweight against the float64 reference on awkward row counts and hidden sizes,
3-D and strided inputs, eps-dominated rows, a bf16 input with an fp32 weight, and the reference itself
against torch.nn.RMSNorm (the module the model uses).

The backward splits rows over a few programs in the interpreter (4; one per SM on a GPU), so 37 rows exercise
uneven row counts per program and the sum of the per-program dweight partials. On a GPU the main test also
runs a real model's activations: 4096-8192 rows, hidden 768-8192.

dweight sums every row in fp32, and that rounding error grows like sqrt(rows) while an element near 0 is held
to the bare atol: at 8192 x 8192 it reached 2.6x the fp32 tolerance (interpreter, 132 programs as on an H100).
So fp32 dweight gets sqrt(rows / 128) times the tolerance, which is 1 up to 128 rows: every CPU-sized
comparison is unscaled. bf16's own rounding (2e-2) dwarfs that error at any size.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch

import kiln.kernels.launch
import kiln.kernels.rms_norm
from kiln.kernels.rms_norm import reference, rms_norm

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations, record_launches

DTYPES = [torch.float32, torch.bfloat16]


def check(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5, seed: int = 1) -> None:
    """Run the Triton path under poisoned allocations and compare y, dx, dweight with float64 autograd."""
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.device, x.dtype)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = reference(x64, w64, eps)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())

    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    with poisoned_allocations():
        y = rms_norm(x, w, eps, backend="triton")
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, w.dtype)
    assert_close(y, y64, x.dtype, "y")
    assert_close(dx, dx64, x.dtype, "dx")
    rows = x.numel() // x.shape[-1]
    # A sum over every row in fp32: its rounding error grows like sqrt(rows) (module docstring).
    dw_scale = max(1.0, (rows / 128) ** 0.5) if w.dtype == torch.float32 else 1.0
    assert_close(dw, dw64, w.dtype, "dweight", scale=dw_scale)


def inputs(shape, dtype, w_dtype=None, scale=3.0, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(device, dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(device, w_dtype or dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [*product([1, 3, 37], [64, 123, 257]),
                                         *on_gpu((8192, 768), (4096, 4096), (8192, 8192))])
def test_rows_and_hidden(rows, hidden, dtype):
    check(*inputs((rows, hidden), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 5, 257), (3, 7, 123)])
def test_batch_time_hidden(shape, dtype):
    check(*inputs(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_input(dtype):
    # Rows 2·H apart (half of each row sliced off), as a view into a wider activation would be.
    x, w = inputs((2, 5, 2 * 123), dtype)
    x = x[..., :123]
    assert not x.is_contiguous()
    check(x, w[:123])


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_eps_dominated_rows(eps):
    # mean(x²) ~ 1e-6, comparable to or far below eps, so eps' place in the formula shows in y and both grads.
    check(*inputs((5, 123), torch.float32, scale=1e-3), eps=eps)


def test_bf16_input_fp32_weight():
    check(*inputs((3, 7, 123), torch.bfloat16, w_dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_nn_rmsnorm(dtype):
    x, w = inputs((4, 123), dtype)
    module = torch.nn.RMSNorm(123, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        module.weight.copy_(w)
        y = module(x)
    assert y.dtype == reference(x, w).dtype == dtype
    assert_close(y, reference(x.double(), w.double(), 1e-5), dtype, "nn.RMSNorm vs reference")


def test_torch_backend_is_reference():
    x, w = inputs((3, 123), torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5, backend="torch"), reference(x, w, 1e-5))


@pytest.mark.parametrize("device", ["cpu", *on_gpu("cuda")])
def test_auto_uses_kernels_only_on_cuda(monkeypatch, device):
    launched = record_launches(monkeypatch, kiln.kernels.rms_norm, "rms_norm_op")
    x, w = inputs((3, 123), torch.float32, device=device)
    assert_close(rms_norm(x, w, backend="auto"), reference(x.double(), w.double()), torch.float32)
    assert bool(launched) == (device == "cuda")


def test_hidden_too_large_for_one_program():
    x, w = inputs((1, kiln.kernels.launch.MAX_FUSED_SIZE + 1), torch.float32)
    with pytest.raises(ValueError, match="rms_norm: 65537 elements"):
        rms_norm(x, w, backend="triton")
