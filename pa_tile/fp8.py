"""fp8 e4m3 codes as torch sees them: the two flavours' dtypes and maxima, decoding.

Below both ``pa_tile.cache`` (which builds quantized caches) and ``pa_tile.reference`` (which
decodes them), so neither imports the other for these. Which flavour an arch reads:
``pa_tile.arch``.
"""

from __future__ import annotations

from typing import Optional

import torch

from pa_tile.arch import FP8_MAX_BY_FORMAT

__all__ = ["FP8_DTYPES", "FP8_MAX", "fp8_dtype", "fp8_format_of", "fp8_decode", "check_fmt", "codes_format"]

FP8_DTYPES = {"fnuz": torch.float8_e4m3fnuz, "ocp": torch.float8_e4m3fn}
# Largest finite magnitudes. FNUZ's exponent bias is 8 (OCP: 7), so its top code is
# 2^7 * 1.875 = 240; OCP reserves mantissa 0b111 of the top exponent for NaN: 2^8 * 1.75 = 448.
FP8_MAX = dict(FP8_MAX_BY_FORMAT)


def check_fmt(fmt, name="fmt") -> str:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"{name}: fp8 format must be 'fnuz' or 'ocp', got {fmt!r}")
    return fmt


def fp8_dtype(fmt: str) -> torch.dtype:
    """torch dtype for an fp8 e4m3 format: 'fnuz' (gfx942) or 'ocp' (gfx950)."""
    return FP8_DTYPES[check_fmt(fmt)]


def fp8_format_of(dtype: torch.dtype) -> str:
    """Inverse of ``fp8_dtype``; TypeError for a dtype that is not an e4m3 fp8 dtype."""
    for fmt, dt in FP8_DTYPES.items():
        if dt == dtype:
            return fmt
    raise TypeError(f"dtype: expected torch.float8_e4m3fnuz or torch.float8_e4m3fn, got {dtype}")


def codes_format(codes: torch.Tensor, fmt: Optional[str], name: str) -> str:
    """Resolve the fp8 format of ``codes`` (fp8 dtype, or uint8 plus an explicit fmt)."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype == torch.uint8:
        if fmt is None:
            raise ValueError(f"{name}: uint8 fp8 codes need an explicit fp8 format ('fnuz' or 'ocp')")
        return check_fmt(fmt)
    if codes.dtype in FP8_DTYPES.values():
        own = fp8_format_of(codes.dtype)
        if fmt is not None and check_fmt(fmt) != own:
            raise ValueError(f"{name}: dtype {codes.dtype} is fp8 format {own!r}, but format {fmt!r} was given")
        return own
    raise TypeError(f"{name}: expected fp8 e4m3 codes (float8_e4m3fnuz, float8_e4m3fn or uint8), got {codes.dtype}")


def fp8_decode(codes: torch.Tensor, fmt: Optional[str] = None) -> torch.Tensor:
    """Decode fp8 e4m3 codes to float32 (NaN codes decode to NaN).

    ``codes``: any shape, dtype float8_e4m3fnuz / float8_e4m3fn, or uint8 with ``fmt``.
    """
    fmt = codes_format(codes, fmt, "codes")
    if codes.dtype == torch.uint8:
        codes = codes.view(FP8_DTYPES[fmt])
    return codes.to(torch.float32)
