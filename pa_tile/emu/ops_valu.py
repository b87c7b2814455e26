"""Vector ALU: VOP1/VOP2/VOP3 (incl. carry ops and cndmask), VOPC, VOP3P, DPP and SDWA forms,
and the cross-lane moves (readlane, writelane, readfirstlane, mbcnt, permlane swaps).

Per-lane semantics follow the CDNA3 ISA guide, chapter 12 (instruction pseudo-code) and
chapter 6 ("Vector ALU Operations": EXEC masking, VOPC/carry-out writes 0 for inactive lanes,
DPP, SDWA). Float arithmetic uses numpy float32, which is IEEE round-to-nearest-even with
denormals kept (FlyDSL kernels run with denormals enabled); ops whose hardware corner cases
differ from plain IEEE (min/max NaN rules, fma, transcendentals, conversions) go through
``numerics``.
"""

from __future__ import annotations

import numpy as np

from . import numerics as nx
from .ops_base import LANES, M32, WIDTH, as_u32, op, words_from_mask

U32 = np.uint32
U64 = np.uint64
_LANE = np.arange(LANES)


# --------------------------------------------------------------------------- DPP / SDWA

def _dpp_pattern(ctx):
    """(source lane per lane, static validity) for the DPP control of this instruction."""
    m = ctx.mods
    i = _LANE
    row_base = i & ~15
    r = i & 15
    if "quad_perm" in m:
        q = np.array(m["quad_perm"])
        return (i & ~3) + q[i & 3], np.ones(LANES, bool)
    if "row_shl" in m:
        n = m["row_shl"]
        return np.where(r + n < 16, i + n, i), r + n < 16
    if "row_shr" in m:
        n = m["row_shr"]
        return np.where(r - n >= 0, i - n, i), r - n >= 0
    if "row_ror" in m:
        n = m["row_ror"]
        return row_base + ((r - n) & 15), np.ones(LANES, bool)
    if "wave_shl" in m:
        return np.minimum(i + 1, 63), i < 63
    if "wave_shr" in m:
        return np.maximum(i - 1, 0), i > 0
    if "wave_rol" in m:
        return (i + 1) & 63, np.ones(LANES, bool)
    if "wave_ror" in m:
        return (i - 1) & 63, np.ones(LANES, bool)
    if "row_mirror" in m:
        return row_base + 15 - r, np.ones(LANES, bool)
    if "row_half_mirror" in m:
        return (i & ~7) + 7 - (i & 7), np.ones(LANES, bool)
    if "row_bcast" in m:
        n = m["row_bcast"]
        if n == 15:
            return np.maximum(row_base - 1, 0), row_base > 0
        if n == 31:
            return np.full(LANES, 31), i >= 32
        raise ctx.fail(f"row_bcast:{n}")
    raise ctx.fail("DPP instruction without a DPP control")


def _dpp(ctx, r0):
    """Wrap the src0 reader; returns (reader -> (values, write_mask)).

    CDNA3 ISA §6 "DPP": a source lane that is out of range -- or disabled in EXEC -- is invalid.
    With BOUND_CTRL set (``bound_ctrl:0`` and ``bound_ctrl:1`` both set it in LLVM's syntax for
    gfx9) an invalid source reads 0; otherwise the destination lane is not written.
    row_mask/bank_mask disable whole rows / 4-lane banks of the destination.
    """
    src, valid = _dpp_pattern(ctx)
    m = ctx.mods
    row_mask = m.get("row_mask", 0xF)
    bank_mask = m.get("bank_mask", 0xF)
    bound = "bound_ctrl" in m
    wmask = (((row_mask >> (_LANE >> 4)) & 1) & ((bank_mask >> ((_LANE >> 2) & 3)) & 1)).astype(bool)
    unknown = set(m) - {"quad_perm", "row_shl", "row_shr", "row_ror", "wave_shl", "wave_shr", "wave_rol",
                        "wave_ror", "row_mirror", "row_half_mirror", "row_bcast", "row_mask", "bank_mask",
                        "bound_ctrl", "clamp"}
    if unknown:
        raise ctx.fail(f"DPP modifiers {sorted(unknown)}")
    all_valid = bool(valid.all())

    def rd(w):
        x = np.broadcast_to(r0(w), (LANES,))[src]
        ok = valid if w.eall else (valid & w.em[src])
        if bound:
            if not (all_valid and w.eall):
                x = np.where(ok, x, x.dtype.type(0))
            return x, wmask
        return x, (wmask if all_valid and w.eall else wmask & ok)
    return rd


_SEL = {"BYTE_0": (0, 8), "BYTE_1": (8, 8), "BYTE_2": (16, 8), "BYTE_3": (24, 8),
        "WORD_0": (0, 16), "WORD_1": (16, 16), "DWORD": (0, 32)}


def _sdwa_src(ctx, o, sel_name, typ):
    """SDWA source: the selected byte/word, zero- or (with sext()) sign-extended, then the
    float neg/abs modifiers, viewed as *typ* (CDNA3 §6 "SDWA")."""
    sel = ctx.mods.get(sel_name, "DWORD")
    if sel not in _SEL:
        raise ctx.fail(f"{sel_name}:{sel}")
    shift, bits = _SEL[sel]
    raw = ctx.vread(_bare(o), "u32")
    width = WIDTH[typ]
    fm, sh, sign, top = U32((1 << bits) - 1), U32(shift), U32(1 << (bits - 1)), U32(1 << (width - 1))
    sext, neg, ab = o.sext and bits < 32, o.neg, o.abs
    dt = {"f32": np.float32, "i32": np.int32, "u32": np.uint32, "f16": np.float16, "i16": np.int16,
          "u16": np.uint16}[typ]

    def rd(w):
        x = (raw(w) >> sh) & fm if bits < 32 else raw(w)
        if sext:
            x = (x ^ sign) - sign
        if ab:
            x = x & ~top
        if neg:
            x = x ^ top
        return x.astype(np.uint16).view(dt) if width == 16 else x.view(dt)
    return rd


def _bare(o):
    """The operand without source modifiers."""
    return o.__class__(o.kind, index=o.index, count=o.count, value=o.value, name=o.name, literal=o.literal)


def _sdwa_dst(ctx, wr):
    sel = ctx.mods.get("dst_sel", "DWORD")
    unused = ctx.mods.get("dst_unused", "UNUSED_PAD")
    if sel not in _SEL or unused not in ("UNUSED_PAD", "UNUSED_SEXT", "UNUSED_PRESERVE"):
        raise ctx.fail(f"dst_sel:{sel} dst_unused:{unused}")
    shift, bits = _SEL[sel]
    if bits == 32:
        return wr
    row = ctx.vrow(ctx.ops[0])
    fm = U32((1 << bits) - 1)
    sh = U32(shift)
    field = U32(((1 << bits) - 1) << shift)

    def w_(w, r, m=None):
        v = (as_u32(r) & fm) << sh
        if unused == "UNUSED_PRESERVE":
            v = (w.v[row] & ~field) | v
        elif unused == "UNUSED_SEXT":
            top = (v >> U32(shift + bits - 1)) & U32(1)
            v = v | np.where(top.astype(bool), U32(M32) & ~U32((1 << (shift + bits)) - 1), U32(0))
        wr(w, v, m)
    return w_


# --------------------------------------------------------------------------- generic VALU

def _post(ctx, dst_t, fn):
    """Apply VOP3 clamp (float: to [0, 1], NaN -> 0 under DX10_CLAMP) to a result function."""
    if "mul" in ctx.mods or "div" in ctx.mods:
        # Output modifiers are ignored by hardware when IEEE mode / denormals are on (CDNA3 §6.1),
        # which is how FlyDSL kernels run; LLVM never emits them there.
        raise ctx.fail("output modifiers (mul:/div:) are not emulated")
    if not ctx.mods.get("clamp"):
        return fn
    if dst_t == "f32":
        def clamped(*a):
            r = np.asarray(fn(*a))
            if r.dtype != np.float32:
                r = r.view(np.float32)
            return np.where(np.isnan(r), np.float32(0), np.clip(r, np.float32(0), np.float32(1))).astype(np.float32)
        return clamped
    raise ctx.fail("clamp on a non-f32 result")


def vop(ctx, dst_t, src_ts, fn, *, op_sel_ok=False):
    """Plain VALU op: ``ops[0] = fn(ops[1], ...)`` with EXEC, DPP, SDWA, neg/abs, clamp handled."""
    n = len(src_ts)
    ctx.need(1 + n)
    ops = ctx.ops
    hi = [False] * (n + 1)
    if "op_sel" in ctx.mods:
        sel = ctx.mods["op_sel"]
        if not op_sel_ok and any(sel):
            raise ctx.fail("op_sel")
        hi = list(sel) + [False] * (n + 1 - len(sel))
    if ctx.enc == "sdwa":
        readers = [_sdwa_src(ctx, ops[1 + i], f"src{i}_sel", t) for i, t in enumerate(src_ts)]
    else:
        readers = [ctx.vread(ops[1 + i], t, hi=hi[i]) for i, t in enumerate(src_ts)]
    wr = ctx.vwrite(ops[0], dst_t, hi=hi[n] if len(hi) > n else False)
    if ctx.enc == "sdwa":
        wr = _sdwa_dst(ctx, wr)
    fn = _post(ctx, dst_t, fn)
    if ctx.enc == "dpp":
        if ops[1].kind != "v":
            raise ctx.fail("DPP src0 must be a VGPR")
        d0 = _dpp(ctx, readers[0])
        rest = readers[1:]
        if n == 1:
            def h(w):
                x, m = d0(w)
                wr(w, fn(x), m)
        else:
            def h(w):
                x, m = d0(w)
                wr(w, fn(x, *[r(w) for r in rest]), m)
        return h
    if n == 1:
        r0, = readers
        return lambda w: wr(w, fn(r0(w)))
    if n == 2:
        r0, r1 = readers
        return lambda w: wr(w, fn(r0(w), r1(w)))
    if n == 3:
        r0, r1, r2 = readers
        return lambda w: wr(w, fn(r0(w), r1(w), r2(w)))
    return lambda w: wr(w, fn(*[r(w) for r in readers]))


def _reg(names, dst_t, src_ts, fn, archs=None, **kw):
    for name in names.split():
        op(name, archs=archs)(lambda ctx, fn=fn: vop(ctx, dst_t, src_ts, fn, **kw))


G950 = ("gfx950",)


F, I, U = "f32", "i32", "u32"
_f = np.float32


def _sh(b):
    return b & U32(31)


# The hottest float ops: numerics keeps both the exact corner-case rules and a cheap check
# for when a plain numpy evaluation already equals them.
_fma, _max, _min = nx.fma_f32, nx.max_f32, nx.min_f32


# ---- VOP1/VOP2 float
_reg("v_add_f32", F, (F, F), lambda a, b: a + b)
_reg("v_sub_f32", F, (F, F), lambda a, b: a - b)
_reg("v_subrev_f32", F, (F, F), lambda a, b: b - a)
_reg("v_mul_f32", F, (F, F), lambda a, b: a * b)
_reg("v_max_f32", F, (F, F), _max)
_reg("v_min_f32", F, (F, F), _min)
_reg("v_fma_f32", F, (F, F, F), _fma)
_reg("v_mad_f32", F, (F, F, F), lambda a, b, c: a * b + c)
_reg("v_max3_f32", F, (F, F, F), lambda a, b, c: _max(_max(a, b), c))
_reg("v_min3_f32", F, (F, F, F), lambda a, b, c: _min(_min(a, b), c))
_reg("v_maximum3_f32", F, (F, F, F), lambda a, b, c: nx.maximum3_f32(a, b, c), archs=G950)
_reg("v_minimum3_f32", F, (F, F, F), lambda a, b, c: nx.minimum3_f32(a, b, c), archs=G950)
_reg("v_ldexp_f32", F, (F, I), lambda a, b: nx.ldexp_f32(a, b))
_reg("v_exp_f32", F, (F,), lambda a: nx.exp2_f32(a))
_reg("v_log_f32", F, (F,), lambda a: nx.log2_f32(a))
_reg("v_rcp_f32 v_rcp_iflag_f32", F, (F,), lambda a: nx.rcp_f32(a))
_reg("v_rsq_f32", F, (F,), lambda a: nx.rsq_f32(a))
_reg("v_sqrt_f32", F, (F,), lambda a: nx.sqrt_f32(a))
_reg("v_floor_f32", F, (F,), lambda a: np.floor(a))
_reg("v_ceil_f32", F, (F,), lambda a: np.ceil(a))
_reg("v_trunc_f32", F, (F,), lambda a: np.trunc(a))
_reg("v_rndne_f32", F, (F,), lambda a: np.rint(a))
_reg("v_fract_f32", F, (F,), lambda a: np.where(np.isinf(a), _f(np.nan), np.minimum(a - np.floor(a), _f(0.99999994))))


def _med3(a, b, c):
    # CDNA3 V_MED3_F32: NaN handling aside, the median of three.
    return _max(_min(a, b), _min(_max(a, b), c))


_reg("v_med3_f32", F, (F, F, F), _med3)


@op("v_fmac_f32", "v_mac_f32")
def _fmac(ctx):
    """D = S0 * S1 + D (fmac fused, mac with an intermediate rounding)."""
    ctx.need(3)
    fused = ctx.base == "v_fmac_f32"
    fn = _fma if fused else (lambda a, b, c: a * b + c)
    ctx.ops = ctx.ops + (ctx.ops[0],)
    return vop(ctx, F, (F, F, F), fn)


@op("v_fmamk_f32")
def _fmamk(ctx):  # D = S0 * K + S1, K printed in the middle
    return vop(ctx, F, (F, F, F), _fma)


@op("v_fmaak_f32")
def _fmaak(ctx):  # D = S0 * S1 + K
    return vop(ctx, F, (F, F, F), _fma)


# ---- conversions
def _f2u(a):
    a = np.nan_to_num(np.trunc(a.astype(np.float64)), nan=0.0)
    return np.clip(a, 0, 4294967295.0).astype(np.uint64).astype(U32)


def _f2i(a):
    a = np.nan_to_num(np.trunc(a.astype(np.float64)), nan=0.0)
    return np.clip(a, -2147483648.0, 2147483647.0).astype(np.int64).astype(np.int32)


_reg("v_cvt_f32_i32", F, (I,), lambda a: a.astype(np.float32))
_reg("v_cvt_f32_u32", F, (U,), lambda a: a.astype(np.float32))
_reg("v_cvt_u32_f32", U, (F,), _f2u)
_reg("v_cvt_i32_f32", I, (F,), _f2i)
_reg("v_cvt_rpi_i32_f32", I, (F,), lambda a: _f2i(np.floor(a.astype(np.float64) + 0.5)))
_reg("v_cvt_flr_i32_f32", I, (F,), lambda a: _f2i(np.floor(a)))
for _k in range(4):
    _reg(f"v_cvt_f32_ubyte{_k}", F, (U,), (lambda k: lambda a: ((a >> U32(8 * k)) & U32(0xFF)).astype(np.float32))(_k))
_reg("v_cvt_f32_f16", F, ("u16",), lambda a: nx.f16_bits_to_f32(a))
_reg("v_cvt_f16_f32", "u16", (F,), lambda a: nx.f32_to_f16_bits(a))
_reg("v_cvt_f32_bf16", F, ("u16",), lambda a: nx.bf16_bits_to_f32(a))
_reg("v_cvt_pk_bf16_f32", U, (F, F), lambda a, b: nx.cvt_pk_bf16_f32(a, b), archs=G950)
_reg("v_cvt_pkrtz_f16_f32", U, (F, F), lambda a, b: _pkrtz(a, b))
_reg("v_cvt_pk_f16_f32", U, (F, F), lambda a, b: _pk16_bits(nx.f32_to_f16_bits(a), nx.f32_to_f16_bits(b)), archs=G950)


def _pk16_bits(lo, hi):
    return lo.astype(U32) | (hi.astype(U32) << U32(16))
_reg("v_pack_b32_f16", U, ("u16", "u16"), lambda a, b: a.astype(U32) | (b.astype(U32) << U32(16)), op_sel_ok=True)


def _pkrtz(a, b):
    def rtz(x):
        x = np.asarray(x, np.float32)
        h = x.astype(np.float16)
        # round toward zero: step back one f16 ulp where RNE rounded away from zero
        away = np.abs(h.astype(np.float32)) > np.abs(x)
        h = np.where(away & np.isfinite(x), np.nextafter(h, np.float16(0)), h)
        return h.view(np.uint16).astype(U32)
    return rtz(a) | (rtz(b) << U32(16))


# ---- integer / bitwise
_reg("v_mov_b32", U, (U,), lambda a: a)
_reg("v_mov_b64", "u64", ("u64",), lambda a: a)
_reg("v_not_b32", U, (U,), lambda a: ~a)
_reg("v_bfrev_b32", U, (U,), lambda a: _bitrev(a))
_reg("v_ffbh_u32", U, (U,), lambda a: _ffbh(a))
_reg("v_ffbl_b32", U, (U,), lambda a: _ffbl(a))
_reg("v_bcnt_u32_b32", U, (U, U), lambda a, b: _popcount(a) + b)
_reg("v_add_u32", U, (U, U), lambda a, b: a + b)
_reg("v_sub_u32", U, (U, U), lambda a, b: a - b)
_reg("v_subrev_u32", U, (U, U), lambda a, b: b - a)
_reg("v_and_b32", U, (U, U), lambda a, b: a & b)
_reg("v_or_b32", U, (U, U), lambda a, b: a | b)
_reg("v_xor_b32", U, (U, U), lambda a, b: a ^ b)
_reg("v_xnor_b32", U, (U, U), lambda a, b: ~(a ^ b))
_reg("v_lshlrev_b32", U, (U, U), lambda a, b: b << _sh(a))
_reg("v_lshrrev_b32", U, (U, U), lambda a, b: b >> _sh(a))
_reg("v_ashrrev_i32", I, (U, I), lambda a, b: b >> _sh(a).astype(np.int32))
_reg("v_max_i32", I, (I, I), np.maximum)
_reg("v_min_i32", I, (I, I), np.minimum)
_reg("v_max_u32", U, (U, U), np.maximum)
_reg("v_min_u32", U, (U, U), np.minimum)
_reg("v_max3_i32", I, (I, I, I), lambda a, b, c: np.maximum(np.maximum(a, b), c))
_reg("v_min3_i32", I, (I, I, I), lambda a, b, c: np.minimum(np.minimum(a, b), c))
_reg("v_max3_u32", U, (U, U, U), lambda a, b, c: np.maximum(np.maximum(a, b), c))
_reg("v_min3_u32", U, (U, U, U), lambda a, b, c: np.minimum(np.minimum(a, b), c))
_reg("v_med3_i32", I, (I, I, I), lambda a, b, c: np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c)))
_reg("v_med3_u32", U, (U, U, U), lambda a, b, c: np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c)))


def _s24(a):
    return ((a.astype(np.int64) & 0xFFFFFF) ^ 0x800000) - 0x800000


def _u24(a):
    return a.astype(np.uint64) & U64(0xFFFFFF)


_reg("v_mul_u32_u24", U, (U, U), lambda a, b: (_u24(a) * _u24(b)).astype(U32))
_reg("v_mul_hi_u32_u24", U, (U, U), lambda a, b: ((_u24(a) * _u24(b)) >> U64(32)).astype(U32))
_reg("v_mul_i32_i24", U, (U, U), lambda a, b: as_u32(_s24(a) * _s24(b)))
_reg("v_mul_hi_i32_i24", U, (U, U), lambda a, b: as_u32((_s24(a) * _s24(b)) >> 32))
_reg("v_mad_u32_u24", U, (U, U, U), lambda a, b, c: (_u24(a) * _u24(b)).astype(U32) + c)
_reg("v_mad_i32_i24", U, (U, U, U), lambda a, b, c: as_u32(_s24(a) * _s24(b)) + c)
_reg("v_mul_lo_u32", U, (U, U), lambda a, b: a * b)
_reg("v_mul_hi_u32", U, (U, U), lambda a, b: ((a.astype(U64) * b.astype(U64)) >> U64(32)).astype(U32))
_reg("v_mul_hi_i32", U, (I, I), lambda a, b: as_u32((a.astype(np.int64) * b.astype(np.int64)) >> 32))
_reg("v_add3_u32", U, (U, U, U), lambda a, b, c: a + b + c)
_reg("v_lshl_add_u32", U, (U, U, U), lambda a, b, c: (a << _sh(b)) + c)
_reg("v_add_lshl_u32", U, (U, U, U), lambda a, b, c: (a + b) << _sh(c))
_reg("v_lshl_or_b32", U, (U, U, U), lambda a, b, c: (a << _sh(b)) | c)
_reg("v_and_or_b32", U, (U, U, U), lambda a, b, c: (a & b) | c)
_reg("v_or3_b32", U, (U, U, U), lambda a, b, c: a | b | c)
_reg("v_xad_u32", U, (U, U, U), lambda a, b, c: (a ^ b) + c)
_reg("v_bfi_b32", U, (U, U, U), lambda a, b, c: (a & b) | (~a & c))
_reg("v_alignbit_b32", U, (U, U, U), lambda a, b, c: (((a.astype(U64) << U64(32)) | b) >> (c & U32(31)).astype(U64)).astype(U32))
_reg("v_alignbyte_b32", U, (U, U, U), lambda a, b, c: (((a.astype(U64) << U64(32)) | b) >> ((c & U32(3)) * U32(8)).astype(U64)).astype(U32))
_reg("v_lshlrev_b64", "u64", (U, "u64"), lambda a, b: b << (a & U32(63)).astype(U64))
_reg("v_lshrrev_b64", "u64", (U, "u64"), lambda a, b: b >> (a & U32(63)).astype(U64))
_reg("v_ashrrev_i64", "i64", (U, "i64"), lambda a, b: b >> (a & U32(63)).astype(np.int64))
_reg("v_lshl_add_u64", "u64", ("u64", U, "u64"), lambda a, b, c: (a << (b & U32(63)).astype(U64)) + c)


def _bfe(a, off, width, signed):
    off = (off & U32(31)).astype(U64)
    width = (width & U32(31)).astype(U64)
    x = (a.astype(U64) >> off) & ((U64(1) << width) - U64(1))
    if signed:
        sign = np.where(width > 0, U64(1) << np.maximum(width, U64(1)) - U64(1), U64(0))
        x = np.where(x & sign, x | ~((U64(1) << width) - U64(1)), x)
    return (x & U64(M32)).astype(U32)


_reg("v_bfe_u32", U, (U, U, U), lambda a, b, c: _bfe(a, b, c, False))
_reg("v_bfe_i32", U, (U, U, U), lambda a, b, c: _bfe(a, b, c, True))
_reg("v_bfm_b32", U, (U, U), lambda a, b: ((U32(1) << _sh(a)) - U32(1)) << _sh(b))


def _bitrev(a):
    a = a.astype(U32)
    out = np.zeros_like(a)
    for k in range(32):
        out |= ((a >> U32(k)) & U32(1)) << U32(31 - k)
    return out


def _popcount(a):
    a = a.astype(U32)
    return np.unpackbits(np.atleast_1d(a).view(np.uint8).reshape(-1, 4), axis=1).sum(axis=1).astype(U32)


def _ffbh(a):
    a = np.atleast_1d(a).astype(U32)
    n = np.full(a.shape, M32, U32)
    for k in range(31, -1, -1):
        n = np.where((n == U32(M32)) & (((a >> U32(k)) & U32(1)) == 1), U32(31 - k), n)
    return n


def _ffbl(a):
    a = np.atleast_1d(a).astype(U32)
    n = np.full(a.shape, M32, U32)
    for k in range(32):
        n = np.where((n == U32(M32)) & (((a >> U32(k)) & U32(1)) == 1), U32(k), n)
    return n


def _perm(s0, s1, sel):
    """V_PERM_B32 (CDNA3 §12.11): byte k of D = BYTE_PERMUTE({S0, S1}, S2[8k+7:8k])."""
    data = (s0.astype(U64) << U64(32)) | s1.astype(U64)
    out = np.zeros(np.broadcast(s0, s1, sel).shape, U32)
    for k in range(4):
        sl = ((sel >> U32(8 * k)) & U32(0xFF)).astype(U64)
        byte = (data >> (U64(8) * np.minimum(sl, U64(7)))) & U64(0xFF)
        sign = lambda bit: ((data >> U64(bit)) & U64(1)) * U64(0xFF)  # noqa: E731
        r = np.where(sl >= 13, U64(0xFF), np.where(sl == 12, U64(0),
            np.where(sl == 11, sign(63), np.where(sl == 10, sign(47), np.where(sl == 9, sign(31),
            np.where(sl == 8, sign(15), byte))))))
        out |= r.astype(U32) << U32(8 * k)
    return out


_reg("v_perm_b32", U, (U, U, U), _perm)


@op("v_bitop3_b32", archs=G950)
def _bitop3(ctx):
    """gfx950 V_BITOP3_B32: each result bit is ``ttbl[{S0, S1, S2}]`` (S0 the MSB of the index)."""
    tt = int(ctx.mods.get("bitop3", 0))
    mods = dict(ctx.mods)
    mods.pop("bitop3", None)
    ctx.mods = mods
    terms = [i for i in range(8) if tt >> i & 1]

    def fn(a, b, c):
        r = np.zeros(np.broadcast(a, b, c).shape, U32)
        for i in terms:
            r |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        return r
    return vop(ctx, U, (U, U, U), fn)


@op("v_cvt_pk_fp8_f32", "v_cvt_pk_bf8_f32")
def _cvt_pk_8(ctx):
    """V_CVT_PK_FP8_F32: two f32 -> two fp8 bytes in the low or high word (op_sel on the dst)."""
    ctx.need(3)
    sel = ctx.mods.get("op_sel", (0, 0, 0))
    word_hi = bool(sel[-1]) if len(sel) == 3 else False
    if any(sel[:2]):
        raise ctx.fail("op_sel on the sources")
    extra = set(ctx.mods) - {"op_sel", "clamp"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    fmt = nx.fp8_format_for_arch(ctx.arch)
    sat = bool(ctx.desc.get("fp16_overflow", 0))
    conv = nx.cvt_pk_fp8_f32 if ctx.base == "v_cvt_pk_fp8_f32" else nx.cvt_pk_bf8_f32
    r0 = ctx.vread(ctx.ops[1], F)
    r1 = ctx.vread(ctx.ops[2], F)
    row = ctx.vrow(ctx.ops[0])
    wr = ctx.vwrite(ctx.ops[0], U)
    return lambda w: wr(w, conv(r0(w), r1(w), w.v[row], word_hi, fmt, sat))


def _byte_sel(ctx):
    if ctx.enc == "sdwa":
        sel = ctx.mods.get("src0_sel", "BYTE_0")
        return {"BYTE_0": 0, "BYTE_1": 1, "BYTE_2": 2, "BYTE_3": 3, "DWORD": 0, "WORD_0": 0, "WORD_1": 2}[sel]
    s = ctx.mods.get("op_sel", (0, 0))
    return (s[0] if len(s) > 0 else 0) | ((s[1] if len(s) > 1 else 0) << 1)


@op("v_cvt_f32_fp8", "v_cvt_f32_bf8")
def _cvt_f32_fp8(ctx):
    ctx.need(2)
    k = _byte_sel(ctx)
    fmt = nx.fp8_format_for_arch(ctx.arch)
    conv = nx.cvt_f32_fp8 if ctx.base == "v_cvt_f32_fp8" else nx.cvt_f32_bf8
    raw = ctx.vread(_bare(ctx.ops[1]), U)
    wr = ctx.vwrite(ctx.ops[0], F)
    return lambda w: wr(w, conv(np.broadcast_to(raw(w), (LANES,)), k, fmt))


@op("v_cvt_pk_f32_fp8", "v_cvt_pk_f32_bf8")
def _cvt_pk_f32_fp8(ctx):
    ctx.need(2)
    if ctx.enc == "sdwa":
        word_hi = ctx.mods.get("src0_sel", "WORD_0") == "WORD_1"
    else:
        word_hi = bool(ctx.mods.get("op_sel", (0,))[0])
    fmt = nx.fp8_format_for_arch(ctx.arch)
    conv = nx.cvt_pk_f32_fp8 if ctx.base == "v_cvt_pk_f32_fp8" else nx.cvt_pk_f32_bf8
    raw = ctx.vread(_bare(ctx.ops[1]), U)
    row = ctx.vrow(ctx.ops[0])
    wlo = ctx.vwrite(ctx.ops[0].__class__("v", index=row), F)
    whi = ctx.vwrite(ctx.ops[0].__class__("v", index=row + 1), F)

    def h(w):
        lo, hi = conv(np.broadcast_to(raw(w), (LANES,)), word_hi, fmt)
        wlo(w, lo)
        whi(w, hi)
    return h


# --------------------------------------------------------------------------- carry ops

def _carry_op(kind):
    """v_add_co/v_sub_co/v_subrev_co (carry out) and v_addc/v_subb/v_subbrev (carry in and out)."""
    def build(ctx):
        cin = kind in ("addc", "subb", "subbrev")
        ctx.need(5 if cin else 4)
        o = ctx.ops
        if ctx.enc in ("dpp", "sdwa"):
            raise ctx.fail("DPP/SDWA carry ops")
        ra = ctx.vread(o[2], U)
        rb = ctx.vread(o[3], U)
        rc = ctx.mask_read(o[4]) if cin else None
        wr = ctx.vwrite(o[0], U)
        wc = ctx.mask_write(o[1])
        clamp = bool(ctx.mods.get("clamp"))
        if set(ctx.mods) - {"clamp"}:
            raise ctx.fail(f"modifiers {sorted(ctx.mods)}")

        def h(w):
            a = ra(w).astype(np.int64)
            b = rb(w).astype(np.int64)
            c = rc(w).astype(np.int64) if cin else 0
            if kind in ("add", "addc"):
                r = a + b + c
                carry = r > M32
            elif kind in ("sub", "subb"):
                r = a - b - c
                carry = r < 0
            else:
                r = b - a - c
                carry = r < 0
            res = (np.clip(r, 0, M32) if clamp else (r & M32)).astype(U32)
            wr(w, res)
            wc(w, np.broadcast_to(carry, (LANES,)))
        return h
    return build


op("v_add_co_u32")(_carry_op("add"))
op("v_sub_co_u32")(_carry_op("sub"))
op("v_subrev_co_u32")(_carry_op("subrev"))
op("v_addc_co_u32")(_carry_op("addc"))
op("v_subb_co_u32")(_carry_op("subb"))
op("v_subbrev_co_u32")(_carry_op("subbrev"))


@op("v_mad_u64_u32", "v_mad_i64_i32")
def _mad64(ctx):
    """{carry, D.u64} = S0 * S1 + S2.u64 (CDNA3 §12.11); the carry is the 65th bit."""
    ctx.need(5)
    o = ctx.ops
    signed = ctx.base == "v_mad_i64_i32"
    t = I if signed else U
    ra = ctx.vread(o[2], t)
    rb = ctx.vread(o[3], t)
    rc = ctx.vread(o[4], "i64" if signed else "u64")
    wr = ctx.vwrite(o[0], "u64")
    wc = ctx.mask_write(o[1])

    def h(w):
        if signed:
            p = ra(w).astype(np.int64) * rb(w).astype(np.int64)
            c = rc(w)
            s = p + c
            carry = ((p >= 0) == (c >= 0)) & ((s >= 0) != (p >= 0))
            wr(w, s.view(U64))
        else:
            p = ra(w).astype(U64) * rb(w).astype(U64)
            s = p + rc(w)
            carry = s < p
            wr(w, s)
        wc(w, np.broadcast_to(carry, (LANES,)))
    return h


@op("v_cndmask_b32")
def _cndmask(ctx):
    """D = VCC/SGPR-pair lane bit ? S1 : S0 (neg/abs apply as float modifiers)."""
    ctx.need(4)
    o = ctx.ops
    if ctx.enc == "sdwa":
        r0 = _sdwa_src(ctx, o[1], "src0_sel", U)
        r1 = _sdwa_src(ctx, o[2], "src1_sel", U)
    else:
        r0 = ctx.vread(o[1], F if (o[1].neg or o[1].abs) else U)
        r1 = ctx.vread(o[2], F if (o[2].neg or o[2].abs) else U)
    rm = ctx.mask_read(o[3])
    wr = ctx.vwrite(o[0], U)
    if ctx.enc == "sdwa":
        wr = _sdwa_dst(ctx, wr)
    if ctx.enc == "dpp":
        d0 = _dpp(ctx, r0)

        def hd(w):
            x, m = d0(w)
            wr(w, np.where(rm(w), as_u32(r1(w)), as_u32(x)), m)
        return hd
    return lambda w: wr(w, np.where(rm(w), as_u32(r1(w)), as_u32(r0(w))))


# --------------------------------------------------------------------------- VOPC

_FCMP = {
    "f": lambda a, b: np.zeros(np.broadcast(a, b).shape, bool),
    "lt": lambda a, b: a < b,
    "eq": lambda a, b: a == b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "lg": lambda a, b: (a < b) | (a > b),
    "ge": lambda a, b: a >= b,
    "o": lambda a, b: ~(np.isnan(a) | np.isnan(b)),
    "u": lambda a, b: np.isnan(a) | np.isnan(b),
    "nge": lambda a, b: ~(a >= b),
    "nlg": lambda a, b: ~((a < b) | (a > b)),
    "ngt": lambda a, b: ~(a > b),
    "nle": lambda a, b: ~(a <= b),
    "neq": lambda a, b: ~(a == b),
    "nlt": lambda a, b: ~(a < b),
    "tru": lambda a, b: np.ones(np.broadcast(a, b).shape, bool),
}
_ICMP = {
    "f": _FCMP["f"],
    "lt": lambda a, b: a < b,
    "eq": lambda a, b: a == b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ne": lambda a, b: a != b,
    "lg": lambda a, b: a != b,
    "ge": lambda a, b: a >= b,
    "t": _FCMP["tru"],
}


def _vopc(fn, typ, write_exec):
    def build(ctx):
        ctx.need(3)
        o = ctx.ops
        if ctx.enc == "sdwa":
            r0 = _sdwa_src(ctx, o[1], "src0_sel", typ)
            r1 = _sdwa_src(ctx, o[2], "src1_sel", typ)
        else:
            r0 = ctx.vread(o[1], typ)
            r1 = ctx.vread(o[2], typ)
        if ctx.enc == "dpp":
            raise ctx.fail("DPP compares")
        wm = ctx.mask_write(o[0])
        extra = set(ctx.mods) - {"src0_sel", "src1_sel", "clamp"}
        if extra:
            raise ctx.fail(f"modifiers {sorted(extra)}")
        if not write_exec:
            return lambda w: wm(w, np.broadcast_to(fn(r0(w), r1(w)), (LANES,)))

        def hx(w):
            # V_CMPX (gfx9): the result goes to the SGPR destination and to EXEC.
            m = np.broadcast_to(fn(r0(w), r1(w)), (LANES,)) & w.em
            wm(w, m)
            w.s[126:128] = words_from_mask(m)
            w.sync_exec()
        return hx
    return build


for _c, _fn in _FCMP.items():
    for _t in ("f32", "f64", "f16"):
        op(f"v_cmp_{_c}_{_t}")(_vopc(_fn, _t, False))
        op(f"v_cmpx_{_c}_{_t}")(_vopc(_fn, _t, True))
for _c, _fn in _ICMP.items():
    for _t in ("i32", "u32", "i64", "u64", "i16", "u16"):
        if _c == "lg":
            continue
        op(f"v_cmp_{_c}_{_t}")(_vopc(_fn, _t, False))
        op(f"v_cmpx_{_c}_{_t}")(_vopc(_fn, _t, True))


def _classify(a, mask):
    """V_CMP_CLASS_F32: bit of S1 for the class of S0 (0 sNaN, 1 qNaN, 2 -inf, 3 -norm,
    4 -denorm, 5 -0, 6 +0, 7 +denorm, 8 +norm, 9 +inf)."""
    # S1 is a bit mask, but the compare builder reads both sources as f32: use its bits.
    mask = np.asarray(mask).view(U32)
    b = np.atleast_1d(a).view(U32)
    neg = (b >> U32(31)) == 1
    exp = (b >> U32(23)) & U32(0xFF)
    man = b & U32(0x7FFFFF)
    cls = np.where(exp == 255,
                   np.where(man == 0, np.where(neg, 2, 9), np.where(man & U32(0x400000), 1, 0)),
                   np.where(exp == 0,
                            np.where(man == 0, np.where(neg, 5, 6), np.where(neg, 4, 7)),
                            np.where(neg, 3, 8)))
    return ((mask >> cls.astype(U32)) & U32(1)).astype(bool)


op("v_cmp_class_f32")(_vopc(_classify, "f32", False))
op("v_cmpx_class_f32")(_vopc(_classify, "f32", True))


# --------------------------------------------------------------------------- VOP3P

def _pk_mods(ctx, n):
    m = ctx.mods
    op_sel = tuple(m.get("op_sel", (0,) * n)) + (0,) * n
    op_sel_hi = tuple(m.get("op_sel_hi", (1,) * n)) + (1,) * n
    neg_lo = tuple(m.get("neg_lo", (0,) * n)) + (0,) * n
    neg_hi = tuple(m.get("neg_hi", (0,) * n)) + (0,) * n
    extra = set(m) - {"op_sel", "op_sel_hi", "neg_lo", "neg_hi", "clamp"}
    if extra or m.get("clamp"):
        raise ctx.fail(f"modifiers {sorted(extra) or ['clamp']}")
    return op_sel[:n], op_sel_hi[:n], neg_lo[:n], neg_hi[:n]


def _pk32_src(ctx, o):
    """Both dwords of a 64-bit packed-f32 source as uint32 arrays (lo, hi)."""
    if o.kind == "imm":
        rd = ctx.vread(o, U)
        return lambda w: (rd(w), rd(w))
    if o.kind in ("v", "a", "s"):
        lo = ctx.vread(o.__class__(o.kind, index=o.index, count=1), U)
        hi = ctx.vread(o.__class__(o.kind, index=o.index + 1, count=1), U)
        return lambda w: (lo(w), hi(w))
    raise ctx.fail(f"bad packed source {o}")


def _pk_f32(fn, n):
    """v_pk_{add,mul,fma}_f32: two independent f32 lanes per register pair (CDNA3 §12.11 VOP3P)."""
    def build(ctx):
        ctx.need(n + 1)
        op_sel, op_sel_hi, neg_lo, neg_hi = _pk_mods(ctx, n)
        srcs = [_pk32_src(ctx, o) for o in ctx.ops[1:]]
        row = ctx.vrow(ctx.ops[0])
        wlo = ctx.vwrite(ctx.ops[0].__class__("v", index=row), F)
        whi = ctx.vwrite(ctx.ops[0].__class__("v", index=row + 1), F)
        sign = U32(0x80000000)
        zero = U32(0)
        nl = [sign if x else zero for x in neg_lo]
        nh = [sign if x else zero for x in neg_hi]

        if n == 2 and not any(neg_lo) and not any(neg_hi):
            # the common form (no neg): no per-call lists, no sign flips. Both halves are
            # computed before either is written (a source may overlap the destination).
            (s0, s1), (a0, a1), (b0, b1) = srcs, op_sel, op_sel_hi

            def h2(w):
                v0, v1 = s0(w), s1(w)
                rlo = fn(v0[a0].view(np.float32), v1[a1].view(np.float32))
                rhi = fn(v0[b0].view(np.float32), v1[b1].view(np.float32))
                wlo(w, rlo)
                whi(w, rhi)
            return h2

        def h(w):
            vals = [s(w) for s in srcs]
            lo = [(v[op_sel[i]] ^ nl[i]).view(np.float32) for i, v in enumerate(vals)]
            hi = [(v[op_sel_hi[i]] ^ nh[i]).view(np.float32) for i, v in enumerate(vals)]
            rlo = fn(*lo)
            rhi = fn(*hi)
            wlo(w, rlo)
            whi(w, rhi)
        return h
    return build


op("v_pk_add_f32")(_pk_f32(lambda a, b: a + b, 2))
op("v_pk_mul_f32")(_pk_f32(lambda a, b: a * b, 2))
op("v_pk_fma_f32")(_pk_f32(_fma, 3))


@op("v_pk_mov_b32")
def _pk_mov(ctx):
    """D.lo = S0[op_sel[0]], D.hi = S1[op_sel[1]] (dwords of the 64-bit sources)."""
    ctx.need(3)
    sel = tuple(ctx.mods.get("op_sel", (0, 0))) + (0, 0)
    if set(ctx.mods) - {"op_sel", "op_sel_hi"}:
        raise ctx.fail(f"modifiers {sorted(ctx.mods)}")
    s0 = _pk32_src(ctx, ctx.ops[1])
    s1 = _pk32_src(ctx, ctx.ops[2])
    row = ctx.vrow(ctx.ops[0])
    wlo = ctx.vwrite(ctx.ops[0].__class__("v", index=row), U)
    whi = ctx.vwrite(ctx.ops[0].__class__("v", index=row + 1), U)

    def h(w):
        # The sources are views of register rows and D may overlap them (LLVM emits
        # v_pk_mov_b32 v[4:5], v[20:21], v[4:5] op_sel:[1,0]): copy both before writing either.
        a = np.array(s0(w)[sel[0]])
        b = np.array(s1(w)[sel[1]])
        wlo(w, a)
        whi(w, b)
    return h


def _pk16(fn, n, typ="f16"):
    """Packed 16-bit VOP3P: result half k uses source half op_sel[i] (lo) / op_sel_hi[i] (hi)."""
    def build(ctx):
        ctx.need(n + 1)
        op_sel, op_sel_hi, neg_lo, neg_hi = _pk_mods(ctx, n)
        srcs = [ctx.vread(o, U) for o in ctx.ops[1:]]
        wr = ctx.vwrite(ctx.ops[0], U)
        fl = typ == "f16"

        def half(x, sel, neg):
            h = ((x >> U32(16)) if sel else x).astype(np.uint16)
            if neg and fl:
                h = h ^ np.uint16(0x8000)
            return h.view(np.float16) if fl else h

        def h(w):
            vals = [s(w) for s in srcs]
            lo = fn(*[half(v, op_sel[i], neg_lo[i]) for i, v in enumerate(vals)])
            hi = fn(*[half(v, op_sel_hi[i], neg_hi[i]) for i, v in enumerate(vals)])
            lo = np.asarray(lo).astype(np.float16 if fl else np.uint16).view(np.uint16).astype(U32)
            hi = np.asarray(hi).astype(np.float16 if fl else np.uint16).view(np.uint16).astype(U32)
            wr(w, lo | (hi << U32(16)))
        return h
    return build


def _fma16(a, b, c):
    # f16 products are exact in f32 and the f32 sum rounds once more: exact enough unless the
    # sum itself lands on an f16 tie after f32 rounding (f32 has 13 spare bits, so only when the
    # exact sum needs more than 24 bits); compute in float64 to make that impossible.
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float16)


op("v_pk_add_f16")(_pk16(lambda a, b: a + b, 2))
op("v_pk_mul_f16")(_pk16(lambda a, b: a * b, 2))
op("v_pk_fma_f16")(_pk16(_fma16, 3))
op("v_pk_max_f16")(_pk16(lambda a, b: np.fmax(a, b), 2))
op("v_pk_min_f16")(_pk16(lambda a, b: np.fmin(a, b), 2))
op("v_pk_add_u16")(_pk16(lambda a, b: a + b, 2, "u16"))


def _f16op(fn, n):
    def build(ctx):
        return vop(ctx, "f16", ("f16",) * n, lambda *a: np.asarray(fn(*a)).astype(np.float16), op_sel_ok=True)
    return build


op("v_add_f16")(_f16op(lambda a, b: a + b, 2))
op("v_sub_f16")(_f16op(lambda a, b: a - b, 2))
op("v_mul_f16")(_f16op(lambda a, b: a * b, 2))
op("v_fma_f16")(_f16op(_fma16, 3))
op("v_max_f16")(_f16op(lambda a, b: np.fmax(a, b), 2))
op("v_min_f16")(_f16op(lambda a, b: np.fmin(a, b), 2))


@op("v_accvgpr_read_b32", "v_accvgpr_write_b32", "v_accvgpr_mov_b32")
def _accvgpr(ctx):
    ctx.need(2)
    return vop(ctx, U, (U,), lambda a: a)


# --------------------------------------------------------------------------- cross-lane

@op("v_readlane_b32")
def _readlane(ctx):
    ctx.need(3)
    src = ctx.vread(ctx.ops[1], U)
    lane = ctx.sread(ctx.ops[2])
    wr = ctx.swrite(ctx.ops[0])
    return lambda w: wr(w, int(np.broadcast_to(src(w), (LANES,))[lane(w) & 63]))


@op("v_readfirstlane_b32")
def _readfirstlane(ctx):
    ctx.need(2)
    src = ctx.vread(ctx.ops[1], U)
    wr = ctx.swrite(ctx.ops[0])

    def h(w):
        x = np.broadcast_to(src(w), (LANES,))
        lane = 0 if w.eall else (int(np.argmax(w.em)) if w.em.any() else 0)
        wr(w, int(x[lane]))
    return h


@op("v_writelane_b32")
def _writelane(ctx):
    """Writes one lane regardless of EXEC (CDNA3 §12, V_WRITELANE_B32)."""
    ctx.need(3)
    val = ctx.sread(ctx.ops[1])
    lane = ctx.sread(ctx.ops[2])
    row = ctx.vrow(ctx.ops[0])

    def h(w):
        w.v[row, lane(w) & 63] = val(w)
    return h


@op("v_mbcnt_lo_u32_b32", "v_mbcnt_hi_u32_b32")
def _mbcnt(ctx):
    """D = popcount(S0 & lanes-below-me mask, lo or hi half) + S1."""
    ctx.need(3)
    hi = ctx.base == "v_mbcnt_hi_u32_b32"
    lane = _LANE
    n_below = np.clip(lane - (32 if hi else 0), 0, 32)
    below = np.where(n_below >= 32, U64(M32), (U64(1) << n_below.astype(U64)) - U64(1))
    r0 = ctx.vread(ctx.ops[1], U)
    r1 = ctx.vread(ctx.ops[2], U)

    def fn(a, b):
        x = (np.broadcast_to(a, (LANES,)).astype(U64) & below).astype(U32)
        return _popcount(x) + b
    wr = ctx.vwrite(ctx.ops[0], U)
    return lambda w: wr(w, fn(r0(w), r1(w)))


@op("v_permlane16_swap_b32", "v_permlane32_swap_b32", archs=G950)
def _permlane_swap(ctx):
    """gfx950: swap the odd 16-lane rows of VDST with the even rows of VSRC (permlane16), or
    the upper 32 lanes of VDST with the lower 32 of VSRC (permlane32). Both registers change."""
    ctx.need(2)
    if set(ctx.mods) - {"bound_ctrl", "fi"}:
        raise ctx.fail(f"modifiers {sorted(ctx.mods)}")
    a = ctx.vrow(ctx.ops[0])
    b = ctx.vrow(ctx.ops[1])
    if ctx.base == "v_permlane16_swap_b32":
        lanes_a = np.concatenate([np.arange(16, 32), np.arange(48, 64)])
        lanes_b = np.concatenate([np.arange(0, 16), np.arange(32, 48)])
    else:
        lanes_a = np.arange(32, 64)
        lanes_b = np.arange(0, 32)

    def h(w):
        va = w.v[a].copy()
        vb = w.v[b].copy()
        na, nb = va.copy(), vb.copy()
        na[lanes_a] = vb[lanes_b]
        nb[lanes_b] = va[lanes_a]
        if a == b:
            # One register as both operands: the two halves trade places; writing na and
            # then nb would let the second write undo half of the first.
            na[lanes_b] = va[lanes_a]
            nb = na
        if w.eall:
            w.v[a] = na
            w.v[b] = nb
        else:
            np.copyto(w.v[a], na, where=w.em)
            np.copyto(w.v[b], nb, where=w.em)
    return h


@op("v_nop")
def _v_nop(ctx):
    return lambda w: None

