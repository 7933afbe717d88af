"""Packed SFT rows (pipeline/scoring/rows.py): best-fit never splits or repeats an example, and the packed loss and
its gradients equal the padded rows' on the same examples, in float64."""

import random

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.scoring.rows import IGNORE, best_fit, packed_rows, to_rows
from kiln.pipeline.post.sft_loss import masked_loss
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
    assert cut == 0 and x.tolist() == [[1, 2, 4, 5, 6, PAD, PAD, PAD]]  # in the examples' order
    assert y.tolist() == [[2, 3, IGNORE, 6, 7, IGNORE, IGNORE, IGNORE]]
    assert segments.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]]


def pairs(n: int, seq_len: int, seed: int) -> tuple[list[Rendered], list[Rendered]]:
    """Chosen and rejected renderings of pairs: one prompt, two answers of mixed lengths, some cut at the row."""
    rng = random.Random(seed)
    chosen, rejected = [], []
    for _ in range(n):
        prompt = [rng.randint(1, 63) for _ in range(rng.randint(1, seq_len // 2))]
        for side in (chosen, rejected):
            answer = [rng.randint(1, 63) for _ in range(rng.randint(1, seq_len // 2 + (5 if rng.random() < .2 else 0)))]
            side.append(Rendered(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return chosen, rejected


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shared_prompt_pairs_equal_their_padded_rows_in_float64(arch):
    """A pair as one row (its prompt once, then both answers): the summed answer log-probabilities and the
    gradients of a loss of them equal the two padded rows' (float64), prompts of one token and cut answers
    included; the rows hold fewer tokens than the padded ones' real tokens."""
    from kiln.pipeline.scoring.answers import answer_logps, pair_logps, shared_pairs

    torch.manual_seed(0)
    seq_len = 24
    model = GPT(ModelConfig(arch=arch, n_layer=2, n_head=2, n_kv_head=2 if arch == "gpt2" else 1, d_model=32,
                            max_seq_len=seq_len, vocab_size=64, qk_norm=arch == "llama")).double()
    chosen, rejected = pairs(12, seq_len, seed=2)
    (xc, yc), (xr, yr) = to_rows(chosen, seq_len, PAD, "test"), to_rows(rejected, seq_len, PAD, "test")
    shared = shared_pairs(xc, yc, xr, yr, PAD)
    assert len(shared[0]) == 12 and (shared[0] != PAD).sum() < (xc != PAD).sum() + (xr != PAD).sum()
    weights = torch.randn(2, 12, dtype=torch.float64)

    def loss_and_grads(logps):
        model.zero_grad()
        loss = (torch.stack(logps) * weights).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    got = pair_logps(model, shared, yc, yr)
    want = answer_logps(model, torch.cat([xc, xr]), torch.cat([yc, yr])).split(12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    (loss, grads), (want_loss, want_grads) = loss_and_grads(got), loss_and_grads(want)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_scores_of_uneven_groups_equal_each_row_alone_in_float64():
    """score_rows over groups of 4, 1, 3 and 2 rows sharing a prompt each (evaluate's items of varying choices),
    in batches of whole groups: every row's summed log-probability equals its own padded row's (float64), and
    `greedy` flags exactly the rows whose every target is the argmax, a target made the argmax included."""
    from kiln.pipeline.scoring.answers import score_rows

    torch.manual_seed(3)
    model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, d_model=32, max_seq_len=24,
                            vocab_size=64, qk_norm=True)).double().eval()
    gen = torch.Generator().manual_seed(4)
    x, y = torch.full((10, 20), PAD), torch.full((10, 20), IGNORE)
    row = 0
    for size in (4, 1, 3, 2):
        prompt = torch.randint(1, 64, (int(torch.randint(1, 8, (), generator=gen)),), generator=gen)
        for _ in range(size):
            answer = torch.randint(1, 64, (int(torch.randint(1, 10, (), generator=gen)),), generator=gen)
            ids = torch.cat([prompt, answer])
            x[row, :len(ids) - 1], y[row, len(prompt) - 1:len(ids) - 1] = ids[:-1], answer
            row += 1
    with torch.no_grad():  # row 5's one-token answer is the model's own argmax: a greedy row
        y[5] = torch.where(y[5] != IGNORE, model(x[5:6])[0].argmax(-1), IGNORE)
        token = model(x, y, stats=True)
    want_logp = token.logp.sum(-1)
    want_greedy = (token.hit | (y == IGNORE)).all(-1)
    got_logp, got_greedy = score_rows(model, x, y, batch_size=5, pad=PAD, groups=[4, 1, 3, 2], greedy=True)
    torch.testing.assert_close(got_logp, want_logp, rtol=1e-10, atol=1e-10)
    assert got_greedy.tolist() == want_greedy.tolist() and got_greedy[5]
    plain = score_rows(model, x, y, batch_size=5, pad=PAD, groups=[4, 1, 3, 2])
    torch.testing.assert_close(plain, want_logp, rtol=1e-10, atol=1e-10)


def test_shared_rows_gather_back_into_the_separate_layout():
    """shared_rows on a hand-made group: the prefix stops before the first target (that token predicts differently
    for each answer) and at the first input the rows disagree on; `where` finds each separate column."""
    from kiln.pipeline.scoring.rows import shared_rows

    x = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [5, 4, 4, 4, 4]])
    y = torch.tensor([[-100, -100, 8, 1, -100], [-100, -100, 2, -100, -100], [-100, 4, 4, 4, 3]])
    sx, sy, packed, where = shared_rows(x, y, [[0, 1], [2]], pad=0, multiple=3)
    assert sx.tolist() == [[5, 6, 7, 8, 9, 0], [5, 4, 4, 4, 4, 0]]  # the group's [5, 6] once; a group of one alone
    assert sy.tolist() == [[-100, -100, 8, 1, 2, -100], [-100, 4, 4, 4, 3, -100]]
    assert packed.segments.tolist() == [[0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 0, 1]]  # a pad: a piece of its own
    assert packed.shares.tolist() == [[0, 0, 0, 0, 0, 3], [0, 0, 0, 0, 0, 1]]
    assert packed.positions().tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 4, 0]]
    flat = sy.reshape(-1)[where]
    assert torch.equal(torch.where(y != -100, flat, -100), y)


def test_examples_that_share_no_row_pack_into_the_padded_rows_exactly():
    """Rows and their examples come in the examples' order: when no two examples fit in one row, packing gives the
    padded rows themselves (the same batches follow), the pads one segment past the example."""
    rendered = [Rendered(list(range(1, n + 1)), [0] * 3 + [1] * (n - 3)) for n in (20, 14, 26, 18)]
    x, y, segments, cut = packed_rows(rendered, 24, PAD)
    padded = to_rows(rendered, 24, PAD, "test")
    assert torch.equal(x, padded[0]) and torch.equal(y, padded[1]) and cut == 1
    assert segments.tolist()[1] == [0] * 13 + [1] * 11
