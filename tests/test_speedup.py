"""pa_tile.perf.speedup: the stage chapters' closing predictions (a model's, labelled so)."""

import pytest

from pa_tile import backend
from pa_tile.perf import model, speedup


def _fake_prediction(us, bound="issue (valu_issue)", serial=1.0):
    return model.Prediction("MI300X", {}, us, 1.0, bound, {}, {"latency_exposures_per_tile": serial})


def test_steps_pair_each_stage_with_the_previous_on_every_gpu_and_shape(monkeypatch):
    times = {"s2": 200.0, "s3": 100.0}
    monkeypatch.setattr(speedup, "_predict", lambda stage, shape, hw, arch: _fake_prediction(
        times[stage] * (1.0 if hw == "mi300x" else 0.5) * shape.batch / 16))
    other = speedup.HEADLINE.__class__(batch=32, context=4096, num_q_heads=8, num_kv_heads=1)
    steps = speedup.predicted_steps("s3", "s2", shapes=(speedup.HEADLINE, other))
    assert [(s.shape, s.gpu) for s in steps] == [(sh.label, g) for sh in (speedup.HEADLINE, other)
                                                 for g, _, _ in speedup.GPUS]
    assert all(s.speedup == pytest.approx(2.0) for s in steps)
    text = speedup.format_steps(steps)
    assert text.startswith("PREDICTED") and "s3 vs s2" in text and "2.00x" in text
    assert "held out" in text and "the earliest versions'" in text  # the validation error beside it


def test_a_prediction_outside_the_calibration_carries_its_caution(monkeypatch):
    monkeypatch.setattr(speedup, "_predict", lambda stage, shape, hw, arch: _fake_prediction(
        500.0, bound="memory latency (per-wave)", serial=5.0))
    steps = speedup.predicted_steps("s1")
    assert steps[0].previous is None and steps[0].speedup is None
    assert steps[0].flagged == (("s1", 5.0),)
    assert "CAUTION s1: latency-bound with MI300X 5.0" in speedup.format_steps(steps)


def test_on_a_gpu_backend_the_report_says_why_there_is_none(monkeypatch):
    monkeypatch.setattr(backend, "current_backend", lambda: "gpu")
    assert speedup.report("s3", "s2").startswith("skipped on a GPU")


@pytest.mark.slow
def test_a_real_step_is_predicted_from_emulator_samples_taken_once():
    if backend.current_backend() != "emu":
        pytest.skip("the model samples its kernels in the emulator")
    shape = speedup.HEADLINE.__class__(batch=2, context=1024, num_q_heads=8, num_kv_heads=1, head_dim=128,
                                       block_size=16)
    steps = speedup.predicted_steps("s4", "s3", shapes=(shape,))
    assert len(steps) == len(speedup.GPUS)
    assert all(st.us > 0 and st.previous_us > 0 and st.speedup > 0 for st in steps)
    taken = dict(speedup._SAMPLES)
    again = speedup.predicted_steps("s4", "s3", shapes=(shape,))
    assert speedup._SAMPLES == taken  # one sample per kernel configuration
    assert [s.us for s in again] == [s.us for s in steps]  # deterministic
