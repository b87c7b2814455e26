# GENERATED from notebooks/06_split_k_and_the_finished_kernel.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 6: split-K partitions, the flash-combine reduce, and the finished ``paged_decode``.

The partial kernel is chapter 5's (``pa_tile.stages.s5_phase_split_mtp``) specialized with
``num_partitions`` > 1: workgroup z walks a contiguous range of 256-token tiles and writes the
partition's row max, row sum and normalized output. ``build_reduce`` merges them into the output
(global max, rescaled sums, weighted outputs; empty partitions add nothing, never NaN).
``choose_num_partitions`` picks the split from the problem's shape and the target's CU count;
``paged_decode`` validates everything, carves the partial buffers out of a caller's
``workspace`` (no allocation: graph-capturable) and runs the one or two launches.
"""

import functools
import math
import types

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu

from pa_tile.stages import s5_phase_split_mtp as s5
from pa_tile.stages.s2_register_softmax import (
    FP8_MAX, LOG2E, TILE, _buffer_load, _buffer_store, _exp2, _fmax, _imin, _rcp, _rsrc, _select, _splat4,
)

__all__ = ["paged_decode", "launch_args", "build_reduce", "combine_torch", "choose_num_partitions",
           "workspace_size", "make_workspace", "CU_COUNT", "MAX_PARTITIONS"]

#: compute units of the two targets: MI300X (gfx942) and MI355X (gfx950)
CU_COUNT = {"gfx942": 304, "gfx950": 256}
#: the largest split chapter 5's kernel accepts
MAX_PARTITIONS = 64
#: workgroups the heuristic aims for, per CU (see ``choose_num_partitions``)
WORKGROUPS_PER_CU = 4
#: a partition gets at least this many 256-token tiles (see ``choose_num_partitions``)
MIN_TILES_PER_PARTITION = 2
REDUCE_THREADS = 256


def combine_torch(pmax, psum, pout, query_length, group):
    """The reduce in float32 torch, with the kernel's guards: partials ``[S, kvh, NP, rows(, d)]``
    -> ``[S·query_length, kvh·group, d]``."""
    live = psum > 0
    gmax = torch.where(live, pmax, torch.tensor(float("-inf"))).amax(2, keepdim=True)
    w = torch.where(live, psum * torch.exp(torch.where(live, pmax - gmax, torch.zeros(()))), torch.zeros(()))
    den = w.sum(2)
    o = (w[..., None] * pout).sum(2) * torch.where(den > 0, 1.0 / den.clamp_min(1e-38), torch.zeros(()))[..., None]
    S, kvh, rows, d = o.shape
    return o.reshape(S, kvh, query_length, group, d).permute(0, 2, 1, 3, 4).reshape(S * query_length, kvh * group, d)


@functools.lru_cache(maxsize=None)
def build_reduce(head_dim, group, query_length, q_dtype="f16"):
    """The ``@flyc.jit`` flash-combine launcher ``launch(out, pmax, psum, pout, num_seqs,
    num_kv_heads, num_partitions)`` for one (head_dim, group, query_length, query dtype).

    Reads chapter 5's partials (``pmax``/``psum`` [S, kvh, NP, rows], ``pout`` [S, kvh, NP, rows,
    head_dim], float32) and writes ``out`` [S·query_length, kvh·group, head_dim] (contiguous, f16 or
    bf16): ``M = max_{ℓ>0} m``, ``w = ℓ·exp(m - M)`` (0 where ℓ = 0), ``out = Σ w·o / Σ w`` (0 if Σ w = 0).
    """
    if head_dim % 64 or not 64 <= head_dim <= 256:
        raise ValueError(f"unsupported head_dim={head_dim} (64, 128 or 256)")
    if not (1 <= group <= s5.MAX_GROUP and 1 <= query_length <= s5.MAX_QUERY_LENGTH):
        raise ValueError(f"unsupported group={group}, query_length={query_length}")
    HD, G, QL = head_dim, group, query_length
    ROWS = G * QL
    LPR = HD // 4  # lanes per row: 4 channels (one dwordx4) each
    RPW = REDUCE_THREADS // LPR  # rows per workgroup
    QDT = fx.BFloat16 if q_dtype == "bf16" else fx.Float16

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                     num_kv_heads: fx.Int32, num_partitions: fx.Int32):
        tid = fx.Int32(gpu.thread_id("x"))
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        r = fx.Int32(gpu.block_id("z")) * RPW + tid // LPR
        rc = _imin(r, ROWS - 1)  # rows past the end compute a real row's result and do not store it
        d0 = (tid % LPR) * 4
        mx_rs, sm_rs, po_rs, o_rs = (_rsrc(t) for t in (pmax, psum, pout, out))
        stat0 = (seq * num_kv_heads + kvh) * num_partitions * ROWS + rc  # partition 0's stats, in floats
        ninf = fx.Float32(float("-inf"))
        zero = fx.Float32(0.0)

        # pass 1: the global max over partitions that saw a token (an empty one enters as -inf)
        for z, m_run in range(0, num_partitions, 1, init=[ninf]):
            i = stat0 + fx.Int32(z) * ROWS
            m = _buffer_load(mx_rs, i * 4, 1).bitcast(fx.Float32)
            s = _buffer_load(sm_rs, i * 4, 1).bitcast(fx.Float32)
            res = yield [_fmax(fx.Float32(m_run[0]), fx.Float32(_select(s > 0.0, m, ninf)))]
        gmax = fx.Float32(res)

        # pass 2: weights w = l·e^(m - M), selected (not multiplied) to 0 for empty partitions,
        # so M = -inf (all empty) never meets 0·inf
        for z, st in range(0, num_partitions, 1, init=[zero, fx.Vector.filled(4, 0.0, fx.Float32)]):
            i = stat0 + fx.Int32(z) * ROWS
            m = _buffer_load(mx_rs, i * 4, 1).bitcast(fx.Float32)
            s = _buffer_load(sm_rs, i * 4, 1).bitcast(fx.Float32)
            o = _buffer_load(po_rs, (i * HD + d0) * 4, 4).bitcast(fx.Float32)
            w = fx.Float32(_select(s > 0.0, s * _exp2((m - gmax) * LOG2E), zero))
            res = yield [fx.Float32(st[0]) + w, fx.Vector(st[1]) + o * _splat4(w)]
        den = fx.Float32(res[0])
        inv = fx.Float32(_select(den > 0.0, _rcp(den), zero))
        o = fx.Vector(res[1]) * _splat4(inv)
        if r < ROWS:
            qi = rc // G
            orow = (seq * QL + qi) * (num_kv_heads * G) + kvh * G + (rc - qi * G)
            _buffer_store(o.to(QDT).bitcast(fx.Int32), o_rs, (orow * HD + d0) * 2)

    @flyc.jit
    def launch(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
               num_seqs: fx.Int32, num_kv_heads: fx.Int32, num_partitions: fx.Int32,
               stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6(out, pmax, psum, pout, num_kv_heads, num_partitions).launch(
            grid=(num_seqs, num_kv_heads, (ROWS + RPW - 1) // RPW), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch


def choose_num_partitions(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128, group=8, query_length=1):
    """The split-K partition count for a problem shape on ``arch`` (1 = no split, no reduce).

    Aims for ``WORKGROUPS_PER_CU × CU_COUNT[arch]`` workgroups of the partial kernel while giving
    every partition at least ``MIN_TILES_PER_PARTITION`` 256-token tiles, then rounds so the
    longest sequence's tiles split evenly (no trailing empty partition).
    """
    if arch not in CU_COUNT:
        raise ValueError(f"arch: expected one of {sorted(CU_COUNT)}, got {arch!r}")
    m_groups = s5.plan(head_dim, group, query_length)[3]
    base = max(1, num_seqs * num_kv_heads * m_groups)
    tiles = max(1, -(-max_context // TILE))
    want = -(-WORKGROUPS_PER_CU * CU_COUNT[arch] // base)
    cap = max(1, tiles // MIN_TILES_PER_PARTITION)
    parts = max(1, min(want, cap, MAX_PARTITIONS))
    per = -(-tiles // parts)
    return -(-tiles // per)


def workspace_size(num_seqs, num_kv_heads, group, query_length, head_dim, num_partitions):
    """float32 elements of the workspace for one problem shape and partition count
    (1 when ``num_partitions`` is 1: a placeholder the unsplit kernel never touches)."""
    if num_partitions <= 1:
        return 1
    return num_seqs * num_kv_heads * num_partitions * group * query_length * (head_dim + 2)


def _carve(workspace, num_seqs, num_kv_heads, rows, head_dim, num_partitions):
    shape = (num_seqs, num_kv_heads, num_partitions, rows)
    n = num_seqs * num_kv_heads * num_partitions * rows
    return (workspace[:n].view(shape), workspace[n:2 * n].view(shape),
            workspace[2 * n:2 * n + n * head_dim].view(shape + (head_dim,)))


def _inspect(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
             softmax_scale, query_length, sliding_window, arch, m_tiles):
    """Validate the problem (no allocation for tensor arguments); -> a namespace describing it."""
    arch = s5._resolve_arch(arch)
    s5._int_opt(sliding_window, "sliding_window", 0)
    if m_tiles is not None:
        s5._int_opt(m_tiles, "m_tiles", 1, 8)
    s5._need_tensor(query, "query")
    if query.dtype not in s5.QUERY_DTYPES:
        raise TypeError(f"query: expected float16 or bfloat16, got {query.dtype}")
    if query.dim() != 3 or query.shape[2] not in s5.HEAD_DIMS or query.shape[0] == 0 or query.shape[1] == 0:
        raise ValueError(f"query: expected [num_seqs*query_length, num_q_heads, head_dim in {s5.HEAD_DIMS}], "
                         f"got {tuple(query.shape)}")
    if query.stride(2) != 1:
        raise ValueError("query: channels (dim 2) must be contiguous; rows and heads may be strided")
    total_rows, num_q_heads, head_dim = query.shape
    s5._need_tensor(context_lengths, "context_lengths")
    if context_lengths.dtype != torch.int32:
        raise TypeError(f"context_lengths: expected int32, got {context_lengths.dtype}")
    if context_lengths.dim() != 1 or context_lengths.shape[0] == 0 or not context_lengths.is_contiguous():
        raise ValueError(f"context_lengths: expected a contiguous [num_seqs >= 1], got {tuple(context_lengths.shape)}")
    num_seqs = context_lengths.shape[0]
    if query_length is None:
        if total_rows % num_seqs:
            raise ValueError(f"query: {total_rows} rows is not a multiple of num_seqs={num_seqs} (context_lengths)")
        query_length = total_rows // num_seqs
    s5._int_opt(query_length, "query_length", 1, s5.MAX_QUERY_LENGTH)
    if total_rows != num_seqs * query_length:
        raise ValueError(f"query: expected {num_seqs}*{query_length} rows (num_seqs*query_length), got {total_rows}")
    s5._check_cache(key_cache, "key_cache", arch, (5,))
    s5._check_cache(value_cache, "value_cache", arch, (4, 5))
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
    num_blocks, num_kv_heads, d16, block_size, w16 = key_cache.shape
    if d16 * 16 != head_dim or w16 != 16:
        raise ValueError(f"key_cache: expected blocked [num_blocks, num_kv_heads, {head_dim // 16}, block_size, 16], "
                         f"got {tuple(key_cache.shape)}")
    if block_size not in s5.BLOCK_SIZES:
        raise ValueError(f"key_cache: block_size (dim 3) must be one of {s5.BLOCK_SIZES}, got {block_size}")
    if num_blocks == 0 or num_kv_heads == 0:
        raise ValueError(f"key_cache: empty dimension in shape {tuple(key_cache.shape)}")
    trans_v = value_cache.dim() == 5
    want_v = ((num_blocks, num_kv_heads, block_size // 16, head_dim, 16) if trans_v
              else (num_blocks, num_kv_heads, head_dim, block_size))
    if tuple(value_cache.shape) != want_v:
        raise ValueError(f"value_cache: expected {'trans-blocked' if trans_v else 'plain'} {want_v}, "
                         f"got {tuple(value_cache.shape)}")
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= s5.MAX_GROUP:
        raise ValueError(f"query: num_q_heads={num_q_heads} must be 1..{s5.MAX_GROUP} times num_kv_heads={num_kv_heads}")
    s5._need_tensor(block_tables, "block_tables")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables: expected int32, got {block_tables.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables: expected [{num_seqs}, max_blocks_per_seq >= 1], got {tuple(block_tables.shape)}")
    if not block_tables.is_contiguous():
        raise ValueError("block_tables: must be contiguous")
    device = query.device
    pts = (num_blocks, num_kv_heads, block_size)
    key_scale, kpt = s5._scale(key_scale, "key_scale", device, pts)
    value_scale, vpt = s5._scale(value_scale, "value_scale", device, pts)
    if kpt != vpt:
        raise ValueError("value_scale: key_scale and value_scale must both be per tensor or both per token")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be finite and > 0, got {softmax_scale}")
    for name, x in dict(key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                        context_lengths=context_lengths, key_scale=key_scale, value_scale=value_scale).items():
        if x.device != device:
            raise ValueError(f"{name}: on {x.device}, but query is on {device}")
    if device.type == "cpu":  # plain Python lists: the check itself allocates no tensor
        room = block_tables.shape[1] * block_size
        for s, n in enumerate(context_lengths.tolist()):
            if not query_length <= n <= room:
                raise ValueError(f"context_lengths: sequence {s} has {n} tokens; need {query_length} .. {room}")
            for j, page in enumerate(block_tables[s, : -(-n // block_size)].tolist()):
                if not 0 <= page < num_blocks:
                    raise ValueError(f"block_tables: entry [{s}, {j}] = {page} is not a page id in [0, {num_blocks})")
    span = (total_rows - 1) * query.stride(0) + (num_q_heads - 1) * query.stride(1) + head_dim
    if span * 2 >= 2**31:
        raise ValueError("query: too large for the kernel's 32-bit byte offsets")
    return types.SimpleNamespace(
        arch=arch, num_seqs=num_seqs, query_length=query_length, num_q_heads=num_q_heads, head_dim=head_dim,
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, block_size=block_size, trans_v=trans_v,
        per_token=kpt, key_scale=key_scale, value_scale=value_scale, softmax_scale=float(softmax_scale),
        q_dtype=s5.QUERY_DTYPES[query.dtype], device=device, max_context=block_tables.shape[1] * block_size,
    )


def _partitions(p, num_partitions):
    if num_partitions is None:
        return choose_num_partitions(p.num_seqs, p.num_kv_heads, p.max_context, arch=p.arch, head_dim=p.head_dim,
                                     group=p.group, query_length=p.query_length)
    s5._int_opt(num_partitions, "num_partitions", 1, MAX_PARTITIONS)
    return num_partitions


def make_workspace(query, key_cache, block_tables, *, query_length=None, num_partitions=None, arch=None):
    """A float32 workspace for ``paged_decode`` calls with these shapes (same partition choice)."""
    for name, x in (("query", query), ("key_cache", key_cache), ("block_tables", block_tables)):
        s5._need_tensor(x, name)
    if query.dim() != 3 or key_cache.dim() != 5 or block_tables.dim() != 2 or block_tables.shape[0] == 0:
        raise ValueError("query, key_cache, block_tables: expected 3, 5 and 2 dims as for paged_decode")
    num_seqs, kvh, hd = block_tables.shape[0], key_cache.shape[1], query.shape[2]
    ql = query.shape[0] // num_seqs if query_length is None else query_length
    group = query.shape[1] // kvh
    if ql < 1 or group < 1:
        raise ValueError("query: fewer rows or heads than block_tables' sequences or key_cache's KV heads")
    p = types.SimpleNamespace(arch=s5._resolve_arch(arch), num_seqs=num_seqs, num_kv_heads=kvh, head_dim=hd,
                              group=group, query_length=ql, max_context=block_tables.shape[1] * key_cache.shape[3])
    n = workspace_size(num_seqs, kvh, group, ql, hd, _partitions(p, num_partitions))
    return torch.empty(n, dtype=torch.float32, device=query.device)


class _Pipeline:
    """The partial kernel and (when split) the reduce as one callable: ``compile_isa`` sees both."""

    def __init__(self, steps, arch):
        self.steps, self.arch = steps, arch

    def __call__(self, stream=None):
        for launcher, args in self.steps:
            if stream is None:
                launcher(*args)
            else:
                launcher(*args, stream=stream)

    @property
    def _mem_cache(self):  # toolchain.compile_isa clears it to force code generation
        return types.SimpleNamespace(clear=lambda: [getattr(l, "_mem_cache", {}).clear() for l, _ in self.steps])


def _build(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, softmax_scale,
           sliding_window, query_length, out, workspace, num_partitions, m_tiles, arch):
    p = _inspect(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                 softmax_scale, query_length, sliding_window, arch, m_tiles)
    parts = _partitions(p, num_partitions)
    if out is None:
        out = torch.empty((p.num_seqs * p.query_length, p.num_q_heads, p.head_dim), dtype=query.dtype, device=p.device)
    else:
        s5._need_tensor(out, "out")
        if out.dtype != query.dtype or tuple(out.shape) != tuple(query.shape):
            raise ValueError(f"out: expected {query.dtype} {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}")
        if not out.is_contiguous() or out.device != p.device:
            raise ValueError(f"out: must be contiguous and on {p.device}")
    rows = p.group * p.query_length
    need = workspace_size(p.num_seqs, p.num_kv_heads, p.group, p.query_length, p.head_dim, parts)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=p.device)
    else:
        s5._need_tensor(workspace, "workspace")
        if workspace.dtype != torch.float32 or workspace.dim() != 1 or not workspace.is_contiguous():
            raise ValueError(f"workspace: expected a contiguous 1-d float32 tensor, got {workspace.dtype} "
                             f"{tuple(workspace.shape)}")
        if workspace.device != p.device:
            raise ValueError(f"workspace: on {workspace.device}, but query is on {p.device}")
        if workspace.numel() < need:
            raise ValueError(f"workspace: {parts} partitions need {need} float32 elements, got {workspace.numel()} "
                             f"(size it with pa_tile.make_workspace or workspace_size)")
    if parts > 1:
        pmax, psum, pout = _carve(workspace, p.num_seqs, p.num_kv_heads, rows, p.head_dim, parts)
        first = (out, pmax, psum, pout)
    else:
        d = workspace[:1]
        first = (out, d, d, d)
    partial = s5.build_launcher(p.arch, p.block_size, p.head_dim, p.group, p.query_length, p.q_dtype, p.per_token,
                                p.trans_v, sliding_window, parts, m_tiles)
    steps = [(partial, first + (
        query, key_cache.view(torch.uint8), value_cache.view(torch.uint8), block_tables, context_lengths,
        p.key_scale, p.value_scale, p.num_seqs, p.num_kv_heads, block_tables.shape[1], query.stride(0),
        query.stride(1), p.softmax_scale * LOG2E))]
    if parts > 1:
        reduce = build_reduce(p.head_dim, p.group, p.query_length, p.q_dtype)
        steps.append((reduce, (out, pmax, psum, pout, p.num_seqs, p.num_kv_heads, parts)))
    return _Pipeline(steps, p.arch), out


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, sliding_window=0, query_length=None, out=None, workspace=None,
                num_partitions=None, m_tiles=None, arch=None):
    """``(launcher, (), arch)`` after validation: ``launcher()`` runs the partial kernel and, when
    split, the reduce; ``pa_tile.toolchain.compile_isa(launcher, arch=arch)`` returns both kernels'
    assembly (partial kernel first)."""
    pipe, _ = _build(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                     softmax_scale, sliding_window, query_length, out, workspace, num_partitions, m_tiles, arch)
    return pipe, (), pipe.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, sliding_window=0, query_length=None, out=None, workspace=None,
                 num_partitions=None, m_tiles=None, arch=None):
    """fp8 paged decode attention (the finished pa_tile kernel); returns ``out``.

    ``query`` [num_seqs·query_length, num_q_heads, head_dim] f16/bf16 (row ``s·query_length + i`` is
    draft ``i`` of sequence ``s``, the last ``query_length`` positions, causally masked; rows and
    heads may be strided); ``key_cache`` blocked [num_blocks, num_kv_heads, head_dim//16, block_size,
    16]; ``value_cache`` trans-blocked [num_blocks, num_kv_heads, block_size//16, head_dim, 16] or
    plain [num_blocks, num_kv_heads, head_dim, block_size]; fp8 e4m3 of the arch (FNUZ on gfx942,
    OCP on gfx950) or uint8 codes; ``block_tables`` [num_seqs, max_blocks] int32;
    ``context_lengths`` [num_seqs] int32; float32 scales, both [1] or both [num_blocks,
    num_kv_heads, block_size] (per token). ``sliding_window``: a query at position p sees tokens
    (p - W, p] (0 = all). ``num_partitions``: split-K count (None = ``choose_num_partitions``).
    With ``out`` and ``workspace`` (``make_workspace``) given, nothing is allocated: the call can
    be captured in a CUDA/HIP graph. ``arch`` defaults to the GPU's (or the emulator's) target.
    """
    pipe, out = _build(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                       softmax_scale, sliding_window, query_length, out, workspace, num_partitions, m_tiles, arch)
    from pa_tile import backend, toolchain

    backend.ensure_backend()
    with toolchain.target_arch(pipe.arch):
        pipe(torch.cuda.current_stream(out.device) if out.is_cuda else None)
    return out
