"""The timing model against hardware measurements.

``scripts/validate_model.py`` checks :mod:`pa_tile.perf.model` against the times quoted in the seed
kernel's history; this module checks it against the times *you* measure: every ``ok`` record of a
stage in a ``pa_tile bench`` results file (``pa_tile.perf.bench``) is predicted at its shape on the
GPU it ran on, and set beside the measurement (``python -m pa_tile validate FILE``; chapter 09 plots
it for each recorded file). Nothing here times anything, and nothing here is a measurement but the
file's own ``time_us``.

The model samples its kernels in the emulator, so :func:`compare` needs the ``emu`` backend; a
process that launched on the GPU cannot switch (``pa_tile.backend``), which is why the command line
and chapter 09 run it in a process of its own.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import hw as _hw
from .roofline import DecodeShape

__all__ = ["Comparison", "spearman", "model_hardware", "compare", "summary", "format_comparison", "plot",
           "WITHIN"]

#: the error a prediction may have and still count as right, as in the seed validation's target
WITHIN = 0.15


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank); nan for fewer than two pairs."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    n = len(xs)
    if n < 2 or len(ys) != n:
        return float("nan")
    rx, ry = ranks(list(xs)), ranks(list(ys))
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else float("nan")


def model_hardware(results: Dict) -> Tuple[_hw.Hardware, str]:
    """The model's hardware for the GPU a results file was measured on, and how it was chosen: by
    product name (``AMD Instinct MI308X`` -> the MI308X entry), else by arch (an assumption, said
    so). The device's own CU count, when recorded, replaces the entry's: the grid's waves and the
    stage's split follow it (a partitioned MI300X, an MI325X)."""
    machine = results.get("machine") or {}
    name = str(machine.get("gpu_name") or "").upper().replace(" ", "")
    arch = results.get("arch") or machine.get("arch")
    chosen = next((h for h in sorted(_hw.HARDWARE.values(), key=lambda h: -len(h.name))
                   if h.name.upper() in name), None)
    if chosen is not None:
        note = f"matched device name {machine.get('gpu_name')!r}"
    elif arch:
        chosen = _hw.hardware(arch)
        note = (f"ASSUMED from arch {arch}: device {machine.get('gpu_name')!r} is none of "
                f"{[h.name for h in _hw.HARDWARE.values()]}; predicted as an {chosen.name}")
    else:
        raise ValueError("results: the file names neither a known GPU nor an arch")
    cus = machine.get("compute_units")
    if cus and int(cus) != chosen.compute_units:
        note += f"; {cus} CUs as recorded (the {chosen.name} entry has {chosen.compute_units})"
        chosen = dataclasses.replace(chosen, compute_units=int(cus))
    return chosen, note


@dataclasses.dataclass
class Comparison:
    """One measured stage launch and the model's prediction of it."""

    stage: str
    label: str
    shape: Dict
    measured_us: float
    predicted_us: float
    floor_us: float
    bound: str
    serial_latencies: float

    @property
    def error(self) -> float:
        """predicted / measured - 1 (positive: the model is slower than the hardware)."""
        return self.predicted_us / self.measured_us - 1.0

    @property
    def outside_calibration(self) -> bool:
        from . import model

        return model.outside_calibration(self.bound, self.serial_latencies)

    def to_dict(self) -> Dict:
        return dict(dataclasses.asdict(self), error=self.error, outside_calibration=self.outside_calibration)

    @classmethod
    def from_dict(cls, d: Dict) -> "Comparison":
        """A row of ``pa_tile validate --json`` (its derived fields are recomputed, not read)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def _config_key(shape: DecodeShape) -> Tuple:
    """What an emulator sample depends on: the shape less its batch and context."""
    d = shape.to_dict()
    return tuple(sorted((k, v) for k, v in d.items() if k not in ("batch", "context")))


def compare(results: Dict, *, stages: Optional[Sequence[str]] = None,
            predictor: Optional[Callable] = None) -> List[Comparison]:
    """Every ``ok`` stage record of ``results`` (a ``pa_tile bench`` dict or file path), predicted.

    ``predictor(stage, shape, hardware, sample_cache) -> model.Prediction`` defaults to the model
    (one emulator sample per stage and configuration, reused across batches and contexts)."""
    from . import bench

    data = bench.load_results(results)
    hwc, _ = model_hardware(data)
    predictor = predictor or _predict_with_model
    cache: Dict = {}
    out = []
    for rec in data["results"]:
        if rec.get("status") != "ok" or rec.get("kind") != "stage":
            continue
        if stages is not None and rec["impl"] not in stages:
            continue
        shape = DecodeShape.from_dict(rec["shape"])
        pred = predictor(rec["impl"], shape, hwc, cache)
        out.append(Comparison(rec["impl"], rec.get("label") or shape.label, rec["shape"], float(rec["time_us"]),
                              pred.predicted_us, pred.floor_us, pred.bound,
                              float(pred.details.get("latency_exposures_per_tile", 0.0))))
    return out


def _predict_with_model(stage: str, shape: DecodeShape, hwc: _hw.Hardware, cache: Dict):
    from . import model

    key = (stage, hwc.arch, _config_key(shape))
    if key not in cache:
        cache[key] = model.sample_stage(stage, shape, hwc.arch)
    return model.predict_stage(stage, shape, hwc, sample=cache[key])


def summary(rows: Sequence[Comparison]) -> Dict:
    """How far the model is from the measurements: count within :data:`WITHIN`, median and worst
    |error|, Spearman's rank correlation of predicted against measured."""
    if not rows:
        return dict(points=0, within=0, median_abs_err=float("nan"), worst_abs_err=float("nan"),
                    spearman=float("nan"))
    errs = [abs(r.error) for r in rows]
    return dict(points=len(rows), within=sum(e <= WITHIN for e in errs), median_abs_err=statistics.median(errs),
                worst_abs_err=max(errs),
                spearman=spearman([r.predicted_us for r in rows], [r.measured_us for r in rows]))


def format_comparison(rows: Sequence[Comparison], note: str = "") -> str:
    """A table, one row per measured launch, then the summary (the model's figures labelled)."""
    from ._table import format_rows

    table = [dict(stage=r.stage, shape=r.label, measured_us=r.measured_us, predicted_us=r.predicted_us,
                  error=f"{r.error:+.0%}", bound=r.bound + (" (outside calibration)" if r.outside_calibration else ""))
             for r in rows]
    s = summary(rows)
    lines = [note] if note else []
    lines.append(format_rows(table, headers=dict(measured_us="measured µs", predicted_us="PREDICTED µs")))
    lines.append(f"{s['within']}/{s['points']} predictions within {WITHIN:.0%} of the measurement; median |error| "
                 f"{s['median_abs_err']:.1%}, worst {s['worst_abs_err']:.1%}; Spearman {s['spearman']:.3f}")
    return "\n".join(lines)


def plot(rows: Sequence[Comparison], *, title: str = "", ax=None):
    """PREDICTED against MEASURED time, log-log, one colour per stage, with the line of equality and
    the band of :data:`WITHIN` around it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 5))
    else:
        fig = ax.figure
    if rows:
        lo = min(min(r.measured_us, r.predicted_us) for r in rows) / 1.5
        hi = max(max(r.measured_us, r.predicted_us) for r in rows) * 1.5
        xs = [lo, hi]
        ax.loglog(xs, xs, "k-", lw=1, label="predicted = measured")
        ax.fill_between(xs, [x * (1 - WITHIN) for x in xs], [x * (1 + WITHIN) for x in xs], color="0.85",
                        label=f"within {WITHIN:.0%}")
        for stage in sorted({r.stage for r in rows}):
            pts = [r for r in rows if r.stage == stage]
            ax.scatter([r.measured_us for r in pts], [r.predicted_us for r in pts], s=18, label=stage, zorder=3)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 20, not 2 x 10^1
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
    ax.set_xlabel("MEASURED time per call (µs)")
    ax.set_ylabel("PREDICTED time per call (µs, pa_tile.perf.model)")
    s = summary(rows)
    ax.set_title(title or f"the model against {s['points']} measurements: {s['within']} within {WITHIN:.0%}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
