"""The evaluate stage: multiple-choice scoring against a by-hand computation, and `kiln eval` end to end."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.evaluate.scoring import ChoiceTask, choice_hits, encode_request
from kiln.pipeline.tasks.tasks import MCItem
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.text.bpe import EOT, load_tokenizer


def scrambled(vocab_size: int, max_seq_len: int, seed: int = 0) -> GPT:
    """A float64 random model with noisy weights, so log-probabilities differ clearly between choices."""
    torch.manual_seed(seed)
    m = GPT(ModelConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_kv_head=1, d_model=32, max_seq_len=max_seq_len))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m.double().eval()


def by_hand(m: GPT, tok, eot: int, context: str, continuation: str) -> tuple[float, bool]:
    """Summed log-prob and greediness of a continuation: one unpadded forward over exactly this request."""
    request = encode_request(tok, eot, context, continuation, m.config.max_seq_len)
    ids = torch.tensor(request.ids)
    with torch.no_grad():
        logp = torch.log_softmax(m(ids[None, :-1])[0], dim=-1)
    total, greedy = 0.0, True
    for pos in range(len(ids) - 1 - request.n_target, len(ids) - 1):
        total += logp[pos, ids[pos + 1]].item()
        greedy &= int(logp[pos].argmax()) == int(ids[pos + 1])
    return total, greedy


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny.tokenizer, ordinary=True)


def test_encode_request_moves_trailing_space_and_cuts_from_the_left(tok):
    eot = tok.token_to_id(EOT)
    r = encode_request(tok, eot, "the king ", "said", 64)
    assert r.ids[0] == eot and tok.decode(list(r.ids[1:])) == "the king said"
    assert tok.decode(list(r.ids[-r.n_target:])) == " said"  # the space belongs to the continuation
    long = encode_request(tok, eot, "the queen of Denmark " * 20, "speak", 16)
    assert len(long.ids) == 17 and tok.decode(list(long.ids[-long.n_target:])) == " speak"
    # An answer that alone fills the window still fits (after one id of context); one token more is refused, as
    # lm-evaluation-harness asserts len(continuation_enc) <= max_length (HFLM._loglikelihood_tokens).
    answer = " " + " ".join(["king"] * 40)
    n = len(tok.encode("the" + answer).ids) - len(tok.encode("the").ids)
    fits = encode_request(tok, eot, "the", answer, n)
    assert fits.n_target == n and len(fits.ids) == n + 1 and fits.ids[0] == tok.encode("the").ids[-1]
    assert encode_request(tok, eot, "the", answer, n - 1) is None


def test_items_with_an_answer_longer_than_the_window_are_left_out_and_counted(tok):
    eot = tok.token_to_id(EOT)
    m = scrambled(tok.get_vocab_size(), 16)
    short = MCItem(("the king",) * 2, (" said", " spoke"), 0)
    long = MCItem(("the king",) * 2, (" said", " " + "speak to me " * 10), 0)
    task = ChoiceTask(tok, eot, [short, long, short], m.config.max_seq_len)
    assert (task.items, task.too_long, len(task.requests)) == ([short, short], 1, 4)
    alone = ChoiceTask(tok, eot, [short], m.config.max_seq_len)
    assert task.score(m, 8)[0] == alone.score(m, 8)[0]


def test_acc_norm_divides_by_characters_of_the_choice_as_lm_evaluation_harness():
    """lm-evaluation-harness, lm_eval/api/task.py, ConfigurableTask.process_results (multiple_choice):
    `completion_len = np.array([float(len(i)) for i in choices])`, `pred_norm = np.argmax(lls / completion_len)`,
    with `choices` the raw answers (doc_to_choice): the target delimiter is added to the request, not counted.
    The log-likelihoods here are made up so that the character and the UTF-8-byte-with-delimiter conventions pick
    different answers."""
    items = [MCItem(("q",) * 2, (" ab", " abcdef"), 1, ("ab", "abcdef")),   # -3/2 < -8/6, but -3/3 > -8/7
             MCItem(("q",) * 2, (" 東京", " Tokyo"), 1, ("東京", "Tokyo")),  # -3/2 < -5/5, but -3/7 > -5/6 (bytes)
             MCItem(("q",) * 3, (" a", " b", " c"), 0, ("a", "b", "c"))]     # a tie goes to the first
    lls = [-3.0, -8.0, -3.0, -5.0, -1.0, -1.0, -1.0]
    harness, by_bytes, at = [], [], 0
    for item in items:
        ll = np.array(lls[at:at + item.n_choices])
        at += item.n_choices
        harness.append(int(np.argmax(ll / np.array([float(len(c)) for c in item.choices]))))
        by_bytes.append(int(np.argmax(ll / np.array([len(k.encode()) for k in item.continuations]))))
    assert harness == [item.gold for item in items] and by_bytes == [0, 0, 0]
    got = choice_hits(torch.tensor(lls, dtype=torch.float64), items)
    assert {k: v.tolist() for k, v in got.items()} == {"acc": [0.0, 0.0, 1.0], "acc_norm": [1.0, 1.0, 1.0]}


def test_multiple_choice_scores_match_a_hand_computation(tok):
    eot = tok.token_to_id(EOT)
    m = scrambled(tok.get_vocab_size(), 24)
    items = [
        MCItem(("doc 1: the king",) * 4, (" said", " of Denmark well,", " O", " café 東京"), 2,
               ("said", "of Denmark well,", "O", "café 東京")),
        MCItem(("the queen said ", "the king said "), (" speak to me",) * 2, 1,  # partial scoring: contexts differ
               ("the queen said ", "the king said ")),
        MCItem(("night " * 30,) * 2, (" day", " hear me"), 0, ("day", "hear me")),  # context cut on the left
        MCItem(("",) * 3, ("naïve", "1234", "x=y+1;"), 0),  # empty context: only <|endoftext|> before it
    ]
    # Rows of 3: the first item (4 choices) takes a batch alone, the others share theirs.
    task = ChoiceTask(tok, eot, items, m.config.max_seq_len)
    got, per_item = task.score(m, batch_rows=3)
    hits, norm = [], []
    for item in items:
        scores = [by_hand(m, tok, eot, c, k)[0] for c, k in zip(item.contexts, item.continuations)]
        per_char = [s / len(c) for s, c in zip(scores, item.choices or item.continuations)]
        hits.append(float(max(range(item.n_choices), key=lambda i: (scores[i], -i)) == item.gold))
        norm.append(float(max(range(item.n_choices), key=lambda i: (per_char[i], -i)) == item.gold))
    assert len(task.requests) == 11
    assert got == {"acc": sum(hits) / 4, "acc_norm": sum(norm) / 4}
    assert {k: v.tolist() for k, v in per_item.items()} == {"acc": hits, "acc_norm": norm}  # item by item
    assert 0 < sum(hits) + sum(norm) < 8  # the items are not all right or all wrong, so the comparison can fail


def test_lambada_accuracy_and_perplexity_match_a_hand_computation(tok):
    eot = tok.token_to_id(EOT)
    m = scrambled(tok.get_vocab_size(), 32, seed=3)
    items = []
    for context in ("the king of", "doc 7: well, said the", "speak to me", "O night", "the queen", "hear me, O"):
        ids = [eot, *tok.encode(context).ids]
        with torch.no_grad():
            top = int(m(torch.tensor([ids]))[0, -1].argmax())
        word = tok.decode([top])
        items.append(MCItem((context,), (word,), 0))  # the model's own greedy token: a hit if it round-trips
        items.append(MCItem((context,), (" Denmark",), 0))
    got, per_item = ChoiceTask(tok, eot, items, m.config.max_seq_len, lambada=True).score(m, batch_rows=4)
    hand = [by_hand(m, tok, eot, item.contexts[0], item.continuations[0]) for item in items]
    assert per_item["acc"].tolist() == [float(g) for _, g in hand] and list(per_item) == ["acc"]  # ppl: no items
    assert got["acc"] == pytest.approx(sum(g for _, g in hand) / len(items), abs=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(-sum(s for s, _ in hand) / len(items)), rel=1e-9)
    assert 0 < got["acc"] < 1


# --- kiln eval end to end -------------------------------------------------------------------------------

EVAL = {"models": ["base", "sft", "dpo"], "tokens": 2048, "batch_size": 8, "samples": ["ROMEO.", "To be"],
        "max_new_tokens": 8}
POST = {"val_examples": 12}


@pytest.fixture(scope="module")
def workspace(shakespeare, tmp_path_factory):
    """Three random models in a base -> sft -> dpo chain (as the stages record it) for the default corpus."""
    root = tmp_path_factory.mktemp("eval")
    tokenizer = shakespeare.tokenizer
    config = ModelConfig(vocab_size=load_tokenizer(tokenizer).get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2,
                         d_model=32, max_seq_len=128)
    init = None
    for seed, name in enumerate(("base", "sft", "dpo")):
        torch.manual_seed(seed)
        meta = {"tokenizer_sha256": sha256_file(tokenizer)}
        if init is not None:
            meta |= {"chat_format": "chatml", "init": {"model": str(init), "sha256": "x"}}
        init = save_model(GPT(config), config, root / "models" / name, meta)
    return root


def run_eval(shakespeare, root: Path, eval_params: dict, out: str = "out") -> tuple[object, Path]:
    params = root / f"{out}.yaml"
    params.write_text(yaml.safe_dump({"eval": eval_params, "train": {"device": "cpu"}, "sft": POST, "dpo": POST}))
    result = CliRunner().invoke(app, [
        "eval", "--params", str(params), "--models", str(root / "models"), "--shards", str(shakespeare.shards),
        "--tokenizer", str(shakespeare.tokenizer), "--corpus", str(shakespeare.corpus),
        "--out", str(root / out)])
    return result, root / out / "metrics"  # a hand run (--params, --models...): its metrics/ in its --out


def test_eval_reports_every_model_side_by_side_and_is_deterministic(shakespeare, workspace, tmp_path):
    task = tmp_path / "task.jsonl"
    rows = [{"query": "ROMEO. But soft,", "choices": ["what light", "hear me"], "gold": 0},
            {"query": "Good night,", "choices": ["good night", "hear me " * 100], "gold": 0},  # > 128 tokens
            {"query": "To be", "choices": ["or not", "sweet"], "gold": 1}]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = {**EVAL, "tasks": [{"name": "cloze", "data": "builtin", "limit": 16},
                                {"name": "mine", "data": str(task), "format": "query"}]}
    result, out = run_eval(shakespeare, workspace, params)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())["eval"]
    models = ["base", "sft", "dpo"]
    for metric in ("val_loss", "val_bpb", "val_ppl", "cloze/acc", "cloze/acc_norm", "mine/acc", "mine/acc_norm",
                   "posttrain/accuracy", "posttrain/preference_accuracy"):
        assert list(report[metric]) == models, metric
    assert list(report["posttrain/reward_accuracy"]) == ["sft", "dpo"]  # base has no model it started from
    for name in models:
        assert report["val_ppl"][name] == pytest.approx(math.exp(report["val_loss"][name]), rel=1e-4)
        assert 0 <= report["cloze/acc"][name] <= 1
    assert report["items"] == {"cloze": 16, "cloze/too_long": 0, "mine": 2, "mine/too_long": 1, "posttrain": 12,
                               "posttrain_pairs": 12}
    warnings = [line for line in result.output.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: eval.tasks[1] mine: 1 of 3 items left out: an answer is longer than the model's "
                        "128-token context (lm-evaluation-harness refuses them)"]
    base_samples = (out / "samples" / "base.md").read_text()
    assert "plain continuation" in base_samples and "ROMEO." in base_samples
    assert "chat format" in (out / "samples" / "dpo.md").read_text()
    # The report says where guessing lands: ln V for the loss, 1/2 for mine's two choices, a coin for pairs
    page = (out / "report.md").read_text()
    vocab = json.loads((workspace / "models/base/config.json").read_text())["model"]["vocab_size"]
    assert f"| val_loss | lower | {math.log(vocab):.4f} | " in page and f"| val_ppl | lower | {vocab:.4f} | " in page
    bpb = math.log(vocab) * report["val_bpb"]["sft"] / report["val_loss"]["sft"]
    assert f"| val_bpb | lower | {bpb:.4f} | " in page
    assert "| mine/acc | higher | 0.5000 | " in page and "| posttrain/preference_accuracy | higher | 0.5000 | " in page
    assert re.search(r"Made with params digest `[0-9a-f]{12}` .* from the models base `[0-9a-f]{12}`, sft", page)
    # CORE: the mean over the multiple-choice tasks of (acc - chance) / (1 - chance), guessing at 0, with its
    # interval (the bootstrap over items weighs each task equally: mine has 2 items to cloze's 16)
    cloze_chance = float(re.search(r"\| cloze/acc \| higher \| ([0-9.]+) \|", page).group(1))
    for name in models:
        want = ((report["cloze/acc"][name] - cloze_chance) / (1 - cloze_chance)
                + (report["mine/acc"][name] - 0.5) / 0.5) / 2
        assert report["core"][name] == pytest.approx(want, abs=1e-4), name
    assert re.search(r"\| core \| higher \| 0\.0000 \| -?[0-9.]+ \[-?[0-9.]+, -?[0-9.]+\]", page)

    again, out2 = run_eval(shakespeare, workspace, params, out="again")
    assert again.exit_code == 0, again.output
    assert (out2 / "eval.json").read_text() == (out / "eval.json").read_text()
    assert (out2 / "samples" / "sft.md").read_text() == (out / "samples" / "sft.md").read_text()


@pytest.mark.parametrize("change, named", [
    ({"models": ["base", "rlhf"]}, "rlhf"),
    ({"tasks": [{"name": "x", "data": "nowhere.jsonl"}]}, "nowhere.jsonl"),
    ({"tasks": [{"name": "x", "data": "builtin"}]}, "eval.tasks[0].limit"),
    ({"tasks": [{"name": "x", "data": "a.jsonl", "gold": 1}]}, "eval.tasks[0]: unknown key 'gold'"),
    ({"tasks": [{"data": "a.jsonl"}]}, "missing key 'name'"),
    ({"tasks": [{"name": "x", "data": "a.jsonl", "format": "csv"}]}, "eval.tasks[0].format"),
    ({"tokens": 0}, "eval.tokens"),
    ({"quantize": "int3"}, "eval.quantize"),
    ({"quantize": "int4"}, "--quantize int4: TorchAO's int4 weight kernels need a CUDA GPU"),
])
def test_eval_bad_input_exits_2_naming_it(shakespeare, workspace, change, named):
    result, out = run_eval(shakespeare, workspace, {**EVAL, **change}, out="bad")
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
    assert not (out / "eval.json").exists()


def test_eval_with_no_samples_writes_a_samples_file_per_model_saying_so(shakespeare, workspace):
    params = {**EVAL, "models": ["base", "dpo"], "samples": [], "tasks": [], "posttrain": False}
    result, out = run_eval(shakespeare, workspace, params, out="nosamples")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["base.md", "dpo.md"]
    for name in ("base", "dpo"):
        text = (out / "samples" / f"{name}.md").read_text()
        assert text.startswith(f"# Samples: {name} (") and "No prompts: `eval.samples` is empty." in text
        assert "## 1" not in text


def test_eval_refuses_a_model_folder_without_weights(shakespeare, workspace, tmp_path):
    (workspace / "models" / "empty").mkdir(exist_ok=True)
    result, out = run_eval(shakespeare, workspace, {**EVAL, "models": ["base", "empty"]}, out="noweights")
    assert result.exit_code == 2 and "no model.safetensors" in result.output
    assert not (out / "eval.json").exists()


def test_eval_scores_a_quantized_copy_beside_each_model(shakespeare, workspace, monkeypatch):
    """eval.quantize=int8: each model, then its int8 copy as `<model>+int8`, every metric side by side and the
    copy set against its original with paired intervals; the copy's numbers are the quantized model's own."""
    from kiln.pipeline.serve import text_model

    quantized = []
    real = text_model.quantize_model
    monkeypatch.setattr(text_model, "quantize_model", lambda model, kind: quantized.append(kind) or real(model, kind))
    params = {**EVAL, "models": ["sft", "dpo"], "quantize": "int8",
              "tasks": [{"name": "cloze", "data": "builtin", "limit": 16}]}
    result, out = run_eval(shakespeare, workspace, params, out="quantized")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())["eval"]
    assert list(report["val_bpb"]) == ["sft", "sft+int8", "dpo", "dpo+int8"]
    assert quantized.count("int8") == 2  # one copy of each model, loaded and quantized
    # DPO's implicit reward is against the model it was trained from; a quantized copy was trained from nothing
    assert list(report["posttrain/reward_accuracy"]) == ["dpo"]
    plain, _ = run_eval(shakespeare, workspace, {**params, "quantize": None}, out="plain")
    assert plain.exit_code == 0, plain.output
    original = json.loads((out.parent.parent / "plain/metrics/eval.json").read_text())["eval"]
    for name in ("sft", "dpo"):  # the originals score as they do alone
        assert report["val_bpb"][name] == original["val_bpb"][name]
        # int8 weights move a random 1-layer model's near-uniform loss by less than its 5th decimal
        assert abs(report["val_bpb"][f"{name}+int8"] - report["val_bpb"][name]) < 0.01
    page = (out / "report.md").read_text()
    assert "sft+int8 (vs sft)" in page and "dpo+int8 (vs dpo)" in page
    assert (out / "samples" / "dpo+int8.md").is_file()
