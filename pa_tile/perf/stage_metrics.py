"""Per-stage performance metrics that need no GPU: static facts of the compiled code and
dynamic facts of one emulator run, condensed to the handful of numbers chapter 09 plots and
``tests/test_perf_metrics.py`` pins.

Static (:func:`static_metrics`, from ``pa_tile.isa``): registers, LDS, occupancy, the main
loop's instruction count by family, and the load widths of the whole kernel.

Dynamic (:func:`trace_metrics`): the stage runs in the emulator twice, on one sequence of one
KV head at two context lengths that are whole 256-token tiles (1024 and 2048 by default), and
every figure "per tile" is the *difference* of the two runs divided by the difference in tiles,
so the prologue and the epilogue (query load, final merge, output store) cancel and what is
left is the cost of the loop itself. (A split-K stage splits both runs, into partitions of the
same number of tiles, so its per-tile figures include its per-partition overhead and the reduce,
amortized over the tiles of a partition: a real cost of splitting.) Global loads are attributed to the tensor they read by
address (the first active lane's address inside a tensor's storage), so K and V loads are
measured apart from block-table and query loads. For K and V:

* ``bytes_per_load``: bytes one wave-wide load instruction requests (active lanes x width);
* ``lines_128B_per_load``: distinct 128-byte lines (the vL1D / L2 line) one such instruction
  touches, counted from the start of its tensor (``pa_tile.emu.memory.coalescing_lines``);
* ``coalescing``: unique bytes used / (128 x lines touched): 1.0 when every byte of every
  touched line is wanted, 0.5 when half of each line is wasted. Lanes that re-read the
  same bytes do not raise it (unlike ``tracing``'s ``min_lines_128B / lines_128B``);
* ``bytes_per_tile``: bytes requested per 256-token tile (ideal: 256 x head_dim per KV head).

LDS: the worst bank-conflict degree of any access (1 = conflict free) and the extra cycles
conflicts cost per tile.

Needs the emulator backend for :func:`trace_metrics`; :func:`collect` runs it in a subprocess
with ``PA_TILE_BACKEND=emu`` when this process uses the GPU. ``python -m
pa_tile.perf.stage_metrics`` prints the values ``tests/test_perf_metrics.py`` expects.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "ARCHS",
    "BLOCK_SIZES",
    "StaticMetrics",
    "TraceMetrics",
    "static_metrics",
    "trace_metrics",
    "collect",
    "expected_entry",
]

ARCHS = ("gfx942", "gfx950")
BLOCK_SIZES = (16, 64)
TILE = 256
#: group 8 (64 query heads over 8 KV heads, notebook 00's model), head_dim 128: every stage supports it
GROUP, HEAD_DIM = 8, 128


def _shape(context: int, block_size: int):
    from .roofline import DecodeShape

    return DecodeShape(batch=1, context=(context,), num_q_heads=GROUP, num_kv_heads=1, head_dim=HEAD_DIM,
                       block_size=block_size)


# ---------------------------------------------------------------------------------------------
# static


@dataclasses.dataclass
class StaticMetrics:
    stage: str
    arch: str
    block_size: int
    kernel: str
    other_kernels: List[str]
    vgpr: int
    agpr: int
    vgpr_unified: int
    sgpr: int
    lds_bytes: int
    waves_per_simd: float
    bound_by: Tuple[str, ...]
    loop_instructions: int
    loop_families: Dict[str, int]
    load_widths: Dict[str, Dict[str, int]]

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d["bound_by"] = list(self.bound_by)
        return d


def static_metrics(stage: str, arch: str = "gfx942", block_size: int = 16) -> StaticMetrics:
    """Compile ``stage`` for a group-8, head_dim-128 case (nothing runs) and read its code.

    With several kernels in the text (a split-K stage's reduce kernel), the one with the
    largest main loop is the main kernel; the others are listed by name.
    """
    from .. import isa
    from . import adapters

    ad = adapters.get(stage)
    # 2048 tokens: long enough that a split-K stage splits, so its reduce kernel is compiled too
    text = ad.compile_isa(ad.make_case(_shape(2048, block_size), arch), arch)
    stats = [isa.IsaStats.from_asm(text, kernel=k) for k in isa.kernel_names(text)]
    main = max(stats, key=lambda s: (s.main_loop_instructions, s.n_instructions))
    occ = isa.occupancy(main, arch)
    lp = main.main_loop
    return StaticMetrics(
        stage=ad.name, arch=arch, block_size=block_size, kernel=main.kernel,
        other_kernels=[s.kernel for s in stats if s is not main], vgpr=main.vgpr, agpr=main.agpr,
        vgpr_unified=main.vgpr_unified, sgpr=main.sgpr, lds_bytes=main.lds_bytes,
        waves_per_simd=occ.waves_per_simd, bound_by=tuple(occ.bound_by),
        loop_instructions=main.main_loop_instructions, loop_families=dict(lp.families) if lp else {},
        load_widths={k: dict(v) for k, v in main.load_widths.items()},
    )


# ---------------------------------------------------------------------------------------------
# dynamic


def _tagged_trace_class():
    from ..emu.memory import Trace, coalescing_lines

    class TaggedTrace(Trace):
        """A ``Trace`` that also records which tensor each global access reads and how many
        distinct bytes it uses."""

        def __init__(self, arch: str, regions: Dict[str, Tuple[int, int]]):
            super().__init__(arch)
            self.regions = regions
            self.tagged: List[Tuple[str, str, bool, int, int, int]] = []  # region, mnemonic, write, bytes, unique, lines

        def _region(self, addr: int) -> str:
            for name, (lo, hi) in self.regions.items():
                if lo <= addr < hi:
                    return name
            return "other"

        def global_access(self, mnemonic, line, addrs, mask, nbytes, *, kind="global", write=False, wave=None):
            super().global_access(mnemonic, line, addrs, mask, nbytes, kind=kind, write=write, wave=wave)
            if kind == "scalar" or not self._on(wave):
                return
            m = np.asarray(mask, dtype=bool)
            if not m.any():
                return
            a = np.asarray(addrs, dtype=np.uint64)[m]
            unique = np.unique((a[:, None] + np.arange(nbytes, dtype=np.uint64)[None, :]).reshape(-1)).size
            n_lines = coalescing_lines(addrs, m, nbytes, self.bases)
            self.tagged.append((self._region(int(a[0])), mnemonic, bool(write), int(m.sum()) * nbytes, int(unique),
                                n_lines))

    return TaggedTrace


def _storage_range(t) -> Tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


@dataclasses.dataclass
class _Run:
    instructions: int
    families: Dict[str, int]
    loads: Dict[str, Dict[str, float]]  # region -> executions, bytes, unique, lines_128B
    lds_max_degree: int
    lds_accesses: int
    lds_conflict_cycles: int
    check: object


def _run_once(ad, arch: str, context: int, block_size: int, seed: int) -> _Run:
    from ..emu import launch
    from ..isa import FAMILIES, instruction_family
    from . import checks

    case = ad.make_case(_shape(context, block_size), arch, seed=seed)
    inputs = ad.inputs(case)
    regions = {"K": _storage_range(inputs["key_cache"]), "V": _storage_range(inputs["value_cache"])}
    trace = _tagged_trace_class()(arch, regions)
    with launch.launch_options(trace=trace):
        out = ad.module.paged_decode(**inputs, arch=arch)
    check = checks.compare(out, checks.reference_output(case), ad.tolerance)
    fam = {f: 0 for f in FAMILIES}
    for mn, c in trace.counts.items():
        fam[instruction_family(mn)] += c
    loads: Dict[str, Dict[str, float]] = {}
    for region, _mn, write, nbytes, unique, n_lines in trace.tagged:
        if write:
            continue
        r = loads.setdefault(region, dict(executions=0, bytes=0, unique=0, lines_128B=0))
        r["executions"] += 1
        r["bytes"] += nbytes
        r["unique"] += unique
        r["lines_128B"] += n_lines
    lds = [r for r in trace.summary() if r["space"] == "lds"]
    return _Run(sum(trace.counts.values()), fam, loads, max((r["max_degree"] for r in lds), default=0),
                sum(r["executions"] for r in lds), sum(r["conflict_cycles"] for r in lds), check)


@dataclasses.dataclass
class TraceMetrics:
    stage: str
    arch: str
    block_size: int
    contexts: Tuple[int, int]
    instructions_per_tile: float
    families_per_tile: Dict[str, float]
    k: Dict[str, float]
    v: Dict[str, float]
    lds_max_degree: int
    lds_conflict_cycles_per_tile: float
    checks_ok: bool
    check: str

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def _kv_figures(small: Dict, big: Dict, tiles: int) -> Dict[str, float]:
    from ..emu.memory import LINE_BYTES

    if not big or not big["executions"]:
        return dict(loads=0, bytes_per_load=0.0, lines_128B_per_load=0.0, coalescing=0.0, bytes_per_tile=0.0)
    small = small or dict(executions=0, bytes=0)
    return dict(
        loads=big["executions"], bytes_per_load=big["bytes"] / big["executions"],
        lines_128B_per_load=big["lines_128B"] / big["executions"],
        coalescing=big["unique"] / (LINE_BYTES * big["lines_128B"]),
        bytes_per_tile=(big["bytes"] - small["bytes"]) / tiles,
    )


def trace_metrics(stage: str, arch: str = "gfx942", block_size: int = 16, contexts: Tuple[int, int] = (1024, 2048),
                  *, seed: int = 0) -> TraceMetrics:
    """Run ``stage`` in the emulator at two context lengths (whole 256-token tiles) and derive
    the figures of the module docstring. Both runs are checked against the reference."""
    from .. import backend
    from . import adapters

    backend.require_emulator("trace_metrics (collect() runs it in a subprocess for you)")
    lo, hi = contexts
    if lo % TILE or hi % TILE or hi <= lo:
        raise ValueError(f"contexts: expected two increasing multiples of {TILE}, got {contexts}")
    backend.ensure_backend()
    ad = adapters.get(stage)
    a, b = (_run_once(ad, arch, L, block_size, seed) for L in (lo, hi))
    tiles = (hi - lo) // TILE
    return TraceMetrics(
        stage=ad.name, arch=arch, block_size=block_size, contexts=(lo, hi),
        instructions_per_tile=(b.instructions - a.instructions) / tiles,
        families_per_tile={f: (b.families[f] - a.families[f]) / tiles for f in b.families},
        k=_kv_figures(a.loads.get("K"), b.loads.get("K"), tiles),
        v=_kv_figures(a.loads.get("V"), b.loads.get("V"), tiles),
        lds_max_degree=b.lds_max_degree,
        lds_conflict_cycles_per_tile=(b.lds_conflict_cycles - a.lds_conflict_cycles) / tiles,
        checks_ok=bool(a.check.ok and b.check.ok), check=f"ctx {lo}: {a.check}; ctx {hi}: {b.check}",
    )


# ---------------------------------------------------------------------------------------------
# everything, for the notebook


def collect(stages: Optional[Sequence[str]] = None, archs: Sequence[str] = ARCHS,
            block_sizes: Sequence[int] = BLOCK_SIZES, *, trace_block_size: int = 16, progress: bool = True) -> Dict:
    """Static metrics for every (stage, arch, block size) and trace metrics for every (stage,
    arch) at ``trace_block_size``. A stage that cannot be driven (missing adapter, compile or
    run error) is reported under ``errors`` instead of stopping the rest.

    When this process is not on the emulator backend (a GPU machine), the trace part runs in
    a subprocess with ``PA_TILE_BACKEND=emu``. ``progress``: a bar per part on stderr when someone
    watches (``pa_tile.progress`` decides: never in an nbconvert or nbval run); ``False``: never.
    """
    from .. import backend
    from ..progress import progress as bar
    from . import adapters

    stages = list(adapters.stage_names() if stages is None else stages)
    out: Dict = dict(stages=stages, static=[], trace=[], errors=[])
    static_jobs = [(st, arch, bs) for st in stages for arch in archs for bs in block_sizes]
    when = None if progress else False
    for st, arch, bs in bar(static_jobs, desc="compile", enabled=when):
        try:
            out["static"].append(static_metrics(st, arch, bs).to_dict())
        except Exception as e:  # noqa: BLE001 - reported, the chapter goes on
            out["errors"].append(dict(stage=st, arch=arch, block_size=bs, part="static",
                                      error=f"{type(e).__name__}: {e}"))
    if backend.current_backend() == "emu":
        for st, arch in bar([(st, arch) for st in stages for arch in archs], desc="trace", enabled=when):
            try:
                out["trace"].append(trace_metrics(st, arch, trace_block_size).to_dict())
            except Exception as e:  # noqa: BLE001
                out["errors"].append(dict(stage=st, arch=arch, block_size=trace_block_size, part="trace",
                                          error=f"{type(e).__name__}: {e}"))
    else:
        sub = _collect_trace_subprocess(stages, archs, trace_block_size)
        out["trace"], out["errors"] = sub["trace"], out["errors"] + sub["errors"]
    return out


def _collect_trace_subprocess(stages, archs, block_size) -> Dict:
    env = dict(os.environ, PA_TILE_BACKEND="emu")
    env.pop("PA_TILE_SIMULATE_GPU", None)  # the traces need the plain emulator, not a simulated GPU
    cmd = [sys.executable, "-m", "pa_tile.perf.stage_metrics", "--json", "--stages", ",".join(stages),
           "--archs", ",".join(archs), "--block-size", str(block_size)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return dict(trace=[], errors=[dict(stage=",".join(stages), part="trace", error=res.stderr[-2000:])])
    return json.loads(res.stdout)


def expected_entry(stage: str, arch: str = "gfx942") -> str:
    """The line ``tests/test_perf_metrics.py`` wants for ``stage`` on ``arch`` (measured now)."""
    s = static_metrics(stage, arch, 16)
    t = trace_metrics(stage, arch, 16)
    return (f'    ("{s.stage}", "{arch}"): dict(loop_static={s.loop_instructions}, '
            f"per_tile={t.instructions_per_tile:.1f}, k_coalescing={t.k['coalescing']:.3f}, "
            f"v_coalescing={t.v['coalescing']:.3f}, k_bytes_per_load={t.k['bytes_per_load']:.0f}, "
            f"v_bytes_per_load={t.v['bytes_per_load']:.0f}, kv_bytes_per_tile={t.k['bytes_per_tile'] + t.v['bytes_per_tile']:.0f}, "
            f"lds_degree={t.lds_max_degree}, lds_cycles_per_tile={t.lds_conflict_cycles_per_tile:.1f}),")


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pa_tile.perf.stage_metrics",
                                description="Measure the per-stage metrics tests/test_perf_metrics.py pins "
                                            "(runs the emulator; set PA_TILE_BACKEND=emu on a GPU machine).")
    p.add_argument("--stages", default=None, help="comma-separated (default: every stage present)")
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print trace metrics as JSON instead of test entries")
    a = p.parse_args(argv)
    from . import adapters

    stages = a.stages.split(",") if a.stages else adapters.stage_names()
    archs = a.archs.split(",")
    if a.json:
        out = dict(trace=[], errors=[])
        from ..progress import progress as bar

        for st, arch in bar([(st, arch) for st in stages for arch in archs], desc="trace"):
            try:
                out["trace"].append(trace_metrics(st, arch, a.block_size).to_dict())
            except Exception as e:  # noqa: BLE001
                out["errors"].append(dict(stage=st, arch=arch, block_size=a.block_size, part="trace",
                                          error=f"{type(e).__name__}: {e}"))
        print(json.dumps(out))
        return 0
    for st in stages:
        for arch in archs:
            print(expected_entry(st, arch))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
