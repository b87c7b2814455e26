"""Issue 13: what a kernel engineer using pa_tile.emu as a sanitizer for their own FlyDSL
kernels needs beyond pa_tile's own launchers.

* ``flyc.compile`` / ``CompiledFunction`` launchers with CPU tensors run, first call included,
  and repeated launches of one kernel parse nothing again;
* ``launch_options(execute=False)``: the launch boundary without device work (host cost);
* ``launch_options(regions=[...])`` for kernels taking raw pointers;
* per-view bounds by default (K and V as views into one cache allocation);
* scratch: pa_tile's own spilling configurations run and match the reference;
* schedules: a pa_tile kernel under run-to-barrier and ``quantum=1``.
"""

import re

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.compiler.jit_argument import from_c_void_p

from pa_tile import backend, cache
from pa_tile.emu import asm as emu_asm
from pa_tile.emu import launch as L
from pa_tile.emu import machine
from pa_tile.emu.memory import MemoryFault
from pa_tile.tiny_kernels import scale_add

FMT = {"gfx942": "fnuz", "gfx950": "ocp"}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    # Installing the hook cannot be undone in-process (FlyDSL's backend and runtime library are
    # swapped), so an emulator-tier module only ever installs it where the emulator is the
    # backend anyway: on a ROCm machine these tests skip instead of hijacking later GPU tests.
    if backend.ensure_backend() != "emu":
        pytest.skip("emulator-tier test; this process runs on a GPU backend")


# ------------------------------------------------------------------ item 3: CompiledFunction


class CachedLauncher:
    """The common FlyDSL pattern: compile on the first call (which also launches, given live
    tensors) and call the cached CompiledFunction afterwards."""

    def __init__(self, jit_fn):
        self.jit_fn, self.compiled, self.compiles = jit_fn, {}, 0

    def __call__(self, *args):
        key = (tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)), L.current_arch())
        fn = self.compiled.get(key)
        if fn is None:
            self.compiles += 1
            self.compiled[key] = flyc.compile(self.jit_fn, *args)
        else:
            fn(*args, fx.Stream(None))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_a_launcher_caching_compiled_functions_runs_on_every_call(arch, monkeypatch):
    monkeypatch.setenv("ARCH", arch)
    launch = CachedLauncher(scale_add)
    for i in range(3):
        torch.manual_seed(i)
        x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
        with L.record_launches() as log:
            launch(x, y, out, 1.0 + i)
        assert torch.allclose(out, (1.0 + i) * x + y, rtol=0, atol=1e-6), f"call {i}"
        assert [r.arch for r in log] == [arch]
        # sanitized like a jit call, regions named after the launcher's parameters
        assert {(x.data_ptr(), "X"), (y.data_ptr(), "Y"), (out.data_ptr(), "Out")} <= {
            (r[0], r[2]) for r in log[0].regions}
    assert launch.compiles == 1


def test_repeated_compiled_launches_parse_nothing_again(monkeypatch):
    launch = CachedLauncher(scale_add)
    x, y, out = torch.randn(8, 64), torch.randn(8, 64), torch.zeros(8, 64)
    launch(x, y, out, 2.0)
    parses, asm_parses = L._code_objects.parses, []
    real = emu_asm.parse
    monkeypatch.setattr(emu_asm, "parse", lambda text: asm_parses.append(1) or real(text))
    for _ in range(3):
        out.zero_()
        launch(x, y, out, 2.0)
        assert torch.allclose(out, 2.0 * x + y, rtol=0, atol=1e-6)
    assert L._code_objects.parses == parses and not asm_parses


def test_execute_false_builds_the_launch_but_runs_nothing(monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("execute=False ran the kernel")

    monkeypatch.setattr(machine, "run_kernel", must_not_run)
    launch = CachedLauncher(scale_add)
    x, y, out = torch.randn(8, 64), torch.randn(8, 64), torch.zeros(8, 64)
    with L.record_launches() as log, L.launch_options(execute=False):
        launch(x, y, out, 2.0)
        launch(x, y, out, 2.0)
    assert len(log) == 2 and all(not r.execute for r in log)
    assert len(log[1].kernarg) == log[1].meta.kernarg_segment_size
    assert (out == 0).all()
    with pytest.raises(ValueError, match="execute"):
        with L.launch_options(execute="no"):
            pass


# ------------------------------------------------------------------ item 4: extra regions


@flyc.kernel
def raw_pointer_kernel(P: fx.Pointer, Out: fx.Tensor):
    tid = fx.thread_idx.x
    Out[tid] = fx.generic_load(P, dtype=fx.Float32) + fx.Float32(1.0)


@flyc.jit
def raw_pointer(P: fx.Pointer, Out: fx.Tensor):
    raw_pointer_kernel(P, Out).launch(grid=(1, 1, 1), block=(64, 1, 1))


def test_regions_option_sanitizes_raw_pointer_kernels():
    src, out = torch.full((4,), 5.0), torch.zeros(64)
    ptr = from_c_void_p(fx.Float32, src.data_ptr())
    with pytest.raises(MemoryFault, match="outside every allowed region"):
        raw_pointer(ptr, out)  # nothing tells the sanitizer where P points
    with L.launch_options(regions=[src]):
        raw_pointer(ptr, out)
    assert (out == 6.0).all()
    out.zero_()
    with L.record_launches() as log, L.launch_options(regions=[(src.data_ptr(), 16, "src")]):
        raw_pointer(ptr, out)
    assert (out == 6.0).all() and (src.data_ptr(), 16, "src") in log[0].regions
    # A region too short for the access: the fault names it as the nearest region.
    with pytest.raises(MemoryFault, match="nearest region 'src-head'.*runs 2 B past its end"):
        with L.launch_options(regions=[(src.data_ptr(), 2, "src-head")]):
            raw_pointer(ptr, out)
    for bad in ([(0, 4, "null")], [3.5]):
        with pytest.raises((ValueError, TypeError)):
            with L.launch_options(regions=bad):
                pass


# ------------------------------------------------------------------ item 6: per-view bounds

PAGE = 16


@flyc.kernel
def gather_pages_kernel(K: fx.Tensor, V: fx.Tensor, Pages: fx.Tensor, Out: fx.Tensor):
    # Like a paged-attention load: element tid of the page Pages[tid // 16], from K and from V,
    # through buffer descriptors as pa_tile's own kernels do.
    tid = fx.thread_idx.x
    Kb, Vb = fx.rocdl.make_buffer_tensor(K), fx.rocdl.make_buffer_tensor(V)
    i = Pages[tid // PAGE] * PAGE + tid % PAGE
    Out[tid] = Kb[i] + Vb[i]


@flyc.jit
def gather_pages(K: fx.Tensor, V: fx.Tensor, Pages: fx.Tensor, Out: fx.Tensor):
    gather_pages_kernel(K, V, Pages, Out).launch(grid=(1, 1, 1), block=(64, 1, 1))


@flyc.kernel
def gather_k_kernel(K: fx.Tensor, Pages: fx.Tensor, Out: fx.Tensor):
    tid = fx.thread_idx.x
    Out[tid] = K[Pages[tid // PAGE] * PAGE + tid % PAGE]


@flyc.jit
def gather_k(K: fx.Tensor, Pages: fx.Tensor, Out: fx.Tensor):
    gather_k_kernel(K, Pages, Out).launch(grid=(1, 1, 1), block=(64, 1, 1))


def _layered_cache(layers=3, pages=4):
    # [layer, K/V, page * 16]: one allocation for every layer, as serving engines keep it
    return torch.arange(layers * 2 * pages * PAGE, dtype=torch.float32).reshape(layers, 2, pages * PAGE)


def test_k_and_v_views_of_one_cache_fault_on_an_out_of_range_page():
    kv = _layered_cache()
    k, v = kv[1, 0], kv[1, 1]
    pages, out = torch.tensor([3, 0, 2, 1], dtype=torch.int32), torch.zeros(64)
    gather_pages(k, v, pages, out)
    idx = (pages.long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    assert torch.equal(out, k[idx] + v[idx])
    pages[2] = 4  # one past the last page: K's read lands in V's view, V's in layer 2's K
    with pytest.raises(MemoryFault, match=r"leaves the region .* 'K' .*\(into region 'V'\)"):
        gather_pages(k, v, pages, out)
    with L.launch_options(bounds="storage"):  # the opt-out: whole storages, no fault
        gather_pages(k, v, pages, out)


def test_a_view_into_a_larger_allocation_allows_only_its_own_bytes():
    kv = _layered_cache()
    k, pages, out = kv[1, 0], torch.tensor([0, 1, 2, 4], dtype=torch.int32), torch.zeros(64)
    with L.record_launches() as log, pytest.raises(MemoryFault, match="'K'"):
        gather_k(k, pages, out)  # page 4 of K is V's page 0 of the same layer
    assert (k.data_ptr(), k.numel() * 4, "K") in log[0].regions
    with L.launch_options(bounds="storage"):
        gather_k(k, pages, out)
    assert torch.equal(out[48:], kv[1, 1, :PAGE])


# ------------------------------------------------------------------ item 5: scratch


def _spill_case(arch, head_dim):
    return cache.make_case(
        num_seqs=1, num_q_heads=32, num_kv_heads=1, head_dim=head_dim, block_size=16, context_lengths=[40],
        query_length=4, fp8_format=FMT[arch], scales="per-tensor", query_dtype=torch.float16, seed=3,
        pad_block_id=-1)


# 8 M-tiles at head_dim 256 in chapter 5's register-resident loop need 512+ registers (their
# output fragments alone are 512) and spill ~1 KB per lane. The kernel splits P·V by head_dim by
# default (and then does not spill), so the test builds the register-resident loop for 8.
@pytest.mark.parametrize("arch, head_dim, m_tiles", [
    pytest.param("gfx942", 256, 8, marks=pytest.mark.slow),  # a few seconds of CPU each, more on a busy machine
    pytest.param("gfx950", 256, 8, marks=pytest.mark.slow),
])
def test_spilling_stage5_configurations_run_and_match_the_reference(arch, head_dim, m_tiles, monkeypatch, request):
    from pa_tile.stages import s5_phase_split_mtp as s5

    monkeypatch.setattr(s5, "WIDE_ABOVE", 8)
    s5.build_launcher.cache_clear()  # no launcher built with the default split is reused here,
    request.addfinalizer(s5.build_launcher.cache_clear)  # nor one of these after the test
    case = _spill_case(arch, head_dim)
    args = (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)
    with L.record_launches() as log:
        out = s5.paged_decode(*args, m_tiles=m_tiles, arch=arch)
    assert re.search(r"^\s*scratch_store_dword", log[0].asm, re.M)  # it really spills
    assert log[0].meta.private_segment_fixed_size > 0
    case.assert_matches(out)


# ------------------------------------------------------------------ item 7: schedules


def test_a_pa_tile_kernel_gives_the_same_answer_under_both_schedules():
    # Stage 5's phase split hands rows between waves through LDS with barriers: a schedule that
    # interleaves waves instruction by instruction must not change a bit of the result (and the
    # race detector, on in both, must find nothing).
    from pa_tile.stages import s5_phase_split_mtp as s5

    case = cache.make_case(num_seqs=1, num_q_heads=8, num_kv_heads=1, head_dim=64, block_size=16,
                           context_lengths=[20], query_length=4, fp8_format="fnuz", scales="per-tensor",
                           query_dtype=torch.float16, seed=5, pad_block_id=-1)
    args = (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)
    runs = []
    for quantum in (None, 1):
        with L.record_launches() as log, L.launch_options(quantum=quantum):
            runs.append(s5.paged_decode(*args, m_tiles=2, arch="gfx942").clone())
        assert log[0].quantum == quantum and log[0].lds_races == "raise"
    assert torch.equal(runs[0], runs[1])
    case.assert_matches(runs[0])


def test_stage5_with_k_and_v_carved_from_one_multi_layer_cache_runs_under_per_view_bounds():
    # The legitimate side of per-view bounds: pa_tile's own kernel, given K and V as views into
    # one allocation holding three layers, stays inside its views (and matches the reference).
    from pa_tile.stages import s5_phase_split_mtp as s5

    case = cache.make_case(num_seqs=1, num_q_heads=8, num_kv_heads=1, head_dim=64, block_size=16,
                           context_lengths=[40], query_length=2, fp8_format="fnuz", scales="per-tensor",
                           query_dtype=torch.float16, seed=7, pad_block_id=-1)
    k, v = case.k_blocked(), case.v_trans_blocked()
    layers = torch.zeros(3, 2, k.numel() * k.element_size(), dtype=torch.uint8)
    layers[1, 0] = k.contiguous().view(torch.uint8).reshape(-1)
    layers[1, 1] = v.contiguous().view(torch.uint8).reshape(-1)
    k_view = layers[1, 0].view(k.dtype).view(k.shape)
    v_view = layers[1, 1].view(v.dtype).view(v.shape)
    with L.record_launches() as log:
        out = s5.paged_decode(case.query, k_view, v_view, case.block_tables, case.context_lengths, case.k_scale,
                              case.v_scale, arch="gfx942")
    spans = {r[2]: r[:2] for r in log[0].regions}
    assert any(r == (k_view.data_ptr(), k.numel() * k.element_size()) for r in spans.values())
    case.assert_matches(out)
