"""Shared fixtures: pipeline outputs built once per test worker, on the default corpus and on a tiny one."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

# Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this when a kernel
# is decorated, so it must be set before anything imports kernels/.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.pipeline.config import build_section
from kiln.pipeline.text.prepare import prepare
from kiln.pipeline.text.shard import ShardParams, shard
from kiln.pipeline.text.sources import DataParams
from kiln.pipeline.text.tokenizer import TokenizerParams, train_tokenizer

# Under `pytest -n 2` on two cores each worker would start a full torch thread pool and oversubscribe the CPU
# (tiny ops measured ~50x slower); one intra-op thread per worker keeps every core busy exactly once.
torch.set_num_threads(1)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _release_cuda_cache():
    """On a GPU, `make gpu-check` runs the kernel tests in 8 workers: each keeps what its caching allocator
    holds from its largest float64 reference (over 20 GB seen on an H100), so together they ran out of device
    memory. Handing the cache back after every test keeps each worker at what its current test needs."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Real-world fixtures in ../shared/data: beside the development checkout, absent from a bare clone (where
    these tests say so and skip rather than fail on a missing file)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA}: real-data fixtures not found beside this checkout")
    return SHARED_DATA


def write_params(path: Path, sections: dict) -> Path:
    """A params.yaml holding `sections` (the rest of every section takes its defaults)."""
    path.write_text(yaml.safe_dump(sections), encoding="utf-8")
    return path


@dataclass
class Built:
    root: Path
    corpus: Path
    tokenizer: Path
    shards: Path


def build(root: Path, data: dict, tokenizer: dict, shard_params: dict) -> Built:
    with contextlib.chdir(root):
        prepare(build_section(DataParams, data), Path("data/corpus"))
        train_tokenizer(build_section(TokenizerParams, tokenizer), Path("data/corpus"), Path("data/tokenizer"))
        shard(build_section(ShardParams, shard_params), Path("data/corpus"), Path("data/tokenizer/tokenizer.json"),
              Path("data/shards"))
    return Built(root, root / "data/corpus", root / "data/tokenizer/tokenizer.json", root / "data/shards")


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Built:
    """The default pipeline (shakespeare corpus, default params) run once."""
    return build(tmp_path_factory.mktemp("shakespeare"), {}, {}, {})


def make_documents(n: int, seed: int = 0) -> list[str]:
    """Distinct short documents with a mix of scripts, so that tiny tokenizers see multi-byte text."""
    rng = random.Random(seed)
    words = ["the", "king", "queen", "of", "Denmark", "naïve", "café", "東京", "🙂", "night", "day", "speak",
             "hear", "me", "1234", "x=y+1;", "\t", "well,", "said", "O"]
    return [f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + "\n"
            for i in range(n)]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Built:
    """A small corpus (~300 documents) with a small vocabulary and small shards, several per split."""
    root = tmp_path_factory.mktemp("tiny")
    src = root / "src"
    src.mkdir()
    for i, text in enumerate(make_documents(300)):
        (src / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    return build(root, {"source": str(src), "val_fraction": 0.2}, {"vocab_size": 300}, {"shard_tokens": 2048})


@contextlib.contextmanager
def one_dvc_at_a_time():
    """DVC locks the repository it runs in: tests that run dvc in this checkout take turns across workers."""
    repo = Path(__file__).resolve().parents[1]
    with open(Path("/tmp") / f"kiln-dvc-{abs(hash(str(repo)))}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


DATA_STACK = ("dvc", "dvclive", "datasets", "tokenizers", "tiktoken", "pyarrow")


def imports_without_the_data_stack(*modules: str) -> None:
    """Import `modules` in a fresh interpreter where every package of `DATA_STACK` fails to import, as on the GPU
    machine (torch and nothing of dvc, datasets or the tokenizers); fail naming what the import needed."""
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in DATA_STACK)
    code = f"import sys; {blocked}; " + "; ".join(f"import {m}" for m in modules)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1]


def fails_in_one_line(args: list[str], code: int, *names: str) -> str:
    """Run `kiln *args` in this process and check it failed as bad input or a failed stage must: exit `code`,
    one line of output that mentions every one of `names` (a file, a key, a value), and no traceback."""
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, args)
    # a hand run says where it writes before it starts: the failure is the line after it
    output = re.sub(r"\A\w+: a hand run \(.*\), writing under .*\n", "", result.output.strip())
    assert result.exit_code == code, f"kiln {' '.join(args)}: exit {result.exit_code}, expected {code}:\n{output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    for name in names:
        assert str(name) in output, f"{name!r} not named in: {output}"
    return output


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes: compared before and after a failed run, it shows nothing of the
    previous output was touched."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


# Row files and chat messages for the data-loader tests (test_chat_data, test_prompt_data).
def raw_rows(path: Path) -> list:
    """The rows of a .json, .jsonl or .jsonl.gz file as plain JSON, read without kiln."""
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def summary(capsys):
    """The printed summary line, with rich's wrapping at the console width undone."""
    return " ".join(capsys.readouterr().err.split())


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}
