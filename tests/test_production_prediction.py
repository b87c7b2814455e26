"""Upstream's production kernel as the timing model predicts it (scripts/predict_production.py).

The prediction itself needs a FlyDSL checkout (the kernel is built from it at run time), so these
tests check what can be checked without one: how the harness reads upstream's work list, which
quotes it predicts at, and that the committed prediction and the validation report agree."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "pa_tile" / "data"


def _script(name):
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pp():
    return _script("predict_production")


def test_a_bins_partitions_are_the_sum_of_its_works_kv_ranges(pp):
    # 3 bins: works 0-1 (partitions 0..5 of seq 0, 0..2 of seq 1), none, work 2 (seq 1's 2..9)
    info = torch.zeros(3, 8, dtype=torch.int32)
    info[:, 4] = torch.tensor([0, 0, 2])
    info[:, 5] = torch.tensor([5, 2, 9])
    meta = dict(work_indptr=torch.tensor([0, 2, 2, 3], dtype=torch.int32), work_info_flat=info.reshape(-1))
    assert pp._bin_partitions(meta) == [7, 0, 7]


def test_it_predicts_where_upstream_quotes_the_production_kernel(pp):
    data = json.loads((DATA / "pr825_mi300x_timings.json").read_text())
    items = pp.quoted_shapes(data)
    timed = [i for i in items if i.get("measured_us")]
    assert len(timed) == 1 and timed[0]["same_version"]
    assert timed[0]["shape"]["batch"] == data["production"]["shape"]["batch"] == 128
    assert timed[0]["shape"]["block_size"] == 1024 and timed[0]["measured_us"] == [190, 214]
    reading = data["bandwidth_readings"][0]
    assert reading["quoted_in"].startswith("876bed80") and "2.85 TB/s = 54% peak" in reading["quote"]
    others = [i for i in items if not i["same_version"]]  # another version: labelled so, both blocks of the step
    assert sorted(i["shape"]["block_size"] for i in others) == [16, 64]
    assert [i["fraction_of_peak"] for i in others if i["shape"]["block_size"] == 16] == [0.54]


def test_the_committed_prediction_is_the_reports():
    pred = json.loads((DATA / "production_prediction.json").read_text())
    assert pred["sha"].startswith("ecbc2d6b") and pred["gpu"] == "mi308x"
    rows = pred["rows"]
    assert {r["layout"]["path"] for r in rows} == {"work list", "partitions"}
    assert set(pred["cap_fits"]) == {"cap, fold 0", "cap, fold 1", "cap, fold 2"}
    for r in rows:
        assert set(r["alternatives"]) == set(pred["cap_fits"])  # the cap form's folds, beside the default
        assert r["predicted_us"] >= r["floor_us"] > 0
        assert 0 < r["predicted_fraction_of_peak"] <= 1
    vm = _script("validate_model")
    report = (DATA / "model_validation.md").read_text()
    rows = json.loads((DATA / "model_validation.json").read_text())["rows"]
    section = vm._production_section(rows)
    assert any("the WRONG way round" in line for line in section)  # the tile/production gap, read as a step
    for line in vm._production_summary() + section:
        assert line in report.splitlines()  # regenerate the report after re-predicting


def test_the_cap_fits_are_the_ones_the_report_records(pp):
    report = "\n".join(_script("validate_model")._mlp_section())
    for name, f in pp.CAP_FITS.items():
        row = next(line for line in report.splitlines() if line.startswith(f"| {name[-1]} "))
        assert (f"{f['hbm_efficiency']:.2f} / {f['mem_latency_cycles']:.0f} / {f['launch_us']:g} / "
                f"{f['cu_bytes_in_flight'] / 1024:.0f} KiB") in row
