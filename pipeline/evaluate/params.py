"""The `eval` section: which models the evaluate stage compares, on which tokens, tasks and sample prompts."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar

from kiln.pipeline.config import Section, coerce
from kiln.pipeline.errors import UserError, shown
from kiln.pipeline.serve.request import MAX_TEMPERATURE
from kiln.pipeline.tasks.chat_data import PROMPT_FORMATS
from kiln.pipeline.tasks.tasks import TASK_FORMATS, TaskSpec
from kiln.pipeline.text.corpus import SURROGATE

DEFAULT_SAMPLES = ["ROMEO.\nBut soft, what light", "To be, or not to be", "Who speaks first in this passage?\n\nKING."]


@dataclass
class GenTaskSpec:
    """An `eval.tasks` entry with a `reward` key."""

    name: str
    data: str                          # builtin | a .json/.jsonl/.parquet file | hf:<dataset>[:<config>]
    reward: str                        # exact | numeric | contains | regex | module:function | file.py:function
    reward_pattern: str | None = None  # reward regex: the pattern, {answer} standing for the escaped answer
    format: str = "auto"               # auto | prompt_answer | gsm8k
    split: str = "test"                # hf split
    limit: int | None = None           # at most this many prompts (builtin: how many to derive)
    samples: int = 8                   # n samples per prompt behind pass@k; 0: greedy only
    temperature: float = 1.0           # of the samples
    max_new_tokens: int = 16
    reward_timeout: float = 10.0       # seconds a reward of the user's own may take per completion
    reward_memory_gib: float = 16.0    # address space per process of a reward of the user's own (RLIMIT_AS)
    reward_processes: int = 1024       # processes a reward of the user's own may run at once

    def check(self, key: str) -> None:
        def bad(name: str, expected: str) -> UserError:
            return UserError(f"params: {key}.{name}={shown(getattr(self, name))}: expected {expected}")

        if self.format not in ("auto", *PROMPT_FORMATS):
            raise bad("format", f"auto or one of {', '.join(PROMPT_FORMATS)}")
        if self.limit is not None and self.limit < 1:
            raise bad("limit", "a positive integer or null")
        if self.data == "builtin" and self.limit is None:
            raise UserError(f"params: {key}.limit: the number of speaker questions to derive when data is builtin")
        if self.samples < 0:
            raise bad("samples", "0 (greedy only) or more")
        if self.samples and not 0 < self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"a number above 0 and at most {MAX_TEMPERATURE} (the samples' temperature; "
                      "samples: 0 for greedy only)")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "a positive integer")
        if not 0 < self.reward_timeout < math.inf:
            raise bad("reward_timeout", "a positive number of seconds")
        if not 0 < self.reward_memory_gib < math.inf:
            raise bad("reward_memory_gib", "a positive number of GiB")
        if self.reward_processes < 1:
            raise bad("reward_processes", "a positive integer")

    def ks(self) -> list[int]:
        """The k of each sampled/pass@k: powers of two up to n."""
        return [2 ** i for i in range(self.samples.bit_length())]


@dataclass
class EvalParams(Section):
    """The evaluate stage: which models, how many val tokens, which multiple-choice tasks, which samples."""

    SECTION: ClassVar[str] = "eval"
    models: list[str] = dataclasses.field(default_factory=lambda: ["base", "sft", "dpo", "grpo"])  # data/models/*
    tokens: int = 65536  # val tokens for loss, perplexity and bits per byte: the same budget for every model
    batch_size: int = 16  # rows per forward
    # A multiple-choice task: {name, data, format, split, shots, limit, delimiter}; data `builtin` is the corpus
    # cloze task. A generative task has a reward: {name, data, reward, reward_pattern, format, split, limit,
    # samples, temperature, max_new_tokens, reward_timeout, reward_memory_gib, reward_processes}; data `builtin` is the built-in task's held-out speaker questions.
    tasks: list[dict] = dataclasses.field(default_factory=lambda: [
        {"name": "cloze", "data": "builtin", "limit": 500},
        {"name": "speaker", "data": "builtin", "reward": "exact", "limit": 300, "samples": 8, "temperature": 1.0,
         "max_new_tokens": 16}])
    gen_batch_size: int = 256  # generative tasks: answers the engine's cache holds at once (the rest queue)
    posttrain: bool = True  # the built-in post-training task's held-out accuracy and preference accuracy
    samples: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_SAMPLES))
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy, the same text on every run
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    # null | int8 | int4 | fp8: each model also scored with its blocks' linear layers quantized so (model/quantize.py, as
    # `kiln serve --quantize`), a column `<model>+<kind>` set against the original's with paired intervals
    quantize: str | None = None

    def check(self) -> None:
        if not self.models or len(set(self.models)) < len(self.models):
            raise self.bad("models", "a non-empty list of distinct model folder names")
        for name in self.models:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
                raise self.bad("models", f"folder names under data/models (got {name!r})")
        if self.quantize is not None:
            from kiln.model.quantize import KINDS  # here: the params answer without importing torch otherwise

            if self.quantize not in KINDS:
                raise self.bad("quantize", f"null or one of {', '.join(KINDS)}")
        for name in ("tokens", "batch_size", "gen_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise self.bad("temperature", f"0 (greedy) to {MAX_TEMPERATURE}")
        if self.top_k is not None and self.top_k < 1:
            raise self.bad("top_k", "a positive integer or null")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise self.bad("top_p", "a number in (0, 1] or null")
        for i, prompt in enumerate(self.samples):
            if SURROGATE.search(prompt):  # YAML can spell one ("\ud800"); no tokenizer can encode it
                raise UserError(f"params: {self.SECTION}.samples[{i}]: not valid Unicode (a lone surrogate)")
        self.task_specs()

    def task_specs(self) -> list[TaskSpec | GenTaskSpec]:
        """`tasks` as TaskSpecs (multiple choice) and GenTaskSpecs (an entry with a `reward`), each key
        type-checked; errors name the entry (`eval.tasks[1].gold`)."""
        specs, names = [], set()
        for i, entry in enumerate(self.tasks):
            key = f"{self.SECTION}.tasks[{i}]"
            cls = GenTaskSpec if "reward" in entry else TaskSpec
            hints = typing.get_type_hints(cls)
            unknown = sorted(set(entry) - set(hints))
            if unknown:
                hint = ("; a generative task needs a reward" if cls is TaskSpec
                        and unknown[0] in typing.get_type_hints(GenTaskSpec) else "")
                raise UserError(f"params: {key}: unknown key {unknown[0]!r} (expected {', '.join(hints)}{hint})")
            for field in ("name", "data"):
                if field not in entry:
                    raise UserError(f"params: {key}: missing key {field!r}")
            spec = cls(**{k: coerce(f"{key}.{k}", v, hints[k]) for k, v in entry.items()})
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec.name) or spec.name in names:
                raise UserError(f"params: {key}.name={spec.name!r}: expected a distinct name of letters, digits, "
                                "_ . -")
            names.add(spec.name)
            if cls is GenTaskSpec:
                spec.check(key)
                specs.append(spec)
                continue
            if spec.format not in ("auto", *TASK_FORMATS):
                raise UserError(f"params: {key}.format={spec.format!r}: expected auto or one of "
                                f"{', '.join(TASK_FORMATS)}")
            if spec.shots < 0 or (spec.limit is not None and spec.limit < 1):
                bad = "shots" if spec.shots < 0 else "limit"
                raise UserError(f"params: {key}.{bad}={getattr(spec, bad)!r}: expected "
                                + ("0 or more" if bad == "shots" else "a positive integer or null"))
            if spec.data == "builtin" and spec.limit is None:
                raise UserError(f"params: {key}.limit: the number of cloze items to derive when data is builtin")
            specs.append(spec)
        return specs
