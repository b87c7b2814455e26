"""Stage 1 (``pa_tile.stages.s1_tile_qk``): the compiled kernel against the float32 reference.

The emulator tests run the real gfx942 / gfx950 machine code FlyDSL produces, through the
normal ``@flyc.jit`` launcher, on CPU tensors. The ``rocm`` variants run the same launcher on
a ROCm GPU when the process has one.
"""

import math

import pytest
import torch

from pa_tile import arch as pa_arch

from pa_tile import backend, cache, isa, toolchain
from pa_tile.stages import s1_tile_qk as s1

ARCHS = ("gfx942", "gfx950")
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
NAN_CODE = {"fnuz": 0x80, "ocp": 0x7F}
# A single token, a partial first page, a tile ending on a page boundary, exactly one tile,
# and one token past four tiles.
CONTEXTS = (1, 17, 128, 256, 1027)


def make(arch, block_size, group, contexts=CONTEXTS, num_kv_heads=2, seed=0):
    # pad_block_id=-1: block-table entries past a sequence's last page are -1, so any stray
    # page lookup reads outside the cache and the emulator's sanitizer faults.
    return cache.make_case(len(contexts), group * num_kv_heads, num_kv_heads, s1.HEAD_DIM, block_size,
                           list(contexts), fp8_format=FMT[arch], seed=seed, pad_block_id=-1)


def run(case, arch, device="cpu", **kwargs):
    args = [case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale]
    args = [a.to(device) for a in args]
    return s1.paged_decode(*args, arch=arch, **kwargs).cpu()


def v_max(case, s):
    """Largest |value| among the V vectors of sequence ``s``'s tokens (dequantized)."""
    L = int(case.context_lengths[s])
    pages = case.block_tables[s, : -(-L // case.block_size)].long()
    v = cache.dequantize(case.v_cache[pages], scale=case.v_scale)  # [pages, kv_heads, block, d]
    return float(v.transpose(0, 1).reshape(case.num_kv_heads, -1, case.head_dim)[:, :L].abs().max())


def assert_close_to_reference(got, want, case):
    """fp8-justified bound, per sequence.

    The kernel rounds each probability to e4m3 once (3 mantissa bits: relative error <= 2^-4)
    before P·V, so the convex combination o = sum_t w_t v_t moves by at most 2^-4 * max|v|.
    The query is rounded to e4m3 too (per-row scale), which perturbs every logit and hence the
    weights by a comparable relative amount: the bound is 2 * 2^-4 * max|v| of the values the
    sequence reads, plus f16 rounding of the output (2^-11 relative, 2^-10 allowed). K and V
    are not error sources: kernel and reference read the same fp8 codes and scales. (Measured
    on these cases the error is about a tenth of the bound; a layout, mask or scale mistake
    costs O(max|v|).)
    """
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "non-finite output"
    for s in range(case.num_seqs):
        err = (got[s].float() - want[s].float()).abs().max().item()
        tol = 2 * 2**-4 * v_max(case, s) + 2**-10 * want[s].float().abs().max().item()
        assert err <= tol, f"sequence {s} (context {int(case.context_lengths[s])}): max error {err:.4g} > {tol:.4g}"


def kernel_model(case, arch, softmax_scale=None):
    """Pure-torch model of the kernel's arithmetic: same fp8 roundings of q and p, same tiles.

    Everything the kernel quantizes is quantized here the same way (per-row fp8 query, fp8
    probabilities scaled by FP8_MAX, per 256-token tile against the running max), so the only
    differences left are f32 summation order, v_exp/v_rcp (~1 ulp) and the odd fp8 code that
    lands on the other side of a rounding tie because of them.
    """
    dtype, fp8_max = pa_arch.fp8_torch_dtype(arch), pa_arch.fp8_max(arch)
    d, bs, G = case.head_dim, case.block_size, case.query_group_size
    scale = (softmax_scale or 1 / math.sqrt(d)) * s1.LOG2E
    k_codes, v_codes = cache.fp8_decode(case.k_cache), cache.fp8_decode(case.v_cache)
    ks, vs = float(case.k_scale.reshape(-1)[0]), float(case.v_scale.reshape(-1)[0])
    out = torch.empty_like(case.query)
    for s in range(case.num_seqs):
        L = int(case.context_lengths[s])
        pages = case.block_tables[s, : -(-L // bs)].long()
        for h in range(case.num_kv_heads):
            q = case.query[s, h * G:(h + 1) * G].float()
            amax = q.abs().amax(-1, keepdim=True)
            q8 = cache.fp8_decode((q * (fp8_max / amax.clamp_min(1e-30))).to(dtype))
            row_factor = amax * (scale / fp8_max) * ks
            K = k_codes[pages, h].reshape(-1, d)[:L]
            V = v_codes[pages, h].reshape(-1, d)[:L]
            m, l, o = torch.full((G, 1), -math.inf), torch.zeros(G, 1), torch.zeros(G, d)
            for t0 in range(0, L, s1.TILE_TOKENS):
                x = (q8 @ K[t0:t0 + s1.TILE_TOKENS].T) * row_factor
                m_new = torch.maximum(m, x.amax(-1, keepdim=True))
                p = torch.exp2(x - m_new)
                corr = torch.exp2(m - m_new)
                l = l * corr + p.sum(-1, keepdim=True)
                p8 = cache.fp8_decode((p * fp8_max).to(dtype))
                o = o * corr + p8 @ V[t0:t0 + s1.TILE_TOKENS]
                m = m_new
            out[s, h * G:(h + 1) * G] = (o / l * (vs / fp8_max)).to(out.dtype)
    return out


def assert_matches_model(got, model, case):
    """Mean error tiny (systematic mistakes cost O(max|v|) on average); max error within one
    fp8 ulp of one probability (2^-3 relative of a weight <= 1, times max|v|)."""
    vmax = max(v_max(case, s) for s in range(case.num_seqs))
    diff = (got.float() - model.float()).abs()
    assert diff.mean().item() <= 2**-12 * vmax, f"mean |kernel - model| = {diff.mean().item():.3g}"
    assert diff.max().item() <= 2**-3 * vmax, f"max |kernel - model| = {diff.max().item():.3g}"


def _on_emulator():
    if backend.current_backend() != "emu":
        pytest.skip("this process runs kernels on the GPU; the rocm-marked variants cover it")


# ───────────────────────── emulator: correctness ─────────────────────────


@pytest.mark.parametrize("group", s1.LIMITS.groups)
@pytest.mark.parametrize("block_size", s1.LIMITS.block_sizes)
@pytest.mark.parametrize("arch", ARCHS)
def test_emulated_kernel_matches_reference(arch, block_size, group):
    _on_emulator()
    case = make(arch, block_size, group)
    got = run(case, arch)
    assert_close_to_reference(got, case.reference(), case)
    assert_matches_model(got, kernel_model(case, arch), case)


@pytest.mark.parametrize("arch", ARCHS)
def test_slots_past_the_context_cannot_leak(arch):
    """NaN codes in every K/V slot past each context (in the sequences' own last pages)."""
    _on_emulator()
    case = make(arch, 16, 8, contexts=(5, 33, 270), num_kv_heads=1, seed=3)
    k, v = case.k_cache.view(torch.uint8), case.v_cache.view(torch.uint8)
    for s, L in enumerate(case.context_lengths.tolist()):
        last = int(case.block_tables[s, (L - 1) // 16])
        k[last, :, L % 16:, :] = NAN_CODE[FMT[arch]]
        v[last, :, L % 16:, :] = NAN_CODE[FMT[arch]]
    want = case.reference()
    assert torch.isfinite(want).all()
    assert_close_to_reference(run(case, arch), want, case)


def test_softmax_scale_and_out_argument():
    _on_emulator()
    case = make("gfx942", 64, 16, contexts=(300, 40), num_kv_heads=1, seed=5)
    out = torch.full_like(case.query, float("nan"))
    got = s1.paged_decode(case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
                          case.k_scale, case.v_scale, softmax_scale=0.2, out=out, arch="gfx942")
    assert got is out
    assert_close_to_reference(out, case.reference(softmax_scale=0.2), case)
    assert_matches_model(out, kernel_model(case, "gfx942", softmax_scale=0.2), case)


def test_uint8_codes_are_accepted():
    _on_emulator()
    case = make("gfx942", 16, 8, contexts=(40,), num_kv_heads=1, seed=6)
    got = s1.paged_decode(case.query, case.k_cache.view(torch.uint8), case.v_plain().view(torch.uint8),
                          case.block_tables, case.context_lengths, case.k_scale, case.v_scale, arch="gfx942")
    assert_close_to_reference(got, case.reference(), case)


# ───────────────────────── argument checking ─────────────────────────


def _good():
    case = make("gfx942", 16, 8, contexts=(17, 3), num_kv_heads=1)
    return dict(query=case.query, key_cache=case.k_cache, value_cache=case.v_plain(),
                block_tables=case.block_tables, context_lengths=case.context_lengths,
                key_scale=case.k_scale, value_scale=case.v_scale)


def _set(name, value):
    return lambda a: {**a, name: value(a) if callable(value) else value}


BAD = [
    ("query", TypeError, _set("query", lambda a: a["query"].float())),
    ("query", TypeError, _set("query", lambda a: a["query"].tolist())),
    ("query", ValueError, _set("query", lambda a: a["query"][..., :64].contiguous())),
    ("query", ValueError, _set("query", lambda a: a["query"].transpose(0, 1))),
    ("query", ValueError, _set("query", lambda a: a["query"][:, :4].contiguous())),  # group of 4
    # the other arch's flavour: a ValueError in every stage (pa_tile.problem), not a wrong type
    ("key_cache", ValueError, _set("key_cache", lambda a: a["key_cache"].view(torch.float8_e4m3fn))),
    ("key_cache", ValueError, _set("key_cache", lambda a: a["key_cache"][:, :, :8].contiguous())),  # block 8
    ("value_cache", ValueError, _set("value_cache", lambda a: a["value_cache"].transpose(2, 3).contiguous())),
    ("value_cache", TypeError, _set("value_cache", lambda a: a["value_cache"].to(torch.float16))),
    ("block_tables", TypeError, _set("block_tables", lambda a: a["block_tables"].long())),
    ("block_tables", ValueError, _set("block_tables", lambda a: a["block_tables"][:1])),
    ("block_tables", ValueError, _set("block_tables", lambda a: torch.full_like(a["block_tables"], -1))),
    ("context_lengths", TypeError, _set("context_lengths", lambda a: a["context_lengths"].long())),
    ("context_lengths", ValueError, _set("context_lengths", lambda a: torch.tensor([0, 3], dtype=torch.int32))),
    ("context_lengths", ValueError, _set("context_lengths", lambda a: torch.tensor([33, 3], dtype=torch.int32))),
    ("key_scale", ValueError, _set("key_scale", -0.5)),  # floats are accepted (every stage); > 0 only
    ("key_scale", TypeError, _set("key_scale", lambda a: a["key_scale"].double())),
    ("value_scale", ValueError, _set("value_scale", torch.ones(2))),
]


@pytest.mark.parametrize("name,error,mutate", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_argument_is_named_before_anything_is_built(name, error, mutate, monkeypatch):
    monkeypatch.setattr(s1, "build_launcher", lambda *a, **k: pytest.fail("built a kernel for bad input"))
    with pytest.raises(error, match=f"^{name}:"):
        s1.paged_decode(**mutate(_good()), arch="gfx942")


@pytest.mark.parametrize("kwargs,name,error", [
    (dict(arch="gfx90a"), "arch", ValueError),
    (dict(arch="gfx942", softmax_scale="0.1"), "softmax_scale", TypeError),
    (dict(arch="gfx942", softmax_scale=float("inf")), "softmax_scale", ValueError),
    (dict(arch="gfx942", out=torch.empty(2, 8, 128)), "out", ValueError),
    (dict(arch="gfx942", out=torch.empty(2, 8, 128, dtype=torch.float16, device="meta")), "out", ValueError),
    (dict(arch="gfx950"), "key_cache", ValueError),  # FNUZ codes handed to gfx950
])
def test_bad_keyword_is_named(kwargs, name, error, monkeypatch):
    monkeypatch.setattr(s1, "build_launcher", lambda *a, **k: pytest.fail("built a kernel for bad input"))
    with pytest.raises(error, match=f"^{name}:"):
        s1.paged_decode(**_good(), **kwargs)


# ───────────────────────── what it compiles to ─────────────────────────


@pytest.mark.parametrize("block_size", s1.LIMITS.block_sizes)
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_code_shape(arch, block_size):
    """Design facts of the compiled kernel: 16 MFMAs per product per wave, 64-bit gathers for
    K and V (16 + 16 per thread and tile), the 22.6 KB of LDS, no scratch."""
    case = make(arch, block_size, 8, contexts=(17,), num_kv_heads=1)
    launcher, args, _ = s1.launch_args(case.query, case.k_cache, case.v_plain(), case.block_tables,
                                       case.context_lengths, case.k_scale, case.v_scale, arch=arch)
    st = isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))
    assert st.count("v_mfma_f32_16x16x32_fp8_fp8") == 32
    assert st.count("buffer_load_dwordx2") == 32
    assert st.lds_bytes == 2048 + 16384 + 4096 + 64
    assert st.scratch_bytes == 0 and st.vgpr_spill == 0
    assert st.main_loop is not None and st.main_loop.families["barrier"] == 3  # three per tile


# ───────────────────────── on a ROCm GPU ─────────────────────────


@pytest.mark.rocm
@pytest.mark.parametrize("group", s1.LIMITS.groups)
@pytest.mark.parametrize("block_size", s1.LIMITS.block_sizes)
def test_gpu_kernel_matches_reference(block_size, group):
    if backend.current_backend() != "gpu":
        pytest.skip("needs a ROCm GPU")
    arch = backend.default_arch()
    if arch not in ARCHS:
        pytest.skip(f"stage 1 targets {ARCHS}, this GPU is {arch}")
    case = make(arch, block_size, group)
    got = run(case, arch, device="cuda")
    assert_close_to_reference(got, case.reference(), case)
    assert_matches_model(got, kernel_model(case, arch), case)
