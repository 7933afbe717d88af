"""kiln's kernels under torch.compile: every one is a torch.library op, so a model that uses them is one graph.

For llama (RMSNorm, RoPE, SwiGLU, flash attention, fused linear + cross-entropy) and gpt2 (flash attention and
the fused loss) with kernels="triton", the training step traces to one forward graph with no break, AOT
autograd makes one backward graph of it, both hold kiln's ops (so nothing fell back to torch's), and inductor's
`fullgraph=True` compile gives eager's loss and gradients to 1e-5. Then the same for a QLoRA + LoRA model (NF4
dequantisation) and the serving engine's forward over a paged KV cache (paged decode attention).

On this CPU the ops launch their kernels through Triton's interpreter, called by the compiled code as
opaque ops (inductor compiles everything around them to C++); on a GPU the same ops launch natively.
"""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.lora import apply_adapter
from kiln.pipeline.serve.kv_cache import PagedKVCache, Segment

from kernel_checks import DEVICE

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The ops each model's graphs must hold: forward, and backward.
LLAMA_OPS = ({"rms_norm", "rope", "swiglu", "flash_attention", "linear_cross_entropy"},
             {"rms_norm_backward", "rope", "swiglu_backward", "flash_attention_backward"})
GPT2_OPS = ({"flash_attention", "linear_cross_entropy"}, {"flash_attention_backward"})


@pytest.fixture(autouse=True)
def _no_compile_caches():
    """Compile from scratch: inductor's on-disk caches key a graph on the ops it calls, not on the Python of
    their autograd formulas, so an entry from before a formula changed would be replayed as it was."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def model(arch: str, d_model: int = 32) -> GPT:
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=100, n_layer=2, n_head=2, n_kv_head=1 if arch == "llama" else 2,
                         d_model=d_model, max_seq_len=17, arch=arch)
    return GPT(config).to(DEVICE).set_kernels("triton")


def batch(vocab: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, vocab, (2, 2, 17), generator=g).to(DEVICE)
    y[1, -4:] = -100
    return x, y


def kiln_ops(gm: torch.fx.GraphModule) -> set[str]:
    """The kiln ops a graph calls."""
    return {str(node.target).split(".")[1] for node in gm.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("kiln.")}


def graphs_of_a_step(net: torch.nn.Module, *args) -> dict[str, list[set[str]]]:
    """Compile net(*args).backward() with AOT autograd: the kiln ops of each forward and backward graph made."""
    made = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            made[kind].append(kiln_ops(gm))
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    torch.compile(net, backend=backend, fullgraph=True)(*args).backward()
    return made


def assert_same_step(eager: torch.nn.Module, compiled: torch.nn.Module, *args) -> None:
    """Inductor's fullgraph compile of the step gives eager's loss and every gradient to 1e-5."""
    loss = eager(*args)
    loss.backward()
    torch._dynamo.reset()
    compiled_loss = torch.compile(compiled, backend="inductor", fullgraph=True)(*args)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # torch.compile, ~8 s each on 2 cores: `make test-slow`
@pytest.mark.parametrize("arch, ops", [("llama", LLAMA_OPS), ("gpt2", GPT2_OPS)])
def test_training_step_is_one_graph_of_kiln_ops(arch, ops):
    net = model(arch).train()
    x, y = batch()
    explained = torch._dynamo.explain(net)(x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    made = graphs_of_a_step(net, x, y)
    assert len(made["forward"]) == 1 and len(made["backward"]) == 1
    assert made["forward"][0] >= ops[0], made["forward"][0]
    assert made["backward"][0] >= ops[1], made["backward"][0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.slow  # inductor's C++ build, ~20 s each on 2 cores: `make test-slow`
def test_inductor_step_equals_eager(arch):
    eager = model(arch).train()
    assert_same_step(eager, copy.deepcopy(eager), *batch())


@pytest.mark.slow  # torch.compile, ~45 s on 2 cores: `make test-slow`
def test_qlora_step_is_one_graph_and_equals_eager():
    """QLoRA (NF4 base, LoRA on every projection) with kiln's kernels: one graph, NF4 dequantisation in it,
    and the adapters' gradients equal eager's under inductor."""
    # NF4 stores rows in blocks of 64 weights
    eager = apply_adapter(model("llama", d_model=64), "qlora", 4, 8.0, 0.0, LORA_TARGETS).train()
    x, y = batch()
    explained = torch._dynamo.explain(eager)(x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    made = graphs_of_a_step(copy.deepcopy(eager), x, y)
    assert len(made["forward"]) == 1 and len(made["backward"]) == 1
    assert {"nf4_dequantize", "rms_norm", "flash_attention"} <= made["forward"][0]
    assert "nf4_dequantize" in made["backward"][0]  # the weight is dequantised again, never saved
    assert_same_step(eager, copy.deepcopy(eager), x, y)


def paged_step(net: GPT, cache: PagedKVCache, ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    cache.begin(segments)
    return net(ids, cache=cache)


@pytest.mark.slow  # torch.compile, ~20 s on 2 cores: `make test-slow`
def test_paged_forward_is_one_graph_and_equals_eager():
    """The serving engine's step over a paged cache, with a prefill and two decodes in one flat batch (the
    decodes through the paged attention op): one graph, and inductor's logits equal eager's."""
    net = model("llama").eval()
    cache = PagedKVCache(net.config, num_blocks=8, block_size=4, device=DEVICE, backend="triton")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        # two sequences' prompts (6 and 3 tokens) already in the cache
        paged_step(net, cache, torch.randint(0, 100, (1, 9), generator=g).to(DEVICE),
                   [Segment([0, 1], 0, 6), Segment([2], 0, 3)])
        segments = [Segment([0, 1], 6, 1), Segment([2], 3, 1), Segment([3, 4], 0, 5)]
        ids = torch.randint(0, 100, (1, 7), generator=g).to(DEVICE)
        cache.begin(segments)
        explained = torch._dynamo.explain(net)(ids, cache=cache)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        assert {"paged_attention", "rms_norm", "swiglu"} <= kiln_ops(explained.graphs[0])
        want = paged_step(net, cache, ids, segments)
        torch._dynamo.reset()
        compiled = torch.compile(net, backend="inductor", fullgraph=True)
        got = paged_step(compiled, cache, ids, segments)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
