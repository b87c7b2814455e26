"""Memory-access report of one kernel run in the emulator (``pa_tile.emu.memory.Trace``).

Per vector-memory instruction (global_/buffer_): how often it ran, bytes it moved per
execution (active lanes x access width), 128-byte lines (the vL1D / L2 line of both targets) it
touched per execution against the fewest those bytes could fit in (coalescing efficiency = fewest
/ touched: 1 when every touched line is fully used, below 1 when accesses straddle or skip lines,
above 1 when lanes read
overlapping addresses, e.g. a wave-uniform value loaded by every lane). Per LDS instruction: bank-conflict degree (1 =
conflict free) and the extra cycles conflicts cost. Plus the dynamic instruction mix, and
dynamic wave-instructions per 256-token tile: all instructions executed by all waves, divided
by the number of (sequence, KV head, 256-token tile) triples the call covers.

The trace needs the emulator backend (``PA_TILE_BACKEND=emu`` or ``pa_tile.set_backend``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ._table import format_rows
from .roofline import DecodeShape

__all__ = ["TILE_TOKENS", "TraceReport", "report_from_trace", "trace_stage", "trace_tiny", "compulsory_bytes"]

#: Tokens per tile for the "instructions per tile" figure (the stages' workgroup tile).
TILE_TOKENS = 256


@dataclasses.dataclass
class TraceReport:
    kernel: str
    arch: str
    vmem: List[Dict]
    lds: List[Dict]
    scalar_loads: int
    scalar_load_bytes: int
    dynamic_instructions: int
    families: Dict[str, int]
    tiles: Optional[int] = None
    shape: Optional[DecodeShape] = None
    check: Optional[object] = None  # checks.CheckResult of the traced run

    @property
    def instructions_per_tile(self) -> Optional[float]:
        return self.dynamic_instructions / self.tiles if self.tiles else None

    def traffic(self) -> Optional[Dict]:
        """Global bytes loaded against the compulsory bytes of the call's shape.

        ``loaded_bytes``: what the wave instructions ask the memory system for, vector loads
        counted per execution as the distinct bytes their lanes read (64 lanes loading one page
        id are one 4-byte request) plus scalar loads; ``lane_bytes`` counts every lane's bytes
        (a broadcast load 64 times). Both count a byte again each time another instruction,
        wave or workgroup loads it: re-reading K/V shows in both."""
        if self.shape is None:
            return None
        loads = [r for r in self.vmem if r["op"] == "load"]
        loaded = sum(r["distinct_bytes"] for r in loads) + self.scalar_load_bytes
        lane_bytes = sum(r["bytes"] for r in loads) + self.scalar_load_bytes
        need, visible = compulsory_bytes(self.shape), compulsory_bytes(self.shape, visible_only=True)
        return dict(loaded_bytes=loaded, lane_bytes=lane_bytes, compulsory_bytes=need, visible_bytes=visible,
                    vs_compulsory=loaded / need, vs_visible=loaded / visible)

    def totals(self) -> Dict:
        """Whole-run figures: load bytes and 128-byte lines, overall efficiency, LDS conflict cycles."""
        loads = [r for r in self.vmem if r["op"] == "load"]
        stores = [r for r in self.vmem if r["op"] == "store"]

        def agg(rows):
            n_lines = sum(r["lines_128B"] for r in rows)
            return (sum(r["bytes"] for r in rows), n_lines,
                    (sum(r["min_lines_128B"] for r in rows) / n_lines) if n_lines else 1.0)

        lb, ls, le = agg(loads)
        sb, ss, se = agg(stores)
        return dict(load_bytes=lb, load_lines_128B=ls, load_efficiency=le, store_bytes=sb, store_lines_128B=ss,
                    store_efficiency=se, lds_accesses=sum(r["executions"] for r in self.lds),
                    lds_max_degree=max((r["max_degree"] for r in self.lds), default=0),
                    lds_conflict_cycles=sum(r["conflict_cycles"] for r in self.lds),
                    dynamic_instructions=self.dynamic_instructions, tiles=self.tiles,
                    instructions_per_tile=self.instructions_per_tile)

    def to_dict(self) -> Dict:
        return dict(kernel=self.kernel, arch=self.arch, shape=self.shape.to_dict() if self.shape else None,
                    vmem=self.vmem, lds=self.lds, scalar_loads=self.scalar_loads,
                    scalar_load_bytes=self.scalar_load_bytes,
                    dynamic_instructions=self.dynamic_instructions, families=self.families, tiles=self.tiles,
                    totals=self.totals(), traffic=self.traffic(), check=self.check.to_dict() if self.check is not None else None)

    def format(self) -> str:
        head = f"memory-access trace: {self.kernel} on {self.arch}"
        if self.shape is not None:
            head += f" ({self.shape.label})"
        out = [head, ""]
        if self.check is not None:
            out += [f"check vs reference: {self.check}", ""]
        out.append("vector memory instructions (per execution = one wave instruction):")
        out.append(format_rows(self.vmem, ["mnemonic", "line", "op", "executions", "bytes_per_exec",
                                           "lines_128B_per_exec", "min_lines_128B_per_exec", "efficiency"],
                               headers=dict(bytes_per_exec="bytes/exec", lines_128B_per_exec="128B lines/exec",
                                            min_lines_128B_per_exec="min lines/exec")))
        out += ["", "LDS instructions (conflict degree 1 = conflict free):"]
        out.append(format_rows(self.lds, ["mnemonic", "line", "op", "executions", "bytes_per_exec", "max_degree",
                                          "mean_degree", "conflict_cycles"],
                               headers=dict(bytes_per_exec="bytes/exec")) if self.lds else "(none)")
        t = self.totals()
        out += ["", f"scalar memory loads executed: {self.scalar_loads}",
                f"dynamic wave-instructions: {self.dynamic_instructions} ("
                + ", ".join(f"{k} {v}" for k, v in self.families.items() if v) + ")",
                f"global loads: {t['load_bytes']} B in {t['load_lines_128B']} 128-byte lines, "
                f"efficiency {t['load_efficiency']:.2f}; LDS conflict cycles {t['lds_conflict_cycles']}"]
        tr = self.traffic()
        if tr is not None:
            out.append(f"traffic: {tr['loaded_bytes']} B loaded (distinct bytes per instruction, vector + scalar) = "
                       f"{tr['vs_compulsory']:.2f}x the compulsory {tr['compulsory_bytes']} B ({tr['vs_visible']:.2f}x "
                       f"the visible tokens' {tr['visible_bytes']} B; {tr['lane_bytes']} B counting every lane)")
        if self.tiles:
            out.append(f"instructions per {TILE_TOKENS}-token tile: {self.instructions_per_tile:.1f} "
                       f"({self.tiles} (sequence, KV head, tile) triples)")
        return "\n".join(out)

    __str__ = format


def compulsory_bytes(shape: DecodeShape, *, visible_only: bool = False) -> int:
    """Bytes one decode call must load at least: each sequence's K and V for its context, once
    per KV head (rounded up to the kernels' 256-token tile unless ``visible_only``), the query,
    the per-token scales of those tokens, one block-table entry per page, the context lengths
    and the per-tensor scales. Issue #12 defines it; traffic is measured against it."""
    kvh, hd = shape.num_kv_heads, shape.head_dim
    total = shape.batch * 4  # context lengths
    total += shape.batch * shape.query_length * shape.num_q_heads * hd * shape.query_bytes
    for L in shape.context_lengths:
        tokens = L if visible_only else -(-L // TILE_TOKENS) * TILE_TOKENS
        total += 2 * tokens * kvh * hd * shape.kv_bytes  # K and V, once
        if shape.scales == "per-token":
            total += 2 * tokens * kvh * 4
        total += -(-L // shape.block_size) * 4  # one page id per page of the context
    if shape.scales != "per-token":
        total += 8
    return total


def _op(mnemonic: str) -> str:
    return "store" if "_store" in mnemonic or mnemonic.startswith("ds_write") else "load"


def report_from_trace(trace, kernel: str, *, shape: Optional[DecodeShape] = None) -> TraceReport:
    """Condense a ``Trace`` into per-instruction rows and totals."""
    from ..isa import FAMILIES, instruction_family

    vmem, lds, scalar, scalar_bytes = [], [], 0, 0
    for r in trace.summary():
        n = r["executions"]
        if r["space"] in ("global", "buffer"):
            vmem.append(dict(mnemonic=r["mnemonic"], line=r["line"], space=r["space"], op=_op(r["mnemonic"]),
                             executions=n, bytes=r["bytes"], distinct_bytes=r["distinct_bytes"],
                             lines_128B=r["lines_128B"], min_lines_128B=r["min_lines_128B"],
                             bytes_per_exec=r["bytes"] / n, lines_128B_per_exec=r["lines_128B"] / n,
                             min_lines_128B_per_exec=r["min_lines_128B"] / n, efficiency=r["efficiency"]))
        elif r["space"] == "lds":
            lds.append(dict(mnemonic=r["mnemonic"], line=r["line"], op=_op(r["mnemonic"]), executions=n,
                            bytes=r["bytes"], bytes_per_exec=r["bytes"] / n, max_degree=r["max_degree"],
                            mean_degree=r["mean_degree"], conflict_cycles=r["conflict_cycles"]))
        else:
            scalar += n
            scalar_bytes += r["bytes"]
    fam = {f: 0 for f in FAMILIES}
    for m, c in trace.counts.items():
        fam[instruction_family(m)] += c
    tiles = None
    if shape is not None:
        tiles = shape.num_kv_heads * sum(-(-L // TILE_TOKENS) for L in shape.context_lengths)
    return TraceReport(kernel, trace.arch, vmem, lds, scalar, scalar_bytes, sum(trace.counts.values()), fam, tiles,
                       shape)


def _require_emulator():
    from .. import backend

    backend.require_emulator("the memory-access trace")


def trace_stage(stage: str, shape: Optional[DecodeShape] = None, arch: str = "gfx942", *, seed: int = 0,
                **options) -> TraceReport:
    """Run ``stage`` once in the emulator on a case of ``shape`` (default: the stage's small one),
    recording every access; the report includes the run's check against the reference.
    ``options`` go to the stage's ``paged_decode`` (``num_partitions``, ``schedule``, ...)."""
    from ..emu import launch
    from ..emu.memory import Trace
    from . import adapters, checks

    _require_emulator()
    ad = adapters.get(stage)
    shape = shape or ad.default_shape()
    case = ad.make_case(shape, arch, seed=seed)
    trace = Trace(arch)
    with launch.launch_options(trace=trace):
        out = ad.run(case, arch, **options)
    rep = report_from_trace(trace, f"stage {ad.name}", shape=shape)
    rep.check = checks.compare(out, checks.reference_output(case), ad.tolerance)
    return rep


def trace_tiny(arch: str = "gfx942") -> TraceReport:
    """The same report for ``tiny_kernels.scale_add`` on a [16, 128] float32 tile."""
    from ..emu import launch
    from ..emu.memory import Trace
    from . import adapters, checks

    _require_emulator()
    k = adapters.get("tiny")
    x, y, out = k.tensors()
    trace = Trace(arch)
    with launch.launch_options(trace=trace):
        k.run(x, y, out, arch)
    rep = report_from_trace(trace, "tiny (scale_add)")
    rep.check = checks.compare(out, k.reference(x, y), k.tolerance)
    return rep
