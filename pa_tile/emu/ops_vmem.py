"""Memory instructions that leave the compute unit: SMEM (s_load/s_buffer_load), GLOBAL and
MUBUF (buffer_*) loads and stores.

Address arithmetic follows the CDNA3 ISA guide: §9 "Scalar Memory Operations", §10 "Vector
Memory Buffer Instructions" (V# decode, offen/idxen, soffset, range checking -- delegated to
``memory.buffer_load``/``buffer_store``), §11 "Flat, Scratch and Global Instructions" (global
with a 64-bit VGPR address and ``off``, or an SGPR base plus a 32-bit VGPR offset). Loads and
stores go through ``wave.mem`` (``memory.GlobalMemory``), whose sanitizer rejects any address
outside the launch's tensors; ``wave.trace`` (``memory.Trace``) is told about every access.
"""

from __future__ import annotations

import numpy as np

from . import memory as mm
from .ops_base import LANES, M32, M64, op

U32, U64 = np.uint32, np.uint64

# name suffix -> (bytes per lane, how the loaded bytes become register contents)
#   "dw": whole dwords; "zx"/"sx": zero/sign-extend into one dword; "lo"/"hi": d16 into one half
_LOAD_FORMS = {
    "dword": (4, "dw"), "dwordx2": (8, "dw"), "dwordx3": (12, "dw"), "dwordx4": (16, "dw"),
    "ubyte": (1, "zx"), "sbyte": (1, "sx"), "ushort": (2, "zx"), "sshort": (2, "sx"),
    "ubyte_d16": (1, "lo"), "ubyte_d16_hi": (1, "hi"), "sbyte_d16": (1, "lo_sx"),
    "sbyte_d16_hi": (1, "hi_sx"), "short_d16": (2, "lo"), "short_d16_hi": (2, "hi"),
}
_STORE_FORMS = {
    "dword": (4, "dw"), "dwordx2": (8, "dw"), "dwordx3": (12, "dw"), "dwordx4": (16, "dw"),
    "byte": (1, "lo"), "short": (2, "lo"), "byte_d16_hi": (1, "hi"), "short_d16_hi": (2, "hi"),
}


def _load_writer(ctx, o, nbytes, form):
    """Writer ``wr(w, data u8[64, nbytes], mask)`` placing loaded bytes into VGPRs."""
    row = ctx.vrow(o)
    if form == "dw":
        n = nbytes // 4
        if o.count != n:
            raise ctx.fail(f"destination {o} should be {n} registers")

        def wr(w, d, m):
            vals = d.view(U32).T
            if m.all():
                w.v[row:row + n] = vals
            else:
                np.copyto(w.v[row:row + n], vals, where=m[None, :])
        return wr
    bits = nbytes * 8
    signed = form.endswith("sx")

    def widen(d):
        x = d[:, 0].astype(U32) if nbytes == 1 else d.view(np.uint16)[:, 0].astype(U32)
        if signed:
            s = U32(1 << (bits - 1))
            x = (x ^ s) - s
        return x

    if form in ("zx", "sx"):
        def wr(w, d, m):
            np.copyto(w.v[row], widen(d), where=m)
        return wr
    hi = form.startswith("hi")
    shift, keep = (U32(16), U32(0x0000FFFF)) if hi else (U32(0), U32(0xFFFF0000))

    def wr16(w, d, m):
        x = widen(d) & U32(0xFFFF)
        np.copyto(w.v[row], (w.v[row] & keep) | (x << shift), where=m)
    return wr16


def _store_reader(ctx, o, nbytes, form):
    """Reader ``rd(w) -> u8[64, nbytes]`` of the data VGPRs of a store."""
    row = ctx.vrow(o)
    if form == "dw":
        n = nbytes // 4
        if o.count != n:
            raise ctx.fail(f"data {o} should be {n} registers")
        return lambda w: np.ascontiguousarray(w.v[row:row + n].T).view(np.uint8)
    shift = U32(16 if form == "hi" else 0)
    dt = np.uint8 if nbytes == 1 else np.uint16
    return lambda w: (w.v[row] >> shift).astype(dt).view(np.uint8).reshape(LANES, nbytes)


def _trace_global(w, ctx_m, line, addrs, mask, nbytes, kind, write):
    w.trace.global_access(ctx_m, line, addrs, mask, nbytes, kind=kind, write=write, wave=w.uid)


# --------------------------------------------------------------------------- GLOBAL

def _global_addr(ctx, vaddr, saddr, offset):
    if saddr.kind == "special" and saddr.name == "off":
        if vaddr.count != 2:
            raise ctx.fail("global address without saddr must be a VGPR pair")
        ra = ctx.vread(vaddr, "u64")
        return lambda w: np.broadcast_to(ra(w), (LANES,)) + U64(offset & M64)
    if saddr.kind != "s" or saddr.count != 2:
        raise ctx.fail(f"bad saddr {saddr}")
    rv = ctx.vread(vaddr, "u32")
    rs = ctx.sread(saddr, 64)
    return lambda w: rv(w).astype(U64) + U64((rs(w) + offset) & M64)


def _global_mods(ctx):
    extra = set(ctx.mods) - {"offset", "glc", "slc", "nt", "sc0", "sc1"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    return int(ctx.mods.get("offset", 0))


def _global_load(ctx):
    form_name = ctx.base[len("global_load_"):]
    if form_name not in _LOAD_FORMS:
        raise ctx.fail("unknown global load width")
    nbytes, form = _LOAD_FORMS[form_name]
    ctx.need(3)
    off = _global_mods(ctx)
    addr = _global_addr(ctx, ctx.ops[1], ctx.ops[2], off)
    wr = _load_writer(ctx, ctx.ops[0], nbytes, form)
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        a = addr(w)
        m = w.em
        d = w.mem.load(a, m, nbytes, origin)
        if w.trace is not None:
            _trace_global(w, mnem, line, a, m, nbytes, "global", False)
        wr(w, d, m)
    return h


def _global_store(ctx):
    form_name = ctx.base[len("global_store_"):]
    if form_name not in _STORE_FORMS:
        raise ctx.fail("unknown global store width")
    nbytes, form = _STORE_FORMS[form_name]
    ctx.need(3)
    off = _global_mods(ctx)
    addr = _global_addr(ctx, ctx.ops[0], ctx.ops[2], off)
    rd = _store_reader(ctx, ctx.ops[1], nbytes, form)
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        a = addr(w)
        m = w.em
        w.mem.store(a, m, rd(w), origin)
        if w.trace is not None:
            _trace_global(w, mnem, line, a, m, nbytes, "global", True)
    return h


for _f in _LOAD_FORMS:
    op(f"global_load_{_f}")(_global_load)
for _f in _STORE_FORMS:
    op(f"global_store_{_f}")(_global_store)


# --------------------------------------------------------------------------- MUBUF

_VSHARP_CACHE: dict = {}


def vsharp(words: np.ndarray) -> "mm.BufferResource":
    key = tuple(int(x) for x in words)
    r = _VSHARP_CACHE.get(key)
    if r is None:
        if len(_VSHARP_CACHE) > 4096:
            _VSHARP_CACHE.clear()
        r = _VSHARP_CACHE[key] = mm.decode_vsharp(key)
    return r


def _buffer_operands(ctx, vaddr, srsrc, soffset):
    m = ctx.mods
    extra = set(m) - {"offset", "offen", "idxen", "glc", "slc", "nt", "sc0", "sc1"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    offen, idxen = bool(m.get("offen")), bool(m.get("idxen"))
    inst = int(m.get("offset", 0))
    if srsrc.kind != "s" or srsrc.count != 4:
        raise ctx.fail(f"resource {srsrc} must be 4 SGPRs")
    ri = srsrc.index
    rso = ctx.sread(soffset)
    if offen or idxen:
        if vaddr.kind != "v" or vaddr.count != (2 if offen and idxen else 1):
            raise ctx.fail(f"bad vaddr {vaddr} for offen={offen} idxen={idxen}")
    vrow = vaddr.index if vaddr.kind == "v" else None

    def kw(w):
        d = dict(soffset=rso(w), inst_offset=inst, offen=offen, idxen=idxen)
        if idxen:
            d["vaddr_index"] = w.v[vrow]
            if offen:
                d["vaddr_offset"] = w.v[vrow + 1]
        elif offen:
            d["vaddr_offset"] = w.v[vrow]
        return d
    return (lambda w: vsharp(w.s[ri:ri + 4])), kw


def _buffer_load(ctx):
    form_name = ctx.base[len("buffer_load_"):]
    if form_name not in _LOAD_FORMS:
        raise ctx.fail("unknown buffer load width")
    nbytes, form = _LOAD_FORMS[form_name]
    ctx.need(4)
    rsrc, kw = _buffer_operands(ctx, ctx.ops[1], ctx.ops[2], ctx.ops[3])
    wr = _load_writer(ctx, ctx.ops[0], nbytes, form)
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        m = w.em
        acc = mm.buffer_load(w.mem, rsrc(w), m, nbytes, origin=origin, **kw(w))
        if w.trace is not None:
            _trace_global(w, mnem, line, acc.addrs, acc.touched, nbytes, "buffer", False)
        wr(w, acc.data, m)
    return h


def _buffer_store(ctx):
    form_name = ctx.base[len("buffer_store_"):]
    if form_name not in _STORE_FORMS:
        raise ctx.fail("unknown buffer store width")
    nbytes, form = _STORE_FORMS[form_name]
    ctx.need(4)
    rsrc, kw = _buffer_operands(ctx, ctx.ops[1], ctx.ops[2], ctx.ops[3])
    rd = _store_reader(ctx, ctx.ops[0], nbytes, form)
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        acc = mm.buffer_store(w.mem, rsrc(w), w.em, rd(w), origin=origin, **kw(w))
        if w.trace is not None:
            _trace_global(w, mnem, line, acc.addrs, acc.touched, nbytes, "buffer", True)
    return h


for _f in _LOAD_FORMS:
    op(f"buffer_load_{_f}")(_buffer_load)
for _f in _STORE_FORMS:
    op(f"buffer_store_{_f}")(_buffer_store)


# --------------------------------------------------------------------------- SMEM

_SMEM_N = {"dword": 1, "dwordx2": 2, "dwordx4": 4, "dwordx8": 8, "dwordx16": 16}
_LANE0 = np.zeros(LANES, bool)
_LANE0[0] = True


def _smem_offset(ctx):
    """Byte offset accessor: ``imm``, ``sgpr`` or ``sgpr offset:imm`` (gfx9 SMEM forms)."""
    o = ctx.ops[2]
    imm = int(ctx.mods.get("offset", 0))
    extra = set(ctx.mods) - {"offset", "glc", "nv", "sc0", "sc1", "nt"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    if o.kind == "imm":
        c = int(o.value) + imm  # gfx9 SMEM immediates are signed (21 bits)
        return lambda w: c
    r = ctx.sread(o)
    return lambda w: r(w) + imm


def _smem_trace(w, mnem, line, addr, nbytes):
    a = np.zeros(LANES, U64)
    a[0] = addr
    w.trace.global_access(mnem, line, a, _LANE0, nbytes, kind="scalar", write=False, wave=w.uid)


@op(*[f"s_load_{k}" for k in _SMEM_N])
def _s_load(ctx):
    n = _SMEM_N[ctx.base[len("s_load_"):]]
    ctx.need(3)
    base = ctx.sread(ctx.ops[1], 64)
    off = _smem_offset(ctx)
    wr = ctx.swrite_n(ctx.ops[0], n)
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        addr = (base(w) + off(w)) & M64
        wr(w, w.mem.load_scalar(addr, n, origin))
        if w.trace is not None:
            _smem_trace(w, mnem, line, addr, 4 * n)
    return h


@op(*[f"s_buffer_load_{k}" for k in _SMEM_N])
def _s_buffer_load(ctx):
    n = _SMEM_N[ctx.base[len("s_buffer_load_"):]]
    ctx.need(3)
    src = ctx.ops[1]
    if src.kind != "s" or src.count != 4:
        raise ctx.fail(f"resource {src} must be 4 SGPRs")
    ri = src.index
    off = _smem_offset(ctx)
    wr = ctx.swrite_n(ctx.ops[0], n)
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        rs = vsharp(w.s[ri:ri + 4])
        o = off(w) & M32
        wr(w, mm.scalar_buffer_load(w.mem, rs, o, n, origin))
        if w.trace is not None:
            _smem_trace(w, mnem, line, rs.base + (o & ~3), 4 * n)
    return h
