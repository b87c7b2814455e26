"""Stage 6 (split-K and the finished kernel): the flash-combine reduce against its torch model
(empty partitions, all-empty rows, no NaN), the partition heuristic, and the finished
``paged_decode`` in the emulator against the float32 reference over the feature matrix on gfx942
and gfx950, split and unsplit; resources of the split specialization and of the reduce."""

import pytest
import torch

import pa_tile.arch

from pa_tile import backend, cache, isa, toolchain
from pa_tile.stages import s5_phase_split_mtp as s5
from pa_tile.stages import s6_split_k as s6

ARCHS = ("gfx942", "gfx950")
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
EMPTY_MAX = -6.9e29  # what chapter 5 writes for a partition that saw no token of a row

# Checked as chapters 2 and 5 (tests/test_stage2.py): the fp8 bound per element
# (pa_tile.reference.fp8_error_bound, which a split keeps: float32 partials, one float32
# combine) and the mean error at most REF_MEAN.
REF_MEAN = 0.012


@pytest.fixture(scope="module")
def device():
    backend.ensure_backend()
    return backend.device_for_tensors()


def _case(arch, bs, hd, g, ql, contexts=cache.RAGGED_CONTEXTS, scales="per-tensor", qdt=torch.float16, kvh=1, seed=1):
    ctx = [max(c, ql) for c in contexts]
    return cache.make_case(len(ctx), g * kvh, kvh, hd, bs, ctx, query_length=ql, fp8_format=FMT[arch], scales=scales,
                           query_dtype=qdt, seed=seed, pad_block_id=-1)


def _args(case, trans_v=True, device="cpu", strided=False):
    q = case.query
    if strided:
        wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 32, dtype=q.dtype)
        wide[:, :, : q.shape[2]] = q
        q = wide[:, :, : q.shape[2]]
        assert q.stride(1) == q.shape[2] + 32
    v = case.v_trans_blocked() if trans_v else case.v_plain()
    a = (q, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale, case.v_scale)
    return tuple(x.to(device) for x in a)


def _check(out, case, **kw):
    case.assert_matches(out, mean_err=REF_MEAN, **kw)


# ---------------------------------------------------------------------------- the reduce alone


def _partials(S, kvh, NP, rows, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    pmax = torch.randn(S, kvh, NP, rows, generator=g) * 4
    psum = torch.rand(S, kvh, NP, rows, generator=g) * 50 + 1
    pout = torch.randn(S, kvh, NP, rows, hd, generator=g)
    pmax[0, 0, 1 % NP] = -40.0  # live but far below the max: weight e^-44 ~ 0, not NaN
    for sel in ((0, 0, NP - 1), (S - 1, kvh - 1, slice(None), rows - 1)):  # an empty partition; an all-empty row
        pmax[sel], psum[sel], pout[sel] = EMPTY_MAX, 0.0, 0.0
    return pmax, psum, pout


def test_combine_torch_model():
    """The model itself: a row's weights follow l·e^(m - M); empty partitions add nothing."""
    pmax = torch.tensor([2.0, EMPTY_MAX, 0.5, float("-inf")]).view(1, 1, 4, 1)
    psum = torch.tensor([3.0, 0.0, 5.0, 0.0]).view(1, 1, 4, 1)
    pout = torch.tensor([1.0, 123.0, -1.0, float("nan")]).view(1, 1, 4, 1, 1) * torch.ones(1, 1, 4, 1, 2)
    w = torch.tensor([3.0, 5.0 * torch.exp(torch.tensor(-1.5))])
    want = (w[0] * 1.0 + w[1] * -1.0) / w.sum()
    pout[0, 0, 3] = 0.0  # empty partitions carry out = 0 (a NaN there would leak through 0·NaN)
    got = s6.combine_torch(pmax, psum, pout, 1, 1)
    torch.testing.assert_close(got, torch.full((1, 1, 2), float(want)))
    none = s6.combine_torch(torch.full_like(pmax, EMPTY_MAX), torch.zeros_like(psum), torch.zeros_like(pout), 1, 1)
    assert (none == 0).all()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("S,kvh,NP,ql,g,hd,qdt", [
    (2, 2, 3, 2, 5, 64, torch.float16),  # odd group, rows straddle M-tile boundaries
    (1, 3, 7, 4, 8, 128, torch.bfloat16),
    (2, 1, 2, 1, 4, 256, torch.float16),  # 64 lanes per row
    (1, 1, 1, 3, 32, 128, torch.float16),  # a single partition: out = o
    (1, 2, 4, 1, 8, 128, torch.float16),  # one whole group (REDUCE_GROUP = 4)
    (2, 1, 9, 1, 8, 64, torch.bfloat16),  # two groups and a tail of one
])
def test_reduce_matches_model(arch, S, kvh, NP, ql, g, hd, qdt, device):
    pmax, psum, pout = _partials(S, kvh, NP, ql * g, hd)
    out = torch.full((S * ql, kvh * g, hd), float("nan"), dtype=qdt, device=device)
    launcher = s6.build_reduce(hd, g, ql, "bf16" if qdt == torch.bfloat16 else "f16")
    with toolchain.target_arch(arch):
        launcher(out, pmax.to(device), psum.to(device), pout.to(device), S, kvh, NP, pmax, pmax)
    out = out.float().cpu()
    assert torch.isfinite(out).all()  # every row written, none NaN
    want = s6.combine_torch(pmax, psum, pout, ql, g)
    ulp = 2.0**-8 if qdt == torch.bfloat16 else 2.0**-11
    torch.testing.assert_close(out, want, atol=1e-3, rtol=2 * ulp)
    if NP > 1 or S * kvh > 1:
        assert (out[-1, -1] == 0).all()  # the all-empty row


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("balanced", [False, True])
def test_the_reduce_waits_for_memory_once_per_group(arch, balanced):
    """One loop, and every load of a group (stats and output of REDUCE_GROUP partitions) issued
    before its first wait: a wait per partition made the reduce a third of chapter 09's call in
    the timing model (the loop's latency, ``pa_tile.perf.model``)."""
    S, NP, rows = 2, 6, 8
    out = torch.zeros(S, 8, 128, dtype=torch.float16)
    stats, pout = torch.zeros(S * NP, 1, rows), torch.zeros(S * NP, 1, rows, 128)  # a work list's layout
    if balanced:
        args = (out, stats, stats, pout, torch.tensor([0, 5, S * NP], dtype=torch.int32), S, 1, stats, stats)
    else:
        args = (out, stats.view(S, 1, NP, rows), stats.view(S, 1, NP, rows), pout.view(S, 1, NP, rows, 128), S, 1, NP,
                stats, stats)
    asm = toolchain.compile_isa(s6.build_reduce(128, 8, 1, "f16", balanced=balanced), *args, arch=arch)
    st = isa.IsaStats.from_asm(asm)
    lp = st.main_loop
    assert lp is not None and len(st.loops) == 1, st.loops  # one pass, not a loop per pass
    body = asm.splitlines()[lp.start_line - 1:lp.end_line]
    first_wait = next(i for i, line in enumerate(body) if "vmcnt" in line)
    loads = sum(1 for line in body[:first_wait] if "buffer_load" in line)
    assert loads == 3 * s6.REDUCE_GROUP == lp.families["buffer"], (loads, lp.families)


# ---------------------------------------------------------------------------- heuristic


def test_heuristic_fills_the_machine_without_tiny_partitions():
    """The rule of thumb (``policy="budget"``, the default before the timing model chose)."""
    for arch, cus in (("gfx942", 304), ("gfx950", 256)):
        assert pa_tile.arch.info(arch).cu_count == cus
        # one long sequence: the partials' byte budget caps it (128 tiles, 8 rows: at most
        # 0.03·128·512·128 / (8·130·4) = 60), rounded to 3 tiles per partition -> 43
        assert s6.choose_num_partitions_budget(1, 8, 32768, arch=arch) == 43
        # 4k tokens = 16 tiles: budget 7, rounded to 3 tiles per partition -> 6
        assert s6.choose_num_partitions_budget(1, 8, 4096, arch=arch) == 6
        # 16 rows a KV head halve the budget; 64 rows (MTP 4 x group 16) of a 1027-token context: none
        assert s6.choose_num_partitions_budget(1, 8, 4096, arch=arch, group=16) == 3
        assert s6.choose_num_partitions_budget(3, 1, 1027, arch=arch, group=16, query_length=4) == 1
        # 1 tile or 1 token: nothing to split
        assert s6.choose_num_partitions_budget(1, 1, 256, arch=arch) == 1
        assert s6.choose_num_partitions_budget(1, 1, 1, arch=arch) == 1
        # a batch that fills 4 workgroups per CU by itself is not split
        assert s6.choose_num_partitions_budget(cus // 2, 8, 32768, arch=arch) == 1
    # in between: enough partitions for ~4 workgroups per CU, rounded so tiles split evenly
    P = s6.choose_num_partitions_budget(16, 8, 32768, arch="gfx942")  # want ceil(1216/128) = 10; 128 tiles -> 13 per -> 10
    assert P == 10 and -(-128 // P) * P >= 128 and -(-128 // P) * (P - 1) < 128
    assert s6.choose_num_partitions_budget(16, 8, 32768, arch="gfx950") == 8
    # M-groups count as workgroups: query_length 4 x group 16 = 4 M-tiles -> 4x fewer partitions wanted
    assert (s6.choose_num_partitions_budget(4, 8, 65536, arch="gfx942", group=16, query_length=4)
            < s6.choose_num_partitions_budget(4, 8, 65536, arch="gfx942"))
    with pytest.raises(ValueError, match="arch"):
        s6.choose_num_partitions_budget(1, 1, 1000, arch="gfx90a")


def _batches():
    """(num_seqs, num_kv_heads, max_context, arch, tiles) over batch sizes, KV heads, contexts
    around the tile edges and both archs: where a partition choice must stay in the limits."""
    for S in (1, 2, 7, 64, 1000):
        for kvh in (1, 4, 8):
            for ctx in (1, 255, 256, 257, 511, 513, 5000, 100000):
                for arch in ARCHS:
                    yield S, kvh, ctx, arch, -(-ctx // 256)


def test_heuristic_never_exceeds_limits():
    for S, kvh, ctx, arch, tiles in _batches():
        P = s6.choose_num_partitions_budget(S, kvh, ctx, arch=arch)
        assert 1 <= P <= s6.MAX_PARTITIONS
        assert P == 1 or tiles // P >= s6.MIN_TILES_PER_PARTITION
        per = -(-tiles // P)
        assert per * (P - 1) < tiles  # the longest sequence leaves no partition empty


def test_heuristic_keeps_the_partials_under_their_byte_budget():
    for rows_g, ql in ((1, 1), (8, 1), (16, 1), (8, 4), (32, 4)):
        for hd in (64, 128, 256):
            for ctx in (256, 1027, 4096, 32768, 100000):
                P = s6.choose_num_partitions_budget(1, 1, ctx, arch="gfx942", head_dim=hd, group=rows_g, query_length=ql)
                if P > 1:
                    tiles = -(-ctx // 256)
                    partials = P * rows_g * ql * (hd + 2) * 4
                    assert partials <= s6.PARTIAL_BYTES_BUDGET * tiles * 2 * 256 * hd


def test_model_choice_never_exceeds_limits():
    """The default (the timing model's table): within the kernel's limits, tiles split evenly."""
    for S, kvh, ctx, arch, tiles in _batches():
        P = s6.choose_num_partitions(S, kvh, ctx, arch=arch)
        assert 1 <= P <= min(s6.MAX_PARTITIONS, tiles)
        per = -(-tiles // P)
        assert per * (P - 1) < tiles  # the longest sequence leaves no partition empty


# ---------------------------------------------------------------------------- the finished kernel

# block, head_dim, group, query_length, scales, query dtype, trans V, window, strided query, partitions
MATRIX = [
    (16, 128, 8, 1, "per-tensor", torch.float16, True, 0, False, None),  # auto: the model's 5 partitions
    (64, 128, 16, 1, "per-token", torch.bfloat16, True, 0, True, 3),
    (16, 64, 32, 3, "per-token", torch.float16, False, 0, False, None),
    (64, 64, 4, 4, "per-tensor", torch.bfloat16, True, 300, False, 5),  # 5 = one tile per partition
    (16, 128, 5, 2, "per-tensor", torch.float16, False, 100, True, 2),
    (64, 64, 1, 1, "per-token", torch.float16, True, 0, False, 1),  # unsplit: no reduce
]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: "bs{}-hd{}-g{}-ql{}-{}-{}-{}-w{}-{}-P{}".format(
    c[0], c[1], c[2], c[3], c[4], str(c[5])[6:], "vt" if c[6] else "vp", c[7], "qs" if c[8] else "qc", c[9]))
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_reference(arch, cfg, device):
    bs, hd, g, ql, scales, qdt, trans_v, window, strided, P = cfg
    case = _case(arch, bs, hd, g, ql, scales=scales, qdt=qdt)
    out = s6.paged_decode(*_args(case, trans_v, device, strided), sliding_window=window, num_partitions=P, arch=arch)
    assert out.dtype == qdt and out.shape == case.query.shape
    _check(out, case, sliding_window=window)


def test_auto_split_is_used_on_the_ragged_set():
    """The matrix's auto rows really split (1027 tokens = 5 tiles: the model's table says 5
    partitions of one tile; the traffic cap keeps 2, of 3 + 2 tiles, as the rule of thumb took)."""
    case = _case("gfx942", 16, 128, 8, 1)
    assert s6.choose_num_partitions(4, 1, case.block_tables.shape[1] * 16, arch="gfx942", policy="fastest") == 5
    assert s6.choose_num_partitions(4, 1, case.block_tables.shape[1] * 16, arch="gfx942") == 2
    assert s6.choose_num_partitions(4, 1, case.block_tables.shape[1] * 16, arch="gfx942", policy="budget") == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_split_equals_unsplit(arch, device):
    """Partition boundaries (5 partitions: one per tile of 1027 tokens, empty ones for the short
    sequences) change nothing but float32-vs-f16 rounding of the partials; KV heads > 1."""
    case = _case(arch, 16, 64, 8, 2, scales="per-token", kvh=2, seed=4)
    args = _args(case, device=device)
    one = s6.paged_decode(*args, num_partitions=1, arch=arch).float().cpu()
    # the unsplit path is chapter 5's kernel, bit for bit
    assert torch.equal(one, s5.paged_decode(*args, arch=arch).float().cpu())
    for P in (2, 5, 7):
        split = s6.paged_decode(*args, num_partitions=P, arch=arch).float().cpu()
        torch.testing.assert_close(split, one, atol=2e-2, rtol=2**-8)


def test_window_empties_early_partitions(device):
    """A 40-token window over 1027 tokens: every partition but the last sees nothing."""
    case = _case("gfx950", 64, 128, 8, 3, contexts=[1027, 600], scales="per-token", seed=9)
    out = s6.paged_decode(*_args(case, device=device), sliding_window=40, num_partitions=5, arch="gfx950")
    _check(out, case, sliding_window=40)


def test_compiles_both_kernels():
    case = _case("gfx942", 16, 128, 8, 1, contexts=[20])
    pipe, args, arch = s6.launch_args(*_args(case), num_partitions=4, arch="gfx942")
    text = toolchain.compile_isa(pipe, *args, arch=arch)
    names = isa.kernel_names(text)
    assert len(names) == 2 and "pa_decode_s5" in names[0] and "pa_reduce_s6" in names[1]
    red = isa.IsaStats.from_asm(text, kernel=1)
    assert red.scratch_bytes == 0 and red.vgpr_spill == 0 and red.lds_bytes == 0
    assert isa.occupancy(red, "gfx942").waves_per_simd == 8
    pipe1, args1, _ = s6.launch_args(*_args(case), num_partitions=1, arch="gfx942")
    assert len(isa.kernel_names(toolchain.compile_isa(pipe1, *args1, arch="gfx942"))) == 1


# Split specializations of the partial kernel against the upstream figures (NP=1 of all 96 rows is
# tests/test_stage5.py's): the heaviest (query_length 4, group 16) and lightest rows, both arches.
SPLIT_UPSTREAM = {  # (arch, block, head_dim, query_length, group, per_token) -> (VGPR+AGPR, waves/SIMD)
    ("gfx942", 16, 128, 4, 16, False): (246, 2), ("gfx942", 64, 128, 4, 16, True): (265, 1),
    ("gfx950", 16, 64, 4, 16, True): (189, 2), ("gfx950", 64, 128, 4, 8, False): (178, 2),
    ("gfx942", 64, 64, 1, 16, False): (90, 5), ("gfx950", 16, 64, 1, 8, False): (88, 5),
}


@pytest.mark.parametrize("key", sorted(SPLIT_UPSTREAM), ids=lambda k: "{}-bs{}-hd{}-ql{}-g{}-{}".format(
    *k[:5], "tok" if k[5] else "ten"))
def test_split_resources_match_or_beat_upstream(key):
    arch, bs, hd, ql, g, tok = key
    case = cache.make_case(1, g, 1, hd, bs, 20, query_length=ql, fp8_format=FMT[arch],
                           scales="per-token" if tok else "per-tensor", query_dtype=torch.bfloat16)
    pipe, args, arch = s6.launch_args(*_args(case), num_partitions=4, arch=arch)
    st = isa.IsaStats.from_asm(toolchain.compile_isa(pipe, *args, arch=arch), kernel=0)
    assert st.scratch_bytes == 0 and st.vgpr_spill == 0 and st.sgpr_spill == 0
    vgpr, waves = SPLIT_UPSTREAM[key]
    occ = isa.occupancy(st, arch).waves_per_simd
    assert st.vgpr_unified <= vgpr and occ >= waves, f"ours {st.vgpr_unified} / {occ}, upstream {vgpr} / {waves}"


# ---------------------------------------------------------------------------- real GPU


@pytest.mark.rocm
@pytest.mark.skipif(not backend.gpu_available(), reason="needs a ROCm GPU")
@pytest.mark.parametrize("cfg", MATRIX)
def test_gpu_long_contexts(cfg):
    arch = backend.default_arch()
    if arch not in ARCHS:
        pytest.skip(f"pa_tile targets gfx942/gfx950, this GPU is {arch}")
    bs, hd, g, ql, scales, qdt, trans_v, window, strided, P = cfg
    case = _case(arch, bs, hd, g, ql, list(cache.RAGGED_CONTEXTS) * 4 + [4099, 16384], scales, qdt, kvh=4)
    out = s6.paged_decode(*_args(case, trans_v, "cuda", strided), sliding_window=window, num_partitions=P, arch=arch)
    _check(out, case, sliding_window=window)
