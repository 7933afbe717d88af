"""A model on disk: `model.safetensors` (weights only) + `config.json` ({"model": config, **extra}).

safetensors cannot run code when loaded (unlike pickle) and refuses tensors that share storage, so a tied
LM head is stored once, under the token embedding's name, and re-tied by building the model from its config.
Both files are written into a temp folder beside the target and renamed into place together, so a reader
never finds new weights with an old config, or half a file. Weights holding NaN or infinity are never written
(a StageError: the run that made them diverged) nor loaded. Loading checks every field of config.json by type,
and every tensor's name, shape, dtype and finiteness, before touching the model, and reports the file at fault.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.model.atomic import atomic_dir
from kiln.model.config import ModelConfig
from kiln.model.errors import StageError, UserError
from kiln.model.files import read_capped
from kiln.model.gpt import GPT

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# A model trained with adapters also keeps them alone: their tensors, and config.json's "adapter" and "init"
ADAPTER_WEIGHTS = "adapter.safetensors"
# what a model folder holds (a converted one also its tokenizer.json): anything else in the way is the user's
MODEL_FOLDER = (CONFIG, WEIGHTS, ADAPTER_WEIGHTS, "tokenizer.json")
# Wrappers that prefix parameter names: torch.compile's OptimizedModule and DDP.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding a NaN or an infinity, or None: one fused reduction per
    tensor (min and max: NaN propagates through both, an infinity is an extreme; GPT-2 124M's weights take 0.6 s
    on a 2-core CPU, against 3.4 s for isfinite().all(), which writes a mask first, and 1.2 s to write them) and
    a single device sync for the lot."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    device = floats[0][1].device
    ok = torch.stack([torch.stack(torch.aminmax(t)).isfinite().all().to(device) for _, t in floats]).cpu()
    return None if ok.all() else floats[int((~ok).nonzero()[0])][0]


def _stored_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the file must hold, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    return {name: tuple(t.shape) for name, t in _stored(model.state_dict(), config).items()}


def _stored(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict minus the tied alias: lm_head.weight is tok_emb.weight when tied."""
    return {k: v for k, v in state_dict.items() if not (config.tie_embeddings and k == "lm_head.weight")}


def _unwrap(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        for prefix in WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        out[name] = tensor
    return out


def save_model(model_or_state_dict: torch.nn.Module | dict, config: ModelConfig, out_dir: Path,
               extra: dict | None = None, adapter: dict[str, torch.Tensor] | None = None) -> Path:
    """Write out_dir/model.safetensors and out_dir/config.json atomically; return out_dir.

    out_dir is replaced as a whole (a previous checkpoint there stays intact until the new one is complete),
    so keep nothing else in it. Tensors are saved in their own dtype, detached, on CPU. `extra` goes into
    config.json beside "model" (e.g. {"tokenizer_sha256": ...}) and must be JSON-serialisable. `adapter`:
    the LoRA tensors the weights include, written to ADAPTER_WEIGHTS in the same folder.
    """
    out_dir = Path(out_dir)
    extra = dict(extra or {})
    if "model" in extra:
        raise ValueError("extra: the key 'model' is reserved for the model config")
    sd = model_or_state_dict
    sd = _unwrap(sd.state_dict() if isinstance(sd, torch.nn.Module) else dict(sd))
    expected = _stored_shapes(config)
    if config.tie_embeddings and "lm_head.weight" in sd:
        head, emb = sd["lm_head.weight"], sd["tok_emb.weight"]
        if head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb):
            raise ValueError("lm_head.weight: differs from tok_emb.weight but the config ties them")
    tensors = _stored(sd, config)
    _check_names_and_shapes({k: tuple(v.shape) for k, v in tensors.items()}, expected, "state dict")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if (bad := first_non_finite(tensors)) is not None:
        raise StageError(f"{out_dir}: not saved: {bad} holds NaN or infinite values (the run diverged)")
    # Strict JSON, checked before anything is written: fails early if `extra` is not JSON-able or not finite.
    meta = json.dumps({"model": config.to_dict(), **extra}, indent=2, allow_nan=False) + "\n"

    with atomic_dir(out_dir, MODEL_FOLDER, "model") as tmp:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        if adapter is not None:
            save_file(adapter, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (tmp / CONFIG).write_text(meta, encoding="utf-8")
    return out_dir


MAX_JSON_BYTES = 64 << 20  # a model's config.json is a few kB; an HF tokenizer_config.json well under this


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`; ValueError naming the file if it is missing, unreadable, not a regular file of at
    most MAX_JSON_BYTES, or not an object."""
    try:
        data = json.loads(read_capped(Path(path), MAX_JSON_BYTES, "a JSON file").decode("utf-8"))
    except UserError as e:
        raise ValueError(str(e)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


SHA256 = re.compile(r"[0-9a-f]{64}")


def load_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    """(config, meta) from model_dir/config.json, where meta is everything beside "model"; the keys of meta that
    kiln reads are checked by type (each may be null: a model converted from elsewhere has no tokenizer hash)."""
    path = Path(model_dir) / CONFIG
    data = read_json_object(path)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: expected an object with a 'model' object")
    for key, value in data["model"].items():  # Python's json reads NaN, Infinity and 1e999
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path}: model.{key}: expected a finite number, got {value}")
    try:
        config = ModelConfig.from_dict(data.pop("model"))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: model.{e}") from None
    sha, chat, init = data.get("tokenizer_sha256"), data.get("chat_format"), data.get("init")
    if sha is not None and not (isinstance(sha, str) and SHA256.fullmatch(sha)):
        raise ValueError(f"{path}: tokenizer_sha256: expected 64 lowercase hex digits or null, got {sha!r}")
    if chat is not None and not isinstance(chat, str):
        raise ValueError(f"{path}: chat_format: expected a string or null, got {chat!r}")
    if init is not None and not (isinstance(init, dict) and isinstance(init.get("model"), str)):
        raise ValueError(f"{path}: init: expected an object with a 'model' string or null, got {init!r}")
    return config, data


def load_model(model_dir: Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """(model, meta) from a folder written by save_model. The model is float32 (weights saved in another
    dtype are cast) and in eval mode; ValueError names the file for anything missing or inconsistent."""
    config, meta = load_config(model_dir)
    path = Path(model_dir) / WEIGHTS
    if not path.is_file():
        raise ValueError(f"{path}: not found")
    try:
        tensors = load_file(path, device=str(device))
    except Exception as e:  # safetensors raises its own error type, OSError, or RuntimeError for bad files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    _check_names_and_shapes({k: tuple(v.shape) for k, v in tensors.items()}, _stored_shapes(config), str(path))
    if not_float := [k for k, v in tensors.items() if not v.is_floating_point()]:
        raise ValueError(f"{path}: {not_float[0]}: expected floating-point weights, got {tensors[not_float[0]].dtype}")
    if (bad := first_non_finite(tensors)) is not None:
        raise ValueError(f"{path}: {bad}: holds NaN or infinite values")
    model = GPT(config).to(device)
    if config.tie_embeddings:
        tensors["lm_head.weight"] = tensors["tok_emb.weight"]  # same Parameter in the model; fills both
    model.load_state_dict(tensors, strict=True)
    return model.eval(), meta


def _check_names_and_shapes(got: dict[str, tuple], want: dict[str, tuple], where: str) -> None:
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unexpected:
        raise ValueError(f"{where}: tensors do not match the config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    wrong = [f"{k} {got[k]} != {want[k]}" for k in want if got[k] != want[k]]
    if wrong:
        raise ValueError(f"{where}: tensor shapes do not match the config ({'; '.join(wrong[:5])})")
