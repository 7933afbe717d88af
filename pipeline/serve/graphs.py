"""CUDA graphs of the decode step: on a GPU a small model's decode step is hundreds of kernel launches, each
costing the host more than the GPU's work, so a decode-only step replays a captured graph of the whole forward
in one launch (vLLM does the same for its decode batches).

A graph replays fixed shapes from fixed addresses, so each batch-size bucket (1, 2, 4, 8, then steps of 8, up to
`max_batch`) has its graph, all captured when the engine starts (`capture_all`, as vLLM does: the H200 run of
2026-11-26 captured each bucket the first time a step of its size ran, and those captures, inside requests'
steps, made the loaded engine 0.15x static batching against 1.89x for its eager steps), and every bucket reads
one set of static input buffers (token ids, positions, slots, block tables of `max_blocks` columns, context lengths). A
step of B decodes is padded to its bucket by the cache (`PagedKVCache.begin(pad_to=...)`): the padding rows
decode a token into the scratch block, which no sequence's table holds, so they never touch a request's keys and
values. The step's arrays still cross to the device in one copy; copying them into the static buffers is work on
the device. Prefill, mixed and speculative steps, and decode batches beyond the largest bucket, run eagerly.

Only the paged kernel's path can be captured (the torch path sizes its gathers on the host), so graphs are on
for CUDA with the Triton backend. `capture` is how a graph is made; tests on a CPU swap in one that runs the
forward on the static buffers each time, which checks the padding and the buffers without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kiln.model.modes import evaluating
from kiln.pipeline.serve.kv_cache import PagedKVCache

GRAPH_BATCH = 256  # by default, decode batches up to this size replay graphs (vLLM captures up to 512)
# the captured inputs: the token ids and the arrays of the cache's decode-only step
INPUTS = ("ids", "positions", "slots", "decode_tables", "decode_lens")

Replay = Callable[[], torch.Tensor]


def cuda_capture(forward: Callable[[], torch.Tensor], pool) -> Replay:
    """`forward` captured in a CUDA graph after two warm-up runs on a side stream (Triton's autotuning and
    lazy initialisations happen there, not in the capture); the replay returns the graph's output tensor,
    rewritten in place by each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


def buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """The captured decode steps of `model` over `cache`, for batches of up to `max_batch` decodes."""

    def __init__(self, model, cache: PagedKVCache, max_batch: int,
                 capture: Callable[[Callable[[], torch.Tensor], object], Replay] | None = None):
        self.model, self.cache = model, cache
        self.buckets = buckets(max_batch)
        self.capture = capture or cuda_capture
        self.pool = torch.cuda.graph_pool_handle() if capture is None else None  # memory every bucket shares
        n, device = self.buckets[-1], cache.device
        self.inputs = {name: torch.zeros(n, dtype=torch.int64, device=device) for name in INPUTS}
        self.inputs["decode_tables"] = torch.zeros(n, cache.max_blocks, dtype=torch.int64, device=device)
        self.replays: dict[int, Replay] = {}
        self.steps = 0  # replayed, over the engine's life (`kiln bench serve`)

    def bucket(self, batch: int) -> int | None:
        """The graph size a decode-only step of `batch` sequences pads to; None when it runs eagerly."""
        return next((b for b in self.buckets if b >= batch), None)

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every bucket's graph, largest first (later, smaller ones reuse its pool's memory), each over a
        step of padding rows only: they decode into the scratch block, so no request's keys are touched.

        The model is in eval mode for it. Under autocast (GRPO's policy: fp32 weights, bf16 compute) autocast's
        cache of cast weights is off while capturing, so each graph records the casts and a replay casts the
        weights as they are then: GRPO's optimizer steps update them in place between rollouts, and a cast
        cached at the warm-up runs would leave the graphs replaying the weights of the capture (torch's
        make_graphed_callables asks for cache_enabled=False for the same reason)."""
        device = self.cache.device.type
        with evaluating(self.model), torch.autocast(device, torch.get_autocast_dtype(device),
                                                    enabled=torch.is_autocast_enabled(device), cache_enabled=False):
            for bucket in reversed(self.buckets):
                on_device = self.cache.begin([], {"ids": np.zeros(bucket, dtype=np.int64)}, pad_to=bucket)
                self._load(on_device)
                self.replays[bucket] = self.capture(self._forward(bucket), self.pool)

    def run(self, on_device: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits (bucket, vocab) of the step the cache has begun, padded to a bucket; `on_device` holds its
        token ids."""
        bucket = self._load(on_device)
        if bucket not in self.replays:  # only where capture_all was not called (the CPU tests' fake capture)
            self.replays[bucket] = self.capture(self._forward(bucket), self.pool)
        self.steps += 1
        return self.replays[bucket]()

    def _load(self, on_device: dict[str, torch.Tensor]) -> int:
        """Copy the begun step's token ids and cache arrays into the static buffers; returns its bucket."""
        bucket = len(on_device["ids"])
        for name, buffer in self.inputs.items():
            buffer[:bucket].copy_(on_device[name] if name == "ids" else self.cache.decode_arrays()[name])
        return bucket

    def _forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The forward a graph captures: the model over the cache, the cache's step arrays bound to the static
        buffers' first `bucket` rows."""
        views = {name: buffer[:bucket] for name, buffer in self.inputs.items()}

        def forward() -> torch.Tensor:
            self.cache.bind_decodes(views)
            return self.model(views["ids"][None], cache=self.cache)[0]
        return forward
