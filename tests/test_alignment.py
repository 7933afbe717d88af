"""Every GEMM a bf16 training step launches, and every tensor kiln's custom ops receive, is 16-byte aligned: the
CPU's proof of what an H200 profile showed. cuBLAS takes its fast sm90 kernels only when each 16-bit operand's
base address and leading dimension are multiples of 16 bytes; the fused LM head once sliced the vocabulary's
padding off its weight, so its logits rows were 50,260 x 2 bytes wide and its three GEMMs fell to sm80
`align2` kernels (~5.2 ms each a step). A dispatch mode records every matmul's operands (the ones inside kiln's
ops too, which it re-enters) on a CPU under bf16 autocast, llama and gpt2, kiln's kernels (the interpreter) and
torch's, with a vocabulary the model pads (1,003 -> 1,024 rows)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT

from kernel_checks import inside_kiln_op

ALIGN = 16  # bytes
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "matmul", "_scaled_mm"}


def problems(t: torch.Tensor) -> list[str]:
    """Why a 16-bit matrix operand would keep cuBLAS off its aligned kernels (none for other dtypes)."""
    if t.element_size() != 2 or t.dim() < 2:
        return []
    size, found = t.element_size(), []
    if t.storage_offset() * size % ALIGN:
        found.append(f"starts {t.storage_offset() * size} bytes into its storage")
    rows, cols = t.stride()[-2:]
    if cols == 1 or t.shape[-1] == 1:
        lead = rows
    elif rows == 1 or t.shape[-2] == 1:
        lead = cols
    else:
        return found + [f"strides {tuple(t.stride())}: neither rows nor columns contiguous"]
    if t.shape[-2] > 1 and t.shape[-1] > 1 and lead * size % ALIGN:
        found.append(f"leading dimension {lead} x {size} bytes")
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) * size % ALIGN:
        found.append(f"batch stride {t.stride(0)} x {size} bytes")
    return found


class Operands(TorchDispatchMode):
    """Records (op, shape, strides, dtype, problems) for every GEMM operand (out= included) and every tensor a
    kiln op is given; a kiln op is run again under the mode so that its own GEMMs are seen too."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kiln_op = func.namespace == "kiln"
        if kiln_op or func.overloadpacket.__name__ in GEMMS:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2:
                    self.seen.append((str(func), tuple(t.shape), t.stride(), t.dtype, problems(t)))
        if kiln_op:
            return inside_kiln_op(self, func, args, kwargs)
        return func(*args, **kwargs)

    def misaligned(self) -> list[tuple]:
        return [s for s in self.seen if s[4]]


def training_step(arch: str, kernels: str) -> Operands:
    """Forward and backward of one bf16-autocast step; 1,003 tokens of vocabulary, padded to 1,024 rows."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=1003, n_layer=1, n_head=4, n_kv_head=2 if arch == "llama" else 4, d_model=64,
                         max_seq_len=24, arch=arch)
    model = GPT(config).set_kernels(kernels)
    x, y = torch.randint(0, 1003, (2, 2, 24))
    y[0, :5] = -100
    with Operands() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
    return mode


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_every_gemm_and_kernel_operand_is_aligned(arch, kernels):
    mode = training_step(arch, kernels)
    ops = {s[0] for s in mode.seen}
    gemms = [s for s in mode.seen if s[3] == torch.bfloat16 and not s[0].startswith("kiln")]
    assert len(gemms) > 20 and any("mm" in op for op in ops)
    if kernels == "triton":
        # the head's chunked GEMMs were recorded from inside the op, on the padded weight's 1,024 rows
        assert "kiln.linear_cross_entropy.default" in ops and "kiln.flash_attention.default" in ops
        assert any(s[0] == "aten.mm.out" and s[1][-1] == 1024 for s in mode.seen)
    assert mode.misaligned() == []


def test_the_check_sees_a_sliced_vocabulary():
    """The layout the H200 profile caught: a weight sliced to the 1,003 real rows makes (tokens, 1,003) bf16
    logits, whose rows are 2,006 bytes apart; the mode flags the GEMMs that write and read them."""
    from kiln.kernels.linear_cross_entropy import linear_cross_entropy

    hidden = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1024, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1003, (48,))
    with Operands() as mode:
        linear_cross_entropy(hidden, weight[:1003], targets, backend="triton").backward()
    assert any("leading dimension 1003 x 2 bytes" in p for s in mode.misaligned() for p in s[4])
    with Operands() as mode:
        linear_cross_entropy(hidden, weight, targets, backend="triton", vocab_size=1003).backward()
    assert mode.misaligned() == []


def test_problems_names_each_kind_of_misalignment():
    base = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert problems(base) == [] and problems(base.T) == [] and problems(base.float()[:, :3]) == []
    assert problems(base[:, :63]) == []  # a narrower view of aligned rows keeps their stride
    assert problems(base[1:]) == []  # 128 bytes in: a row's start, aligned
    assert problems(base.flatten()[1:4033].view(63, 64)) == ["starts 2 bytes into its storage"]
    assert problems(torch.zeros(4, 63, dtype=torch.bfloat16)) == ["leading dimension 63 x 2 bytes"]
    assert problems(base[::2, ::2]) == ["strides (128, 2): neither rows nor columns contiguous"]


@pytest.mark.parametrize("stats", [True, False])
def test_per_token_scoring_runs_the_head_on_the_padded_weight(stats):
    """Post-training's per-token log-probabilities (DPO's and GRPO's scores, evaluation's choices; model/logprobs.py)
    once took the head's weight sliced to the real vocabulary too: (tokens, 1,003) logits, rows 2,006 bytes apart,
    forward and backward."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=1003, n_layer=1, n_head=4, n_kv_head=2, d_model=64, max_seq_len=24)
    model = GPT(config).set_kernels("torch")
    x, y = torch.randint(0, 1003, (2, 2, 24))
    y[0, :5] = -100
    with Operands() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, y, stats=True).logp if stats else model(x, y, reduction="none")
        out.sum().backward()
    assert any(s[1][-1] == 1024 or s[1][0] == 1024 for s in mode.seen)  # the padded weight's rows
    assert mode.misaligned() == []
