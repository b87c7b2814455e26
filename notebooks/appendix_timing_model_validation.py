# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -all
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Appendix · Validating the timing model
#
# Chapter 09 ([Performance](09_performance.ipynb)) predicts every stage's time with
# `pa_tile.perf.model` and labels each figure PREDICTED. This appendix says how far to trust those
# predictions: what the model is checked against, how it scores, where it misses and why, and
# what was tried and dropped. It reads the committed reports (`pa_tile/data/model_validation.json`
# and `.md`, `pa_tile/data/production_prediction.json`); it runs no kernel. Runs on the CPU in
# seconds.
#
# ## What the model is checked against
#
# `scripts/validate_model.py` compiles the versions of the seed kernel's history (ROCm/FlyDSL
# branch `pr-825`) that its commit messages quote gfx942 times for, predicts those times and
# reports the error (`pa_tile/data/model_validation.md`). The times were measured, the evidence
# says, on an 80-CU MI308X (the report's "Device" section; the data file records an MI300X), so the
# validation runs on that part. MI300X and MI355X predictions use the same fitted constants, which
# assumes the same per-CU memory latency and the same fraction of peak HBM bandwidth on those
# parts: an ASSUMPTION. The report's fit uses a third of the points; the rest are held out. The
# earliest versions build only with the flydsl release of their date, and the later history quotes
# ratios rather than times (partition counts measured on one kernel; steps against production's
# kernel); those were recorded with their shape assumptions before the current model first
# predicted them, the fresh test of it. The figures, from the committed report:

# %%
import json
from pathlib import Path

import pa_tile
from pa_tile import show

DATA = Path(pa_tile.__file__).resolve().parent / "data"
seed_report = json.loads((DATA / "model_validation.json").read_text())
vs, reg = seed_report["summary"], seed_report["summary"]["latency_regime"]
held = [r for r in seed_report["rows"] if r["role"] == "held-out"]
prod = next(r for r in json.loads((DATA / "production_prediction.json").read_text())["rows"]
            if r.get("measured_us"))
folds = [f for _, f in sorted(vs["folds"].items())]
figs = {
    "quoted gfx942 (MI308X) times": "{points}: {fit_points} fit, {held_out} held out".format(**vs),
    "fitted constants": ", ".join(vs["fitted"]),
    "held out within 15 %": f"{vs['held_within_15']}/{vs['held_out']}",
    "held out: median, worst error": f"{vs['held_median_abs_err']:.0%}, "
                                     f"{max(abs(r['err']) for r in held):.0%}",
    "held out: Spearman rank correlation": f"{vs['spearman_held']:.2f}",
    "steps predicted the right way": f"{vs['steps_sign_ok']}/{vs['steps']}",
    "fresh points within 15 % (median)": f"{vs['fresh_within_15']}/{vs['fresh_points']} "
                                         f"({vs['fresh_median_abs_err']:.0%})",
    "serial-latency loops within 15 %": "{within_15}/{points}".format(**reg["serial"])
                                        + " (errors " + ", ".join(f"{e:+.0%}" for e in reg[
                                            "serial"]["errors"]) + ")",
    "every other point within 15 %": "{within_15}/{points}".format(**reg["calibrated"]),
    "later history: right way, within 15 %": f"{vs['later_sign_ok']}/{vs['later_steps']}, "
                                             f"{vs['later_within_15']}/{vs['later_steps']}",
    "quoted register counts rebuilt": f"{vs['later_vgpr_match']}/{vs['later_vgpr_checks']}",
    "three folds: held out within 15 %": ", ".join(str(f["held_within_15"]) for f in folds),
    "three folds: fitted latency (cycles)": ", ".join(f"{f['fitted']['mem_latency_cycles']:.0f}"
                                                      for f in folds),
    "production kernel: measured, PREDICTED": "{0}-{1} µs, ".format(*prod["measured_us"])
                                              + f"{prod['predicted_us']:.0f} µs",
    "issue 14's target (all held out within 15 %, every step's sign, Spearman >= 0.9)": vs[
        "verdict"],
}
show.measured(figs, title="The timing model against the seed kernel's measured times")

# %%
reg = vs["latency_regime"]
show.md(f"""Held out, the model lands {vs["held_within_15"]} of {vs["held_out"]} points within
15 % (median {vs["held_median_abs_err"]:.0%}) and ranks them with a Spearman correlation of
{vs["spearman_held"]:.2f}; the fresh steps of the later history go the right way
{vs["later_sign_ok"]} of {vs["later_steps"]} times but are sized within 15 % only
{vs["later_within_15"]} times. So it ranks well and sizes loosely: good enough to see which
stage is several times faster, not to split two within 10 %.

The misses are not spread evenly. A loop that loads, waits, computes and loads again waits out
several memory latencies per tile in series; where that chain bounds the time, the fitted
latency (calibrated on loops that prefetch a tile ahead and wait once a tile) over-predicts it:
those points land {reg["serial"]["within_15"]} of {reg["serial"]["points"]} within 15 %, against
{reg["calibrated"]["within_15"]} of {reg["calibrated"]["points"]} for every other point.
Upstream's production kernel is such a loop (two waits a partition) and the largest miss of all
(`scripts/predict_production.py`): PREDICTED {prod["predicted_us"]:.0f} µs against a measured
{prod["measured_us"][0]}-{prod["measured_us"][1]} µs, which ranks it behind the seed's last tile
kernel, the reverse of what was measured. `python -m pa_tile predict` prints each prediction's
serial latencies per tile and warns outside the calibrated regime.""")

# %% [markdown]
# ## Tried and dropped
#
# * **A per-CU cap on bytes in flight** (memory-level parallelism), which would charge a serial loop
#   its bytes once and its latency per wait. It gains held-out points but loses step directions,
#   and its four fitted constants do not agree from one third of the points to the next (the
#   report's "Memory-level parallelism"), so it was not adopted.
# * **Walking a loop's branches half the time.** The model first took each branch of the main loop
#   with a fixed weight; the phase-split loop of chapter 05 showed that this halved its waits. The
#   walk now takes each branch as often as the emulator sample took it (the report's "The walk's
#   branches"). That change was made after seeing the earliest versions' points, so none of the
#   history is unseen by the current model any more; only the later history's ratios were recorded
#   before it predicted them.
# * **An MI300X device for the history.** The harness first predicted the quoted times on a 304-CU
#   MI300X, as the data file says; the author's other messages and the seed's own occupancy
#   arithmetic name an 80-CU MI308X, and the harness now fakes that CU count (a correction read off
#   the messages, not a fitted constant).
