"""One problem description: the single validation step every pa_tile launcher goes through.

``describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
limits=..., ...)`` checks every argument of a decode call against a stage's :class:`Limits` and
returns an immutable :class:`Problem` (shapes, dtypes, layouts, arch, per-token or not, options).
Stage launchers, ``make_workspace``, ``pa_tile.plan`` and ``pa_tile.paged_decode`` all call it;
what differs between stages is data (their ``Limits``), not code.

Errors: a ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, range, device)
whose message starts with the argument's name, raised before anything is compiled or launched.

Host syncs: :func:`describe` reads only tensor metadata (shapes, dtypes, strides, devices), never
values, so it is free on a GPU. :func:`check_values` reads values (context lengths within the
block table, page ids within the cache, scales finite and > 0): free for CPU tensors, a host
sync for GPU tensors, so ``describe`` runs it only where it is free unless asked
(``check_values=True``); ``pa_tile.plan`` lets the caller choose.

Scales: each is a Python number or a float32 tensor, ``[1]`` (per tensor) or ``[num_blocks,
num_kv_heads, block_size]`` (per token); both must be of the same kind. A per-tensor scale must be
finite and > 0 (a zero key scale makes every score 0, and masked scores 0·-inf = NaN). Per-token
scales are read only where the kernel reads them, at the tokens inside each sequence's context:
there each must be finite and >= 0 (0 is the scale of an all-zero token, which the kernel computes
right); slots past a context are unwritten in a serving cache and may hold anything.

Score range: the kernels round P to fp8 after ``exp_shift``, whose margin grows with the row's
largest score |m| (log2 units, softmax scale applied): 2^(-|m|·2^-21) of P's range, so at |m| = 2^24
the top P is 2^-8 of FP8_MAX (still a normal fp8 number), and near 2^25 every P underflows and the
output is 0/0. :func:`check_values` bounds |m| from the data
the kernel reads (``softmax_scale · log2 e · max key scale · FP8_MAX · max_row ||q||_1``) and refuses
a call whose bound passes :data:`MAX_SCORE_LOG2`, so no silent NaN reaches the output; real
attention's bound sits near 2^6..2^12.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from pa_tile import arch as _arch

__all__ = ["Limits", "Problem", "describe", "check_values", "check_scales", "check_query_starts", "resolve_arch",
           "need_tensor",
           "scale_tensors", "output",
           "int_option", "K_LAYOUTS", "V_LAYOUTS", "QUERY_DTYPES", "MAX_SLIDING_WINDOW", "LOG2E",
           "MAX_SCORE_LOG2", "serving_options", "lse_output", "SOFT_CAP_RANGE"]

LOG2E = 1.4426950408889634
#: torch dtype -> the kernels' name for it
QUERY_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
#: cache layouts by name (``pa_tile.cache`` builds them): dims after [num_blocks, num_kv_heads]
K_LAYOUTS = {"plain": "[block_size, head_dim]", "blocked": "[head_dim//16, block_size, 16]"}
V_LAYOUTS = {"plain": "[head_dim, block_size]", "trans_blocked": "[block_size//16, head_dim, 16]"}
#: windows are compared with token positions in 32-bit arithmetic
MAX_SLIDING_WINDOW = 2**31 - 1
#: every offset the kernels compute is a signed 32-bit byte offset
_OFFSET_LIMIT = 2**31
#: the smallest positive normal float32: a score scale below it flushes to zero in the kernel
_F32_TINY = 2.0**-126
_F32_MAX = 3.4028234663852886e38
#: the largest bound on |score| (log2 units) a call may have: ``exp_shift``'s margin is |m|·2^-21
#: of P's exponent, so up to here the top P is at least 2^-8·FP8_MAX, a normal fp8 number (0.94 in
#: FNUZ, whose smallest normal is 2^-7; 1.75 in OCP); see the module docstring
MAX_SCORE_LOG2 = 2.0**24


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one stage's kernel supports. Stage modules declare one; ``describe`` enforces it."""

    stage: str
    head_dims: Tuple[int, ...] = (128,)
    block_sizes: Tuple[int, ...] = (16, 64)
    groups: Optional[Tuple[int, ...]] = (8, 16)  # None: any of 1 .. max_group
    max_group: int = 16
    max_query_length: int = 1
    query_dtypes: Tuple[torch.dtype, ...] = (torch.float16,)
    k_layouts: Tuple[str, ...] = ("plain",)
    v_layouts: Tuple[str, ...] = ("plain",)
    per_token_scales: bool = False
    strided_query: bool = False  # False: the launcher passes query.contiguous()
    sliding_window: bool = False
    max_partitions: int = 1
    max_m_tiles: int = 1
    #: the most query rows (group x query_length) one KV head's workgroup takes; None: no bound
    max_rows: Optional[int] = None

    def allows_group(self, g: int, query_length: int = 1) -> bool:
        if self.groups is not None:
            return g in self.groups
        return 1 <= g <= self.largest_group(query_length)

    def largest_group(self, query_length: int = 1) -> int:
        """The largest group (query heads per KV head) at ``query_length`` (its rows must fit)."""
        if self.groups is not None:
            return max(self.groups)
        return self.max_group if self.max_rows is None else min(self.max_group, self.max_rows // query_length)

    def groups_text(self, query_length: int = 1) -> str:
        if self.groups is not None:
            return " or ".join(map(str, self.groups))
        return f"1..{self.largest_group(query_length)}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """An immutable description of one validated decode call (no tensors, only facts)."""

    limits: Limits
    arch: str
    device: str  # torch device string of every tensor, e.g. "cpu" or "cuda:0"
    num_seqs: int
    query_length: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks: int  # block-table width
    q_dtype: str  # "f16" | "bf16"
    k_layout: str
    v_layout: str
    per_token: bool
    softmax_scale: float
    sliding_window: int = 0
    # the serving math (chapter 08): sinks given, the soft-cap (0: none), the log-sum-exp out
    sinks: bool = False
    soft_cap: float = 0.0
    lse: bool = False
    #: ragged query rows (``query_start_loc``): the rows of ``query`` (``loc[-1]``); None: uniform,
    #: ``num_seqs x query_length`` rows. When ragged, ``query_length`` is the bound on each
    #: sequence's rows, which the kernels are specialized for.
    ragged_rows: Optional[int] = None

    @property
    def ragged(self) -> bool:
        return self.ragged_rows is not None

    @property
    def total_rows(self) -> int:
        """Rows of ``query`` and ``out``."""
        return self.ragged_rows if self.ragged else self.num_seqs * self.query_length

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        """Query rows one KV head serves: group × query_length."""
        return self.group * self.query_length

    @property
    def max_context(self) -> int:
        """Tokens the block table can address."""
        return self.max_blocks * self.block_size

    @property
    def scale_log2(self) -> float:
        """The kernels' score scale: softmax_scale in log2 units."""
        return self.softmax_scale * LOG2E

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def per_token_shape(self) -> Tuple[int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size)


# ---------------------------------------------------------------------------------------------
# small checks, shared by every launcher


def need_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def int_option(v, name: str, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}: must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def resolve_arch(arch, device=None) -> str:
    """The arch to compile for. ``None``: the arch of ``device`` (a GPU's gfx name) or, for CPU
    tensors, the emulator's (``ARCH`` / ``FLYDSL_GPU_ARCH`` / gfx942). On a GPU an explicit arch
    that differs from the device's is an error: that code cannot run there."""
    from pa_tile import backend

    dev_arch = backend.device_arch(device) if device is not None else None
    if arch is None:
        return dev_arch if dev_arch is not None else backend.default_arch()
    arch = _arch.check_arch(arch)
    if dev_arch is not None and arch != dev_arch:
        raise ValueError(f"arch: {arch!r} was asked for, but the tensors are on {device}, a {dev_arch} GPU")
    return arch


def _check_fp8_cache(x, name: str, arch: str) -> None:
    need_tensor(x, name)
    want = _arch.fp8_torch_dtype(arch)
    others = {_arch.fp8_torch_dtype(a) for a in _arch.ARCHS}
    if x.dtype in others and x.dtype != want:
        raise ValueError(f"{name}: {x.dtype} codes do not match {arch}, which decodes e4m3 as {want} "
                         f"(FNUZ on gfx942, OCP on gfx950); convert the cache or pass the other arch")
    if x.dtype not in (want, torch.uint8):
        raise TypeError(f"{name}: expected {want} (or uint8 codes), got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if x.numel() >= _OFFSET_LIMIT:
        raise ValueError(f"{name}: {x.numel()} bytes exceed the kernel's 32-bit byte offsets")


def _k_layout_of(key_cache, limits: Limits, head_dim: int):
    dims = key_cache.dim()
    layout = {4: "plain", 5: "blocked"}.get(dims)
    if layout not in limits.k_layouts:
        want = " or ".join(f"{k} [num_blocks, num_kv_heads, {K_LAYOUTS[k][1:]}" for k in limits.k_layouts)
        raise ValueError(f"key_cache: stage {limits.stage} reads K {want}, got shape {tuple(key_cache.shape)}")
    if layout == "plain":
        num_blocks, num_kv_heads, block_size, d = key_cache.shape
        ok = d == head_dim
    else:
        num_blocks, num_kv_heads, d16, block_size, w = key_cache.shape
        ok = d16 * 16 == head_dim and w == 16
    if not ok:
        raise ValueError(f"key_cache: expected K {layout} [num_blocks, num_kv_heads, {K_LAYOUTS[layout][1:]} "
                         f"with head_dim {head_dim}, got shape {tuple(key_cache.shape)}")
    if block_size not in limits.block_sizes:
        raise ValueError(f"key_cache: block_size must be one of {limits.block_sizes}, got {block_size} "
                         f"(shape {tuple(key_cache.shape)})")
    if num_blocks == 0 or num_kv_heads == 0:
        raise ValueError(f"key_cache: empty dimension in shape {tuple(key_cache.shape)}")
    return layout, num_blocks, num_kv_heads, block_size


def _v_layout_of(value_cache, v_layout, limits: Limits, num_blocks, num_kv_heads, block_size, head_dim):
    if v_layout is None:
        by_dims = {4: "plain", 5: "trans_blocked"}.get(value_cache.dim())
        v_layout = by_dims if by_dims in limits.v_layouts else limits.v_layouts[0]
    elif not isinstance(v_layout, str) or v_layout not in limits.v_layouts:
        raise ValueError(f"v_layout: stage {limits.stage} reads V as one of {limits.v_layouts}, got {v_layout!r}")
    want = ((num_blocks, num_kv_heads, block_size // 16, head_dim, 16) if v_layout == "trans_blocked"
            else (num_blocks, num_kv_heads, head_dim, block_size))
    if tuple(value_cache.shape) != want:
        raise ValueError(f"value_cache: expected V {v_layout} {list(want)} (pa_tile.cache builds it), "
                         f"got {tuple(value_cache.shape)}")
    return v_layout


def _scale_kind(x, name: str, device, per_token_shape, limits: Limits) -> bool:
    """Checks one scale's kind, dtype, shape and device; -> per_token. Values: ``check_scales``."""
    if isinstance(x, bool) or not isinstance(x, (int, float, torch.Tensor)):
        raise TypeError(f"{name}: expected a float or a float32 tensor, got {type(x).__name__}")
    if not isinstance(x, torch.Tensor):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name}: a per-tensor scale must be finite and > 0, got {x}")
        return False
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: on {x.device}, but query is on {device}")
    if x.numel() == 1 and x.dim() <= 1:
        return False
    if limits.per_token_scales and tuple(x.shape) == tuple(per_token_shape):
        if not x.is_contiguous():
            raise ValueError(f"{name}: a per-token scale must be contiguous")
        return True
    want = f"[1] (per tensor) or {list(per_token_shape)} (per token)" if limits.per_token_scales else "[1]"
    raise ValueError(f"{name}: stage {limits.stage} takes a scale of shape {want}, got {tuple(x.shape)}")


def check_scales(key_scale, value_scale, read=None) -> float:
    """Scale values: a per-tensor scale finite and > 0; per-token scales finite and >= 0 where
    the kernel reads them (``read(x)``: ``(lo, hi)`` of ``x`` over those tokens, None if none;
    None: over all of ``x``). Returns the largest key scale read (0 where none is), for the score
    bound. Reads tensor values: a host sync for GPU tensors."""
    k_max = 0.0
    for name, x in (("key_scale", key_scale), ("value_scale", value_scale)):
        if not isinstance(x, torch.Tensor):  # a number: ``describe`` checked it
            hi = None if x is None else float(x)
        elif x.numel() == 1:
            hi = float(x.reshape(()).item())
            if not (math.isfinite(hi) and hi > 0):
                raise ValueError(f"{name}: a per-tensor scale must be finite and > 0, got {hi}")
        else:
            span = tuple(float(v) for v in x.aminmax()) if read is None else read(x)
            # NaN propagates into both ends
            if span is not None and not (math.isfinite(span[0]) and math.isfinite(span[1]) and span[0] >= 0):
                raise ValueError(f"{name}: every scale inside a context must be finite and >= 0, found values "
                                 f"in [{span[0]}, {span[1]}]")
            hi = None if span is None else span[1]
        if name == "key_scale" and hi is not None:
            k_max = hi
    return k_max


def context_span(problem: Problem, block_tables, context_lengths):
    """``read(x)`` -> ``(lo, hi)`` of a per-token tensor ``x`` [num_blocks, num_kv_heads,
    block_size] over the tokens inside each sequence's context (those whose scales the kernel
    reads), or None when there are none. Page ids must have been checked. Views and gathers
    only: no tensor is created by a factory (an allocation-free call stays allocation-free)."""
    bs = problem.block_size
    pieces = []
    for s, n in enumerate(context_lengths.tolist()):
        full, rem = divmod(n, bs)
        if full:
            pieces.append(block_tables[s, :full])
        if rem:
            pieces.append((int(block_tables[s, full]), rem))

    def read(x):
        if not pieces:
            return None
        spans = [tuple(float(v) for v in (x[p[0], :, : p[1]] if isinstance(p, tuple) else x.index_select(0, p))
                       .aminmax()) for p in pieces]
        if any(math.isnan(a) or math.isnan(b) for a, b in spans):  # min/max would drop a NaN
            return math.nan, math.nan
        return min(a for a, _ in spans), max(b for _, b in spans)

    return read


def check_query_starts(problem: Problem, query_start_loc) -> list:
    """The values of a ragged problem's ``query_start_loc``: 0 first, never falling, the query's
    rows last, each sequence's count at most ``query_length`` (the kernels' bound). Returns the
    counts ``loc[s+1] - loc[s]``. A host sync for a GPU tensor."""
    loc = query_start_loc.tolist()
    if loc[0] != 0:
        raise ValueError(f"query_start_loc: must start at 0, got {loc[0]}")
    counts = [b - a for a, b in zip(loc, loc[1:])]
    for s, n in enumerate(counts):
        if n < 0:
            raise ValueError(f"query_start_loc: decreases at sequence {s} ({loc[s]} -> {loc[s + 1]})")
        if n > problem.query_length:
            raise ValueError(f"query_start_loc: sequence {s} has {n} query rows, more than query_length="
                             f"{problem.query_length} (the bound the kernel is specialized for)")
    if loc[-1] != problem.ragged_rows:
        raise ValueError(f"query_start_loc: ends at {loc[-1]}, but query has {problem.ragged_rows} rows")
    return counts


def score_bound_log2(problem: Problem, query, key_k_max: float) -> float:
    """An upper bound on |score| in log2 units over every row and key the kernel reads:
    ``softmax_scale · log2 e · max key scale · FP8_MAX · max_row ||q_row||_1`` (|q·k| <= ||q||_1 ·
    max |k|, and an fp8 code is at most FP8_MAX)."""
    q_l1 = float(query.abs().sum(-1, dtype=torch.float32).amax())
    return problem.softmax_scale * LOG2E * key_k_max * _arch.fp8_max(problem.arch) * q_l1


def check_values(problem: Problem, block_tables, context_lengths, key_scale=None, value_scale=None,
                 query=None, sinks=None, query_start_loc=None) -> None:
    """The checks that read tensor values (see the module docstring), each reading only what the
    kernel reads: each context length in ``query_length .. max_blocks·block_size``, the page ids
    inside each context in ``[0, num_blocks)``, the scales (:func:`check_scales`) at the tokens
    inside each context, and, given ``query``, the score bound (:func:`score_bound_log2`) within
    :data:`MAX_SCORE_LOG2` (not with a soft-cap, which bounds every score by the cap); ``sinks``
    not NaN or +inf (-inf is no sink). A ragged problem's ``query_start_loc``
    (:func:`check_query_starts`) gives each sequence's own query count in place of
    ``query_length``. A host sync when the tensors are on a GPU."""
    if sinks is not None:
        bad = torch.isnan(sinks) | (sinks == math.inf)
        if bool(bad.any()):
            raise ValueError(f"sinks: must not be NaN or +inf (-inf is no sink), got {sinks[bad][0].item()} at "
                             f"query head {int(bad.nonzero()[0, 0])}")
    ql, room, nb, bs = problem.query_length, problem.max_context, problem.num_blocks, problem.block_size
    # plain Python lists: the check creates no tensor on the device (an allocation-free call
    # stays allocation-free there)
    rows = block_tables.tolist()
    counts = check_query_starts(problem, query_start_loc) if problem.ragged else None
    for s, n in enumerate(context_lengths.tolist()):
        if counts is not None:
            ql = counts[s]
        if not ql <= n <= room:
            raise ValueError(f"context_lengths: sequence {s} has {n} tokens; need {ql} .. {room} "
                             f"(block_tables width {problem.max_blocks} x block_size {bs})")
        for j, page in enumerate(rows[s][: -(-n // bs)]):
            if not 0 <= page < nb:
                raise ValueError(f"block_tables: entry [{s}, {j}] = {page} is not a page id in [0, {nb})")
    read = context_span(problem, block_tables, context_lengths) if problem.per_token else None
    k_max = check_scales(key_scale, value_scale, read)
    if query is not None and key_scale is not None and not problem.soft_cap:
        bound = score_bound_log2(problem, query, k_max)
        if not bound <= MAX_SCORE_LOG2:
            raise ValueError(f"key_scale: scores may reach {bound:.3g} in log2 units (softmax_scale x log2 e x "
                             f"key scale x FP8_MAX x the largest row's |q|_1), past the kernel's "
                             f"{MAX_SCORE_LOG2:.3g}: P's fp8 rounding would lose its range and the output "
                             f"could be NaN; rescale the query or the key scale")


#: the soft-cap values the kernels take: the cap and 2/cap stay normal float32 numbers in log2 units
SOFT_CAP_RANGE = (1e-30, 1e30)


def serving_options(sinks, logits_soft_cap, return_lse, num_q_heads: int, device) -> float:
    """Check the serving-math arguments (metadata only, no value read): ``sinks`` None or a
    contiguous float32 ``[num_q_heads]`` tensor on the query's device; ``logits_soft_cap`` None or
    a finite number in :data:`SOFT_CAP_RANGE`; ``return_lse`` a bool. Returns the soft-cap as a
    float (0.0: none)."""
    if sinks is not None:
        need_tensor(sinks, "sinks")
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks: expected float32 (one logit per query head, natural-log units), got {sinks.dtype}")
        if tuple(sinks.shape) != (num_q_heads,) or not sinks.is_contiguous():
            raise ValueError(f"sinks: expected a contiguous [{num_q_heads}] (num_q_heads) tensor, got "
                             f"{tuple(sinks.shape)}")
        if sinks.device != device:
            raise ValueError(f"sinks: on {sinks.device}, but query is on {device}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if logits_soft_cap is None:
        return 0.0
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
        raise TypeError(f"logits_soft_cap: expected a float or None, got {type(logits_soft_cap).__name__}")
    lo, hi = SOFT_CAP_RANGE
    if not (math.isfinite(logits_soft_cap) and lo <= logits_soft_cap <= hi):
        raise ValueError(f"logits_soft_cap: must be finite and in [{lo:g}, {hi:g}] (None: no cap), got "
                         f"{logits_soft_cap}")
    return float(logits_soft_cap)


def lse_output(problem: Problem, query, lse):
    """The log-sum-exp buffer: ``lse`` checked (contiguous float32 ``[query rows, num_q_heads]`` on
    the query's device), or a new one when None."""
    return _output_buffer(lse, "lse", torch.float32, (query.shape[0], problem.num_q_heads), query.device)


# ---------------------------------------------------------------------------------------------
# the one validation step


def describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
             limits: Limits, softmax_scale=None, query_length=None, sliding_window=0, arch=None,
             v_layout=None, check_values_now: Optional[bool] = None, sinks=None,
             logits_soft_cap=None, return_lse=False, query_start_loc=None) -> Problem:
    """Validate a decode call against ``limits``; -> :class:`Problem`.

    ``value_cache``, ``context_lengths`` and the scales may be ``None`` for callers that size
    buffers before they have them (``make_workspace``): what is given is checked exactly as a
    full call checks it; ``num_seqs`` then comes from ``block_tables``. ``check_values_now``:
    ``None`` runs :func:`check_values` only when the tensors are on the CPU (free there).
    ``sinks``, ``logits_soft_cap``, ``return_lse``: the serving math (:func:`serving_options`).

    ``query_start_loc`` (int32 ``[num_seqs + 1]`` on the query's device): ragged query rows,
    sequence ``s`` owns rows ``loc[s] .. loc[s+1]`` of ``query`` (see :func:`check_query_starts`);
    ``query_length`` is then the bound on a sequence's rows, the kernels' specialization. When it
    is None it defaults to ``limits.max_query_length`` if that bound's rows fit
    (``group x bound <= limits.max_rows``), and is otherwise required: a smaller bound costs
    fewer M-tiles, so a caller who knows its drafts are short should pass it.
    """
    need_tensor(query, "query")
    device = query.device
    arch = resolve_arch(arch, device)
    if query.dtype not in limits.query_dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in limits.query_dtypes)
        raise TypeError(f"query: stage {limits.stage} takes {names}, got {query.dtype}")
    if query.dim() != 3 or query.shape[0] == 0 or query.shape[1] == 0 or query.shape[2] not in limits.head_dims:
        raise ValueError(f"query: expected [num_seqs*query_length >= 1, num_q_heads >= 1, head_dim in "
                         f"{limits.head_dims}], got {tuple(query.shape)}")
    # a stage without strided_query reads a contiguous copy (its launcher makes it)
    if limits.strided_query and query.stride(2) != 1:
        raise ValueError(f"query: channels (dim 2) must be contiguous; rows and heads may be strided, "
                         f"got strides {query.stride()}")
    total_rows, num_q_heads, head_dim = query.shape

    _check_fp8_cache(key_cache, "key_cache", arch)
    k_layout, num_blocks, num_kv_heads, block_size = _k_layout_of(key_cache, limits, head_dim)
    if value_cache is not None:
        _check_fp8_cache(value_cache, "value_cache", arch)
        if value_cache.dtype != key_cache.dtype:
            raise TypeError(f"value_cache: dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
        v_layout = _v_layout_of(value_cache, v_layout, limits, num_blocks, num_kv_heads, block_size, head_dim)
    elif v_layout is None:
        v_layout = limits.v_layouts[0]
    if num_q_heads % num_kv_heads or not limits.allows_group(num_q_heads // num_kv_heads, 1):
        largest = f" (the largest group for query_length 1 is {limits.largest_group(1)})" if limits.max_rows else ""
        raise ValueError(f"query: num_q_heads={num_q_heads} must be {limits.groups_text()} times key_cache's "
                         f"num_kv_heads={num_kv_heads} for stage {limits.stage}{largest}")

    if context_lengths is not None:
        need_tensor(context_lengths, "context_lengths")
        if context_lengths.dtype != torch.int32:
            raise TypeError(f"context_lengths: expected int32, got {context_lengths.dtype}")
        if context_lengths.dim() != 1 or context_lengths.shape[0] == 0:
            raise ValueError(f"context_lengths: expected [num_seqs >= 1], got {tuple(context_lengths.shape)}")
        if not context_lengths.is_contiguous():
            raise ValueError("context_lengths: must be contiguous")
    need_tensor(block_tables, "block_tables")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables: expected int32, got {block_tables.dtype}")
    # num_seqs: one per context length (or per block-table row when there are no lengths yet)
    num_seqs = context_lengths.shape[0] if context_lengths is not None else max(1, block_tables.shape[0])
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables: expected [{num_seqs} (num_seqs), max_blocks_per_seq >= 1], "
                         f"got {tuple(block_tables.shape)}")
    if not block_tables.is_contiguous():
        raise ValueError("block_tables: must be contiguous")
    group = num_q_heads // num_kv_heads
    if query_start_loc is not None:
        _check_query_start_meta(query_start_loc, num_seqs, device)
        if query_length is None:
            if not limits.allows_group(group, limits.max_query_length):
                raise ValueError(f"query_length: required with query_start_loc at group {group} (the default bound "
                                 f"{limits.max_query_length} gives {group * limits.max_query_length} rows per KV "
                                 f"head, past the kernel's {limits.max_rows}); pass the largest sequence's "
                                 f"query rows, at most {limits.max_rows // group}")
            query_length = limits.max_query_length
        int_option(query_length, "query_length", 1, limits.max_query_length)
    elif query_length is None:
        if total_rows % num_seqs:
            raise ValueError(f"query: {total_rows} rows is not a multiple of num_seqs={num_seqs}")
        query_length = total_rows // num_seqs
    int_option(query_length, "query_length", 1, limits.max_query_length)
    if query_start_loc is None and total_rows != num_seqs * query_length:
        raise ValueError(f"query: expected {num_seqs}*{query_length} rows (num_seqs*query_length), got {total_rows}")
    if not limits.allows_group(group, query_length):
        raise ValueError(f"query: num_q_heads={num_q_heads} must be {limits.groups_text(query_length)} times "
                         f"key_cache's num_kv_heads={num_kv_heads} at query_length={query_length} for stage "
                         f"{limits.stage}: group x query_length = {group * query_length} query rows per KV head, "
                         f"past the kernel's {limits.max_rows} (the largest group for query_length "
                         f"{query_length} is {limits.largest_group(query_length)})")
    span = (total_rows - 1) * query.stride(0) + (num_q_heads - 1) * query.stride(1) + head_dim
    if span * query.element_size() >= _OFFSET_LIMIT:
        raise ValueError("query: spans more bytes than the kernel's 32-bit byte offsets reach")

    named = dict(key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                 context_lengths=context_lengths)
    for name, x in named.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name}: on {x.device}, but query is on {device}")
    per_token = False
    if key_scale is not None or value_scale is not None:
        pts = (num_blocks, num_kv_heads, block_size)
        kpt = _scale_kind(key_scale, "key_scale", device, pts, limits)
        vpt = _scale_kind(value_scale, "value_scale", device, pts, limits)
        if kpt != vpt:
            raise ValueError("value_scale: key_scale and value_scale must both be per tensor or both per token")
        per_token = kpt

    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    # the kernels scale scores by float32(softmax_scale · log2 e) after taking their max
    if not (math.isfinite(softmax_scale) and _F32_TINY <= softmax_scale * LOG2E <= _F32_MAX):
        raise ValueError(f"softmax_scale: must be finite, > 0 and representable in float32 as a normal "
                         f"number after the log2 e factor ({_F32_TINY / LOG2E:.3g} .. {_F32_MAX / LOG2E:.3g}), "
                         f"got {softmax_scale}")
    if sliding_window != 0 and not limits.sliding_window:
        raise ValueError(f"sliding_window: stage {limits.stage} has no sliding window")
    int_option(sliding_window, "sliding_window", 0, MAX_SLIDING_WINDOW)

    soft_cap = serving_options(sinks, logits_soft_cap, return_lse, num_q_heads, device)

    problem = Problem(
        limits=limits, arch=arch, device=str(device), num_seqs=num_seqs, query_length=query_length,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        num_blocks=num_blocks, max_blocks=block_tables.shape[1], q_dtype=QUERY_DTYPES[query.dtype],
        k_layout=k_layout, v_layout=v_layout, per_token=per_token, softmax_scale=float(softmax_scale),
        sliding_window=sliding_window, sinks=sinks is not None, soft_cap=soft_cap, lse=return_lse,
        ragged_rows=total_rows if query_start_loc is not None else None,
    )
    if check_values_now is None:
        check_values_now = device.type == "cpu"
    if check_values_now and context_lengths is not None:
        check_values(problem, block_tables, context_lengths, key_scale, value_scale, query, sinks,
                     query_start_loc)
    elif check_values_now and query_start_loc is not None:
        check_query_starts(problem, query_start_loc)
    return problem


def _check_query_start_meta(loc, num_seqs: int, device) -> None:
    """``query_start_loc``'s metadata (no values: no host sync): int32 ``[num_seqs + 1]``,
    contiguous, on the query's device."""
    need_tensor(loc, "query_start_loc")
    if loc.dtype != torch.int32:
        raise TypeError(f"query_start_loc: expected int32, got {loc.dtype}")
    if loc.device != device:
        raise ValueError(f"query_start_loc: on {loc.device}, but query is on {device}")
    if loc.dim() != 1 or loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc: expected [{num_seqs + 1}] (num_seqs + 1), got {tuple(loc.shape)}")
    if not loc.is_contiguous():
        raise ValueError("query_start_loc: must be contiguous")


# ---------------------------------------------------------------------------------------------
# the tensors a launch takes, from a validated problem


def scale_tensors(problem: Problem, key_scale, value_scale):
    """``(key_scale, value_scale)`` as the kernels read them: float32 ``[1]`` or per-token tensors
    on the problem's device. A Python number becomes a new one-element tensor (an allocation:
    pass tensors for allocation-free calls). Kind and shape were checked by ``describe``."""
    out = []
    for x in (key_scale, value_scale):
        if not isinstance(x, torch.Tensor):
            x = torch.tensor([float(x)], dtype=torch.float32, device=problem.torch_device)
        elif not problem.per_token:
            x = x.reshape(1)
        out.append(x)
    return out[0], out[1]


def output(problem: Problem, query, out, name: str = "out"):
    """``out`` checked against the problem (shape and dtype of ``query``, contiguous, same device),
    or a new tensor when ``out`` is None."""
    shape = (problem.total_rows, problem.num_q_heads, problem.head_dim)
    return _output_buffer(out, name, query.dtype, shape, query.device)


def _output_buffer(x, name: str, dtype, shape, device):
    """An output buffer ``x``: a contiguous ``dtype`` tensor of ``shape`` on ``device`` (named
    errors otherwise), or a new one when ``x`` is None."""
    if x is None:
        return torch.empty(shape, dtype=dtype, device=device)
    need_tensor(x, name)
    if x.dtype != dtype or tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected {dtype} {shape}, got {x.dtype} {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if x.device != device:
        raise ValueError(f"{name}: on {x.device}, but query is on {device}")
    return x
