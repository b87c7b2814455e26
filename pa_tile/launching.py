"""The launch boundary every pa_tile kernel goes through, on the GPU and in the emulator alike.

* **Compiled once.** ``@flyc.jit`` traces the Python launcher on every call before it can hit a
  cache; ``flyc.compile`` returns a ``CompiledFunction`` whose calls skip tracing. ``launch``
  keeps one per (launcher, arch, argument signature) for the life of the process, so the first
  call of a configuration pays for tracing and code generation and later calls only marshal
  arguments. Tensor shapes are runtime values of the compiled code (FlyDSL's layout-dynamic
  tensors); the signature holds what is compiled in: dtypes, ranks and stride alignment.
* **One device.** Every tensor argument must be on one device (a named ``ValueError``): host
  pointers must never reach a GPU launch, and device pointers never the emulator.
* **The caller's stream.** On a GPU the kernel is queued on torch's current stream of the
  tensors' device, so it orders with the surrounding torch work and is captured by CUDA/HIP
  graphs; the emulator runs launches synchronously.
* **A simulated GPU** (``pa_tile.backend.simulate_gpu``) checks that every tensor is a ``cuda``
  tensor and the arch is the device's, and records the launch; then it does nothing, or (with
  ``execute``) runs it in the emulator on the host bytes of ``pa_tile.emu.device``'s tensors.

``flyc.compile`` with live arguments is also the first launch: FlyDSL's rule for device tensors,
and the emulator's for CPU tensors (``pa_tile.emu.launch``), so each call launches exactly once.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["launch", "call", "check_one_device", "compiled_count", "clear_cache"]

_compiled: Dict[tuple, object] = {}
_lock = threading.Lock()


def check_one_device(args: Sequence, names: Optional[Sequence[str]] = None) -> torch.device:
    """The device all tensor ``args`` share; a ``ValueError`` naming the first one that differs."""
    device = None
    first = None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if device is None:
                device, first = a.device, (names[i] if names else f"argument {i}")
            elif a.device != device:
                name = names[i] if names else f"argument {i}"
                raise ValueError(f"{name}: on {a.device}, but {first} is on {device}; "
                                 f"every tensor of a launch must be on one device")
    if device is None:
        raise ValueError("a launch needs at least one tensor argument")
    return device


def _signature(args) -> tuple:
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            # shapes are dynamic; the stride-1 axis and stride alignment are compiled in
            sig.append((a.dtype, a.dim(), tuple(s & -s if s else 0 for s in a.stride())))
        else:
            sig.append(type(a))
    return tuple(sig)


def _check_simulated(gpu, jit_fn, args, names, arch) -> None:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.device.type != "cuda":
            name = names[i] if names else f"argument {i}"
            raise ValueError(f"{name}: a {a.device.type} tensor was handed to a launch on the (simulated) "
                             f"{gpu.arch} GPU")
    if arch != gpu.arch:
        raise ValueError(f"arch: code compiled for {arch} was launched on a {gpu.arch} GPU")
    fn = getattr(jit_fn, "func", jit_fn)  # a @flyc.jit JitFunction keeps the Python launcher as .func
    gpu.record(getattr(fn, "__name__", type(jit_fn).__name__), arch,
               tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))


def launch(jit_fn, args: Sequence, *, arch: str, names: Optional[Sequence[str]] = None,
           device: Optional[torch.device] = None):
    """Run the ``@flyc.jit`` launcher ``jit_fn`` on ``args`` (its parameters before ``stream``)
    for ``arch``, compiling it on first use. ``names`` name the arguments in errors; ``device``
    skips the device scan when the caller has already checked it. Returns the compiled function,
    which :func:`call` launches again on arguments of the same signature without any lookup."""
    from pa_tile import backend

    if device is None:
        device = check_one_device(args, names)
    gpu = backend.simulated_gpu()
    if gpu is not None:
        _check_simulated(gpu, jit_fn, args, names, arch)
        if not gpu.executes:
            return _Simulated(jit_fn, names)
        from pa_tile.emu import device as sim_device

        # the emulator's own path from here: the device's memory is these host tensors
        args, device = sim_device.to_host(tuple(args)), torch.device("cpu")
    on_gpu = device.type == "cuda"
    key = (jit_fn, arch, _signature(args))
    compiled = _compiled.get(key)
    if compiled is None:
        with _lock:
            compiled = _compiled.get(key)
            if compiled is None:
                stream = torch.cuda.current_stream(device) if on_gpu else None
                compiled = _compile(jit_fn, args, stream, arch, on_gpu, simulated=gpu is not None)
                _compiled[key] = compiled
                # flyc.compile ran it (the first launch)
                return compiled if gpu is None else _Simulated(jit_fn, names, compiled)
    call(compiled, args, arch, device)
    return compiled if gpu is None else _Simulated(jit_fn, names, compiled)


def call(compiled, args: Sequence, arch: str, device: torch.device) -> None:
    """Launch a function :func:`launch` returned, on arguments of the signature it was compiled
    for (the caller guarantees it: ``pa_tile.Plan.run`` checks its tensors against the plan)."""
    if isinstance(compiled, _Simulated):
        from pa_tile import backend

        _check_simulated(backend.simulated_gpu(), compiled.jit_fn, args, compiled.names, arch)
        if compiled.compiled is not None:
            from pa_tile.emu import device as sim_device

            compiled.compiled(*sim_device.to_host(tuple(args)), None)
    elif device.type == "cuda":
        compiled(*args, torch.cuda.current_stream(device))
    else:  # the emulator: synchronous, its arch read from the compiled code object
        compiled(*args, None)


class _Simulated:
    """What :func:`launch` returns on a simulated GPU: :func:`call` checks and records again, and
    on an executing one launches ``compiled`` (the emulator's function) on the host bytes."""

    __slots__ = ("jit_fn", "names", "compiled")

    def __init__(self, jit_fn, names, compiled=None):
        self.jit_fn, self.names, self.compiled = jit_fn, names, compiled


def _compile(jit_fn, args, stream, arch, on_gpu, simulated=False):
    import flydsl.compiler as flyc

    from pa_tile import backend, toolchain

    chosen = "emu" if simulated else backend.ensure_backend()
    if on_gpu and chosen != "gpu":
        raise ValueError("query: GPU tensors were given, but kernels run in the emulator in this process "
                         f"(backend {chosen!r}); pass CPU tensors or restart on the GPU backend")
    if not on_gpu and chosen == "gpu":
        raise ValueError("query: CPU tensors were given, but kernels run on the GPU in this process; "
                         "move the tensors to the GPU (or use PA_TILE_BACKEND=emu)")
    with toolchain.target_arch(arch):
        return flyc.compile(jit_fn, *args, stream)


def compiled_count() -> int:
    """How many configurations this process has compiled through ``launch``."""
    return len(_compiled)


def clear_cache() -> None:
    """Forget every compiled configuration (tests use it to count compilations)."""
    with _lock:
        _compiled.clear()

