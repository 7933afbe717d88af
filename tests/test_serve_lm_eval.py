"""lm-evaluation-harness against `kiln serve`: its `local-completions` model (token-id prompts, echo, logprobs 1,
max_tokens 1, each continuation's log-likelihood read as token_logprobs[len(context):-1]) scores ARC-Easy items
against a running server, and its own `hf` model scores the same items on the same model exported to the
transformers format (`kiln convert to-hf`): every choice's log-likelihood agrees. The server once put
<|endoftext|> before every token-id prompt, so lm-eval's requests were scored on other ids than it sent: up to
1.03 nats apart from hf on 394 of 400 ARC-Easy choices."""

from __future__ import annotations

import json

import pytest

from kiln.pipeline.tools.convert import to_hf
from test_serve_api import running_server

pytest.importorskip("lm_eval")  # a test-only dependency (pyproject's dev extra); `make setup` installs it

ITEMS = 12  # ARC-Easy's first questions: 48 choices, seconds on the random 512-context model
TASK = """task: kiln_arc_easy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def scored(results: dict) -> dict[int, list[float]]:
    """Each item's choices' log-likelihoods, as lm-eval logged them (--log_samples), by item."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"]["kiln_arc_easy"]}


def test_lm_eval_local_completions_on_kiln_serve_scores_as_its_hf_model_does(tiny, tmp_path, shared_data,
                                                                               monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    (tmp_path / "tasks").mkdir()
    arc = shared_data / "eval/llm-foundry/world_knowledge/arc_easy.jsonl"
    (tmp_path / "tasks/kiln_arc_easy.yaml").write_text(TASK.format(data=arc))
    # its own tasks only: indexing lm-eval's thousands of built-in task files took 30 s
    tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    with running_server(tiny, tmp_path) as (base, _):
        to_hf(tmp_path / "tiny", tmp_path / "hf", tiny.tokenizer)  # the same weights; lm-eval's tokenizer
        served = lm_eval.simple_evaluate(
            model="local-completions", model_args={
                "model": "tiny", "base_url": f"{base}/v1/completions", "tokenizer_backend": "huggingface",
                "tokenizer": str(tmp_path / "hf"), "num_concurrent": 1, "max_retries": 1, "max_length": 512},
            tasks=["kiln_arc_easy"], task_manager=tasks, limit=ITEMS, batch_size=8, log_samples=True)
    hf = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(tmp_path / "hf"), "dtype": "float32"},
                                 device="cpu", tasks=["kiln_arc_easy"], task_manager=tasks, limit=ITEMS,
                                 batch_size=8, log_samples=True)
    theirs, ours = scored(hf), scored(served)
    assert sorted(ours) == sorted(theirs) == list(range(ITEMS))
    for item in range(ITEMS):
        assert len(ours[item]) == 4 and ours[item] == pytest.approx(theirs[item], abs=1e-3), (item, ours, theirs)
    assert served["results"]["kiln_arc_easy"]["acc,none"] == hf["results"]["kiln_arc_easy"]["acc,none"]
    print(json.dumps({"max_abs_diff": max(abs(a - b) for i in theirs for a, b in zip(ours[i], theirs[i]))}))
