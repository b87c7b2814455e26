"""Compile FlyDSL kernels to gfx942/gfx950 assembly on a machine without a GPU.

FlyDSL's ROCDL pipeline needs a ROCm-shaped folder (``ROCM_PATH``) with two things in it:
``llvm/bin/ld.lld`` (links the assembled object into a code object) and
``amdgcn/bitcode/{ockl,ocml}.bc`` (device libraries linked into kernels that call them).
A real ROCm install has both. On a CPU-only machine we assemble the same shape out of parts
that install from ordinary package registries, as symlinks in a cache folder:

* ``ld.lld``: any ``ld.lld`` on PATH, conda-forge's ``lld`` (``$CONDA_PREFIX/bin``), Debian's
  ``lld-19`` (``/usr/lib/llvm-19/bin/ld.lld``), or PyPI's ``ziglang`` (``python -m ziglang
  ld.lld``, wrapped in a two-line script);
* bitcode: conda-forge's ``rocm-device-libs`` (under ``$CONDA_PREFIX``), Debian's
  ``rocm-device-libs``, or the copies shipped inside the ``triton`` wheel.

Nothing here ever writes into a real ROCm install: a valid ``ROCM_PATH`` or ``/opt/rocm`` is used
as it is.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from .arch import ARCHS as SUPPORTED_ARCHS  # the one list of targets

#: Where the prepared CPU toolchain lives (symlinks only). Override with PA_TILE_TOOLCHAIN_DIR.
DEFAULT_TOOLCHAIN_DIR = Path(os.environ.get("PA_TILE_TOOLCHAIN_DIR", Path.home() / ".cache" / "pa_tile" / "rocm-cpu"))


class ToolchainError(RuntimeError):
    """No usable linker or device bitcode could be found; the message says what to install."""


def is_rocm_root(path: Optional[os.PathLike]) -> bool:
    """True if *path* has the two things FlyDSL's ROCDL pipeline reads from ``ROCM_PATH``."""
    if not path:
        return False
    p = Path(path)
    return (p / "llvm" / "bin" / "ld.lld").exists() and all(
        (p / "amdgcn" / "bitcode" / f"{lib}.bc").exists() for lib in ("ockl", "ocml")
    )


def _env_prefixes() -> list:
    """The active conda environment, and this interpreter's own prefix (a conda env's python run
    without ``conda activate`` has no ``CONDA_PREFIX`` but is still inside the env)."""
    out = []
    for p in (os.environ.get("CONDA_PREFIX"), sys.prefix):
        if p and p not in out:
            out.append(p)
    return out


def _find_lld() -> Optional[Path]:
    candidates = [shutil.which("ld.lld")]
    candidates += [os.path.join(p, "bin", "ld.lld") for p in _env_prefixes()]
    candidates += sorted(glob.glob("/usr/lib/llvm-*/bin/ld.lld"), reverse=True)  # newest LLVM first
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return Path(c)
    return None


def _ziglang_lld_wrapper(dest_dir: Path) -> Optional[Path]:
    """ziglang ships lld inside its wheel; it is reached as ``python -m ziglang ld.lld``."""
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None
    wrapper = dest_dir / "ld.lld.ziglang"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _find_bitcode_dir() -> Optional[Path]:
    candidates = []
    for p in _env_prefixes():
        # conda-forge installs under lib/clang/<llvm>/lib/amdgcn and links <prefix>/amdgcn to it
        candidates += [os.path.join(p, "amdgcn", "bitcode"), os.path.join(p, "lib", "amdgcn", "bitcode")]
        candidates += sorted(glob.glob(os.path.join(p, "lib", "clang", "*", "lib", "amdgcn", "bitcode")), reverse=True)
    candidates += sorted(glob.glob("/usr/lib/*/amdgcn/bitcode")) + ["/usr/lib/amdgcn/bitcode"]
    try:  # the triton wheel carries ockl/ocml for its own AMD backend
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            candidates.append(str(Path(spec.origin).parent / "backends" / "amd" / "lib"))
    except (ImportError, ValueError):
        pass
    for c in candidates:
        if all((Path(c) / f"{lib}.bc").exists() for lib in ("ockl", "ocml")):
            return Path(c)
    return None


def prepare_cpu_toolchain(dest: Path = DEFAULT_TOOLCHAIN_DIR) -> Path:
    """Build (or refresh) a ROCm-shaped folder of symlinks at *dest* and return it."""
    lld_dir = dest / "llvm" / "bin"
    lld_dir.mkdir(parents=True, exist_ok=True)
    lld = _find_lld() or _ziglang_lld_wrapper(lld_dir)
    bitcode = _find_bitcode_dir()
    missing = []
    if lld is None:
        missing.append("ld.lld (apt-get install lld-19, conda install -c conda-forge lld, or pip install ziglang)")
    if bitcode is None:
        missing.append("ockl.bc/ocml.bc (apt-get install rocm-device-libs, conda install -c conda-forge "
                       "rocm-device-libs, or pip install triton)")
    if missing:
        raise ToolchainError("cannot prepare a CPU toolchain for FlyDSL; missing: " + "; ".join(missing))
    link = lld_dir / "ld.lld"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(lld)
    bc_link = dest / "amdgcn" / "bitcode"
    bc_link.parent.mkdir(parents=True, exist_ok=True)
    if bc_link.is_symlink() or bc_link.exists():
        bc_link.unlink()
    bc_link.symlink_to(bitcode, target_is_directory=True)
    return dest


def find_rocm_path() -> Optional[Path]:
    """A usable existing root: ``ROCM_PATH``, ``/opt/rocm``, or an already prepared CPU toolchain."""
    for c in (os.environ.get("ROCM_PATH"), "/opt/rocm", DEFAULT_TOOLCHAIN_DIR):
        if is_rocm_root(c):
            return Path(c)
    return None


def ensure_toolchain() -> Path:
    """Make ``ROCM_PATH`` point at a usable root (preparing the CPU one if needed); return it."""
    root = find_rocm_path() or prepare_cpu_toolchain()
    os.environ["ROCM_PATH"] = str(root)
    return root


def describe_toolchain() -> dict:
    """What compiles our kernels on this machine (shown in notebook 00)."""
    root = ensure_toolchain()
    lld = (root / "llvm" / "bin" / "ld.lld").resolve()
    bc = (root / "amdgcn" / "bitcode").resolve()
    import flydsl

    return {"ROCM_PATH": str(root), "ld.lld": str(lld), "bitcode": str(bc), "flydsl": flydsl.__version__}


def check_arch(arch: str) -> str:
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx942', got {type(arch).__name__}")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    return arch


@contextlib.contextmanager
def _env(**values: Optional[str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def target_arch(arch: str) -> Iterator[None]:
    """Compile (and, under the emulator, launch) for *arch* inside this block.

    FlyDSL reads ``ARCH`` for the compile target; ``FLYDSL_GPU_ARCH`` is what kernels that call
    ``get_rocm_arch()`` themselves see, so both are set.
    """
    check_arch(arch)
    with _env(ARCH=arch, FLYDSL_GPU_ARCH=arch):
        yield


def compile_isa(jit_fn, *args, arch: str = "gfx942", **kwargs) -> str:
    """Compile one specialization of a ``@flyc.jit`` launcher for *arch*; return its assembly text.

    Nothing runs: ``COMPILE_ONLY=1`` stops FlyDSL after code generation, and its ASM dump
    (``FLYDSL_DEBUG_DUMP_ASM``) hands us the final assembly. If the launcher launches several
    kernels, their assembly texts are concatenated in launch order.
    """
    ensure_toolchain()
    with tempfile.TemporaryDirectory(prefix="pa_tile_isa_") as d, target_arch(arch), _env(
        COMPILE_ONLY="1", FLYDSL_DEBUG_DUMP_ASM="1", FLYDSL_DUMP_DIR=d
    ):
        # FlyDSL keeps compiled specializations in memory and skips the dump on a hit;
        # forget them so this call always generates (and dumps) code.
        mem_cache = getattr(jit_fn, "_mem_cache", None)
        if mem_cache is not None:
            mem_cache.clear()
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            jit_fn(*args, **kwargs)
        files = sorted(Path(d).glob("*/*final_isa.s"), key=lambda p: p.stat().st_mtime_ns)
        if not files:
            raise RuntimeError(
                f"FlyDSL produced no assembly for {getattr(jit_fn, '__name__', jit_fn)!r} on {arch}; "
                "did the launcher launch a kernel?"
            )
        return "\n".join(f.read_text() for f in files)
