"""The house: installed, kiln is one import name (`kiln`), so nothing of it shadows the PyPI packages named
`kernels`, `model` or `pipeline` (Hugging Face's kernel hub is `kernels`, and transformers and bitsandbytes
import it)."""

from __future__ import annotations

import ast
import json
import inspect
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_wheel_holds_one_top_level_package(tmp_path):
    # Built from a copy: setuptools writes build/ into the source folder, which must stay the user's.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "data", "metrics", "tests", "build",
                                                                "__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("kiln-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"kiln"}
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert {"kiln/kernels", "kiln/model", "kiln/pipeline", "kiln/pipeline/train", "kiln/pipeline/text"} <= packages
    assert not any(n.startswith("kiln/tests/") for n in names)
    # Every module of the three folders is in the wheel: a package missing from pyproject's list would not be.
    shipped = {n for n in names if n.endswith(".py")}
    for folder in ("kernels", "model", "pipeline"):
        for path in (REPO / folder).rglob("*.py"):
            assert f"kiln/{path.relative_to(REPO).as_posix()}" in shipped, f"{path} is not in the wheel"


# ---------------------------------------------------------------- the import graph, read off the source

def module_file(name: str) -> Path | None:
    """The file of a kiln module (`kiln.pipeline.text.bpe` -> pipeline/text/bpe.py), None if not kiln's."""
    if name != "kiln" and not name.startswith("kiln."):
        return None
    parts = name.split(".")[1:]
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["kiln", *parts])


def imports_of(path: Path, packages: bool = True) -> set[str]:
    """Every kiln module `path` imports anywhere it runs (top level or inside a function, not under
    TYPE_CHECKING), with the packages whose `__init__` that import runs unless `packages` is false."""
    found = set()
    tree = ast.parse(path.read_text())
    # what `if TYPE_CHECKING:` imports is for annotations only: it never runs
    for guard in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]:
        guard.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if module_file(".".join(parts[:i]))]
            found |= set(prefixes if packages else prefixes[-1:])
    return found


def closure(modules: set[str]) -> set[str]:
    seen, todo = set(), list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += imports_of(module_file(name)) - seen
    return seen


def trivial(path: Path) -> bool:
    """A package `__init__` that only holds a docstring runs no code worth declaring."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(isinstance(n, ast.Expr) for n in body)


def command_function(cmd: str):
    """The function behind a `kiln ...` command line."""
    import typer

    from kiln.pipeline.cli import app

    command = typer.main.get_command(app)
    for word in cmd.split()[1:]:
        if word.startswith("-") or not hasattr(command, "commands"):
            break
        command = command.commands[word]
    return inspect.unwrap(command.callback)


def top_level_imports(path: Path) -> set[str]:
    return {n for node in ast.parse(path.read_text()).body if isinstance(node, ast.ImportFrom) and node.module
            for n in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if module_file(n)}


def stage_entry_modules(cmd: str) -> set[str]:
    """What a stage's `kiln ...` command imports: its command function's own (lazy) imports and its command
    module's module-level ones. The module's other commands import their stages inside themselves, so its
    whole-file imports are not this command's; cli.py, which only puts the groups together, is no stage's code."""
    function = command_function(cmd)
    inner = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
        if isinstance(node, ast.ImportFrom) and node.module:
            inner |= {n for n in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if module_file(n)}
    return inner | top_level_imports(Path(inspect.getfile(function)))


def stage_code(cmd: str) -> set[Path]:
    files = {module_file(m) for m in closure(stage_entry_modules(cmd))} | {Path(inspect.getfile(command_function(cmd)))}
    return {f for f in files if not trivial(f)}


def declared_code(deps: list[str]) -> set[Path]:
    """dvc.yaml's code deps as files: a folder stands for every module in it."""
    files = set()
    for dep in deps:
        path = REPO / dep
        if dep.split("/")[0] not in ("pipeline", "model", "kernels"):
            continue
        files |= {p for p in path.rglob("*.py") if not trivial(p)} if path.is_dir() else {path}
    return files


STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_dvc_deps_are_exactly_the_code_each_stage_runs(stage):
    spec = STAGES[stage]
    runs, declared = stage_code(spec["cmd"]), declared_code(spec["deps"])
    rel = lambda files: sorted(p.relative_to(REPO).as_posix() for p in files)
    assert not runs - declared, f"{stage}: dvc.yaml misses {rel(runs - declared)}"
    assert not declared - runs, f"{stage}: dvc.yaml lists {rel(declared - runs)}, which the stage never imports"


# Each DVC stage's own module: what no other module may import (what two stages share lives in a library module).
STAGE_MODULES = {"prepare": "kiln.pipeline.text.prepare", "tokenizer": "kiln.pipeline.text.tokenizer",
                 "shard": "kiln.pipeline.text.shard", "scaling_sweep": "kiln.pipeline.scaling.sweep",
                 "scaling_fit": "kiln.pipeline.scaling.fit", "scaling_size": "kiln.pipeline.scaling.size",
                 "pretrain": "kiln.pipeline.train.pretrain", "sft": "kiln.pipeline.post.sft",
                 "dpo": "kiln.pipeline.post.dpo", "grpo": "kiln.pipeline.post.grpo",
                 "evaluate": "kiln.pipeline.evaluate.evaluate"}
MODULES = {module_name(p): p for folder in ("kernels", "model", "pipeline") for p in (REPO / folder).rglob("*.py")}


def test_every_stage_has_its_module():
    # params_check loads the params classes of every stage and has no module of its own
    assert set(STAGE_MODULES) == set(STAGES) - {"params_check"}
    for stage, module in STAGE_MODULES.items():
        assert module in stage_entry_modules(STAGES[stage]["cmd"]), f"{stage}: its command does not import {module}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layering(name):
    """kernels <- model <- pipeline, never upward; no stage module imports another; nothing but the CLI imports
    its command modules."""
    imported = imports_of(MODULES[name])
    layer = name.split(".")[1]
    allowed = {"kernels": ("kiln.kernels",), "model": ("kiln.model", "kiln.kernels"),
               "pipeline": ("kiln.pipeline", "kiln.model", "kiln.kernels")}[layer]
    upward = sorted(m for m in imported if m != "kiln" and not m.startswith(allowed))
    assert not upward, f"{name} imports {upward} from a higher layer"
    if not dispatches(name):
        assert not {m for m in imported if dispatches(m)}, f"{name} imports a command module"
        stages = sorted(m for m in imported & set(STAGE_MODULES.values()) if m != name)
        assert not stages, f"{name} imports the stage module(s) {stages}"


def dispatches(module: str) -> bool:
    """cli.py and its command modules: they import every stage, and nothing imports them but cli.py."""
    return module == "kiln.pipeline.cli" or module.startswith("kiln.pipeline.commands")


def package_of(module: str) -> str | None:
    """The pipeline package a module is in (`train` for kiln.pipeline.train.loop), "" for pipeline's own top-level
    modules (runtime, config, errors, ...), None outside pipeline."""
    parts = module.split(".")
    if parts[:2] != ["kiln", "pipeline"] or len(parts) < 3:
        return None
    return parts[2] if len(parts) > 3 or (REPO / "pipeline" / parts[2]).is_dir() else ""


def test_pipeline_packages_are_layers():
    """No pipeline package imports one that imports it back, however indirectly (post and evaluate share the
    `tasks` and `scoring` libraries, and evaluate imports no post/; evaluate reads serve's model wrapper, serve
    never reads evaluate; train reads the size choice itself).
    The CLI and its command modules, which dispatch to every package, are left out."""
    graph = {}
    for name, path in MODULES.items():
        if package_of(name) is None or dispatches(name):
            continue
        targets = {package_of(m) for m in imports_of(path, packages=False)}
        graph.setdefault(package_of(name), set()).update(targets - {None, package_of(name)})
    assert_acyclic(graph, "packages import each other")
    assert {"tasks", "scoring", "serve"} <= set(graph["evaluate"]) and "evaluate" not in graph["serve"] | graph["post"]
    assert "post" not in graph["evaluate"] and "scoring" in graph["post"]
    # the order docs/architecture.md draws: each package imports only those before it (and pipeline's own modules)
    order = ["", "text", "tasks", "scoring", "train", "scaling", "serve", "evaluate", "post", "tools"]
    assert set(graph) <= set(order), f"a package docs/architecture.md does not place: {set(graph) - set(order)}"
    for package, targets in graph.items():
        later = sorted(t for t in targets if order.index(t) >= order.index(package))
        assert not later, f"{package or 'pipeline'} imports {later}, drawn after it in docs/architecture.md"


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    done, active = set(), []

    def visit(name):
        if name in active:
            raise AssertionError(f"{what}: " + " -> ".join(active[active.index(name):] + [name]))
        if name in done:
            return
        active.append(name)
        for other in sorted(graph.get(name, ())):
            visit(other)
        active.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_no_import_cycle():
    graph = {name: imports_of(path, packages=False) & set(MODULES) - {name} for name, path in MODULES.items()}
    assert_acyclic(graph, "import cycle")


# ---------------------------------------------------------------- the ground floor: what needs no torch

TEXT_STAGES = ("prepare", "tokenizer", "shard", "scaling_fit")
# The stages that build, train or run a model: the only ones a kernel edit may rerun.
MODEL_STAGES = {"scaling_sweep", "pretrain", "sft", "dpo", "grpo", "evaluate"}


def imports_torch_at_import(path: Path) -> bool:
    """Whether importing `path` imports torch: a top-level `import torch...` (one inside a function runs only
    when that function is called)."""
    tree = ast.parse(path.read_text())
    names = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
    return any(name == "torch" or name.startswith("torch.") for name in names)


@pytest.mark.parametrize("stage", TEXT_STAGES)
def test_text_stages_depend_on_no_kernel_and_no_torch_model_module(stage):
    """The text stages and the fit (which fits numbers) take only the model package's torch-free ground
    floor (its writer, errors and config), so neither a kernel nor a model edit reruns them."""
    code = {p.relative_to(REPO).as_posix() for p in declared_code(STAGES[stage]["deps"])}
    assert not [p for p in code if p.startswith("kernels/")], f"{stage} lists kernel files"
    heavy = sorted(p for p in code if p.startswith("model/") and imports_torch_at_import(REPO / p))
    assert not heavy, f"{stage}: these model deps import torch: {heavy}"


def test_a_kernel_edit_reruns_only_the_stages_that_run_a_model(tmp_path):
    """`dvc status` in a copy of the project after editing a kernel: only the model stages name the file."""
    copy = tmp_path / "copy"
    subprocess.run(["git", "clone", "-q", str(REPO), str(copy)], check=True)
    for name in ("dvc.yaml", "dvc.lock"):  # this checkout's, committed or not
        shutil.copy(REPO / name, copy / name)
    kernel = copy / "kernels" / "rms_norm.py"
    kernel.write_text(kernel.read_text() + "\n# edited\n")
    dvc = Path(sys.executable).with_name("dvc")
    status = subprocess.run([str(dvc), "status", "--json"], cwd=copy, capture_output=True, text=True, check=True)
    named = {stage for stage, changes in json.loads(status.stdout).items()
             for change in changes if isinstance(change, dict)
             for deps in [change.get("changed deps", {})] if "kernels/rms_norm.py" in deps}
    assert named == MODEL_STAGES


@pytest.mark.parametrize("args", [["--help"], ["data", "prepare", "--help"], ["tokenizer", "train", "--help"]])
def test_cli_help_imports_no_torch(args):
    """Asking the CLI for help loads no torch (seconds of imports): `-X importtime` lists every module loaded."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "kiln.pipeline.cli", *args], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0 and "Usage" in result.stdout, result.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert "typer" in loaded and "torch" not in loaded


def test_evaluate_reads_little_of_train_and_not_its_loop():
    """Evaluation measures models with the LM loss and the process-group sums; the training loop, its
    checkpoints and curves are no business of it."""
    modules = closure(stage_entry_modules(STAGES["evaluate"]["cmd"]))
    train = {m for m in modules if m.startswith("kiln.pipeline.train.")}
    assert len(train) <= 4 and "kiln.pipeline.train.loop" not in train, sorted(train)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["pretrain", "--help"], ["serve", "--help"],
                                  ["pretrain", "--set", "train.lr=abc"], ["sft", "--set", "nope=1"],
                                  ["dpo", "--set", "beta=x"], ["grpo", "--set", "lr=-1"],
                                  ["evaluate", "--set", "nope=1"], ["data", "prepare", "--set", "nope=1"]])
def test_help_and_bad_params_answer_without_importing_torch(args):
    """Help, --version and a bad param come back before torch is imported (about 2 s of the 2-9 s a user waited
    for an error): the stage's code is imported once its params are known good."""
    code = ("import sys\nfrom kiln.pipeline.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code)\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO)
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "False" and lines[-2] in ("exit 0", "exit 2"), done.stdout[-500:] + done.stderr[-500:]
