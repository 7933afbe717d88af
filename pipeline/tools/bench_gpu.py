"""`kiln bench gpu`: everything a GPU session measures, as one command, so that lent GPU minutes go to
measuring rather than to typing commands.

Steps, each a subprocess with its own log and time limit (one that fails or hangs is recorded and the rest
still run):
- env:      GPU name, driver, CUDA, torch/triton/liger versions, SM count (env.json);
- tests:    the kernel and model tests on the device itself: natively on CUDA, at LLM shapes as well as the
            awkward ones (tests.xml, JUnit);
- kernels:  `kiln bench kernels` (kernels.json): ours vs eager vs compile vs Liger vs SDPA, goal per row;
- train:    `kiln bench train` on the GPT-2 124M shape: eager/compile x torch/Triton kernels (train.json);
- pretrain: the real stages (`kiln data prepare`, `tokenizer train`, `data shard`, `train`) on Shakespeare in
            a scratch folder, GPT-2's tokenizer and 124M shape, bf16 + compile + Triton (pretrain/);
- generate: `kiln bench generate` on the 124M shape in bf16 (generate.json).
Everything lands in `--out` (default metrics/bench/gpu/) with summary.json and one log per step.

`--size smoke` runs the same steps at toy shapes on a CPU (kernels through Triton's interpreter), which is how
the suite checks that this command works before a GPU session depends on it. The GPU machine has torch,
triton and the tokenizer stack but no dvc: `make gpu-wheels` builds the wheels it needs, and `make gpu-check`
installs them there and runs this.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.table import Table

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console

REPO = Path(__file__).resolve().parents[2]
SIZES = ("quick", "full", "smoke")
STEPS = ("env", "tests", "kernels", "train", "pretrain", "generate")

# The GPT-2 124M shape (12 layers, 12 heads, d 768, T 1024) as `--set` overrides; the vocabulary is GPT-2's BPE
# (50,257 + kiln's 3 chat tokens, padded to 50,304 by the model).
GPT2_124M = ["model.arch=gpt2", "model.n_layer=12", "model.n_head=12", "model.n_kv_head=12", "model.d_model=768",
             "model.max_seq_len=1024"]
# The stage runs compile with torch's kernels, the best variant measured: on the first H100 run (2026-11-24)
# inductor's tracing of kiln's kernels failed (kernels/BENCHMARKS.md). They now run outside the
# graphs (kernels/backend.py), untimed on a GPU so far, so compile + Triton is timed last, in its own process.
GPU_TRAIN = ["train.device=cuda", "train.precision=bf16", "train.compile=true", "train.kernels=torch"]
TOY = ["model.n_layer=1", "model.n_head=2", "model.n_kv_head=2", "model.d_model=32", "model.max_seq_len=32"]

TESTS = ["tests/test_kernel_rms_norm.py", "tests/test_kernel_swiglu.py", "tests/test_kernel_rope.py",
         "tests/test_kernel_cross_entropy.py", "tests/test_kernel_linear_cross_entropy.py",
         "tests/test_kernel_flash_attention.py", "tests/test_kernel_nf4.py", "tests/test_kernel_paged_attention.py",
         "tests/test_model.py"]

# Seconds each step may take, per size. Quick's steps took ~9 minutes on an H100 in all, its limits allow ~16:
# split it over two 10-minute device calls with `--steps`, and full over three or more.
LIMITS = {"smoke": {"tests": 240, "kernels": 240, "train": 240, "pretrain": 300, "generate": 120},
          "quick": {"tests": 240, "kernels": 150, "train": 200, "pretrain": 200, "generate": 150},
          "full": {"tests": 420, "kernels": 540, "train": 480, "pretrain": 540, "generate": 180}}


@dataclass
class Step:
    name: str
    commands: list[list[str]]  # run in order; the step stops at the first that fails
    cwd: Path = REPO
    collect: dict[str, str] = field(default_factory=dict)  # path under cwd -> name under --out, copied after


def kiln(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiln.pipeline.cli", *args]


def plan(size: str, out: Path, work: Path) -> list[Step]:
    smoke = size == "smoke"
    train_steps = {"smoke": 4, "quick": 100, "full": 300}[size]
    model = TOY if smoke else GPT2_124M
    # The smoke run checks the plumbing (CI runs them all); on a GPU they spread over 8 of the machine's cores
    # (pytest-xdist, in the GPU image and the venv): the kernel tests took 85 s so on the H100.
    tests = ["-k", "torch_backend"] if smoke else ["-n", "8"]
    variants = ("fp32-eager-torch,fp32-eager-triton" if smoke else
                "bf16-eager-torch,bf16-eager-triton,bf16-compile-torch")
    shape = (["--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--warmup", "1"] if smoke
             else ["--vocab-size", "50304", "--batch-size", "16", "--seq-len", "1024", "--steps", "20", "--warmup", "3"])
    data = (["--set", "data.max_bytes=200000"] if smoke else [])
    tokenizer = (["--set", "vocab_size=300"] if smoke else ["--set", "source=gpt2"])
    train = [*model, *(["train.device=cpu", "train.batch_size=4", "train.batch_tokens=128", "train.eval_tokens=1024"]
                       if smoke else
                       [*GPU_TRAIN, "train.batch_size=16", "train.batch_tokens=131072", "train.lr=0.0006",
                        "train.min_lr=0.00006", "train.warmup_steps=30", "train.eval_tokens=65536"]),
             f"train.max_steps={train_steps}", f"train.eval_every={max(train_steps // 3, 1)}",
             f"train.checkpoint_every={max(train_steps // 2, 1)}", "train.log_every=10"]
    params = str(REPO / "params.yaml")
    return [
        Step("tests", [[sys.executable, "-m", "pytest", *TESTS, *tests, "-q", "-p", "no:cacheprovider",
                        f"--junitxml={out / 'tests.xml'}"]]),
        Step("kernels", [kiln("bench", "kernels", "--size", size, *(["--no-compile"] if smoke else []),
                              "--out", str(out / "kernels.json"))]),
        Step("train", [kiln("bench", "train", "--params", params, *_sets(model), "--variants", variants, *shape,
                            "--device", "cpu" if smoke else "cuda", "--out", str(out / "train.json")),
                       # its own process, last: a device-side assert ends the process it happens in
                       *([] if smoke else [kiln("bench", "train", "--params", params, *_sets(model), "--variants",
                                                "bf16-compile-triton", *shape, "--device", "cuda",
                                                "--out", str(out / "train_compile_triton.json"))])]),
        Step("pretrain", [kiln("data", "prepare", "--params", params, *data),
                          kiln("tokenizer", "train", "--params", params, *tokenizer),
                          kiln("data", "shard", "--params", params),
                          kiln("train", "--params", params, *_sets(train))],
             cwd=work, collect={"metrics/pretrain.json": "pretrain.json", "metrics/pretrain": "pretrain",
                                "metrics/timings/pretrain.json": "pretrain_timings.json"}),
        Step("generate", [kiln("bench", "generate", "--params", params, *_sets(model),
                               *(["--vocab-size", "300", "--batch-sizes", "1,2", "--prompt-len", "8",
                                  "--new-tokens", "8", "--device", "cpu"] if smoke else
                                 ["--vocab-size", "50304", "--batch-sizes", "1,16,64", "--prompt-len", "512",
                                  "--new-tokens", "256", "--dtype", "bf16", "--device", "cuda"]),
                               "--out", str(out / "generate.json"))]),
    ]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def environment() -> dict:
    """What the numbers were measured on: recorded with them, as BENCHMARKS.md quotes them."""
    from kiln.pipeline.tools.bench import machine, package_version

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": package_version("triton"), "liger_kernel": package_version("liger-kernel"), "machine": machine(),
           "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                "memory_gb": round(props.total_memory / 2**30, 1)}
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True)
        env["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    return env


def run_step(step: Step, limit: float, log: Path, env: dict) -> dict:
    """Run the step's commands, streaming their output to the console and to `log`; stop at `limit` seconds."""
    started = time.perf_counter()
    status = "ok"
    with open(log, "w", encoding="utf-8") as sink:
        for argv in step.commands:
            sink.write(f"$ {' '.join(argv)}\n")
            sink.flush()
            remaining = limit - (time.perf_counter() - started)
            proc = subprocess.Popen(argv, cwd=step.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            try:
                output, _ = proc.communicate(timeout=max(remaining, 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
                status = f"timed out after {limit:.0f}s"
            sink.write(output)
            console.print(output.rstrip(), highlight=False, markup=False, soft_wrap=True)
            if status == "ok" and proc.returncode != 0:
                status = f"exit {proc.returncode}"
            if status != "ok":
                break
    return {"step": step.name, "status": status, "seconds": round(time.perf_counter() - started, 1),
            "log": log.name}


def bench_gpu(size: str, steps: list[str] | None, out: Path, work: Path | None) -> dict:
    if size not in SIZES:
        raise UserError(f"--size {size!r}: expected one of {', '.join(SIZES)}")
    unknown = sorted(set(steps or []) - set(STEPS))
    if unknown:
        raise UserError(f"--steps {','.join(unknown)}: no such step (expected some of {', '.join(STEPS)})")
    if size != "smoke" and not torch.cuda.is_available():
        raise UserError("kiln bench gpu needs a CUDA GPU (`--size smoke` runs it at toy shapes on a CPU)")
    selected = [s for s in STEPS if steps is None or s in steps]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-")) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_import_root(), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", COLUMNS="200")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # the smoke run's kernels go through the interpreter
    results = []
    if "env" in selected:
        write_json(out / "env.json", environment())
        results.append({"step": "env", "status": "ok", "seconds": 0.0, "log": "env.json"})
    for step in plan(size, out.resolve(), work.resolve()):
        if step.name not in selected:
            continue
        console.print(f"[bold]== {step.name}[/]", highlight=False)
        result = run_step(step, LIMITS[size][step.name], out / f"{step.name}.log", env)
        for source, name in step.collect.items():
            _copy(step.cwd / source, out / name)
        results.append(result)
    summary = {"benchmark": "gpu", "size": size, "work": str(work), "steps": results,
               "headline": headline(out)}
    write_json(out / "summary.json", summary)
    _print(summary)
    return summary


def _import_root() -> str | None:
    """The folder holding `kiln` when it is imported from a checkout linked as kiln/ (the GPU machine, which has
    no install), so that the steps import it from their own working folders too; None when kiln is installed."""
    import kiln

    package = Path(kiln.__file__).parent
    return str(package.parent) if package.name == "kiln" else None


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    elif src.is_file():
        shutil.copy2(src, dst)


def headline(out: Path) -> dict:
    """The numbers a note quotes, read back from the steps' JSON (absent where a step did not run)."""
    found = {}
    if (path := out / "kernels.json").is_file():
        rows = json.loads(path.read_text())["results"]
        found["kernel_goals_met"] = f"{sum(r['goal_met'] is True for r in rows)}/{len(rows)}"
    variants = [row for name in ("train.json", "train_compile_triton.json") if (out / name).is_file()
                for row in json.loads((out / name).read_text())["results"]]
    if variants:
        best = max(variants, key=lambda r: r["tokens_per_s"])
        found["best_train_variant"] = best["variant"]
        found["best_train_mfu"] = best["mfu"]
        found["best_train_tokens_per_s"] = best["tokens_per_s"]
    for name in ("pretrain.json", "pretrain_timings.json"):
        if (path := out / name).is_file():
            metrics = json.loads(path.read_text())
            metrics = metrics.get("pretrain", metrics)  # the timings file is flat
            found |= {f"pretrain_{k}": metrics[k] for k in ("val_loss", "tokens_per_s", "mfu") if k in metrics}
    return found


def _print(summary: dict) -> None:
    table = Table(title=f"kiln bench gpu --size {summary['size']}")
    for col in ("step", "status", "seconds", "log"):
        table.add_column(col)
    for r in summary["steps"]:
        table.add_row(r["step"], r["status"], f"{r['seconds']:.1f}", r["log"])
    console.print(table)
    for key, value in summary["headline"].items():
        console.print(f"{key}: {value}", highlight=False)
