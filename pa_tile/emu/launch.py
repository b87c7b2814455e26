"""Run FlyDSL's real ``@flyc.jit`` host path on a CPU, with kernel launches going to the emulator.

How it works
------------
:func:`install` (idempotent; ``pa_tile.backend.ensure_backend()`` calls it) changes three things
in the running process, all before the first ``@flyc.jit`` call:

1. FlyDSL's ``"rocm"`` compile backend is re-registered (``force=True``) as a subclass whose last
   pass is ``gpu-module-to-binary{format=isa}``: the compiled module carries the AMDGPU
   assembly text instead of a code object. It keeps the name ``"rocm"`` because FlyDSL
   dispatches on that name (extension implementations, runtime pairing); its ``hash()``
   differs, so the emulator's compiled artifacts never share FlyDSL's (disk) cache entries with
   real-GPU ones.
2. The same backend names our runtime shim (``_shim/emu_runtime.c``, built with ``$CC`` or gcc on
   first use into ``$PA_TILE_CACHE_DIR``, default ``~/.cache/pa_tile``; never next to the source)
   instead of ``libfly_jit_runtime.so`` (which needs HIP). The shim exports the same ``mgpu*``
   ABI; it hands module loads and kernel launches to the ctypes callbacks in this module.
3. The call entries ``JitFunction.__call__``, ``CompiledFunction.__call__`` and ``flyc.compile``
   are wrapped: during a call, every ``torch.Tensor`` argument (also inside tuples, lists and
   dicts, and inside FlyDSL's ``from_torch_tensor`` / ``from_dlpack`` wrappers) is recorded as
   an allowed memory region ``(base, nbytes, name)`` for the emulator's sanitizer, by default
   exactly the bytes its view spans (non-CPU tensors are refused), the target arch is pinned
   (below), and an exception
   raised inside a launch is re-raised from the call with its own traceback, since it cannot
   cross the C frames of FlyDSL's launcher. After a failed launch, the call's later launches are
   skipped and the call raises: nothing reports success for a kernel that did not run.
4. FlyDSL's compile-placeholder checks count CPU tensors as live device tensors, so
   ``flyc.compile(launcher, *cpu_tensors)`` launches as it does with GPU tensors (a launcher
   that compiles on its first call and reuses the ``CompiledFunction`` runs every call).

On each launch the kernarg segment is built from the kernel's ``.amdgpu_metadata`` (parsed with
PyYAML): explicit arguments are copied from ``params[i]`` at ``.offset`` / ``.size``; hidden
arguments get the values HIP's runtime would write (:func:`hidden_arg_values`). The launch is then
given to the launch handler: by default :func:`run_on_emulator`, which calls
``pa_tile.emu.machine.run_kernel``; :func:`set_launch_handler` replaces it (tests do the work in
Python from the kernarg bytes). A code object's text, metadata and parsed program are cached by
the digest of its bytes, and the hidden part of the kernarg per kernel and launch shape, so a
repeated launch does no parsing. :func:`launch_options` passes a ``Trace``, a progress flag, the
LDS race policy and the scheduling quantum to the emulator, chooses per-view or per-storage
bounds, adds regions for raw-pointer kernels, and with ``execute=False`` turns launches into
no-ops (for measuring host cost); :func:`record_launches` collects the :class:`Launch` records
(kernarg, regions, asm).

Target arch
-----------
The emulator models gfx942 (MI300) and gfx950 (MI355). The arch is the first of: environment
``ARCH``, environment ``FLYDSL_GPU_ARCH``, ``"gfx942"``; :func:`set_arch` sets both variables.
FlyDSL compiles for ``ARCH`` but some of its lowering code reads ``FLYDSL_GPU_ARCH`` directly, so
during each ``@flyc.jit`` call ``FLYDSL_GPU_ARCH`` is set to the chosen arch (and restored after).
Changing the arch between calls recompiles (FlyDSL's cache key includes the target). The arch a
launch runs on is read from the assembly's ``amdhsa.target``, never guessed.

``COMPILE_ONLY`` must not be set when kernels should run: FlyDSL then stops after compiling and
nothing is launched (``pa_tile.toolchain.compile_isa`` sets it on purpose).

Supported FlyDSL versions: ``>=0.4.2,<0.6`` (:data:`SUPPORTED_FLYDSL`). The hook relies on
FlyDSL internals (the last pass string, two private ``lru_cache`` s, the backend registry, the
runtime library list, the JIT call entry points); :func:`self_test` checks each of them and
fails with an explanation if one moved. Run it before widening the range.

Limits: one process cannot go back to the real GPU runtime after :func:`install`; code objects
compiled before it (ELF, not assembly) cannot be emulated; ``max_blocks_per_cu()`` is not
modelled; FlyDSL's external-LLVM mode (``FLYDSL_COMPILE_LLVM_DIR``) is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import inspect
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import arch as _arch

SUPPORTED_FLYDSL = ((0, 4, 2), (0, 6))  # [low, high)
SUPPORTED_ARCHS = _arch.ARCHS  # the one list of targets (pa_tile.arch)
DEFAULT_ARCH = _arch.ARCHS[0]  # gfx942

Region = Tuple[int, int, str]  # (base address, size in bytes, name)

SHIM_SOURCE = Path(__file__).resolve().parent / "_shim" / "emu_runtime.c"
SHIM_ABI_VERSION = 1  # PA_EMU_ABI_VERSION in the C source
_REAL_RUNTIME = "libfly_jit_runtime.so"
# Exported by the real runtime for AOT-exported objects only; the JIT host code never calls them.
_AOT_ONLY_PREFIXES = ("flydslAot", "flydslRuntimeTakeError")


class EmuSetupError(RuntimeError):
    """The emulator hook cannot be installed (or FlyDSL changed under it); the message says why."""


class KernargError(ValueError):
    """Kernel arguments do not match the kernel's metadata."""


class LaunchError(RuntimeError):
    """A kernel launch could not be handed to the emulator."""


# --------------------------------------------------------------------------------------- arch


def current_arch() -> str:
    """The arch launches compile for: ``ARCH``, else ``FLYDSL_GPU_ARCH``, else ``gfx942``."""
    arch = os.environ.get("ARCH") or os.environ.get("FLYDSL_GPU_ARCH") or DEFAULT_ARCH
    return arch.strip().lower()


def set_arch(arch: Optional[str]) -> None:
    """Choose the emulated arch for later ``@flyc.jit`` calls (sets ``ARCH`` and ``FLYDSL_GPU_ARCH``).

    ``None`` removes both variables, so the default (gfx942) applies again.
    """
    if arch is None:
        os.environ.pop("ARCH", None)
        os.environ.pop("FLYDSL_GPU_ARCH", None)
        return
    _check_arch(arch)
    os.environ["ARCH"] = arch
    os.environ["FLYDSL_GPU_ARCH"] = arch


def _check_arch(arch: str) -> str:
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx942', got {type(arch).__name__}")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"the emulator models {', '.join(SUPPORTED_ARCHS)} only; got arch {arch!r}")
    return arch


@contextlib.contextmanager
def _pinned_arch() -> Iterator[None]:
    compile_only = os.environ.get("COMPILE_ONLY", "").strip().lower() in ("1", "true", "yes", "on")
    arch = current_arch()
    if not compile_only:
        try:
            _check_arch(arch)
        except ValueError as e:
            raise ValueError(f"{e} (from ARCH / FLYDSL_GPU_ARCH; see pa_tile.emu.launch.set_arch)") from None
    old = os.environ.get("FLYDSL_GPU_ARCH")
    os.environ["FLYDSL_GPU_ARCH"] = arch
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLYDSL_GPU_ARCH", None)
        else:
            os.environ["FLYDSL_GPU_ARCH"] = old


# ----------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class KernelArg:
    """One entry of a kernel's ``.args`` list (explicit or hidden)."""

    offset: int
    size: int
    value_kind: str
    address_space: Optional[str] = None
    name: Optional[str] = None

    @property
    def is_hidden(self) -> bool:
        return self.value_kind.startswith("hidden_")


@dataclass(frozen=True)
class KernelMeta:
    """The launch-relevant part of one ``amdhsa.kernels`` entry; ``raw`` keeps every field."""

    name: str
    symbol: str
    args: Tuple[KernelArg, ...]
    kernarg_segment_size: int
    kernarg_segment_align: int
    group_segment_fixed_size: int
    private_segment_fixed_size: int
    wavefront_size: int
    sgpr_count: int
    vgpr_count: int
    agpr_count: int
    max_flat_workgroup_size: int
    reqd_workgroup_size: Optional[Tuple[int, int, int]]
    uses_dynamic_stack: bool
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # Cached: every launch reads them several times (the instance is frozen, args never change).
    @functools.cached_property
    def explicit_args(self) -> Tuple[KernelArg, ...]:
        return tuple(a for a in self.args if not a.is_hidden)

    @functools.cached_property
    def hidden_args(self) -> Tuple[KernelArg, ...]:
        return tuple(a for a in self.args if a.is_hidden)


@dataclass(frozen=True)
class CodeObjectMeta:
    """``.amdgpu_metadata`` of one assembly text: target, code object version, kernels by name."""

    target: str
    arch: str
    version: Tuple[int, ...]
    kernels: Dict[str, KernelMeta]


def kernel_meta_from_dict(k: dict) -> KernelMeta:
    """Typed view of one raw ``amdhsa.kernels`` entry (e.g. ``pa_tile.emu.asm`` Kernel.metadata)."""

    def arg(a: dict) -> KernelArg:
        return KernelArg(
            offset=int(a[".offset"]),
            size=int(a[".size"]),
            value_kind=str(a[".value_kind"]),
            address_space=a.get(".address_space"),
            name=a.get(".name"),
        )

    reqd = k.get(".reqd_workgroup_size")
    return KernelMeta(
        name=str(k[".name"]),
        symbol=str(k.get(".symbol", f"{k['.name']}.kd")),
        args=tuple(arg(a) for a in k.get(".args", []) or []),
        kernarg_segment_size=int(k.get(".kernarg_segment_size", 0)),
        kernarg_segment_align=int(k.get(".kernarg_segment_align", 8)),
        group_segment_fixed_size=int(k.get(".group_segment_fixed_size", 0)),
        private_segment_fixed_size=int(k.get(".private_segment_fixed_size", 0)),
        wavefront_size=int(k.get(".wavefront_size", 64)),
        sgpr_count=int(k.get(".sgpr_count", 0)),
        vgpr_count=int(k.get(".vgpr_count", 0)),
        agpr_count=int(k.get(".agpr_count", 0)),
        max_flat_workgroup_size=int(k.get(".max_flat_workgroup_size", 1024)),
        reqd_workgroup_size=tuple(int(v) for v in reqd) if reqd else None,
        uses_dynamic_stack=bool(k.get(".uses_dynamic_stack", False)),
        raw=dict(k),
    )


def parse_amdgpu_metadata(asm_text: str) -> CodeObjectMeta:
    """Parse the ``.amdgpu_metadata`` YAML block(s) of AMDGPU assembly text.

    Several blocks (concatenated texts) are merged; they must name the same target.
    """
    from . import asmtext  # the one reader of assembly structure and metadata

    docs = []
    for kind, _, doc, _ in asmtext.scan(asm_text.splitlines()):
        if kind is asmtext.METADATA:
            if not isinstance(doc, dict) or "amdhsa.kernels" not in doc:
                raise ValueError("the .amdgpu_metadata block has no amdhsa.kernels list")
            docs.append(doc)
        elif kind is asmtext.UNTERMINATED and doc == ".amdgpu_metadata":
            raise ValueError("assembly has .amdgpu_metadata without .end_amdgpu_metadata")
    if not docs:
        raise ValueError("assembly has no .amdgpu_metadata block (was it compiled with format=isa?)")
    targets = {str(d.get("amdhsa.target", "")) for d in docs}
    if len(targets) != 1:
        raise ValueError(f"metadata blocks name different targets: {sorted(targets)}")
    target = targets.pop()
    kernels: Dict[str, KernelMeta] = {}
    for d in docs:
        for k in d["amdhsa.kernels"] or []:
            meta = kernel_meta_from_dict(k)
            kernels[meta.name] = meta
    # "amdgcn-amd-amdhsa-unknown-gfx942" or "...-gfx942:sramecc+:xnack-"
    arch = target.rsplit("-", 1)[-1].split(":", 1)[0] if target else ""
    version = tuple(int(v) for v in docs[0].get("amdhsa.version", []) or [])
    return CodeObjectMeta(target=target, arch=arch, version=version, kernels=kernels)


# ------------------------------------------------------------------------------------ kernarg

# Hidden arguments that are pointers to runtime services (printf, hostcall, device enqueue,
# multigrid sync, heap, queue). The emulator provides none of them: they are 0, so a kernel that
# dereferences one faults in the sanitizer (address 0 is in no region) instead of reading garbage.
_HIDDEN_POINTER_KINDS = frozenset(
    {
        "hidden_printf_buffer",
        "hidden_hostcall_buffer",
        "hidden_default_queue",
        "hidden_completion_action",
        "hidden_multigrid_sync_arg",
        "hidden_heap_v1",
        "hidden_queue_ptr",
    }
)


def hidden_arg_values(grid: Sequence[int], block: Sequence[int], dynamic_lds: int = 0) -> Dict[str, int]:
    """Values of the hidden kernel arguments for a launch, as HIP's runtime (CLR) writes them.

    * ``hidden_block_count_*`` = grid (in workgroups), ``hidden_group_size_*`` = block;
    * ``hidden_remainder_*`` = 0: HIP launches count whole workgroups, never a partial one;
    * ``hidden_global_offset_*`` = 0; ``hidden_grid_dims`` = 3 (CLR dispatches every
      module launch as a 3-D NDRange);
    * ``hidden_dynamic_lds_size`` = the launch's dynamic LDS bytes;
    * ``hidden_private_base`` / ``hidden_shared_base`` (aperture bases, read by kernels on
      targets without aperture registers) = 0: the emulator has no flat apertures;
    * service pointers (printf, hostcall, queue, heap, ...) = 0 (see ``_HIDDEN_POINTER_KINDS``);
    * ``hidden_none`` (padding) = 0.
    """
    values = {"hidden_grid_dims": 3, "hidden_dynamic_lds_size": int(dynamic_lds), "hidden_none": 0}
    for i, axis in enumerate("xyz"):
        values[f"hidden_block_count_{axis}"] = int(grid[i])
        values[f"hidden_group_size_{axis}"] = int(block[i])
        values[f"hidden_remainder_{axis}"] = 0
        values[f"hidden_global_offset_{axis}"] = 0
    values["hidden_private_base"] = 0
    values["hidden_shared_base"] = 0
    values.update(dict.fromkeys(_HIDDEN_POINTER_KINDS, 0))
    return values


def build_kernarg(
    meta: KernelMeta,
    explicit: Sequence[bytes],
    grid: Sequence[int],
    block: Sequence[int],
    dynamic_lds: int = 0,
) -> bytes:
    """The kernarg segment: explicit argument bytes at their offsets, hidden ones by value kind.

    ``explicit[i]`` holds the bytes of the i-th explicit argument (exactly ``.size`` of them).
    Unknown hidden kinds that are pointers (they carry an ``.address_space``) are 0; any other
    unknown hidden kind raises, so a new runtime-provided value is never silently wrong.
    """
    args = meta.explicit_args
    if len(explicit) != len(args):
        raise KernargError(
            f"{meta.name}: {len(explicit)} argument values for {len(args)} explicit kernel arguments in its metadata"
        )
    end = max((a.offset + a.size for a in meta.args), default=0)
    if end > meta.kernarg_segment_size:
        raise KernargError(
            f"{meta.name}: arguments end at byte {end} but .kernarg_segment_size is {meta.kernarg_segment_size}"
        )
    seg = bytearray(_hidden_template(meta, tuple(grid), tuple(block), int(dynamic_lds)))
    for i, (a, value) in enumerate(zip(args, explicit)):
        if len(value) != a.size:
            raise KernargError(
                f"{meta.name}: argument {i} ({a.value_kind}) has {len(value)} bytes, metadata says {a.size}"
            )
        seg[a.offset : a.offset + a.size] = value
    return bytes(seg)


_HIDDEN_TEMPLATES: Dict[tuple, Tuple[KernelMeta, bytes]] = {}


def _hidden_template(meta: KernelMeta, grid: tuple, block: tuple, dynamic_lds: int) -> bytes:
    """The kernarg segment with only the hidden arguments filled in, cached per kernel and launch
    shape: a repeated launch then only copies its explicit arguments in."""
    key = (id(meta), grid, block, dynamic_lds)
    hit = _HIDDEN_TEMPLATES.get(key)
    if hit is not None and hit[0] is meta:
        return hit[1]
    seg = bytearray(meta.kernarg_segment_size)
    known = hidden_arg_values(grid, block, dynamic_lds)
    for a in meta.hidden_args:
        if a.value_kind in known:
            value = known[a.value_kind]
        elif a.address_space is not None:
            value = 0
        else:
            raise KernargError(
                f"{meta.name}: hidden argument kind {a.value_kind!r} is not known to pa_tile's launcher; "
                "add its value to pa_tile.emu.launch.hidden_arg_values"
            )
        try:
            seg[a.offset : a.offset + a.size] = int(value).to_bytes(a.size, "little")
        except OverflowError:
            raise KernargError(f"{meta.name}: {a.value_kind} = {value} does not fit in {a.size} bytes") from None
    if len(_HIDDEN_TEMPLATES) > 256:
        _HIDDEN_TEMPLATES.clear()
    _HIDDEN_TEMPLATES[key] = (meta, bytes(seg))
    return bytes(seg)


# ------------------------------------------------------------------------------------ regions


BOUNDS = ("view", "storage")


def tensor_regions(values: Dict[str, Any], bounds: str = "view") -> List[Region]:
    """Allowed regions of every torch.Tensor in *values* (name -> argument), nested containers included.

    ``bounds="view"`` (the default): a tensor allows exactly the bytes its view spans (from its
    lowest to its highest element), so when K and V are views into one allocation, a K index
    that runs past K's view faults instead of quietly reading V or another layer.
    ``bounds="storage"``: a tensor allows its whole storage, for kernels that legitimately reach
    past the view they were given. FlyDSL's ``from_torch_tensor`` / ``from_dlpack`` wrappers
    count as the tensor they wrap; a DLPack object that is not a torch tensor (numpy, ...)
    always contributes the bytes its view spans (:func:`_dlpack_region`): DLPack does not
    describe the allocation around it.

    Regions are named after the argument path (``"qkv[1]"``); identical regions of several
    arguments appear once with the names joined by ``|``. Tensors on a device other than the
    CPU raise ``ValueError``: the emulator executes on host memory.
    """
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be 'view' or 'storage', got {bounds!r}")
    import torch

    found: Dict[Tuple[int, int], List[str]] = {}

    def visit(value: Any, name: str, depth: int) -> None:
        if depth > 8:
            return
        if not isinstance(value, torch.Tensor):
            # FlyDSL's wrappers: TorchTensorJitArg (from_torch_tensor) keeps .torch_tensor,
            # DLTensorJitArg (from_dlpack) keeps the wrapped object as .dltensor.
            inner = getattr(value, "torch_tensor", None)
            if inner is None:
                inner = getattr(value, "dltensor", None)
            if isinstance(inner, torch.Tensor):
                value = inner
            elif inner is not None and getattr(value, "dladaptor", None) is not None:
                region = _dlpack_region(value.dladaptor, name)
                if region is not None:
                    names = found.setdefault(region, [])
                    if name not in names:
                        names.append(name)
                return
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise ValueError(
                    f"argument {name!r} is a tensor on {value.device}; the pa_tile emulator runs kernels on "
                    "host memory, so pass CPU tensors (pa_tile.backend.device_for_tensors() names the right device)"
                )
            span = _view_span(value) if bounds == "view" else _storage_span(value)
            if span is not None:
                names = found.setdefault(span, [])
                if name not in names:
                    names.append(name)
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                visit(v, f"{name}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{name}[{k!r}]", depth + 1)

    for name, value in values.items():
        visit(value, name, 0)
    return [(base, nbytes, "|".join(names)) for (base, nbytes), names in found.items()]


def pointer_regions(values: Dict[str, Any]) -> List[Region]:
    """Allowed regions of raw ``data_ptr()`` integers among *values* while a simulated device
    (``pa_tile.emu.device``) is active: each integer that points into a live device allocation
    allows that allocation, whole (a raw pointer carries no view), named after the argument.
    Without a simulated device, raw-pointer kernels name their memory with ``launch_options(regions=)``."""
    dev = sys.modules.get("pa_tile.emu.device")
    if dev is None or dev.active() is None:
        return []
    found: Dict[Tuple[int, int], List[str]] = {}

    def visit(value: Any, name: str, depth: int) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0xFFFF:
            span = dev.allocation_containing(value)
            if span is not None:
                found.setdefault(span, []).append(f"{name} (pointer)")
        elif isinstance(value, (tuple, list)) and depth < 2:
            for i, v in enumerate(value):
                visit(v, f"{name}[{i}]", depth + 1)

    for name, value in values.items():
        visit(value, name, 0)
    return [(base, nbytes, "|".join(names)) for (base, nbytes), names in found.items()]


def _storage_span(t: Any) -> Optional[Tuple[int, int]]:
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    return (storage.data_ptr(), nbytes) if nbytes else None


def _view_span(t: Any) -> Optional[Tuple[int, int]]:
    """``(base, nbytes)`` from a torch tensor's lowest to its highest element byte."""
    if t.numel() == 0:
        return None
    lo = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    size = t.element_size()
    return t.data_ptr() + lo * size, (hi - lo + 1) * size


def region_of(item: Any, name: str, bounds: str = "view") -> Optional[Region]:
    """An extra allowed region from a tensor (its view or storage, per *bounds*) or a
    ``(base, nbytes, name)`` tuple (see :func:`launch_options` ``regions``)."""
    if isinstance(item, tuple) and len(item) == 3 and not hasattr(item[0], "data_ptr"):
        base, nbytes, label = item
        if not isinstance(base, int) or not isinstance(nbytes, int) or base <= 0 or nbytes < 0:
            raise ValueError(f"region {item!r}: expected (base address > 0, nbytes >= 0, name)")
        return (base, nbytes, str(label)) if nbytes else None
    found = tensor_regions({name: item}, bounds)
    if not found:
        if getattr(item, "numel", None) is not None and item.numel() == 0:
            return None
        raise TypeError(f"{name}: expected a CPU tensor or a (base, nbytes, name) tuple, got {type(item).__name__}")
    return found[0]


def _dlpack_region(adaptor: Any, name: str) -> Optional[Tuple[int, int]]:
    """``(base, nbytes)`` a non-torch DLPack tensor (numpy, ...) spans, from FlyDSL's adaptor.

    Only the bytes the view itself reaches are allowed: DLPack does not describe the
    allocation around a view (torch tensors get their whole storage instead).
    """
    if int(getattr(adaptor, "address_space", 0)) != 0:
        raise ValueError(
            f"argument {name!r} is a DLPack tensor in device memory; the pa_tile emulator runs kernels on host "
            "memory, so pass CPU arrays"
        )
    shape, stride = tuple(adaptor.shape), tuple(adaptor.stride)
    itemsize = max(1, int(adaptor.element_bits) // 8)
    if any(int(n) == 0 for n in shape) or not adaptor.data_ptr:
        return None
    lo = sum((n - 1) * st for n, st in zip(shape, stride) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(shape, stride) if st > 0)
    return int(adaptor.data_ptr) + lo * itemsize, (hi - lo + 1) * itemsize


def _named_arguments(func: Callable, args: tuple, kwargs: dict) -> Dict[str, Any]:
    try:
        bound = inspect.signature(func).bind_partial(*args, **kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        named = {f"arg{i}": a for i, a in enumerate(args)}
        named.update(kwargs)
        return named


# ------------------------------------------------------------------------------------ launches


@dataclass
class LoadedModule:
    """A module FlyDSL loaded through the shim: its assembly text and metadata (or why not)."""

    handle: int
    blob: bytes
    text: Optional[str] = None
    meta: Optional[CodeObjectMeta] = None
    error: Optional[BaseException] = None
    program: Any = None  # pa_tile.emu.asm program, parsed on first run
    key: str = ""  # digest of the code object: modules with the same text share one parse


@dataclass
class Launch:
    """Everything one kernel launch hands to the launch handler."""

    kernel: str
    meta: KernelMeta
    module: LoadedModule
    arch: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    dynamic_lds: int
    explicit_args: Tuple[bytes, ...]  # bytes of each explicit argument, in order
    kernarg: bytes  # the full kernarg segment
    regions: List[Region]
    trace: Any = None
    progress: Optional[bool] = None
    lds_races: str = "raise"
    lds_oob: str = "raise"
    quantum: Optional[int] = None
    execute: bool = True
    bounds: str = "view"
    overread: int = 0
    overreads: int = 0   # after the run: lane loads that used the overread slack

    @property
    def asm(self) -> str:
        return self.module.text or ""


class _CodeObjects:
    """Parse results per code object (digest of its bytes): the text, the metadata, and the
    ``asm`` program (parsed on first run; it also caches the decoded handlers). Every load and
    launch of the same kernel reuses them, so a repeated ``CompiledFunction`` launch does no
    parsing at all."""

    LIMIT = 64

    def __init__(self) -> None:
        import collections

        self._entries: "collections.OrderedDict[str, list]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.parses = 0  # metadata parses done (tests check cache hits with it)

    def metadata(self, key: str, blob: bytes) -> Tuple[str, CodeObjectMeta]:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0], hit[1]
        text = blob.decode("utf-8")
        meta = parse_amdgpu_metadata(text)
        with self._lock:
            self.parses += 1
            self._entries[key] = [text, meta, None]
            while len(self._entries) > self.LIMIT:
                self._entries.popitem(last=False)
        return text, meta

    def program(self, module: "LoadedModule") -> Any:
        from . import asm

        with self._lock:
            hit = self._entries.get(module.key)
            if hit is not None and hit[2] is not None:
                return hit[2]
        program = asm.parse(module.text)
        with self._lock:
            hit = self._entries.get(module.key)
            if hit is not None:
                hit[2] = program
        return program


_code_objects = _CodeObjects()


def run_on_emulator(launch: Launch) -> None:
    """Default launch handler: run the kernel in ``pa_tile.emu.machine`` against the regions."""
    from . import machine, memory

    if launch.module.program is None:
        launch.module.program = _code_objects.program(launch.module)
    mem = memory.GlobalMemory(launch.regions, overread=launch.overread)
    if launch.trace is not None and hasattr(launch.trace, "set_regions"):
        launch.trace.set_regions(launch.regions)  # 128-byte lines counted from each tensor's start
    try:
        machine.run_kernel(
            launch.module.program,
            launch.kernel,
            launch.grid,
            launch.block,
            launch.kernarg,
            mem,
            dynamic_lds=launch.dynamic_lds,
            arch=launch.arch,
            trace=launch.trace,
            progress=launch.progress,
            lds_races=launch.lds_races,
            quantum=launch.quantum,
            lds_oob=launch.lds_oob,
        )
    finally:
        launch.overreads = mem.overreads


_handler: Callable[[Launch], None] = run_on_emulator


def set_launch_handler(fn: Optional[Callable[[Launch], None]]) -> Callable[[Launch], None]:
    """Route launches to ``fn(launch)`` (``None``: back to :func:`run_on_emulator`); returns the previous one."""
    global _handler
    if fn is not None and not callable(fn):
        raise TypeError("the launch handler must be callable as fn(launch)")
    previous, _handler = _handler, fn or run_on_emulator
    return previous


_DEFAULT_OPTIONS: Dict[str, Any] = dict(
    trace=None, progress=None, lds_races="raise", quantum=None, execute=True, bounds="view", regions=(),
    lds_oob="raise", overread=0,
)


class _Local(threading.local):
    call: Optional["_CallContext"] = None
    options: Dict[str, Any] = _DEFAULT_OPTIONS
    recorders: Tuple[list, ...] = ()


_local = _Local()


@contextlib.contextmanager
def launch_options(
    *,
    trace: Any = None,
    progress: Optional[bool] = None,
    lds_races: str = "raise",
    quantum: Optional[int] = None,
    execute: bool = True,
    bounds: str = "view",
    regions: Sequence[Any] = (),
    lds_oob: str = "raise",
    overread: int = 0,
) -> Iterator[None]:
    """Launches in this block (this thread) use these options (unnamed ones take their defaults).

    ``trace``: a ``memory.Trace`` told every instruction and access; ``progress``: a progress
    bar over workgroups on stderr (``True``), none (``False``), or one on long launches when
    someone watches (``None``, see ``pa_tile.progress``); ``lds_races`` (``"raise"``, ``"warn"``, ``"off"``) and
    ``quantum`` (instructions a wave runs before the next takes a turn; ``None``: until its next
    barrier) and ``lds_oob`` (``"raise"``; ``"hardware"``: LDS accesses past the allocation read 0
    and drop writes, as on a GPU): see ``run_kernel``. ``overread``: bytes a global or buffer
    load may run past the end of the region it starts in (default 0: a fault), for a kernel
    that over-reads by design, as on a GPU where the allocation goes on; those bytes read
    ``memory.OVERREAD_POISON`` (0xFF: NaN in f32/f16/bf16), never host memory, and stores get
    no slack.

    ``bounds``: ``"view"`` (default) lets each tensor argument reach exactly the bytes its view
    spans; ``"storage"`` its whole storage, for kernels that legitimately read past a view
    (:func:`tensor_regions`). ``regions``: extra allowed memory for kernels that take raw
    ``data_ptr()`` integers instead of tensors: each item a CPU tensor (its view or storage, per
    ``bounds``, read at each launch) or a ``(base, nbytes, name)`` tuple; the caller keeps that
    memory alive for the block.

    ``execute=False`` is the no-op launch for measuring host cost: each launch still finds its
    kernel's metadata, builds the kernarg segment, collects and checks the allowed regions and
    is recorded (:func:`record_launches`), but the launch handler is not called and no
    instruction runs (outputs are left as they were). ``execute="host"`` skips the emulator's own
    per-launch work too (region walk, kernarg, the launch record): the shim returns at once, so
    what remains is the host path a GPU launch has (pa_tile's and FlyDSL's Python, the C call);
    ``pa_tile.perf.overhead`` measures with it. Everything is checked here, so a typo fails
    before anything compiles.
    """
    if lds_races not in ("raise", "warn", "off"):
        raise ValueError(f"lds_races must be 'raise', 'warn' or 'off', got {lds_races!r}")
    if lds_oob not in ("raise", "hardware"):
        raise ValueError(f"lds_oob must be 'raise' or 'hardware', got {lds_oob!r}")
    if quantum is not None and (isinstance(quantum, bool) or not isinstance(quantum, int) or quantum < 1):
        raise ValueError(f"quantum must be None or a positive int, got {quantum!r}")
    if not isinstance(execute, bool) and execute != "host":
        raise ValueError(f"execute must be True, False or 'host', got {execute!r}")
    if isinstance(overread, bool) or not isinstance(overread, int) or overread < 0:
        raise ValueError(f"overread must be a byte count >= 0, got {overread!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be 'view' or 'storage', got {bounds!r}")
    regions = tuple(regions)
    for i, item in enumerate(regions):
        region_of(item, f"regions[{i}]", bounds)  # fail now on a malformed item
    saved = _local.options
    _local.options = dict(trace=trace, progress=None if progress is None else bool(progress), lds_races=lds_races,
                          quantum=quantum, execute=execute, bounds=bounds, regions=regions, lds_oob=lds_oob,
                          overread=overread)
    try:
        yield
    finally:
        _local.options = saved


@contextlib.contextmanager
def record_launches() -> Iterator[List[Launch]]:
    """Collect every :class:`Launch` made in this block (this thread), failed ones included."""
    log: List[Launch] = []
    _local.recorders = _local.recorders + (log,)
    try:
        yield log
    finally:
        _local.recorders = tuple(r for r in _local.recorders if r is not log)


@dataclass
class _CallContext:
    name: str
    regions: List[Region]
    error: Optional[BaseException] = None


class _Modules:
    """Python side of the shim's modules, keyed by the handle given to C."""

    def __init__(self) -> None:
        self.by_handle: Dict[int, LoadedModule] = {}
        self._next = 1
        self._lock = threading.Lock()
        self.loads = 0  # modules loaded so far (tests use it to see cache hits)

    def load(self, data: int, size: int, nul_terminated: int) -> int:
        try:
            blob = ctypes.string_at(data, size) if data else b""
        except BaseException as e:  # noqa: BLE001 - nothing may escape into C
            blob, err = b"", e
        else:
            err = None
        with self._lock:
            handle, self._next = self._next, self._next + 1
            self.loads += 1
        module = LoadedModule(handle=handle, blob=blob, error=err)
        if err is None:
            try:
                if blob[:4] == b"\x7fELF":
                    raise LaunchError(
                        "FlyDSL loaded an ELF code object, but the emulator needs assembly text: this kernel "
                        "was compiled before pa_tile.emu.launch.install() ran (or by another backend). "
                        "Install the emulator before the first @flyc.jit call."
                    )
                module.key = hashlib.sha256(blob).hexdigest()
                module.text, module.meta = _code_objects.metadata(module.key, blob)
            except BaseException as e:  # noqa: BLE001
                module.error = e
        if module.error is not None:
            _report(module.error)
        self.by_handle[handle] = module
        return handle

    def unload(self, handle: int) -> None:
        self.by_handle.pop(handle, None)


_modules = _Modules()


def _report(error: BaseException) -> None:
    """Hand an exception raised under C frames to the running jit call (or stderr if none)."""
    ctx = _local.call
    if ctx is not None:
        if ctx.error is None:
            ctx.error = error
        return
    import traceback

    print("[pa_tile.emu] error outside a @flyc.jit call (nothing can re-raise it):", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)


def _live_allocations() -> List[Region]:
    lib = _state.lib if _state else None
    if lib is None:
        return []
    n = lib.pa_emu_allocations(None, None, 0)
    if not n:
        return []
    bases, sizes = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
    n = min(n, lib.pa_emu_allocations(bases, sizes, n))
    return [(bases[i], sizes[i], f"mgpuMemAlloc#{i}") for i in range(n) if sizes[i]]


def _make_launch(handle, name_p, dims, dynamic_lds, params, extra, nparams) -> Launch:
    kernel = name_p.decode() if name_p else "?"
    module = _modules.by_handle.get(handle)
    if module is None:
        raise LaunchError(f"launch of {kernel}: its module (handle {handle}) was never loaded or was unloaded")
    if module.error is not None:
        raise LaunchError(f"launch of {kernel}: its module could not be loaded: {module.error}") from module.error
    meta = module.meta.kernels.get(kernel)
    if meta is None:
        raise LaunchError(f"launch of {kernel}: module has kernels {sorted(module.meta.kernels)} only")
    grid = (int(dims[0]), int(dims[1]), int(dims[2]))
    block = (int(dims[3]), int(dims[4]), int(dims[5]))
    cluster = (int(dims[6]), int(dims[7]), int(dims[8]))
    if min(grid) < 1 or min(block) < 1:
        raise LaunchError(f"launch of {kernel}: grid {grid} and block {block} must be positive")
    if cluster != (1, 1, 1):
        raise LaunchError(f"launch of {kernel}: cluster {cluster} requested; gfx942/gfx950 have no clusters")
    threads = block[0] * block[1] * block[2]
    if threads > meta.max_flat_workgroup_size:
        raise LaunchError(
            f"launch of {kernel}: block {block} has {threads} threads, the kernel allows "
            f"{meta.max_flat_workgroup_size} (.max_flat_workgroup_size)"
        )
    if meta.reqd_workgroup_size and block != meta.reqd_workgroup_size:
        raise LaunchError(f"launch of {kernel}: block {block} but the kernel requires {meta.reqd_workgroup_size}")
    if extra and not params:
        raise LaunchError(f"launch of {kernel}: arguments passed through 'extra' (a kernarg buffer) are not supported")
    nexplicit = len(meta.explicit_args)
    if nparams != nexplicit:
        raise KernargError(
            f"launch of {kernel}: FlyDSL passed {nparams} arguments but the kernel metadata lists "
            f"{nexplicit} explicit ones"
        )
    explicit = []
    for i, a in enumerate(meta.explicit_args):
        if not params[i]:
            raise KernargError(f"launch of {kernel}: argument {i} ({a.value_kind}) is a NULL pointer")
        explicit.append(ctypes.string_at(params[i], a.size))
    kernarg = build_kernarg(meta, explicit, grid, block, dynamic_lds)
    ctx = _local.call
    options = dict(_local.options)
    extra = options.pop("regions", ())
    regions = list(ctx.regions if ctx else []) + _live_allocations()
    for i, item in enumerate(extra):
        region = region_of(item, f"regions[{i}]", options["bounds"])
        if region is not None and region not in regions:
            regions.append(region)
    return Launch(
        kernel=kernel,
        meta=meta,
        module=module,
        arch=module.meta.arch,
        grid=grid,
        block=block,
        dynamic_lds=int(dynamic_lds),
        explicit_args=tuple(explicit),
        kernarg=kernarg,
        regions=regions,
        **options,
    )


def _check_regions(regions: Sequence[Region]) -> None:
    """The checks ``memory.GlobalMemory`` makes of each region, without mapping any memory."""
    for base, nbytes, name in regions:
        if int(nbytes) < 0 or int(base) <= 0:
            raise ValueError(f"region {name!r}: bad base {int(base):#x} / size {nbytes}")


def _on_launch(handle, name_p, dims, dynamic_lds, stream, params, extra, nparams) -> int:
    try:
        ctx = _local.call
        if ctx is None:
            raise LaunchError(
                "kernel launched outside a @flyc.jit call, so no tensor arguments are known to the sanitizer; "
                "launch through a @flyc.jit function or flyc.compile()'d function"
            )
        if ctx.error is not None:
            return 2  # an earlier launch of this call failed: later ones would read its garbage
        if _local.options.get("execute") == "host":
            return 0  # the device's work, and the emulator's own per-launch work, skipped
        launch = _make_launch(handle, name_p, dims, dynamic_lds, params, extra, nparams)
        for log in _local.recorders:
            log.append(launch)
        if not launch.execute:
            _check_regions(launch.regions)
            return 0
        _handler(launch)
        return 0
    except BaseException as e:  # noqa: BLE001 - nothing may escape into C
        _report(e)
        return 1


def _tracked_call(call: Callable[[], Any], what: str, named: Callable[[], Dict[str, Any]],
                  pin_arch: bool = True) -> Any:
    if _local.call is not None:  # a jit function used while tracing another: no launch of its own
        return call()
    host_only = _local.options.get("execute") == "host"
    # execute="host": no region walk here and none at the launch: only what a GPU's host does runs
    if host_only:
        regions = []
    else:
        values = named()
        regions = tensor_regions(values, _local.options.get("bounds", "view")) + pointer_regions(values)
    ctx = _CallContext(name=what, regions=regions)
    _local.call = ctx
    try:
        # a compiled function's code object names its arch; only tracing reads ARCH
        with _pinned_arch() if pin_arch else contextlib.nullcontext():
            result = call()
    except BaseException as flydsl_error:
        if ctx.error is None:
            raise
        raise ctx.error from flydsl_error
    finally:
        _local.call = None
    if ctx.error is not None:
        err = ctx.error
        if hasattr(err, "add_note"):
            err.add_note(f"(raised inside the emulator during the @flyc.jit call {what}; re-raised after it returned)")
        raise err
    return result


def _on_host(args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """Arguments with each simulated-device tensor (``pa_tile.emu.device``) replaced by its host
    bytes and its streams by the default stream: what the emulator runs on."""
    dev = sys.modules.get("pa_tile.emu.device")
    if dev is None or dev.active() is None:
        return args, kwargs
    return dev.to_host(args), dev.to_host(kwargs)


def _wrap_jit_call(original: Callable) -> Callable:
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        args, kwargs = _on_host(args, kwargs)
        func = getattr(self, "func", None)
        name = getattr(func, "__name__", type(self).__name__)
        return _tracked_call(
            lambda: original(self, *args, **kwargs), f"{name}()", lambda: _named_arguments(func, args, kwargs)
        )

    __call__._pa_tile_emu_original = original
    return __call__


# CompiledFunction has __slots__ and no weakref slot, so the launcher each one came from is kept
# here (bounded) to name its regions after the launcher's parameters ("K", not "arg1").
_COMPILED_ORIGIN: Dict[int, Tuple[Any, str, Tuple[str, ...]]] = {}


def _remember_compiled(compiled: Any, target: Callable) -> None:
    try:
        params = tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return
    if len(_COMPILED_ORIGIN) >= 256:
        _COMPILED_ORIGIN.pop(next(iter(_COMPILED_ORIGIN)))
    _COMPILED_ORIGIN[id(compiled)] = (compiled, getattr(target, "__name__", "?"), params)


def _compiled_names(compiled: Any, args: tuple) -> Tuple[str, Dict[str, Any]]:
    hit = _COMPILED_ORIGIN.get(id(compiled))
    if hit is None or hit[0] is not compiled:
        return "compiled function", {f"arg{i}": a for i, a in enumerate(args)}
    _, name, params = hit
    named = {(params[i] if i < len(params) else f"arg{i}"): a for i, a in enumerate(args)}
    return f"compiled {name}()", named


def _wrap_compiled_call(original: Callable) -> Callable:
    @functools.wraps(original)
    def __call__(self, *args):
        args, _ = _on_host(args, {})
        hit = _COMPILED_ORIGIN.get(id(self))
        what = f"compiled {hit[1]}()" if hit is not None and hit[0] is self else "compiled function"
        return _tracked_call(lambda: original(self, *args), what, lambda: _compiled_names(self, args)[1],
                             pin_arch=False)

    __call__._pa_tile_emu_original = original
    return __call__


def _wrap_compile_call(original: Callable) -> Callable:
    # flyc.compile() compiles (and, given device tensors, launches) outside JitFunction.__call__.
    @functools.wraps(original)
    def __call__(self, func, *args, **kwargs):
        args, kwargs = _on_host(args, kwargs)
        target = getattr(func, "func", func)
        name = getattr(target, "__name__", "?")
        compiled = _tracked_call(
            lambda: original(self, func, *args, **kwargs),
            f"flyc.compile({name})",
            lambda: _named_arguments(target, args, kwargs),
        )
        if compiled is not None and type(compiled).__name__ == "CompiledFunction":
            _remember_compiled(compiled, target)
        return compiled

    __call__._pa_tile_emu_original = original
    return __call__


# ------------------------------------------------------------- CPU tensors are device tensors

# flyc.compile() launches at once when it is given live device arguments (FlyDSL: "live device
# arguments retain the existing initial launch") and treats every other tensor as a compile
# placeholder. Under the emulator host memory *is* device memory, so without this a launcher
# that calls flyc.compile() on its first call and the cached CompiledFunction afterwards would
# silently skip its first launch.
_PLACEHOLDER_HOOKS = ("_is_compile_placeholder", "_has_live_device_argument")


def _emulated_device_tensor(value: Any) -> bool:
    """Whether *value* is a CPU tensor argument the emulator runs on (torch or FlyDSL-wrapped)."""
    import torch

    inner = getattr(value, "torch_tensor", None) if not isinstance(value, torch.Tensor) else value
    if isinstance(inner, torch.Tensor):
        return inner.device.type == "cpu"
    adaptor = getattr(value, "dladaptor", None)
    if adaptor is not None and getattr(value, "dltensor", None) is not None:
        return bool(adaptor.data_ptr) and int(getattr(adaptor, "address_space", -1)) == 0
    return False


def _wrap_placeholder_check(original: Callable, live: bool) -> Callable:
    @functools.wraps(original)
    def check(value, *args, **kwargs):
        if _emulated_device_tensor(value):
            return live
        return original(value, *args, **kwargs)

    check._pa_tile_emu_original = original
    return check


def _hook_placeholders(jit_function: Any) -> None:
    for name, live in zip(_PLACEHOLDER_HOOKS, (False, True)):
        fn = getattr(jit_function, name)
        if not hasattr(fn, "_pa_tile_emu_original"):
            setattr(jit_function, name, _wrap_placeholder_check(fn, live))


# --------------------------------------------------------------------------------------- shim


def _cache_dir() -> Path:
    root = os.environ.get("PA_TILE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pa_tile"
    )
    return Path(root)


def _c_compiler() -> str:
    cc = os.environ.get("CC") or "gcc"
    path = shutil.which(cc) or (shutil.which("cc") if "CC" not in os.environ else None)
    if not path:
        raise EmuSetupError(
            f"the pa_tile emulator builds a small C library (its FlyDSL runtime shim) on first use, but no C "
            f"compiler was found ({cc!r} is not on PATH). Install gcc (e.g. apt-get install gcc) or set CC."
        )
    return path


_CFLAGS = ("-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-pthread")


def build_shim(cache_dir: Optional[Path] = None) -> Path:
    """Compile ``_shim/emu_runtime.c`` (once per source version) into the per-user cache; return the .so path.

    The file name carries a hash of the source and flags, so a changed source never reuses a
    stale build; the source folder is only read (it may be read-only).
    """
    return build_c_library(SHIM_SOURCE, "shim", "the emulator runtime shim", cache_dir=cache_dir)


def build_c_library(source: Path, stem: str, what: str, extra_flags: Sequence[str] = (),
                    cache_dir: Optional[Path] = None) -> Path:
    """Compile one C file of ``_shim/`` into ``<cache>/<stem>-<hash>.so`` (once per source and
    flags; see :func:`build_shim`) and return its path."""
    src = Path(source).read_bytes()
    flags = (*_CFLAGS, *extra_flags)
    key = hashlib.sha256(src + repr((flags, platform.machine(), sys.platform)).encode()).hexdigest()[:16]
    out_dir = Path(cache_dir) if cache_dir is not None else _cache_dir()
    out = out_dir / f"{stem}-{key}.so"
    if out.exists():
        return out
    cc = _c_compiler()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EmuSetupError(f"cannot create the shim cache folder {out_dir} ({e}); set PA_TILE_CACHE_DIR") from e
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmuSetupError(f"building {what} with {cc} failed:\n{proc.stderr}")
        os.replace(tmp, out)  # atomic: concurrent builders each publish a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def elf_exported_functions(path: os.PathLike) -> set:
    """Names of the functions a shared library exports (defined global/weak FUNC in ``.dynsym``).

    Read straight from the ELF file, so the library is never loaded (FlyDSL's real runtime
    cannot be loaded without HIP) and no binutils are needed.
    """
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        str_off = sections[link][4]
        for pos in range(offset, offset + size, entsize or 24):
            st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, pos)
            if st_shndx == 0 or (st_info >> 4) not in (1, 2) or (st_info & 0xF) != 2:
                continue  # undefined, local, or not a function
            names.add(data[str_off + st_name : data.index(b"\0", str_off + st_name)].decode())
    return names


def real_runtime_path() -> Path:
    """FlyDSL's own JIT runtime library (where its JIT executor looks for it)."""
    from flydsl.compiler import jit_executor

    return Path(jit_executor.__file__).resolve().parent.parent / "_mlir" / "_mlir_libs" / _REAL_RUNTIME


def compare_exports(real: set, shim: set) -> List[str]:
    """Problems with the shim's exports against the real runtime's (empty list: they agree)."""
    problems = []
    real_c = {n for n in real if not n.startswith("_Z") and not n.startswith("_")}
    missing = sorted(n for n in real_c if n.startswith("mgpu") and n not in shim)
    extra = sorted(n for n in shim if n.startswith("mgpu") and n not in real)
    unknown = sorted(n for n in real_c if not n.startswith("mgpu") and not n.startswith(_AOT_ONLY_PREFIXES))
    if missing:
        problems.append(
            f"FlyDSL's runtime exports {missing} but the emulator shim does not: JIT host code calling them "
            "would fail to link. Add them to pa_tile/emu/_shim/emu_runtime.c."
        )
    if extra:
        problems.append(f"the emulator shim exports {extra}, which FlyDSL's runtime no longer has (stale signatures?)")
    if unknown:
        problems.append(
            f"FlyDSL's runtime exports new C symbols {unknown}; check whether JIT host code calls them "
            "and, if so, implement them in the shim"
        )
    return problems


# ------------------------------------------------------------------------------------ install


@dataclass
class _Installed:
    lib: ctypes.CDLL
    shim: Path
    backend_cls: type
    callbacks: tuple  # ctypes callback objects: must outlive every engine


_state: Optional[_Installed] = None
_install_lock = threading.Lock()

_LOAD = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32)
_UNLOAD = ctypes.CFUNCTYPE(None, ctypes.c_uint64)
_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int32,
    ctypes.c_uint64,
    ctypes.c_char_p,
    ctypes.POINTER(ctypes.c_int64),
    ctypes.c_int32,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_uint64,
)


def _version_tuple(v: str) -> Tuple[int, ...]:
    """Leading release numbers: '0.5.0' -> (0, 5, 0); '0.6.0rc1' -> (0, 6, 0); '0.4.2.dev3' -> (0, 4, 2)."""
    parts = []
    for p in v.split("+", 1)[0].split("."):
        m = re.match(r"\d+", p)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() != len(p):
            break
    return tuple(parts)


def check_flydsl_version(version: Optional[str] = None) -> str:
    """Raise :class:`EmuSetupError` unless the installed (or given) FlyDSL version is supported."""
    if version is None:
        import flydsl

        version = getattr(flydsl, "__version__", "0")
    low, high = SUPPORTED_FLYDSL
    if not (low <= _version_tuple(version) < high):
        raise EmuSetupError(
            f"flydsl {version} is outside the range the emulator hook supports (>={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}): it patches FlyDSL internals. Install a supported flydsl, or run "
            "pa_tile.emu.launch.self_test() on this one and widen SUPPORTED_FLYDSL if it passes."
        )
    return version


def _isa_final_pass(fragment: str) -> str:
    if not fragment.startswith("gpu-module-to-binary{") or fragment.count("format=fatbin") != 1:
        raise EmuSetupError(
            f"FlyDSL's last pipeline pass is {fragment!r}, not gpu-module-to-binary{{format=fatbin ...}}; "
            "the emulator hook cannot switch it to assembly output"
        )
    return fragment.replace("format=fatbin", "format=isa")


def _make_backend_class(RocmBackend: type, shim: Path) -> type:
    class EmuRocmBackend(RocmBackend):
        """FlyDSL's ROCm backend, emitting assembly text and linking pa_tile's runtime shim."""

        pa_tile_emulator = True

        def pipeline_fragments(self, *, compile_hints: dict) -> List[str]:
            fragments = list(super().pipeline_fragments(compile_hints=compile_hints))
            fragments[-1] = _isa_final_pass(fragments[-1])
            return fragments

        def external_binary_pipeline_fragments(self, *, compile_hints: dict):
            raise EmuSetupError(
                "FLYDSL_COMPILE_LLVM_DIR (external LLVM code generation) is not supported under the pa_tile "
                "emulator; unset it"
            )

        def jit_runtime_lib_basenames(self) -> List[str]:
            libs = list(super().jit_runtime_lib_basenames())
            if not libs or libs[0] != _REAL_RUNTIME:
                raise EmuSetupError(f"FlyDSL's runtime library list {libs} does not start with {_REAL_RUNTIME}")
            # FlyDSL joins these to its lib folder; joining an absolute path yields the path itself.
            return [str(shim), *libs[1:]]

        def hash(self) -> str:
            return f"{super().hash()}|pa_tile-emu:isa:abi{SHIM_ABI_VERSION}"

    return EmuRocmBackend


def _real_runtime_loaded(maps: str = "/proc/self/maps") -> bool:
    try:
        with open(maps) as f:
            return any(line.rstrip().endswith("/" + _REAL_RUNTIME) for line in f)
    except OSError:  # no procfs: cannot tell
        return False


def _internals_problems() -> List[str]:
    """Checks of the FlyDSL internals the hook relies on (no side effects)."""
    problems = []
    try:
        from flydsl.compiler import backends as B
        from flydsl.compiler import jit_executor, jit_function
        from flydsl.compiler.backends.rocm import RocmBackend
    except Exception as e:  # noqa: BLE001
        return [f"cannot import FlyDSL's compiler modules ({e!r})"]

    register = getattr(B, "register_backend", None)
    if not callable(register) or "force" not in inspect.signature(register).parameters:
        problems.append("flydsl.compiler.backends.register_backend(name, cls, force=...) is gone")
    registry = getattr(B, "_registry", None)
    if not isinstance(registry, dict) or not (
        isinstance(registry.get("rocm"), type) and issubclass(registry["rocm"], RocmBackend)
    ):
        problems.append("flydsl.compiler.backends._registry has no 'rocm' RocmBackend entry")
    for owner, name in ((B, "_make_backend"), (jit_executor, "_resolve_runtime_libs")):
        if not callable(getattr(getattr(owner, name, None), "cache_clear", None)):
            problems.append(
                f"{owner.__name__}.{name} is no longer an lru_cache: the hook cannot make FlyDSL forget "
                "a backend / runtime library resolved before install()"
            )
    for meth in ("pipeline_fragments", "jit_runtime_lib_basenames", "hash", "make_target"):
        if not hasattr(RocmBackend, meth):
            problems.append(f"RocmBackend.{meth} is gone")
    if not problems:
        try:
            backend = RocmBackend(RocmBackend.make_target(DEFAULT_ARCH))
            _isa_final_pass(backend.pipeline_fragments(compile_hints={})[-1])
            libs = backend.jit_runtime_lib_basenames()
            if not libs or libs[0] != _REAL_RUNTIME:
                problems.append(f"RocmBackend.jit_runtime_lib_basenames() is {libs}, expected {_REAL_RUNTIME} first")
        except EmuSetupError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001
            problems.append(f"cannot inspect RocmBackend's pipeline ({e!r})")
    if not real_runtime_path().exists():
        problems.append(f"FlyDSL's runtime library is not at {real_runtime_path()}: the JIT executor's lookup changed")
    for cls_name in ("JitFunction", "CompiledFunction"):
        cls = getattr(jit_function, cls_name, None)
        if cls is None or not callable(getattr(cls, "__call__", None)):
            problems.append(f"flydsl.compiler.jit_function.{cls_name}.__call__ (the call entry the hook wraps) is gone")
    for name in _PLACEHOLDER_HOOKS:
        if not callable(getattr(jit_function, name, None)):
            problems.append(
                f"flydsl.compiler.jit_function.{name} is gone: the hook cannot make flyc.compile() launch with "
                "CPU tensors")
    return problems


def self_test() -> List[str]:
    """Check every FlyDSL internal the hook depends on; raise ``RuntimeError`` explaining any failure.

    Returns the list of checks that passed. Safe to call before or after :func:`install`; after
    it, also checks that FlyDSL now resolves the shim as its runtime library.
    """
    passed = []
    check_flydsl_version()
    passed.append("flydsl version in the supported range")
    problems = _internals_problems()
    if not problems:
        passed.append("backend registry, pipeline last pass, lru caches, runtime list, call entries")
    shim = build_shim()
    problems += compare_exports(elf_exported_functions(real_runtime_path()), elf_exported_functions(shim))
    if not problems:
        passed.append("shim exports exactly the real runtime's mgpu* symbols")
    if _state is not None:
        from flydsl.compiler import backends as B
        from flydsl.compiler import jit_executor

        if B._registry.get("rocm") is not _state.backend_cls:
            problems.append("the 'rocm' backend was re-registered by someone else after install()")
        elif jit_executor._resolve_runtime_libs()[0] != str(_state.shim):
            problems.append(
                f"FlyDSL resolves its runtime library to {jit_executor._resolve_runtime_libs()[0]}, not the shim"
            )
        else:
            passed.append("FlyDSL resolves the shim as its runtime library")
    if problems:
        raise RuntimeError(
            "pa_tile's emulator hook does not fit this FlyDSL install:\n  - " + "\n  - ".join(problems)
        )
    return passed


def is_installed() -> bool:
    return _state is not None


def _preflight() -> None:
    """Refuse to install when it is too late or FlyDSL is configured for another backend."""
    backend_env = os.environ.get("FLYDSL_COMPILE_BACKEND", "").strip().lower()
    if backend_env not in ("", "rocm"):
        raise EmuSetupError(
            f"FLYDSL_COMPILE_BACKEND={backend_env!r}: the emulator replaces FlyDSL's 'rocm' backend only; unset it"
        )
    if _real_runtime_loaded():
        raise EmuSetupError(
            "FlyDSL's real GPU runtime library is already loaded in this process: a @flyc.jit function was "
            "launched before the emulator hook was installed, and its launches can no longer be redirected. "
            "Call pa_tile.backend.ensure_backend() (or pa_tile.emu.launch.install()) before the first "
            "@flyc.jit call, e.g. at the top of the script or notebook, and restart the process."
        )


def install() -> None:
    """Route FlyDSL launches in this process to the emulator. Idempotent; call before the first jit call."""
    global _state
    with _install_lock:
        if _state is not None:
            return
        _preflight()
        self_test()

        from flydsl.compiler import backends as B
        from flydsl.compiler import jit_executor, jit_function
        from flydsl.compiler.backends.rocm import RocmBackend

        shim = build_shim()
        lib = ctypes.CDLL(str(shim))
        if lib.pa_emu_abi_version() != SHIM_ABI_VERSION:
            raise EmuSetupError(f"{shim} has callback ABI {lib.pa_emu_abi_version()}, expected {SHIM_ABI_VERSION}")
        lib.pa_emu_allocations.restype = ctypes.c_uint64
        lib.pa_emu_allocations.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        callbacks = (_LOAD(_modules.load), _UNLOAD(_modules.unload), _LAUNCH(_on_launch))
        lib.pa_emu_set_callbacks(*callbacks)
        # Engines may be destroyed during interpreter shutdown; by then Python must be detached.
        atexit.register(lib.pa_emu_set_callbacks, None, None, None)

        backend_cls = _make_backend_class(RocmBackend, shim)
        B.register_backend("rocm", backend_cls, force=True)
        entries = [(jit_function.JitFunction, _wrap_jit_call), (jit_function.CompiledFunction, _wrap_compiled_call)]
        if hasattr(jit_function, "CompileCallable"):  # flyc.compile's class (absent in some versions)
            entries.append((jit_function.CompileCallable, _wrap_compile_call))
        for cls, wrap in entries:
            if not hasattr(cls.__call__, "_pa_tile_emu_original"):
                cls.__call__ = wrap(cls.__call__)
        _hook_placeholders(jit_function)
        # Anything resolved before now (e.g. by COMPILE_ONLY compiles) named the real backend/runtime.
        B._make_backend.cache_clear()
        jit_executor._resolve_runtime_libs.cache_clear()
        _state = _Installed(lib=lib, shim=shim, backend_cls=backend_cls, callbacks=callbacks)
    self_test()


def module_loads() -> int:
    """How many modules FlyDSL has loaded through the shim in this process (one per compiled artifact)."""
    return _modules.loads
