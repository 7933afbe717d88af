"""Generative eval tasks: each model writes its own answer to each prompt and a reward (tasks/rewards.py) scores it.

A task is prompts with answers: `data: builtin` takes the built-in task's held-out "Who speaks first in this
passage?" questions (val split only, the kind the grpo stage trains on, with passages fitted to leave room for
`max_new_tokens`), any other `data` is read by `load_prompts` (prompt_answer or gsm8k rows). Every prompt is
answered once greedily, which gives `pass@1` and `mean_reward` and the per-prompt rewards the report pairs models
on, and, with `samples: n`, n times at `temperature`, which gives `sampled/pass@k` for k = 1, 2, 4, ... <= n with
the unbiased estimator of Chen et al. 2021 (evaluate/pass_at_k.py). A completion is right when its reward is at least
1 (full marks), as the grpo stage counts its held-out pass@1.

How a model is asked depends on what it was trained on. A chat model (metadata `chat_format`) gets the messages
in its chat template and answers until `<|im_end|>`. The base model never saw chat markers, so it gets plain
text, zero-shot: the messages' contents separated by blank lines, then "\n\nAnswer:", and its answer is the rest
of that line (it stops at the first token holding a newline, as lm-evaluation-harness's generate_until does with
until=["\n"]). Few-shot examples would not fit beside a passage in the default 128-token context.

A prompt that leaves no room for `max_new_tokens` in either rendering is counted (`too_long`) and left out for
every model, so that all models answer the same prompts. Answers come from the serving engine, whose cache holds
`eval.gen_batch_size` of them at once (the rest wait their turn); answer i draws with seed eval.seed + i, whatever
else runs beside it, so a rerun gives the same numbers and every model gets the same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.pipeline.errors import UserError
from kiln.pipeline.evaluate.params import GenTaskSpec
from kiln.pipeline.evaluate.pass_at_k import pass_at_k
from kiln.pipeline.serve.engine import complete
from kiln.pipeline.serve.request import Request, SamplingParams, fork_groups
from kiln.pipeline.tasks.chat_data import load_prompts
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tasks.corpus_task import held_out_items
from kiln.pipeline.tasks.rewards import NamedReward, make_reward, score
from kiln.pipeline.tasks.user_reward import Limits

PLAIN_SUFFIX = "\n\nAnswer:"


@dataclass
class GenTask:
    spec: GenTaskSpec
    key: str                    # `eval.tasks[i]`, which every message about the task names
    reward: NamedReward
    texts: list[str]            # each prompt's last user turn: what a reward gets as the prompt
    answers: list[str]
    chat_ids: list[list[int]]   # each prompt in the chat template, up to the assistant header
    plain_ids: list[list[int]]  # each prompt as plain text, after <|endoftext|>
    line_ends: list[int]        # the tokens holding a newline, and <|endoftext|>: where a plain answer ends
    too_long: int               # prompts left out: no room for max_new_tokens

    @property
    def name(self) -> str:
        return self.spec.name

    def summary(self) -> str:
        n = self.spec.samples
        sampled = f" and {n} samples at temperature {self.spec.temperature}" if n else ""
        return f"{self.name}: {len(self.texts):,} prompts, greedy{sampled}, {self.reward.label}"


@dataclass
class GenResult:
    metrics: dict[str, float]
    rewards: list[float]      # each prompt's greedy reward, in task order
    completions: list[str]    # each prompt's greedy answer
    per_item: dict[str, np.ndarray]  # each metric's per-prompt values, whose mean it is (for its interval)


def plain_prompt(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages) + PLAIN_SUFFIX


def load_gen_task(spec: GenTaskSpec, key: str, chat: ChatFormat, corpus_dir: Path, seq_len: int,
                  seed: int) -> GenTask:
    """The task's prompts, both renderings of each, and its reward; a bad reward fails before any model runs."""
    reward = make_reward(spec.reward, spec.reward_pattern, key, spec.reward_timeout,
                         Limits(int(spec.reward_memory_gib * 2**30), spec.reward_processes))
    if spec.max_new_tokens >= seq_len:
        raise UserError(f"params: {key}.max_new_tokens={spec.max_new_tokens}: expected fewer than the models' "
                        f"max_seq_len={seq_len}")
    if spec.data == "builtin":
        items = held_out_items(corpus_dir, chat, seq_len - spec.max_new_tokens, spec.limit, seed, kinds=("speaker",))
        rows = [item.prompt_answer() for item in items]
    else:
        rows = load_prompts(spec.data, spec.format, spec.split, spec.limit, f"{key}.data")
    task = GenTask(spec, key, reward, [], [], [], [], line_ends(chat), 0)
    for row in rows:
        ids, plain = chat.prompt(row.prompt), [chat.eot, *chat.encode(plain_prompt(row.prompt))]
        if max(len(ids), len(plain)) + spec.max_new_tokens - 1 > seq_len:
            task.too_long += 1
            continue
        task.texts.append(row.question)
        task.answers.append(row.answer)
        task.chat_ids.append(ids)
        task.plain_ids.append(plain)
    if not task.texts:
        raise UserError(f"{key} {spec.name}: no prompt leaves room for {key}.max_new_tokens={spec.max_new_tokens} "
                        f"within max_seq_len={seq_len}: nothing to score")
    return task


def line_ends(chat: ChatFormat) -> list[int]:
    """Every token whose text holds a newline, and <|endoftext|>: a base model's answer ends at the first. A BPE
    vocabulary merges newlines into other tokens (".\n", "\n\n"), so the newline token alone would miss most."""
    tokenizer = chat.tokenizer
    return [i for i in range(tokenizer.get_vocab_size()) if "\n" in tokenizer.decode([i])] + [chat.eot]


def plain_answer(chat: ChatFormat, ids: list[int]) -> str:
    """A base model's answer: its text up to the first newline (or <|endoftext|>)."""
    end = ids.index(chat.eot) if chat.eot in ids else len(ids)
    return chat.text(ids[:end]).split("\n", 1)[0]


def run_gen_task(task: GenTask, model, chat: ChatFormat, chat_model: bool, rows: int, seed: int) -> GenResult:
    """One model's answers (under the caller's autocast): greedy for pass@1 and mean_reward, then `samples` per
    prompt for pass@k."""
    spec = task.spec
    ids = task.chat_ids if chat_model else task.plain_ids
    stops = [chat.im_end, chat.eot] if chat_model else task.line_ends

    def answers(prompts: list[list[int]], temperature: float, n: int = 1) -> list[str]:
        """`n` answers to each prompt, the prompt computed once for them (a request and its forks)."""
        requests = [Request(p, SamplingParams(spec.max_new_tokens, temperature, seed=seed + i, stop_ids=tuple(stops)))
                    for i, p in enumerate(p for p in prompts for _ in range(n))]
        complete(model, fork_groups(requests, n), concurrent=rows)
        return [chat.parse_reply(r.output) if chat_model else plain_answer(chat, r.output) for r in requests]

    def rewards(completions: list[str], n: int, what: str) -> list[float]:
        triples = [(task.texts[i // n], c, task.answers[i // n]) for i, c in enumerate(completions)]
        return score(task.reward, triples, f"{task.key} {task.name} {what}")

    completions = answers(ids, 0.0)
    greedy = rewards(completions, 1, "greedy answers")
    per_item = {"pass@1": (np.array(greedy) >= 1).astype(np.float64), "mean_reward": np.array(greedy, np.float64)}
    if n := spec.samples:
        sampled = np.array(rewards(answers(ids, spec.temperature, n), n, "samples")) >= 1
        right = sampled.reshape(len(ids), n).sum(axis=1).tolist()
        per_item |= {f"sampled/pass@{k}": np.array([pass_at_k(n, c, k) for c in right]) for k in spec.ks()}
    return GenResult({k: float(v.mean()) for k, v in per_item.items()}, greedy, completions, per_item)
