"""The fast engine's C library (``_shim/emu_fastpath.c``): loading it, and a wave's register
file as the raw pointers its functions take.

The library is built on first use with the machine's C compiler, exactly as the runtime shim is
(``launch.build_c_library``, cached per source version in ``~/.cache/pa_tile``). Where no
compiler is found the fast engine runs without it: :func:`lib` returns ``None`` and
``ops_fast`` decodes every instruction with the reference handlers.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import numpy as np

SOURCE = Path(__file__).resolve().parent / "_shim" / "emu_fastpath.c"
ABI_VERSION = 8
# no fused multiply-adds: each C expression must round exactly where numpy's does
_FLAGS = ("-ffp-contract=off", "-fno-fast-math")

_lib = None
_tried = False


def lib() -> Optional[ctypes.CDLL]:
    """The loaded library with argument types set, or ``None`` when it cannot be built here."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    from .launch import EmuSetupError, build_c_library

    try:
        path = build_c_library(SOURCE, "fastpath", "the emulator's fast paths", _FLAGS)
    except EmuSetupError:
        return None
    dll = ctypes.CDLL(str(path))
    if dll.pa_fast_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {dll.pa_fast_abi_version()}, expected {ABI_VERSION}")
    P, I, I64, U = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32
    sigs = {
        "pa_valu_f32": (I, P, P, I, I64, I64, I64),
        "pa_pk_fma_f32": (P, P, I, I64, I64, I64, I),
        "pa_cvt_pk_8": (P, P, I, I64, I64, I, I),
        "pa_mfma_fp8": (P, I, I, I, I, I, I, I, U, P, I),
        "pa_buffer_load": (P, P, I, I, I, U, I64, I, P, P, I),
        "pa_ds_read": (P, P, I, I, I, U, P, I64, P, I, I, I),
        "pa_ds_write": (P, P, I, I, I, U, P, I64, P, I, I, I),
        "pa_run_block": (P, P, P, I, I, P),
        "pa_exp_prep": (P, P, I64, P),
        "pa_exp_finish": (P, P, I, P),
    }
    for name, args in sigs.items():
        f = getattr(dll, name)
        f.argtypes = args
        f.restype = I
    _lib = dll
    return _lib


_V_SHAPE, _S_SHAPE = (512, 64), (128,)


def _usable(a: np.ndarray, shape) -> bool:
    return (isinstance(a, np.ndarray) and a.dtype == np.uint32 and a.shape == shape
            and a.flags.c_contiguous and a.flags.writeable)


def pointers(w):
    """``(v, s, v_address, s_address)`` of wave *w*'s register arrays, cached on the wave and
    refreshed when either array object changed; ``None`` if they are not the plain C-contiguous
    uint32 arrays the C code assumes (the caller then runs the reference handler)."""
    c = w.cptr
    v, s = w.v, w.s
    if c is not None and c[0] is v and c[1] is s:
        return c
    if not (_usable(v, _V_SHAPE) and _usable(s, _S_SHAPE)):
        return None
    c = w.cptr = (v, s, v.ctypes.data, s.ctypes.data)
    return c


def spans(mem):
    """``(bases, ends, bases_address, ends_address, count)`` of a ``GlobalMemory``'s region
    spans, cached on it and refreshed when its regions change (``add_region`` makes new arrays)."""
    c = mem.__dict__.get("_fast_spans")
    b, e = mem._bases, mem._ends
    if c is None or c[0] is not b or c[1] is not e:
        b, e = np.ascontiguousarray(b, np.uint64), np.ascontiguousarray(e, np.uint64)
        c = (mem._bases, mem._ends, b.ctypes.data, e.ctypes.data, len(b), b, e)
        mem.__dict__["_fast_spans"] = c
    return c


_RACE_ARRAYS = ("w_wave", "w_epoch", "w_pc", "r_wave", "r_epoch", "r_pc", "w_val", "w_known", "c_wave", "c_epoch",
                "c_pc")
_RACE_TYPES = (np.int16, np.int32, np.int32, np.int16, np.int32, np.int32, np.uint8, np.bool_, np.int16, np.int32,
               np.int32)


def lds_pointer(lds) -> Optional[int]:
    """Address of an ``memory.LDS``'s bytes when it faults on out-of-bounds accesses (the only
    mode the C paths handle), else None."""
    c = lds.__dict__.get("_fast")
    if c is None or c[0] is not lds.data:
        d = lds.data
        ok = lds.oob == "raise" and d.dtype == np.uint8 and d.flags.c_contiguous and d.flags.writeable
        c = lds.__dict__["_fast"] = (d, d.ctypes.data if ok else None)
    return c[1]


def race_pointers(races):
    """The struct of array addresses ``pa_ds_read``/``pa_ds_write`` take for an
    ``ops_ds.LdsRaceChecker`` (built once per checker), or None if its arrays are not the
    expected ones."""
    c = races.__dict__.get("_fast")
    if c is None:
        arrays = [getattr(races, n) for n in _RACE_ARRAYS]
        ok = all(a.dtype == t and a.flags.c_contiguous and a.flags.writeable for a, t in zip(arrays, _RACE_TYPES))
        c = races.__dict__["_fast"] = (arrays, (ctypes.c_void_p * 11)(*[a.ctypes.data for a in arrays]) if ok
                                       else None)
    return c[1]
