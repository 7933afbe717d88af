"""lm-evaluation-harness against `kiln serve`: its `local-completions` model (echo, logprobs 1, max_tokens 1,
token-id prompts, the continuation's log-likelihood read as token_logprobs[len(context):-1]) on a small local
multiple-choice task, item by item against `kiln evaluate`'s scoring of the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kiln.model.checkpoint import load_model
from kiln.pipeline.evaluate.scoring import ChoiceTask, score_requests
from kiln.pipeline.tasks.tasks import TaskSpec, load_task
from kiln.pipeline.text.bpe import EOT, load_tokenizer
from kiln.pipeline.tools.convert import to_hf
from test_serve_api import running_server

pytest.importorskip("lm_eval")  # a test-only dependency (pyproject's dev extra); `make setup` installs it

ROWS = [
    {"query": "ROMEO: But soft, what light through yonder", "choices": ["window breaks", "door opens", "sky"],
     "gold": 0},
    {"query": "To be, or not to be: that is the", "choices": ["question", "answer"], "gold": 0},
    {"query": "Now is the winter of our", "choices": ["discontent", "summer", "glorious day"], "gold": 0},
    {"query": "A horse! a horse! my kingdom for a", "choices": ["horse", "crown", "sword", "king"], "gold": 0},
    {"query": "Friends, Romans, countrymen, lend me your", "choices": ["ears", "swords"], "gold": 0},
    {"query": "The quality of mercy is not", "choices": ["strained", "given", "free"], "gold": 0},
]
TASK = """task: kiln_lines
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_scores_each_item_as_kiln_evaluate_does(tiny, tmp_path):
    data = tmp_path / "lines.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks/kiln_lines.yaml").write_text(TASK.format(data=data))
    with running_server(tiny, tmp_path) as (base, _):
        to_hf(tmp_path / "tiny", tmp_path / "hf", tiny.tokenizer)  # lm-eval tokenizes with the exported tokenizer
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        result = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model=tiny,base_url={base}/v1/completions,tokenizer_backend=huggingface,tokenizer={tmp_path / 'hf'},"
             "num_concurrent=1,max_retries=1", "--tasks", "kiln_lines", "--include_path", str(tmp_path / "tasks"),
             "--output_path", str(tmp_path / "out"), "--log_samples"],
            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_kiln_lines_*.jsonl")
    theirs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    # kiln evaluate's scoring of the same rows: <|endoftext|> + context + continuation, as the server prefixes it
    model = load_model(tmp_path / "tiny")[0].eval()
    tok = load_tokenizer(tiny.tokenizer, ordinary=True)
    task = load_task(TaskSpec("lines", str(data)), "eval.tasks[0]")
    choice = ChoiceTask(tok, tok.token_to_id(EOT), task.items, model.config.max_seq_len)
    logp, _ = score_requests(model, choice.requests, [item.n_choices for item in choice.items], 8, "fp32")
    at = 0
    assert len(theirs) == len(ROWS) == len(choice.items)
    for sample, item in zip(theirs, choice.items):
        served = [float(resp[0][0]) for resp in sample["resps"]]  # logged as text
        ours = logp[at:at + item.n_choices].tolist()
        at += item.n_choices
        assert served == pytest.approx(ours, abs=1e-4), (sample["doc_id"], served, ours)
        assert sample["acc"] == float(max(range(len(ours)), key=ours.__getitem__) == item.gold)
