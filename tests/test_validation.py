"""The timing model against a `pa_tile bench` results file (pa_tile.perf.validation, `pa_tile validate`).

The results files here are FIXTURES built by the tests: their times are arbitrary numbers chosen
to exercise the plumbing (or the model's own prediction scaled), never presented as measurements."""

import json

import pytest

from pa_tile import backend
from pa_tile.__main__ import main
from pa_tile.perf import bench, hw, model, validation
from pa_tile.perf.roofline import DecodeShape


def _results(records, gpu_name="AMD Instinct MI308X", arch="gfx942", cus=80):
    return dict(schema=bench.SCHEMA, arch=arch, results=records,
                machine=dict(gpu_name=gpu_name, arch=arch, compute_units=cus), peak={}, settings={})


def _record(stage, shape, time_us, status="ok", kind="stage"):
    return dict(impl=stage, kind=kind, shape=shape.to_dict(), label=shape.label, status=status, time_us=time_us)


SMALL = DecodeShape(batch=2, context=512, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)


class _Stub:
    """A predictor that answers 100 us x batch and counts the calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, stage, shape, hwc, cache):
        self.calls.append((stage, shape.batch, hwc.name, hwc.compute_units))
        return model.Prediction(hwc.name, shape.to_dict(), 100.0 * shape.batch, 1.0, "issue (valu_issue)", {},
                                dict(latency_exposures_per_tile=1.0))


def test_spearman_ranks_and_ties():
    assert validation.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert validation.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert validation.spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)
    assert validation.spearman([1.0], [2.0]) != validation.spearman([1.0], [2.0])  # nan: too few


def test_the_model_hardware_follows_the_recorded_device():
    h, note = validation.model_hardware(_results([]))
    assert h.name == "MI308X" and "matched" in note
    h, _ = validation.model_hardware(_results([], gpu_name="AMD Instinct MI300X", cus=304))
    assert h.name == "MI300X" and h.compute_units == 304
    h, note = validation.model_hardware(_results([], gpu_name="AMD Instinct MI325X", cus=304))
    assert h.name == "MI300X" and "ASSUMED from arch gfx942" in note
    h, note = validation.model_hardware(_results([], gpu_name="AMD Instinct MI300X", cus=38))
    assert h.compute_units == 38 and "38 CUs as recorded" in note  # a partitioned device keeps its own count
    h, _ = validation.model_hardware(_results([], gpu_name="AMD Instinct MI355X", arch="gfx950", cus=256))
    assert h.name == "MI355X"
    with pytest.raises(ValueError, match="results"):
        validation.model_hardware(dict(machine={}, results=[]))


def test_only_timed_stages_are_compared_and_errors_are_predicted_over_measured():
    recs = [_record("s6", SMALL, 250.0), _record("s6", DecodeShape(**{**SMALL.to_dict(), "batch": 4}), 380.0),
            _record("s5", SMALL, 200.0, status="check_failed"), _record("torch_baseline", SMALL, 900.0, kind="baseline"),
            _record("s4", SMALL, 150.0)]
    stub = _Stub()
    rows = validation.compare(_results(recs), predictor=stub)
    assert [(r.stage, r.measured_us, r.predicted_us) for r in rows] == [("s6", 250.0, 200.0), ("s6", 380.0, 400.0),
                                                                        ("s4", 150.0, 200.0)]
    assert [round(r.error, 3) for r in rows] == [-0.2, 0.053, 0.333]
    assert all(c[2:] == ("MI308X", 80) for c in stub.calls)
    s = validation.summary(rows)
    assert (s["points"], s["within"]) == (3, 1) and s["median_abs_err"] == pytest.approx(0.2)
    assert s["worst_abs_err"] == pytest.approx(1 / 3) and s["spearman"] == pytest.approx(3 ** 0.5 / 2)  # ranks (1.5, 3, 1.5) against (2, 3, 1)
    assert [r.stage for r in validation.compare(_results(recs), stages=["s4"], predictor=_Stub())] == ["s4"]
    text = validation.format_comparison(rows)
    assert "PREDICTED µs" in text and "measured µs" in text and "1/3 predictions within 15%" in text
    fig = validation.plot(rows)
    ax = fig.axes[0]
    assert "MEASURED" in ax.get_xlabel() and "PREDICTED" in ax.get_ylabel()
    assert validation.summary([])["points"] == 0


def test_validate_predicts_each_timed_stage_with_the_model(tmp_path, capsys):
    if backend.gpu_available():
        pytest.skip("the command switches this process to the emulator")
    backend.set_backend("emu")
    smp = model.sample_stage("s6", SMALL, "gfx942")
    expected = model.predict_stage("s6", SMALL, hw.HARDWARE["mi308x"], sample=smp).predicted_us
    path = tmp_path / "bench.json"
    # the fixture's "measured" time is the model's own prediction x 1.1: a plumbing check, not a timing
    path.write_text(json.dumps(_results([_record("s6", SMALL, 1.1 * expected)])))
    out_json = tmp_path / "rows.json"
    assert main(["validate", str(path), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "within_15=1/1 median_abs_err=0.0909"
    assert "PREDICTED by pa_tile.perf.model" in out and "MI308X" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert rows[0]["predicted_us"] == pytest.approx(expected) and rows[0]["error"] == pytest.approx(1 / 1.1 - 1)


def test_what_reads_the_emulators_records_says_how_to_get_there_from_a_gpu(capsys):
    """The model's samples and the memory traces need the emulator; on a (simulated) GPU they
    refuse with the way out, and the command line exits 2 with that sentence (no traceback)."""
    from pa_tile.perf import tracing

    with backend.simulate_gpu("gfx942"):
        with pytest.raises(backend.BackendError, match="simulated GPU.*without PA_TILE_SIMULATE_GPU"):
            model.sample_stage("s6", SMALL, "gfx942")
        with pytest.raises(backend.BackendError, match="memory-access trace needs the emulator backend"):
            tracing.trace_stage("s2")
        assert main(["predict", "--stage", "s6", "--batch", "2", "--context", "512", "--q-heads", "8",
                     "--kv-heads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pa_tile predict: error:") and "PA_TILE_BACKEND=emu" in err and "Traceback" not in err
