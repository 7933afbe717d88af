"""`kiln bench shard`: the tokenizer backends `kiln data shard` can use, timed side by side on one slice of the
corpus, printed as a table and saved as JSON, with whether each gives the baseline's ids."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rich.table import Table

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.text.bpe import batch_encoder, load_tokenizer
from kiln.pipeline.text.corpus import iter_texts
from kiln.pipeline.tools.machine import machine


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_shard(corpus: Path, tokenizer: Path, split: str, max_mb: float, out: Path, repeats: int = 3) -> dict:
    path = corpus / f"{split}.parquet"
    if not path.is_file():
        raise UserError(f"{path}: corpus split not found (run `kiln data prepare` first)")
    texts, size = [], 0
    for batch in iter_texts(path):
        for text in batch:
            if size >= max_mb * 1e6:
                break
            texts.append(text)
            size += len(text.encode("utf-8"))
    hf = load_tokenizer(tokenizer, ordinary=True)
    hf_batch, ours = batch_encoder(tokenizer, "hf"), batch_encoder(tokenizer, "tiktoken")
    candidates = {
        "hf Tokenizer.encode loop, 1 process (baseline)": lambda: [hf.encode(t).ids for t in texts],
        "hf encode_batch_fast, all cores (shard.backend=hf)": lambda: hf_batch(texts),
        "tiktoken from our merges, all cores (shard.backend=tiktoken)": lambda: ours(texts),
    }
    rows, reference = [], None
    for name, fn in candidates.items():
        seconds, ids = timed(fn, repeats)
        ids = [list(x) for x in ids]
        reference = reference or ids
        rows.append({"method": name, "seconds": round(seconds, 4), "mb_per_s": round(size / 1e6 / seconds, 3),
                     "identical_ids": ids == reference})
    base = rows[0]["seconds"]
    for row in rows:
        row["speedup"] = round(base / row["seconds"], 2)
    table = Table(title=f"sharding throughput: {size / 1e6:.2f} MB of {path}, median of {repeats}, "
                        f"{os.cpu_count()} cores")
    for col in ("method", "seconds", "MB/s", "speedup", "same ids"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["method"], f"{row['seconds']:.3f}", f"{row['mb_per_s']:.2f}", f"{row['speedup']:.2f}x",
                      str(row["identical_ids"]))
    console.print(table)
    result = {"benchmark": "shard", "text_mb": round(size / 1e6, 3), "documents": len(texts), "repeats": repeats,
              "machine": machine(), "results": rows}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result
