"""``scripts/check_upstream_flydsl.py --tests`` loads an upstream test file as a module: one that
defines a dataclass (FlyDSL's ``test_gemm_a16w16_gfx950.py`` does) must load and run, which
needs the module registered in ``sys.modules`` (dataclasses look their module up there)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("check_upstream_flydsl", ROOT / "scripts" / "check_upstream_flydsl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod



def _run_probe(tmp_path, name, monkeypatch, capsys, harness=None):
    """Run the probe test file ``tmp_path/name`` through the harness (``harness``: one already set
    up, else a fresh one) on gfx942; its printed report."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (harness or _harness())._run_file(tmp_path, name, "gfx942", "raise", (), {})
    sys.modules.pop("upstream_test", None)
    return capsys.readouterr().out

def test_a_test_module_with_a_dataclass_loads_and_runs(tmp_path, capsys, monkeypatch):
    (tmp_path / "test_dc.py").write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass Shape:\n    m: int\n    n: int = 4\n\n"
        "def test_shape():\n    assert Shape(2).n == 4\n")
    out = _run_probe(tmp_path, "test_dc.py", monkeypatch, capsys)
    assert "not loaded" not in out
    assert "test_dc.py::test_shape gfx942: PASS" in out


def test_help_prints_the_usage_instead_of_taking_it_for_a_checkout(capsys):
    # ``--help`` used to be read as the checkout path and died on '--help/examples/01-vectorAdd.py'
    h = _harness()
    assert h.main(["--help"]) == 0 and h.main(["-h"]) == 0
    assert capsys.readouterr().out.count("Usage: python scripts/check_upstream_flydsl.py") == 2
    assert h.main([]) == 2


def test_mem_get_info_reports_host_memory():
    # FlyDSL's flash-attention launcher test compares torch.cuda.mem_get_info() before and after
    # a rejected launch; under the emulator the device's memory is the host's
    free, total = _harness()._host_mem_info()
    assert 0 < free <= total


def test_current_stream_has_a_raw_handle_and_current_device_is_the_tensors_device(tmp_path, capsys, monkeypatch):
    # FlyDSL's rmsnorm wrappers launch with torch.cuda.current_stream(i).cuda_stream and compare
    # torch.cuda.current_device() with the tensor's device (both raised on a CPU torch); its
    # two-stage cache test keys by torch.device("cuda", current_device()), which must be x.device
    import torch

    (tmp_path / "test_st.py").write_text(
        "import torch\n\n"
        "def test_stream():\n"
        "    assert torch.cuda.current_stream(None).cuda_stream == 0\n"
        "    torch.cuda.current_stream().synchronize()\n"
        "    assert torch.cuda.is_available()\n"
        "    d = torch.device('cuda', torch.cuda.current_device())\n"
        "    assert torch.randn(2, device='cuda').device == d\n")
    for name in ("current_stream", "current_device", "mem_get_info", "is_available", "synchronize", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    for name in ("cuda", "is_cuda"):
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    h = _harness()
    h._host_torch_cuda(torch)
    assert "test_st.py::test_stream gfx942: PASS" in _run_probe(tmp_path, "test_st.py", monkeypatch, capsys, h)


def test_monkeypatch_and_tmp_path_fixtures_are_provided_and_undone(tmp_path, capsys, monkeypatch):
    # FlyDSL's test_rmsnorm_bwd_two_stage_cache_reuse_across_m takes pytest's monkeypatch
    import os as _os

    (tmp_path / "test_fx.py").write_text(
        "import os\n\n"
        "def test_fx(monkeypatch, tmp_path):\n"
        "    monkeypatch.setenv('PA_TILE_HARNESS_PROBE', '1')\n"
        "    (tmp_path / 'f').write_text('x')\n"
        "    assert os.environ['PA_TILE_HARNESS_PROBE'] == '1'\n\n"
        "def test_other(capfd):\n"
        "    pass\n")
    out = _run_probe(tmp_path, "test_fx.py", monkeypatch, capsys)
    assert "test_fx.py::test_fx gfx942: PASS" in out
    assert "test_fx.py::test_other gfx942: not run (needs fixtures ['capfd'])" in out
    assert "PA_TILE_HARNESS_PROBE" not in _os.environ


def test_streams_are_host_streams(monkeypatch):
    import torch

    for name in ("current_stream", "current_device", "mem_get_info", "is_available", "synchronize", "device",
                 "Stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    for name in ("cuda", "is_cuda"):
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    _harness()._host_torch_cuda(torch)
    s = torch.cuda.Stream(device=torch.device("cuda", 0))
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        assert s.cuda_stream == 0


def test_a_case_timeout_is_not_reported_as_an_emulator_error(tmp_path, capsys, monkeypatch):
    # FlyDSL's test_softmax_bwd_large_shape ran past --timeout inside an instruction and was
    # reported as "internal emulator error CaseTimeout"; the alarm now passes through as itself
    (tmp_path / "test_slow.py").write_text(
        "def test_slow():\n"
        "    try:\n"
        "        while True:\n"
        "            pass\n"
        "    except Exception:\n"
        "        raise RuntimeError('wrapped')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    h = _harness()
    assert not issubclass(h.CaseTimeout, Exception)
    h._run_file(tmp_path, "test_slow.py", "gfx942", "raise", (), {}, timeout=1)
    sys.modules.pop("upstream_test", None)
    out = capsys.readouterr().out
    assert "test_slow.py::test_slow gfx942: FAIL " in out and "CaseTimeout: case ran past --timeout" in out
    assert "wrapped" not in out


def test_raw_ptr_load_gives_plain_type_holders_the_raw_value_and_leaves_dsl_types_alone(monkeypatch):
    # FlyDSL's bf16 conv3d kernel loads with fx.ptr_load(ptr, result_type=BF16Ty), BF16Ty a bare
    # class holding an ir_type: its tree's flydsl (0.3.2) returns the raw value, flydsl 0.5.0
    # calls BF16Ty(value) ("takes no arguments"). --raw-ptr-load restores the former for such
    # holders only.
    import types

    import flydsl.expr as fx
    from flydsl._mlir import ir
    from flydsl.expr import primitive

    h = _harness()

    class Holder:
        ir_type = "bf16"

    class Wraps:
        ir_type = "bf16"

        def __init__(self, v):
            self.v = v

    assert h._is_plain_type_holder(Holder)
    assert not h._is_plain_type_holder(Wraps) and not h._is_plain_type_holder(fx.BFloat16)
    assert not h._is_plain_type_holder(Holder()) and not h._is_plain_type_holder(None)

    calls = []

    def dsl_ptr_load(ptr, result_type=None):   # stands in for 0.5.0's ptr_load
        calls.append(("dsl", ptr, result_type))
        return "wrapped"
    monkeypatch.setattr(primitive, "ptr_load", dsl_ptr_load)
    monkeypatch.setattr(fx, "ptr_load", dsl_ptr_load)
    monkeypatch.setattr(primitive, "fly", types.SimpleNamespace(
        ptr_load=lambda ty, ptr: calls.append(("raw", ty, ptr)) or "raw value"))
    h._raw_ptr_load()
    h._raw_ptr_load()   # idempotent: one wrapper
    assert fx.ptr_load is primitive.ptr_load and primitive.ptr_load._pa_tile_raw
    with ir.Context():
        assert fx.ptr_load("p", result_type=Holder) == "raw value"
        assert fx.ptr_load("p", result_type=fx.BFloat16) == "wrapped"
        assert fx.ptr_load("p") == "wrapped"
    assert calls == [("raw", "bf16", "p"), ("dsl", "p", fx.BFloat16), ("dsl", "p", None)]


def test_overread_option_reaches_the_launches_of_a_case(tmp_path, capsys, monkeypatch):
    # --overread N: the case's launches run with launch_options(overread=N) (FlyDSL's conv3d
    # transpose reads up to 14 B past its input by design)
    (tmp_path / "test_ov.py").write_text(
        "from pa_tile.emu import launch\n\n"
        "def test_ov():\n"
        "    assert launch._local.options['overread'] == 14\n")
    h = _harness()
    h.OVERREAD = 14
    assert "test_ov.py::test_ov gfx942: PASS (" in _run_probe(tmp_path, "test_ov.py", monkeypatch, capsys, h)


def test_a_case_whose_loads_used_the_overread_slack_says_so(tmp_path, capsys, monkeypatch):
    # the verdict of a case names how many lane loads read past a tensor's end (Launch.overreads)
    (tmp_path / "test_ovn.py").write_text(
        "from pa_tile.emu import launch\n\n"
        "def test_ovn():\n"
        "    for log in launch._local.recorders:\n"
        "        log.append(launch.Launch(kernel='k', meta=None, module=None, arch='gfx950', grid=(1, 1, 1),\n"
        "                                 block=(64, 1, 1), dynamic_lds=0, explicit_args=(), kernarg=b'',\n"
        "                                 regions=[], overread=14, overreads=3))\n")
    assert "test_ovn.py::test_ovn gfx942: PASS [over-read: 3 lane loads ran past a tensor's end, read 0xFF]" in \
        _run_probe(tmp_path, "test_ovn.py", monkeypatch, capsys)


def test_bench_by_instructions_answers_do_bench_with_the_emulators_instruction_count(monkeypatch):
    # --bench-by-instructions: FlyDSL's autotuners call flydsl.autotune.do_bench, which times with
    # device events (NoDeviceClock here); the stand-in runs the function once and returns the number
    # of instructions the emulator executed, in place of milliseconds (a ranking proxy, not a time)
    import importlib

    import torch

    from pa_tile import backend
    from pa_tile.emu import launch
    from pa_tile.emu.memory import Trace
    from pa_tile.tiny_kernels import scale_add

    if backend.current_backend() != "emu":
        import pytest

        pytest.skip("emulator-tier test")
    backend.ensure_backend()
    autotune = importlib.import_module("flydsl.autotune")
    monkeypatch.setattr(autotune, "do_bench", autotune.do_bench)
    holder = type(sys)("holder_of_do_bench")  # a module that did `from flydsl.autotune import do_bench`
    holder.do_bench = autotune.do_bench
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    h = _harness()
    h._bench_by_instructions()
    assert autotune.do_bench is h._instruction_bench and holder.do_bench is h._instruction_bench

    x, y = torch.randn(64, 128), torch.randn(64, 128)
    out = torch.zeros(64, 128)
    calls = []

    def run(rows):
        calls.append(rows)
        scale_add(x[:rows], y[:rows], out[:rows], 2.0)

    with launch.launch_options(overread=14):
        small = autotune.do_bench(lambda: run(16), warmup=5, rep=20)
        big = autotune.do_bench(lambda: run(64), quantiles=[0.2, 0.5, 0.8])
        assert launch._local.options["overread"] == 14 and launch._local.options["trace"] is None
    assert calls == [16, 64]  # once each: the count needs no warmup or repeats
    assert torch.equal(out, 2.0 * x + y)
    direct = Trace(launch.current_arch())
    with launch.launch_options(trace=direct):
        scale_add(x[:16], y[:16], out[:16], 2.0)
    assert small == float(direct.seq) > 0
    assert big == [big[0]] * 3 and big[0] > small  # four times the workgroups
