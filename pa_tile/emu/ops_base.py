"""Operand plumbing shared by the instruction families (``ops_*.py``).

Every instruction is decoded once into a *handler*: a closure ``h(wave) -> None | int`` that
does the work for all 64 lanes and returns ``None`` (fall through), a branch target index, or
one of the ``END``/``BARRIER`` sentinels. Builders registered with :func:`op` receive a
:class:`DecodeCtx` and return the handler; they resolve every operand to an accessor closure up
front so nothing is parsed while the kernel runs.

Register state conventions (see ``docs/DESIGN.md``): ``wave.v`` is ``uint32[512, 64]`` (AGPRs at
rows 256..511), ``wave.s`` is ``uint32[128]`` with VCC at s[106:107], M0 at s124 and EXEC at
s[126:127] (the hardware SGPR numbering), ``wave.scc`` an int, ``wave.em`` the cached EXEC lane
mask (``bool[64]``) and ``wave.eall`` whether all 64 lanes are on.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

from .asm import SGPR_EXEC, SGPR_VCC, Instruction, Operand

END = -1
BARRIER = -2

LANES = 64
AGPR_BASE = 256
M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF

DTYPES = {
    "b32": np.uint32, "u32": np.uint32, "i32": np.int32, "f32": np.float32,
    "b64": np.uint64, "u64": np.uint64, "i64": np.int64, "f64": np.float64,
    "b16": np.uint16, "u16": np.uint16, "i16": np.int16, "f16": np.float16, "bf16": np.uint16,
}
WIDTH = {t: np.dtype(d).itemsize * 8 for t, d in DTYPES.items()}
FLOAT_TYPES = ("f16", "f32", "f64")

_INV_2PI = 0.15915494309189535


class UnsupportedInstruction(NotImplementedError):
    """An instruction (or a form of it) the emulator has no semantics for. Raised at decode time."""


class EmulationError(RuntimeError):
    """Something went wrong while executing (the message names the instruction and wave)."""


BuilderFn = Callable[["DecodeCtx"], Callable]
OPS: Dict[str, BuilderFn] = {}
#: base mnemonic -> the only archs that have it (absent: every arch we model)
ARCHS: Dict[str, tuple] = {}


def op(*names: str, archs: Optional[tuple] = None):
    """Register a builder for one or more base mnemonics (without _e32/_e64/_dpp/_sdwa)."""

    def deco(fn: BuilderFn) -> BuilderFn:
        for n in names:
            if n in OPS:
                raise RuntimeError(f"duplicate semantics for {n}")
            OPS[n] = fn
            if archs:
                ARCHS[n] = tuple(archs)
        return fn

    return deco


ENC_SUFFIXES = ("_e32", "_e64", "_dpp", "_sdwa")


def split_mnemonic(m: str):
    for suf in ENC_SUFFIXES:
        if m.endswith(suf):
            return m[: -len(suf)], suf[1:]
    return m, ""


# --------------------------------------------------------------------------- lane masks

def mask_from_words(words: np.ndarray) -> np.ndarray:
    """Two uint32 SGPR words (lane 0 = bit 0 of the first) -> bool[64]."""
    return np.unpackbits(words.view(np.uint8), bitorder="little").view(bool)


def words_from_mask(mask: np.ndarray) -> np.ndarray:
    return np.packbits(mask, bitorder="little").view(np.uint32)


def mask_from_int(x: int) -> np.ndarray:
    return mask_from_words(np.array([x & M32, (x >> 32) & M32], np.uint32))


# --------------------------------------------------------------------------- constants

def _float_bits(value: float, typ: str) -> int:
    """Bit pattern of an inline float constant for an operand of type *typ*."""
    if typ in ("f16", "b16", "u16", "i16"):
        if abs(value - _INV_2PI) < 1e-6:
            return 0x3118
        return int(np.array(value, np.float16).view(np.uint16))
    if typ == "bf16":
        if abs(value - _INV_2PI) < 1e-6:
            return 0x3E22
        return int(np.array(value, np.float32).view(np.uint32)) >> 16
    if WIDTH.get(typ, 32) == 64:
        if abs(value - _INV_2PI) < 1e-6:
            return 0x3FC45F306DC9C882
        return int(np.array(value, np.float64).view(np.uint64))
    if abs(value - _INV_2PI) < 1e-6:
        return 0x3E22F983
    return int(np.array(value, np.float32).view(np.uint32))


def const_bits(o: Operand, typ: str) -> int:
    """The value an immediate operand supplies to an operand of type *typ* (as unsigned bits)."""
    width = WIDTH.get(typ, 32)
    mask = (1 << width) - 1
    v = o.value
    if isinstance(v, float):
        bits = _float_bits(v, typ)
    else:
        # A literal feeding a 64-bit float operand supplies the high dword (ISA: "literal constants").
        if typ == "f64" and o.literal or (typ == "f64" and not -16 <= v <= 64):
            bits = (v & M32) << 32
        else:
            bits = v & mask
    is_float = typ in FLOAT_TYPES or typ == "bf16"
    if o.neg:
        bits = bits ^ (1 << (width - 1)) if is_float else -bits
    if o.abs:
        bits &= ~(1 << (width - 1))
    return bits & mask


# --------------------------------------------------------------------------- decode context

class DecodeCtx:
    """What a builder needs to know about one instruction, plus operand accessor factories."""

    def __init__(self, ins: Instruction, kernel, arch: str, labels: Dict[str, int], index: int):
        self.ins = ins
        self.kernel = kernel.name
        self.desc = kernel.descriptor
        self.arch = arch
        self.labels = labels
        self.index = index
        self.base, self.enc = split_mnemonic(ins.mnemonic)
        self.mods = ins.mods
        self.ops = ins.operands

    @property
    def origin(self) -> str:
        return f"{self.kernel} line {self.ins.line}: {self.ins.text}"

    def fail(self, why: str) -> UnsupportedInstruction:
        return UnsupportedInstruction(f"{self.ins.mnemonic}: {why} ({self.origin})")

    def need(self, n: int) -> None:
        if len(self.ops) != n:
            raise self.fail(f"expected {n} operands, got {len(self.ops)}")

    def no_mods(self, *allowed: str) -> None:
        extra = set(self.mods) - set(allowed)
        if extra:
            raise self.fail(f"modifiers {sorted(extra)} not supported")

    def label(self, o: Operand) -> int:
        if o.kind != "label":
            raise self.fail(f"expected a label, got {o}")
        if o.name not in self.labels:
            raise self.fail(f"unknown label {o.name}")
        return self.labels[o.name]

    # ---- scalar (SALU) accessors: values are Python ints (unsigned)

    def sread(self, o: Operand, bits: int = 32) -> Callable:
        if o.kind == "s":
            i = o.index
            if bits == 64:
                return lambda w: int(w.s[i]) | (int(w.s[i + 1]) << 32)
            return lambda w: int(w.s[i])
        if o.kind == "imm":
            c = const_bits(o, "b64" if bits == 64 else "b32")
            return lambda w: c
        if o.kind == "special" and o.name in ("scc", "src_scc"):
            return lambda w: w.scc
        if o.kind == "special" and o.name in ("vccz", "src_vccz"):
            return lambda w: int(not (w.s[SGPR_VCC] | w.s[SGPR_VCC + 1]))
        if o.kind == "special" and o.name in ("execz", "src_execz"):
            return lambda w: int(not w.eall and not w.em.any())
        raise self.fail(f"cannot read {o} as a scalar source")

    def swrite(self, o: Operand, bits: int = 32) -> Callable:
        if o.kind != "s":
            raise self.fail(f"cannot write {o} as a scalar destination")
        i = o.index
        touches_exec = i <= SGPR_EXEC + 1 and i + bits // 32 > SGPR_EXEC
        if bits == 64:
            if touches_exec:
                def wr(w, x):
                    w.s[i] = x & M32
                    w.s[i + 1] = (x >> 32) & M32
                    w.sync_exec()
            else:
                def wr(w, x):
                    w.s[i] = x & M32
                    w.s[i + 1] = (x >> 32) & M32
            return wr
        if touches_exec:
            def wr32e(w, x):
                w.s[i] = x & M32
                w.sync_exec()
            return wr32e

        def wr32(w, x):
            w.s[i] = x & M32
        return wr32

    def swrite_n(self, o: Operand, n: int) -> Callable:
        """Write n consecutive dwords from a uint32 array (SMEM results, readlane of ranges)."""
        if o.kind != "s" or o.count != n:
            raise self.fail(f"destination {o} should be {n} SGPRs")
        i = o.index
        touches_exec = i <= SGPR_EXEC + 1 and i + n > SGPR_EXEC

        def wr(w, arr):
            w.s[i:i + n] = arr
            if touches_exec:
                w.sync_exec()
        return wr

    # ---- lane masks held in SGPR pairs (VCC, carries, compare results, cndmask selectors)

    def mask_read(self, o: Operand) -> Callable:
        if o.kind == "s" and o.count == 2:
            i = o.index
            return lambda w: mask_from_words(w.s[i:i + 2])
        if o.kind == "imm":
            m = mask_from_int(const_bits(o, "b64"))
            return lambda w: m
        raise self.fail(f"cannot read {o} as a lane mask")

    def mask_write(self, o: Operand) -> Callable:
        """Write a per-lane bool result; inactive lanes write 0 (VOPC and carry-out rule)."""
        if o.kind != "s" or o.count != 2:
            raise self.fail(f"cannot write lane mask to {o}")
        i = o.index
        touches_exec = i == SGPR_EXEC

        def wr(w, m):
            if not w.eall:
                m = m & w.em
            w.s[i:i + 2] = words_from_mask(np.broadcast_to(m, (LANES,)))
            if touches_exec:
                w.sync_exec()
        return wr

    # ---- vector sources: arrays of the operand type, shape (64,) or (1,) (uniform)

    def vread(self, o: Operand, typ: str, hi: bool = False) -> Callable:
        """Accessor for a VALU source of type *typ*. *hi* selects the high 16 bits (op_sel)."""
        dt = DTYPES[typ]
        width = WIDTH[typ]
        sign = 1 << (width - 1)
        fl = typ in FLOAT_TYPES or typ == "bf16"
        if o.kind == "imm":
            bits = const_bits(o, typ)
            if width == 16 and hi:
                bits = 0  # high half of a 16-bit inline constant is zero (non-packed ops)
            arr = np.array([bits], dtype={16: np.uint16, 32: np.uint32, 64: np.uint64}[width]).view(dt)
            arr.setflags(write=False)
            return lambda w: arr
        if o.kind in ("v", "a", "s"):
            if (o.neg or o.abs) and not fl:
                raise self.fail(f"neg/abs modifier on integer operand {o}")
            if width == 64:
                base = self._raw64(o)
            elif width == 32:
                base = self._raw32(o)
            else:
                raw = self._raw32(o)
                if hi:
                    base = lambda w: (raw(w) >> 16).astype(np.uint16)
                else:
                    base = lambda w: raw(w).astype(np.uint16)
            udt = {16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
            if o.neg or o.abs:
                andm = udt(~sign & ((1 << width) - 1)) if o.abs else udt((1 << width) - 1)
                xorm = udt(sign if o.neg else 0)
                b0 = base
                base = lambda w: (b0(w) & andm) ^ xorm
            if dt is udt:
                return base
            return lambda w: base(w).view(dt)
        raise self.fail(f"cannot read {o} as a vector source")

    def _raw32(self, o: Operand) -> Callable:
        if o.kind == "v":
            i = o.index
            return lambda w: w.v[i]
        if o.kind == "a":
            i = o.index + AGPR_BASE
            return lambda w: w.v[i]
        if o.kind == "s":
            i = o.index
            return lambda w: w.s[i:i + 1]
        raise self.fail(f"bad source {o}")

    def _raw64(self, o: Operand) -> Callable:
        if o.kind in ("v", "a"):
            i = o.index + (AGPR_BASE if o.kind == "a" else 0)
            return lambda w: w.v[i].astype(np.uint64) | (w.v[i + 1].astype(np.uint64) << np.uint64(32))
        if o.kind == "s":
            i = o.index
            return lambda w: w.s[i:i + 2].view(np.uint64)
        raise self.fail(f"bad 64-bit source {o}")

    def vrow(self, o: Operand) -> int:
        """Register-file row of a VGPR/AGPR operand."""
        if o.kind == "v":
            return o.index
        if o.kind == "a":
            return o.index + AGPR_BASE
        raise self.fail(f"expected a vector register, got {o}")

    # ---- vector destinations

    def vwrite(self, o: Operand, typ: str, hi: bool = False) -> Callable:
        """Writer ``wr(w, result, extra_mask=None)``; lanes off in EXEC (or extra_mask) keep old values."""
        row = self.vrow(o)
        width = WIDTH[typ]
        if width == 64:
            def wr64(w, r, m=None):
                r = np.asarray(r)
                if r.dtype != np.uint64:
                    r = r.view(np.uint64) if r.dtype.itemsize == 8 else r.astype(np.uint64)
                lo = (r & np.uint64(M32)).astype(np.uint32)
                hi_ = (r >> np.uint64(32)).astype(np.uint32)
                if m is None and w.eall:
                    w.v[row] = lo
                    w.v[row + 1] = hi_
                else:
                    em = w.em if m is None else (w.em & m)
                    np.copyto(w.v[row], lo, where=em)
                    np.copyto(w.v[row + 1], hi_, where=em)
            return wr64
        if width == 16:
            # gfx9 16-bit VALU results zero the high half; op_sel[dst] (hi) writes the high
            # half and keeps the low one.
            def wr16(w, r, m=None):
                r = np.asarray(r)
                if r.dtype != np.uint16:
                    r = r.view(np.uint16)
                r = r.astype(np.uint32)
                val = (w.v[row] & np.uint32(0xFFFF)) | (r << np.uint32(16)) if hi else r
                if m is None and w.eall:
                    w.v[row] = val
                else:
                    em = w.em if m is None else (w.em & m)
                    np.copyto(w.v[row], val, where=em)
            return wr16

        def wr32(w, r, m=None):
            if r.dtype != np.uint32:
                r = r.view(np.uint32) if r.dtype.itemsize == 4 else r.astype(np.uint32)
            if m is None and w.eall:
                w.v[row] = r
            else:
                em = w.em if m is None else (w.em & m)
                np.copyto(w.v[row], r, where=em)
        return wr32


def as_u32(r) -> np.ndarray:
    """Reinterpret a 32-bit result (any 4-byte dtype) or convert an integer array to uint32 bits."""
    r = np.asarray(r)
    if r.dtype == np.uint32:
        return r
    if r.dtype.itemsize == 4:
        return r.view(np.uint32)
    if r.dtype == bool:
        return r.astype(np.uint32)
    return (r.astype(np.int64) & M32).astype(np.uint32)


