"""The sampler's other fields (serve/logits_processors.py): logit_bias, presence, frequency and repetition
penalties, min_tokens and a grammar's mask, batched with each row its own values, against a float64 rule written
out per row; then through the engine: a banned greedy token never comes out, penalised greedy decoding equals a
loop of the model and the reference rule, min_tokens holds the stop ids back, and rows that ask for nothing pay
nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.logits_processors import allowed, pack, process
from kiln.pipeline.serve.request import Request, SamplingParams

VOCAB = 67  # not a multiple of 32: the mask's last word is partly used


def reference(logits: torch.Tensor, request: Request, mask: list[int] | None) -> torch.Tensor:
    """One row's rule in float64, token by token as the docs state it."""
    x, s = logits.double().clone(), request.sampling
    if mask is not None:
        grammar = torch.full_like(x, float("-inf"))
        grammar[mask] = x[mask]
    else:
        grammar = x
    banned = grammar.clone()
    if len(request.output) < s.min_tokens:
        for t in s.stop_ids:
            banned[t] = float("-inf")
    x = grammar if torch.isneginf(banned).all() else banned
    for t, v in s.logit_bias:
        x[t] += v
    if s.repetition_penalty != 1:
        for t in set(request.prompt) | set(request.output):
            x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
    for t in set(request.output):
        x[t] -= s.frequency_penalty * request.output.count(t) + s.presence_penalty
    return x


class FixedMask:
    """A grammar that allows a fixed set of tokens, its mask laid out as llguidance's (`fixed_masks`)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens


def fixed_masks(grammars: list[FixedMask], words: int) -> np.ndarray:
    out = np.zeros((len(grammars), words), np.uint32)
    for row, g in zip(out, grammars):
        for t in g.tokens:
            row[t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


@pytest.fixture(autouse=True)
def fixed(monkeypatch):
    """The grammars of these tests are FixedMask's (real grammars: test_serve_structured.py)."""
    import kiln.pipeline.serve.logits_processors as processors

    monkeypatch.setattr(processors, "masks", fixed_masks)


def random_request(rng: random.Random, plain: bool = False) -> Request:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    if plain:
        return Request(prompt, SamplingParams(8))
    sampling = SamplingParams(
        64, stop_ids=frozenset(rng.sample(range(VOCAB), rng.randint(1, 3))),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), rng.randint(0, 4))),
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]), frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 3)]), min_tokens=rng.choice([0, 5, 50]))
    request = Request(prompt, sampling, output=[rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))])
    if rng.random() < 0.4:
        request.grammar = FixedMask(rng.sample(range(VOCAB), rng.randint(1, 6)))
    return request


@pytest.mark.parametrize("seed", range(6))
def test_each_row_equals_the_float64_rule(seed):
    """Random rows, some asking for nothing, on random logits (bf16 once: the model's output under autocast)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    requests = [random_request(rng, plain=rng.random() < 0.3) for _ in range(9)]
    if not any(r.processed for r in requests):
        requests[0] = random_request(rng)
    logits = (torch.randn(len(requests), VOCAB) * 4).to(torch.bfloat16 if seed % 2 else torch.float32)
    arrays = pack(requests, VOCAB)
    on_device = {k: torch.from_numpy(v) for k, v in arrays.items()}
    before = logits.clone()
    got = process(logits, on_device)
    assert torch.equal(logits, before) and got.dtype == torch.float32  # the model's logits kept for logprobs
    for i, r in enumerate(requests):
        want = reference(logits[i], r, r.grammar.tokens if r.grammar else None) if r.processed else logits[i].double()
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got[i])), (i, r.sampling)
        torch.testing.assert_close(got[i][finite].double(), want[finite], rtol=1e-6, atol=1e-5)


def test_a_grammar_that_allows_only_a_held_back_stop_id_keeps_it():
    """min_tokens would leave the row without a token: the grammar's own mask stands."""
    request = Request([1, 2], SamplingParams(10, stop_ids=frozenset({5}), min_tokens=4))
    request.grammar = FixedMask([5])
    out = process(torch.randn(1, VOCAB), {k: torch.from_numpy(v) for k, v in pack([request], VOCAB).items()})
    assert torch.isfinite(out[0]).tolist() == [t == 5 for t in range(VOCAB)]


def test_allowed_reads_token_t_from_bit_t_mod_32_of_word_t_div_32():
    """Token t is bit t % 32 of int32 word t // 32, the sign bit included; ids past the vocabulary are cut
    (llguidance's own masks read so: test_serve_structured.py)."""
    tokens = [0, 31, 32, 63, 64, 66]
    got = allowed(torch.from_numpy(fixed_masks([FixedMask(tokens)], 3).astype(np.int64)), VOCAB)[0]
    assert torch.nonzero(got).flatten().tolist() == tokens


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, d_model=32, max_seq_len=128,
                           vocab_size=VOCAB)).eval()


def test_a_banned_greedy_token_never_comes_out():
    """logit_bias -100 on every token a greedy request would say first: none of them comes out in 24 tokens."""
    model = tiny_model()
    prompts = [[i, (3 * i) % VOCAB, 7] for i in range(1, 9)]
    free = Engine(model, num_blocks=64, block_size=8).run([Request(p, SamplingParams(24)) for p in prompts])
    banned = {r.output[0] for r in free} | {r.output[1] for r in free}
    biased = Engine(model, num_blocks=64, block_size=8).run(
        [Request(p, SamplingParams(24, logit_bias=tuple((t, -100.0) for t in banned))) for p in prompts]
        + [Request(p, SamplingParams(24)) for p in prompts])  # beside unbiased rows in the same steps
    assert all(not banned & set(r.output) for r in biased[:8])
    assert [r.output for r in biased[8:]] == [r.output for r in free]


def test_penalised_greedy_decoding_equals_the_reference_loop():
    """Each request's greedy tokens equal a loop that runs the model on its whole sequence and takes the argmax
    of the float64 rule, with prompts and penalties of their own in one engine (two preempted on the way)."""
    model = tiny_model(1)
    rng = random.Random(7)
    requests = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))], SamplingParams(
        20, presence_penalty=rng.uniform(-1, 2), frequency_penalty=rng.uniform(0, 2),
        repetition_penalty=rng.uniform(1, 3), logit_bias=((rng.randrange(VOCAB), 5.0),))) for _ in range(6)]
    engine = Engine(model, num_blocks=12, block_size=8)
    engine.run(requests)
    assert engine.scheduler.preemptions > 0
    for r in requests:
        alone = Request(r.prompt, r.sampling)
        with torch.no_grad():
            for _ in range(20):
                logits = model(torch.tensor([alone.prompt + alone.output]))[0, -1]
                alone.output.append(int(reference(logits, alone, None).argmax()))
        assert r.output == alone.output


def test_min_tokens_holds_the_stop_ids_back():
    model = tiny_model(2)
    free = Engine(model, num_blocks=64, block_size=8).run([Request([1, 2, 3], SamplingParams(30))])[0]
    stop = free.output[2]  # a token greedy decoding says third: a stop id ends it there
    ended = Engine(model, num_blocks=64, block_size=8).run([
        Request([1, 2, 3], SamplingParams(30, stop_ids=frozenset({stop}))),
        Request([1, 2, 3], SamplingParams(30, stop_ids=frozenset({stop}), min_tokens=10))])
    assert len(ended[0].output) <= 3 and ended[0].finish_reason == "stop"
    assert stop not in ended[1].output[:10] and len(ended[1].output) > 10


def test_steps_without_a_processed_row_carry_nothing_for_it():
    """A plain step packs no processing array; a step with a processed row packs that row alone, its decodes still
    on the plain decodes' path (no row applied one by one)."""
    import kiln.pipeline.serve.logits_processors as processors

    model = tiny_model()
    engine = Engine(model, num_blocks=64, block_size=8)
    packed, results = [], []
    pack, execute = processors.pack, engine.runner.execute
    processors.pack = lambda requests, vocab: packed.append(pack(requests, vocab)) or packed[-1]
    engine.runner.execute = lambda plan: results.append(execute(plan)) or results[-1]
    try:
        engine.run([Request([1, 2], SamplingParams(4)), Request([3, 4], SamplingParams(4))])
        assert not packed and len(results) == 4
        engine.run([Request([1, 2], SamplingParams(4)), Request([3, 4], SamplingParams(4, presence_penalty=1.0))])
    finally:
        processors.pack = pack
    assert len(packed) == 4 and all(arrays["processed_rows"].tolist() == [1] for arrays in packed)
    assert [list(r.special) for r in results[4:]] == [[0, 1], [], [], []]  # the prompts' step, then plain decodes
