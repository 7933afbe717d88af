"""params.yaml: reading it, `--set` overrides, and the checks every section's dataclass gets.

Each section is a plain dataclass beside the stage that reads it (`DataParams` in text/sources.py,
`TrainParams` in train/params.py, ...), with the defaults params.yaml holds. Every stage reads only its own section, so that DVC's `params:` lists in dvc.yaml stay honest. A bad key or
value stops the command before any work with a `UserError` that names the dotted key (`data.val_fraction`).
Types and finiteness are checked here for every section alike, before the section's own `check()` sees a value:
its range checks are comparisons, and every comparison with NaN is false, so a NaN would pass them all.
`--set key=value` overrides are parsed as YAML scalars, so `--set data.max_docs=null` and
`--set tokenizer.vocab_size=2048` mean what they say.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import ClassVar

import yaml

from kiln.pipeline.errors import UserError, shown
from kiln.pipeline.layout import PARAMS

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
SECTIONS = ("data", "tokenizer", "shard", "model", "train", "scaling", "sft", "dpo", "grpo", "eval")


class Section:
    """Base for section dataclasses: `SECTION` names the params.yaml key, `check()` validates ranges."""

    SECTION: ClassVar[str]

    def check(self) -> None:
        pass

    def bad(self, name: str, expected: str) -> UserError:
        return UserError(f"params: {self.SECTION}.{name}={shown(getattr(self, name))}: expected {expected}")


MAX_PARAMS_BYTES = 1_000_000  # params.yaml is a few kB; anything near this is not a params file
MAX_VALUES = 100_000  # scalars and containers in the document, each alias counted for what it stands for


class _UniqueKeys(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping: YAML loaders keep the last silently, so a
    second `train:` section dropped the first one's keys. Merge keys (`<<: *base`) still override as YAML says."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class says what is wrong with it
                continue
            if repeated:
                raise yaml.YAMLError(f"key {shown(key)} given twice in one mapping (line {key_node.start_mark.line + 1}"
                                     "); expected each key once")
        return super().construct_mapping(node, deep)


def parse_yaml(text: str):
    """A YAML document's value by the safe loader (each key once per mapping), refused (yaml.YAMLError) when its
    aliases make it stand for more than MAX_VALUES values: a "billion laughs" document is small and parses fast
    (an alias is a shared reference), but anything that walks or prints it expands it to gigabytes."""
    value = yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    sizes: dict[int, int] = {}

    def size(node) -> int:  # memoised on identity: each shared node is walked once
        if id(node) not in sizes:
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            sizes[id(node)] = min(1 + sum(size(child) for child in children), MAX_VALUES + 1)
        return sizes[id(node)]
    if size(value) > MAX_VALUES:
        raise yaml.YAMLError(f"its aliases expand it to more than {MAX_VALUES:,} values")
    return value


def read_params_file(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: params file not found")
    if path.stat().st_size > MAX_PARAMS_BYTES:
        raise UserError(f"{path}: {path.stat().st_size:,} bytes; expected a params file of at most "
                        f"{MAX_PARAMS_BYTES:,}")
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections at the top level")
    for key in raw:
        if key not in SECTIONS:
            raise UserError(f"{path}: unknown section '{key}'{did_you_mean(key, SECTIONS)} (expected one of: "
                            f"{', '.join(SECTIONS)})")
    return raw


S = typing.TypeVar("S", bound=Section)


def load_section(cls: type[S], path: Path = PARAMS, overrides: typing.Iterable[str] = ()) -> S:
    """Read `cls.SECTION` from `path`, apply `--set` overrides, type-check and validate."""
    section = cls.SECTION
    values = read_params_file(path).get(section) or {}
    if not isinstance(values, dict):
        raise UserError(f"{path}: section '{section}' must be a mapping")
    values = dict(values)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected key=value")
        sec, _, name = key.rpartition(".")
        if sec not in ("", section):
            raise UserError(f"--set {key}: this command reads only the '{section}' section")
        try:
            values[name] = parse_yaml(text) if text else ""
        except yaml.YAMLError:  # not YAML (a glob such as *.txt): take the text as it is
            values[name] = text
    return build_section(cls, values)


def load_sections(classes: tuple[type[Section], ...], path: Path = PARAMS,
                  overrides: typing.Iterable[str] = ()) -> list[Section]:
    """Several sections for a command that reads more than one; `--set` keys go to the section they name,
    bare keys to the first."""
    names = [cls.SECTION for cls in classes]
    split: dict[str, list[str]] = {name: [] for name in names}
    for item in overrides:
        section = item.partition("=")[0].rpartition(".")[0]
        if section and section not in names:
            raise UserError(f"--set {item.partition('=')[0]}: this command reads only the "
                            f"{', '.join(repr(n) for n in names)} sections")
        split[section or names[0]].append(item)
    return [load_section(cls, path, split[cls.SECTION]) for cls in classes]


def build_section(cls: type[S], values: dict) -> S:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            shown_key = key if isinstance(key, str) and key.isidentifier() else shown(key)  # one line, whatever it is
            raise UserError(f"params: unknown key {cls.SECTION}.{shown_key}{did_you_mean(key, names, cls.SECTION + '.')} "
                            f"(expected one of: {', '.join(names)})")
        kwargs[key] = coerce(f"{cls.SECTION}.{key}", value, hints[key])
    obj = cls(**kwargs)
    for name in names:
        if name == "seed" or name.endswith("_seed"):
            check_seed(getattr(obj, name), f"params: {cls.SECTION}.{name}")
    obj.check()
    return obj


SEED_BOUND = 2 ** 63  # torch's and numpy's generators take a seed as 64 bits; kiln's seeds are in [0, 2**63)


def check_seed(value, name: str) -> None:
    """Refuse a seed outside [0, 2**63): a negative one or one past int64 crashed a run midway (numpy's
    generators refuse negatives, torch overflows past 64 bits)."""
    if isinstance(value, int) and not 0 <= value < SEED_BOUND:
        raise UserError(f"{name}={shown(value)}: expected a whole number in [0, 2**63)")


def did_you_mean(name: object, known, prefix: str = "") -> str:
    """"; did you mean 'lr'?" for the closest of `known` to a mistyped `name`, or "" when none is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def coerce(key: str, value, tp):
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"params: {key}=null: expected {_describe(tp)}")
    for option in options:
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(key, value)
        if option is float and isinstance(value, str) and _FLOAT.fullmatch(value):  # PyYAML reads 1e12 as text
            return _finite(key, value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (str, bool, dict) and isinstance(value, option):
            return value
        if typing.get_origin(option) is list and isinstance(value, list):
            (item,) = typing.get_args(option)
            return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    raise UserError(f"params: {key}={shown(value)}: expected {_describe(tp)}")


def _finite(key: str, value) -> float:
    """`value` as a float, refusing .nan, .inf, and numbers too large for a float (1e999, 10**400)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise UserError(f"params: {key}={shown(value)}: expected a finite number")
    return number


def _describe(tp) -> str:
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    return " or ".join(words.get(o, getattr(o, "__name__", str(o))) for o in options)


