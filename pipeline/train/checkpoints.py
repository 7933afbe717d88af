"""Resume state for long runs: `RUN/step_NNNNNNNN/` folders, written atomically, the newest K of a run kept.

A folder holds `model.safetensors`, `optimizer.safetensors` (every tensor of the optimizer and GradScaler
state, plus the torch RNG states) and `state.json` (step, data-loader state, python/numpy RNG, the run's
fingerprint). No pickle anywhere: a checkpoint cannot run code when loaded.

An FSDP run writes the model and optimizer tensors with `torch.distributed.checkpoint` instead: every rank
saves its own shards into `dcp/` (safetensors files whose metadata records each shard's offsets, so still no
pickle), and a run with any number of processes, FSDP or not, reads back the pieces it needs. Rank 0 writes
the rest (`rng.safetensors`, `state.json`) and renames the folder into place once every rank is done.

The fingerprint is everything that shapes the trajectory (model config, tokenizer, the data, the optimisation
params, the stage's code: pipeline/code_digest.py), and RUN is its hash: a run resumes only from its own folder,
and prunes only its own checkpoints. Changing a param (lowering the lr after a divergence, a `dvc exp run -S`),
the data or the code starts afresh in a folder beside the others, which are never touched; `--resume-from
STEP_FOLDER` goes on from any checkpoint (another run's, one written before this layout) with the params of
this run, whose own checkpoints then go into a folder of their own.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.model.atomic import fsync_tree, replace_dir, writing
from kiln.model.checkpoint import first_non_finite
from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.outputs import atomic_dir, exclusive, recover, write_json
from kiln.pipeline.runtime import SINGLE, World
from kiln.pipeline.train import distributed

NAME = re.compile(r"step_\d{8}")
SHARDED = "dcp"
ANY_STAGE = frozenset({"data", "code", "resumed_from"})


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _steps(folder: Path) -> list[Path]:
    """The checkpoints directly in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and NAME.fullmatch(p.name))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, float) or _is_int(v)) and math.isfinite(v)


# state.json's fields as the loop and the RNGs need them: (check, what is expected). Fields beside them (extra)
# are the loop's own and checked the same way when it reads them.
STATE_FIELDS = {
    "step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "fingerprint": (lambda v: isinstance(v, dict), "an object"),
    # params: the optimizer's numbers, or the parameters' names in a sharded checkpoint
    "param_groups": (lambda v: isinstance(v, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                           and all(_is_int(p) or isinstance(p, str)
                                                                   for p in g["params"]) for g in v),
                     "a list of objects with 'params' numbers or names"),
    "scaler": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "loader": (lambda v: isinstance(v, dict), "an object"),
    "rng_python": (lambda v: isinstance(v, list) and len(v) == 3 and _is_int(v[0]) and isinstance(v[1], list)
                   and all(map(_is_int, v[1])) and (v[2] is None or _is_number(v[2])),
                   "[version, [integers], gauss or null]"),
    "rng_numpy": (lambda v: isinstance(v, list) and len(v) == 5 and isinstance(v[0], str)
                  and isinstance(v[1], list) and all(map(_is_int, v[1])) and _is_int(v[2]) and _is_int(v[3])
                  and _is_number(v[4]), "[name, [integers], pos, has_gauss, gauss]"),
    "train_seconds": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "train_loss": (_is_number, "a finite number"),
}
OPTIONAL = {"train_seconds", "train_loss"}


def read_state(folder: Path) -> dict:
    """`folder`/state.json, every field checked by type; UserError naming the file and field otherwise."""
    path = Path(folder) / "state.json"
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))  # NaN parses, and the field it is in is refused
    except FileNotFoundError:
        raise UserError(f"{path}: not found (expected a checkpoint folder holding state.json)") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: corrupt checkpoint (not JSON: {' '.join(str(e).split())[:120]}); move "
                        f"{path.parent} away to go on") from None
    if not isinstance(state, dict):
        raise UserError(f"{path}: corrupt checkpoint (expected a JSON object, got {type(state).__name__})")
    for key, (ok, expected) in STATE_FIELDS.items():
        if key not in state and key in OPTIONAL:
            continue
        if key not in state or not ok(state[key]):
            got = repr(state.get(key, "nothing"))
            raise UserError(f"{path}: {key}: expected {expected}, got {got[:60]}")
    return state


def run_name(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


class Checkpoints:
    """The checkpoints of one run under `root`. `resume_from`: a checkpoint (of any run) to start from when this
    run has none of its own yet. `command`: the CLI command that trains it, named in the advice when it stops."""

    def __init__(self, root: Path, fingerprint: dict, keep: int, world: World = SINGLE,
                 resume_from: Path | None = None, command: str | None = None):
        self.root, self.keep, self.world, self.command = Path(root), keep, world, command
        self.resume_from = None if resume_from is None else Path(resume_from)
        if self.resume_from is not None:
            origin = read_state(self.resume_from)
            # a stage's runs share the fingerprint's keys (pretrain: model, tokenizer; post-training: start and
            # its own section): other keys are another stage's checkpoint, whose tensors may even fit. The keys
            # every stage has (data, code) tell none apart, and a checkpoint from before them lacks them.
            theirs, ours = (sorted(set(f) - ANY_STAGE) for f in (origin["fingerprint"], fingerprint))
            if theirs != ours:
                raise UserError(f"{self.resume_from}: a checkpoint of another stage (its run is fingerprinted by "
                                f"{', '.join(theirs)}; {command or 'this run'}'s by {', '.join(ours)}); "
                                "--resume-from takes a checkpoint of the same stage")
            # A run continued from another's checkpoint is not the run these params start from scratch.
            fingerprint = {**fingerprint, "resumed_from": {"run": run_name(origin["fingerprint"]),
                                                           "step": origin["step"]}}
        self.fingerprint = fingerprint
        self.folder = self.root / run_name(fingerprint)
        self._read_early: Checkpoint | None = None
        self.newest()  # a broken checkpoint is refused now, before the run sets up and prints anything

    def newest(self) -> Checkpoint | None:
        """The checkpoint to resume from, read and checked; the early read is reused while it is the newest."""
        path = self.latest_path()
        if path is None:
            return None
        if self._read_early is None or self._read_early.path != path:
            self._read_early = self.read(path)
        return self._read_early

    def _all(self) -> list[Path]:
        return _steps(self.folder)

    def latest_path(self) -> Path | None:
        """The newest checkpoint of this run, else `resume_from`, else None to start from scratch."""
        mine = self._all()
        return mine[-1] if mine else self.resume_from

    def others(self) -> list[Path]:
        """The newest checkpoint of every other run under `root` (and any written directly in it), oldest first."""
        if not self.root.is_dir():
            return []
        runs = [p for p in self.root.iterdir() if p.is_dir() and p != self.folder]
        newest = [steps[-1] for steps in map(_steps, runs) if steps]
        return sorted(newest + _steps(self.root)[-1:], key=lambda p: p.stat().st_mtime)

    def advice(self) -> str:
        """How to go on after this run stopped: the last good checkpoint, and that nothing will be deleted."""
        kept = self.latest_path()
        if kept is None:
            return "No checkpoint was written; rerun with a lower learning rate (--set lr=...)."
        again = f" or go on from it: {self.command} --set lr=<lower> --resume-from {kept}" if self.command else ""
        return (f"Last good checkpoint: {kept}. Lower the learning rate (--set lr=...) to start afresh beside "
                f"it{again}; no checkpoint is deleted.")

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler, loader_state: dict,
             extra: dict) -> Path:
        """Called by every rank of a run; `model` as the loop trains it (DDP- or FSDP-wrapped under torchrun)."""
        final = step_dir(self.folder, step)
        bad = self._non_finite(model)
        if bad is not None:
            raise StageError(f"{final}: not saved: {bad} holds NaN or infinite values. {self.advice()}")
        if distributed.is_sharded(model):
            return self._save_sharded(final, step, model, optimizer, scaler, loader_state, extra)
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: gather every rank's share on rank 0
            optimizer.consolidate_state_dict(to=0)
        if self.world.main:
            self._remove_stale()
            with atomic_dir(final) as tmp:
                save_file(_model_tensors(distributed.unwrap(model)), tmp / "model.safetensors")
                opt = optimizer.state_dict()
                tensors = {f"opt.{pid}.{k}": _tensor(v) for pid, st in opt["state"].items() for k, v in st.items()}
                save_file({**tensors, **_rng_tensors()}, tmp / "optimizer.safetensors")
                self._write_state(tmp, step, opt["param_groups"], scaler, loader_state, extra)
            self._rotate()
        distributed.barrier()
        return final

    def _save_sharded(self, final: Path, step: int, model, optimizer, scaler, loader_state: dict,
                      extra: dict) -> Path:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint import save as dcp_save

        tmp = final.with_name(f"{final.name}.tmp-{SHARDED}")  # one name all ranks agree on, without talking
        if self.world.main:
            self._remove_stale()
        distributed.barrier()
        tensors, param_groups = _sharded_state(model, optimizer)
        with writing(final):
            dcp_save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDED), save_distributed=True))
        distributed.barrier()
        if self.world.main:
            with writing(final):
                save_file(_rng_tensors(), tmp / "rng.safetensors")
                self._write_state(tmp, step, param_groups, scaler, loader_state, extra)
                fsync_tree(tmp)
                replace_dir(tmp, final)
            self._rotate()
        distributed.barrier()
        return final

    def _non_finite(self, model: torch.nn.Module) -> str | None:
        """The first weight holding NaN or infinity, checked by every rank on what it holds (an FSDP rank its
        shards, so the verdict is summed over ranks and every rank stops alike)."""
        local = {name: t.to_local() if hasattr(t, "to_local") else t
                 for name, t in distributed.unwrap(model).state_dict().items()}
        bad = first_non_finite(local)
        if distributed.is_sharded(model):
            flag = torch.tensor([float(bad is not None)], device=next(iter(local.values())).device)
            if distributed.total(flag).item() and bad is None:
                bad = "a weight on another process"
        return bad

    def _remove_stale(self) -> None:
        """Finish or undo the replace of a checkpoint that a kill interrupted, and drop its temp folders."""
        for name in {p.name.split(".")[0] for p in self.folder.glob("step_*.*-*")}:
            recover(self.folder / name)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """This run's hold on the folder (rank 0 takes it): a second run on the same checkpoints refuses; what a
        killed save left is recovered first."""
        with exclusive(self.root):
            if self.folder.is_dir():
                self._remove_stale()
            yield

    def _write_state(self, folder: Path, step: int, param_groups: list, scaler, loader_state: dict,
                     extra: dict) -> None:
        np_state = np.random.get_state()
        write_json(folder / "state.json", {
            "step": step,
            "fingerprint": self.fingerprint,
            "param_groups": param_groups,
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "loader": loader_state,
            "rng_python": _jsonable(random.getstate()),
            "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            **extra,
        })

    def _rotate(self) -> None:
        for path in self._all()[:-self.keep]:
            shutil.rmtree(path)

    def read(self, path: Path) -> Checkpoint:
        """What `path` holds, every file checked: state.json by field, the tensors readable and finite (a sharded
        checkpoint's are checked as they load). UserError naming the file otherwise."""
        state = read_state(path)
        if path.parent == self.folder and state["fingerprint"] != self.fingerprint:
            raise UserError(f"{path / 'state.json'}: fingerprint: not the one its folder {self.folder} is named "
                            "after; move the folder away to go on")
        if (path / SHARDED).is_dir():
            return Checkpoint(path, state)
        weights, tensors = _read_tensors(path / "model.safetensors"), _read_tensors(path / "optimizer.safetensors")
        if (bad := first_non_finite(weights)) is not None:
            raise UserError(f"{path / 'model.safetensors'}: {bad}: holds NaN or infinite values")
        return Checkpoint(path, state, weights, tensors)

    def load(self, checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> dict:
        """Restore a checkpoint (from `read`) into the live objects; return its state.json."""
        from torch.distributed.checkpoint.api import CheckpointException

        path, state = checkpoint.path, checkpoint.state
        self._read_early = None  # its tensors are the model's and optimizer's now
        try:
            if checkpoint.weights is None:
                _load_sharded(path / SHARDED, model, optimizer)
                _set_rng(load_file(path / "rng.safetensors"), state)
            else:
                _load_full(checkpoint, distributed.unwrap(model), optimizer)
            if state["scaler"] is not None:
                scaler.load_state_dict(state["scaler"])
        except (OSError, SafetensorError, KeyError, ValueError, TypeError, RuntimeError, CheckpointException) as e:
            reason = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever the library wrote
            raise UserError(f"{path}: corrupt checkpoint ({reason[:300]}); move it away to go on") from None
        return state


@dataclass
class Checkpoint:
    """A checkpoint read from disk: its folder, state.json and (unless sharded) its tensors."""

    path: Path
    state: dict
    weights: dict[str, torch.Tensor] | None = None
    tensors: dict[str, torch.Tensor] | None = None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError) as e:
        raise UserError(f"{path}: corrupt checkpoint ({' '.join(str(e).split())[:200]}); move "
                        f"{path.parent} away to go on") from None


def _load_full(checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    path, weights = checkpoint.path, checkpoint.weights
    if distributed.is_sharded(model):
        raise UserError(f"{path}: written by a single-process or DDP run, which an FSDP run cannot resume; "
                        "resume it with train.parallel=ddp")
    want = {name: tuple(t.shape) for name, t in _model_tensors(model).items()}
    got = {name: tuple(t.shape) for name, t in weights.items()}
    if got != want:
        wrong = sorted(set(got) ^ set(want)) or [n for n in want if got[n] != want[n]]
        raise UserError(f"{path / 'model.safetensors'}: tensors do not match the model ({wrong[:3]})")
    # Tied weights are one Parameter stored under its first name, so loading it fills both uses.
    model.load_state_dict(weights, strict=False)
    groups, params = _param_groups(path, checkpoint.state["param_groups"], optimizer)
    optimizer.load_state_dict({"state": _optimizer_state(path, checkpoint.tensors, params), "param_groups": groups})
    _set_rng(checkpoint.tensors, checkpoint.state)


def _param_groups(path: Path, saved: list[dict], optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
    """The groups to load (the saved parameter numbering with this run's hyperparameters: after --resume-from
    they may differ) and {saved number: the live parameter}."""
    live = optimizer.param_groups
    if [len(g.get("params", ())) for g in saved] != [len(g["params"]) for g in live]:
        raise UserError(f"{path / 'state.json'}: param_groups: {len(saved)} groups of "
                        f"{[len(g.get('params', ())) for g in saved]} parameters, this run's optimizer has "
                        f"{[len(g['params']) for g in live]}")
    groups = [{**old, **{k: v for k, v in new.items() if k != "params"}} for old, new in zip(saved, live)]
    params = {number: param for old, new in zip(saved, live) for number, param in zip(old["params"], new["params"])}
    return groups, params


def _optimizer_state(path: Path, tensors: dict[str, torch.Tensor], params: dict) -> dict[int, dict]:
    """{parameter number: {name: tensor}} from `opt.N.NAME` tensors, each moment shaped like its parameter."""
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if not key.startswith("opt."):
            continue
        _, number, name = key.split(".", 2)
        param = params.get(int(number))
        if param is None or (value.dim() and value.shape != param.shape):
            raise UserError(f"{path / 'optimizer.safetensors'}: {key}: shape {tuple(value.shape)} fits no parameter "
                            "of this model")
        state.setdefault(int(number), {})[name] = value
    return state


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.stack(torch.cuda.get_rng_state_all()).cpu()
    return tensors


def _set_rng(tensors: dict[str, torch.Tensor], state: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["rng.cuda"]))
    random.setstate(_tupled(state["rng_python"]))
    kind, keys, *rest = state["rng_numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """({"model": ..., "optim": ...} tensors keyed by parameter name, as DCP saves and loads them; the optimizer's
    param groups). The tied head is left out: it is the embedding, and safetensors refuses aliases."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    seen, unaliased = set(), {}
    for name, tensor in weights.items():
        tensor = _plain(tensor)
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.untyped_storage().data_ptr() not in seen:
            seen.add(local.untyped_storage().data_ptr())
            unaliased[name] = tensor
    return {"model": unaliased, "optim": optim["state"]}, optim["param_groups"]


def _plain(tensor):
    """`tensor` (a DTensor or not) with the plain tensor inside a wrapper subclass around its data (TorchAO's fp8
    all-gather weights: one inner tensor of the same shape, whose storage holds the values) in its place: DCP's
    safetensors writer saves it, and loads into it in place. Anything else (NF4's codes and scales) as it is."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not is_traceable_wrapper_subclass(local):
        return tensor
    names, _ = local.__tensor_flatten__()
    inner = getattr(local, names[0])
    if len(names) != 1 or inner.shape != local.shape or inner.dtype != local.dtype:
        return tensor
    if not isinstance(tensor, DTensor):
        return inner
    return DTensor.from_local(inner, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                              stride=tensor.stride())


def _load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Fill the live model and optimizer (plain, DDP or FSDP, any world size) from a sharded checkpoint."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if hasattr(optimizer, "consolidate_state_dict"):
        raise UserError(f"{folder.parent}: an FSDP checkpoint; resume it with train.zero1=false")
    tensors, param_groups = _sharded_state(model, optimizer)
    dcp_load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)))
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": param_groups},
                   options=StateDictOptions(strict=False))


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with shared (tied) tensors stored once: safetensors refuses aliases."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().contiguous().cpu()
    return out


def _tensor(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.tensor(v)


def _jsonable(obj):
    return [_jsonable(x) for x in obj] if isinstance(obj, tuple) else obj


def _tupled(obj):
    return tuple(_tupled(x) for x in obj) if isinstance(obj, list) else obj
