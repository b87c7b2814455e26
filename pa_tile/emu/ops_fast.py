"""The fast engine's handlers: the hottest instructions of pa_tile's kernels, same bits, less time.

``machine.decode_kernel(engine="fast")`` first builds every instruction's reference handler (so
every form is validated exactly as before), then offers it to the builder registered here for
its base mnemonic. A builder returns a faster handler for the forms it covers, or the reference
handler unchanged for any other form (modifiers, DPP/SDWA, operand kinds it does not take).

Two kinds of fast handler:

* calls into ``_shim/emu_fastpath.c`` (``fastpath.lib()``), which works on the wave's register
  file in place: fp8 x fp8 MFMA, f32 max/min/max3/min3, fma/fmac, packed fma, f32 -> fp8/bf8
  packing. The C code performs the same IEEE operations as the numpy reference in
  ``numerics`` (exact products and sums, round-to-odd, one final rounding), so equality is by
  construction; ``tests/test_emu_engine_ops.py`` checks it on random and corner-case bits.
* numpy paths that skip the reference's corner-case machinery when a cheap check shows no
  corner case is present (``v_exp_f32``: no denormal input, no NaN, no result below the f32
  normal range), and fall back to the reference handler otherwise.

A wave whose register arrays are not the plain ones the C code assumes (``fastpath.pointers``
returns None) runs the reference handler.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

from . import fastpath
from . import numerics as nx
from .ops_base import AGPR_BASE, const_bits

#: base mnemonic -> builder(ctx, reference_handler) -> handler
FAST: Dict[str, Callable] = {}


def available() -> bool:
    """Whether the C fast paths can be used here (a C compiler was found)."""
    return fastpath.lib() is not None


def _fast(*names):
    def deco(fn):
        for n in names:
            FAST[n] = fn
        return fn
    return deco


def src_code(o, typ: str = "f32", pair: bool = False) -> Optional[int]:
    """One source operand as the C code's int64 (see the header of emu_fastpath.c), or None."""
    if o.kind == "imm":
        if pair:
            return 2 | (const_bits(o, "u32") << 32)   # a packed-f32 constant: one dword, both halves
        return 2 | (const_bits(o, typ) << 32)
    if o.kind not in ("v", "a", "s") or o.count != (2 if pair else 1):
        return None
    if pair and (o.neg or o.abs):
        return None
    idx = o.index + (AGPR_BASE if o.kind == "a" else 0)
    return (1 if o.kind == "s" else 0) | (4 if o.abs else 0) | (8 if o.neg else 0) | (idx << 8)


def _plain(ctx, allowed=()) -> bool:
    return ctx.enc in ("", "e32", "e64") and not (set(ctx.mods) - set(allowed))


def _c_handler(ref, fn, *args):
    """A handler calling ``fn(*args[:1], v, s, *args[1:])`` on the wave's register file."""
    first, rest = args[0], args[1:]
    pointers = fastpath.pointers

    def h(w):
        c = pointers(w)
        if c is None:
            return ref(w)
        fn(first, c[2], c[3], *rest)
    return h


def _c_handler_vs(ref, fn, *args):
    """As :func:`_c_handler` for functions whose first arguments are ``v, s``."""
    pointers = fastpath.pointers

    def h(w):
        c = pointers(w)
        if c is None:
            return ref(w)
        fn(c[2], c[3], *args)
    return h


_VALU_OPS = {"v_max_f32": (0, 2), "v_min_f32": (1, 2), "v_max3_f32": (2, 3), "v_min3_f32": (3, 3),
             "v_fma_f32": (4, 3), "v_fmac_f32": (4, 2)}


@_fast(*_VALU_OPS)
def _valu_f32(ctx, ref):
    if not _plain(ctx) or ctx.ops[0].kind not in ("v", "a") or ctx.ops[0].count != 1:
        return ref
    op, n = _VALU_OPS[ctx.base]
    srcs = list(ctx.ops[1:1 + n])
    if ctx.base == "v_fmac_f32":
        srcs.append(ctx.ops[0])               # D = S0 * S1 + D
    codes = [src_code(o) for o in srcs]
    if any(c is None for c in codes):
        return ref
    codes += [0] * (3 - len(codes))
    dst = ctx.vrow(ctx.ops[0])
    return _c_handler(ref, fastpath.lib().pa_valu_f32, op, dst, *codes)


@_fast("v_pk_fma_f32")
def _pk_fma(ctx, ref):
    if not _plain(ctx, ("op_sel", "op_sel_hi", "neg_lo", "neg_hi")):
        return ref
    m = ctx.mods
    fields = [tuple(m.get(k, (d,) * 3)) + (d,) * 3 for k, d in
              (("op_sel", 0), ("op_sel_hi", 1), ("neg_lo", 0), ("neg_hi", 0))]
    sel = 0
    for f, field in enumerate(fields):
        for i in range(3):
            sel |= (1 if field[i] else 0) << (4 * f + i)
    codes = [src_code(o, pair=True) for o in ctx.ops[1:4]]
    if any(c is None for c in codes) or ctx.ops[0].kind not in ("v", "a"):
        return ref
    return _c_handler_vs(ref, fastpath.lib().pa_pk_fma_f32, ctx.vrow(ctx.ops[0]), *codes, sel)


def _fmt_code(kind: str, arch: str, saturate: bool) -> int:
    s = nx._spec(kind, nx.fp8_format_for_arch(arch))
    return (s.mbits | (s.emin + 64) << 4 | s.max_mag << 12 | int(s.fnuz) << 20 | int(s.has_inf) << 21
            | int(saturate) << 22)


@_fast("v_cvt_pk_fp8_f32", "v_cvt_pk_bf8_f32")
def _cvt_pk_8(ctx, ref):
    if not _plain(ctx, ("op_sel", "clamp")) or ctx.ops[0].kind not in ("v", "a"):
        return ref
    sel = ctx.mods.get("op_sel", (0, 0, 0))
    word_hi = bool(sel[-1]) if len(sel) == 3 else False
    codes = [src_code(o) for o in ctx.ops[1:3]]
    if any(c is None for c in codes):
        return ref
    kind = "fp8" if ctx.base == "v_cvt_pk_fp8_f32" else "bf8"
    fmt = _fmt_code(kind, ctx.arch, bool(ctx.desc.get("fp16_overflow", 0)))
    return _c_handler_vs(ref, fastpath.lib().pa_cvt_pk_8, ctx.vrow(ctx.ops[0]), *codes, int(word_hi), fmt)


_FP8_MFMAS = tuple(m for m in nx.MFMA_MNEMONICS if m.endswith("_fp8_fp8"))


@_fast(*_FP8_MFMAS)
def _mfma_fp8(ctx, ref):
    """fp8 x fp8 only: there the double dot product is exact, so its order cannot matter."""
    if set(ctx.mods) - {"cbsz", "abid", "blgp"} or any(int(ctx.mods.get(k, 0)) for k in ("cbsz", "abid", "blgp")):
        return ref
    M, N, K, _, _, nc = nx.mfma_shapes(ctx.base)
    d, a, b, c = ctx.ops
    rc, cconst = -1, 0
    if c.kind in ("v", "a"):
        rc = ctx.vrow(c)
    else:
        cconst = const_bits(c, "f32")
    table = nx._decode_table("fp8", nx.fp8_format_for_arch(ctx.arch))
    keep = np.ascontiguousarray(table, dtype=np.uint32)
    tptr = keep.ctypes.data
    ovfl = int(bool(ctx.desc.get("fp16_overflow", 0)))
    fn = fastpath.lib().pa_mfma_fp8
    pointers = fastpath.pointers
    rd, ra, rb = ctx.vrow(d), ctx.vrow(a), ctx.vrow(b)

    def h(w, _keep=keep):
        p = pointers(w)
        if p is None:
            return ref(w)
        fn(p[2], M, N, K, rd, ra, rb, rc, cconst, tptr, ovfl)
    return h


_F32_MIN_NORMAL = np.float32(2.0 ** -126)


@_fast("v_exp_f32")
def _exp(ctx, ref):
    """numpy's exp2 in float64 rounded to f32 is what the reference computes whenever no input
    is a denormal (the reference flushes those) and every result is an f32 normal number (the
    reference flushes smaller ones and canonicalises NaNs); otherwise the reference runs."""
    if not _plain(ctx):
        return ref
    read = ctx.vread(ctx.ops[1], "f32")
    write = ctx.vwrite(ctx.ops[0], "f32")
    f64, f32, u32 = np.float64, np.float32, np.uint32
    mag, den = u32(0x7FFFFFFF), u32(0x007FFFFF)

    def h(w):
        x = read(w)
        r = np.exp2(x.astype(f64)).astype(f32)
        if (r >= _F32_MIN_NORMAL).all() and not (((x.view(u32) & mag) - u32(1)) < den).any():
            write(w, r)
        else:
            return ref(w)
    return h


_DWORD_LOADS = {"buffer_load_dword": 1, "buffer_load_dwordx2": 2, "buffer_load_dwordx3": 3, "buffer_load_dwordx4": 4}


@_fast(*_DWORD_LOADS)
def _buffer_load(ctx, ref):
    """Untraced MUBUF dword loads whose every active lane is in range and inside the region the
    V#'s base points into (the sanitizer's verdict for them: pass); anything else, the reference."""
    from .memory import GlobalMemory

    m = ctx.mods
    if set(m) - {"offset", "offen", "glc", "slc", "nt", "sc0", "sc1"}:
        return ref
    dst_o, vaddr, srsrc, soffset = ctx.ops
    offen = bool(m.get("offen"))
    if offen and (vaddr.kind != "v" or vaddr.count != 1):
        return ref
    if soffset.kind == "imm":
        soff = 2 | (const_bits(soffset, "b32") << 32)
    elif soffset.kind == "s" and soffset.count == 1:
        soff = 1 | (soffset.index << 8)
    else:
        return ref
    dst, nregs, ri = ctx.vrow(dst_o), _DWORD_LOADS[ctx.base], srsrc.index
    vrow = vaddr.index if offen else -1
    inst = int(m.get("offset", 0)) & 0xFFFFFFFF
    fn = fastpath.lib().pa_buffer_load
    pointers, spans = fastpath.pointers, fastpath.spans

    def h(w):
        mem = w.mem
        if w.trace is None and type(mem) is GlobalMemory and not mem.overread:
            c = pointers(w)
            if c is not None:
                sp = spans(mem)
                r = fn(c[2], c[3], dst, nregs, vrow, inst, soff, ri, sp[2], sp[3], sp[4])
                if r >= 0:
                    mem._last = r      # what memory.GlobalMemory._resolve remembers
                    return
                if r == -2:
                    return
        return ref(w)
    return h


_DS_DWORDS = {"b32": 1, "b64": 2, "b96": 3, "b128": 4}


def _ds(ctx, ref, write):
    """ds_read_b32..b128 / ds_write_b32..b128, untraced, in an LDS that faults out of bounds:
    the access, the race checker's bookkeeping and the registers as ops_ds does them; a lane out
    of bounds or a race to report runs the reference handler instead (which reports it)."""
    if set(ctx.mods) - {"offset"}:
        return ref
    data_o, addr_o = (ctx.ops[1], ctx.ops[0]) if write else (ctx.ops[0], ctx.ops[1])
    nregs = _DS_DWORDS[ctx.base.rsplit("_", 1)[1]]
    if addr_o.kind != "v" or addr_o.count != 1 or data_o.kind not in ("v", "a") or data_o.count != nregs:
        return ref
    row, arow = ctx.vrow(data_o), addr_o.index
    off = int(ctx.mods.get("offset", 0)) & 0xFFFFFFFF
    pc = ctx.index
    lib = fastpath.lib()
    fn = lib.pa_ds_write if write else lib.pa_ds_read
    pointers, lds_pointer, race_pointers = fastpath.pointers, fastpath.lds_pointer, fastpath.race_pointers

    def h(w):
        if w.trace is None:
            c = pointers(w)
            lds = w.lds
            p = lds_pointer(lds) if c is not None and lds is not None else None
            if p is not None:
                races = w.races
                if races is None:
                    rp, epoch = None, 0
                else:
                    rp, epoch = race_pointers(races), races.epoch
                    if rp is None:
                        return ref(w)
                if fn(c[2], c[3], row, nregs, arow, off, p, lds.limit, rp, w.wave_id, pc, epoch) == 0:
                    return
        return ref(w)
    return h


for _k in _DS_DWORDS:
    FAST[f"ds_read_{_k}"] = lambda ctx, ref: _ds(ctx, ref, False)
    FAST[f"ds_write_{_k}"] = lambda ctx, ref: _ds(ctx, ref, True)
