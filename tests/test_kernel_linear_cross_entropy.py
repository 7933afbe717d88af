"""Chunked linear + cross-entropy: loss, grad_hidden and grad_weight against the float64 reference (full
logits, then the plain cross-entropy) for every reduction, with and without z-loss, ignored tokens (a whole
chunk of them too), one chunk and several, fp32 and bf16; and a memory guard showing that no tensor of
N × V elements is ever created, forward or backward. On a GPU the main test also runs a GPT-2-sized LM head:
4096 tokens, D = 768, V = 50304.

At CPU sizes grad_weight sums over at most 37 tokens and the logits over D ≤ 33 products, in fp32 inside each
matmul. The GPU-only shape sums 4096 tokens, 768 products and 50304 vocabulary entries, still with no `scale`:
run in the interpreter ("sum" and "none") its worst error was 0.61x the tolerance (bf16 grad_weight).

In bf16 the logits chunk is rounded to bf16 (as eager F.linear rounds its output), which moves each softmax
entry by up to |logit|·2⁻⁹ of itself; logits of std 2 keep that inside the bf16 tolerance, while peakier ones
(std ≈ 6) measurably leave it, from that rounding alone.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kiln.kernels.linear_cross_entropy
from kiln.kernels.linear_cross_entropy import default_chunk_size, linear_cross_entropy, reference

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations, record_launches

DTYPES = [torch.float32, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]


def inputs(N, V, D, dtype, seed=0, device=DEVICE):
    """Unit-variance hidden states and weights of std 2/sqrt(D), so logits have std 2 (a softmax about as peaked
    as a trained LM's); tokens 8..15 (one whole chunk of 8) and every fifth token ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(device, dtype)
    weight = (2 / D ** 0.5 * torch.randn(V, D, generator=g)).to(device, dtype)
    targets = torch.randint(V, (N,), generator=g).to(device)
    targets[8:16] = -100
    targets[2::5] = -100
    return hidden, weight, targets


def check_against_reference(hidden, weight, targets, dtype, reduction, z_loss, chunk_size, seed=1):
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = reference(h64, w64, targets, z_loss=z_loss, reduction=reduction)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    upstream = upstream.to(hidden.device)
    want_dh, want_dw = torch.autograd.grad(want, (h64, w64), upstream)

    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    with poisoned_allocations():
        got = linear_cross_entropy(h, w, targets, z_loss=z_loss, reduction=reduction, chunk_size=chunk_size,
                                   backend="triton")
        got_dh, got_dw = torch.autograd.grad(got, (h, w), upstream.float())
    assert got.dtype == torch.float32 and got_dh.dtype == got_dw.dtype == dtype
    assert_close(got, want, dtype, "loss")
    assert_close(got_dh, want_dh, dtype, "grad_hidden")
    assert_close(got_dw, want_dw, dtype, "grad_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("N,V,D,chunk_size", [
    (1, 1000, 16, None),
    (37, 1000, 33, None),  # one chunk (the default is up to 4·D rows)
    (37, 1000, 16, 8),  # five chunks, the last one short, chunk 8..15 all ignored
    (3, 50304, 16, 2),
    *on_gpu((4096, 50304, 768, None)),  # two chunks of 2048
])
def test_matches_reference(N, V, D, chunk_size, reduction, z_loss, dtype):
    check_against_reference(*inputs(N, V, D, dtype), dtype, reduction, z_loss, chunk_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("N,V,padded,D,chunk_size", [
    (37, 1000, 1024, 16, 8),
    (5, 300, 301, 8, None),
    *on_gpu((4096, 50260, 50304, 768, None)),  # GPT-2's vocabulary + kiln's 3 chat tokens, as the model pads it
])
def test_padded_weight(N, V, padded, D, chunk_size, reduction, dtype):
    """The model's whole padded weight with vocab_size = V: the padding rows (large here, so any that leaked
    into the softmax would dominate it) are never scored and get a weight gradient of exactly 0."""
    hidden, weight, targets = inputs(N, V, D, dtype)
    pad_rows = torch.full((padded - V, D), 3.0, dtype=dtype, device=weight.device)
    full = torch.cat([weight, pad_rows])
    want = reference(hidden.double(), weight.double(), targets, reduction=reduction)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_dh, want_dw = torch.autograd.grad(reference(h64, w64, targets, reduction=reduction), (h64, w64),
                                           upstream.to(hidden.device))
    h, w = hidden.clone().requires_grad_(), full.clone().requires_grad_()
    with poisoned_allocations():
        got = linear_cross_entropy(h, w, targets, reduction=reduction, chunk_size=chunk_size, backend="triton",
                                   vocab_size=V)
        got_dh, got_dw = torch.autograd.grad(got, (h, w), upstream.float().to(hidden.device))
    assert_close(got, want, dtype, "loss")
    assert_close(got_dh, want_dh, dtype, "grad_hidden")
    assert_close(got_dw[:V], want_dw, dtype, "grad_weight")
    assert torch.equal(got_dw[V:], torch.zeros_like(got_dw[V:])), "padding rows' gradient"
    # the reference path takes vocab_size too
    assert torch.equal(reference(hidden.double(), full.double(), targets, reduction=reduction, vocab_size=V), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("N,V,padded,D,chunk_size", [(37, 1000, 1024, 16, 8), (5, 300, 301, 8, None)])
def test_softcap(N, V, padded, D, chunk_size, reduction, dtype):
    """The model's logit_softcap inside the fused head: loss and both gradients of cap·tanh(logits / cap), with
    z-loss, ignored tokens and padding rows, against the formula written out in float64 (logits of std 6 and a
    cap of 5, so most are bent and many saturate)."""
    cap, z_loss = 5.0, 1e-4
    hidden, weight, targets = inputs(N, V, D, dtype)
    weight = weight * 3
    full = torch.cat([weight, torch.full((padded - V, D), 3.0, dtype=dtype, device=weight.device)])
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    capped = cap * torch.tanh(h64 @ w64.T / cap)
    valid = targets != -100
    lse = capped.logsumexp(-1)
    rows = torch.where(valid, lse - capped.gather(1, targets.clamp(min=0)[:, None])[:, 0] + z_loss * lse ** 2, 0.0)
    want = {"mean": rows.sum() / valid.sum(), "sum": rows.sum(), "none": rows}[reduction]
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want_dh, want_dw = torch.autograd.grad(want, (h64, w64), upstream.to(hidden.device))
    h, w = hidden.clone().requires_grad_(), full.clone().requires_grad_()
    with poisoned_allocations():
        got = linear_cross_entropy(h, w, targets, z_loss=z_loss, reduction=reduction, chunk_size=chunk_size,
                                   backend="triton", vocab_size=V, softcap=cap)
        got_dh, got_dw = torch.autograd.grad(got, (h, w), upstream.float().to(hidden.device))
    assert_close(got, want, dtype, "loss")
    assert_close(got_dh, want_dh, dtype, "grad_hidden")
    assert_close(got_dw[:V], want_dw, dtype, "grad_weight")
    assert torch.equal(got_dw[V:], torch.zeros_like(got_dw[V:])), "padding rows' gradient"
    # the torch path (the reference) computes the same formula
    torch.testing.assert_close(reference(hidden.double(), full.double(), targets, z_loss=z_loss,
                                         reduction=reduction, vocab_size=V, softcap=cap), want.detach(),
                               rtol=1e-12, atol=1e-12)


def test_rejects_a_bad_softcap():
    hidden, weight, targets = inputs(4, 50, 8, torch.float32)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            linear_cross_entropy(hidden, weight, targets, backend="triton", softcap=bad)


def test_rejects_vocab_size_outside_the_weight():
    hidden, weight, targets = inputs(4, 50, 8, torch.float32)
    for bad in (0, 51):
        with pytest.raises(ValueError, match="vocab_size must be 1..50"):
            linear_cross_entropy(hidden, weight, targets, backend="triton", vocab_size=bad)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_weight_or_hidden(reduction):
    """Only the gradient asked for is computed (and returned right)."""
    hidden, weight, targets = inputs(20, 300, 8, torch.float32)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = reference(h64, w64, targets, reduction=reduction).sum()
    want_dh, want_dw = torch.autograd.grad(want, (h64, w64))
    for trainable, want_grad in ((hidden, want_dh), (weight, want_dw)):
        x = trainable.clone().requires_grad_()
        args = (x, weight, targets) if trainable is hidden else (hidden, x, targets)
        with poisoned_allocations():
            (got,) = torch.autograd.grad(linear_cross_entropy(*args, reduction=reduction, chunk_size=6,
                                                              backend="triton").sum(), x)
        assert_close(got, want_grad, torch.float32, "grad")


def test_no_grad_forward():
    hidden, weight, targets = inputs(20, 300, 8, torch.float32)
    with torch.no_grad(), poisoned_allocations():
        got = linear_cross_entropy(hidden, weight, targets, z_loss=1e-4, chunk_size=7, backend="triton")
    assert_close(got, reference(hidden.double(), weight.double(), targets, z_loss=1e-4), torch.float32, "loss")


class LargestTensor(TorchDispatchMode):
    """Records the most bytes of any tensor an aten op returns (allocations, matmul outputs, copies; bytes
    because Triton's interpreter copies kernel arguments back as raw uint8 storages)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes = max([self.bytes] + [t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                         if isinstance(t, torch.Tensor)])
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("chunk_size", [None, 8])
def test_never_allocates_tokens_by_vocab(chunk_size, reduction):
    """Forward and backward stay within one chunk of logits (or the weight, or hidden), never N × V; "none"
    recomputes the chunks in backward, so it is checked too. The default chunk is 256 rows here."""
    N, V, D = 640, 100, 4
    hidden, weight, targets = inputs(N, V, D, torch.float32)
    hidden.requires_grad_(), weight.requires_grad_()
    rows = chunk_size or default_chunk_size(N, D)
    assert rows <= 256
    largest = LargestTensor()
    with largest:
        linear_cross_entropy(hidden, weight, targets, reduction=reduction, chunk_size=chunk_size,
                             backend="triton").sum().backward()
    fp32 = 4
    assert largest.bytes <= fp32 * max(rows * V, V * D, N * D) < fp32 * N * V


def test_memory_guard_sees_the_reference_allocate_tokens_by_vocab():
    """The guard above can fail: it sees the reference's (N, V) logits, and its backward's (N, V) gradient."""
    N, V, D = 64, 500, 4
    hidden, weight, targets = inputs(N, V, D, torch.float32)
    hidden.requires_grad_(), weight.requires_grad_()
    with LargestTensor() as forward:
        loss = linear_cross_entropy(hidden, weight, targets, backend="torch")
    with LargestTensor() as backward:
        loss.backward()
    assert forward.bytes == backward.bytes == 4 * N * V


def test_default_chunk_size():
    assert default_chunk_size(8192, 768) == 2816  # 3 chunks: 2731 rows rounded up to 11 · 256
    assert default_chunk_size(16384, 768) == 2816  # 6 chunks, the last of 2304 rows
    assert default_chunk_size(4096, 512) == 2048
    assert default_chunk_size(37, 16) == 37  # never more rows than tokens
    assert default_chunk_size(640, 4) == 256  # 40 chunks of 16 rows would be; a chunk is 256 rows at least
    assert default_chunk_size(0, 16) == 1


def test_rejects_mismatched_dtypes():
    hidden, weight, targets = inputs(4, 50, 8, torch.float32)
    with pytest.raises(ValueError, match="weight.to"):
        linear_cross_entropy(hidden, weight.bfloat16(), targets, backend="triton")


def test_torch_and_auto_backends_are_the_reference(monkeypatch):
    launched = record_launches(monkeypatch, kiln.kernels.linear_cross_entropy, "linear_cross_entropy_op")
    hidden, weight, targets = inputs(20, 300, 8, torch.float32, device="cpu")
    want = reference(hidden, weight, targets, z_loss=1e-4)
    for backend in ("torch", "auto"):  # auto on CPU tensors: the reference
        h = hidden.clone().requires_grad_()
        got = linear_cross_entropy(h, weight, targets, z_loss=1e-4, backend=backend)
        assert torch.equal(got, want)
    assert not launched
