"""A stage's PREDICTED speedup over the stage before it: the closing cell of each stage chapter.

The timing model's figures (``pa_tile.perf.model``), never a measurement: each stage is sampled in
the emulator, predicted on MI300X and MI355X at a shape, and set beside the previous stage on the
same shape, with the model's validation error (``pa_tile/data/model_validation.json``) and its
caution where a prediction lies outside the regime it was calibrated on.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from . import model
from .roofline import DecodeShape

__all__ = ["HEADLINE", "GPUS", "Step", "predicted_steps", "format_steps", "report"]

#: the shape every chapter is predicted at: batch 16 x 16384 tokens, 8 query heads over one KV
#: head, head_dim 128 (upstream's seed kernel has a quoted MI308X time there; chapter 09 uses it)
HEADLINE = DecodeShape(batch=16, context=16384, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
#: (label, model hardware, arch)
GPUS: Tuple[Tuple[str, str, str], ...] = (("MI300X", "mi300x", "gfx942"), ("MI355X", "mi355x", "gfx950"))
#: the emulator sample's two contexts (whole tiles, one sequence): short, as chapter 09 takes them
SAMPLE_CONTEXTS = (256, 512)


@dataclasses.dataclass
class Step:
    gpu: str
    shape: str
    stage: str
    us: float
    previous: Optional[str] = None
    previous_us: Optional[float] = None
    bound: str = ""
    serial_latencies: float = 0.0
    #: (stage, memory latencies per tile in series) of either prediction outside the model's
    #: calibrated regime (``model.calibration_note``)
    flagged: Tuple[Tuple[str, float], ...] = ()

    @property
    def speedup(self) -> Optional[float]:
        return self.previous_us / self.us if self.previous_us else None


_SAMPLES: Dict[tuple, model.Sample] = {}


def _predict(stage: str, shape: DecodeShape, hw: str, arch: str) -> model.Prediction:
    key = (stage, arch, shape.group, shape.query_length, shape.head_dim, shape.scales)
    if key not in _SAMPLES:  # one sample per kernel configuration, reused across shapes
        _SAMPLES[key] = model.sample_stage(stage, shape, arch, contexts=SAMPLE_CONTEXTS)
    return model.predict_stage(stage, shape, hw, sample=_SAMPLES[key])


def predicted_steps(stage: str, previous: Optional[str] = None,
                    shapes: Sequence[DecodeShape] = (HEADLINE,)) -> List[Step]:
    """``stage`` (and ``previous``, if given) predicted on every GPU of :data:`GPUS` at each shape."""
    out = []
    for shape in shapes:
        for label, hw, arch in GPUS:
            p = _predict(stage, shape, hw, arch)
            q = _predict(previous, shape, hw, arch) if previous else None
            flagged = tuple((name, x.details["latency_exposures_per_tile"]) for name, x in ((stage, p), (previous, q))
                            if x is not None and model.outside_calibration(x.bound, x.details["latency_exposures_per_tile"]))
            out.append(Step(label, shape.label, stage, p.predicted_us, previous, q.predicted_us if q else None,
                            p.bound, p.details["latency_exposures_per_tile"], flagged))
    return out


def _validation_line() -> str:
    s = model.validation_summary()
    if not s:
        return "model validation: no report found (scripts/validate_model.py writes it)"
    return (f"model error against {s['points']} quoted MI308X times: held out {s['held_within_15']}/{s['held_out']} "
            f"within 15 % (median {s['held_median_abs_err']:.0%}); the earliest versions' {s['fresh_within_15']}/"
            f"{s['fresh_points']}; target {s['verdict']} (pa_tile/data/model_validation.md)")


def format_steps(steps: Sequence[Step]) -> str:
    from ._table import format_rows

    rows = []
    for st in steps:
        row = {"shape": st.shape, "GPU": st.gpu, f"{st.stage} µs (PREDICTED)": f"{st.us:.0f}"}
        if st.previous:
            row[f"{st.previous} µs (PREDICTED)"] = f"{st.previous_us:.0f}"
            row[f"{st.stage} vs {st.previous}"] = f"{st.speedup:.2f}x"
        row.update({"bound": st.bound, "serial lat/tile": f"{st.serial_latencies:.1f}"})
        rows.append(row)
    lines = ["PREDICTED by pa_tile.perf.model (a model, not a measurement)", format_rows(rows), _validation_line()]
    lines += _cautions(steps)
    return "\n".join(lines)


def _cautions(steps: Sequence[Step]) -> List[str]:
    """One line per stage some prediction of which lies outside the calibrated regime."""
    by_stage: Dict[str, List[str]] = {}
    for st in steps:
        for name, n in st.flagged:
            by_stage.setdefault(name, []).append(f"{st.gpu} {n:.1f}")
    ser = model.latency_regime().get("serial", {})
    seen = (f"; the validation's points of that kind: {ser['within_15']}/{ser['points']} within 15 %, steps "
            f"{ser.get('steps_sign_ok', 0)}/{ser.get('steps', 0)} the right way") if ser.get("points") else ""
    return [f"CAUTION {name}: latency-bound with {', '.join(sorted(set(v)))} memory latencies per tile in series, "
            f"outside the regime the model is calibrated on (about one){seen}" for name, v in by_stage.items()]


def report(stage: str, previous: Optional[str] = None, shapes: Sequence[DecodeShape] = (HEADLINE,)) -> str:
    """The chapter's closing figure as text; on a GPU backend, why there is none (the model
    samples its kernels in the emulator)."""
    from .. import backend

    if backend.current_backend() != "emu":
        return ("skipped on a GPU: the timing model samples its kernels in the emulator (run this chapter "
                "with PA_TILE_BACKEND=emu for its predictions; chapter 09 times the stages on this GPU)")
    return format_steps(predicted_steps(stage, previous, shapes))
