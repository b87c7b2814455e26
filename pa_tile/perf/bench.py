"""Benchmark harness: time each stage, a plain PyTorch baseline and installed paged-attention
kernels on a ROCm GPU; results to JSON, plots from the JSON.

Rules it keeps:

* It times only on a ROCm GPU (``pa_tile.backend`` says ``gpu``). Anywhere else :func:`run`
  raises :class:`GpuRequired` before doing anything: no number is ever estimated or invented.
* Nothing is timed before it passed its correctness check against ``pa_tile.reference`` in the
  same run, on the same inputs. A failed check, a shape the kernel refuses (ValueError /
  TypeError from its validation) or any error is recorded with its reason, and the run goes on.
* Timing: inputs and output are allocated once; the launch is captured in a CUDA graph
  (``torch.cuda.CUDAGraph``) so no host launch overhead is measured; each sample is one graph
  replay between two ``torch.cuda.Event`` s. With ``cold_cache`` (default) a 512 MiB buffer is
  overwritten before every sample, so K/V come from HBM and not from the 256 MB Infinity Cache
  (MI300X / MI355X). After ``warmup`` replays, ``iters`` samples; the minimum is reported (the
  least disturbed run), with the median next to it. After capture, one replay into a poisoned
  output is checked again, so a graph that does not really run the kernel cannot be timed.
* Bandwidth = bytes of ``pa_tile.perf.roofline.traffic`` / time; % of peak against the HBM
  figure of the GPU (matched by device name; an arch-based guess is flagged in the JSON).

Other kernels (aiter's ``pa_fwd_asm``, vLLM's ``paged_attention_rocm``) are used only when they
import; their calls are written from those libraries' public signatures and have never been
run by this project, so any failure is recorded, never raised.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import adapters, checks, roofline
from ._table import format_rows
from .checks import Tolerance
from .roofline import DecodeShape

__all__ = [
    "GpuRequired",
    "NO_GPU_MESSAGE",
    "SCHEMA",
    "Settings",
    "Timing",
    "SHAPE_SETS",
    "shape_set",
    "require_gpu",
    "machine_info",
    "time_call",
    "implementations",
    "run",
    "write_results",
    "load_results",
    "results_table",
    "format_results",
    "plot_bandwidth",
    "plot_time",
]

SCHEMA = "pa_tile.bench/1"

NO_GPU_MESSAGE = (
    "timings need a ROCm GPU (a ROCm build of torch that sees an MI300/MI355); {why}. "
    "Nothing was timed: pa_tile never estimates or invents timings. On this machine use "
    "`python -m pa_tile roofline` for the time floors, and `check` / `trace` / `isa` for the kernels."
)


class GpuRequired(RuntimeError):
    """Timing was asked for where there is no ROCm GPU backend."""


def require_gpu() -> None:
    """Raise :class:`GpuRequired` (saying why) unless kernels run on a ROCm GPU in this process."""
    from .. import backend

    if not backend.gpu_available():
        hip = getattr(torch.version, "hip", None)
        why = ("torch is a CPU/CUDA build (torch.version.hip is not set)" if not hip
               else "torch is a ROCm build but sees no GPU")
        raise GpuRequired(NO_GPU_MESSAGE.format(why=why))
    try:
        chosen = backend.current_backend()
    except backend.BackendError as e:
        raise GpuRequired(NO_GPU_MESSAGE.format(why=str(e))) from e
    if chosen != "gpu":
        raise GpuRequired(NO_GPU_MESSAGE.format(
            why=f"the backend is {chosen!r} ({backend.ENV_VAR} or set_backend); the emulator cannot be timed"))


def machine_info() -> Dict[str, Any]:
    """Versions and the device, as recorded in every results file (GPU fields None without one)."""
    info: Dict[str, Any] = dict(
        python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
        torch_hip=getattr(torch.version, "hip", None), flydsl=None, pa_tile=None,
        gpu_name=None, arch=None, compute_units=None, gpu_memory_bytes=None,
        time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    try:
        import flydsl

        info["flydsl"] = getattr(flydsl, "__version__", None)
    except ImportError:
        pass
    from .. import __version__

    info["pa_tile"] = __version__
    from .. import backend

    if backend.gpu_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_name=p.name, arch=getattr(p, "gcnArchName", "").split(":", 1)[0] or None,
                    compute_units=p.multi_processor_count, gpu_memory_bytes=p.total_memory)
    return info


# ---------------------------------------------------------------------------------------------
# timing


@dataclasses.dataclass(frozen=True)
class Settings:
    warmup: int = 10
    iters: int = 50
    graph: bool = True
    cold_cache: bool = True
    flush_bytes: int = 512 << 20  # 2x the 256 MB Infinity Cache of MI300X / MI355X
    reps: int = 10  # launches per graph when the cache is kept hot (amortizes the replay)

    def __post_init__(self):
        for name in ("warmup", "iters", "reps", "flush_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}: expected an int >= {0 if name == 'warmup' else 1}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Timing:
    min_us: float
    median_us: float
    samples: int
    method: str  # "graph" or "eager"
    cache: str  # "cold" or "hot"
    note: Optional[str] = None

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def time_call(call: Callable[[], None], settings: Settings = Settings(), *, out: Optional[torch.Tensor] = None,
              verify: Optional[Callable[[torch.Tensor], Optional[str]]] = None) -> Timing:
    """Time ``call`` (one launch on the current stream) as the module docstring describes.

    With ``out`` and ``verify``: before timing, ``out`` is poisoned (NaN, or zeros for integer
    outputs), the captured graph replayed once, and ``verify(out)`` must return None (else the
    reason, raised as RuntimeError): proof that the replay, not an earlier eager call, wrote it.
    """
    require_gpu()
    for _ in range(max(1, settings.warmup)):
        call()
    torch.cuda.synchronize()
    reps = 1 if settings.cold_cache else settings.reps
    replay, method, note = None, "eager", None
    if settings.graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream before capture
                call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    call()
            replay, method = graph.replay, "graph"
        except Exception as e:  # noqa: BLE001 - recorded; eager timing is flagged in the results
            torch.cuda.synchronize()
            note = f"graph capture failed ({type(e).__name__}: {e}); timed eager launches"
    if replay is None:
        def replay():
            for _ in range(reps):
                call()
    if out is not None and verify is not None:
        torch.cuda.synchronize()
        if out.is_floating_point():
            out.fill_(float("nan"))
        else:
            out.zero_()
        replay()
        torch.cuda.synchronize()
        problem = verify(out)
        if problem:
            raise RuntimeError(f"after one {method} replay into a poisoned output: {problem}")
    flush = torch.empty(settings.flush_bytes, dtype=torch.uint8, device="cuda") if settings.cold_cache else None
    for _ in range(settings.warmup):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(settings.iters):
        if flush is not None:
            flush.zero_()
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)  # ms -> µs per launch
    return Timing(min(samples), statistics.median(samples), len(samples), method,
                  "cold" if settings.cold_cache else "hot", note)


# ---------------------------------------------------------------------------------------------
# what gets timed

@dataclasses.dataclass
class Prepared:
    call: Callable[[], None]  # one launch on the current stream, writing ``out``: what is timed
    out: torch.Tensor
    tolerance: Tolerance
    how: str
    first: Optional[Callable[[], None]] = None  # the checked run, if not ``call`` (validating entry point)


class _Impl:
    name = ""
    kind = ""

    def unavailable(self) -> Optional[str]:
        """None when usable here, else why not."""
        return None

    def prepare(self, case, arch: str) -> Prepared:
        """Raises ValueError/TypeError when the shape is not supported."""
        raise NotImplementedError


class StageImpl(_Impl):
    kind = "stage"

    def __init__(self, name: str):
        self.adapter = adapters.get(name)
        self.name = self.adapter.name

    def prepare(self, case, arch):
        inputs = self.adapter.inputs(case)
        out = torch.empty_like(inputs["query"])
        call, how = self.adapter.launcher(case, arch, out, inputs=inputs)
        first = lambda: self.adapter.module.paged_decode(**inputs, out=out, arch=arch)  # noqa: E731
        return Prepared(call, out, self.adapter.tolerance, how, first)


#: The baseline runs SDPA in the query's dtype; these bounds are its rounding, not a kernel's.
BASELINE_TOLERANCE = {
    torch.float32: Tolerance(1e-4, 1e-5),
    torch.float16: Tolerance(1e-2, 5e-3),
    torch.bfloat16: Tolerance(4e-2, 2e-2),
}


class BaselineImpl(_Impl):
    name = "torch"
    kind = "baseline"

    def prepare(self, case, arch):
        from .baseline import paged_decode_torch

        out = torch.empty_like(case.query)
        L = int(max(case.context_lengths.tolist()))

        def call():
            paged_decode_torch(case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lengths,
                               case.k_scale, case.v_scale, query_length=case.query_length,
                               max_context_length=L, out=out)

        return Prepared(call, out, BASELINE_TOLERANCE[case.query.dtype], "gather + dequantize + scaled_dot_product_attention")


def _per_token_rows(scale: torch.Tensor, case) -> torch.Tensor:
    """[kvh, num_blocks*block_size] float32: one scale per (kv head, cache slot)."""
    nb, kvh, bs = case.num_blocks, case.num_kv_heads, case.block_size
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(kvh, nb * bs).contiguous()
    return scale.permute(1, 0, 2).reshape(kvh, nb * bs).contiguous()


class AiterAsmImpl(_Impl):
    """aiter's assembly paged decode, ``aiter.pa_fwd_asm`` (K blocked, V trans-blocked, scales
    per (kv head, slot)); its bf16-query kernels get the query converted to bf16."""

    name = "aiter.pa_fwd_asm"
    kind = "external"

    def unavailable(self):
        try:
            import aiter
        except Exception as e:  # noqa: BLE001 - any import failure means "not here"
            return f"aiter does not import ({type(e).__name__}: {e})"
        return None if hasattr(aiter, "pa_fwd_asm") else "aiter has no pa_fwd_asm"

    def prepare(self, case, arch):
        import aiter

        if case.query_length != 1:
            raise ValueError("query_length > 1 is not wired for aiter.pa_fwd_asm here")
        q = case.query.to(torch.bfloat16)
        k = cache_layout("k_blocked", case.k_cache)
        v = cache_layout("v_trans_blocked", case.v_cache)
        ks, vs = _per_token_rows(case.k_scale, case), _per_token_rows(case.v_scale, case)
        out = torch.empty_like(q)
        bt = case.block_tables

        def call():
            # 6th argument: max_num_blocks in older aiter, block_tables_stride0 in newer; equal here.
            aiter.pa_fwd_asm(q, k, v, bt, case.context_lengths, bt.stride(0), K_QScale=ks, V_QScale=vs, out_=out)

        return Prepared(call, out, adapters.STAGE_TOLERANCE, "aiter.pa_fwd_asm (bf16 query)")


class VllmRocmImpl(_Impl):
    """vLLM's ROCm custom paged attention, ``vllm._custom_ops.paged_attention_rocm``, bound by
    parameter name (the signature changed between vLLM versions)."""

    name = "vllm.paged_attention_rocm"
    kind = "external"
    partition = 256  # the smallest partition vLLM's ROCm kernel has used: buffers big enough for any

    def unavailable(self):
        try:
            from vllm import _custom_ops as ops
        except Exception as e:  # noqa: BLE001
            return f"vllm does not import ({type(e).__name__}: {e})"
        return None if hasattr(ops, "paged_attention_rocm") else "vllm._custom_ops has no paged_attention_rocm"

    def prepare(self, case, arch):
        from vllm import _custom_ops as ops

        if case.query_length != 1 or case.scales != "per-tensor":
            raise ValueError("only query_length 1 with per-tensor scales is wired for vLLM here")
        fn = ops.paged_attention_rocm
        ns, qh, d = case.query.shape
        L = int(max(case.context_lengths.tolist()))
        parts = -(-L // self.partition)
        out = torch.empty_like(case.query)
        f32 = dict(dtype=torch.float32, device=case.query.device)
        sig = inspect.signature(fn)

        def scale_arg(name, t):
            ann = str(sig.parameters[name].annotation) if name in sig.parameters else ""
            return t if "Tensor" in ann else float(t.reshape(()))

        values = dict(
            out=out, exp_sum=torch.empty(ns, qh, parts, **f32), exp_sums=torch.empty(ns, qh, parts, **f32),
            max_logits=torch.empty(ns, qh, parts, **f32),
            tmp_out=torch.empty(ns, qh, parts, d, dtype=case.query.dtype, device=case.query.device),
            query=case.query, key_cache=cache_layout("k_blocked", case.k_cache).view(torch.uint8),
            value_cache=cache_layout("v_plain", case.v_cache).view(torch.uint8), num_kv_heads=case.num_kv_heads,
            scale=1.0 / math.sqrt(d), block_tables=case.block_tables, seq_lens=case.context_lengths,
            context_lens=case.context_lengths, query_start_loc=None, block_size=case.block_size,
            max_seq_len=L, max_context_len=L, alibi_slopes=None, kv_cache_dtype="fp8",
            k_scale=scale_arg("k_scale", case.k_scale), v_scale=scale_arg("v_scale", case.v_scale),
            fp8_out_scale=None,
        )
        kwargs = {}
        for p in sig.parameters.values():
            if p.name in values:
                kwargs[p.name] = values[p.name]
            elif p.default is inspect.Parameter.empty:
                raise TypeError(f"vllm.paged_attention_rocm: unrecognized required parameter {p.name!r} in this version")

        def call():
            fn(**kwargs)

        return Prepared(call, out, adapters.STAGE_TOLERANCE, "vllm._custom_ops.paged_attention_rocm (kv_cache_dtype fp8)")


def cache_layout(name: str, logical: torch.Tensor) -> torch.Tensor:
    from .. import cache

    return {"k_blocked": cache.to_k_blocked, "v_plain": cache.to_v_plain,
            "v_trans_blocked": cache.to_v_trans_blocked}[name](logical)


EXTERNALS = (AiterAsmImpl, VllmRocmImpl)


def implementations(stages: Optional[Sequence[str]] = None, *, baseline: bool = True,
                    external: bool = True) -> List[_Impl]:
    """What :func:`run` times: the stages (default: every one present), then the baseline, then
    the external kernels that import."""
    names = adapters.stage_names() if stages is None else list(stages)
    impls: List[_Impl] = [StageImpl(n) for n in names]
    if baseline:
        impls.append(BaselineImpl())
    if external:
        impls += [cls() for cls in EXTERNALS]
    return impls


# ---------------------------------------------------------------------------------------------
# shapes

SHAPE_SETS = {
    "quick": dict(batches=(1, 16, 128), contexts=(129, 2048, 16384), head_dims=(128,)),
    "upstream": dict(),
}


def shape_set(name: str, **kwargs) -> List[DecodeShape]:
    """``'quick'`` (9 shapes, head_dim 128) or ``'upstream'`` (roofline.upstream_shapes())."""
    if name not in SHAPE_SETS:
        raise ValueError(f"shape set: expected one of {sorted(SHAPE_SETS)}, got {name!r}")
    return roofline.upstream_shapes(**{**SHAPE_SETS[name], **kwargs})


# ---------------------------------------------------------------------------------------------
# the run


def _record(impl: _Impl, shape: DecodeShape, **kw) -> Dict:
    rec = dict(impl=impl.name, kind=impl.kind, shape=shape.to_dict(), label=shape.label, status=None, reason=None,
               how=None, check=None, timing=None, time_us=None, median_us=None, bytes=None, floor_us=None,
               bandwidth_tb_s=None, pct_hbm_peak=None, tflops=None)
    rec.update(kw)
    return rec


def _measure(impl: _Impl, case, ref: torch.Tensor, shape: DecodeShape, arch: str, spec: roofline.GpuSpec,
             settings: Settings) -> Dict:
    why = impl.unavailable()
    if why:
        return _record(impl, shape, status="unavailable", reason=why)
    try:
        prep = impl.prepare(case, arch)
    except (ValueError, TypeError) as e:
        return _record(impl, shape, status="unsupported", reason=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return _record(impl, shape, status="error", reason=f"prepare: {type(e).__name__}: {e}")
    call, out, tol = prep.call, prep.out, prep.tolerance
    rec = _record(impl, shape, how=prep.how)
    try:
        (prep.first or call)()
        torch.cuda.synchronize()
    except (ValueError, TypeError) as e:
        rec.update(status="unsupported", reason=f"{type(e).__name__}: {e}")
        return rec
    except Exception as e:  # noqa: BLE001
        rec.update(status="error", reason=f"first launch: {type(e).__name__}: {e}")
        return rec
    res = checks.compare(out, ref, tol)
    rec["check"] = res.to_dict()
    if not res.ok:
        rec.update(status="check_failed", reason=str(res))
        return rec

    def verify(o):
        again = checks.compare(o, ref, tol)
        return None if again.ok else str(again)

    try:
        t = time_call(call, settings, out=out, verify=verify)
    except Exception as e:  # noqa: BLE001
        rec.update(status="error", reason=f"timing: {type(e).__name__}: {e}")
        return rec
    nbytes = roofline.traffic(shape).total
    sec = t.min_us * 1e-6
    rec.update(status="ok", timing=t.to_dict(), time_us=t.min_us, median_us=t.median_us, bytes=nbytes,
               floor_us=roofline.time_floor(shape, spec).time_us, bandwidth_tb_s=nbytes / sec / 1e12,
               pct_hbm_peak=100.0 * nbytes / sec / spec.hbm_bytes_per_s, tflops=roofline.flops(shape) / sec / 1e12)
    return rec


def failures(results: Dict) -> List[Dict]:
    """Records of a results dict whose correctness check failed or that errored (not merely
    unavailable or unsupported here): any makes ``pa_tile bench`` exit non-zero."""
    return [r for r in results.get("results", []) if r.get("status") in ("check_failed", "error")]


def run(stages: Optional[Sequence[str]] = None, shapes: Optional[Iterable[DecodeShape]] = None, *,
        baseline: bool = True, external: bool = True, settings: Settings = Settings(), seed: int = 0,
        out_path: Optional[Union[str, os.PathLike]] = None, peak: Optional[roofline.GpuSpec] = None,
        progress: Optional[Callable[[str], None]] = print) -> Dict:
    """Check then time every implementation on every shape; returns (and writes) the results.

    ``shapes`` default to ``shape_set('quick')``; ``peak`` overrides the GPU figures used for %
    of peak. Raises :class:`GpuRequired` at once when there is no ROCm GPU backend.
    """
    require_gpu()
    from .. import backend

    backend.ensure_backend()
    shapes = shape_set("quick") if shapes is None else list(shapes)
    impls = implementations(stages, baseline=baseline, external=external)
    info = machine_info()
    arch = backend.default_arch()
    if peak is None:
        spec, peak_note = roofline.gpu_for_device(info["gpu_name"] or "", arch)
    else:
        spec, peak_note = peak, "given by the caller"
    results = dict(schema=SCHEMA, machine=info, arch=arch, peak=dict(spec.to_dict(), note=peak_note),
                   settings=dataclasses.asdict(settings), seed=seed, results=[])
    say = progress or (lambda s: None)
    for shape in shapes:
        case = ref = None
        try:
            case = adapters.make_case(shape, arch, seed=seed, device="cuda")
            ref = checks.reference_output(case)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for this shape: recorded
            for impl in impls:
                results["results"].append(_record(impl, shape, status="error", reason=f"case: {type(e).__name__}: {e}"))
            say(f"[bench] {shape.label}: could not build the case ({e})")
        else:
            for impl in impls:
                rec = _measure(impl, case, ref, shape, arch, spec, settings)
                results["results"].append(rec)
                if rec["status"] == "ok":
                    say(f"[bench] {shape.label:<48} {impl.name:<26} {rec['time_us']:9.2f} µs "
                        f"{rec['bandwidth_tb_s']:6.2f} TB/s {rec['pct_hbm_peak']:5.1f}% of peak")
                else:
                    say(f"[bench] {shape.label:<48} {impl.name:<26} {rec['status']}: {rec['reason']}")
        del case, ref
        torch.cuda.empty_cache()
        if out_path is not None:  # keep what finished if a later shape takes the process down
            write_results(results, out_path)
    return results


# ---------------------------------------------------------------------------------------------
# results files


def write_results(results: Dict, path: Union[str, os.PathLike]) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)
    return path


def load_results(source: Union[str, os.PathLike, Dict]) -> Dict:
    """A results dict from a path (or passed through), checked to be a pa_tile bench file."""
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"not a pa_tile benchmark results file (schema {data.get('schema')!r}, expected {SCHEMA!r})")
    if not isinstance(data.get("results"), list):
        raise ValueError("results file has no 'results' list")
    return data


def results_table(source, *, status: Optional[str] = None) -> List[Dict]:
    """Flat rows for display: shape, implementation, status, µs, floor, TB/s, % of peak."""
    data = load_results(source)
    rows = []
    for r in data["results"]:
        if status is not None and r["status"] != status:
            continue
        s = r["shape"]
        ctx = s["context"] if isinstance(s["context"], int) else max(s["context"])
        rows.append(dict(batch=s["batch"], context=ctx, head_dim=s["head_dim"], heads=f"{s['num_q_heads']}/{s['num_kv_heads']}",
                         ql=s["query_length"], scales=s["scales"], impl=r["impl"], status=r["status"],
                         time_us=r["time_us"], floor_us=r["floor_us"], tb_s=r["bandwidth_tb_s"], pct_peak=r["pct_hbm_peak"],
                         reason=None if r["status"] == "ok" else (r["reason"] or "")[:60]))
    return rows


def format_results(source) -> str:
    data = load_results(source)
    m, p = data["machine"], data["peak"]
    head = (f"{m.get('gpu_name')} ({data.get('arch')}), torch {m.get('torch')} hip {m.get('torch_hip')}, "
            f"flydsl {m.get('flydsl')}; peak {p['hbm_tb_s']:.1f} TB/s ({p['note']})")
    return head + "\n" + format_rows(results_table(data), headers=dict(time_us="µs", floor_us="floor µs", tb_s="TB/s",
                                                                        pct_peak="% peak"))


def _ok_series(data: Dict, head_dim, batch, key: str):
    series: Dict[Tuple, List[Tuple[int, float]]] = {}
    for r in data["results"]:
        if r["status"] != "ok":
            continue
        s = r["shape"]
        if head_dim is not None and s["head_dim"] != head_dim:
            continue
        if batch is not None and s["batch"] != batch:
            continue
        ctx = s["context"] if isinstance(s["context"], int) else max(s["context"])
        series.setdefault((r["impl"], s["batch"], s["head_dim"]), []).append((ctx, r[key]))
    return {k: sorted(v) for k, v in series.items()}


def plot_bandwidth(source, *, head_dim: Optional[int] = None, batch: Optional[int] = None, ax=None):
    """Achieved TB/s vs context length per (implementation, batch), with the HBM peak line."""
    import matplotlib.pyplot as plt

    data = load_results(source)
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    for (impl, b, d), pts in _ok_series(data, head_dim, batch, "bandwidth_tb_s").items():
        ax.semilogx([c for c, _ in pts], [v for _, v in pts], marker="o", ms=3, label=f"{impl} b{b} d{d}")
    peak = data["peak"]["hbm_tb_s"]
    ax.axhline(peak, color="k", ls="--", lw=1, label=f"HBM peak {peak:.1f} TB/s")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("achieved bandwidth (TB/s)")
    ax.set_title(f"{data['machine'].get('gpu_name')}: bytes moved / measured time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_time(source, *, head_dim: Optional[int] = None, batch: Optional[int] = None, ax=None):
    """Measured µs vs context length per (implementation, batch), with the roofline floor dashed."""
    import matplotlib.pyplot as plt

    data = load_results(source)
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    for (impl, b, d), pts in _ok_series(data, head_dim, batch, "time_us").items():
        ax.loglog([c for c, _ in pts], [v for _, v in pts], marker="o", ms=3, label=f"{impl} b{b} d{d}")
    floors = _ok_series(data, head_dim, batch, "floor_us")
    seen = set()
    for (impl, b, d), pts in floors.items():
        if (b, d) in seen:
            continue
        seen.add((b, d))
        ax.loglog([c for c, _ in pts], [v for _, v in pts], "k--", lw=1, label=f"HBM floor b{b} d{d}")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time per call (µs)")
    ax.set_title(f"{data['machine'].get('gpu_name')}: min of {data['settings']['iters']} "
                 f"{'cold' if data['settings']['cold_cache'] else 'hot'}-cache graph replays")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
