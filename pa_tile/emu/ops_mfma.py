"""MFMA (matrix core) instructions. The arithmetic and the lane layouts live in
``numerics.mfma``; this module only moves register rows in and out.

MFMA ignores EXEC (CDNA3 §7.1.2), so all 64 lanes of the destination are written.
"""

from __future__ import annotations

import numpy as np

from . import numerics as nx
from .ops_base import LANES, OPS, const_bits, op

_U32 = np.uint32


def _mfma(ctx):
    try:
        _, _, _, na, nb, nc = nx.mfma_shapes(ctx.base)
    except NotImplementedError as e:
        raise ctx.fail(str(e)) from None
    if ctx.arch not in nx.mfma_archs(ctx.base):
        raise ctx.fail(f"not available on {ctx.arch}")
    ctx.need(4)
    d, a, b, c = ctx.ops
    for o, n, what in ((d, nc, "D"), (a, na, "A"), (b, nb, "B")):
        if o.kind not in ("v", "a") or o.count != n:
            raise ctx.fail(f"{what} operand {o} should be {n} vector registers")
    extra = set(ctx.mods) - {"cbsz", "abid", "blgp"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    cbsz, abid, blgp = (int(ctx.mods.get(k, 0)) for k in ("cbsz", "abid", "blgp"))
    if cbsz or abid or blgp:
        raise ctx.fail("cbsz/abid/blgp broadcasting is not emulated")
    rd, ra, rb = ctx.vrow(d), ctx.vrow(a), ctx.vrow(b)
    if c.kind == "imm":
        cval = np.full((nc, LANES), const_bits(c, "f32"), _U32)
        getc = lambda w: cval  # noqa: E731
    elif c.kind in ("v", "a") and c.count == nc:
        rc = ctx.vrow(c)
        getc = lambda w: w.v[rc:rc + nc]  # noqa: E731
    else:
        raise ctx.fail(f"C operand {c} should be {nc} vector registers or a constant")
    name, arch = ctx.base, ctx.arch
    ovfl = bool(ctx.desc.get("fp16_overflow", 0))

    def h(w):
        w.v[rd:rd + nc] = nx.mfma(name, w.v[ra:ra + na], w.v[rb:rb + nb], getc(w), arch, fp16_ovfl=ovfl)
    return h


for _m in nx.MFMA_MNEMONICS:
    if _m not in OPS:
        op(_m)(_mfma)
