# GENERATED from notebooks/01_tile_qk.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 1: fp8 paged-attention decode written with FlyDSL's tile/layout API.

One workgroup of 4 waves per (sequence, kv head) walks the context in 256-token tiles with an
online softmax. Per tile: ``S = Q·Kᵀ`` on a tiled fp8 MFMA (the waves split the tokens), K
gathered page by page through the block table; scores staged in LDS for a row-wise softmax;
fp8 probabilities ``P`` through LDS; ``O = O·corr + P·V`` (the waves split head-dim).

Layouts (see ``pa_tile.cache``): query ``[num_seqs, num_q_heads, 128]`` f16; K cache
``[num_blocks, num_kv_heads, block_size, 128]``; V cache ``[num_blocks, num_kv_heads, 128,
block_size]``; fp8 e4m3 codes (``float8_e4m3fnuz`` on gfx942, ``float8_e4m3fn`` on gfx950, or
uint8); per-tensor float32 scales ``[1]``; ``block_size`` 16 or 64; 8 or 16 query heads per kv head.
"""

import functools
import math

import torch

import flydsl.expr as fx
from flydsl.expr import range_constexpr
from flydsl.expr.typing import ReductionOp, T

from pa_tile import launching, problem
from pa_tile.arch import fp8_format, fp8_max
from pa_tile.kernel_lib import jit_launcher

__all__ = [
    "paged_decode",
    "launch_args",
    "build_launcher",
    "HEAD_DIM",
    "TILE_TOKENS",
    "FX_FP8",
    "LIMITS",
]


HEAD_DIM = 128  # channels per head (the only head size stage 1 supports)
TILE_TOKENS = 256  # tokens per trip of the main loop
NUM_WAVES = 4  # waves per workgroup
WAVE_SIZE = 64  # lanes per wave on CDNA
MMA_ROWS = 16  # query rows per workgroup: the MFMA's M (a GQA group of 8 is padded to 16)
ROW_THREADS = 16  # threads sharing one query row in the row-wise phases (16 rows x 16 = 256)
LOG2E = 1.4426950408889634
#: what stage 1 supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s1", head_dims=(HEAD_DIM,), block_sizes=(16, 64), groups=(8, 16))

# FlyDSL's element type for each fp8 flavour (which flavour an arch reads: pa_tile.arch)
FX_FP8 = {"fnuz": fx.Float8E4M3FNUZ, "ocp": fx.Float8E4M3FN}


def make_tiled_mma(fp8):
    """The fp8 16x16x32 MFMA repeated over the 4 waves along N: a (16, 64, 32) tile per step.

    Q·Kᵀ: N is tokens, so each wave owns 16 of every 64 tokens. P·V: N is channels, so each
    wave owns 16 of every 64 channels. Both contract over K in steps of 32.
    """
    atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 32, fp8))
    return fx.make_tiled_mma(atom, fx.make_layout((1, NUM_WAVES, 1), (0, 1, 0)))


def counting(layout):
    """A tensor with no memory behind it: its element at a coordinate is ``layout(coordinate)``."""
    return fx.make_view(fx.make_int_tuple(0), layout)


def k_virtual_layout(block_size):
    """(token, channel) of a K tile -> offset, as if the tile's pages were stored back to back."""
    page = block_size * HEAD_DIM
    pages = TILE_TOKENS // block_size
    return fx.make_layout(((block_size, pages), HEAD_DIM), ((HEAD_DIM, page), 1))


def v_virtual_layout(block_size):
    """(channel, token) of a V tile -> offset, its pages ([HEAD_DIM, block_size]) back to back."""
    page = block_size * HEAD_DIM
    pages = TILE_TOKENS // block_size
    return fx.make_layout((HEAD_DIM, (block_size, pages)), (block_size, (1, page)))


def physical_offsets(virtual, tile, block_table_row, last_page, num_kv_heads, kv_head, block_size):
    """Translate virtual tile offsets into cache offsets (in fp8 elements) through the block table.

    ``virtual`` holds the virtual offset of the first element of each piece this thread loads.
    A sequence's pages past ``last_page`` are clamped to it, so no stray block-table entry is
    ever read; the tokens they bring in are masked by the caller.
    """
    page = block_size * HEAD_DIM
    pages_per_tile = TILE_TOKENS // block_size
    v = virtual.load()
    offsets = []
    for i in range_constexpr(v.numel):
        logical_page = fx.min(tile * pages_per_tile + v[i] // page, last_page)
        physical_page = fx.Int32(block_table_row[logical_page])
        offsets.append((physical_page * num_kv_heads + kv_head) * page + v[i] % page)
    frag = fx.make_fragment_like(virtual, fx.Int32)
    frag.store(fx.Vector.from_elements(offsets, dtype=fx.Int32))
    return frag


def row_split_copy(atom, rows, values_per_thread):
    """A tiled copy where thread ``t`` owns row ``t // 16``, elements ``(t % 16) * v ... + v``."""
    return fx.make_tiled_copy_tv(
        atom,
        fx.make_ordered_layout((rows, ROW_THREADS), order=(1, 0)),
        fx.make_ordered_layout((1, values_per_thread), order=(1, 0)),
    )


def row_allreduce(x, combine):
    """Combine a value over the 16 adjacent lanes that share a query row (xor butterfly)."""
    for step in (8, 4, 2, 1):
        x = combine(x, x.shuffle_xor(step, WAVE_SIZE))
    return x


def to_fp8(values, fp8):
    """f32 vector (length a multiple of 4) -> fp8 codes, round to nearest even, in hardware."""
    words = []
    for i in range_constexpr(values.numel // 4):
        lo = fx.rocdl.cvt_pk_fp8_f32(T.i32, values[4 * i], values[4 * i + 1], fx.Int32(0), False)
        words.append(fx.rocdl.cvt_pk_fp8_f32(T.i32, values[4 * i + 2], values[4 * i + 3], lo, True))
    return fx.Vector.from_elements(words, dtype=fx.Int32).bitcast(fp8)


def rcp(x):
    """1/x with one v_rcp_f32 (about 1 ulp), instead of an IEEE division sequence."""
    return fx.Float32(fx.rocdl.rcp(T.f32, x))


def zero_tokens_past(frag, first_token, n_valid):
    """Zero the fp8 codes of tokens >= ``n_valid`` in a V fragment made of 8-token pieces.

    ``first_token[i]`` is the first token of piece ``i``; a piece is one 64-bit word, masked
    bytewise (the last valid piece of the context may be partial).
    """
    n = first_token.numel
    keep_bytes = [fx.max(fx.min(n_valid - first_token[i], 8), 0) for i in range_constexpr(n)]
    keep_bytes = fx.Vector.from_elements(keep_bytes, dtype=fx.Int32)
    ones = fx.Vector.filled(n, 1, fx.Int64)
    mask = (keep_bytes >= 8).select(fx.Vector.filled(n, -1, fx.Int64),
                                    (ones << (keep_bytes * 8).to(fx.Int64)) - 1)
    frag.store((frag.load().bitcast(fx.Int64) & mask).bitcast(frag.element_type))


def quantize_query(query, seq, kv_head, tid, row, group_size, fp8, fp8_max_, sQ, log2_scale,
                   k_scale):
    """Part 1: this kv head's query rows to fp8 in LDS ``sQ``, one scale per row; returns the
    thread's row factor (raw score -> log2 units)."""
    q_groups = fx.zipped_divide(query[seq, None, None], (group_size, HEAD_DIM))
    q_rows = fx.slice(q_groups, (None, (kv_head, 0)))
    q_atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), fx.Float16)
    # threads past the group's rows re-read them (a valid address) and zero them below
    q_src = row_split_copy(q_atom, group_size,
                           8).get_slice(tid % (group_size * ROW_THREADS)).partition_S(q_rows)
    q_frag = fx.make_fragment_like(q_src)
    fx.copy(q_atom, q_src, q_frag)
    q = q_frag.load().to(fx.Float32)
    # rows 8-15 of a group of 8: padding
    q = (row < group_size).select(q, fx.Vector.filled_like(q, 0.0))
    q_amax = row_allreduce(fx.absf(q).reduce(ReductionOp.MAX), fx.maxnumf)
    q_codes = to_fp8(q * (fx.Float32(fp8_max_) * rcp(fx.maxnumf(q_amax, fx.Float32(1e-30)))), fp8)
    lds64 = fx.make_copy_atom(fx.UniversalCopy64b(), fp8)
    sq_dst = row_split_copy(lds64, MMA_ROWS, 8).get_slice(tid).partition_D(sQ)
    sq_frag = fx.make_fragment_like(sq_dst)
    sq_frag.store(q_codes)
    fx.copy(lds64, sq_frag, sq_dst)
    # see "where every scale goes"
    row_factor = q_amax * fx.Float32(log2_scale / fp8_max_) * k_scale
    fx.gpu.barrier()
    return row_factor


class Tiles:
    """Part 2 (loop-invariant operand copies and index tensors) and the phases of part 3."""

    def __init__(self, fp8, tid, block_size, group_size, sQ, sS, sP, block_tables, seq, kv_head,
                 context_len, out):
        chunk = TILE_TOKENS // ROW_THREADS  # scores per thread in the softmax phase
        self.tiled_mma = make_tiled_mma(fp8)
        self.thr_mma = thr_mma = self.tiled_mma.thr_slice(tid)
        # the operand copies: A (Q or P) from LDS, B (K or V) from the cache, C (scores) to LDS
        self.lds64 = fx.make_copy_atom(fx.UniversalCopy64b(), fp8)
        self.a_copy = fx.make_tiled_copy_A(self.lds64, self.tiled_mma).get_slice(tid)
        self.gather64 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), fp8)
        self.b_copy = fx.make_tiled_copy_B(self.gather64, self.tiled_mma).get_slice(tid)
        self.s32 = fx.make_copy_atom(fx.UniversalCopy32b(), fx.Float32)
        self.c_copy = fx.make_tiled_copy_C(self.s32, self.tiled_mma).get_slice(tid)
        self.q_mma = thr_mma.make_fragment_A(sQ)  # Q stays in registers for the whole loop
        fx.copy(self.lds64, self.a_copy.partition_S(sQ), self.a_copy.retile(self.q_mma))
        self.k_layout = k_virtual_layout(block_size)
        self.v_layout = v_virtual_layout(block_size)
        # one offset per 8-byte piece; token_of: V tile coordinate -> token
        self.k_virtual = self.b_copy.partition_S(counting(self.k_layout))[(0, None), None, None]
        self.v_virtual = self.b_copy.partition_S(counting(self.v_layout))[(0, None), None, None]
        token_of = counting(fx.make_layout((HEAD_DIM, TILE_TOKENS), (0, 1)))
        v_first_token = self.b_copy.partition_S(token_of)[(0, None), None, None].load()
        self.v_first_token = v_first_token.reshape(v_first_token.numel)
        self.block_table_row = block_tables[seq, None]
        self.last_page = (context_len - 1) // block_size
        self.sm_atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
        self.sm_copy = row_split_copy(self.sm_atom, MMA_ROWS, chunk).get_slice(tid)
        s_token_of = counting(fx.make_layout((MMA_ROWS, TILE_TOKENS), (0, 1)))
        self.s_token = self.sm_copy.partition_S(s_token_of).load()
        self.p_atom = fx.make_copy_atom(fx.UniversalCopy128b(), fp8)
        self.p_dst = row_split_copy(self.p_atom, MMA_ROWS, chunk).get_slice(tid).partition_D(sP)

        out_groups = fx.zipped_divide(out[seq, None, None], (group_size, HEAD_DIM))
        out_rows = fx.slice(out_groups, (None, (kv_head, 0)))
        out_layout = fx.make_layout((MMA_ROWS, HEAD_DIM), (HEAD_DIM, 1))
        self.out_tile = fx.make_view(fx.get_iter(out_rows), out_layout)
        o_row = thr_mma.partition_C(counting(fx.make_layout((MMA_ROWS, HEAD_DIM), (1, 0)))).load()
        self.o_row = o_row.reshape(o_row.numel)  # query row of each of this thread's output values
        self.sQ, self.sS, self.sP, self.block_size = sQ, sS, sP, block_size

    def offsets(self, virtual, tile, num_kv_heads, kv_head):
        return physical_offsets(virtual, tile, self.block_table_row, self.last_page, num_kv_heads,
                                kv_head, self.block_size)


def tile_scores(t, tile, key_cache, num_kv_heads, kv_head):
    """S = Q·Kᵀ for one tile, K gathered page by page straight into the B fragments; S to LDS."""
    k_mma = t.thr_mma.make_fragment_B(fx.make_view(fx.get_iter(key_cache), t.k_layout))
    k_offsets = t.offsets(t.k_virtual, tile, num_kv_heads, kv_head)
    fx.gather(t.gather64, fx.get_iter(key_cache), k_offsets, t.b_copy.retile(k_mma))
    s_mma = t.thr_mma.make_fragment_C(t.sS)
    s_mma.fill(0.0)
    fx.gemm(t.tiled_mma, s_mma, t.q_mma, k_mma, s_mma)
    fx.copy(t.s32, t.c_copy.retile(s_mma), t.c_copy.partition_D(t.sS))
    fx.gpu.barrier()


def tile_softmax(t, n_valid, row_factor, m_old, l_old, fp8, fp8_max_):
    """The online softmax, row-wise (16 threads per row, 16 scores each); P to LDS as fp8.
    Returns ``(m_new, l_new, correction)``."""
    s_src = t.sm_copy.partition_S(t.sS)
    s_frag = fx.make_fragment_like(s_src)
    fx.copy(t.sm_atom, s_src, s_frag)
    s = s_frag.load()
    x = (t.s_token < n_valid).select(s * row_factor, fx.Vector.filled_like(s, float("-inf")))
    m_new = fx.maxnumf(m_old, row_allreduce(x.reduce(ReductionOp.MAX), fx.maxnumf))
    p = fx.math.exp2(x - m_new)
    correction = fx.math.exp2(m_old - m_new)
    l_new = l_old * correction + row_allreduce(p.reduce(ReductionOp.ADD), lambda a, b: a + b)
    p_frag = fx.make_fragment_like(t.p_dst)
    p_frag.store(to_fp8(p * fx.Float32(fp8_max_), fp8))  # p in [0, 1] -> [0, FP8_MAX]
    fx.copy(t.p_atom, p_frag, t.p_dst)
    return m_new, l_new, correction


def tile_pv(t, tile, value_cache, num_kv_heads, kv_head, n_valid, o_old, sRow):
    """O = O * correction + P·V, with every wave reading all of P back from LDS."""
    p_mma = t.thr_mma.make_fragment_A(t.sP)
    fx.copy(t.lds64, t.a_copy.partition_S(t.sP), t.a_copy.retile(p_mma))
    v_mma = t.thr_mma.make_fragment_B(fx.make_view(fx.get_iter(value_cache), t.v_layout))
    v_frag = t.b_copy.retile(v_mma)
    v_offsets = t.offsets(t.v_virtual, tile, num_kv_heads, kv_head)
    fx.gather(t.gather64, fx.get_iter(value_cache), v_offsets, v_frag)
    zero_tokens_past(v_frag, t.v_first_token, n_valid)
    pv = fx.make_fragment_like(t.thr_mma.partition_C(t.out_tile), fx.Float32)
    pv.fill(0.0)
    fx.gemm(t.tiled_mma, pv, p_mma, v_mma, pv)
    o_row = t.o_row
    row_correction = fx.Vector.from_elements(
        [fx.Float32(sRow[o_row[i]]) for i in range_constexpr(o_row.numel)], dtype=fx.Float32
    )
    return o_old * row_correction + pv.load().reshape(o_row.numel)


def normalized_output(t, final, sRow, v_scale, fp8_max_, tid):
    """O / l, with P's FP8_MAX and V's scale folded back in.

    Returns ``(copy atom, src, dst)`` of the f16 store."""
    o_row = t.o_row
    inv_l = fx.Vector.from_elements([rcp(sRow[o_row[i]]) for i in range_constexpr(o_row.numel)],
                                    dtype=fx.Float32)
    o = fx.Vector(final[2]) * inv_l * (v_scale * fx.Float32(1.0 / fp8_max_))
    o_out = fx.make_fragment_like(t.thr_mma.partition_C(t.out_tile))
    o_out.store(o.to(fx.Float16))
    store16 = fx.make_copy_atom(fx.rocdl.BufferCopy16b(), fx.Float16)
    o_copy = fx.make_tiled_copy_C(store16, t.tiled_mma).get_slice(tid)
    return store16, o_copy.retile(o_out), o_copy.partition_D(t.out_tile)


def shared_storage(fp8):
    """The workgroup's LDS as a FlyDSL struct (``fp8``: the arch's fp8 element type)."""

    @fx.struct
    class SharedStorage:
        q: fx.Array[fp8, MMA_ROWS * HEAD_DIM, 16]  # quantized query rows
        s: fx.Array[fx.Float32, MMA_ROWS * TILE_TOKENS, 16]  # raw scores of one tile
        p: fx.Array[fp8, MMA_ROWS * TILE_TOKENS, 16]  # quantized probabilities of one tile
        row: fx.Array[fx.Float32, MMA_ROWS, 16]  # per-row scalar handed from softmax to P·V

    return SharedStorage


def lds_views(lds):
    """``(sQ, sS, sP, sRow)``: an allocated ``shared_storage``'s arrays, as row-major tensors."""
    sQ = lds.q.view(fx.make_layout((MMA_ROWS, HEAD_DIM), (HEAD_DIM, 1)))
    sS = lds.s.view(fx.make_layout((MMA_ROWS, TILE_TOKENS), (TILE_TOKENS, 1)))
    sP = lds.p.view(fx.make_layout((MMA_ROWS, TILE_TOKENS), (TILE_TOKENS, 1)))
    sRow = lds.row.view(fx.make_layout(MMA_ROWS, 1))
    return sQ, sS, sP, sRow


@functools.lru_cache(maxsize=None)
def build_launcher(arch, block_size, group_size, softmax_scale):
    """The stage-1 ``@flyc.jit`` launcher for one configuration (all four are compile-time)."""
    fp8, fp8_max_ = FX_FP8[fp8_format(arch)], fp8_max(arch)
    SharedStorage = shared_storage(fp8)
    def paged_decode_kernel(query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                            block_tables: fx.Tensor, context_lengths: fx.Tensor,
                            key_scale: fx.Tensor, value_scale: fx.Tensor, out: fx.Tensor,
                            num_kv_heads: fx.Int32):
        tid, seq, kv_head = fx.thread_idx.x, fx.block_idx.x, fx.block_idx.y
        row, part = tid // ROW_THREADS, tid % ROW_THREADS  # row-wise phases: row, its sixteenth
        tensors = (query, key_cache, value_cache, block_tables, out)
        query, key_cache, value_cache, block_tables, out = map(fx.rocdl.make_buffer_tensor, tensors)
        context_len = fx.Int32(context_lengths[seq])
        k_scale, v_scale = fx.Float32(key_scale[0]), fx.Float32(value_scale[0])
        sQ, sS, sP, sRow = lds_views(fx.SharedAllocator().allocate(SharedStorage).peek())
        row_factor = quantize_query(query, seq, kv_head, tid, row, group_size, fp8, fp8_max_, sQ,
                                    softmax_scale * LOG2E, k_scale)
        t = Tiles(fp8, tid, block_size, group_size, sQ, sS, sP, block_tables, seq, kv_head,
                  context_len, out)
        num_tiles = (context_len + TILE_TOKENS - 1) // TILE_TOKENS
        o_zero = fx.Vector.filled(t.o_row.numel, 0.0, fx.Float32)
        init = [fx.Float32(float("-inf")), fx.Float32(0.0), o_zero]
        for tile, state in range(fx.Int32(0), num_tiles, fx.Int32(1), init=init):
            tile = fx.Int32(tile)
            n_valid = context_len - tile * TILE_TOKENS  # tokens of this tile inside the context
            tile_scores(t, tile, key_cache, num_kv_heads, kv_head)
            m_new, l_new, correction = tile_softmax(t, n_valid, row_factor, fx.Float32(state[0]),
                                                    fx.Float32(state[1]), fp8, fp8_max_)
            if part == 0:
                fx.memref_store(correction, sRow, row)
            fx.gpu.barrier()
            o_new = tile_pv(t, tile, value_cache, num_kv_heads, kv_head, n_valid,
                            fx.Vector(state[2]), sRow)
            fx.gpu.barrier()
            final = yield [m_new, l_new, o_new]
        if part == 0:
            fx.memref_store(fx.Float32(final[1]), sRow, row)
        fx.gpu.barrier()
        store16, o_src, o_dst = normalized_output(t, final, sRow, v_scale, fp8_max_, tid)
        if t.o_row[0] < group_size:  # a thread's 4 rows are all real or all padding
            fx.copy(store16, o_src, o_dst)

    # launch(out, query, ..., value_scale, num_seqs, num_kv_heads, stream); no fma contraction
    return jit_launcher(paged_decode_kernel, contract=False)


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *,
                softmax_scale=None, out=None, arch=None):
    """``(launcher, args, arch)`` after validation, with nothing compiled or launched:
    ``launcher(*args)`` (inside ``pa_tile.toolchain.target_arch(arch)``) runs the kernel and
    fills ``args[0]``, the output; ``pa_tile.toolchain.compile_isa(launcher, *args,
    arch=arch)`` shows its assembly. Same arguments as ``paged_decode``."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    fp8 = torch.float8_e4m3fnuz if fp8_format(p.arch) == "fnuz" else torch.float8_e4m3fn
    args = (problem.output(p, query, out), query.contiguous(),
            key_cache.view(torch.uint8).view(fp8),
            value_cache.view(torch.uint8).view(fp8), block_tables, context_lengths, ks, vs,
            p.num_seqs, p.num_kv_heads)
    return build_launcher(p.arch, p.block_size, p.group, p.softmax_scale), args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *,
                 softmax_scale=None, out=None, arch=None):
    """fp8 paged decode attention (stage 1); returns ``out`` ``[num_seqs, num_q_heads, 128]`` f16.

    ``key_cache`` ``[num_blocks, num_kv_heads, block_size, 128]`` and ``value_cache``
    ``[num_blocks, num_kv_heads, 128, block_size]`` hold fp8 e4m3 codes of ``arch`` (FNUZ on
    gfx942, OCP on gfx950; uint8 accepted); values are ``code * key_scale`` / ``code *
    value_scale`` (float32 [1] or floats, > 0). ``block_tables`` ``[num_seqs, max_blocks]`` int32,
    ``context_lengths`` ``[num_seqs]`` int32 (>= 1). ``softmax_scale`` defaults to 1/sqrt(128);
    ``arch`` to the tensors' device (the emulator's for CPU tensors).
    Validation: ``pa_tile.problem``.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables,
                                       context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch)
    launching.launch(launcher, args, arch=arch)
    return args[0]
