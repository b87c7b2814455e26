"""How fast the emulator runs real kernels, per engine: ``python -m pa_tile.perf.emu_speed``.

Launches pa_tile's kernels through FlyDSL's normal launcher into the emulator -- stage 2
(``pa_tile.stages.s2_register_softmax.paged_decode``) and the finished kernel (stage 6,
``pa_tile.paged_decode``: split-K decode plus its reduce) -- by default on 3 sequences x 8 query
heads (1 KV head), context 1027, head_dim 128, block 16, for gfx942 and gfx950, once with each
emulator engine (``reference``: the numpy semantics; ``fast``: the default, same bits; see
``pa_tile.emu.machine.ENGINES``), side by side in one process. ``--large`` adds the shape of
issue 39: batch 16 x 4,096 tokens, group 8 (8 query heads on 1 KV head), head_dim 128.

Per engine:

* ``wall_s``: wall time of one launch after a warm-up call (which compiles; the compile and
  first-launch time is reported as ``first_call_s``), best of ``repeat``, without a trace;
* ``instructions``: dynamic wave instructions executed (the sum of a ``Trace``'s counts, from
  one extra traced launch; an instruction counts once per wave, not per lane);
* ``instructions_per_s`` = instructions / wall_s;
* ``max_abs_err`` against the float32 reference and ``ok`` (within the stage's fp8 bound).

The comparison adds ``speedup`` (reference wall / fast wall) and ``identical``: both engines
wrote the same output bytes and the same trace (every count and memory record).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from pa_tile.arch import ARCHS, fp8_format

HEAD_DIM = 128


STAGES = ("s2", "s6")
ENGINES = ("reference", "fast")   # pa_tile.emu.machine.ENGINES, the old one first
#: today's shape (the chapters' demonstration size) and issue 39's larger one
DEFAULT_SHAPE = dict(num_seqs=3, num_q_heads=8, context=1027)
LARGE_SHAPE = dict(num_seqs=16, num_q_heads=8, context=4096)


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
    stage: str = "s2"
    engine: str = "fast"


@dataclass
class Comparison:
    """One kernel and shape on one arch, run by every engine."""

    arch: str
    stage: str
    shape: str
    results: Dict[str, BenchResult]
    identical: bool            # same output bytes and the same trace from every engine

    @property
    def speedup(self) -> float:
        r, f = self.results.get("reference"), self.results.get("fast")
        return r.wall_s / f.wall_s if r and f and f.wall_s > 0 else float("nan")


def make_case(arch: str, num_seqs: int = 3, num_q_heads: int = 8, context: int = 1027, block_size: int = 16,
              seed: int = 0):
    import torch

    from pa_tile import cache

    return cache.make_case(num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=1, head_dim=HEAD_DIM,
                           block_size=block_size, context_lengths=context, fp8_format=fp8_format(arch),
                           scales="per-tensor", seed=seed, query_dtype=torch.float16)


@contextmanager
def _engine(engine: Optional[str]):
    """Launches inside use *engine* (``$PA_TILE_EMU_ENGINE`` is read at every launch)."""
    from pa_tile.emu.machine import ENGINE_ENV, check_engine

    if engine is None:
        yield
        return
    check_engine(engine)
    old = os.environ.get(ENGINE_ENV)
    os.environ[ENGINE_ENV] = engine
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENGINE_ENV, None)
        else:
            os.environ[ENGINE_ENV] = old


#: every stage's module, and whether it reads K blocked / V transposed-blocked (stages 4-6)
_STAGE_MODULES = {"s1": ("s1_tile_qk", False), "s2": ("s2_register_softmax", False), "s3": ("s3_raw_loads", False),
                  "s4": ("s4_blocked_layouts", True), "s5": ("s5_phase_split_mtp", True),
                  "s6": ("s6_split_k", True)}


def _launcher(stage: str, case):
    """``(call, args)``: the stage's ``paged_decode`` and its arguments in that stage's layouts."""
    import importlib

    if stage not in _STAGE_MODULES:
        raise ValueError(f"stage must be one of {tuple(_STAGE_MODULES)}, got {stage!r}")
    name, blocked = _STAGE_MODULES[stage]
    mod = importlib.import_module(f"pa_tile.stages.{name}")
    k, v = (case.k_blocked(), case.v_trans_blocked()) if blocked else (case.k_cache, case.v_plain())
    return mod.paged_decode, (case.query, k, v, case.block_tables, case.context_lengths, case.k_scale,
                              case.v_scale)


def _trace_state(trace, regions=()) -> tuple:
    """Everything a trace recorded, for comparing two runs (:func:`same_trace`). Scalar loads
    carry an address: one inside a launch's tensor (*regions*: ``(base, nbytes, name)``) becomes
    ``(name, offset)``, since host code may allocate a small tensor afresh for every call."""
    def where(addr):
        for b, n, name in regions:
            if b <= addr < b + n:
                return (name, addr - b)
        return addr

    scalar = [r[:4] + (where(r[4]),) + r[5:] for r in trace.scalar_records]
    return (trace.seq, sorted(trace.counts.items()), trace.global_records, trace.lds_records, scalar)


def same_trace(a: tuple, b: tuple, launches: int) -> bool:
    """Whether two :func:`_trace_state` s of the same launches record the same thing.

    Every count and every vector (global, buffer, LDS) record must be equal. Scalar records must
    be equal but for an address outside the launch's tensors, which may differ by one constant
    per launch: each launch copies its kernarg segment to a fresh buffer
    (``machine.run_kernel``), so the ``s_load`` s of the arguments read the same offsets at
    another address. At most *launches* distinct
    nonzero differences are allowed, each only on ``s_load`` records."""
    if a[:4] != b[:4] or len(a[4]) != len(b[4]):
        return False
    deltas = set()
    for ra, rb in zip(a[4], b[4]):
        ra, rb = list(ra), list(rb)
        addr = [i for i, (x, y) in enumerate(zip(ra, rb)) if x != y]
        if not addr:
            continue
        if len(addr) != 1 or not str(ra[2]).startswith("s_load") or not isinstance(ra[addr[0]], int) \
                or not isinstance(rb[addr[0]], int):
            return False
        deltas.add(ra[addr[0]] - rb[addr[0]])
    return len(deltas) <= launches


def _check_args(arch: str, stage: str) -> None:
    from pa_tile import backend

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if stage not in _STAGE_MODULES:
        raise ValueError(f"stage must be one of {tuple(_STAGE_MODULES)}, got {stage!r}")
    if backend.current_backend() != "emu":
        raise RuntimeError("the emulator benchmark needs the emu backend (PA_TILE_BACKEND=emu or set_backend('emu'))")


def compare(arch: str = "gfx942", stage: str = "s2", num_seqs: int = 3, num_q_heads: int = 8,
            context: int = 1027, block_size: int = 16, *, engines: Sequence[str] = ENGINES, repeat: int = 1,
            seed: int = 0) -> Comparison:
    """Run one kernel and shape with every engine in *engines*, in this process, on the same
    tensors: a warm-up call each, then ``repeat`` rounds timing one launch per engine in turn (so a
    busy machine slows them alike; the best of each is kept), then one traced launch each, whose
    output bytes and trace are compared."""
    import torch

    from pa_tile.emu import launch
    from pa_tile.emu.memory import Trace
    from pa_tile.reference import within_bound

    _check_args(arch, stage)
    case = make_case(arch, num_seqs, num_q_heads, context, block_size, seed)
    call, args = _launcher(stage, case)
    out = None
    first, groups, walls = {}, {}, {e: [] for e in engines}
    for e in engines:
        with _engine(e):
            t0 = time.perf_counter()
            with launch.record_launches() as log:
                out = call(*args, arch=arch) if out is None else call(*args, out=out, arch=arch)
            first[e] = time.perf_counter() - t0
            groups[e] = sum(x.grid[0] * x.grid[1] * x.grid[2] for x in log)
    for _ in range(max(1, int(repeat))):
        for e in engines:
            with _engine(e):
                t0 = time.perf_counter()
                call(*args, out=out, arch=arch)
                walls[e].append(time.perf_counter() - t0)
    ref, bound = case.error_bound(out_dtype=out.dtype)  # pa_tile.reference.fp8_error_bound
    results, outs, traces = {}, [], []
    for e in engines:
        out.view(torch.uint8).fill_(0xFF)     # poison: an engine that wrote nothing cannot pass
        trace = Trace(arch)
        with _engine(e), launch.launch_options(trace=trace), launch.record_launches() as traced:
            call(*args, out=out, arch=arch)
        outs.append(out.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        traces.append(_trace_state(trace, [r for x in traced for r in x.regions]))
        instructions = sum(trace.counts.values())
        ok, _ = within_bound(out, ref, bound)
        wall = min(walls[e])
        results[e] = BenchResult(
            arch=arch, shape=f"{num_seqs}x{num_q_heads}x{context} (1 KV head, d={HEAD_DIM}, block {block_size})",
            workgroups=groups[e], first_call_s=first[e], wall_s=wall, instructions=instructions,
            instructions_per_s=instructions / wall if wall > 0 else 0.0,
            max_abs_err=float((out.float().cpu() - ref).abs().max()), ok=ok, stage=stage, engine=e)
    launches = len(log)
    identical = all(o == outs[0] for o in outs) and all(same_trace(t, traces[0], launches) for t in traces)
    return Comparison(arch=arch, stage=stage, shape=results[engines[0]].shape, results=results, identical=identical)


def run(arch: str = "gfx942", num_seqs: int = 3, num_q_heads: int = 8, context: int = 1027, block_size: int = 16,
        *, repeat: int = 1, seed: int = 0, stage: str = "s2", engine: Optional[str] = None) -> BenchResult:
    """Benchmark one kernel and shape on one arch with one engine (``None``: the default one)."""
    from pa_tile.emu.machine import check_engine

    e = check_engine(engine)
    return compare(arch, stage, num_seqs, num_q_heads, context, block_size, engines=(e,), repeat=repeat,
                   seed=seed).results[e]


def format_results(results: Sequence[BenchResult]) -> str:
    from pa_tile.emu.memory import format_table

    rows = [dict(arch=r.arch, stage=r.stage, engine=r.engine, shape=r.shape, workgroups=r.workgroups,
                 first_call_s=r.first_call_s, wall_s=r.wall_s, instructions=r.instructions,
                 minstr_per_s=r.instructions_per_s / 1e6, max_abs_err=r.max_abs_err,
                 ok="PASS" if r.ok else "FAIL") for r in results]
    return format_table(rows, floatfmt=".3f")


def format_comparisons(comps: Sequence[Comparison]) -> str:
    """One row per kernel, shape and arch: each engine's wall time and rate, and the ratio."""
    from pa_tile.emu.memory import format_table

    rows = []
    for c in comps:
        row = dict(arch=c.arch, stage=c.stage, shape=c.shape.split(" (")[0],
                   instructions=next(iter(c.results.values())).instructions)
        for e, r in c.results.items():
            row[f"{e}_s"] = r.wall_s
            row[f"{e}_minstr_per_s"] = r.instructions_per_s / 1e6
        row["speedup"] = c.speedup
        row["identical"] = "yes" if c.identical else "NO"
        row["ok"] = "PASS" if all(r.ok for r in c.results.values()) else "FAIL"
        rows.append(row)
    return format_table(rows, floatfmt=".3f")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pa_tile.perf.emu_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                   help="s2: stage 2; s6: the finished kernel (split-K + reduce)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--seqs", type=int, default=DEFAULT_SHAPE["num_seqs"])
    p.add_argument("--heads", type=int, default=DEFAULT_SHAPE["num_q_heads"], help="query heads (one KV head)")
    p.add_argument("--context", type=int, default=DEFAULT_SHAPE["context"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--large", action="store_true",
                   help="also run 16 sequences x 4096 tokens, 8 query heads (about 12x today's work per launch; "
                        "slow with the reference engine)")
    p.add_argument("--repeat", type=int, default=3, help="timed launches per engine (the best is reported)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per engine run) instead of a table")
    args = p.parse_args(argv)

    from pa_tile import backend

    backend.set_backend("emu")
    shapes = [dict(num_seqs=args.seqs, num_q_heads=args.heads, context=args.context)]
    if args.large:
        shapes.append(dict(LARGE_SHAPE))
    comps: List[Comparison] = [compare(a, st, **sh, block_size=args.block_size, engines=args.engines,
                                       repeat=args.repeat)
                               for sh in shapes for st in args.stages for a in args.arch]
    if args.json:
        print(json.dumps([dict(asdict(r), identical=c.identical) for c in comps for r in c.results.values()],
                         indent=2))
    else:
        print(format_comparisons(comps))
    ok = all(r.ok for c in comps for r in c.results.values()) and all(c.identical for c in comps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
