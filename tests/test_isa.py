"""pa_tile.isa: static facts read from real gfx942/gfx950 assembly and from hand-written snippets.

Expected numbers come from the assembly text itself (counted here with plain line matching,
independently of the module) or from the upstream reference table, never from isa.py.
"""

import json
import re

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu

from pa_tile import isa, toolchain, upstream

ARCHS = ("gfx942", "gfx950")
LDS_THREADS = 256


# --- two tiny kernels, compiled inside the tests -------------------------------------------------


@flyc.kernel
def _vadd_kernel(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, tiled_copy: fx.TiledCopy):
    tid = fx.thread_idx.x
    bm, bn = fx.block_idx.x, fx.block_idx.y
    tile = tiled_copy.tile_mn
    thr = tiled_copy.get_slice(tid)
    ga = thr.partition_S(fx.flat_divide(A, tile)[None, None, bm, bn])
    gb = thr.partition_S(fx.flat_divide(B, tile)[None, None, bm, bn])
    gc = thr.partition_D(fx.flat_divide(C, tile)[None, None, bm, bn])
    ra, rb, rc = fx.make_fragment_like(ga), fx.make_fragment_like(gb), fx.make_fragment_like(gc)
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    fx.copy(atom, ga, ra)
    fx.copy(atom, gb, rb)
    rc.store(ra.load() + rb.load())
    fx.copy(atom, rc, gc)


@flyc.jit
def _vadd(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    tiled = fx.make_tiled_copy_tv(
        atom, fx.make_ordered_layout((8, 16), order=(1, 0)), fx.make_ordered_layout((1, 4), order=(0, 1))
    )
    tm, tn = tiled.tile_mn.unpack()
    M, N = A.shape.unpack()
    _vadd_kernel(A, B, C, tiled).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1), stream=stream)


@fx.struct
class _Smem:
    buf: fx.Array[fx.Float32, LDS_THREADS, 16]


@flyc.kernel(known_block_size=(LDS_THREADS, 1, 1))
def _rot_sum_kernel(A: fx.Tensor, B: fx.Tensor, n_iter: fx.Int32):
    """Stage A's tile in LDS, then n_iter times: barrier, read a rotated neighbour, accumulate."""
    tid = fx.Int32(gpu.thread_id("x"))
    base = fx.Int32(gpu.block_id("x")) * LDS_THREADS
    p = fx.SharedAllocator().allocate(_Smem).peek().buf.ptr
    fx.ptr_store(
        fx.Vector.from_elements([fx.Float32(A[base + tid])], dtype=fx.Float32), fx.add_offset(p, fx.make_int_tuple(tid))
    )
    for i, st in range(0, n_iter, 1, init=[fx.Float32(0.0)]):
        gpu.barrier()
        j = (tid + fx.Int32(i)) % LDS_THREADS
        v = fx.ptr_load(fx.add_offset(p, fx.make_int_tuple(j)), result_type=fx.Vector.make_type(1, fx.Float32))
        results = yield [st[0] + fx.Vector(v)[0]]
    B[base + tid] = results


@flyc.jit
def _rot_sum(A: fx.Tensor, B: fx.Tensor, n_iter: fx.Int32, stream: fx.Stream = fx.Stream(None)):
    _rot_sum_kernel(A, B, n_iter).launch(grid=(4, 1, 1), block=(LDS_THREADS, 1, 1), stream=stream)


@pytest.fixture(scope="module")
def asm():
    out = {}
    for arch in ARCHS:
        out["vadd", arch] = toolchain.compile_isa(_vadd, torch.zeros(16, 128), torch.zeros(16, 128),
                                                  torch.zeros(16, 128), arch=arch)
        out["lds", arch] = toolchain.compile_isa(_rot_sum, torch.zeros(1024), torch.zeros(1024), 5, arch=arch)
    return out


# --- independent readers of the text ------------------------------------------------------------


def _body_lines(text, kernel):
    """Instruction lines (first token) from the kernel label to .Lfunc_end, padding excluded."""
    lines = text.splitlines()
    start = lines.index(f"{kernel}:")
    body = []
    for ln in lines[start + 1:]:
        if ln.startswith(".Lfunc_end"):
            break
        s = ln.strip()
        if not s or s.endswith(":") or s.startswith((".", ";")):
            continue
        body.append(s.split()[0])
    while body and body[-1] == "s_nop":
        body.pop()
    return body


def _meta(text, key):
    return int(re.search(rf"^[\s-]+\.{key}:\s+(\d+)$", text, re.M).group(1))


def _kernel_name(text):
    return re.search(r"^\s+\.name:\s+(\S+)$", text, re.M).group(1)


# --- compiled kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_vector_add_facts_match_the_text(asm, arch):
    text = asm["vadd", arch]
    s = isa.IsaStats.from_asm(text)
    body = _body_lines(text, s.kernel)
    assert s.kernel == _kernel_name(text) and s.kernel.startswith("_vadd_kernel")
    assert s.arch == arch
    assert s.n_instructions == len(body) and body[-1] == "s_endpgm"
    assert sum(s.families.values()) == s.n_instructions
    assert s.count("global_load_dwordx4") == body.count("global_load_dwordx4") == 2  # A and B, 128 bits each
    assert s.count("global_store_dwordx4") == 1
    assert s.load_widths == {"global": {"dwordx4": 2}}
    assert s.store_widths == {"global": {"dwordx4": 1}}
    assert s.families["global"] == 3 and s.families["ds"] == 0 and s.families["mfma"] == 0
    assert s.families["smem"] == sum(1 for m in body if m.startswith("s_load_"))
    assert s.families["waitcnt"] == body.count("s_waitcnt")
    assert s.mnemonics == {m: body.count(m) for m in set(body)}
    # metadata
    assert s.vgpr_unified == _meta(text, "vgpr_count") and s.agpr == _meta(text, "agpr_count") == 0
    assert s.vgpr == s.vgpr_unified == s.vgpr_unified_computed
    assert s.sgpr == _meta(text, "sgpr_count")
    assert (s.lds_bytes, s.scratch_bytes, s.vgpr_spill, s.sgpr_spill) == (0, 0, 0, 0)
    assert s.wavefront_size == 64 and s.workgroup_size == 128 and s.max_flat_workgroup_size == 128
    assert s.loops == [] and s.main_loop is None and s.main_loop_instructions == 0
    occ = isa.occupancy(s)
    assert occ.arch == arch and occ.waves_per_workgroup == 2
    assert occ.waves_per_simd == 8 and occ.workgroups_per_cu == 16  # few registers: the 8-wave cap


@pytest.mark.parametrize("arch", ARCHS)
def test_lds_barrier_loop_kernel(asm, arch):
    text = asm["lds", arch]
    s = isa.IsaStats.from_asm(text)
    body = _body_lines(text, s.kernel)
    assert s.arch == arch and s.n_instructions == len(body)
    assert s.lds_bytes == _meta(text, "group_segment_fixed_size") == LDS_THREADS * 4
    assert s.reqd_workgroup_size == (LDS_THREADS, 1, 1) and s.workgroup_size == LDS_THREADS
    assert s.count("s_barrier") == s.families["barrier"] == body.count("s_barrier") > 0
    assert s.families["ds"] == sum(1 for m in body if m.startswith("ds_"))
    assert s.load_widths["global"] == {"dword": 1} and s.store_widths["global"] == {"dword": 1}
    assert s.load_widths["ds"]["b32"] == body.count("ds_read_b32") and s.store_widths["ds"] == {"b32": 1}

    # the runtime loop: barrier + LDS read inside, the global load/store outside
    lp = s.main_loop
    assert lp is not None and lp.innermost and lp.depth == 1
    assert lp.families["barrier"] >= 1 and lp.families["ds"] >= 1 and lp.families["global"] == 0
    assert s.main_loop_instructions == lp.n_instructions == max(x.n_instructions for x in s.loops)
    lines = text.splitlines()
    assert lines[lp.start_line - 2] == f"{lp.header}:"  # the header label sits right above the body
    span = [ln.strip() for ln in lines[lp.start_line - 1:lp.end_line]]
    assert lp.n_instructions == sum(1 for t in span if t and not t.endswith(":") and not t.startswith("."))
    closing = lines[lp.end_line - 1].split()
    assert closing[0].startswith(("s_cbranch", "s_branch")) and closing[1] == lp.header
    # every loop the text closes with a backward branch was found
    headers = {ln[:-1] for ln in lines if re.fullmatch(r"\.LBB\d+_\d+:", ln)}
    backward = set()
    seen = set()
    for ln in lines:
        if ln[:-1] in headers:
            seen.add(ln[:-1])
        parts = ln.split()
        if parts and parts[0].startswith(("s_cbranch", "s_branch")) and parts[1] in seen:
            backward.add(parts[1])
    assert {x.header for x in s.loops} == backward

    occ = isa.occupancy(s)
    assert occ.waves_per_workgroup == 4 and occ.waves_per_simd == occ.workgroups_per_cu


def test_diff_of_compiled_kernels_shows_deltas(asm):
    a = isa.IsaStats.from_asm(asm["vadd", "gfx942"])
    b = isa.IsaStats.from_asm(asm["lds", "gfx942"])
    out = isa.diff(a, b, labels=("vadd", "rot_sum"))
    lines = out.splitlines()
    assert lines[0].split() == ["metric", "vadd", "rot_sum", "delta"]
    lds = next(ln for ln in lines if ln.startswith("LDS bytes"))
    assert lds.split()[-3:] == ["0", str(LDS_THREADS * 4), f"+{LDS_THREADS * 4}"]
    n = next(ln for ln in lines if ln.startswith("instructions"))
    assert n.split()[-1] == f"{b.n_instructions - a.n_instructions:+d}"
    bar = next(ln for ln in lines if ln.strip().startswith("s_barrier"))
    assert bar.split()[-1] == f"+{b.count('s_barrier')}"
    x4 = next(ln for ln in lines if ln.strip().startswith("global load dwordx4 "))
    assert x4.split()[-1] == "-2"
    rows = isa.diff_rows(a, b)
    assert ("budget", "LDS bytes", 0, LDS_THREADS * 4, f"+{LDS_THREADS * 4}") in rows
    assert all(r[0] != "mnemonic" for r in isa.diff_rows(a, b, mnemonics=False))


def test_compact_diff_keeps_changes_and_headline_rows(asm):
    a = isa.IsaStats.from_asm(asm["vadd", "gfx942"])
    b = isa.IsaStats.from_asm(asm["lds", "gfx942"])
    full = isa.diff(a, b, labels=("vadd", "rot_sum"))
    compact = isa.diff(a, b, labels=("vadd", "rot_sum"), compact=True)
    rows = {(sec, k): d for sec, k, _, _, d in isa.diff_rows(a, b)}
    names = [ln.strip().split("  ")[0] for ln in compact.splitlines()[2:] if not ln.endswith(":")]
    same_vgpr = a.vgpr == a.vgpr_unified and b.vgpr == b.vgpr_unified  # then "vgpr" repeats "vgpr unified"
    changed = [k for (sec, k), d in rows.items() if d != "0" and not (k == "vgpr" and same_vgpr)]
    assert set(names) == set(changed) | set(isa.HEADLINE) and len(names) == len(set(names))
    assert "agpr" not in names and ("vgpr" in names) == (not same_vgpr and "vgpr" in changed)
    # the rows it keeps read as in the full table
    for ln in compact.splitlines()[2:]:
        if not ln.endswith(":"):
            assert ln in full.splitlines()
    assert compact.splitlines()[:2] == full.splitlines()[:2] and len(compact.splitlines()) < len(full.splitlines())
    assert "0       0" not in compact  # a family row that changed nowhere is gone
    # a kernel against itself: only the headline rows, all 0
    same = isa.diff(a, a, compact=True, mnemonics=False).splitlines()[2:]
    assert [ln.split()[-1] for ln in same] == ["0"] * len(isa.HEADLINE)
    assert [ln.rsplit(None, 3)[0] for ln in same] == list(isa.HEADLINE)


def test_diff_side_by_side_has_one_column_group_per_pair(asm):
    pairs = {arch: (isa.IsaStats.from_asm(asm["vadd", arch]), isa.IsaStats.from_asm(asm["lds", arch]))
             for arch in ARCHS}
    text = isa.diff_side_by_side(pairs, labels=("vadd", "rot_sum"))
    lines = text.splitlines()
    assert lines[0].split() == list(ARCHS)
    assert lines[1].split() == ["metric"] + ["vadd", "rot_sum", "delta"] * 2 and set(lines[2]) == {"-"}
    for arch in ARCHS:  # the arch's name sits over its three columns
        col = lines[0].index(arch)
        assert lines[1].index("vadd", col - 8 if arch != ARCHS[0] else 0) - col < 8
    singles = {arch: isa.diff(*pairs[arch], labels=("vadd", "rot_sum"), mnemonics=False) for arch in ARCHS}
    for ln in lines[3:]:
        if ln.endswith(":"):
            continue
        parts = ln.split()
        metric, cells = " ".join(parts[:-6]), parts[-6:]
        for j, arch in enumerate(ARCHS):
            row = next((x for x in singles[arch].splitlines()[2:] if x.strip().startswith(metric + " ")), None)
            if row is None:  # a width only the other arch has: 0 on both sides here
                assert cells[3 * j:3 * j + 3] == ["0", "0", "0"]
            else:
                assert row.split()[-3:] == cells[3 * j:3 * j + 3], (arch, metric)
    assert any(ln.startswith("LDS bytes") for ln in lines) and not any(ln.startswith("agpr") for ln in lines)
    one = isa.diff_side_by_side({"gfx942": pairs["gfx942"]}, labels=("vadd", "rot_sum"), compact=False)
    assert one.splitlines()[1:] == isa.diff(*pairs["gfx942"], labels=("vadd", "rot_sum"), mnemonics=False).splitlines()
    with pytest.raises(ValueError, match="no pair"):
        isa.diff_side_by_side({})


@pytest.mark.parametrize("arch", ARCHS)
def test_loop_phases_split_at_the_main_loop(asm, arch):
    text = asm["lds", arch]
    s = isa.IsaStats.from_asm(text)
    lp = s.main_loop
    phases = isa.loop_phases(s)
    assert phases == isa.loop_phases(text)
    (p, p0, p1), (l, l0, l1), (e, e0, e1) = phases
    assert (p, l, e) == ("prologue", "loop", "epilogue")
    assert p0 == 1 and p1 + 1 == l0 == lp.start_line and l1 == lp.end_line == e0 - 1 and e1 >= len(text.splitlines())
    # the loop's lines are exactly those of its instructions' span (header label excluded)
    lines = text.splitlines()
    assert lines[l0 - 2] == f"{lp.header}:" and lines[l1 - 1].split()[1] == lp.header
    assert isa.loop_phases(isa.IsaStats.from_asm(asm["vadd", arch])) == [("prologue", 1, isa._LAST_LINE)]


def test_summary_dict_and_notebook_views(asm):
    s = isa.IsaStats.from_asm(asm["lds", "gfx950"])
    text = isa.summary(s)
    assert s.kernel in text and "gfx950" in text and f"LDS           {s.lds_bytes} B" in text
    assert f"{s.n_instructions} static" in text and f"main loop     {s.main_loop_instructions} instructions" in text
    assert str(isa.occupancy(s)) in text
    d = json.loads(json.dumps(s.to_dict()))
    assert d["lds_bytes"] == s.lds_bytes and d["families"] == s.families
    assert d["main_loop_instructions"] == s.main_loop_instructions and len(d["loops"]) == len(s.loops)
    rows = s.table()
    assert ("LDS", f"{s.lds_bytes} B") in rows
    md = s._repr_markdown_()
    assert md.startswith("| fact | value |") and md.count("\n") == len(rows) + 1
    assert s._repr_html_().count("<tr>") == len(rows)


def test_histogram_plot(asm):
    import matplotlib

    matplotlib.use("Agg")
    stats = [isa.IsaStats.from_asm(asm["vadd", "gfx942"]), isa.IsaStats.from_asm(asm["lds", "gfx942"])]
    fig = isa.histogram_plot(stats, ["vadd", "lds"])
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * len(isa.FAMILIES)
    heights = [p.get_height() for p in ax.patches]
    assert heights[: len(isa.FAMILIES)] == [stats[0].families[f] for f in isa.FAMILIES]
    fig2 = isa.histogram_plot(stats, ["vadd", "lds"], by="mnemonic", top=5)
    assert len(fig2.axes[0].get_xticklabels()) == 5
    with pytest.raises(ValueError, match="labels"):
        isa.histogram_plot(stats, ["only one"])
    import matplotlib.pyplot as plt

    plt.close("all")


def test_kernel_selection_in_concatenated_text(asm):
    text = asm["vadd", "gfx942"] + "\n" + asm["lds", "gfx950"]
    names = isa.kernel_names(text)
    va, ld = _kernel_name(asm["vadd", "gfx942"]), _kernel_name(asm["lds", "gfx950"])
    assert names == [va, ld]
    with pytest.raises(ValueError, match=re.escape(va)):
        isa.IsaStats.from_asm(text)
    with pytest.raises(ValueError, match="kernels in the assembly"):
        isa.IsaStats.from_asm(text, kernel="nope")
    s = isa.IsaStats.from_asm(text, kernel=ld)
    assert s.kernel == ld and s.arch == "gfx950" and s.lds_bytes == LDS_THREADS * 4
    assert isa.IsaStats.from_asm(text, kernel=0).kernel == va
    # each kernel's body stays its own: no instructions leak across the module boundary
    assert s.n_instructions == isa.IsaStats.from_asm(asm["lds", "gfx950"]).n_instructions


# --- occupancy -----------------------------------------------------------------------------------

# (arch, vgpr_count, lds bytes, occupancy) for every row of the upstream pa_decode_tile table
# (256-thread workgroups); the VGPR budget bounds each one.
UPSTREAM_ROWS = [(r["arch"], r["vgpr"], r["lds"], r["occ"]) for r in upstream.tile_isa_figures()]
assert len(UPSTREAM_ROWS) == 96


@pytest.mark.parametrize("arch,vgpr,lds,occ", UPSTREAM_ROWS)
def test_occupancy_matches_upstream_table(arch, vgpr, lds, occ):
    o = isa.occupancy_for(arch, vgpr, sgpr=69, lds_bytes=lds, workgroup_size=256)
    assert o.waves_per_simd == occ and o.workgroups_per_cu == occ
    assert o.bound_by == ("vgpr",)
    # the same through IsaStats
    s = isa.IsaStats(kernel="k", arch=arch, vgpr_unified=vgpr, sgpr=69, lds_bytes=lds, workgroup_size=256)
    assert isa.occupancy(s).waves_per_simd == occ


def test_occupancy_other_bounds():
    # LDS: 40000 B rounds to 40448 (gfx942, 512 B blocks) -> 1 workgroup in 64 KiB,
    # and to 40960 (gfx950, 1280 B blocks) -> 4 in 160 KiB.
    o = isa.occupancy_for("gfx942", 32, lds_bytes=40000)
    assert (o.waves_per_simd, o.bound_by) == (1, ("lds",))
    o = isa.occupancy_for("gfx950", 32, lds_bytes=40000)
    assert (o.waves_per_simd, o.bound_by) == (4, ("lds",))
    assert isa.occupancy_for("gfx950", 32, lds_bytes=40961).waves_per_simd == 3
    # SGPRs: 100 round up to 112 of 800 -> 7 waves; 96 still allows 8
    o = isa.occupancy_for("gfx942", 32, sgpr=100)
    assert (o.waves_per_simd, o.bound_by) == (7, ("sgpr",))
    assert isa.occupancy_for("gfx942", 32, sgpr=96).waves_per_simd == 8
    # VGPR granule of 8: 64 -> 8 waves, 65 -> 72 -> 7 waves
    assert isa.occupancy_for("gfx942", 64).waves_per_simd == 8
    assert isa.occupancy_for("gfx942", 65).waves_per_simd == 7
    # one-wave workgroups spread over 4 SIMDs: LDS-bound average can be fractional
    o = isa.occupancy_for("gfx942", 32, lds_bytes=20000, workgroup_size=64)
    assert (o.workgroups_per_cu, o.waves_per_simd, o.bound_by) == (3, 0.75, ("lds",))
    # 512-thread workgroups put 2 waves on each SIMD
    o = isa.occupancy_for("gfx942", 128, workgroup_size=512)
    assert (o.workgroups_per_cu, o.waves_per_simd) == (2, 4)
    with pytest.raises(ValueError, match="gfx90a"):
        isa.occupancy_for("gfx90a", 32)
    with pytest.raises(ValueError, match="arch"):
        isa.occupancy(isa.IsaStats(kernel="k", vgpr_unified=8))


# --- synthetic assembly ------------------------------------------------------------------------

SYNTH = """\
\t.amdgcn_target "amdgcn-amd-amdhsa--gfx942"
\t.text
\t.globl\tk0
\t.type\tk0,@function
k0:                                     ; @k0
\ts_load_dwordx4 s[4:7], s[0:1], 0x0    ; kernargs
\tv_mov_b32_e32 v1, 0
.LBB0_1:                                ; outer loop header
\tbuffer_load_dwordx4 v[2:5], v0, s[4:7], 0 offen
\ts_mov_b32 s8, 0
.LBB0_2:                                ; inner loop header
\ts_waitcnt vmcnt(0)
\tv_mfma_f32_16x16x32_fp8_fp8 v[6:9], v[2:3], v[4:5], v[6:9]
\ts_add_i32 s8, s8, 1
\ts_cmp_lt_i32 s8, 4
\ts_cbranch_scc1 .LBB0_2
\tds_write_b128 v0, v[6:9] offset:16
\ts_cbranch_vccz .LBB0_4                 ; forward: not a loop
\ts_barrier
.LBB0_4:
\ts_add_i32 s9, s9, 1
\ts_cbranch_scc0 .LBB0_1
\ts_cmp_eq_u32 s9, 7
\ts_cbranch_scc1 .LBB0_1                 ; second back edge to the same header
\tglobal_store_dwordx4 v[0:1], v[6:9], off
\ts_endpgm
\ts_nop 0
\ts_nop 0
.Lfunc_end0:
\t.size\tk0, .Lfunc_end0-k0
\t.section\t.rodata,"a",@progbits
\t.amdhsa_kernel k0
\t\t.amdhsa_group_segment_fixed_size 4096
\t\t.amdhsa_next_free_vgpr 262
\t\t.amdhsa_accum_offset 256
\t.end_amdhsa_kernel
\t.text
\t.set .Lk0.num_vgpr, 253
\t.set .Lk0.num_agpr, 6
\t.p2alignl 6, 3212836864
\t.fill 256, 4, 3212836864
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     6
    .group_segment_fixed_size: 4096
    .max_flat_workgroup_size: 256
    .name:           k0
    .private_segment_fixed_size: 16
    .sgpr_count:     20
    .vgpr_count:     262
    .vgpr_spill_count: 3
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa--gfx942
...
\t.end_amdgpu_metadata
"""


def test_synthetic_loops_padding_and_registers():
    s = isa.IsaStats.from_asm(SYNTH)
    assert s.kernel == "k0" and s.arch == "gfx942"
    assert s.n_instructions == 18  # the two s_nop after s_endpgm are padding
    assert s.count("s_nop") == 0
    by_header = {lp.header: lp for lp in s.loops}
    assert set(by_header) == {".LBB0_1", ".LBB0_2"}
    outer, inner = by_header[".LBB0_1"], by_header[".LBB0_2"]
    assert (outer.start, outer.end, outer.n_instructions) == (2, 15, 14)  # to the later back edge
    assert (inner.start, inner.end, inner.n_instructions) == (4, 8, 5)
    assert (outer.depth, outer.innermost, inner.depth, inner.innermost) == (1, False, 2, True)
    assert s.main_loop is inner and s.main_loop_instructions == 5
    assert inner.families["mfma"] == 1 and inner.families["branch"] == 1 and inner.families["waitcnt"] == 1
    assert outer.families["buffer"] == 1 and outer.families["barrier"] == 1 and outer.families["ds"] == 1
    assert (inner.start_line, inner.end_line) == (12, 16)
    assert s.families == {"global": 1, "buffer": 1, "smem": 1, "ds": 1, "mfma": 1, "valu": 1, "salu": 5,
                          "waitcnt": 1, "barrier": 1, "branch": 4, "other": 1}
    assert s.load_widths == {"buffer": {"dwordx4": 1}}
    assert s.store_widths == {"ds": {"b128": 1}, "global": {"dwordx4": 1}}
    # registers: unified = align(253, 4) + 6 = 262, as the metadata says
    assert (s.vgpr, s.agpr, s.vgpr_unified, s.vgpr_unified_computed) == (253, 6, 262, 262)
    assert (s.sgpr, s.vgpr_spill, s.lds_bytes, s.scratch_bytes) == (20, 3, 4096, 16)
    assert s.workgroup_size == 256 and s.reqd_workgroup_size is None
    o = isa.occupancy(s)
    assert o.waves_per_simd == 1 and o.bound_by == ("vgpr",)


def test_registers_without_llvm_symbols_fall_back_to_descriptor():
    text = "\n".join(ln for ln in SYNTH.splitlines() if not ln.startswith("\t.set"))
    s = isa.IsaStats.from_asm(text)
    assert (s.vgpr, s.agpr, s.vgpr_unified) == (256, 6, 262)  # accum_offset marks the arch VGPR end


def test_instruction_families():
    cases = {
        "global_load_dwordx4": "global", "flat_load_dword": "global", "scratch_store_dword": "global",
        "buffer_load_dword": "buffer", "buffer_wbinvl1_vol": "other", "s_load_dwordx2": "smem",
        "s_buffer_load_dword": "smem", "ds_read_b128": "ds", "ds_bpermute_b32": "ds",
        "v_mfma_f32_16x16x32_fp8_fp8": "mfma", "v_smfmac_f32_16x16x64_fp8_fp8": "mfma",
        "v_accvgpr_read_b32": "valu", "v_pk_mul_f32": "valu", "v_cmp_lt_f32_e64": "valu",
        "s_mov_b32": "salu", "s_and_saveexec_b64": "salu", "s_cmp_lg_u32": "salu", "s_waitcnt": "waitcnt",
        "s_barrier": "barrier", "s_branch": "branch", "s_cbranch_execz": "branch", "s_setpc_b64": "branch",
        "s_nop": "other", "s_endpgm": "other", "s_setprio": "other",
    }
    assert {m: isa.instruction_family(m) for m in cases} == cases


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no kernel"):
        isa.IsaStats.from_asm("\t.text\n")
    with pytest.raises(TypeError, match="text"):
        isa.IsaStats.from_asm(b"bytes")
    with pytest.raises(ValueError, match="out of range"):
        isa.IsaStats.from_asm(SYNTH, kernel=3)
