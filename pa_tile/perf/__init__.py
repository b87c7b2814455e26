"""Performance tooling: the roofline model of a decode call, the GPU benchmark harness, the
emulator memory-access report, and the per-stage adapters they share.

* ``roofline``  bytes / flops of one decode call and its time floor on MI300X / MI355X.
* ``baseline``  a plain PyTorch paged decode (gather pages, dequantize, SDPA) to compare against.
* ``adapters``  the one place that knows how to feed a ``PagedCase`` to each stage module.
* ``checks``    output-vs-reference error metrics and tolerances.
* ``tracing``   memory-access report from the emulator's ``Trace``.
* ``bench``     timings on a ROCm GPU (refuses to time anywhere else), results as JSON, plots.
* ``model``, ``hw``  the timing model (a prediction, never a timing) and its cited constants.
* ``validation``  the timing model against a ``bench`` results file, point by point.

Submodules are imported on demand; none of them needs a GPU to import.
"""

import importlib as _importlib

_SUBMODULES = ("roofline", "baseline", "adapters", "checks", "tracing", "bench", "model", "hw", "validation")


def __getattr__(name):
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'pa_tile.perf' has no attribute {name!r}")
