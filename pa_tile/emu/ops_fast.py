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

import ctypes
from typing import Callable, Dict, Optional

import numpy as np

from . import fastpath
from . import numerics as nx
from .memory import GlobalMemory
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
    is a denormal or NaN (the reference flushes / quiets those) and no result is NaN; results
    below the f32 normal range become +0, as the reference flushes them. A VGPR source goes
    through C on both sides of numpy's exp2 (``pa_exp_prep`` / ``pa_exp_finish``: 64 lanes, as
    the reference passes them); other sources, or any special input, take the numpy path below
    or the reference."""
    if not _plain(ctx):
        return ref
    src = ctx.ops[1]
    if src.kind in ("v", "a") and not src.neg and not src.abs and ctx.ops[0].kind in ("v", "a"):
        lib = fastpath.lib()
        prep, finish, pointers = lib.pa_exp_prep, lib.pa_exp_finish, fastpath.pointers
        code, dst = src_code(src), ctx.vrow(ctx.ops[0])
        x64, r64 = np.zeros(64), np.zeros(64)
        xp, rp, exp2 = x64.ctypes.data, r64.ctypes.data, np.exp2

        def hv(w):
            c = pointers(w)
            if c is None or prep(c[2], c[3], code, xp) < 0:
                return ref(w)
            exp2(x64, out=r64)
            if finish(c[2], c[3], dst, rp) < 0:
                return ref(w)
        return hv
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
    entry = _buffer_load_entry(ctx)  # the operand decoding the blocks use too
    if entry is None:
        return ref
    _, dst, vrow, soff, ri, inst, nregs = entry[0]
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
    if set(ctx.mods) - {"offset"} or len(ctx.ops) != 2:
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


# --------------------------------------------------------------------------- straight-line blocks
#
# Consecutive instructions that the C library can run (each described by an entry of
# ``pa_run_block``'s table, mirroring its reference handler) and that no branch can enter in the
# middle (no label among them) run as one call. Used only where instructions are neither counted
# nor interleaved one at a time (no trace, no ``quantum``): ``machine`` asks :func:`block_code`.

INSN = np.dtype([("op", "<i4"), ("dst", "<i4"), ("a", "<i8"), ("b", "<i8"), ("c", "<i8"), ("d", "<i8"),
                 ("e", "<i8")])
_OPS = ["nop", "v_mov_b32", "v_not_b32", "v_add_u32", "v_sub_u32", "v_subrev_u32", "v_and_b32", "v_or_b32",
        "v_xor_b32", "v_lshlrev_b32", "v_lshrrev_b32", "v_ashrrev_i32", "v_max_i32", "v_min_i32", "v_max_u32",
        "v_min_u32", "v_med3_i32", "v_mul_lo_u32", "v_add3_u32", "v_lshl_add_u32", "v_add_lshl_u32",
        "v_lshl_or_b32", "v_and_or_b32", "v_or3_b32", "v_bfe_u32", "v_cndmask_b32",
        "cmp_lt", "cmp_eq", "cmp_le", "cmp_gt", "cmp_ne", "cmp_ge",
        "s_mov_b32", "s_mov_b64", "s_add_u32", "s_sub_u32", "s_add_i32", "s_sub_i32", "s_mul_i32",
        "s_and_b32", "s_or_b32", "s_xor_b32", "s_andn2_b32", "s_and_b64", "s_or_b64", "s_xor_b64", "s_andn2_b64",
        "s_lshl_b32", "s_lshr_b32", "s_ashr_i32", "s_lshl_b64", "s_lshr_b64",
        "s_min_i32", "s_max_i32", "s_min_u32", "s_max_u32", "s_cselect_b32", "s_cselect_b64",
        "s_cmp_eq_i32", "s_cmp_lg_i32", "s_cmp_gt_i32", "s_cmp_ge_i32", "s_cmp_lt_i32", "s_cmp_le_i32",
        "s_cmp_eq_u32", "s_cmp_lg_u32", "s_cmp_gt_u32", "s_cmp_ge_u32", "s_cmp_lt_u32", "s_cmp_le_u32",
        "valu_f32", "pk_fma", "cvt_pk8", "mfma_fp8", "f_arith", "pk_arith", "cvt_f32_f16",
        "buffer_load", "ds_read", "ds_write", "s_load", "s_addc_u32", "s_subb_u32", "saveexec", "branch",
        "ds_bpermute", "ds_swizzle", "buffer_store"]
_BRANCH_TAKEN = 0xFFFFF      # emu_fastpath.c BRANCH_TAKEN
_BRANCHES = {"s_branch": 0, "s_cbranch_scc0": 1, "s_cbranch_scc1": 2, "s_cbranch_vccz": 3, "s_cbranch_vccnz": 4,
             "s_cbranch_execz": 5, "s_cbranch_execnz": 6}
_SAVEEXEC_KINDS = ("and", "or", "xor", "andn2", "orn2", "nand", "nor", "xnor", "andn1", "orn1")
_MEMORY = {"buffer_load", "ds_read", "ds_write", "s_load", "buffer_store"}
_ARITH = {"v_add_f32": 0, "v_sub_f32": 1, "v_subrev_f32": 2, "v_mul_f32": 3}
_PK_ARITH = {"v_pk_add_f32": 0, "v_pk_mul_f32": 3}
OPCODE = {n: i for i, n in enumerate(_OPS)}
_NOPS = ("s_nop", "s_waitcnt", "s_setprio", "s_sched_barrier", "sched_barrier", "s_waitcnt_vscnt",
         "s_waitcnt_vmcnt", "s_waitcnt_lgkmcnt", "s_waitcnt_expcnt")
_VALU_UNARY = ("v_mov_b32", "v_not_b32")
_VALU_TYPES = {"v_ashrrev_i32": ("u32", "i32"), "v_max_i32": ("i32", "i32"), "v_min_i32": ("i32", "i32"),
               "v_med3_i32": ("i32", "i32", "i32")}
_S64_SRC = {"s_mov_b64": (64,), "s_and_b64": (64, 64), "s_or_b64": (64, 64), "s_xor_b64": (64, 64),
            "s_andn2_b64": (64, 64), "s_lshl_b64": (64, 32), "s_lshr_b64": (64, 32), "s_cselect_b64": (64, 64)}
_S64_DST = ("s_mov_b64", "s_and_b64", "s_or_b64", "s_xor_b64", "s_andn2_b64", "s_lshl_b64", "s_lshr_b64",
            "s_cselect_b64")
_EXEC = 126


def _touches_exec(o, n):
    return o.kind == "s" and o.index <= _EXEC + 1 and o.index + n > _EXEC


def _scalar_src(o, bits):
    """(code, constant) of a SALU source as ctx.sread reads it, or None."""
    if o.kind == "s":
        return (1 | (o.index << 8), 0) if o.count == bits // 32 else None
    if o.kind == "imm":
        c = const_bits(o, "b64" if bits == 64 else "b32")
        return (2, c - (1 << 64) if c >= 1 << 63 else c)
    return None


def block_entry(ctx):
    """``(entry tuple for INSN, writes EXEC)`` when instruction *ctx* can run inside a block
    exactly as its reference handler runs it, else None."""
    base, ops = ctx.base, ctx.ops
    if base in _NOPS:
        return (OPCODE["nop"], 0, 0, 0, 0, 0, 0), False
    if base in _DWORD_LOADS or base in _DWORD_STORES:
        return _buffer_load_entry(ctx)
    if base.startswith(("ds_read_b", "ds_write_b")) and base.rsplit("_", 1)[1] in _DS_DWORDS:
        return _ds_entry(ctx, base.startswith("ds_write"))
    if base.startswith("s_load_dword"):
        return _s_load_entry(ctx)
    if base in ("ds_bpermute_b32", "ds_swizzle_b32"):
        return _permute_entry(ctx, base, ops)
    if base in _BRANCHES:
        if len(ops) != 1 or ops[0].kind != "label" or ctx.mods:
            return None
        return (OPCODE["branch"], 0, _BRANCHES[base], 0, 0, 0, 0), False
    if base.endswith("_saveexec_b64") and base[2:-len("_saveexec_b64")] in _SAVEEXEC_KINDS:
        if len(ops) != 2 or ctx.mods or ops[0].kind != "s" or ops[0].count != 2:
            return None
        src = _scalar_src(ops[1], 64)
        if src is None:
            return None
        return (OPCODE["saveexec"], ops[0].index, src[0], 0, 0,
                _SAVEEXEC_KINDS.index(base[2:-len("_saveexec_b64")]), src[1]), True
    if base in ("s_addk_i32", "s_movk_i32"):
        from .ops_salu import _simm16, _sx

        if len(ops) != 2 or ctx.mods or ops[0].kind != "s" or ops[0].count != 1:
            return None
        k = _sx(_simm16(ctx, ops[1]), 16) & 0xFFFFFFFF
        if base == "s_movk_i32":
            return (OPCODE["s_mov_b32"], ops[0].index, 2, 0, 0, k, 0), _touches_exec(ops[0], 1)
        return (OPCODE["s_add_i32"], ops[0].index, 1 | (ops[0].index << 8), 2, 0, 0, k), _touches_exec(ops[0], 1)
    if base == "v_cvt_f32_f16" and ctx.enc == "sdwa":
        return _cvt_f32_f16_sdwa(ctx, ops)
    if ctx.enc not in ("", "e32", "e64"):
        return None
    if base.startswith("v_"):
        return _valu_entry(ctx, base, ops)
    if base.startswith("s_") and not ctx.mods:
        return _salu_entry(base, ops)
    return None


def _valu_entry(ctx, base, ops):
    if base in _ARITH or base == "v_cvt_f32_f16":
        if not _plain(ctx) or ops[0].kind not in ("v", "a") or ops[0].count != 1 or len(ops) != (3 if base in _ARITH
                                                                                                  else 2):
            return None
        if base == "v_cvt_f32_f16":
            a = None if ops[1].neg or ops[1].abs else src_code(ops[1], "u16")
            return None if a is None else ((OPCODE["cvt_f32_f16"], ctx.vrow(ops[0]), a, 0, 0, 0, 0), False)
        a, b = src_code(ops[1]), src_code(ops[2])
        if a is None or b is None:
            return None
        return (OPCODE["f_arith"], ctx.vrow(ops[0]), a, b, 0, _ARITH[base], 0), False
    if base in _PK_ARITH:
        if not _plain(ctx, ("op_sel", "op_sel_hi", "neg_lo", "neg_hi")) or ops[0].kind not in ("v", "a") \
                or len(ops) != 3:
            return None
        a, b = src_code(ops[1], pair=True), src_code(ops[2], pair=True)
        if a is None or b is None:
            return None
        return (OPCODE["pk_arith"], ctx.vrow(ops[0]), a, b, _pk_sel(ctx), _PK_ARITH[base], 0), False
    if base in _VALU_OPS or base in ("v_pk_fma_f32", "v_cvt_pk_fp8_f32", "v_cvt_pk_bf8_f32") or base in _FP8_MFMAS:
        return _c_entry(ctx, base, ops)
    if base.startswith("v_cmp_") and not base.startswith("v_cmpx"):
        parts = base.split("_")          # v_cmp_<op>_<type>
        if len(parts) != 4 or parts[3] not in ("i32", "u32") or f"cmp_{parts[2]}" not in OPCODE:
            return None
        if set(ctx.mods) - {"clamp"} or ops[0].kind != "s" or ops[0].count != 2:
            return None
        a, b = src_code(ops[1], parts[3]), src_code(ops[2], parts[3])
        if a is None or b is None:
            return None
        return (OPCODE[f"cmp_{parts[2]}"], ops[0].index, a, b, int(parts[3] == "u32"), 0, 0), \
            _touches_exec(ops[0], 2)
    if base not in OPCODE or ctx.mods or ops[0].kind not in ("v", "a") or ops[0].count != 1:
        return None
    if base == "v_cndmask_b32":
        if len(ops) != 4 or ops[3].kind != "s" or ops[3].count != 2:
            return None
        a, b = src_code(ops[1]), src_code(ops[2])
        if a is None or b is None:
            return None
        return (OPCODE[base], ctx.vrow(ops[0]), a, b, ops[3].index, 0, 0), False
    n = 1 if base in _VALU_UNARY else 3 if OPCODE[base] >= OPCODE["v_med3_i32"] and base != "v_mul_lo_u32" else 2
    if len(ops) != 1 + n:
        return None
    types = _VALU_TYPES.get(base, ("u32",) * n)
    codes = [src_code(o, t) for o, t in zip(ops[1:], types)]
    if any(c is None for c in codes) or any(o.neg or o.abs for o in ops[1:]):
        return None
    codes += [0] * (3 - n)
    return (OPCODE[base], ctx.vrow(ops[0]), *codes, 0, 0), False


def _cvt_f32_f16_sdwa(ctx, ops):
    """v_cvt_f32_f16_sdwa with a whole-dword destination: the selected word of the source (as
    ops_valu._sdwa_src reads it), converted."""
    m = ctx.mods
    shift = {"WORD_0": 0, "WORD_1": 16, "DWORD": 0}.get(m.get("src0_sel", "DWORD"))
    if set(m) - {"src0_sel", "dst_sel", "dst_unused"} or m.get("dst_sel", "DWORD") != "DWORD" or shift is None:
        return None
    if len(ops) != 2 or ops[0].kind not in ("v", "a") or ops[0].count != 1 or ops[1].neg or ops[1].abs \
            or ops[1].sext or ops[1].kind not in ("v", "s"):
        return None
    a = src_code(ops[1], "u32")
    return None if a is None else ((OPCODE["cvt_f32_f16"], ctx.vrow(ops[0]), a, 0, shift, 0, 0), False)


def _c_entry(ctx, base, ops):
    """The single-instruction C paths (above) as block entries, for the forms their builders take."""
    if base in _VALU_OPS:
        if not _plain(ctx) or ops[0].kind not in ("v", "a") or ops[0].count != 1:
            return None
        op, n = _VALU_OPS[base]
        srcs = list(ops[1:1 + n]) + ([ops[0]] if base == "v_fmac_f32" else [])
        codes = [src_code(o) for o in srcs]
        if any(c is None for c in codes):
            return None
        codes += [0] * (3 - len(codes))
        return (OPCODE["valu_f32"], ctx.vrow(ops[0]), *codes, op, 0), False
    if base == "v_pk_fma_f32":
        if not _plain(ctx, ("op_sel", "op_sel_hi", "neg_lo", "neg_hi")) or ops[0].kind not in ("v", "a"):
            return None
        codes = [src_code(o, pair=True) for o in ops[1:4]]
        if any(c is None for c in codes):
            return None
        return (OPCODE["pk_fma"], ctx.vrow(ops[0]), *codes, _pk_sel(ctx), 0), False
    if base in ("v_cvt_pk_fp8_f32", "v_cvt_pk_bf8_f32"):
        if not _plain(ctx, ("op_sel", "clamp")) or ops[0].kind not in ("v", "a"):
            return None
        sel = ctx.mods.get("op_sel", (0, 0, 0))
        codes = [src_code(o) for o in ops[1:3]]
        if any(c is None for c in codes):
            return None
        kind = "fp8" if base == "v_cvt_pk_fp8_f32" else "bf8"
        fmt = _fmt_code(kind, ctx.arch, bool(ctx.desc.get("fp16_overflow", 0)))
        return (OPCODE["cvt_pk8"], ctx.vrow(ops[0]), *codes, int(bool(sel[-1]) if len(sel) == 3 else False),
                fmt, 0), False
    # fp8 MFMA
    if set(ctx.mods) - {"cbsz", "abid", "blgp"} or any(int(ctx.mods.get(k, 0)) for k in ("cbsz", "abid", "blgp")):
        return None
    M, N, K, _, _, _ = nx.mfma_shapes(base)
    d, a, b, c = ops
    rc, cconst = (ctx.vrow(c), 0) if c.kind in ("v", "a") else (-1, const_bits(c, "f32"))
    ovfl = int(bool(ctx.desc.get("fp16_overflow", 0)))
    return (OPCODE["mfma_fp8"], ctx.vrow(d), ctx.vrow(a), ctx.vrow(b), rc,
            cconst | ovfl << 32 | M << 40 | K << 48, _mfma_table(ctx.arch).ctypes.data), False


def _salu_entry(base, ops):
    if base not in OPCODE:
        return None
    if base.startswith("s_cmp_"):
        if len(ops) != 2:
            return None
        a, b = _scalar_src(ops[0], 32), _scalar_src(ops[1], 32)
        if a is None or b is None:
            return None
        return (OPCODE[base], 0, a[0], b[0], 0, a[1], b[1]), False
    srcs = _S64_SRC.get(base, (32,) if base == "s_mov_b32" else (32, 32))
    dst_bits = 64 if base in _S64_DST else 32
    if len(ops) != 1 + len(srcs) or ops[0].kind != "s" or ops[0].count != dst_bits // 32:
        return None
    got = [_scalar_src(o, bits) for o, bits in zip(ops[1:], srcs)]
    if any(g is None for g in got):
        return None
    got += [(0, 0)] * (2 - len(got))
    return (OPCODE[base], ops[0].index, got[0][0], got[1][0], 0, got[0][1], got[1][1]), \
        _touches_exec(ops[0], dst_bits // 32)


_DWORD_STORES = {"buffer_store_dword": 1, "buffer_store_dwordx2": 2, "buffer_store_dwordx3": 3,
                 "buffer_store_dwordx4": 4}


def _buffer_load_entry(ctx):
    """MUBUF dword loads and stores (the same operands; a store's first operand is its data)."""
    m = ctx.mods
    if set(m) - {"offset", "offen", "glc", "slc", "nt", "sc0", "sc1"} or len(ctx.ops) != 4:
        return None
    dst_o, vaddr, srsrc, soffset = ctx.ops
    offen = bool(m.get("offen"))
    if offen and (vaddr.kind != "v" or vaddr.count != 1):
        return None
    if soffset.kind == "imm":
        soff = 2 | (const_bits(soffset, "b32") << 32)
    elif soffset.kind == "s" and soffset.count == 1:
        soff = 1 | (soffset.index << 8)
    else:
        return None
    store = ctx.base in _DWORD_STORES
    nregs = (_DWORD_STORES if store else _DWORD_LOADS)[ctx.base]
    if dst_o.kind not in ("v", "a") or dst_o.count != nregs:
        return None
    return (OPCODE["buffer_store" if store else "buffer_load"], ctx.vrow(dst_o), vaddr.index if offen else -1,
            soff, srsrc.index, int(m.get("offset", 0)) & 0xFFFFFFFF, nregs), False


def _ds_entry(ctx, write):
    if set(ctx.mods) - {"offset"} or len(ctx.ops) != 2:
        return None
    data_o, addr_o = (ctx.ops[1], ctx.ops[0]) if write else (ctx.ops[0], ctx.ops[1])
    nregs = _DS_DWORDS[ctx.base.rsplit("_", 1)[1]]
    if addr_o.kind != "v" or addr_o.count != 1 or data_o.kind not in ("v", "a") or data_o.count != nregs:
        return None
    return (OPCODE["ds_write" if write else "ds_read"], ctx.vrow(data_o), addr_o.index,
            int(ctx.mods.get("offset", 0)) & 0xFFFFFFFF, nregs, ctx.index, 0), False


_SMEM_N = {"s_load_dword": 1, "s_load_dwordx2": 2, "s_load_dwordx4": 4, "s_load_dwordx8": 8, "s_load_dwordx16": 16}


def _s_load_entry(ctx):
    """As ops_vmem._s_load: ``(base pair + offset) & ~3``, offset an immediate or an SGPR plus
    ``offset:``."""
    n = _SMEM_N.get(ctx.base)
    if n is None or len(ctx.ops) != 3 or set(ctx.mods) - {"offset", "glc", "nv", "sc0", "sc1", "nt"}:
        return None
    dst, base, off = ctx.ops
    if dst.kind != "s" or dst.count != n or base.kind != "s" or base.count != 2:
        return None
    imm = int(ctx.mods.get("offset", 0))
    if off.kind == "imm":
        code, add = 2, int(off.value) + imm
    elif off.kind == "s" and off.count == 1:
        code, add = 1 | (off.index << 8), imm
    else:
        return None
    return (OPCODE["s_load"], dst.index, base.index, code, n, add, 0), _touches_exec(dst, n)


_SWIZZLES: Dict[int, np.ndarray] = {}


def _permute_entry(ctx, base, ops):
    """ds_bpermute_b32 / ds_swizzle_b32 as ops_ds computes them (register-only: no LDS access)."""
    from .ops_ds import _swizzle_pattern

    if set(ctx.mods) - {"offset"} or ops[0].kind not in ("v", "a") or ops[0].count != 1:
        return None
    off = int(ctx.mods.get("offset", 0))
    if base == "ds_bpermute_b32":
        if len(ops) != 3 or any(o.kind not in ("v", "a") or o.count != 1 for o in ops[1:]):
            return None
        return (OPCODE["ds_bpermute"], ctx.vrow(ops[0]), ctx.vrow(ops[1]), ctx.vrow(ops[2]), off & 0xFFFFFFFF,
                0, 0), False
    if len(ops) != 2 or ops[1].kind not in ("v", "a") or ops[1].count != 1:
        return None
    pattern = _SWIZZLES.get(off)
    if pattern is None:
        pattern = _SWIZZLES[off] = np.ascontiguousarray(_swizzle_pattern(off), np.uint8)
    return (OPCODE["ds_swizzle"], ctx.vrow(ops[0]), 0, ctx.vrow(ops[1]), 0, 0, pattern.ctypes.data), False


def _pk_sel(ctx):
    m = ctx.mods
    fields = [tuple(m.get(k, (d,) * 3)) + (d,) * 3 for k, d in
              (("op_sel", 0), ("op_sel_hi", 1), ("neg_lo", 0), ("neg_hi", 0))]
    sel = 0
    for f, field in enumerate(fields):
        for i in range(3):
            sel |= (1 if field[i] else 0) << (4 * f + i)
    return sel


_TABLES: Dict[str, np.ndarray] = {}


def _mfma_table(arch):
    t = _TABLES.get(arch)
    if t is None:
        t = _TABLES[arch] = np.ascontiguousarray(nx._decode_table("fp8", nx.fp8_format_for_arch(arch)), np.uint32)
    return t


def block_code(program, kernel, arch, code, make_ctx):
    """*code* (per-instruction handlers) with the first instruction of every run of at least two
    block-able instructions replaced by one handler running the run in C and returning the index
    after it."""
    lib = fastpath.lib()
    if lib is None:
        return code
    run_block, pointers = lib.pa_run_block, fastpath.pointers
    labels = set(program.labels.values())
    out = list(code)
    entries = {}
    for i, h in enumerate(code):
        if h is not None:
            e = block_entry(make_ctx(i))
            if e is not None:
                entries[i] = e
    i, n = 0, len(code)
    while i < n:
        if i not in entries:
            i += 1
            continue
        if _OPS[entries[i][0][0]] == "branch":
            i += 1
            continue
        j = i + 1
        # a memory entry only ever starts a block: when its C path refuses (a fault to report,
        # lanes out of range, ...), its own handler runs as the instruction the loop is at;
        # a branch only ever ends one
        target = None
        while j < n and j in entries and j not in labels and _OPS[entries[j][0][0]] not in _MEMORY:
            j += 1
            if _OPS[entries[j - 1][0][0]] == "branch":
                target = make_ctx(j - 1).label(program.instructions[j - 1].operands[0])
                break
        memory = _OPS[entries[i][0][0]] in _MEMORY
        if j - i >= 2 or memory:
            table = np.array([tuple(_i64(x) for x in entries[k][0]) for k in range(i, j)], INSN)
            sync = any(entries[k][1] for k in range(i, j))
            out[i] = _block_handler(run_block, pointers, table, j, sync, code[i:j], memory, target)
        i = j
    return out


def _i64(x: int) -> int:
    """A 64-bit field as the signed value numpy stores (the C side reads the same bits)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _memory_context(w):
    """The ``ctx`` array of ``pa_run_block`` for wave *w* (cached on the wave, rebuilt when its
    memory, LDS, race checker or regions change; wave id and epoch are written at every call)."""
    mem, lds, races = w.mem, w.lds, w.races
    f = w.fctx
    if f is None or f[0] is not mem or f[1] is not lds or f[2] is not races or \
            (f[4] is not None and f[4] is not mem._bases):
        f = w.fctx = _build_memory_context(w, mem, lds, races)
    arr = f[3]
    if races is not None:
        arr[9] = races.epoch
    arr[8] = w.wave_id
    return f


def _build_memory_context(w, mem, lds, races):
    arr = np.zeros(10, np.int64)
    arr[4] = -1
    spans_of = None
    if type(mem) is GlobalMemory and not mem.overread:
        sp = fastpath.spans(mem)
        arr[0], arr[1], arr[2], arr[3] = sp[2], sp[3], sp[4], 1
        spans_of = mem._bases
    elif mem is not None and hasattr(mem, "_bases"):
        spans_of = mem._bases
    lp = fastpath.lds_pointer(lds) if lds is not None else None
    rp = fastpath.race_pointers(races) if races is not None else None
    if lp is not None and (races is None or rp is not None):
        arr[5], arr[6] = lp, lds.limit
        arr[7] = ctypes.addressof(rp) if rp is not None else 0
    return (mem, lds, races, arr, spans_of, arr.ctypes.data)


def _block_handler(run_block, pointers, table, nxt, sync, handlers, memory=False, target=None):
    """One block: the instructions of *table* (ending with a branch to *target*, if given), then
    the index after them or the branch target."""
    tptr, count, size = table.ctypes.data, len(table), table.itemsize

    def h(w, _keep=table):
        c = w.cptr
        if c is None or c[0] is not w.v or c[1] is not w.s:
            c = pointers(w)
        if c is None or (memory and w.trace is not None):   # the instructions one by one
            for k, f in enumerate(handlers):
                r = f(w)
                if r is not None:
                    if k == count - 1 and target is not None:
                        return r            # the final branch, taken
                    raise RuntimeError(f"fast engine: block entry {k} returned {r}")
            return nxt
        if memory:
            f = _memory_context(w)
            cx, arr = f[5], f[3]
        else:
            cx = arr = None
        start = 0
        while True:
            r = run_block(c[2], c[3], tptr + start * size, count - start, w.scc, cx)
            if r < 0:
                raise RuntimeError(f"fast engine: block entry {start - r - 1} has no C operation")
            w.scc = r & 1
            if sync:
                w.sync_exec()
            if arr is not None and arr[4] >= 0:
                w.mem._last = int(arr[4])      # what memory.GlobalMemory._resolve remembers
                arr[4] = -1
            if r < 2:
                return nxt
            if r >> 1 == _BRANCH_TAKEN:
                return target
            # entry k left to its own handler: f32 arithmetic on a NaN (the reference decides
            # the payload), or the memory entry that starts this block refusing (its handler
            # faults, reports a race, or handles what C does not); the C code resumes after it
            k = start + (r >> 1) - 1
            handlers[k](w)
            start = k + 1
            if start == count:
                return nxt
    return h
