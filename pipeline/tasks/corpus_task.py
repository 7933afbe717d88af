"""The built-in post-training task: questions about passages of the corpus itself, so `dvc repro` runs SFT and
DPO offline with nothing but the default corpus, and their effect can be measured.

A passage is a few consecutive non-blank lines of one document (a scene of a play). Three kinds of question:
- `title`: "Which play is this passage from?" The answer is the document's `source` (the play's title); the
  wrong answers are other titles of the corpus.
- `speaker`: "Who speaks first in this passage?" The passage opens with a speaker's name, the answer; the
  wrong answers are speakers of other scenes who never speak in this one.
- `continue`: "Continue this passage:" The answer is the line that follows (two lines when the first is only a
  speaker's name); the wrong answers are such lines from other documents.
Every item carries its answer and three wrong ones: SFT trains on the answer, DPO prefers it to the first
wrong one, and accuracy asks which of the four the model finds likeliest. Training items come from the train
split, held-out items from the val split only: both splits are whole scenes, so a held-out passage is always
text the model never trained on (its play, it has seen).

GRPO and a generative eval take the same items without their wrong answers (`prompt_items`): the model writes
the answer and a reward checks it, by default for `speaker` questions only, whose short name an exact-match
reward can judge (a passage or a continuation line has no one right wording).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from kiln.pipeline.errors import UserError
from kiln.pipeline.progress import console
from kiln.pipeline.tasks.chat_data import Pair, PromptAnswer
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tasks.tasks import MCItem

KINDS = ("title", "speaker", "continue")
QUESTIONS = {"title": "Which play is this passage from?", "speaker": "Who speaks first in this passage?",
             "continue": "Continue this passage:"}
N_WRONG = 3
MIN_LINES = 4  # a passage of at least 2 lines and an answer line after it
SPEAKER = re.compile(r"[A-Z][A-Z .,'&-]*\.")  # "HAMLET.", "FIRST CITIZEN."
# Capitals ending in "." that head a part of the text instead of naming who speaks: "ACT II.", "SCENE I.",
# "PROLOGUE.", "THE ARGUMENT." (Lucrece). In the Shakespeare corpus these are the only such headings.
HEADING = re.compile(r"(ACT|SCENE|PROLOGUE|EPILOGUE|THE)\b")


def is_speaker(line: str) -> bool:
    """Whether a line only names who speaks next."""
    line = line.strip()
    return SPEAKER.fullmatch(line) is not None and HEADING.match(line) is None


@dataclass(frozen=True)
class TaskItem:
    kind: str
    prompt: tuple[dict, ...]
    answer: str
    wrong: tuple[str, ...]

    @property
    def choices(self) -> tuple[str, ...]:
        """The answer first, then the wrong ones: the gold index is 0."""
        return (self.answer, *self.wrong)

    def conversation(self, answer: str | None = None) -> list[dict]:
        return [*self.prompt, {"role": "assistant", "content": self.answer if answer is None else answer}]

    def pair(self) -> Pair:
        return Pair(list(self.prompt), [{"role": "assistant", "content": self.answer}],
                    [{"role": "assistant", "content": self.wrong[0]}])

    def prompt_answer(self) -> PromptAnswer:
        return PromptAnswer(list(self.prompt), self.answer)


@dataclass(frozen=True)
class Document:
    source: str
    lines: tuple[str, ...]


def read_documents(corpus_dir: Path, split: str) -> list[Document]:
    path = Path(corpus_dir) / f"{split}.parquet"
    if not path.is_file():
        raise UserError(f"{path}: corpus split not found (run `kiln data prepare` first)")
    table = pq.read_table(path)
    if "source" not in table.column_names:
        raise UserError(f"{path}: no `source` column (re-run `kiln data prepare`)")
    docs = []
    for text, source in zip(table.column("text").to_pylist(), table.column("source").to_pylist()):
        # A play's first scene opens with its title, which would answer the title question outright.
        lines = tuple(line.rstrip() for line in text.splitlines()
                      if line.strip() and line.strip().upper() != source.upper())
        if len(lines) >= MIN_LINES:
            docs.append(Document(source, lines))
    return docs


def next_line(lines: tuple[str, ...], i: int) -> str:
    """Line i, joined by the next when line i only names who speaks."""
    if is_speaker(lines[i]) and i + 1 < len(lines):
        return f"{lines[i]}\n{lines[i + 1]}"
    return lines[i]


class TaskBuilder:
    """Draws items from one split's documents; titles come from both splits (`titles`)."""

    def __init__(self, docs: list[Document], titles: list[str], chat: ChatFormat, seq_len: int):
        if not docs:
            raise UserError(f"builtin task: the corpus split has no document of {MIN_LINES} or more non-blank lines")
        self.docs, self.titles, self.chat, self.seq_len = docs, titles, chat, seq_len
        self.kinds = KINDS if len(titles) > N_WRONG else ("continue",)
        sizes = np.array([len(d.lines) for d in docs], dtype=np.float64)
        self.weights = sizes / sizes.sum()  # long scenes give more passages
        sample = "\n".join(line for d in docs[:200] for line in d.lines)
        self.chars_per_token = len(sample) / max(1, len(chat.encode(sample)))

    def build(self, n: int, seed: int, kinds: tuple[str, ...] | None = None) -> list[TaskItem]:
        kinds = kinds or self.kinds
        if unknown := [k for k in kinds if k not in KINDS]:
            raise UserError(f"builtin task: unknown kind {', '.join(unknown)} (expected {', '.join(KINDS)})")
        if "title" in kinds and len(self.titles) <= N_WRONG:
            raise UserError(f"builtin task: the corpus has {len(self.titles)} titles, too few for title questions "
                            f"(each needs {N_WRONG} wrong ones)")
        rng = np.random.default_rng(seed)
        items: list[TaskItem] = []
        for attempt in range(20 * n):
            if len(items) == n:
                break
            # By attempt, not by item: a kind this corpus cannot make (no speaker names) yields to the others.
            item = self._item(kinds[attempt % len(kinds)], rng)
            if item is not None:
                items.append(item)
        if not items:
            # Also what a speaker-only build meets in a corpus without speaker names: hence the kinds named.
            raise UserError(f"builtin task: no passage fits max_seq_len={self.seq_len} tokens with its question "
                            f"({', '.join(kinds)})")
        return items

    def _item(self, kind: str, rng: np.random.Generator) -> TaskItem | None:
        d = int(rng.choice(len(self.docs), p=self.weights))
        doc = self.docs[d]
        if kind == "title":
            answer = doc.source
            others = [t for t in self.titles if t != answer]
            wrong = tuple(others[i] for i in rng.choice(len(others), N_WRONG, replace=False))
            start, end = int(rng.integers(0, len(doc.lines) - 1)), len(doc.lines)
        elif kind == "speaker":
            tags = [i for i, line in enumerate(doc.lines[:-1]) if is_speaker(line)]
            if not tags:
                return None
            start, end = tags[int(rng.integers(0, len(tags)))], len(doc.lines)
            answer = doc.lines[start].strip().rstrip(".")
            wrong = tuple(self._other_speaker(doc, rng) for _ in range(N_WRONG))
            if None in wrong:
                return None
        else:
            end = int(rng.integers(2, len(doc.lines)))  # the answer is line `end`, after at least 2 lines
            answer = next_line(doc.lines, end)
            wrong = tuple(self._other_line(d, rng) for _ in range(N_WRONG))
            start = 0
        return self._fit(kind, doc.lines, start, end, answer, wrong)

    def _other_speaker(self, doc: Document, rng: np.random.Generator) -> str | None:
        """A speaker of another document who is not named in this one."""
        for _ in range(100):
            other = self.docs[int(rng.integers(0, len(self.docs)))]
            tags = [line.strip().rstrip(".") for line in other.lines if is_speaker(line)]
            names = [t for t in tags if t not in doc.lines and f"{t}." not in doc.lines]
            if names:
                return names[int(rng.integers(0, len(names)))]
        return None

    def _other_line(self, d: int, rng: np.random.Generator) -> str:
        other = int(rng.integers(0, len(self.docs) - 1))
        lines = self.docs[other + (other >= d)].lines if len(self.docs) > 1 else self.docs[d].lines
        return next_line(lines, int(rng.integers(0, len(lines))))

    def _fit(self, kind, lines, start, end, answer, wrong) -> TaskItem | None:
        """The longest passage in lines[start:end] that fits with its longest choice: a title passage keeps its
        first lines, a continuation keeps the lines just before its answer."""
        longest = max((answer, *wrong), key=lambda a: len(self.chat.encode(a)))
        overhead = len(self.chat.render(self._conversation(kind, "", longest)).ids)
        budget = (self.seq_len + 1 - overhead) * self.chars_per_token
        picked: list[str] = []
        order = range(start, end) if kind != "continue" else range(end - 1, start - 1, -1)
        for i in order:
            if sum(len(s) + 1 for s in picked) + len(lines[i]) > budget and picked:
                break
            picked.append(lines[i])
        if kind == "continue":
            picked.reverse()
        while picked:
            item = TaskItem(kind, tuple(self._conversation(kind, "\n".join(picked), answer)[:-1]), answer, wrong)
            if len(self.chat.render(item.conversation(longest)).ids) <= self.seq_len + 1:
                return item
            picked = picked[:-1] if kind != "continue" else picked[1:]
        return None

    @staticmethod
    def _conversation(kind: str, passage: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": f"{QUESTIONS[kind]}\n\n{passage}"},
                {"role": "assistant", "content": answer}]


def task_items(corpus_dir: Path, chat: ChatFormat, seq_len: int, n_train: int, n_val: int, seed: int,
               kinds: tuple[str, ...] | None = None) -> tuple[list[TaskItem], list[TaskItem]]:
    """(train items, held-out items) of the built-in task, of `kinds` (default: every kind the corpus can make);
    the same seed gives the same items."""
    train_docs = read_documents(corpus_dir, "train")
    builder = TaskBuilder(train_docs, corpus_titles(corpus_dir), chat, seq_len)
    train = builder.build(n_train, seed, kinds)
    val = held_out_items(corpus_dir, chat, seq_len, n_val, seed, kinds)
    console.print(f"builtin task: {len(train):,} train and {len(val):,} held-out items "
                  f"({', '.join(kinds or builder.kinds)}) "
                  f"from {len(train_docs)} documents and the val split, {len(builder.titles)} titles",
                  highlight=False)
    return train, val


def held_out_items(corpus_dir: Path, chat: ChatFormat, seq_len: int, n_val: int, seed: int,
                   kinds: tuple[str, ...] | None = None) -> list[TaskItem]:
    """The held-out items `task_items` gives for this seed, without building the train items (for eval)."""
    builder = TaskBuilder(read_documents(corpus_dir, "val"), corpus_titles(corpus_dir), chat, seq_len)
    return builder.build(n_val, seed + 1, kinds)


def prompt_items(corpus_dir: Path, chat: ChatFormat, seq_len: int, n_train: int, n_val: int, seed: int,
                 kinds: tuple[str, ...] = ("speaker",)) -> tuple[list[PromptAnswer], list[PromptAnswer]]:
    """(train, held-out) rows of the built-in task in generative form, for GRPO and a generative eval: the
    question as the prompt and the true answer to check completions against. These are `task_items`' items
    for the same seed and kinds, so the held-out prompts come from the val split only. A passage is fitted
    to `seq_len` with its longest choice, which leaves at least that much room for a completion."""
    train, val = task_items(corpus_dir, chat, seq_len, n_train, n_val, seed, kinds)
    return [item.prompt_answer() for item in train], [item.prompt_answer() for item in val]


def corpus_titles(corpus_dir: Path) -> list[str]:
    """Every source title of both splits: the wrong answers of `title` questions."""
    return sorted({d.source for split in ("train", "val") for d in read_documents(corpus_dir, split)})


def cloze_items(corpus_dir: Path, chat: ChatFormat, seq_len: int, n: int, seed: int) -> list[MCItem]:
    """The built-in eval task: `continue` questions of the val split as plain text, no chat markers: the
    passage is the context and "\n" + each candidate line a continuation (acc_norm divides by the line's own
    characters, the delimiter not counted, as for any task), so a base model is scored on what pretraining
    taught it. The true line's position is drawn per item: with gold always first, a tie (two
    equal lines) would count as a hit."""
    header = f"{QUESTIONS['continue']}\n\n"
    items = TaskBuilder(read_documents(corpus_dir, "val"), [], chat, seq_len).build(n, seed, kinds=("continue",))
    rng = np.random.default_rng(seed)
    out = []
    for item in items:
        order = rng.permutation(len(item.choices))
        out.append(MCItem((item.prompt[0]["content"].removeprefix(header),) * len(order),
                          tuple(f"\n{item.choices[i]}" for i in order), int(np.argmin(order)),
                          tuple(item.choices[i] for i in order)))
    return out
