"""Where pa_tile's kernels run: on a ROCm GPU (``gpu``) or in the CPU emulator (``emu``).

The choice, first match wins:

1. :func:`set_backend` (``"gpu"``, ``"emu"`` or ``"auto"``; ``None`` clears it);
2. environment ``PA_TILE_BACKEND`` (same values);
3. ``auto``: ``gpu`` when torch is a ROCm build (``torch.version.hip``) and sees a GPU, else ``emu``.

Asking for ``gpu`` without a usable GPU raises :class:`BackendError`. :func:`ensure_backend`
must run before the first ``@flyc.jit`` call of the process (pa_tile's stage launchers call it):
for ``emu`` it installs the emulator hook (``pa_tile.emu.launch.install``), which cannot be
undone, so the process then stays on the emulator.
"""

from __future__ import annotations

import os
from typing import Optional

BACKENDS = ("gpu", "emu")
_CHOICES = BACKENDS + ("auto",)
ENV_VAR = "PA_TILE_BACKEND"

_override: Optional[str] = None
_override_source = "set_backend()"


class BackendError(RuntimeError):
    """The requested backend cannot be used here; the message says why."""


def gpu_available() -> bool:
    """True when torch is a ROCm build and at least one GPU is visible to it."""
    try:
        import torch
    except ImportError:
        return False
    if not getattr(torch.version, "hip", None):
        return False
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 - a broken driver means "no GPU" here
        return False


def _check_choice(name: str, source: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{source} must be a str (one of {', '.join(_CHOICES)}), got {type(name).__name__}")
    choice = name.strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{source}={name!r} is not one of {', '.join(_CHOICES)}")
    return choice


def _emulator_installed() -> bool:
    from .emu import launch

    return launch.is_installed()


_HOOK_INSTALLED = (
    "the emulator hook is already installed in this process (FlyDSL launches go to the emulator); "
    "restart Python to use the GPU"
)


def _gpu_refusal(source: str) -> Optional[str]:
    """Why ``gpu`` cannot be used here, or ``None``.

    A missing GPU is named first whatever else holds, so the answer does not depend on what ran
    earlier in the process (whether something already installed the emulator hook)."""
    installed = _emulator_installed()
    if not gpu_available():
        msg = (
            f"{source} asks for the GPU backend, but there is no usable ROCm GPU: it needs a ROCm build of "
            "torch (torch.version.hip is set) that sees a GPU (torch.cuda.is_available()). Use 'emu' or 'auto' "
            "to run in the CPU emulator."
        )
        return msg + (f" (Also, {_HOOK_INSTALLED}.)" if installed else "")
    if installed:
        return f"{source} asks for the GPU, but {_HOOK_INSTALLED}"
    return None


def set_backend(name: Optional[str], *, source: str = "set_backend()") -> None:
    """Force ``"gpu"`` or ``"emu"`` (or ``"auto"``) for this process; ``None`` returns to env/auto.

    ``"gpu"`` is accepted here without a GPU (the error comes from :func:`current_backend`),
    except once the emulator hook is installed, when it raises at once: that cannot change.
    ``source`` is how errors name the choice (the command line passes ``"--backend gpu"``)."""
    global _override, _override_source
    if name is None:
        _override, _override_source = None, "set_backend()"
        return
    choice = _check_choice(name, "backend")
    if choice == "gpu" and _emulator_installed():
        raise BackendError(_gpu_refusal(source))
    _override, _override_source = choice, source


def current_backend() -> str:
    """``"gpu"`` or ``"emu"`` (see the module docstring for how it is chosen; a
    :class:`simulate_gpu` block is ``gpu``)."""
    if _simulated is not None:
        return "gpu"
    if _override is not None:
        choice, source = _override, _override_source
    else:
        choice = _check_choice(os.environ.get(ENV_VAR) or "auto", ENV_VAR)
        source = f"{ENV_VAR}={choice}"
    if choice == "auto":
        # Once the hook is in, launches go to the emulator whatever hardware appears.
        return "emu" if _emulator_installed() or not gpu_available() else "gpu"
    if choice == "gpu":
        refusal = _gpu_refusal(source)
        if refusal:
            raise BackendError(refusal)
    return choice


def require_emulator(what: str) -> None:
    """Raise :class:`BackendError` unless this process runs its kernels in the emulator: ``what``
    (the timing model's samples, a memory trace) reads the emulator's own records of a launch. The
    message says how to get there from a GPU, real or simulated."""
    if current_backend() == "emu":
        return
    if _simulated is not None:
        where, fix = (f"a simulated GPU ({SIMULATE_ENV_VAR})",
                      f"run it in a process without {SIMULATE_ENV_VAR}, with {ENV_VAR}=emu")
    else:
        where, fix = ("the GPU", f"set {ENV_VAR}=emu (or pa_tile.set_backend('emu')) before the process's first "
                                 "kernel launch, or run it in a process of its own")
    raise BackendError(f"{what} needs the emulator backend, and this process runs its kernels on {where}: {fix}")


def ensure_backend() -> str:
    """Make the chosen backend usable (installs the emulator hook for ``emu``); returns its name."""
    backend = current_backend()
    if _simulated is not None:
        return backend  # a simulated GPU set up its own executor (the emulator) when it started
    if backend == "emu":
        from . import toolchain
        from .emu import launch

        # Kernels that call device math (ocml) link bitcode from ROCM_PATH even when the
        # emulator takes assembly text, so the CPU toolchain must be in place first.
        toolchain.ensure_toolchain()
        launch.install()
    return backend


def default_arch() -> str:
    """The arch to compile for: the GPU's gfx name on ``gpu``; on ``emu`` ``ARCH`` /
    ``FLYDSL_GPU_ARCH`` or ``gfx942`` (``pa_tile.emu.launch.current_arch``)."""
    if current_backend() == "gpu":
        import torch

        return device_arch(torch.device("cuda"))
    from .emu import launch

    return launch.current_arch()


def device_for_tensors() -> str:
    """The torch device kernel arguments live on: ``"cuda"`` on gpu (ROCm torch), ``"cpu"`` on emu."""
    return "cuda" if current_backend() == "gpu" else "cpu"


# ---------------------------------------------------------------------------------------------
# device facts: what the tensors' device is, read from the device (never a table on a GPU)

_simulated = None  # a SimulatedGPU while simulate_gpu() is active


def device_arch(device) -> Optional[str]:
    """The gfx arch of a GPU ``device`` (``torch.device``, str or tensor), or ``None`` for the CPU
    (where the emulator runs whatever arch is asked for) and for a ``cuda`` device this PyTorch
    cannot see (fake tensors traced on a CPU-only build: there is no GPU to ask, so the call
    takes the arch it is given, else the emulator's default, as for CPU tensors)."""
    import torch

    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type != "cuda" or not _gpu_visible():
        return None
    if _simulated is not None:
        return _simulated.arch
    return torch.cuda.get_device_properties(_index(device)).gcnArchName.split(":", 1)[0]


def _gpu_visible() -> bool:
    """A GPU answers for ``cuda`` devices: a simulated one, or one this PyTorch build can see."""
    import torch

    return _simulated is not None or torch.cuda.is_available()


def _index(device) -> int:
    import torch

    if device.index is not None:
        return device.index
    try:
        return torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # no initialized CUDA/HIP context
        return 0


def cu_count(device, arch: str) -> int:
    """Compute units of ``device``: the GPU's own count (MI300A, MI308X and MI325X differ from
    MI300X), or for CPU tensors the flagship part of ``arch`` (``pa_tile.arch``) the emulator
    stands in for (also for a ``cuda`` device this PyTorch cannot see: see ``device_arch``)."""
    import torch

    from . import arch as _arch

    device = torch.device(device)
    if device.type != "cuda" or not _gpu_visible():
        return _arch.info(arch).cu_count
    if _simulated is not None:
        return _simulated.cu_count
    return int(torch.cuda.get_device_properties(_index(device)).multi_processor_count)


class SimulatedGPU:
    """A GPU that is not there: ``device_arch``/``cu_count`` answer for it, and every kernel launch
    (``pa_tile.launching``) checks that each tensor argument is on a ``cuda`` device and that the
    kernel was compiled for this arch, and records the launch.

    Without ``execute`` the launch does nothing else: with ``FakeTensorMode`` providing ``cuda``
    tensors, it proves on a CPU what a ROCm run would see, reading no value. With ``execute`` the
    ``cuda`` device is :mod:`pa_tile.emu.device` (tensors that say ``cuda:0`` and keep their bytes on
    the host) and each checked launch runs in the emulator on those bytes: GPU code, a chapter or
    a harness written for a GPU, runs unchanged and computes real results."""

    def __init__(self, arch: str = "gfx942", cu_count: Optional[int] = None, execute: bool = False):
        from . import arch as _arch

        self.arch = _arch.check_arch(arch)
        self.cu_count = cu_count if cu_count is not None else _arch.info(self.arch).cu_count
        self.executes = bool(execute)
        self.launches: list = []  # (kernel name, arch, grid-less summary of the arguments)
        self.log_path: Optional[str] = None  # PA_TILE_SIMULATE_GPU_LOG: a line per launch, appended

    def record(self, kernel: str, arch: str, summary: tuple) -> None:
        self.launches.append((kernel, arch, summary))
        if self.log_path:  # a process that is killed at the end (a notebook kernel) leaves its count
            with open(self.log_path, "a") as f:
                f.write(f"{kernel} {arch}\n")


def simulated_gpu() -> Optional[SimulatedGPU]:
    """The active :class:`SimulatedGPU`, if any."""
    return _simulated


class simulate_gpu:
    """``with simulate_gpu("gfx950") as gpu: ...``: the backend is ``gpu`` and launches are checked
    (see :class:`SimulatedGPU`; ``execute=True`` runs them in the emulator on host-backed ``cuda``
    tensors); ``gpu.launches`` lists what ran or would have run."""

    def __init__(self, arch: str = "gfx942", cu_count: Optional[int] = None, execute: bool = False):
        self.gpu = SimulatedGPU(arch, cu_count, execute)

    def __enter__(self) -> SimulatedGPU:
        global _simulated
        self._saved = _simulated
        if self.gpu.executes:
            self._device = _start_device(self.gpu)
        _simulated = self.gpu
        return self.gpu

    def __exit__(self, *exc):
        global _simulated
        _simulated = self._saved
        if self.gpu.executes:
            self._device.__exit__(*exc)
        return False


def _start_device(gpu: SimulatedGPU):
    """Enter the host-backed ``cuda`` device for ``gpu`` and make the emulator its executor; the
    returned context manager (entered) leaves it again."""
    from . import toolchain
    from .emu import device, launch

    toolchain.ensure_toolchain()
    launch.install()
    ctx = device.simulated_device(gpu.arch, gpu.cu_count, name=f"simulated {gpu.arch} (pa_tile.emu)")
    ctx.__enter__()
    return ctx


_process_device = None  # the process-wide simulated device's context (kept: leaving it ends it)


SIMULATE_ENV_VAR = "PA_TILE_SIMULATE_GPU"


def _simulate_from_env() -> None:
    """``PA_TILE_SIMULATE_GPU=gfx942`` (or ``gfx950``, optionally ``:<CUs>``): the whole process runs
    on an executing simulated GPU, so a notebook or script takes its GPU code paths on a CPU;
    ``PA_TILE_SIMULATE_GPU_LOG=<file>`` appends a line per launch to that file."""
    global _simulated, _process_device
    spec = os.environ.get(SIMULATE_ENV_VAR, "").strip()
    if not spec or _simulated is not None:
        return
    arch, _, cus = spec.partition(":")
    try:
        cu = int(cus) if cus else None
    except ValueError:
        raise ValueError(f"{SIMULATE_ENV_VAR}={spec!r}: the CU count after ':' must be an integer") from None
    gpu = SimulatedGPU(arch, cu, execute=True)
    _process_device = _start_device(gpu)
    _simulated = gpu
    gpu.log_path = os.environ.get(SIMULATE_ENV_VAR + "_LOG") or None


def runnable_archs() -> tuple:
    """The archs whose kernels can run here: both on the emulator, the device's own on a GPU.
    Chapters loop over it so that the same cell runs on a CPU and on an MI300/MI355 runner."""
    from . import arch as _arch

    if current_backend() == "gpu":
        return (default_arch(),)
    return _arch.ARCHS


_simulate_from_env()
