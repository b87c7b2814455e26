# GENERATED from notebooks/07_split_k_and_the_finished_kernel.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 6: split-K partitions, the flash-combine reduce, and the finished ``paged_decode``.

Chapter 06's kernel split into partitions (``num_partitions``, or a balanced ``work_list``), the
reduce that merges their partials (``build_reduce``), the choice of the split
(``choose_num_partitions``) and the workspace. The public API over them is ``pa_tile.api``.
"""

import dataclasses
import functools
import math
import types

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from pa_tile import arch as _arch
from pa_tile.kernel_lib import (LOG2E, TILE, buffer_load, buffer_store, device_code, exp2, fmax,
                                imin,
                                rcp, rsrc, scalar_load, select, splat4)
from pa_tile.serving_math import log2, with_sink
from pa_tile.stages import s5_phase_split_mtp as s5

__all__ = ["paged_decode", "launch_args", "build_reduce", "combine_torch", "choose_num_partitions",
           "choose_num_partitions_budget", "partition_table", "DEFAULT_POLICY",
           "TRAFFIC_CAP", "split_extra_bytes", "within_traffic_cap", "workspace_size",
           "carve", "make_workspace", "LIMITS", "MAX_PARTITIONS",
           "PARTIAL_BYTES_BUDGET", "DEFAULT_SCHEDULE", "SCHEDULES", "chunk_floor",
           "choose_schedule", "work_entries", "work_list", "work_list_buffers",
           "reduce_geometry", "load_partition_group", "merge_partition_group",
           "combine_partitions", "write_combined", "uniform_reduce", "listed_reduce",
           "tabled_split", "build_ragged_reduce", "listed_ragged_reduce", "tiles_to_walk"]


#: the finished kernel supports what chapter 06's does; the split is what this chapter adds
LIMITS = dataclasses.replace(s5.LIMITS, stage="s6")
#: the largest split chapter 06's kernel accepts
MAX_PARTITIONS = LIMITS.max_partitions
#: workgroups the heuristic aims for, per CU (see ``choose_num_partitions``)
WORKGROUPS_PER_CU = 4
#: a partition gets at least this many 256-token tiles (see ``choose_num_partitions``)
MIN_TILES_PER_PARTITION = 2
#: the partials a split writes and the reduce reads back may cost at most this fraction of the
#: K and V bytes the call must read (see ``choose_num_partitions``)
PARTIAL_BYTES_BUDGET = 0.03
REDUCE_THREADS = 256
#: partitions the reduce loads together, waiting for memory once per group (its section)
REDUCE_GROUP = 4
#: the byte offset 2^31 (as a signed 32-bit value; the hardware reads offsets unsigned), past every
#: partial buffer (``s5.check_partial_offsets`` keeps them below 2^31): a buffer load there returns
#: 0 and fetches nothing
PAST_PARTIALS = -(2**31)


def combine_torch(pmax, psum, pout, query_length, group):
    """The reduce in float32 torch, with the kernel's guards: partials ``[S, kvh, NP, rows(, d)]``
    -> ``[S·query_length, kvh·group, d]``."""
    live = psum > 0
    gmax = torch.where(live, pmax, torch.tensor(float("-inf"))).amax(2, keepdim=True)
    w = torch.where(live, psum * torch.exp(torch.where(live, pmax - gmax, torch.zeros(()))),
                    torch.zeros(()))
    den = w.sum(2)
    o = (w[..., None] * pout).sum(2) * torch.where(den > 0, 1.0 / den.clamp_min(1e-38),
                                                   torch.zeros(()))[..., None]
    S, kvh, rows, d = o.shape
    return o.reshape(S, kvh, query_length, group,
                     d).permute(0, 2, 1, 3, 4).reshape(S * query_length, kvh * group, d)


def reduce_geometry(head_dim, group, query_length, q_dtype="f16", sinks=False, lse=False):
    """The reduce's compile-time sizes for one (head_dim, group, query_length, query dtype),
    checked: ``HD``, ``G``, ``QL``; ``ROWS`` query rows per (sequence, KV head); ``LPR`` lanes
    per row (4 channels, one dwordx4, each); ``RPW`` rows per workgroup; ``GRID_Z`` workgroups
    per (sequence, KV head); ``QDT`` the output dtype; ``SINKS``, ``LSE``: chapter 08's sinks
    and log-sum-exp out."""
    if head_dim % 64 or not 64 <= head_dim <= 256:
        raise ValueError(f"unsupported head_dim={head_dim} (64, 128 or 256)")
    if not (1 <= query_length <= s5.LIMITS.max_query_length
            and s5.LIMITS.allows_group(group, query_length)):
        raise ValueError(f"unsupported group={group}, query_length={query_length} (group "
                         f"{s5.LIMITS.groups_text(query_length)} at this query_length)")
    rows = group * query_length
    lanes = head_dim // 4  # lanes per row: 4 channels (one dwordx4) each
    rows_per_wg = REDUCE_THREADS // lanes
    return types.SimpleNamespace(HD=head_dim, G=group, QL=query_length, ROWS=rows, LPR=lanes,
                                 RPW=rows_per_wg, SINKS=sinks, LSE=lse,
                                 QDT=fx.BFloat16 if q_dtype == "bf16" else fx.Float16,
                                 GRID_Z=(rows + rows_per_wg - 1) // rows_per_wg)


def load_partition_group(c, rsrcs, stat0, stride, zb, hi, d0):
    """The maxes, sums and 4 output channels of partitions ``zb .. zb + REDUCE_GROUP`` of the
    thread's row (stats at float ``stat0 + z·stride``, outputs ``HD`` floats apart), every load
    issued before any is used; a slot at or past ``hi`` reads 0 from ``PAST_PARTIALS``."""
    mx_rs, sm_rs, po_rs = rsrcs
    maxes, sums, outs = [], [], []
    for u in range_constexpr(REDUCE_GROUP):
        here = zb + u < hi
        i = stat0 + (zb + u) * stride
        at = fx.Int32(select(here, i * 4, PAST_PARTIALS))
        maxes.append(buffer_load(mx_rs, at, 1).bitcast(fx.Float32))
        sums.append(buffer_load(sm_rs, at, 1).bitcast(fx.Float32))
        outs.append(buffer_load(po_rs, fx.Int32(select(here, (i * c.HD + d0) * 4, PAST_PARTIALS)),
                                4)
                    .bitcast(fx.Float32))
    return maxes, sums, outs


def merge_partition_group(st, maxes, sums, outs, ninf, zero):
    """The state ``st`` = ``[M, Σw, Σw·o]`` after one group: ``M`` rises to the group's live maxima
    (an empty partition enters as ``ninf``), what came before is rescaled by ``e^(M_old - M)``, and
    each partition adds ``w = ℓ·e^(m - M)``, selected (not multiplied) to 0 where ``ℓ = 0``, so
    ``M = -inf`` (every partition so far empty) never meets ``0·inf``. Returns ``(M, Σw, Σw·o)``."""
    m_run = fx.Float32(st[0])
    m_new = m_run  # the running max over partitions that saw a token
    for u in range_constexpr(REDUCE_GROUP):
        m_new = fmax(m_new, fx.Float32(select(sums[u] > 0.0, maxes[u], ninf)))
    corr = fx.Float32(select(m_new > ninf, exp2((m_run - m_new) * LOG2E), zero))
    den, acc = fx.Float32(st[1]) * corr, fx.Vector(st[2]) * splat4(corr)
    for u in range_constexpr(REDUCE_GROUP):
        w = fx.Float32(select(sums[u] > 0.0, sums[u] * exp2((maxes[u] - m_new) * LOG2E), zero))
        den, acc = den + w, acc + outs[u] * splat4(w)
    return m_new, den, acc


@device_code
def combine_partitions(c, out, pmax, psum, pout, num_kv_heads, z0, z1, first, stride, sinks,
                       lse, query_start_loc=None):
    """Merge partitions ``z0(seq) .. z1(seq)`` of this thread's row, whose stats sit at float
    ``first(seq, kvh) + z·stride``, and write its 4 channels (``c``: ``reduce_geometry``). With
    ``query_start_loc`` (ragged rows) sequence ``seq`` owns ``out`` rows ``loc[seq] ..
    loc[seq+1]``; a row past them (padding) loads no partial and writes nothing."""
    tid = fx.Int32(gpu.thread_id("x"))
    seq = fx.Int32(gpu.block_id("x"))
    kvh = fx.Int32(gpu.block_id("y"))
    r = fx.Int32(gpu.block_id("z")) * c.RPW + tid // c.LPR
    rc = imin(r, c.ROWS - 1)  # rows past the end compute a real row's result and do not store it
    d0 = (tid % c.LPR) * 4
    mx_rs, sm_rs, po_rs, o_rs = (rsrc(t) for t in (pmax, psum, pout, out))
    stat0 = first(seq, kvh) + rc  # partition z's stats at stat0 + z·stride, in floats
    ninf = fx.Float32(float("-inf"))
    zero = fx.Float32(0.0)
    lo, hi = z0(seq), z1(seq)
    ragged = None
    if const_expr(query_start_loc is not None):
        q0 = scalar_load(query_start_loc, seq)
        live_rows = (scalar_load(query_start_loc, seq + 1) - q0) * c.G
        hi = fx.Int32(select(r < live_rows, hi, lo))  # a padding row merges no partition
        ragged = (q0, live_rows)
    init = [ninf, zero, fx.Vector.filled(4, 0.0, fx.Float32)]
    for gi, st in range(0, (hi - lo + (REDUCE_GROUP - 1)) // REDUCE_GROUP, 1, init=init):
        zb = lo + fx.Int32(gi) * REDUCE_GROUP
        maxes, sums, outs = load_partition_group(c, (mx_rs, sm_rs, po_rs), stat0, stride, zb, hi,
                                                 d0)
        m_new, den, acc = merge_partition_group(st, maxes, sums, outs, ninf, zero)
        res = yield [m_new, den, acc]
    write_combined(c, res, o_rs, sinks, lse, seq, kvh, r, rc, d0, num_kv_heads, ragged)


@device_code
def write_combined(c, res, o_rs, sinks, lse, seq, kvh, r, rc, d0, num_kv_heads, ragged=None):
    """The row's merged state ``res`` = ``[M, Σw, Σw·o]`` to its 4 channels of ``out`` (with the
    sink's share taken out if ``c.SINKS``) and, if ``c.LSE``, its log-sum-exp to ``lse``;
    ``ragged``: ``(first out row, live rows)`` of the sequence's ragged rows."""
    zero = fx.Float32(0.0)
    den = fx.Float32(res[1])
    inv = fx.Float32(select(den > 0.0, rcp(den), zero))
    qi = rc // c.G
    lse2 = None
    if const_expr(c.SINKS or c.LSE):
        # the keys' log-sum-exp in log2 units: -inf when no partition saw a key (M = -inf, den 0)
        lse2 = fx.Float32(res[0]) * LOG2E + log2(den)
        if const_expr(c.SINKS):
            sink2 = buffer_load(rsrc(sinks), (kvh * c.G + rc - qi * c.G) * 4, 1).bitcast(
                fx.Float32) * LOG2E
            g, lse2 = with_sink(lse2, sink2)
            inv = inv * g
    o = fx.Vector(res[2]) * splat4(inv)
    live, base = c.ROWS, seq * c.QL
    if const_expr(ragged is not None):
        base, live = ragged
    if r < live:
        orow = (base + qi) * (num_kv_heads * c.G) + kvh * c.G + (rc - qi * c.G)
        buffer_store(o.to(c.QDT).bitcast(fx.Int32), o_rs, (orow * c.HD + d0) * 2)
        if const_expr(c.LSE):
            if d0 == 0:
                buffer_store(fx.Float32(lse2 * (1.0 / LOG2E)).bitcast(fx.Int32), rsrc(lse),
                             orow * 4)


@functools.lru_cache(maxsize=None)
def build_reduce(head_dim, group, query_length, q_dtype="f16", balanced=False, sinks=False,
                 lse=False, ragged=False):
    """The ``@flyc.jit`` flash-combine ``launch(out, pmax, psum, pout, num_seqs, num_kv_heads,
    num_partitions, sinks, lse)`` for one (head_dim, group, query_length, query dtype):
    partials ``pmax``/``psum`` [S, kvh, NP, rows], ``pout`` [S, kvh, NP, rows, head_dim]
    (float32) -> ``out`` [S·query_length, kvh·group, head_dim] (f16/bf16) = ``Σ w·o / Σ w``,
    ``w = ℓ·exp(m - max m)`` (live partitions; 0 where ℓ = 0, ``out`` 0 if Σ w = 0).
    ``balanced``: a work list's partials [entries, kvh, rows(, head_dim)], ``launch(out, pmax,
    psum, pout, offsets, num_seqs, num_kv_heads, sinks, lse)``: sequence s merges entries
    ``offsets[s] .. offsets[s+1]``. ``sinks``/``lse`` (chapter 08): read/written only when their
    flag is set (else any tensor). ``ragged``: the rows of ``query_start_loc``, a last argument
    (``build_ragged_reduce``)."""
    c = reduce_geometry(head_dim, group, query_length, q_dtype, sinks, lse)
    if ragged:
        return build_ragged_reduce(c, balanced)
    return listed_reduce(c) if balanced else uniform_reduce(c)


def uniform_reduce(c):
    """``build_reduce``'s launcher for a uniform split's partials."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                     num_kv_heads: fx.Int32, num_partitions: fx.Int32, sinks: fx.Tensor,
                     lse: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads, lambda seq: 0,
                           lambda seq: num_partitions,
                           lambda seq, kvh: (seq * num_kv_heads + kvh) * num_partitions * ROWS,
                           ROWS, sinks, lse)

    @flyc.jit
    def launch(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
               num_seqs: fx.Int32,
               num_kv_heads: fx.Int32, num_partitions: fx.Int32, sinks: fx.Tensor, lse: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6(out, pmax, psum, pout, num_kv_heads, num_partitions, sinks, lse).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch


def listed_reduce(c):
    """``build_reduce``'s launcher for a work list's partials (sequence s: ``offsets[s] ..
    offsets[s+1]``)."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                            offsets: fx.Tensor, num_kv_heads: fx.Int32, sinks: fx.Tensor,
                            lse: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads,
                           lambda seq: scalar_load(offsets, seq),
                           lambda seq: scalar_load(offsets, seq + 1),
                           lambda seq, kvh: kvh * ROWS, num_kv_heads * ROWS, sinks, lse)

    @flyc.jit
    def launch_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                      offsets: fx.Tensor, num_seqs: fx.Int32, num_kv_heads: fx.Int32,
                      sinks: fx.Tensor, lse: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6_listed(out, pmax, psum, pout, offsets, num_kv_heads, sinks, lse).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch_listed


def build_ragged_reduce(c, balanced):
    """``build_reduce`` for ragged query rows: sequence s writes ``out`` rows ``loc[s] ..
    loc[s+1]`` (``c.QL`` is their bound); ``query_start_loc`` after the sinks and lse places."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z
    if balanced:
        return listed_ragged_reduce(c)

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6_ragged(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                            num_kv_heads: fx.Int32, num_partitions: fx.Int32, sinks: fx.Tensor,
                            lse: fx.Tensor, query_start_loc: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads, lambda seq: 0,
                           lambda seq: num_partitions,
                           lambda seq, kvh: (seq * num_kv_heads + kvh) * num_partitions * ROWS,
                           ROWS, sinks, lse, query_start_loc)

    @flyc.jit
    def launch(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
               num_seqs: fx.Int32, num_kv_heads: fx.Int32, num_partitions: fx.Int32,
               sinks: fx.Tensor, lse: fx.Tensor, query_start_loc: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6_ragged(out, pmax, psum, pout, num_kv_heads, num_partitions, sinks, lse,
                            query_start_loc).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch


def listed_ragged_reduce(c):
    """``build_ragged_reduce`` for a work list's partials."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6_listed_ragged(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor,
                                   pout: fx.Tensor, offsets: fx.Tensor, num_kv_heads: fx.Int32,
                                   sinks: fx.Tensor, lse: fx.Tensor, query_start_loc: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads,
                           lambda seq: scalar_load(offsets, seq),
                           lambda seq: scalar_load(offsets, seq + 1),
                           lambda seq, kvh: kvh * ROWS, num_kv_heads * ROWS, sinks, lse,
                           query_start_loc)

    @flyc.jit
    def launch_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                      offsets: fx.Tensor, num_seqs: fx.Int32, num_kv_heads: fx.Int32,
                      sinks: fx.Tensor, lse: fx.Tensor, query_start_loc: fx.Tensor,
                      stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6_listed_ragged(out, pmax, psum, pout, offsets, num_kv_heads, sinks, lse,
                                   query_start_loc).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch_listed


def choose_num_partitions_budget(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128,
                                 group=8,
                                 query_length=1, cu_count=None):
    """The rule of thumb (the default before the timing model chose): the split-K partition count.

    Aims for ``WORKGROUPS_PER_CU × cu_count`` workgroups of the partial kernel while giving every
    partition at least ``MIN_TILES_PER_PARTITION`` 256-token tiles and keeping the partials'
    bytes under ``PARTIAL_BYTES_BUDGET`` of the K/V bytes, then rounds so the longest
    sequence's tiles split evenly (no trailing empty partition). ``cu_count``: the device's
    (``pa_tile.backend.cu_count``); None takes the flagship part of ``arch`` (``pa_tile.arch``).
    """
    if cu_count is None:
        cu_count = _arch.info(arch).cu_count
    m_groups = s5.plan(head_dim, group, query_length)[3]
    base = max(1, num_seqs * num_kv_heads * m_groups)
    tiles = max(1, -(-max_context // TILE))
    want = -(-WORKGROUPS_PER_CU * cu_count // base)
    cap = max(1, tiles // MIN_TILES_PER_PARTITION)
    # each partition writes rows × (head_dim + 2) floats per KV head that the reduce reads back;
    # the KV head's K and V are 2 × 256 × head_dim fp8 bytes per tile
    rows = group * query_length
    budget = int(PARTIAL_BYTES_BUDGET * tiles * 2 * TILE * head_dim // (rows * (head_dim + 2) * 4))
    parts = max(1, min(want, cap, budget, MAX_PARTITIONS))
    per = -(-tiles // parts)
    return -(-tiles // per)


#: how ``choose_num_partitions`` decides by default: "model" (the timing model's table, capped
#: at :data:`TRAFFIC_CAP`), "fastest" (the table uncapped) or "budget" (the rule of thumb above)
DEFAULT_POLICY = "model"
#: the "model" policy's split may load at most this many times the call's compulsory bytes
#: (``pa_tile.perf.tracing.compulsory_bytes``; issue #12: decode is memory-bound, bytes are the
#: metric)
TRAFFIC_CAP = 1.05
#: the first-principles extra bytes of a split (:func:`split_extra_bytes`) times this bound what
#: the emulator measures a split loading beyond the unsplit call (query and page-id re-reads at
#: partition edges): ``tests/test_traffic.py`` checks it
SPLIT_EXTRA_MARGIN = 1.25


@functools.lru_cache(maxsize=None)
def partition_table():
    """``pa_tile/data/partition_table.json``: the partition count the timing model
    (``pa_tile.perf.model``) predicts fastest, per configuration and (sequences × KV heads, tiles)
    grid point; written by ``scripts/partition_table.py``. MODEL PREDICTIONS, not measurements."""
    import importlib.resources
    import json

    return json.loads((importlib.resources.files(
        "pa_tile") / "data" / "partition_table.json").read_text())


def _nearest(values, x):
    """Index of the value nearest to ``x`` on a log scale."""
    lx = math.log(max(x, 1e-9))
    return min(range(len(values)), key=lambda i: abs(math.log(values[i]) - lx))


def split_extra_bytes(num_seqs, num_kv_heads, head_dim, group, query_length, num_partitions,
                      query_bytes=2):
    """Bytes a split into ``num_partitions`` loads beyond the unsplit call, from first principles:
    every partition after the first re-reads its KV head's query rows, and the reduce reads each
    partition's float32 partials back (``rows × (head_dim + 2)``: output, max, sum)."""
    if num_partitions <= 1:
        return 0
    rows = group * query_length
    per_head = (num_partitions
                - 1) * rows * head_dim * query_bytes + num_partitions * rows * (head_dim + 2) * 4
    return num_seqs * num_kv_heads * per_head


@functools.lru_cache(maxsize=1024)  # one shape's bytes, asked once per candidate split
def _uniform_compulsory_bytes(num_seqs, num_kv_heads, max_context, head_dim, group, query_length,
                              block_size,
                              per_token, query_bytes):
    """``pa_tile.perf.tracing.compulsory_bytes`` with every sequence at ``max_context``."""
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.perf.tracing import compulsory_bytes

    return compulsory_bytes(DecodeShape(
        batch=num_seqs, context=max(1, max_context), num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, query_length=query_length,
        scales="per-token" if per_token else "per-tensor", query_bytes=query_bytes))


def within_traffic_cap(num_seqs, num_kv_heads, max_context, num_partitions, *, head_dim=128,
                       group=8,
                       query_length=1, block_size=16, per_token=False, query_bytes=2):
    """Whether a split of ``num_partitions`` keeps the call at or under :data:`TRAFFIC_CAP` x its
    compulsory bytes: the unsplit call taken at its compulsory bytes (every sequence at
    ``max_context``), plus :data:`SPLIT_EXTRA_MARGIN` x :func:`split_extra_bytes`."""
    extra = SPLIT_EXTRA_MARGIN * split_extra_bytes(num_seqs, num_kv_heads, head_dim, group,
                                                   query_length,
                                                   num_partitions, query_bytes)
    need = _uniform_compulsory_bytes(num_seqs, num_kv_heads, max_context, head_dim, group,
                                     query_length,
                                     block_size, per_token, query_bytes)
    return extra <= (TRAFFIC_CAP - 1.0) * need


def tabled_split(num_seqs, num_kv_heads, tiles, *, arch, head_dim, group, query_length, cu_count):
    """The timing model's split of ``tiles`` 256-token tiles, from :func:`partition_table`:
    ``(partitions, tiles per partition)``. The part tabled for ``arch`` whose CU count is nearest
    ``cu_count`` (MI300X 304 / MI308X 80 for gfx942, MI355X 256 for gfx950), the configuration
    sampled nearest to this one (nearest head_dim, then query rows ``group × query_length``, then
    query length), the grid point nearest on a log scale to ``num_seqs × num_kv_heads`` (scaled by
    the part's CU count over ``cu_count``, exact for a tabled part) and to ``tiles``; it keeps that
    point's tiles per partition, then rounds so the tiles split evenly."""
    table = partition_table()
    rows = group * query_length
    configs = [c for c in table["configs"] if c["arch"] == arch]
    part = min({c["cu_count"] for c in configs}, key=lambda n: abs(math.log2(n / max(1, cu_count))))
    configs = [c for c in configs if c["cu_count"] == part]
    c = min(configs, key=lambda c: (abs(math.log2(c["head_dim"] / head_dim)),
                                    abs(math.log2(c["group"] * c["query_length"] / rows)),
                                    abs(c["query_length"] - query_length)))
    i = _nearest(table["seq_heads"], num_seqs * num_kv_heads * c["cu_count"] / max(1, cu_count))
    j = _nearest(table["tiles"], tiles)
    per = -(-table["tiles"][j] // c["best"][i][j])  # the grid point's tiles per partition
    parts = max(1, min(-(-tiles // per), MAX_PARTITIONS))
    per = -(-tiles // parts)
    return -(-tiles // per), per


def choose_num_partitions(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128, group=8,
                          query_length=1,
                          cu_count=None, policy=None, block_size=16, per_token=False,
                          query_bytes=2):
    """The split-K partition count for a problem shape (1 = no split, no reduce).

    ``policy`` (None: :data:`DEFAULT_POLICY`) ``"model"``: the timing model's choice, looked up in
    :func:`partition_table` (no emulator, no model at plan time; :func:`tabled_split` says how);
    then the largest even split not above it whose bytes stay within :data:`TRAFFIC_CAP`
    (:func:`within_traffic_cap`, which reads ``block_size``, ``per_token`` scales and
    ``query_bytes``). ``"fastest"``: the table's count uncapped (at small batches with many query
    rows the model predicts it up to ~1.5x faster, for up to ~1.6x the compulsory bytes: chapter
    07's appendix). ``"budget"``: :func:`choose_num_partitions_budget`, the earlier rule of thumb.
    ``cu_count``: the device's (``pa_tile.backend.cu_count``); None takes the flagship part of
    ``arch`` (``pa_tile.arch``).
    """
    policy = DEFAULT_POLICY if policy is None else policy
    if policy == "budget":
        return choose_num_partitions_budget(num_seqs, num_kv_heads, max_context, arch=arch,
                                            head_dim=head_dim,
                                            group=group, query_length=query_length,
                                            cu_count=cu_count)
    if policy not in ("model", "fastest"):
        raise ValueError(f"policy: expected 'model', 'fastest' or 'budget', got {policy!r}")
    if cu_count is None:
        cu_count = _arch.info(arch).cu_count
    _arch.check_arch(arch)
    tiles = max(1, -(-max_context // TILE))
    parts, per = tabled_split(num_seqs, num_kv_heads, tiles, arch=arch, head_dim=head_dim,
                              group=group,
                              query_length=query_length, cu_count=cu_count)
    if policy == "model":
        while parts > 1 and not within_traffic_cap(num_seqs, num_kv_heads, max_context, parts,
                                                   head_dim=head_dim,
                                                   group=group, query_length=query_length,
                                                   block_size=block_size,
                                                   per_token=per_token, query_bytes=query_bytes):
            per += 1
            parts = -(-tiles // per)  # the next smaller even split
    return parts


#: how a split lays its work out: "balanced" (a work list, "Ragged batches") or "uniform" (each
#: sequence in ``num_partitions`` equal ranges of its own tiles)
DEFAULT_SCHEDULE = "balanced"
SCHEDULES = ("balanced", "uniform")


def choose_schedule(num_partitions, schedule=None):
    """The layout of a call's work: ``schedule`` if given (``"balanced"`` also balances an
    unsplit call: a work list aiming at one chunk per sequence), else :data:`DEFAULT_SCHEDULE`
    for a split and ``"uniform"`` (chapter 06's kernel, no reduce) for an unsplit call, whose
    lengths the plan cannot read without a host sync: balancing a batch of short sequences
    would add a partial per sequence, past the traffic cap."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES} or None, got {schedule!r}")
    return schedule or (DEFAULT_SCHEDULE if num_partitions > 1 else "uniform")


def chunk_floor(head_dim, group, query_length, *, block_size=16, per_token=False, query_bytes=2):
    """The fewest 256-token tiles a balanced split's chunk gets: its extra bytes (one more query
    read and one more partial's round trip, :data:`SPLIT_EXTRA_MARGIN` x) at most
    ``TRAFFIC_CAP - 1`` of its tiles' compulsory bytes (and at least
    ``MIN_TILES_PER_PARTITION``)."""
    def compulsory(ctx):
        return _uniform_compulsory_bytes(1, 1, ctx, head_dim, group, query_length, block_size,
                                         per_token, query_bytes)

    per_tile = compulsory(2 * TILE) - compulsory(TILE)
    extra = SPLIT_EXTRA_MARGIN * (split_extra_bytes(1, 1, head_dim, group, query_length, 3,
                                                    query_bytes)
                                  - split_extra_bytes(1, 1, head_dim, group, query_length, 2,
                                                      query_bytes))
    return max(MIN_TILES_PER_PARTITION, math.ceil(extra / ((TRAFFIC_CAP - 1.0) * per_tile)))


def work_entries(num_seqs, num_partitions):
    """Entries of a balanced work list aiming at ``num_seqs × num_partitions`` chunks: every
    sequence may add one short chunk, so ``num_seqs × (num_partitions + 1)`` always suffice."""
    return num_seqs * (num_partitions + 1)


def work_list_buffers(num_seqs, num_partitions, device):
    """The tensors :func:`work_list` computes in (a plan allocates them once, so a run allocates
    nothing and a captured graph replays the list's ops on its lengths)."""
    n = work_entries(num_seqs, num_partitions)
    per_seq = ("tiles", "first", "units", "chunks", "ends", "qlens", "has_rows")
    b = {k: torch.empty(num_seqs, dtype=torch.int64, device=device) for k in per_seq}
    b.update({k: torch.empty(n, dtype=torch.int64, device=device) for k in ("seq", "t0", "t1",
                                                                            "gathered")})
    b.update(per=torch.empty(1, dtype=torch.int64, device=device), x=torch.arange(n, device=device),
             live=torch.empty(n, dtype=torch.bool, device=device),
             work=torch.zeros(n, 4, dtype=torch.int32, device=device),
             offsets=torch.zeros(num_seqs + 1, dtype=torch.int32, device=device))
    return b


def tiles_to_walk(b, context_lengths, query_length, sliding_window, query_start_loc=None):
    """Per sequence, into the work list's buffers ``b``: its 256-token ``tiles``, the ``first``
    one a sliding window lets any row see, and the ``units`` between (0 for a ragged sequence
    without queries: the kernel would load nothing)."""
    S = context_lengths.shape[0]
    tiles, first, units = b["tiles"], b["first"], b["units"]
    torch.add(context_lengths, TILE - 1, out=tiles).floor_divide_(TILE)
    if query_start_loc is not None:
        qn = torch.sub(query_start_loc.narrow(0, 1, S), query_start_loc.narrow(0, 0, S),
                       out=b["qlens"])
    if sliding_window > 0 and query_start_loc is not None:  # the sequence's own rows' windows
        torch.sub(context_lengths, qn, out=first).add_(1 - sliding_window).clamp_min_(
            0).floor_divide_(TILE)
    elif sliding_window > 0:  # as the kernel's tile_range: tiles wholly before every row's window
        torch.sub(context_lengths, query_length - 1 + sliding_window,
                  out=first).clamp_min_(0).floor_divide_(TILE)
    else:
        first.zero_()
    torch.sub(tiles, first, out=units).clamp_min_(0)
    if query_start_loc is not None:
        units.mul_(torch.clamp(qn, 0, 1, out=b["has_rows"]))


def work_list(context_lengths, num_partitions, min_tiles, *, query_length=1, sliding_window=0,
              buffers=None, fixed_chunks=False, query_start_loc=None):
    """The balanced split of a batch, on ``context_lengths``' device without reading a value on
    the host: ``(work, offsets)``, ``work`` [``work_entries``, 4] int32 rows (sequence, first tile,
    end tile, 0), ``offsets`` [S + 1] int32 (sequence s owns entries
    ``offsets[s] .. offsets[s+1]``). Chunks of ``per = max(min_tiles, ceil(total /
    (S·num_partitions)))`` tiles, the tiles a sliding window skips left out. Every op writes
    into ``buffers`` (:func:`work_list_buffers`; None: allocated here), so with them given
    nothing is allocated. ``fixed_chunks``: ``per = min_tiles`` whatever the batch (batch
    invariance, chapter 08; ``num_partitions`` must then cover the longest sequence's chunks).
    ``query_start_loc`` (ragged rows): each sequence's own query count ``loc[s+1] - loc[s]``
    bounds its window's first tile, and a sequence without queries gets no chunk."""
    S = context_lengths.shape[0]
    b = buffers if buffers is not None else work_list_buffers(S, num_partitions,
                                                              context_lengths.device)
    tiles, first, units, chunks, ends, per = (b[k] for k in ("tiles", "first", "units", "chunks",
                                                             "ends", "per"))
    seq, t0, t1, g, x = (b[k] for k in ("seq", "t0", "t1", "gathered", "x"))
    tiles_to_walk(b, context_lengths, query_length, sliding_window, query_start_loc)
    target = S * num_partitions
    if fixed_chunks:
        per.fill_(min_tiles)
    else:
        torch.sum(units, 0, keepdim=True, out=per).add_(target - 1).floor_divide_(
            target).clamp_min_(min_tiles)
    torch.add(units, per, out=chunks).sub_(1).floor_divide_(per)
    torch.cumsum(chunks, 0, out=ends)
    torch.searchsorted(ends, x, right=True, out=seq).clamp_max_(S - 1)
    # gathers (index_select), not indexing: fake cuda tensors (pa_tile's CPU proofs) take them
    # t0 = first[seq] + (x - (ends[seq] - chunks[seq])) * per: the entry's place in its sequence
    torch.index_select(ends, 0, seq, out=t0).sub_(torch.index_select(chunks, 0, seq, out=g))
    torch.sub(x, t0, out=t0).mul_(per).add_(torch.index_select(first, 0, seq, out=g))
    torch.minimum(torch.add(t0, per, out=t1), torch.index_select(tiles, 0, seq, out=g), out=t1)
    # past the last chunk: empty
    torch.where(torch.lt(x, ends.narrow(0, S - 1, 1), out=b["live"]), t1, t0, out=t1)
    work, offsets = b["work"], b["offsets"]
    # add, not copy_: fake cuda tensors take an out= op, not copy_
    for col, v in enumerate((seq, t0, t1)):
        torch.add(v, 0, out=work.select(1, col))
    torch.add(ends, 0, out=offsets.narrow(0, 1, S))
    return work, offsets


def workspace_size(num_seqs, num_kv_heads, group, query_length, head_dim, num_partitions,
                   schedule="uniform"):
    """float32 elements of the workspace for one problem shape, partition count and schedule
    (1 when ``num_partitions`` is 1: a placeholder the unsplit kernel never touches; a balanced
    split's partials are per work-list entry, ``work_entries`` of them)."""
    if num_partitions <= 1 and schedule != "balanced":
        return 1
    slots = work_entries(num_seqs,
                         num_partitions) if schedule == "balanced" else num_seqs * num_partitions
    return slots * num_kv_heads * group * query_length * (head_dim + 2)


def carve(workspace, num_seqs, num_kv_heads, rows, head_dim, num_partitions):
    """``(pmax, psum, pout)`` as views of a float32 ``workspace`` (see ``workspace_size``)."""
    shape = (num_seqs, num_kv_heads, num_partitions, rows)
    n = num_seqs * num_kv_heads * num_partitions * rows
    # narrow, not slicing: the same views, and fake cuda tensors (pa_tile's CPU proofs) support it
    return (workspace.narrow(0, 0, n).view(shape), workspace.narrow(0, n, n).view(shape),
            workspace.narrow(0, 2 * n, n * head_dim).view(shape + (head_dim,)))


def make_workspace(query, key_cache, block_tables, *, query_length=None, num_partitions=None,
                   arch=None,
                   schedule=None):
    """A float32 workspace for ``paged_decode`` calls with these shapes (same validation,
    partition choice and schedule as the call: ``pa_tile.api.make_workspace``)."""
    from pa_tile import api

    return api.make_workspace(query, key_cache, block_tables, query_length=query_length,
                              num_partitions=num_partitions, arch=arch, schedule=schedule)


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, **options):
    """``(launcher, (), arch)`` after validation: ``launcher()`` runs the partial kernel and, when
    split, the reduce; ``pa_tile.toolchain.compile_isa(launcher, arch=arch)`` returns both kernels'
    assembly (partial kernel first). Options as ``paged_decode``."""
    from pa_tile import api

    out = options.pop("out", None)
    pl = api.plan(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                  value_scale, **options)
    return pl.pipeline(query, key_cache, value_cache, out=out), (), pl.problem.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, **options):
    """The finished kernel, ``pa_tile.paged_decode`` (``pa_tile.api``)."""
    from pa_tile import api

    return api.paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                            value_scale,
                            **options)
