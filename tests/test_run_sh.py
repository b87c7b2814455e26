"""./run.sh: usage, exit codes, and `lab` (the project's Jupyter settings, root) — with a fake
venv whose `jupyter` only prints what it was given, so nothing is installed or started."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_sh(*args, env=None):
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_prints_usage_and_exits_0(flag):
    r = run_sh(flag)
    assert r.returncode == 0, r.stderr
    assert "usage: ./run.sh COMMAND" in r.stdout
    for verb in ("setup", "walkthrough", "lab", "test"):
        assert f"\n  {verb}" in r.stdout


@pytest.mark.parametrize("argv", [["frobnicate"], []])
def test_unknown_or_missing_command_exits_2_with_usage(argv):
    r = run_sh(*argv)
    assert r.returncode == 2
    assert "usage: ./run.sh COMMAND" in r.stderr and r.stdout == ""


@pytest.fixture
def fake_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "jupyter"):
        f = venv / "bin" / tool
        f.write_text('#!/bin/sh\necho "ARGS $*"\necho "JUPYTER_CONFIG_PATH=$JUPYTER_CONFIG_PATH"\n')
        f.chmod(0o755)
    # set up already: the stamp matches what setup would write
    key = subprocess.run(["cksum", "pyproject.toml", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    (venv / ".pa_tile-setup").write_text(key)
    return venv


def test_lab_uses_the_project_settings_and_works_as_root(fake_venv):
    r = run_sh("lab", "--no-browser", env={"PA_TILE_VENV": str(fake_venv), "JUPYTER_CONFIG_PATH": "/elsewhere"})
    assert r.returncode == 0, r.stderr
    args = next(ln for ln in r.stdout.splitlines() if ln.startswith("ARGS "))
    assert args.startswith("ARGS lab") and "--no-browser" in args and args.endswith("notebooks/")
    assert ("--allow-root" in args) == (os.getuid() == 0)
    assert f"JUPYTER_CONFIG_PATH={ROOT}/.jupyter:/elsewhere" in r.stdout  # the user's own path still applies


def test_project_settings_make_py_chapters_open_as_notebooks(monkeypatch):
    # What JupyterLab reads: labconfig/default_setting_overrides.json on the Jupyter config path.
    settings_utils = pytest.importorskip("jupyterlab_server.settings_utils")
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", str(ROOT / ".jupyter"))
    overrides, error = settings_utils._get_overrides("/nonexistent-app-settings")
    assert not error
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["python"] == "Jupytext Notebook"
