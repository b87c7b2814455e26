"""pyproject.toml (pip, CI) and environment.yml (conda) declare the same dependencies."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ ]", spec.strip(), maxsplit=1)[0].lower()


def test_dependency_lists_agree():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pip_deps = {_name(d): d.replace(" ", "") for d in pyproject["project"]["dependencies"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {}
    for d in env["dependencies"]:
        for spec in d["pip"] if isinstance(d, dict) else [d]:
            conda[_name(spec)] = spec.replace(" ", "")
    conda.pop("python"), conda.pop("pip")
    assert pip_deps == conda


def test_flydsl_range_is_pinned():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (fly,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("flydsl")]
    assert ">=" in fly and "<" in fly.replace("<=", "")
