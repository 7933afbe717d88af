"""Stage `sft`: data/models/base -> data/models/sft/, supervised fine-tuning on chat-format examples.

The targets are the assistant tokens of the examples (their `<|im_end|>` included) and every token of the
`sft.text_share` rows of corpus text mixed in, each text row weighted `sft.text_weight`; the loss is their
weighted mean over an optimizer step, however they fall across micro-batches. Examples are packed into rows
(`sft.packing`, scoring/rows.py), or padded one a row. Held-out: the loss on answer tokens only, and for the
built-in task the accuracy of picking the true answer among four, measured on the base model before training too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.pipeline.errors import UserError
from kiln.pipeline.post.common import ExampleBatches, Start, rendered_of, rows_sha256, start
from kiln.pipeline.post.params import SFTParams
from kiln.pipeline.post.sft_loss import masked_loss
from kiln.pipeline.post.stage import Stage, run_stage
from kiln.pipeline.scoring.answers import ChoiceScorer, score_rows
from kiln.pipeline.scoring.rows import IGNORE, to_rows
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.text.corpus import iter_texts
from kiln.pipeline.train.curves import Panel
from kiln.pipeline.train.params import TrainParams

PANELS = [Panel("loss on assistant tokens", "cross-entropy (nats/token)", {"loss": "train", "val_loss": "held-out"}),
          Panel("built-in task, held-out", "accuracy", {"val_accuracy": "all", "val_accuracy_title": "title",
                                                       "val_accuracy_speaker": "speaker",
                                                       "val_accuracy_continue": "continue"}),
          Panel("learning rate", "lr", {"lr": "lr"}),
          Panel("gradient norm before clipping", "global L2 norm", {"grad_norm": "grad_norm"})]


def rows_of(conversations: list[list[dict]], chat: ChatFormat, seq_len: int, what: str):
    """Padded (x, y) rows of the conversations that keep an answer token within seq_len."""
    return to_rows(rendered_of(conversations, chat, seq_len, what), seq_len, chat.pad, what)


def train_rows(conversations: list[list[dict]], chat: ChatFormat, seq_len: int, packing: bool) -> tuple:
    """The training examples as rows: padded (x, y), or packed (x, y, segments) with `packing`; how many examples
    they hold, and how many answer tokens an example has on average."""
    rendered = rendered_of(conversations, chat, seq_len, "sft train")
    rows = to_rows(rendered, seq_len, chat.pad, "sft train", packing)
    return rows, len(rendered), (rows[1] != IGNORE).sum().item() / max(1, len(rendered))


def text_rows(corpus_dir: Path, chat: ChatFormat, seq_len: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`n` distinct windows of the corpus's train split, every token a target, each document after an
    `<|endoftext|>` as in pretraining. Mixed into the SFT rows, they keep the plain-text model pretraining made
    (trained on the chat examples alone, val bits per byte rose by ~0.9 while the task was learnt)."""
    pieces = [np.zeros(0, dtype=np.int64)]
    for texts in iter_texts(Path(corpus_dir) / "train.parquet"):
        pieces += [np.array([chat.eot, *e.ids], dtype=np.int64) for e in chat.tokenizer.encode_batch_fast(texts)]
    ids = np.concatenate(pieces)
    windows = (len(ids) - 1) // seq_len
    if n > windows:
        raise UserError(f"sft.text_share: {n:,} text rows wanted, the corpus's train split has {windows:,} windows "
                        f"of max_seq_len={seq_len}")
    starts = np.random.default_rng([seed, 2]).choice(windows, size=n, replace=False) * seq_len
    rows = torch.from_numpy(np.stack([ids[s:s + seq_len + 1] for s in starts]).reshape(n, seq_len + 1))
    return rows[:, :-1], rows[:, 1:]


def sft(params: SFTParams, train_params: TrainParams, base_dir: Path, tokenizer_path: Path, corpus_dir: Path,
        out_dir: Path, checkpoint_dir: Path, curves_dir: Path | None = None,
        resume_from: Path | None = None) -> dict:
    s = start(params, train_params, base_dir, tokenizer_path, corpus_dir)
    return run_stage(s, lambda: sft_stage(params, s, base_dir, corpus_dir), out_dir, checkpoint_dir, curves_dir,
                     resume_from)


def sft_stage(params: SFTParams, s: Start, base_dir: Path, corpus_dir: Path) -> Stage:
    """SFT's rows (the examples', then the corpus text's), its weighted loss and its held-out measures."""
    loop, chat, data, seq_len, world = s.loop, s.chat, s.data, s.model.config.max_seq_len, s.world
    rows, examples, answer_tokens = train_rows(data.train, chat, seq_len, params.packing)
    x, y = rows[:2]
    n_text = round(len(x) * params.text_share / (1 - params.text_share))
    weights = torch.ones(len(x))
    segments = rows[2:]  # packed: each token's example; a text row is one stream, as in pretraining
    if n_text:
        text_x, text_y = text_rows(corpus_dir, chat, seq_len, n_text, params.seed)
        x, y = torch.cat([x, text_x]), torch.cat([y, text_y])
        weights = torch.cat([weights, torch.full((n_text,), params.text_weight)])
        segments = tuple(torch.cat([s, torch.zeros_like(text_x)]) for s in segments)
    val_x, val_y = rows_of(data.val, chat, seq_len, "sft held-out")
    scorer = ChoiceScorer(data.items, chat, seq_len)
    val_targets = int((val_y != -100).sum())

    def evaluate(m) -> dict:
        out = scorer.accuracy(m, params.batch_size)
        if val_targets:
            out["val_loss"] = -score_rows(m, val_x, val_y, params.batch_size, chat.pad).sum().item() / val_targets
        return out

    packed = f" packed into {len(x) - n_text:,} rows" if params.packing else ""
    return Stage(
        name="sft", loss_fn=masked_loss,
        batches=lambda accum: ExampleBatches((x, y, weights, *segments), params.batch_size, accum, params.seed,
                                             per_token=True, rank=world.rank, world_size=world.size),
        evaluate=evaluate, data=rows_sha256(x, y, weights, *segments), micro_batch_tokens=params.batch_size * seq_len,
        summary=f"{examples:,} train examples{packed} ({answer_tokens:.1f} answer tokens each on average) and "
                f"{n_text:,} rows of corpus text, {len(val_x):,} held-out examples, "
                f"{loop.max_steps} steps x {params.batch_examples} rows, from {base_dir}",
        panels=PANELS, title=f"{len(x):,} examples",
        metrics=lambda result, before: {**result, "examples": examples, "text_rows": n_text,
                                        "val_examples": len(val_x),
                                        "base": {k: round(v, 5) for k, v in before.items()}})
