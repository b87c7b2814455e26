# GENERATED from notebooks/04_blocked_layouts.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 4: blocked K/V cache layouts, a conflict-free merge, and the widened scope.

Stage 3's pipelined kernel reading K blocked ``[num_blocks, kv_heads, head_dim//16, block_size, 16]``
and V trans-blocked ``[num_blocks, kv_heads, block_size//16, head_dim, 16]`` (or V plain
``[num_blocks, kv_heads, head_dim, block_size]`` with ``v_layout="plain"``). Scope: block_size 16/64,
head_dim 64/128, f16 or bf16 query (output in the query's dtype; the query may be strided, e.g. a
slice of a fused QKV tensor, as long as its last dim is contiguous), 8 or 16 query heads per KV
head, fp8 e4m3 K/V of the arch's flavour, per-tensor ``[1]`` or per-token
``[num_blocks, kv_heads, block_size]`` float32 scales.
"""

import functools
import math

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.compiler.kernel_function import CompilationContext
from flydsl.expr import arith, const_expr, gpu, range_constexpr

from pa_tile.stages.s2_register_softmax import (  # unchanged from stage 2
    FP8_MAX, FP8_TORCH, GROUP_SIZES, LOG2E, MASKED, SPAN, TILE, WAVE, WAVES,
    _buffer_load, _buffer_store, _exp2, _fmax, _i64, _imax, _imin, _lds_load, _lds_store, _mfma,
    _pack_fp8, _rcp, _rsrc, _scalar_load, _select, _splat4, _tree_sum, _uniform, _xor_lanes,
    _need_tensor, _resolve_arch,
)

__all__ = ["paged_decode", "build_launcher", "launch_args", "numerics_model", "HEAD_DIMS", "BLOCK_SIZES",
           "GROUP_SIZES", "V_LAYOUTS", "QUERY_DTYPES"]

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 64)
V_LAYOUTS = ("trans_blocked", "plain")
QUERY_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
STATS_STRIDE = 5  # words per head row of the merge's (max, sum) table: 4 waves + 1 pad (see the notebook)


def _to_f32(words, qdt):
    """4 dwords of f16/bf16 bits -> 8 float32."""
    return words.bitcast(fx.BFloat16 if qdt == "bf16" else fx.Float16).to(fx.Float32)


def _query_operands(q_rs, row_byte, valid, fp8_max, grp, halves, qdt):
    """Stage 2's query quantization for ``halves`` = head_dim // 64 channel halves and either 16-bit dtype.

    ``ops[2h + k]``: channels ``16(grp + 4h) + 8k .. +8`` of the row at byte ``row_byte``, as fp8 codes.
    """
    vals = []
    for h in range_constexpr(halves):
        for k in range_constexpr(2):
            vals.append(_to_f32(_buffer_load(q_rs, row_byte + 32 * (grp + 4 * h), 4, offset=16 * k), qdt))
    amax = fx.Float32(1e-20)
    for v in vals:
        for i in range_constexpr(8):
            amax = _fmax(amax, fx.Float32(fx.absf(v[i])))
    amax = _fmax(amax, _xor_lanes(amax, 16))
    amax = _fmax(amax, _xor_lanes(amax, 32))
    inv = fx.Float32(_select(valid, _rcp(amax) * fp8_max, fx.Float32(0.0)))
    ops = []
    for v in vals:
        s = v * inv
        ops.append(_i64(_pack_fp8(s[0], s[1], s[2], s[3]), _pack_fp8(s[4], s[5], s[6], s[7])))
    return ops, amax * (1.0 / fp8_max)


def _mask_tail(s, v_words, n_valid):
    """Stage 2's tail mask for any number of V words (4 per d-chunk)."""
    ninf = fx.Float32(float("-inf"))
    s = fx.Vector.from_elements(
        [fx.Float32(_select(n_valid > i, fx.Float32(s[i]), ninf)) for i in range_constexpr(16)], dtype=fx.Float32
    )
    masks = []
    for k in range_constexpr(4):
        keep = _imax(_imin(n_valid - 4 * k, 4), 0)
        partial = (fx.Int32(1) << (keep * 8 % 32)) - 1
        masks.append(fx.Int32(_select(keep > 3, fx.Int32(-1), partial)))
    n = v_words.numel
    return s, fx.Vector.from_elements([fx.Int32(v_words[i]) & masks[i % 4] for i in range_constexpr(n)], dtype=fx.Int32)


def _softmax_step(s, m_old, l_old, c_qk, log2_fp8_max, p_weight=None):
    """Stage 2's online-softmax step; ``p_weight`` (16 per-token factors in [0, 1]) scales P
    after the sum and before the fp8 rounding: per-token V scales."""
    s_max = fx.Float32(s[0])
    for i in range_constexpr(1, 16):
        s_max = _fmax(s_max, fx.Float32(s[i]))
    m_tile = s_max * c_qk
    m_tile = _fmax(m_tile, _xor_lanes(m_tile, 16))
    m_tile = _fmax(m_tile, _xor_lanes(m_tile, 32))
    m_new = _fmax(m_old, m_tile)
    corr = _exp2(m_old - m_new)
    shift = m_new - log2_fp8_max
    p = [_exp2(fx.Float32(s[i]) * c_qk - shift) for i in range_constexpr(16)]
    l_new = l_old * corr + _tree_sum(p)
    if const_expr(p_weight is not None):
        p = [p[i] * fx.Float32(p_weight[i]) for i in range_constexpr(16)]
    words = [_pack_fp8(p[4 * a], p[4 * a + 1], p[4 * a + 2], p[4 * a + 3]) for a in range_constexpr(4)]
    return [_i64(words[0], words[1]), _i64(words[2], words[3])], corr, m_new, l_new


def _pv_step(o, v_words, p_ops, corr):
    corr4 = _splat4(corr)
    out = []
    for j in range_constexpr(len(o)):
        w = [fx.Int32(v_words[4 * j + k]) for k in range_constexpr(4)]
        acc = o[j] * corr4
        acc = _mfma(_i64(w[0], w[1]), p_ops[0], acc)
        acc = _mfma(_i64(w[2], w[3]), p_ops[1], acc)
        out.append(acc)
    return out


def _merge_waves(o, m_w, l_w, v_scale, lds, wave, lane, col, stride):
    """Stage 2's merge for ``len(o) // 4`` d-chunks per wave, with the (max, sum) table's head
    rows ``stride`` words apart. Returns this wave's d-chunks, normalized."""
    per = len(o) // WAVES
    stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
    xchg = fx.recast_iter(fx.Uint8, lds.xchg.ptr)
    l_w = l_w + _xor_lanes(l_w, 16)
    l_w = l_w + _xor_lanes(l_w, 32)
    _lds_store(stats, (col * stride + wave) * 4, fx.Vector.from_elements([m_w], dtype=fx.Float32))
    _lds_store(stats, ((16 + col) * stride + wave) * 4, fx.Vector.from_elements([l_w], dtype=fx.Float32))
    gpu.barrier()
    if const_expr(stride % 4 == 0):
        m4 = _lds_load(stats, col * stride * 4, WAVES)
        l4 = _lds_load(stats, (16 + col) * stride * 4, WAVES)
        m4, l4 = [fx.Float32(m4[w]) for w in range(WAVES)], [fx.Float32(l4[w]) for w in range(WAVES)]
    else:  # rows are not 16-byte aligned any more: four 4-byte reads each
        m4 = [fx.Float32(_lds_load(stats, (col * stride + w) * 4, 1)[0]) for w in range(WAVES)]
        l4 = [fx.Float32(_lds_load(stats, ((16 + col) * stride + w) * 4, 1)[0]) for w in range(WAVES)]
    m = _fmax(_fmax(m4[0], m4[1]), _fmax(m4[2], m4[3]))
    total = fx.Float32(0.0)
    for w in range_constexpr(WAVES):
        total = total + l4[w] * _exp2(m4[w] - m)
    o = [x * _splat4(_exp2(m_w - m) * v_scale * _rcp(total)) for x in o]
    for r in range_constexpr(1, WAVES):
        for s in range_constexpr(per):
            _lds_store(xchg, ((wave * per + s) * WAVE + lane) * 16, o[per * r + s])
        gpu.barrier()
        src = (wave + (WAVES - r)) % WAVES
        for s in range_constexpr(per):
            o[s] = o[s] + _lds_load(xchg, ((src * per + s) * WAVE + lane) * 16, 4)
        if const_expr(r < WAVES - 1):
            gpu.barrier()
    return o[:per]


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, head_dim: int, group: int, arch: str, q_dtype: str = "f16",
                   per_token: bool = False, v_layout: str = "trans_blocked", stats_stride: int = STATS_STRIDE):
    """The ``@flyc.jit`` launcher for one specialization (``stats_stride=4``: the unpadded merge table)."""
    if (block_size not in BLOCK_SIZES or head_dim not in HEAD_DIMS or group not in GROUP_SIZES
            or arch not in FP8_MAX or q_dtype not in ("f16", "bf16") or v_layout not in V_LAYOUTS
            or stats_stride < WAVES):
        raise ValueError(f"unsupported specialization {block_size=}, {head_dim=}, {group=}, {arch=}, {q_dtype=}, "
                         f"{v_layout=}, {stats_stride=}")
    BS, HD, G, PT, VT = block_size, head_dim, group, bool(per_token), v_layout == "trans_blocked"
    FMAX = FP8_MAX[arch]
    LOG2_FMAX = math.log2(FMAX)
    PAGE_BYTES = BS * HD
    PPS = SPAN // BS  # pages per wave span
    NJ = HD // 16  # d-chunks of O
    PER = NJ // WAVES  # d-chunks each wave stores
    HALVES = HD // 64  # 64-channel halves of a K row / of the query
    ODT = fx.BFloat16 if q_dtype == "bf16" else fx.Float16

    @fx.struct
    class Shared:
        stats: fx.Array[fx.Float32, 2 * 16 * stats_stride, 16]
        xchg: fx.Array[fx.Float32, WAVES * PER * WAVE * 4, 16]

    @flyc.kernel(known_block_size=(WAVES * WAVE, 1, 1))
    def pa_decode_s4(
        out: fx.Tensor,
        query: fx.Tensor,
        key_cache: fx.Tensor,
        value_cache: fx.Tensor,
        block_tables: fx.Tensor,
        context_lengths: fx.Tensor,
        key_scale: fx.Tensor,
        value_scale: fx.Tensor,
        v_norm: fx.Tensor,
        num_kv_heads: fx.Int32,
        max_blocks: fx.Int32,
        q_seq_stride: fx.Int32,
        q_head_stride: fx.Int32,
        scale_log2: fx.Float32,
    ):
        tid = fx.Int32(gpu.thread_id("x"))
        wave = _uniform(tid // WAVE)
        lane = tid % WAVE
        col = lane % 16
        grp = lane // 16
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        q_rs, k_rs, v_rs, bt_rs, o_rs = (_rsrc(t) for t in (query, key_cache, value_cache, block_tables, out))
        ctx = _scalar_load(context_lengths, seq)
        v_scale = _scalar_load(v_norm, 0).bitcast(fx.Float32)  # per token: the largest V scale
        q_row = (seq * q_seq_stride + (kvh * G + _imin(col, G - 1)) * q_head_stride) * 2
        q_ops, q_scale = _query_operands(q_rs, q_row, col < G, FMAX, grp, HALVES, q_dtype)
        if const_expr(PT):
            c_qk = q_scale * scale_log2  # K's scale multiplies each score instead
            ks_rs, vs_rs = _rsrc(key_scale), _rsrc(value_scale)
            inv_vnorm = _rcp(v_scale)
        else:
            c_qk = q_scale * _scalar_load(key_scale, 0).bitcast(fx.Float32) * scale_log2

        last_page = (ctx - 1) // BS
        num_tiles = (ctx + (TILE - 1)) // TILE
        bt_row = seq * max_blocks
        # the lane's first K slot (token 16·(col//4) + col%4 of the span) and V/scale token group
        k_slot = col % 4 if const_expr(PPS > 1) else (col // 4) * 16 + col % 4
        k_lane = (grp * BS + k_slot) * 16  # K blocked: (d//16, slot) rows of 16 bytes
        v_group = 0 if const_expr(PPS > 1) else grp  # slot // 16 of the lane's 16 V tokens
        if const_expr(VT):
            v_lane = (v_group * HD + col) * 16  # V trans-blocked: (slot//16, channel) rows of 16 tokens
            chunk_off = [((j + PER * wave) % NJ) * 256 for j in range_constexpr(NJ)]
        else:
            v_lane = col * BS + v_group * 16  # V plain: channel rows of block_size tokens
            chunk_off = [((j + PER * wave) % NJ) * (16 * BS) for j in range_constexpr(NJ)]
        s_lane = v_group * 16 * 4  # the lane's 16 per-token scales, bytes into the (page, head) row
        k_page_j = col // 4 if const_expr(PPS > 1) else 0
        v_page_j = grp if const_expr(PPS > 1) else 0

        def page_id(tile, j):
            idx = _imin(tile * (TILE // BS) + wave * PPS + j, last_page)
            return _buffer_load(bt_rs, (bt_row + idx) * 4, 1)

        def slab(page):
            return (page * num_kv_heads + kvh) * PAGE_BYTES

        def load_k(page):
            voff = slab(page) + k_lane
            words = []
            for a in range_constexpr(4):
                for h in range_constexpr(HALVES):
                    v = _buffer_load(k_rs, voff, 4, soffset=h * 4 * BS * 16, offset=a * 64)
                    words.extend([v[i] for i in range_constexpr(4)])
            return fx.Vector.from_elements(words, dtype=fx.Int32)

        def load_v(page):
            voff = slab(page) + v_lane
            words = []
            for j in range_constexpr(NJ):
                v = _buffer_load(v_rs, voff, 4, soffset=chunk_off[j])
                words.extend([v[k] for k in range_constexpr(4)])
            return fx.Vector.from_elements(words, dtype=fx.Int32)

        def load_scales(rs, page):
            voff = ((page * num_kv_heads + kvh) * BS) * 4 + s_lane
            vals = []
            for k in range_constexpr(4):
                v = _buffer_load(rs, voff, 4, offset=16 * k).bitcast(fx.Float32)
                vals.extend([v[i] for i in range_constexpr(4)])
            return vals

        def tile_math(t, k_words, v_words, v_page, o, m_old, l_old):
            s = []
            for a in range_constexpr(4):
                acc = fx.Vector.filled(4, 0.0, fx.Float32)
                for h in range_constexpr(HALVES):
                    for half in range_constexpr(2):
                        w0 = (HALVES * a + h) * 4 + 2 * half
                        acc = _mfma(_i64(k_words[w0], k_words[w0 + 1]), q_ops[2 * h + half], acc)
                s.extend([acc[i] for i in range_constexpr(4)])
            p_weight = None
            if const_expr(PT):
                ks = load_scales(ks_rs, v_page)  # s[4a + i] is token 16·grp + 4a + i: scale 4a + i
                s = [fx.Float32(s[i]) * fx.Float32(ks[i]) for i in range_constexpr(16)]
                p_weight = [fx.Float32(x) * inv_vnorm for x in load_scales(vs_rs, v_page)]
            s = fx.Vector.from_elements(s, dtype=fx.Float32)
            n_valid = ctx - (t * TILE + wave * SPAN + grp * 16)
            if t + 1 == num_tiles:
                s, v_words = _mask_tail(s, v_words, n_valid)
            p_ops, corr, m_new, l_new = _softmax_step(s, m_old, l_old, c_qk, LOG2_FMAX, p_weight)
            return _pv_step(o, v_words, p_ops, corr), m_new, l_new

        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        state = ([load_k(page_id(0, k_page_j)), page_id(1, k_page_j), page_id(0, v_page_j)]
                 + [zero4] * NJ + [fx.Float32(MASKED), fx.Float32(0.0)])
        for t, st in range(0, num_tiles, 1, init=state):
            t = fx.Int32(t)
            k_words, k_page_next, v_page = st[0], st[1], st[2]
            o = [st[3 + j] for j in range_constexpr(NJ)]
            m_old, l_old = st[3 + NJ], st[4 + NJ]
            v_words = load_v(v_page)
            k_words_next = load_k(k_page_next)
            carry = [k_words_next, page_id(t + 2, k_page_j), page_id(t + 1, v_page_j)]
            fx.rocdl.sched_barrier(0)
            o, m_new, l_new = tile_math(t, k_words, v_words, v_page, o, m_old, l_old)
            res = yield carry + o + [m_new, l_new]

        lds = fx.SharedAllocator().allocate(Shared).peek()
        mine = _merge_waves([res[3 + j] for j in range_constexpr(NJ)], fx.Float32(res[3 + NJ]),
                            fx.Float32(res[4 + NJ]), v_scale, lds, wave, lane, col, stats_stride)
        if col < G:
            row = (seq * (num_kv_heads * G) + kvh * G + col) * (HD * 2)
            for s in range_constexpr(PER):
                _buffer_store(mine[s].to(ODT).bitcast(fx.Int32), o_rs, row + ((PER * wave + s) * 16 + grp * 4) * 2)

    @flyc.jit
    def launch(
        out: fx.Tensor,
        query: fx.Tensor,
        key_cache: fx.Tensor,
        value_cache: fx.Tensor,
        block_tables: fx.Tensor,
        context_lengths: fx.Tensor,
        key_scale: fx.Tensor,
        value_scale: fx.Tensor,
        v_norm: fx.Tensor,
        num_seqs: fx.Int32,
        num_kv_heads: fx.Int32,
        max_blocks: fx.Int32,
        q_seq_stride: fx.Int32,
        q_head_stride: fx.Int32,
        scale_log2: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        with CompilationContext.compile_hints({"fastmath": arith.FastMathFlags.contract}):
            pa_decode_s4(
                out, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, v_norm,
                num_kv_heads, max_blocks, q_seq_stride, q_head_stride, scale_log2,
            ).launch(grid=(num_seqs, num_kv_heads, 1), block=(WAVES * WAVE, 1, 1), stream=stream)

    return launch


def _check_codes(x, name, arch, dims):
    _need_tensor(x, name)
    want = FP8_TORCH[arch]
    if x.dtype in FP8_TORCH.values() and x.dtype != want:
        raise ValueError(f"{name}: {x.dtype} codes do not match {arch}, which decodes e4m3 as {want} "
                         f"(FNUZ on gfx942, OCP on gfx950); convert the cache or pass the other arch")
    if x.dtype not in (want, torch.uint8):
        raise TypeError(f"{name}: expected {want} (or uint8 codes), got {x.dtype}")
    if x.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if x.numel() >= 2**31:
        raise ValueError(f"{name}: {x.numel()} bytes exceed the kernel's 32-bit byte offsets")


def _scales(key_scale, value_scale, per_token_shape, device):
    """-> (key_scale, value_scale, v_norm, per_token)"""
    out = []
    for x, name in ((key_scale, "key_scale"), (value_scale, "value_scale")):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            x = torch.tensor([float(x)], dtype=torch.float32, device=device)
        _need_tensor(x, name)
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32, got {x.dtype}")
        if x.numel() == 1:
            out.append((x.reshape(1).contiguous(), False))
        elif tuple(x.shape) == per_token_shape:
            if not x.is_contiguous():
                raise ValueError(f"{name}: a per-token scale must be contiguous")
            out.append((x, True))
        else:
            raise ValueError(f"{name}: expected shape [1] (per tensor) or {list(per_token_shape)} (per token), "
                             f"got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}: on {x.device}, but query is on {device}")
    (ks, kpt), (vs, vpt) = out
    if kpt != vpt:
        raise ValueError("value_scale: key_scale and value_scale must both be per tensor or both per token")
    if device.type == "cpu" and not (torch.isfinite(ks).all() and torch.isfinite(vs).all() and (vs > 0).all()):
        raise ValueError("value_scale: scales must be finite, and V's > 0")
    # per token, P is weighted by v_scale / max(v_scale) <= 1 so that it stays in fp8 range
    v_norm = vs.amax().reshape(1) if vpt else vs
    return ks, vs, v_norm, vpt


def _validate(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
              softmax_scale, out, arch, v_layout):
    arch = _resolve_arch(arch)
    if not isinstance(v_layout, str) or v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout: expected one of {V_LAYOUTS}, got {v_layout!r}")
    _need_tensor(query, "query")
    if query.dtype not in QUERY_DTYPES:
        raise TypeError(f"query: expected float16 or bfloat16, got {query.dtype}")
    if query.dim() != 3 or query.shape[2] not in HEAD_DIMS or query.shape[0] == 0:
        raise ValueError(f"query: expected [num_seqs >= 1, num_q_heads, 64 | 128], got {tuple(query.shape)}")
    if query.stride(2) != 1:
        raise ValueError(f"query: the head_dim axis must be contiguous (stride 1), got strides {query.stride()}")
    num_seqs, num_q_heads, head_dim = query.shape
    _check_codes(key_cache, "key_cache", arch, 5)
    _check_codes(value_cache, "value_cache", arch, 5 if v_layout == "trans_blocked" else 4)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
    num_blocks, num_kv_heads, d16, block_size, sixteen = key_cache.shape
    if sixteen != 16 or d16 * 16 != head_dim:
        raise ValueError(f"key_cache: expected K blocked [num_blocks, num_kv_heads, {head_dim // 16}, block_size, 16], "
                         f"got {tuple(key_cache.shape)}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"key_cache: block_size (dim 3) must be one of {BLOCK_SIZES}, got {block_size}")
    if num_blocks == 0 or num_kv_heads == 0:
        raise ValueError(f"key_cache: empty dimension in shape {tuple(key_cache.shape)}")
    want_v = ((num_blocks, num_kv_heads, block_size // 16, head_dim, 16) if v_layout == "trans_blocked"
              else (num_blocks, num_kv_heads, head_dim, block_size))
    if tuple(value_cache.shape) != want_v:
        raise ValueError(f"value_cache: expected V {v_layout} {want_v}, got {tuple(value_cache.shape)}")
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads not in GROUP_SIZES:
        raise ValueError(f"query: num_q_heads={num_q_heads} must be {GROUP_SIZES[0]} or {GROUP_SIZES[1]} times "
                         f"key_cache's num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    _need_tensor(block_tables, "block_tables")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables: expected int32, got {block_tables.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables: expected [{num_seqs}, max_blocks_per_seq >= 1], got {tuple(block_tables.shape)}")
    _need_tensor(context_lengths, "context_lengths")
    if context_lengths.dtype != torch.int32:
        raise TypeError(f"context_lengths: expected int32, got {context_lengths.dtype}")
    if tuple(context_lengths.shape) != (num_seqs,):
        raise ValueError(f"context_lengths: expected shape ({num_seqs},), got {tuple(context_lengths.shape)}")
    device = query.device
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                    ("context_lengths", context_lengths)):
        if x.device != device:
            raise ValueError(f"{name}: on {x.device}, but query is on {device}")
    ks, vs, v_norm, per_token = _scales(key_scale, value_scale, (num_blocks, num_kv_heads, block_size), device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be finite and > 0, got {softmax_scale}")
    if out is None:
        out = torch.empty(tuple(query.shape), dtype=query.dtype, device=device)
    else:
        _need_tensor(out, "out")
        if out.dtype != query.dtype or tuple(out.shape) != tuple(query.shape):
            raise ValueError(f"out: expected {query.dtype} {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out: must be contiguous")
        if out.device != device:
            raise ValueError(f"out: on {out.device}, but query is on {device}")
    if device.type == "cpu":
        ctx = context_lengths.to(torch.int64)
        room = block_tables.shape[1] * block_size
        bad = (ctx < 1) | (ctx > room)
        if bad.any():
            s = int(bad.nonzero()[0])
            raise ValueError(f"context_lengths: sequence {s} has {int(ctx[s])} tokens; need 1 .. {room}")
        used = torch.arange(block_tables.shape[1]) * block_size < ctx[:, None]
        bt = block_tables.to(torch.int64)
        wrong = used & ((bt < 0) | (bt >= num_blocks))
        if wrong.any():
            s, j = (int(i) for i in wrong.nonzero()[0])
            raise ValueError(f"block_tables: entry [{s}, {j}] = {int(bt[s, j])} is not a page id in [0, {num_blocks})")
    last = (num_seqs - 1) * query.stride(0) + (num_q_heads - 1) * query.stride(1) + head_dim
    if last * 2 >= 2**31 or out.numel() * 2 >= 2**31:
        raise ValueError("query: too large for the kernel's 32-bit byte offsets")
    launcher = build_launcher(block_size, head_dim, group, arch, QUERY_DTYPES[query.dtype], per_token, v_layout)
    args = (
        out, query, key_cache.view(torch.uint8), value_cache.view(torch.uint8), block_tables.contiguous(),
        context_lengths.contiguous(), ks, vs, v_norm,
        num_seqs, num_kv_heads, block_tables.shape[1], query.stride(0), query.stride(1), float(softmax_scale) * LOG2E,
    )
    return launcher, args, arch


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, out=None, arch=None, v_layout="trans_blocked"):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel."""
    return _validate(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                     softmax_scale, out, arch, v_layout)


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, out=None, arch=None, v_layout="trans_blocked"):
    """fp8 paged decode attention; returns ``out`` (shaped like ``query``, in the query's dtype).

    ``query`` [num_seqs, num_q_heads, 64|128] f16/bf16, last dim contiguous (other strides free);
    ``key_cache`` K blocked [num_blocks, num_kv_heads, head_dim//16, block_size, 16];
    ``value_cache`` V trans-blocked [num_blocks, num_kv_heads, block_size//16, head_dim, 16], or V plain
    [num_blocks, num_kv_heads, head_dim, block_size] with ``v_layout="plain"``; fp8 e4m3 of the arch's
    flavour (or uint8 codes); ``block_tables`` [num_seqs, max_blocks] int32; ``context_lengths``
    [num_seqs] int32; ``key_scale``/``value_scale`` float32 [1] or [num_blocks, num_kv_heads,
    block_size]; ``softmax_scale`` defaults to 1/sqrt(head_dim).
    """
    from pa_tile import backend, toolchain

    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch, v_layout=v_layout)
    backend.ensure_backend()
    with toolchain.target_arch(arch):
        launcher(*args)
    return args[0]


def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                   softmax_scale=None, arch, v_layout="trans_blocked"):
    """float32 torch model of the stage-4 kernel's roundings (arguments as ``paged_decode``);
    returns float32 shaped like ``query``. Stage 2's model plus head_dim 64, per-token scales
    (K's on each score, V's as P weights ``v_scale / max(v_scale)`` before the fp8 rounding)."""
    from pa_tile.cache import from_k_blocked, from_v_plain, from_v_trans_blocked

    fmax, fp8 = FP8_MAX[arch], FP8_TORCH[arch]
    num_seqs, num_q_heads, hd = query.shape
    scale = 1.0 / math.sqrt(hd) if softmax_scale is None else float(softmax_scale)
    decode = lambda x: x.view(torch.uint8).view(fp8).float()  # noqa: E731
    kc = decode(from_k_blocked(key_cache.view(torch.uint8)))
    vraw = value_cache.view(torch.uint8)
    vc = decode(from_v_trans_blocked(vraw) if v_layout == "trans_blocked" else from_v_plain(vraw))
    ks, vs = torch.as_tensor(key_scale, dtype=torch.float32), torch.as_tensor(value_scale, dtype=torch.float32)
    per_token = ks.numel() > 1
    v_norm = float(vs.max()) if per_token else float(vs.reshape(()))
    _, kvh, bs, _ = kc.shape
    group = num_q_heads // kvh
    out = torch.empty(num_seqs, num_q_heads, hd)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    scale_log2 = f32(scale * LOG2E)  # ... scores (and so P's fp8 codes) round alike
    for s in range(num_seqs):
        n = int(context_lengths[s])
        pages = block_tables[s, : -(-n // bs)].long()
        k = kc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, hd)[:, :n]
        v = vc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, hd)[:, :n]
        q = query[s].float().reshape(kvh, group, hd)
        amax = q.abs().amax(-1, keepdim=True).clamp_min(1e-20)
        q8 = (q * (fmax / amax)).to(fp8).float()
        q_scale = amax * f32(1.0 / fmax)  # the kernel's order of float32 operations, so that
        raw = torch.einsum("hgd,htd->hgt", q8, k)
        if per_token:
            kst = ks[pages].permute(1, 0, 2).reshape(kvh, -1)[:, :n]
            wt = (vs[pages].permute(1, 0, 2).reshape(kvh, -1)[:, :n] / v_norm)[:, None, :]
            x = (raw * kst[:, None, :]) * (q_scale * scale_log2)
        else:
            wt = torch.ones(1)
            x = raw * ((q_scale * ks.reshape(())) * scale_log2)
        m = torch.full((kvh, group, WAVES), MASKED)
        l = torch.zeros(kvh, group, WAVES)
        o = torch.zeros(kvh, group, WAVES, hd)
        for t0 in range(0, n, TILE):
            for w in range(WAVES):
                lo, hi = t0 + w * SPAN, min(t0 + (w + 1) * SPAN, n)
                if hi <= lo:
                    continue
                m_new = torch.maximum(m[..., w], x[..., lo:hi].amax(-1))
                corr = torch.exp2(m[..., w] - m_new)
                p = torch.exp2(x[..., lo:hi] - (m_new - math.log2(fmax))[..., None])
                l[..., w] = l[..., w] * corr + p.sum(-1)
                pw = p * (wt[..., lo:hi] if per_token else 1.0)
                o[..., w, :] = o[..., w, :] * corr[..., None] + pw.to(fp8).float() @ v[:, lo:hi]
                m[..., w] = m_new
        f = torch.exp2(m - m.amax(-1, keepdim=True))
        res = (o * f[..., None]).sum(2) / (l * f).sum(-1)[..., None] * v_norm
        out[s] = res.reshape(num_q_heads, hd)
    return out
