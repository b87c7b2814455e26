"""The two targets, in one place: every fact pa_tile knows about gfx942 (MI300) and gfx950 (MI355).

Everything that depends on the arch (fp8 flavour and its largest value, LDS size, the CU count
the emulator pretends to have, occupancy limits) reads it from here, the notebooks included.
This module imports only the standard library, so every wing of the package (the emulator too)
may use it.

fp8 e4m3 has two flavours (CDNA3 ISA guide §7.2, CDNA4 §7.3):

* FNUZ on gfx942 (``torch.float8_e4m3fnuz``): exponent bias 8, one NaN code (0x80), no
  infinities, largest magnitude 2^7 · 1.875 = 240;
* OCP on gfx950 (``torch.float8_e4m3fn``): bias 7, mantissa 0b111 of the top exponent is NaN,
  largest magnitude 2^8 · 1.75 = 448.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

__all__ = ["ARCHS", "ArchInfo", "INFO", "check_arch", "info", "fp8_format", "fp8_max", "fp8_torch_dtype",
           "arch_of_fp8_dtype", "FP8_MAX_BY_FORMAT"]

#: largest finite e4m3 magnitude of each flavour
FP8_MAX_BY_FORMAT: Dict[str, float] = {"fnuz": 240.0, "ocp": 448.0}


@dataclasses.dataclass(frozen=True)
class ArchInfo:
    """Facts of one target. ``cu_count`` is the flagship part's (MI300X / MI355X): the emulator
    uses it as its stand-in; on a GPU the real count comes from the device's properties."""

    name: str
    product: str
    fp8_format: str  # "fnuz" | "ocp" (CDNA3 ISA guide §7.2, CDNA4 §7.3)
    cu_count: int  # MI300X data sheet 304, MI355X data sheet 256
    #: bytes a CU's workgroups can share: CDNA3 white paper 64 KiB, CDNA4 white paper 160 KiB
    lds_per_cu: int
    lds_per_workgroup: int  # bytes one workgroup may allocate (both: all of the CU's LDS; LLVM's LDS-size tests)
    lds_granule: int  # bytes LDS is allocated in (LLVM getLdsDwGranularity: 128 / 320 dwords)
    #: 4-byte banks: CDNA3 32 (CDNA3 ISA guide, LDS chapter), CDNA4 64 (CDNA4 white paper; measured
    #: on MI350X, see pa_tile.emu.memory's bank-conflict notes)
    lds_banks: int
    wave_size: int = 64  # wave64 only (CDNA has no wave32)
    simds_per_cu: int = 4  # CDNA3/CDNA4 white papers: 4 SIMD units per CU
    max_waves_per_simd: int = 8  # LLVM AMDGPU getMaxWavesPerEU for gfx90a and later
    vgprs_per_lane: int = 512  # VGPR + AGPR, one unified file on gfx90a and later (LLVM AMDGPUUsage)
    vgpr_granule: int = 8  # LLVM getVGPRAllocGranule (gfx90a and later, wave64)
    sgprs_per_simd: int = 800  # LLVM getTotalNumSGPRs (GFX8 and later)
    sgpr_granule: int = 16  # LLVM getSGPRAllocGranule (GFX8 and later)
    max_workgroups_per_cu: int = 16  # barrier slots (LLVM getMaxWorkGroupsPerCU)

    @property
    def fp8_max(self) -> float:
        return FP8_MAX_BY_FORMAT[self.fp8_format]

    @property
    def fp8_torch_name(self) -> str:
        return "float8_e4m3fnuz" if self.fp8_format == "fnuz" else "float8_e4m3fn"


INFO: Dict[str, ArchInfo] = {
    "gfx942": ArchInfo("gfx942", "MI300X", "fnuz", cu_count=304, lds_per_cu=64 * 1024,
                       lds_per_workgroup=64 * 1024, lds_granule=512, lds_banks=32),
    "gfx950": ArchInfo("gfx950", "MI355X", "ocp", cu_count=256, lds_per_cu=160 * 1024,
                       lds_per_workgroup=160 * 1024, lds_granule=1280, lds_banks=64),
}

#: the archs pa_tile compiles for, in a stable order
ARCHS: Tuple[str, ...] = tuple(INFO)


def check_arch(arch, name: str = "arch") -> str:
    """``arch`` itself if it is a supported target name; a named TypeError/ValueError otherwise.
    A device's full name such as ``gfx942:sramecc+:xnack-`` is accepted and shortened."""
    if not isinstance(arch, str):
        raise TypeError(f"{name}: expected a str such as 'gfx942', got {type(arch).__name__}")
    short = arch.split(":", 1)[0]
    if short not in INFO:
        raise ValueError(f"{name}: expected one of {list(ARCHS)}, got {arch!r}")
    return short


def info(arch: str) -> ArchInfo:
    return INFO[check_arch(arch)]


def fp8_format(arch: str) -> str:
    """``"fnuz"`` (gfx942) or ``"ocp"`` (gfx950): how the arch's fp8 instructions read e4m3."""
    return info(arch).fp8_format


def fp8_max(arch: str) -> float:
    """Largest finite e4m3 magnitude on ``arch``: 240 (FNUZ) or 448 (OCP)."""
    return info(arch).fp8_max


def fp8_torch_dtype(arch: str):
    """The torch dtype whose codes ``arch`` decodes as e4m3."""
    dtype = _FP8_DTYPES.get(arch)
    if dtype is None:
        import torch

        dtype = _FP8_DTYPES[arch] = getattr(torch, info(arch).fp8_torch_name)
    return dtype


_FP8_DTYPES: Dict[str, object] = {}


def arch_of_fp8_dtype(dtype) -> str:
    """The arch whose fp8 flavour is the torch dtype ``dtype``."""
    for name, a in INFO.items():
        if str(dtype) == f"torch.{a.fp8_torch_name}":
            return name
    raise TypeError(f"dtype: expected torch.float8_e4m3fnuz or torch.float8_e4m3fn, got {dtype}")
