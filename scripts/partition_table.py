#!/usr/bin/env python
"""Write ``pa_tile/data/partition_table.json``: the split-K partition count the timing model
(``pa_tile.perf.model``) predicts fastest for the finished kernel (stage s6), tabulated so that
``pa_tile.stages.s6_split_k.choose_num_partitions`` can look it up at plan time without the
emulator or the model (a table the model precomputes; nothing is fitted here).

One command (CPU, the emulator backend; about 13 CPU-minutes, ``--jobs 2`` halves the wall time)::

    python scripts/partition_table.py [--out pa_tile/data/partition_table.json] [--jobs N]

Per configuration (GPU, head_dim, group, query_length; :data:`CONFIGS`) it emulates one sample of
stage s6 (``model.sample_stage``: one sequence of one KV head at two short contexts), walks its
compiled code once, then for every grid point (sequences x KV heads :data:`SEQ_HEADS`, 256-token
tiles of the longest sequence :data:`TILES`, uniform contexts, block size 16, per-tensor scales)
predicts the launch at every candidate partition count (:data:`CANDIDATES`, those that split the
tiles into distinct even shares) and keeps the fastest. A candidate must be predicted faster than
the best smaller count by more than :data:`MIN_GAIN`, so the table does not trade partials'
traffic for a predicted gain within the model's noise. Every figure in the file is a MODEL
PREDICTION for its part (MI300X 304 CUs, MI308X 80, MI355X 256); the model's validation
(pa_tile/data/model_validation.md) says how far to trust it, in particular on partition-only
changes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "pa_tile" / "data" / "partition_table.json"

#: (gpu, head_dim, group, query_length) sampled; other configurations take the nearest (s6 docs)
#: (the MI308X, gfx942 with 80 CUs and the MI300X's HBM, has 3.8x the bandwidth per CU: its own block)
CONFIGS = [(gpu, hd, g, ql) for gpu in ("mi300x", "mi308x", "mi355x")
           for hd, g, ql in [(128, 1, 1), (128, 4, 1), (128, 8, 1), (128, 16, 1), (128, 32, 1), (128, 8, 2),
                             (128, 8, 4), (128, 16, 4), (64, 8, 1), (256, 8, 1)]]
#: sequences x KV heads: 1 .. 4096, four points per octave
SEQ_HEADS = sorted({max(1, round(2 ** (k / 4))) for k in range(0, 49)})
#: 256-token tiles of the longest sequence: every count to 16, then four points per octave to 512
TILES = sorted(set(range(1, 17)) | {round(2 ** (k / 4)) for k in range(16, 37)})
#: partition counts tried (those up to the tile count, and the kernel's MAX_PARTITIONS)
CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
#: a larger count must be predicted faster by more than this fraction to be chosen
MIN_GAIN = 0.02


def _even(tiles: int, p: int) -> int:
    per = -(-tiles // p)
    return -(-tiles // per)


def _config(cfg):
    """The table block of one (gpu, head_dim, group, query_length): independent of every other."""
    from pa_tile import backend
    from pa_tile.perf import hw as hwm
    from pa_tile.perf import model
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.stages import s6_split_k as s6

    backend.set_backend("emu")
    backend.ensure_backend()
    gpu, hd, g, ql = cfg
    t0 = time.time()
    hwc = hwm.hardware(gpu)
    probe = DecodeShape(batch=1, context=1024, num_q_heads=g, num_kv_heads=1, head_dim=hd, block_size=16,
                        query_length=ql)
    smp = model.sample_stage("s6", probe, hwc.arch)
    main = model.kernel_code(smp.main_asm, hw=hwc, vmem_segments=model.vmem_segments(smp.per_tile),
                             line_counts=smp.line_per_tile or None)
    red = model.reduce_code(smp, hwc)
    best, gain = [], []
    for n in SEQ_HEADS:
        row, grow = [], []
        for t in TILES:
            shape = DecodeShape(batch=n, context=t * 256, num_q_heads=g, num_kv_heads=1, head_dim=hd,
                                block_size=16, query_length=ql)
            times = {}
            for p in sorted({_even(t, p) for p in CANDIDATES if p <= min(t, s6.MAX_PARTITIONS)}):
                times[p] = model.predict(shape=shape, hw=hwc, per_tile=smp.per_tile, fixed=smp.fixed, main=main,
                                         waves_per_workgroup=smp.waves_per_workgroup, m_groups=smp.m_groups,
                                         partitions=p, reduce=red).predicted_us
            pick = 1
            for p in sorted(times):
                if times[p] < times[pick] * (1 - MIN_GAIN):
                    pick = p
            row.append(pick)
            grow.append(round(times[1] / times[pick], 3))
        best.append(row)
        gain.append(grow)
    block = dict(gpu=gpu, arch=hwc.arch, cu_count=hwc.compute_units, head_dim=hd, group=g, query_length=ql,
                 m_groups=smp.m_groups, best=best, predicted_speedup_over_1=gain)
    return block, f"{gpu} hd{hd} g{g} ql{ql}: {time.time() - t0:.0f} s"


def build(log=print, jobs: int = 1):
    from pa_tile.perf import model

    out = dict(
        generated_by="scripts/partition_table.py", model="pa_tile.perf.model (MODEL PREDICTIONS, not measurements)",
        loaded_latency=model.LOADED_LATENCY, min_gain=MIN_GAIN, seq_heads=SEQ_HEADS, tiles=TILES,
        candidates=list(CANDIDATES), configs=[])
    with contextlib.ExitStack() as stack:
        if jobs <= 1:
            blocks = map(_config, CONFIGS)
        else:
            import multiprocessing

            # spawn: each worker builds its own FlyDSL/MLIR context instead of inheriting a forked one
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(jobs))
            blocks = pool.imap(_config, CONFIGS)  # in order: the file does not depend on --jobs
        for block, line in blocks:
            out["configs"].append(block)
            log(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--jobs", type=int, default=1, help="configurations built in parallel processes")
    args = ap.parse_args(argv)
    table = build(lambda m: print(m, file=sys.stderr, flush=True), jobs=args.jobs)
    text = json.dumps(table, separators=(",", ":"))
    # one row per line: reviewable diffs
    text = text.replace("],[", "],\n[")
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
