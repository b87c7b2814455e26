"""Every chapter under nbval on a simulated GPU: what an MI300/MI355 runner would execute and check.

``PA_TILE_SIMULATE_GPU=<arch>`` gives the notebook's kernel process one GPU
(``pa_tile.emu.device``: ``cuda`` tensors whose bytes are on the host; the emulator runs the
launches). The chapters take their GPU paths: tensors on ``backend.device_for_tensors()``, the
arch from the device, emulator-only cells skipped with their printed reason. Every launch is
checked at pa_tile's launch boundary (each tensor a ``cuda`` tensor, the code compiled for the
device's arch) and every torch op keeps torch's device rules, so a chapter that handed a host
tensor to a kernel, mixed host and device tensors, or asked for the other arch's code on the
device fails here as on the runner. nbval then compares each cell's output with the committed one
(the emulator run), as `.github/workflows/rocm.yml` does: an output that differs between the
tiers and is not tagged ``nbval-ignore-output`` fails here first.

Chapters alternate between the archs, so each arch's runner is rehearsed on half of them; the main
nbval run (``./run.sh test``) covers the emulator path of all of them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
CHAPTERS = sorted(p.name for p in NB_DIR.glob("[0-9][0-9]_*.ipynb"))


def _arch(name: str) -> str:
    return "gfx942" if int(name[:2]) % 2 == 0 else "gfx950"


def test_every_chapter_is_here():
    assert len(CHAPTERS) == 10


@pytest.mark.slow
@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_passes_nbval_on_a_simulated_gpu(name, tmp_path):
    arch = _arch(name)
    log = tmp_path / "launches.txt"
    env = dict(os.environ, PA_TILE_SIMULATE_GPU=arch, PA_TILE_SIMULATE_GPU_LOG=str(log), PA_TILE_PROGRESS="0",
               TQDM_DISABLE="1")
    env.pop("PA_TILE_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "--nbval", str(NB_DIR / name), "--nbval-sanitize-with",
           str(NB_DIR / "nbval_sanitize.cfg"), "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-x"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    launches = log.read_text().split("\n")[:-1] if log.exists() else []
    # chapter 00 launches its warm-up kernel through FlyDSL directly, and chapter 09 runs no kernel in
    # its own process on a GPU (its traces run in an emulator subprocess, its timings in `pa_tile bench`)
    if not name.startswith(("00_", "09_")):
        assert launches, f"{name} launched no pa_tile kernel on the simulated GPU"
    assert all(line.split()[1] == arch for line in launches), sorted(set(launches))
