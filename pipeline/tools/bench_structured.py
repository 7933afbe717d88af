"""`kiln bench structured`: structured outputs on a trained model, on the serving engine.

Validity: `--schemas` JSON schemas of varied shape (nested objects, arrays with item bounds, enums, integers and
numbers with bounds, booleans, bounded strings, required and optional keys), made from `--seed`, each asked of
the model as a chat request with `--n` samples at temperature 1 (a request and its forks, as `n` is served). Every
output must parse and validate (the `jsonschema` package, which the bench needs); the table counts those that do,
how the others ended, and each schema's compile time, first and from the cache.

Load: `--concurrent` requests at once, the same prompts and seeds, with none constrained and with `--constrained`
of them following the schemas, taking turns `--repeats` times after one untimed pair: output tokens/s of each,
and their ratio (the median of the repeats', each kept). The work is made equal: no request stops before
max_tokens, an unconstrained one having no stop id and a constrained one following a JSON array of its schema's
objects, longer than max_tokens allows.
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import time
from decimal import Decimal
from pathlib import Path

import torch
from rich.table import Table

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.grammar import Grammars
from kiln.pipeline.serve.request import Request, SamplingParams, fork_groups
from kiln.pipeline.serve.text_model import TextModel
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tools.machine import machine

WORDS = ["name", "king", "queen", "age", "lord", "city", "act", "scene", "line", "speaker", "count", "ok", "tags",
         "year", "place", "mood", "items", "kind", "score", "id"]


def make_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema: an object at the top, its values any of the kinds below, nested at most three deep, small
    enough that its longest output fits the DAG's models' 128-token context."""
    kinds = ["integer", "number", "boolean", "enum", "string", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        keys = rng.sample(WORDS, rng.randint(1, 3 if depth == 0 else 2))
        return {"type": "object", "properties": {k: make_schema(rng, depth + 1) for k in keys},
                "required": sorted(rng.sample(keys, rng.randint(0, len(keys)))), "additionalProperties": False}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        # in hundredths: a number's digits are bounded as a string's characters are (below), else a small model at
        # temperature 1 may write digits until max_tokens
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 100]), "multipleOf": 0.01}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    return {"type": "array", "items": make_schema(rng, depth + 2), "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3)}


def prompt_ids(chat: ChatFormat, schema: dict) -> list[int]:
    """A short question (the DAG's models have 128 tokens of context): the schema's keys."""
    return chat.prompt([{"role": "user", "content": " ".join(schema["properties"])}])


def valid(text: str, schema: dict) -> bool:
    """Whether `text` is JSON that follows `schema`, its numbers read as decimals (in floats 1.12 is no multiple
    of 0.01, and jsonschema would say so)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text, parse_float=Decimal),
                            json.loads(json.dumps(schema), parse_float=Decimal))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def bench_structured(model_dir: Path, tokenizer: Path, schemas: int, n: int, concurrent: int, constrained: int,
                     max_tokens: int, repeats: int, seed: int, device: str, out: Path) -> dict:
    if importlib.util.find_spec("jsonschema") is None:
        raise UserError("kiln bench structured: needs the jsonschema package (pip install jsonschema)")
    if not 0 <= constrained <= concurrent:
        raise UserError(f"--constrained={constrained}: expected 0 to --concurrent={concurrent}")
    from kiln.pipeline.runtime import pick_device

    lm = TextModel(model_dir, tokenizer, pick_device(device))
    if not lm.meta.get("chat_format"):
        raise UserError(f"{model_dir}: not a chat model (SFT, DPO or GRPO): structured outputs are asked of one")
    chat, model = ChatFormat(lm.tokenizer), lm.model.eval()
    rng = random.Random(seed)
    made = [make_schema(rng) for _ in range(schemas)]
    grammars = Grammars(tokenizer, [chat.im_end, chat.eot], model.config.vocab_size)
    longest = max(len(prompt_ids(chat, schema)) for schema in made)
    max_tokens = min(max_tokens or model.config.max_seq_len, model.config.max_seq_len + 1 - longest)
    compile_ms, cached_ms = [], []
    requests = []
    for i, schema in enumerate(made):
        started = time.perf_counter()
        grammar, _ = grammars.compile("json", schema)
        compile_ms.append(1e3 * (time.perf_counter() - started))
        started = time.perf_counter()
        _, hit = grammars.compile("json", schema)
        cached_ms.append(1e3 * (time.perf_counter() - started))
        assert hit
        for j in range(n):
            r = Request(prompt_ids(chat, schema), SamplingParams(max_tokens, 1.0, seed=seed + n * i + j,
                                                                 stop_ids=(chat.im_end, chat.eot)))
            r.grammar = grammar.copy()
            requests.append(r)
    heads = fork_groups(requests, n)
    with torch.inference_mode():
        Engine.sized_for(model, heads).run(heads)
    texts = [chat.parse_reply(r.output) for r in requests]
    ok = [valid(t, made[k // n]) for k, t in enumerate(texts)]
    endings = {reason: sum(r.finish_reason == reason for r in requests) for reason in ("stop", "length")}
    validity = {"schemas": schemas, "n": n, "outputs": len(requests), "valid": sum(ok),
                "valid_share": round(sum(ok) / len(ok), 4), "finish_reasons": endings,
                "output_tokens_mean": round(statistics.mean(len(r.output) for r in requests), 1),
                "compile_ms_median": round(statistics.median(compile_ms), 2),
                "compile_ms_max": round(max(compile_ms), 2),
                "cached_ms_median": round(statistics.median(cached_ms), 3),
                "invalid_examples": [{"schema": made[k // n], "text": texts[k][:300]}
                                     for k, good in enumerate(ok) if not good][:5]}
    load = loaded_throughput(model, chat, grammars, made, concurrent, constrained, max_tokens, repeats, seed)
    result = {"machine": machine(), "model": str(model_dir), "validity": validity,
              "load": load}
    table = Table(title="kiln bench structured")
    for column in ("measure", "value"):
        table.add_column(column)
    table.add_row("outputs valid", f"{sum(ok)} / {len(ok)} ({schemas} schemas x n={n}, temperature 1)")
    table.add_row("finish reasons", ", ".join(f"{k} {v}" for k, v in endings.items()))
    table.add_row("compile ms (median / max; cached)", f"{validity['compile_ms_median']} / "
                                                       f"{validity['compile_ms_max']}; {validity['cached_ms_median']}")
    for row in load["rows"]:
        table.add_row(f"{row['variant']} tokens/s", f"{row['output_tokens_per_s']:,}")
    table.add_row(f"{constrained} of {concurrent} constrained / none (median)", f"{load['ratio_median']:.3f}\n"
                  f"({', '.join(f'{r:.3f}' for r in load['ratios'])})")
    console.print(table)
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result


def loaded_throughput(model, chat: ChatFormat, grammars: Grammars, schemas: list[dict], concurrent: int,
                      constrained: int, max_tokens: int, repeats: int, seed: int) -> dict:
    """`concurrent` requests at once, unconstrained and with `constrained` of them following a schema each,
    taking turns (which goes first alternates): output tokens/s of each run and the ratio of each pair."""
    spread = {k * concurrent // constrained for k in range(constrained)}  # evenly among the others

    def run(with_grammar: bool) -> dict:
        requests = []
        for i in range(concurrent):
            schema = schemas[i % len(schemas)]
            r = Request(prompt_ids(chat, schema), SamplingParams(max_tokens, 1.0, seed=seed + i))
            if with_grammar and i in spread:
                r.grammar = grammars.compile("json", {"type": "array", "items": schema, "minItems": max_tokens})[0]
            requests.append(r)
        engine = Engine.sized_for(model, requests)
        started = time.perf_counter()
        with torch.inference_mode():
            engine.run(requests)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.output) for r in requests)
        return {"variant": f"{sum(r.grammar is not None for r in requests)} of {concurrent} constrained",
                "output_tokens": tokens, "seconds": round(seconds, 3),
                "output_tokens_per_s": round(tokens / seconds, 1)}

    rows, ratios = [], []
    run(False), run(True)  # untimed: the first runs pay for allocations and the grammars' first compiles
    for k in range(repeats):
        pair = [run(False), run(True)] if k % 2 == 0 else [run(True), run(False)][::-1]
        rows += pair
        ratios.append(pair[1]["output_tokens_per_s"] / pair[0]["output_tokens_per_s"])
    return {"concurrent": concurrent, "constrained": constrained, "max_tokens": max_tokens, "rows": rows,
            "ratios": [round(r, 4) for r in ratios], "ratio_median": round(statistics.median(ratios), 4)}
