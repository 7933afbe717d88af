"""The continuous-batching engine against `generate`: greedy outputs token for token whatever the arrival
times, prompt lengths, prefill chunk sizes, preemptions and shared prefixes; the blocks' books; per-request
sampling that does not depend on the batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.model.config import ModelConfig
from kiln.model.generate import generate
from kiln.model.gpt import GPT
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.input_batch import slots_of
from kiln.pipeline.serve.request import Request, SamplingParams, fork_groups

VOCAB = 97


def tiny(arch: str = "llama", seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    heads = {"llama": (4, 2), "gpt2": (4, 4)}[arch]
    # llama untied: a random model whose head is its embedding mostly repeats its input, as would any draft
    config = ModelConfig(vocab_size=VOCAB, n_layer=2, n_head=heads[0], n_kv_head=heads[1], d_model=32,
                         max_seq_len=64, arch=arch, tie_embeddings=arch == "gpt2")
    return GPT(config).eval()


def prompts(n: int, seed: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(shared or []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def check_rows(engine: Engine) -> None:
    """The runner's per-slot rows (serve/input_batch.py) are exactly the running requests' block tables,
    sampling settings and standing, each in a slot of its own, every other slot is free, and the stop ids are
    counted for the running requests alone."""
    batch, running = engine.runner.batch, list(engine.scheduler.running)
    slots = [r.slot for r in running]
    assert min(slots, default=0) >= 0 and len(set(slots)) == len(slots)
    assert sorted(slots + batch.free) == list(range(batch.capacity))
    for r in running:
        s = r.sampling
        assert batch.tables[r.slot, :len(r.table)].tolist() == r.table and batch.table_len[r.slot] == len(r.table)
        assert (batch.temperature[r.slot], batch.top_k[r.slot]) == (np.float32(s.temperature), s.top_k or VOCAB)
        assert batch.top_p[r.slot] == np.float32(1.0 if s.top_p is None else s.top_p)
        assert batch.keys[r.slot] == r.noise_key
        standing = (r.length, r.computed, r.tokens[-1], len(r.prompt), len(r.prompt) + s.max_tokens)
        assert (batch.length[r.slot], batch.computed[r.slot], batch.last[r.slot], batch.prompt_len[r.slot],
                batch.limit[r.slot]) == standing
    stops = [t for r in running for t in r.sampling.stop_ids if 0 <= t < VOCAB]
    assert batch.stop_count.tolist() == [stops.count(t) for t in range(VOCAB)]


def checking_rows(engine: Engine) -> Engine:
    """`engine` with its rows checked before every step's plan runs, when they must be right."""
    execute = engine.runner.execute

    def checked(plan):
        check_rows(engine)
        return execute(plan)

    engine.runner.execute = checked
    return engine


def run_arriving(engine: Engine, requests: list[Request], seed: int) -> None:
    """Requests join at random steps while others run; check the block books after every step and the
    runner's per-slot rows before every step."""
    rng = random.Random(seed)
    pending = list(requests)
    checking_rows(engine)
    while pending or engine.has_work():
        while pending and (not engine.has_work() or rng.random() < 0.3):
            engine.add(pending.pop(0))
        engine.step()
        for r in engine.scheduler.running:  # blocks for the tokens it has (cached, or to be fed next), no more
            assert engine.pool.blocks_for(r.computed) <= len(r.table) <= engine.pool.blocks_for(len(r.tokens))
    assert engine.pool.in_use() == 0


@pytest.mark.parametrize(("arch", "blocks", "block_size", "budget", "shared"), [
    ("llama", 64, 4, 256, None),       # plenty of room: continuous batching alone
    ("llama", 64, 4, 7, None),         # 7-token steps: prompts prefill in chunks beside the decodes
    ("llama", 12, 4, 32, None),        # 12 blocks of 4 for 8 requests: preemption and recompute
    ("gpt2", 40, 8, 16, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]),  # a shared system prompt
    ("llama", 48, 5, 9, None),         # blocks of 5: slots found by division, not by shifts
])
def test_greedy_engine_equals_generate_token_for_token(arch, blocks, block_size, budget, shared):
    model = tiny(arch)
    texts = prompts(8, seed=blocks + budget, shared=shared)
    stop = 3
    expected = [generate(model, [p], 12, temperature=0.0, stop_ids=[stop])[0] for p in texts]
    engine = Engine(model, num_blocks=blocks, block_size=block_size, max_batch_tokens=budget)
    requests = [Request(p, SamplingParams(max_tokens=12, stop_ids=(stop,)), id=str(i)) for i, p in enumerate(texts)]
    run_arriving(engine, requests, seed=budget)
    assert [r.output for r in requests] == expected
    assert (engine.scheduler.preemptions > 0) == (blocks == 12)
    assert all(r.finish_reason == ("stop" if r.output[-1] == stop else "length") for r in requests)
    if shared:  # requests that arrived after the system prompt was computed skipped its cached block
        assert engine.scheduler.prefill_tokens < sum(len(p) for p in texts)


def test_prefix_caching_skips_the_shared_prompt():
    model = tiny()
    system = list(range(10, 42))  # 32 tokens: 8 blocks of 4
    texts = [system + [50 + i, 60 + i] for i in range(4)]
    counts = {}
    for caching in (False, True):
        engine = Engine(model, num_blocks=64, block_size=4, prefix_caching=caching)
        first = engine.add(Request(texts[0], SamplingParams(max_tokens=3)))
        engine.step()  # blocks are shared once their keys and values are computed
        outs = [first] + engine.run([Request(p, SamplingParams(max_tokens=3)) for p in texts[1:]])
        counts[caching] = engine.scheduler.prefill_tokens
        assert [r.output for r in outs] == [generate(model, [p], 3, temperature=0.0)[0] for p in texts]
    # the first request computes the prompt; the other three only their last 2 tokens
    assert counts[False] == 4 * 34 and counts[True] == 34 + 3 * 2
    # all four at once, in 8-token steps: the others wait while the first computes the prompt, then share it
    engine = Engine(model, num_blocks=64, block_size=4, max_batch_tokens=8)
    outs = engine.run([Request(p, SamplingParams(max_tokens=3)) for p in texts])
    assert engine.scheduler.prefill_tokens == 34 + 3 * 2
    assert [r.output for r in outs] == [generate(model, [p], 3, temperature=0.0)[0] for p in texts]


def test_plain_decode_steps_stop_each_request_at_its_own_stop_and_cache_the_blocks_they_fill():
    """Steps where every request decodes (the runner's flat results, `StepResult.decoded`, where the scheduler
    looks only at the rows the runner flags): each request stops at its own stop id, never at another's (the
    runner's flags count every running request's), ends at max_tokens, and the blocks its decoding filled are
    shared with a later request whose prompt is its whole text."""
    model = tiny()
    texts = prompts(6, seed=21)
    free = [generate(model, [p], 16, temperature=0.0)[0] for p in texts]
    # each request's stop: the token of its 9th step when it first appears there, so it stops mid-decode (else one
    # it never gives, so it runs to max_tokens); another request's outputs hold some of them
    stopping = [out[8] not in out[:8] for out in free]
    stops = [out[8] if stop else min(set(range(VOCAB)) - set(out)) for out, stop in zip(free, stopping)]
    assert sum(stopping) >= 3 and any(t in stops[:i] + stops[i + 1:] for i, out in enumerate(free)
                                                      for t in out)
    expected = [generate(model, [p], 16, temperature=0.0, stop_ids=[stop])[0] for p, stop in zip(texts, stops)]
    engine = checking_rows(Engine(model, num_blocks=64, block_size=4))
    requests = engine.run([Request(p, SamplingParams(max_tokens=16, stop_ids=(stop,))) for p, stop in zip(texts,
                                                                                                        stops)])
    assert [r.output for r in requests] == expected
    assert [r.finish_reason for r in requests] == ["stop" if stop else "length" for stop in stopping]
    # alone (no other request's stop ids flag its rows), a request's decoding fills blocks that a later request
    # whose prompt is its whole text shares
    first = engine.run([Request(texts[1], SamplingParams(max_tokens=16))])[0]
    whole, before = first.tokens, engine.scheduler.prefill_tokens
    again = engine.run([Request(whole, SamplingParams(max_tokens=3))])[0]
    assert engine.scheduler.prefill_tokens - before == len(whole) - 4 * ((len(whole) - 1) // 4)
    assert (len(whole) - 1) // 4 > -(-len(texts[1]) // 4)  # blocks its decodes filled were among those shared
    assert again.output == generate(model, [whole], 3, temperature=0.0)[0]


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny()
    texts = prompts(5, seed=3)
    sampling = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=1234)
    alone = Engine(model, num_blocks=64, block_size=4).run([Request(texts[0], sampling)])[0].output
    together = Engine(model, num_blocks=64, block_size=4, max_batch_tokens=9).run(
        [Request(p, sampling if i == 0 else SamplingParams(max_tokens=10, temperature=1.0, seed=i)) for i, p in
         enumerate(texts)])
    assert together[0].output == alone and len(alone) == 10


def test_abort_gives_the_blocks_back_and_bad_requests_are_refused():
    model = tiny()
    engine = Engine(model, num_blocks=8, block_size=4)
    request = engine.add(Request(list(range(1, 10)), SamplingParams(max_tokens=5)))
    engine.step()
    assert engine.pool.in_use() > 0
    engine.abort(request)
    assert engine.pool.in_use() == 0 and request.finish_reason == "abort" and not engine.has_work()
    with pytest.raises(ValueError, match="context is 64 tokens"):
        engine.add(Request(list(range(60)), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="8 blocks"):
        engine.add(Request(list(range(30)), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(Request([], SamplingParams(max_tokens=1)))


@pytest.mark.parametrize(("draft_seed", "speculate", "blocks"), [(0, 4, 64), (5, 3, 64), (5, 4, 14)])
def test_speculative_greedy_equals_plain_greedy(draft_seed, speculate, blocks):
    """A draft that is the model itself is always right; another random model is mostly wrong; in a small pool
    the verify steps' extra blocks force preemptions. The output is the model's greedy output every time."""
    model, draft = tiny(), tiny(seed=draft_seed)
    texts = prompts(6, seed=11)
    expected = [generate(model, [p], 16, temperature=0.0, stop_ids=[3])[0] for p in texts]
    engine = Engine(model, num_blocks=blocks, block_size=4, max_batch_tokens=12, draft=draft, speculate=speculate)
    requests = [Request(p, SamplingParams(max_tokens=16, stop_ids=(3,))) for p in texts]
    run_arriving(engine, requests, seed=draft_seed)
    assert [r.output for r in requests] == expected
    rate = engine.scheduler.accepted / engine.scheduler.drafted
    assert rate == 1.0 if draft_seed == 0 else rate < 0.2


def test_speculative_sampling_is_reproducible_and_the_draft_must_match():
    model, draft = tiny(), tiny(seed=5)
    sampling = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    runs = [Engine(model, num_blocks=64, block_size=4, draft=draft).run([Request([5, 6, 7], sampling)])[0].output
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12
    other = GPT(ModelConfig(vocab_size=VOCAB + 1, n_layer=1, n_head=2, n_kv_head=2, d_model=16, max_seq_len=64))
    with pytest.raises(ValueError, match="same vocabulary"):
        Engine(model, num_blocks=8, draft=other)


def test_decode_through_the_triton_kernel_equals_generate():
    """The engine's decode attention in the paged Triton kernel (Triton's interpreter on a CPU)."""
    model = tiny()
    texts = prompts(3, seed=2)
    engine = Engine(model, num_blocks=32, block_size=4, backend="triton")
    outs = engine.run([Request(p, SamplingParams(max_tokens=5)) for p in texts])
    assert [r.output for r in outs] == [generate(model, [p], 5, temperature=0.0)[0] for p in texts]


class Crossings(TorchDispatchMode):
    """Every crossing between Python's or numpy's data and a tensor during a step: a tensor made from host data
    (`torch.tensor`, `from_numpy`, `as_tensor`: aten.lift_fresh), a copy between devices, and a read back
    (`item`, `int`, `bool`: aten._local_scalar_dense; `tolist` and `numpy`, which do not dispatch, counted by
    wrapping them). On a GPU each is a transfer, and a read back a sync."""

    def __init__(self):
        super().__init__()
        self.to_device = self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.to_device += 1
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.to_host += 1
        elif func is torch.ops.aten.copy_.default and args[0].device != args[1].device:
            self.to_device += args[0].device.type != "cpu"
            self.to_host += args[0].device.type == "cpu"
        return func(*args, **kwargs)


@pytest.mark.parametrize("batch", [1, 3, 9])
def test_a_step_crosses_to_the_device_once_and_back_once(batch, monkeypatch):
    """Greedy, sampled and seeded requests together, prefills in chunks beside decodes: at most one copy to the
    device and one read back per step, whatever the batch. The step's arrays are packed as on a GPU (on a CPU
    each is its own tensor): the one copy is the transfer's, and nothing else makes a tensor from host data."""
    from kiln.pipeline.serve.transfer import HostToDevice

    model = tiny()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch_tokens=24)
    transfer = engine.cache.transfer = HostToDevice("cpu", 4096, pack=True)
    kinds = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9),
             SamplingParams(max_tokens=8, temperature=1.2, seed=5)]
    for i, p in enumerate(prompts(batch, seed=batch)):
        engine.add(Request(p, kinds[i % 3]))
    reads = []
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, **k: (reads.append(1), _o(self, *a, **k))[1])
    steps = 0
    while engine.has_work():
        reads.clear()
        uploads = transfer.uploads
        with Crossings() as crossings:
            engine.step()
        steps += 1
        to_device = crossings.to_device + transfer.uploads - uploads
        assert to_device <= 1 and crossings.to_host + len(reads) <= 1, (steps, to_device, crossings.to_host,
                                                                        len(reads))
    assert steps >= 8  # the prefills and every decode were checked


@pytest.mark.parametrize(("lengths", "batched"), [([5, 9, 3], True), ([2, 2, 2, 2], True), ([40, 1, 3], True),
                                                 ([60, 2, 2, 2], False)])
def test_prefills_in_one_padded_batch_give_each_prompt_its_own_logits(lengths, batched):
    """Several prefills in one step (padded into one attention call when that is cheap, one call each when one
    chunk is much longer): every prompt's last logits as a forward over it alone gives them, and decodes beside
    them too."""
    from kiln.pipeline.serve.kv_cache import PagedKVCache, Segment

    model = tiny()
    rng = random.Random(len(lengths))
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    cache = PagedKVCache(model.config, num_blocks=64, block_size=4)
    tables, at = [], 0
    for s in seqs:
        n = -(-len(s) // 4)
        tables.append(list(range(at + n - 1, at - 1, -1)))  # blocks in reverse order: the tables are honoured
        at += n
    segments = [Segment(t, 0, len(s)) for t, s in zip(tables, seqs)]
    ids = torch.tensor([sum(seqs, [])])
    with torch.no_grad():
        cache.begin(segments)
        assert cache.batched == batched
        got = model(ids, cache=cache)[0]
        want = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_token_slice_is_the_slice_of_the_whole_sequence():
    rng = random.Random(0)
    for _ in range(500):
        r = Request([rng.randrange(9) for _ in range(rng.randrange(1, 6))], SamplingParams(3))
        r.output = [rng.randrange(9) for _ in range(rng.randrange(0, 6))]
        start = rng.randrange(r.length)
        stop = rng.randrange(start, r.length + 1)
        assert r.token_slice(start, stop) == r.tokens[start:stop]


def test_requests_behind_one_prompt_share_it_in_the_step_that_computes_it():
    """Three requests of one prompt queued before a short request: the first computes the prompt and the other
    two share its full blocks in that same step (the step writes every chunk's keys and values before any
    chunk reads them), feeding only the last block's tokens, and the short request starts beside them. When
    the budget cuts the first one's chunk, nothing is admitted after it; the next step shares both the
    blocks cached by then and those that step fills."""
    model = tiny()
    prompt = list(range(10, 42))  # 32 tokens: 7 full blocks of 4 before the last token's block
    expected = generate(model, [prompt], 2, temperature=0.0)[0]
    engine = Engine(model, num_blocks=64, block_size=4, max_batch_tokens=64)
    group = [engine.add(Request(prompt, SamplingParams(max_tokens=2))) for _ in range(3)]
    short = engine.add(Request([70, 71], SamplingParams(max_tokens=2)))
    first = engine.scheduler.schedule()
    assert [(s.request, s.count) for s in first] == [(group[0], 32), (group[1], 4), (group[2], 4), (short, 2)]
    assert group[1].table[:7] == group[2].table[:7] == group[0].table[:7]
    assert len({r.table[7] for r in group}) == 3  # the block each writes into is its own
    engine.execute(first)
    while engine.has_work():
        engine.step()
    assert [r.output for r in group] == [expected] * 3
    assert short.output == generate(model, [[70, 71]], 2, temperature=0.0)[0]
    assert engine.scheduler.prefill_tokens == 32 + 2 * 4 + 2

    engine = Engine(model, num_blocks=64, block_size=4, max_batch_tokens=20)
    group = [engine.add(Request(prompt, SamplingParams(max_tokens=2))) for _ in range(3)]
    first = engine.scheduler.schedule()
    assert [(s.request, s.count) for s in first] == [(group[0], 20)]
    engine.execute(first)
    second = engine.scheduler.schedule()  # blocks 0-4 cached, 5 and 6 filled by group[0]'s chunk in this step
    assert [(s.request, s.count) for s in second] == [(group[0], 12), (group[1], 4), (group[2], 4)]
    engine.execute(second)
    while engine.has_work():
        engine.step()
    assert [r.output for r in group] == [expected] * 3
    assert engine.scheduler.prefill_tokens == 32 + 2 * 4


def test_groups_of_samples_prefill_every_prompt_in_the_first_step():
    """GRPO's rollouts queue group after group (G samples of each prompt) behind a shared system prompt: the first
    step starts all of them, each prompt computed once and the system prompt once, and each request draws what
    `generate` does."""
    model = tiny()
    texts = prompts(4, seed=5, shared=list(range(10, 22)))  # 12 shared tokens: three full blocks of 4
    engine = Engine(model, num_blocks=128, block_size=4, max_batch_tokens=256)
    requests = [engine.add(Request(p, SamplingParams(max_tokens=4))) for p in texts for _ in range(4)]
    plan = engine.scheduler.schedule()
    assert [s.request for s in plan] == requests
    for g, text in enumerate(texts):
        own = [s.count for s in plan[4 * g:4 * g + 4]]
        first = len(text) if g == 0 else len(text) - 12  # the system prompt once, then each prompt once
        assert own == [first] + [len(text) - (len(text) - 1) // 4 * 4] * 3
    engine.execute(plan)
    while engine.has_work():
        engine.step()
    assert [r.output for r in requests] == [o for o in generate(model, texts, 4, temperature=0.0) for _ in range(4)]


def sampled(seed: int, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


def alone(model: GPT, prompt: list[int], sampling: SamplingParams) -> list[int]:
    return Engine(model, num_blocks=64, block_size=4).run([Request(prompt, sampling)])[0].output


@pytest.mark.parametrize("length", [30, 32], ids=["partial_last_block", "whole_blocks"])
def test_n_samples_of_one_prompt_cost_one_prefill_and_draw_as_if_alone(length):
    """`n` as one request: the prompt is computed once, the 7 forks share its full blocks (the partly filled last
    one copied, else their decodes would write into each other's) and take their first tokens from its last
    position. Each sample is what the same request draws alone, and greedy forks are generate's output."""
    model = tiny()
    prompt = [(7 * i) % VOCAB for i in range(1, length + 1)]
    engine = Engine(model, num_blocks=64, block_size=4)
    parent = Request(prompt, sampled(100))
    parent.forks = [Request(prompt, sampled(100 + j)) for j in range(1, 8)]
    group = [parent, *parent.forks]
    engine.add(parent)
    engine.step()  # the prompt in one chunk, then the forks
    full, partial = divmod(length, 4)
    for fork in group[1:]:
        assert fork.table[:full] == parent.table[:full] and fork.computed == length and len(fork.output) == 1
        if partial:  # its own block, a copy of the request's for the prompt's last tokens, made before it decodes
            assert fork.table[full] != parent.table[full]
            assert (parent.table[full], fork.table[full], partial) in engine.scheduler.changes.copies
    engine.step()  # each fork's first decode, into its own block
    for fork in group[1:] if partial else ():
        for cache in (engine.cache.k, engine.cache.v):
            assert torch.equal(cache[:, fork.table[full], :partial], cache[:, parent.table[full], :partial])
            assert not torch.equal(cache[:, fork.table[full], partial], cache[:, parent.table[full], partial])
    while engine.has_work():
        engine.step()
    assert engine.scheduler.prefill_tokens == length
    assert [r.output for r in group] == [alone(model, prompt, sampled(100 + j)) for j in range(8)]
    assert len({tuple(r.output) for r in group}) > 1 and engine.pool.in_use() == 0
    # a fork's blocks, the prompt's and those its decodes filled, are cached under its own text
    text = group[3].tokens
    engine.run([Request(text, SamplingParams(max_tokens=1))])
    assert engine.scheduler.prefill_tokens - length == len(text) - 4 * ((len(text) - 1) // 4)
    greedy = [Request(prompt, SamplingParams(max_tokens=6)) for _ in range(4)]
    greedy[0].forks = greedy[1:]
    Engine(model, num_blocks=64, block_size=4).run(greedy[:1])
    assert [r.output for r in greedy] == [generate(model, [prompt], 6, temperature=0.0)[0]] * 4


def test_groups_decoding_over_their_shared_prompt_draw_as_if_alone(monkeypatch):
    """Four groups of 8 samples (and greedy groups) decode over their shared prompt blocks by cascade attention
    (serve/shared_prefix.py: it must run here); each sample is what its request draws alone, on the plain path,
    and greedy samples are generate's output."""
    from kiln.pipeline.serve import shared_prefix

    calls = []
    attend = shared_prefix.attend
    monkeypatch.setattr(shared_prefix, "attend", lambda *a: calls.append(1) or attend(*a))
    monkeypatch.setattr(shared_prefix, "MIN_ROWS", 16)  # 32 samples: the engine's threshold keeps a CPU's plain path
    model = tiny()
    texts = prompts(4, seed=9, shared=list(range(30, 46)))
    heads = []
    for g, prompt in enumerate(texts):
        heads.append(Request(prompt, sampled(10 * g)))
        heads[-1].forks = [Request(prompt, sampled(10 * g + j)) for j in range(1, 8)]
    Engine(model, num_blocks=256, block_size=4).run(heads)
    assert calls
    for head in heads:
        for r in (head, *head.forks):
            assert r.output == alone(model, r.prompt, r.sampling)
    calls.clear()
    greedy = [Request(p, SamplingParams(max_tokens=6)) for p in texts for _ in range(8)]
    Engine(model, num_blocks=256, block_size=4).run(fork_groups(greedy, 8))
    assert calls
    expected = generate(model, texts, 6, temperature=0.0)
    assert [r.output for r in greedy] == [e for e in expected for _ in range(8)]
    calls.clear()  # turned off (vLLM's disable_cascade_attn), every decode gathers its whole context
    plain = [Request(p, SamplingParams(max_tokens=6)) for p in texts for _ in range(8)]
    Engine(model, num_blocks=256, block_size=4, cascade=False).run(fork_groups(plain, 8))
    assert not calls and [r.output for r in plain] == [r.output for r in greedy]


def test_a_fork_the_pool_cannot_hold_computes_its_prompt_itself():
    """Four blocks of 4 for a 10-token prompt: the request holds three, its first fork takes the last for its copy
    of the partly filled block, the second waits with its first token, as a preempted request does, and
    computes what is not cached once the others are done. Every sample is still what it draws alone."""
    model = tiny()
    prompt = list(range(20, 30))
    engine = Engine(model, num_blocks=4, block_size=4)
    parent = Request(prompt, sampled(7, max_tokens=2))
    parent.forks = [Request(prompt, sampled(8, max_tokens=2)), Request(prompt, sampled(9, max_tokens=2))]
    group = [parent, *parent.forks]
    engine.run([parent])
    # the second fork finds the prompt's two full blocks cached and computes the rest and its first token
    assert engine.scheduler.prefill_tokens == 10 + 3
    assert [r.output for r in group] == [alone(model, prompt, sampled(s, max_tokens=2)) for s in (7, 8, 9)]
    assert engine.pool.in_use() == 0


def test_a_fork_takes_the_block_a_decode_finishing_earlier_in_its_step_gave_back():
    """A step's tokens are applied in its plan's order: a decode that finishes (listed before the prompts) gives
    its block back before the prompt that ends in the same step starts its fork, so the fork gets the one block
    its copy needs instead of waiting to compute the prompt again."""
    model = tiny()
    engine = Engine(model, num_blocks=3, block_size=4)
    first = engine.add(Request([5, 6, 7], sampled(3, max_tokens=2)))  # one block, done after its next decode
    engine.step()
    prompt = [20, 21, 22, 23, 24, 25]  # two blocks, the last partly filled: its fork needs a copy of it
    parent = Request(prompt, sampled(4, max_tokens=2))
    parent.forks = [Request(prompt, sampled(5, max_tokens=2))]
    engine.add(parent)
    plan = engine.scheduler.schedule()
    assert [(seq.request, seq.count) for seq in plan] == [(first, 1), (parent, 6)]
    assert engine.pool.available() == 0
    engine.execute(plan)
    assert first.finish_reason == "length" and parent.forks == [] and engine.pool.available() == 0
    fork = next(r for r in engine.scheduler.running if r is not parent)
    assert fork.computed == len(prompt) and len(fork.output) == 1  # started on the prompt, not queued again
    while engine.has_work():
        engine.step()
    assert engine.scheduler.prefill_tokens == 3 + 6
    assert [fork.output, parent.output] == [alone(model, prompt, sampled(s, max_tokens=2)) for s in (5, 4)]


def test_aborting_a_request_hands_its_forks_on_and_a_fork_can_go_alone():
    model = tiny()
    prompt = list(range(30, 45))
    engine = Engine(model, num_blocks=64, block_size=4)
    parent = Request(prompt, sampled(1))
    parent.forks = [Request(prompt, sampled(2)), Request(prompt, sampled(3)), Request(prompt, sampled(4))]
    first, second, third = parent.forks
    engine.add(parent)
    engine.abort(third)  # not started: it leaves the group
    engine.abort(parent)  # before its prompt ran: the first fork takes its place, the second with it
    assert third.finish_reason == parent.finish_reason == "abort" and first.forks == [second]
    while engine.has_work():
        engine.step()
    assert engine.scheduler.prefill_tokens == len(prompt) and third.output == parent.output == []
    assert [first.output, second.output] == [alone(model, prompt, sampled(s)) for s in (2, 3)]
    with pytest.raises(ValueError, match="samples of the request's own prompt"):
        engine.add(Request(prompt, sampled(5), forks=[Request(prompt[1:], sampled(6))]))


def test_an_engine_kept_across_weight_updates_samples_as_a_fresh_one():
    """GRPO keeps one engine for the stage: after an optimizer step changes the weights in place, the engine
    forgets its cached prefixes (their keys and values are the old weights') and then samples exactly what a
    fresh engine built on the updated model samples; a reset with a request running is refused."""
    model = tiny()
    prompt = list(range(10, 40))

    def group() -> list[Request]:
        requests = [Request(prompt, sampled(50 + j)) for j in range(4)]
        requests[0].forks = requests[1:]
        return requests

    engine = Engine(model, num_blocks=64, block_size=4)
    engine.run(group()[:1])
    with torch.no_grad():  # an optimizer step: the same tensors, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.reset_prefix_cache()
    before = engine.scheduler.prefill_tokens
    kept = group()
    engine.run(kept[:1])
    assert engine.scheduler.prefill_tokens - before == len(prompt)  # nothing stale was shared
    fresh = group()
    Engine(model, num_blocks=64, block_size=4).run(fresh[:1])
    assert [r.output for r in kept] == [r.output for r in fresh]
    engine.add(Request(prompt, SamplingParams(max_tokens=4)))
    engine.step()
    with pytest.raises(RuntimeError, match="in use"):
        engine.reset_prefix_cache()


@pytest.mark.parametrize("blocks", [200, 14])
def test_per_slot_rows_follow_forks_preemption_and_aborts(blocks):
    """Sampled groups (a request and its forks, seeded) and lone requests, some aborted mid-run, in a roomy pool
    and in one so small that requests are preempted and recomputed: before every step the runner's rows are the
    running requests' tables and settings, and every request draws what it draws alone (a row's draws depend on
    its seed and position only, so a stale row would show)."""
    model = tiny()
    texts = prompts(6, seed=4)

    def make() -> list[Request]:
        made = [Request(p, SamplingParams(max_tokens=10, temperature=0.9, top_k=20 if i % 2 else None,
                                          top_p=0.8 if i % 3 else None, seed=100 + i)) for i, p in enumerate(texts)]
        for k, head in enumerate(made[:2]):  # two groups of three samples
            head.forks = [Request(head.prompt, SamplingParams(max_tokens=8, temperature=0.7, seed=200 + 3 * k + j))
                          for j in range(2)]
        return made

    alone = [r for head in make() for r in (head, *head.forks)]
    expected = [Engine(model, num_blocks=200, block_size=4).run([Request(r.prompt, r.sampling)])[0].output
                for r in alone]
    heads = make()
    engine = checking_rows(Engine(model, num_blocks=blocks, block_size=4, max_batch_tokens=16))
    for head in heads:
        engine.add(head)
    everyone = [r for head in heads for r in (head, *head.forks)]
    aborted = everyone[5]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort(aborted)
    engine.execute([])  # the last step's releases reach the rows as a next step's would
    assert not engine.scheduler.running and len(engine.runner.batch.free) == engine.runner.batch.capacity
    assert (engine.scheduler.preemptions > 0) == (blocks == 14)
    for r, want in zip(everyone, expected):
        if r is aborted:
            assert r.finish_reason == "abort" and r.output == want[:len(r.output)]
        else:
            assert r.output == want


def side_by_side(model: GPT, make, blocks: int, budget: int, arriving: float) -> tuple[list[bool], int]:
    """The requests `make()` gives, arriving at random steps (a chance of `arriving` each step) with a request
    aborted every 11th step, on an engine that plans every step in full and on one that reuses a steady decode
    step's plan (`Scheduler.decoding`): every step's plan and every request's output and finish reason are the
    same. Returns, for each step the steady one could reuse, whether it did, and its preemptions."""
    def run(engine: Engine) -> tuple[list, list[Request]]:
        heads, plans, rng, steps = make(), [], random.Random(3), 0
        everyone = [r for head in heads for r in (head, *head.forks)]
        index = {id(r): i for i, r in enumerate(everyone)}
        pending = list(heads)
        while pending or engine.has_work():
            while pending and (not engine.has_work() or rng.random() < arriving):
                engine.add(pending.pop(0))
            plan = engine.scheduler.schedule()
            plans.append([(index[id(seq.request)], seq.count, seq.lookahead) for seq in plan])
            engine.execute(plan)
            steps += 1
            if steps % 11 == 0 and engine.scheduler.running:
                engine.abort(next(iter(engine.scheduler.running)))
            assert steps < 500, "the engine stopped making progress"
        return plans, everyone

    full = Engine(model, num_blocks=blocks, block_size=4, max_batch_tokens=budget)
    full.scheduler._decode_again = lambda *_: None  # every step planned in full
    steady = checking_rows(Engine(model, num_blocks=blocks, block_size=4, max_batch_tokens=budget))
    reused = []
    decode_again = steady.scheduler._decode_again

    def counted(*decoding):
        got = decode_again(*decoding)
        reused.append(got is not None)
        return got

    steady.scheduler._decode_again = counted
    want, expected = run(full)
    got, requests = run(steady)
    assert got == want
    assert [(r.output, r.finish_reason) for r in requests] == [(r.output, r.finish_reason) for r in expected]
    return reused, steady.scheduler.preemptions


@pytest.mark.parametrize("blocks", [200, 16])
def test_a_steady_decode_step_is_planned_as_the_full_schedule_plans_it(blocks):
    """After a step of plain decodes of every running request the scheduler reuses that plan (less the finished
    requests, blocks grown for the ones that filled theirs) instead of walking every request again: with lone
    requests and groups arriving at random steps, aborts, and a pool small enough to preempt, every step is
    planned as the full schedule plans it, and the reuse happened often."""
    model = tiny()
    texts = prompts(14, seed=7)

    def make() -> list[Request]:
        made = [Request(p, SamplingParams(max_tokens=6 + i % 9, temperature=0.8, seed=300 + i, stop_ids=(3, 11)))
                for i, p in enumerate(texts)]
        for k, head in enumerate(made[::5]):  # groups of three samples among lone requests
            head.forks = [Request(head.prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=400 + 3 * k + j))
                          for j in range(2)]
        return made

    reused, preemptions = side_by_side(model, make, blocks, budget=64, arriving=0.3)
    assert sum(reused) >= 10 and (preemptions > 0) == (blocks == 16)


def test_a_prompt_a_full_step_left_out_is_not_left_out_of_the_next():
    """A group's forks start decoding while a long prompt is mid-prefill and the budget is no more than the
    decodes: that step leaves the prompt out, so its plan is no steady one to reuse; the prompt goes on as soon
    as a decode finishes."""
    def make() -> list[Request]:
        head = Request([5, 6], SamplingParams(max_tokens=5, temperature=0.8, seed=1))
        head.forks = [Request([5, 6], SamplingParams(max_tokens=3 + j, temperature=0.8, seed=2 + j)) for j in range(2)]
        return [head, Request(list(range(20, 39)), SamplingParams(max_tokens=4, temperature=0.8, seed=9))]

    side_by_side(tiny(), make, blocks=200, budget=3, arriving=1.0)


@pytest.mark.parametrize("block_size", [1, 3, 4, 5, 16])
def test_a_slot_is_its_block_times_the_block_size_plus_its_offset(block_size):
    rng = np.random.default_rng(block_size)
    tables = rng.integers(0, 1000, (6, 5))
    positions = rng.integers(0, 5 * block_size, (6, 7))
    expected = [[tables[i, p // block_size] * block_size + p % block_size for p in row]
                for i, row in enumerate(positions.tolist())]
    assert slots_of(tables[:, None, :], positions, block_size).tolist() == expected
    assert slots_of(tables, positions[:, 0], block_size).tolist() == [row[0] for row in expected]
