"""Packed SFT rows (pipeline/post/packing.py): best-fit never splits or repeats an example, and the packed loss and
its gradients equal the padded rows' on the same examples, in float64."""

import random

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.post.common import to_rows
from kiln.pipeline.post.packing import IGNORE, best_fit, packed_rows
from kiln.pipeline.post.sft import masked_loss
from kiln.pipeline.tasks.chat_format import Rendered

PAD = 0


def test_best_fit_places_every_item_once_within_capacity_and_fills_bins():
    rng = random.Random(3)
    lengths = [rng.randint(1, 40) for _ in range(300)] + [40, 40, 1]
    bins = best_fit(lengths, 40)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # never split, never repeated
    assert all(sum(lengths[i] for i in b) <= 40 for b in bins)
    assert len(bins) <= 1.1 * sum(lengths) / 40 + 1  # best-fit decreasing: within ~11/9 of the optimum, here far less
    assert best_fit([3, 5, 2, 4], 7) == [[1, 2], [3, 0]]  # longest first, each into the fullest bin it fits
    assert best_fit([], 8) == []


def examples(n: int, seq_len: int, seed: int) -> list[Rendered]:
    """Chat-like examples: a prompt (mask 0) then an answer (mask 1), of mixed lengths, some longer than a row."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(1, seq_len // 4), rng.randint(1, seq_len // 4)
        if rng.random() < 0.1:
            answer += seq_len  # cut at seq_len + 1 tokens, as the padded rows cut it
        ids = [rng.randint(1, 63) for _ in range(prompt + answer)]
        out.append(Rendered(ids, [0] * prompt + [1] * answer))
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_loss_and_gradients_equal_the_padded_rows_in_float64(arch):
    torch.manual_seed(0)
    seq_len = 24
    model = GPT(ModelConfig(arch=arch, n_layer=2, n_head=2, n_kv_head=2 if arch == "gpt2" else 1, d_model=32,
                            max_seq_len=seq_len, vocab_size=64, qk_norm=arch == "llama")).double()
    rendered = examples(40, seq_len, seed=1)
    padded = to_rows(rendered, seq_len, PAD, "test")
    x, y, segments, cut = packed_rows(rendered, seq_len, PAD)
    assert cut == sum(len(r.ids) > seq_len + 1 for r in rendered) > 0
    assert len(x) < len(padded[0]) / 1.5  # fewer rows: the point of packing
    assert (y != IGNORE).sum() == (padded[1] != IGNORE).sum()  # every target kept, none added
    assert sorted(y[y != IGNORE].tolist()) == sorted(padded[1][padded[1] != IGNORE].tolist())

    def loss_and_grads(rows):
        model.zero_grad()
        targets = float((rows[1] != IGNORE).sum())
        loss = masked_loss(model, (rows[0], rows[1], torch.ones(len(rows[0]), dtype=torch.float64), *rows[2:],
                                   torch.tensor(targets, dtype=torch.float64)))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = loss_and_grads(padded)
    got, got_grads = loss_and_grads((x, y, segments))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_pads_after_the_last_example_get_a_segment_of_their_own():
    rendered = [Rendered([1, 2, 3], [0, 1, 1]), Rendered([4, 5, 6, 7], [0, 0, 1, 1])]
    x, y, segments, cut = packed_rows(rendered, 8, PAD)
    assert cut == 0 and x.tolist() == [[4, 5, 6, 1, 2, PAD, PAD, PAD]]
    assert y.tolist() == [[IGNORE, 6, 7, 2, 3, IGNORE, IGNORE, IGNORE]]
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
