"""LDS (DS) instructions: reads/writes of 1..16 bytes, read2/write2 (+st64), and the lane
permutes that use the LDS crossbar without touching memory (ds_bpermute, ds_permute,
ds_swizzle). CDNA3 ISA guide §12.13 (DS opcodes) and §11 "Data Share Operations".

Addresses are byte addresses in the workgroup's LDS (``wave.lds``, a ``memory.LDS``), formed as
``ADDR VGPR + offset``; read2/write2 scale their 8-bit offsets by the element size (x64 for the
st64 forms).
"""

from __future__ import annotations

import numpy as np

from .ops_base import LANES, EmulationError, op

U32 = np.uint32
_LANE = np.arange(LANES)


class LdsRaceError(EmulationError):
    """Two waves of a workgroup touched the same LDS bytes between two barriers, at least one
    of them writing: the result depends on wave timing."""


class LdsRaceChecker:
    """Per-byte bookkeeping of the last writer and reader(s) of a workgroup's LDS.

    A barrier epoch is the stretch between two ``s_barrier`` releases. Hardware gives no order
    between waves inside an epoch, so a byte written by one wave and read or written by another
    in the same epoch is a race (the emulator's run-to-barrier schedule would silently pick one
    order). ``mode``: ``'raise'`` (default) raises :class:`LdsRaceError` at the second access,
    ``'warn'`` records it in :attr:`races` and goes on, ``'off'`` never checks.

    Writes of equal values commute: two waves storing the same byte value to one byte is no
    write-write race (FlyDSL's MoE sorting clears ``cumsum[0]`` from every thread), and a write
    of the value a byte already holds races with no read (the reader sees that value in either
    order). Different values, or a read of a byte another wave changed, still are. The rule
    needs each write's bytes and the LDS before it lands (``new``, ``cur``); without them every
    write counts as a change.
    """

    _MANY = -2

    def __init__(self, nbytes: int, mode: str, describe):
        if mode not in ("raise", "warn"):
            raise ValueError(f"lds_races must be 'raise', 'warn' or 'off', got {mode!r}")
        n = max(int(nbytes), 1)
        self.mode = mode
        self.describe = describe  # instruction index -> text for messages
        self.epoch = 0
        self.w_wave = np.full(n, -1, np.int16)
        self.w_epoch = np.full(n, -1, np.int32)
        self.w_pc = np.zeros(n, np.int32)
        self.r_wave = np.full(n, -1, np.int16)
        self.r_epoch = np.full(n, -1, np.int32)
        self.r_pc = np.zeros(n, np.int32)
        self.w_val = np.zeros(n, np.uint8)     # byte stored by the last write
        self.w_known = np.zeros(n, bool)
        # the last write that changed the byte: only such a write can be seen by a read
        self.c_wave = np.full(n, -1, np.int16)
        self.c_epoch = np.full(n, -1, np.int32)
        self.c_pc = np.zeros(n, np.int32)
        self.races: list = []

    def barrier(self) -> None:
        self.epoch += 1

    def _report(self, kind, wave, pc, byte, other_wave, other_pc):
        other = "several waves" if other_wave == self._MANY else f"wave {other_wave}"
        msg = (f"LDS {kind} race at byte {byte:#x}: wave {wave} at {self.describe(pc)} and {other} at "
               f"{self.describe(other_pc)} with no s_barrier in between")
        if self.mode == "raise":
            raise LdsRaceError(msg)
        self.races.append(msg)

    def access(self, wave: int, pc: int, addrs, mask, nbytes: int, write: bool, new=None, cur=None) -> None:
        lanes = np.flatnonzero(mask)
        if lanes.size == 0:
            return
        idx = (addrs[lanes].astype(np.int64)[:, None] + np.arange(nbytes)).ravel()
        keep = (idx >= 0) & (idx < self.w_wave.size)  # out-of-range bytes are the LDS's business
        vals = same_w = same_r = None
        if write and new is not None and cur is not None:
            keep &= idx < cur.size
            vals = np.asarray(new, np.uint8)[lanes].ravel()[keep]
        idx = idx[keep]
        if idx.size == 0:
            return
        if vals is not None:
            same_w, same_r = self.w_known[idx] & (self.w_val[idx] == vals), cur[idx] == vals
        e = self.epoch
        if write:
            other_w = (self.w_epoch[idx] == e) & (self.w_wave[idx] != wave)
            if same_w is not None:
                other_w &= ~same_w
            if other_w.any():
                b = int(idx[np.argmax(other_w)])
                self._report("write-write", wave, pc, b, int(self.w_wave[b]), int(self.w_pc[b]))
        else:
            other_w = (self.c_epoch[idx] == e) & (self.c_wave[idx] != wave)
            if other_w.any():
                b = int(idx[np.argmax(other_w)])
                self._report("read-after-write", wave, pc, b, int(self.c_wave[b]), int(self.c_pc[b]))
        if write:
            other_r = (self.r_epoch[idx] == e) & (self.r_wave[idx] != wave)
            if same_r is not None:
                other_r &= ~same_r
            if other_r.any():
                b = int(idx[np.argmax(other_r)])
                self._report("write-after-read", wave, pc, b, int(self.r_wave[b]), int(self.r_pc[b]))
            self.w_wave[idx] = wave
            self.w_epoch[idx] = e
            self.w_pc[idx] = pc
            self.w_val[idx] = vals if vals is not None else 0
            self.w_known[idx] = vals is not None   # an unknown byte equals no later write
            ch = idx if same_r is None else idx[~same_r]
            self.c_wave[ch] = wave
            self.c_epoch[ch] = e
            self.c_pc[ch] = pc
        else:
            shared = (self.r_epoch[idx] == e) & (self.r_wave[idx] != wave)
            self.r_wave[idx] = np.where(shared, self._MANY, wave)
            self.r_epoch[idx] = e
            self.r_pc[idx] = pc

_READ = {"b32": (4, "dw"), "b64": (8, "dw"), "b96": (12, "dw"), "b128": (16, "dw"),
         "u8": (1, "zx"), "i8": (1, "sx"), "u16": (2, "zx"), "i16": (2, "sx"),
         "u8_d16": (1, "lo"), "u8_d16_hi": (1, "hi"), "i8_d16": (1, "lo_sx"), "i8_d16_hi": (1, "hi_sx"),
         "u16_d16": (2, "lo"), "u16_d16_hi": (2, "hi")}
_WRITE = {"b32": (4, "dw"), "b64": (8, "dw"), "b96": (12, "dw"), "b128": (16, "dw"),
          "b8": (1, "lo"), "b16": (2, "lo"), "b8_d16_hi": (1, "hi"), "b16_d16_hi": (2, "hi")}


def _mods(ctx, *allowed):
    extra = set(ctx.mods) - set(allowed) - {"gds"}
    if extra or ctx.mods.get("gds"):
        raise ctx.fail(f"modifiers {sorted(extra) or ['gds']}")


def _trace(w, mnem, line, addrs, mask, nbytes, write):
    w.trace.lds_access(mnem, line, addrs, mask, nbytes, write=write, wave=w.uid)


def _check(w, pc, addrs, mask, nbytes, write, data=None):
    w.races.access(w.wave_id, pc, addrs, mask, nbytes, write, data, w.lds.data)


def _addr(ctx, o):
    if o.kind != "v" or o.count != 1:
        raise ctx.fail(f"address {o} must be one VGPR")
    r = o.index
    return lambda w, off: w.v[r] + U32(off)


def _writer(ctx, o, nbytes, form):
    # The same placement rules as vector memory loads.
    from .ops_vmem import _load_writer

    return _load_writer(ctx, o, nbytes, form)


def _reader(ctx, o, nbytes, form):
    from .ops_vmem import _store_reader

    return _store_reader(ctx, o, nbytes, form)


def _ds_read(ctx):
    nbytes, form = _READ[ctx.base[len("ds_read_"):]]
    ctx.need(2)
    _mods(ctx, "offset")
    off = int(ctx.mods.get("offset", 0))
    addr = _addr(ctx, ctx.ops[1])
    wr = _writer(ctx, ctx.ops[0], nbytes, form)
    origin, mnem, line, pc = ctx.origin, ctx.ins.mnemonic, ctx.ins.line, ctx.index

    def h(w):
        a = addr(w, off)
        m = w.em
        d = w.lds.read(a, m, nbytes, origin)
        if w.races is not None:
            _check(w, pc, a, m, nbytes, False)
        if w.trace is not None:
            _trace(w, mnem, line, a, m, nbytes, False)
        wr(w, d, m)
    return h


def _ds_write(ctx):
    nbytes, form = _WRITE[ctx.base[len("ds_write_"):]]
    ctx.need(2)
    _mods(ctx, "offset")
    off = int(ctx.mods.get("offset", 0))
    addr = _addr(ctx, ctx.ops[0])
    rd = _reader(ctx, ctx.ops[1], nbytes, form)
    origin, mnem, line, pc = ctx.origin, ctx.ins.mnemonic, ctx.ins.line, ctx.index

    def h(w):
        a = addr(w, off)
        m = w.em
        data = rd(w)
        if w.races is not None:
            _check(w, pc, a, m, nbytes, True, data)
        w.lds.write(a, m, data, origin)
        if w.trace is not None:
            _trace(w, mnem, line, a, m, nbytes, True)
    return h


for _k in _READ:
    op(f"ds_read_{_k}")(_ds_read)
for _k in _WRITE:
    op(f"ds_write_{_k}")(_ds_write)


def _pair_geometry(ctx, prefix):
    kind = ctx.base[len(prefix):]  # b32 / b64 / st64_b32 / st64_b64
    st64 = kind.startswith("st64_")
    size = 8 if kind.endswith("b64") else 4
    if kind not in ("b32", "b64", "st64_b32", "st64_b64"):
        raise ctx.fail("unknown read2/write2 form")
    scale = size * (64 if st64 else 1)
    _mods(ctx, "offset0", "offset1")
    return size, int(ctx.mods.get("offset0", 0)) * scale, int(ctx.mods.get("offset1", 0)) * scale


def _ds_read2(ctx):
    ctx.base = ctx.base.replace("ds_read2st64_", "ds_read2_st64_")
    size, off0, off1 = _pair_geometry(ctx, "ds_read2_")
    ctx.need(2)
    n = size // 4
    dst = ctx.ops[0]
    if dst.count != 2 * n:
        raise ctx.fail(f"destination {dst} should be {2 * n} registers")
    row = ctx.vrow(dst)
    addr = _addr(ctx, ctx.ops[1])
    origin, mnem, line, pc = ctx.origin, ctx.ins.mnemonic, ctx.ins.line, ctx.index

    def h(w):
        m = w.em
        a0, a1 = addr(w, off0), addr(w, off1)
        d0 = w.lds.read(a0, m, size, origin)
        d1 = w.lds.read(a1, m, size, origin)
        if w.races is not None:
            _check(w, pc, a0, m, size, False)
            _check(w, pc, a1, m, size, False)
        if w.trace is not None:
            _trace(w, mnem, line, a0, m, size, False)
            _trace(w, mnem, line, a1, m, size, False)
        vals = np.concatenate([d0.view(U32), d1.view(U32)], axis=1).T
        np.copyto(w.v[row:row + 2 * n], vals, where=m[None, :])
    return h


def _ds_write2(ctx):
    ctx.base = ctx.base.replace("ds_write2st64_", "ds_write2_st64_")
    size, off0, off1 = _pair_geometry(ctx, "ds_write2_")
    ctx.need(3)
    form = "dw"
    addr = _addr(ctx, ctx.ops[0])
    r0 = _reader(ctx, ctx.ops[1], size, form)
    r1 = _reader(ctx, ctx.ops[2], size, form)
    origin, mnem, line, pc = ctx.origin, ctx.ins.mnemonic, ctx.ins.line, ctx.index

    def h(w):
        m = w.em
        a0, a1 = addr(w, off0), addr(w, off1)
        d0 = r0(w)
        if w.races is not None:
            _check(w, pc, a0, m, size, True, d0)
        w.lds.write(a0, m, d0, origin)
        d1 = r1(w)
        if w.races is not None:
            _check(w, pc, a1, m, size, True, d1)
        w.lds.write(a1, m, d1, origin)
        if w.trace is not None:
            _trace(w, mnem, line, a0, m, size, True)
            _trace(w, mnem, line, a1, m, size, True)
    return h


for _k in ("b32", "b64"):
    op(f"ds_read2_{_k}", f"ds_read2st64_{_k}")(_ds_read2)
    op(f"ds_write2_{_k}", f"ds_write2st64_{_k}")(_ds_write2)


@op("ds_bpermute_b32")
def _ds_bpermute(ctx):
    """dst[i] = data[((addr[i] + offset) / 4) % 64], reading 0 from lanes off in EXEC
    (CDNA3 §12.13 DS_BPERMUTE_B32 pseudo-code)."""
    ctx.need(3)
    _mods(ctx, "offset")
    off = U32(int(ctx.mods.get("offset", 0)))
    ra, rd = ctx.vrow(ctx.ops[1]), ctx.vrow(ctx.ops[2])
    wr = ctx.vwrite(ctx.ops[0], "u32")

    def h(w):
        src = ((w.v[ra] + off) >> U32(2)) & U32(63)
        data = w.v[rd] if w.eall else np.where(w.em, w.v[rd], U32(0))
        wr(w, data[src])
    return h


@op("ds_permute_b32")
def _ds_permute(ctx):
    """Forward permute: lane i sends data[i] to lane ((addr[i] + offset) / 4) % 64; the highest
    sending lane wins; lanes nobody sends to get 0 (CDNA3 §12.13 DS_PERMUTE_B32)."""
    ctx.need(3)
    _mods(ctx, "offset")
    off = U32(int(ctx.mods.get("offset", 0)))
    ra, rd = ctx.vrow(ctx.ops[1]), ctx.vrow(ctx.ops[2])
    wr = ctx.vwrite(ctx.ops[0], "u32")

    def h(w):
        dst = (((w.v[ra] + off) >> U32(2)) & U32(63)).astype(np.int64)
        tmp = np.zeros(LANES, U32)
        senders = _LANE[w.em]
        tmp[dst[senders]] = w.v[rd][senders]  # numpy assigns in order: the highest lane wins
        wr(w, tmp)
    return h


def _swizzle_pattern(offset: int) -> np.ndarray:
    """Source lane per lane for a ds_swizzle offset (CDNA3 §12.13 DS_SWIZZLE_B32):
    bit 15 set -> QDMode: lane i reads lane (i & ~3) + offset[2k+1:2k] with k = i & 3;
    else bitmask mode within each 32-lane half: ((i & and) | or) ^ xor on the low 5 bits."""
    i = _LANE
    if offset & 0x8000:
        sel = np.array([(offset >> (2 * k)) & 3 for k in range(4)])
        return (i & ~3) + sel[i & 3]
    and_m, or_m, xor_m = offset & 31, (offset >> 5) & 31, (offset >> 10) & 31
    return (i & 32) | ((((i & 31) & and_m) | or_m) ^ xor_m)


@op("ds_swizzle_b32")
def _ds_swizzle(ctx):
    ctx.need(2)
    _mods(ctx, "offset")
    src = _swizzle_pattern(int(ctx.mods.get("offset", 0)))
    rd = ctx.vrow(ctx.ops[1])
    wr = ctx.vwrite(ctx.ops[0], "u32")

    def h(w):
        data = w.v[rd] if w.eall else np.where(w.em, w.v[rd], U32(0))
        wr(w, data[src])
    return h
