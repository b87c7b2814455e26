"""pa_tile.perf: roofline arithmetic by hand, the PyTorch baseline against the reference, the
harness refusing to time without a GPU, results files and plots, and (on a ROCm GPU) timings."""

import json
import subprocess
import sys

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from pa_tile import cache
from pa_tile.backend import gpu_available
from pa_tile.perf import adapters, bench, checks, roofline, tracing
from pa_tile.perf.baseline import baseline_from_case, paged_decode_torch
from pa_tile.perf.checks import Tolerance
from pa_tile.perf.roofline import DecodeShape

NO_GPU = "needs a ROCm GPU (torch.version.hip set and a visible device)"

# ---------------------------------------------------------------------------------------------
# roofline: every number below is worked out by hand in the comment next to it


def test_traffic_per_tensor_by_hand():
    s = DecodeShape(batch=1, context=129, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    t = roofline.traffic(s)
    assert t.k == t.v == 129 * 128  # 16512 fp8 bytes each
    assert t.k_scale == t.v_scale == 4  # one float32 each
    assert t.query == t.out == 8 * 128 * 2  # 2048: 8 heads x 128 x f16
    assert t.block_tables == 9 * 4  # ceil(129 / 16) = 9 pages
    assert t.context_lengths == 4
    assert t.total == 2 * 16512 + 8 + 2 * 2048 + 36 + 4 == 37168
    # whole pages: 9 x 16 = 144 slots read for K and for V
    assert roofline.traffic(s, whole_pages=True).k == 144 * 128
    assert roofline.flops(s) == 4 * 128 * 8 * 129  # 528384: q.k and p.v, 2 flops per MAC


def test_traffic_per_token_mtp_gqa_by_hand():
    s = DecodeShape(batch=2, context=(100, 37), num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                    query_length=2, scales="per-token")
    t = roofline.traffic(s)
    assert t.k == t.v == 137 * 2 * 64  # 17536: 137 tokens x 2 kv heads x 64
    assert t.k_scale == t.v_scale == 4 * 137 * 2  # 1096: a float32 per (token, kv head)
    assert t.query == t.out == 2 * 2 * 8 * 64 * 2  # 4096: 2 seqs x 2 query tokens x 8 heads x 64 x f16
    assert t.block_tables == (7 + 3) * 4  # ceil(100/16) + ceil(37/16) pages
    assert t.total == 45504
    # causal MTP: row 0 sees L-1 tokens, row 1 sees L -> (99+100) + (36+37) = 272 visible (row, token) pairs
    assert roofline.flops(s) == 4 * 64 * 8 * 272 == 557056
    assert roofline.arithmetic_intensity(s) == pytest.approx(557056 / 45504)


def test_time_floor_and_hardware_figures():
    s = DecodeShape(batch=1, context=129, num_q_heads=8, num_kv_heads=1, head_dim=128)
    f300 = roofline.time_floor(s, "MI300X")
    assert f300.memory_s == pytest.approx(37168 / 5.3e12)
    assert f300.time_us == pytest.approx(37168 / 5.3e12 * 1e6)
    assert f300.bound == "memory"
    assert roofline.time_floor(s, "mi355x").time_s == pytest.approx(37168 / 8e12)
    mi300, mi355 = roofline.GPUS["MI300X"], roofline.GPUS["MI355X"]
    assert (mi300.compute_units, mi300.hbm_tb_s, mi300.arch) == (304, 5.3, "gfx942")
    assert (mi355.compute_units, mi355.hbm_tb_s, mi355.arch) == (256, 8.0, "gfx950")
    assert mi300.fp8_dense_flops == pytest.approx(2614.9e12, rel=1e-4)  # the data sheet's figure
    assert mi355.fp8_dense_flops / 1e15 == pytest.approx(5.0, rel=0.01)
    assert mi300.ridge_flops_per_byte == pytest.approx(493, abs=1)
    # a long decode with group 8 does ~2*G = 16 flops per byte: far below either ridge
    long = DecodeShape(batch=1, context=16384, num_q_heads=64, num_kv_heads=8, head_dim=128)
    assert roofline.arithmetic_intensity(long) == pytest.approx(16, rel=2e-3)
    assert roofline.time_floor(long, "MI355X").bound == "memory"
    # heavy MTP on a tiny context flips nothing either, but the compute floor is reported
    assert roofline.time_floor(long, "MI300X").compute_s == pytest.approx(roofline.flops(long) / mi300.fp8_dense_flops)


def test_gpu_matching_by_name_and_flagged_arch_guess():
    spec, note = roofline.gpu_for_device("AMD Instinct MI300X", "gfx942")
    assert spec.name == "MI300X" and "matched" in note
    spec, note = roofline.gpu_for_device("AMD Instinct MI355X", "gfx950")
    assert spec.name == "MI355X"
    spec, note = roofline.gpu_for_device("AMD Instinct MI325X", "gfx942")
    assert spec.name == "MI300X" and note.startswith("ASSUMED")
    with pytest.raises(ValueError, match="no HBM figures"):
        roofline.gpu_for_device("Some GPU", "gfx1100")
    with pytest.raises(ValueError, match="known: MI300X, MI355X"):
        roofline.gpu_spec("H100")


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch=1, context=10, num_q_heads=6, num_kv_heads=4), "not a multiple"),
    (dict(batch=1, context=3, query_length=4), "shorter than query_length"),
    (dict(batch=2, context=(5, 6, 7)), "3 lengths for batch=2"),
    (dict(batch=1, context=5, scales="per-page"), "scales"),
    (dict(batch=0, context=5), "batch"),
    (dict(batch=1, context=5.0), "context"),
])
def test_shape_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DecodeShape(**kwargs)


def test_shape_round_trips_and_from_case():
    s = DecodeShape(batch=2, context=[100, 37], num_q_heads=16, num_kv_heads=2, query_length=2, scales="per-token")
    assert s.context == (100, 37) and DecodeShape.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    case = cache.make_case(2, 16, 2, 64, 16, [100, 37], query_length=2, scales="per-token")
    c = DecodeShape.from_case(case)
    assert (c.batch, c.context, c.num_q_heads, c.num_kv_heads, c.head_dim, c.query_length, c.scales) == \
        (2, (100, 37), 16, 2, 64, 2, "per-token")


def test_upstream_grid_table_and_plot():
    shapes = roofline.upstream_shapes()
    assert len(shapes) == len(roofline.BATCHES) * len(roofline.CONTEXTS) * len(roofline.HEAD_DIMS) == 84
    assert {s.batch for s in shapes} == {1, 4, 16, 64, 128, 256}
    assert min(s.context for s in shapes) == 129 and max(s.context for s in shapes) == 16384
    assert {s.head_dim for s in shapes} == {64, 128}
    rows = roofline.table(shapes[:3])
    assert len(rows) == 3 and rows[0]["MI300X_bound"] == "memory"
    assert rows[0]["MI355X_us"] == pytest.approx(roofline.time_floor(shapes[0], "MI355X").time_us)
    text = roofline.format_table(rows)
    assert "MI300X floor µs" in text and "MI355X floor µs" in text and len(text.splitlines()) == 2 + 3
    fig = roofline.plot(roofline.upstream_shapes(batches=(1, 16), head_dims=(128,)))
    assert len(fig.axes[0].lines) == 2 * 2  # (2 batches) x (2 GPUs)
    ys = fig.axes[0].lines[0].get_ydata()
    assert list(ys) == sorted(ys)  # the floor grows with the context


# ---------------------------------------------------------------------------------------------
# the PyTorch baseline against the reference (CPU)

BASELINE_CASES = {
    "gqa": dict(num_seqs=3, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, context_lengths=[100, 37, 5]),
    "mtp_per_token_ocp_pad": dict(num_seqs=2, num_q_heads=16, num_kv_heads=2, head_dim=32, block_size=16,
                                  context_lengths=[50, 17], query_length=3, scales="per-token", fp8_format="ocp",
                                  pad_block_id=-1),
    "mha_ql4": dict(num_seqs=2, num_q_heads=4, num_kv_heads=4, head_dim=16, block_size=8, context_lengths=[9, 4],
                    query_length=4),
    "group16_long": dict(num_seqs=1, num_q_heads=16, num_kv_heads=1, head_dim=128, block_size=64,
                         context_lengths=[1000]),
}


@pytest.mark.parametrize("name", sorted(BASELINE_CASES))
def test_baseline_matches_reference_in_float32(name):
    case = cache.make_case(**BASELINE_CASES[name], query_dtype=torch.float32, seed=3)
    got = baseline_from_case(case)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, case.reference(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_baseline_in_the_query_dtype_is_within_its_tolerance(dtype):
    case = cache.make_case(**BASELINE_CASES["mtp_per_token_ocp_pad"], query_dtype=dtype, seed=1)
    out = torch.empty_like(case.query)
    assert baseline_from_case(case, out=out) is out
    res = checks.compare(out, case.reference(), bench.BASELINE_TOLERANCE[dtype])
    assert res.ok, res
    assert res.max_rel > 0  # really computed in the low precision


def test_baseline_ignores_nan_garbage_past_the_context():
    case = cache.make_case(2, 8, 1, 64, 16, [20, 33], query_dtype=torch.float32)
    ref = case.reference()
    nan = torch.tensor(float("nan")).to(case.k_cache.dtype)
    for s, L in enumerate((20, 33)):
        last = int(case.block_tables[s, (L - 1) // 16])
        case.k_cache[last, :, L % 16:] = nan
        case.v_cache[last, :, L % 16:] = nan
    got = baseline_from_case(case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)


def test_baseline_rejects_bad_input():
    case = cache.make_case(1, 8, 2, 64, 16, 20)
    with pytest.raises(TypeError, match="key_cache"):
        paged_decode_torch(case.query, case.k_cache.float(), case.v_cache, case.block_tables, case.context_lengths,
                           case.k_scale, case.v_scale)
    with pytest.raises(ValueError, match="max_context_length"):
        paged_decode_torch(case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lengths,
                           case.k_scale, case.v_scale, max_context_length=1000)


# ---------------------------------------------------------------------------------------------
# checks


def test_compare_metrics():
    ref = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    r = checks.compare(ref * 1.1, ref, Tolerance(0.2, 0.2))
    assert r.ok and r.max_rel == pytest.approx(0.1) and r.rms_rel == pytest.approx(0.1)
    assert r.max_abs == pytest.approx(0.4)
    assert not checks.compare(ref * 1.1, ref, Tolerance(0.05, 0.2)).ok
    bad = ref.clone()
    bad[0, 0] = float("nan")
    r = checks.compare(bad, ref, Tolerance(1, 1))
    assert not r.ok and "non-finite" in r.reason and "FAIL" in str(r)
    assert "shape" in checks.compare(ref[0], ref, Tolerance(1, 1)).reason


def test_reference_output_in_chunks_equals_the_reference():
    case = cache.make_case(5, 8, 2, 64, 16, [100, 37, 5, 64, 200], query_length=1)
    one_seq_budget = 100 * 2 * 4 * 2 * 64  # float32 K+V of 100 tokens: forces several chunks
    assert torch.equal(checks.reference_output(case, chunk_bytes=one_seq_budget), case.reference())


# ---------------------------------------------------------------------------------------------
# adapters


def test_cases_follow_the_arch_fp8_flavour():
    s = DecodeShape(batch=2, context=(40, 17), num_q_heads=8, num_kv_heads=1)
    assert adapters.make_case(s, "gfx942").k_cache.dtype == torch.float8_e4m3fnuz
    assert adapters.make_case(s, "gfx950").v_cache.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="arch"):
        adapters.make_case(s, "gfx90a")


def test_device_case_generator_builds_a_valid_case():
    # The GPU benchmark builds cases with this on the device; on the CPU it must give a case the
    # reference accepts, with each sequence's pages distinct, and the baseline must agree.
    s = DecodeShape(batch=3, context=(70, 16, 33), num_q_heads=8, num_kv_heads=2, head_dim=64, scales="per-token")
    case = adapters._device_case(s, "fnuz", "cpu", 0, torch.float32)
    assert case.k_cache.shape == (5 + 1 + 3, 2, 16, 64) and case.k_scale.shape == (9, 2, 16)
    used = torch.cat([case.block_tables[0, :5], case.block_tables[1, :1], case.block_tables[2, :3]])
    assert sorted(used.tolist()) == list(range(9))
    torch.testing.assert_close(baseline_from_case(case), case.reference(), rtol=2e-5, atol=2e-6)


def test_stage_adapters_cover_every_stage_present():
    for name in adapters.stage_names():
        ad = adapters.get(name)
        case = ad.make_case(ad.default_shape(), "gfx942")
        inputs = ad.inputs(case)
        assert set(inputs) == {"query", "key_cache", "value_cache", "block_tables", "context_lengths",
                               "key_scale", "value_scale"}
        assert ad.tolerance.max_rel > 0
    with pytest.raises(ValueError, match="unknown stage"):
        adapters.get("s99")


def test_per_token_scale_rows_for_external_kernels():
    case = cache.make_case(2, 8, 2, 64, 16, [20, 33], scales="per-token")
    rows = bench._per_token_rows(case.k_scale, case)
    assert rows.shape == (2, case.num_blocks * 16)
    b, h, t = 1, 1, 5
    assert rows[h, b * 16 + t] == case.k_scale[b, h, t]
    flat = cache.make_case(1, 8, 2, 64, 16, 20)
    assert torch.equal(bench._per_token_rows(flat.k_scale, flat), flat.k_scale.expand(2, flat.num_blocks * 16))


# ---------------------------------------------------------------------------------------------
# trace report (condensing logic; the emulator run itself is exercised through the CLI)


def test_report_from_a_trace():
    from pa_tile.emu.memory import Trace

    tr = Trace("gfx942")
    addrs = torch.arange(64, dtype=torch.int64).numpy().astype("uint64")
    mask = [True] * 64
    for _ in range(2):
        tr.count("global_load_dwordx4")
        tr.global_access("global_load_dwordx4", 10, addrs * 16, mask, 16)  # 1 KiB contiguous: 8 lines
        tr.count("global_load_dword")
        tr.global_access("global_load_dword", 11, addrs * 64, mask, 4)  # two dwords per 128 B line: 32 lines
        tr.count("ds_read_b32")
        tr.lds_access("ds_read_b32", 12, (addrs * 128).astype("uint32"), mask, 4)  # every lane on bank 0
    tr.count("v_add_f32_e32")
    s = DecodeShape(batch=1, context=300, num_q_heads=8, num_kv_heads=2)
    rep = tracing.report_from_trace(tr, "synthetic", shape=s)
    wide, narrow = rep.vmem
    assert (wide["executions"], wide["bytes_per_exec"], wide["lines_128B_per_exec"], wide["efficiency"]) == (2, 1024, 8, 1.0)
    assert (narrow["lines_128B_per_exec"], narrow["min_lines_128B_per_exec"]) == (32, 2)
    assert narrow["efficiency"] == pytest.approx(2 / 32)
    (lds,) = rep.lds
    assert lds["max_degree"] > 1 and lds["conflict_cycles"] > 0
    assert rep.dynamic_instructions == 7 and rep.families["global"] == 4 and rep.families["valu"] == 1
    assert rep.tiles == 2 * 2  # 2 kv heads x ceil(300 / 256) tiles
    t = rep.totals()
    assert t["load_lines_128B"] == 2 * (8 + 32) and t["load_efficiency"] == pytest.approx(2 * 10 / 80)
    text = rep.format()
    assert "global_load_dword" in text and "conflict" in text and "per 256-token tile" in text
    json.dumps(rep.to_dict())


# ---------------------------------------------------------------------------------------------
# the harness on a machine without a GPU


@pytest.mark.skipif(gpu_available(), reason="a ROCm GPU is present: the harness is allowed to time here")
def test_harness_refuses_to_time_without_a_gpu(monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("the harness must refuse before preparing anything")

    monkeypatch.setattr(bench, "implementations", must_not_run)
    monkeypatch.setattr(adapters, "make_case", must_not_run)
    with pytest.raises(bench.GpuRequired, match="Nothing was timed"):
        bench.run(["s1"], [DecodeShape(batch=1, context=129)])
    with pytest.raises(bench.GpuRequired, match="ROCm GPU"):
        bench.time_call(lambda: None)
    with pytest.raises(bench.GpuRequired):
        bench.require_gpu()
    info = bench.machine_info()
    assert info["gpu_name"] is None and info["torch"] == torch.__version__ and info["pa_tile"]


def test_harness_refuses_the_emulator_even_with_a_gpu(monkeypatch):
    from pa_tile import backend

    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    monkeypatch.setattr(backend, "current_backend", lambda: "emu")
    with pytest.raises(bench.GpuRequired, match="emulator cannot be timed"):
        bench.require_gpu()


def test_settings_and_shape_sets():
    with pytest.raises(ValueError, match="iters"):
        bench.Settings(iters=0)
    assert len(bench.shape_set("quick")) == 9
    assert len(bench.shape_set("upstream")) == 84
    assert {s.scales for s in bench.shape_set("quick", scales="per-token")} == {"per-token"}
    with pytest.raises(ValueError, match="shape set"):
        bench.shape_set("huge")


def test_implementations_list_stages_baseline_and_guarded_externals():
    impls = bench.implementations()
    names = [i.name for i in impls]
    assert names[:len(adapters.stage_names())] == adapters.stage_names()
    assert "torch" in names
    for impl in impls:
        if impl.kind == "external":
            reason = impl.unavailable()  # never raises, whatever is (not) installed
            assert reason is None or isinstance(reason, str)
    assert [i.kind for i in bench.implementations([], baseline=False, external=False)] == []


@pytest.mark.skipif(gpu_available(), reason="runs the stages in the emulator; on a GPU machine the rocm tests time them")
def test_harness_logic_with_the_timer_stubbed(monkeypatch):
    """The bookkeeping of a run, on the CPU: the emulator stands in for the GPU and a stub for the
    timer (test-only; the harness itself refuses to time here, see above). Checks that every
    implementation is checked before it is timed, that a failed check is never timed, that an
    unsupported shape is recorded with the kernel's own reason, and that bandwidth = bytes / time."""
    from pa_tile import backend

    timed = []

    def fake_time_call(call, settings, *, out=None, verify=None):
        out.fill_(float("nan"))
        call()  # the timed launch must really write the output
        assert verify(out) is None
        timed.append(call)
        return bench.Timing(min_us=20.0, median_us=21.0, samples=3, method="graph", cache="cold")

    class WrongBaseline(bench.BaselineImpl):
        name = "wrong"

        def prepare(self, case, arch):
            prep = super().prepare(case, arch)
            inner = prep.call
            prep.call = lambda: (inner(), prep.out.mul_(1.5))
            return prep

    monkeypatch.setattr(bench, "require_gpu", lambda: None)
    monkeypatch.setattr(bench, "time_call", fake_time_call)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.torch.cuda, "current_stream", lambda: None)  # FlyDSL: default queue
    monkeypatch.setattr(backend, "default_arch", lambda: "gfx942")
    real_make_case = adapters.make_case
    monkeypatch.setattr(adapters, "make_case", lambda s, a, seed=0, device=None: real_make_case(s, a, seed=seed))
    monkeypatch.setattr(bench, "implementations",
                        lambda stages, baseline, external: [bench.StageImpl(n) for n in stages]
                        + [bench.BaselineImpl(), WrongBaseline()])
    ok_shape = DecodeShape(batch=2, context=(300, 129), num_q_heads=8, num_kv_heads=1, head_dim=128)
    # head_dim 96: no stage supports it (s4-s6 do take 64), the baseline does
    bad_shape = DecodeShape(batch=1, context=64, num_q_heads=8, num_kv_heads=1, head_dim=96)
    stages = adapters.stage_names()
    data = bench.run(stages, [ok_shape, bad_shape], peak=roofline.GPUS["MI300X"], progress=None)
    recs = {(r["impl"], r["shape"]["head_dim"]): r for r in data["results"]}
    for name in stages + ["torch"]:
        r = recs[name, 128]
        assert r["status"] == "ok", r["reason"]
        assert r["check"]["ok"] and r["time_us"] == 20.0
        assert r["bytes"] == roofline.traffic(ok_shape).total
        assert r["bandwidth_tb_s"] == pytest.approx(r["bytes"] / 20e-6 / 1e12)
        assert r["pct_hbm_peak"] == pytest.approx(100 * r["bytes"] / 20e-6 / 5.3e12)
    for name in stages:
        r = recs[name, 96]
        assert r["status"] == "unsupported" and "query" in r["reason"] and r["time_us"] is None
    assert recs["torch", 96]["status"] == "ok"
    wrong = recs["wrong", 128]
    assert wrong["status"] == "check_failed" and wrong["time_us"] is None and not wrong["check"]["ok"]
    assert len(timed) == len(stages) + 2  # stages and torch at head_dim 128, torch at 96; never "wrong"
    json.dumps(data)


def _synthetic_results():
    # Test data for the reader and the plots only: clearly not a measurement.
    s1, s2 = DecodeShape(batch=1, context=2048), DecodeShape(batch=1, context=16384)
    peak = dict(roofline.GPUS["MI300X"].to_dict(), note="synthetic")
    rows = []
    for s, t in ((s1, 10.0), (s2, 40.0)):
        b = roofline.traffic(s).total
        rows.append(dict(impl="torch", kind="baseline", shape=s.to_dict(), label=s.label, status="ok", reason=None,
                         time_us=t, median_us=t, floor_us=roofline.time_floor(s).time_us, bytes=b,
                         bandwidth_tb_s=b / (t * 1e-6) / 1e12, pct_hbm_peak=100 * b / (t * 1e-6) / 5.3e12))
    rows.append(dict(impl="s1", kind="stage", shape=s1.to_dict(), label=s1.label, status="check_failed",
                     reason="FAIL: error above tolerance", time_us=None, floor_us=None, bandwidth_tb_s=None,
                     pct_hbm_peak=None))
    return dict(schema=bench.SCHEMA, machine=dict(gpu_name="synthetic", torch="x", torch_hip="y", flydsl="z"),
                arch="gfx942", peak=peak, settings=dict(iters=5, cold_cache=True), results=rows)


def test_results_file_table_and_plots(tmp_path):
    path = bench.write_results(_synthetic_results(), tmp_path / "r.json")
    data = bench.load_results(path)
    rows = bench.results_table(data)
    assert [r["status"] for r in rows] == ["ok", "ok", "check_failed"]
    assert rows[2]["time_us"] is None and "tolerance" in rows[2]["reason"]
    text = bench.format_results(path)
    assert "synthetic" in text and "check_failed" in text
    fig = bench.plot_bandwidth(path)
    (line, peak_line) = fig.axes[0].lines  # one ok series + the HBM peak; the failed row is not drawn
    assert list(line.get_xdata()) == [2048, 16384]
    assert peak_line.get_ydata()[0] == pytest.approx(5.3)
    fig = bench.plot_time(data)
    assert len(fig.axes[0].lines) == 2  # measured + floor
    with pytest.raises(ValueError, match="not a pa_tile benchmark"):
        bench.load_results(dict(schema="other", results=[]))


# ---------------------------------------------------------------------------------------------
# on a ROCm GPU: real timings (each in a fresh process, so no emulator hook installed by other
# tests can be in the way)


def _bench_in_subprocess(tmp_path, args):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pa_tile", "bench", "--out", str(out), "--warmup", "2", "--iters", "5",
           "--no-external"] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return bench.load_results(out)


@pytest.mark.rocm
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
def test_gpu_baseline_is_checked_then_timed(tmp_path):
    data = _bench_in_subprocess(tmp_path, ["--stages", "", "--batch", "4", "--context", "1024"])
    (rec,) = [r for r in data["results"] if r["impl"] == "torch"]
    assert rec["status"] == "ok", rec
    assert rec["check"]["ok"] and rec["timing"]["method"] in ("graph", "eager")
    assert 0 < rec["time_us"] <= rec["median_us"]
    assert rec["bandwidth_tb_s"] == pytest.approx(rec["bytes"] / (rec["time_us"] * 1e-6) / 1e12)
    assert data["machine"]["gpu_name"] and data["arch"] in ("gfx942", "gfx950")


@pytest.mark.rocm
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
@pytest.mark.parametrize("stage", adapters.stage_names())
def test_gpu_stage_is_checked_then_timed_with_graph_replay(tmp_path, stage):
    data = _bench_in_subprocess(tmp_path, ["--stages", stage, "--no-baseline", "--batch", "8",
                                           "--context", "129,4096"])
    recs = [r for r in data["results"] if r["impl"] == stage]
    assert len(recs) == 2
    for rec in recs:
        assert rec["status"] == "ok", rec
        assert rec["timing"]["method"] == "graph", rec["timing"]
        assert rec["time_us"] >= rec["floor_us"] * 0.5  # cannot beat HBM by 2x: catches a broken timer


def test_stage_tolerance_fails_a_kernel_that_reads_one_wrong_page():
    from pa_tile.reference import paged_attention_reference

    case = cache.make_case(1, 8, 1, 128, 16, [2000], seed=1)
    bt = case.block_tables.clone()
    bt[0, 3] = bt[0, 4]  # page 3 read from page 4's slot
    wrong = paged_attention_reference(case.query, case.k_cache, case.v_cache, bt, case.context_lengths,
                                      case.k_scale, case.v_scale)
    assert not checks.compare(wrong, case.reference(), adapters.STAGE_TOLERANCE).ok
    assert not checks.compare(case.reference() * 1.1, case.reference(), adapters.STAGE_TOLERANCE).ok


def _attention_from(q, k_logical, v_logical, ks, vs, case):
    """The reference on rebuilt logical caches: what a correct external kernel would return."""
    from pa_tile.reference import paged_attention_reference

    return paged_attention_reference(q, k_logical, v_logical, case.block_tables, case.context_lengths, ks, vs)


def test_external_kernel_plumbing_with_stand_in_modules(monkeypatch):
    # aiter and vLLM are not installed here. Stand-ins with their public signatures check what the
    # harness hands them (layouts, scale shapes, argument names) and answer with the reference on
    # the caches rebuilt from those layouts, so a wrong layout or scale shows up as a failed check.
    import types

    case = cache.make_case(2, 8, 2, 128, 16, [40, 17])
    nb, kvh, bs, d = case.num_blocks, case.num_kv_heads, case.block_size, case.head_dim
    seen = {}

    def pa_fwd_asm(Q, K, V, block_tables, context_lens, max_num_blocks, K_QScale=None, V_QScale=None, out_=None,
                   high_precision=1):
        assert K.shape == (nb, kvh, d // 16, bs, 16) and V.shape == (nb, kvh, bs // 16, d, 16)
        assert K_QScale.shape == V_QScale.shape == (kvh, nb * bs) and max_num_blocks == block_tables.shape[1]
        ks = K_QScale.reshape(kvh, nb, bs).permute(1, 0, 2).contiguous()
        vs = V_QScale.reshape(kvh, nb, bs).permute(1, 0, 2).contiguous()
        out_.copy_(_attention_from(Q, cache.from_k_blocked(K), cache.from_v_trans_blocked(V), ks, vs, case))
        seen["aiter"] = True
        return out_

    def paged_attention_rocm(out: torch.Tensor, exp_sum: torch.Tensor, max_logits: torch.Tensor,
                             tmp_out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, num_kv_heads: int, scale: float, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc, block_size: int, max_seq_len: int,
                             alibi_slopes, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
                             fp8_out_scale=None, mfma_type: str = "fp8"):
        assert key_cache.dtype == value_cache.dtype == torch.uint8 and kv_cache_dtype == "fp8"
        assert isinstance(k_scale, torch.Tensor) and num_kv_heads == kvh and block_size == bs and max_seq_len == 40
        assert exp_sum.shape[-1] * 256 >= max_seq_len and tmp_out.shape[-1] == d
        assert scale == pytest.approx(d ** -0.5)
        k = cache.from_k_blocked(key_cache.view(case.k_cache.dtype))
        v = cache.from_v_plain(value_cache.view(case.v_cache.dtype))
        out.copy_(_attention_from(query, k, v, k_scale, v_scale, case))
        seen["vllm"] = True

    vllm = types.ModuleType("vllm")
    vllm._custom_ops = types.SimpleNamespace(paged_attention_rocm=paged_attention_rocm)
    monkeypatch.setitem(sys.modules, "aiter", types.SimpleNamespace(pa_fwd_asm=pa_fwd_asm))
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    ref = case.reference()
    for impl in (bench.AiterAsmImpl(), bench.VllmRocmImpl()):
        assert impl.unavailable() is None
        prep = impl.prepare(case, "gfx942")
        prep.call()
        res = checks.compare(prep.out, ref, prep.tolerance)
        assert res.ok, (impl.name, res)
    assert seen == {"aiter": True, "vllm": True}
    mtp = cache.make_case(1, 8, 2, 128, 16, [40], query_length=2)
    for impl in (bench.AiterAsmImpl(), bench.VllmRocmImpl()):
        with pytest.raises(ValueError, match="query_length"):
            impl.prepare(mtp, "gfx942")
