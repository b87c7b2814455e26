"""Numerics of the emulated CDNA3 (gfx942) / CDNA4 (gfx950) ALUs, as pure numpy functions.

Everything here is array-in/array-out with no wave state; the instruction modules decode operands,
call these, and write registers back. Register contents are ``uint32`` arrays; "f32" arguments are
``float32`` arrays whose *bit patterns* are preserved (pass ``bits.view(np.float32)``).

Sources, cited as "CDNA3 §x" / "CDNA4 §x" below:

* AMD Instinct MI300 (CDNA3) ISA reference guide and AMD Instinct CDNA4 ISA reference guide
  (markdown conversions in github.com/kuhar/amdgpu-isa-manuals, ``cdna3/README.md``,
  ``cdna4/README.md``): §7.1.4 general MFMA input/output layout, §7.1.2 MFMA control rules,
  §7.2 (CDNA3) / §7.3 (CDNA4) "BF8 and FP8 formats and conversions" incl. Table 30 and the
  FP16_OVFL rule, §7.3 / §7.4 "Floating-point handling details", §12.7-§12.11 instruction pseudo-code
  (V_CVT_PK_FP8_F32, V_CVT_F32_FP8, V_CVT_PK_F32_FP8, V_CVT_PK_BF16_F32, V_EXP_F32, V_LOG_F32,
  V_RCP_F32, V_RSQ_F32, V_SQRT_F32, V_LDEXP_F32, V_MAX_F32, V_MIN_F32, V_MAX3_F32,
  V_MAXIMUM3_F32), §3.5 Table 4 MODE register (FP16_OVFL, bit 23).
* ROCm/amd_matrix_instruction_calculator (CDNA3 register layouts; used to cross-check the
  layout formulas during development).

Hardware facts that shape the API (details at each function):

* fp8/bf8 are FNUZ on gfx942 (e4m3 bias 8, e5m2 bias 16, 0x80 is the only NaN, no -0, no inf)
  and OCP on gfx950 (e4m3fn bias 7, max 448, NaN 0x7f/0xff, no inf; e5m2 bias 15 with inf).
* F32 -> FP8/BF8 conversion (V_CVT_PK_FP8_F32 and friends) is round-to-nearest-even and
  **ignores the instruction's clamp bit**. Overflow is governed by the MODE bit FP16_OVFL
  (initialised from the kernel descriptor's ``.amdhsa_fp16_overflow``), which is what the
  ``saturate`` argument models. FlyDSL kernels are compiled with ``.amdhsa_fp16_overflow 0``,
  so on real hardware an out-of-range f32 becomes NaN (fp8) / inf (bf8) unless the kernel
  clamps first (HIP's saturating converters do exactly that with ``v_med3_f32`` before the
  conversion instruction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Tuple

import numpy as np

from .. import arch as _arch

__all__ = [
    "f32_bits", "bits_f32", "fp8_format_for_arch",
    "fp8_decode", "fp8_encode", "bf8_decode", "bf8_encode",
    "cvt_pk_fp8_f32", "cvt_pk_bf8_f32", "cvt_f32_fp8", "cvt_f32_bf8", "cvt_pk_f32_fp8", "cvt_pk_f32_bf8",
    "f32_to_f16_bits", "f16_bits_to_f32", "f32_to_bf16_bits", "bf16_bits_to_f32", "cvt_pk_bf16_f32",
    "mfma", "mfma_archs", "mfma_shapes", "mfma_lane_layout", "mfma_pack_operand", "mfma_unpack_result", "MFMA_MNEMONICS",
    "exp2_f32", "log2_f32", "rcp_f32", "rsq_f32", "sqrt_f32", "ldexp_f32",
    "round_f32", "fma_f32", "max_f32", "min_f32", "max3_f32", "min3_f32",
    "maximum_f32", "minimum_f32", "maximum3_f32", "minimum3_f32",
]

# The NaN AMD's VALU returns for an invalid operation (log(-1), sqrt(-inf), ...): the ISA's
# functional examples (CDNA3/CDNA4 §12.8, V_LOG_F32 / V_RSQ_F32 / V_SQRT_F32) all show 0xffc00000.
DEFAULT_NAN_BITS = np.uint32(0xFFC00000)
F32_MAX = np.float32(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------
# bit views
# --------------------------------------------------------------------------------------------

def f32_bits(x) -> np.ndarray:
    """float32 array -> its uint32 bit patterns (no conversion of values)."""
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def bits_f32(u) -> np.ndarray:
    """uint32 bit patterns -> float32 array with those bits (NaN payloads preserved)."""
    return np.asarray(u, dtype=np.uint32).view(np.float32)


def _to64(bits) -> np.ndarray:
    """f32 bit patterns -> float64 values; signalling NaNs stay NaN without a numpy warning."""
    with np.errstate(invalid="ignore"):
        return np.asarray(bits, dtype=np.uint32).view(np.float32).astype(np.float64)


def _quiet(bits: np.ndarray) -> np.ndarray:
    return bits | np.uint32(0x00400000)


def _is_nan_bits(bits: np.ndarray) -> np.ndarray:
    return (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)


def _is_snan_bits(bits: np.ndarray) -> np.ndarray:
    return _is_nan_bits(bits) & ((bits & np.uint32(0x00400000)) == 0)


# --------------------------------------------------------------------------------------------
# fp8 / bf8
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Small:
    """An 8-bit float format. Codes are ordered by magnitude in the low 7 bits."""

    name: str
    mbits: int
    bias: int
    fnuz: bool           # 0x80 is the lone NaN, zero is unsigned
    has_inf: bool        # OCP e5m2 only: 0x7c/0xfc
    max_mag: int         # largest finite magnitude code (low 7 bits)

    @property
    def emin(self) -> int:          # exponent of the smallest normal
        return 1 - self.bias

    def nan_code(self, sign):
        # OCP: keep the sign like torch does (0x7f / 0xff). Unverified on gfx950 silicon; RDNA4
        # captures (rocjitsu-derived GoC model) return 0xff/0xfe for every NaN. Either decodes
        # back to NaN, so only the stored bit pattern could differ.
        return np.uint8(0x80) if self.fnuz else (sign << 7) | np.uint8(0x7F)

    def overflow_code(self, sign):
        # What FP16_OVFL=0 produces (CDNA3 §7.2 / CDNA4 §7.3 table): NaN for fp8, inf for bf8.
        # FNUZ has no inf, its "inf" encoding is the NaN code 0x80 (Table 30).
        if self.fnuz:
            return np.full_like(sign, 0x80)
        return (sign << 7) | np.uint8(0x7C if self.has_inf else 0x7F)


_FORMATS: Dict[Tuple[str, str], _Small] = {
    ("fp8", "fnuz"): _Small("e4m3fnuz", 3, 8, True, False, 0x7F),    # max 240 (CDNA3 Table 30)
    ("fp8", "ocp"): _Small("e4m3fn", 3, 7, False, False, 0x7E),      # max 448 (CDNA4 Table 30)
    ("bf8", "fnuz"): _Small("e5m2fnuz", 2, 16, True, False, 0x7F),   # max 57344
    ("bf8", "ocp"): _Small("e5m2", 2, 15, False, True, 0x7B),        # max 57344, inf 0x7c
}

# each arch's fp8 flavour, read from pa_tile.arch (the one home of arch facts)
_ARCH_FP8 = {name: a.fp8_format for name, a in _arch.INFO.items()}


def fp8_format_for_arch(arch: str) -> str:
    """'fnuz' on CDNA3 (gfx942), 'ocp' on CDNA4 (gfx950) -- CDNA3 §7.2 vs CDNA4 §7.3 Table 30."""
    try:
        return _ARCH_FP8[arch]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCH_FP8)}") from None


def _spec(kind: str, fmt: str) -> _Small:
    if fmt in _ARCH_FP8:
        fmt = _ARCH_FP8[fmt]
    try:
        return _FORMATS[(kind, fmt)]
    except KeyError:
        raise ValueError(f"fmt must be 'fnuz' or 'ocp' (or an arch name), got {fmt!r}") from None


@lru_cache(maxsize=None)
def _decode_table(kind: str, fmt: str) -> np.ndarray:
    s = _spec(kind, fmt)
    out = np.empty(256, dtype=np.uint32)
    ebits = 7 - s.mbits
    top = (1 << ebits) - 1
    for code in range(256):
        sign, e, m = code >> 7, (code >> s.mbits) & top, code & ((1 << s.mbits) - 1)
        if s.fnuz and code == 0x80:
            out[code] = 0x7FC00000   # which quiet NaN the hardware returns is not documented
        elif s.has_inf and e == top:
            out[code] = (sign << 31) | (0x7F800000 if m == 0 else 0x7FC00000)
        elif not s.fnuz and not s.has_inf and e == top and m == (1 << s.mbits) - 1:
            out[code] = (sign << 31) | 0x7FC00000      # e4m3fn: only S.1111.111 is NaN
        else:
            if e == 0:
                mag = math.ldexp(m, s.emin - s.mbits)
            else:
                mag = math.ldexp((1 << s.mbits) | m, e - s.bias - s.mbits)
            out[code] = np.float32(-mag if sign else mag).view(np.uint32)
    out.setflags(write=False)
    return out


def _decode(codes, kind, fmt) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype.kind not in "ui":
        raise TypeError(f"fp8 codes must be an integer array, got {codes.dtype}")
    return _decode_table(kind, fmt)[codes.astype(np.uint8)].view(np.float32)


def _encode(x, kind, fmt, saturate) -> np.ndarray:
    """RNE conversion of f32 values to an 8-bit float, vectorised.

    Rounding is decided on the exact value: |x| is scaled by a power of two so that one unit is
    one ulp of the target at x's binade (or the subnormal quantum) and ``np.rint`` rounds half to
    even. Codes grow monotonically with magnitude, so ``((e - emin) << M) + n`` is the code even
    when rounding carries into the next binade, and "rounded value > max" is "code > max code":
    overflow is judged *after* rounding (e4m3 OCP: 464 -> 448, anything above -> NaN), the same
    rule torch applies and that the RDNA4 conversion model built from silicon captures (the GoC
    emulator's ``narrow_fp8``, derived from AMD's rocjitsu) uses.
    """
    s = _spec(kind, fmt)
    x = np.asarray(x, dtype=np.float32)
    bits = f32_bits(x)
    sign = (bits >> np.uint32(31)).astype(np.uint8)
    mag_bits = bits & np.uint32(0x7FFFFFFF)
    is_nan = mag_bits > np.uint32(0x7F800000)
    is_inf = mag_bits == np.uint32(0x7F800000)
    a = np.where(is_nan | is_inf, 0.0, np.abs(_to64(bits)))
    _, ex = np.frexp(a)                      # a = f * 2**ex with f in [0.5, 1): floor(log2 a) = ex-1
    e_eff = np.where(a > 0, np.maximum(ex.astype(np.int64) - 1, s.emin), s.emin)
    n = np.rint(np.ldexp(a, -(e_eff - s.mbits).astype(np.int32))).astype(np.int64)
    code_mag = ((e_eff - s.emin) << s.mbits) + n
    over = code_mag > s.max_mag
    mag8 = np.minimum(code_mag, s.max_mag).astype(np.uint8)
    out = (sign << 7) | mag8
    if s.fnuz:
        out = np.where(mag8 == 0, np.uint8(0), out)     # no negative zero: -0 and -tiny give 0x00
    if saturate:
        out = np.where(over | is_inf, (sign << 7) | np.uint8(s.max_mag), out)
    else:
        out = np.where(over | is_inf, s.overflow_code(sign), out)
    out = np.where(is_nan, s.nan_code(sign), out)
    return out.astype(np.uint8)


def fp8_decode(codes, fmt: str) -> np.ndarray:
    """e4m3 codes (any integer array, low 8 bits used) -> float32. fmt: 'fnuz' | 'ocp' | arch.

    Exact (every fp8 value is an f32). NaN codes (FNUZ 0x80, OCP 0x7f/0xff) give a quiet NaN
    (which NaN pattern V_CVT_F32_FP8 produces is not documented). Denormals are kept: CDNA3 §7.3.
    """
    return _decode(codes, "fp8", fmt)


def bf8_decode(codes, fmt: str) -> np.ndarray:
    """e5m2 codes -> float32 (FNUZ 0x80 -> NaN; OCP 0x7c/0xfc -> +-inf, 0x7d..0x7f -> NaN)."""
    return _decode(codes, "bf8", fmt)


def fp8_encode(x, fmt: str, saturate: bool = False) -> np.ndarray:
    """f32 -> e4m3 code (uint8) exactly as V_CVT_PK_FP8_F32 computes one byte.

    Round to nearest even (CDNA3/CDNA4 §12.11, V_CVT_PK_FP8_F32: "ROUND_MODE = ROUND_NEAREST_EVEN",
    "Ignores OMOD and clamp"). ``saturate`` is the MODE.FP16_OVFL bit (CDNA3 §7.2 / CDNA4 §7.3
    "FP16_OVFL rule"): True -> overflow and +-inf give +-max (240 / 448); False (FlyDSL's kernel
    descriptor default) -> NaN (FNUZ 0x80; OCP 0x7f|sign). NaN -> NaN. Values below half the
    smallest denormal give zero (FNUZ: always 0x00, there is no -0; OCP: 0x80 for negatives).
    Inputs that are f32 denormals round to (signed) zero whether or not MODE flushes them.
    """
    return _encode(x, "fp8", fmt, saturate)


def bf8_encode(x, fmt: str, saturate: bool = False) -> np.ndarray:
    """f32 -> e5m2 code, as V_CVT_PK_BF8_F32. Overflow/inf with saturate=False give +-inf
    (OCP 0x7c/0xfc; FNUZ has no inf so 0x80), with saturate=True +-57344."""
    return _encode(x, "bf8", fmt, saturate)


def _cvt_pk_8(kind, s0, s1, old, word_hi, fmt, saturate):
    lo = _encode(s0, kind, fmt, saturate).astype(np.uint32)
    hi = _encode(s1, kind, fmt, saturate).astype(np.uint32)
    pair = lo | (hi << np.uint32(8))
    old = np.asarray(old, dtype=np.uint32)
    word_hi = np.asarray(word_hi, dtype=bool)
    return np.where(word_hi, (old & np.uint32(0x0000FFFF)) | (pair << np.uint32(16)),
                    (old & np.uint32(0xFFFF0000)) | pair).astype(np.uint32)


def cvt_pk_fp8_f32(s0, s1, old, word_hi, fmt: str, saturate: bool = False) -> np.ndarray:
    """V_CVT_PK_FP8_F32 on one lane-array: returns the new destination register.

    Per the pseudo-code (CDNA3/CDNA4 §12.11, opcode 674): ``{f32_to_fp8(S1), f32_to_fp8(S0)}`` is
    written to bits [15:0] (OPSEL[3]=0, ``word_hi=False``) or [31:16] (``word_hi=True``); the
    other half of ``old`` is preserved. S0 lands in the lower byte. LLVM prints OPSEL[3] as the
    last op_sel entry: ``v_cvt_pk_fp8_f32 v1, v2, v3 op_sel:[0,0,1]`` writes the high word
    (encoding bit 14, LLVM MC test gfx940). neg/abs source modifiers are the caller's job
    (applied to s0/s1 before the call); clamp and omod are ignored by the hardware.
    """
    return _cvt_pk_8("fp8", s0, s1, old, word_hi, fmt, saturate)


def cvt_pk_bf8_f32(s0, s1, old, word_hi, fmt: str, saturate: bool = False) -> np.ndarray:
    """V_CVT_PK_BF8_F32: as :func:`cvt_pk_fp8_f32` with e5m2 results."""
    return _cvt_pk_8("bf8", s0, s1, old, word_hi, fmt, saturate)


def _byte(src, sel):
    src = np.asarray(src, dtype=np.uint32)
    sel = np.asarray(sel)
    if np.any((sel < 0) | (sel > 3)):
        raise ValueError("byte select must be 0..3")
    sel = sel.astype(np.uint32)
    return ((src >> (np.uint32(8) * sel)) & np.uint32(0xFF)).astype(np.uint8)


def cvt_f32_fp8(src, byte_sel, fmt: str) -> np.ndarray:
    """V_CVT_F32_FP8: decode byte ``byte_sel`` (SDWA SRC0_SEL BYTE0..3, default BYTE0) of the
    u32 source register to float32 (CDNA3/CDNA4 §12.8 opcode 84). On gfx950 the VOP3 form picks
    the byte with op_sel instead; the caller turns either encoding into ``byte_sel``."""
    return fp8_decode(_byte(src, byte_sel), fmt)


def cvt_f32_bf8(src, byte_sel, fmt: str) -> np.ndarray:
    """V_CVT_F32_BF8: as :func:`cvt_f32_fp8` for e5m2."""
    return bf8_decode(_byte(src, byte_sel), fmt)


def _pk_f32(kind, src, word_hi, fmt):
    src = np.asarray(src, dtype=np.uint32)
    word = np.where(np.asarray(word_hi, dtype=bool), src >> np.uint32(16), src & np.uint32(0xFFFF))
    lo = _decode(word & np.uint32(0xFF), kind, fmt)
    hi = _decode(word >> np.uint32(8), kind, fmt)
    return lo, hi


def cvt_pk_f32_fp8(src, word_hi, fmt: str):
    """V_CVT_PK_F32_FP8: (D0, D1) = decode(bytes 0,1) of the selected word (SDWA WORD1 ->
    ``word_hi=True``): ``D0 = fp8_to_f32(tmp[7:0])``, ``D1 = fp8_to_f32(tmp[15:8])``
    (CDNA3/CDNA4 §12.8 opcode 86). Returns two float32 arrays (dst, dst+1)."""
    return _pk_f32("fp8", src, word_hi, fmt)


def cvt_pk_f32_bf8(src, word_hi, fmt: str):
    """V_CVT_PK_F32_BF8: as :func:`cvt_pk_f32_fp8` for e5m2."""
    return _pk_f32("bf8", src, word_hi, fmt)


# --------------------------------------------------------------------------------------------
# f16 / bf16
# --------------------------------------------------------------------------------------------

def f32_to_f16_bits(x, saturate: bool = False) -> np.ndarray:
    """f32 -> IEEE half bits (uint16), round to nearest even, denormals kept (FlyDSL kernels run
    with ``.amdhsa_float_denorm_mode_16_64 3``). ``saturate`` models MODE.FP16_OVFL (CDNA3 §3.5 Table 4,
    MODE bit 23: "an overflowed FP16 result is clamped to +/- MAX_FP16 ... while still preserving
    true INF values"). NaNs are quieted, keeping sign and the top payload bits (IEEE
    convertFormat); the hardware's exact NaN payload is not documented."""
    x = np.asarray(x, dtype=np.float32)
    bits = f32_bits(x)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    nan = _is_nan_bits(bits)
    qnan = (((bits >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7E00)
            | ((bits >> np.uint32(13)) & np.uint32(0x3FF))).astype(np.uint16)
    h = np.where(nan, qnan, h)
    if saturate:
        finite_in = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
        became_inf = (h & np.uint16(0x7FFF)) == np.uint16(0x7C00)
        h = np.where(finite_in & became_inf, (h & np.uint16(0x8000)) | np.uint16(0x7BFF), h)
    return h.astype(np.uint16)


def f16_bits_to_f32(h) -> np.ndarray:
    """IEEE half bits -> float32 (exact; NaNs quieted as V_CVT_F32_F16 would, payload kept)."""
    h = np.asarray(h).astype(np.uint16)
    out = f32_bits(h.view(np.float16).astype(np.float32))
    return bits_f32(np.where(_is_nan_bits(out), _quiet(out), out))


def f32_to_bf16_bits(x, rounding: str = "rne") -> np.ndarray:
    """f32 -> bf16 bits (uint16).

    ``rounding='rne'`` is V_CVT_PK_BF16_F32 (gfx950, CDNA4 §12.11 opcode 616: ``ROUND_MODE =
    ROUND_NEAREST_EVEN; f32_to_bf16``): add 0x7fff plus the kept LSB and truncate, which also
    rounds f32 denormals correctly (bf16 shares f32's exponent range) and overflows to inf past
    bf16 max. NaN is quieted (sign and top 6 payload bits kept, bit 6 set), as LLVM's own
    software lowering does on gfx942; silicon NaN payloads are not documented.
    ``rounding='truncate'`` keeps the high half (what a plain shift/perm-based pack does).
    """
    bits = f32_bits(x)
    if rounding == "truncate":
        return (bits >> np.uint32(16)).astype(np.uint16)
    if rounding != "rne":
        raise ValueError("rounding must be 'rne' or 'truncate'")
    shape = bits.shape
    bits = bits.reshape(-1)   # array (not scalar) arithmetic: it wraps without a warning
    hi = bits >> np.uint32(16)
    # In 32 bits the sum wraps only for bits >= 0xFFFF8000: negative NaNs, replaced below.
    r = ((bits + (hi & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16)).astype(np.uint16)
    q = (hi | np.uint32(0x0040)).astype(np.uint16)
    return np.where(_is_nan_bits(bits), q, r).reshape(shape)


def bf16_bits_to_f32(h) -> np.ndarray:
    """bf16 bits -> float32: a 16-bit left shift, exact (NaN payloads unchanged)."""
    return bits_f32(np.asarray(h).astype(np.uint32) << np.uint32(16))


def cvt_pk_bf16_f32(s0, s1) -> np.ndarray:
    """V_CVT_PK_BF16_F32 (gfx950): ``D[15:0] = bf16(S0)``, ``D[31:16] = bf16(S1)``, RNE."""
    lo = f32_to_bf16_bits(s0).astype(np.uint32)
    hi = f32_to_bf16_bits(s1).astype(np.uint32)
    return lo | (hi << np.uint32(16))


# --------------------------------------------------------------------------------------------
# MFMA
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Mfma:
    name: str
    M: int
    N: int
    K: int
    a_type: str       # 'f32' | 'f16' | 'bf16' | 'fp8' | 'bf8'
    b_type: str
    archs: Tuple[str, ...]

    @property
    def bits(self) -> int:
        return {"f32": 32, "f16": 16, "bf16": 16}.get(self.a_type, 8)

    @property
    def k_per_lane(self) -> int:       # K_L of §7.1.4.1 (one block)
        return self.K * self.M // 64

    @property
    def in_regs(self) -> int:
        return self.k_per_lane * self.bits // 32

    @property
    def c_regs(self) -> int:
        return self.M * self.N // 64


_BOTH = ("gfx940", "gfx941", "gfx942", "gfx950")
_MFMA_TABLE: Dict[str, _Mfma] = {}
_ALIASES: Dict[str, str] = {}


def _reg(name, M, N, K, ta, tb, archs, aliases=()):
    _MFMA_TABLE[name] = _Mfma(name, M, N, K, ta, tb, archs)
    for a in aliases:
        _ALIASES[a] = name


# Mnemonics as LLVM prints them for gfx942/gfx950 (checked by compiling FlyDSL MFMA atoms);
# the pre-gfx940 spellings are accepted as aliases. Shapes: CDNA3 §7.1.2 Table 28, CDNA4 §7.1.2.
# The f32 forms hold one f32 per lane in A and B (K_L = 1); their layouts follow the same §7.1.4
# formulas and were checked entry by entry against amd_matrix_instruction_calculator (CDNA3).
_reg("v_mfma_f32_16x16x4_f32", 16, 16, 4, "f32", "f32", _BOTH, ("v_mfma_f32_16x16x4f32",))
_reg("v_mfma_f32_32x32x2_f32", 32, 32, 2, "f32", "f32", _BOTH, ("v_mfma_f32_32x32x2f32",))
_reg("v_mfma_f32_16x16x16_f16", 16, 16, 16, "f16", "f16", _BOTH, ("v_mfma_f32_16x16x16f16",))
_reg("v_mfma_f32_16x16x16_bf16", 16, 16, 16, "bf16", "bf16", _BOTH, ("v_mfma_f32_16x16x16bf16_1k",))
_reg("v_mfma_f32_32x32x8_f16", 32, 32, 8, "f16", "f16", _BOTH, ("v_mfma_f32_32x32x8f16",))
_reg("v_mfma_f32_32x32x8_bf16", 32, 32, 8, "bf16", "bf16", _BOTH, ("v_mfma_f32_32x32x8bf16_1k",))
for _ta in ("fp8", "bf8"):
    for _tb in ("fp8", "bf8"):
        _reg(f"v_mfma_f32_16x16x32_{_ta}_{_tb}", 16, 16, 32, _ta, _tb, _BOTH)
        _reg(f"v_mfma_f32_32x32x16_{_ta}_{_tb}", 32, 32, 16, _ta, _tb, _BOTH)
# gfx950-only double-K f16/bf16 forms (CDNA4 §7.1.2, "Matrix Multiply on FP16 or BF16 data")
_reg("v_mfma_f32_16x16x32_f16", 16, 16, 32, "f16", "f16", ("gfx950",))
_reg("v_mfma_f32_16x16x32_bf16", 16, 16, 32, "bf16", "bf16", ("gfx950",))
_reg("v_mfma_f32_32x32x16_f16", 32, 32, 16, "f16", "f16", ("gfx950",))
_reg("v_mfma_f32_32x32x16_bf16", 32, 32, 16, "bf16", "bf16", ("gfx950",))

# int8 forms: i32 accumulators, same §7.1.4 layouts (checked entry by entry against
# amd_matrix_instruction_calculator, CDNA3); gfx950 adds the double-K ones (CDNA4 §7.1.2)
_reg("v_mfma_i32_16x16x32_i8", 16, 16, 32, "i8", "i8", _BOTH)
_reg("v_mfma_i32_32x32x16_i8", 32, 32, 16, "i8", "i8", _BOTH)
_reg("v_mfma_i32_16x16x64_i8", 16, 16, 64, "i8", "i8", ("gfx950",))
_reg("v_mfma_i32_32x32x32_i8", 32, 32, 32, "i8", "i8", ("gfx950",))

MFMA_MNEMONICS = tuple(sorted(_MFMA_TABLE))


def _lookup(mnemonic: str) -> _Mfma:
    m = mnemonic.strip().lower()
    m = _ALIASES.get(m, m)
    try:
        return _MFMA_TABLE[m]
    except KeyError:
        raise NotImplementedError(
            f"MFMA {mnemonic!r} is not emulated; supported: {', '.join(MFMA_MNEMONICS)}") from None


def mfma_archs(mnemonic: str) -> Tuple[str, ...]:
    """The archs whose ISA has this MFMA (the double-K f16/bf16 forms are gfx950-only)."""
    return _lookup(mnemonic).archs


def mfma_shapes(mnemonic: str) -> Tuple[int, int, int, int, int, int]:
    """(M, N, K, a_regs, b_regs, c_regs) for a supported MFMA mnemonic (aliases accepted)."""
    s = _lookup(mnemonic)
    return s.M, s.N, s.K, s.in_regs, s.in_regs, s.c_regs


@lru_cache(maxsize=None)
def _layout(name: str):
    """Index maps of CDNA3/CDNA4 §7.1.4 for one block (B = 1).

    Input: ``K_L = K / (64 / M)``; A[i][k] is item ``k % K_L`` of lane ``i + M * (k // K_L)``
    and B[k][j] is item ``k % K_L`` of lane ``j + N * (k // K_L)``; items are packed
    little-endian, so item t sits in register ``t * bits // 32`` at bit ``t * bits % 32``.
    Output (C and D): H = 4, ``M_I = 64 / N``; D[i][j] is in register
    ``i % 4 + 4 * (i // (4 * M_I))`` of lane ``j + N * ((i // 4) % M_I)``.
    """
    s = _MFMA_TABLE[name]
    kl = s.k_per_lane
    lanes = np.arange(64)
    t = np.arange(kl)
    # (lane, item) -> (row, k) for A and (k, col) for B
    a_i = np.broadcast_to((lanes % s.M)[:, None], (64, kl))
    a_k = (lanes // s.M)[:, None] * kl + t[None, :]
    b_j = np.broadcast_to((lanes % s.N)[:, None], (64, kl))
    b_k = (lanes // s.N)[:, None] * kl + t[None, :]
    # (reg, lane) -> (i, j) for C/D
    m_i = 64 // s.N
    i = np.arange(s.M)[:, None]
    j = np.arange(s.N)[None, :]
    c_reg = np.broadcast_to(i % 4 + 4 * (i // (4 * m_i)), (s.M, s.N))
    c_lane = j + s.N * ((i // 4) % m_i)
    c_row = np.empty((s.c_regs, 64), dtype=np.int64)
    c_col = np.empty((s.c_regs, 64), dtype=np.int64)
    c_row[c_reg, c_lane] = np.broadcast_to(i, (s.M, s.N))
    c_col[c_reg, c_lane] = np.broadcast_to(j, (s.M, s.N))
    return dict(a_i=a_i, a_k=a_k, b_k=b_k, b_j=b_j, c_reg=c_reg, c_lane=c_lane, c_row=c_row, c_col=c_col)


def mfma_lane_layout(mnemonic: str) -> dict:
    """Register/lane layout of an MFMA's operands, for drawing and for packing data by hand.

    Returns a dict with
      ``'A'``: int array (64, K_L, 2): for (lane, item) the A coordinates (i, k);
      ``'B'``: int array (64, K_L, 2): for (lane, item) the B coordinates (k, j);
      ``'C'``: int array (c_regs, 64, 2): for (register, lane) the C/D coordinates (i, j);
      ``'A_where'``: (M, K, 3) -> (register, lane, bit offset) holding A[i][k];
      ``'B_where'``: (K, N, 3) -> (register, lane, bit offset) holding B[k][j];
      ``'C_where'``: (M, N, 2) -> (register, lane) holding C[i][j] / D[i][j];
    plus ``'M','N','K','K_L','item_bits','items_per_reg','a_regs','b_regs','c_regs'``.
    Item t of a lane lives in register ``t // items_per_reg``, bits
    ``[(t % items_per_reg) * item_bits, +item_bits)`` (CDNA3/CDNA4 §7.1.4).
    """
    s = _lookup(mnemonic)
    L = _layout(s.name)
    ipr = 32 // s.bits
    kl = s.k_per_lane
    a_where = np.empty((s.M, s.K, 3), dtype=np.int64)
    b_where = np.empty((s.K, s.N, 3), dtype=np.int64)
    lanes = np.broadcast_to(np.arange(64)[:, None], (64, kl))
    t = np.broadcast_to(np.arange(kl)[None, :], (64, kl))
    a_where[L["a_i"], L["a_k"]] = np.stack([t // ipr, lanes, (t % ipr) * s.bits], axis=-1)
    b_where[L["b_k"], L["b_j"]] = np.stack([t // ipr, lanes, (t % ipr) * s.bits], axis=-1)
    return {
        "A": np.stack([L["a_i"], L["a_k"]], axis=-1),
        "B": np.stack([L["b_k"], L["b_j"]], axis=-1),
        "C": np.stack([L["c_row"], L["c_col"]], axis=-1),
        "A_where": a_where, "B_where": b_where,
        "C_where": np.stack([L["c_reg"], L["c_lane"]], axis=-1),
        "M": s.M, "N": s.N, "K": s.K, "K_L": kl, "item_bits": s.bits, "items_per_reg": ipr,
        "a_regs": s.in_regs, "b_regs": s.in_regs, "c_regs": s.c_regs,
    }


def _items(regs: np.ndarray, bits: int) -> np.ndarray:
    """(R, 64) u32 registers -> (64, R * 32/bits) items per lane, little-endian within a dword."""
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    parts = [(regs >> np.uint32(bits * p)) & mask for p in range(per)]   # each (R, 64)
    return np.stack(parts, axis=-1).transpose(1, 0, 2).reshape(64, -1)  # item = reg*per + p


def _values(items: np.ndarray, typ: str, fmt: str) -> np.ndarray:
    if typ == "f32":
        return _to64(items)
    if typ == "f16":
        with np.errstate(invalid="ignore"):
            return items.astype(np.uint16).view(np.float16).astype(np.float64)
    if typ == "bf16":
        return _to64(items.astype(np.uint32) << np.uint32(16))
    return _to64(f32_bits(_decode(items, typ, fmt)))


def _check_regs(x, rows, what):
    x = np.asarray(x)
    if x.dtype != np.uint32:
        if x.dtype.kind not in "ui":
            raise TypeError(f"{what} registers must be uint32, got {x.dtype}")
        x = x.astype(np.uint32)
    try:
        return np.broadcast_to(x, (rows, 64))
    except ValueError:
        raise ValueError(f"{what} must have shape ({rows}, 64), got {x.shape}") from None


def mfma(mnemonic: str, a, b, c, arch: str = "gfx942", *, fp16_ovfl: bool = False,
         cbsz: int = 0, abid: int = 0, blgp: int = 0) -> np.ndarray:
    """D = A x B + C for one wave, on registers.

    ``a``, ``b``: uint32 (a_regs, 64) -- the register rows SRC0/SRC1 name, one column per lane;
    ``c``: uint32 f32 bits (c_regs, 64) (a scalar broadcasts: SRC2 may be an inline constant).
    Returns D as uint32 f32 bits, shape (c_regs, 64). Layouts: :func:`mfma_lane_layout`.
    fp8/bf8 operands are decoded in the arch's format (FNUZ on gfx942, OCP on gfx950).

    Arithmetic model: every product is exact in float64 (f16/bf16/fp8 significands are at most
    11 bits, f32 ones 24), the K products are summed in float64, C is added with round-to-odd and the result
    is rounded once to f32 with RNE (CDNA3 §7.1.2: MFMA "ignores Round Mode from MODE and forces
    it to RNE"; §7.3: input, C and result denormals are kept regardless of MODE). With e4m3 on
    both sides the float64 dot product is exact (products lie in [2^-20, 2^18), a 32-term sum
    needs < 45 bits), so D is exactly RNE(C + A.B); with e5m2/f16/bf16 only the float64 dot
    product can round (relative 2^-53; likewise for the f32 forms, whose 48-bit products
    can make a 4-term float64 sum inexact). The hardware's internal accumulation order and
    width are not documented (the matrix core chains 4x1 x 1x4 outer products, CDNA3 §7), so
    silicon may differ from this model by a few f32 ulps on sums with heavy cancellation.
    ``fp16_ovfl`` is MODE.FP16_OVFL: finite results beyond f32 range become +-FLT_MAX instead
    of +-inf (§7.1.2 "Clamp" row). NaN results are returned as 0x7fc00000 (hardware payload
    undocumented). EXEC is ignored by MFMA (§7.1.2), so every lane is computed.
    CBSZ/ABID/BLGP broadcasting is not emulated (none of pa_tile's kernels use it).
    """
    if cbsz or abid or blgp:
        raise NotImplementedError("MFMA cbsz/abid/blgp modifiers are not emulated")
    s = _lookup(mnemonic)
    if arch not in s.archs:
        raise ValueError(f"{s.name} does not exist on {arch} (available on {', '.join(s.archs)})")
    fmt = fp8_format_for_arch(arch)
    a = _check_regs(a, s.in_regs, "A")
    b = _check_regs(b, s.in_regs, "B")
    c = _check_regs(c, s.c_regs, "C")
    if s.a_type == "i8":
        return _mfma_i8(s, a, b, c, _layout(s.name))
    G, kl = 64 // s.M, s.k_per_lane
    av = _values(_items(a, s.bits), s.a_type, fmt)           # (64, K_L)
    bv = _values(_items(b, s.bits), s.b_type, fmt)
    A = av.reshape(G, s.M, kl).transpose(1, 0, 2).reshape(s.M, s.K)       # A[i, g*K_L+t]
    B = bv.reshape(64 // s.N, s.N, kl).transpose(0, 2, 1).reshape(s.K, s.N)  # B[g*K_L+t, j]
    L = _layout(s.name)
    C = _to64(c[L["c_reg"], L["c_lane"]])
    with np.errstate(over="ignore", invalid="ignore"):
        D64 = _add_round_to_odd(A @ B, C)
        D32 = D64.astype(np.float32)
    if fp16_ovfl:
        D32 = np.where(np.isfinite(D64) & np.isinf(D32), np.copysign(F32_MAX, D64).astype(np.float32), D32)
    dbits = f32_bits(D32)
    dbits = np.where(np.isnan(D32), np.uint32(0x7FC00000), dbits)
    out = np.empty((s.c_regs, 64), dtype=np.uint32)
    out[L["c_reg"], L["c_lane"]] = dbits
    return out


def _mfma_i8(s, a, b, c, L):
    """V_MFMA_I32_*_I8: D.i32 = C.i32 + sum of int8 products, exact, wrapping to 32 bits (the
    guide gives no saturation for the integer MFMAs)."""
    G, kl = 64 // s.M, s.k_per_lane
    av = _items(a, 8).astype(np.uint8).view(np.int8).astype(np.int64)
    bv = _items(b, 8).astype(np.uint8).view(np.int8).astype(np.int64)
    A = av.reshape(G, s.M, kl).transpose(1, 0, 2).reshape(s.M, s.K)
    B = bv.reshape(64 // s.N, s.N, kl).transpose(0, 2, 1).reshape(s.K, s.N)
    C = c[L["c_reg"], L["c_lane"]].view(np.int32).astype(np.int64)
    D = ((A @ B + C) & 0xFFFFFFFF).astype(np.uint32)
    out = np.empty((s.c_regs, 64), dtype=np.uint32)
    out[L["c_reg"], L["c_lane"]] = D
    return out


def mfma_pack_operand(mnemonic: str, which: str, values) -> np.ndarray:
    """Place a matrix into the registers an MFMA reads (the inverse of the layout).

    ``which='A'``: (M, K) element codes (uint8 for fp8/bf8, uint16 bits for f16/bf16; for the
    f32 forms float32 values or their uint32 bits); ``'B'``: (K, N) codes; ``'C'``: (M, N)
    float32 values. Returns uint32 (regs, 64).
    """
    s = _lookup(mnemonic)
    L = _layout(s.name)
    which = which.upper()
    if which == "C":
        v = np.asarray(values, dtype=np.float32)
        if v.shape != (s.M, s.N):
            raise ValueError(f"C must be ({s.M}, {s.N}), got {v.shape}")
        out = np.empty((s.c_regs, 64), dtype=np.uint32)
        out[L["c_reg"], L["c_lane"]] = f32_bits(v)
        return out
    if which not in ("A", "B"):
        raise ValueError("which must be 'A', 'B' or 'C'")
    v = np.asarray(values)
    shape = (s.M, s.K) if which == "A" else (s.K, s.N)
    if v.shape != shape:
        raise ValueError(f"{which} must be {shape}, got {v.shape}")
    if s.bits == 32 and v.dtype.kind == "f":
        v = f32_bits(v)
    items = v[L["a_i"], L["a_k"]] if which == "A" else v[L["b_k"], L["b_j"]]   # (64, K_L)
    items = items.astype(np.uint32) & np.uint32((1 << s.bits) - 1)
    per = 32 // s.bits
    items = items.reshape(64, s.in_regs, per)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(s.bits))[None, None, :]
    return np.bitwise_or.reduce(items << shifts, axis=2).T.astype(np.uint32).copy()


def mfma_unpack_result(mnemonic: str, d) -> np.ndarray:
    """(c_regs, 64) uint32 D registers -> (M, N) float32 matrix."""
    s = _lookup(mnemonic)
    L = _layout(s.name)
    d = _check_regs(d, s.c_regs, "D")
    return bits_f32(d[L["c_reg"], L["c_lane"]])


# --------------------------------------------------------------------------------------------
# transcendentals (VOP1), ldexp
# --------------------------------------------------------------------------------------------
# ISA (CDNA3/CDNA4 §12.8): V_EXP/LOG/RCP/RSQ/SQRT_F32 have "1ULP accuracy, denormals are
# flushed" -- inputs that are denormal act as signed zero and denormal results become signed
# zero, independent of MODE (LLVM relies on this: it wraps these ops in scaling code whenever
# denormals must survive). Here every result is computed in float64 and rounded once to f32 (RNE),
# i.e. correctly rounded (<= 0.5 ulp from exact), so it can differ from silicon by at most 1 ulp
# (silicon is within 1 ulp of exact). Special cases follow the ISA's functional examples
# bit-for-bit; a NaN input comes back quieted with its payload; an invalid operation returns
# 0xffc00000.

def _f32_in(x):
    x = np.asarray(x, dtype=np.float32)
    bits = f32_bits(x)
    denorm = ((bits & np.uint32(0x7F800000)) == 0) & ((bits & np.uint32(0x007FFFFF)) != 0)
    flushed = np.where(denorm, bits & np.uint32(0x80000000), bits)
    return bits, flushed, _to64(flushed)


def _f32_out(r64, in_bits, flush_result=True):
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.asarray(r64).astype(np.float32)
    rb = f32_bits(r)
    if flush_result:
        den = ((rb & np.uint32(0x7F800000)) == 0) & ((rb & np.uint32(0x007FFFFF)) != 0)
        rb = np.where(den, rb & np.uint32(0x80000000), rb)
    rb = np.where(_is_nan_bits(rb), DEFAULT_NAN_BITS, rb)
    rb = np.where(_is_nan_bits(in_bits), _quiet(in_bits), rb)
    return bits_f32(rb)


def exp2_f32(x) -> np.ndarray:
    """V_EXP_F32: 2**x. exp(-inf)=+0, exp(+-0)=1, exp(+inf)=+inf; results below 2^-126 flush to
    +0 (so 2**x for x < -126 is 0, where IEEE would give a denormal)."""
    bits, _, xf = _f32_in(x)
    with np.errstate(over="ignore"):
        return _f32_out(np.exp2(xf), bits)


def log2_f32(x) -> np.ndarray:
    """V_LOG_F32: log2(x). +-0 and denormals -> -inf; x < 0 (incl. -inf) -> 0xffc00000;
    +inf -> +inf; log2(1) = +0."""
    bits, _, xf = _f32_in(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log2(np.abs(xf))
    r = np.where(xf < 0, np.nan, r)
    return _f32_out(r, bits)


def rcp_f32(x) -> np.ndarray:
    """V_RCP_F32: 1/x. +-0/denormal -> +-inf, +-inf -> +-0; results that would be denormal
    (|x| > 2^126) flush to signed zero."""
    bits, _, xf = _f32_in(x)
    with np.errstate(divide="ignore"):
        return _f32_out(1.0 / xf, bits)


def rsq_f32(x) -> np.ndarray:
    """V_RSQ_F32: 1/sqrt(x). +0/+denormal -> +inf, -0/-denormal -> -inf, x < 0 -> 0xffc00000,
    +inf -> +0."""
    bits, _, xf = _f32_in(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(xf == 0, np.copysign(np.inf, xf), 1.0 / np.sqrt(np.where(xf < 0, np.nan, xf)))
    return _f32_out(r, bits)


def sqrt_f32(x) -> np.ndarray:
    """V_SQRT_F32: sqrt(x). Denormal inputs act as signed zero (sqrt(-0) = -0);
    x < 0 -> 0xffc00000; +inf -> +inf."""
    bits, _, xf = _f32_in(x)
    with np.errstate(invalid="ignore"):
        r = np.sqrt(xf)
    return _f32_out(r, bits)


def ldexp_f32(x, e) -> np.ndarray:
    """V_LDEXP_F32: x * 2**e (e: int32) with one RNE rounding; denormal inputs and results kept
    (the op honours MODE denormals, which FlyDSL kernels enable). Exact via float64: any f32
    scaled by 2^k with |k| <= 400 is a float64 normal, so only the final cast rounds."""
    bits = f32_bits(x)
    xf = _to64(bits)
    k = np.clip(np.asarray(e).astype(np.int64), -400, 400).astype(np.int32)
    with np.errstate(over="ignore"):
        r = np.ldexp(xf, k).astype(np.float32)
    rb = np.where(_is_nan_bits(bits), _quiet(bits), f32_bits(r))
    return bits_f32(rb)


# --------------------------------------------------------------------------------------------
# rounding helpers, fma, min/max
# --------------------------------------------------------------------------------------------

def _add_round_to_odd(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """p + c in float64 rounded to odd (exact p, c). TwoSum gives the exact rounding error; an
    inexact sum whose last bit is even moves one ulp toward the error. A round-to-odd value with
    >= 2 spare bits rounds to f32 exactly as the exact sum would (no double rounding)."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bp = s - p
        err = (p - (s - bp)) + (c - bp)
        even = (s.view(np.int64) & 1) == 0
        fix = np.isfinite(s) & (err != 0) & even
        return np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)


def round_f32(x64) -> np.ndarray:
    """float64 -> float32, round to nearest even (one rounding; overflow -> +-inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(x64, dtype=np.float64).astype(np.float32)


_F32_MIN_NORMAL = 2.0 ** -126


def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded f32 fused multiply-add (V_FMA_F32 / V_FMAC_F32, RNE, denormals kept).

    a*b is exact in float64 (24+24 significant bits), but fl64(a*b + c) rounded again to f32 is
    NOT always the fma: the first rounding can land exactly on an f32 halfway point (double
    rounding; e.g. a = b = 1 + 2^-12, c = 2^-80). That can only happen when the float64 sum
    sits on such a midpoint (its low 29 significand bits are 0x10000000) or the result is not an
    f32 normal number; only then (and for NaN/inf) is the exact path taken (the VALU's hot path
    stays one numpy multiply-add). The exact path computes the float64 sum in round-to-odd:
    TwoSum recovers its exact error, and an inexact result with an even last bit is moved one
    float64 ulp toward the error. Rounding a round-to-odd value with >= 2 extra bits to the
    narrower format is correctly rounded, so the final cast is exact fma.
    """
    a, b, c = (np.asarray(x, dtype=np.float32) for x in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.asarray(a.astype(np.float64) * b + c.astype(np.float64))
    bits = np.atleast_1d(s).view(np.int64)
    mag = np.abs(s)
    if (((bits & 0x1FFFFFFF) == 0x10000000).any() or not np.isfinite(s).all()
            or ((mag < _F32_MIN_NORMAL) & (mag != 0)).any() or (mag > float(F32_MAX)).any()):
        return _fma_f32_exact(a, b, c)
    return s.astype(np.float32)


def _fma_f32_exact(a, b, c) -> np.ndarray:
    ab, bb, cb = np.broadcast_arrays(f32_bits(a), f32_bits(b), f32_bits(c))
    a, b, c = _to64(ab), _to64(bb), _to64(cb)
    with np.errstate(invalid="ignore", over="ignore"):
        rb = f32_bits(_add_round_to_odd(a * b, c).astype(np.float32))
    # NaN results: an input NaN comes back quieted (S0, then S1, then S2 -- IEEE leaves the
    # choice open and the ISA does not say); inf*0 / inf-inf give the VALU default NaN.
    rb = np.where(_is_nan_bits(rb), DEFAULT_NAN_BITS, rb)
    for src in (cb, bb, ab):
        rb = np.where(_is_nan_bits(src), _quiet(src), rb)
    return bits_f32(rb)


def _minmax(a, b, ieee: bool, want_max: bool):
    ab, bb = f32_bits(a), f32_bits(b)
    ab, bb = np.broadcast_arrays(ab, bb)
    af, bf = _to64(ab), _to64(bb)
    if want_max:
        pick_a = (af >= bf) if ieee else (af > bf)
    else:
        pick_a = af < bf
    res = np.where(pick_a, ab, bb)
    # signed zeros: +0 beats -0 for max, -0 beats +0 for min (pseudo-code's explicit cases)
    zero_pair = (af == 0) & (bf == 0)
    neg_a = (ab >> np.uint32(31)) == 1
    if want_max:
        res = np.where(zero_pair, np.where(neg_a, bb, ab), res)
    else:
        res = np.where(zero_pair, np.where(neg_a, ab, bb), res)
    res = np.where(_is_nan_bits(bb), ab, res)
    res = np.where(_is_nan_bits(ab), bb, res)
    if ieee:
        res = np.where(_is_snan_bits(bb), _quiet(bb), res)
        res = np.where(_is_snan_bits(ab), _quiet(ab), res)
    return bits_f32(res)


def _minmax_no_nan(a, b, want_max: bool):
    r = np.maximum(a, b) if want_max else np.minimum(a, b)
    zeros = (a == 0) & (b == 0)
    if zeros.any():  # the sign of a zero result is not numpy's choice
        ab, bb = np.broadcast_arrays(f32_bits(a), f32_bits(b))
        r = np.where(zeros, bits_f32((ab & bb) if want_max else (ab | bb)), r)
    return r


def max_f32(a, b, ieee: bool = True) -> np.ndarray:
    """V_MAX_F32 (CDNA3/CDNA4 §12.7 opcode 11 pseudo-code). With MODE.IEEE (FlyDSL kernels set
    ``.amdhsa_ieee_mode 1``) a *signalling* NaN operand returns that NaN quieted (S0 checked
    first); otherwise a quiet NaN operand is ignored and the other operand returned (two quiet
    NaNs -> S1). max(+0, -0) = +0 either order. Ties/compare: ``S0 >= S1 ? S0 : S1``.
    Without NaN operands (the VALU's hot path) this is numpy's maximum plus the zero-sign rule."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    if np.isnan(a).any() or np.isnan(b).any():
        return _minmax(a, b, ieee, True)
    return _minmax_no_nan(a, b, True)


def min_f32(a, b, ieee: bool = True) -> np.ndarray:
    """V_MIN_F32 (§12.7 opcode 10): mirror of :func:`max_f32`; min(+0, -0) = -0."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    if np.isnan(a).any() or np.isnan(b).any():
        return _minmax(a, b, ieee, False)
    return _minmax_no_nan(a, b, False)


def max3_f32(a, b, c, ieee: bool = True) -> np.ndarray:
    """V_MAX3_F32 = v_max_f32(v_max_f32(S0, S1), S2) (§12.11 opcode 467)."""
    return max_f32(max_f32(a, b, ieee), c, ieee)


def min3_f32(a, b, c, ieee: bool = True) -> np.ndarray:
    """V_MIN3_F32 = v_min_f32(v_min_f32(S0, S1), S2)."""
    return min_f32(min_f32(a, b, ieee), c, ieee)


def _maximum(a, b, want_max: bool):
    ab, bb = np.broadcast_arrays(f32_bits(a), f32_bits(b))
    af, bf = _to64(ab), _to64(bb)
    neg_a = (ab >> np.uint32(31)) == 1
    neg_b = (bb >> np.uint32(31)) == 1
    zero_pair = (af == 0) & (bf == 0)
    if want_max:
        pick_a = (af > bf) | (zero_pair & ~neg_a & neg_b)
    else:
        pick_a = (af < bf) | (zero_pair & neg_a & ~neg_b)
    res = np.where(pick_a, ab, bb)
    res = np.where(_is_nan_bits(bb), _quiet(bb), res)
    res = np.where(_is_nan_bits(ab), _quiet(ab), res)
    res = np.where(_is_snan_bits(bb) & ~_is_snan_bits(ab), _quiet(bb), res)
    return bits_f32(res)


def maximum_f32(a, b) -> np.ndarray:
    """IEEE 754-2019 maximum(), the building block of V_MAXIMUM3_F32 (gfx950). CDNA4 only names
    it; the definition used is RDNA4 ISA V_MAXIMUM_F32: an sNaN operand (S0 first) returns
    quieted, else a qNaN operand is returned (S0 first), else the larger with +0 > -0.
    Independent of MODE.IEEE."""
    return _maximum(a, b, True)


def minimum_f32(a, b) -> np.ndarray:
    """IEEE minimum(): NaN-propagating, -0 < +0 (mirror of :func:`maximum_f32`)."""
    return _maximum(a, b, False)


def maximum3_f32(a, b, c) -> np.ndarray:
    """V_MAXIMUM3_F32 (gfx950, CDNA4 §12.11 opcode 681):
    ``v_maximum_f32(v_maximum_f32(S0, S1), S2)`` -- any NaN operand gives NaN. (With the clamp
    modifier and DX10_CLAMP the NaN would become 0; clamp belongs to the caller.)"""
    return maximum_f32(maximum_f32(a, b), c)


def minimum3_f32(a, b, c) -> np.ndarray:
    """V_MINIMUM3_F32 (gfx950): ``v_minimum_f32(v_minimum_f32(S0, S1), S2)``."""
    return minimum_f32(minimum_f32(a, b), c)


# --------------------------------------------------------------------------------------------
# IEEE f32 division: V_DIV_SCALE_F32, V_DIV_FMAS_F32, V_DIV_FIXUP_F32 (CDNA3/CDNA4 §12.11)
# --------------------------------------------------------------------------------------------
# LLVM lowers an IEEE ``fdiv float`` n / d to
#   ds = div_scale(d, d, n); ns, vcc = div_scale(n, d, n); r = rcp(ds);
#   Newton-Raphson refinement of r and of q = ns * r with fma;
#   q' = div_fmas(err, r, q, vcc); result = div_fixup(q', d, n).
# div_scale moves operands whose quotient or reciprocal would leave the normal range by 2^+-64
# (and raises VCC when only one of them moved, so the quotient is off by 2^+-64); div_fmas
# undoes that in its one rounding; div_fixup supplies the IEEE special cases.
#
# Where the guide's pseudo-code cannot be read literally we take the reading that makes the
# sequence above an IEEE division (and test exactly that, tests/test_emu_div.py):
# * "1.0 / 64'F(S1) == DENORM.f64" is never true for an f32 S1; it is read as "1/S1 would be an
#   f32 denormal" (|S1| > 2^126), the case where V_RCP_F32 would flush its result;
# * V_DIV_FMAS_F32's "2.0F ** 32 * fma(...)" cannot undo a 2^64 scaling; the factor is taken as
#   2^64 when S2 (the scaled quotient) has exponent > 127 and 2^-64 otherwise, the shape the
#   guide gives for V_DIV_FMAS_F64 (2^+-128 around exponent 1023);
# * when both operands would need the same scaling (denormal divisor, tiny dividend) both are
#   scaled and VCC stays 0; when 1/S1 and S2/S1 would both be denormal only the divisor is
#   scaled (down) and VCC is set;
# * V_DIV_FIXUP_F32 returns +-inf for a NaN quotient that is not explained by a NaN input
#   (an overflowed scaled quotient: inf - inf inside the refinement).

_EXP = np.uint32(0x7F800000)
_MAN = np.uint32(0x007FFFFF)
_SIGN = np.uint32(0x80000000)


def _exponent(bits):
    return ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int64)


def _is_denorm_bits(bits):
    return ((bits & _EXP) == 0) & ((bits & _MAN) != 0)


def div_scale_f32(s0, s1, s2):
    """V_DIV_SCALE_F32: (D, vcc) with S1 the divisor and S2 the dividend; S0 is the one this
    instruction scales (LLVM passes S0 = S1 for the divisor and S0 = S2 for the dividend)."""
    b0, b1, b2 = np.broadcast_arrays(f32_bits(s0), f32_bits(s1), f32_bits(s2))
    x0, x1, x2 = _to64(b0), _to64(b1), _to64(b2)
    e1, e2 = _exponent(b1), _exponent(b2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rcp_denorm = (np.abs(x1) > 2.0 ** 126) & np.isfinite(x1)
        q = np.abs(x2 / x1)
    quot_denorm = (q < 2.0 ** -126) & (q != 0) & np.isfinite(q)
    up = f32_bits(ldexp_f32(bits_f32(b0), 64))
    down = f32_bits(ldexp_f32(bits_f32(b0), -64))
    is_den, is_num = x0 == x1, x0 == x2
    zero = (x1 == 0) | (x2 == 0)
    c_big = ~zero & (e2 - e1 >= 96)                       # dividend near f32 max over divisor
    rest = ~zero & ~c_big
    c_den = rest & _is_denorm_bits(b1)                    # denormal divisor: scale both up
    rest &= ~c_den
    c_both = rest & rcp_denorm & quot_denorm
    rest &= ~c_both
    c_rcp = rest & rcp_denorm                             # huge divisor: scale both down
    rest &= ~c_rcp
    c_q = rest & quot_denorm                              # denormal quotient: dividend up
    rest &= ~c_q
    c_tiny = rest & (e2 <= 23)                            # tiny dividend: scale both up
    d = b0.copy()
    d = np.where((c_big & is_den) | c_den | c_tiny | (c_q & is_num & ~is_den), up, d)
    d = np.where((c_both & is_den) | c_rcp, down, d)
    d = np.where(zero, DEFAULT_NAN_BITS, d)
    return bits_f32(d.astype(np.uint32)), c_big | c_both | c_q


def div_fmas_f32(s0, s1, s2, vcc):
    """V_DIV_FMAS_F32: fma(S0, S1, S2), times 2^+-64 in the same rounding where VCC is set."""
    b0, b1, b2 = np.broadcast_arrays(f32_bits(s0), f32_bits(s1), f32_bits(s2))
    vcc = np.broadcast_to(np.asarray(vcc, bool), b0.shape)
    plain = fma_f32(bits_f32(b0), bits_f32(b1), bits_f32(b2))
    if not vcc.any():
        return plain
    a, b, c = _to64(b0), _to64(b1), _to64(b2)
    scale = np.where(_exponent(b2) > 127, 2.0 ** 64, 2.0 ** -64)
    with np.errstate(invalid="ignore", over="ignore"):
        # round-to-odd keeps the single rounding exact also when the scaled result is an f32
        # denormal (the scaling by a power of two is exact in float64)
        scaled = (_add_round_to_odd(a * b, c) * scale).astype(np.float32)
    rb = np.where(np.isnan(scaled), f32_bits(plain), f32_bits(scaled))
    return np.where(vcc, bits_f32(rb), plain).astype(np.float32)


def div_fixup_f32(s0, s1, s2):
    """V_DIV_FIXUP_F32: S0 the quotient, S1 the divisor, S2 the dividend; IEEE special cases."""
    b0, b1, b2 = np.broadcast_arrays(f32_bits(s0), f32_bits(s1), f32_bits(s2))
    x1, x2 = _to64(b1), _to64(b2)
    neg = ((b1 ^ b2) & _SIGN) != 0
    sign = np.where(neg, _SIGN, np.uint32(0))
    inf_b = sign | _EXP
    zero_b = sign
    mag = b0 & ~_SIGN
    out = np.where(_is_nan_bits(b0) | ((b0 & ~_SIGN) == _EXP), inf_b, sign | mag)
    e1, e2 = _exponent(b1), _exponent(b2)
    out = np.where(e2 - e1 < -150, zero_b, out)              # quotient below half the smallest denormal
    out = np.where(np.isinf(x1) | (x2 == 0), zero_b, out)
    out = np.where((x1 == 0) | np.isinf(x2), inf_b, out)
    out = np.where(np.isinf(x1) & np.isinf(x2), DEFAULT_NAN_BITS, out)
    out = np.where((x1 == 0) & (x2 == 0), DEFAULT_NAN_BITS, out)
    out = np.where(_is_nan_bits(b1), _quiet(b1), out)
    out = np.where(_is_nan_bits(b2), _quiet(b2), out)
    return bits_f32(out.astype(np.uint32))


# --------------------------------------------------------------------------------------------
# gfx950 V_MFMA_F32_{16X16X128,32X32X64}_F8F6F4 (CDNA4 §7.1.2, §7.3 "MX formats")
# --------------------------------------------------------------------------------------------
# CBSZ selects A's format and BLGP B's (0 fp8 e4m3, 1 bf8 e5m2, 2 fp6 e2m3, 3 bf6 e3m2, 4 fp4
# e2m1); items are packed back to back, little-endian, across the dwords of a lane, so A/B take
# 8, 6 or 4 VGPRs. fp8/bf8 are the OCP formats of gfx950; the fp6/fp4 ones have no inf or NaN.
# Lane i + M * g holds row i of A (column i of B) and K_L = 32 items of it, but which 32 depends
# on the item width (:func:`f8f6f4_k_index`): 4- and 6-bit items are the consecutive K block g
# (the §7.1.4 formula), while 8-bit items come as two runs of 16, K = 16 g .. 16 g + 15 in
# registers 0-3 and the same run K / 2 further on in registers 4-7. The 8-bit split is the layout
# of AMD's CDNA4 matrix-core blog (ROCm blogs, "Matrix Core Programming on AMD CDNA3 and CDNA4
# architecture", its fp8 v_mfma_scale_f32_32x32x64_f8f6f4 example loads
# a_reg[16 i + j] = A[lane % 32][16 (lane / 32) + 32 i + j]; its fp4 example loads 32 consecutive
# K); 16x16x128 is taken to split the same way at K / 2 = 64, which FlyDSL's MXFP8 GEMM (written
# for the hardware) confirms end to end. amd_matrix_instruction_calculator has no CDNA4 data.
# Accumulation as in :func:`mfma`.

F8F6F4_FORMATS = {0: ("fp8", 8), 1: ("bf8", 8), 2: ("fp6", 6), 3: ("bf6", 6), 4: ("fp4", 4)}
_MINI = {"fp6": (2, 3, 1), "bf6": (3, 2, 3), "fp4": (2, 1, 1)}  # exponent bits, mantissa bits, bias
F8F6F4_SHAPES = {"v_mfma_f32_16x16x128_f8f6f4": (16, 16, 128), "v_mfma_f32_32x32x64_f8f6f4": (32, 32, 64)}


def f8f6f4_regs(fmt_code: int, M: int, K: int) -> int:
    """VGPRs one lane's A (or B) items take for this format."""
    return K * M // 64 * F8F6F4_FORMATS[fmt_code][1] // 32


def _unpack_items(regs, bits, n):
    by = np.ascontiguousarray(np.asarray(regs, np.uint32).T).view(np.uint8)      # (64, R*4)
    bitv = np.unpackbits(by, axis=1, bitorder="little")[:, : n * bits].reshape(64, n, bits)
    return (bitv.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(axis=2).astype(np.uint32)


def _mini_decode(codes, kind):
    e_bits, m_bits, bias = _MINI[kind]
    sign = np.where((codes >> (e_bits + m_bits)) & 1, -1.0, 1.0)
    e = (codes >> m_bits) & ((1 << e_bits) - 1)
    m = codes & ((1 << m_bits) - 1)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - m_bits), (1 + m / 2.0 ** m_bits) * np.exp2(e.astype(np.float64) - bias))
    return sign * mag


F8F6F4_SCALE_SHAPES = {"v_mfma_scale_f32_16x16x128_f8f6f4": (16, 16, 128),
                        "v_mfma_scale_f32_32x32x64_f8f6f4": (32, 32, 64)}


def e8m0_scale(codes) -> np.ndarray:
    """OCP MX E8M0 block scale: 2**(code - 127); code 0xFF is NaN (OCP MX v1.0 §5.4)."""
    codes = np.asarray(codes, np.int64)
    return np.where(codes == 0xFF, np.nan, np.exp2((codes - 127).astype(np.float64)))


def f8f6f4_k_index(mnemonic: str, fmt_code: int) -> np.ndarray:
    """K coordinate of item t of lane l, shape (64, 32), for A (or B) of a gfx950 f8f6f4 MFMA in
    format *fmt_code*; that lane holds row ``l % M`` of A (column ``l % N`` of B)."""
    M, _, K = F8F6F4_SHAPES.get(mnemonic) or F8F6F4_SCALE_SHAPES[mnemonic]
    g = (np.arange(64) // M)[:, None]
    t = np.arange(32)[None, :]
    if F8F6F4_FORMATS[fmt_code][1] == 8:
        return 16 * g + (K // 2) * (t // 16) + t % 16
    return 32 * g + t


def mfma_f8f6f4(mnemonic: str, a, b, c, cbsz: int = 0, blgp: int = 0, scale_a=None, scale_b=None) -> np.ndarray:
    """D = A x B + C for the gfx950 mixed-format MFMA; a/b are the (regs, 64) source rows.

    ``v_mfma_scale_*`` (CDNA4 §7.1.2 "MFMA with scaling"): D = (scaleA . A) x (scaleB . B) + C,
    with one E8M0 scale per 32 consecutive K items of a row (A) or column (B). *scale_a* /
    *scale_b* are the 64 per-lane E8M0 codes: lane i + M * g holds the scale of row (column) i
    for K block g (K = 32 g .. 32 g + 31), whichever K items that lane's data holds (8-bit items:
    halves of two blocks)."""
    M, N, K = F8F6F4_SHAPES.get(mnemonic) or F8F6F4_SCALE_SHAPES[mnemonic]
    kl = K * M // 64
    lane_row = np.broadcast_to((np.arange(64) % M)[:, None], (64, kl))

    def matrix(regs, code, scale):     # (M, K) values, rows indexed like A's
        kind, bits = F8F6F4_FORMATS[code]
        items = _unpack_items(regs, bits, kl)
        if bits == 8:
            v = _to64(f32_bits(_decode(items, kind, "ocp")))
        else:
            v = _mini_decode(items.astype(np.int64), kind)
        X = np.empty((M, K))
        X[lane_row, f8f6f4_k_index(mnemonic, code)] = v
        if scale is not None:
            X = X * np.repeat(e8m0_scale(scale).reshape(K // 32, M).T, 32, axis=1)
        return X

    A = matrix(a, cbsz, scale_a)
    B = matrix(b, blgp, scale_b).T
    ref = "v_mfma_f32_16x16x4_f32" if M == 16 else "v_mfma_f32_32x32x2_f32"   # same C/D layout
    L = _layout(ref)
    c = _check_regs(c, M * N // 64, "C")
    C = _to64(c[L["c_reg"], L["c_lane"]])
    with np.errstate(over="ignore", invalid="ignore"):
        D32 = _add_round_to_odd(A @ B, C).astype(np.float32)
    dbits = np.where(np.isnan(D32), np.uint32(0x7FC00000), f32_bits(D32))
    out = np.empty((M * N // 64, 64), dtype=np.uint32)
    out[L["c_reg"], L["c_lane"]] = dbits
    return out
