"""`kiln bench data`: throughput per core and peak memory of the data stages (prepare, tokenizer, shard) at two
or more corpus sizes, to say what a large corpus will cost and to show that memory does not grow with it.

The corpus at scale k is Shakespeare's documents k times over, one jsonl file per play and copy (the units
`prepare` spreads over its workers); copy i > 0 prefixes each text with `[copy i]`, so no document is a
duplicate and each copy falls on its own side of the split. Each stage runs as its own `kiln` command in a
child process, measured from outside:
- wall seconds: the stage's own timing (metrics/timings/<stage>.json: `seconds`, the tokenizer's
  `train_seconds`), which leaves out the start-up;
- CPU seconds: those of the child (every thread: the BPE trainer's, tiktoken's) and of its descendants
  (prepare's forkserver and workers), read from /proc every 20 ms (the last moments of each may be missed,
  more on a busy machine; prepare's workers are idle in theirs), less what a child that only imports the
  stage's modules spends. Throughput per core is MB per CPU second, which a busy machine changes far less
  than MB per wall second;
- peak memory: the largest RSS high-water mark (the kernel's VmHWM) among the child and its descendants, and
  its growth over what the imports alone hold.
It reads /proc, so it runs on Linux.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.tools.machine import machine

POLL_S = 0.02
# Each stage: its command (run in the scale's folder, on the params file) and the module it spends its time in.
# They are hand runs into one folder, RUN: its corpus/, tokenizer/, shards/, metrics/ and checkpoints/.
RUN = "run"
COMMANDS = {
    "prepare": (["data", "prepare", "--out", RUN], "kiln.pipeline.text.prepare"),
    "tokenizer": (["tokenizer", "train", "--corpus", f"{RUN}/corpus", "--out", RUN], "kiln.pipeline.text.tokenizer"),
    "shard": (["data", "shard", "--corpus", f"{RUN}/corpus", "--tokenizer", f"{RUN}/tokenizer/tokenizer.json",
               "--out", RUN], "kiln.pipeline.text.shard"),
}
STAGES = tuple(COMMANDS)


def write_corpus(folder: Path, scale: int, max_mb: float | None) -> int:
    """Shakespeare's documents `scale` times (at most `max_mb` MB of them per copy) as jsonl, one file per play
    and copy; returns the bytes of text written."""
    from kiln.pipeline.text.sources import DecodeStats, shakespeare_units

    folder.mkdir(parents=True)
    plays, size = [], 0
    for unit in shakespeare_units():
        texts = []
        for doc in unit.documents("text", "strict", DecodeStats()):
            if max_mb is not None and size + len(doc.text.encode()) > max_mb * 1e6:
                break
            texts.append(doc.text)
            size += len(doc.text.encode())
        if texts:
            plays.append(texts)
    written = 0
    for copy in range(scale):
        prefix = f"[copy {copy}] " if copy else ""
        for p, texts in enumerate(plays):
            lines = [json.dumps({"text": prefix + text}) + "\n" for text in texts]
            (folder / f"copy{copy:03d}_play{p:02d}.jsonl").write_text("".join(lines), encoding="utf-8")
            written += sum(len((prefix + text).encode()) for text in texts)
    return written


# --- measuring a command --------------------------------------------------------------------------------------


def high_water_mark(pid: int) -> int:
    """The most RSS the process has held (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


@dataclass
class Usage:
    cpu_seconds: float
    peak_rss_mb: float  # of the largest process
    processes: int
    output: str = ""


@dataclass
class Tree:
    """A process and its descendants, sampled: the CPU seconds and RSS high-water mark each reached."""

    pid: int
    cpu: dict[int, float] = field(default_factory=dict)
    hwm: dict[int, int] = field(default_factory=dict)

    def sample(self) -> None:
        todo, tick = [self.pid], os.sysconf("SC_CLK_TCK")
        while todo:
            pid = todo.pop()
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                self.cpu[pid] = (int(stat[11]) + int(stat[12])) / tick  # utime + stime
                self.hwm[pid] = max(self.hwm.get(pid, 0), high_water_mark(pid))
                todo += children(pid)
            except (OSError, IndexError, ValueError):  # it ended, or became a zombie, while being read
                continue


def run_measured(argv: list[str], cwd: Path) -> Usage:
    """Run `argv` in `cwd` and measure it with its descendants; a failure is reported with its last line."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        tree, done = Tree(proc.pid), threading.Event()

        def poll():
            while not done.wait(POLL_S):
                tree.sample()

        sampler = threading.Thread(target=poll)
        sampler.start()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped: /proc still has its CPU
        done.set()
        sampler.join()
        tree.sample()
        proc.wait()
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        last = output.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        error = UserError if proc.returncode == UserError.exit_code else StageError
        raise error(f"kiln bench data: {' '.join(argv[3:5])}: {last[0]}")
    # Both from /proc alone: wait4's CPU would count again the descendants the child waited for, and its
    # ru_maxrss starts from this process's RSS, which the child shared until it ran exec.
    return Usage(sum(tree.cpu.values()), max(tree.hwm.values(), default=0) / 1e6, max(len(tree.cpu), 1), output)


def kiln(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiln.pipeline.cli", *args]


# --- the benchmark --------------------------------------------------------------------------------------------


def measure_stage(stage: str, params: Path, source: Path, root: Path, imports: Usage) -> dict:
    args, _ = COMMANDS[stage]
    extra = ["--set", f"data.source={source}"] if stage == "prepare" else []
    usage = run_measured(kiln(*args, "--params", str(params), *extra), root)
    timings = json.loads((root / RUN / "metrics/timings" / f"{stage}.json").read_text())
    results = json.loads((root / RUN / "metrics" / f"{stage}.json").read_text())[stage]
    if stage == "prepare":
        docs = results["train_documents"] + results["val_documents"]
        mb, what = (results["train_bytes"] + results["val_bytes"]) / 1e6, f"{docs:,} docs"
    elif stage == "tokenizer":
        mb, what = results["train_chars"] / 1e6, f"{results['train_chars']:,} characters sampled"
    else:
        mb, what = results["text_mb"], f"{results['train_tokens'] + results['val_tokens']:,} tokens"
    seconds = timings["train_seconds" if stage == "tokenizer" else "seconds"]
    cpu = max(usage.cpu_seconds - imports.cpu_seconds, 1e-3)
    return {"stage": stage, "mb": round(mb, 3), "what": what, "seconds": seconds, "cpu_seconds": round(cpu, 3),
            "mb_per_s": round(mb / max(seconds, 1e-3), 3), "mb_per_cpu_s": round(mb / cpu, 3),
            "peak_rss_mb": round(usage.peak_rss_mb, 1),
            "growth_mb": round(usage.peak_rss_mb - imports.peak_rss_mb, 1), "processes": usage.processes}


def bench_data(params: Path, scales: list[int], max_mb: float | None, out: Path) -> dict:
    if not Path("/proc/self/task").is_dir():
        raise UserError("kiln bench data reads memory and CPU time from /proc, which only Linux has")
    if not scales or min(scales) < 1:
        raise UserError(f"--scales {','.join(map(str, scales))}: expected positive integers, e.g. 1,8")
    if max_mb is not None and not 0 < max_mb < float("inf"):
        raise UserError(f"--max-mb {max_mb}: expected a positive number of MB")
    if not params.is_file():
        raise UserError(f"{params}: params file not found")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-data-") as tmp:
        # What starting Python and importing a stage costs, to take away from each stage's measure.
        imports = {stage: run_measured([sys.executable, "-c", f"import kiln.pipeline.cli, {module}"], Path(tmp))
                   for stage, (_, module) in COMMANDS.items()}
        for scale in scales:
            root = Path(tmp) / f"x{scale}"
            write_corpus(root / "source", scale, max_mb)
            for stage in STAGES:
                row = measure_stage(stage, params.resolve(), root / "source", root, imports[stage])
                rows.append({"scale": scale, **row})
    table = Table(title=f"data stages on Shakespeare x{', x'.join(map(str, scales))}, {os.cpu_count()} cores, "
                        f"load {os.getloadavg()[0]:.1f}")
    for col in ("stage", "size", "MB", "wall s", "CPU s", "MB/s/core", "peak RSS MB", "growth MB", "procs"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["stage"], f"x{r['scale']}", f"{r['mb']:.2f}", f"{r['seconds']:.2f}",
                      f"{r['cpu_seconds']:.2f}", f"{r['mb_per_cpu_s']:.2f}", f"{r['peak_rss_mb']:.0f}",
                      f"{r['growth_mb']:.0f}", str(r["processes"]))
    console.print(table)
    ratios = {}
    for stage in STAGES:
        at = {r["scale"]: r for r in rows if r["stage"] == stage}
        small, large = at[min(scales)], at[max(scales)]
        ratios[stage] = {"peak_rss": round(large["peak_rss_mb"] / small["peak_rss_mb"], 3),
                         "growth": round(large["growth_mb"] / max(small["growth_mb"], 1.0), 3)}
    console.print(f"x{max(scales)} over x{min(scales)}: " + "; ".join(
        f"{stage} peak RSS {r['peak_rss']:.2f}x, growth {r['growth']:.2f}x" for stage, r in ratios.items()),
        highlight=False)
    result = {"benchmark": "data", "scales": scales, "max_mb_per_copy": max_mb, "machine": machine(),
              "load_average": list(os.getloadavg()),
              "imports": {stage: {"cpu_seconds": round(u.cpu_seconds, 3), "peak_rss_mb": round(u.peak_rss_mb, 1)}
                          for stage, u in imports.items()},
              "results": rows, "largest_over_smallest": ratios}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result
