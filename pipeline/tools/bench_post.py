"""`kiln bench post`: post-training's layouts side by side in one run: SFT's padded rows against its packed rows,
and GRPO's training pass with a row per completion against a row per group (its prompt once, then its samples).

The examples are real chat data (`--data`, repeatable: files or hf: datasets in any of SFT's formats, or GSM8K's
question/answer rows as one exchange each), rendered with the DAG's tokenizer at a context of
`--seq-len`. Each row trains a copy of the same freshly initialised model (the `model` section's shape at that
context) for `--steps` micro-batches of `--batch-size` rows after `--warmup` untimed ones: forward, backward and
AdamW, SFT's own weighted loss (post/sft_loss.py `masked_loss`). What a layout is worth is the real tokens it moves:
non-pad tokens/s; peak memory is the device's (CUDA only; a CPU has no allocator
statistics).

GRPO's rows are groups of `--group-size` completions of the data's prompts (the examples up to their answer), each
completion `--completion-tokens` random tokens at most, and each layout runs the same micro-batches of
`--batch-size` completions: the loss is their summed log-probability (what GRPO's surrogate weighs), timed as
completion tokens/s.

Equal work is checked, not assumed: the first `--check` examples' summed answer-token loss at the initial weights,
computed in each layout, must agree (they are the same sums, arranged differently), and the table shows both.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from kiln.model.gpt import GPT
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.post.common import rendered_of
from kiln.pipeline.post.sft_loss import masked_loss
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.scoring.answers import answer_logps, shared_answer_logps
from kiln.pipeline.scoring.rows import IGNORE, shared_rows, to_rows
from kiln.pipeline.tasks.chat_data import load_conversations, load_prompts
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.text.bpe import load_tokenizer
from kiln.pipeline.tools.bench_train import resolve_device, synchronize
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.train.params import ModelParams

LAYOUTS = ("padded", "packed")
GRPO_LAYOUTS = ("separate", "shared")


def load_examples(spec: str, limit: int | None) -> list[list[dict]]:
    """A file's conversations: SFT's formats by their columns, or a prompt/answer file (GSM8K's question and
    worked answer) as one user turn and its answer."""
    try:
        return load_conversations(spec, "auto", max_rows=limit, key="--data")
    except UserError as sft_error:
        try:
            rows = load_prompts(spec, "auto", max_rows=limit, key="--data")
        except UserError:
            raise sft_error from None
    return [[*r.prompt, {"role": "assistant", "content": r.answer}] for r in rows]


def layout_rows(rendered: list, seq_len: int, pad: int, layout: str) -> tuple[torch.Tensor, ...]:
    """SFT's batch tensors for a layout: (x, y, row weights[, segments])."""
    rows = to_rows(rendered, seq_len, pad, f"bench post {layout}", packing=layout == "packed")
    return rows[0], rows[1], torch.ones(len(rows[0])), *rows[2:]


def micro_batches(rows: tuple[torch.Tensor, ...], batch_size: int, count: int, seed: int):
    """`count` micro-batches of `batch_size` rows, drawn without replacement in a seeded order (repeating when the
    rows run out), each with its weighted target count as `masked_loss` divides by."""
    order = torch.cat([torch.randperm(len(rows[0]), generator=torch.Generator().manual_seed(seed + e))
                       for e in range(-(-count * batch_size // len(rows[0])))])
    for k in range(count):
        pick = order[k * batch_size:(k + 1) * batch_size]
        batch = [t[pick] for t in rows]
        yield [*batch, (batch[1] != IGNORE).sum().double()]


@torch.no_grad()
def summed_loss(model: GPT, rows: tuple[torch.Tensor, ...], batch_size: int, device: torch.device) -> float:
    """The rows' answer-token losses summed, at the model's weights: the same for any layout of the same examples."""
    total = 0.0
    for i in range(0, len(rows[0]), batch_size):
        batch = [t[i:i + batch_size].to(device) for t in rows]
        total += masked_loss(model, [*batch, torch.tensor(1.0)]).item()
    return total


def timed(template: GPT, batches, loss_fn, counted, warmup: int, device: torch.device,
          progress: Progress) -> tuple[float, int, float | None]:
    """(seconds, what `counted` counts, peak GB on CUDA) of training a copy of `template` on `batches` after
    `warmup` of them: `loss_fn(model, batch)`, backward, AdamW."""
    model = copy.deepcopy(template).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    total = 0
    start = time.perf_counter()
    for k, batch in enumerate(batches):
        if k == warmup:
            synchronize(device)
            start, total = time.perf_counter(), 0
        batch = [t.to(device) for t in batch]
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total += counted(batch)
        progress.advance(1)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return time.perf_counter() - start, total, None if peak is None else round(peak, 3)


def time_layout(template: GPT, rows: tuple[torch.Tensor, ...], pad: int, batch_size: int, steps: int, warmup: int,
                seed: int, device: torch.device, progress: Progress) -> dict:
    seconds, real, peak = timed(template, micro_batches(rows, batch_size, warmup + steps, seed), masked_loss,
                                lambda batch: int((batch[0] != pad).sum()), warmup, device, progress)
    return {"rows": len(rows[0]), "seconds": round(seconds, 3), "non_pad_tokens": real,
            "non_pad_tokens_per_s": round(real / seconds, 1),
            "fill": round(float((rows[0] != pad).double().mean()), 4), "peak_memory_gb": peak}


def grpo_batches(rendered: list, seq_len: int, pad: int, vocab: int, group: int, completion_tokens: int,
                 batch_size: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` micro-batches of `batch_size` completions, `group` to a prompt (the examples' prompts that leave
    room for a completion), each completion 1..`completion_tokens` random tokens: separate rows x, y (targets on
    the completion), as GRPO's rollouts make them."""
    prompts = [r.ids[:r.mask.index(1)] for r in rendered if 1 in r.mask]
    prompts = [p for p in prompts if 1 < len(p) <= seq_len - completion_tokens]
    if not prompts:
        raise UserError(f"--data: no prompt leaves room for --completion-tokens {completion_tokens} within "
                        f"--seq-len {seq_len}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        sequences = []
        for _ in range(-(-batch_size // group)):
            prompt = prompts[rng.integers(len(prompts))]
            sequences += [(prompt, rng.integers(0, vocab, rng.integers(1, completion_tokens + 1)).tolist())
                          for _ in range(group)]
        sequences = sequences[:batch_size]
        width = max(len(p) + len(c) for p, c in sequences) - 1
        x = torch.full((len(sequences), width), pad, dtype=torch.long)
        y = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
        for i, (p, c) in enumerate(sequences):
            x[i, :len(p) + len(c) - 1] = torch.tensor((p + c)[:-1])
            y[i, len(p) - 1:len(p) + len(c) - 1] = torch.tensor(c)
        out.append((x, y))
    return out


def grpo_layout(batches: list, layout: str, group: int, pad: int):
    """The micro-batches as a layout runs them: separate rows (x, y), or shared rows (x, y, segments, shares,
    where, the separate targets)."""
    for x, y in batches:
        if layout == "separate":
            yield [x, y]
            continue
        groups = [list(range(i, min(i + group, len(x)))) for i in range(0, len(x), group)]
        shared_x, shared_y, packed, where = shared_rows(x, y, groups, pad)
        yield [shared_x, shared_y, packed.segments, packed.shares, where, y]


def grpo_loss(model, batch: list[torch.Tensor]) -> torch.Tensor:
    """Minus the completions' summed log-probability, per completion token."""
    y = batch[-1] if len(batch) > 2 else batch[1]
    logps = answer_logps(model, *batch) if len(batch) == 2 else shared_answer_logps(model, batch[:5], y)
    return -logps.sum() / (y != IGNORE).sum()


def time_grpo(template: GPT, batches: list, layout: str, group: int, pad: int, warmup: int, device: torch.device,
              progress: Progress) -> dict:
    seconds, targets, peak = timed(template, grpo_layout(batches, layout, group, pad), grpo_loss,
                                   lambda batch: int((batch[-1] != IGNORE).sum()), warmup, device, progress)
    forward = sum(int((b[0] != pad).sum()) for b in grpo_layout(batches[warmup:], layout, group, pad))
    return {"forward_tokens": forward, "seconds": round(seconds, 3), "completion_tokens": targets,
            "completion_tokens_per_s": round(targets / seconds, 1), "peak_memory_gb": peak}


def median_run(runs: list[dict], key: str) -> dict:
    """The run of median `key`, with every run's `key` beside it."""
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2] | {f"{key}_runs": [r[key] for r in runs]}


def ratios(runs: dict[str, list[dict]], a: str, b: str, key: str, name: str) -> dict:
    """a's `key` over b's, repeat by repeat (the two ran back to back): the median, and every repeat's."""
    each = sorted(round(x[key] / y[key], 3) for x, y in zip(runs[a], runs[b]))
    return {name: each[(len(each) - 1) // 2], f"{name}_runs": each}


def bench_post(model_params: ModelParams, data: list[str], tokenizer_path: Path, seq_len: int, batch_size: int,
               steps: int, warmup: int, check: int, max_examples: int | None, device_name: str, out: Path,
               group_size: int = 8, completion_tokens: int = 64, repeats: int = 3, seed: int = 0) -> dict:
    for option, value in (("--seq-len", seq_len), ("--batch-size", batch_size), ("--steps", steps),
                          ("--check", check), ("--group-size", group_size), ("--completion-tokens", completion_tokens),
                          ("--repeats", repeats)):
        if value < 1:
            raise UserError(f"{option} {value}: expected a positive integer")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: expected an integer >= 0")
    if not data:
        raise UserError("--data: expected at least one chat data file")
    device = resolve_device(device_name)
    chat = ChatFormat(load_tokenizer(tokenizer_path, ordinary=True))
    conversations = [c for spec in data for c in load_examples(spec, max_examples)]
    rendered = rendered_of(conversations, chat, seq_len, "bench post")
    vocab = load_tokenizer(tokenizer_path).get_vocab_size()
    grpo = grpo_batches(rendered, seq_len, chat.pad, vocab, group_size, completion_tokens, batch_size,
                        warmup + steps, seed)
    torch.manual_seed(seed)
    template = GPT(model_params.config(vocab, max_seq_len=seq_len))
    checked = rendered[:check]
    result = {"machine": machine(), "device": str(device), "data": data, "examples": len(rendered),
              "seq_len": seq_len, "batch_size": batch_size, "steps": steps, "check": len(checked),
              "model_params": template.num_params(), "group_size": group_size,
              "completion_tokens": completion_tokens, "repeats": repeats, "rows": {}, "grpo": {}}
    with Progress("bench post", total=repeats * (len(LAYOUTS) + len(GRPO_LAYOUTS)) * (steps + warmup)) as progress:
        sft_runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
        grpo_runs: dict[str, list[dict]] = {layout: [] for layout in GRPO_LAYOUTS}
        for repeat in range(repeats):  # the layouts take turns going first: a drifting machine favours neither
            for layout in LAYOUTS[::1 - 2 * (repeat % 2)]:
                sft_runs[layout].append(time_layout(template, layout_rows(rendered, seq_len, chat.pad, layout),
                                                    chat.pad, batch_size, steps, warmup, seed, device, progress))
            for layout in GRPO_LAYOUTS[::1 - 2 * (repeat % 2)]:
                grpo_runs[layout].append(time_grpo(template, grpo, layout, group_size, chat.pad, warmup, device,
                                                   progress))
    model = template.to(device).eval()
    for layout, runs in sft_runs.items():
        result["rows"][layout] = median_run(runs, "non_pad_tokens_per_s") | {
            "check_loss": summed_loss(model, layout_rows(checked, seq_len, chat.pad, layout), batch_size, device)}
    for layout, runs in grpo_runs.items():
        result["grpo"][layout] = median_run(runs, "completion_tokens_per_s") | {
            "check_loss": sum(grpo_loss(model, [t.to(device) for t in b]).item()
                              for b in grpo_layout(grpo[:1], layout, group_size, chat.pad))}
    result |= ratios(sft_runs, "packed", "padded", "non_pad_tokens_per_s", "packed_over_padded")
    result |= ratios(grpo_runs, "shared", "separate", "completion_tokens_per_s", "shared_over_separate")
    padded, packed = result["rows"]["padded"], result["rows"]["packed"]
    result["check_relative_difference"] = abs(packed["check_loss"] - padded["check_loss"]) / abs(padded["check_loss"])
    separate, shared = result["grpo"]["separate"], result["grpo"]["shared"]
    result["grpo_check_relative_difference"] = abs(shared["check_loss"] - separate["check_loss"]) / abs(
        separate["check_loss"])
    write_json(out, result)
    _print(result)
    return result


def _print(result: dict) -> None:
    table = Table(title=f"SFT layouts: {result['examples']:,} examples at {result['seq_len']} tokens, "
                        f"{result['batch_size']} rows x {result['steps']} micro-batches, {result['device']}, median "
                        f"of {result['repeats']} repeats (packed/padded each: {result['packed_over_padded_runs']})")
    for column in ("layout", "rows", "fill", "non-pad tok/s", "x padded (median of repeats)", "peak GB",
                   f"summed loss, first {result['check']} examples"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for name, row in result["rows"].items():
        table.add_row(name, f"{row['rows']:,}", f"{row['fill']:.1%}", f"{row['non_pad_tokens_per_s']:,.0f}",
                      f"{result['packed_over_padded'] if name == 'packed' else 1:.2f}x",
                      "-" if row["peak_memory_gb"] is None else f"{row['peak_memory_gb']:.3g}",
                      f"{row['check_loss']:.6g}")
    console.print(table)
    table = Table(title=f"GRPO's training pass: groups of {result['group_size']} completions of up to "
                        f"{result['completion_tokens']} tokens, {result['batch_size']} completions x "
                        f"{result['steps']} micro-batches (shared/separate each repeat: "
                        f"{result['shared_over_separate_runs']})")
    for column in ("layout", "forward tokens", "completion tok/s", "x separate (median of repeats)", "peak GB",
                   "loss, first batch"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for name, row in result["grpo"].items():
        table.add_row(name, f"{row['forward_tokens']:,}", f"{row['completion_tokens_per_s']:,.0f}",
                      f"{result['shared_over_separate'] if name == 'shared' else 1:.2f}x",
                      "-" if row["peak_memory_gb"] is None else f"{row['peak_memory_gb']:.3g}",
                      f"{row['check_loss']:.6g}")
    console.print(table)
