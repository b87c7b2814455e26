"""The margin of ``kernel_lib.exp_shift``, checked against the emulator's fp8 conversion rule.

Its docstring says: without the margin the top P of a row is FP8_MAX·2^δ, |δ| about 1.5 ulp of
the row max |m| plus the rounding of m - log2 FP8_MAX; v_cvt_pk_fp8_f32 judges overflow after
rounding, so that P turns NaN only once |m| >= 2^19 (FNUZ) or 2^21 (OCP); with the margin (|m|·2^-21) it never passes FP8_MAX. The kernel's
float32 order is reproduced in numpy: m = f32(max(s)·c), shift = f32(m - log2 FP8_MAX) (+ the
margin), the exponent one fma (exact in float64, rounded once to float32), v_exp_f32 and the
conversion as pa_tile.emu.numerics models them."""

import numpy as np
import pytest

from pa_tile import arch
from pa_tile.emu import numerics as nx

F32 = np.float32
#: the smallest |row max| at which the top P can turn NaN without the margin (see kernel_lib)
ONSET = {"fnuz": 2.0 ** 19, "ocp": 2.0 ** 21}


def _top_p(m_abs_lo, m_abs_hi, fmt, margin, n=20000, seed=0):
    """The decoded fp8 P of rows' top scores with |row max| drawn in [m_abs_lo, m_abs_hi)."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(0.05, 0.25, n).astype(F32)
    m_abs = np.exp2(rng.uniform(np.log2(m_abs_lo), np.log2(m_abs_hi), n))
    s = (m_abs / c * rng.choice([-1.0, 1.0], n)).astype(F32)
    log2_max = F32(np.log2(F32(arch.FP8_MAX_BY_FORMAT[fmt])))
    m = (s * c).astype(F32)                                   # the row max, rounded once
    shift = (m - log2_max).astype(F32)
    if margin:
        shift = (shift + (np.abs(m) * F32(2.0 ** -21)).astype(F32)).astype(F32)
    x = (s.astype(np.float64) * c.astype(np.float64) - shift.astype(np.float64)).astype(F32)  # one fma
    p = nx.exp2_f32(x)
    return m, nx.fp8_decode(nx.fp8_encode(p, fmt), fmt)


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_without_the_margin_the_top_p_stays_finite_below_the_onset(fmt):
    _, p = _top_p(2.0 ** 4, ONSET[fmt], fmt, margin=False)
    assert np.isfinite(p).all() and p.max() == arch.FP8_MAX_BY_FORMAT[fmt]


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_without_the_margin_a_larger_row_max_can_turn_the_top_p_into_nan(fmt):
    _, p = _top_p(ONSET[fmt], 2 * ONSET[fmt], fmt, margin=False)
    assert np.isnan(p).any()


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_with_the_margin_the_top_p_never_passes_fp8_max(fmt):
    _, p = _top_p(2.0 ** 4, 2.0 ** 24, fmt, margin=True)
    assert np.isfinite(p).all() and p.max() <= arch.FP8_MAX_BY_FORMAT[fmt]
