"""Post-training's held-out data as evaluate measures every model on it: the built-in task's held-out items (the
sft section's) and the preference pairs held out of DPO's data (the dpo section's), found exactly as the stages
find them. Evaluate gets it from the command that runs it, so that it needs no import of post/."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.pipeline.post.common import load_chat_data
from kiln.pipeline.post.params import DPOParams, SFTParams
from kiln.pipeline.scoring.answers import ChoiceScorer, PostTrainData, pair_rows
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tasks.corpus_task import held_out_items

# The keys of the sft and dpo sections this reads, as dvc.yaml's evaluate stage lists them.
READS = {"sft": ("data", "val_examples", "seed"), "dpo": ("data", "format", "split", "max_examples", "val_examples",
                                                          "seed")}


@dataclass(frozen=True)
class HeldOut:
    sft: SFTParams
    dpo: DPOParams

    def load(self, chat: ChatFormat, seq_len: int, corpus_dir: Path) -> PostTrainData:
        sft, dpo = self.sft, self.dpo
        items = held_out_items(corpus_dir, chat, seq_len, sft.val_examples, sft.seed) if sft.data == "builtin" else []
        if dpo.data == "builtin":
            pairs = [item.pair() for item in held_out_items(corpus_dir, chat, seq_len, dpo.val_examples, dpo.seed)]
        else:
            pairs = load_chat_data(dpo, chat, seq_len, corpus_dir).val
        return PostTrainData(ChoiceScorer(items, chat, seq_len), pair_rows(pairs, chat, seq_len, "eval dpo held-out"))

    def keys(self) -> dict[str, dict]:
        """The values of the keys it reads, section by section: part of evaluate's params digest."""
        return {section: {k: getattr(obj, k) for k in READS[section]} for section, obj in (("sft", self.sft),
                                                                                           ("dpo", self.dpo))}
