"""How far a kernel's output is from the reference, and whether that is close enough.

Two numbers, both relative to the size of the reference output so they mean the same thing
at every shape (decode outputs shrink like 1/sqrt(context) for random data):

* ``max_rel`` = max |out - ref| / max |ref|: the worst element;
* ``rms_rel`` = ||out - ref||_2 / ||ref||_2: the typical element.

A non-finite value in the output fails whatever the numbers say.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

__all__ = ["Tolerance", "CheckResult", "compare"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    max_rel: float
    rms_rel: float

    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    ok: bool
    max_abs: float
    max_rel: float
    rms_rel: float
    finite: bool
    tolerance: Tolerance
    reason: Optional[str] = None

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d["tolerance"] = self.tolerance.to_dict()
        return d

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        s = (f"{verdict}: max|err| {self.max_abs:.3g}, max rel {self.max_rel:.3g} (tol {self.tolerance.max_rel:g}), "
             f"rms rel {self.rms_rel:.3g} (tol {self.tolerance.rms_rel:g})")
        return s + (f" - {self.reason}" if self.reason else "")


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> CheckResult:
    """Error metrics of ``out`` against ``ref`` (any devices/dtypes; compared in float64 on the CPU)."""
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, float("inf"), float("inf"), float("inf"), False, tol,
                           f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite = bool(torch.isfinite(o).all())
    if not finite:
        bad = int((~torch.isfinite(o)).sum())
        return CheckResult(False, float("inf"), float("inf"), float("inf"), False, tol,
                           f"{bad} non-finite output element(s)")
    err = (o - r).abs()
    scale = float(r.abs().max()) or 1.0
    max_abs = float(err.max()) if err.numel() else 0.0
    norm = float(r.norm()) or 1.0
    max_rel, rms_rel = max_abs / scale, float((o - r).norm()) / norm
    ok = max_rel <= tol.max_rel and rms_rel <= tol.rms_rel
    reason = None if ok else "error above tolerance"
    return CheckResult(ok, max_abs, max_rel, rms_rel, True, tol, reason)


def reference_output(case, *, chunk_bytes: int = 1 << 30, device=None) -> torch.Tensor:
    """``pa_tile.reference`` on a ``PagedCase``, a few sequences at a time (returned on the CPU).

    The reference dequantizes the pages it gathers to float32; chunking over sequences keeps
    that under about ``chunk_bytes`` for benchmark-sized cases. It runs on ``device`` (default:
    the case's); if that fails with a RuntimeError (e.g. a device the reference does not
    handle) it runs on CPU copies instead.
    """
    from ..reference import paged_attention_reference

    device = torch.device(device) if device is not None else case.query.device
    per_token = 2 * 4 * case.num_kv_heads * case.head_dim  # float32 K and V of one token
    lengths = [int(x) for x in case.context_lengths.tolist()]
    chunks, s0, acc = [], 0, 0
    for s, L in enumerate(lengths):
        if s > s0 and acc + L * per_token > chunk_bytes:
            chunks.append((s0, s))
            s0, acc = s, 0
        acc += L * per_token
    chunks.append((s0, len(lengths)))

    ql = case.query_length

    def run(dev):
        k, v, ks, vs = (t.to(dev) for t in (case.k_cache, case.v_cache, case.k_scale, case.v_scale))  # once
        outs = []
        for a, b in chunks:
            outs.append(paged_attention_reference(
                case.query[a * ql:b * ql].to(dev), k, v, case.block_tables[a:b].to(dev),
                case.context_lengths[a:b].to(dev), ks, vs, query_length=ql).cpu())
        return torch.cat(outs)

    if device.type == "cpu":
        return run(device)
    try:
        return run(device)
    except RuntimeError:
        return run(torch.device("cpu"))
