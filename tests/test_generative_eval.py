"""Generative eval tasks (pipeline/evaluate/generative.py): pass@k against counts made here from raw generations,
chat and plain prompts, prompts too long for the context, params validation, and `kiln evaluate` end to end
(metrics, report.md, a reward that raises)."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kiln.model.generate import generate
from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.evaluate.params import EvalParams
from kiln.pipeline.evaluate.generative import GenTaskSpec, load_gen_task, plain_answer, run_gen_task
from kiln.pipeline.tasks.tasks import TaskSpec
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.serve.sampler import exponentials
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.text.bpe import load_tokenizer

from conftest import fails_in_one_line, tree_bytes, user, write_jsonl, write_params

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the king", "O night", "speak to me", "doc 7: well, said", "hear me, O queen"]
SAME = "def same(prompt, completion, answer):\n    return float(completion == answer)\n"


@pytest.fixture(scope="module")
def chat(tiny):
    return ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))


def noisy_model(vocab_size: int, seed: int = 0, max_seq_len: int = 64) -> GPT:
    """A random model with noisy weights, so that its next-token distributions are peaked but not one-hot."""
    torch.manual_seed(seed)
    m = GPT(ModelConfig(vocab_size=vocab_size, n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=max_seq_len))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return m.eval()


def task_for(tmp_path, chat, rows: list[dict], seq_len: int = 64, **spec):
    """A generative task over `rows` (prompt_answer rows), scored by exact string equality."""
    (tmp_path / "same.py").write_text(SAME)
    data = write_jsonl(tmp_path / "qa.jsonl", rows)
    spec = GenTaskSpec("qa", data, f"{tmp_path / 'same.py'}:same", **{"format": "prompt_answer", **spec})
    return load_gen_task(spec, "eval.tasks[0]", chat, Path("unused"), seq_len, seed=0)


def one_token(model, ids: list[int], rank: int, chat: ChatFormat) -> str:
    """The text of the model's rank-th likeliest next token after `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1]
    return chat.parse_reply([int(logits.argsort(descending=True)[rank])])


def test_pass_at_k_against_a_count_of_raw_samples(tmp_path, chat):
    model = noisy_model(chat.tokenizer.get_vocab_size())
    prompts = [chat.prompt([user(p)]) for p in PROMPTS]
    # The greedy token is the answer of the first three prompts; the second-likeliest that of the other two, which
    # greedy decoding misses and sampling sometimes hits.
    answers = [one_token(model, ids, int(i >= 3), chat) for i, ids in enumerate(prompts)]
    task = task_for(tmp_path, chat, [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, answers)],
                    samples=8, temperature=1.0, max_new_tokens=1)
    assert task.chat_ids == prompts
    got = run_gen_task(task, model, chat, True, rows=64, seed=11)

    # Sample j of prompt i is answer 8i + j, drawn from the model's next-token distribution by the exponential
    # race with the sampler's noise for key eval seed + 8i + j at the prompt's end.
    raw = []
    for n, ids in enumerate(ids for ids in prompts for _ in range(8)):
        with torch.no_grad():
            probs = model(torch.tensor([ids]))[0, -1].float().softmax(-1)
        race = exponentials(torch.tensor([11 + n]), torch.tensor([len(ids)]), len(probs))[0]
        raw.append([int((probs / race).argmax())])
    right = [sum(chat.parse_reply(raw[8 * i + j]) == answers[i] for j in range(8)) for i in range(5)]
    assert any(0 < c < 8 for c in right), right  # the estimator has something to average
    want = {"pass@1": 3 / 5, "mean_reward": 3 / 5}
    for k in (1, 2, 4, 8):  # Chen et al.'s closed form, in exact integers
        want[f"sampled/pass@{k}"] = sum(1 - comb(8 - c, k) / comb(8, k) for c in right) / 5
    assert got.metrics == pytest.approx(want, abs=1e-12) and list(got.metrics) == list(want)
    assert got.rewards == [1.0, 1.0, 1.0, 0.0, 0.0] and got.completions[:3] == answers[:3]
    again = run_gen_task(task, model, chat, True, rows=64, seed=11)
    assert again.metrics == got.metrics and again.completions == got.completions
    # Neither greedy answers nor samples depend on how many the engine holds at once.
    small = run_gen_task(task, model, chat, True, rows=3, seed=11)
    assert small.completions == got.completions and small.metrics == got.metrics


def test_samples_zero_is_greedy_only(tmp_path, chat):
    model = noisy_model(chat.tokenizer.get_vocab_size())
    task = task_for(tmp_path, chat, [{"prompt": p, "answer": "x"} for p in PROMPTS], samples=0)
    assert task.spec.ks() == [] and GenTaskSpec("a", "b", "exact", samples=5).ks() == [1, 2, 4]
    assert list(run_gen_task(task, model, chat, True, 64, 0).metrics) == ["pass@1", "mean_reward"]


def test_chat_and_plain_renderings(tmp_path, chat):
    rows = [{"prompt": [{"role": "system", "content": "Be terse."}, user("Who speaks?")], "answer": "ROMEO"},
            {"prompt": "Who speaks next?", "answer": "JULIET"}]
    task = task_for(tmp_path, chat, rows)
    assert task.texts == ["Who speaks?", "Who speaks next?"] and task.answers == ["ROMEO", "JULIET"]
    assert task.chat_ids == [chat.prompt(rows[0]["prompt"]), chat.prompt([user("Who speaks next?")])]
    assert [chat.text(ids) for ids in task.plain_ids] == ["<|endoftext|>Be terse.\n\nWho speaks?\n\nAnswer:",
                                                          "<|endoftext|>Who speaks next?\n\nAnswer:"]
    assert task.plain_ids[1] == [chat.eot, *chat.encode("Who speaks next?\n\nAnswer:")]
    # A base model's answer is the rest of its line: every token holding a newline ends it (the default
    # tokenizer has 17, ".\n" and "\n\n" among them; this tiny one has one).
    newline_tokens = {i for t, i in chat.tokenizer.get_vocab().items() if "Ċ" in t}  # byte-level BPE's "\n"
    assert newline_tokens and set(task.line_ends) == newline_tokens | {chat.eot}
    assert plain_answer(chat, chat.encode(" KING.\nthe queen") + [chat.eot]) == " KING."
    assert plain_answer(chat, chat.encode(" the king") + [chat.eot] + chat.encode("\n")) == " the king"


def test_a_base_model_answers_the_plain_prompt_up_to_the_end_of_its_line(tmp_path, chat):
    model = noisy_model(chat.tokenizer.get_vocab_size(), seed=2)
    task = task_for(tmp_path, chat, [{"prompt": p, "answer": "x"} for p in PROMPTS], max_new_tokens=12, samples=0)
    got = run_gen_task(task, model, chat, False, rows=2, seed=0)
    by_hand = []
    for p in PROMPTS:  # alone, with no stop at all: the text up to the first newline is the same answer
        ids = [chat.eot, *chat.encode(p + "\n\nAnswer:")]
        out = generate(model, [ids], 12, temperature=0.0)[0]
        by_hand.append(chat.text(out).split("<|endoftext|>")[0].split("\n")[0])
    assert got.completions == by_hand
    chat_answers = run_gen_task(task, model, chat, True, rows=2, seed=0).completions
    assert chat_answers != by_hand  # the chat rendering is another prompt


def test_prompts_too_long_are_counted_and_left_out_for_every_model(tmp_path, chat):
    rows = [{"prompt": p, "answer": "x"} for p in PROMPTS] + [{"prompt": "the king " * 40, "answer": "x"}]
    task = task_for(tmp_path, chat, rows, max_new_tokens=8)
    assert task.too_long == 1 and task.texts == PROMPTS
    fits = max(max(len(c), len(p)) for c, p in zip(task.chat_ids, task.plain_ids)) + 8 - 1
    assert fits <= 64
    with pytest.raises(UserError, match=r"^eval\.tasks\[0\] qa: no prompt leaves room for "
                                        r"eval\.tasks\[0\]\.max_new_tokens=8 within max_seq_len=64: nothing to score$"):
        task_for(tmp_path, chat, rows[-1:], max_new_tokens=8)


@pytest.mark.parametrize("entry, message", [
    ({"samples": -1}, "params: eval.tasks[1].samples=-1: expected 0 (greedy only) or more"),
    ({"temperature": 0}, "params: eval.tasks[1].temperature=0.0: expected a number above 0"),
    ({"temperature": 1e308}, "params: eval.tasks[1].temperature=1e+308: expected a number above 0 and at most 2"),
    ({"format": "query"}, "params: eval.tasks[1].format='query': expected auto or one of prompt_answer, gsm8k"),
    ({"limit": None}, "params: eval.tasks[1].limit: the number of speaker questions to derive"),
    ({"max_new_tokens": 0}, "params: eval.tasks[1].max_new_tokens=0: expected a positive integer"),
    ({"samples": "8"}, "params: eval.tasks[1].samples='8': expected an integer"),
    ({"shots": 5}, "params: eval.tasks[1]: unknown key 'shots' (expected name, data, reward, reward_pattern,"),
    ({"name": "cloze"}, "params: eval.tasks[1].name='cloze': expected a distinct name"),
])
def test_bad_generative_task_entries_name_the_key(entry, message):
    tasks = [{"name": "cloze", "data": "builtin", "limit": 5},
             {**{"name": "speaker", "data": "builtin", "reward": "exact", "limit": 5}, **entry}]
    with pytest.raises(UserError) as info:
        build_section(EvalParams, {"tasks": tasks})
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_generative_key_on_a_multiple_choice_task_says_what_is_missing():
    with pytest.raises(UserError, match=r"unknown key 'samples' \(expected name, data, format, split, shots, limit, "
                                        r"delimiter; a generative task needs a reward\)$"):
        build_section(EvalParams, {"tasks": [{"name": "x", "data": "x.jsonl", "samples": 4}]})


def test_default_params_hold_the_builtin_generative_task_and_round_trip():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())["eval"]
    assert build_section(EvalParams, raw) == EvalParams()
    assert EvalParams().task_specs() == [
        TaskSpec("cloze", "builtin", limit=500),
        GenTaskSpec("speaker", "builtin", "exact", limit=300, samples=8, temperature=1.0, max_new_tokens=16)]
    assert EvalParams().task_specs()[1].ks() == [1, 2, 4, 8]


# --- kiln evaluate end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """Random models in a base -> sft -> dpo chain (as the stages record it) for the tiny corpus."""
    root = tmp_path_factory.mktemp("gen_eval") / "models"
    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    init = None
    for seed, name in enumerate(("base", "sft", "dpo")):
        meta = {"tokenizer_sha256": sha256_file(tiny.tokenizer)}
        if init is not None:
            meta |= {"chat_format": "chatml", "init": {"model": str(init), "sha256": "x"}}
        model = noisy_model(vocab, seed)
        init = save_model(model, model.config, root / name, meta)
    return root


def eval_args(tiny, models: Path, out: Path, task: dict) -> list[str]:
    params = write_params(out.parent / f"{out.name}.yaml", {
        "eval": {"models": ["base", "sft", "dpo"], "tokens": 256, "batch_size": 4, "tasks": [task],
                 "posttrain": False, "samples": ["doc 1:"], "max_new_tokens": 2, "gen_batch_size": 8},
        "train": {"device": "cpu"}})
    return ["evaluate", "--params", str(params), "--models", str(models), "--shards", str(tiny.shards),
            "--tokenizer", str(tiny.tokenizer), "--corpus", str(tiny.corpus), "--out", str(out)]


def qa_task(tmp_path: Path, reward: str = "exact") -> dict:
    rows = [{"prompt": p, "answer": "the"} for p in PROMPTS] + [{"prompt": "the king " * 40, "answer": "the"}]
    return {"name": "qa", "data": write_jsonl(tmp_path / "qa.jsonl", rows), "reward": reward, "samples": 4,
            "max_new_tokens": 3}


def test_evaluate_writes_generative_metrics_and_the_same_report_twice(tiny, models, tmp_path):
    task = qa_task(tmp_path)
    runs = []
    for out in (tmp_path / "one", tmp_path / "two"):
        result = CliRunner().invoke(app, eval_args(tiny, models, out, task))
        assert result.exit_code == 0, result.output
        runs.append(tree_bytes(out / "metrics"))  # a hand run's metrics: its --out's metrics/
    assert runs[0] == runs[1]  # eval.json, report.md and the samples, byte for byte
    printed = result.output.splitlines()  # the closing table: whole lines, a mean over items with its interval
    assert any(line.startswith("qa/sampled/pass@4 ") and line.count(" [") == 3 for line in printed), result.output
    assert any(line.startswith("val_loss ") and "[" not in line for line in printed)
    assert "eval: every metric, [low, high] its 95% bootstrap interval over items" in printed
    assert set(runs[0]) == {"eval.json", "report.md", "samples/base.md", "samples/sft.md", "samples/dpo.md"}
    metrics = json.loads(runs[0]["eval.json"])["eval"]
    keys = ["qa/pass@1", "qa/mean_reward", "qa/sampled/pass@1", "qa/sampled/pass@2", "qa/sampled/pass@4"]
    assert [key for key in metrics if key.startswith("qa/")] == keys
    for key in keys:
        assert list(metrics[key]) == ["base", "sft", "dpo"] and all(0 <= v <= 1 for v in metrics[key].values())
    assert metrics["items"] == {"qa": 5, "qa/too_long": 1}
    report = runs[0]["report.md"].decode()
    assert "| metric | better | chance | base | sft (vs base) | dpo (vs sft) |" in report
    sft, dpo = metrics["qa/pass@1"]["sft"], metrics["qa/pass@1"]["dpo"]
    assert f"| qa/pass@1 | higher | - | {metrics['qa/pass@1']['base']:.4f} [" in report  # with its interval
    assert "Paired bootstrap over the items both models answered" in report
    assert f"| qa/pass@1 | dpo | sft | {dpo:.4f} | {sft:.4f} | {dpo - sft:+.4f} | [" in report
    assert "| qa/sampled/pass@4 | dpo | sft | " in report  # every item-mean metric, not greedy pass@1 alone
    assert "### qa 3" in report and "### qa 4" not in report
    assert "[samples/dpo.md](samples/dpo.md)" in report  # a link from metrics/report.md that resolves


def test_a_reward_that_raises_stops_evaluate_in_one_line_and_writes_nothing(tiny, models, tmp_path):
    out = tmp_path / "metrics"
    result = CliRunner().invoke(app, eval_args(tiny, models, out, qa_task(tmp_path)))
    assert result.exit_code == 0, result.output
    before = tree_bytes(out)
    (tmp_path / "boom.py").write_text("def boom(prompt, completion, answer):\n    raise KeyError(answer)\n")
    spec = f"{tmp_path / 'boom.py'}:boom"
    result = CliRunner().invoke(app, eval_args(tiny, models, out, qa_task(tmp_path, spec)))
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: eval.tasks[0] qa greedy answers: eval.tasks[0].reward={spec!r}: row 0 raised "
                      "KeyError: 'the'"], result.output
    assert "Traceback" not in result.output and result.output.rstrip().endswith("KeyError: 'the'")
    assert tree_bytes(out) == before


def test_a_bad_reward_is_refused_before_any_model_runs(tiny, models, tmp_path):
    out = tmp_path / "metrics"
    fails_in_one_line(eval_args(tiny, models, out, qa_task(tmp_path, "exactly")), 2,
                      "params: eval.tasks[0].reward='exactly': expected one of exact, numeric")
    assert not out.exists()
