"""The one place that knows how to drive each kernel: build its inputs, run it, compile it.

The CLI, the trace report and the benchmark go through :func:`get` and never touch a stage
module directly, so when a stage grows a new requirement only this file changes.

A stage module (``pa_tile.stages.sN_*``) is driven through, in order of preference:

* ``inputs_from_case(case) -> dict``: kwargs for its ``paged_decode`` (caches in its layout);
  otherwise module attributes ``K_LAYOUT`` / ``V_LAYOUT`` (names below), otherwise the
  ``_LAYOUTS`` table here, read off the module's docstring;
* ``compile_isa(case, arch) -> str``; otherwise ``launch_args(...) -> (launcher, args, arch)``
  (same arguments as ``paged_decode``; validates, launches nothing) plus
  ``pa_tile.toolchain.compile_isa``;
* ``launch_args`` also gives the benchmark a launch on the *current* torch stream (so it can be
  captured in a CUDA graph); without it the benchmark falls back to ``paged_decode``;
* ``CHECK_TOLERANCE = (max_rel, rms_rel)``; otherwise :data:`STAGE_TOLERANCE`;
* ``QUERY_DTYPE`` and ``LIMITS`` (``pa_tile.problem.Limits``) for the default shape.

Cases are built in the arch's fp8 flavour (FNUZ on gfx942, OCP on gfx950).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .. import arch as _arch
from .. import cache
from .checks import Tolerance
from .roofline import DecodeShape

__all__ = [
    "AdapterError",
    "FP8_FORMAT",
    "STAGE_TOLERANCE",
    "StageAdapter",
    "TinyKernel",
    "TINY_KERNELS",
    "get",
    "stage_names",
    "make_case",
]

#: arch -> fp8 flavour (the one home is pa_tile.arch)
FP8_FORMAT = {a: _arch.fp8_format(a) for a in _arch.ARCHS}

#: Stages quantize the query and the probabilities to fp8 before their MFMAs; the reference
#: does not. Stages 1 and 2 measured max_rel 0.029-0.046 and rms_rel 0.030-0.038 in the
#: emulator (gfx942 and gfx950, head_dim 128, contexts 17..2000, groups 8 and 16, pages of 16
#: and 64); these bounds leave about 1.6x room and still fail
#: a kernel that reads one wrong page (rms_rel 0.12 at 2000 tokens, 0.2-0.5 below 300) or
#: scales its output 10% off.
STAGE_TOLERANCE = Tolerance(max_rel=0.08, rms_rel=0.06)

#: Layouts of stages that do not (yet) expose ``inputs_from_case`` / ``K_LAYOUT``: the stage's
#: module docstring is the source.
_LAYOUTS = {
    "s1": ("k_plain", "v_plain"),  # "K cache [nb, kvh, block_size, 128]; V cache [nb, kvh, 128, block_size]"
    "s2": ("k_plain", "v_plain"),  # "K cache [nb, kvh, block_size, 128] and V cache [nb, kvh, 128, block_size]"
    "s3": ("k_plain", "v_plain"),  # "K [num_blocks, kv_heads, block_size, 128]; V [num_blocks, kv_heads, 128, block_size]"
    # "K blocked [num_blocks, kv_heads, head_dim//16, block_size, 16] and V trans-blocked
    # [num_blocks, kv_heads, block_size//16, head_dim, 16]" (its default v_layout)
    "s4": ("k_blocked", "v_trans_blocked"),
    # "blocked K [nb, kvh, head_dim//16, block, 16], trans-blocked V [nb, kvh, block//16, head_dim, 16]"
    "s5": ("k_blocked", "v_trans_blocked"),
    # "key_cache blocked [...]; value_cache trans-blocked [...] or plain [...]" (paged_decode's docstring)
    "s6": ("k_blocked", "v_trans_blocked"),
}


_K_BUILDERS: Dict[str, Callable] = {"k_plain": lambda k: k, "k_blocked": cache.to_k_blocked}
_V_BUILDERS: Dict[str, Callable] = {
    "v_logical": lambda v: v, "v_plain": cache.to_v_plain, "v_trans_blocked": cache.to_v_trans_blocked,
}


class AdapterError(RuntimeError):
    """A stage module lacks what the tooling needs; the message says what to add and where."""


def _check_arch(arch: str) -> str:
    if arch not in FP8_FORMAT:
        raise ValueError(f"arch: expected one of {sorted(FP8_FORMAT)}, got {arch!r}")
    return arch


def _device_case(shape: DecodeShape, fmt: str, device, seed: int, query_dtype: torch.dtype):
    """``cache.make_case`` semantics, generated on ``device`` (a GPU case can be gigabytes)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ctx = shape.context_lengths
    pages = [-(-L // shape.block_size) for L in ctx]
    nb, width = sum(pages), max(pages)
    ns, ql = shape.batch, shape.query_length
    q = torch.randn(ns * ql, shape.num_q_heads, shape.head_dim, generator=g, device=device).to(query_dtype)
    per_row = shape.scales == "per-token"
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(nb, shape.num_kv_heads, shape.block_size, shape.head_dim, generator=g, device=device)
        s = cache.amax_scale(x, fmt, per_row)
        caches.append(cache.quantize_fp8(x, fmt, s))
        scales.append(s)
        del x
    perm = torch.randperm(nb, generator=g, device=device)
    bt = torch.randint(0, nb, (ns, width), generator=g, device=device)
    start = 0
    for i, n in enumerate(pages):
        bt[i, :n] = perm[start:start + n]
        start += n
    return cache.PagedCase(
        query=q.contiguous(), k_cache=caches[0].contiguous(), v_cache=caches[1].contiguous(),
        block_tables=bt.to(torch.int32).contiguous(),
        context_lengths=torch.tensor(ctx, dtype=torch.int32, device=device),
        k_scale=scales[0], v_scale=scales[1], num_seqs=ns, num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, block_size=shape.block_size,
        query_length=ql, fp8_format=fmt, scales=shape.scales, seed=seed, num_blocks=nb, max_blocks_per_seq=width,
    )


def make_case(shape: DecodeShape, arch: str, *, seed: int = 0, device="cpu",
              query_dtype: torch.dtype = torch.float16) -> "cache.PagedCase":
    """A ``PagedCase`` of ``shape`` in ``arch`` 's fp8 flavour: ``cache.make_case`` on the CPU,
    generated directly on the device otherwise (same construction, different random stream)."""
    fmt = FP8_FORMAT[_check_arch(arch)]
    if torch.device(device).type == "cpu":
        return cache.make_case(
            shape.batch, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
            list(shape.context_lengths), query_length=shape.query_length, fp8_format=fmt, scales=shape.scales,
            query_dtype=query_dtype, seed=seed, device="cpu",
        )
    return _device_case(shape, fmt, device, seed, query_dtype)


def _with_arch(arch: str):
    from .. import toolchain

    return toolchain.target_arch(arch)


class StageAdapter:
    """How the tooling drives one stage module (see the module docstring)."""

    kind = "stage"

    def __init__(self, name: str):
        from .. import stages

        self.module = stages.get(name)  # ValueError naming the available stages
        self.name = next(k for k, (m, _) in stages.STAGES.items() if m == self.module.__name__)

    def __repr__(self) -> str:
        return f"StageAdapter({self.name!r}, {self.module.__name__})"

    # -- facts ---------------------------------------------------------------------------------

    @property
    def query_dtype(self) -> torch.dtype:
        return getattr(self.module, "QUERY_DTYPE", torch.float16)

    @property
    def tolerance(self) -> Tolerance:
        t = getattr(self.module, "CHECK_TOLERANCE", None)
        return Tolerance(*t) if t is not None else STAGE_TOLERANCE

    def default_shape(self, batch: int = 2, context=(300, 129)) -> DecodeShape:
        """A small shape the stage supports, from its ``LIMITS``."""
        lim = getattr(self.module, "LIMITS", None)
        group = 8 if lim is None or lim.allows_group(8) else lim.groups[0]
        head_dim = 128 if lim is None or 128 in lim.head_dims else lim.head_dims[0]
        block = 16 if lim is None else lim.block_sizes[0]
        return DecodeShape(batch=batch, context=context, num_q_heads=group, num_kv_heads=1, head_dim=head_dim,
                           block_size=block)

    def layouts(self) -> Tuple[str, str]:
        m = self.module
        if getattr(m, "K_LAYOUT", None) and getattr(m, "V_LAYOUT", None):
            return m.K_LAYOUT, m.V_LAYOUT
        if self.name in _LAYOUTS:
            return _LAYOUTS[self.name]
        raise AdapterError(
            f"stage {self.name} ({m.__name__}) exposes neither inputs_from_case(case) nor K_LAYOUT/V_LAYOUT, "
            f"and pa_tile/perf/adapters.py has no layout for it: add one of them"
        )

    # -- inputs and runs -----------------------------------------------------------------------

    def make_case(self, shape: DecodeShape, arch: str, *, seed: int = 0, device="cpu"):
        return make_case(shape, arch, seed=seed, device=device, query_dtype=self.query_dtype)

    def inputs(self, case) -> Dict:
        """kwargs for the stage's ``paged_decode`` (no ``out``/``arch``)."""
        fn = getattr(self.module, "inputs_from_case", None)
        if fn is not None:
            return dict(fn(case))
        k_layout, v_layout = self.layouts()
        if k_layout not in _K_BUILDERS or v_layout not in _V_BUILDERS:
            raise AdapterError(f"stage {self.name}: unknown layouts {k_layout!r}/{v_layout!r}; "
                               f"known {sorted(_K_BUILDERS)} / {sorted(_V_BUILDERS)}")
        return dict(query=case.query, key_cache=_K_BUILDERS[k_layout](case.k_cache),
                    value_cache=_V_BUILDERS[v_layout](case.v_cache), block_tables=case.block_tables,
                    context_lengths=case.context_lengths, key_scale=case.k_scale, value_scale=case.v_scale)

    def run(self, case, arch: str, *, out: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
        """Run on the current backend (``paged_decode`` picks it); returns the output. ``options``:
        the stage's own ``paged_decode`` options (``num_partitions``, ``schedule``, ...)."""
        return self.module.paged_decode(**self.inputs(case), out=out, arch=_check_arch(arch), **options)

    def launcher(self, case, arch: str, out: torch.Tensor, *, inputs: Optional[Dict] = None
                 ) -> Tuple[Callable[[], None], str]:
        """``(call, how)``: ``call()`` launches once on the current torch stream, writing ``out``.

        With ``launch_args`` validation happens here, once, and ``call`` only launches, so it can
        be captured in a CUDA graph. ``inputs``: from :meth:`inputs` (built here if None).
        """
        from .. import backend

        _check_arch(arch)
        inputs = self.inputs(case) if inputs is None else inputs
        fn = self._launch_args()
        backend.ensure_backend()
        if fn is None:
            def call():
                self.module.paged_decode(**inputs, out=out, arch=arch)

            return call, "paged_decode (FlyDSL's default stream)"
        launcher, args, arch = fn(**inputs, out=out, arch=arch)

        def call():
            with _with_arch(arch):
                launcher(*args, stream=torch.cuda.current_stream())

        return call, "launch_args on the current stream"

    def _launch_args(self) -> Optional[Callable]:
        return getattr(self.module, "launch_args", None)

    def compile_isa(self, case, arch: str) -> str:
        """Assembly text of the kernel(s) the stage launches for ``case`` (nothing runs)."""
        _check_arch(arch)
        m = self.module
        if hasattr(m, "compile_isa"):
            return m.compile_isa(case, arch)
        fn = self._launch_args()
        if fn is None:
            raise AdapterError(f"stage {self.name} exposes neither compile_isa(case, arch) nor launch_args(...)")
        from .. import toolchain

        launcher, args, arch = fn(**self.inputs(case), arch=arch)
        return toolchain.compile_isa(launcher, *args, arch=arch)


class TinyKernel:
    """``pa_tile.tiny_kernels.scale_add`` (Out = alpha*X + Y) behind the same verbs as a stage,
    so the CLI can be exercised before any stage exists."""

    kind = "tiny"
    name = "tiny"
    tolerance = Tolerance(max_rel=1e-6, rms_rel=1e-6)
    shape = (16, 128)
    alpha = 2.0

    def tensors(self, device="cpu", seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        x, y = (torch.randn(self.shape, generator=g).to(device) for _ in range(2))
        return x, y, torch.zeros(self.shape, device=device)

    def reference(self, x, y):
        return self.alpha * x + y

    def compile_isa(self, arch: str) -> str:
        from .. import toolchain
        from ..tiny_kernels import scale_add

        x, y, out = self.tensors()
        return toolchain.compile_isa(scale_add, x, y, out, self.alpha, arch=_check_arch(arch))

    def run(self, x, y, out, arch: str) -> torch.Tensor:
        from .. import backend
        from ..tiny_kernels import scale_add

        backend.ensure_backend()
        with _with_arch(_check_arch(arch)):
            scale_add(x, y, out, self.alpha)
        return out


TINY_KERNELS = {"tiny": TinyKernel}


def stage_names():
    """Stages present in this checkout (``pa_tile.stages.available()``)."""
    from .. import stages

    return stages.available()


def get(name: str):
    """A :class:`StageAdapter` for a stage name, or a tiny kernel for ``'tiny'``."""
    if name in TINY_KERNELS:
        return TINY_KERNELS[name]()
    return StageAdapter(name)

