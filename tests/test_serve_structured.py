"""Structured outputs through `kiln serve` as clients ask for them: the `openai` client's
`beta.chat.completions.parse` with a pydantic model, JSON mode, a JSON schema on the completions route, vLLM's
`structured_outputs` (choice, regex, json) through `extra_body`, streamed and with `n`; every output validated with
`jsonschema`, against a random model that would never write JSON by itself. Then the cache of compiled grammars
as /metrics counts it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest

from test_serve_api import running_server

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    # strings bounded: a random model at temperature 1 would rarely close one
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    friends: list[Annotated[str, pydantic.Field(max_length=6)]] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def client(tiny, tmp_path_factory):
    with running_server(tiny, tmp_path_factory.mktemp("structured")) as (base, _):
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def chat(**kwargs):
    return {"model": "tiny", "messages": [{"role": "user", "content": "who?"}], "max_tokens": 400} | kwargs


def test_parse_with_a_pydantic_model_returns_the_model(client):
    """The client sends Person's strict JSON schema as response_format and parses the answer into Person."""
    _, api = client
    done = api.beta.chat.completions.parse(**chat(response_format=Person, temperature=1.0, n=4, seed=3))
    assert len(done.choices) == 4
    for choice in done.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content
        assert 0 <= choice.message.parsed.age <= 120 and len(choice.message.parsed.friends) <= 2


def test_json_mode_and_a_schema_on_both_routes_whole_and_streamed(client):
    _, api = client
    done = api.chat.completions.create(**chat(response_format={"type": "json_object"}, temperature=1.0, seed=1,
                                              logprobs=True, top_logprobs=2))
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    tokens = done.choices[0].logprobs.content  # the model's own log-probabilities, of the tokens the grammar let out
    assert "".join(t.token for t in tokens) == done.choices[0].message.content and all(t.logprob <= 0 for t in tokens)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    pieces = [c.choices[0].delta.content or "" for c in api.chat.completions.create(
        **chat(response_format=schema, temperature=1.0, seed=2, stream=True))]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)
    text = api.completions.create(model="tiny", prompt="the king", max_tokens=400, temperature=1.0, n=4, seed=5,
                                  extra_body={"response_format": schema})
    for choice in text.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_vllm_structured_outputs_choice_regex_and_json(client):
    _, api = client
    picks = api.chat.completions.create(**chat(temperature=1.0, n=8, seed=0, extra_body={
        "structured_outputs": {"choice": ["yes", "no", "it is \"unclear\""]}}))
    assert {c.message.content for c in picks.choices} <= {"yes", "no", 'it is "unclear"'}
    dates = api.completions.create(model="tiny", prompt="on", max_tokens=40, temperature=1.0, n=4, seed=0,
                                   extra_body={"structured_outputs": {"regex": r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"}})
    assert all(re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]", c.text) for c in dates.choices), dates
    assert all(c.finish_reason == "stop" for c in dates.choices)  # the grammar ended them, not max_tokens
    one = api.completions.create(model="tiny", prompt="x", max_tokens=400, temperature=0.0,
                                 extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}})
    jsonschema.validate(json.loads(one.choices[0].text), SCHEMA)


def test_a_repeated_schema_compiles_once(client):
    """The second and third requests with the same schema are cache hits; another schema is a miss."""
    base, api = client

    def counts() -> dict[str, float]:
        text = api._client.get(f"{base}/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'kiln:structured_output_grammars_total\{cache="(\w+)"\} (\S+)', text)}

    before = counts()
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    for _ in range(3):
        api.chat.completions.create(**chat(response_format={"type": "json_schema", "json_schema": {
            "name": "k", "schema": schema}}, max_tokens=20))
    after = counts()
    assert after.get("miss", 0) - before.get("miss", 0) == 1 and after["hit"] - before.get("hit", 0) == 2


def test_grammars_hold_through_forks_preemption_and_the_prefix_cache(tiny):
    """On the engine alone: 6 requests of 4 samples each (a request and its forks) at temperature 1, in a pool
    small enough to preempt, half of them sharing a prompt with the others (the prefix cache): every output is
    its schema's JSON, and plain requests in the same steps are what they are alone."""
    from kiln.pipeline.serve.engine import Engine
    from kiln.pipeline.serve.grammar import Grammars
    from kiln.pipeline.serve.request import Request, SamplingParams, fork_groups
    from kiln.pipeline.text.bpe import EOT, load_tokenizer

    tok = load_tokenizer(tiny.tokenizer, ordinary=True)
    eot = tok.token_to_id(EOT)
    model = tiny_model_for(tok.get_vocab_size())
    grammars = Grammars(tiny.tokenizer, [eot], model.config.vocab_size)
    schemas = [SCHEMA, {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
               {"enum": ["king", "queen", "O"]}]
    prompts = [[eot, *tok.encode(text).ids] for text in ("the king said", "the king said well", "night")]
    constrained = []
    for i in range(6):
        schema = schemas[i % 3]
        grammar, _ = grammars.compile("json", schema)
        for j in range(4):
            r = Request(prompts[i % 3], SamplingParams(150, 1.0, seed=10 * i + j, stop_ids=(eot,)))
            r.grammar = grammar.copy()
            constrained.append((r, schema))
    plain = [Request(p, SamplingParams(20, 1.0, seed=99 + k)) for k, p in enumerate(prompts)]
    alone = [Engine(model, num_blocks=64, block_size=8).run([Request(p.prompt, p.sampling)])[0].output
             for p in plain]
    engine = Engine(model, num_blocks=40, block_size=8)
    engine.run(fork_groups([r for r, _ in constrained], 4) + plain)
    assert engine.scheduler.preemptions > 0 and engine.pool.in_use() == 0
    for r, schema in constrained:
        jsonschema.validate(json.loads(tok.decode([t for t in r.output if t != eot])), schema)
    assert [p.output for p in plain] == alone


def tiny_model_for(vocab: int):
    import torch

    from kiln.model.config import ModelConfig
    from kiln.model.gpt import GPT

    torch.manual_seed(0)
    return GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, d_model=32, max_seq_len=256,
                           vocab_size=vocab + 5)).eval()  # ids past the tokenizer: never allowed


def test_a_bad_grammar_is_one_line_naming_what_was_asked(tiny, tmp_path):
    from kiln.pipeline.serve.grammar import GrammarError, Grammars

    grammars = Grammars(tiny.tokenizer, [0], 300)
    for kind, spec, words in (("json", {"type": "frobnicate"}, "frobnicate"), ("regex", "([a-", "unclosed"),
                              ("grammar", "start: missing_rule", "missing_rule")):
        with pytest.raises(GrammarError, match=words) as e:
            grammars.compile(kind, spec)
        assert "\n" not in str(e.value)


def test_generate_follows_a_json_schema_file_or_a_regex(tiny, tmp_path):
    """`kiln generate --json-schema FILE` and `--regex`: the completion follows it; a bad one is one line."""
    from typer.testing import CliRunner

    from conftest import fails_in_one_line
    from kiln.model.checkpoint import save_model
    from kiln.pipeline.cli import app
    from kiln.pipeline.outputs import sha256_file

    model = tiny_model_for(300)
    save_model(model, model.config, tmp_path / "m", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    common = ["generate", "--model", str(tmp_path / "m"), "--tokenizer", str(tiny.tokenizer), "--device", "cpu",
              "--seed", "4", "--max-new-tokens", "200"]
    result = CliRunner().invoke(app, [*common, "--prompt", "the king", "--json-schema", str(tmp_path / "schema.json")])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.output.strip().removeprefix("the king")), SCHEMA)
    result = CliRunner().invoke(app, [*common, "--prompt", "O", "--regex", "(night|day) [0-9]{2}"])
    assert result.exit_code == 0 and re.fullmatch(r"O(night|day) [0-9]{2}", result.output.strip()), result.output
    (tmp_path / "bad.json").write_text('{"type": ')
    fails_in_one_line([*common, "--prompt", "x", "--json-schema", str(tmp_path / "bad.json")], 2, "bad.json",
                      "not JSON")
    fails_in_one_line([*common, "--prompt", "x", "--regex", "(a"], 2, "--regex")
    fails_in_one_line([*common, "--prompt", "x", "--regex", "a", "--json-schema", str(tmp_path / "schema.json")], 2,
                      "--json-schema", "--regex")


def test_a_steps_masks_are_each_grammars_allowed_tokens(tiny):
    """`masks` (llguidance's threads, one call for the step's rows) read through `allowed` equal each matcher's
    own answer token by token (its logit-bias form, a byte per token), mid-way through different outputs."""
    import numpy as np
    import torch

    from kiln.pipeline.serve.grammar import Grammars, mask_words, masks
    from kiln.pipeline.serve.logits_processors import allowed
    from kiln.pipeline.text.bpe import load_tokenizer

    tok = load_tokenizer(tiny.tokenizer, ordinary=True)
    grammars = Grammars(tiny.tokenizer, [0], 303)
    rows = [grammars.compile("json", SCHEMA)[0], grammars.compile("regex", "[a-z]+ [0-9]{1,3}")[0],
            grammars.compile("choice", ["the king", "the queen"])[0]]
    for grammar, text in zip(rows, ['{"name": "O', "night", "the"]):
        assert grammar.matcher.consume_tokens(tok.encode(text).ids)
    got = allowed(torch.from_numpy(masks(rows, mask_words(303)).astype(np.int64)), 303)
    for row, grammar in zip(got, rows):
        want = np.frombuffer(grammar.matcher.compute_logit_bias(), np.uint8)[:303] > 0
        assert row.tolist() == want.tolist() and 0 < row.sum() < 303


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # needs the DAG's models (make repro): make test-slow
@pytest.mark.skipif(not (REPO / "data/models/sft/model.safetensors").is_file(), reason="no DAG models: make repro")
def test_the_dags_sft_model_answers_in_schema_through_the_real_client(tmp_path):
    """`kiln serve` on the DAG's SFT model (a trained model, unlike the random one above): the openai client's
    parse with a pydantic model, JSON mode and vLLM's structured_outputs, n=4 at temperature 1, all valid."""
    import subprocess
    import sys
    import time

    import httpx2 as httpx

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "kiln.pipeline.cli", "serve", "--model",
                                    str(REPO / "data/models/sft"), "--tokenizer",
                                    str(REPO / "data/tokenizer/tokenizer.json"), "--port", "0", "--device", "cpu",
                                    "--quiet"], stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if said := re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text()):
                break
            time.sleep(0.1)
        base = f"http://127.0.0.1:{said.group(1)}"
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        ask = {"model": "sft", "messages": [{"role": "user", "content": "Who speaks?"}], "max_tokens": 90,
               "temperature": 1.0, "n": 4, "seed": 0}
        done = api.beta.chat.completions.parse(**ask, response_format=Person)
        assert all(isinstance(c.message.parsed, Person) for c in done.choices)
        done = api.chat.completions.create(**ask, response_format={"type": "json_object"})
        assert all(isinstance(json.loads(c.message.content), dict) for c in done.choices)
        done = api.chat.completions.create(**ask, extra_body={"structured_outputs": {"json": SCHEMA}})
        for c in done.choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
    finally:
        process.terminate()
        process.wait(timeout=30)
