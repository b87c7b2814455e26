"""`python -m pa_tile`: help, roofline, isa / check / trace on the tiny kernel and on every stage
present, the bench refusal on CPU, and the error paths (exit code 2 with a clear message)."""

import json
import os
import subprocess
import sys

import pytest

from pa_tile import backend
from pa_tile.__main__ import main
from pa_tile.backend import gpu_available
from pa_tile.perf import adapters, bench, roofline

STAGES = adapters.stage_names()


@pytest.fixture(autouse=True)
def _restore_backend():
    yield
    backend.set_backend(None)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_trace(capsys, *argv):
    """``trace`` switches this process to the emulator for good: harmless where there is no GPU
    (the emulator is all there is), so in-process there; in a fresh interpreter otherwise."""
    if not gpu_available():
        return run(capsys, "trace", *argv)
    return run_process("trace", *argv)


def run_process(*argv, env=None):
    """A fresh interpreter: ``trace`` forces the emulator, whose hook a process cannot take back."""
    proc = subprocess.run([sys.executable, "-m", "pa_tile", *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


# ---------------------------------------------------------------------------------------------
# help and argument errors


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for cmd in ("isa", "check", "trace", "bench", "roofline"):
        assert cmd in text


@pytest.mark.parametrize("cmd", ["isa", "check", "trace", "bench", "roofline"])
def test_subcommand_help(capsys, cmd):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: python -m pa_tile " + cmd in capsys.readouterr().out


def test_module_entry_point_runs():
    code, out, err = run_process("roofline", "--batch", "1", "--context", "129", "--head-dim", "128")
    assert code == 0, err
    assert "MI300X floor µs" in out


@pytest.mark.parametrize("argv", [
    [],  # no subcommand
    ["frobnicate"],
    ["isa"],  # neither --stage nor --kernel
    ["isa", "--kernel", "huge"],
    ["isa", "--kernel", "tiny", "--arch", "gfx90a"],
    ["roofline", "--context", "0"],
    ["roofline", "--batch", "two"],
    ["check", "--kernel", "tiny", "--batch", "1,2"],
])
def test_bad_arguments_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_unknown_stage_lists_the_available_ones(capsys):
    code, out, err = run(capsys, "isa", "--stage", "s42")
    assert code == 2
    assert "unknown stage 's42'" in err and "available stages: " + ", ".join(STAGES) in err and "--kernel tiny" in err


def test_known_but_missing_stage_says_so(capsys, monkeypatch):
    import pa_tile.stages as stages

    # a checkout part-way through the walkthrough: the last chapter's module is not there yet
    present = [s for s in stages.STAGES][:-1]
    monkeypatch.setattr(stages, "available", lambda: present)
    missing = list(stages.STAGES)[-1]
    code, out, err = run(capsys, "check", "--stage", missing)
    assert code == 2 and f"stage {missing!r} is not built" in err
    assert "available stages: " + ", ".join(present) in err


# ---------------------------------------------------------------------------------------------
# roofline


def test_roofline_table_numbers(capsys):
    code, out, err = run(capsys, "roofline", "--batch", "1", "--context", "129", "--head-dim", "128", "--json")
    assert code == 0, err
    (row,) = json.loads(out)
    # 129 tokens x 8 kv heads x 128 x 1 B, twice; 2 scales; q and o: 64 heads x 128 x 2 B; 9 pages; 1 length
    assert row["bytes"] == 2 * 129 * 8 * 128 + 8 + 2 * 64 * 128 * 2 + 9 * 4 + 4 == 297008
    assert row["MI300X_us"] == pytest.approx(297008 / 5.3e12 * 1e6)
    assert row["MI355X_us"] == pytest.approx(297008 / 8e12 * 1e6)


def test_roofline_grid_text_and_plot(capsys, tmp_path):
    png = tmp_path / "floor.png"
    code, out, err = run(capsys, "roofline", "--gpu", "MI355X", "--batch", "1,256", "--context", "129,16384",
                         "--query-length", "2", "--scales", "per-token", "--plot", str(png))
    assert code == 0, err
    lines = out.splitlines()
    assert "MI355X floor µs" in lines[0] and "MI300X" not in lines[0]
    assert len([ln for ln in lines if ln.lstrip().startswith(("1 ", "256 "))]) == 2 * 2 * 2  # batches x ctx x head dims
    assert "8 TB/s HBM, 256 CUs" in out
    assert png.stat().st_size > 1000


def test_roofline_unknown_gpu(capsys):
    code, out, err = run(capsys, "roofline", "--gpu", "H100")
    assert code == 2 and "unknown 'H100'" in err and "MI300X" in err


def test_roofline_bad_heads(capsys):
    code, out, err = run(capsys, "roofline", "--q-heads", "12", "--kv-heads", "8")
    assert code == 2 and "not a multiple" in err


# ---------------------------------------------------------------------------------------------
# isa on the tiny kernel


def test_isa_tiny_summary(capsys):
    code, out, err = run(capsys, "isa", "--kernel", "tiny")
    assert code == 0, err
    assert "scale_add_kernel" in out and "gfx942" in out
    assert "global: dwordx4 2" in out  # X and Y: one 128-bit load per thread each


def test_isa_tiny_json(capsys):
    code, out, err = run(capsys, "isa", "--kernel", "tiny", "--arch", "gfx950", "--json")
    assert code == 0, err
    (k,) = json.loads(out)
    assert k["arch"] == "gfx950" and k["kernel"].startswith("scale_add_kernel")
    assert k["load_widths"]["global"]["dwordx4"] == 2 and k["store_widths"]["global"]["dwordx4"] == 1
    assert k["families"]["mfma"] == 0 and k["lds_bytes"] == 0


def test_isa_tiny_diff_across_archs(capsys):
    code, out, err = run(capsys, "isa", "--kernel", "tiny", "--diff", "gfx950")
    assert code == 0, err
    header = out.splitlines()[1]
    assert "tiny gfx942" in header and "tiny gfx950" in header and "delta" in header
    assert any(ln.startswith("vgpr ") for ln in out.splitlines())


def test_isa_diff_with_unknown_target(capsys):
    code, out, err = run(capsys, "isa", "--kernel", "tiny", "--diff", "s42")
    assert code == 2 and "unknown stage 's42'" in err


# ---------------------------------------------------------------------------------------------
# check on the tiny kernel


def test_check_tiny_passes(capsys):
    code, out, err = run(capsys, "check", "--kernel", "tiny")
    assert code == 0, err
    assert "tiny (scale_add)" in out and "PASS" in out


def test_check_exits_1_on_a_mismatch(capsys, monkeypatch):
    # A wrong reference stands in for a wrong kernel: the command must say FAIL and exit 1.
    monkeypatch.setattr(adapters.TinyKernel, "reference", lambda self, x, y: 3.0 * x + y)
    code, out, err = run(capsys, "check", "--kernel", "tiny")
    assert code == 1
    assert "FAIL" in out and "error above tolerance" in out


def test_check_exits_1_when_the_kernel_run_fails(capsys, monkeypatch):
    def crash(self, x, y, out, arch):
        raise RuntimeError("MemoryFault: lane 3 read 0xdead outside every region")

    monkeypatch.setattr(adapters.TinyKernel, "run", crash)
    code, out, err = run(capsys, "check", "--kernel", "tiny")
    assert code == 1
    assert "FAIL: the run raised RuntimeError: MemoryFault" in out


@pytest.mark.skipif(gpu_available(), reason="a ROCm GPU is present, so asking for it is not an error here")
def test_check_on_a_missing_gpu_is_a_clear_error():
    code, out, err = run_process("check", "--kernel", "tiny", "--backend", "gpu")  # fresh: no emulator hook yet
    assert code == 2 and "no usable ROCm GPU" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# trace on the tiny kernel


def test_trace_tiny_memory_report(capsys, tmp_path):
    js = tmp_path / "trace.json"
    code, out, err = run_trace(capsys, "--kernel", "tiny", "--json", str(js))
    assert code == 0, err
    assert "global_load_dwordx4" in out and "PASS" in out
    rep = json.loads(js.read_text())
    # [16, 128] float32 in 8x64 tiles: 4 workgroups x 2 waves; each wave instruction moves 64 lanes
    # x 16 B = 1 KiB of contiguous memory = 8 fully used 128-byte lines.
    vmem = rep["vmem"]
    assert [r["op"] for r in vmem] == ["load", "load", "store"]
    for r in vmem:
        assert (r["executions"], r["bytes_per_exec"], r["lines_128B_per_exec"], r["efficiency"]) == (8, 1024, 8, 1.0)
    assert rep["lds"] == [] and rep["totals"]["lds_conflict_cycles"] == 0
    assert rep["families"]["global"] == 24 and rep["dynamic_instructions"] > 24
    assert rep["check"]["ok"]


# ---------------------------------------------------------------------------------------------
# bench


@pytest.mark.skipif(gpu_available(), reason="a ROCm GPU is present: bench times there")
def test_bench_refuses_on_cpu(capsys):
    code, out, err = run(capsys, "bench", "--shapes", "quick")
    assert code == 2
    assert "timings need a ROCm GPU" in err and "Nothing was timed" in err
    assert out == ""


def test_bench_show_prints_a_results_file(capsys, tmp_path):
    s = roofline.DecodeShape(batch=1, context=2048)
    rec = dict(impl="torch", kind="baseline", shape=s.to_dict(), label=s.label, status="unsupported",
               reason="TypeError: synthetic", time_us=None, floor_us=None, bandwidth_tb_s=None, pct_hbm_peak=None)
    data = dict(schema=bench.SCHEMA, machine=dict(gpu_name="synthetic"), arch="gfx942",
                peak=dict(roofline.GPUS["MI300X"].to_dict(), note="synthetic"), settings={}, results=[rec])
    path = bench.write_results(data, tmp_path / "r.json")
    code, out, err = run(capsys, "bench", "--show", str(path))
    assert code == 0, err
    assert "synthetic" in out and "unsupported" in out
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "nope"}))
    code, out, err = run(capsys, "bench", "--show", str(tmp_path / "bad.json"))
    assert code == 2 and "not a pa_tile benchmark results file" in err


# ---------------------------------------------------------------------------------------------
# every stage present in this checkout


def test_stages_are_present():
    # The stage-dependent tests below are parametrized over pa_tile.stages.available(); stage 1
    # has landed, so an empty list would mean they silently stopped running.
    assert "s1" in STAGES, STAGES


@pytest.mark.parametrize("stage", STAGES)
def test_isa_stage_on_both_archs(capsys, stage):
    code, out, err = run(capsys, "isa", "--stage", stage, "--diff", "gfx950", "--json")
    assert code == 0, err
    pairs = json.loads(out)
    assert pairs
    for arch, key in (("gfx942", "a"), ("gfx950", "b")):
        kernels = [p[key] for p in pairs]
        assert all(k["arch"] == arch for k in kernels)
        assert sum(k["families"]["mfma"] for k in kernels) > 0  # the QK and PV matmuls
        assert any(k["main_loop_instructions"] > 0 for k in kernels)  # the loop over 256-token tiles
    assert any(row[1] == "vgpr" for row in pairs[0]["rows"])


@pytest.mark.skipif(len(STAGES) < 2, reason="needs two stages to diff")
def test_isa_diff_between_two_stages(capsys):
    a, b = STAGES[:2]
    code, out, err = run(capsys, "isa", "--stage", a, "--diff", b)
    assert code == 0, err
    assert f"{a} gfx942" in out and f"{b} gfx942" in out and "main loop instr" in out


@pytest.mark.parametrize("stage", STAGES)
def test_check_stage_passes(capsys, stage):
    code, out, err = run(capsys, "check", "--stage", stage, "--context", "300,17,129")
    assert code == 0, err + out
    assert f"stage {stage} (b3 ctx17..300" in out and "PASS" in out


@pytest.mark.parametrize("stage", STAGES)
def test_check_stage_rejects_an_unsupported_shape(capsys, stage):
    # head_dim 96 is outside every stage's scope (64/128, later 256): the stage itself must refuse
    code, out, err = run(capsys, "check", "--stage", stage, "--head-dim", "96", "--q-heads", "8", "--kv-heads", "1")
    assert code == 2
    assert "head_dim" in err or "query" in err  # the stage's own validation names the argument


@pytest.mark.parametrize("stage", STAGES)
def test_trace_stage(capsys, tmp_path, stage):
    js = tmp_path / "trace.json"
    code, out, err = run_trace(capsys, "--stage", stage, "--context", "300,129", "--json", str(js))
    assert code == 0, err + out
    rep = json.loads(js.read_text())
    assert rep["check"]["ok"]
    assert rep["tiles"] == 2 + 1  # ceil(300/256) + ceil(129/256) tiles, one kv head
    t = rep["totals"]
    # every K/V byte of the case is loaded at least once: 429 tokens x 128 x 2 caches
    assert t["load_bytes"] >= 429 * 128 * 2
    assert t["load_lines_128B"] > 0 and t["instructions_per_tile"] > 0
    assert all(r["executions"] > 0 for r in rep["vmem"] + rep["lds"])
    assert "instructions per 256-token tile" in out
