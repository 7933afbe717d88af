"""The `grpo` section, apart from `sft` and `dpo`'s so that a change to it reruns only the grpo stage."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from kiln.pipeline.post.params import PostTrainParams
from kiln.pipeline.serve.request import MAX_TEMPERATURE

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # how the per-token losses aggregate (post/grpo_loss.py)

if TYPE_CHECKING:
    from kiln.pipeline.tasks.chat_data import PromptAnswer
    from kiln.pipeline.tasks.chat_format import ChatFormat


@dataclass
class GRPOParams(PostTrainParams):
    """GRPO: the policy samples `group_size` completions of each prompt, a reward scores them, and each
    completion's reward relative to its group's is the advantage of all its tokens (post/grpo.py).

    Counts are completions: `batch_examples` per optimizer step (prompts x group_size), `batch_size` per
    micro-step. One rollout batch feeds `epochs` optimizer steps (TRL's num_iterations)."""

    SECTION: ClassVar[str] = "grpo"
    init: str = "sft"  # the model folder GRPO starts from (and whose copy is the KL reference): sft | dpo
    max_examples: int | None = 2000  # prompts
    val_examples: int = 100  # held-out prompts behind the stage's own greedy pass@1 curve
    max_steps: int = 500
    batch_size: int = 32
    batch_examples: int = 32
    lr: float = 2e-4
    min_lr: float = 2e-5
    warmup_steps: int = 5
    eval_every: int = 50
    checkpoint_every: int = 50
    log_every: int = 1
    group_size: int = 8  # completions per prompt
    epochs: int = 1  # optimizer steps per rollout batch; > 1 reuses samples through the importance ratio
    # DAPO's dynamic sampling: groups with one reward (no advantage) are replaced by further prompts' groups, for
    # up to this many rounds of sampling per rollout batch; 1: off, every scheduled group is trained on
    sampling_rounds: int = 1
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 16
    epsilon_low: float = 0.2  # the clip range of the ratio: [1 - epsilon_low, 1 + epsilon_high]
    epsilon_high: float = 0.28  # DAPO's clip-higher: more room for unlikely tokens with a positive advantage
    beta: float = 0.0  # weight of the k3 KL to the starting model (0: no reference model is kept, as in TRL)
    loss_type: str = "dapo"  # dapo | grpo | bnpo | dr_grpo (post/grpo_loss.py says how each aggregates)
    scale_rewards: bool = True  # divide by the group's std; false: Dr. GRPO's unscaled advantages
    reward: str = "exact"  # exact | numeric | contains | regex | module:function | file.py:function
    reward_pattern: str | None = None  # the regex of reward=regex, {answer} standing for the escaped answer
    reward_timeout: float = 10.0  # seconds a reward of the user's own may take per completion
    reward_memory_gib: float = 16.0  # address space per process of a reward of the user's own (RLIMIT_AS)
    reward_processes: int = 1024  # processes a reward of the user's own may run at once
    # rollouts launched step by step, no CUDA graphs (verl's rollout.enforce_eager, `kiln serve --enforce-eager`):
    # to debug, or to measure what the graphs buy; a CPU captures none either way
    enforce_eager: bool = False

    def check(self) -> None:
        super().check()
        if self.init not in ("sft", "dpo"):
            raise self.bad("init", "sft or dpo")
        for name in ("epochs", "max_new_tokens", "sampling_rounds"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        if self.group_size < 2:
            raise self.bad("group_size", "2 or more (an advantage is a reward relative to the rest of its group)")
        if self.batch_examples % self.group_size:
            raise self.bad("batch_examples", f"a multiple of grpo.group_size={self.group_size}")
        # A resumed run regenerates its rollout batch from the checkpoint's weights, so a checkpoint must fall
        # where a rollout batch begins.
        for name in ("checkpoint_every", "max_steps"):
            if getattr(self, name) % self.epochs:
                raise self.bad(name, f"a multiple of grpo.epochs={self.epochs}")
        if not 0 < self.temperature <= MAX_TEMPERATURE:
            raise self.bad("temperature", f"a positive number up to {MAX_TEMPERATURE} (GRPO needs different samples "
                           "of one prompt)")
        if not 0 < self.top_p <= 1:
            raise self.bad("top_p", "a number in (0, 1]")
        if not 0 <= self.epsilon_low < 1:
            raise self.bad("epsilon_low", "a number in [0, 1)")
        if not self.epsilon_high >= 0:
            raise self.bad("epsilon_high", "a number >= 0")
        if not self.beta >= 0:
            raise self.bad("beta", "a number >= 0")
        if not 0 < self.reward_timeout < math.inf:
            raise self.bad("reward_timeout", "a positive number of seconds")
        if not 0 < self.reward_memory_gib < math.inf:
            raise self.bad("reward_memory_gib", "a positive number of GiB")
        if self.reward_processes < 1:
            raise self.bad("reward_processes", "a positive integer")
        if self.loss_type not in LOSS_TYPES:
            raise self.bad("loss_type", f"one of {', '.join(LOSS_TYPES)}")

    def formats(self) -> tuple[str, ...]:
        from kiln.pipeline.tasks.chat_data import PROMPT_FORMATS

        return PROMPT_FORMATS

    def loader(self) -> Callable[..., list]:
        from kiln.pipeline.tasks.chat_data import load_prompts

        return load_prompts

    def builtin(self, corpus_dir: Path, chat: ChatFormat,
                seq_len: int) -> tuple[list[PromptAnswer], list[PromptAnswer], list]:
        """The built-in task's items as prompts with their answers, and no multiple-choice items: GRPO's own
        held-out measure is greedy pass@1."""
        from kiln.pipeline.tasks.corpus_task import prompt_items

        # Passages fitted to leave room for a whole completion, so that no prompt is dropped as too long.
        train, val = prompt_items(corpus_dir, chat, seq_len - self.max_new_tokens, self.max_examples,
                                  self.val_examples, self.seed)
        return train, val, []
