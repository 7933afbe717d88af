"""SFT and DPO end to end on tiny models, the built-in task, and the commands' errors."""

import contextlib
import json
import random
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from kiln.model.generate import generate
from kiln.model.checkpoint import load_model, save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.code_digest import stage_code_sha256
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.tasks.chat_data import Pair
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.scoring.rows import IGNORE
from kiln.pipeline.tasks.corpus_task import task_items
from kiln.pipeline.post.dpo import dpo, pair_metrics
from kiln.pipeline.post.params import DPOParams, SFTParams
from kiln.pipeline.scoring.answers import PairRows, logps, pair_rows
from kiln.pipeline.post.sft import sft, text_rows
from kiln.pipeline.text.bpe import load_tokenizer
from kiln.pipeline.train.params import TrainParams

ANSWERS = ["Claudius", "Gertrude", "Ophelia", "Polonius", "Laertes", "Horatio", "Yorick", "Osric"]
TRAIN = {"device": "cpu", "keep_checkpoints": 1}
LOOP = {"max_steps": 300, "batch_size": 4, "batch_examples": 4, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 5,
        "eval_every": 150, "checkpoint_every": 150, "log_every": 50, "val_examples": 2}


def questions() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Name number {i}?"},
                          {"role": "assistant", "content": name}]} for i, name in enumerate(ANSWERS)]


def save_base(tokenizer: Path, out: Path) -> Path:
    """A randomly initialised tiny model saved as a base model for `tokenizer`."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=load_tokenizer(tokenizer).get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2,
                         d_model=64, max_seq_len=64)
    return save_model(GPT(config), config, out, {"tokenizer_sha256": sha256_file(tokenizer)})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def greedy_answers(model_dir: Path, tokenizer: Path, conversations: list[list[dict]]) -> list[str]:
    chat = ChatFormat(load_tokenizer(tokenizer, ordinary=True))
    model, _ = load_model(model_dir)
    prompts = [chat.prompt(c[:-1]) for c in conversations]
    outs = generate(model, prompts, 8, temperature=0, stop_ids=[chat.im_end])
    return [chat.parse_reply(o) for o in outs]


@pytest.fixture(scope="module")
def sft_model(tiny, tmp_path_factory):
    """SFT of a random tiny model on 8 question/name examples (2 of them held out)."""
    root = tmp_path_factory.mktemp("sft")
    data = write_jsonl(root / "sft.jsonl", questions())
    base = save_base(tiny.tokenizer, root / "base")
    with contextlib.chdir(root):
        # No corpus text mixed in: the test is that the examples themselves are learnt.
        metrics = sft(build_section(SFTParams, {"data": str(data), "text_share": 0.0, **LOOP}),
                      build_section(TrainParams, TRAIN), base,
                      tiny.tokenizer, tiny.corpus, root / "sft", root / "ck-sft", root / "curves-sft")
    return root / "sft", metrics


def test_sft_reproduces_its_examples(tiny, sft_model):
    model_dir, metrics = sft_model
    tmp_path = model_dir.parent
    assert metrics["examples"] == 6 and metrics["val_examples"] == 2
    assert metrics["train_loss"] < 0.2 < metrics["base"]["val_loss"]
    conversations = [row["messages"] for row in questions()]
    got = greedy_answers(model_dir, tiny.tokenizer, conversations)
    # The 6 training examples are reproduced exactly (the 2 held out are unknowable names).
    assert sum(g == c[-1]["content"] for g, c in zip(got, conversations)) >= 6
    assert json.loads((tmp_path / "metrics/sft.json").read_text())["sft"]["examples"] == 6
    assert (tmp_path / "curves-sft/curves.png").is_file()
    assert fingerprint(tmp_path / "ck-sft")["code"] == stage_code_sha256("sft")


def fingerprint(checkpoints: Path) -> dict:
    """The fingerprint of the one run in a checkpoint folder: a fix to the stage's code (which makes DVC rerun
    it) must be another run, not the old one's final checkpoint resumed with nothing left to train."""
    (state,) = checkpoints.glob("*/step_*/state.json")
    return json.loads(state.read_text())["fingerprint"]


@pytest.mark.slow  # a DPO run to convergence, ~10 s on 2 cores: `make test-slow`
def test_dpo_learns_every_preference(tiny, sft_model, tmp_path):
    model_dir, _ = sft_model
    pairs = [{"prompt": f"Name number {i}?", "chosen": name, "rejected": ANSWERS[(i + 3) % len(ANSWERS)]}
             for i, name in enumerate(ANSWERS)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    params = build_section(DPOParams, {"data": str(data), **LOOP, "lr": 3e-3, "min_lr": 3e-4, "beta": 0.5})
    with contextlib.chdir(tmp_path):
        metrics = dpo(params, build_section(TrainParams, TRAIN), model_dir, tiny.tokenizer, tiny.corpus,
                      tmp_path / "dpo", tmp_path / "ck-dpo", tmp_path / "curves-dpo")
    # At the start the policy is the reference: every reward is 0, so no pair counts as won.
    assert "train/rewards/accuracies" not in metrics["sft"]
    assert metrics["train/rewards/accuracies"] == 1.0
    assert metrics["train/rewards/margins"] > 0 and metrics["train/rewards/chosen"] > metrics["train/rewards/rejected"]
    assert metrics["train/logps/chosen"] > metrics["train/logps/rejected"]
    assert metrics["pairs"] == 6 and metrics["val_pairs"] == 2
    assert (tmp_path / "dpo/model.safetensors").is_file()
    curves = tmp_path / "curves-dpo/plots/metrics"
    assert (curves / "val/rewards/accuracies.tsv").is_file() and (curves / "loss.tsv").is_file()
    assert fingerprint(tmp_path / "ck-dpo")["code"] == stage_code_sha256("dpo") != stage_code_sha256("sft")


def pairs_of_many_lengths(n: int = 12) -> list[Pair]:
    """Answers of a few to 40-odd tokens, so that a sum and a per-token average of their log-probs differ."""
    rng = random.Random(0)
    words = ["the", "king", "queen", "of", "Denmark", "night", "day", "speak", "hear", "me", "well,", "said", "O"]

    def answer(k: int) -> list[dict]:
        return [{"role": "assistant", "content": " ".join(rng.choices(words, k=k))}]

    return [Pair([{"role": "user", "content": f"Say {i}"}], answer(1 + i + i // 2), answer(rng.randint(1, 4)))
            for i in range(n)]


def llama_twin(model: GPT):
    """The same weights as a transformers Llama, its forward patched as TRL's DPOTrainer patches it."""
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    from kiln.model.hf import hf_config, to_hf_tensors

    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(hf_config(model.config, {})))
    missing = twin.load_state_dict(to_hf_tensors(model.state_dict(), model.config), strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to the embedding, as in kiln
    add_fused_lm_head(twin, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return twin.eval()


def trl_dpo(policy: GPT, reference: GPT, rows: PairRows, pad: int, beta: float, loss: str,
            label_smoothing: float, sft_weight: float) -> tuple[float, dict[str, float]]:
    """(loss, logged metrics) of TRL's own `DPOTrainer._compute_loss` (trl 1.16, trl/trainer/dpo_trainer.py)
    on transformers twins of the two models and the very token rows kiln scores, the trainer's state stubbed."""
    from trl.trainer.dpo_trainer import DPOTrainer

    # TRL's batch: chosen rows then rejected ones, whole sequences, a completion mask over the answer tokens.
    x, y = (torch.cat(t) for t in zip(rows.chosen, rows.rejected))
    ids = torch.cat([x, torch.full_like(x[:, :1], pad)], dim=1)
    ids[:, 1:] = torch.where(y != IGNORE, y, ids[:, 1:])
    completion = torch.nn.functional.pad((y != IGNORE).long(), (1, 0))
    inputs = {"input_ids": ids, "attention_mask": (ids != pad).long(), "completion_mask": completion}
    if loss == "sigmoid" and label_smoothing:
        # TRL 1.x's sigmoid ignores label_smoothing; conservative DPO, TRL 0.x's smoothed sigmoid
        # -(1 - e) log s(bh) - e log s(-bh), is 2(1 - e) sigmoid - (1 - 2e) robust, TRL's two losses weighted.
        losses, weights = ["sigmoid", "robust"], [2 * (1 - label_smoothing), -(1 - 2 * label_smoothing)]
    else:
        losses, weights = [loss], [1.0]
    if sft_weight:  # RPO in TRL 1.x: the "sft" loss (chosen answers' NLL per token) beside the preference loss
        losses, weights = [*losses, "sft"], [*weights, sft_weight]
    twin = llama_twin(policy)
    trainer = SimpleNamespace(
        model=twin, ref_model=llama_twin(reference), precompute_ref_logps=False, ld_alpha=None,
        f_divergence_type="reverse_kl", loss_types=losses, loss_weights=weights, beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, aux_loss_enabled=False, _tp_size=1,
        _total_train_tokens=0, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t))
    with torch.no_grad():
        value = DPOTrainer._compute_loss(trainer, twin, inputs, return_outputs=False)
    return value.item(), {k: v[0] for k, v in trainer._metrics["eval"].items()}


@pytest.mark.parametrize("loss,smoothing,sft_weight", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0),
                                                       ("sigmoid", 0.0, 0.7)])
def test_dpo_loss_and_metrics_are_trls(tiny, loss, smoothing, sft_weight):
    chat = ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))
    config = ModelConfig(vocab_size=load_tokenizer(tiny.tokenizer).get_vocab_size(), n_layer=2, n_head=2,
                         n_kv_head=2, d_model=64, max_seq_len=96)
    policy, reference = (GPT(config).eval() for _ in range(2))  # two random draws: the log-ratios are not 0
    rows = pair_rows(pairs_of_many_lengths(), chat, config.max_seq_len, "test")
    assert len(rows) == 12 and rows.tokens()[0].min() < 10 < 40 < rows.tokens()[0].max()
    rows.ref_chosen, rows.ref_rejected = logps(reference, rows, 5)
    pc, pr = logps(policy, rows, 5)
    params = build_section(DPOParams, {"beta": 0.5, "loss": loss, "label_smoothing": smoothing,
                                       "sft_weight": sft_weight})
    ours, our_loss = pair_metrics(params, rows, pc, pr, "val")
    want_loss, want = trl_dpo(policy, reference, rows, chat.pad, 0.5, loss, smoothing, sft_weight)
    assert our_loss == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected"]
    assert {k: ours[f"val/{k}"] for k in names} == pytest.approx({k: want[k] for k in names}, rel=1e-4, abs=1e-5)
    assert 0 < want["rewards/accuracies"] < 1
    # The check can tell sums from per-token averages: on these answers they are far apart.
    assert abs(want["logps/chosen"] - (pc / rows.tokens()[0]).mean().item()) > 10


def test_builtin_task_holds_out_val_passages_only(shakespeare):
    chat = ChatFormat(load_tokenizer(shakespeare.tokenizer, ordinary=True))
    train, val = task_items(shakespeare.corpus, chat, 128, 60, 30, seed=5)
    assert len(train) == 60 and len(val) == 30
    assert {i.kind for i in val} == {"title", "speaker", "continue"}
    text = {split: "\n".join(pq.read_table(shakespeare.corpus / f"{split}.parquet").column("text").to_pylist())
            for split in ("train", "val")}
    titles = set(pq.read_table(shakespeare.corpus / "train.parquet").column("source").to_pylist())
    for item in val:
        passage = item.prompt[0]["content"].split("\n\n", 1)[1]
        lines = [line for line in passage.splitlines() if len(line.strip()) > 30]
        assert all(line in text["val"] for line in lines)
        assert not any(line in text["train"] for line in lines[:1]), "a held-out passage is in the train split"
        assert len(set(item.choices)) == 4 and item.answer not in item.wrong
        assert len(chat.render(item.conversation(max(item.choices, key=len))).ids) <= 129
        if item.kind == "title":
            assert item.answer in titles | {"A Lover's Complaint"} and set(item.wrong) <= titles | {
                "A Lover's Complaint"}
        if item.kind == "speaker":
            assert passage.startswith(item.answer + ".")
    assert task_items(shakespeare.corpus, chat, 128, 60, 30, seed=5)[1] == val  # deterministic


def test_sft_text_rows_are_distinct_windows_of_the_train_split(shakespeare):
    chat = ChatFormat(load_tokenizer(shakespeare.tokenizer, ordinary=True))
    x, y = text_rows(shakespeare.corpus, chat, 64, 300, seed=3)
    assert x.shape == y.shape == (300, 64) and (y != IGNORE).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert len({tuple(row) for row in x.tolist()}) == 300
    train = "\n".join(pq.read_table(shakespeare.corpus / "train.parquet").column("text").to_pylist())
    for row in x[:20].tolist():  # text between two <|endoftext|> is one train document's
        for piece in chat.tokenizer.decode(row, skip_special_tokens=False).split("<|endoftext|>"):
            assert piece.strip() in train
    assert torch.equal(text_rows(shakespeare.corpus, chat, 64, 300, seed=3)[0], x)
    with pytest.raises(UserError, match="sft.text_share"):
        text_rows(shakespeare.corpus, chat, 64, 10**7, seed=3)
    with pytest.raises(UserError, match="sft.text_share"):
        build_section(SFTParams, {"text_share": 1.0})


def test_commands_refuse_bad_input(tiny, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["sft", "--set", "format=xml", "--tokenizer", str(tiny.tokenizer)])
    assert result.exit_code == 2 and "sft.format='xml'" in result.output
    result = runner.invoke(app, ["dpo", "--set", "loss=ipo", "--set", "label_smoothing=0.1"])
    assert result.exit_code == 2 and "dpo.label_smoothing" in result.output
    result = runner.invoke(app, ["dpo", "--sft", str(tmp_path / "nothing"), "--tokenizer", str(tiny.tokenizer)])
    assert result.exit_code == 2 and "nothing" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["sft", "--set", "batch_examples=10", "--set", "batch_size=4"])
    assert result.exit_code == 2 and "sft.batch_examples" in result.output


def test_chat_streams_answers_and_keeps_the_conversation(tiny, sft_model):
    model_dir, _ = sft_model
    runner = CliRunner()
    result = runner.invoke(app, ["chat", "--model", str(model_dir), "--tokenizer", str(tiny.tokenizer),
                                 "--temperature", "0", "--max-new-tokens", "16"],
                           input="Name number 0?\n/reset\nName number 1?\n")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["kiln> Claudius", "kiln> Gertrude"]
