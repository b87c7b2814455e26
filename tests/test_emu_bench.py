"""`python -m pa_tile.perf.emu_speed`: the stage-2 kernel through FlyDSL's launcher into the emulator."""

import json

import pytest

from pa_tile import backend
from pa_tile.perf import emu_speed as bench

# The full 3 x 8 x 1027 launch takes about a second here; the bound is for slow shared CI.
FULL_SHAPE_BOUND_S = 30.0


@pytest.fixture(autouse=True)
def _restore_backend():
    yield
    backend.set_backend(None)  # main() forces the emulator; later tests choose for themselves


def test_small_run_through_the_command_line(capsys):
    code = bench.main(["--arch", "gfx942", "--stages", "s2", "--engines", "fast", "--seqs", "1", "--heads", "8",
                       "--context", "17", "--json"])
    assert code == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["arch"] == "gfx942" and r["shape"].startswith("1x8x17") and r["ok"]
    assert r["workgroups"] == 1 and r["instructions"] > 100
    assert r["instructions_per_s"] == pytest.approx(r["instructions"] / r["wall_s"])


@pytest.mark.parametrize("arch", bench.ARCHS)
def test_full_shape_is_fast_and_correct(arch):
    backend.set_backend("emu")
    r = bench.run(arch)  # 3 sequences x 8 query heads, 1 KV head, context 1027, d 128, block 16
    assert r.ok, f"max error {r.max_abs_err:.4f} against the reference"
    assert r.wall_s < FULL_SHAPE_BOUND_S, f"{arch}: one launch took {r.wall_s:.1f} s"
    assert r.workgroups == 3 and r.instructions > 0
    text = bench.format_results([r])
    assert "3x8x1027" in text and "PASS" in text


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="gfx90a"):
        bench.run("gfx90a")
