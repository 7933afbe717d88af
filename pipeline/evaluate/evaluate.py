"""Stage `evaluate`: every model in `eval.models` measured the same way, side by side in `metrics/eval.json`.

For each model: val loss, perplexity and bits per byte on the first `eval.tokens` of the val shards (the same
tokens for every model, so the numbers compare across models and runs); each task of `eval.tasks` scored as
lm-evaluation-harness does (evaluate/scoring.py); the built-in post-training task's held-out accuracy and the
preference accuracy on the DPO held-out pairs; each generative task of `eval.tasks` (an entry with a `reward`:
greedy pass@1, mean reward and sampled pass@k, evaluate/generative.py); and greedy generations of a few fixed prompts
written to `metrics/samples/<model>.md`. `items` in eval.json counts the items each task scored and
`<task>/too_long` those left out because they do not fit the context window (for a multiple-choice task, an answer
alone; the harness refuses them). `metrics/report.md` (evaluate/report.py) puts it all in one page, each model
against the model it started from.

eval.json is keyed metric first, model second ({"val_bpb": {"base": .., "sft": .., "dpo": ..}}), so that
`dvc metrics show` and `dvc metrics diff` list the models of one metric together. Multiple-choice tasks are
scored on plain text for every model, chat models included, as the harness does by default; the post-training
metrics use the chat format for every model, the base model included (as sft.json reports it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from kiln.model.checkpoint import load_config
from kiln.model.quantize import check_quantize
from kiln.pipeline import layout
from kiln.pipeline.errors import UserError
from kiln.pipeline.evaluate.generative import GenResult, GenTask, load_gen_task, run_gen_task
from kiln.pipeline.evaluate.intervals import Intervals
from kiln.pipeline.evaluate.params import EvalParams, GenTaskSpec
from kiln.pipeline.evaluate.report import report_markdown
from kiln.pipeline.evaluate.scoring import ChoiceTask
from kiln.pipeline.outputs import atomic_write_files, metrics_files, sha256_file
from kiln.pipeline.progress import Progress, console, print_columns
from kiln.pipeline.runtime import autocast, prepare_device
from kiln.pipeline.scoring.answers import PostTrainData, logps
from kiln.pipeline.serve.engine import complete
from kiln.pipeline.serve.text_model import Sampling, TextModel
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tasks.corpus_task import cloze_items
from kiln.pipeline.tasks.tasks import Task, load_task
from kiln.pipeline.text.loader import ShardSet
from kiln.pipeline.train.lm_eval import byte_lengths, evaluate_lm
from kiln.pipeline.train.params import TrainParams

REPORT = "report.md"  # in the metrics folder, beside eval.json
SAMPLES = "samples"  # the folder of <model>.md generations, beside them too


class HeldOutSource(Protocol):
    """Where post-training's held-out data comes from (post/held_out.py `HeldOut`, given by the command): what
    it loads, and the params keys it reads, for the report's digest."""

    def load(self, chat: ChatFormat, seq_len: int, corpus_dir: Path) -> PostTrainData: ...

    def keys(self) -> dict[str, dict]: ...


def starting_models(dirs: dict[str, Path]) -> dict[str, str | None]:
    """Each model's starting model (the folder its metadata's `init` names) when that one is evaluated too."""
    by_path = {path.resolve(): name for name, path in dirs.items()}
    starts = {}
    for name, path in dirs.items():
        init = (load_config(path)[1].get("init") or {}).get("model")
        starts[name] = by_path.get(Path(init).resolve()) if init is not None else None
    return starts


def check_models(params: EvalParams, models_dir: Path) -> dict[str, Path]:
    """Every model folder, checked before any work: a missing one is named, not found after an hour."""
    dirs = {name: Path(models_dir) / name for name in params.models}
    for name, path in dirs.items():
        if not (path / "model.safetensors").is_file():
            raise UserError(f"{path}: no model.safetensors (eval.models names {name!r}; run the stage that makes it)")
        try:
            load_config(path)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
    return dirs


def load_tasks(params: EvalParams, chat: ChatFormat, corpus_dir: Path,
               seq_len: int) -> tuple[dict[str, Task], list[GenTask]]:
    """(multiple-choice tasks by their key `eval.tasks[i]`, generative tasks), each in `eval.tasks` order."""
    tasks, gen_tasks = {}, []
    for i, spec in enumerate(params.task_specs()):
        key = f"eval.tasks[{i}]"
        if isinstance(spec, GenTaskSpec):
            gen_tasks.append(load_gen_task(spec, key, chat, corpus_dir, seq_len, params.seed))
        elif spec.data == "builtin":
            tasks[key] = Task(spec.name, "cloze", cloze_items(corpus_dir, chat, seq_len, spec.limit, params.seed), {})
        else:
            tasks[key] = load_task(spec, key)
    return tasks, gen_tasks


def check_samples(params: EvalParams, lm: TextModel, seq_len: int) -> None:
    """A prompt too long to continue is named before any work rather than after every model is scored."""
    for i, prompt in enumerate(params.samples):
        n = len(lm.tokenizer.encode(prompt).ids)
        if 1 + n + params.max_new_tokens - 1 > seq_len:  # <|endoftext|> first; the last new token is never an input
            raise UserError(f"params: eval.samples[{i}]: {n} tokens + eval.max_new_tokens={params.max_new_tokens} "
                            f"do not fit the models' max_seq_len={seq_len}")


def encode_tasks(tasks: dict[str, Task], gen_tasks: list[GenTask], tokenizer, eot: int,
                 seq_len: int) -> list[ChoiceTask]:
    """Each multiple-choice task's requests, and one line per task saying what will be scored: nothing is printed
    before every task is known to have something to score, so that bad input reads as one line."""
    scorers = [ChoiceTask(tokenizer, eot, task.items, seq_len, task.format == "lambada") for task in tasks.values()]
    too_long = f"an answer is longer than the model's {seq_len}-token context"
    for (key, task), scorer in zip(tasks.items(), scorers):
        if not scorer.items:
            raise UserError(f"{key} {task.name}: in every item {too_long}: nothing to score")
    for (key, task), scorer in zip(tasks.items(), scorers):
        console.print(f"{key} {task.summary()}", highlight=False)
        if scorer.too_long:
            console.print(f"warning: {key} {task.name}: {scorer.too_long:,} of {len(task.items):,} items "
                          f"left out: {too_long} (lm-evaluation-harness refuses them)", highlight=False, soft_wrap=True)
    for task in gen_tasks:
        console.print(f"{task.key} {task.summary()}", highlight=False)
        if task.too_long:
            console.print(f"warning: {task.key} {task.name}: {task.too_long:,} of {task.too_long + len(task.texts):,} "
                          f"prompts left out: no room for {task.key}.max_new_tokens={task.spec.max_new_tokens} "
                          f"within the model's {seq_len}-token context", highlight=False, soft_wrap=True)
    return scorers


def samples_markdown(name: str, model_dir: Path, lm: TextModel, prompts: list[str], sampling: Sampling,
                     chat: ChatFormat | None) -> str:
    """Each prompt and its generation, as markdown; a chat model gets each prompt as a user message. No prompts
    still make the file, one of the stage's declared outputs."""
    how = "greedy" if sampling.temperature == 0 else (f"temperature {sampling.temperature}, top_k {sampling.top_k}, "
                                                      f"top_p {sampling.top_p}, seed {sampling.seed}")
    lines = [f"# Samples: {name} ({model_dir})", "",
             f"{how}, at most {sampling.max_new_tokens} new tokens, "
             + ("each prompt as a user message in the chat format" if chat else "plain continuation"), ""]
    if not prompts:
        return "\n".join([*lines, "No prompts: `eval.samples` is empty.", ""])
    if chat is None:
        outs = lm.complete(prompts, sampling)
    else:
        context = lm.model.config.max_seq_len
        ids = [chat.prompt([{"role": "user", "content": p}])[-(context - 1):] for p in prompts]
        new = min(sampling.max_new_tokens, context + 1 - max(map(len, ids)))
        requests = [sampling.request(p, new, [chat.im_end, chat.eot], i) for i, p in enumerate(ids)]
        complete(lm.model, requests)
        outs = [chat.parse_reply(r.output) for r in requests]
    for i, (prompt, out) in enumerate(zip(prompts, outs), 1):
        lines += [f"## {i}", "", "Prompt:", "", "```text", prompt, "```", "", "Output:", "", "```text", out, "```", ""]
    return "\n".join(lines)


@dataclass
class Plan:
    """What the stage checks and loads before it scores any model, so that bad input fails in seconds."""

    dirs: dict[str, Path]  # each model's folder, in eval.models order
    starts: dict[str, str | None]  # each model's starting model, when evaluated too
    val: ShardSet
    bytes_per_token: torch.Tensor
    device: torch.device
    first: TextModel  # the first model, loaded once for the checks and reused for its own scores
    chat: ChatFormat
    seq_len: int
    tasks: dict[str, Task]
    scorers: list[ChoiceTask]  # one per multiple-choice task
    gen_tasks: list[GenTask]
    post: PostTrainData | None
    sampling: Sampling

    def parts(self) -> int:
        """Progress parts per model: val loss, each task, post-training, samples."""
        return 2 + len(self.tasks) + len(self.gen_tasks) + (self.post is not None)


def plan_evaluation(params: EvalParams, train: TrainParams, held_out: HeldOutSource, shards_dir: Path,
                    tokenizer_path: Path, corpus_dir: Path, models_dir: Path) -> Plan:
    """Every model folder, the tokenizer, the val shards, every task and sample prompt checked and loaded, in the
    order whose first failure is the cheapest to find."""
    dirs = check_models(params, models_dir)
    if not tokenizer_path.is_file():
        raise UserError(f"{tokenizer_path}: tokenizer not found (run `kiln tokenizer train` first)")
    val = ShardSet(shards_dir, "val", tokenizer_sha256=sha256_file(tokenizer_path))
    bytes_per_token = byte_lengths(tokenizer_path)
    device = prepare_device(train)
    check_quantize(params.quantize, device)
    first = TextModel(dirs[params.models[0]], tokenizer_path, device)
    chat = ChatFormat(first.tokenizer)
    seq_len = first.model.config.max_seq_len
    tasks, gen_tasks = load_tasks(params, chat, corpus_dir, seq_len)
    check_samples(params, first, seq_len)
    scorers = encode_tasks(tasks, gen_tasks, first.tokenizer, chat.eot, seq_len)
    starts = starting_models(dirs)
    if params.quantize:  # each quantized copy is compared with its original, item by item
        starts |= {quantized_name(name, params.quantize): name for name in dirs}
    post = held_out.load(chat, seq_len, corpus_dir) if params.posttrain else None
    sampling = Sampling(params.max_new_tokens, params.temperature, params.top_k, params.top_p, params.seed)
    sampling.check()
    return Plan(dirs, starts, val, bytes_per_token, device, first, chat, seq_len, tasks, scorers, gen_tasks, post,
                sampling)


class Scores:
    """What scoring every model gathers: its metrics, its generative tasks' answers, its samples page, and its
    log-probabilities of the preference pairs (the reward accuracy of a model trained from it needs them)."""

    def __init__(self, plan: Plan):
        self.results: dict[str, dict[str, float]] = {}
        self.per_item: dict[str, dict[str, np.ndarray]] = {}  # by model: each item-mean metric's per-item values
        self.answers: list[dict[str, GenResult]] = [{} for _ in plan.gen_tasks]  # per generative task, by model
        self.samples: dict[str, str] = {}
        self.pair_logps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def quantized_name(name: str, kind: str) -> str:
    """The report's name of a model's quantized copy ('+' is never in a model folder's name)."""
    return f"{name}+{kind}"


def score_model(plan: Plan, params: EvalParams, train: TrainParams, name: str, model_dir: Path, tokenizer_path: Path,
                scores: Scores, progress: Progress, quantize: str | None = None) -> None:
    """Score the model in `model_dir` as `name`; `quantize`: a copy of it quantized so (model/quantize.py)."""
    first = model_dir == plan.dirs[params.models[0]] and quantize is None
    lm = plan.first if first else TextModel(model_dir, tokenizer_path, plan.device, quantize)
    model, meta = lm.model.set_kernels(train.kernels), load_config(model_dir)[1]
    if model.config.max_seq_len != plan.seq_len:
        raise UserError(f"{model_dir}: max_seq_len {model.config.max_seq_len}, but {plan.dirs[params.models[0]]} "
                        f"has {plan.seq_len}; eval.models must share one context length")
    torch.manual_seed(params.seed)
    with autocast(plan.device, train.precision):  # once for everything this model computes
        score_parts(plan, params, name, model_dir, lm, model, meta, scores, progress, quantize)


def score_parts(plan: Plan, params: EvalParams, name: str, model_dir: Path, lm: TextModel, model, meta: dict,
                scores: Scores, progress: Progress, quantize: str | None) -> None:
    """score_model's measures, one after the other, each its own progress part."""
    out = scores.results[name] = {}
    per_item = scores.per_item[name] = {}
    progress.advance(0, model=name, part="val loss")
    lm_metrics = evaluate_lm(model, plan.val, plan.bytes_per_token, params.batch_size, plan.seq_len, params.tokens)
    out |= lm_metrics | {"val_ppl": math.exp(lm_metrics["val_loss"])}
    progress.advance(1)
    centred = []
    for task, scorer in zip(plan.tasks.values(), plan.scorers):
        progress.advance(0, part=task.name)
        values, hits = scorer.score(model, params.batch_size)
        out |= {f"{task.name}/{k}": v for k, v in values.items()}
        per_item |= {f"{task.name}/{k}": v for k, v in hits.items()}
        if (level := task_chance(scorer)) is not None and level < 1:
            centred.append((hits["acc"] - level) / (1 - level))
        progress.advance(1)
    if centred:
        per_item["core"] = core_items(centred)
        out["core"] = float(per_item["core"].mean())
    for task, by_model in zip(plan.gen_tasks, scores.answers):
        progress.advance(0, part=task.name)
        by_model[name] = run_gen_task(task, model, plan.chat, bool(meta.get("chat_format")), params.gen_batch_size,
                                      params.seed)
        out |= {f"{task.name}/{k}": v for k, v in by_model[name].metrics.items()}
        per_item |= {f"{task.name}/{k}": v for k, v in by_model[name].per_item.items()}
        progress.advance(1)
    if plan.post is not None:
        progress.advance(0, part="posttrain")
        per_item |= score_posttrain(plan, params, name, model, scores, trained_from=quantize is None)
        out |= {k: float(v.mean()) for k, v in per_item.items() if k.startswith("posttrain/")}
        progress.advance(1)
    progress.advance(0, part="samples")
    scores.samples[name] = samples_markdown(name, model_dir, lm, params.samples, plan.sampling,
                                            plan.chat if meta.get("chat_format") else None)
    progress.advance(1)


def score_posttrain(plan: Plan, params: EvalParams, name: str, model, scores: Scores,
                    trained_from: bool = True) -> dict[str, np.ndarray]:
    """Per item: the built-in task's held-out accuracy, the preference accuracy on DPO's held-out pairs and,
    against the model this one was trained from when that one is evaluated too, DPO's implicit-reward accuracy
    (`trained_from`: not for a quantized copy, which was not trained from its original)."""
    out = {f"posttrain/{k.removeprefix('val_')}": v
           for k, v in plan.post.scorer.hits(model, params.batch_size).items()}
    pc, pr = logps(model, plan.post.pairs, params.batch_size)
    scores.pair_logps[name] = (pc, pr)
    out["posttrain/preference_accuracy"] = (pc > pr).double().numpy()
    if trained_from and plan.starts[name] in scores.pair_logps:
        ic, ir = scores.pair_logps[plan.starts[name]]
        out["posttrain/reward_accuracy"] = ((pc - ic) > (pr - ir)).double().numpy()
    return out


def task_chance(scorer) -> float | None:
    """A multiple-choice task's accuracy by guessing: the mean over its items of 1 / their choices (None for
    LAMBADA's greedy exact match, which has no guess, or a task without items)."""
    if scorer.lambada or not scorer.items:
        return None
    return sum(1 / item.n_choices for item in scorer.items) / len(scorer.items)


def core_items(centred: list[np.ndarray]) -> np.ndarray:
    """CORE (DCLM's aggregate, as nanochat reports it): the mean over the multiple-choice tasks of each one's
    centred accuracy (acc - chance) / (1 - chance), 0 for guessing and 1 for every item right. Given each task's
    per-item centred hits, the per-item values whose plain mean is CORE: task t's n_t items each weigh
    1 / (tasks * n_t), so a bootstrap over the items resamples CORE itself."""
    total = sum(len(c) for c in centred)
    return np.concatenate([c * total / (len(centred) * len(c)) for c in centred])


def chance_levels(plan: Plan, metrics: dict) -> dict[str, float]:
    """What guessing scores on each metric that has such a level: a uniform guess over the vocabulary for the
    losses (bits per byte by the tokens-to-bytes ratio of the scored window, the same for every model), over each
    item's choices for a multiple-choice accuracy, a coin for a preference pair. A generative task's reward is the
    user's: it has none."""
    vocab = plan.first.model.config.vocab_size
    chance = {"val_loss": math.log(vocab), "val_ppl": float(vocab)}
    loss, bpb = metrics.get("val_loss", {}), metrics.get("val_bpb", {})
    if (model := next((m for m in loss if m in bpb and loss[m] > 0), None)) is not None:
        chance["val_bpb"] = math.log(vocab) * bpb[model] / loss[model]
    for task, scorer in zip(plan.tasks.values(), plan.scorers):
        if (level := task_chance(scorer)) is not None:
            chance |= {f"{task.name}/acc": level, f"{task.name}/acc_norm": level}
    chance["core"] = 0.0  # centred: guessing scores 0
    if plan.post is not None:
        if plan.post.scorer.n_choices:
            chance |= {k: 1 / plan.post.scorer.n_choices for k in metrics if k.startswith("posttrain/accuracy")}
        chance |= {"posttrain/preference_accuracy": 0.5, "posttrain/reward_accuracy": 0.5}
    return {k: v for k, v in chance.items() if k in metrics}


# What evaluate reads of train, as dvc.yaml's evaluate stage lists it (the sft and dpo keys: its HeldOutSource's).
READS = {"train": ("device", "precision", "kernels")}


def provenance(params: EvalParams, train: TrainParams, held_out: HeldOutSource, dirs: dict[str, Path]) -> str:
    """The report's line on where it came from: a digest of the params it read and each model's hash. No commit
    id: written inside, it would change the report (a DVC output) at every commit; the commit whose dvc.lock
    records the report's hash is the one."""
    read = {"eval": dataclasses.asdict(params), "train": {k: getattr(train, k) for k in READS["train"]},
            **held_out.keys()}
    digest = hashlib.sha256(json.dumps(read, sort_keys=True, default=str).encode()).hexdigest()[:12]
    models = ", ".join(f"{name} `{sha256_file(path / 'model.safetensors')[:12]}`" for name, path in dirs.items())
    return (f"Made with params digest `{digest}` (sha256 of the `eval` section and the train, sft and dpo keys "
            f"dvc.yaml lists for evaluate, as loaded) from the models {models} (sha256 of model.safetensors, first "
            "12 hex digits); the commit is the one whose dvc.lock holds this file's hash.")


def item_counts(plan: Plan) -> dict[str, int]:
    """How many items each task scored and how many it left out as too long."""
    counts = {}
    for task, scorer in zip(plan.tasks.values(), plan.scorers):
        counts |= {task.name: len(scorer.items), f"{task.name}/too_long": scorer.too_long}
    for task in plan.gen_tasks:
        counts |= {task.name: len(task.texts), f"{task.name}/too_long": task.too_long}
    if plan.post is not None:
        counts |= {"posttrain": len(plan.post.scorer.kinds), "posttrain_pairs": len(plan.post.pairs)}
    return counts


def evaluate(params: EvalParams, train: TrainParams, held_out: HeldOutSource, shards_dir: Path,
             tokenizer_path: Path, corpus_dir: Path, models_dir: Path = layout.MODELS,
             metrics_dir: Path | None = None) -> dict:
    """Score every model of eval.models; eval.json, report.md and samples/<model>.md go to `metrics_dir` (the
    stage's metrics/, or a hand run's)."""
    metrics_dir = layout.metrics_dir() if metrics_dir is None else Path(metrics_dir)
    samples_dir = metrics_dir / SAMPLES
    with Progress("eval: checking the models and loading every task"):
        p = plan_evaluation(params, train, held_out, shards_dir, tokenizer_path, corpus_dir, models_dir)
    scores = Scores(p)
    # every model, each followed by its quantized copy when eval.quantize asks for one
    kinds = [None, params.quantize] if params.quantize else [None]
    runs = [(name if kind is None else quantized_name(name, kind), model_dir, kind)
            for name, model_dir in p.dirs.items() for kind in kinds]
    with Progress("eval", unit="parts", total=len(runs) * p.parts()) as progress:
        for name, model_dir, quantize in runs:
            score_model(p, params, train, name, model_dir, tokenizer_path, scores, progress, quantize)
    for task, scorer in zip(p.tasks.values(), p.scorers):
        console.print(f"{task.name}: {len(scorer.items):,} items scored"
                      + (f", {sum(task.skipped.values()):,} rows skipped" if task.skipped else ""), highlight=False)
    metrics = report(scores.results) | {"items": item_counts(p)}
    intervals = Intervals(scores.per_item, p.starts, params.seed)
    names = [name for name, _, _ in runs]
    page = report_markdown(metrics, names, p.starts, list(zip(p.gen_tasks, scores.answers)), intervals,
                           SAMPLES, chance_levels(p, metrics), provenance(params, train, held_out, p.dirs))
    # the samples, the report and the metrics land together or not at all (a full disk once left new samples
    # beside an old report)
    atomic_write_files({**{samples_dir / f"{name}.md": text.encode("utf-8") for name, text in scores.samples.items()},
                        metrics_dir / REPORT: page.encode("utf-8"), **metrics_files("eval", metrics, metrics_dir)})
    print_table(scores.results, names, intervals)
    return metrics


def report(results: dict[str, dict[str, float]]) -> dict:
    """{model: {metric: value}} -> {metric: {model: value}}, metrics in first-seen order, rounded."""
    metrics: dict[str, dict[str, float]] = {}
    for name, values in results.items():
        for key, value in values.items():
            metrics.setdefault(key, {})[name] = round(value, 5)
    return metrics


def print_table(results: dict[str, dict[str, float]], names: list[str], intervals: Intervals) -> None:
    """Every metric of every model in aligned columns, never cut or wrapped (a log keeps whole lines), with the
    95% interval of those that are a mean over items."""
    rows = [["metric", *names]] + [[key, *(f"{row[n]:.4f}{intervals.shown(n, key)}" if n in row else "-"
                                           for n in names)] for key, row in report(results).items()]
    print_columns("eval: every metric, [low, high] its 95% bootstrap interval over items", rows)
