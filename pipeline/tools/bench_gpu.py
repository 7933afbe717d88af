"""`kiln bench gpu`: everything a GPU session measures, as one command, so that lent GPU minutes go to
measuring rather than to typing commands.

Steps, each a subprocess with its own log and time limit (one that fails or hangs is recorded and the rest
still run), the headline first:
- env:      GPU name, driver, CUDA, torch/triton/liger versions, SM count (env.json);
- train:    `kiln bench train` on the GPT-2 124M shape, bf16, compiled, with torch's kernels, kiln's, then
            kiln's fused head alone and kiln's attention alone (the gap to torch's step split by op), each row
            with its top GPU kernels from torch.profiler (tokens/s, MFU, peak memory beside plan memory's
            estimate: train.json); full adds the compile modes and plan memory's largest micro-batch;
- kernels:  `kiln bench kernels` (kernels.json): ours vs eager vs compile vs Liger vs SDPA, CUDA-graph timed,
            goal per row, the autotuner's picks; quick times the ops of the GPT-2 step only;
- tests:    the kernel and model tests on the device itself: natively on CUDA, at LLM shapes as well as the
            awkward ones, and the engine's CUDA graphs against its eager steps (tests.xml, JUnit); quick runs
            the fused head's and the custom ops' only;
- pretrain: the real stages (`kiln data prepare`, `tokenizer train`, `data shard`, `train`) on Shakespeare in
            a scratch folder, GPT-2's tokenizer and 124M shape, bf16 + compile (pretrain/);
- generate: `kiln bench generate` on the 124M shape in bf16 (generate.json), then batch 1 again beside the model
            quantized as `kiln serve --quantize` int8, int4 and fp8 quantize it (generate_quantize.json: decode
            rate, weight bytes and quality against the original's; a kind that fails leaves the first file);
- serve:    `kiln bench serve` on the default shape (serve.json): the engine (decode steps replaying CUDA
            graphs) against static batching and transformers, GRPO-shaped rollouts, and the engine step's host
            microseconds, copies and graph replays;
- grpo:     `kiln grpo` from the pretrain step's model, twice: its kept engine's rollouts replaying CUDA graphs,
            then with grpo.enforce_eager (grpo_graphs.json, grpo_eager.json: the stage's timings, rollout
            tokens/s and their share of the stage); then the engine's graph tests (grpo_tests.xml).
The headline counts each test file's results as passed, failed and skipped (a skipped test is not a passed one),
and says where the run was: `checked_on`, and for grpo `grpo_graphs_checked`, which on a CPU reads "not run:
needs CUDA" (no graphs are captured there, so both grpo runs are eager and their ratio is noise, and the graph
tests' CUDA cases skip): a smoke run checks the plumbing and the arithmetic, the graph half only a GPU.
Quick runs all but generate and grpo (name them with --steps, grpo beside pretrain, to run them at quick's
shapes), full all of them. Everything lands in `--out` (default metrics/bench/gpu/new/) with
one log per step and summary.json, which is rewritten after every step (and `--pack` re-archives the folder
then), so a run cut off by a time limit keeps what the finished steps measured. The headline reads only files
this run wrote: a step that did not run (or wrote nothing) is named as not run, never filled from an older
run's files in the same folder.

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
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.table import Table

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console

REPO = Path(__file__).resolve().parents[2]
SIZES = ("quick", "full", "smoke")
STEPS = ("env", "train", "kernels", "tests", "pretrain", "post", "generate", "serve", "grpo")

# The GPT-2 124M shape (12 layers, 12 heads, d 768, T 1024) as `--set` overrides; the vocabulary is GPT-2's BPE
# (50,257 + kiln's 3 chat tokens = 50,260, which the model pads to 50,304).
GPT2_124M = ["model.arch=gpt2", "model.tie_embeddings=true", "model.n_layer=12", "model.n_head=12",
             "model.n_kv_head=12", "model.d_model=768", "model.max_seq_len=1024"]
GPT2_VOCAB = "50260"
# The stage runs compile with torch's kernels, what train.kernels=auto picks until bench train's headline shows
# kiln's faster under compile (train/loop.py, KILN_KERNELS_FASTER_UNDER_COMPILE).
GPU_TRAIN = ["train.device=cuda", "train.precision=bf16", "train.compile=true", "train.kernels=torch"]
TOY = ["model.n_layer=1", "model.n_head=2", "model.n_kv_head=2", "model.d_model=32", "model.max_seq_len=32"]

TESTS = ["tests/test_kernel_rms_norm.py", "tests/test_kernel_swiglu.py", "tests/test_kernel_rope.py",
         "tests/test_kernel_cross_entropy.py", "tests/test_kernel_linear_cross_entropy.py",
         "tests/test_kernel_flash_attention.py", "tests/test_kernel_nf4.py", "tests/test_kernel_paged_attention.py",
         "tests/test_serve_graphs.py",
         "tests/test_kernel_ops.py", "tests/test_compile.py", "tests/test_model.py"]

# Chat examples of mixed lengths for the post step: prompts of 5 to `words` words, answers Pareto-long from `answer`
# words (a few long, most short), as real chat data is
CHAT_DATA = ("import json, random; r = random.Random(0); w = 'the king of Denmark said well'.split(); "
             "open('run/chat.jsonl', 'w').writelines(json.dumps({{"
             "'prompt': ' '.join(r.choices(w, k=r.randint(5, {words}))), "
             "'response': ' '.join(r.choices(w, k=int(r.paretovariate(1.2) * {answer})))}}) + chr(10) "
             "for _ in range({rows}))")

PACK_EVERY = 30  # seconds: a call cut off at its limit still returns the rows its running step has written

# The steps each size runs unless --steps names others: quick leaves out generate, whose 24 runs did not fit its
# 40 s on the H200 and which no recent change touches, and grpo (two stage runs), to keep one call under 9
# minutes.
SIZE_STEPS = {"quick": ("env", "train", "kernels", "tests", "pretrain", "post", "serve"), "full": STEPS,
              "smoke": STEPS}
# Quick's kernel rows: the ops the GPT-2 step runs (flash attention, the fused head and its cross-entropy);
# its tests: the head's and the custom ops' (flash attention's took too long beside them); full: all of both.
STEP_OPS = "linear_cross_entropy,cross_entropy,flash_attention"
STEP_TESTS = ["tests/test_kernel_cross_entropy.py", "tests/test_kernel_linear_cross_entropy.py",
              "tests/test_kernel_ops.py"]
# The train step's rows: torch's kernels (the baseline), kiln's, then kiln's head alone and attention alone, so
# one run splits the gap by op (GPT-2 uses no other kiln op: its norm is LayerNorm and its MLP GELU).
GPU_VARIANTS = "bf16-compile-torch,bf16-compile-triton,bf16-compile-triton:head,bf16-compile-triton:attention"

# Seconds each step may take, per size. Quick's sum to 480 s: with the wheels' install (~20 s) one call stays under 9
# minutes (post's 30 s, not yet run on a GPU, came from train's 180, kernels' 80, tests' 80 and serve's 40, each kept
# above its last measured time). From the H200 runs: 2026-11-26 (quick)
# train 75 s for two compiled rows, pretrain 55 s, serve 19 s; 2026-11-27 (first run) train cut at 100 s inside kiln's
# compiled row (kiln's compiled in 56 s), kernels cut at 140 s after all 20 rows; 2026-11-27 (this layout) train 152 s
# for its four compiled rows (compiles 30, 44, 21, 21 s) and their profiles, kernels' 6 step rows ~70 s (cut at 75 s
# on the way out), pretrain 60 s (before its Muon run was added: 30 s more allowed for it, unmeasured), serve 31 s,
# and the two cross-entropy test files 52 s on 8 workers (with flash attention's and the ops' files beside them the
# step did not finish in 75 s, so quick leaves flash attention's to full; the ops' file beside the two is not timed
# yet). A step cut at its limit keeps the rows its JSON already holds (serve writes its JSON at the end: give it
# room). Full's train (the compile modes, a max-autotune compile per kernel choice) takes a call of its own. grpo (not
# yet run on a GPU): two runs of 20 steps from a cold start each, 124M in bf16 with prompts of up to 1,000 tokens; its
# limit is a guess with room.
LIMITS = {"smoke": {"train": 240, "kernels": 240, "tests": 240, "pretrain": 300, "post": 120, "generate": 120,
                    "serve": 120, "grpo": 240},
          "quick": {"train": 170, "kernels": 70, "tests": 75, "pretrain": 100, "post": 30, "generate": 80, "serve": 35,
                    "grpo": 240},
          "full": {"train": 560, "kernels": 540, "tests": 420, "pretrain": 540, "post": 120, "generate": 300,
                   "serve": 300, "grpo": 300}}


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
    # Quick leaves out test_compile (inductor compiles per worker, a minute each; bench train's compiled rows
    # already run kiln's ops in one compiled graph).
    tests = ["-k", "torch_backend"] if smoke else ["-n", "8"]
    test_files = STEP_TESTS if size == "quick" else TESTS
    # The headline: the compiled step with torch's kernels, then kiln's (a crash there keeps the first row).
    # On a CPU compiling takes most of a minute a variant, so the smoke run checks the same command eagerly.
    variants = "fp32-eager-torch,fp32-eager-triton,fp32-eager-triton:head" if smoke else GPU_VARIANTS
    grid = (["--compile-modes", "default,max-autotune-no-cudagraphs,reduce-overhead", "--plan-batch"]
            if size == "full" else [])
    shape = (["--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--warmup", "1"] if smoke
             else ["--vocab-size", GPT2_VOCAB, "--batch-size", "16", "--seq-len", "1024", "--steps", "20",
                   "--warmup", "3"])
    data = (["--set", "data.max_bytes=200000"] if smoke else [])
    tokenizer = (["--set", "vocab_size=300"] if smoke else ["--set", "source=gpt2"])
    train = [*model, *(["train.device=cpu", "train.batch_size=4", "train.batch_tokens=128", "train.eval_tokens=1024"]
                       if smoke else
                       [*GPU_TRAIN, "train.batch_size=16", "train.batch_tokens=131072", "train.lr=0.0006",
                        "train.min_lr=0.00006", "train.warmup_steps=30", "train.eval_tokens=65536"]),
             f"train.max_steps={train_steps}", f"train.eval_every={max(train_steps // 3, 1)}",
             f"train.checkpoint_every={max(train_steps // 2, 1)}", "train.log_every=10"]
    params = str(REPO / "params.yaml")
    # GRPO from the pretrain step's model, its prompts the built-in task's (passages fitted to the context); the
    # toy model's 32 positions hold none of those, so the smoke run's prompts are a file of short ones
    grpo = [*(["train.device=cpu", "max_steps=2", "batch_examples=8", "batch_size=8", "group_size=4",
               "max_new_tokens=4", "data=run/grpo_prompts.jsonl"] if smoke else
              ["train.device=cuda", "train.precision=bf16", "max_steps=20", "max_examples=200"]),
            "val_examples=4", "eval_every=1000", "checkpoint_every=1000", "log_every=5"]
    grpo_run = [kiln("grpo", "--params", params, *_sets(grpo), "--start", "run/model", "--tokenizer",
                     "run/tokenizer/tokenizer.json", "--corpus", "run/corpus", "--out", f"run/grpo-{how}",
                     *(["--set", "enforce_eager=true"] if how == "eager" else [])) for how in ("graphs", "eager")]
    generate_shape = (["--vocab-size", "300", "--prompt-len", "8", "--new-tokens", "8", "--device", "cpu"] if smoke
                      else ["--vocab-size", GPT2_VOCAB, "--prompt-len", "512", "--new-tokens", "256", "--dtype", "bf16",
                            "--device", "cuda"])
    prompts = [[sys.executable, "-c", "import json; open('run/grpo_prompts.jsonl', 'w').writelines(json.dumps("
                "{'prompt': f'Say {w}.', 'answer': w}) + chr(10) for w in 'abcdefgh')"]] if smoke else []
    # SFT's packed rows against its padded ones (the packing issue's row): chat examples of mixed lengths, made
    # here (the machine has no datasets), at the GPT-2 shape's 1,024-token context
    chat = [sys.executable, "-c", CHAT_DATA.format(**({"rows": 40, "words": 6, "answer": 2} if smoke else
                                                     {"rows": 400, "words": 300, "answer": 20}))]
    # (the toy tokenizer's 300 tokens spend several on a word: 128 positions hold two short examples)
    post_shape = (["--seq-len", "128", "--batch-size", "2", "--steps", "2", "--warmup", "1", "--check", "4",
                   "--group-size", "2", "--completion-tokens", "8", "--repeats", "1", "--device", "cpu"] if smoke else
                  ["--seq-len", "1024", "--batch-size", "8", "--steps", "10", "--warmup", "2", "--check", "16",
                   "--device", "cuda"])
    return [
        Step("train", [kiln("bench", "train", "--params", params, *_sets(model), "--variants", variants, *grid, *shape,
                            "--top-ops", "--device", "cpu" if smoke else "cuda", "--out", str(out / "train.json"))]),
        Step("kernels", [kiln("bench", "kernels", "--size", size, *(["--no-compile"] if smoke else []),
                              *(["--ops", STEP_OPS] if size == "quick" else []), "--out", str(out / "kernels.json"))]),
        Step("tests", [[sys.executable, "-m", "pytest", *test_files, *tests, "-q", "-p", "no:cacheprovider",
                        f"--junitxml={out / 'tests.xml'}"]]),
        # The four stages as hand runs (the repo's params.yaml, other values) into one folder, run/
        Step("pretrain", [kiln("data", "prepare", "--params", params, *data, "--out", "run"),
                          kiln("tokenizer", "train", "--params", params, *tokenizer, "--corpus", "run/corpus",
                               "--out", "run"),
                          kiln("data", "shard", "--params", params, "--corpus", "run/corpus", "--tokenizer",
                               "run/tokenizer/tokenizer.json", "--out", "run"),
                          kiln("train", "--params", params, *_sets([*train, "train.optimizer=adamw"]), "--shards",
                               "run/shards", "--tokenizer", "run/tokenizer/tokenizer.json", "--out", "run"),
                          # the recipe issue's row: the same run (seed, data, steps) with Muon on the blocks
                          kiln("train", "--params", params, *_sets([*train, "train.optimizer=muon"]), "--shards",
                               "run/shards", "--tokenizer", "run/tokenizer/tokenizer.json", "--out", "run-muon")],
             cwd=work, collect={"run/metrics/pretrain.json": "pretrain.json", "run/metrics/pretrain": "pretrain",
                                "run/metrics/timings/pretrain.json": "pretrain_timings.json",
                                "run-muon/metrics/pretrain.json": "pretrain_muon.json",
                                "run-muon/metrics/timings/pretrain.json": "pretrain_muon_timings.json"}),
        Step("post", [chat, kiln("bench", "post", "--params", params, *_sets(model), "--data", "run/chat.jsonl",
                                 "--tokenizer", "run/tokenizer/tokenizer.json", *post_shape,
                                 "--out", str(out / "post.json"))], cwd=work),
        Step("generate", [kiln("bench", "generate", "--params", params, *_sets(model), *generate_shape,
                               "--batch-sizes", "1,2" if smoke else "1,16,64", "--out", str(out / "generate.json")),
                          kiln("bench", "generate", "--params", params, *_sets(model), *generate_shape,
                               "--batch-sizes", "1", "--quantize", "int8" if smoke else "int8,int4,fp8",
                               "--out", str(out / "generate_quantize.json"))]),
        Step("serve", [kiln("bench", "serve", "--params", params,
                            *([*_sets(TOY), "--vocab-size", "300", "--requests", "6", "--batch", "2",
                               "--device", "cpu"] if smoke else
                              ["--requests", "64" if size == "quick" else "256", "--device", "cuda"]),
                            "--rate", "0", "--out", str(out / "serve.json"))]),
        # then the engine's graph tests, whose CUDA ones check that a kept graphed engine samples after a weight
        # update as one captured afresh (quick's tests step leaves them out)
        Step("grpo", [*prompts, *grpo_run,
                      [sys.executable, "-m", "pytest", str(REPO / "tests" / "test_serve_graphs.py"), "-q", "-p",
                       "no:cacheprovider", f"--junitxml={out / 'grpo_tests.xml'}"]], cwd=work,
             collect={f"run/grpo-{how}/metrics/timings/grpo.json": f"grpo_{how}.json" for how in ("graphs", "eager")}),
    ]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def environment() -> dict:
    """What the numbers were measured on: recorded with them, as BENCHMARKS.md quotes them."""
    from kiln.pipeline.tools.machine import machine, package_version

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


def run_step(step: Step, limit: float, log: Path, env: dict, meanwhile: Callable[[], None] = lambda: None) -> dict:
    """Run the step's commands, their output to the console and to `log`; stop at `limit` seconds. `meanwhile`
    runs every PACK_EVERY seconds while a command runs (packing the rows its JSON holds so far)."""
    started = time.perf_counter()
    status = "ok"
    with open(log, "w", encoding="utf-8") as sink:
        for argv in step.commands:
            sink.write(f"$ {' '.join(argv)}\n")
            sink.flush()
            proc = subprocess.Popen(argv, cwd=step.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            while True:
                remaining = limit - (time.perf_counter() - started)
                try:  # a timed-out communicate keeps what it read, and the next call goes on from there
                    output, _ = proc.communicate(timeout=max(min(remaining, PACK_EVERY), 1))
                    break
                except subprocess.TimeoutExpired:
                    if remaining > PACK_EVERY:
                        meanwhile()
                        continue
                    proc.kill()
                    output, _ = proc.communicate()
                    status = f"timed out after {limit:.0f}s"
                    break
            sink.write(output)
            console.print(output.rstrip(), highlight=False, markup=False, soft_wrap=True)
            if status == "ok" and proc.returncode != 0:
                status = f"exit {proc.returncode}"
            if status != "ok":
                break
    return {"step": step.name, "status": status, "seconds": round(time.perf_counter() - started, 1),
            "log": log.name}


def bench_gpu(size: str, steps: list[str] | None, out: Path, work: Path | None, pack: Path | None = None) -> dict:
    """`pack`: a .tgz of `out`, rewritten after every step (the GPU machine's $OUT returns a few files, not a
    folder, and a command past its limit returns only what was written by then)."""
    if size not in SIZES:
        raise UserError(f"--size {size!r}: expected one of {', '.join(SIZES)}")
    unknown = sorted(set(steps or []) - set(STEPS))
    if unknown:
        raise UserError(f"--steps {','.join(unknown)}: no such step (expected some of {', '.join(STEPS)})")
    if size != "smoke" and not torch.cuda.is_available():
        raise UserError("kiln bench gpu needs a CUDA GPU (`--size smoke` runs it at toy shapes on a CPU)")
    selected = list(SIZE_STEPS[size]) if steps is None else [s for s in STEPS if s in steps]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-")) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_import_root(), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", COLUMNS="200")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # the smoke run's kernels go through the interpreter
    summary = {"benchmark": "gpu", "size": size, "checked_on": checked_on(), "work": str(work), "complete": False,
               "steps": [], "headline": {}, "not_run": [s for s in STEPS if s not in selected]}
    started = time.time()
    if "env" in selected:
        write_json(out / "env.json", environment())
        summary["steps"].append({"step": "env", "status": "ok", "seconds": 0.0, "log": "env.json"})
    for step in plan(size, out.resolve(), work.resolve()):
        if step.name not in selected:
            continue
        console.print(f"[bold]== {step.name}[/]", markup=True)
        result = run_step(step, LIMITS[size][step.name], out / f"{step.name}.log", env,
                          meanwhile=lambda: _save(summary, out, pack))
        for source, name in step.collect.items():
            _copy(step.cwd / source, out / name)
        summary["steps"].append(result)
        summary["headline"] = headline(out, started)
        _save(summary, out, pack)
        if step.name == "train":  # the headline, as soon as it is measured
            for line in train_lines(summary["headline"]):
                console.print(line, highlight=False, soft_wrap=True)
    summary["complete"] = True
    _save(summary, out, pack)
    _print(summary)
    return summary


def checked_on() -> str:
    """Where the run's figures come from: a GPU's name, or a CPU and what a CPU leaves unchecked."""
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {NOT_ON_CPU}"


# what a smoke run on a CPU does not exercise
NOT_ON_CPU = "the GPU half not exercised (no CUDA graphs or native kernels; their tests skip)"
GRAPHS_NOT_RUN = ("not run: needs CUDA (a CPU captures no graphs: both grpo runs are eager, their ratio is noise, "
                  "and the graph tests' CUDA cases skip)")


JUNIT_OUTCOMES = {"failure": "failed", "error": "errors", "skipped": "skipped"}  # a testcase's child -> its count


def junit_results(path: Path) -> dict[str, int]:
    """A pytest JUnit file's counts: passed, failed, errors and skipped (a skipped test did not pass)."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcomes = [JUNIT_OUTCOMES[child.tag] for child in case if child.tag in JUNIT_OUTCOMES]
        counts["tests"] += 1
        counts[outcomes[0] if outcomes else "passed"] += 1
    return counts


def _save(summary: dict, out: Path, pack: Path | None) -> None:
    write_json(out / "summary.json", summary)
    if pack is not None:
        partial = pack.with_name(pack.name + ".partial")
        with tarfile.open(partial, "w:gz") as archive:
            archive.add(out, arcname=out.as_posix().lstrip("/"))  # as the Makefile's final `tar czf` names it
        partial.replace(pack)  # whole or not at all, if the call is cut off while it packs


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


def headline(out: Path, since: float = 0.0) -> dict:
    """The numbers a note quotes, read back from the steps' JSON files written at or after `since` (a time.time()
    value: the run's start), so an older run's files in `out` never stand in for a step that did not run."""
    found = {}

    def fresh(name: str) -> Path | None:
        path = out / name
        return path if path.is_file() and path.stat().st_mtime >= since else None

    if path := fresh("train.json"):
        rows = json.loads(path.read_text())["results"]
        found["train"] = {row["variant"]: {"error": row["error"]} if "error" in row else
                          {k: row.get(k) for k in ("step_ms", "speedup", "tokens_per_s", "mfu", "peak_memory_gb",
                                                   "plan_memory_gb", "batch_size", "device_busy_ms_per_step",
                                                   "top_ops")}
                          for row in rows}
        timed = [row for row in rows if "error" not in row]
        if timed:
            best = max(timed, key=lambda r: r["tokens_per_s"])
            found["best_train_variant"] = best["variant"]
            found["best_train_mfu"] = best["mfu"]
            found["best_train_tokens_per_s"] = best["tokens_per_s"]
    if path := fresh("kernels.json"):
        rows = json.loads(path.read_text())["results"]
        found["kernel_goals_met"] = f"{sum(r['goal_met'] is True for r in rows)}/{len(rows)}"
    if path := fresh("tests.xml"):
        found["tests_results"] = junit_results(path)
    for run in ("pretrain", "pretrain_muon"):
        for name in (f"{run}.json", f"{run}_timings.json"):
            if path := fresh(name):
                metrics = json.loads(path.read_text())
                metrics = metrics.get("pretrain", metrics)  # the timings file is flat
                found |= {f"{run}_{k}": metrics[k] for k in ("val_loss", "tokens_per_s", "mfu") if k in metrics}
    if found.get("pretrain_tokens_per_s") and found.get("pretrain_muon_tokens_per_s"):
        # Muon's step time against AdamW's (the same tokens a step), and its val loss after the same tokens
        found["muon_step_time_vs_adamw"] = round(found["pretrain_tokens_per_s"] / found["pretrain_muon_tokens_per_s"],
                                                 3)
    if path := fresh("post.json"):
        # packed SFT rows against padded ones: non-pad tokens/s, the goal 2x
        post = json.loads(path.read_text())
        found["post_packed_over_padded"] = post["packed_over_padded"]
        found["post_fill"] = {k: row["fill"] for k, row in post["rows"].items()}
        found["post_grpo_shared_over_separate"] = post["shared_over_separate"]
    if path := fresh("generate_quantize.json"):
        for kind in json.loads(path.read_text())["quantize"]:
            if kind["quantize"]:
                found[f"generate_{kind['quantize']}"] = {k: kind[k] for k in (
                    "decode_speedup_vs_original", "linear_bytes", "kl_vs_original", "top1_agreement")}
    grpo = {how: json.loads(path.read_text()) for how in ("graphs", "eager") if (path := fresh(f"grpo_{how}.json"))}
    for how, timings in grpo.items():
        found |= {f"grpo_{how}_{k}": timings[k] for k in ("rollout_tokens_per_s", "generate_share", "seconds")}
    if len(grpo) == 2 and grpo["eager"]["rollout_tokens_per_s"]:
        found["grpo_graphs_speedup"] = round(grpo["graphs"]["rollout_tokens_per_s"]
                                             / grpo["eager"]["rollout_tokens_per_s"], 3)
    if grpo:
        found["grpo_graphs_checked"] = "cuda" if torch.cuda.is_available() else GRAPHS_NOT_RUN
    if path := fresh("grpo_tests.xml"):
        found["grpo_tests_results"] = junit_results(path)
    return found


TOP_KERNELS = 5  # per train row in the printed headline (the JSON keeps the profile's 25)


def train_lines(found: dict) -> list[str]:
    """The training step's headline, a line per variant, and under it its top kernels by device time."""
    lines = []
    for variant, row in found.get("train", {}).items():
        if "error" in row:
            lines.append(f"headline: {variant}: failed: {row['error']}")
            continue
        mfu = "" if row["mfu"] is None else f", MFU {row['mfu']:.1%}"
        memory = "" if row["peak_memory_gb"] is None else f", peak {row['peak_memory_gb']:.3g} GB"
        busy = "" if row.get("device_busy_ms_per_step") is None else \
            f" (device busy {row['device_busy_ms_per_step']:.1f} ms)"
        lines.append(f"headline: {variant}: {row['step_ms']:.1f} ms/step{busy} ({row['speedup']:.2f}x the first "
                     f"row), {row['tokens_per_s']:,.0f} tokens/s{mfu}{memory} (plan {row['plan_memory_gb']:.3g} GB), "
                     f"batch {row['batch_size']}")
        lines += [f"    {op['self_ms_per_step']:7.2f} ms/step {op['share']:6.1%}  x{op['calls_per_step']}  {op['op']}"
                  for op in (row.get("top_ops") or [])[:TOP_KERNELS]]
    return lines


def _print(summary: dict) -> None:
    table = Table(title=f"kiln bench gpu --size {summary['size']}, on {summary['checked_on']}")
    for col in ("step", "status", "seconds", "log"):
        table.add_column(col)
    for r in summary["steps"]:
        table.add_row(r["step"], r["status"], f"{r['seconds']:.1f}", r["log"])
    console.print(table)
    if summary["not_run"]:
        console.print(f"not run: {', '.join(summary['not_run'])} (no figures of theirs below)", highlight=False)
    for line in train_lines(summary["headline"]):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    for key, value in summary["headline"].items():
        if key != "train":
            console.print(f"{key}: {value}", highlight=False)
