"""The shared kernel library: every device helper, constant and building block that more than one
chapter's kernel uses. The chapters import it by these public names; each helper is taught (its
source shown, its instruction named, tested) in the chapter where it first matters, chapter 2
for most of them.

Two layers:

* **device helpers**, one hardware operation each: buffer loads/stores through a buffer resource
  (V#), scalar loads, ``v_readfirstlane``, lane exchange, fp8 packing, the fp8 MFMA, LDS access;
* **building blocks** of the register-resident kernel: ``Pages`` (which K/V bytes a lane loads),
  ``query_operands``, ``scores``, ``mask_tail``/``zero_tail_v``, ``softmax_step``, ``pv_step``,
  ``exchange`` and ``merge_waves``. Chapter 2 writes them for its kernel (head_dim 128, plain
  layouts) and teaches them; chapter 3 reuses them unchanged; their parameters (head size, blocked
  layouts, per-token P weights, the merge table's stride, exchange slots) are what chapters 4 and 5
  add, and chapter 4 teaches those.

Everything here runs while FlyDSL traces a kernel (inside ``@flyc.kernel``); nothing launches.
"""

import inspect
import math
import operator

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl.compiler.kernel_function import CompilationContext
from flydsl.expr import arith, const_expr, gpu, range_constexpr
from flydsl.expr.typing import T

__all__ = [
    "WAVE", "WAVES", "TILE", "SPAN", "HEAD_DIM", "LOG2E", "MASKED", "NNAN",
    "ir_value", "rsrc", "buffer_load", "buffer_store", "scalar_load", "uniform", "select", "imin",
           "imax",
    "fmax", "exp2", "rcp", "xor_lanes", "row_reduce", "wave_reduce", "max4", "row_max", "pack_fp8",
           "i64", "mfma", "splat4", "lds_ptr", "lds_store",
    "lds_load", "tree_sum", "lane_coords",
    "Pages", "query_operands", "quantize_query", "scores", "zero_tail_v", "mask_tail", "exp_shift",
           "softmax_step",
    "pv_step", "exchange", "merge_waves", "store_chunks", "device_code", "jit_launcher",
           "model_operands", "softmax_model",
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
    return fx.rocdl.get_buffer_rsrc(fx.get_iter(fx.rocdl.make_buffer_tensor(tensor,
                                                                            max_size=False)))


def buffer_load(resource, voffset, dwords, soffset=0, offset=0):
    """`dwords` 32-bit words per lane at byte resource + soffset (SGPR) + voffset (VGPR) + offset
    (immediate)."""
    ty = T.i32 if dwords == 1 else T.vec(dwords, T.i32)
    v = fx.rocdl.raw_ptr_buffer_load(ty, resource, ir_value(fx.Int32(voffset) + offset),
                                     ir_value(fx.Int32(soffset)),
                                     aux=0)
    return fx.Int32(v) if dwords == 1 else fx.Vector(v)


def buffer_store(value, resource, voffset):
    aux = ir.IntegerAttr.get(T.i32, 0)
    fx.rocdl.raw_ptr_buffer_store(ir_value(value), resource, ir_value(fx.Int32(voffset)),
                                  ir_value(fx.Int32(0)),
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


def row_reduce(x, op):
    """``x`` combined with ``op`` (``fmax``, ``operator.add``) over the four lanes that share a row
    of the 16-row band (lanes ``col + 16·grp``): two ``xor_lanes`` steps."""
    x = op(x, xor_lanes(x, 16))
    return op(x, xor_lanes(x, 32))


def wave_reduce(x, op):
    """``x`` combined with ``op`` over all 64 lanes of the wave: six ``xor_lanes`` steps."""
    for k in (1, 2, 4, 8, 16, 32):
        x = op(x, xor_lanes(x, k))
    return x


def max4(xs):
    """The largest of four f32 values (one per wave, read from an LDS table), as a balanced tree."""
    return fmax(fmax(fx.Float32(xs[0]), fx.Float32(xs[1])), fmax(fx.Float32(xs[2]),
                                                                 fx.Float32(xs[3])))


def row_max(s, c):
    """The row's largest scaled score ``max(s)·c`` (``c > 0``: the max commutes with the scaling),
    over this lane's 16 scores ``s`` and the row's other three lanes."""
    m = fx.Float32(s[0])
    for i in range_constexpr(1, 16):
        m = fmax(m, fx.Float32(s[i]))
    return row_reduce(m * c, fmax)


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
    return fx.recast_iter(fx.PointerType.get(fx.Float32.ir_type, fx.AddressSpace.Shared,
                                             4 * floats), p)


def lds_store(base_u8, byte_off, vec):
    fx.ptr_store(vec, lds_ptr(base_u8, byte_off, vec.numel))


def lds_load(base_u8, byte_off, floats):
    ty = fx.Vector.make_type(floats, fx.Float32)
    return fx.Vector(fx.ptr_load(lds_ptr(base_u8, byte_off, floats), result_type=ty))


def lane_coords():
    """``(tid, wave, lane, col, grp)`` of this thread: ``col = lane % 16`` is its MFMA column (a
    query row), ``grp = lane // 16`` its row band / k-slice; ``wave`` is made wave-uniform
    (SGPR)."""
    tid = fx.Int32(gpu.thread_id("x"))
    wave = uniform(tid // WAVE)
    lane = tid % WAVE
    return tid, wave, lane, lane % 16, lane // 16


# ---------------------------------------------------------------------------------------------
# building blocks: written for chapter 2's kernel (head_dim 128, plain layouts), with the
# parameters chapters 4 and 5 need (head sizes, blocked layouts, per-token weights, merge tables)


class Pages:
    """Where this lane's K and V bytes are: page ids of a tile, and the K and V words a lane loads
    from a page of one (sequence, KV head).

    Wave ``wave`` owns tokens ``64·wave ..`` of every 256-token tile: 4 pages (block 16), 2 (block
    32), one (block 64) or half of one (block 128: the span starts ``64·(wave % 2)`` tokens into
    page ``2·tile + wave // 2``). Lane ``(col, grp)`` loads, for token chunk ``a``, 16 bytes of
    the K row of wave-token ``16·(col // 4) + 4a + col % 4`` at channels ``16·(grp + 4h)``, and
    for each d-chunk ``j`` the 16 V bytes of channel ``16j + col``, tokens ``16·grp ..``
    (chapter 2). ``k_blocked``: K pages ``[head_dim//16, block, 16]`` instead of ``[block,
    head_dim]``; ``v_trans``: V pages ``[block//16, head_dim, 16]`` instead of ``[head_dim, block]``
    (chapter 4).
    """

    def __init__(self, bt_rs, k_rs, v_rs, bt_row, last_page, kvh, num_kv_heads, wave, col, grp, *,
                 block_size, head_dim=HEAD_DIM, k_blocked=False, v_trans=False):
        if block_size not in (16, 32, 64, 128):
            raise ValueError(f"block_size: expected 16, 32, 64 or 128, got {block_size}")
        self.bt_rs, self.k_rs, self.v_rs = bt_rs, k_rs, v_rs
        self.bt_row, self.last_page = bt_row, last_page
        self.kvh, self.num_kv_heads = kvh, num_kv_heads
        self.wave, self.col, self.grp = wave, col, grp
        self.bs, self.nh, self.nch = block_size, head_dim // 64, head_dim // 16
        # pages per wave span: 4, 2, 1 (block 16, 32, 64); block 128 holds two spans a page (0)
        self.pps = SPAN // block_size
        self.page_bytes = block_size * head_dim
        self.v_trans, self.head_dim = v_trans, head_dim
        bs = block_size
        # bytes between the K rows of consecutive slots, and between 16-channel chunks of a row
        self.k_row, self.k_chunk = (16, bs * 16) if k_blocked else (head_dim, 16)
        v_chunk = 16 * (16 if v_trans or bs == 16 else bs)  # bytes between d-chunks of a V page
        if bs in (16, 64):
            # the lane's first K slot on its page
            slot = col % 4 if self.pps > 1 else (col // 4) * 16 + col % 4
            self.k_lane = slot * self.k_row + grp * self.k_chunk
            if self.pps > 1:
                # page grp of the span (trans-blocked and plain agree for block 16)
                self.v_lane = col * 16
            else:
                self.v_lane = grp * (head_dim * 16) + col * 16 if v_trans else col * bs + grp * 16
            self.k_j = col // 4 if self.pps > 1 else 0  # which page of the span holds the K, V
            self.v_j = grp if self.pps > 1 else 0
        else:
            self._pages_32_128(col, grp)
        cpw = self.nch // WAVES
        # register slot j holds d-chunk (j + cpw·wave) mod nch: the merge then moves fixed slots
        self.chunk_off = [((j + cpw * wave) % self.nch) * v_chunk
                          for j in range_constexpr(self.nch)]

    def v_tokens_at(self, t):
        """Byte offset, in a V page, of the 16 tokens ``t ..`` (``t`` a multiple of 16) of
        channel 0: a 16-token group of the trans-blocked page, or a row stretch of the plain
        one."""
        return (t // 16) * (self.head_dim * 16) if self.v_trans else t

    def _pages_32_128(self, col, grp):
        """``k_lane``, ``v_lane``, ``k_j``, ``v_j`` of blocks 32 and 128 (16 and 64 keep chapter
        2's expressions, so their machine code is unchanged). The lane's K tokens ``16·(col //
        4) + col % 4 + 4a`` and V tokens ``16·grp ..`` of its span fall on page ``tok // bs`` of
        the span, at ``tok % bs``; with block 128 the span itself starts ``span_start`` tokens
        into the page."""
        bs = self.bs
        v_ch = 16 if self.v_trans else bs  # bytes between the V rows of consecutive channels
        if bs == 32:
            k_slot = ((col // 4) % 2) * 16 + col % 4
            v_tok = (grp % 2) * 16
            self.k_j, self.v_j = col // 8, grp // 2
        else:
            k_slot = (col // 4) * 16 + col % 4 + self.span_start()
            v_tok = grp * 16 + self.span_start()
            self.k_j = self.v_j = 0
        self.k_lane = k_slot * self.k_row + grp * self.k_chunk
        self.v_lane = self.v_tokens_at(v_tok) + col * v_ch
        # block 128: the lane's V offset in a span that starts on the page (the head_dim split
        # adds each span's start itself)
        self.v_lane0 = self.v_tokens_at(grp * 16) + col * v_ch if bs == 128 else self.v_lane

    def span_start(self, sp=None):
        """Block 128: the first token, in its page, of span ``sp`` (default: this wave's); 0 for
        the smaller blocks, whose spans start on a page."""
        if self.pps > 0:
            return 0
        return ((self.wave if sp is None else sp) % 2) * SPAN

    def span_page(self, sp):
        """Index in the tile of the first page of span ``sp``."""
        return sp * self.pps if self.pps > 0 else sp // (self.bs // SPAN)

    def page_id(self, tile, j):
        """Page id of page ``j`` of this wave's span in ``tile``, clamped to the sequence's last
        page: past the context a wave re-reads that page (its tokens are masked later)."""
        idx = imin(tile * (TILE // self.bs) + self.span_page(self.wave) + j, self.last_page)
        return buffer_load(self.bt_rs, (self.bt_row + idx) * 4, 1)

    def slab(self, page):
        """Byte offset of (page, KV head) in a K or V cache."""
        return (page * self.num_kv_heads + self.kvh) * self.page_bytes

    def k(self, page):
        """The lane's K words: ``4·nh`` dwordx4 from one address register, immediate offsets apart;
        word ``(nh·a + h)·4 + w`` is chunk ``a``, channel half ``h``."""
        voff = self.slab(page) + self.k_lane
        words = []
        for a in range_constexpr(4):
            for h in range_constexpr(self.nh):
                v = buffer_load(self.k_rs, voff, 4,
                                offset=a * 4 * self.k_row + h * 4 * self.k_chunk)
                words.extend([v[i] for i in range_constexpr(4)])
        return fx.Vector.from_elements(words, dtype=fx.Int32)

    def v(self, page):
        """The lane's V words: one dwordx4 per d-chunk slot, the slot's chunk offset in an SGPR."""
        voff = self.slab(page) + self.v_lane
        words = []
        for j in range_constexpr(self.nch):
            v = buffer_load(self.v_rs, voff, 4, soffset=self.chunk_off[j])
            words.extend([v[k] for k in range_constexpr(4)])
        return fx.Vector.from_elements(words, dtype=fx.Int32)


def query_operands(q_rs, row_elem, valid, fp8_max, grp, halves=2, dtype=fx.Float16):
    """Load, quantize and pack this lane's share of one query row as the B operands of Q·Kᵀ.

    Returns ``(ops, q_scale)``: ``ops[2h + half]`` holds channels ``16(grp + 4h) + 8·half .. +8``
    of the row starting at element ``row_elem`` (``halves`` = head_dim // 64; 16-bit values of
    ``dtype``) as fp8 codes, zeros where ``valid`` is false (padding rows).
    """
    vals = []
    for h in range_constexpr(halves):
        for half in range_constexpr(2):
            v = buffer_load(q_rs, (row_elem + 16 * (grp + 4 * h)) * 2, 4, offset=16 * half)
            vals.append(v.bitcast(dtype).to(fx.Float32))
    return quantize_query(vals, valid, fp8_max)


def quantize_query(vals, valid, fp8_max):
    """This lane's query values (f32 vectors of 8) -> ``(ops, q_scale)``: fp8 codes scaled so the
    row's largest magnitude lands on ``fp8_max`` (the row's four lanes agree on it with two
    ``xor_lanes`` steps), packed as i64 MFMA operands; zeros where ``valid`` is false."""
    amax = fx.Float32(1e-20)  # an all-zero row gets a tiny positive scale, never 0 or inf
    for v in vals:
        for i in range_constexpr(8):
            amax = fmax(amax, fx.Float32(fx.absf(v[i])))
    amax = row_reduce(amax, fmax)
    inv = fx.Float32(select(valid, rcp(amax) * fp8_max, fx.Float32(0.0)))
    ops = []
    for v in vals:
        s = v * inv
        ops.append(i64(pack_fp8(s[0], s[1], s[2], s[3]), pack_fp8(s[4], s[5], s[6], s[7])))
    return ops, amax * (1.0 / fp8_max)


def scores(k_words, q_ops, halves=2):
    """Q·Kᵀ turned around: the lane's 16 raw scores, ``s[4a + i]`` = wave-token
    ``16·grp + 4a + i``
    of its query row (K words as ``Pages.k`` loads them; ``halves`` = head_dim // 64)."""
    s = []
    for a in range_constexpr(4):
        acc = fx.Vector.filled(4, 0.0, fx.Float32)
        for h in range_constexpr(halves):
            for half in range_constexpr(2):
                w0 = (a * halves + h) * 4 + 2 * half
                acc = mfma(i64(k_words[w0], k_words[w0 + 1]), q_ops[2 * h + half], acc)
        s.extend([fx.Float32(acc[i]) for i in range_constexpr(4)])
    return s


def zero_tail_v(v_words, n_valid):
    """V bytes of lane-tokens >= ``n_valid`` -> 0: a page's unused slots may hold NaN codes, and
    0·NaN is NaN inside the MFMA. ``v_words[4j + k]`` holds tokens ``4k .. 4k+3`` of d-chunk
    ``j``."""
    masks = []
    for k in range_constexpr(4):
        keep = imax(imin(n_valid - 4 * k, 4), 0)  # bytes of dword k to keep: 0..4
        partial = (fx.Int32(1) << (keep * 8 % 32)) - 1
        masks.append(fx.Int32(select(keep > 3, fx.Int32(-1), partial)))
    n = v_words.numel
    kept = [fx.Int32(v_words[i]) & masks[i % 4] for i in range_constexpr(n)]
    return fx.Vector.from_elements(kept, dtype=fx.Int32)


def mask_tail(s, v_words, n_valid):
    """Last tile only: scores of tokens at or past the context -> -inf, their V bytes -> 0.

    ``s[4a + i]`` is wave-token ``16g + 4a + i``; ``n_valid`` = tokens of the lane's 16 inside.
    """
    ninf = fx.Float32(float("-inf"))
    s = fx.Vector.from_elements(
        [fx.Float32(select(n_valid > i, fx.Float32(s[i]), ninf)) for i in range_constexpr(16)],
                                dtype=fx.Float32
    )
    return s, zero_tail_v(v_words, n_valid)


def tree_sum(xs):
    """Pairwise sum: log2(n) dependent adds instead of n."""
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] for i in range(0, len(xs), 2)]
    return xs[0]


def exp_shift(m_new, log2_fp8_max):
    """What P's exponent subtracts, ``p = 2^(s·c - shift)``: ``m_new - log2 FP8_MAX`` (the largest
    P lands on FP8_MAX, the format's whole range spent on P) and a margin of ``|m_new|·2^-21``.

    Why a margin: the row max is rounded once (max(s)·c) and so is ``m_new - log2 FP8_MAX``,
    while each exponent s·c - shift is one fma; without the margin the top P is FP8_MAX·2^δ,
    δ up to half an ulp of |m_new| plus the error of rounding m_new - log2 FP8_MAX to that ulp.
    The conversion (v_cvt_pk_fp8_f32, overflow judged after rounding to nearest even, as
    pa_tile.emu.numerics models it) keeps anything below FP8_MAX + half its ulp (248 FNUZ, 464
    OCP) finite, so the top P turns NaN only when 2^δ >= 31/30 (FNUZ; 29/28 OCP): from |m_new|
    >= 2^19 (~5.2e5, an ulp of 2^-4) on FNUZ and 2^21 (~2.1e6) on OCP, not at ordinary scores
    (|m_new| ~ 1e4 gives δ <= 0.0015). Such a row max needs extreme scores (fp8 Q·K at
    head_dim 128 with unit scales reaches ~1e6); there the margin, |m_new|·2^-21 >= 2 ulps of
    |m_new|, keeps the top P at or under FP8_MAX (tests/test_exp_shift_margin.py checks all three).
    Its cost: one fma per row and tile, and P loses a factor 2^-(|m_new|·2^-21), common to the
    row's P of the tile and cancelled by the normalization up to that factor's change from tile
    to tile, a relative 2^-21·|Δm|."""
    return m_new - log2_fp8_max + fx.Float32(fx.absf(m_new)) * (2.0 ** -21)


def softmax_step(s, m_old, l_old, c_qk, log2_fp8_max, p_weight=None):
    """One tile of the online softmax for this lane's 16 raw scores ``s``.

    Returns ``(p_ops, corr, m_new, l_new)``: ``p_ops`` are the two P·V B operands (8 fp8
    codes each, tokens ``16g .. 16g+7`` and ``16g+8 .. 16g+15``). ``p_weight`` (16 per-token
    factors in [0, 1], chapter 4) scales P after the sum and before the fp8 rounding.
    """
    m_new = fmax(m_old, row_max(s, c_qk))
    corr = exp2(m_old - m_new)
    shift = exp_shift(m_new, log2_fp8_max)
    p = [exp2(fx.Float32(s[i]) * c_qk - shift) for i in range_constexpr(16)]
    l_new = l_old * corr + tree_sum(p)
    if const_expr(p_weight is not None):
        p = [p[i] * fx.Float32(p_weight[i]) for i in range_constexpr(16)]
    words = [pack_fp8(p[4 * a], p[4 * a + 1], p[4 * a + 2],
                      p[4 * a + 3]) for a in range_constexpr(4)]
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


def exchange(xchg, o, wave, lane, slots, more_after=False):
    """The four-wave sum of ``o`` (this wave's d-chunk accumulators, slot ``j`` = d-chunk
    ``(j + cpw·wave) mod nch``), a reduce-scatter: returns the ``cpw = len(o) / WAVES`` chunks this
    wave keeps. In round ``r`` a wave writes the slots wave ``(wave + r) mod 4`` keeps and adds
    what wave ``(wave - r) mod 4`` wrote, ``slots`` at a time: ``WAVES·WAVE·16·slots`` bytes of
    LDS at ``xchg``. ``more_after``: another exchange follows (keep the final barrier)."""
    cpw = len(o) // WAVES
    o = list(o)
    for rnd in range_constexpr(1, WAVES):
        src = (wave + (WAVES - rnd)) % WAVES
        for b in range_constexpr(0, cpw, slots):
            for s in range_constexpr(b, b + slots):
                lds_store(xchg, ((wave * slots + s - b) * WAVE + lane) * 16, o[cpw * rnd + s])
            gpu.barrier()
            for s in range_constexpr(b, b + slots):
                o[s] = o[s] + lds_load(xchg, ((src * slots + s - b) * WAVE + lane) * 16, 4)
            if const_expr(rnd < WAVES - 1 or b + slots < cpw or more_after):
                gpu.barrier()  # the next round overwrites the slots just read
    return o[:cpw]


def merge_waves(o, m_w, l_w, v_scale, lds, wave, lane, col, stride=WAVES):
    """Combine the four waves' (max, sum, O); returns this wave's ``len(o) / WAVES`` d-chunks
    (``(j + cpw·wave) mod nch``), normalized. ``lds.stats``: the (max, sum) table, head rows
    ``stride`` words apart (chapter 4 pads them); ``lds.xchg``: the exchange's slots."""
    stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
    l_w = row_reduce(l_w, operator.add)
    # stats: [max | sum][head][wave]; the 4 lanes of a head write the same value to the same word
    lds_store(stats, (col * stride + wave) * 4, fx.Vector.from_elements([m_w], dtype=fx.Float32))
    lds_store(stats, ((16 + col) * stride + wave) * 4, fx.Vector.from_elements([l_w],
                                                                               dtype=fx.Float32))
    gpu.barrier()
    if const_expr(stride % 4 == 0):
        m4 = lds_load(stats, col * stride * 4, WAVES)
        l4 = lds_load(stats, (16 + col) * stride * 4, WAVES)
        m4 = [fx.Float32(m4[w]) for w in range(WAVES)]
        l4 = [fx.Float32(l4[w]) for w in range(WAVES)]
    else:  # rows are not 16-byte aligned: four 4-byte reads each
        m4 = [fx.Float32(lds_load(stats, (col * stride + w) * 4, 1)[0]) for w in range(WAVES)]
        l4 = [fx.Float32(lds_load(stats, ((16 + col) * stride + w) * 4,
                                  1)[0]) for w in range(WAVES)]
    m = max4(m4)
    total = fx.Float32(0.0)
    for w in range_constexpr(WAVES):
        total = total + l4[w] * exp2(m4[w] - m)
    o = [x * splat4(exp2(m_w - m) * v_scale * rcp(total)) for x in o]
    return exchange(fx.recast_iter(fx.Uint8, lds.xchg.ptr), o, wave, lane, len(o) // WAVES)


def store_chunks(o_rs, chunks, row_byte, wave, grp, dtype=fx.Float16):
    """Store this wave's d-chunks of one output row (at byte ``row_byte``), as ``merge_waves``
    returns them: chunk ``s`` is d-chunk ``len(chunks)·wave + s``, and lane ``(col, grp)`` writes
    its channels ``4·grp .. 4·grp+3`` (four 16-bit values of ``dtype``: two dwords)."""
    per = len(chunks)
    for s in range_constexpr(per):
        buffer_store(chunks[s].to(dtype).bitcast(fx.Int32), o_rs,
                     row_byte + ((per * wave + s) * 16 + grp * 4) * 2)


# ---------------------------------------------------------------------------------------------
# the launch


def device_code(fn):
    """``fn`` with FlyDSL's kernel-body rewrite applied: its ``if`` on a device value becomes a
    branch in the kernel (``scf.if``), as it would written inline in the kernel. Only a kernel's
    own body gets that rewrite; a helper called from it otherwise sees a device value where Python
    wants a bool. (FlyDSL's ``ASTRewriter.transform`` is what ``@flyc.kernel`` itself applies.)"""
    from flydsl.compiler.ast_rewriter import ASTRewriter

    return ASTRewriter.transform(fn)


def jit_launcher(body, grid_yz=None, contract=True):
    """The ``@flyc.jit`` launcher of kernel function ``body`` (one workgroup of ``WAVES`` waves per
    grid point). It takes ``body``'s arguments, with ``out`` first when ``body`` has one, plus
    ``num_seqs: fx.Int32`` (grid x) before ``num_kv_heads`` and a trailing ``stream``;
    ``grid_yz(args)`` gives grid y and z from the arguments by name (default: one per KV head).
    ``contract`` lets the compiler fuse a multiply and an add into one f32 fma."""
    kernel = flyc.kernel(known_block_size=(WAVES * WAVE, 1, 1))(body)
    kparams = list(inspect.signature(body).parameters.values())
    names = [p.name for p in kparams]
    seqs = inspect.Parameter("num_seqs", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             annotation=fx.Int32)
    # stable: the rest keep the kernel's order
    params = sorted(kparams, key=lambda p: p.name != "out")
    params.insert(next(i for i, p in enumerate(params) if p.name == "num_kv_heads"), seqs)
    stream = inspect.Parameter("stream", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               default=fx.Stream(None),
                               annotation=fx.Stream)
    grid_yz = grid_yz or (lambda a: (a["num_kv_heads"], 1))
    hints = {"fastmath": arith.FastMathFlags.contract} if contract else {}

    def launch(**a):
        with CompilationContext.compile_hints(hints):
            kernel(*[a[n] for n in names]).launch(grid=(a["num_seqs"],) + tuple(grid_yz(a)),
                                                  block=(WAVES * WAVE, 1, 1), stream=a["stream"])

    launch.__signature__ = inspect.Signature(params + [stream])
    return flyc.jit(launch)


# ---------------------------------------------------------------------------------------------
# the host-side model of the building blocks' roundings


def model_operands(query_rows, kc, vc, block_row, n, fp8_max, fp8_dtype):
    """One sequence's operands as the kernel sees them, for the torch models: ``(q8, q_scale, k,
    v, pages)``: the query rows ``[kvh, group, d]`` quantized to fp8 per row by their amax, the
    float32 dequantization scale ``amax · f32(1/FP8_MAX)`` (the kernel's order), K and V of the
    sequence's first ``n`` tokens ``[kvh, n, d]`` from decoded caches ``[blocks, kvh, block, d]``,
    and the page ids read."""
    kvh, bs, d = kc.shape[1], kc.shape[2], kc.shape[3]
    pages = block_row[: -(-n // bs)].long()
    k = kc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :n]
    v = vc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :n]
    amax = query_rows.abs().amax(-1, keepdim=True).clamp_min(1e-20)
    q8 = (query_rows * (fp8_max / amax)).to(fp8_dtype).float()
    return q8, amax * torch.tensor(1.0 / fp8_max, dtype=torch.float32), k, v, pages


def softmax_model(s, c, v, fp8_max, fp8_dtype, p_weight=None):
    """float32 torch model of ``softmax_step``, ``pv_step`` and ``merge_waves`` (before the V
    scale) for one sequence: each wave's online softmax over its 64 tokens of every tile, P
    rounded to fp8 after ``exp_shift`` (margin included) and the optional per-token weights,
    the sum over unrounded P, the four-wave merge. ``s`` [kvh, group, n]: the raw float32 scores
    the kernel holds; ``c`` [kvh, group, 1]: its float32 ``c_qk``; ``v`` [kvh, n, head_dim]: V
    codes as floats; ``p_weight`` broadcastable to ``s``. Returns [kvh, group, head_dim] float32.

    The roundings are the kernel's: the row max is ``max(s)·c`` rounded once; each exponent
    ``s·c - shift`` is one fma (one rounding, here in float64: the product of two floats is
    exact there), not ``s·c`` rounded and then shifted. The difference is up to an ulp of the
    row max, which at |m| ~ 10 is enough to flip the fp8 code of a heavy token's P now and then."""
    kvh, group, n = s.shape
    # as the kernel's f32 constant
    log2_fmax = torch.tensor(math.log2(fp8_max), dtype=torch.float32)
    m = torch.full((kvh, group, WAVES), MASKED)
    l = torch.zeros(kvh, group, WAVES)
    o = torch.zeros(kvh, group, WAVES, v.shape[-1])
    for t0 in range(0, n, TILE):
        for w in range(WAVES):
            lo, hi = t0 + w * SPAN, min(t0 + (w + 1) * SPAN, n)
            if hi <= lo:
                continue
            sw = s[..., lo:hi]
            m_new = torch.maximum(m[..., w], sw.amax(-1) * c[..., 0])
            corr = torch.exp2(m[..., w] - m_new)
            # exp_shift, in its float32 order: (m - log2 FP8_MAX) + |m|·2^-21 (an exact product)
            shift = (m_new - log2_fmax) + m_new.abs() * 2.0 ** -21
            p = torch.exp2((sw.double() * c.double() - shift.double()[..., None]).float())
            l[..., w] = l[..., w] * corr + p.sum(-1)
            if p_weight is not None:
                p = p * p_weight[..., lo:hi]
            o[..., w, :] = o[..., w, :] * corr[..., None] + p.to(fp8_dtype).float() @ v[:, lo:hi]
            m[..., w] = m_new
    f = torch.exp2(m - m.amax(-1, keepdim=True))
    return (o * f[..., None]).sum(2) / (l * f).sum(-1)[..., None]
