"""pa_tile: an fp8 paged-attention decode kernel for AMD Instinct GPUs, built step by step in FlyDSL.

``import pa_tile`` registers the PyTorch op ``torch.ops.pa_tile.paged_decode`` (``torch_ops``: it
imports torch, nothing else of pa_tile's). The submodules load on first use, so the import stays
cheap:
``arch`` (gfx942/gfx950 facts), ``problem`` (the one validation step), ``kernel_lib`` (the
device helpers the chapters share), ``launching`` (compile once, launch on the tensors' device and
stream), ``api`` (``plan``/``paged_decode``/the torch op), ``merge`` (``merge_states``: attentions over
disjoint keys merged by their log-sum-exp), ``toolchain`` (compile on a CPU),
``isa`` (static facts of compiled code), ``reference``, ``fp8`` and ``cache`` (the float32
reference, fp8 codes, cases and cache layouts), ``emu`` (the CPU emulator of gfx942/gfx950
machine code), ``backend`` (GPU, emulator or a simulated GPU), ``stages`` (the kernels), ``perf``
(roofline, traces, host cost, the timing model, benchmarks), ``upstream`` (the recorded figures
of the kernel this walkthrough retraces), ``figures`` (the chapters' figures), ``progress`` (the
progress bars, drawn only when someone watches).
"""

__version__ = "0.1.0"

import importlib as _importlib

from . import torch_ops  # noqa: F401  (registers torch.ops.pa_tile.paged_decode and its fake)

_SUBMODULES = ("toolchain", "isa", "reference", "cache", "emu", "backend", "stages", "perf", "upstream", "tiny_kernels",
               "arch", "fp8", "problem", "kernel_lib", "launching", "api", "show", "progress", "figures", "torch_ops",
               "merge")


#: the public API, each name re-exported lazily from its module (the finished kernel's from ``api``)
_API = {name: "pa_tile.api" for name in ("paged_decode", "plan", "Plan", "make_workspace", "workspace_size",
                                          "choose_num_partitions")}
_API["merge_states"] = "pa_tile.merge"
#: the public names (the book's API reference documents these); the submodules are imported by name
__all__ = list(_API)


if __import__("os").environ.get("PA_TILE_SIMULATE_GPU"):
    # a process-wide simulated GPU must exist before the first "cuda" tensor is made
    _importlib.import_module(f"{__name__}.backend")


def __getattr__(name):
    if name in _API:
        return getattr(_importlib.import_module(_API[name]), name)
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'pa_tile' has no attribute {name!r}")
