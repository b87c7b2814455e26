"""Device helpers of the serving math (chapter 08, "Serving real models"): the logit soft-cap
(Gemma 2), attention sinks (gpt-oss) and the row's log-sum-exp out (for merging attentions).

Each is a compile-time option of the kernels (``pa_tile.stages.s5_phase_split_mtp.Spec`` and
``s6_split_k.build_reduce``): off, none of this is traced and the machine code is what it was
without them (``tests/test_machine_code_unchanged.py`` holds the instruction streams to
fingerprints recorded before they existed).

Units: the kernels keep scores in log2 units (``x2 = x·log2 e``: the softmax runs on ``exp2``,
v_exp_f32); the arguments here follow them and say so.
"""

import flydsl.expr as fx
from flydsl.expr import const_expr
from flydsl.expr.typing import T

from pa_tile.kernel_lib import LOG2E, buffer_load, exp2, exp_shift, fmax, ir_value, rcp, select

__all__ = ["log2", "soft_capped", "with_sink", "finish_row"]


def log2(x):
    """v_log_f32: log2 x to about 1 ulp (-inf at 0)."""
    return fx.Float32(fx.rocdl.log(T.f32, ir_value(fx.Float32(x))))


def soft_capped(s, c_qk, cap):
    """Gemma 2's soft-cap ``cap·tanh(x/cap)`` of the scaled logits ``x = s·c_qk``, for a list of
    raw scores ``s`` and their factor ``c_qk`` to log2 units; ``cap`` (natural units, > 0) is a
    compile-time float. Returns the capped logits in log2 units, ``cap2·tanh(x2/cap2)`` with
    ``cap2 = cap·log2 e`` (tanh commutes with the change of units).

    CDNA3 has no tanh instruction (CDNA3 ISA guide, VOP1 opcodes: exp, log, rcp, rsq, sqrt, sin,
    cos), so ``tanh u = 1 - 2/(e^(2u) + 1)`` on v_exp_f32 and v_rcp_f32: ``e^(2u) = 2^(x2·2/cap)``.
    Both ends are exact limits: a large ``x2`` gives ``2^(..) = inf``, ``rcp(inf) = 0``, ``+cap2``;
    a very negative one ``rcp(1) = 1``, ``-cap2``. Near 0 the result is a difference of two
    numbers near ``cap2``: absolute error a few ulps of ``cap2`` (~1e-5 at cap 50), against an
    fp8 score error of ~2^-4 relative."""
    cap2 = cap * LOG2E
    k, two_cap2 = 2.0 / cap, 2.0 * cap2
    return [rcp(exp2(fx.Float32(x) * c_qk * k) + 1.0) * (-two_cap2) + cap2 for x in s]


def with_sink(keys_lse2, sink2):
    """A row whose keys' log-sum-exp is ``keys_lse2`` and whose softmax denominator gains
    ``2^sink2`` (both log2 units): ``(g, lse2)``, the factor ``1/(1 + 2^(sink2 - keys_lse2))``
    that turns the output normalized over the keys into the one normalized with the sink, and the
    log2 of the whole denominator.

    Overflow-free: ``lse2 = max + log2(1 + 2^-|d|)`` never exponentiates a positive number, and a
    sink far above the keys makes ``g`` exactly 0 (``rcp(inf)``), the limit. ``sink2 = -inf``
    (no sink) gives ``g = 1`` and ``lse2 = keys_lse2``; a row with no key (``keys_lse2 = -inf``)
    gives ``g = 0`` and ``lse2 = sink2``: no NaN on either side."""
    # no key: d = +inf (not -inf - -inf = NaN when the sink is -inf too)
    d = fx.Float32(select(keys_lse2 > float("-inf"), sink2 - keys_lse2, fx.Float32(float("inf"))))
    g = rcp(exp2(d) + 1.0)
    lse2 = fmax(keys_lse2, sink2) + log2(exp2(fx.Float32(-fx.absf(d))) + 1.0)
    return g, lse2


def finish_row(c, f, mx, total, sinks_rs, head):
    """One row at the end of an unsplit kernel (``c``: its ``Spec``): its output factor ``f``
    (``1/total``, V scale applied) with the sink's share taken out if ``c.SINKS``, and the log2 of
    its whole softmax denominator: ``(f, lse2)``. ``mx`` is the row's running max and ``total``
    its sum of P, both relative to ``exp_shift(mx)`` (log2 units); the sink of query head
    ``head`` is read from ``sinks_rs`` (natural-log units, not scaled by softmax_scale)."""
    keys_lse2 = exp_shift(mx, c.LOG2_FMAX) + log2(total)
    if const_expr(not c.SINKS):
        return f, keys_lse2
    sink2 = buffer_load(sinks_rs, head * 4, 1).bitcast(fx.Float32) * LOG2E
    g, lse2 = with_sink(keys_lse2, sink2)
    return f * g, lse2
