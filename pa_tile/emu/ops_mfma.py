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


@op(*nx.F8F6F4_SHAPES, *nx.F8F6F4_SCALE_SHAPES, archs=("gfx950",))
def _mfma_f8f6f4(ctx):
    """gfx950 mixed-format MFMA: ``cbsz`` / ``blgp`` name A's / B's element format here (not the
    broadcast controls of the other MFMAs), and fix how many VGPRs each source spans.

    ``v_mfma_scale_*`` take two more 32-bit sources, A's and B's E8M0 scales, one per lane;
    ``op_sel[i] | op_sel_hi[i] << 1`` picks the byte of scale source i (LLVM's OPSEL_A/OPSEL_B
    immediates, printed that way)."""
    scaled = ctx.base in nx.F8F6F4_SCALE_SHAPES
    ctx.need(6 if scaled else 4)
    extra = set(ctx.mods) - {"cbsz", "blgp", "abid"} - ({"op_sel", "op_sel_hi"} if scaled else set())
    if extra or int(ctx.mods.get("abid", 0)):
        raise ctx.fail(f"modifiers {sorted(extra) or ['abid']}")
    cbsz, blgp = int(ctx.mods.get("cbsz", 0)), int(ctx.mods.get("blgp", 0))
    if cbsz not in nx.F8F6F4_FORMATS or blgp not in nx.F8F6F4_FORMATS:
        raise ctx.fail(f"cbsz:{cbsz} blgp:{blgp} name no format")
    M, N, K = (nx.F8F6F4_SHAPES.get(ctx.base) or nx.F8F6F4_SCALE_SHAPES[ctx.base])
    nc = M * N // 64
    d, a, b, c = ctx.ops[:4]
    scales = None
    if scaled:
        sel = tuple(ctx.mods.get("op_sel", (0, 0, 0))) + (0, 0)
        hi = tuple(ctx.mods.get("op_sel_hi", (0, 0, 0))) + (0, 0)
        if sel[2] or hi[2]:
            raise ctx.fail("op_sel[2] / op_sel_hi[2] on a scaled MFMA")
        shifts = [8 * (int(sel[i]) | int(hi[i]) << 1) for i in (0, 1)]
        reads = [ctx.vread(o, "u32") for o in ctx.ops[4:6]]

        def scales(w):
            return [(np.broadcast_to(r(w), (LANES,)) >> _U32(sh)) & _U32(0xFF) for r, sh in zip(reads, shifts)]
    na, nb = nx.f8f6f4_regs(cbsz, M, K), nx.f8f6f4_regs(blgp, M, K)
    # LLVM prints the 8-register range for every format; the instruction reads only the first ones
    for o, n, what in ((a, na, "A"), (b, nb, "B")):
        if o.kind not in ("v", "a") or o.count < n:
            raise ctx.fail(f"{what} operand {o} should be at least {n} vector registers")
    if d.kind not in ("v", "a") or d.count != nc:
        raise ctx.fail(f"D operand {d} should be {nc} vector registers")
    rd, ra, rb = ctx.vrow(d), ctx.vrow(a), ctx.vrow(b)
    if c.kind == "imm":
        cval = np.full((nc, LANES), const_bits(c, "f32"), _U32)
        getc = lambda w: cval  # noqa: E731
    elif c.kind in ("v", "a") and c.count == nc:
        rc = ctx.vrow(c)
        getc = lambda w: w.v[rc:rc + nc]  # noqa: E731
    else:
        raise ctx.fail(f"C operand {c} should be {nc} vector registers or a constant")
    name = ctx.base

    def h(w):
        sa, sb = scales(w) if scales else (None, None)
        w.v[rd:rd + nc] = nx.mfma_f8f6f4(name, w.v[ra:ra + na], w.v[rb:rb + nb], getc(w), cbsz, blgp, sa, sb)
    return h
