"""Stage `dpo`: data/models/sft -> data/models/dpo/, direct preference optimisation (Rafailov et al., 2023).

The policy starts as the SFT model, which is also the frozen reference. Each pair is one row, its prompt computed
once for both answers (scoring/answers.py), in training and in every scoring pass. The reference's log-probabilities of
every chosen and rejected answer are computed once, before training, so no second model sits in memory while
the policy trains. An answer's log-probability is summed over its tokens after the shared prompt (its
`<|im_end|>` included). The losses are TRL's (`DPOTrainer._compute_loss`, trl 1.16): `dpo.loss: ipo` divides
each log-ratio by its answer's length, as TRL does after checking with the IPO authors, so that the margin
target 1/(2 beta) does not depend on how long the answers are. `dpo.label_smoothing` is conservative DPO, the
smoothed sigmoid loss of TRL 0.x (TRL 1.x's `sigmoid` ignores label_smoothing; its `robust` is another loss).
`dpo.sft_weight` adds the chosen answers' NLL per token (RPO; TRL's loss_type "sft"), to the training loss and
to `val_loss` alike, as TRL's logged loss includes every term.

Metrics carry TRL's names and are TRL's quantities, whatever the loss: rewards/chosen = beta (log pi(chosen) -
log ref(chosen)) with summed log-probabilities, rewards/rejected alike, rewards/margins their difference,
rewards/accuracies the share of pairs with margin > 0, logps/chosen and logps/rejected the policy's summed
log-probabilities; `train/` on a fixed sample of training pairs, `val/` on the held-out ones.
`val/preference_accuracy` (log pi(chosen) > log pi(rejected)) needs no reference, so the SFT model has one too
(`sft` in the metrics) and the two can be compared.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.pipeline.post.common import ExampleBatches, Start, rows_sha256, start
from kiln.pipeline.post.dpo_loss import batch_loss, dpo_loss
from kiln.pipeline.post.params import DPOParams
from kiln.pipeline.post.stage import Stage, run_stage
from kiln.pipeline.runtime import autocast
from kiln.pipeline.scoring.answers import (ChoiceScorer, PairRows, answer_tokens, logps, pair_logps, pair_rows,
                                           shared_pairs)
from kiln.pipeline.train.curves import Panel
from kiln.pipeline.train.params import TrainParams

PANELS = [Panel("DPO loss", "loss, mean over pairs", {"loss": "train", "val_loss": "held-out"}),
          Panel("pairs ranked right", "share of pairs", {"train/rewards/accuracies": "reward, train",
                                                         "val/rewards/accuracies": "reward, held-out",
                                                         "val/preference_accuracy": "policy alone, held-out"}),
          Panel("implicit rewards, held-out", "beta x log-ratio to reference", {"val/rewards/chosen": "chosen",
                                                                         "val/rewards/rejected": "rejected",
                                                                         "val/rewards/margins": "margin"}),
          Panel("built-in task, held-out", "accuracy", {"val_accuracy": "accuracy"}),
          Panel("learning rate", "lr", {"lr": "lr"})]


def pair_metrics(params: DPOParams, rows: PairRows, pc: torch.Tensor, pr: torch.Tensor,
                 prefix: str) -> tuple[dict, float]:
    """(TRL's reward and log-prob metrics under `prefix/`, the loss) for policy log-probs pc, pr."""
    tokens = rows.tokens()
    losses, chosen, rejected = dpo_loss(pc, pr, rows.ref_chosen, rows.ref_rejected, tokens, params.beta,
                                        params.label_smoothing, params.loss)
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/margins": (chosen - rejected).mean(), "rewards/accuracies": (chosen > rejected).double().mean(),
               "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}
    loss = batch_loss(losses, pc, tokens[0], params.sft_weight)
    return {f"{prefix}/{k}": v.item() for k, v in metrics.items()}, loss.item()


def dpo(params: DPOParams, train_params: TrainParams, sft_dir: Path, tokenizer_path: Path, corpus_dir: Path,
        out_dir: Path, checkpoint_dir: Path, curves_dir: Path | None = None,
        resume_from: Path | None = None) -> dict:
    s = start(params, train_params, sft_dir, tokenizer_path, corpus_dir)
    return run_stage(s, lambda: dpo_stage(params, s, sft_dir), out_dir, checkpoint_dir, curves_dir, resume_from)


def dpo_stage(params: DPOParams, s: Start, sft_dir: Path) -> Stage:
    """DPO's pair rows with the reference's log-probabilities, its loss and its held-out measures."""
    model, loop, chat, data, seq_len, world = s.model, s.loop, s.chat, s.data, s.model.config.max_seq_len, s.world
    train_rows = pair_rows(data.train, chat, seq_len, "dpo train")
    val_rows = pair_rows(data.val, chat, seq_len, "dpo held-out")
    with autocast(next(model.parameters()).device, loop.precision):
        for rows in (train_rows, val_rows):  # the reference, once: the model is still the SFT model here
            rows.ref_chosen, rows.ref_rejected = logps(model, rows, params.batch_size)
    sample = train_rows.head(max(len(val_rows), 1))
    scorer = ChoiceScorer(data.items, chat, seq_len)

    def evaluate(m) -> dict:
        out = scorer.accuracy(m, params.batch_size)
        if len(sample):
            pc, pr = logps(m, sample, params.batch_size)
            out |= pair_metrics(params, sample, pc, pr, "train")[0]
        if len(val_rows):
            pc, pr = logps(m, val_rows, params.batch_size)
            metrics, loss = pair_metrics(params, val_rows, pc, pr, "val")
            out |= metrics | {"val_loss": loss, "val/preference_accuracy": (pc > pr).double().mean().item()}
        return out

    def loss_fn(m, batch):
        *shared, yc, yr, ref_c, ref_r = batch
        pc, pr = pair_logps(m, shared, yc, yr)
        tokens = answer_tokens(yc), answer_tokens(yr)
        losses = dpo_loss(pc, pr, ref_c, ref_r, tokens, params.beta, params.label_smoothing, params.loss)[0]
        return batch_loss(losses, pc, tokens[0], params.sft_weight)

    tensors = (*train_rows.chosen, *train_rows.rejected, train_rows.ref_chosen.float(), train_rows.ref_rejected.float())

    def collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """A micro-batch of padded pairs as a row per pair, its prompt once (scoring/answers.py)."""
        xc, yc, xr, yr, ref_c, ref_r = batch
        return [*shared_pairs(xc, yc, xr, yr, chat.pad), yc, yr, ref_c, ref_r]
    return Stage(
        name="dpo", loss_fn=loss_fn,
        batches=lambda accum: ExampleBatches(tensors, params.batch_size, accum, params.seed, rank=world.rank,
                                             world_size=world.size, collate=collate),
        evaluate=evaluate, data=rows_sha256(*tensors[:4]),
        fingerprint={"dpo": {"beta": params.beta, "label_smoothing": params.label_smoothing, "loss": params.loss,
                             "sft_weight": params.sft_weight}},
        micro_batch_tokens=2 * params.batch_size * seq_len,
        summary=f"{len(train_rows):,} train and {len(val_rows):,} held-out pairs, {params.loss} loss, beta "
                f"{params.beta}, {loop.max_steps} steps x {params.batch_examples} pairs, from {sft_dir}",
        panels=PANELS, title=f"{len(train_rows):,} pairs",
        # before training the policy is its own reference: its rewards (log-ratios of 0) say nothing
        # The loop counts every pair as two rows of max_seq_len; a pair's forward holds its prompt once and its
        # answers, fewer tokens and varying: an MFU from those counts would be fiction, so pairs/s stands instead.
        flops_per_token=0.0,
        metrics=lambda result, before: {**{k: v for k, v in result.items() if k not in ("tokens", "tokens_per_s")},
                                        "pairs_per_s": round(result["steps"] * params.batch_examples
                                                             / result["seconds"], 2) if result["seconds"] else 0.0,
                                        "pairs": len(train_rows), "val_pairs": len(val_rows),
                                        "sft": {k: round(v, 5) for k, v in before.items()
                                                if not k.startswith(("train/rewards", "val/rewards"))}})
