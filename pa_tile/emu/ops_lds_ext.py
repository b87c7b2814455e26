"""LDS forms beyond plain reads and writes: direct-to-LDS buffer loads (``buffer_load_* ... lds``)
and gfx950's transposing LDS read ``ds_read_b64_tr_b16``.

* Direct-to-LDS (CDNA3 §10 "MUBUF: load to LDS", CDNA4 likewise, which adds the dwordx3/dwordx4
  widths): the buffer address is formed as for any MUBUF load (range check: out-of-range bytes
  read 0), but the data goes to LDS instead of VGPRs, at ``M0 + inst_offset + lane * size``:
  M0 holds the wave's LDS destination base (LLVM writes it with ``s_mov_b32 m0, ...`` just
  before), lanes are packed in lane order, one ``size``-byte slot per lane whether or not the lane
  is active (inactive lanes write nothing). The instruction offset moving the LDS address too is
  how LLVM's ``buffer_load ... lds`` lowering treats it; an assumption beyond the guide's text.
* ``ds_read_b64_tr_b16`` (CDNA4 §11 "LDS transpose loads"): every lane reads 8 bytes (four 16-bit
  elements) at its address; then within each 16-lane group, lane ``l`` receives as its element
  ``n`` element ``l % 4`` of what lane ``(l & ~15) + (l >> 2) % 4 + 4 n`` read -- a 4 x 16
  transpose that turns row-major 16-bit tiles into MFMA operand order. Lanes off in EXEC read
  nothing (their part reads 0) and are not written (an assumption: the guide does not say).
"""

from __future__ import annotations

import numpy as np

from . import memory as mm
from .ops_base import LANES, OPS, op
from .ops_vmem import _LOAD_FORMS, _buffer_operands

U32 = np.uint32
_LANE = np.arange(LANES)
G950 = ("gfx950",)


def _buffer_load_lds(ctx):
    nbytes, _ = _LOAD_FORMS[ctx.base[len("buffer_load_"):]]
    if nbytes > 4 and ctx.arch != "gfx950":
        raise ctx.fail("direct-to-LDS loads wider than a dword exist on gfx950 only")
    ctx.need(3)
    mods = dict(ctx.mods)
    mods.pop("lds")
    ctx.mods = mods
    rsrc, kw = _buffer_operands(ctx, ctx.ops[0], ctx.ops[1], ctx.ops[2])
    inst = int(mods.get("offset", 0))
    slot = (_LANE * nbytes).astype(U32)
    origin, mnem, line, pc = ctx.origin, ctx.ins.mnemonic, ctx.ins.line, ctx.index

    def h(w):
        m = w.em
        acc = mm.buffer_load(w.mem, rsrc(w), m, nbytes, origin=origin, **kw(w))
        la = (U32(w.m0) + U32(inst) + slot).astype(U32)
        if w.races is not None:
            w.races.access(w.wave_id, pc, la, m, nbytes, True, acc.data, w.lds.data)
        w.lds.write(la, m, acc.data, origin)
        if w.trace is not None:
            w.trace.global_access(mnem, line, acc.addrs, acc.touched, nbytes, kind="buffer", write=False, wave=w.uid)
            w.trace.lds_access(mnem, line, la, m, nbytes, write=True, wave=w.uid)
    return h


def _with_lds_form(name):
    plain = OPS.pop(name)

    def build(ctx):
        return _buffer_load_lds(ctx) if ctx.mods.get("lds") else plain(ctx)
    op(name)(build)


for _f in ("dword", "dwordx3", "dwordx4", "ubyte", "sbyte", "ushort", "sshort"):
    _with_lds_form(f"buffer_load_{_f}")


def tr_b16_sources():
    """(source lane, source halfword) for (destination lane, element n): arrays of shape (64, 4)."""
    l = _LANE[:, None]
    n = np.arange(4)[None, :]
    return (l & ~15) + ((l >> 2) & 3) + 4 * n, np.broadcast_to(l & 3, (LANES, 4))


@op("ds_read_b64_tr_b16", archs=G950)
def _ds_read_b64_tr_b16(ctx):
    ctx.need(2)
    extra = set(ctx.mods) - {"offset"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    off = U32(int(ctx.mods.get("offset", 0)))
    dst, a = ctx.ops
    if dst.kind != "v" or dst.count != 2 or a.kind != "v" or a.count != 1:
        raise ctx.fail("expected v[n:n+1], vaddr")
    row, arow = ctx.vrow(dst), a.index
    src_lane, src_half = tr_b16_sources()
    origin, mnem, line, pc = ctx.origin, ctx.ins.mnemonic, ctx.ins.line, ctx.index

    def h(w):
        m = w.em
        addr = w.v[arow] + off
        raw = w.lds.read(addr, m, 8, origin).view(np.uint16).copy()      # (64, 4)
        raw[~m] = 0
        if w.races is not None:
            w.races.access(w.wave_id, pc, addr, m, 8, False)
        if w.trace is not None:
            w.trace.lds_access(mnem, line, addr, m, 8, write=False, wave=w.uid)
        out = raw[src_lane, src_half]                                      # (64, 4) u16
        vals = np.ascontiguousarray(out).view(U32).T                        # (2, 64)
        np.copyto(w.v[row:row + 2], vals, where=m[None, :])
    return h
