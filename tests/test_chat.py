"""The chat format's ids and mask, the DPO loss against hand-computed values, and the example batches."""

import math
import re

import pytest
import torch

from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.post.common import ExampleBatches, held_out
from kiln.pipeline.scoring.rows import IGNORE
from kiln.pipeline.post.dpo_loss import dpo_loss
from kiln.pipeline.text.bpe import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer in verse."},
    {"role": "user", "content": "Who is the king of Denmark?"},
    {"role": "assistant", "content": "Claudius, the usurper,\nwho poisoned his brother."},
    {"role": "user", "content": "And the queen? <|im_end|> café 🙂"},
    {"role": "assistant", "content": "Gertrude."},
]


@pytest.fixture(scope="module")
def chat(tiny):
    return ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))


def test_rendered_text_is_chatml(chat):
    r = chat.render(CONVERSATION)
    expected = "<|endoftext|>" + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert chat.text(r.ids) == expected
    assert len(r.ids) == len(r.mask)


def spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    out, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def test_mask_is_exactly_the_assistant_turns(chat):
    r = chat.render(CONVERSATION)
    text = chat.text(r.ids)
    # Independently of the mask: what follows each assistant header, up to and including its end marker.
    want = re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, flags=re.S)
    assert [chat.text(s) for s in spans(r.ids, r.mask)] == want
    assert want == [m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant"]


def test_user_text_cannot_forge_a_turn_marker(chat):
    r = chat.render(CONVERSATION)
    assert r.ids.count(chat.im_end) == len(CONVERSATION)  # one per turn: the one in the user's text is plain text
    assert r.ids.count(chat.im_start) == len(CONVERSATION)


def test_first_trained_masks_only_later_answers_and_prompt_is_a_prefix(chat):
    r = chat.render(CONVERSATION, first_trained=4)
    assert [chat.text(s) for s in spans(r.ids, r.mask)] == ["Gertrude.<|im_end|>"]
    prompt = chat.prompt(CONVERSATION[:4])
    assert r.ids[:len(prompt)] == prompt
    assert chat.text(prompt).endswith("<|im_start|>assistant\n")
    assert not any(r.mask[:len(prompt)])


def test_parse_reply_stops_at_end_of_turn(chat):
    ids = chat.reply("Gertrude.") + chat.encode("garbage after the end")
    assert chat.parse_reply(ids) == "Gertrude."
    assert chat.parse_reply(chat.encode("no end yet")) == "no end yet"
    with pytest.raises(ValueError, match="role"):
        chat.render([{"role": "narrator", "content": "x"}])


def test_dpo_loss_matches_hand_computed_values():
    pc, pr = torch.tensor([-1.0, -3.0], dtype=torch.float64), torch.tensor([-2.0, -1.0], dtype=torch.float64)
    rc, rr = torch.tensor([-1.5, -2.0], dtype=torch.float64), torch.tensor([-1.5, -2.0], dtype=torch.float64)
    tokens = torch.tensor([1, 4]), torch.tensor([2, 1])  # answer lengths: IPO averages the log-ratios over them
    beta = 0.1
    # h = (pc - rc) - (pr - rr): pair 0: 0.5 - (-0.5) = 1; pair 1: -1 - 1 = -2
    h = [1.0, -2.0]
    h_ipo = [0.5 / 1 - (-0.5) / 2, -1 / 4 - 1 / 1]
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    want_sigmoid = [-math.log(sig(beta * v)) for v in h]
    want_smooth = [-(0.8 * math.log(sig(beta * v)) + 0.2 * math.log(sig(-beta * v))) for v in h]
    want_ipo = [(v - 1 / (2 * beta)) ** 2 for v in h_ipo]  # (0.75 - 5)^2, (-1.25 - 5)^2
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, tokens, beta)
    assert losses.tolist() == pytest.approx(want_sigmoid, abs=1e-12)
    assert chosen.tolist() == pytest.approx([0.05, -0.1]) and rejected.tolist() == pytest.approx([-0.05, 0.1])
    assert dpo_loss(pc, pr, rc, rr, tokens, beta, label_smoothing=0.2)[0].tolist() == pytest.approx(want_smooth,
                                                                                                   abs=1e-12)
    losses, chosen_ipo, rejected_ipo = dpo_loss(pc, pr, rc, rr, tokens, beta, loss="ipo")
    assert losses.tolist() == pytest.approx(want_ipo, abs=1e-12)
    assert chosen_ipo.tolist() == chosen.tolist() and rejected_ipo.tolist() == rejected.tolist()  # summed, as TRL


@pytest.mark.parametrize("kind,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_gradient_raises_chosen_and_lowers_rejected(kind, smoothing):
    gen = torch.Generator().manual_seed(0)
    pc = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    pr = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    rc, rr = torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)
    losses, _, _ = dpo_loss(pc, pr, rc, rr, (torch.ones(8), torch.ones(8)), beta=0.5, label_smoothing=smoothing,
                            loss=kind)
    losses.sum().backward()
    if kind == "ipo":  # a squared loss pushes towards the target margin 1/(2 beta) = 1, from either side
        below = ((pc - rc) - (pr - rr)).detach() < 1.0
        assert (pc.grad[below] < 0).all() and (pr.grad[below] > 0).all()
        assert (pc.grad[~below] > 0).all()
    else:  # descent (-grad) raises log pi(chosen) and lowers log pi(rejected)
        assert (pc.grad < 0).all() and (pr.grad > 0).all()


def test_example_batches_reshuffle_per_epoch_and_resume():
    x = torch.arange(10)[:, None].repeat(1, 3)
    y = torch.where(torch.arange(10)[:, None] % 2 == 0, torch.full((10, 3), 5), torch.full((10, 3), IGNORE))
    y[:, 0] = 7  # every row has at least one target; even rows have 3, odd rows 1
    w = torch.where(torch.arange(10) < 4, 0.25, 1.0)  # rows 0-3 weigh a quarter (as corpus text in SFT may)
    a = ExampleBatches((x, y, w), batch_size=2, accum=2, seed=3, per_token=True)
    seen = [next(a) for _ in range(10)]  # 20 rows: two epochs
    first = torch.cat([b[0][:, 0] for b in seen[:5]])
    second = torch.cat([b[0][:, 0] for b in seen[5:]])
    assert sorted(first.tolist()) == list(range(10)) and sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist()
    for step in range(5):  # both micro-batches of a step carry (weighted targets in the step) / accum
        m1, m2 = seen[2 * step], seen[2 * step + 1]
        targets = sum(float(((m[1] != IGNORE).sum(1) * m[2]).sum()) for m in (m1, m2))
        assert m1[3].item() == m2[3].item() == targets / 2
    b = ExampleBatches((x, y, w), batch_size=2, accum=2, seed=3, per_token=True)
    b.load_state_dict(ExampleBatches((x, y), 2, 2, 3).state_dict() | {"step": 6})
    assert all(torch.equal(u, v) for u, v in zip(next(b), seen[6]))
    with pytest.raises(Exception, match="seed"):
        b.load_state_dict(a.state_dict() | {"seed": 4})


def test_held_out_split_ignores_row_order():
    keys = [f"row {i}" for i in range(40)]
    train, val = held_out(keys, 5)
    assert len(val) == 5 and sorted(train + val) == list(range(40))
    reordered = keys[::-1]
    _, val2 = held_out(reordered, 5)
    assert {keys[i] for i in val} == {reordered[i] for i in val2}
    assert len(held_out(keys[:8], 5)[1]) == 2  # never more than a quarter


def lines(*given: str):
    """A `read` over `given`, then end of input."""
    it = iter(given)

    def read() -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


def test_kiln_chat_takes_a_message_of_several_lines():
    """The built-in task's questions are several lines: between two lines of three double quotes they are one
    turn, and so are lines pasted together (input already waiting); otherwise a line is a turn."""
    from kiln.pipeline.commands.serving import read_message

    read = lines('"""', "Which play is this from?", "", "ROMEO: But soft!", '"""', "and this?")
    assert read_message(read) == "Which play is this from?\n\nROMEO: But soft!"
    assert read_message(read) == "and this?" and read_message(read) is None
    assert read_message(lines('"""one line"""')) == "one line"
    waiting = iter([True, True, False])
    assert read_message(lines("first", "second", "third", "fourth"), lambda: next(waiting)) == "first\nsecond\nthird"
    assert read_message(lines('"""', "never closed")) == "never closed"  # end of input ends it


def test_kiln_chat_refuses_a_bad_turn_and_goes_on(tiny, tmp_path):
    """One line that was not UTF-8 (called a lone surrogate) or longer than the context ended the session; now
    that turn is refused in one line and the next one is answered."""
    import subprocess
    import sys

    import torch

    from kiln.model.checkpoint import save_model
    from kiln.model.config import ModelConfig
    from kiln.model.gpt import GPT
    from kiln.pipeline.outputs import sha256_file
    from kiln.pipeline.text.bpe import load_tokenizer

    config = ModelConfig(vocab_size=load_tokenizer(tiny.tokenizer).get_vocab_size(), n_layer=1, n_head=2,
                         n_kv_head=1, d_model=16, max_seq_len=64)
    torch.manual_seed(0)
    save_model(GPT(config), config, tmp_path / "chat", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    turns = b"caf\xe9 au lait\n" + b"word " * 200 + b"\nhello\n"
    result = subprocess.run([sys.executable, "-m", "kiln.pipeline.cli", "chat", "--model", str(tmp_path / "chat"),
                             "--tokenizer", str(tiny.tokenizer), "--max-new-tokens", "3", "--device", "cpu"],
                            input=turns, capture_output=True, timeout=120)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "error: message: not valid UTF-8 (byte 0xe9 at character 3); not sent, type another" in err
    assert "error: message: " in err and "tokens with the chat markers; the model's context is 64" in err
    assert result.stdout.decode().count("kiln> ") == 1  # the one good turn was answered
