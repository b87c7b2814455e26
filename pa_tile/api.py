"""The finished kernel's API: plan once per batch, run per layer, and a PyTorch op.

::

    plan = pa_tile.plan(query, key_cache, value_cache, block_tables, context_lengths, k_scale, v_scale)
    for layer in layers:                      # same shapes, new tensors each layer
        out = plan.run(q[layer], k_caches[layer], v_caches[layer], out=out_buf)

``plan`` validates everything once (``pa_tile.problem``), chooses the split-K partition count
from the shapes and the device's CU count, lays a balanced split's work out from the context
lengths (``Plan.refresh`` does it again after they change in place), and carves the workspace;
``Plan.run`` only checks that the tensors it is given match the plan (metadata, no values: no
host sync), then launches chapters 05-06's kernel (and chapter 07's reduce when split) through
``pa_tile.launching`` (compiled once, on torch's current stream). With ``out=`` given ``run``
allocates nothing, so it can be captured in a CUDA/HIP graph. ``paged_decode`` is the one-shot call built on the same pieces.

``torch.ops.pa_tile.paged_decode`` (``pa_tile.torch_ops``, registered by ``import pa_tile``) is
what ``paged_decode`` and ``run`` call while PyTorch traces them (``torch.compile``,
``FakeTensorMode``): they hand it their arguments as given, and the op plans and launches outside
the traced region (``op_impl``), so user code calling them compiles with the default arguments;
in eager mode they call the same implementation directly.
"""

from __future__ import annotations

from typing import Optional

import torch

from pa_tile import backend, launching, problem
from pa_tile.stages import s5_phase_split_mtp as s5
from pa_tile.stages import s6_split_k as s6

__all__ = ["plan", "Plan", "paged_decode", "make_workspace", "workspace_size", "choose_num_partitions", "LIMITS"]

#: what the finished kernel supports (chapter 07's stage limits)
LIMITS = s6.LIMITS
choose_num_partitions = s6.choose_num_partitions


def workspace_size(num_seqs, num_kv_heads, group, query_length, head_dim, num_partitions, schedule=None) -> int:
    """float32 elements of the workspace of a call with these shapes, ``num_partitions`` and
    ``schedule``; ``None`` is the call's own default (``s6.choose_schedule``: balanced for a split),
    so a workspace sized with the defaults serves a call made with the defaults. A ragged call
    (``query_start_loc``) takes ``query_length`` = its bound (8 by default), as its partials do."""
    return s6.workspace_size(num_seqs, num_kv_heads, group, query_length, head_dim, num_partitions,
                             s6.choose_schedule(num_partitions, schedule))


def _partitions(p: problem.Problem, num_partitions) -> int:
    if num_partitions is None:
        return s6.choose_num_partitions(p.num_seqs, p.num_kv_heads, p.max_context, arch=p.arch, head_dim=p.head_dim,
                                        group=p.group, query_length=p.query_length,
                                        cu_count=backend.cu_count(p.torch_device, p.arch), block_size=p.block_size,
                                        per_token=p.per_token)  # query_bytes: 2 for both f16 and bf16
    return problem.int_option(num_partitions, "num_partitions", 1, LIMITS.max_partitions)


def _split(p: problem.Problem, num_partitions, schedule, chunk_tiles, batch_invariant):
    """``(partitions, schedule, chunk_tiles)`` of a call. ``batch_invariant``: a balanced work list
    of fixed chunks of ``chunk_tiles`` tiles (None: ``s6.chunk_floor``, the traffic cap's), so a
    sequence's chunks, and with them its bits, depend on its own length only; the partition count
    then only sizes the work list (its longest possible sequence's chunks). Otherwise
    ``chunk_tiles`` None is ``s6.chunk_floor`` for the chosen split, 1 for an explicit
    ``num_partitions`` (honoured to the tile, as the uniform split honours it)."""
    if chunk_tiles is not None:
        problem.int_option(chunk_tiles, "chunk_tiles", 1, 1 << 20)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    def floor():  # the traffic cap's chunk, only where a choice needs it
        return s6.chunk_floor(p.head_dim, p.group, p.query_length, block_size=p.block_size, per_token=p.per_token)

    if batch_invariant:
        if num_partitions is not None:
            raise ValueError("num_partitions: batch_invariant=True splits every sequence into chunks of chunk_tiles "
                             "tiles; leave num_partitions None")
        if schedule not in (None, "balanced"):
            raise ValueError(f"schedule: batch_invariant=True uses the balanced schedule's work list, got {schedule!r}")
        per = floor() if chunk_tiles is None else chunk_tiles
        tiles = -(-p.max_context // s6.TILE)
        return -(-tiles // per), "balanced", per
    parts = _partitions(p, num_partitions)
    if chunk_tiles is None:
        chunk_tiles = floor() if num_partitions is None else 1
    return parts, s6.choose_schedule(parts, schedule), chunk_tiles


def _workspace(p: problem.Problem, parts: int, m_tiles, workspace, schedule="uniform"):
    if parts > 1:
        s5.partial_shapes(p, parts, m_tiles)  # refuses splits beyond 32-bit offsets
    if schedule == "balanced":
        s5.check_partial_offsets(p, s6.work_entries(p.num_seqs, parts), m_tiles,
                                 split=f"a balanced split of {p.num_seqs} sequences into {parts} partitions")
    need = s6.workspace_size(p.num_seqs, p.num_kv_heads, p.group, p.query_length, p.head_dim, parts, schedule)
    if workspace is None:
        return torch.empty(need, dtype=torch.float32, device=p.torch_device)
    problem.need_tensor(workspace, "workspace")
    if workspace.dtype != torch.float32 or workspace.dim() != 1 or not workspace.is_contiguous():
        raise ValueError(f"workspace: expected a contiguous 1-d float32 tensor, got {workspace.dtype} "
                         f"{tuple(workspace.shape)}")
    if workspace.device != p.torch_device:
        raise ValueError(f"workspace: on {workspace.device}, but query is on {p.device}")
    if workspace.numel() < need:
        raise ValueError(f"workspace: {parts} {schedule} partitions need {need} float32 elements, got {workspace.numel()} "
                         f"(size it with pa_tile.make_workspace or workspace_size)")
    return workspace


def _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
              softmax_scale, sliding_window, query_length, m_tiles, arch, check_values, sinks=None,
              logits_soft_cap=None, return_lse=False, query_start_loc=None):
    if m_tiles is not None:
        problem.int_option(m_tiles, "m_tiles", 1, LIMITS.max_m_tiles)
    if check_values is None:
        check_values = (isinstance(query, torch.Tensor) and query.device.type == "cpu"
                        and not _tracing(query))
    return problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                            limits=LIMITS, softmax_scale=softmax_scale, query_length=query_length,
                            sliding_window=sliding_window, arch=arch, check_values_now=check_values, sinks=sinks,
                            logits_soft_cap=logits_soft_cap, return_lse=return_lse, query_start_loc=query_start_loc)


def _codes(cache):
    """The kernels read caches as bytes."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def _tracing(t) -> bool:
    """PyTorch is tracing (torch.compile) or the tensors are fakes: go through the op. Under a
    simulated GPU fake tensors take the real path, whose launch boundary checks them."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and backend.simulated_gpu() is None


class Pipeline:
    """The partial kernel and (when split) the reduce as one callable over ``@flyc.jit``
    launchers, for ``pa_tile.toolchain.compile_isa`` and the benchmark's graph capture."""

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
        import types

        return types.SimpleNamespace(clear=lambda: [getattr(l, "_mem_cache", {}).clear() for l, _ in self.steps])


class Plan:
    """A validated batch: problem, partition count and schedule, workspace, block tables, context
    lengths and default scales fixed. ``run`` is the per-layer call."""

    def __init__(self, p: problem.Problem, num_partitions: int, m_tiles: Optional[int], workspace, block_tables,
                 context_lengths, key_scale, value_scale, query_meta, cache_meta, schedule="uniform",
                 chunk_tiles=1, sinks=None, batch_invariant=False, query_start_loc=None):
        self.problem, self.num_partitions, self.m_tiles = p, num_partitions, m_tiles
        self.schedule = schedule
        self.workspace, self.block_tables, self.context_lengths = workspace, block_tables, context_lengths
        self.key_scale, self.value_scale = problem.scale_tensors(p, key_scale, value_scale)
        self.sinks = sinks  # chapter 08's serving math: run(sinks=) replaces them per layer
        self.batch_invariant = batch_invariant
        self._query_meta, self._cache_meta = query_meta, cache_meta
        rows = s5.plan(p.head_dim, p.group, p.query_length, m_tiles)[0]
        self._balanced = schedule == "balanced"
        #: the call writes partials and runs the reduce (a split, or any balanced schedule)
        self.splits = num_partitions > 1 or self._balanced
        # a balanced split's grid x is its work list's entries, each with one partial slot per KV head
        grid_x = s6.work_entries(p.num_seqs, num_partitions) if self._balanced else p.num_seqs
        slots = (grid_x, 1) if self._balanced else (p.num_seqs, num_partitions)
        self._partials = tuple(s6.carve(workspace, slots[0], p.num_kv_heads, rows, p.head_dim, slots[1])
                               if self.splits else (workspace.narrow(0, 0, 1),) * 3)
        self._out_shape = (p.total_rows, p.num_q_heads, p.head_dim)
        #: ragged query rows (``p.ragged``): the int32 [num_seqs + 1] row starts the kernels read
        self.query_start_loc = query_start_loc
        stride = query_meta[3]
        self._scalars = (grid_x, p.num_kv_heads, p.max_blocks, stride[0], stride[1], p.scale_log2)
        self._reduce_scalars = (p.num_seqs, p.num_kv_heads) if self._balanced else \
            (p.num_seqs, p.num_kv_heads, num_partitions)
        self.chunk_tiles = chunk_tiles  # the fewest tiles a balanced split's chunk gets
        self._work_buffers = s6.work_list_buffers(p.num_seqs, num_partitions, p.torch_device) \
            if self._balanced else None
        self._work = None  # plan() lays it out (not while PyTorch traces: the op's run does)
        self._compiled, self._compiled_on = None, None

    # -- the per-layer call --------------------------------------------------------------------

    def run(self, query, key_cache, value_cache, key_scale=None, value_scale=None, out=None, sinks=None,
            lse=None):
        """Attention of this layer's ``query`` over its caches; returns ``out``, or ``(out, lse)``
        for a plan made with ``return_lse=True``. Checks that the tensors match the plan (shapes,
        dtypes, device, query strides' reach); scales and sinks default to the plan's. No value is
        read (no host sync); with ``out`` (and ``lse``) given nothing is allocated."""
        self._check(query, "query", self._query_meta)
        self._check_cache(key_cache, "key_cache")
        self._check_cache(value_cache, "value_cache")
        ks = self.key_scale if key_scale is None else self._scale(key_scale, "key_scale")
        vs = self.value_scale if value_scale is None else self._scale(value_scale, "value_scale")
        if out is None:
            out = torch.empty(self._out_shape, dtype=query.dtype, device=query.device)
        elif not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        elif out.shape != self._out_shape or out.dtype != query.dtype or out.device != query.device \
                or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous {query.dtype} {self._out_shape} on {query.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        sinks = self._sinks(sinks)
        p = self.problem
        if lse is not None and not p.lse:
            raise ValueError("lse: the plan was made without return_lse=True")
        if p.lse:
            lse = problem.lse_output(p, query, lse)
        if _tracing(query):
            torch.ops.pa_tile.paged_decode(query, key_cache, value_cache, self.block_tables, self.context_lengths,
                                           ks, vs, out, self.workspace, p.softmax_scale, p.sliding_window,
                                           p.query_length, None if self.batch_invariant else self.num_partitions,
                                           self.m_tiles, p.arch, self.schedule, self.chunk_tiles, sinks,
                                           p.soft_cap or None, lse, self.batch_invariant, self.query_start_loc)
        else:
            self._launch(query, key_cache, value_cache, ks, vs, out, sinks, lse)
        return (out, lse) if p.lse else out

    def _sinks(self, x):
        """The sinks of a run: the plan's, or ``x`` checked like them (metadata only)."""
        if x is None:
            return self.sinks
        if not self.problem.sinks:
            raise ValueError("sinks: the plan was made without sinks (they specialize the kernel); make a plan "
                             "with sinks=")
        problem.serving_options(x, None, False, self.problem.num_q_heads, self.problem.torch_device)
        return x

    @property
    def _partial(self):  # built on first use: tracing a plan (torch.compile) must not build kernels
        if self._balanced:
            return s5.launcher_for(self.problem, 1, self.m_tiles, work_list=True)
        return s5.launcher_for(self.problem, self.num_partitions, self.m_tiles)

    @property
    def _reduce(self):
        p = self.problem
        return s6.build_reduce(p.head_dim, p.group, p.query_length, p.q_dtype, self._balanced, p.sinks, p.lse,
                               p.ragged) if self.splits else None

    def work_list(self):
        """``(work, offsets)`` of a balanced split (``s6.work_list``), as laid out when planned or
        last refreshed; None for an unsplit or uniform plan."""
        return self._work

    def refresh(self):
        """Lay a balanced split's work out again from the context lengths' current values (after
        changing them in place, e.g. between the decode steps of a captured graph): device ops
        into the plan's own buffers, no host sync, nothing allocated; a run reads the result.
        Layers of one step share it, so ``run`` does not redo it (its twenty-odd small ops cost
        about 90 µs of host time on a CPU: once a step, not once a layer). Returns the plan."""
        if self._balanced:
            p = self.problem
            self._work = s6.work_list(self.context_lengths, self.num_partitions, self.chunk_tiles,
                                      query_length=p.query_length, sliding_window=p.sliding_window,
                                      buffers=self._work_buffers, fixed_chunks=self.batch_invariant,
                                      query_start_loc=self.query_start_loc)
        return self

    def _steps(self, query, key_cache, value_cache, ks, vs, out, sinks=None, lse=None):
        """``[(launcher, args), ...]`` of one run: the partial kernel, then the reduce when split.
        Sinks and the log-sum-exp go to the unsplit kernel (lse in the max's place) or the reduce;
        where they are off, their places hold a tensor that is never read (``ks``)."""
        wl = self._work
        work = self.context_lengths if wl is None else wl[0]  # the unsplit/uniform kernel never reads it
        sk = ks if sinks is None else sinks
        partials = self._partials
        if not self.splits and lse is not None:
            partials = (lse,) + partials[1:]
        # a ragged call's row starts go last in both kernels (their own specializations)
        loc = (self.query_start_loc,) if self.problem.ragged else ()
        steps = [(self._partial, (out,) + partials + (query, _codes(key_cache), _codes(value_cache),
                                                      self.block_tables, self.context_lengths, work, ks, vs)
                  + self._scalars + (sk,) + loc)]
        if self.splits:
            extra = (wl[1],) if wl is not None else ()
            steps.append((self._reduce, (out,) + partials + extra + self._reduce_scalars
                          + (sk, ks if lse is None else lse) + loc))
        return steps

    def _launch(self, query, key_cache, value_cache, ks, vs, out, sinks=None, lse=None):
        p, device = self.problem, query.device
        steps = self._steps(query, key_cache, value_cache, ks, vs, out, sinks, lse)
        if self._compiled is None or self._compiled_on != device:
            # first launch (or a simulated GPU's first real one): compile, then keep the handles
            self._compiled = [launching.launch(fn, args, arch=p.arch, device=device) for fn, args in steps]
            self._compiled_on = device
            return
        for compiled, (_, args) in zip(self._compiled, steps):
            launching.call(compiled, args, p.arch, device)

    def pipeline(self, query, key_cache, value_cache, out=None) -> Pipeline:
        """The launches of one ``run`` as a :class:`Pipeline` (``compile_isa``, graph capture);
        ``pipe.lse`` is the log-sum-exp buffer of a ``return_lse`` plan."""
        out = problem.output(self.problem, query, out)
        p = self.problem
        lse = problem.lse_output(p, query, None) if p.lse else None
        pipe = Pipeline(self._steps(query, key_cache, value_cache, self.key_scale, self.value_scale, out,
                                    self.sinks, lse), p.arch)
        pipe.out, pipe.lse = out, lse
        return pipe

    # -- per-call checks: metadata only --------------------------------------------------------

    def _check(self, x, name, meta):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if (x.shape, x.dtype, x.device, x.stride()) != meta:
            shape, dtype, device, stride = meta
            raise ValueError(f"{name}: the plan was made for {dtype} {tuple(shape)} (strides {stride}) on {device}, "
                             f"got {x.dtype} {tuple(x.shape)} (strides {x.stride()}) on {x.device}; make a new plan")

    def _check_cache(self, x, name):
        p = self.problem
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        want = self._cache_meta[name]
        if (x.shape, x.dtype, x.device) != want or not x.is_contiguous():
            raise ValueError(f"{name}: the plan was made for a contiguous {want[1]} {tuple(want[0])} on {p.device}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}; make a new plan")

    def _scale(self, x, name):
        p = self.problem
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: Plan.run takes float32 tensors (a float would allocate); got "
                            f"{type(x).__name__}")
        want = p.per_token_shape if p.per_token else (1,)
        if x.dtype != torch.float32 or x.device != p.torch_device or (tuple(x.shape) != tuple(want)
                                                                       and not (not p.per_token and x.numel() == 1)):
            raise ValueError(f"{name}: expected float32 {list(want)} on {p.device} like the plan's, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        return x if p.per_token else x.reshape(1)

    def __repr__(self) -> str:
        p = self.problem
        queries = f"<={p.query_length}" if p.ragged else f"{p.query_length}"
        return (f"Plan({p.num_seqs} seqs x {queries} queries, {p.num_q_heads}/{p.num_kv_heads} heads, "
                f"head_dim {p.head_dim}, block {p.block_size}, {p.arch}, {self.num_partitions} partition(s)"
                + (", balanced" if self._balanced else "") + (", batch-invariant" if self.batch_invariant else "")
                + (f", soft-cap {p.soft_cap:g}" if p.soft_cap else "") + (", sinks" if p.sinks else "")
                + (", lse" if p.lse else "") + ")")


def plan(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
         softmax_scale=None, sliding_window=0, query_length=None, workspace=None, num_partitions=None,
         m_tiles=None, arch=None, check_values=None, schedule=None, chunk_tiles=None, sinks=None,
         logits_soft_cap=None, return_lse=False, batch_invariant=False, query_start_loc=None) -> Plan:
    """Validate a batch once and fix what its layers share; -> :class:`Plan`.

    Arguments as :func:`paged_decode`. ``check_values``: read context lengths, page ids and scales
    to check them (``pa_tile.problem.check_values``); ``None`` does so only for CPU tensors, where
    it is free; ``True`` on a GPU costs one host sync, here, not in ``run``. Allocates the
    workspace unless one is given (``make_workspace``). ``chunk_tiles``: the fewest 256-token
    tiles of a balanced split's chunk (None: ``s6.chunk_floor``, the traffic cap, for the chosen
    split; 1 for an explicit ``num_partitions``, honoured as the uniform split honours it); with
    ``batch_invariant`` every chunk's size (:func:`_split`). ``query_start_loc``: ragged query rows
    (:func:`paged_decode`); the plan keeps the tensor, whose values may change in place between runs
    (``refresh`` after they do, for a balanced split)."""
    p = _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                  softmax_scale=softmax_scale, sliding_window=sliding_window, query_length=query_length,
                  m_tiles=m_tiles, arch=arch, check_values=check_values, sinks=sinks,
                  logits_soft_cap=logits_soft_cap, return_lse=return_lse, query_start_loc=query_start_loc)
    parts, sched, chunk_tiles = _split(p, num_partitions, schedule, chunk_tiles, batch_invariant)
    ws = _workspace(p, parts, m_tiles, workspace, sched)
    pl = Plan(p, parts, m_tiles, ws, block_tables, context_lengths, key_scale, value_scale,
              (query.shape, query.dtype, query.device, query.stride()),
              {"key_cache": (key_cache.shape, key_cache.dtype, key_cache.device),
               "value_cache": (value_cache.shape, value_cache.dtype, value_cache.device)}, sched, chunk_tiles,
              sinks, batch_invariant, query_start_loc)
    return pl if _tracing(query) else pl.refresh()


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, sliding_window=0, query_length=None, out=None, workspace=None,
                 num_partitions=None, m_tiles=None, arch=None, schedule=None, sinks=None, logits_soft_cap=None,
                 return_lse=False, lse=None, batch_invariant=False, query_start_loc=None):
    """fp8 paged decode attention (the finished pa_tile kernel); returns ``out``, or ``(out, lse)``
    with ``return_lse=True``.

    ``query`` [num_seqs·query_length, num_q_heads, head_dim] f16/bf16 (row ``s·query_length + i`` is
    draft ``i`` of sequence ``s``, the last ``query_length`` positions, causally masked; rows and
    heads may be strided); ``key_cache`` blocked [num_blocks, num_kv_heads, head_dim//16, block_size,
    16]; ``value_cache`` trans-blocked [num_blocks, num_kv_heads, block_size//16, head_dim, 16] or
    plain [num_blocks, num_kv_heads, head_dim, block_size]; fp8 e4m3 of the arch (FNUZ on gfx942,
    OCP on gfx950) or uint8 codes; ``block_tables`` [num_seqs, max_blocks] int32;
    ``context_lengths`` [num_seqs] int32; scales (> 0), floats or float32 tensors, both [1] or both
    [num_blocks, num_kv_heads, block_size] (per token). ``sliding_window``: a query at position p
    sees tokens (p - W, p] (0 = all). ``num_partitions``: split-K count (None =
    ``choose_num_partitions`` for the device's CU count). ``schedule``: how a split lays out its
    work, ``"balanced"`` (a work list of equal chunks of the batch's tiles, for ragged batches) or
    ``"uniform"`` (each sequence in ``num_partitions`` equal parts); None = ``s6.DEFAULT_SCHEDULE``.
    With ``out`` and ``workspace``
    (``make_workspace``) given, nothing is allocated: the call can be captured in a CUDA/HIP graph.
    ``arch`` defaults to the tensors' device (the emulator's for CPU tensors).

    Serving math (chapter 08), each a compile-time specialization (off: the kernels' machine code
    is unchanged):

    * ``sinks``: float32 ``[num_q_heads]``, one logit per query head in natural-log units, not
      multiplied by ``softmax_scale`` (gpt-oss): each row's softmax denominator gains
      ``exp(sinks[h])``, V gains nothing. -inf is no sink.
    * ``logits_soft_cap``: ``cap · tanh(s / cap)`` on the scaled logits ``s`` before masking
      (Gemma 2); None: none.
    * ``return_lse``: also return ``lse``, float32 ``[query rows, num_q_heads]``, the natural log
      of each row's softmax denominator (``softmax_scale`` applied), written into ``lse`` if given.
      It includes the sink: it is the denominator ``out`` was divided by, so ``(out, lse)`` is an
      attention state that :func:`pa_tile.merge_states` merges exactly with one over other keys
      (give the sinks to one of the parts only). -inf for a row with no key.
    * ``batch_invariant``: a sequence's output is bitwise the same whatever batch it sits in and
      wherever: its keys are split into fixed chunks of ``s6.chunk_floor`` tiles (a balanced work
      list whose chunk size does not depend on the batch) and always merged by the reduce.

    ``query_start_loc`` (int32 [num_seqs + 1], on the query's device; vLLM's name): ragged query
    rows. Sequence ``s`` has ``q_s = loc[s+1] - loc[s]`` queries, rows ``loc[s] .. loc[s+1]`` of
    ``query`` (``[loc[-1], num_q_heads, head_dim]``) and of ``out``, the last ``q_s`` positions of its
    context, causally masked (0: skipped, no row). ``query_length`` is then the bound on every
    ``q_s`` (no host sync reads it from ``loc``); None takes ``LIMITS.max_query_length`` (8) when
    ``group x 8 <= 128`` rows fit, else it must be given. The kernels are specialized for the bound,
    so a smaller one is cheaper.

    Checks (``pa_tile.problem``): every argument's kind, dtype, shape, layout and device, before any
    launch; values (context lengths, page ids, scale values) only for CPU tensors, where reading
    them is free; use ``plan(..., check_values=True)`` to check them once on a GPU.
    """
    if lse is not None and return_lse is not True:
        raise ValueError("lse: a buffer for the log-sum-exp was given without return_lse=True")
    if _tracing(query):  # torch.compile / fake tensors: the op plans outside the traced region
        return _via_op(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                       softmax_scale, sliding_window, query_length, out, workspace, num_partitions, m_tiles, arch,
                       schedule, sinks, logits_soft_cap, return_lse, lse, batch_invariant, query_start_loc)
    tensors = (query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, workspace,
               sinks, query_start_loc)
    key = _call_key(tensors, (softmax_scale, sliding_window, query_length, num_partitions, m_tiles, arch, schedule,
                              logits_soft_cap, repr(return_lse), repr(batch_invariant)))
    pl = _plans.get(key) if key is not None else None
    if pl is None:
        pl = plan(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                  softmax_scale=softmax_scale, sliding_window=sliding_window, query_length=query_length,
                  workspace=workspace, num_partitions=num_partitions, m_tiles=m_tiles, arch=arch,
                  schedule=schedule, sinks=sinks, logits_soft_cap=logits_soft_cap, return_lse=return_lse,
                  batch_invariant=batch_invariant, query_start_loc=query_start_loc)
        # a plan owning its workspace is not shared between calls (streams could overlap on it)
        if key is not None and (workspace is not None or not pl.splits):
            if len(_plans) >= _MAX_PLANS:
                _plans.pop(next(iter(_plans)))
            _plans[key] = pl
    else:
        # the same call as before, by every tensor's metadata and memory: only the values may differ
        if query.device.type == "cpu":
            problem.check_values(pl.problem, block_tables, context_lengths, key_scale, value_scale, query, sinks,
                                 query_start_loc)
        pl.refresh()  # a balanced split's work follows the lengths' values
    return pl.run(query, key_cache, value_cache, out=out, lse=lse)


def _scale_tensor(x, name, device):
    """A Python number as the float32 ``[1]`` tensor the op takes; a tensor as it is."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.full((1,), float(x), dtype=torch.float32, device=device)
    return problem.need_tensor(x, name)


def _via_op(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, softmax_scale,
            sliding_window, query_length, out, workspace, num_partitions, m_tiles, arch, schedule, sinks,
            logits_soft_cap, return_lse, lse, batch_invariant, query_start_loc=None):
    """``paged_decode`` while PyTorch traces: the arguments as given into the op (``op_fake``
    validates them at trace time, ``op_impl`` plans and launches at run time)."""
    problem.need_tensor(query, "query")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if return_lse and lse is None:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    torch.ops.pa_tile.paged_decode(query, key_cache, value_cache, block_tables, context_lengths,
                                   _scale_tensor(key_scale, "key_scale", query.device),
                                   _scale_tensor(value_scale, "value_scale", query.device), out, workspace,
                                   softmax_scale, sliding_window, query_length, num_partitions, m_tiles, arch,
                                   schedule, None, sinks, logits_soft_cap, lse, batch_invariant, query_start_loc)
    return (out, lse) if return_lse else out


_plans: dict = {}
_MAX_PLANS = 64


def _call_key(tensors, options):
    """Every tensor's metadata and memory, and the options: a call with the same key is the same
    problem on the same buffers, so its plan serves again. ``None`` when an argument is not a
    tensor/number (the full validation then names it), or a fake (its memory is no address: every
    fake's ``data_ptr`` reads 0, and PyTorch deprecates reading it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    key = []
    for t in tensors:
        if isinstance(t, FakeTensor):
            return None
        if isinstance(t, torch.Tensor):
            key.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))
        elif t is None or (isinstance(t, (int, float)) and not isinstance(t, bool)):
            key.append(t)
        else:
            return None
    for o in options:
        if not (o is None or isinstance(o, (int, float, str))) or isinstance(o, bool):
            return None
        key.append((type(o), o))
    return tuple(key)


def make_workspace(query, key_cache, block_tables, *, query_length=None, num_partitions=None, arch=None,
                   value_cache=None, context_lengths=None, schedule=None, batch_invariant=False, chunk_tiles=None,
                   query_start_loc=None):
    """A float32 workspace for ``paged_decode`` calls with these shapes: the same validation of the
    arguments it is given and the same partition choice (and schedule) as the call. Ragged calls
    (``query_start_loc``) size it for ``query_length``, their bound (``workspace_size`` with it)."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, None, None, limits=LIMITS,
                         query_length=query_length, arch=arch, query_start_loc=query_start_loc)
    parts, sched, _ = _split(p, num_partitions, schedule, chunk_tiles, batch_invariant)
    return _workspace(p, parts, None, None, sched)


# ---------------------------------------------------------------------------------------------
# the PyTorch op (registered in pa_tile.torch_ops; these are its implementations)

_op_plans: dict = {}


def _op_options(softmax_scale, sliding_window, query_length, num_partitions, m_tiles, arch, schedule, chunk_tiles,
                logits_soft_cap, lse, batch_invariant):
    return dict(softmax_scale=softmax_scale, sliding_window=sliding_window, query_length=query_length,
                num_partitions=num_partitions, m_tiles=m_tiles, arch=arch, schedule=schedule, chunk_tiles=chunk_tiles,
                logits_soft_cap=logits_soft_cap, return_lse=lse is not None, batch_invariant=batch_invariant)


def op_impl(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, out,
            workspace=None, softmax_scale=None, sliding_window=0, query_length=None, num_partitions=None,
            m_tiles=None, arch=None, schedule=None, chunk_tiles=None, sinks=None, logits_soft_cap=None, lse=None,
            batch_invariant=False, query_start_loc=None) -> None:
    """``torch.ops.pa_tile.paged_decode`` on real tensors: plan (once per shapes, options and
    workspace), then launch into ``out``. The plan is keyed by metadata, not memory: the block
    tables, lengths and scales of each call are the ones launched with."""
    opts = _op_options(softmax_scale, sliding_window, query_length, num_partitions, m_tiles, arch, schedule,
                       chunk_tiles, logits_soft_cap, lse, batch_invariant)
    tensors = (query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, out) + tuple(
        t for t in (sinks, lse) if t is not None)
    key = None
    if workspace is not None:  # a plan owning its workspace is not shared (streams could overlap on it)
        key = tuple((t.shape, t.dtype, t.device, t.stride()) for t in tensors) + tuple(opts.values()) + (
            workspace.data_ptr(), workspace.numel()) + (
            None if query_start_loc is None else (query_start_loc.shape, query_start_loc.dtype,
                                                  query_start_loc.device),)
    pl = _op_plans.get(key) if key is not None else None
    if pl is None:
        pl = plan(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                  workspace=workspace, sinks=sinks, query_start_loc=query_start_loc, **opts)
        if key is not None:
            if len(_op_plans) >= _MAX_PLANS:
                _op_plans.pop(next(iter(_op_plans)))
            _op_plans[key] = pl
    else:
        if query.device.type == "cpu":
            problem.check_values(pl.problem, block_tables, context_lengths, key_scale, value_scale, query, sinks,
                                 query_start_loc)
        pl.block_tables, pl.context_lengths = block_tables, context_lengths
        pl.query_start_loc = query_start_loc
        pl.refresh()
    problem.output(pl.problem, query, out)
    if lse is not None:
        problem.lse_output(pl.problem, query, lse)
    pl._launch(query, key_cache, value_cache, pl._scale(key_scale, "key_scale"),
               pl._scale(value_scale, "value_scale"), out, pl._sinks(sinks), lse)


def op_fake(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, out,
            workspace=None, softmax_scale=None, sliding_window=0, query_length=None, num_partitions=None,
            m_tiles=None, arch=None, schedule=None, chunk_tiles=None, sinks=None, logits_soft_cap=None, lse=None,
            batch_invariant=False, query_start_loc=None) -> None:
    """The op on fake tensors (trace time): every metadata check of the call, no value read,
    nothing launched; a bad argument raises here, named, as the eager call would. Under symbolic
    shapes (dynamic compilation) the checks wait for the real call, which makes them all before
    it launches."""
    tensors = (query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, out, workspace,
               sinks, lse, query_start_loc)
    if not all(isinstance(d, int) for t in tensors if t is not None for d in t.shape):
        return
    p = _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                  softmax_scale=softmax_scale, sliding_window=sliding_window, query_length=query_length,
                  m_tiles=m_tiles, arch=arch, check_values=False, sinks=sinks, logits_soft_cap=logits_soft_cap,
                  return_lse=lse is not None, query_start_loc=query_start_loc)
    problem.output(p, query, out)
    if lse is not None:
        problem.lse_output(p, query, lse)
    parts, sched, _ = _split(p, num_partitions, schedule, chunk_tiles, batch_invariant)
    if workspace is not None:
        _workspace(p, parts, m_tiles, workspace, sched)
