"""Cross-entropy kernel: loss and logits gradient against the float64 reference for every reduction, with and
without z-loss, ignored rows, vocabularies from 37 to 50304; plus a retained graph's second backward, and the
reference itself against F.cross_entropy. On a GPU the main test also runs a training step's logits: 4096
tokens over vocabularies of 32768 and 50304, and 1024 over 128256 (the float64 reference of 4096 would hold
several 4 GB copies).

The loss per row is a log-sum-exp over the whole vocabulary, but the kernel accumulates it in fp32 and the
values compared are O(10) (O(10^4) summed over 4096 rows, an error relative to that sum), so the per-dtype
tolerances hold without `scale` (measured in the interpreter at 1024 x 128256, "sum": at most 0.15x the
tolerance, bf16 dlogits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln.kernels.cross_entropy
from kiln.kernels.cross_entropy import cross_entropy, reference

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations, record_launches

DTYPES = [torch.float32, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]


def inputs(N, V, dtype, ignore_index=-100, seed=0, device=DEVICE):
    """Logits with a spread like a trained LM's (std 3, so the softmax is peaked), every third row ignored."""
    g = torch.Generator().manual_seed(seed)
    # Scaled and cast on the device: at the GPU-only sizes that costs seconds per test on one CPU thread.
    logits = (3 * torch.randn(N, V, generator=g).to(device)).to(dtype)
    targets = torch.randint(V, (N,), generator=g).to(device)
    targets[1::3] = ignore_index
    return logits, targets


def check_against_reference(logits, targets, dtype, reduction, z_loss=0.0, ignore_index=-100, seed=1):
    """Triton loss and d loss / d logits (under a random upstream gradient) vs float64 on the same values."""
    x64 = logits.double().requires_grad_()
    want = reference(x64, targets, ignore_index, z_loss, reduction)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    upstream = upstream.to(logits.device)
    (want_grad,) = torch.autograd.grad(want, x64, upstream)

    x = logits.detach().requires_grad_()
    with poisoned_allocations():
        got = cross_entropy(x, targets, ignore_index, z_loss, reduction, backend="triton")
        (got_grad,) = torch.autograd.grad(got, x, upstream.float())
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    assert_close(got, want, dtype, "loss")
    assert_close(got_grad, want_grad, dtype, "dlogits")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("N,V", [(1, 37), (37, 1000), (3, 50304),
                                 *on_gpu((4096, 32768), (4096, 50304), (1024, 128256))])
def test_matches_reference(N, V, reduction, z_loss, dtype):
    check_against_reference(*inputs(N, V, dtype), dtype, reduction, z_loss)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_z_loss_and_custom_ignore_index(dtype):
    """A z-loss large enough to dominate the gradient, and ignore_index = 0 (a real class id)."""
    logits, targets = inputs(7, 257, dtype, ignore_index=0)
    check_against_reference(logits, targets, dtype, "mean", z_loss=0.1, ignore_index=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits_do_not_overflow(dtype):
    """exp(1000) overflows fp32: only a max-subtracted log-sum-exp survives."""
    logits, targets = inputs(5, 300, dtype)
    check_against_reference(logits.float().add(1000).to(dtype), targets, dtype, "sum")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored(reduction):
    """As F.cross_entropy: "mean" is 0/0 = NaN, the others 0; the gradient is 0 everywhere."""
    logits, targets = inputs(4, 50, torch.float32)
    targets[:] = -100
    x = logits.requires_grad_()
    with poisoned_allocations():
        got = cross_entropy(x, targets, reduction=reduction, backend="triton")
        (grad,) = torch.autograd.grad(got.sum(), x)
    want = F.cross_entropy(logits, targets, reduction=reduction)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_strided_logits_and_broadcast_upstream():
    """Logits cut from a padded vocabulary (as the model's lm_head output is) and a "none" loss whose
    upstream gradient is an expanded (stride 0) tensor from .sum()."""
    padded, targets = inputs(6, 128, torch.float32)
    x64 = padded.double().requires_grad_()
    (want,) = torch.autograd.grad(reference(x64[:, :100], targets.clamp(max=99), reduction="none").sum(), x64)
    x = padded.requires_grad_()
    with poisoned_allocations():
        loss = cross_entropy(x[:, :100], targets.clamp(max=99), reduction="none", backend="triton")
        (got,) = torch.autograd.grad(loss.sum(), x)
    assert_close(got, want, torch.float32, "dlogits")
    assert torch.equal(got[:, 100:], torch.zeros_like(got[:, 100:]))


def test_no_grad_forward():
    logits, targets = inputs(5, 1000, torch.float32)
    with torch.no_grad(), poisoned_allocations():
        got = cross_entropy(logits, targets, z_loss=1e-4, backend="triton")
    assert_close(got, reference(logits.double(), targets, z_loss=1e-4), torch.float32, "loss")


def test_logits_are_left_alone():
    """The public op writes its gradient to a buffer of its own: the caller's logits are the same afterwards."""
    logits, targets = inputs(9, 1000, torch.float32)
    x = logits.clone().requires_grad_()
    cross_entropy(x, targets, backend="triton").backward()
    assert torch.equal(x.detach(), logits)


def test_second_backward_gives_the_same_gradient():
    """Backward multiplies the stored gradient into a new tensor, so a retained graph can be run again."""
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    loss = cross_entropy(2 * x, torch.randint(10, (4,), device=DEVICE), backend="triton")
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    assert torch.equal(first, second)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reference_is_f_cross_entropy(reduction):
    """Without z-loss the reference must be exactly what the model computes today."""
    logits, targets = inputs(11, 300, torch.float64)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, want = reference(x1, targets, reduction=reduction), F.cross_entropy(x2, targets, reduction=reduction)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x1)[0], torch.autograd.grad(want.sum(), x2)[0])


def test_bf16_reference_computes_in_fp32():
    logits, targets = inputs(5, 300, torch.bfloat16)
    got = reference(logits, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.cross_entropy(logits.float(), targets))


def test_torch_and_auto_backends_are_the_reference(monkeypatch):
    launched = record_launches(monkeypatch, kiln.kernels.cross_entropy, "cross_entropy_op")
    logits, targets = inputs(5, 300, torch.float32, device="cpu")
    want = reference(logits, targets, z_loss=1e-4)
    for backend in ("torch", "auto"):  # auto on CPU tensors: the reference
        x = logits.clone().requires_grad_()
        got = cross_entropy(x, targets, z_loss=1e-4, backend=backend)
        assert torch.equal(got, want)
    assert not launched
