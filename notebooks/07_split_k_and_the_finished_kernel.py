# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -all
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 06 · Split-K, the reduce, and the finished kernel
#
# Chapter 5's kernel launches one workgroup per (sequence, KV head, M-group) and walks the whole
# context inside it. That is the right shape for a big batch. It is the wrong shape for the
# decode step of one long conversation:
#
# | batch × KV heads | workgroups | MI300X (304 CUs) busy | MI355X (256 CUs) busy |
# |---|---|---|---|
# | 1 × 8 | 8 | 2.6 % | 3.1 % |
# | 4 × 8 | 32 | 10.5 % | 12.5 % |
# | 32 × 8 | 256 | 84 % | 100 % |
#
# With 8 workgroups, 296 of MI300X's CUs idle while 8 of them stream a 32k-token context each.
# Decode is bound by memory bandwidth, and one CU cannot pull more than a small share of HBM
# bandwidth. **Split-K** (flash-decoding) cuts the context into `num_partitions` contiguous ranges,
# runs them as separate workgroups (grid z), and merges the partial results with a second, tiny
# kernel: the **reduce** or *flash-combine*.
#
# This chapter adds that reduce kernel, the heuristic that picks the partition count, and the
# public entry point `pa_tile.paged_decode` that wraps everything built so far: validation, the
# workspace for the partial results (so the call allocates nothing and can be captured in a
# CUDA/HIP graph), and the two launches.

# %%
import math

import matplotlib.pyplot as plt
import torch

from pa_tile import backend, cache, figures, isa, toolchain
from pa_tile.arch import fp8_format
from pa_tile.emu.memory import format_table
from pa_tile.progress import progress as tqdm

# %% [markdown]
# Three sequences of one batch, split four ways: each partition takes a contiguous run of a
# sequence's 256-token tiles, a short sequence leaves the last partitions empty, and the reduce
# combines, per query row, what the partitions of that row's sequence wrote.

# %%
figures.split_k(context_lengths=[300, 1027, 2600], num_partitions=4)
plt.show()

# %% [markdown]
# ## The module
#
# The chapter's code is `pa_tile.stages.s6_split_k`. The partial kernel is chapter 5's
# (`pa_tile.stages.s5_phase_split_mtp`) specialized with `num_partitions` > 1: workgroup z walks a
# contiguous range of 256-token tiles and writes the partition's row max, row sum and normalized
# output. `build_reduce` merges them into the output (global max, rescaled sums, weighted outputs;
# empty partitions add nothing, never NaN). `choose_num_partitions` picks the split from the
# problem's shape and the device's CU count; `work_list` lays it out balanced for ragged batches
# (equal chunks of the batch's tiles, one workgroup each, `choose_schedule`); `workspace_size` and
# `carve` lay the partials out in one buffer. The finished API built from them (`pa_tile.plan`,
# `pa_tile.paged_decode`, the `torch.ops.pa_tile.paged_decode` op) is `pa_tile.api`; this module's
# `paged_decode` and `launch_args` are the stage contract over it.

# %% tags=["export"]
"""Stage 6: split-K partitions, the flash-combine reduce, and the finished ``paged_decode``.

Chapter 5's kernel split into partitions (``num_partitions``, or a balanced ``work_list``), the
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
from flydsl.expr import gpu, range_constexpr

from pa_tile import arch as _arch
from pa_tile.kernel_lib import (LOG2E, TILE, buffer_load, buffer_store, device_code, exp2, fmax, imin, rcp, rsrc,
                                scalar_load, select, splat4)
from pa_tile.stages import s5_phase_split_mtp as s5

__all__ = ["paged_decode", "launch_args", "build_reduce", "combine_torch", "choose_num_partitions",
           "choose_num_partitions_budget", "partition_table", "DEFAULT_POLICY", "TRAFFIC_CAP", "split_extra_bytes",
           "within_traffic_cap", "workspace_size", "carve", "make_workspace", "LIMITS",
           "MAX_PARTITIONS", "PARTIAL_BYTES_BUDGET", "DEFAULT_SCHEDULE", "SCHEDULES", "chunk_floor",
           "choose_schedule", "work_entries", "work_list", "work_list_buffers", "reduce_geometry",
           "load_partition_group", "merge_partition_group", "combine_partitions", "tabled_split"]

# %% [markdown]
# Its constants, each explained in the section that uses it: what the finished kernel supports,
# the partition heuristic's targets ("How many partitions?"), and the reduce's workgroup, the
# partitions it loads together and the offset past every partial buffer ("The reduce kernel").

# %% tags=["export"]
#: the finished kernel supports what chapter 5's does; the split is what this chapter adds
LIMITS = dataclasses.replace(s5.LIMITS, stage="s6")
#: the largest split chapter 5's kernel accepts
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

# %% [markdown]
# ## The partial results and the merge math
#
# Partition `z` of a (sequence, KV head) sees a token range `T_z`. For one query row with scores
# `s_t = softmax_scale · q·k_t` it keeps the three numbers flash attention keeps anyway, and chapter 5
# writes them out (layout in `s5.build_launcher`'s docstring):
#
# * `m_z = max_{t∈T_z} s_t` (natural-log units),
# * `ℓ_z = Σ_{t∈T_z} exp(s_t − m_z)`,
# * `o_z = Σ_{t∈T_z} exp(s_t − m_z) · v_t / ℓ_z` (the partition's own softmax output, *normalized*).
#
# The full softmax over `T = ∪ T_z` follows exactly, because `exp(s − m_z) = exp(s − M)·exp(M − m_z)`:
#
# $$M = \max_z m_z,\qquad w_z = ℓ_z\,e^{m_z − M},\qquad o = \frac{\sum_z w_z\,o_z}{\sum_z w_z}.$$
#
# Storing `o_z` normalized (instead of `Σ p·v`) keeps the partial values in the range of V whatever
# the magnitudes of `ℓ_z`, and the reduce needs one multiply-add per partition.
#
# **Numerics of the combine.** A partition may see *no* token of a row: the context is shorter than
# the partition's start, or a sliding window or the causal mask of MTP hides all of it. Chapter 5
# writes `m_z = −6.9e29` (a finite −∞), `ℓ_z = 0`, `o_z = 0` for it. The reduce must let it add
# nothing and never produce NaN:
#
# * `M` is the max over partitions **with `ℓ_z > 0`** only; empty ones enter as `−∞`.
# * `w_z` is *selected* to 0 when `ℓ_z = 0`, never computed as `0 · exp(m_z − M)`: with `M = −∞`
#   (every partition empty) that exponent is `exp(+∞)` and `0 · ∞` is NaN.
# * The output is selected to 0 when `Σ w_z = 0` (a row no partition saw: impossible for a valid
#   decode, where each row sees at least its own token, but a corrupt input must not become NaN).
# * `M ≥ m_z` for every live partition, so every `exp(m_z − M) ≤ 1`: no overflow.
#
# In torch, the numerics model the tests hold the kernel to:

# %% tags=["export"]
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

# %%
# four partitions of one row: two live, one empty, one live but far below the max
pmax = torch.tensor([[[[2.0], [-6.9e29], [0.5], [-40.0]]]])
psum = torch.tensor([[[[3.0], [0.0], [5.0], [1.0]]]])
pout = torch.tensor([[[[[1.0]], [[0.0]], [[-1.0]], [[7.0]]]]])
print("combined:", combine_torch(pmax, psum, pout, 1, 1).flatten().tolist())
print("all empty:", combine_torch(torch.full_like(pmax, -6.9e29), torch.zeros_like(psum), torch.zeros_like(pout), 1, 1).flatten().tolist())

# %% [markdown]
# ## The reduce kernel
#
# One thread per 4 output channels: a row of `head_dim` channels takes `head_dim/4` lanes (16, 32 or
# 64), so a 256-thread workgroup merges 16, 8 or 4 rows, and every partial-output load is one
# `buffer_load_dwordx4` of 16 contiguous bytes (a row's lanes read it as whole 64-byte segments).
# Grid `(num_seqs, num_kv_heads, ceil(rows / rows_per_workgroup))`: sequence and KV head come from
# the block ids, so no index is ever divided at run time (the row's `(MTP position, head)` split
# divides by the compile-time `group`).
#
# One loop over the partitions (a run-time count, so one compiled reduce serves every split), in
# groups of `REDUCE_GROUP` = 4: a group's 12 loads (`m_z`, `ℓ_z` and the 16 bytes of `o_z` for each
# of its partitions) are all issued before the first is used, so the loop waits for memory once per
# group instead of once per partition. The merge is online, as in the kernel's own loop: the
# running max `M` rises to the group's live maxima, what came before is rescaled by `e^(M_old - M)`,
# and each partition adds `w_z = ℓ_z e^(m_z - M)` to `Σ w` and `w_z o_z` to the output. A group slot
# past the last partition loads at byte offset 2^31, beyond every partial buffer (the kernel's
# 32-bit offsets keep them below it): the buffer resource's bound makes that load return 0, an empty
# partition, without fetching anything, so the tail costs no bytes and no branch. The output is
# converted to the query dtype and stored as 8 bytes per lane.
#
# An earlier version made two passes (the max, then the weighted sum), each waiting for memory once
# per partition: at the 16-way split of chapter 8's shape the timing model of the time put it at
# 15 µs of a 48 µs call on MI300X, and the grouped pass at 5 µs, 2 of them the launch (a model's
# figures, not measurements; today's is the `reduce` term of chapter 8's predictions).

# %% tags=["export"]
def reduce_geometry(head_dim, group, query_length, q_dtype="f16"):
    """The reduce's compile-time sizes for one (head_dim, group, query_length, query dtype), checked:
    ``HD``, ``G``, ``QL``; ``ROWS`` query rows per (sequence, KV head); ``LPR`` lanes per row (4
    channels, one dwordx4, each); ``RPW`` rows per workgroup; ``GRID_Z`` workgroups per (sequence,
    KV head); ``QDT`` the output dtype."""
    if head_dim % 64 or not 64 <= head_dim <= 256:
        raise ValueError(f"unsupported head_dim={head_dim} (64, 128 or 256)")
    if not (1 <= group <= s5.LIMITS.max_group and 1 <= query_length <= s5.LIMITS.max_query_length):
        raise ValueError(f"unsupported group={group}, query_length={query_length}")
    rows = group * query_length
    lanes = head_dim // 4  # lanes per row: 4 channels (one dwordx4) each
    rows_per_wg = REDUCE_THREADS // lanes
    return types.SimpleNamespace(HD=head_dim, G=group, QL=query_length, ROWS=rows, LPR=lanes, RPW=rows_per_wg,
                                 QDT=fx.BFloat16 if q_dtype == "bf16" else fx.Float16,
                                 GRID_Z=(rows + rows_per_wg - 1) // rows_per_wg)

# %% [markdown]
# A group's loads, all issued before the first is used, so the loop waits for memory once per
# group. A slot past the last partition loads at `PAST_PARTIALS`: it reads an empty partition and
# fetches nothing, so the tail of the last group needs no branch.

# %% tags=["export"]
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
        outs.append(buffer_load(po_rs, fx.Int32(select(here, (i * c.HD + d0) * 4, PAST_PARTIALS)), 4)
                    .bitcast(fx.Float32))
    return maxes, sums, outs

# %% [markdown]
# The online merge of one group into the running state `(M, Σ w, Σ w·o)`, as in the kernel's own
# loop. Empty partitions are *selected* away, never multiplied by 0, so an all-empty prefix
# (`M = −∞`) never meets `0 · ∞`.

# %% tags=["export"]
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

# %% [markdown]
# One thread's whole job: find its row and channels from the thread and block ids, loop over the
# row's partitions a group at a time, then divide by `Σ w` (0 for a row no partition saw) and
# store the row's 4 channels in the query dtype. Where a sequence's partitions are is passed in
# (`z0`, `z1`, `first`, `stride`), so one body serves the uniform split and the work list.

# %% tags=["export"]
@device_code
def combine_partitions(c, out, pmax, psum, pout, num_kv_heads, z0, z1, first, stride):
    """Merge partitions ``z0(seq) .. z1(seq)`` of this thread's row, whose stats sit at float
    ``first(seq, kvh) + z·stride``, and write its 4 channels (``c``: ``reduce_geometry``)."""
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
    init = [ninf, zero, fx.Vector.filled(4, 0.0, fx.Float32)]
    for gi, st in range(0, (hi - lo + (REDUCE_GROUP - 1)) // REDUCE_GROUP, 1, init=init):
        zb = lo + fx.Int32(gi) * REDUCE_GROUP
        maxes, sums, outs = load_partition_group(c, (mx_rs, sm_rs, po_rs), stat0, stride, zb, hi, d0)
        m_new, den, acc = merge_partition_group(st, maxes, sums, outs, ninf, zero)
        res = yield [m_new, den, acc]
    den = fx.Float32(res[1])
    inv = fx.Float32(select(den > 0.0, rcp(den), zero))
    o = fx.Vector(res[2]) * splat4(inv)
    if r < c.ROWS:
        qi = rc // c.G
        orow = (seq * c.QL + qi) * (num_kv_heads * c.G) + kvh * c.G + (rc - qi * c.G)
        buffer_store(o.to(c.QDT).bitcast(fx.Int32), o_rs, (orow * c.HD + d0) * 2)

# %% [markdown]
# The two launchers: a uniform split's partitions of a (sequence, KV head) are `num_partitions`
# consecutive slots; a work list's are the entries `offsets[s] .. offsets[s+1]` of sequence `s`.
# Grid `(num_seqs, num_kv_heads, GRID_Z)` either way.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_reduce(head_dim, group, query_length, q_dtype="f16", balanced=False):
    """The ``@flyc.jit`` flash-combine launcher ``launch(out, pmax, psum, pout, num_seqs,
    num_kv_heads, num_partitions)`` for one (head_dim, group, query_length, query dtype).

    Reads chapter 5's partials (``pmax``/``psum`` [S, kvh, NP, rows], ``pout`` [S, kvh, NP, rows,
    head_dim], float32) and writes ``out`` [S·query_length, kvh·group, head_dim] (contiguous, f16 or
    bf16): ``M = max_{ℓ>0} m``, ``w = ℓ·exp(m - M)`` (0 where ℓ = 0), ``out = Σ w·o / Σ w`` (0 if Σ w = 0).
    ``balanced``: the partials of a work list instead (``[entries, kvh, rows(, head_dim)]``, see
    "Ragged batches"), ``launch(out, pmax, psum, pout, offsets, num_seqs, num_kv_heads)``:
    sequence s merges entries ``offsets[s] .. offsets[s+1]``.
    """
    c = reduce_geometry(head_dim, group, query_length, q_dtype)
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    if balanced:
        @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
        def pa_reduce_s6_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                                offsets: fx.Tensor, num_kv_heads: fx.Int32):
            combine_partitions(c, out, pmax, psum, pout, num_kv_heads, lambda seq: scalar_load(offsets, seq),
                               lambda seq: scalar_load(offsets, seq + 1), lambda seq, kvh: kvh * ROWS,
                               num_kv_heads * ROWS)

        @flyc.jit
        def launch_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor, offsets: fx.Tensor,
                          num_seqs: fx.Int32, num_kv_heads: fx.Int32, stream: fx.Stream = fx.Stream(None)):
            pa_reduce_s6_listed(out, pmax, psum, pout, offsets, num_kv_heads).launch(
                grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

        return launch_listed

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                     num_kv_heads: fx.Int32, num_partitions: fx.Int32):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads, lambda seq: 0, lambda seq: num_partitions,
                           lambda seq, kvh: (seq * num_kv_heads + kvh) * num_partitions * ROWS, ROWS)

    @flyc.jit
    def launch(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
               num_seqs: fx.Int32, num_kv_heads: fx.Int32, num_partitions: fx.Int32,
               stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6(out, pmax, psum, pout, num_kv_heads, num_partitions).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch

# %% [markdown]
# The reduce on its own, on synthetic partials with the corner cases planted (gfx942 and gfx950,
# emulated): partition 1 of (seq 0, KV head 0) empty for every row, every partition empty for one
# row, and ordinary rows. It must agree with the torch model to the query dtype's rounding, with no NaN.

# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"
DEV = backend.device_for_tensors()

# %% tags=["nbval-ignore-output"]
from pa_tile import launching  # noqa: E402


def synthetic_partials(S, kvh, NP, rows, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    pmax = torch.randn(S, kvh, NP, rows, generator=g) * 4
    psum = torch.rand(S, kvh, NP, rows, generator=g) * 50 + 1
    pout = torch.randn(S, kvh, NP, rows, hd, generator=g)
    for sel in ((0, 0, NP - 1), (S - 1, kvh - 1, slice(None), rows - 1)):  # an empty partition; an all-empty row
        pmax[sel], psum[sel], pout[sel] = -6.9e29, 0.0, 0.0
    return pmax, psum, pout


def run_reduce(arch, pmax, psum, pout, ql, g, qdt):
    S, kvh, NP, rows, hd = pout.shape
    out = torch.full((S * ql, kvh * g, hd), float("nan"), dtype=qdt, device=DEV)
    launcher = build_reduce(hd, g, ql, "bf16" if qdt == torch.bfloat16 else "f16")
    launching.launch(launcher, (out, pmax.to(DEV), psum.to(DEV), pout.to(DEV), S, kvh, NP), arch=arch)
    return out.cpu()


rrows = []
for arch in backend.runnable_archs():
    for (S, kvh, NP, ql, g, hd, qdt) in ((2, 2, 3, 2, 5, 64, torch.float16), (1, 3, 7, 4, 8, 128, torch.bfloat16),
                                         (2, 1, 1, 1, 4, 256, torch.float16)):
        pm, ps, po = synthetic_partials(S, kvh, NP, ql * g, hd)
        out = run_reduce(arch, pm, ps, po, ql, g, qdt).float()
        want = combine_torch(pm, ps, po, ql, g)
        err = (out - want).abs().max().item()
        rrows.append(dict(arch=arch, seqs=S, kv_heads=kvh, partitions=NP, query_len=ql, group=g, head_dim=hd,
                          dtype=str(qdt)[6:], max_err=f"{err:.1e}", finite=bool(torch.isfinite(out).all()),
                          all_empty_row_is_0=bool((out[-1, -1] == 0).all())))
print(format_table(rrows))
assert all(r["finite"] and r["all_empty_row_is_0"] and float(r["max_err"]) < 2**-7 * 8 for r in rrows)

# %% [markdown]
# ## How many partitions?
#
# More partitions fill more CUs but cost something each: a partition pays chapter 5's prologue
# (load and quantize Q, fetch the first page ids) and its four-wave merge, and writes
# `rows × (head_dim + 2)` floats that the reduce reads back. Two policies balance the two. The
# **default is the timing model's** (`pa_tile.perf.model`, chapter 8): the count it predicts
# fastest, looked up in a table it precomputed (below). The **rule of thumb** it replaced,
# `choose_num_partitions_budget` (`policy="budget"`), is still here, because it explains the
# trade-off in three lines:
#
# 1. **Enough workgroups.** Without a split there are `batch × kv_heads × m_groups` workgroups.
#    The target is `4 × CUs` of them (1216 on MI300X, 1024 on MI355X): the finished kernel runs 4–5
#    waves per SIMD, i.e. 4 resident 4-wave workgroups per CU, so one full round of residency keeps
#    every CU's memory pipeline busy; beyond that a split only adds partials.
# 2. **Enough work per partition, few bytes of partials.** Every partition gets at least
#    `MIN_TILES_PER_PARTITION = 2` tiles (512 tokens, 128 KB of K+V at head_dim 128), and all
#    partitions' partials together stay under `PARTIAL_BYTES_BUDGET = 3 %` of the K and V bytes the
#    call must read: decode is memory-bound, and the partials are bytes the unsplit kernel never
#    moves. Per KV head that is `P ≤ 0.03 · tiles · 512 · head_dim / (4 · rows · (head_dim + 2))`,
#    about `3.8 · tiles / rows`: 8 query rows may split a 5-tile context in 2, 16 rows not at all,
#    and a 128-tile context up to 61 or 30 ways.
# 3. **No idle tail.** The split is rounded so the longest sequence's tiles divide evenly:
#    `tiles per partition = ceil(tiles / P)`, then `P = ceil(tiles / tiles per partition)`.
#
# The context length is read from **shapes**, not values: `block_tables.shape[1] × block_size`,
# the most tokens any sequence can have. Reading `context_lengths` would synchronize with the GPU
# and could not be captured in a graph, and a graph replay must launch the same grid every time.
# Shorter sequences of the batch simply leave their last partitions empty, which the reduce handles.

# %% tags=["export"]
def choose_num_partitions_budget(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128, group=8,
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


# %% [markdown]
# The default is the timing model's choice (below) within a traffic cap: a split may load at
# most 1.05x the call's compulsory bytes (decode is memory-bound; bytes are the metric), so the
# model's count is lowered to the largest even split whose partials fit. `policy="fastest"` takes
# the model's count uncapped, and the rule above stays as the `"budget"` policy; the model's
# table is read once per process.

# %% tags=["export"]
#: how ``choose_num_partitions`` decides by default: "model" (the timing model's table, capped
#: at :data:`TRAFFIC_CAP`), "fastest" (the table uncapped) or "budget" (the rule of thumb above)
DEFAULT_POLICY = "model"
#: the "model" policy's split may load at most this many times the call's compulsory bytes
#: (``pa_tile.perf.tracing.compulsory_bytes``; issue #12: decode is memory-bound, bytes are the metric)
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

    return json.loads((importlib.resources.files("pa_tile") / "data" / "partition_table.json").read_text())


def _nearest(values, x):
    """Index of the value nearest to ``x`` on a log scale."""
    lx = math.log(max(x, 1e-9))
    return min(range(len(values)), key=lambda i: abs(math.log(values[i]) - lx))

# %% [markdown]
# The traffic cap in bytes. What a split adds is known from first principles: each partition after
# the first re-reads its KV head's query rows, and the reduce reads every partition's partials
# back. The cap compares that (with `SPLIT_EXTRA_MARGIN` for what the emulator measures on top) with
# the unsplit call's compulsory bytes.

# %% tags=["export"]
def split_extra_bytes(num_seqs, num_kv_heads, head_dim, group, query_length, num_partitions, query_bytes=2):
    """Bytes a split into ``num_partitions`` loads beyond the unsplit call, from first principles:
    every partition after the first re-reads its KV head's query rows, and the reduce reads each
    partition's float32 partials back (``rows × (head_dim + 2)``: output, max, sum)."""
    if num_partitions <= 1:
        return 0
    rows = group * query_length
    per_head = (num_partitions - 1) * rows * head_dim * query_bytes + num_partitions * rows * (head_dim + 2) * 4
    return num_seqs * num_kv_heads * per_head


@functools.lru_cache(maxsize=1024)  # one shape's bytes, asked once per candidate split
def _uniform_compulsory_bytes(num_seqs, num_kv_heads, max_context, head_dim, group, query_length, block_size,
                              per_token, query_bytes):
    """``pa_tile.perf.tracing.compulsory_bytes`` with every sequence at ``max_context``."""
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.perf.tracing import compulsory_bytes

    return compulsory_bytes(DecodeShape(
        batch=num_seqs, context=max(1, max_context), num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, query_length=query_length,
        scales="per-token" if per_token else "per-tensor", query_bytes=query_bytes))


def within_traffic_cap(num_seqs, num_kv_heads, max_context, num_partitions, *, head_dim=128, group=8,
                       query_length=1, block_size=16, per_token=False, query_bytes=2):
    """Whether a split of ``num_partitions`` keeps the call at or under :data:`TRAFFIC_CAP` x its
    compulsory bytes: the unsplit call taken at its compulsory bytes (every sequence at
    ``max_context``), plus :data:`SPLIT_EXTRA_MARGIN` x :func:`split_extra_bytes`."""
    extra = SPLIT_EXTRA_MARGIN * split_extra_bytes(num_seqs, num_kv_heads, head_dim, group, query_length,
                                                   num_partitions, query_bytes)
    need = _uniform_compulsory_bytes(num_seqs, num_kv_heads, max_context, head_dim, group, query_length,
                                     block_size, per_token, query_bytes)
    return extra <= (TRAFFIC_CAP - 1.0) * need

# %% [markdown]
# The table lookup: the tabled GPU part nearest in CU count (bandwidth per CU differs between
# parts, so an 80-CU part is not a 304-CU part with more sequences), the sampled configuration
# nearest in head_dim and query rows, and the grid point nearest in work; its tiles per partition,
# rounded so this context's tiles split evenly.

# %% tags=["export"]
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

# %% [markdown]
# The chooser: the policy, the table's split, and (for the default policy) that split lowered to
# the largest even split whose bytes stay within the traffic cap.

# %% tags=["export"]
def choose_num_partitions(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128, group=8, query_length=1,
                          cu_count=None, policy=None, block_size=16, per_token=False, query_bytes=2):
    """The split-K partition count for a problem shape (1 = no split, no reduce).

    ``policy`` (None: :data:`DEFAULT_POLICY`) ``"model"``: the timing model's choice, looked up in
    :func:`partition_table` (no emulator, no model at plan time; :func:`tabled_split` says how);
    then the largest even split not above it whose bytes stay within :data:`TRAFFIC_CAP`
    (:func:`within_traffic_cap`, which reads ``block_size``, ``per_token`` scales and
    ``query_bytes``). ``"fastest"``: the table's count uncapped (at small batches with many query
    rows the model predicts it up to ~1.5x faster, for up to ~1.6x the compulsory bytes: chapter
    06). ``"budget"``: :func:`choose_num_partitions_budget`, the earlier rule of thumb.
    ``cu_count``: the device's (``pa_tile.backend.cu_count``); None takes the flagship part of
    ``arch`` (``pa_tile.arch``).
    """
    policy = DEFAULT_POLICY if policy is None else policy
    if policy == "budget":
        return choose_num_partitions_budget(num_seqs, num_kv_heads, max_context, arch=arch, head_dim=head_dim,
                                            group=group, query_length=query_length, cu_count=cu_count)
    if policy not in ("model", "fastest"):
        raise ValueError(f"policy: expected 'model', 'fastest' or 'budget', got {policy!r}")
    if cu_count is None:
        cu_count = _arch.info(arch).cu_count
    _arch.check_arch(arch)
    tiles = max(1, -(-max_context // TILE))
    parts, per = tabled_split(num_seqs, num_kv_heads, tiles, arch=arch, head_dim=head_dim, group=group,
                              query_length=query_length, cu_count=cu_count)
    if policy == "model":
        while parts > 1 and not within_traffic_cap(num_seqs, num_kv_heads, max_context, parts, head_dim=head_dim,
                                                   group=group, query_length=query_length, block_size=block_size,
                                                   per_token=per_token, query_bytes=query_bytes):
            per += 1
            parts = -(-tiles // per)  # the next smaller even split
    return parts

# %%
from pa_tile.arch import info as arch_info  # noqa: E402

hrows = []
for batch, kvh in ((1, 8), (4, 8), (16, 8), (64, 8), (256, 8), (8, 1)):
    row = dict(batch=batch, kv_heads=kvh)
    for ctx in (1024, 4096, 32768):
        for arch in ("gfx942", "gfx950"):
            P = choose_num_partitions_budget(batch, kvh, ctx, arch=arch)
            row[f"{ctx // 1024}k {arch}"] = f"{P} ({batch * kvh * P / arch_info(arch).cu_count:.1f}/CU)"
    hrows.append(row)
print("rule of thumb: partitions (workgroups per CU), group 8, query_length 1, head_dim 128")
print(format_table(hrows))

# %% [markdown]
# Read the table by rows (the rule of thumb's choices). One sequence of 32k tokens on 8 KV heads: 43 partitions of 3 tiles,
# 1.1 workgroups per CU instead of 0.03; the partials' byte budget, not the CU count, stops it
# there (64 partitions of 2 tiles would read 3.2 % of the K/V bytes again as partials). At 4k
# tokens the budget allows 6 (3 tiles each), at 1k none: a 4-tile context is read by one
# workgroup per KV head, and its latency, not bandwidth, bounds the call. A batch of 64 × 8
# heads (512 workgroups) is topped up to 4–5 per CU by a 2–3-way split; at 256 × 8 nothing
# splits. MI355X has fewer CUs, so it splits a little less for the same problem.
#
# ### The timing model decides
#
# The rule's 3 % budget is a guess about a trade the timing model can price: chapter 8's model
# predicts a launch's time from the compiled code and an emulator sample, including what a split
# adds (each partition's prologue and merge, the partials' bytes, the reduce kernel, the grid's
# waves over the CUs). `scripts/partition_table.py` runs it for stage 6 over a grid (sequences ×
# KV heads from 1 to 4096, contexts of 1 to 512 tiles, four points per octave; 10 head_dim /
# group / query-length configurations per part: MI300X, MI355X, and the 80-CU MI308X, whose
# bandwidth per CU is 3.8x the MI300X's, so it is not a MI300X with more sequences) and writes
# the fastest count per point to `pa_tile/data/partition_table.json`, taking a larger count only
# when it is predicted more than 2 % faster. `choose_num_partitions` looks the shape up there: no
# emulator and no model at plan time, a dictionary lookup. Below: the model's predicted time
# against the partition count for four shapes, the rule of thumb's choice (open square) and the
# table's (star).
#
# How far to trust it: the model's held-out error is in `pa_tile/data/model_validation.md`
# (measured on an 80-CU MI308X, the machine the seed kernel's commit messages were timed on), and
# its weakest spot is exactly this trade: the steps of the seed kernel's history that changed only
# the partition count (batch 64-256) are predicted in the right direction but not to size (batch
# 96: measured 26 % faster, predicted 16 %; production's split count at batch 64: measured 7 %
# slower, predicted 33 %). Four more partition steps, measured on one later version of that
# kernel (2154f0cf, in the comment on its split heuristic), were recorded and then predicted by
# this model before it had seen them (the report's "Fresh steps from the later history"): all
# four in the right direction, among them 81 sequences × 1027 tokens, where 8 partitions measured
# 30 % slower than 2; to size within 15 % at both block sizes it may have used only at 81 × 16k
# (8 → 32 partitions at batch 1: measured 2.5x faster, predicted 1.9-2.1x; 1 → 5 at batch 3:
# measured about 1.3x, predicted 1.7-1.9x; 2 → 8 at 81 × 1027: measured 1.30x slower, predicted
# 1.38-1.57x). Where the rule left CUs idle (small batch, short context) the
# model's extra partitions fill them, the direction nobody disputes; at large batch its choices
# rest on the grid's wave quantization, the least validated part. And the table's grid is
# coarse: between grid points it takes the nearest point's tiles per partition, which in the
# quantization-dominated regime can pick a count the model itself predicts a few % slower than
# its argmin at the exact shape (one of the four shapes below: 16 × 32k, 3 against the exact
# shape's 4, predicted within 1 % of each other).

# %% tags=["nbval-ignore-output"]
from pa_tile import figures  # noqa: E402
from pa_tile.perf import model  # noqa: E402
from pa_tile.perf.roofline import DecodeShape  # noqa: E402

SWEEP = {  # label: (batch, context, q heads, kv heads, query_length); head_dim 128, block 16
    "3 x 1027 tokens, 16 heads / 1 KV head, 4 query tokens": (3, 1027, 16, 1, 4),
    "4 x 1027 tokens, 8 heads / 1 KV head": (4, 1027, 8, 1, 1),
    "16 x 32k tokens, 64 heads / 8 KV heads": (16, 32768, 64, 8, 1),
    "152 x 32k tokens, 64 heads / 8 KV heads": (152, 32768, 64, 8, 1),
}
SWEEP_GPUS = {"MI300X": ("mi300x", "gfx942"), "MI355X": ("mi355x", "gfx950")}
if backend.current_backend() == "emu":  # the model's samples are emulator traces
    samples, panels, picks, srows = {}, {}, {}, []
    for label, (b, ctx, qh, kvh, ql) in SWEEP.items():
        shape = DecodeShape(batch=b, context=ctx, num_q_heads=qh, num_kv_heads=kvh, head_dim=128, block_size=16,
                            query_length=ql)
        tiles = -(-ctx // TILE)
        panels[label], picks[label] = {}, {}
        for gpu, (name, arch) in SWEEP_GPUS.items():
            key = (arch, shape.group, ql)
            if key not in samples:  # one emulator sample per configuration (as the table's script takes it)
                probe = DecodeShape(batch=1, context=1024, num_q_heads=shape.group, num_kv_heads=1, head_dim=128,
                                    block_size=16, query_length=ql)
                samples[key] = model.sample_stage("s6", probe, arch)
            ps = sorted({-(-tiles // -(-tiles // p)) for p in range(1, min(tiles, MAX_PARTITIONS) + 1)})
            us = [model.predict_stage("s6", shape, name, sample=samples[key], partitions=p,
                                      schedule="uniform").predicted_us for p in ps]  # as the table is made
            t = dict(zip(ps, us))
            rule, fastest, chosen = (choose_num_partitions(b, kvh, ctx, arch=arch, group=shape.group, query_length=ql,
                                                           policy=policy) for policy in ("budget", "fastest", None))
            panels[label][gpu] = (ps, us)
            picks[label][gpu] = dict(rule=rule, fastest=fastest, default=chosen)
            srows.append({"shape": label, "GPU": gpu, "rule P": rule, "rule µs (pred.)": f"{t[rule]:.1f}",
                          "fastest P": fastest, "fastest µs (pred.)": f"{t[fastest]:.1f}",
                          "default P": chosen, "default µs (pred.)": f"{t[chosen]:.1f}",
                          "argmin P": min(t, key=t.get)})
    print("PREDICTED by pa_tile.perf.model (not measured): stage 6, head_dim 128, block size 16")
    print(format_table(srows))
    fig = figures.partition_sweep(panels, picks, note="stage 6, head_dim 128; square: rule of thumb, star: the model's "
                                  "table, dot: the default (the table within the traffic cap)")
    plt.show()
else:
    print("skipped on a GPU: the model samples its kernels in the emulator (run this chapter with "
          "PA_TILE_BACKEND=emu to see its predictions)")

# %% [markdown]
# At small batch the model and the bytes disagree. 3 sequences of 1027 tokens with 64 query rows
# per KV head: the model's fastest is one partition per tile, predicted about 1.6x faster than
# no split on both GPUs, but its partials (5 partitions x 64 rows x 130 floats per sequence,
# read back by the reduce) would load 1.58x the compulsory bytes instead of 0.86x unsplit; the
# chapter's own ragged set (4 × 1027, 8 rows) would go from 2 partitions to 5, about 1.45x
# (predicted), for +8 % of the loads. The default keeps the bytes: the traffic cap allows the
# 8-row set its 2 partitions and the 64-row set none, and `tests/test_traffic.py` measures every
# configuration of the upstream test grid (query_length 1-4, group 8-32, both scale kinds, both
# archs, batch 3 and 81) at or under 1.05x. These small launches are latency-bound, so the
# model says the cap costs them time: `policy="fastest"` is there for a caller who measures that
# it pays on their GPU. At 16 × 8 KV heads × 32k the model splits far less than the rule (3
# against 10 and 8) for about the same predicted time (under 1 % better), and the cap does not bind: the
# reduce reads every partition's partials back, and 3 partitions already make 384 workgroups
# (304 / 256 CUs). At 152 × 8 × 32k (4-5 workgroups per CU unsplit) nothing splits. The table's
# count is the model's own argmin at the exact shape in every row but that one. (All times here
# are MODEL predictions.)

# %% [markdown]
# ## Ragged batches: a balanced split
#
# The split above gives every sequence the same `P` partitions of its own tiles, `P` chosen from
# the block table's width, the longest sequence. A real decode batch is ragged: one 32k-token
# conversation beside seven 1k-token ones. Then the long sequence's `P` workgroups walk
# `ceil(128 / P)` tiles each while the short ones' walk one or none, and the launch lasts as
# long as its busiest workgroup. Upstream's persistent kernel hands out 256-token work units
# evenly instead; here the same idea fits chapter 5's kernel without a new loop: a **work
# list**. The batch's tiles are laid end to end and cut into chunks of `per` tiles, `per =
# max(floor, ceil(total / (S·P)))`, never across a sequence (its last chunk is shorter), so the
# grid's x is the list's entries, not the sequences, and entry x says (sequence, first tile, end
# tile). Each entry writes one partial; the reduce merges sequence s's entries `offsets[s] ..
# offsets[s+1]`. `floor` is the traffic cap in tiles: a chunk's extra bytes (its query re-read
# and its partials' round trip, times `SPLIT_EXTRA_MARGIN`) stay within 5 % of its tiles' (for the
# split the chooser picks; an explicit `num_partitions` is honoured down to one-tile chunks, as
# the uniform layout honours it).
#
# The list is built on the device by torch ops (cumsum, searchsorted) that never read a value
# on the host, so there is no sync, and `S·(P + 1)` entries always suffice (at most one short
# chunk per sequence); entries past the last chunk are empty (`t_end = t_start`) and read
# nothing but their entry. Unlike upstream's persistent workgroups, a chunk never spans two
# sequences: every workgroup stays one sequence's, as chapter 5's kernel is, at the cost of one
# short chunk per sequence.

# %% tags=["export"]
#: how a split lays its work out: "balanced" (a work list, "Ragged batches") or "uniform" (each
#: sequence in ``num_partitions`` equal ranges of its own tiles)
DEFAULT_SCHEDULE = "balanced"
SCHEDULES = ("balanced", "uniform")


def choose_schedule(num_partitions, schedule=None):
    """The layout of a call's work: ``schedule`` if given (``"balanced"`` also balances an
    unsplit call: a work list aiming at one chunk per sequence), else :data:`DEFAULT_SCHEDULE`
    for a split and ``"uniform"`` (chapter 5's kernel, no reduce) for an unsplit call, whose
    lengths the plan cannot read without a host sync: balancing a batch of short sequences
    would add a partial per sequence, past the traffic cap."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES} or None, got {schedule!r}")
    return schedule or (DEFAULT_SCHEDULE if num_partitions > 1 else "uniform")


def chunk_floor(head_dim, group, query_length, *, block_size=16, per_token=False, query_bytes=2):
    """The fewest 256-token tiles a balanced split's chunk gets: its extra bytes (one more query
    read and one more partial's round trip, :data:`SPLIT_EXTRA_MARGIN` x) at most
    ``TRAFFIC_CAP - 1`` of its tiles' compulsory bytes (and at least ``MIN_TILES_PER_PARTITION``)."""
    def compulsory(ctx):
        return _uniform_compulsory_bytes(1, 1, ctx, head_dim, group, query_length, block_size, per_token, query_bytes)

    per_tile = compulsory(2 * TILE) - compulsory(TILE)
    extra = SPLIT_EXTRA_MARGIN * (split_extra_bytes(1, 1, head_dim, group, query_length, 3, query_bytes)
                                  - split_extra_bytes(1, 1, head_dim, group, query_length, 2, query_bytes))
    return max(MIN_TILES_PER_PARTITION, math.ceil(extra / ((TRAFFIC_CAP - 1.0) * per_tile)))

# %% [markdown]
# The list's size is fixed by the shapes alone, so a plan allocates its buffers once and a run
# (or a captured graph's replay) allocates nothing.

# %% tags=["export"]
def work_entries(num_seqs, num_partitions):
    """Entries of a balanced work list aiming at ``num_seqs × num_partitions`` chunks: every
    sequence may add one short chunk, so ``num_seqs × (num_partitions + 1)`` always suffice."""
    return num_seqs * (num_partitions + 1)


def work_list_buffers(num_seqs, num_partitions, device):
    """The tensors :func:`work_list` computes in (a plan allocates them once, so a run allocates
    nothing and a captured graph replays the list's ops on its lengths)."""
    n = work_entries(num_seqs, num_partitions)
    per_seq = ("tiles", "first", "units", "chunks", "ends")
    b = {k: torch.empty(num_seqs, dtype=torch.int64, device=device) for k in per_seq}
    b.update({k: torch.empty(n, dtype=torch.int64, device=device) for k in ("seq", "t0", "t1", "gathered")})
    b.update(per=torch.empty(1, dtype=torch.int64, device=device), x=torch.arange(n, device=device),
             live=torch.empty(n, dtype=torch.bool, device=device),
             work=torch.zeros(n, 4, dtype=torch.int32, device=device),
             offsets=torch.zeros(num_seqs + 1, dtype=torch.int32, device=device))
    return b

# %% [markdown]
# The list itself, in torch ops that write into those buffers: tiles per sequence (less those a
# sliding window skips), the chunk size, chunks per sequence and their running sum (the
# offsets), then each entry's sequence (a sorted search) and its first and end tile.

# %% tags=["export"]
def work_list(context_lengths, num_partitions, min_tiles, *, query_length=1, sliding_window=0, buffers=None):
    """The balanced split of a batch, on ``context_lengths``' device without reading a value on
    the host: ``(work, offsets)``, ``work`` [``work_entries``, 4] int32 rows (sequence, first tile,
    end tile, 0), ``offsets`` [S + 1] int32 (sequence s owns entries ``offsets[s] .. offsets[s+1]``).
    Chunks of ``per = max(min_tiles, ceil(total / (S·num_partitions)))`` tiles, the tiles a
    sliding window skips left out. Every op writes into ``buffers`` (:func:`work_list_buffers`;
    None: allocated here), so with them given nothing is allocated."""
    S = context_lengths.shape[0]
    b = buffers if buffers is not None else work_list_buffers(S, num_partitions, context_lengths.device)
    tiles, first, units, chunks, ends, per = (b[k] for k in ("tiles", "first", "units", "chunks", "ends", "per"))
    seq, t0, t1, g, x = (b[k] for k in ("seq", "t0", "t1", "gathered", "x"))
    torch.add(context_lengths, TILE - 1, out=tiles).floor_divide_(TILE)
    if sliding_window > 0:  # as the kernel's tile_range: tiles wholly before every row's window
        torch.sub(context_lengths, query_length - 1 + sliding_window, out=first).clamp_min_(0).floor_divide_(TILE)
    else:
        first.zero_()
    torch.sub(tiles, first, out=units).clamp_min_(0)
    target = S * num_partitions
    torch.sum(units, 0, keepdim=True, out=per).add_(target - 1).floor_divide_(target).clamp_min_(min_tiles)
    torch.add(units, per, out=chunks).sub_(1).floor_divide_(per)
    torch.cumsum(chunks, 0, out=ends)
    torch.searchsorted(ends, x, right=True, out=seq).clamp_max_(S - 1)
    # gathers (index_select), not indexing: fake cuda tensors (pa_tile's CPU proofs) take them
    # t0 = first[seq] + (x - (ends[seq] - chunks[seq])) * per: the entry's place in its sequence
    torch.index_select(ends, 0, seq, out=t0).sub_(torch.index_select(chunks, 0, seq, out=g))
    torch.sub(x, t0, out=t0).mul_(per).add_(torch.index_select(first, 0, seq, out=g))
    torch.minimum(torch.add(t0, per, out=t1), torch.index_select(tiles, 0, seq, out=g), out=t1)
    torch.where(torch.lt(x, ends.narrow(0, S - 1, 1), out=b["live"]), t1, t0, out=t1)  # past the last chunk: empty
    work, offsets = b["work"], b["offsets"]
    for col, v in enumerate((seq, t0, t1)):  # add, not copy_: fake cuda tensors take an out= op, not copy_
        torch.add(v, 0, out=work.select(1, col))
    torch.add(ends, 0, out=offsets.narrow(0, 1, S))
    return work, offsets

# %% [markdown]
# One 32k-token conversation beside seven 1k-token ones, 8 KV heads: the split the chooser picks
# for the block table's width, laid out both ways. Each bar is one workgroup's tiles (per KV head).

# %%
RAGGED = [32768] + [1024] * 7
P_RAGGED = choose_num_partitions(len(RAGGED), 8, max(RAGGED), arch="gfx942")
work, offsets = work_list(torch.tensor(RAGGED, dtype=torch.int32), P_RAGGED, chunk_floor(128, 8, 1))
tiles = [-(-L // TILE) for L in RAGGED]
uniform = [[(z * -(-n // P_RAGGED), min((z + 1) * -(-n // P_RAGGED), n)) for z in range(P_RAGGED)] for n in tiles]
balanced = [[tuple(work[x, 1:3].tolist()) for x in range(offsets[s], offsets[s + 1])] for s in range(len(RAGGED))]
figures.work_layouts(tiles, {f"uniform, P = {P_RAGGED}": uniform,
                             f"balanced, chunks of {work[0, 2] - work[0, 1]} tiles": balanced})
plt.show()

# %% [markdown]
# What the timing model predicts for four batches, each sequence 64 query heads over 8 KV heads:
# three ragged, one even. "uniform" is the split the chooser picks laid out as before;
# "balanced" is the same partition count as a work list (for the batch the chooser does not
# split, `schedule="balanced"` asked for explicitly, see below). A ragged grid is timed as the
# dispatcher runs it: each workgroup to the CU slot that frees first (`model.grid_of`), not as
# generations of equal workgroups.

# %% tags=["nbval-ignore-output"]
RAGGED_BATCHES = {
    "32k +\n15 x 1k": [32768] + [1024] * 15,
    "8 mixed,\n64 .. 12k": [8000, 300, 2000, 100, 12000, 700, 64, 3000],
    "4 x 16k +\n60 x 512": [16384] * 4 + [512] * 60,
    "16 x 4k\n(even)": [4096] * 16,
}
if backend.current_backend() == "emu":  # the model's samples are emulator traces (the sweep's above)
    bars = []
    for label, lengths in RAGGED_BATCHES.items():
        shape = DecodeShape(batch=len(lengths), context=tuple(lengths), num_q_heads=64, num_kv_heads=8,
                            head_dim=128, block_size=16)
        for gpu, (name, arch) in SWEEP_GPUS.items():
            parts = choose_num_partitions(len(lengths), 8, max(lengths), arch=arch)
            pred = {sched: model.predict_stage("s6", shape, name, sample=samples[(arch, 8, 1)], partitions=parts,
                                               schedule=sched) for sched in SCHEDULES}
            bars.append(dict(batch=label, partitions=parts, gpu=gpu, floor=pred["uniform"].floor_us,
                             **{k: v.predicted_us for k, v in pred.items()}))
    figures.schedule_predictions(bars, note="stage 6, 64 / 8 heads, head_dim 128")
    plt.show()
else:
    print("skipped on a GPU: the model samples its kernels in the emulator")

# %% [markdown]
# The model's verdict (MODEL predictions, MI300X / MI355X): one 32k sequence beside fifteen 1k
# ones goes from about 194 / 164 µs to 48 / 38 µs, because the uniform split's busiest workgroup
# walks 43 tiles and the balanced one's at most 4; the eight mixed lengths take 36 % / 24 % less time; the even
# batch is unchanged (its chunks are the uniform split's, within 1 %: the empty entries cost a
# scalar load and a partial write each, no query read). The third batch is where the chooser
# splits nothing (64 sequences x 8 KV heads already fill the GPU, judged by the block table's
# width), yet four 16k sequences make the unsplit launch last 288 / 242 µs; asked for
# (`schedule="balanced"`), the list cuts them into 6-tile chunks and the model predicts 83 / 57.
# The default cannot make that call itself: whether a batch is ragged is in `context_lengths`,
# whose values the plan never reads on a GPU (a host sync), and balancing a batch of short
# sequences would give each a partial and a reduce for nothing (past the traffic cap), so an
# unsplit call stays chapter 5's kernel unless the caller, who knows its batches, asks.
#
# The work list is made when the batch is planned, into buffers the plan owns (`torch.add(...,
# out=)`, `searchsorted(..., out=)`: no allocation, no host read), and every layer's `run`
# reads it: about 90 µs of host time on this CPU for the twenty-odd small ops, paid once per
# decode step, not once per layer. Lengths changed in place (a captured graph's next step) need
# `plan.refresh()`, the same ops into the same buffers; the one-shot `pa_tile.paged_decode`
# refreshes on every call.

# %% [markdown]
# ### M-tiles per workgroup
#
# The other grid choice is chapter 5's: all of a KV head's M-tiles in one workgroup, so K and V
# are read once. `m_tiles=` caps them, and the rest go to more workgroups along grid y, each
# reading K and V again. Asked the same way, with 4 query tokens x group 16 (64 rows, 4 M-tiles)
# over 8k tokens and 8 KV heads, the split the chooser picks for each batch:

# %% tags=["nbval-ignore-output"]
if backend.current_backend() == "emu":
    MT_BATCHES = (1, 4, 16, 64)
    mt_panels = {}
    for gpu, (name, arch) in SWEEP_GPUS.items():
        mt_panels[gpu] = {}
        for cap in (4, 2, 1):
            probe = DecodeShape(batch=1, context=1024, num_q_heads=16, num_kv_heads=1, head_dim=128, block_size=16,
                                query_length=4)
            smp = model.sample_stage("s6", probe, arch, m_tiles=cap)
            us = [model.predict_stage("s6", DecodeShape(batch=b, context=8192, num_q_heads=128, num_kv_heads=8,
                                                        head_dim=128, block_size=16, query_length=4),
                                      name, sample=smp).predicted_us for b in MT_BATCHES]
            mt_panels[gpu][f"m_tiles={cap}: K/V read {4 // cap}x"] = (MT_BATCHES, us)
    figures.m_tile_predictions(mt_panels, note="stage 6, 4 query tokens x group 16, 8k tokens, 8 KV heads")
    plt.show()
else:
    print("skipped on a GPU: the model samples its kernels in the emulator")

# %% [markdown]
# Here the model and the bytes disagree again, as they did over partitions at small batch. Up
# to 16 sequences the model predicts one M-tile per workgroup faster (MI300X 140 -> 95 µs at one
# sequence, MI355X 114 -> 81: four times the workgroups to hide the latency of), for 4x the K/V
# loads, which it assumes hit L2 (its `l2_extra_bytes` go at L2 bandwidth, an optimistic
# assumption no measurement here checks); at 64 sequences the re-reads cost more than the
# parallelism buys (416 -> 517 µs). Within the traffic cap the choice is forced: any M-tile split
# reads K and V at least twice, so the default keeps all M-tiles together, and `m_tiles=` is the
# knob for a caller who measures that the re-reads pay on their GPU. (MODEL predictions.)

# %% [markdown]
# ## The workspace
#
# The partials of `P > 1` partitions live in one float32 buffer: `pmax`, `psum` (`S·kvh·P·rows`
# each) and `pout` (`S·kvh·P·rows·head_dim`), carved out as views. When the caller passes it (and
# `out`), `paged_decode` allocates nothing: every launch argument is a view of a caller tensor, so
# the call can be captured in a CUDA/HIP graph and replayed. `make_workspace` sizes it from the same
# shapes the call will see, with the same heuristic, so the two agree.

# %% tags=["export"]
def workspace_size(num_seqs, num_kv_heads, group, query_length, head_dim, num_partitions, schedule="uniform"):
    """float32 elements of the workspace for one problem shape, partition count and schedule
    (1 when ``num_partitions`` is 1: a placeholder the unsplit kernel never touches; a balanced
    split's partials are per work-list entry, ``work_entries`` of them)."""
    if num_partitions <= 1 and schedule != "balanced":
        return 1
    slots = work_entries(num_seqs, num_partitions) if schedule == "balanced" else num_seqs * num_partitions
    return slots * num_kv_heads * group * query_length * (head_dim + 2)


def carve(workspace, num_seqs, num_kv_heads, rows, head_dim, num_partitions):
    """``(pmax, psum, pout)`` as views of a float32 ``workspace`` (see ``workspace_size``)."""
    shape = (num_seqs, num_kv_heads, num_partitions, rows)
    n = num_seqs * num_kv_heads * num_partitions * rows
    # narrow, not slicing: the same views, and fake cuda tensors (pa_tile's CPU proofs) support it
    return (workspace.narrow(0, 0, n).view(shape), workspace.narrow(0, n, n).view(shape),
            workspace.narrow(0, 2 * n, n * head_dim).view(shape + (head_dim,)))

# %% [markdown]
# ## The entry point
#
# `paged_decode` checks every argument before anything is compiled or launched (a `TypeError` for a
# wrong type, a `ValueError` for a wrong shape or value, each naming the argument), resolves the
# layout options from the tensors (plain or trans-blocked V from the rank, per-tensor or per-token
# scales from the shape, query length from the rows, f16/bf16 from the query), picks the partition
# count, and runs chapter 5's kernel once (writing `out` directly) or twice-over (partials, then the
# reduce). On a GPU both launches go to torch's current stream, which is what graph capture records.
# Values are checked only on the CPU (emulator), where it is free; on a GPU, reading
# `context_lengths` would synchronize.

# %% tags=["export"]
def make_workspace(query, key_cache, block_tables, *, query_length=None, num_partitions=None, arch=None,
                   schedule=None):
    """A float32 workspace for ``paged_decode`` calls with these shapes (same validation,
    partition choice and schedule as the call: ``pa_tile.api.make_workspace``)."""
    from pa_tile import api

    return api.make_workspace(query, key_cache, block_tables, query_length=query_length,
                              num_partitions=num_partitions, arch=arch, schedule=schedule)


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, **options):
    """``(launcher, (), arch)`` after validation: ``launcher()`` runs the partial kernel and, when
    split, the reduce; ``pa_tile.toolchain.compile_isa(launcher, arch=arch)`` returns both kernels'
    assembly (partial kernel first). Options as ``paged_decode``."""
    from pa_tile import api

    out = options.pop("out", None)
    pl = api.plan(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, **options)
    return pl.pipeline(query, key_cache, value_cache, out=out), (), pl.problem.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, **options):
    """The finished kernel, ``pa_tile.paged_decode`` (``pa_tile.api``)."""
    from pa_tile import api

    return api.paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                            **options)


# %% [markdown]
# ## Using it
#
# The finished kernel is `pa_tile.paged_decode` (this module's function, re-exported). Five lines,
# with the caches built by `pa_tile.cache` from a test case (in a real server they come from the
# KV-cache manager, already in these layouts):

# %% tags=["nbval-ignore-output"]
import pa_tile  # noqa: E402

arch = backend.default_arch()  # the GPU's, or the emulator's
case = cache.make_case(2, 16, 2, 128, 16, [300, 1027], fp8_format=fp8_format(arch), seed=5)
kv = dict(key_cache=case.k_blocked(), value_cache=case.v_trans_blocked())
out = pa_tile.paged_decode(case.query, **kv, block_tables=case.block_tables, context_lengths=case.context_lengths,
                           key_scale=case.k_scale, value_scale=case.v_scale)
err = float((out.float().cpu() - case.reference().float().cpu()).abs().max())
print(tuple(out.shape), out.dtype, f"max |err| vs reference: {err:.4f}")

# %% [markdown]
# For graph capture, allocate `out` and the workspace once and pass them every step:
#
# ```python
# ws = pa_tile.make_workspace(query, key_cache, block_tables)
# out = torch.empty_like(query)
# g = torch.cuda.CUDAGraph()
# with torch.cuda.graph(g):
#     pa_tile.paged_decode(query, key_cache, value_cache, block_tables, context_lengths,
#                          key_scale, value_scale, out=out, workspace=ws)
# g.replay()  # after updating query / block_tables / context_lengths in place
# ```
#
# A wrong argument is named before anything is compiled:

# %%
for bad, fix in ((dict(block_tables=case.block_tables.long()), "int64 block table"),
                 (dict(workspace=torch.empty(10, device=case.query.device)), "workspace too small for the split"),
                 (dict(num_partitions=0), "no partitions")):
    kw = dict(key_cache=case.k_blocked(), value_cache=case.v_trans_blocked(), block_tables=case.block_tables,
              context_lengths=case.context_lengths, key_scale=case.k_scale, value_scale=case.v_scale)
    kw.update(bad)
    P = kw.pop("num_partitions", 2)
    try:
        pa_tile.paged_decode(case.query, **kw, num_partitions=P)
    except (TypeError, ValueError) as e:
        print(f"{fix:36s} -> {type(e).__name__}: {e}")

# %% [markdown]
# ## Does it work? The full feature matrix
#
# Every option of the finished kernel, on the emulated gfx942 and gfx950 code, against the float32
# reference: block 16/64, head_dim 64/128 (256: see below), query_length 1–4, groups 1–32, per-tensor
# and per-token scales, f16/bf16, trans-blocked and plain V, a sliding window, a strided query, and
# the split chosen by default (`P`: the timing model's table) or forced. The contexts are the ragged set (1, 17, 256, 1027;
# raised to `query_length`) with shuffled pages and `-1` in unused block-table entries; with
# 1027 tokens (5 tiles) a split of 3 leaves the 17-token sequence two empty partitions and the
# 1-token one two as well. Checked as in chapters 2 and 5: every element within the fp8 bound
# (`case.error_bound()`, which a split keeps: float32 partials, one float32 combine).

# %%
def make(arch, bs, hd, g, ql, scales="per-tensor", qdt=torch.float16, contexts=cache.RAGGED_CONTEXTS, kvh=1, seed=1,
         device=None):
    """A case on ``device`` (default: where kernels run here; "cpu" for compile-only cells)."""
    ctx = [max(c, ql) for c in contexts]
    return cache.make_case(len(ctx), g * kvh, kvh, hd, bs, ctx, query_length=ql, fp8_format=fp8_format(arch),
                           scales=scales, query_dtype=qdt, seed=seed, pad_block_id=-1, device=device)


def inputs(case, trans_v=True, strided=False):
    q = case.query
    if strided:  # rows and heads strided: a view into a wider buffer
        wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 32, dtype=q.dtype, device=q.device)
        wide[:, :, : q.shape[2]] = q
        q = wide[:, :, : q.shape[2]]
    v = case.v_trans_blocked() if trans_v else case.v_plain()
    return (q, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale, case.v_scale)

# %% tags=["nbval-ignore-output"]
MATRIX = [  # block, head_dim, group, query_length, scales, query dtype, trans V, window, strided, partitions
    (16, 128, 8, 1, "per-tensor", torch.float16, True, 0, False, None),
    (64, 128, 16, 1, "per-token", torch.bfloat16, True, 0, True, 3),
    (16, 64, 32, 3, "per-token", torch.float16, False, 0, False, None),
    (64, 64, 4, 4, "per-tensor", torch.bfloat16, True, 300, False, 5),
    (16, 128, 5, 2, "per-tensor", torch.float16, False, 100, True, 2),
    (64, 64, 1, 1, "per-tensor", torch.float16, True, 0, False, 1),
]
rows = []
for arch in backend.runnable_archs():
    for bs, hd, g, ql, sc, qdt, tv, w, strided, P in tqdm(MATRIX, desc=f"run {arch}"):
        case = make(arch, bs, hd, g, ql, sc, qdt)
        args = inputs(case, tv, strided)
        used = P or choose_num_partitions(len(cache.RAGGED_CONTEXTS), 1, args[3].shape[1] * bs, arch=arch,
                                          head_dim=hd, group=g, query_length=ql, block_size=bs,
                                          per_token=sc == "per-token")
        out = pa_tile.paged_decode(*args, sliding_window=w, num_partitions=P, arch=arch).cpu()
        ok, of_bound, mean_err = case.check(out, sliding_window=w)
        rows.append(dict(arch=arch, block=bs, head_dim=hd, group=g, query_len=ql, scales=sc, q=str(qdt)[6:],
                         v="trans" if tv else "plain", window=w, strided=strided, P=f"{used}{'' if P else ' (auto)'}",
                         of_bound=round(of_bound, 2), mean_err=f"{mean_err:.4f}", ok=ok))
print(format_table(rows))
assert all(r["ok"] for r in rows)

# %% [markdown]
# Splitting must not change the answer beyond rounding: the same problem with 1, 2 and 5 partitions
# (5 = one tile each for the 1027-token sequence). The partial outputs are rounded to float32, not
# to the query dtype, so the split results differ from the unsplit one by at most a few f16 ulps.

# %% tags=["nbval-ignore-output"]
arch = backend.runnable_archs()[-1]  # gfx950 on the emulator, the device's own on a GPU
case = make(arch, 16, 128, 8, 2, "per-token")
outs = {P: pa_tile.paged_decode(*inputs(case), num_partitions=P, arch=arch).float().cpu() for P in (1, 2, 5)}
for P in (2, 5):
    print(f"P={P}: max |out - out(P=1)| = {float((outs[P] - outs[1]).abs().max()):.2e}")
    assert torch.allclose(outs[P], outs[1], atol=2e-2, rtol=2**-8)

# %% [markdown]
# ## head_dim 256
#
# The upstream tile kernel compiles head_dim 256 too. Chapter 5's kernel is written for any multiple of
# 64 channels (`head_dim/64` K chunks per lane, `head_dim/16` output chunks), and the reduce above
# handles 256 (64 lanes per row). What does 256 cost? The output fragment of one M-tile doubles to
# 64 registers per lane and K and V of a tile to 64 each; the LDS barely grows (the merge's
# exchange rounds are sized to the staged query): measured on the compiled code (gfx942, block 16,
# bf16, one M-tile).

# %%
def stats_for(arch, bs, hd, g, ql, scales="per-tensor", P=1, which=0):
    case = make(arch, bs, hd, g, ql, scales, torch.bfloat16, contexts=[20], device="cpu")  # compile only
    pipe, a, arch = launch_args(*inputs(case), num_partitions=P, arch=arch)
    text = toolchain.compile_isa(pipe, *a, arch=arch)
    return isa.IsaStats.from_asm(text, kernel=which)


supports_256 = 256 in s5.LIMITS.head_dims
print("chapter 5's kernel accepts head_dim 256:", supports_256)
r256 = []
if supports_256:
    for hd in (128, 256):
        for sc in ("per-tensor", "per-token"):
            st = stats_for("gfx942", 16, hd, 8, 1, sc)
            r256.append(dict(head_dim=hd, scales=sc, vgpr=st.vgpr_unified, agpr=st.agpr, spills=st.vgpr_spill,
                             scratch=st.scratch_bytes, lds=st.lds_bytes,
                             waves_per_simd=isa.occupancy(st, "gfx942").waves_per_simd))
    print(format_table(r256))

# %% [markdown]
# head_dim 256 doubles the output fragment and the K/V registers of a tile (about 70 registers more
# than head_dim 128): 2 waves per SIMD instead of 4, 256 more bytes of LDS, no scratch, and it
# matches the reference in the emulator (tested). Half the occupancy is the price of keeping a
# 256-channel output fragment per wave; loading K and V in two head-dim halves, or splitting the
# output across waves (upstream's P·V layout, at the cost of an LDS round trip per tile), would win
# a wave back.
#
# ## Registers and occupancy against the upstream kernel
#
# The finished kernel is chapter 5's partial kernel (specialized per split) plus the reduce. The
# recorded figures of FlyDSL's `pa_decode_tile` (`pa_tile/data/upstream_pa_decode_tile_isa.md`, read
# by `pa_tile.upstream`; the 64 head_dim 64/128 configurations, both arches, one partition) next to this kernel's
# **split** specialization (`P = 4`, what a small batch runs; `tests/test_stage5.py` checks `P = 1`
# against the same figures): each configuration's margin over upstream.

# %%
from pa_tile import upstream  # noqa: E402

UPSTREAM = {  # (arch, block, head_dim, query_length, group, per_token) -> (VGPR+AGPR, waves/SIMD)
    (r["arch"], r["block"], r["head_dim"], r["query_len"], r["group"], r["per_token"]): (r["vgpr"], r["occ"])
    for r in upstream.tile_isa_figures() if r["head_dim"] <= 128
}

up_rows = []
for (arch, bs, hd, ql, g, tok), (uv, uo) in tqdm(sorted(UPSTREAM.items()), desc="compile"):
    st = stats_for(arch, bs, hd, g, ql, "per-token" if tok else "per-tensor", P=4)
    occ = isa.occupancy(st, arch).waves_per_simd
    up_rows.append(dict(arch=arch, block=bs, head_dim=hd, query_len=ql, group=g, scales="token" if tok else "tensor",
                        vgpr=st.vgpr_unified, upstream=uv, waves=occ, upstream_waves=uo,
                        spill=st.vgpr_spill + st.scratch_bytes,
                        meets="yes" if st.vgpr_unified <= uv and occ >= uo else "NO"))
figures.upstream_margins(up_rows, [("VGPR+AGPR", "vgpr", "upstream", False), ("waves/SIMD", "waves", "upstream_waves", True)],
                         color="arch", marker="scales",
                         title="The split kernel (P = 4) against upstream's pa_decode_tile: each configuration's margin")
plt.show()
print(sum(r["meets"] == "yes" for r in up_rows), "of", len(up_rows), "meet or beat upstream;",
      "spills/scratch anywhere:", any(r["spill"] for r in up_rows),
      f"(ROCm/FlyDSL {upstream.UPSTREAM_COMMIT[:8]}, compiled here with flydsl {upstream.FLYDSL_VERSION})")

# %% [markdown]
# The split adds only the partial stores after the loop, so the figures follow chapter 5's (its
# table has the unsplit ones, and `tests/test_stage5.py` pins them): every configuration meets or
# beats upstream, by a wide margin with several M-tiles (query_length 4), where upstream keeps a
# bigger output fragment per wave. No spill anywhere.
#
# The reduce is small enough to never matter for occupancy:

# %%
st_red = stats_for("gfx942", 16, 128, 8, 1, P=4, which=1)
print(isa.summary(st_red))

# %% [markdown]
# ## What the split adds to the compiled code, against chapter 5
#
# Same problem (gfx942, block 16, head_dim 128, group 8, one query token, bf16, per-tensor): the
# unsplit kernel (chapter 5's output path) against the `P = 4` specialization.

# %%
print(isa.diff(stats_for("gfx942", 16, 128, 8, 1, P=1), stats_for("gfx942", 16, 128, 8, 1, P=4),
               labels=("stage 5 (P=1)", "stage 6 (P=4)"), mnemonics=False, compact=True))  # rows that changed

# %% [markdown]
# The loop is unchanged (same instruction count, table above). Outside it the split computes its tile range
# (scalar work: +45 SALU), writes float32 partials (`buffer_store_dwordx4` of 4 channels instead of
# `dwordx2` of 4 halves: no conversion to f16, −34 VALU) and the two stats (`buffer_store_dword`).
#
# ## Memory traffic of one tile, split
#
# One sequence of 512 tokens (two tiles), block 16, head_dim 128, group 8, one query token,
# per-tensor scales, `P = 2`: each partition walks one tile and writes its partials, then the reduce
# reads them. The two launches of `launch_args`' pipeline are traced separately by the emulator (gfx942):
# before, in and after each kernel's loop, one row per kind of access, its figures per execution.

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

case = make("gfx942", 16, 128, 8, 1, contexts=[512], device="cpu")
pipe, _, arch = launch_args(*inputs(case), num_partitions=2, arch="gfx942")
steps = pipe.steps if backend.current_backend() == "emu" else ()
for (launcher, largs), name in zip(steps, ("partial kernel (2 workgroups, one tile each)", "reduce")):
    trace = Trace("gfx942")
    with emu_launch.record_launches() as launched, emu_launch.launch_options(trace=trace), toolchain.target_arch(arch):
        launcher(*largs)
    print(f"--- {name}")
    print(trace.grouped_table(phases=isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)))
if not steps:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# The partial kernel reads each K and V byte of its tile once in `buffer_load_dwordx4`s (64-byte
# segments fully used), as in chapter 5. The split costs, per partition, `rows × head_dim` floats of
# partial output (4 KB for these 8 rows) plus 8 bytes of stats per row, written once and read back
# once by the reduce, against 64 KB of K+V for the tile. The reduce reads the partial outputs in
# whole 64-byte segments; its per-row stats loads are one dword that the row's 32 lanes share.

# %% [markdown]
# ## Predicted time against stage 5 (a model, not a measurement)
#
# The split is where the finished kernel's predicted gain at decode batch sizes comes from: 16
# long workgroups, each a chain of 64 tiles waiting on memory, become a few hundred short ones of
# 4 tiles running side by side across the machine; the reduce kernel and its launch give part of
# it back (the prediction's `reduce` term, chapter 8). Chapter 8 sets every stage and upstream's
# tile kernel side by side on this shape.

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

print(speedup.report("s6", "s5"))

# %% [markdown]
# ## What you built
#
# * **Chapter 1**: a readable fp8 paged-decode kernel with FlyDSL's tile API, and the tools to see
#   its machine code (`pa_tile.isa`) and run it without a GPU (`pa_tile.emu`).
# * **Chapter 2**: scores turned around (`K·Qᵀ`), each wave's softmax and P·V in registers, one
#   LDS merge after the loop.
# * **Chapters 3–4**: raw `dwordx4` loads and the blocked K / trans-blocked V layouts they want,
#   per-token scales, head_dim 64/128, bf16, strided queries.
# * **Chapter 5**: multi-token (MTP) decode and wide GQA in 16-row M-tiles, the phase split, exact
#   masking (a hidden token adds exactly nothing), sliding windows.
# * **Chapter 7**: split-K over partitions with a NaN-proof flash-combine, the partition count the
#   timing model predicts fastest (a precomputed table; the 3 %-budget rule of thumb beside it), a
#   balanced work list that keeps a ragged batch's longest sequence from setting the launch's
#   length, and `pa_tile.paged_decode`: one validated call that allocates nothing
#   given a workspace, so it can live inside a CUDA/HIP graph.
