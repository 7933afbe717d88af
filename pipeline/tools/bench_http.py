"""`kiln bench serve --http N`: N concurrent streaming clients through the real server, against the engine.

The model (trained, or the bench's random one) is served by `kiln serve` in a process of its own on a free port;
N clients of the `openai` package's async client stream completions of the bench's workload at once (prompts
as token ids, greedy, each to its drawn length or <|endoftext|>), and the same requests then run on an engine
called directly in this process, with the server's defaults (blocks for 16 full contexts, blocks of 16 tokens,
steps of 256 tokens). The row reports errors, time to first token, output tokens/s, the HTTP side's share of
what the engine alone does, and the CPU seconds the server and the clients spent beside the engine's: on a
machine of few cores the clients compete with the server, and the server's CPU against the engine's is its
own overhead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.model.checkpoint import save_model
from kiln.model.gpt import GPT
from kiln.pipeline.errors import UserError
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.request import Request, SamplingParams
from kiln.pipeline.tools.serve_workload import percentile, workload

SERVER_BLOCK_SIZE, SERVER_STEP_TOKENS, SERVER_CONTEXTS = 16, 256, 16  # kiln serve's defaults


def run_http(model: GPT, model_dir: Path | None, tokenizer: Path, clients: int, seed: int) -> list[dict]:
    """The HTTP row and the engine's row on the same `clients` requests."""
    from kiln.pipeline.text.bpe import EOT, load_tokenizer  # here: the GPU machine's benches run without tokenizers

    try:
        import openai
    except ImportError:
        raise UserError("--http: needs the openai package (pip install openai), whose client the load test "
                        "drives the server with") from None
    tok = load_tokenizer(tokenizer)
    eot = tok.token_to_id(EOT)
    c = model.config
    # token ids the server takes (within both the tokenizer's vocabulary and the model's), and a context one token
    # short for the <|endoftext|> each prompt starts with: the server takes token ids as sent, so both rows send it
    load = workload(clients, 0.0, dataclasses.replace(c, vocab_size=min(c.vocab_size, tok.get_vocab_size()),
                                                      max_seq_len=c.max_seq_len - 1), seed)
    prompts = [[eot, *p] for p in load.prompts]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-http-") as scratch:
        if model_dir is None:
            model_dir = Path(scratch) / "model"
            save_model(model, c, model_dir, {})
        device = next(model.parameters()).device
        with served(model_dir, tokenizer, device) as (base, pid):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
            server_cpu, client_cpu = cpu_seconds(pid), time.process_time()
            http = asyncio.run(stream_all(client, model_dir.name, prompts, load.outputs))
            # on a machine of few cores the clients' parsing competes with the server: say what each spent
            http["client_cpu_s"] = round(time.process_time() - client_cpu, 3)
            if server_cpu is not None:
                http["server_cpu_s"] = round(cpu_seconds(pid) - server_cpu, 3)
    engine = Engine(model, SERVER_CONTEXTS * math.ceil(c.max_seq_len / SERVER_BLOCK_SIZE), SERVER_BLOCK_SIZE,
                    SERVER_STEP_TOKENS)
    requests = [Request(p, SamplingParams(n, stop_ids=(eot,))) for p, n in zip(prompts, load.outputs)]
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        engine.run(requests)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output) for r in requests)
    direct = {"variant": f"engine called directly, {clients} requests", "requests": clients, "output_tokens": tokens,
              "output_tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 3),
              "cpu_s": round(time.process_time() - cpu, 3)}
    http["http_vs_engine"] = round(http["output_tokens_per_s"] / direct["output_tokens_per_s"], 3)
    if "server_cpu_s" in http:  # the server's own cost for the same tokens, the clients' aside
        http["server_cpu_vs_engine"] = round(http["server_cpu_s"] / max(direct["cpu_s"], 1e-9), 3)
    return [http, direct]


def cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU seconds so far (Linux's /proc), or None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_all(client, name: str, prompts: list[list[int]], outputs: list[int]) -> dict:
    """Every request streamed at once; tokens counted from each stream's usage chunk."""
    async def one(prompt: list[int], n: int, start: float):
        first, usage = None, None
        stream = await client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return first, usage

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p, n, start) for p, n in zip(prompts, outputs)),
                                   return_exceptions=True)
    seconds = time.perf_counter() - start
    done = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    tokens = sum(u or 0 for _, u in done)
    ttft = [f for f, _ in done if f is not None]
    return {"variant": f"kiln serve over HTTP, {len(results)} streaming clients", "requests": len(results),
            "errors": len(errors), "first_error": repr(errors[0])[:200] if errors else None, "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 3),
            "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 2), "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 2)}


@contextlib.contextmanager
def served(model_dir: Path, tokenizer: Path, device):
    """`kiln serve` on a free port of 127.0.0.1, quiet, until the block ends: its base URL and process id."""
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "kiln.pipeline.cli", "serve", "--model", str(model_dir),
                                "--tokenizer", str(tokenizer), "--port", str(port), "--device", str(device.type),
                                "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if process.poll() is not None:
                raise UserError(f"--http: kiln serve exited: {process.stderr.read().strip()[-300:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{base}/health", timeout=1):
                    break
            time.sleep(0.1)
        else:
            raise UserError("--http: kiln serve did not answer /health within a minute")
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)
