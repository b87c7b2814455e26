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
# # 07 · Performance: how fast, why, and how far from the limit
#
# The previous chapters each changed the kernel for a reason: fewer barriers, wider loads,
# a pipelined loop, layouts the hardware likes. This chapter measures every stage side by side
# with the same yardsticks, in three tiers that need progressively more hardware:
#
# 1. **the roofline** (pure arithmetic): how many bytes a decode call must move, so the time
#    no kernel can beat on MI300X (5.3 TB/s) and MI355X (8 TB/s);
# 2. **the compiled code** (any machine): registers, LDS, occupancy, the main loop's
#    instructions by kind, load widths;
# 3. **the emulator trace** (any machine): bytes per load instruction, 64-byte segments per
#    wave access, LDS bank conflicts, instructions executed per 256-token tile;
# 4. **predicted time** (any machine; a MODEL, not a measurement): `pa_tile.perf.model` predicts
#    each stage's MI300X and MI355X kernel time from its compiled code and an emulator sample,
#    shown beside the model's own error against published gfx942 measurements (an MI308X's);
# 5. **timings** (a ROCm GPU only): the benchmark harness of `pa_tile.perf.bench`, which checks
#    every kernel against the reference before it times it. Without a GPU the timing section says
#    so; the predictions of tier 4 are never presented as timings.
#
# Every stage the checkout contains (`pa_tile.stages.available()`) is measured; a stage added
# later appears when the notebook is re-executed.

# %%
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from pa_tile import backend, figures, stages
from pa_tile.perf import adapters, bench, roofline, stage_metrics, validation
from pa_tile.perf._table import format_rows

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
STAGES = stages.available()
print("stages in this checkout:", ", ".join(STAGES))

# %% [markdown]
# The tooling drives a stage through `pa_tile.perf.adapters` (which layouts its caches use, how
# to compile it without running it). A stage the adapters do not know yet is reported here and
# left out, rather than stopping the chapter.

# %%
usable, missing = [], []
for name in STAGES:
    try:
        ad = adapters.get(name)
        ad.inputs(ad.make_case(ad.default_shape(batch=1, context=(17,)), "gfx942"))
        usable.append(name)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        missing.append(name)
        print(f"{name}: left out ({type(e).__name__}: {e})")
print("measured below:", ", ".join(usable))

# %% [markdown]
# ## 1 · The roofline: decode is a streaming problem
#
# A decode step reads every cached K and V token of every sequence once. Per token and KV head
# that is `2 · head_dim` fp8 bytes, and the work done with them is one dot product per query
# head in the group for K and one axpy for V: `4 · head_dim · group` flops. So a decode call does
# about `2 · group` flops per byte (16 for group 8). MI300X's ridge point (dense fp8 peak over
# HBM bandwidth) is about 490 flops per byte: decode sits 30x below it, so its time floor is
# simply **bytes moved / HBM bandwidth**. The table counts every byte once (K, V, scales, query,
# output, block tables), for the shapes upstream benchmarks (64 query heads over 8 KV heads).

# %%
spec300, spec355 = roofline.GPUS["MI300X"], roofline.GPUS["MI355X"]
print(f"MI300X: {spec300.hbm_tb_s} TB/s, ridge {spec300.ridge_flops_per_byte:.0f} flop/B;  "
      f"MI355X: {spec355.hbm_tb_s} TB/s, ridge {spec355.ridge_flops_per_byte:.0f} flop/B")
rows = roofline.table(roofline.upstream_shapes(batches=(1, 16, 256), contexts=(129, 2048, 16384)))
print(roofline.format_table(rows))

# %% [markdown]
# The floor spans five orders of magnitude over the grid (batch 1..256, context 129..16384,
# head_dim 64/128). At batch 1 a call moves 0.15 to 34 MB, at most a few microseconds at HBM
# speed: there, launch latency and the
# per-workgroup prologue (query load, final merge) dominate, not bandwidth. At batch 256 with
# 16k tokens a call moves gigabytes and only the streaming rate matters.

# %%
all_rows = roofline.table()
figures.roofline(roofline.upstream_shapes(batches=(1, 16, 256)))
plt.show()
print(f"{len(all_rows)} upstream shapes: floor from {min(r['MI355X_us'] for r in all_rows):.3g} µs (MI355X) "
      f"to {max(r['MI300X_us'] for r in all_rows):.0f} µs (MI300X); "
      f"all memory bound: {all(r['MI300X_bound'] == r['MI355X_bound'] == 'memory' for r in all_rows)}")

# %% [markdown]
# ## 2 · What the compiler produced
#
# For each stage, both archs and both page sizes, compile a group-8, head_dim-128 case (on the
# CPU; nothing runs) and read the assembly with `pa_tile.isa`: register budget (VGPR + AGPR, in
# the unified file of CDNA3/4), LDS, the waves per SIMD those allow, the instructions of the
# main loop by family, and the width of every load. `pa_tile.perf.stage_metrics` condenses it.

# %%
data = stage_metrics.collect(usable, archs=stage_metrics.ARCHS, block_sizes=stage_metrics.BLOCK_SIZES, progress=True)
for err in data["errors"]:
    print(f"not measured: {err['stage']} {err.get('arch', '')} {err['part']}: {err['error'][:200]}")
static = data["static"]
print(format_rows(
    [dict(stage=s["stage"], arch=s["arch"], block=s["block_size"], vgpr=s["vgpr"], agpr=s["agpr"],
          unified=s["vgpr_unified"], sgpr=s["sgpr"], lds=s["lds_bytes"], waves_simd=s["waves_per_simd"],
          bound_by="+".join(s["bound_by"]), loop_instr=s["loop_instructions"],
          loop_mfma=s["loop_families"].get("mfma", 0), loop_vmem=s["loop_families"].get("buffer", 0)
          + s["loop_families"].get("global", 0), loop_ds=s["loop_families"].get("ds", 0),
          loop_barrier=s["loop_families"].get("barrier", 0)) for s in static]))


# %% [markdown]
# The same numbers as pictures. Top row: the register budget, the occupancy it allows and the
# LDS a workgroup reserves. Bottom row: the main loop by instruction family, the loop's length
# in each configuration, and every load of the kernel by width (`buffer`/`global` = from HBM,
# `ds` = from LDS).

# %%
def pick(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


CONFIGS = [(a, b) for a in stage_metrics.ARCHS for b in stage_metrics.BLOCK_SIZES]
names = [s for s in usable if pick(static, stage=s)]
figures.static_facts(static, names, CONFIGS, ref=("gfx942", 16))
plt.show()

# %% [markdown]
# What the compiled code says:
#
# * **Stage 1** spends the most: the LDS softmax round trip (scores out, probabilities in,
#   transposed) costs ~22 KiB of LDS and barriers inside the loop, a main loop of ~800
#   instructions, and it reads K with 64-bit loads (`dwordx2`), because the tiled copy derived
#   from the MMA cannot do better (chapter 3).
# * **Stage 2** keeps the softmax in registers: LDS drops to the one-off merge (8.5 KiB), no
#   barrier is left in the loop, the loop shrinks to under 300 instructions, and every K/V load
#   is a 128-bit `dwordx4`. Fewer registers and less LDS give 4 waves per SIMD.
# * **Stage 3** buys latency hiding with registers: the next tile's K is in flight during the
#   current tile, which costs ~30 more VGPRs and one wave per SIMD on gfx942.
# * **Stage 4** keeps stage 3's loop on the blocked layouts (and 128 more bytes of LDS for a
#   padded, conflict-free merge table). **Stage 5**'s phase split returns to stage 2's budget:
#   ~116-124 VGPRs, 4 waves per SIMD, the shortest loop. **Stage 6** compiles stage 5's kernel plus a
#   small reduce kernel (the table shows the main one).

# %% [markdown]
# ## 3 · What the kernel does, instruction by instruction (emulator trace)
#
# Static counts do not say how the loads hit memory. The emulator runs the real compiled code
# and records every access: for each global load the active lanes' addresses (so the distinct
# 64-byte segments one wave instruction touches, and how many of those bytes are used), for each
# LDS access the bank-conflict degree (32 banks on gfx942, 64 on gfx950), and every instruction
# executed. Each stage runs on one sequence of one KV head at 1024 and at 2048 tokens; "per tile"
# figures are the difference divided by 4 tiles, so the prologue and the epilogue cancel. K and V
# loads are told apart from block-table and query loads by the tensor their addresses fall in.
# Every traced run is checked against the reference first.

# %%
trace = data["trace"]
print(format_rows(
    [dict(stage=t["stage"], arch=t["arch"], instr_per_tile=t["instructions_per_tile"],
          k_B_per_load=t["k"]["bytes_per_load"], k_segs=t["k"]["segments_per_load"], k_coal=t["k"]["coalescing"],
          v_B_per_load=t["v"]["bytes_per_load"], v_segs=t["v"]["segments_per_load"], v_coal=t["v"]["coalescing"],
          kv_B_per_tile=t["k"]["bytes_per_tile"] + t["v"]["bytes_per_tile"], lds_degree=t["lds_max_degree"],
          lds_cyc_per_tile=t["lds_conflict_cycles_per_tile"], correct=t["checks_ok"]) for t in trace],
    headers=dict(k_coal="K coalescing", v_coal="V coalescing")))
assert all(t["checks_ok"] for t in trace), "a traced run disagreed with the reference"
# every stage reads each K and V byte of a tile exactly once: 2 x 256 tokens x 128 channels
assert all(t["k"]["bytes_per_tile"] + t["v"]["bytes_per_tile"] == 2 * 256 * 128 for t in trace)

# %%
tnames = [s for s in usable if pick(trace, stage=s)]
figures.trace_facts(trace, tnames, stage_metrics.ARCHS, ref="gfx942")
plt.show()

# %% [markdown]
# What the trace says:
#
# * **Load width and coalescing.** Stage 1's K loads are 512 B per wave instruction and use
#   half of every 64-byte segment they touch (lanes 16 bytes apart read 8 bytes each), so the
#   memory system fetches each K byte's segment twice over. From stage 2 on, every K and V load
#   moves 1 KiB per instruction (64 lanes x 16 B) with every touched segment fully used: the
#   loads are as wide and as dense as the ISA allows. All stages request exactly the 64 KiB of
#   K and V a tile holds per KV head, nothing more.
# * **LDS.** Stage 1's softmax round trip hits 16-way bank conflicts inside the loop, thousands
#   of stall cycles per tile. Stages 2-4 have no LDS access in the loop; the merge after it is
#   2-way conflicted (stage 4 pads its table and makes it conflict free). Stage 5 splits P·V
#   across the waves by head_dim, so its loop shares the row max and P through LDS every tile:
#   the P slab is conflict free, the max table's write 2-way (8 cycles per tile), and stage 6
#   pays the row sums' merge through the same table once per partition.
# * **Executed work.** Stage 1 executes ~3200 wave-instructions per tile; stage 2 about 750
#   (4x less), stage 3 adds ~20% for its pipelining bookkeeping; stage 5's head_dim split adds
#   its sharing (~820, for fewer registers). Stage 6 splits a sequence into partitions of two
#   or three tiles here (its default: the model's table within the traffic cap), each with its
#   own prologue, merge and partial store, plus a reduce: about 1.4x stage 5's instructions per
#   tile at batch 1.
#   That is the price of putting more CUs on one sequence; whether it pays is a question of
#   parallelism, which only a GPU timing answers.
#
# These are the numbers `tests/test_perf_metrics.py` pins per stage and arch, so a change that
# lengthens the loop, narrows a load, breaks coalescing or adds a bank conflict fails CI
# without a GPU.

# %% [markdown]
# ### Traffic against the compulsory bytes
#
# Decode is memory-bound, so the figure that matters most is how many bytes a call loads
# against the fewest it could: each sequence's K and V for its context (rounded up to the
# 256-token tile) once per KV head, plus the query, per-token scales and one block-table entry
# per page (`pa_tile.perf.tracing.compulsory_bytes`). The emulator counts every vector and
# scalar global load of the call (all kernels of it). Batch 3 × 1027 tokens, one KV head, pages
# of 16, gfx942, each stage's default plan and partitions:

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import tracing  # noqa: E402
from pa_tile.perf.roofline import DecodeShape  # noqa: E402

TRAFFIC_CONFIGS = [(s, 1, 8) for s in ("s2", "s3", "s4") if s in usable] + [
    (s, ql, g) for s in ("s5", "s6") if s in usable for ql in (1, 4) for g in (8, 16)]
if backend.current_backend() == "emu":
    traffic = []
    for s, ql, g in TRAFFIC_CONFIGS:
        shape = DecodeShape(batch=3, context=1027, num_q_heads=g, num_kv_heads=1, head_dim=128, block_size=16,
                            query_length=ql)
        rep = tracing.trace_stage(s, shape, "gfx942")
        tr = rep.traffic()
        traffic.append(dict(stage=s, query_length=ql, group=g, loaded_MB=tr["loaded_bytes"] / 1e6,
                            x_compulsory=tr["vs_compulsory"], x_visible=tr["vs_visible"], correct=rep.check.ok))
    print(format_rows(traffic, headers=dict(x_compulsory="x compulsory", x_visible="x visible tokens")))
    assert all(t["correct"] for t in traffic)
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# Loaded bytes are each wave instruction's distinct bytes, summed over the call: 64 lanes loading
# one page id are one 4-byte request, but a byte read again by another instruction, wave or
# workgroup counts again. Every stage that reads a byte once lands below 1: the compulsory count
# rounds each context up to whole 256-token tiles, the kernels stop at the last page (1027 tokens
# are 65 pages, not 80). Against the visible tokens' bytes the finished kernel loads 1.06-1.11x:
# the last page's unused tokens, page ids, the query, and for the split (`s6` at one query token,
# group 8: two partitions) the partials the reduce reads back. Stages 3-4 prefetch K a tile ahead,
# so they load one more tile's K (1.12x). At `query_length` 4 the M-tiles of a KV head share one
# workgroup and its K/V reads (chapter 5's phase split, P·V split across the waves by head_dim):
# stage 5 alone reads K and V once at both group sizes. Stage 6 splits only within its traffic
# cap (1.05x the compulsory bytes, chapter 7): two partitions at one query token and group 8,
# whose partials the reduce reads back (1.12x the visible bytes instead of stage 5's 1.07x), and
# no split at the wider rows, where the model's fastest split would load up to 1.58x.

# %% [markdown]
# ## 4 · Predicted time (a model, not a measurement)
#
# `pa_tile.perf.model` turns what sections 2 and 3 measured into a time: it walks the main loop's
# instructions in order for one wave (issue rates, MFMA and transcendental occupancy, the
# `s_waitcnt` stalls on loads still in flight, prefetch across iterations), with the loop's
# branches taken as often as the emulator sample took them; it stacks the resident workgroups a
# CU holds (occupancy from section 2), deals the grid over the XCDs and CUs in waves, adds each
# workgroup's fixed cost, the reduce kernel of a split and the launch, and bounds it all by HBM,
# L2 and Infinity Cache bandwidth, with the memory latency rising as HBM fills. Every constant
# cites its source in `pa_tile.perf.hw`; three are FITTED on a third of the points below.
#
# How wrong it is, first: `scripts/validate_model.py` compiles 19 versions of the seed kernel's
# history (ROCm/FlyDSL branch `pr-825`), predicts the gfx942 times their commit messages quote
# and reports the error (`pa_tile/data/model_validation.md`). Those times were measured, the
# evidence says, on an 80-CU MI308X (the report's "Device" section), so the validation runs on
# that part; MI300X and MI355X predictions below use the same fitted constants, assuming the same
# per-CU latency and fraction of peak HBM (FlyDSL's own CI measured its streaming kernels at
# 0.66-0.70 of peak on an MI325X and 0.71-0.72 on an MI355X: that fraction roughly carries over to
# gfx950; the latency is not checked there). The six earliest versions build only with flydsl
# 0.2.2, the release of their date; their points were first predicted after the fit and the model
# were fixed, the one *fresh* test of it (9/12 within 15 %, median 5.9 %, as first predicted).
# Since then one more change was made after seeing them, to how the walk runs a loop's branches
# (chapter 5's loop showed that the old walk halved its waits; the report's "The walk's branches"), so no
# point is unseen any more. The later history (2026-07-06 to 07-20) quotes ratios, not times:
# eleven of them (four partition counts measured on one kernel; seven steps against production's
# kernel: head_dim 64, multi-token decode with per-token and per-tensor scales, two of them across
# an occupancy cliff), and three head_dim-64 multi-token times of one commit, were recorded with their shape assumptions before the current model first
# predicted them, each version built with the flydsl release of its date, which rebuilds the
# register counts their messages quote. They are the fresh test of this model. The figures:

# %%
seed_report = json.loads((ROOT / "pa_tile" / "data" / "model_validation.json").read_text())
vs = seed_report["summary"]
print(f"model validation against {vs['points']} quoted gfx942 (MI308X) times ({vs['held_out']} held out, "
      f"{vs['fit_points']} used to fit {', '.join(vs['fitted'])}):")
print(f"  held-out points within 15 %: {vs['held_within_15']}/{vs['held_out']}, median |error| "
      f"{vs['held_median_abs_err']:.0%}, worst {max(abs(r['err']) for r in seed_report['rows'] if r['role'] == 'held-out'):.0%}")
print(f"  Spearman rank correlation (held out): {vs['spearman_held']:.2f}; "
      f"before->after steps predicted in the right direction: {vs['steps_sign_ok']}/{vs['steps']}")
print(f"  fresh points only: {vs['fresh_within_15']}/{vs['fresh_points']} within 15 %, median |error| "
      f"{vs['fresh_median_abs_err']:.0%}, Spearman {vs['spearman_fresh']:.2f}, steps {vs['fresh_steps_sign_ok']}/{vs['fresh_steps']}")
reg = vs["latency_regime"]
print(f"  latency-bound loops waiting out > 1.5 memory latencies per tile in series (every fit point: "
      f"{reg['fit_exposures'][0]:.2f}-{reg['fit_exposures'][1]:.2f}): {reg['serial']['within_15']}/"
      f"{reg['serial']['points']} within 15 %, errors {', '.join(f'{e:+.0%}' for e in reg['serial']['errors'])}, "
      f"steps {reg['serial']['steps_sign_ok']}/{reg['serial']['steps']}; every other point: "
      f"{reg['calibrated']['within_15']}/{reg['calibrated']['points']}, steps "
      f"{reg['calibrated']['steps_sign_ok']}/{reg['calibrated']['steps']}")
print(f"  fresh steps of the later history: {vs['later_sign_ok']}/{vs['later_steps']} in the right direction, "
      f"{vs['later_within_15']}/{vs['later_steps']} within 15 % of the measured ratio, median |ratio error| "
      f"{vs['later_median_ratio_err']:.0%}; quoted register counts rebuilt: {vs['later_vgpr_match']}/{vs['later_vgpr_checks']}")
folds = [f for _, f in sorted(vs["folds"].items())]
within = ", ".join(str(f["held_within_15"]) for f in folds)
steps_right = ", ".join(str(f["steps_sign_ok"]) for f in folds)
latencies = ", ".join(f"{f['fitted']['mem_latency_cycles']:.0f}" for f in folds)
print(f"  the same fit on each third of the points (three-fold cross-validation): held-out within 15 % "
      f"{within} of {vs['held_out']}, steps right {steps_right} of {vs['steps']}, fitted latency {latencies} cycles")
prod = next(r for r in json.loads((ROOT / "pa_tile" / "data" / "production_prediction.json").read_text())["rows"]
            if r.get("measured_us"))
print(f"  upstream's production kernel (ecbc2d6b's pa_decode_ps, b{prod['shape']['batch']} ctx{prod['shape']['context']} "
      f"block {prod['shape']['block_size']}), first predicted after all of the above: measured "
      f"{prod['measured_us'][0]}-{prod['measured_us'][1]} µs, PREDICTED {prod['predicted_us']:.0f} µs "
      f"({prod['predicted_us'] / prod['measured_us'][1] - 1:+.0%} to {prod['predicted_us'] / prod['measured_us'][0] - 1:+.0%}; "
      f"{prod['exposures']:.0f} serial latencies per partition)")
print(f"  issue 14's target (all held-out within 15 %, every step's sign, Spearman >= 0.9): {vs['verdict']}")

# %% [markdown]
# So read what follows as a model's ranking with an error bar of tens of percent, not as times:
# good enough to see which stage is several times faster, not to split two within 10 % (the
# fresh steps ranked every pair of variants the right way, and sized 5 of 14 within 15 %). The
# misses are not spread evenly: a loop that loads, waits, computes and loads again waits out
# several memory latencies per tile in series, and where that chain bounds the time the fitted
# latency (calibrated on loops that prefetch a tile ahead, one per tile) over-predicts it.
# Upstream's production kernel is such a loop (two waits a partition) and the largest miss of
# all (`scripts/predict_production.py`; the report's "Upstream's production kernel"): the model
# even ranks it behind the seed's last tile kernel, the reverse of the 1.2-1.3x its message measured. A
# per-CU cap on bytes in flight, which would charge such a loop its bytes once and its latency
# per wait, was tried and not adopted: it gains held-out points but loses step directions, and
# its four fitted constants do not agree from one third of the points to the next (the report's
# "Memory-level parallelism"). The table below gives each stage's count (`serial lat/tile`);
# `python -m pa_tile predict` prints it and warns outside the calibrated regime.
#
# The problem: upstream's shape at which the seed's last tile kernel (`ecbc2d6b`, the head of
# `pr-825`) has a quoted time (on the MI308X), batch 16 × 16384 tokens, 8 query heads over 1 KV head,
# head_dim 128. Our stages use block size 16 (upstream's test used 1024; the model counts whole
# pages, the difference is below 0.1 % of the bytes). Each stage is sampled in the emulator (one
# sequence of one KV head, one and two tiles) and predicted with its own choice of partitions.

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import model  # noqa: E402

from pa_tile.perf import speedup  # noqa: E402

PRED_SHAPE = speedup.HEADLINE  # the shape each stage chapter's closing prediction is made at
# MI308X: the part upstream's quoted time was measured on, for the like-for-like comparison
PRED_GPUS = {"MI308X": ("mi308x", "gfx942"), "MI300X": ("mi300x", "gfx942"), "MI355X": ("mi355x", "gfx950")}
predicted = {gpu: {} for gpu in PRED_GPUS}
prow = []
for name in usable:
    row = {"stage": name}
    for gpu, (hwname, arch) in PRED_GPUS.items():
        try:
            smp = model.sample_stage(name, PRED_SHAPE, arch, contexts=(256, 512))
            p = model.predict_stage(name, PRED_SHAPE, hwname, sample=smp)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row[f"{gpu} µs (PREDICTED)"] = f"n/a ({type(e).__name__})"
            continue
        predicted[gpu][name] = p.predicted_us
        row[f"{gpu} µs (PREDICTED)"] = f"{p.predicted_us:.0f}"
        row[f"{gpu} bound"] = p.bound
        row[f"{gpu} P"] = p.details["partitions"]
        row.setdefault("serial lat/tile", f"{p.details['latency_exposures_per_tile']:.1f}")
    prow.append(row)
floors = {gpu: roofline.time_floor(PRED_SHAPE, gpu).time_us for gpu in PRED_GPUS if gpu in roofline.GPUS}
up = next((r for r in seed_report["rows"] if r["commit"].startswith("ecbc2d6b") and r["batch"] == 16), None)
print(f"PREDICTED by pa_tile.perf.model (not measured): {PRED_SHAPE.label}")
print(format_rows(prow))
print("HBM floor (roofline): " + ", ".join(f"{g} {v:.1f} µs" for g, v in floors.items()))
if up:
    print(f"upstream tile kernel ecbc2d6b (pr-825 head) on the MI308X: measured {up['measured_us']:g} µs (quoted in "
          f"its commit), PREDICTED {up['predicted_us']:.0f} µs by the same model ({up['err']:+.0%}, a {up['role']} point)")

# %%
refs = {}
if up:
    refs[f"upstream tile kernel ecbc2d6b, MI308X: measured {up['measured_us']:g} µs"] = up["measured_us"]
    refs[f"upstream tile kernel ecbc2d6b, MI308X: PREDICTED {up['predicted_us']:.0f} µs"] = up["predicted_us"]
names = [n for n in usable if any(n in predicted[g] for g in PRED_GPUS)]
fig = figures.stage_predictions(
    names, {f"{gpu} (PREDICTED)": [predicted[gpu].get(n) for n in names] for gpu in PRED_GPUS},
    title=f"PREDICTED kernel time per stage (pa_tile.perf.model, not measured): {PRED_SHAPE.label}",
    references=refs,
    note=(f"model error vs MI308X measurements (held out): median {vs['held_median_abs_err']:.0%}, "
          f"{vs['held_within_15']}/{vs['held_out']} within 15 %; target {vs['verdict']}. "
          "Upstream's kernel has no MI355X prediction: its code was compiled for gfx942 only."))
plt.show()

# %% [markdown]
# What the model says, in its own terms (the table's `bound` column): every stage is limited by
# memory latency per wave, not by HBM bandwidth. At 16 sequences × 1 KV head the unsplit stages
# run 16 workgroups on 304 (256) CUs, each walking 64 tiles in turn, so the time is one
# workgroup's latency chain; stage 6's split (16 to 22 partitions of 3-4 tiles here, column `P`)
# spreads the work over the machine, which is where nearly all of its predicted gain comes from.
# Stage 1's tile-API loads and LDS round trips make it the slowest by a wide margin, though it
# waits out about five latencies per tile, outside the calibrated regime, so its bar is likely
# too tall (the errors of that regime are printed above). Stages 2 to 6 wait out one a tile, the
# regime the model is calibrated on; stage 5 ties stage 4 because it issues V with K (chapter 5,
# "When to load V": with V after the scores it waited out two and was predicted 1.7x slower).
# Against upstream's tile kernel on the same work, compare the MI308X bars (the part its time was
# measured on), prediction with prediction: the model lands within a few percent of upstream's
# measured time there (printed above; that point is one of the fit points), and it puts stage 6,
# with the 16 partitions it would choose on that 80-CU part, about a third below upstream's
# predicted time (39 against 58 µs). That is a model's ranking inside its own error bar, not a
# win: neither bar is a measurement of ours.
#
# ## 5 · Timings (ROCm GPU only)
#
# On a machine with a ROCm GPU this cell runs the benchmark harness (`python -m pa_tile bench`,
# the real code path: graph replay, GPU events, cold cache, min of N, each kernel checked against
# the reference first, compared with a plain PyTorch baseline and any installed paged-attention
# kernels) and writes `results/bench-<gpu>-<time>.json`. Elsewhere it says that timings need a GPU
# and times nothing.

# %% tags=["nbval-ignore-output"]
results_dir = ROOT / "results"
if backend.gpu_available():
    results_dir.mkdir(exist_ok=True)
    info = bench.machine_info()
    tag = (info["gpu_name"] or "gpu").replace(" ", "_") + "-" + info["time_utc"].replace(":", "")
    out_file = results_dir / f"bench-{tag}.json"
    env = dict(os.environ, PA_TILE_BACKEND="gpu")
    cmd = [sys.executable, "-m", "pa_tile", "bench", "--shapes", "quick", "--stages", ",".join(usable),
           "--out", str(out_file)]
    print(" ".join(cmd))
    subprocess.run(cmd, env=env, check=False)
else:
    why = "torch is not a ROCm build" if not getattr(__import__("torch").version, "hip", None) else "no GPU is visible"
    print(f"No ROCm GPU here ({why}): timings need a GPU, so nothing is timed. "
          "Sections 1-3 above are what this machine can measure.")

# %% [markdown]
# Recorded results: every `results/bench-*.json` written by a real run of the harness (on this
# machine or committed from one) is shown below with its plots, and beside them the timing
# model's prediction of every stage it timed, at the same shape on the same device
# (`python -m pa_tile validate FILE`, `pa_tile.perf.validation`): the first test of the model
# against pa_tile's own kernels on hardware. If there is no file, there is nothing to show; no
# figure is ever made up.

# %% tags=["nbval-ignore-output"]
files = sorted(glob.glob(str(results_dir / "bench-*.json")))
if not files:
    print("no recorded hardware results (results/bench-*.json): run the harness on an MI300/MI355 "
          "with `python -m pa_tile bench --out results/bench-<gpu>.json`")
for f in files:
    try:
        res = bench.load_results(f)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"{f}: skipped ({e})")
        continue
    print(Path(f).name)
    print(bench.format_results(res))
    fig, axs = plt.subplots(1, 3, figsize=(19, 4.5))
    bench.plot_time(res, head_dim=128, ax=axs[0])
    bench.plot_bandwidth(res, head_dim=128, ax=axs[1])
    # the model beside these timings, predicted in a process of its own: the model samples its
    # kernels in the emulator, which a process that launched on the GPU cannot switch to
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "PA_TILE_SIMULATE_GPU"}
        run = subprocess.run([sys.executable, "-m", "pa_tile", "validate", f, "--json", f"{tmp}/rows.json"],
                             env=dict(env, PA_TILE_BACKEND="emu"), capture_output=True, text=True)
        print(run.stdout if run.returncode == 0 else f"pa_tile validate failed: {run.stderr.strip()[-400:]}")
        if run.returncode == 0:
            rows = json.loads(Path(tmp, "rows.json").read_text())["rows"]
            validation.plot([validation.Comparison.from_dict(r) for r in rows], ax=axs[2])
    plt.show()

# %% [markdown]
# ## Summary
#
# | tier | needs | what it shows |
# |---|---|---|
# | roofline | nothing | decode is memory bound at every upstream shape; floor = bytes / HBM bandwidth |
# | compiled code | CPU toolchain | registers, LDS, occupancy, loop length, load widths per stage |
# | emulator trace | CPU | K/V loads 1 KiB per instruction and fully coalesced from stage 2 on; LDS conflicts gone from the loop; instructions per tile |
# | predicted time | CPU | a MODEL's MI300X/MI355X time per stage and for upstream's tile kernel, with its validation error (`pa_tile/data/model_validation.md`) |
# | timings | ROCm GPU | time, TB/s and % of HBM peak per stage vs PyTorch and installed kernels (`results/`) |
#
# The same measurements from the command line: `python -m pa_tile isa --stage s2 --diff s3`,
# `python -m pa_tile trace --stage s2`, `python -m pa_tile roofline`,
# `python -m pa_tile predict --stage s6 --batch 16 --context 16384` (a prediction), `python -m pa_tile bench`.
