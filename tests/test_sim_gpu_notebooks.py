"""Every chapter, top to bottom, on a simulated GPU: what an MI300/MI355 runner would execute.

``PA_TILE_SIMULATE_GPU=<arch>`` makes the notebook's kernel process see one GPU
(``pa_tile.emu.device``: ``cuda`` tensors whose bytes are on the host; the emulator runs the
launches). The chapters take their GPU paths: tensors on ``backend.device_for_tensors()``, the
arch from the device, emulator-only cells skipped with their printed reason. Every launch is
checked at pa_tile's launch boundary (each tensor a ``cuda`` tensor, the code compiled for the
device's arch), and every torch op keeps torch's device rules, so a chapter that handed a host
tensor to a kernel, compared a device result with a host one, or asked for the other arch's
code on the device fails here as it would on the runner. The chapters' own correctness checks run
too, on the emulator's results.

Chapters alternate between the archs so both are covered; the nbval run covers the emulator path.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(p.name for p in NB_DIR.glob("[0-9][0-9]_*.ipynb"))
MARK = "SIMULATED-GPU-LAUNCHES"


def _arch(name: str) -> str:
    return "gfx942" if int(name[:2]) % 2 == 0 else "gfx950"


def test_every_chapter_is_here():
    assert len(CHAPTERS) == 8


@pytest.mark.slow
@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_runs_on_a_simulated_gpu(name, monkeypatch):
    arch = _arch(name)
    nb = nbformat.read(NB_DIR / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "from pa_tile import backend as _b\n"
        "_g = _b.simulated_gpu()\n"
        f"print('{MARK}', _b.current_backend(), _g.arch, len(_g.launches), sorted({{a for _, a, _ in _g.launches}}))"))
    monkeypatch.setenv("PA_TILE_SIMULATE_GPU", arch)
    monkeypatch.setenv("PA_TILE_PROGRESS", "0")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.delenv("PA_TILE_BACKEND", raising=False)
    NotebookClient(nb, timeout=1800, kernel_name="python3",
                   resources={"metadata": {"path": str(NB_DIR)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert MARK in text, text
    backend, seen_arch, launches, archs = text.split(MARK, 1)[1].split(None, 3)
    assert backend == "gpu" and seen_arch == arch
    # chapter 00 launches its warm-up kernel through FlyDSL directly; every other chapter runs pa_tile kernels
    if not name.startswith("00_"):
        assert int(launches) > 0, f"{name} launched no pa_tile kernel on the simulated GPU"
        assert archs.strip() == repr([arch]), archs
