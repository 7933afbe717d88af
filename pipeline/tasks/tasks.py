"""Multiple-choice benchmarks read in their public formats and turned into uniform items for the scorer.

Each benchmark ships in its own shape (llm-foundry's query/choices jsonl, WinoGrande's partial-scoring options,
HellaSwag's original schema, LAMBADA's context and last word, MMLU's header-less CSV per subject), so there is one
small adapter per format and the scorer only sees `MCItem`s: a context and a continuation per choice and the index
of the right one. Where lm-evaluation-harness defines a prompt (HellaSwag's cleanup, the MMLU template) it is
followed to the character, so that scores can be compared with published ones. Every field is checked by type: a
row that breaks its format (a gold index that is not an int in range, choices that are not a list of strings) is
an error naming its file and line, as the harness would fail on it. Only rows the benchmark itself leaves
unlabelled (HellaSwag's test split) are counted and skipped; a task with no usable row at all is an error.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kiln.pipeline.errors import UserError
from kiln.pipeline.stage_inputs import check_declared
from kiln.pipeline.tasks.chat_data import Skip, convert_rows, read_rows, reasons
from kiln.pipeline.tasks.task_files import Row, is_row_file, read_csv_file, read_row_file
from kiln.pipeline.text.corpus import SURROGATE

TASK_FORMATS = ("query", "partial", "hellaswag", "lambada", "mmlu")

# The columns that identify each format, tried in this order.
TASK_COLUMNS = {"query": ("query", "choices"), "partial": ("context_options", "continuation"),
                "hellaswag": ("ctx_a", "ctx_b", "endings"), "lambada": ("context", "continuation"),
                "mmlu": ("question", "choices", "answer")}

MMLU_LETTERS = ("A", "B", "C", "D")
MMLU_CONTINUATIONS = tuple(" " + letter for letter in MMLU_LETTERS)
MMLU_CELLS = ("question", "A", "B", "C", "D", "answer letter")
MMLU_FILE = re.compile(r"(?P<subject>.+)_(?P<split>[^_]+)\.csv(?:\.gz)?")
HELLASWAG_TAG = re.compile(r"\[.*?\]")


@dataclass(frozen=True)
class MCItem:
    contexts: tuple[str, ...]       # one per choice (the same string repeated unless partial scoring)
    continuations: tuple[str, ...]  # one per choice, the text whose log-prob is scored (delimiter included)
    gold: int                       # index of the right choice
    # The answers as the harness's doc_to_choice gives them, no delimiter: acc_norm divides by their length in
    # characters. Empty: the continuations themselves.
    choices: tuple[str, ...] = ()

    @property
    def n_choices(self) -> int:
        return len(self.continuations)


@dataclass
class TaskSpec:
    name: str
    data: str                 # hf:<dataset>[:<config>] or a local path (file, or for mmlu a directory)
    format: str = "auto"      # auto | one of TASK_FORMATS
    split: str = "test"       # hf split; for an mmlu directory: the sub-folder (dev|val|test)
    shots: int = 0            # mmlu only: k examples from the dev split of the same subject, prepended
    limit: int | None = None  # score at most this many items (the first ones, in file order)
    delimiter: str = " "      # put between context and each choice


@dataclass
class Task:
    name: str
    format: str
    items: list[MCItem]
    skipped: dict[str, int]  # reason -> count of rows that could not be used

    def summary(self) -> str:
        return (f"{self.name}: {len(self.items):,} items"
                + (f", skipped {sum(self.skipped.values()):,} ({reasons(Counter(self.skipped))})" if self.skipped
                   else ""))


class BadRow(Exception):
    """A row that breaks its format; the message names the field and what was expected."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")


def detect_task_format(row: dict, where: str) -> str:
    """The format whose columns the first row has; `where` names the row in the error."""
    fmt = next((fmt for fmt, columns in TASK_COLUMNS.items() if all(c in row for c in columns)), None)
    if fmt is None:
        expected = "; ".join(f"{fmt}: {', '.join(columns)}" for fmt, columns in TASK_COLUMNS.items())
        raise UserError(f"{where}: cannot tell the task format from the columns {', '.join(row) or '(none)'} "
                        f"(expected {expected}; or set format)")
    return fmt


def load_task(spec: TaskSpec, key: str) -> Task:
    where = f"params: {key}={spec.data!r}"
    if spec.format != "auto" and spec.format not in TASK_FORMATS:
        raise UserError(f"params: {key}: unknown format {spec.format!r} (expected auto, {', '.join(TASK_FORMATS)})")
    path = None if spec.data.startswith("hf:") else Path(spec.data)
    if path is not None and not path.exists():
        raise UserError(f"{where}: no such file or directory")
    if path is not None:
        check_declared(path, f"{key}.data")
    if path is not None and spec.format in ("auto", "mmlu") and _is_mmlu_csv(path):
        fmt, rows = "mmlu", _csv_rows(_mmlu_files(path, spec.split, where))
    else:
        rows = _rows(spec.data, spec.split, key, where)
        first = next(rows, None)
        if first is None:
            raise UserError(f"{where}: no rows")
        fmt = detect_task_format(first.values, first.where) if spec.format == "auto" else spec.format
        rows = itertools.chain([first], rows)
    convert = (partial(_mmlu_item, shots=_shot_picker(spec, key, where)) if fmt == "mmlu"
               else partial(CONVERTERS[fmt], delimiter=spec.delimiter))
    items, skipped, _ = convert_rows(rows, partial(_located, convert), spec.limit, where)
    return Task(spec.name, fmt, items, dict(skipped))


def _rows(data: str, split: str, key: str, where: str) -> Iterator[Row]:
    if data.startswith("hf:"):
        return (Row(f"{data} (split {split}) row {i}", row) for i, row in enumerate(read_rows(data, split, key), 1))
    path = Path(data)
    if not is_row_file(path):
        raise UserError(f"{where}: unsupported file type (expected .jsonl, .json, .parquet, optionally .gz; an "
                        "MMLU .csv[.gz] or folder; or hf:<dataset>[:<config>])")
    return read_row_file(path)


def _located(convert: Callable[[dict], object], row: Row):
    """A row that breaks its format stops the task, named by file and line: a benchmark scored on a silently
    smaller set is not the benchmark its published numbers are for. Only `Skip` (a row the benchmark itself
    leaves unlabelled) is counted and passed over."""
    try:
        return convert(row.values)
    except BadRow as e:
        raise UserError(f"{row.where}: {e}") from None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(row: dict, name: str) -> object:
    if row.get(name) is None:
        raise BadRow(name, "missing")
    return row[name]


def _checked(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise BadRow(name, f"expected a string, got {_shown(value)}")
    if SURROGATE.search(value):  # JSON can spell one ("\ud800"); no tokenizer can encode it
        raise BadRow(name, "not valid Unicode (a lone surrogate)")
    return value


def _string(row: dict, name: str) -> str:
    return _checked(_field(row, name), name)


def _text(row: dict, name: str) -> str:
    value = _string(row, name)
    if not value.strip():
        raise BadRow(name, "empty")
    return value


def _choices(row: dict, name: str) -> list[str]:
    value = _field(row, name)
    if not isinstance(value, list) or len(value) < 2:
        raise BadRow(name, f"expected a list of at least 2 strings, got {_shown(value)}")
    for i, choice in enumerate(value):
        if not _checked(choice, f"{name}[{i}]").strip():
            raise BadRow(f"{name}[{i}]", "empty")
    return value


def _gold(value: object, n_choices: int, name: str) -> int:
    if type(value) is not int or not 0 <= value < n_choices:  # bool is an int too, and never a valid label
        raise BadRow(name, f"expected an int in 0..{n_choices - 1}, got {_shown(value)}")
    return value


def _query(row: dict, delimiter: str) -> MCItem:
    context, choices = _text(row, "query"), _choices(row, "choices")
    return MCItem((context,) * len(choices), tuple(delimiter + c for c in choices),
                  _gold(_field(row, "gold"), len(choices), "gold"), tuple(choices))


def _partial(row: dict, delimiter: str) -> MCItem:
    """WinoGrande-style partial scoring: the options differ in the context, and only the shared rest is scored.
    The harness's choices are the options, so acc_norm divides by their length (it reports only acc)."""
    contexts, continuation = _choices(row, "context_options"), _text(row, "continuation")
    return MCItem(tuple(contexts), (delimiter + continuation,) * len(contexts),
                  _gold(_field(row, "gold"), len(contexts), "gold"), tuple(contexts))


def _hellaswag_text(text: str) -> str:
    """lm-evaluation-harness's cleanup of the WikiHow artifacts in HellaSwag, kept as is so that scores compare."""
    return HELLASWAG_TAG.sub("", text.strip().replace(" [title]", ". ")).replace("  ", " ")


def _hellaswag(row: dict, delimiter: str) -> MCItem:
    label = row.get("label")
    if label is None or label == "":  # the public test split has its labels blanked
        raise Skip("no gold label")
    endings = [_hellaswag_text(e) for e in _choices(row, "endings")]
    for i, ending in enumerate(endings):
        if not ending.strip():
            raise BadRow(f"endings[{i}]", "empty after the harness's cleanup")
    context = _hellaswag_text(_string(row, "activity_label") + ": " + _string(row, "ctx_a") + " "
                              + _string(row, "ctx_b").capitalize())
    if isinstance(label, str):
        label = int(label) if label.strip().isdecimal() else label
    return MCItem((context,) * len(endings), tuple(delimiter + e for e in endings), _gold(label, len(endings), "label"),
                  tuple(endings))


def _lambada(row: dict, delimiter: str) -> MCItem:
    continuation = _text(row, "continuation")
    return MCItem((_text(row, "context"),), (delimiter + continuation,), 0, (continuation,))


CONVERTERS: dict[str, Callable[[dict, str], MCItem]] = {
    "query": _query, "partial": _partial, "hellaswag": _hellaswag, "lambada": _lambada,
}


def _is_mmlu_csv(path: Path) -> bool:
    return path.is_dir() or path.name.removesuffix(".gz").endswith(".csv")


def _mmlu_files(path: Path, split: str, where: str) -> list[Path]:
    if path.is_file():
        if not MMLU_FILE.fullmatch(path.name):
            raise UserError(f"{where}: expected an MMLU file named <subject>_<split>.csv[.gz]")
        return [path]
    files = sorted(f for f in (path / split).glob(f"*_{split}.csv*") if MMLU_FILE.fullmatch(f.name))
    if not files:
        raise UserError(f"{where}: no <subject>_{split}.csv[.gz] files in {path / split}")
    return files


def _csv_rows(files: list[Path]) -> Iterator[Row]:
    """MMLU's CSVs have no header (question, four choices, answer letter) and the subject only in the file name;
    their rows are given the shape of the Hugging Face rows, with the letter as the answer."""
    for file in files:
        subject = MMLU_FILE.fullmatch(file.name)["subject"]
        for where, cells in read_csv_file(file):
            if len(cells) != len(MMLU_CELLS):
                raise UserError(f"{where}: expected {len(MMLU_CELLS)} cells ({', '.join(MMLU_CELLS)}), "
                                f"got {len(cells)}")
            yield Row(where, {"subject": subject, "question": cells[0], "choices": cells[1:-1], "answer": cells[-1]})


def _mmlu_question(row: dict) -> tuple[str, str, int]:
    """(subject, question block, gold) from a CSV row (answer letter) or a Hugging Face row (answer index)."""
    subject, question, choices = _string(row, "subject"), _text(row, "question"), _choices(row, "choices")
    if len(choices) != len(MMLU_LETTERS):
        raise BadRow("choices", f"expected {len(MMLU_LETTERS)} (A to D), got {len(choices)}")
    answer = _field(row, "answer")
    if isinstance(answer, str):
        if answer not in MMLU_LETTERS:
            raise BadRow("answer", f"expected a letter A to D, got {_shown(answer)}")
        answer = MMLU_LETTERS.index(answer)
    block = question.strip() + "".join(f"\n{letter}. {c}" for letter, c in zip(MMLU_LETTERS, choices)) + "\nAnswer:"
    return subject, block, _gold(answer, len(choices), "answer")


def _mmlu_item(row: dict, shots: Callable[[str, tuple[str, int]], list[tuple[str, int]]]) -> MCItem:
    subject, block, gold = _mmlu_question(row)
    prompt = (f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
              + "".join(f"{shot} {MMLU_LETTERS[answer]}\n\n" for shot, answer in shots(subject, (block, gold)))
              + block)
    return MCItem((prompt,) * len(MMLU_CONTINUATIONS), MMLU_CONTINUATIONS, gold, MMLU_LETTERS)


def _shot_picker(spec: TaskSpec, key: str, where: str) -> Callable[[str, tuple[str, int]], list[tuple[str, int]]]:
    """(subject, question) -> its k-shot examples, the first `spec.shots` dev questions of the subject.

    As in lm-evaluation-harness, a dev question equal to the one scored is dropped rather than replaced (one val
    question of college_physics repeats a dev one and so gets k-1 examples), and when the dev split itself is scored
    k+1 are drawn so that every question still gets k."""
    if not spec.shots:
        return lambda subject, question: []
    dev = _dev_questions(spec, key, where)
    path = Path(spec.data)
    draw = spec.shots + ((MMLU_FILE.fullmatch(path.name)["split"] if path.is_file() else spec.split) == "dev")

    def pick(subject: str, question: tuple[str, int]) -> list[tuple[str, int]]:
        candidates = dev(subject)
        if len(candidates) < draw:
            raise UserError(f"{where}: shots={spec.shots} needs {draw} dev questions of subject {subject!r}, "
                            f"found {len(candidates)}")
        return [q for q in candidates[:draw] if q != question][:spec.shots]
    return pick


def _dev_questions(spec: TaskSpec, key: str, where: str) -> Callable[[str], list[tuple[str, int]]]:
    """subject -> its dev questions in file order, each subject read once."""
    by_subject: dict[str, list[tuple[str, int]]] = {}
    if spec.data.startswith("hf:"):
        for subject, block, gold in _questions(_rows(spec.data, "dev", key, where)):
            by_subject.setdefault(subject, []).append((block, gold))
        return lambda subject: by_subject.get(subject, [])
    path = Path(spec.data)
    if not _is_mmlu_csv(path):
        raise UserError(f"{where}: shots={spec.shots} needs an MMLU directory, <subject>_<split>.csv[.gz] file or "
                        "hf: data set to take the dev examples from")
    dev_dir = (path if path.is_dir() else path.parent.parent) / "dev"

    def questions(subject: str) -> list[tuple[str, int]]:
        if subject not in by_subject:
            file = next((f for f in (dev_dir / f"{subject}_dev.csv", dev_dir / f"{subject}_dev.csv.gz")
                         if f.is_file()), None)
            if file is None:
                raise UserError(f"{where}: shots={spec.shots} needs {dev_dir / subject}_dev.csv[.gz]")
            by_subject[subject] = [(block, gold) for _, block, gold in _questions(_csv_rows([file]))]
        return by_subject[subject]
    return questions


def _questions(rows: Iterator[Row]) -> Iterator[tuple[str, str, int]]:
    return (_located(_mmlu_question, row) for row in rows)
