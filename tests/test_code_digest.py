"""The digest of a training stage's code (pipeline/code_digest.py), which every training stage's checkpoints are
fingerprinted with: the modules kiln's own dvc.yaml lists for the stage, nothing else."""

import shutil
from pathlib import Path

import pytest

from kiln.pipeline import code_digest
from kiln.pipeline.code_digest import stage_code_sha256
from kiln.pipeline.errors import UserError


def edit_code(stage: str, root: Path, monkeypatch) -> None:
    """Point the digest at a copy (under `root`) of kiln's dvc.yaml and `stage`'s modules, one of them edited as a
    fix would be."""
    files = code_digest.code_files(stage)
    for path in [code_digest.ROOT / "dvc.yaml", *files]:
        copy = root / path.relative_to(code_digest.ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
    fixed = root / files[-1].relative_to(code_digest.ROOT)
    fixed.write_text(fixed.read_text() + "\n# a fix\n")
    monkeypatch.setattr(code_digest, "ROOT", root)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_digest_follows_the_modules_dvc_yaml_lists_for_the_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(code_digest, "ROOT", tmp_path)
    write(tmp_path, {"dvc.yaml": "stages:\n  train:\n    deps:\n      - data/shards\n      - pipeline/one.py\n"
                                 "      - model\n  other:\n    deps:\n      - pipeline/two.py\n",
                     "pipeline/one.py": "A = 1\n", "pipeline/two.py": "B = 2\n", "model/m.py": "C = 3\n",
                     "model/notes.txt": "", "data/shards/x.bin": "tokens"})
    before = stage_code_sha256("train")
    assert stage_code_sha256("train") == before and stage_code_sha256("other") != before
    write(tmp_path, {"pipeline/two.py": "B = 3\n", "data/shards/x.bin": "other tokens", "model/notes.txt": "x"})
    assert stage_code_sha256("train") == before  # another stage's module, data, a file that is no module
    for name, text in (("pipeline/one.py", "A = 2\n"), ("model/m.py", "C = 4\n"), ("model/sub/new.py", "")):
        write(tmp_path, {name: text})  # a listed module, or one of a listed folder
        assert stage_code_sha256("train") != before, name
        before = stage_code_sha256("train")
    (tmp_path / "pipeline/one.py").rename(tmp_path / "pipeline/three.py")
    with pytest.raises(UserError, match=r"pipeline/one\.py: cannot read it to fingerprint the train stage's code"):
        stage_code_sha256("train")


def test_without_dvc_yaml_every_module_of_kiln_counts(tmp_path, monkeypatch):
    """An installed wheel ships no dvc.yaml: any other release is other code."""
    monkeypatch.setattr(code_digest, "ROOT", tmp_path)
    write(tmp_path, {"pipeline/one.py": "A = 1\n", "kernels/k.py": "K = 1\n", "tests/t.py": ""})
    before = stage_code_sha256("pretrain")
    write(tmp_path, {"tests/t.py": "x = 1\n"})
    assert stage_code_sha256("pretrain") == before
    write(tmp_path, {"kernels/k.py": "K = 2\n"})
    assert stage_code_sha256("pretrain") != before


@pytest.mark.parametrize("text", ["stages: [", "stages:\n  other:\n    deps: []\n", "- a list\n"])
def test_a_dvc_yaml_without_the_stage_is_one_line(tmp_path, monkeypatch, text):
    monkeypatch.setattr(code_digest, "ROOT", tmp_path)
    write(tmp_path, {"dvc.yaml": text})
    with pytest.raises(UserError, match=r"dvc\.yaml: cannot read the pretrain stage's deps \(\w+\), which "
                                        "fingerprint its code"):
        stage_code_sha256("pretrain")


def test_kilns_own_training_stages_hash_their_own_modules():
    for stage in ("pretrain", "scaling_sweep", "sft", "dpo", "grpo"):
        files = code_digest.code_files(stage)
        assert code_digest.ROOT / "pipeline/train/loop.py" in files and all(p.suffix == ".py" for p in files)
    assert code_digest.ROOT / "pipeline/post/grpo.py" in code_digest.code_files("grpo")
    assert code_digest.ROOT / "pipeline/post/grpo.py" not in code_digest.code_files("sft")
