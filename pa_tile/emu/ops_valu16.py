"""Vector ALU, continued: the 16-bit integer/float families, integer clamp (saturation) on the
32-bit adds, the mixed-precision ``v_fma_mix*`` ops and the IEEE division helpers
(``v_div_scale/fmas/fixup_f32``).

Semantics from the CDNA3 ISA guide §12.10-§12.11 (VOP2/VOP3 pseudo-code) and §6 (VOP3 clamp,
op_sel, SDWA); CDNA4 is identical for these. Kept apart from ``ops_valu`` so the 16-bit
families read as one table.

* 16-bit results go to the low half of the VGPR with the high half zeroed (gfx9), or to the high
  half with the low half kept when VOP3 ``op_sel`` selects the destination's high word; SDWA
  forms place them with ``dst_sel``/``dst_unused`` like any SDWA op.
* ``clamp`` on integer ops saturates to the destination type's range instead of wrapping (CDNA3
  §6.1 "clamp: for integer ops, saturate"); on float ops it clamps to [0, 1] (NaN -> 0).
"""

from __future__ import annotations

import numpy as np

from . import numerics as nx
from .ops_base import LANES, OPS, mask_from_words, op
from .ops_valu import _pk16, vop
from .asm import SGPR_VCC

U16, U32 = np.uint16, np.uint32
_RANGE = {"u16": (0, 0xFFFF), "i16": (-0x8000, 0x7FFF), "u32": (0, 0xFFFFFFFF), "i32": (-0x80000000, 0x7FFFFFFF)}


def _take_clamp(ctx) -> bool:
    """Remove ``clamp`` from this instruction's modifiers (``vop`` would refuse it) and return it."""
    clamp = bool(ctx.mods.get("clamp"))
    if "clamp" in ctx.mods:
        ctx.mods = {k: v for k, v in ctx.mods.items() if k != "clamp"}
    return clamp


def _int_result(dst_t, clamp):
    """Wide (int64) result -> dst_t bits: wrap, or saturate under clamp."""
    lo, hi = _RANGE[dst_t]
    bits = 16 if dst_t.endswith("16") else 32
    mask = (1 << bits) - 1
    out = U16 if bits == 16 else U32

    def fin(r):
        r = np.asarray(r, np.int64)
        if clamp:
            r = np.clip(r, lo, hi)
        return (r & mask).astype(out)
    return fin


def vop_int(ctx, dst_t, src_ts, fn):
    """Integer VALU op computed on int64 values of the sources (signed/unsigned by type), with
    wrap-around or (clamp) saturation to dst_t."""
    clamp = _take_clamp(ctx)
    fin = _int_result(dst_t, clamp)
    sdwa16 = ctx.enc == "sdwa" and dst_t.endswith("16")

    def f(*a):
        r = fin(fn(*[x.astype(np.int64) for x in a]))
        return r.astype(U32) if sdwa16 else r
    return vop(ctx, "u32" if sdwa16 else dst_t, src_ts, f, op_sel_ok=True)


def vop_f16(ctx, src_ts, fn, dst_t="f16"):
    """f16-result VALU op; clamp limits to [0, 1] (NaN -> 0)."""
    clamp = _take_clamp(ctx)
    sdwa = ctx.enc == "sdwa"

    def f(*a):
        r = np.asarray(fn(*a))
        if dst_t == "f16":
            r = r.astype(np.float16)
            if clamp:
                r = np.where(np.isnan(r), np.float16(0), np.clip(r, np.float16(0), np.float16(1))).astype(np.float16)
            r = r.view(U16)
        return r.astype(U32) if sdwa else r
    return vop(ctx, "u32" if sdwa else ("u16" if dst_t == "f16" else dst_t), src_ts, f, op_sel_ok=True)


def _ireg(names, dst_t, src_ts, fn):
    for n in names.split():
        op(n)(lambda ctx, fn=fn: vop_int(ctx, dst_t, src_ts, fn))


def _freg(names, src_ts, fn, dst_t="f16"):
    for n in names.split():
        op(n)(lambda ctx, fn=fn: vop_f16(ctx, src_ts, fn, dst_t))


U, I, H = "u16", "i16", "f16"

# ---- 16-bit integer (CDNA3 §12.10 VOP2, §12.11 VOP3)
_ireg("v_add_u16", U, (U, U), lambda a, b: a + b)
_ireg("v_sub_u16", U, (U, U), lambda a, b: a - b)
_ireg("v_subrev_u16", U, (U, U), lambda a, b: b - a)
_ireg("v_add_i16", I, (I, I), lambda a, b: a + b)
_ireg("v_sub_i16", I, (I, I), lambda a, b: a - b)
_ireg("v_mul_lo_u16", U, (U, U), lambda a, b: a * b)
_ireg("v_mad_u16", U, (U, U, U), lambda a, b, c: a * b + c)
_ireg("v_mad_i16", I, (I, I, I), lambda a, b, c: a * b + c)
_ireg("v_max_u16", U, (U, U), np.maximum)
_ireg("v_max_i16", I, (I, I), np.maximum)
_ireg("v_min_u16", U, (U, U), np.minimum)
_ireg("v_min_i16", I, (I, I), np.minimum)
_ireg("v_max3_u16", U, (U, U, U), lambda a, b, c: np.maximum(np.maximum(a, b), c))
_ireg("v_max3_i16", I, (I, I, I), lambda a, b, c: np.maximum(np.maximum(a, b), c))
_ireg("v_min3_u16", U, (U, U, U), lambda a, b, c: np.minimum(np.minimum(a, b), c))
_ireg("v_min3_i16", I, (I, I, I), lambda a, b, c: np.minimum(np.minimum(a, b), c))
_ireg("v_med3_u16", U, (U, U, U), lambda a, b, c: np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c)))
_ireg("v_med3_i16", I, (I, I, I), lambda a, b, c: np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c)))
# shifts take the count from S0[3:0] (the "rev" forms: D = S1 shifted by S0)
_ireg("v_lshlrev_b16", U, (U, U), lambda a, b: b << (a & 15))
_ireg("v_lshrrev_b16", U, (U, U), lambda a, b: b >> (a & 15))
_ireg("v_ashrrev_i16", U, (U, I), lambda a, b: b >> (a & 15))
# 16 x 16 -> 32 multiply-adds
_ireg("v_mad_u32_u16", "u32", (U, U, "u32"), lambda a, b, c: a * b + c)
_ireg("v_mad_i32_i16", "i32", (I, I, "i32"), lambda a, b, c: a * b + c)
_ireg("v_cvt_f16_u16", U, (U,), lambda a: a.astype(np.float16).view(U16).astype(np.int64))
_ireg("v_cvt_f16_i16", U, (I,), lambda a: a.astype(np.float16).view(U16).astype(np.int64))


def _f16_to_int(signed):
    lo, hi = _RANGE["i16" if signed else "u16"]

    def f(a):
        x = np.nan_to_num(np.trunc(a.astype(np.float64)), nan=0.0)
        return np.clip(x, lo, hi).astype(np.int64)
    return f


op("v_cvt_u16_f16")(lambda ctx: vop_int(ctx, U, (H,), _f16_to_int(False)))
op("v_cvt_i16_f16")(lambda ctx: vop_int(ctx, I, (H,), _f16_to_int(True)))


# ---- 16-bit float (numpy's float16 arithmetic rounds the exact f32 result once more; for +, -,
# * of f16 operands f32 has the 2p+2 bits that make that double rounding harmless)
def _f64(fn):
    return lambda *a: fn(*[x.astype(np.float64) for x in a])


# ops_valu's f16 ops are taken over here so that they get clamp and SDWA destinations too
for _n in ("v_add_f16", "v_sub_f16", "v_mul_f16", "v_fma_f16", "v_max_f16", "v_min_f16"):
    OPS.pop(_n)
_freg("v_add_f16", (H, H), lambda a, b: a + b)
_freg("v_sub_f16", (H, H), lambda a, b: a - b)
_freg("v_mul_f16", (H, H), lambda a, b: a * b)
_freg("v_fma_f16", (H, H, H), lambda a, b, c: nx._add_round_to_odd(a.astype(np.float64) * b, c.astype(np.float64)))
_freg("v_max_f16", (H, H), np.fmax)
_freg("v_min_f16", (H, H), np.fmin)
_freg("v_subrev_f16", (H, H), lambda a, b: b - a)
_freg("v_mad_f16", (H, H, H), lambda a, b, c: (a.astype(np.float32) * b + c).astype(np.float16))  # two roundings
_freg("v_max3_f16", (H, H, H), lambda a, b, c: np.fmax(np.fmax(a, b), c))
_freg("v_min3_f16", (H, H, H), lambda a, b, c: np.fmin(np.fmin(a, b), c))
_freg("v_med3_f16", (H, H, H), lambda a, b, c: np.fmax(np.fmin(a, b), np.fmin(np.fmax(a, b), c)))
_freg("v_ldexp_f16", (H, I), lambda a, b: np.ldexp(a.astype(np.float64), np.clip(b.astype(np.int64), -64, 64)))
_freg("v_floor_f16", (H,), np.floor)
_freg("v_ceil_f16", (H,), np.ceil)
_freg("v_trunc_f16", (H,), np.trunc)
_freg("v_rndne_f16", (H,), np.rint)
_freg("v_fract_f16", (H,), lambda a: np.where(np.isinf(a), np.float16(np.nan), np.minimum(a - np.floor(a), np.float16(0.9995))))
_freg("v_sqrt_f16", (H,), _f64(np.sqrt))
_freg("v_rcp_f16", (H,), _f64(lambda a: 1.0 / a))
_freg("v_rsq_f16", (H,), _f64(lambda a: 1.0 / np.sqrt(a)))
_freg("v_exp_f16", (H,), _f64(np.exp2))
_freg("v_log_f16", (H,), _f64(np.log2))


@op("v_mac_f16")
def _mac_f16(ctx):
    """D = S0 * S1 + D, two roundings (gfx9 V_MAC_F16 is not fused)."""
    ctx.need(3)
    ctx.ops = ctx.ops + (ctx.ops[0],)
    return vop_f16(ctx, (H, H, H), lambda a, b, c: (a.astype(np.float32) * b).astype(np.float16).astype(np.float32) + c)


@op("v_madmk_f16", "v_madak_f16")
def _madk_f16(ctx):  # madmk: S0 * K + S1 (K printed in the middle); madak: S0 * S1 + K
    return vop_f16(ctx, (H, H, H), lambda a, b, c: (a.astype(np.float32) * b).astype(np.float16).astype(np.float32) + c)


def _class16(ctx):
    """V_CMP_CLASS_F16: the f32 class test of the (exactly widened) f16 value."""
    from .ops_valu import _classify, _vopc

    return _vopc(lambda a, m: _classify(a.astype(np.float32), np.asarray(m).view(U16).astype(U32)), "f16", False)(ctx)


op("v_cmp_class_f16")(_class16)


# ---- packed 16-bit integer VOP3P (each half independently; op_sel/op_sel_hi pick source halves)
def _wrap16(fn):
    def f(*a):
        r = fn(*[x.astype(np.int64) for x in a])
        return (np.asarray(r, np.int64) & 0xFFFF).astype(U16)
    return f


def _pk_int(fn, n, signed=False):
    def build(ctx):
        def f(*a):
            a = [x.view(np.int16) if signed else x for x in a]
            return _wrap16(fn)(*a)
        return _pk16(f, n, "u16")(ctx)
    return build


op("v_pk_sub_u16")(_pk_int(lambda a, b: a - b, 2))
op("v_pk_add_i16")(_pk_int(lambda a, b: a + b, 2, True))
op("v_pk_sub_i16")(_pk_int(lambda a, b: a - b, 2, True))
op("v_pk_mul_lo_u16")(_pk_int(lambda a, b: a * b, 2))
op("v_pk_mad_u16")(_pk_int(lambda a, b, c: a * b + c, 3))
op("v_pk_mad_i16")(_pk_int(lambda a, b, c: a * b + c, 3, True))
op("v_pk_max_u16")(_pk_int(np.maximum, 2))
op("v_pk_min_u16")(_pk_int(np.minimum, 2))
op("v_pk_max_i16")(_pk_int(np.maximum, 2, True))
op("v_pk_min_i16")(_pk_int(np.minimum, 2, True))
op("v_pk_lshlrev_b16")(_pk_int(lambda a, b: b << (a & 15), 2))
op("v_pk_lshrrev_b16")(_pk_int(lambda a, b: b >> (a & 15), 2))
op("v_pk_ashrrev_i16")(_pk_int(lambda a, b: (b ^ 0x8000) - 0x8000 >> (a & 15), 2))


# ---- integer clamp on the 32-bit adds/subs: saturate instead of wrapping
def _with_int_clamp(name, fn, typ):
    plain = OPS.pop(name)

    def build(ctx):
        if not ctx.mods.get("clamp"):
            return plain(ctx)
        return vop_int(ctx, typ, (typ, typ), fn)
    op(name)(build)


_with_int_clamp("v_add_u32", lambda a, b: a + b, "u32")
_with_int_clamp("v_sub_u32", lambda a, b: a - b, "u32")
_with_int_clamp("v_subrev_u32", lambda a, b: b - a, "u32")
_ireg("v_add_i32", "i32", ("i32", "i32"), lambda a, b: a + b)   # VOP3-only gfx9 forms
_ireg("v_sub_i32", "i32", ("i32", "i32"), lambda a, b: a - b)


# ---- mixed precision FMA (CDNA3 §12.11 V_FMA_MIX_F32 / V_FMA_MIXLO_F16 / V_FMA_MIXHI_F16)
def _mix_sources(ctx):
    """Per source: op_sel_hi[i] = 0 -> the 32-bit register as f32; 1 -> an f16 half (op_sel[i]
    picks high or low), widened exactly. neg/abs (LLVM prints them on the operands; encoded in
    neg_lo/neg_hi) apply after the widening."""
    m = ctx.mods
    extra = set(m) - {"op_sel", "op_sel_hi", "clamp"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    sel = tuple(m.get("op_sel", (0, 0, 0))) + (0, 0, 0)
    sel_hi = tuple(m.get("op_sel_hi", (0, 0, 0))) + (0, 0, 0)
    readers = []
    for i, o in enumerate(ctx.ops[1:4]):
        bare = o.__class__(o.kind, index=o.index, count=o.count, value=o.value, name=o.name, literal=o.literal)
        if sel_hi[i]:
            raw = ctx.vread(bare, "f16", hi=bool(sel[i]) and o.kind != "imm")
        else:
            raw = ctx.vread(bare, "f32")
        neg, ab = o.neg, o.abs

        def rd(w, raw=raw, neg=neg, ab=ab):
            x = raw(w).astype(np.float64)
            if ab:
                x = np.abs(x)
            return -x if neg else x
        readers.append(rd)
    return readers, bool(m.get("clamp"))


def _mix_exact(a, b, c):
    """a*b + c (float64 inputs holding f32/f16 values) in round-to-odd float64: rounds once more
    to f32 or f16 exactly as the exact fma would."""
    with np.errstate(invalid="ignore", over="ignore"):
        return nx._add_round_to_odd(a * b, c)


def _clamp01(x):
    return np.where(np.isnan(x), 0.0, np.clip(x, 0.0, 1.0))


@op("v_fma_mix_f32")
def _fma_mix_f32(ctx):
    ctx.need(4)
    readers, clamp = _mix_sources(ctx)
    wr = ctx.vwrite(ctx.ops[0], "f32")

    def h(w):
        a, b, c = (r(w) for r in readers)
        r = _mix_exact(a, b, c)
        with np.errstate(over="ignore", invalid="ignore"):
            r32 = r.astype(np.float32)
        if clamp:
            r32 = _clamp01(r32).astype(np.float32)
        wr(w, np.broadcast_to(r32, (LANES,)).copy())
    return h


@op("v_fma_mixlo_f16", "v_fma_mixhi_f16")
def _fma_mix_f16(ctx):
    """The f16 result goes to the low (mixlo) or high (mixhi) half; the other half is kept."""
    ctx.need(4)
    readers, clamp = _mix_sources(ctx)
    hi = ctx.base == "v_fma_mixhi_f16"
    wr = ctx.vwrite(ctx.ops[0], "u32")
    row = ctx.vrow(ctx.ops[0])

    def h(w):
        a, b, c = (r(w) for r in readers)
        r = _mix_exact(a, b, c)
        with np.errstate(over="ignore", invalid="ignore"):
            r16 = r.astype(np.float16)
        if clamp:
            r16 = _clamp01(r16).astype(np.float16)
        bits = np.broadcast_to(r16.view(U16).astype(U32), (LANES,))
        old = w.v[row]
        wr(w, (old & U32(0x0000FFFF)) | (bits << U32(16)) if hi else (old & U32(0xFFFF0000)) | bits)
    return h


# ---- IEEE division helpers (numerics.div_*: pseudo-code and its reading documented there)

@op("v_div_scale_f32")
def _div_scale(ctx):
    """vdst, sdst(VCC-like lane mask), S0, S1, S2 (VOP3b)."""
    ctx.need(5)
    if set(ctx.mods) - {"clamp"} or ctx.mods.get("clamp"):
        raise ctx.fail(f"modifiers {sorted(ctx.mods)}")
    d, sd, a, b, c = ctx.ops
    ra, rb, rc = (ctx.vread(o, "f32") for o in (a, b, c))
    wr = ctx.vwrite(d, "f32")
    if sd.kind == "special" and sd.name == "null":
        wm = None
    else:
        wm = ctx.mask_write(sd)

    def h(w):
        r, v = nx.div_scale_f32(ra(w), rb(w), rc(w))
        wr(w, np.broadcast_to(r, (LANES,)).copy())
        if wm is not None:
            wm(w, np.broadcast_to(v, (LANES,)))
    return h


@op("v_div_fmas_f32")
def _div_fmas(ctx):
    """D = fma(S0, S1, S2), scaled by 2^+-64 in lanes whose VCC bit is set."""
    ctx.need(4)
    clamp = _take_clamp(ctx)
    if ctx.mods:
        raise ctx.fail(f"modifiers {sorted(ctx.mods)}")
    ra, rb, rc = (ctx.vread(o, "f32") for o in ctx.ops[1:])
    wr = ctx.vwrite(ctx.ops[0], "f32")

    def h(w):
        vcc = mask_from_words(w.s[SGPR_VCC:SGPR_VCC + 2])
        r = nx.div_fmas_f32(ra(w), rb(w), rc(w), vcc)
        if clamp:
            r = _clamp01(r).astype(np.float32)
        wr(w, np.broadcast_to(r, (LANES,)).copy())
    return h


op("v_div_fixup_f32")(lambda ctx: vop(ctx, "f32", ("f32", "f32", "f32"), nx.div_fixup_f32))



# ---- f64 VALU (VOP3; CDNA3 §12.11): numpy float64 is IEEE RNE with denormals, as the f64 unit
# runs here; min/max follow the IEEE-mode NaN rule (a quiet NaN operand loses, like the f32 ops)
def _reg64(name, n, fn):
    op(name)(lambda ctx: vop(ctx, "f64", ("f64",) * n, fn))


_reg64("v_add_f64", 2, lambda a, b: a + b)
_reg64("v_mul_f64", 2, lambda a, b: a * b)
_reg64("v_max_f64", 2, np.fmax)
_reg64("v_min_f64", 2, np.fmin)
op("v_ldexp_f64")(lambda ctx: vop(ctx, "f64", ("f64", "i32"), lambda a, e: np.ldexp(a, np.clip(e, -2200, 2200))))


@op("v_bitop3_b16", archs=("gfx950",))
def _bitop3_b16(ctx):
    """gfx950 V_BITOP3_B16: the 16-bit form of V_BITOP3_B32 (result bit = ttbl[{S0, S1, S2}])."""
    tt = int(ctx.mods.get("bitop3", 0))
    ctx.mods = {k: v for k, v in ctx.mods.items() if k != "bitop3"}
    terms = [i for i in range(8) if tt >> i & 1]

    def fn(a, b, c):
        r = np.zeros(np.broadcast(a, b, c).shape, np.int64)
        for i in terms:
            r |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        return r
    return vop_int(ctx, "u16", ("u16", "u16", "u16"), fn)
