"""`kiln generate`: a model folder plus its tokenizer, prompts in, continuations out."""

import pytest
import torch
from typer.testing import CliRunner

from kiln.model.generate import generate
from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.errors import UserError
from kiln.pipeline.serve.text_model import Sampling, TextModel
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.text.bpe import EOT, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory):
    torch.manual_seed(0)
    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    model = GPT(ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=24))
    out = tmp_path_factory.mktemp("sample") / "model"
    save_model(model, model.config, out, {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    return out


def invoke(*args):
    result = CliRunner().invoke(app, ["generate", *args])
    return result.exit_code, result.output


def test_greedy_continuation_is_the_models_argmax_chain(tiny, model_dir):
    lm = TextModel(model_dir, tiny.tokenizer)
    tok = load_tokenizer(tiny.tokenizer, ordinary=True)
    prompt_ids = [tok.token_to_id(EOT), *tok.encode("doc 7: the king").ids]
    # The reference: the argmax chain of full forward passes, no cache, and no early stop.
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, lm.model(ids)[:, -1:].argmax(-1)], dim=1)
    want = ids[0, len(prompt_ids):].tolist()
    want = want[:want.index(tok.token_to_id(EOT))] if tok.token_to_id(EOT) in want else want
    [got] = lm.complete(["doc 7: the king"], Sampling(max_new_tokens=6, temperature=0))
    assert got == tok.decode(want)

    code, out = invoke("--model", str(model_dir), "--tokenizer", str(tiny.tokenizer), "--prompt",
                       "doc 7: the king", "--temperature", "0", "--max-new-tokens", "6")
    assert code == 0 and out == "doc 7: the king" + got + "\n"


def test_seeded_sampling_repeats_and_fills_the_context(tiny, model_dir):
    args = ("--model", str(model_dir), "--tokenizer", str(tiny.tokenizer), "--prompt", "doc", "--prompt", "the",
            "--seed", "3", "--top-k", "20", "--top-p", "0.9")
    first, second = invoke(*args), invoke(*args)
    assert first[0] == 0 and first == second
    lm = TextModel(model_dir, tiny.tokenizer)
    room = 24 + 1 - (1 + len(lm.tokenizer.encode("doc").ids))  # the context less <|endoftext|> and the prompt
    lm.complete(["doc"], Sampling(max_new_tokens=room))
    with pytest.raises(UserError, match="max_seq_len=24"):
        lm.complete(["doc"], Sampling(max_new_tokens=room + 1))
    lm.complete(["doc"], Sampling())  # by default the reply may use all of that room, and no more


def test_prompts_run_as_engine_requests_of_their_own(tiny, model_dir):
    """`kiln generate` runs on the serving engine: greedy output is batched `generate`'s for prompts of mixed
    lengths, and a seeded prompt's sample depends on its own seed (seed + its index), not on its companions."""
    lm = TextModel(model_dir, tiny.tokenizer)
    prompts = ["doc", "doc 7: the king and the", "the"]
    eot = lm.tokenizer.token_to_id(EOT)
    ids = [[eot, *lm.tokenizer.encode(p).ids] for p in prompts]
    want = generate(lm.model, ids, 8, temperature=0, stop_ids=[eot])
    assert lm.complete(prompts, Sampling(max_new_tokens=8, temperature=0)) == \
        [lm.tokenizer.decode([t for t in w if t != eot]) for w in want]
    sampled = Sampling(max_new_tokens=10, temperature=1.5, seed=5)
    together = lm.complete(["doc", "the"], sampled)
    assert together[0] == lm.complete(["doc"], sampled)[0]
    assert together[1] == lm.complete(["the"], Sampling(max_new_tokens=10, temperature=1.5, seed=6))[0]


@pytest.mark.parametrize("args, message", [
    (("--max-new-tokens", "500"), "max_seq_len=24"),
    (("--temperature", "-1"), "--temperature=-1"),
    (("--top-p", "1.5"), "--top-p=1.5"),
    (("--top-k", "0"), "--top-k=0"),
])
def test_bad_arguments_exit_2(tiny, model_dir, args, message):
    code, out = invoke("--model", str(model_dir), "--tokenizer", str(tiny.tokenizer), "--prompt", "doc", *args)
    assert code == 2 and message in out


def test_wrong_tokenizer_or_missing_model_exit_2(tiny, shakespeare, model_dir, tmp_path):
    code, out = invoke("--model", str(model_dir), "--tokenizer", str(shakespeare.tokenizer), "--prompt", "x")
    assert code == 2 and "not the tokenizer" in out
    code, out = invoke("--model", str(tmp_path / "nope"), "--tokenizer", str(tiny.tokenizer), "--prompt", "x")
    assert code == 2 and "nope" in out
    with pytest.raises(UserError, match="not found"):
        TextModel(model_dir, tmp_path / "missing.json")
