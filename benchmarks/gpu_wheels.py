"""The wheels the lent GPU machine lacks, for ``python3 scripts/dev.py gpu-check`` there (issue 34).

The GPU machine (docs: the device guide of this workplace) has Python 3.12, torch 2.11 with CUDA, Lightning,
Accelerate and transformers, but not hivemind, and no network. This module walks collabopt's runtime requirements
through the metadata of this environment (``.venv``: the versions collabopt is tested with), drops the
distributions the GPU machine's image already holds (:data:`ON_DEVICE`, read off the guide's list of 2026-11-17),
and downloads the rest as binary wheels for CPython 3.12 on manylinux x86_64, each pinned to the version installed
here, into ``wheels/gpu/`` (git-ignored). The folder travels with the working tree when ``carry`` names it; the
tree and carried paths may be 64 MiB in all, so the total is checked against :data:`BUDGET_MIB`.

``protobuf`` is carried although the image has one: hivemind's generated code needs protobuf >= 5.29, and the
image's version was never read.

How the next session with a GPU runs the check: here, ``python3 scripts/dev.py gpu-wheels`` (the folder is
git-ignored, so each checkout makes its own); then one ``run`` call of the device tool with ``carry:
["wheels/gpu"]``, ``timeout_s: 600`` and this command (one line)::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir wheels/gpu/*.whl
    && python3 -m pip install -q --no-index --no-deps --find-links wheels/gpu/build -e .
    && PYTHONUNBUFFERED=1 python3 scripts/dev.py gpu-check --out $OUT 2>&1 | tee $OUT/gpu-check.log

The first install puts hivemind and what it lacks into the machine's Python (python3 there is a virtual environment
holding torch), the second installs collabopt from the working tree (editable, so ``collabopt.integrations`` maps
to ``integrations/``), building it with the carried setuptools and wheel. ``gpu-check`` runs with the interpreter
that runs ``dev.py`` when there is no ``.venv`` (there is none on the GPU machine: ``.venv`` is ignored and not
carried), so nothing is fetched there. Then copy ``gpu.md`` and ``gpu.json`` from the returned files into
``benchmarks/results/``, commit them, and run ``python -m benchmarks.tables`` to write the README's and docs' tables.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "wheels" / "gpu"
BUDGET_MIB = 48  # of the 64 MiB that travel: the rest is the working tree (a few MiB) and headroom
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64"]
# the GPU machine's Python (3.12 on Linux x86_64), for the requirements' environment markers
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
ALWAYS_CARRY = {"protobuf"}
BUILD_REQUIRES = ["setuptools>=68", "wheel"]  # pyproject.toml's [build-system]

# Python packages of the GPU machine's image ('cuda'), as the device guide (KINDS.md) listed them on 2026-11-17
DEVICE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
ON_DEVICE = set(DEVICE_PACKAGES.split())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_on_device(roots: tuple[str, ...] = ("collabopt",)) -> dict[str, str]:
    """{distribution: version installed here} of every runtime requirement of ``roots`` (recursively, extras and
    other platforms' markers left out) that the GPU machine lacks, plus :data:`ALWAYS_CARRY`."""
    have = {canonical(n) for n in ON_DEVICE} - ALWAYS_CARRY
    found: dict[str, str] = {}
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run `python3 scripts/dev.py test --co -q` once first "
                             "(it sets up .venv), then again") from None
        if name not in roots and name not in have:
            found[canonical(dist.metadata["Name"])] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if (req.marker is None or req.marker.evaluate(DEVICE_MARKERS)) and canonical(req.name) not in have:
                todo.append(req.name)
    return dict(sorted(found.items()))


def installs_on_device(wheel: str) -> bool:
    """Whether a wheel of this name installs on CPython 3.12 / Linux x86_64."""
    return any((tag.interpreter in ("py3", "cp312") or tag.abi == "abi3")
               and (tag.platform == "any" or tag.platform.endswith("x86_64"))
               for tag in parse_wheel_filename(wheel)[3])


def download(pins: dict[str, str], folder: Path) -> None:
    """Binary wheels of ``pins`` for CPython 3.12 / manylinux x86_64 into ``folder`` (one version of each). A package
    published as a source archive only is built into a wheel here, which must then be pure Python (any platform)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        name, version = old.name.split("-")[:2]
        if pins.get(canonical(name)) != version:
            old.unlink()  # another version or a package no longer needed: two versions stop the install there
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    for name, version in pins.items():
        if any(canonical(w.name.split("-")[0]) == name for w in folder.glob("*.whl")):
            continue
        spec = f"{name}=={version}"
        got = subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                              "--implementation", "cp", *platforms, "-d", str(folder), spec],
                             capture_output=True, text=True)
        if got.returncode != 0:  # no wheel published: build one (pure Python packages only)
            print(f"{spec}: no wheel published, building one here", flush=True)
            subprocess.run([*pip, "wheel", "--no-deps", "--no-binary", name, "-w", str(folder), spec], check=True)
    build = folder / "build"  # collabopt's build requirements, for `pip install --find-links wheels/gpu/build -e .`
    if not any(build.glob("setuptools-*.whl")) or not any(build.glob("wheel-*.whl")):
        subprocess.run([*pip, "download", "--only-binary=:all:", "-d", str(build), *BUILD_REQUIRES],
                       check=True)
    impure = [w.name for w in folder.glob("*.whl") if not installs_on_device(w.name)]
    if impure:
        raise SystemExit(f"wheels that will not install on CPython 3.12 / x86_64: {impure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the wheels go (default: wheels/gpu)")
    parser.add_argument("--list", action="store_true", help="only print what would be downloaded")
    args = parser.parse_args(argv)
    pins = missing_on_device()
    print("missing on the GPU machine:", ", ".join(f"{n}=={v}" for n, v in pins.items()), flush=True)
    if args.list:
        return 0
    download(pins, args.dir)
    wheels = sorted(args.dir.glob("**/*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.relative_to(args.dir)}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dir} (budget {BUDGET_MIB} MiB of the 64 MiB "
          "that travel with the working tree)")
    if total > BUDGET_MIB * 2**20:
        print("too large to carry", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
