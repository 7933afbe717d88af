"""Log-probabilities from the engine (`SamplingParams.logprobs`, `prompt_logprobs`), against a float64 reference:
the log-softmax at temperature 1 over the whole vocabulary of a plain forward over the whole sequence, whatever
the step shapes (chunked prefill, a cached prefix, forks, preemption) the engine ran them in."""

from __future__ import annotations

import random

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.request import Request, SamplingParams

VOCAB = 97


def model(arch: str) -> GPT:
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=96, arch=arch)
    return GPT(config).eval()


def reference(m: GPT, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), VOCAB) float64 log-probabilities of the next token at every position."""
    with torch.no_grad():
        return m(torch.tensor([tokens]))[0].double().log_softmax(-1)


def check(entries, ref: torch.Tensor, targets: list[int], k: int) -> None:
    assert len(entries) == len(targets)
    for (value, alternatives), row, target in zip(entries, ref, targets):
        assert value == pytest.approx(row[target].item(), abs=2e-5)
        best = row.topk(k)
        assert [v for _, v in alternatives] == pytest.approx(best.values.tolist(), abs=2e-5)
        assert all(row[token].item() == pytest.approx(v, abs=2e-5) for token, v in alternatives)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logprobs_of_outputs_and_prompts_equal_a_plain_forward(arch):
    m = model(arch)
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    # a budget of 16 tokens a step: the prompts prefill in chunks, beside the decodes of the others
    engine = Engine(m, num_blocks=64, block_size=4, max_batch_tokens=16)
    requests = [Request(p, SamplingParams(6, temperature=[0.0, 1.0][i % 2], seed=i, logprobs=[0, 3, 5][i % 3],
                                          prompt_logprobs=[2, None, 0][i % 3])) for i, p in enumerate(prompts)]
    plain = Request(prompts[0], SamplingParams(6))  # asks for nothing: gets nothing
    engine.run([*requests, plain])
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    for r in requests:
        ref = reference(m, r.prompt + r.output)
        n = len(r.prompt)
        check(r.logprobs, ref[n - 1:n - 1 + len(r.output)], r.output, r.sampling.logprobs)
        if r.sampling.prompt_logprobs is None:
            assert r.prompt_logprobs == []
        else:  # computed whole, though the shared prefix was in the cache for the others
            check(r.prompt_logprobs, ref[:n - 1], r.prompt[1:], r.sampling.prompt_logprobs)


def test_forks_and_a_preempted_request_report_the_same_values():
    """n samples of one prompt: each its own tokens' values, and the prompt's, computed once; a pool too small
    for everyone preempts and recomputes, and the values stay the reference's."""
    m = model("llama")
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(13)]
    head = Request(prompt, SamplingParams(8, temperature=1.0, seed=0, logprobs=2, prompt_logprobs=1))
    head.forks = [Request(prompt, SamplingParams(8, temperature=1.0, seed=s, logprobs=2, prompt_logprobs=1))
                  for s in (1, 2)]
    others = [Request([rng.randrange(VOCAB) for _ in range(30)], SamplingParams(20, logprobs=1, prompt_logprobs=1))
              for _ in range(3)]
    engine = Engine(m, num_blocks=24, block_size=4, max_batch_tokens=64)
    engine.run([head, *others])
    assert engine.scheduler.preemptions > 0
    for r in [head, *head.forks, *others]:
        ref = reference(m, r.prompt + r.output)
        n = len(r.prompt)
        check(r.logprobs, ref[n - 1:n - 1 + len(r.output)], r.output, r.sampling.logprobs)
        check(r.prompt_logprobs, ref[:n - 1], r.prompt[1:], 1)
