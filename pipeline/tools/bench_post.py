"""`kiln bench post`: post-training's layouts side by side in one run: SFT's padded rows against its packed rows.

The examples are real chat data (`--data`, repeatable: files or hf: datasets in any of SFT's formats, or GSM8K's
question/answer rows as one exchange each), rendered with the DAG's tokenizer at a context of
`--seq-len`. Each row trains a copy of the same freshly initialised model (the `model` section's shape at that
context) for `--steps` micro-batches of `--batch-size` rows after `--warmup` untimed ones: forward, backward and
AdamW, SFT's own weighted loss (post/sft_loss.py `masked_loss`). What a layout is worth is the real tokens it moves:
non-pad tokens/s; peak memory is the device's (CUDA only; a CPU has no allocator
statistics).

Equal work is checked, not assumed: the first `--check` examples' summed answer-token loss at the initial weights,
computed in each layout, must agree (they are the same sums, arranged differently), and the table shows both.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from rich.table import Table

from kiln.model.gpt import GPT
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.post.common import rendered_of
from kiln.pipeline.post.sft_loss import masked_loss
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.scoring.rows import IGNORE, to_rows
from kiln.pipeline.tasks.chat_data import load_conversations, load_prompts
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.text.bpe import load_tokenizer
from kiln.pipeline.tools.bench_train import resolve_device, synchronize
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.train.params import ModelParams

LAYOUTS = ("padded", "packed")


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


def time_layout(template: GPT, rows: tuple[torch.Tensor, ...], pad: int, batch_size: int, steps: int, warmup: int,
                seed: int, device: torch.device, progress: Progress) -> dict:
    model = copy.deepcopy(template).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    real = 0
    start = time.perf_counter()
    for k, batch in enumerate(micro_batches(rows, batch_size, warmup + steps, seed)):
        if k == warmup:
            synchronize(device)
            start, real = time.perf_counter(), 0
        batch = [t.to(device) for t in batch]
        masked_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        real += int((batch[0] != pad).sum())
        progress.advance(1)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {"rows": len(rows[0]), "seconds": round(seconds, 3), "non_pad_tokens": real,
            "non_pad_tokens_per_s": round(real / seconds, 1),
            "fill": round(float((rows[0] != pad).double().mean()), 4),
            "peak_memory_gb": None if peak is None else round(peak, 3)}


def bench_post(model_params: ModelParams, data: list[str], tokenizer_path: Path, seq_len: int, batch_size: int,
               steps: int, warmup: int, check: int, max_examples: int | None, device_name: str, out: Path,
               seed: int = 0) -> dict:
    for option, value in (("--seq-len", seq_len), ("--batch-size", batch_size), ("--steps", steps),
                          ("--check", check)):
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
    torch.manual_seed(seed)
    template = GPT(model_params.config(load_tokenizer(tokenizer_path).get_vocab_size(), max_seq_len=seq_len))
    checked = rendered[:check]
    result = {"machine": machine(), "device": str(device), "data": data, "examples": len(rendered),
              "seq_len": seq_len, "batch_size": batch_size, "steps": steps, "check": len(checked),
              "model_params": template.num_params(), "rows": {}}
    with Progress("bench post", total=len(LAYOUTS) * (steps + warmup)) as progress:
        for layout in LAYOUTS:
            row = time_layout(template, layout_rows(rendered, seq_len, chat.pad, layout), chat.pad, batch_size,
                              steps, warmup, seed, device, progress)
            row["check_loss"] = summed_loss(template.to(device).eval(), layout_rows(checked, seq_len, chat.pad,
                                                                                  layout), batch_size, device)
            result["rows"][layout] = row
    padded, packed = result["rows"]["padded"], result["rows"]["packed"]
    result["packed_over_padded"] = round(packed["non_pad_tokens_per_s"] / padded["non_pad_tokens_per_s"], 3)
    result["check_relative_difference"] = abs(packed["check_loss"] - padded["check_loss"]) / abs(padded["check_loss"])
    write_json(out, result)
    _print(result)
    return result


def _print(result: dict) -> None:
    table = Table(title=f"SFT layouts: {result['examples']:,} examples at {result['seq_len']} tokens, "
                        f"{result['batch_size']} rows x {result['steps']} micro-batches, {result['device']}")
    for column in ("layout", "rows", "fill", "non-pad tok/s", "x padded", "peak GB",
                   f"summed loss, first {result['check']} examples"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    base = result["rows"]["padded"]["non_pad_tokens_per_s"]
    for name, row in result["rows"].items():
        table.add_row(name, f"{row['rows']:,}", f"{row['fill']:.1%}", f"{row['non_pad_tokens_per_s']:,.0f}",
                      f"{row['non_pad_tokens_per_s'] / base:.2f}x",
                      "-" if row["peak_memory_gb"] is None else f"{row['peak_memory_gb']:.3g}",
                      f"{row['check_loss']:.6g}")
    console.print(table)
