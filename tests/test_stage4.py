"""Stage 4 (blocked K/V layouts, widened scope): the compiled kernel in the emulator over block 16/64,
head_dim 64/128, f16/bf16 query, per-tensor/per-token scales, trans-blocked/plain V, strided query;
against the float32 reference, the torch model of its roundings, and stage 3 (bit-identical on
stage 3's scope); the emulator trace proves every K and V byte arrives by 128-bit loads at the
minimum segment count and that the LDS has no bank conflict."""

import numpy as np
import pytest
import torch

from pa_tile import backend, cache, isa, toolchain
from pa_tile.emu import launch as emu_launch
from pa_tile.emu.memory import LINE_BYTES, Trace, coalescing_lines
from pa_tile.stages import s3_raw_loads as s3
from pa_tile.stages import s4_blocked_layouts as s4

ARCHS = ("gfx942", "gfx950")
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
CONTEXTS = list(cache.RAGGED_CONTEXTS)
# Against the float32 reference: the fp8 bound (pa_tile.reference.fp8_error_bound; per-token V
# weights add no rounding beyond P's own) and a mean error of at most REF_MEAN (observed up to
# 0.011: at head_dim 64 the query's rounding moves scores in proportion to softmax_scale = 1/8).
REF_MEAN = 0.015
# Against numerics_model (same roundings): float32 summation order, v_exp_f32's ~1 ulp, and the
# final rounding to the output dtype: 2e-4 + one ulp of f16 (2^-10) or bf16 (2^-7) relative.
MODEL_ATOL = 2e-4
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture(scope="module")
def device():
    backend.ensure_backend()
    return backend.device_for_tensors()


def _case(arch, block_size, head_dim=128, group=8, contexts=CONTEXTS, kv_heads=1, seed=1, q_dtype=torch.float16,
          scales="per-tensor", pad_block_id=-1, **kw):
    return cache.make_case(len(contexts), group * kv_heads, kv_heads, head_dim, block_size, list(contexts),
                           fp8_format=FMT[arch], seed=seed, query_dtype=q_dtype, scales=scales,
                           pad_block_id=pad_block_id, **kw)


def _args(case, v_layout="trans_blocked", device="cpu"):
    v = case.v_trans_blocked() if v_layout == "trans_blocked" else case.v_plain()
    a = (case.query, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale, case.v_scale)
    return tuple(x.to(device) for x in a)


COMBOS = [(torch.float16, "per-tensor", "trans_blocked"), (torch.bfloat16, "per-token", "trans_blocked"),
          (torch.float16, "per-token", "plain")]


@pytest.mark.parametrize("q_dtype,scales,v_layout", COMBOS, ids=["f16-tensor-tb", "bf16-token-tb", "f16-token-plain"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_widened_matrix(arch, block_size, head_dim, q_dtype, scales, v_layout, device):
    case = _case(arch, block_size, head_dim, q_dtype=q_dtype, scales=scales)
    args = _args(case, v_layout)
    out = s4.paged_decode(*_args(case, v_layout, device), arch=arch, v_layout=v_layout).cpu()
    assert out.dtype == q_dtype and out.shape == case.query.shape
    case.assert_matches(out, mean_err=REF_MEAN)
    model = s4.numerics_model(*args, arch=arch, v_layout=v_layout)
    bad = (out.float() - model).abs() > MODEL_ATOL + ULP[q_dtype] * model.abs()
    assert not bad.any(), f"{int(bad.sum())} outputs off the model"


@pytest.mark.parametrize("arch", ARCHS)
def test_bit_identical_to_stage3_on_its_scope(arch, device):
    case = _case(arch, 16, kv_heads=2, group=16, contexts=[1, 300, 1027])
    want = s3.paged_decode(*(x.to(device) for x in (case.query, case.k_cache, case.v_plain(), case.block_tables,
                                                    case.context_lengths, case.k_scale, case.v_scale)), arch=arch)
    for v_layout in ("trans_blocked", "plain"):
        got = s4.paged_decode(*_args(case, v_layout, device), arch=arch, v_layout=v_layout)
        assert torch.equal(got.cpu(), want.cpu()), v_layout


def test_strided_query_from_fused_qkv(device):
    case = _case("gfx950", 64, 64, group=8, kv_heads=2, contexts=[5, 300], q_dtype=torch.bfloat16, scales="per-token")
    want = s4.paged_decode(*_args(case, device=device), arch="gfx950").cpu()
    qkv = torch.full((2, 16 + 2 * 2, 64), float("nan"), dtype=torch.bfloat16)
    qkv[:, :16] = case.query
    q = qkv[:, :16].to(device)
    assert not q.is_contiguous()
    got = s4.paged_decode(q, *_args(case, device=device)[1:], arch="gfx950").cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_stale_slots_never_leak(arch, device):
    block_size, contexts = 16, [3, 17, 300]
    clean = _case(arch, block_size, 64, contexts=contexts, seed=5, num_blocks=40, scales="per-token")
    want = s4.paged_decode(*_args(clean, device=device), arch=arch).cpu()
    k = clean.k_cache.view(torch.uint8).clone()
    v = clean.v_cache.view(torch.uint8).clone()
    nan_code = {"gfx942": 0x80, "gfx950": 0x7F}[arch]
    for s, n in enumerate(contexts):
        last = int(clean.block_tables[s, (n - 1) // block_size])
        k[last, :, n % block_size or block_size:, :] = nan_code
        v[last, :, n % block_size or block_size:, :] = nan_code
    dt = clean.k_cache.dtype
    args = (clean.query, cache.to_k_blocked(k).view(dt), cache.to_v_trans_blocked(v).view(dt), clean.block_tables,
            clean.context_lengths, clean.k_scale, clean.v_scale)
    got = s4.paged_decode(*(x.to(device) for x in args), arch=arch).cpu()
    assert torch.equal(got, want)


class _AddressTrace(Trace):
    def __init__(self, arch):
        super().__init__(arch)
        self.addresses = []

    def global_access(self, mnemonic, line, addrs, mask, nbytes, **kw):
        super().global_access(mnemonic, line, addrs, mask, nbytes, **kw)
        self.addresses.append((mnemonic, nbytes, kw.get("write", False),
                               np.asarray(addrs, dtype=np.int64)[np.asarray(mask, bool)]))


@pytest.mark.parametrize("block_size,head_dim,scales", [(16, 128, "per-tensor"), (64, 64, "per-token")])
@pytest.mark.parametrize("arch", ARCHS)
def test_trace_all_kv_bytes_by_128bit_loads_in_whole_128B_lines_no_lds_conflicts(arch, block_size, head_dim, scales):
    n = 300
    case = _case(arch, block_size, head_dim, group=16, contexts=[n], scales=scales)
    args = _args(case)
    trace = _AddressTrace(arch)
    with emu_launch.launch_options(trace=trace):
        s4.paged_decode(*args, arch=arch)
    named = dict(k=args[1], v=args[2])
    if scales == "per-token":
        named.update(ks=args[5], vs=args[6])
    seen = {name: set() for name in named}
    touched = dict(k=set(), v=set())
    for mnemonic, nbytes, write, a in trace.addresses:
        for name, t in named.items():
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            inside = (a >= lo) & (a < hi)
            if not inside.any():
                continue
            assert inside.all() and not write
            assert mnemonic == "buffer_load_dwordx4" and nbytes == 16, (name, mnemonic)
            assert a.size == 64  # whole-wave loads
            # 16-byte aligned; a K/V load touches at most twice the 128-byte lines its distinct bytes
            # need (K: every 4-lane group reads 64 contiguous bytes, half a line, and the wave's next
            # load the other half), and every line a K/V load touches is read whole by the kernel
            # (checked below). Per-token scales are shared by the 16 lanes of a row group (16 copies
            # of 4 pieces per load), so they are held to the width only
            assert not (a % 16).any()
            distinct = np.unique(a).size * 16
            if name in ("k", "v"):
                lines = coalescing_lines(a.astype(np.uint64), np.ones(64, bool), 16, np.array([lo], np.uint64))
                assert lines <= 2 * -(-distinct // LINE_BYTES)
                touched[name].update(((a - lo) // LINE_BYTES).tolist())
            for x in (a - lo).tolist():
                seen[name].update(range(x, x + 16))
    pages = case.block_tables[0, : -(-n // block_size)].tolist()
    need_k, need_v = set(), set()
    for t in range(n):
        p, slot = pages[t // block_size], t % block_size
        for d in range(head_dim):
            need_k.add(int(np.ravel_multi_index(cache.layout_index("k_blocked", p, 0, slot, d), args[1].shape)))
            need_v.add(int(np.ravel_multi_index(cache.layout_index("v_trans_blocked", p, 0, slot, d), args[2].shape)))
    assert need_k <= seen["k"] and need_v <= seen["v"]
    for name in ("k", "v"):  # no line fetched for part of its bytes
        assert all(set(range(ln * LINE_BYTES, (ln + 1) * LINE_BYTES)) <= seen[name] for ln in touched[name]), name
    lds = [r for r in trace.accesses() if r["space"] == "lds"]
    assert lds and max(r["conflict_degree"] for r in lds) == 1
    assert sum(r["conflict_cycles"] for r in lds) == 0


def test_unpadded_merge_table_would_conflict():
    """The padding is what removes the conflict: rows of 4 words conflict 2-way (heads c and c+8)."""
    arch = "gfx942"
    case = _case(arch, 16, group=16, contexts=[256])
    launcher, args, _ = s4.launch_args(*_args(case), arch=arch)
    degrees = {}
    for stride in (4, s4.STATS_STRIDE):
        trace = Trace(arch)
        with emu_launch.launch_options(trace=trace), toolchain.target_arch(arch):
            s4.build_launcher(16, 128, 16, arch, "f16", False, "trans_blocked", stride)(*args)
        degrees[stride] = max(r["conflict_degree"] for r in trace.accesses() if r["space"] == "lds")
    assert degrees == {4: 2, s4.STATS_STRIDE: 1}


@pytest.mark.parametrize("arch", ARCHS)
def test_resources(arch):
    for bs, hd, qd, sc in ((16, 128, torch.float16, "per-tensor"), (64, 64, torch.bfloat16, "per-token")):
        case = _case(arch, bs, hd, group=16, contexts=[17, 300], q_dtype=qd, scales=sc)
        launcher, args, arch = s4.launch_args(*_args(case), arch=arch)
        st = isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))
        assert st.vgpr_spill == 0 and st.scratch_bytes == 0 and st.agpr == 0
        assert isa.occupancy(st, arch).waves_per_simd >= 3
        assert st.count("s_barrier") == 6
        widths = st.load_widths["buffer"]
        assert set(widths) <= {"dword", "dwordx4"}


# ---------------------------------------------------------------------------- validation


def _good():
    case = _case("gfx942", 16, contexts=[5, 20])
    return dict(zip(("query", "key_cache", "value_cache", "block_tables", "context_lengths", "key_scale",
                     "value_scale"), _args(case)))


BAD = [
    ("query", TypeError, lambda g: dict(g, query=g["query"].float())),
    ("query", ValueError, lambda g: dict(g, query=g["query"][:, :, :32])),
    ("query", ValueError, lambda g: dict(g, query=g["query"][:, :, ::2].repeat(1, 1, 2)[:, :, ::2])),
    ("query", ValueError, lambda g: dict(g, query=g["query"][:, :4])),
    ("key_cache", ValueError, lambda g: dict(g, key_cache=cache.from_k_blocked(g["key_cache"]))),
    ("key_cache", ValueError, lambda g: dict(g, key_cache=g["key_cache"].view(torch.uint8).view(torch.float8_e4m3fn))),
    ("value_cache", ValueError, lambda g: dict(g, value_cache=cache.to_v_plain(cache.from_v_trans_blocked(g["value_cache"])))),
    ("value_cache", TypeError, lambda g: dict(g, value_cache=g["value_cache"].view(torch.uint8))),
    ("block_tables", TypeError, lambda g: dict(g, block_tables=g["block_tables"].long())),
    ("block_tables", ValueError, lambda g: dict(g, block_tables=g["block_tables"] + 100)),
    ("context_lengths", ValueError, lambda g: dict(g, context_lengths=torch.tensor([0, 20], dtype=torch.int32))),
    ("key_scale", ValueError, lambda g: dict(g, key_scale=torch.ones(3, dtype=torch.float32))),
    ("value_scale", ValueError, lambda g: dict(g, value_scale=torch.ones(tuple(g["key_cache"].shape[:2]) + (16,)))),
    ("value_scale", TypeError, lambda g: dict(g, value_scale=torch.ones(1, dtype=torch.float64))),
]


@pytest.mark.parametrize("name,exc,make", BAD, ids=[f"{n}-{e.__name__}-{i}" for i, (n, e, _) in enumerate(BAD)])
def test_bad_input_is_named_before_anything_is_built(name, exc, make, monkeypatch):
    monkeypatch.setattr(s4, "build_launcher", lambda *a, **k: pytest.fail("launcher built"))
    with pytest.raises(exc, match=name):
        s4.paged_decode(**make(_good()), arch="gfx942")


@pytest.mark.parametrize("kwargs,name,exc", [
    (dict(arch="gfx90a"), "arch", ValueError),
    (dict(v_layout="blocked"), "v_layout", ValueError),
    (dict(softmax_scale=0.0), "softmax_scale", ValueError),
    (dict(out=torch.empty(2, 8, 128, dtype=torch.bfloat16)), "out", ValueError),
])
def test_bad_options_are_named(kwargs, name, exc, monkeypatch):
    monkeypatch.setattr(s4, "build_launcher", lambda *a, **k: pytest.fail("launcher built"))
    kwargs.setdefault("arch", "gfx942")
    with pytest.raises(exc, match=name):
        s4.paged_decode(**_good(), **kwargs)


@pytest.mark.rocm
@pytest.mark.skipif(not backend.gpu_available(), reason="needs a ROCm GPU")
@pytest.mark.parametrize("q_dtype,scales,v_layout", COMBOS)
def test_gpu_long_contexts(q_dtype, scales, v_layout):
    arch = backend.default_arch()
    if arch not in ARCHS:
        pytest.skip(f"stage 4 targets gfx942/gfx950, this GPU is {arch}")
    for bs, hd in ((16, 128), (64, 64)):
        case = _case(arch, bs, hd, kv_heads=4, contexts=CONTEXTS * 8 + [4099, 8192], q_dtype=q_dtype, scales=scales)
        out = s4.paged_decode(*_args(case, v_layout, "cuda"), arch=arch, v_layout=v_layout).cpu()
        model = s4.numerics_model(*_args(case, v_layout), arch=arch, v_layout=v_layout)
        assert not ((out.float() - model).abs() > MODEL_ATOL + ULP[q_dtype] * model.abs()).any()


@pytest.mark.parametrize("scales", ["per-tensor", "per-token"])
@pytest.mark.parametrize("arch", ARCHS)
def test_large_scores_stay_finite(arch, scales, device):
    """K scales of 1e4 (per token) and 1e5 (per tensor) make scores of ~1e4-1e5 in log2 units:
    without ``kernel_lib.exp_shift``'s margin the top P came out just past FP8_MAX and its fp8
    conversion made it NaN. Against the model (which fuses each exponent as the kernel does) the
    tolerances are this module's: the same roundings, up to summation order, v_exp_f32's ulp and
    the output rounding. Against the reference the fp8 bound holds in both: per token the fp8
    query's rounding (2^-4 of a score) times scores this large moves the softmax weights by whole
    factors, in the model as well, and the bound computes that move rather than bounding it."""
    case = _case(arch, 16, contexts=[300, 40], seed=3, scales=scales)
    case.k_scale.mul_(1e4 if scales == "per-token" else 1e5)
    out = s4.paged_decode(*_args(case, device=device), arch=arch).cpu()
    assert torch.isfinite(out.float()).all()
    case.assert_matches(out)
    model = s4.numerics_model(*_args(case), arch=arch)
    bad = (out.float() - model).abs() > MODEL_ATOL + ULP[torch.float16] * model.abs()
    assert not bad.any(), f"{int(bad.sum())} outputs off the model"
