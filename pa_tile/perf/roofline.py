"""Roofline model of one fp8 paged-decode call: bytes it must move, flops it must do, time floor.

A decode call streams every cached K and V token of every sequence once and does little
arithmetic with each byte (about ``2·G`` flops per byte for a query group of ``G`` heads,
``query_length`` times more with MTP), two orders of magnitude below the point where
MI300X / MI355X become compute bound. So its time floor is the bytes it moves divided by the
HBM bandwidth; :func:`time_floor` reports the compute floor too, and which one binds.

What :func:`traffic` counts (each byte once; nothing assumed to hit in a cache):

* K and V: ``context`` tokens x ``num_kv_heads`` x ``head_dim`` x 1 byte (fp8) each, per
  sequence (``whole_pages=True``: rounded up to whole pages, what a kernel that reads every
  slot of its last page moves);
* scales: per tensor one float32 each for K and V; per token one float32 per token and KV head
  (``num_blocks x num_kv_heads x block_size`` in the cache, only the used slots counted);
* query in and output out: ``batch x query_length x num_q_heads x head_dim`` elements of
  ``query_bytes`` / ``out_bytes`` (2: f16/bf16);
* block tables (4 bytes per page used) and context lengths (4 bytes per sequence).

Flops: for each query row (causal with MTP: row ``i`` of ``query_length`` sees
``L - query_length + i + 1`` tokens) and query head, ``2·head_dim`` for ``q·k`` and
``2·head_dim`` for ``p·v`` per visible token. Softmax exponentials run on the VALU and are not
counted; neither is work a kernel wastes on masked slots.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ._table import format_rows

__all__ = [
    "DecodeShape",
    "Traffic",
    "GpuSpec",
    "GPUS",
    "Floor",
    "traffic",
    "flops",
    "arithmetic_intensity",
    "time_floor",
    "gpu_spec",
    "gpu_for_device",
    "upstream_shapes",
    "BATCHES",
    "CONTEXTS",
    "HEAD_DIMS",
    "HEADS",
    "table",
    "format_table",
    "plot",
]

SCALES = ("per-tensor", "per-token")


def _int(v, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    return v


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The sizes of one decode call. ``context`` is one length for every sequence or one per sequence.

    Defaults follow notebook 00's model: 64 query heads over 8 KV heads (group 8), head_dim 128,
    pages of 16 tokens, one query token per sequence, per-tensor scales, f16/bf16 query and output.
    """

    batch: int
    context: Union[int, Tuple[int, ...]]
    num_q_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    query_length: int = 1
    scales: str = "per-tensor"
    query_bytes: int = 2
    out_bytes: int = 2
    kv_bytes: int = 1

    def __post_init__(self):
        for name in ("batch", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "query_length",
                     "query_bytes", "out_bytes", "kv_bytes"):
            _int(getattr(self, name), name)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads: {self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.scales not in SCALES:
            raise ValueError(f"scales: expected one of {SCALES}, got {self.scales!r}")
        ctx = self.context
        if isinstance(ctx, (list, tuple)):
            ctx = tuple(ctx)
            object.__setattr__(self, "context", ctx)
            if len(ctx) != self.batch:
                raise ValueError(f"context: {len(ctx)} lengths for batch={self.batch}")
            lengths = ctx
        else:
            lengths = (ctx,)
        for L in lengths:
            _int(L, "context")
            if L < self.query_length:
                raise ValueError(f"context: {L} is shorter than query_length={self.query_length}")

    @property
    def context_lengths(self) -> Tuple[int, ...]:
        return self.context if isinstance(self.context, tuple) else (self.context,) * self.batch

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def tokens(self) -> int:
        return sum(self.context_lengths)

    @property
    def pages(self) -> int:
        return sum(-(-L // self.block_size) for L in self.context_lengths)

    @property
    def max_context(self) -> int:
        return max(self.context_lengths)

    @property
    def label(self) -> str:
        ctx = self.context if isinstance(self.context, int) else f"{min(self.context)}..{max(self.context)}"
        return (f"b{self.batch} ctx{ctx} h{self.num_q_heads}/{self.num_kv_heads} d{self.head_dim} "
                f"bs{self.block_size} ql{self.query_length} {self.scales}")

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d["context"] = list(self.context) if isinstance(self.context, tuple) else self.context
        return d

    @classmethod
    def from_dict(cls, d: Dict) -> "DecodeShape":
        d = dict(d)
        if isinstance(d.get("context"), list):
            d["context"] = tuple(d["context"])
        return cls(**d)

    @classmethod
    def from_case(cls, case) -> "DecodeShape":
        """The shape of a ``pa_tile.cache.PagedCase``."""
        return cls(
            batch=case.num_seqs, context=tuple(int(x) for x in case.context_lengths.tolist()),
            num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
            block_size=case.block_size, query_length=case.query_length, scales=case.scales,
            query_bytes=case.query.element_size(), out_bytes=case.query.element_size(),
        )


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one decode call moves between HBM and the GPU, by tensor."""

    k: int
    v: int
    k_scale: int
    v_scale: int
    query: int
    out: int
    block_tables: int
    context_lengths: int

    @property
    def kv(self) -> int:
        return self.k + self.v

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def to_dict(self) -> Dict[str, int]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


def traffic(shape: DecodeShape, *, whole_pages: bool = False) -> Traffic:
    """Bytes moved by one call (see the module docstring for what is counted)."""
    if not isinstance(shape, DecodeShape):
        raise TypeError(f"shape: expected a DecodeShape, got {type(shape).__name__}")
    tokens = shape.pages * shape.block_size if whole_pages else shape.tokens
    kv = tokens * shape.num_kv_heads * shape.head_dim * shape.kv_bytes
    scale = 4 * tokens * shape.num_kv_heads if shape.scales == "per-token" else 4
    rows = shape.batch * shape.query_length * shape.num_q_heads * shape.head_dim
    return Traffic(
        k=kv, v=kv, k_scale=scale, v_scale=scale,
        query=rows * shape.query_bytes, out=rows * shape.out_bytes,
        block_tables=4 * shape.pages, context_lengths=4 * shape.batch,
    )


def flops(shape: DecodeShape) -> int:
    """Useful flops of one call: 4·head_dim per (query row, query head, visible token)."""
    ql = shape.query_length
    # rows i = 0..ql-1 of a sequence of length L see L - ql + i + 1 tokens
    visible = sum(ql * L - ql * (ql - 1) // 2 for L in shape.context_lengths)
    return 4 * shape.head_dim * shape.num_q_heads * visible


def arithmetic_intensity(shape: DecodeShape, *, whole_pages: bool = False) -> float:
    """Flops per byte moved."""
    return flops(shape) / traffic(shape, whole_pages=whole_pages).total


# ---------------------------------------------------------------------------------------------
# hardware
#
# Sources (peak figures as AMD publishes them):
# * AMD Instinct MI300X accelerator data sheet
#   (https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf):
#   304 compute units, 2100 MHz peak engine clock, 192 GB HBM3 at 5.3 TB/s peak bandwidth,
#   2614.9 TFLOPS peak dense FP8 (= 304 CUs x 4096 FP8 flops/clock/CU x 2.1 GHz).
# * AMD Instinct MI355X GPU data sheet (https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html):
#   256 compute units, 2400 MHz peak engine clock, 288 GB HBM3E at 8 TB/s peak bandwidth,
#   about 5.0 PFLOPS peak dense FP8 (= 256 CUs x 8192 FP8 flops/clock/CU x 2.4 GHz; CDNA 4
#   doubled the per-CU FP8 matrix rate of CDNA 3 with v_mfma_f32_16x16x128_f8f6f4). The
#   v_mfma_f32_16x16x32_fp8_fp8 pa_tile's kernels issue keeps CDNA 3's 4096 flops/clock/CU on
#   CDNA 4 (CDNA4 ISA guide: 16 cycles; pa_tile.perf.hw mfma_cycles), so their own fp8 ceiling on
#   MI355X is half this peak; the roofline keeps the data sheet's figure.
# * CU counts and architectures also in ROCm's "GPU hardware specifications" table
#   (https://rocm.docs.amd.com/en/latest/reference/gpu-specs.html).
# TB/s here is 10^12 bytes per second, as in the data sheets.


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    arch: str
    hbm_bytes_per_s: float
    compute_units: int
    peak_clock_mhz: int
    fp8_flops_per_clock_per_cu: int
    source: str

    @property
    def hbm_tb_s(self) -> float:
        return self.hbm_bytes_per_s / 1e12

    @property
    def fp8_dense_flops(self) -> float:
        return self.compute_units * self.fp8_flops_per_clock_per_cu * self.peak_clock_mhz * 1e6

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which the fp8 MFMA peak, not HBM, bounds a kernel."""
        return self.fp8_dense_flops / self.hbm_bytes_per_s

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d.update(hbm_tb_s=self.hbm_tb_s, fp8_dense_tflops=self.fp8_dense_flops / 1e12)
        return d


GPUS: Dict[str, GpuSpec] = {
    "MI300X": GpuSpec("MI300X", "gfx942", 5.3e12, 304, 2100, 4096, "AMD Instinct MI300X data sheet"),
    "MI355X": GpuSpec("MI355X", "gfx950", 8.0e12, 256, 2400, 8192, "AMD Instinct MI355X data sheet"),
}


def gpu_spec(name: Union[str, GpuSpec]) -> GpuSpec:
    """A ``GPUS`` entry by name (case-insensitive), or a ``GpuSpec`` passed through."""
    if isinstance(name, GpuSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"gpu: expected a name such as 'MI300X', got {type(name).__name__}")
    for k, spec in GPUS.items():
        if k.lower() == name.strip().lower():
            return spec
    raise ValueError(f"gpu: unknown {name!r}; known: {', '.join(GPUS)}")


def gpu_for_device(device_name: str, arch: Optional[str]) -> Tuple[GpuSpec, str]:
    """The spec for a GPU as torch names it, and how it was chosen.

    Matched by product name first (``'AMD Instinct MI300X'``); otherwise by arch, which is
    only an assumption (gfx942 also covers MI300A / MI325X, whose bandwidths differ), and the
    returned note says so.
    """
    text = (device_name or "").upper().replace(" ", "")
    for k, spec in GPUS.items():
        if k in text:
            return spec, f"matched device name {device_name!r}"
    for spec in GPUS.values():
        if arch and arch.startswith(spec.arch):
            return spec, (f"ASSUMED from arch {arch}: device {device_name!r} is not one of {list(GPUS)}; "
                          "% of peak uses the figures of " + spec.name)
    raise ValueError(f"no HBM figures for device {device_name!r} (arch {arch}); known: {list(GPUS)}")


@dataclasses.dataclass(frozen=True)
class Floor:
    """Lower bounds on the time of one call on one GPU."""

    gpu: str
    bytes: int
    flops: int
    memory_s: float
    compute_s: float

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def time_us(self) -> float:
        return self.time_s * 1e6

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def time_floor(shape: DecodeShape, gpu: Union[str, GpuSpec] = "MI300X", *, whole_pages: bool = False) -> Floor:
    """Bytes / HBM bandwidth and flops / dense fp8 peak for one call."""
    spec = gpu_spec(gpu)
    b = traffic(shape, whole_pages=whole_pages).total
    f = flops(shape)
    return Floor(spec.name, b, f, b / spec.hbm_bytes_per_s, f / spec.fp8_dense_flops)


# ---------------------------------------------------------------------------------------------
# the benchmark grid

#: The range upstream's decode benchmarks cover (batch 1..256, context 129..16384 with the odd
#: 129 that leaves one token in a last page, head_dim 64 and 128); the points in between are ours.
BATCHES = (1, 4, 16, 64, 128, 256)
CONTEXTS = (129, 512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
#: (num_q_heads, num_kv_heads): notebook 00's 64/8 (group 8).
HEADS = ((64, 8),)


def upstream_shapes(batches: Iterable[int] = BATCHES, contexts: Iterable[int] = CONTEXTS,
                    head_dims: Iterable[int] = HEAD_DIMS, heads: Iterable[Tuple[int, int]] = HEADS,
                    **kwargs) -> List[DecodeShape]:
    """Every combination, as ``DecodeShape`` s (``kwargs``: block_size, query_length, scales, ...)."""
    return [DecodeShape(batch=b, context=c, num_q_heads=qh, num_kv_heads=kvh, head_dim=d, **kwargs)
            for d in head_dims for (qh, kvh) in heads for b in batches for c in contexts]


def table(shapes: Optional[Sequence[DecodeShape]] = None, gpus: Sequence[Union[str, GpuSpec]] = ("MI300X", "MI355X"),
          *, whole_pages: bool = False) -> List[Dict]:
    """One row per shape: sizes, MB moved, GFLOP, flops/byte, and the time floor (µs) per GPU."""
    shapes = upstream_shapes() if shapes is None else list(shapes)
    specs = [gpu_spec(g) for g in gpus]
    rows = []
    for s in shapes:
        t = traffic(s, whole_pages=whole_pages)
        row = dict(batch=s.batch, context=s.context if isinstance(s.context, int) else s.max_context,
                   q_heads=s.num_q_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                   query_length=s.query_length, scales=s.scales, bytes=t.total, kv_bytes=t.kv,
                   MB=t.total / 1e6, GFLOP=flops(s) / 1e9, flops_per_byte=flops(s) / t.total)
        for spec in specs:
            fl = time_floor(s, spec, whole_pages=whole_pages)
            row[f"{spec.name}_us"] = fl.time_us
            row[f"{spec.name}_bound"] = fl.bound
        rows.append(row)
    return rows


_COLUMNS = ("batch", "context", "head_dim", "q_heads", "kv_heads", "query_length", "scales", "MB", "flops_per_byte")


def format_table(rows: List[Dict]) -> str:
    """The table as text: sizes, MB, flops/byte and each GPU's floor in µs."""
    if not rows:
        return "(no rows)"
    gpu_cols = [k for k in rows[0] if k.endswith("_us")]
    headers = {c: c.replace("_us", " floor µs") for c in gpu_cols}
    headers.update(flops_per_byte="flop/B", query_length="ql")
    return format_rows(rows, list(_COLUMNS) + gpu_cols, headers=headers)


def plot(shapes: Optional[Sequence[DecodeShape]] = None, gpus: Sequence[Union[str, GpuSpec]] = ("MI300X", "MI355X"),
         *, ax=None, whole_pages: bool = False):
    """Log-log time floor vs context length, one line per (batch, head_dim, heads) and GPU.

    Default shapes: batches 1, 16, 256 at head_dim 64 and 128. Returns the Figure.
    """
    import matplotlib.pyplot as plt

    shapes = upstream_shapes(batches=(1, 16, 256)) if shapes is None else list(shapes)
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    series: Dict[Tuple, List[DecodeShape]] = {}
    for s in shapes:
        key = (s.batch, s.head_dim, s.num_q_heads, s.num_kv_heads, s.query_length, s.scales)
        series.setdefault(key, []).append(s)
    styles = ("-", "--", ":", "-.")
    for gi, g in enumerate(gpus):
        spec = gpu_spec(g)
        for (b, d, qh, kvh, ql, sc), ss in series.items():
            ss = sorted(ss, key=lambda s: s.max_context)
            xs = [s.max_context for s in ss]
            ys = [time_floor(s, spec, whole_pages=whole_pages).time_us for s in ss]
            ax.loglog(xs, ys, styles[gi % len(styles)], marker="o", ms=3,
                      label=f"{spec.name} b{b} d{d}" + ("" if ql == 1 else f" ql{ql}"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time floor (µs)")
    heads = sorted({(s.num_q_heads, s.num_kv_heads) for s in shapes})
    ax.set_title("Decode time floor = bytes moved / HBM bandwidth\n(heads q/kv: "
                 + ", ".join(f"{q}/{k}" for q, k in heads) + ")")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig

