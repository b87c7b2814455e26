"""Packaging: the wheel needs only what `import pa_tile` and the kernels use; the notebooks' and
the tests' tools are extras; pyproject.toml (pip, CI) and environment.yml (conda) agree."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

import pa_tile

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]

# conda-forge names for PyPI ones; torch is the CPU-only build there, on purpose
CONDA_NAME = {"torch": "pytorch-cpu"}
CONDA_TOOLCHAIN = {"lld", "rocm-device-libs", "c-compiler"}
NOT_RUNTIME = {"jupyterlab", "jupytext", "nbval", "pytest", "ipykernel", "nbconvert", "matplotlib"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[;]", spec.strip(), maxsplit=1)[0].lower()


def _specs(specs):
    return {_name(d): d.replace(" ", "") for d in specs}


def test_runtime_dependencies_carry_no_notebook_or_test_tools():
    runtime = set(_specs(PROJECT["dependencies"]))
    assert runtime == {"flydsl", "torch", "numpy", "pyyaml", "tqdm"}
    assert not runtime & NOT_RUNTIME
    assert {"jupyterlab", "jupytext"} <= set(_specs(EXTRAS["notebooks"]))
    assert {"pytest", "nbval"} <= set(_specs(EXTRAS["test"]))


def test_environment_yml_matches_pyproject():
    want = {}
    for spec in PROJECT["dependencies"] + EXTRAS["notebooks"] + EXTRAS["test"]:
        name = _name(spec)
        want[CONDA_NAME.get(name, name)] = spec.replace(" ", "").replace(name, CONDA_NAME.get(name, name), 1)
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {}
    for d in env["dependencies"]:
        for spec in d["pip"] if isinstance(d, dict) else [d]:
            conda[_name(spec)] = spec.replace(" ", "")
    conda.pop("python"), conda.pop("pip")
    assert CONDA_TOOLCHAIN <= set(conda), "environment.yml must carry the CPU toolchain"
    for tool in CONDA_TOOLCHAIN:
        conda.pop(tool)
    assert conda == want


def test_flydsl_range_is_pinned():
    (fly,) = [d for d in PROJECT["dependencies"] if d.startswith("flydsl")]
    assert ">=" in fly and "<" in fly.replace("<=", "")


def test_license_is_an_spdx_expression_with_its_text():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    # SPDX strings need setuptools 77; an older one would reject the metadata
    (req,) = PYPROJECT["build-system"]["requires"]
    assert req.replace(" ", "") == "setuptools>=77"


def test_version_has_one_home():
    assert PROJECT["dynamic"] == ["version"] and "version" not in PROJECT
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pa_tile.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pa_tile.__version__)


def test_setup_installs_the_notebook_and_test_extras():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"-e \"?\.\[notebooks,test[],]", setup), "setup.sh must install -e .[notebooks,test]"


def test_package_and_kernels_import_without_the_extras():
    # Block the extras' modules: `import pa_tile`, the emulator, the CLI and the finished kernel
    # must still import (what a plain `pip install pa_tile` gives).
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'matplotlib', 'jupytext', 'jupyterlab', 'nbval', 'pytest', 'nbformat'}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pa_tile, pa_tile.__main__, pa_tile.emu.launch, pa_tile.isa, pa_tile.perf.roofline\n"
        "from pa_tile.stages import s6_split_k\n"
        "print('ok', pa_tile.paged_decode.__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok paged_decode")
