"""`kiln convert`: kiln model folders to and from Hugging Face `transformers` folders (GPT-2 and Llama).

The tensor and config mapping is `model/hf.py`; this module reads and writes the folders. Neither direction
needs `transformers` (an optional dependency; the tests use it as the independent reference). What it decides:
- Weights come from safetensors (one file or an index of shards), or from pytorch_model.bin read with
  `torch.load(weights_only=True)`; every name, shape and dtype is checked against the config before
  conversion, and every value is finite. Each HF file read is untrusted: a field of the wrong type or range,
  an index naming a file outside its folder, an unreadable file is a UserError naming the file and field.
- The tokenizer is copied byte for byte, so its sha256 still matches the one the model records. HF's side gets
  a tokenizer_config.json with `<|endoftext|>` as bos and eos, and a chat template for chat models that
  renders kiln's ChatML; like kiln's tokenizer it adds no token by itself (`kiln generate` prepends
  `<|endoftext|>` to a prompt, and a transformers user must do the same to get the same continuation).
  generation_config.json gives generate() kiln's end tokens: `<|im_end|>` and `<|endoftext|>` for a chat model
  (without the first, a chat model's answer would run on into a made-up next turn), `<|endoftext|>` for a base one.
- An output folder appears whole or not at all: it is built beside its final name and renamed into place.
"""

from __future__ import annotations

import re
import reprlib
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.model.adapter_spec import TOKEN_ROWS, spec_problem
from kiln.model.atomic import check_replaceable, forced
from kiln.model.checkpoint import ADAPTER_WEIGHTS, MODEL_FOLDER, read_json_object, save_model
from kiln.model.config import ModelConfig
from kiln.model.hf import (
    EMBEDDING,
    hf_config,
    hf_shapes,
    kiln_config,
    lora_deltas,
    peft_adapter,
    to_hf_tensors,
    to_kiln_tensors,
    token_rows_base,
)
from kiln.pipeline.errors import UserError
from kiln.pipeline.layout import TOKENIZER_FILE
from kiln.pipeline.outputs import atomic_dir, sha256_file, write_json
from kiln.pipeline.progress import console
from kiln.pipeline.serve.text_model import TextModel
from kiln.pipeline.tasks.chat_format import IM_END, IM_START, PAD
from kiln.pipeline.text.bpe import EOT, load_tokenizer

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
TORCH_WEIGHTS, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
ADAPTER_DIR, PEFT_WEIGHTS, PEFT_CONFIG = "adapter", "adapter_model.safetensors", "adapter_config.json"
TOKENIZER_CONFIG, GENERATION_CONFIG = "tokenizer_config.json", "generation_config.json"
HF_FOLDER = (CONFIG, WEIGHTS, INDEX, "model-*.safetensors", GENERATION_CONFIG, TOKENIZER_FILE, TOKENIZER_CONFIG,
             "special_tokens_map.json", ADAPTER_DIR)  # what `to-hf` writes, and what transformers' own save adds
HUB_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+")
# Tensors some checkpoints hold that are not weights: GPT-2's causal-mask buffers, Llama's rotary frequencies
# (kiln derives both from the config).
NOT_WEIGHTS = re.compile(r"(^|\.)h\.\d+\.attn\.(masked_)?bias$|\.rotary_emb\.inv_freq$")

# kiln's ChatML (kiln.pipeline.tasks.chat_format.ChatFormat.render) as a transformers chat template, the
# generation prompt included. Token ids match kiln's except where kiln's per-part encoding differs from
# encoding the rendered string: a message that starts with a line break, or that contains special-token text
# (kiln encodes it as plain text).
CHATML_TEMPLATE = (
    "{{- '<|endoftext|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('role ' + message['role'] + ' is not one of system, user, assistant') }}"
    "{%- endif %}"
    r"{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


# --- from-hf -------------------------------------------------------------------------------------------------

def from_hf(src: str, out: Path) -> None:
    """Write the kiln model folder `out` from an HF folder or hub id `src`."""
    if Path(src).exists():  # a local source inside `out` is the more useful thing to say than what `out` holds
        _not_over(out, Path(src))
    _check_out(out, MODEL_FOLDER, "model", kiln=True)
    src_dir = source_dir(src)
    _not_over(out, src_dir)
    config = read_hf_config(src_dir / CONFIG)
    tensors = read_hf_weights(src_dir, config)
    extra = {"converted_from": src}
    tokenizer = src_dir / TOKENIZER_FILE
    note = _tokenizer_note(out, tokenizer)  # reads the tokenizer: a bad one fails before anything is written
    if tokenizer.is_file():
        extra["tokenizer_sha256"] = sha256_file(tokenizer)
        if _chat_template(src_dir) == CHATML_TEMPLATE:
            extra["chat_format"] = "chatml"
    with atomic_dir(out, MODEL_FOLDER, "model") as tmp:
        # save_model replaces the empty temp folder with the model; the tokenizer joins it before `out` appears.
        save_model(to_kiln_tensors(tensors, config), config, tmp, extra)
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
    console.print(f"from-hf: {out} ({config.arch}, {_params(tensors):,} parameters, vocab {config.vocab_size:,}, "
                  f"context {config.max_seq_len:,})", highlight=False, soft_wrap=True)
    console.print(note, highlight=False, soft_wrap=True)


def source_dir(src: str) -> Path:
    """A local folder as is; otherwise a hub id, downloaded (config, tokenizer and safetensors only)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists() or not HUB_ID.fullmatch(src):
        raise UserError(f"{src}: not found (expected an HF model folder or a hub id such as openai-community/gpt2)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"{src}: no such folder, and huggingface_hub is not installed to download it") from None
    try:
        return Path(snapshot_download(src, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # huggingface_hub raises many types (offline, no such repo, gated, ...)
        raise UserError(f"{src}: no such folder, and downloading it from the hub failed ({_first_line(e)})") from None


def read_hf_config(path: Path) -> ModelConfig:
    """The kiln config of an HF config.json; UserError naming the file and field for anything else."""
    try:
        return kiln_config(_read_json(path), str(path))
    except ValueError as e:
        raise UserError(str(e)) from None


def read_hf_weights(src_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's weights (safetensors, single or sharded; pytorch_model.bin read without pickle code),
    names made canonical and checked against `config`."""
    files, where = _weight_files(src_dir)
    tensors = {}
    for path in files:
        tensors.update(_read_weights(path))
    if config.arch == "gpt2":  # GPT-2's original files name the tensors without the `transformer.` prefix
        tensors = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
                   for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if not NOT_WEIGHTS.search(k)}
    if config.tie_embeddings and "lm_head.weight" in tensors:
        # Some files store a tied head too; a copy that differs would leave it unclear which one was trained.
        head, embedding = tensors.pop("lm_head.weight"), tensors.get(EMBEDDING[config.arch])
        if embedding is not None and not torch.equal(head, embedding):
            raise UserError(f"{where}: lm_head.weight differs from {EMBEDDING[config.arch]}, but config.json ties "
                            f"them (tie_word_embeddings)")
    if config.n_layer > len(tensors):  # before hf_shapes, which builds every layer a hostile config.json asks for
        field = "n_layer" if config.arch == "gpt2" else "num_hidden_layers"
        raise UserError(f"{where}: tensors do not match config.json ({field}={config.n_layer:,} layers, but only "
                        f"{len(tensors):,} tensors)")
    try:
        want = hf_shapes(config)
    except (ValueError, RuntimeError) as e:  # sizes GPT refuses, or that overflow torch's even on the meta device
        raise UserError(f"{src_dir / CONFIG}: not a size kiln's model can take ({_first_line(e)})") from None
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise UserError(f"{where}: tensors do not match config.json (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]})")
    wrong = [f"{k} {tuple(tensors[k].shape)} != {want[k]}" for k in want if tuple(tensors[k].shape) != want[k]]
    if wrong:
        raise UserError(f"{where}: tensor shapes do not match config.json ({'; '.join(wrong[:3])})")
    for name, t in tensors.items():
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise UserError(f"{where}: {name}: expected finite floating-point weights, got "
                            + (f"{t.dtype}" if not t.is_floating_point() else "a non-finite value"))
    return tensors


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file or pytorch_model.bin (read without running pickle code)."""
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch.load raise their own types for bad files
        # torch.load's refusal opens with advice to load without weights_only; the reason follows this marker.
        reason = _first_line(e, after="WeightsUnpickler error:")
        raise UserError(f"{path}: not a readable weights file ({reason})") from None
    if not isinstance(tensors, dict):
        raise UserError(f"{path}: expected a dict of tensor name -> tensor, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise UserError(f"{path}: {reprlib.repr(name)}: expected a tensor, got {type(t).__name__}")
    return tensors


def _weight_files(src_dir: Path) -> tuple[list[Path], Path]:
    """(the files holding the weights, the file to name in errors: the weights or their index)."""
    for single, index in ((WEIGHTS, INDEX), (TORCH_WEIGHTS, TORCH_INDEX)):
        if (src_dir / single).is_file():
            return [src_dir / single], src_dir / single
        if (src_dir / index).is_file():
            return index_files(src_dir / index), src_dir / index
    raise UserError(f"{src_dir}: no weights ({WEIGHTS}, {INDEX}, {TORCH_WEIGHTS} or {TORCH_INDEX})")


def index_files(index: Path) -> list[Path]:
    """The weight files an index's weight_map names, each a file beside the index (never a path out of its
    folder), of the index's own kind (.safetensors or .bin)."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: weight_map: expected a non-empty object (tensor name -> file name), got "
                        f"{reprlib.repr(weight_map)}")
    suffix = Path(index.name.removesuffix(".index.json")).suffix  # .safetensors or .bin
    for tensor, name in weight_map.items():
        if not (isinstance(name, str) and name.endswith(suffix) and Path(name).name == name and "\0" not in name):
            raise UserError(f"{index}: weight_map[{reprlib.repr(tensor)}]: expected the name of a {suffix} file "
                            f"beside the index, got {reprlib.repr(name)}")
    names = sorted(set(weight_map.values()))
    if absent := [name for name in names if not (index.parent / name).is_file()]:
        raise UserError(f"{index}: weight_map names {absent[0]}, which is not in {index.parent}")
    return [index.parent / name for name in names]


def _chat_template(src_dir: Path) -> str | None:
    """The source's chat template, if any. transformers also allows a list of named templates, which is never
    kiln's own."""
    path = src_dir / TOKENIZER_CONFIG
    template = _read_json(path).get("chat_template") if path.is_file() else None
    if not (template is None or isinstance(template, (str, list))):
        raise UserError(f"{path}: chat_template: expected a string or a list of named templates, got "
                        f"{reprlib.repr(template)}")
    return template if isinstance(template, str) else None


def _not_over(out: Path, src: Path) -> None:
    """Refuse an output folder that is the source or holds it: replacing it whole would delete the source."""
    if Path(src).resolve().is_relative_to(Path(out).resolve()):
        raise UserError(f"{out}: is or holds the source {src}, which writing it would replace; choose another "
                        f"folder")


def _check_out(out: Path, holds: tuple[str, ...], what: str, kiln: bool) -> None:
    """Refuse, before any work and unless --force, an `out` in the way that is not a folder of the kind written
    there: one holding other files (`check_replaceable`), or whose config.json is the other kind's (a kiln model
    folder holds only names a transformers folder also holds, so to-hf would replace one with no question)."""
    check_replaceable(out, holds, what)
    config = Path(out) / CONFIG
    if forced() or not config.is_file():
        return
    try:
        found = "a kiln model's" if isinstance(read_json_object(config).get("model"), dict) else \
            "a transformers model's"
    except ValueError:
        found = "unreadable"
    if found != ("a kiln model's" if kiln else "a transformers model's"):
        raise UserError(f"{out}: its {CONFIG} is {found}, so it is not a {what} folder such as this command "
                        "writes; choose another OUT, or pass --force to replace it")


def _first_line(e: Exception, after: str = "") -> str:
    """The first line of an exception's message (past `after`, if there): library errors (torch.load's above
    all) span many lines."""
    text = str(e).split(after)[-1] if after else str(e)
    return next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)


def _params(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


def _tokenizer_note(out: Path, tokenizer: Path) -> str:
    """Which kiln commands can use the copied tokenizer: kiln marks document starts with <|endoftext|>, and
    chats with the ChatML tokens."""
    if not tokenizer.is_file():
        return (f"no {TOKENIZER_FILE} in the source: pass the model's tokenizer as --tokenizer to kiln commands "
                f"(kiln generate, chat, sft, dpo need one with {EOT})")
    tok = load_tokenizer(tokenizer)
    lacking = [t for t in (EOT, PAD, IM_START, IM_END) if tok.token_to_id(t) is None]
    use = f"--model {out} --tokenizer {out / TOKENIZER_FILE}"
    if EOT in lacking:
        return (f"tokenizer copied to {out / TOKENIZER_FILE}; it lacks {EOT}, which kiln generate, chat, sft and "
                f"dpo need, so use the model from Python (model.load_model)")
    if lacking:
        return (f"tokenizer copied: `kiln generate {use}` can use it; it lacks {', '.join(lacking)}, which kiln "
                f"chat, sft and dpo need")
    return f"tokenizer copied: kiln generate, chat, sft and dpo can use it ({use})"


# --- to-hf ---------------------------------------------------------------------------------------------------

def to_hf(model_dir: Path, out: Path, tokenizer_path: Path, adapter: bool = False) -> None:
    """Write the transformers folder `out` from the kiln model folder `model_dir` and its tokenizer. With
    `adapter`, `out` holds the model the adapter was trained on (the merged weights minus its update, for QLoRA
    the dequantised base) and `out/adapter/` the adapter in PEFT's format, which PeftModel puts back."""
    _not_over(out, model_dir)
    _check_out(out, HF_FOLDER, "transformers model", kiln=False)
    text = TextModel(model_dir, tokenizer_path)  # checks that the tokenizer is the model's
    model, meta, tok, config = text.model, text.meta, text.tokenizer, text.model.config
    if tok.get_vocab_size() > config.vocab_size:
        raise UserError(f"{tokenizer_path}: {tok.get_vocab_size():,} tokens, more than the model's vocab_size="
                        f"{config.vocab_size:,}")
    eot, pad = tok.token_to_id(EOT), tok.token_to_id(PAD)
    try:
        hf = hf_config(config, {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": pad})
    except ValueError as e:
        raise UserError(str(e)) from None
    chat = meta.get("chat_format") == "chatml" and None not in (tok.token_to_id(IM_START), tok.token_to_id(IM_END))
    specials = {"bos_token": EOT, "eos_token": EOT} if eot is not None else {}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                        **({"pad_token": PAD} if pad is not None else {}),
                        "model_max_length": config.max_seq_len, "clean_up_tokenization_spaces": False}
    if chat:
        tokenizer_config["chat_template"] = CHATML_TEMPLATE
    # generate() stops at any of these eos ids, as kiln does: a chat model's turn ends with <|im_end|>, and
    # kiln chat stops there or at <|endoftext|>; a base model stops at <|endoftext|> alone (kiln generate).
    generation = {"bos_token_id": eot, "eos_token_id": [tok.token_to_id(IM_END), eot] if chat else eot,
                  "pad_token_id": pad}
    state = model.state_dict()
    if adapter:
        lora, spec = _read_adapter(model_dir, meta, config)
        state = token_rows_base(state, lora, spec, config)
        for name, delta in lora_deltas(lora, spec).items():
            state[name] = state[name] - delta
        peft_tensors, peft_config = peft_adapter(lora, spec, config, str(out))
    tensors = to_hf_tensors(state, config)
    with atomic_dir(out, HF_FOLDER, "transformers model") as tmp:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        if adapter:
            (tmp / ADAPTER_DIR).mkdir()
            save_file(peft_tensors, tmp / ADAPTER_DIR / PEFT_WEIGHTS, metadata={"format": "pt"})
            write_json(tmp / ADAPTER_DIR / PEFT_CONFIG, peft_config)
        write_json(tmp / CONFIG, hf)
        write_json(tmp / GENERATION_CONFIG, generation)
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        write_json(tmp / TOKENIZER_CONFIG, tokenizer_config)
    console.print(f"to-hf: {out} ({hf['architectures'][0]}, {_params(tensors):,} parameters, float32"
                  + (", ChatML chat template" if chat else "") + ")"
                  + (f"; {out / ADAPTER_DIR}: its {spec['adapter']} adapter in PEFT's format "
                     "(PeftModel.from_pretrained)" if adapter else ""), highlight=False, soft_wrap=True)
    if eot is None:
        console.print(f"note: the tokenizer has no {EOT}, so bos/eos are left unset", highlight=False, soft_wrap=True)
    if config.arch == "llama" and config.dropout:
        console.print(f"note: dropout={config.dropout} (training only) is not carried: HF Llama has attention "
                      f"dropout only", highlight=False, soft_wrap=True)


def _read_adapter(model_dir: Path, meta: dict, config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter a post-training stage saved beside its merged model, checked against config.json's spec."""
    spec, path = meta.get("adapter"), model_dir / ADAPTER_WEIGHTS
    if spec is None:
        raise UserError(f"{model_dir}: no adapter (it was trained with adapter: full); convert it without --adapter")
    if (problem := spec_problem(spec)) is not None:
        raise UserError(f"{model_dir / CONFIG}: adapter: {problem}")
    if not path.is_file():
        raise UserError(f"{path}: not found, though {model_dir / CONFIG} says the model was trained with adapter: "
                        f"{spec['adapter']}")
    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors' own error, OSError
        raise UserError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
    token_rows = {name: tensors.pop(f"tok_emb.{name}", None) for name in TOKEN_ROWS}
    if "trainable_tokens" in spec:
        shape = (len(spec["trainable_tokens"]), config.d_model)
        for name, t in token_rows.items():
            if t is None or tuple(t.shape) != shape or not t.isfinite().all():
                raise UserError(f"{path}: tok_emb.{name}: expected finite rows of shape {shape}, one per "
                                f"trainable_tokens id in {model_dir / CONFIG}")
        if max(spec["trainable_tokens"]) >= config.vocab_size:
            raise UserError(f"{model_dir / CONFIG}: adapter: trainable_tokens: ids past the vocabulary "
                            f"({config.vocab_size:,})")
    elif any(t is not None for t in token_rows.values()):
        raise UserError(f"{path}: trained token rows, though {model_dir / CONFIG} lists no trainable_tokens")
    for name, t in tensors.items():
        twin = name.replace(".lora_A.", ".lora_B.") if ".lora_A." in name else name.replace(".lora_B.", ".lora_A.")
        rows = t.shape[0] if ".lora_A." in name else t.shape[-1]
        if twin not in tensors or t.dim() != 2 or rows != spec["rank"] or not t.isfinite().all():
            raise UserError(f"{path}: {name}: expected finite 2-d lora_A/lora_B pairs of rank {spec['rank']}")
    return tensors | {f"tok_emb.{name}": t for name, t in token_rows.items() if t is not None}, spec


def _read_json(path: Path) -> dict:
    try:
        return read_json_object(path)
    except ValueError as e:
        raise UserError(str(e)) from None
