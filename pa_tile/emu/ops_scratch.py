"""Scratch (the private segment): ``scratch_load_*`` / ``scratch_store_*`` and the per-lane
memory behind them.

gfx942 and gfx950 have *architected flat scratch* (LLVM AMDGPUUsage, processor table): the
hardware points FLAT_SCRATCH at the wave's slice of the queue's scratch backing memory, there
is no private segment buffer V# in user SGPRs (``.amdhsa_user_sgpr_private_segment_buffer``
must be 0) and no wave offset SGPR is set up. Scratch instructions address a lane's own private
bytes: ``address = (vaddr VGPR or 0) + (saddr SGPR or 0) + offset`` (CDNA3 §11 "Scratch"),
and the hardware swizzles that per lane into the backing memory. The swizzle is invisible to
the kernel, so the emulator keeps each lane's ``.amdhsa_private_segment_fixed_size`` bytes
apart (:class:`PrivateSegment`) and checks every access against that size, lane by lane: past
it, real hardware reads or overwrites the next lane's or wave's spill slots.
"""

from __future__ import annotations

import numpy as np

from .memory import MemoryFault
from .ops_base import LANES, M32, op
from .ops_vmem import _LOAD_FORMS, _STORE_FORMS, _load_writer, _store_reader

U32, I64 = np.uint32, np.int64


class PrivateSegment:
    """Each lane's private bytes of one wave (``uint8[64, nbytes]``), zeroed per workgroup."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.data = np.zeros((LANES, self.nbytes), np.uint8)

    def reset(self) -> None:
        self.data.fill(0)

    def _check(self, offs, mask, nbytes, origin, what):
        lanes = np.flatnonzero(mask)
        o = offs[lanes]
        bad = (o < 0) | (o + nbytes > self.nbytes)
        if bad.any():
            lane, addr = int(lanes[bad][0]), int(o[bad][0])
            raise MemoryFault(
                f"{origin}: scratch {what} of {nbytes} B by lane {lane} at private offset {addr} is outside the "
                f"lane's private segment of {self.nbytes} B ({int(bad.sum())} of {lanes.size} active lanes out of "
                "bounds; .amdhsa_private_segment_fixed_size)",
                origin=origin, space="scratch", lane=lane, address=addr, nbytes=nbytes,
                nearest=("private segment", 0, self.nbytes), bad_lanes=lanes[bad].tolist())
        return lanes, o

    def load(self, offs, mask, nbytes, origin=""):
        out = np.zeros((LANES, nbytes), np.uint8)
        if mask.any():
            lanes, o = self._check(offs, mask, nbytes, origin, "load")
            out[lanes] = self.data[lanes[:, None], o[:, None] + np.arange(nbytes)]
        return out

    def store(self, offs, mask, data, origin=""):
        nbytes = data.shape[1]
        if mask.any():
            lanes, o = self._check(offs, mask, nbytes, origin, "store")
            self.data[lanes[:, None], o[:, None] + np.arange(nbytes)] = data[lanes]


def _offsets(ctx, vaddr, saddr):
    """Per-lane private byte offset accessor (int64, so a negative sum faults instead of wrapping)."""
    extra = set(ctx.mods) - {"offset", "glc", "slc", "nt", "sc0", "sc1"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    imm = int(ctx.mods.get("offset", 0))
    if vaddr.kind == "v" and vaddr.count == 1:
        rv = ctx.vread(vaddr, "u32")
    elif vaddr.kind == "special" and vaddr.name == "off":
        rv = None
    else:
        raise ctx.fail(f"scratch vaddr {vaddr} must be one VGPR or off")
    if saddr.kind == "s" and saddr.count == 1:
        rs = ctx.sread(saddr)
    elif saddr.kind == "special" and saddr.name == "off":
        rs = None
    else:
        raise ctx.fail(f"scratch saddr {saddr} must be one SGPR or off")
    const = np.full(LANES, imm, I64)

    def offs(w):
        o = const
        if rs is not None:
            s = rs(w) & M32
            o = o + (s - (1 << 32) if s >> 31 else s)  # SGPR offset is signed
        if rv is not None:
            o = o + np.broadcast_to(rv(w), (LANES,)).astype(I64)
        return o
    return offs


def _need_scratch(origin, w):
    if w.scratch is None:
        raise MemoryFault(
            f"{origin}: scratch access, but the kernel declares no private segment "
            "(.amdhsa_private_segment_fixed_size 0)",
            origin=origin, space="scratch", lane=None, address=0, nbytes=0)
    return w.scratch


def _scratch_load(ctx):
    form_name = ctx.base[len("scratch_load_"):]
    if form_name not in _LOAD_FORMS:
        raise ctx.fail("unknown scratch load width")
    nbytes, form = _LOAD_FORMS[form_name]
    ctx.need(3)
    offs = _offsets(ctx, ctx.ops[1], ctx.ops[2])
    wr = _load_writer(ctx, ctx.ops[0], nbytes, form)
    origin = ctx.origin

    def h(w):
        m = w.em
        d = _need_scratch(origin, w).load(offs(w), m, nbytes, origin)
        wr(w, d, m)
    return h


def _scratch_store(ctx):
    form_name = ctx.base[len("scratch_store_"):]
    if form_name not in _STORE_FORMS:
        raise ctx.fail("unknown scratch store width")
    nbytes, form = _STORE_FORMS[form_name]
    ctx.need(3)
    offs = _offsets(ctx, ctx.ops[0], ctx.ops[2])
    rd = _store_reader(ctx, ctx.ops[1], nbytes, form)
    origin = ctx.origin

    def h(w):
        _need_scratch(origin, w).store(offs(w), w.em, rd(w), origin)
    return h


for _f in _LOAD_FORMS:
    op(f"scratch_load_{_f}")(_scratch_load)
for _f in _STORE_FORMS:
    op(f"scratch_store_{_f}")(_scratch_store)
