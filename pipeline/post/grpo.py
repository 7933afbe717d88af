"""Stage `grpo`: data/models/<grpo.init> -> data/models/grpo/, reinforcement learning from verifiable rewards
(GRPO, Shao et al. 2024), on the one training loop.

Each rollout batch takes `batch_examples / group_size` prompts, samples `group_size` completions of each from the
policy as it is now (on the serving engine, stopping at `<|im_end|>`: a group's prompt is computed once and its
completions share its cached blocks), scores them with `grpo.reward`, and turns
each completion's reward relative to its group's into the advantage of its tokens (post/grpo_loss.py). The batch
then feeds `grpo.epochs` optimizer steps; from the second on, the importance ratio against the log-probabilities
of the policy that sampled it (computed once, right after sampling) carries the clip. Log-probabilities are of
logits / temperature, the distribution the completions were drawn from (as TRL does).

With `grpo.beta` > 0 a frozen copy of the starting model is the KL reference: it scores each rollout batch
once, under no_grad, so it holds weights but never activations. With beta 0 (the default, as TRL's) no
reference is kept and `kl` is not logged.

Resuming regenerates the rollout batch of the checkpoint's step from the checkpoint's weights with the batch's
own seed, so a resumed run samples what an uninterrupted one did (hence checkpoints only where a rollout batch
begins: grpo.checkpoint_every is a multiple of grpo.epochs).

Per logged step, the metrics carry TRL's names and meanings: reward (mean over the step's completions),
reward_std (the mean of the groups' standard deviations), frac_reward_zero_std (groups that teach nothing; these
three of the scheduled prompts, before dynamic sampling replaces any), groups_informative and sampling_rounds
(with grpo.sampling_rounds > 1: the trained batch's share of groups with a spread, the rounds it took),
completions/mean_length, completions/clipped_ratio (completions cut by max_new_tokens), entropy (of the policy at
the sampled positions), clip_ratio/* and kl. Held out: greedy pass@1 and mean reward on `val_examples` prompts.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.machinery
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.model.logprobs import TokenStats
from kiln.model.lora import adapters_off, is_adapted
from kiln.model.modes import evaluating
from kiln.model.packed import Packed
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.post.common import ExampleBatches, Start, start
from kiln.pipeline.post.grpo_loss import group_advantages, policy_loss
from kiln.pipeline.post.grpo_params import GRPOParams
from kiln.pipeline.post.stage import Stage, run_stage
from kiln.pipeline.progress import console
from kiln.pipeline.runtime import PRECISIONS, SINGLE, World, autocast
from kiln.pipeline.scoring.rows import IGNORE, separate, shared_rows
from kiln.pipeline.serve.engine import Engine, complete
from kiln.pipeline.serve.request import Request, SamplingParams, fork_groups
from kiln.pipeline.tasks.chat_data import PromptAnswer
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tasks.rewards import NamedReward, make_reward, score
from kiln.pipeline.tasks.user_reward import Limits, is_file
from kiln.pipeline.train import distributed
from kiln.pipeline.train.curves import Panel
from kiln.pipeline.train.loop import accumulation_steps
from kiln.pipeline.train.params import TrainParams

# The serving engine, each completion with its own seed (rollout batch seed + j): the draws differ from the
# batched generator's that the runs before it sampled with.
ROLLOUT_SAMPLER = "engine, seed + j"
PANELS = [Panel("reward", "mean over the step's completions", {"reward": "train (sampled)",
                                                               "val/reward": "held-out (greedy)"}),
          Panel("held-out greedy pass@1", "share of prompts", {"val/pass@1": "pass@1"}),
          Panel("groups", "share / std", {"frac_reward_zero_std": "groups with one reward",
                                          "groups_informative": "trained groups with a spread (dynamic sampling)",
                                          "reward_std": "reward std"}),
          Panel("completions", "tokens", {"completions/mean_length": "mean length"}),
          Panel("policy", "nats / share", {"entropy": "entropy", "kl": "KL to start (k3)",
                                           "clip_ratio/region_mean": "clipped tokens"}),
          Panel("learning rate", "lr", {"lr": "lr"})]


@dataclass
class Prompts:
    """Prompts as the policy sees them, with what a reward sees: the last user turn's text and the answer."""

    ids: list[list[int]]
    texts: list[str]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def encode_prompts(rows: list[PromptAnswer], chat: ChatFormat, seq_len: int, max_new_tokens: int,
                   what: str) -> Prompts:
    """The rows whose prompt leaves room for max_new_tokens within seq_len (the rest counted and skipped)."""
    out = Prompts([], [], [])
    for row in rows:
        ids = chat.prompt(row.prompt)
        if len(ids) + max_new_tokens - 1 <= seq_len:
            out.ids.append(ids)
            out.texts.append(row.question)
            out.answers.append(row.answer)
    if len(out) < len(rows):
        console.print(f"{what}: skipped {len(rows) - len(out):,} of {len(rows):,} prompts too long for "
                      f"grpo.max_new_tokens={max_new_tokens} within max_seq_len={seq_len}", highlight=False)
    if rows and not len(out):
        raise UserError(f"{what}: no prompt leaves room for grpo.max_new_tokens={max_new_tokens} within "
                        f"max_seq_len={seq_len}")
    return out


WIDTH_BUCKET = 64  # columns: a compiled micro-batch's width is rounded up to a multiple of this


class Rollouts:
    """The loop's micro-batches: scored completions that the policy samples as training goes.

    Micro-batch k belongs to optimizer step k // accum; step s trains on rollout batch s // epochs, sampled when
    its first micro-batch is asked for. A micro-batch is (x, y, advantages, old log-probs, reference log-probs,
    completion tokens of the whole step / (accum x processes)): with that last one the loop's mean over
    micro-batches and ranks is the dapo loss over the step exactly (post/grpo_loss.py, `aggregate`).

    Under torchrun every rank samples and scores the whole rollout batch, with the same seed and the same
    weights, so they all hold the same batch (and an FSDP model's collective forwards stay in step); rank r
    trains on rows [(kW + r)B, (kW + r + 1)B) of it. The sampling is repeated, not split: what is shared is
    the backward and the optimizer step."""

    def __init__(self, model: torch.nn.Module, prompts: Prompts, params: GRPOParams, chat: ChatFormat,
                 reward: NamedReward, precision: str, accum: int, world: World = SINGLE, compiled: bool = False):
        self.model, self.prompts, self.params, self.chat, self.reward = model, prompts, params, chat, reward
        # A micro-batch drops its trailing all-padding columns. Under torch.compile it keeps them up to a multiple
        # of WIDTH_BUCKET, so the compiled graphs (and kiln's head's chunking) see a few widths, not a new one
        # every micro-batch; eagerly the width is exact, as the DAG's numbers were made.
        self.bucket = WIDTH_BUCKET if compiled else 1
        self.stops = (chat.im_end, chat.eot)  # where a completion ends
        self.precision, self.accum, self.world, self.step = precision, accum, world, 0
        self.per_rollout = params.batch_examples // params.group_size
        self.order = ExampleBatches((torch.arange(len(prompts)),), self.per_rollout, 1, params.seed)
        # The reference is the starting model: with adapters, the policy with them switched off (no second copy);
        # otherwise a frozen copy, weights only.
        self.ref = None
        if params.beta and not is_adapted(model):
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.batch: list[torch.Tensor] | None = None
        self.batch_index = -1
        self.rollout_stats: list[dict] = []
        self.loss_stats: list[dict] = []
        self.current: dict = {}
        self.seconds, self.tokens = 0.0, 0
        self.engine: Engine | None = None  # the stage's one serving engine, built at the first rollout

    def __iter__(self):
        return self

    def __next__(self) -> list[torch.Tensor]:
        opt_step, micro = divmod(self.step, self.accum)
        index = opt_step // self.params.epochs
        if index != self.batch_index:
            self.batch, self.batch_index = self._rollout(index, opt_step + 1), index
        self.step += 1
        B, first = self.params.batch_size, micro * self.world.size + self.world.rank
        x, y, advantages, old, ref, per_micro = self.batch
        rows = slice(first * B, (first + 1) * B)
        width = int((y[rows] != IGNORE).any(dim=0).nonzero().max()) + 1  # trailing all-padding columns dropped
        width = min(-(-width // self.bucket) * self.bucket, y.shape[1])
        old, ref = (t[rows, :width] if t.numel() else t for t in (old, ref))
        return [*self._shared(x[rows, :width], y[rows, :width], rows.start), y[rows, :width], advantages[rows], old,
                ref, per_micro]

    def _shared(self, x: torch.Tensor, y: torch.Tensor, first: int) -> tuple[torch.Tensor, ...]:
        """Completions first, first + 1, ... (rows x, y) as rows of one copy of their prompt and then each of its
        completions there (scoring/rows.py `shared_rows`): x, y, segments, shares, and where each of the separate
        rows' columns is in them."""
        G = self.params.group_size
        groups = [[i - first for i in g] for _, g in itertools.groupby(range(first, first + len(x)),
                                                                          key=lambda i: i // G)]
        shared_x, shared_y, packed, where = shared_rows(x, y, groups, self.chat.pad, self.bucket)
        return shared_x, shared_y, packed.segments, packed.shares, where

    def _rollout(self, index: int, step: int) -> list[torch.Tensor]:
        """Rollout batch `index`: its prompts' groups sampled and scored. With grpo.sampling_rounds > 1 (DAPO's
        dynamic sampling) a group whose completions all got one reward (no advantage: it teaches nothing) is set
        aside and groups of further prompts, drawn by (seed, index, round) from those not yet used, take its
        place, for up to that many rounds; what is still missing then is filled with set-aside groups."""
        started = time.perf_counter()
        p, G = self.params, self.params.group_size
        self.order.step = index
        chosen = next(self.order)[0].tolist()
        used, kept, spare, sampled_tokens, first = set(chosen), [], [], 0, None
        for round_ in range(p.sampling_rounds):
            if round_:
                rng = np.random.default_rng([p.seed, index, round_])
                left = np.setdiff1d(np.arange(len(self.prompts)), sorted(used))
                if not len(left):
                    break
                chosen = rng.choice(left, size=min(self.per_rollout, len(left)), replace=False).tolist()
                used.update(chosen)
            seeds = [p.seed, index] if round_ == 0 else [p.seed, index, round_]  # round 0: as without rounds
            groups = self._sample(chosen, int(np.random.SeedSequence(seeds).generate_state(1)[0]), step)
            sampled_tokens += sum(len(c) for _, completions, _ in groups for c in completions)
            if first is None:
                first = torch.stack([r for _, _, r in groups])
            for group in groups:
                informative = p.sampling_rounds == 1 or bool(group[2].max() > group[2].min())
                (kept if informative else spare).append(group)
            if len(kept) >= self.per_rollout:
                break
        batch = (kept + spare)[:self.per_rollout]
        prompt_ids = [self.prompts.ids[i] for i, _, _ in batch for _ in range(G)]
        completions = [c for _, group, _ in batch for c in group]
        rewards = torch.cat([r for _, _, r in batch])
        advantages = group_advantages(rewards, G, p.scale_rewards).float()
        x, y = completion_rows(prompt_ids, completions, self.chat.pad)
        n_tokens = int((y != IGNORE).sum())
        old = self._score(self.model, x, y) if p.epochs > 1 else torch.zeros(0)
        ref = torch.zeros(0)
        if self.ref is not None:
            ref = self._score(self.ref, x, y)
        elif self.params.beta:
            with adapters_off(self.model):
                ref = self._score(self.model, x, y)
        # reward, reward_std and frac_reward_zero_std are the scheduled prompts' (the first round): what the
        # policy does on the data, comparable with or without dynamic sampling; the trained batch's share of
        # groups that teach something is `groups_informative`.
        trained = rewards.view(-1, G)
        self.current = {"reward": first.mean().item(), "reward_std": first.std(dim=1).mean().item(),
                        "frac_reward_zero_std": (first.std(dim=1) == 0).double().mean().item(),
                        "completions/mean_length": n_tokens / len(completions),
                        "completions/clipped_ratio": float(np.mean([c[-1] not in self.stops for c in completions]))}
        if p.sampling_rounds > 1:
            self.current |= {"groups_informative": (trained.std(dim=1) > 0).double().mean().item(),
                             "sampling_rounds": float(round_ + 1)}
        self.rollout_stats.append(self.current)
        self.seconds += time.perf_counter() - started
        self.tokens += sampled_tokens
        return [x, y, advantages, old, ref, torch.tensor(n_tokens / (self.accum * self.world.size))]

    def _sample(self, chosen: list[int], seed: int, step: int) -> list[tuple[int, list[list[int]], torch.Tensor]]:
        """(prompt index, its group_size completions, their rewards) for each prompt of `chosen`."""
        p, G = self.params, self.params.group_size
        device = next(self.model.parameters()).device
        # On the serving engine: a group is one request and its G - 1 forks, so its prompt is computed once, and a
        # finished completion's place goes to the next at once. Completion j draws with seed + j, whatever else
        # runs.
        requests = [Request(self.prompts.ids[i], SamplingParams(p.max_new_tokens, p.temperature, None, p.top_p,
                                                                seed + j, self.stops))
                    for j, i in enumerate(i for i in chosen for _ in range(G))]
        with autocast(device, self.precision):
            complete(self.model, fork_groups(requests, G), engine=self._engine())
        completions = [r.output for r in requests]
        groups = []
        for j, i in enumerate(chosen):
            group = completions[j * G:(j + 1) * G]
            rows = [(self.prompts.texts[i], self.chat.parse_reply(c), self.prompts.answers[i]) for c in group]
            rewards = score(self.reward, rows, f"grpo step {step}: grpo.data prompt {i}, completions")
            groups.append((i, group, torch.tensor(rewards, dtype=torch.float64)))
        return groups

    def _engine(self) -> Engine:
        """The engine every rollout runs on, the policy's own weights: built once, its cache in the compute dtype
        and holding a rollout batch's groups at the dataset's longest prompt at once, and on CUDA its decode steps
        captured as graphs up to the rollout's width (replays cast the weights as they are then); at each later
        rollout it only forgets its cached prefixes, which the optimizer steps since made stale (TRL's
        `reset_prefix_cache` after it moves the weights to vLLM). An FSDP policy's forward gathers its shards
        with collectives: it decodes eagerly, as every policy does with grpo.enforce_eager."""
        if self.engine is None:
            p, G = self.params, self.params.group_size
            longest = [Request(max(self.prompts.ids, key=len), SamplingParams(p.max_new_tokens)) for _ in range(G)]
            width = 0 if p.enforce_eager or distributed.is_sharded(self.model) else self.per_rollout * G
            self.engine = Engine.sized_for(self.model, fork_groups(longest, G) * self.per_rollout,
                                           dtype=PRECISIONS[self.precision], graph_batch=width)
        else:
            self.engine.reset_prefix_cache()
        return self.engine

    @torch.no_grad()
    def _score(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the completion tokens under `model` (N, W), micro-batch by micro-batch, each
        prompt computed once."""
        device = next(model.parameters()).device
        out = []
        with evaluating(model):
            for i in range(0, len(y), self.params.batch_size):
                with autocast(device, self.precision):
                    rows = slice(i, i + self.params.batch_size)
                    shared = self._shared(x[rows], y[rows], i)
                    out.append(self._token_stats(model, shared, y[rows].to(device)).logp.cpu())
        return torch.cat(out)

    def _token_stats(self, model, shared: tuple[torch.Tensor, ...], y: torch.Tensor) -> TokenStats:
        """Each completion token's log p (at the sampling temperature, as TRL) and entropy, in the separate rows'
        layout of `y`, from one forward of the shared rows."""
        x, ys, segments, shares, where = (t.to(y.device) for t in shared)
        token = model(x, ys, temperature=self.params.temperature, stats=True, packed=Packed(segments, shares))
        return TokenStats(*(separate(t, where, y) for t in token))

    def loss(self, model, batch: list[torch.Tensor]) -> torch.Tensor:
        *shared, y, advantages, old, ref, per_micro = batch
        p = self.params
        token = self._token_stats(model, tuple(shared), y)
        logps, mask = token.logp, (y != IGNORE).float()
        loss, metrics = policy_loss(logps, old if old.numel() else logps.detach(), advantages, mask,
                                    p.epsilon_low, p.epsilon_high, ref if ref.numel() else None, p.beta,
                                    p.loss_type, p.max_new_tokens, per_micro)
        with torch.no_grad():
            metrics["entropy"] = ((token.entropy * mask).sum() / mask.sum().clamp(min=1)).item()
        self.loss_stats.append({k: v for k, v in metrics.items() if k in LOGGED})
        return loss

    def log_metrics(self) -> dict:
        """Means over what was sampled and trained since the last call (the rollout batch in use if none was
        sampled since)."""
        rollouts, losses = self.rollout_stats or [self.current], self.loss_stats
        self.rollout_stats, self.loss_stats = [], []
        out = {k: float(np.mean([s[k] for s in stats])) for stats in (rollouts, losses) if stats for k in stats[0]}
        if losses:  # each rank's own rows: averaged over ranks (the rollouts' are the same on every rank)
            keys = list(losses[0])
            means = distributed.mean(torch.tensor([out[k] for k in keys], dtype=torch.float64,
                                                  device=next(self.model.parameters()).device))
            out |= dict(zip(keys, means.tolist()))
        return out

    def state_dict(self) -> dict:
        # The sampling totals travel with the run, so that a resumed run reports the whole run's rollout speed.
        return {"step": self.step, "seed": self.params.seed, "accum": self.accum, "processes": self.world.size,
                "prompts": len(self.prompts), "rollout_seconds": self.seconds, "rollout_tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.params.seed), ("accum", self.accum), ("processes", self.world.size),
                          ("prompts", len(self.prompts))):
            if state.get(key, 1 if key == "processes" else None) != mine:  # checkpoints before torchrun: 1
                raise UserError(f"resume state: rollouts {key}={state.get(key)!r}, this run has {mine!r}")
        step = int(state["step"])
        if step % (self.accum * self.params.epochs):
            raise UserError(f"resume state: rollouts step {step} is inside a rollout batch; a checkpoint must "
                            "fall where one begins (grpo.checkpoint_every a multiple of grpo.epochs)")
        self.step = step
        self.seconds, self.tokens = float(state.get("rollout_seconds", 0.0)), int(state.get("rollout_tokens", 0))


LOGGED = ("kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy")


def completion_rows(prompt_ids: list[list[int]], completions: list[list[int]],
                    pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x and targets y (N, W) of prompt + completion, right-padded to the longest: y holds the completion
    tokens (its stop token included) at the positions that predict them, -100 elsewhere."""
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completions)) - 1
    x = torch.full((len(completions), width), pad, dtype=torch.long)
    y = torch.full((len(completions), width), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        seq = p + c
        x[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        y[i, len(p) - 1:len(seq) - 1] = torch.tensor(c)
    return x, y


def greedy_rewards(model, prompts: Prompts, chat: ChatFormat, reward: NamedReward, max_new_tokens: int,
                   what: str) -> list[float]:
    """Each prompt's reward for its greedy completion (under the caller's autocast)."""
    requests = [Request(ids, SamplingParams(max_new_tokens, stop_ids=(chat.im_end, chat.eot))) for ids in prompts.ids]
    completions = [r.output for r in complete(model, requests)]
    rows = [(t, chat.parse_reply(c), a) for t, c, a in zip(prompts.texts, completions, prompts.answers)]
    return score(reward, rows, what)


def grpo(params: GRPOParams, train_params: TrainParams, start_dir: Path, tokenizer_path: Path, corpus_dir: Path,
         out_dir: Path, checkpoint_dir: Path, curves_dir: Path | None = None,
         resume_from: Path | None = None) -> dict:
    # a bad reward fails before the model loads
    reward = make_reward(params.reward, params.reward_pattern, timeout=params.reward_timeout,
                         limits=Limits(int(params.reward_memory_gib * 2**30), params.reward_processes))
    s = start(params, train_params, start_dir, tokenizer_path, corpus_dir)
    return run_stage(s, lambda: grpo_stage(params, s, reward, start_dir), out_dir, checkpoint_dir, curves_dir,
                     resume_from)


def grpo_stage(params: GRPOParams, s: Start, reward: NamedReward, start_dir: Path) -> Stage:
    """GRPO's prompts and the rollouts that sample and score completions of them as training goes, its policy
    loss and its held-out greedy rewards."""
    model, loop, chat, seq_len, world = s.model, s.loop, s.chat, s.model.config.max_seq_len, s.world
    prompts = encode_prompts(s.data.train, chat, seq_len, params.max_new_tokens, "grpo train")
    val = encode_prompts(s.data.val, chat, seq_len, params.max_new_tokens, "grpo held-out")
    micro = params.batch_size * seq_len
    rollouts = Rollouts(model, prompts, params, chat, reward, loop.precision,
                        accumulation_steps(loop, micro, world.size), world, compiled=loop.compile)

    def evaluate(m) -> dict:
        if not len(val):
            return {}
        rewards = np.array(greedy_rewards(m, val, chat, reward, params.max_new_tokens, "grpo held-out"))
        return {"val/reward": float(rewards.mean()), "val/pass@1": float((rewards >= 1).mean())}

    def metrics(result: dict, before: dict) -> dict:
        # The loop's tokens count every row as max_seq_len long; what GRPO moves is completions, counted here.
        return {**{k: v for k, v in result.items() if k not in ("tokens", "tokens_per_s")},
                "prompts": len(prompts), "val_prompts": len(val), "start": {k: round(v, 5) for k, v in before.items()},
                "rollout_tokens_per_s": round(rollouts.tokens / rollouts.seconds, 1) if rollouts.seconds else 0.0,
                "generate_share": round(rollouts.seconds / result["seconds"], 4) if result["seconds"] else 0.0}

    data = json.dumps([prompts.ids, prompts.texts, prompts.answers]).encode()
    return Stage(
        name="grpo", loss_fn=rollouts.loss, evaluate=evaluate,
        batches=lambda accum: rollouts,  # built above for these same accumulation steps
        data=hashlib.sha256(data).hexdigest(),
        fingerprint={"grpo": {k: getattr(params, k) for k in ("group_size", "epochs", "temperature", "top_p",
                                                              "max_new_tokens", "epsilon_low", "epsilon_high",
                                                              "beta", "loss_type", "scale_rewards", "reward",
                                                              "reward_pattern")}
                     | {"reward_sha256": reward_sha256(params.reward)},
                     # how rollouts are drawn: a checkpoint of the batched generator's draws is another run's
                     "rollouts": ROLLOUT_SAMPLER},
        micro_batch_tokens=micro,
        summary=f"{len(prompts):,} train and {len(val):,} held-out prompts, {loop.max_steps} steps x "
                f"{rollouts.per_rollout} prompts x {params.group_size} completions, {reward.label}, "
                f"{params.loss_type} loss, from {start_dir}",
        panels=PANELS, title=f"{len(prompts):,} prompts x {params.group_size}", metrics=metrics,
        # The loop counts every row as max_seq_len tokens; a rollout row is a prompt and a short completion,
        # and sampling takes a third of the time: an MFU from those counts would be fiction.
        flops_per_token=0.0, log_metrics=rollouts.log_metrics, show=("reward",),
        suspect=f"The advantages come from {reward.label}: a reward of large magnitude (or unscaled, with "
                "grpo.scale_rewards false) can overflow the loss.")


def reward_sha256(spec: str) -> str | None:
    """sha256 of the file a reward of the user's own (`file.py:function`, `module:function`) is defined in, so
    that a run after the file changed starts afresh; None for kiln's own rewards, which the code digest covers."""
    if ":" not in spec:
        return None
    target = spec.rpartition(":")[0]
    return sha256_file(Path(target) if is_file(target) else module_file(target, spec))


def module_file(name: str, spec: str) -> Path:
    """The file an import of module `name` from sys.path finds, looked up without running its code or its
    packages' (the reward runs in a process of its own, never in the stage's)."""
    found, search = None, None
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        found = importlib.machinery.PathFinder.find_spec(".".join(parts[:i]), search)
        if found is None:
            break
        search = found.submodule_search_locations
    if found is None or not found.has_location:
        raise UserError(f"params: grpo.reward={spec!r}: found no file for module {name!r} to fingerprint the run "
                        "with; name the file instead (path/to/file.py:function)")
    return Path(found.origin)
