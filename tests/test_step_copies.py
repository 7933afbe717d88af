"""The copies and host reads of one training step, counted and pinned: a copy or a sync that appears unseen costs
every step on a GPU (a host read drains the GPU's queue; the H200's compiled GPT-2 step already idles ~4 ms of
~38 waiting on the host). A dispatch mode counts `copy_`, `clone` (what a `.contiguous()` that copies runs) and
`_local_scalar_dense` (`.item()`) in the loop's own `Step`, inside kiln's ops too (re-entered), leaving out the
copies Triton's CPU interpreter makes to launch a kernel and the step counters the CPU's unfused AdamW reads
(CUDA's fused AdamW reads none). Under torch.compile the graph itself holds no host read: tests/test_compile.py
compiles the step's forward and backward with fullgraph=True, which a read would break."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Step, build_optimizer, compile_forward
from kiln.pipeline.train.params import TrainParams

from kernel_checks import inside_kiln_op

COUNTED = {"copy_", "clone", "_local_scalar_dense"}
LEFT_OUT = ("triton/runtime/interpreter", "torch/optim/")  # the interpreter's launch copies, CPU AdamW's reads


def called_from(parts: tuple[str, ...]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in parts):
            return True
        frame = frame.f_back
    return False


class CopiesAndReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kiln":
            return inside_kiln_op(self, func, args, kwargs)
        name = func.overloadpacket.__name__
        if name in COUNTED and not called_from(LEFT_OUT):
            self.counts[name] += 1
        return func(*args, **kwargs)


def step_counts(arch: str, kernels: str, precision: str) -> collections.Counter:
    """The second step of a 2-layer model (the first allocates AdamW's state), eager, on this CPU."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=1003, n_layer=2, n_head=4, n_kv_head=2 if arch == "llama" else 4, d_model=64,
                         max_seq_len=24, arch=arch)
    model = GPT(config).set_kernels(kernels)
    params = dataclasses.replace(TrainParams(), precision=precision, kernels=kernels)
    cpu = torch.device("cpu")
    step = Step(model, compile_forward(model, params), build_optimizer(model, params, cpu),
                torch.amp.GradScaler("cpu", enabled=False), lm_loss, 1, params, cpu)
    batch = itertools.repeat(tuple(torch.randint(1003, (2, 2, 24))))
    step(batch, 1e-3, pytest.fail)
    with CopiesAndReads() as mode:
        step(batch, 1e-3, pytest.fail)
    return mode.counts


# (arch, kernels, precision) -> counts. The one host read is the loop's loss read (its NaN guard). The copies:
# torch's GQA path expands k and v to every query head (repeat_interleave: 3 clones in the forward and 3 in the
# backward a layer, a known cost; kiln's flash attention reads each kv head in place); kiln's fused head rounds
# its fp32 weight-gradient sum to bf16 once (one copy a step).
EXPECTED = {
    ("gpt2", "torch", "fp32"): {"_local_scalar_dense": 1},
    ("gpt2", "torch", "bf16"): {"_local_scalar_dense": 1},
    ("gpt2", "triton", "fp32"): {"_local_scalar_dense": 1},
    ("gpt2", "triton", "bf16"): {"_local_scalar_dense": 1, "copy_": 1},
    ("llama", "torch", "fp32"): {"_local_scalar_dense": 1, "clone": 12},
    ("llama", "torch", "bf16"): {"_local_scalar_dense": 1, "clone": 12},
    ("llama", "triton", "fp32"): {"_local_scalar_dense": 1},
    ("llama", "triton", "bf16"): {"_local_scalar_dense": 1, "copy_": 1},
}


@pytest.mark.slow  # profiled steps, Triton's CPU interpreter, ~35 s in all on 2 cores: `make test-slow`
@pytest.mark.parametrize("arch,kernels,precision", list(EXPECTED))
def test_a_steps_copies_and_host_reads_are_the_pinned_ones(arch, kernels, precision):
    assert dict(step_counts(arch, kernels, precision)) == EXPECTED[arch, kernels, precision]


def test_the_count_sees_a_copy_and_a_read_added_to_the_step(monkeypatch):
    """A `.contiguous()` that copies and an `.item()` slipped into the loss are counted."""
    from kiln.pipeline.train import lm

    def loss(model, batch):
        value = lm.lm_loss(model, batch)
        batch[0].T.contiguous()
        value.detach().item()
        return value

    monkeypatch.setattr(sys.modules[__name__], "lm_loss", loss)
    assert dict(step_counts("gpt2", "torch", "fp32")) == {"_local_scalar_dense": 2, "clone": 1}
