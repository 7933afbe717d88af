"""CUDA graphs of the engine's decode steps: the padding to batch-size buckets and the static buffers checked on
any device (a capture that runs the forward on the buffers at each replay), the captured graphs themselves on
CUDA (`make gpu-check` runs this file on the GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE
from test_serve_engine import prompts, tiny

from kiln.pipeline.serve.engine import Engine, complete
from kiln.pipeline.serve.graphs import DecodeGraphs, buckets
from kiln.pipeline.serve.request import Request, SamplingParams


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(1) == [1] and buckets(5) == [1, 2, 4, 5] and buckets(8) == [1, 2, 4, 8]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]


# the Triton path in the interpreter takes 6 s of a suite near its 10 minutes; on a GPU both run natively
@pytest.mark.parametrize("backend", ["torch", "triton"] if torch.cuda.is_available() else ["torch"])
def test_decode_steps_padded_to_graph_buckets_give_the_eager_tokens(backend):
    """CUDA graphs' shapes, checked on a CPU with a capture that runs the forward on the static buffers at each
    replay: decode-only steps padded to their bucket (1, 2, 4, 5 here; 6 or 7 decodes run eagerly), the padding
    rows decoding into the scratch block. Every request gets the eager engine's tokens, greedy and seeded
    sampling alike."""
    model = tiny().to(DEVICE)
    texts = prompts(7, seed=11)

    def requests() -> list[Request]:  # ending one by one: every batch size from 7 down
        return [Request(p, SamplingParams(max_tokens=4 + i, temperature=0.8 * (i % 2), top_k=30, seed=i))
                for i, p in enumerate(texts)]
    expected = [r.output for r in Engine(model, 64, 4, max_batch_tokens=16, backend=backend).run(requests())]
    engine = Engine(model, 64, 4, max_batch_tokens=16, backend=backend)
    engine.runner.graphs = graphs = DecodeGraphs(model, engine.cache, 5, capture=lambda forward, pool: forward)
    assert graphs.buckets == [1, 2, 4, 5]
    decodes, execute = [], engine.runner.execute
    engine.runner.execute = lambda plan: (decodes.append(len(plan)) if all(s.count == 1 for s in plan) else None,
                                          execute(plan))[1]
    assert [r.output for r in engine.run(requests())] == expected
    assert 3 in decodes and max(decodes) > 5  # a padded step, and steps too large for a graph
    bucket = {1: 1, 2: 2, 3: 4, 4: 4, 5: 5}
    assert graphs.steps == sum(n <= 5 for n in decodes) and set(graphs.replays) == {bucket[n] for n in decodes
                                                                                     if n <= 5}
    assert engine.cache.k[:, engine.cache.scratch].abs().sum() > 0  # where the padding rows wrote


def test_processed_rows_are_processed_outside_the_graph():
    """Rows with logit_bias and penalties beside plain ones: decode steps still replay their bucket's graph (the
    processing runs on the logits it returns), and every request gets the eager engine's tokens."""
    model = tiny().to(DEVICE)
    texts = prompts(4, seed=5)

    def requests() -> list[Request]:
        return [Request(p, SamplingParams(max_tokens=6, temperature=0.8 * (i % 2), seed=i, frequency_penalty=1.5 * (
            i < 2), logit_bias=((7, -100.0),) if i == 3 else ())) for i, p in enumerate(texts)]
    expected = [r.output for r in Engine(model, 64, 4, max_batch_tokens=16).run(requests())]
    engine = Engine(model, 64, 4, max_batch_tokens=16)
    engine.runner.graphs = graphs = DecodeGraphs(model, engine.cache, 4, capture=lambda forward, pool: forward)
    assert [r.output for r in engine.run(requests())] == expected and graphs.steps > 0
    assert all(7 not in r.output for r in engine.run(requests()[3:]))


def test_every_bucket_captured_up_front_writes_only_the_scratch_block():
    """capture_all (the engine's start on CUDA) makes every bucket's graph before any request, from padding rows
    that write into the scratch block alone; the engine's steps then capture nothing and give the eager tokens."""
    model = tiny().to(DEVICE)
    texts = prompts(6, seed=3)

    def requests() -> list[Request]:
        return [Request(p, SamplingParams(max_tokens=3 + i)) for i, p in enumerate(texts)]
    expected = [r.output for r in Engine(model, 64, 4, max_batch_tokens=16).run(requests())]
    engine = Engine(model, 64, 4, max_batch_tokens=16)
    captured = []

    def capture(forward, pool):  # runs the forward once, as a real capture's warm-up runs do
        captured.append(forward())
        return forward
    engine.runner.graphs = graphs = DecodeGraphs(model, engine.cache, 8, capture=capture)
    graphs.capture_all()
    assert len(captured) == 4 and set(graphs.replays) == {1, 2, 4, 8}
    k = engine.cache.k
    assert k[:, engine.cache.scratch].abs().sum() > 0
    assert k[:, :engine.cache.scratch].abs().sum() == 0 and engine.cache.v[:, :engine.cache.scratch].abs().sum() == 0
    assert [r.output for r in engine.run(requests())] == expected
    assert len(captured) == 4 and graphs.steps > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (make gpu-check runs this)")
def test_cuda_graphs_replay_the_eager_engine():
    """Real graphs on CUDA: decode-only steps replay them, and every request gets the tokens the eager engine
    gives (greedy; sampled with seeds)."""
    model = tiny().to("cuda")
    texts = prompts(12, seed=4)

    def requests() -> list[Request]:
        return [Request(p, SamplingParams(max_tokens=3 + i, temperature=0.7 * (i % 2), seed=i))
                for i, p in enumerate(texts)]
    expected = [r.output for r in Engine(model, 96, 4, max_batch_tokens=32, graph_batch=0).run(requests())]
    engine = Engine(model, 96, 4, max_batch_tokens=32, graph_batch=8)
    assert engine.runner.graphs is not None
    assert [r.output for r in engine.run(requests())] == expected
    assert engine.runner.graphs.steps > 0 and set(engine.runner.graphs.replays) <= {1, 2, 4, 8}


@pytest.mark.parametrize("autocast", [False, True])
def test_graphs_are_captured_in_eval_mode_recording_the_weight_casts(autocast):
    """A training model's graphs (GRPO's kept engine) are captured in eval mode, and under autocast with its cache
    of cast weights off, so that the graph records the casts and casts the weights as they are at each replay;
    the model's mode and the caller's autocast are as they were after."""
    model = tiny().train()
    engine = Engine(model, 64, 4, graph_batch=0)
    seen = []

    def capture(forward, pool):
        seen.append((model.training, torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
        return forward

    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        DecodeGraphs(model, engine.cache, 4, capture=capture).capture_all()
        assert torch.is_autocast_enabled("cpu") == autocast and torch.is_autocast_cache_enabled()
    assert seen == [(False, autocast, False)] * 3 and model.training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (make gpu-check runs this)")
def test_a_graphed_engine_kept_across_weight_updates_under_autocast_samples_as_a_fresh_one():
    """GRPO's kept engine on CUDA: fp32 weights under bf16 autocast, decode graphs captured once; after an
    optimizer step changes the weights in place, the replays use the new weights (the graphs recorded the casts):
    the sampled tokens are those of an engine captured afresh on the updated model (graphs of the same buckets,
    so the same kernels), and the decode steps did replay graphs."""
    model = tiny().to("cuda").train()
    texts = prompts(6, seed=9)

    def requests() -> list[Request]:
        return [Request(p, SamplingParams(max_tokens=8, temperature=0.8, seed=i)) for i, p in enumerate(texts)]

    with torch.autocast("cuda", torch.bfloat16):
        kept = Engine.sized_for(model, requests(), dtype=torch.bfloat16, graph_batch=8)
        complete(model, requests(), engine=kept)
    with torch.no_grad():  # an optimizer step: the same tensors, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    kept.reset_prefix_cache()
    with torch.autocast("cuda", torch.bfloat16):
        again = [r.output for r in complete(model, requests(), engine=kept)]
        fresh = [r.output for r in complete(model, requests(), engine=Engine.sized_for(
            model, requests(), dtype=torch.bfloat16, graph_batch=8))]
    assert kept.runner.graphs is not None and kept.runner.graphs.steps > 0
    assert again == fresh
