"""The shared kernel library: every device helper, constant and building block that more than one
chapter's kernel uses. The chapters import it by these public names; each helper is taught (its
source shown, its instruction named, tested) in the chapter where it first matters, chapter 2
for most of them.

Two layers:

* **device helpers**, one hardware operation each: buffer loads/stores through a buffer resource
  (V#), scalar loads, ``v_readfirstlane``, lane exchange, fp8 packing, the fp8 MFMA, LDS access;
* **stage-2 building blocks** for head_dim 128 on the plain layouts (``query_operands``,
  ``mask_tail``, ``softmax_step``, ``pv_step``, ``merge_waves``), which chapter 3 reuses unchanged.
  Later chapters generalize them in their own modules.

Everything here runs while FlyDSL traces a kernel (inside ``@flyc.kernel``); nothing launches.
"""

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl.expr import arith, const_expr, gpu, range_constexpr
from flydsl.expr.typing import T

__all__ = [
    "WAVE", "WAVES", "TILE", "SPAN", "HEAD_DIM", "LOG2E", "MASKED", "NNAN",
    "ir_value", "rsrc", "buffer_load", "buffer_store", "scalar_load", "uniform", "select", "imin", "imax",
    "fmax", "exp2", "rcp", "xor_lanes", "pack_fp8", "i64", "mfma", "splat4", "lds_ptr", "lds_store",
    "lds_load", "tree_sum", "lane_coords",
    "query_operands", "quantize_query", "mask_tail", "softmax_step", "pv_step", "merge_waves",
]

WAVE = 64  # lanes per wave on CDNA
WAVES = 4  # waves per workgroup in every pa_tile kernel
TILE = 256  # tokens per main-loop trip, for the whole workgroup
SPAN = TILE // WAVES  # tokens of each tile one wave owns
HEAD_DIM = 128  # the head size of the stage-2 building blocks below
LOG2E = 1.4426950408889634
# A finite "minus infinity" for a running max: MASKED - MASKED is 0 (never NaN) and
# exp2(MASKED - m) is 0 for any real m.
MASKED = -1.0e30
# Scores are never NaN, so max may lower to a bare v_max (no NaN canonicalization).
NNAN = arith.FastMathFlags.nnan


# ---------------------------------------------------------------------------------------------
# device helpers

def ir_value(x):
    return x.ir_value() if hasattr(x, "ir_value") else x


def rsrc(tensor):
    """Buffer resource (V#) over a tensor: base address and size in four SGPRs.

    The size is the tensor's own footprint (``cosize(layout)`` bytes, computed on the device from
    its runtime shape and strides), not the 4 GiB maximum: the hardware returns 0 for a load past
    it and drops a store, so an offset gone wrong (a bad page id in the block table, which the
    per-call path does not read on a GPU) stays inside the tensor instead of reading or writing
    someone else's memory."""
    return fx.rocdl.get_buffer_rsrc(fx.get_iter(fx.rocdl.make_buffer_tensor(tensor, max_size=False)))


def buffer_load(resource, voffset, dwords, soffset=0, offset=0):
    """`dwords` 32-bit words per lane at byte resource + soffset (SGPR) + voffset (VGPR) + offset (imm)."""
    ty = T.i32 if dwords == 1 else T.vec(dwords, T.i32)
    v = fx.rocdl.raw_ptr_buffer_load(ty, resource, ir_value(fx.Int32(voffset) + offset), ir_value(fx.Int32(soffset)),
                                     aux=0)
    return fx.Int32(v) if dwords == 1 else fx.Vector(v)


def buffer_store(value, resource, voffset):
    aux = ir.IntegerAttr.get(T.i32, 0)
    fx.rocdl.raw_ptr_buffer_store(ir_value(value), resource, ir_value(fx.Int32(voffset)), ir_value(fx.Int32(0)),
                                  aux=aux)


def scalar_load(tensor, index):
    """One 32-bit word of `tensor` into an SGPR; `index` (in words) must be wave-uniform."""
    return fx.Int32(fx.rocdl.s_buffer_load(fx.get_iter(fx.rocdl.make_buffer_tensor(tensor)), index))


def uniform(x):
    return fx.Int32(fx.rocdl.readfirstlane(T.i32, ir_value(x)))


def select(cond, a, b):
    return arith.select(ir_value(cond), ir_value(a), ir_value(b))


def imin(a, b):
    return fx.Int32(arith.minsi(ir_value(fx.Int32(a)), ir_value(fx.Int32(b))))


def imax(a, b):
    return fx.Int32(arith.maxsi(ir_value(fx.Int32(a)), ir_value(fx.Int32(b))))


def fmax(a, b):
    return fx.Float32(fx.maxnumf(a, b, fastmath=NNAN))


def exp2(x):
    """v_exp_f32: 2^x to about 1 ulp, 0 for very negative x."""
    return fx.Float32(fx.rocdl.exp2(T.f32, ir_value(fx.Float32(x))))


def rcp(x):
    return fx.Float32(fx.rocdl.rcp(T.f32, ir_value(fx.Float32(x))))


def xor_lanes(x, k):
    """`x` of lane (lane ^ k)."""
    return fx.Float32(x).shuffle_xor(k, WAVE)


def pack_fp8(a, b, c, d):
    """Four f32 -> one dword of fp8 codes, `a` in the low byte; round to nearest even."""
    lo = fx.rocdl.cvt_pk_fp8_f32(T.i32, a, b, fx.Int32(0), False)
    return fx.Int32(fx.rocdl.cvt_pk_fp8_f32(T.i32, c, d, lo, True))


def i64(lo, hi):
    """Two dwords -> one 64-bit MFMA operand (eight fp8 codes, `lo` first)."""
    return fx.Vector.from_elements([lo, hi], dtype=fx.Int32).bitcast(fx.Int64)[0]


def mfma(a, b, c):
    """D = A·B + C on the 16x16x32 fp8 MFMA; a, b: i64 (8 codes per lane), c: f32x4."""
    return fx.Vector(fx.rocdl.mfma_f32_16x16x32_fp8_fp8(T.f32x4, [a, b, c]))


def splat4(x):
    return fx.Vector.from_elements([x] * 4, dtype=fx.Float32)


def lds_ptr(base_u8, byte_off, floats):
    p = fx.add_offset(base_u8, fx.make_int_tuple(fx.Int32(byte_off)))
    # alignment = access size, so a 4-float access becomes one ds_read/write_b128
    return fx.recast_iter(fx.PointerType.get(fx.Float32.ir_type, fx.AddressSpace.Shared, 4 * floats), p)


def lds_store(base_u8, byte_off, vec):
    fx.ptr_store(vec, lds_ptr(base_u8, byte_off, vec.numel))


def lds_load(base_u8, byte_off, floats):
    ty = fx.Vector.make_type(floats, fx.Float32)
    return fx.Vector(fx.ptr_load(lds_ptr(base_u8, byte_off, floats), result_type=ty))


def lane_coords():
    """``(tid, wave, lane, col, grp)`` of this thread: ``col = lane % 16`` is its MFMA column (a
    query row), ``grp = lane // 16`` its row band / k-slice; ``wave`` is made wave-uniform (SGPR)."""
    tid = fx.Int32(gpu.thread_id("x"))
    wave = uniform(tid // WAVE)
    lane = tid % WAVE
    return tid, wave, lane, lane % 16, lane // 16


# ---------------------------------------------------------------------------------------------
# stage-2 building blocks (head_dim 128, plain K/V layouts)


def query_operands(q_rs, head, valid, fp8_max, grp):
    """Load, quantize and pack this lane's share of Q as the four B operands of Q·Kᵀ.

    Returns ``(ops, q_scale)``: ``ops[2h + half]`` holds channels ``16(grp + 4h) + 8·half .. +8``
    of query row ``head`` as fp8 codes (zeros where ``valid`` is false: padding heads).
    """
    row = head * (HEAD_DIM * 2)
    vals = []
    for h in range_constexpr(2):
        d0 = 16 * (grp + 4 * h)
        for half in range_constexpr(2):
            v = buffer_load(q_rs, row + d0 * 2, 4, offset=16 * half)
            vals.append(v.bitcast(fx.Float16).to(fx.Float32))
    return quantize_query(vals, valid, fp8_max)


def quantize_query(vals, valid, fp8_max):
    """This lane's query values (f32 vectors of 8) -> ``(ops, q_scale)``: fp8 codes scaled so the
    row's largest magnitude lands on ``fp8_max`` (the row's four lanes agree on it with two
    ``xor_lanes`` steps), packed as i64 MFMA operands; zeros where ``valid`` is false."""
    amax = fx.Float32(1e-20)  # an all-zero row gets a tiny positive scale, never 0 or inf
    for v in vals:
        for i in range_constexpr(8):
            amax = fmax(amax, fx.Float32(fx.absf(v[i])))
    amax = fmax(amax, xor_lanes(amax, 16))
    amax = fmax(amax, xor_lanes(amax, 32))
    inv = fx.Float32(select(valid, rcp(amax) * fp8_max, fx.Float32(0.0)))
    ops = []
    for v in vals:
        s = v * inv
        ops.append(i64(pack_fp8(s[0], s[1], s[2], s[3]), pack_fp8(s[4], s[5], s[6], s[7])))
    return ops, amax * (1.0 / fp8_max)


def mask_tail(s, v_words, n_valid):
    """Last tile only: scores of tokens at or past the context -> -inf, their V bytes -> 0.

    ``s[4a + i]`` is wave-token ``16g + 4a + i``; ``v_words[4j + k]`` holds those tokens'
    bytes ``4k .. 4k+3`` for d-chunk ``j``; ``n_valid`` = tokens of the lane's 16 inside.
    """
    ninf = fx.Float32(float("-inf"))
    s = fx.Vector.from_elements(
        [fx.Float32(select(n_valid > i, fx.Float32(s[i]), ninf)) for i in range_constexpr(16)], dtype=fx.Float32
    )
    masks = []
    for k in range_constexpr(4):
        keep = imax(imin(n_valid - 4 * k, 4), 0)  # bytes of dword k to keep: 0..4
        partial = (fx.Int32(1) << (keep * 8 % 32)) - 1
        masks.append(fx.Int32(select(keep > 3, fx.Int32(-1), partial)))
    v_words = fx.Vector.from_elements(
        [fx.Int32(v_words[i]) & masks[i % 4] for i in range_constexpr(32)], dtype=fx.Int32
    )
    return s, v_words


def tree_sum(xs):
    """Pairwise sum: log2(n) dependent adds instead of n."""
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] for i in range(0, len(xs), 2)]
    return xs[0]


def softmax_step(s, m_old, l_old, c_qk, log2_fp8_max):
    """One tile of the online softmax for this lane's 16 raw scores ``s``.

    Returns ``(p_ops, corr, m_new, l_new)``: ``p_ops`` are the two P·V B operands (8 fp8
    codes each, tokens ``16g .. 16g+7`` and ``16g+8 .. 16g+15``).
    """
    s_max = fx.Float32(s[0])
    for i in range_constexpr(1, 16):
        s_max = fmax(s_max, fx.Float32(s[i]))
    m_tile = s_max * c_qk  # c_qk > 0, so the max commutes with the scaling
    m_tile = fmax(m_tile, xor_lanes(m_tile, 16))
    m_tile = fmax(m_tile, xor_lanes(m_tile, 32))
    m_new = fmax(m_old, m_tile)
    corr = exp2(m_old - m_new)
    shift = m_new - log2_fp8_max
    p = [exp2(fx.Float32(s[i]) * c_qk - shift) for i in range_constexpr(16)]
    l_new = l_old * corr + tree_sum(p)
    words = [pack_fp8(p[4 * a], p[4 * a + 1], p[4 * a + 2], p[4 * a + 3]) for a in range_constexpr(4)]
    return [i64(words[0], words[1]), i64(words[2], words[3])], corr, m_new, l_new


def pv_step(o, v_words, p_ops, corr):
    """O_j = O_j · corr + V_j · P for every d-chunk slot ``o[j]`` of this wave (8 at head_dim 128;
    chapter 4's other head sizes use it with their own count)."""
    corr4 = splat4(corr)
    out = []
    for j in range_constexpr(len(o)):
        w = [fx.Int32(v_words[4 * j + k]) for k in range_constexpr(4)]
        acc = o[j] * corr4
        acc = mfma(i64(w[0], w[1]), p_ops[0], acc)
        acc = mfma(i64(w[2], w[3]), p_ops[1], acc)
        out.append(acc)
    return out


def merge_waves(o, m_w, l_w, v_scale, lds, wave, lane, col, grp):
    """Combine the four waves' (max, sum, O); returns d-chunks 2·wave and 2·wave+1, normalized."""
    stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
    xchg = fx.recast_iter(fx.Uint8, lds.xchg.ptr)
    l_w = l_w + xor_lanes(l_w, 16)
    l_w = l_w + xor_lanes(l_w, 32)
    # stats: [max | sum][head][wave]; the 4 lanes of a head write the same value to the same word
    lds_store(stats, (col * WAVES + wave) * 4, fx.Vector.from_elements([m_w], dtype=fx.Float32))
    lds_store(stats, ((16 + col) * WAVES + wave) * 4, fx.Vector.from_elements([l_w], dtype=fx.Float32))
    gpu.barrier()
    m4 = lds_load(stats, col * WAVES * 4, WAVES)
    l4 = lds_load(stats, (16 + col) * WAVES * 4, WAVES)
    m = fmax(fmax(fx.Float32(m4[0]), fx.Float32(m4[1])), fmax(fx.Float32(m4[2]), fx.Float32(m4[3])))
    total = fx.Float32(0.0)
    for w in range_constexpr(WAVES):
        total = total + fx.Float32(l4[w]) * exp2(fx.Float32(m4[w]) - m)
    o = [x * splat4(exp2(m_w - m) * v_scale * rcp(total)) for x in o]
    for r in range_constexpr(1, WAVES):
        for s in range_constexpr(2):
            lds_store(xchg, ((wave * 2 + s) * WAVE + lane) * 16, o[2 * r + s])
        gpu.barrier()
        src = (wave + (WAVES - r)) % WAVES
        for s in range_constexpr(2):
            o[s] = o[s] + lds_load(xchg, ((src * 2 + s) * WAVE + lane) * 16, 4)
        if const_expr(r < WAVES - 1):
            gpu.barrier()  # the next round overwrites the slots just read
    return o[0], o[1]
