"""Every bound checked before work or allocation (third hostile round): seeds outside [0, 2**63) crashed a run
midway or overflowed; `kiln serve --block-size 1000000000` and `--kv-blocks 1000000000000` were allocation
tracebacks; `kiln plan memory --device-gb 1e308` an OverflowError. Each is one line now, exit 2."""

from __future__ import annotations

import pytest

from conftest import fails_in_one_line, write_params
from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.text.bpe import load_tokenizer

BIG = str(2 ** 70)


@pytest.mark.parametrize("value", ["-1", BIG, str(2 ** 63)])
def test_a_seed_outside_int64_is_refused_before_the_run(tmp_path, value):
    params = write_params(tmp_path / "params.yaml", {"train": {"device": "cpu"}})
    fails_in_one_line(["pretrain", "--params", str(params), "--set", f"train.seed={value}", "--out",
                       str(tmp_path / "run")], 2, f"params: train.seed={value}", "[0, 2**63)")
    fails_in_one_line(["sft", "--params", str(params), "--set", f"sft.seed={value}", "--out",
                       str(tmp_path / "run")], 2, f"params: sft.seed={value}")
    fails_in_one_line(["generate", "--prompt", "hi", "--seed", value], 2, f"--seed={value}", "[0, 2**63)")
    fails_in_one_line(["seeds", "pretrain", "--seeds", f"1,{value}", "--out", str(tmp_path / "s")], 2,
                      f"seed={value}")
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()


def test_the_largest_seed_is_taken(tmp_path):
    """2**63 - 1 is a seed: the bound is int64's, not narrower."""
    from kiln.pipeline.config import check_seed

    check_seed(2 ** 63 - 1, "seed")
    check_seed(0, "seed")


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    config = ModelConfig(vocab_size=load_tokenizer(tiny.tokenizer).get_vocab_size(), n_layer=1, n_head=2,
                         n_kv_head=1, d_model=16, max_seq_len=32)
    save_model(GPT(config), config, root / "model", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    return root / "model"


@pytest.mark.parametrize("args, names", [
    (["--block-size", "1000000000"], ["--block-size=1000000000", "at most the model's context, 32 tokens"]),
    (["--kv-blocks", "1000000000000"], ["--kv-blocks=1000000000000 x --block-size=16", "GB free"]),
])
def test_serve_refuses_a_cache_larger_than_the_device(model_dir, tiny, args, names):
    fails_in_one_line(["serve", "--model", str(model_dir), "--tokenizer", str(tiny.tokenizer), "--device", "cpu",
                       *args], 2, *names)


@pytest.mark.parametrize("value", ["1e308", "0", "-1"])
def test_plan_memory_refuses_an_absurd_device(value):
    fails_in_one_line(["plan", "memory", "--device-gb", value], 2, "--device-gb", "expected a positive number of GB")
