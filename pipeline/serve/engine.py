"""Continuous batching over a paged KV cache: the engine puts a scheduler, a model runner and a block pool
together and runs steps.

A step is three parts, as vLLM's v1 engine has them: the scheduler decides (serve/scheduler.py: which requests
feed which tokens, blocks found or a request preempted; no tensor touched), the runner launches
(serve/runner.py: the plan packed into one copy to the device, the model over the paged cache
(serve/kv_cache.py), every request's token sampled on the device and read back at once), and the scheduler's
update applies the tokens (outputs grown, finished requests let go, full blocks offered for sharing).

SamplingParams is per request: its own temperature, top-k, top-p and seed, so what a request draws does not
depend on which others share its steps; greedy (temperature 0) is the argmax, the same tokens `kiln generate`
gives. A request's forks (more samples of its prompt) are added with it and draw as they would alone.
"""

from __future__ import annotations

import torch

from kiln.model.modes import evaluating
from kiln.pipeline.serve.blocks import BlockPool
from kiln.pipeline.serve.graphs import GRAPH_BATCH
from kiln.pipeline.serve.kv_cache import PagedKVCache
from kiln.pipeline.serve.request import Request
from kiln.pipeline.serve.runner import ModelRunner
from kiln.pipeline.serve.scheduler import Scheduler
from kiln.pipeline.serve.step import ScheduledSequence


class Engine:
    """`model` (a GPT in eval mode) serving requests from a pool of `num_blocks` blocks of `block_size` tokens.
    On CUDA, decode-only steps of up to `graph_batch` sequences replay CUDA graphs (0: never). `cascade`: on the
    torch attention path, decodes that share a prompt read it once (PagedKVCache)."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True, dtype: torch.dtype | None = None, backend: str = "auto",
                 draft=None, speculate: int = 4, graph_batch: int = GRAPH_BATCH, cascade: bool = True):
        if max_batch_tokens < 1 or speculate < 1 or graph_batch < 0:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}, speculate={speculate}, graph_batch={graph_batch}: "
                             "expected positive integers (graph_batch may be 0)")
        self.model = model
        device = next(p.device for p in model.parameters())
        dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, device, dtype, backend, max_batch_tokens,
                                  cascade)
        # Speculative decoding: the draft keeps its own cache with the same block tables as the target's.
        draft_cache = None
        if draft is not None:
            c, d = model.config, draft.config
            if d.vocab_size != c.vocab_size or d.max_seq_len < c.max_seq_len:
                raise ValueError(f"draft: vocabulary {d.vocab_size} and context {d.max_seq_len}; the model has "
                                 f"{c.vocab_size} and {c.max_seq_len} (the draft needs the same vocabulary and at "
                                 "least its context)")
            draft_cache = PagedKVCache(d, num_blocks, block_size, device, dtype, backend, max_batch_tokens, cascade)
        self.scheduler = Scheduler(self.pool, model.config.max_seq_len, max_batch_tokens, prefix_caching,
                                   speculate if draft is not None else 0)
        self.runner = ModelRunner(model, self.cache, draft, draft_cache, graph_batch)

    @classmethod
    def sized_for(cls, model, requests: list[Request], concurrent: int | None = None, block_size: int = 16,
                  max_batch_tokens: int = 2048, dtype: torch.dtype | None = None, graph_batch: int = 0,
                  cascade: bool = True) -> Engine:
        """An engine whose cache holds `concurrent` of `requests` (all, by default) at their longest, so the batch
        stays full and nothing is preempted while the rest wait their turn. `dtype`: the cache's (default the
        parameters'). `graph_batch`: on CUDA, decode steps of up to that many sequences replay graphs captured
        now (GRPO's kept engine, at its rollout width); 0 (the default): every step launched eagerly, as
        evaluate's tasks run, each meeting a batch size once or twice as its requests finish, too few replays to
        repay capturing graphs on a fresh engine."""
        def blocks(r: Request) -> int:
            return -(-(len(r.prompt) + r.sampling.max_tokens) // block_size)

        need = []
        for r in requests:  # a fork shares its prompt's full blocks with the request it forks from
            need += [blocks(r), *(blocks(f) - len(f.prompt) // block_size for f in r.forks)]
        need.sort(reverse=True)
        return cls(model, max(1, sum(need[:concurrent])), block_size, max_batch_tokens, dtype=dtype,
                   graph_batch=graph_batch, cascade=cascade)

    def add(self, request: Request) -> Request:
        """Queue a request (checked: it must fit the model's context and, alone, the pool)."""
        return self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        """Stop a request now (a client that went away): its blocks go back at once."""
        self.scheduler.abort(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> None:
        """After the model's weights changed (an optimizer step): the cached prefixes' keys and values are the old
        weights', so none may be shared again."""
        self.pool.reset()

    def step(self) -> list[tuple[Request, int]]:
        """Run one step; return (request, new token) for each request that got a token (finished ones too)."""
        return self.execute(self.scheduler.schedule())

    def execute(self, plan: list[ScheduledSequence]) -> list[tuple[Request, int]]:
        """Run a plan the scheduler has just made (a step's second half) and apply its tokens."""
        self.runner.apply(self.scheduler.take_changes())  # the plan's per-slot rows, slots freed, forks' blocks
        if not plan:
            return []
        return self.scheduler.update(plan, self.runner.execute(plan))

    def run(self, requests: list[Request]) -> list[Request]:
        """Add `requests` and step until every one has finished (tests, `kiln generate`)."""
        for request in requests:
            self.add(request)
        while self.has_work():
            self.step()
        return requests


def complete(model, requests: list[Request], concurrent: int | None = None,
             engine: Engine | None = None) -> list[Request]:
    """Run `requests` (and their forks) to the end on `engine` (one of `model`'s), or on one made for them
    (`Engine.sized_for`). The model is in eval mode for the call and back as it was after (what GRPO's rollouts,
    evaluate's generative tasks and `kiln generate` run on)."""
    with evaluating(model):
        return (engine or Engine.sized_for(model, requests, concurrent)).run(requests)
