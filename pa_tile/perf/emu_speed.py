"""How fast the emulator runs a real kernel: ``python -m pa_tile.perf.emu_speed``.

Launches the stage-2 kernel (``pa_tile.stages.s2_register_softmax.paged_decode``) through
FlyDSL's normal launcher into the emulator, by default on 3 sequences x 8 query heads (1 KV
head), context 1027, head_dim 128, block 16 -- for gfx942 and gfx950 -- and reports

* ``wall_s``: wall time of one launch after a warm-up call (which compiles; the compile and
  first-launch time is reported as ``first_call_s``), best of ``repeat``, without a trace;
* ``instructions``: dynamic wave instructions executed (the sum of a ``Trace``'s counts, from
  one extra traced launch; an instruction counts once per wave, not per lane);
* ``instructions_per_s`` = instructions / wall_s;
* ``max_abs_err`` against the float32 reference and ``ok`` (within stage 2's tolerance).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from pa_tile.arch import ARCHS, fp8_format

HEAD_DIM = 128


@dataclass
class BenchResult:
    arch: str
    shape: str
    workgroups: int
    first_call_s: float
    wall_s: float
    instructions: int
    instructions_per_s: float
    max_abs_err: float
    ok: bool


def make_case(arch: str, num_seqs: int = 3, num_q_heads: int = 8, context: int = 1027, block_size: int = 16,
              seed: int = 0):
    import torch

    from pa_tile import cache

    return cache.make_case(num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=1, head_dim=HEAD_DIM,
                           block_size=block_size, context_lengths=context, fp8_format=fp8_format(arch),
                           scales="per-tensor", seed=seed, query_dtype=torch.float16)


def run(arch: str = "gfx942", num_seqs: int = 3, num_q_heads: int = 8, context: int = 1027, block_size: int = 16,
        *, repeat: int = 1, seed: int = 0) -> BenchResult:
    """Benchmark one shape on one arch in the emulator (see the module docstring)."""
    import torch

    from pa_tile import backend
    from pa_tile.stages import s2_register_softmax as s2
    from pa_tile.reference import within_bound

    from pa_tile.emu import launch
    from pa_tile.emu.memory import Trace

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if backend.current_backend() != "emu":
        raise RuntimeError("the emulator benchmark needs the emu backend (PA_TILE_BACKEND=emu or set_backend('emu'))")
    case = make_case(arch, num_seqs, num_q_heads, context, block_size, seed)
    args = (case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)

    t0 = time.perf_counter()
    with launch.record_launches() as log:
        out = s2.paged_decode(*args, arch=arch)
    first = time.perf_counter() - t0
    workgroups = sum(x.grid[0] * x.grid[1] * x.grid[2] for x in log)

    walls = []
    for _ in range(max(1, int(repeat))):
        t0 = time.perf_counter()
        s2.paged_decode(*args, out=out, arch=arch)
        walls.append(time.perf_counter() - t0)
    wall = min(walls)

    trace = Trace(arch)
    with launch.launch_options(trace=trace):
        s2.paged_decode(*args, out=out, arch=arch)
    instructions = sum(trace.counts.values())

    ref, bound = case.error_bound(out_dtype=out.dtype)  # pa_tile.reference.fp8_error_bound
    ok, _ = within_bound(out, ref, bound)
    err = (out.float().cpu() - ref).abs()
    return BenchResult(arch=arch, shape=f"{num_seqs}x{num_q_heads}x{context} (1 KV head, d={HEAD_DIM}, "
                       f"block {block_size})", workgroups=workgroups, first_call_s=first, wall_s=wall,
                       instructions=instructions, instructions_per_s=instructions / wall if wall > 0 else 0.0,
                       max_abs_err=float(err.max()), ok=ok)


def format_results(results: Sequence[BenchResult]) -> str:
    from pa_tile.emu.memory import format_table

    rows = [dict(arch=r.arch, shape=r.shape, workgroups=r.workgroups, first_call_s=r.first_call_s,
                 wall_s=r.wall_s, instructions=r.instructions, minstr_per_s=r.instructions_per_s / 1e6,
                 max_abs_err=r.max_abs_err, ok="PASS" if r.ok else "FAIL") for r in results]
    return format_table(rows, floatfmt=".3f")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pa_tile.perf.emu_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--seqs", type=int, default=3)
    p.add_argument("--heads", type=int, default=8, help="query heads (one KV head)")
    p.add_argument("--context", type=int, default=1027)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="timed launches per arch (the best is reported)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)

    from pa_tile import backend

    backend.set_backend("emu")
    results: List[BenchResult] = [run(a, args.seqs, args.heads, args.context, args.block_size, repeat=args.repeat)
                                  for a in args.arch]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(format_results(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
