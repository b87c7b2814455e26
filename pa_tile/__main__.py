"""``python -m pa_tile`` (or ``pa-tile``): the kernel engineer's command line.

Subcommands: ``isa`` (static facts of the compiled code, or a diff), ``check`` (run a kernel
against the reference), ``trace`` (memory-access report from the emulator), ``bench`` (GPU
timings; needs a ROCm GPU), ``roofline`` (bytes, flops and time floors), ``predict`` (the timing
model's time for a stage and shape), ``validate`` (the timing model against a ``bench`` results file),
``overhead`` (host time per call). ``--kernel tiny``
selects ``pa_tile.tiny_kernels.scale_add`` instead of a stage. Exit codes: 0 success, 1 a
check failed, 2 bad arguments or an environment that cannot do what was asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
ARCHS = ("gfx942", "gfx950")


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit code 2."""


def _not_kernel_failures():
    from .backend import BackendError
    from .emu.launch import EmuSetupError
    from .perf.adapters import AdapterError
    from .toolchain import ToolchainError

    # EmuSetupError: the emulator cannot start here (no C compiler, an unsupported FlyDSL):
    # the machine's setup, not the kernel, so exit 2 like the other setup errors.
    return (CliError, BackendError, EmuSetupError, AdapterError, ToolchainError, ValueError, TypeError, OSError)


# ---------------------------------------------------------------------------------------------
# argument helpers


def _int_list(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _pos_int(text: str) -> int:
    vals = _int_list(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return vals[0]


def _stage_help() -> str:
    from .stages import STAGES, available

    have = available()
    also = "" if list(have) == list(STAGES) else f" (all stages: {', '.join(STAGES)})"
    return f"stage short name: one of {', '.join(have) or 'none'}{also}"


def _check_stage(name: str) -> str:
    from .stages import STAGES, available

    have = available()
    if name in have:
        return name
    for short, (mod, _) in STAGES.items():
        if name in (mod, mod.rsplit(".", 1)[1]):
            if short in have:
                return short
            name = short
            break
    if name in STAGES:
        raise CliError(f"stage {name!r} is not built (its notebook was not exported yet); "
                       f"available stages: {', '.join(have) or 'none'}")
    raise CliError(f"unknown stage {name!r}; available stages: {', '.join(have) or 'none'} "
                   f"(known names: {', '.join(STAGES)}; or use --kernel tiny)")


def _add_target(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--stage", metavar="NAME", help=_stage_help())
    g.add_argument("--kernel", choices=["tiny"],
                   help="a tiny demo kernel instead of a stage: 'tiny' = tiny_kernels.scale_add (Out = 2X + Y)")


def _add_shape(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shape (defaults: the stage's small supported shape)")
    g.add_argument("--batch", type=_pos_int, help="number of sequences")
    g.add_argument("--context", type=_int_list, metavar="L[,L...]",
                   help="context length for every sequence, or one per sequence (sets --batch)")
    g.add_argument("--q-heads", type=_pos_int, help="query heads")
    g.add_argument("--kv-heads", type=_pos_int, help="KV heads")
    g.add_argument("--head-dim", type=_pos_int)
    g.add_argument("--block-size", type=_pos_int, help="tokens per page")
    g.add_argument("--query-length", type=_pos_int, help="query tokens per sequence (MTP)")
    g.add_argument("--scales", choices=["per-tensor", "per-token"])
    g.add_argument("--seed", type=int, default=0, help="random seed of the case's tensors")


def _shape(args, default):
    """A DecodeShape from the shape options, unset ones taken from ``default``."""
    from .perf.roofline import DecodeShape

    ctx = args.context
    batch = args.batch
    if ctx is None:
        context = default.context
        if batch is not None and not isinstance(context, int):
            context = max(context)
        batch = batch or default.batch
    elif len(ctx) == 1:
        context, batch = ctx[0], batch or default.batch
    else:
        if batch is not None and batch != len(ctx):
            raise CliError(f"--context gives {len(ctx)} lengths but --batch is {batch}")
        context, batch = tuple(ctx), len(ctx)
    q, kv = args.q_heads, args.kv_heads
    if q is None and kv is not None:
        q = kv * default.group
    try:
        return DecodeShape(
            batch=batch, context=context, num_q_heads=q or default.num_q_heads,
            num_kv_heads=kv or default.num_kv_heads, head_dim=args.head_dim or default.head_dim,
            block_size=args.block_size or default.block_size, query_length=args.query_length or default.query_length,
            scales=args.scales or default.scales,
        )
    except (ValueError, TypeError) as e:
        raise CliError(f"bad shape: {e}") from None


# ---------------------------------------------------------------------------------------------
# isa


def _isa_text(target: str, arch: str, args) -> str:
    from .perf import adapters

    if target == "tiny":
        return adapters.get("tiny").compile_isa(arch)
    ad = adapters.get(target)
    shape = _shape(args, ad.default_shape())
    return ad.compile_isa(ad.make_case(shape, arch, seed=args.seed), arch)


def _stats(text: str):
    from . import isa

    return [isa.IsaStats.from_asm(text, n) for n in isa.kernel_names(text)]


def _diff_target(diff: str, target: str, arch: str):
    """(target, arch, labels) to compare with; refused here, before anything compiles."""
    if diff in ARCHS:
        return target, diff, (f"{target} {arch}", f"{target} {diff}")
    if diff.lower().startswith("gfx"):
        raise CliError(f"--diff {diff}: pa_tile compiles for {' and '.join(ARCHS)} only")
    other = "tiny" if diff == "tiny" else _check_stage(diff)
    return other, arch, (f"{target} {arch}", f"{other} {arch}")


def cmd_isa(args) -> int:
    from . import isa

    target = "tiny" if args.kernel else _check_stage(args.stage)
    other = None if args.diff is None else _diff_target(args.diff, target, args.arch)
    a = _stats(_isa_text(target, args.arch, args))
    if other is None:
        if args.json:
            print(json.dumps([s.to_dict() for s in a], indent=1, default=str))
        else:
            print("\n\n".join(isa.summary(s) for s in a))
        return EXIT_OK
    other_target, other_arch, labels = other
    b = _stats(_isa_text(other_target, other_arch, args))
    if args.json:
        print(json.dumps([dict(a=x.to_dict(), b=y.to_dict(), rows=isa.diff_rows(x, y)) for x, y in zip(a, b)],
                         indent=1, default=str))
        return EXIT_OK
    parts = [f"{x.kernel} vs {y.kernel}\n" + isa.diff(x, y, labels=labels) for x, y in zip(a, b)]
    if len(a) != len(b):
        parts.append(f"note: {labels[0]} has {len(a)} kernel(s), {labels[1]} has {len(b)}; compared the first {min(len(a), len(b))}")
    print("\n\n".join(parts))
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# check


def cmd_check(args) -> int:
    from . import backend
    from .perf import adapters, checks

    if args.backend:
        backend.set_backend(args.backend, source=f"--backend {args.backend}")
    name = backend.current_backend()  # BackendError if the GPU was asked for and is missing
    arch = args.arch or backend.default_arch()
    device = backend.device_for_tensors()
    if args.kernel:
        k = adapters.get("tiny")
        x, y, out = k.tensors(device, seed=args.seed)
        what, tol = "tiny (scale_add)", k.tolerance
        run_it, expected = (lambda: k.run(x, y, out, arch)), (lambda: k.reference(x, y))
    else:
        ad = adapters.get(_check_stage(args.stage))
        shape = _shape(args, ad.default_shape())
        case = ad.make_case(shape, arch, seed=args.seed, device=device)
        what, tol = f"stage {ad.name} ({shape.label})", ad.tolerance
        run_it, expected = (lambda: ad.run(case, arch)), (lambda: checks.reference_output(case))
    # before the run, so a long emulator run shows what it is doing (its progress bar follows)
    print(f"{what} on {name} {arch}", flush=True)
    try:
        got = run_it()
    except _not_kernel_failures():
        raise  # refused arguments or a broken setup: a usage error, not a failed check
    except Exception as e:  # noqa: BLE001 - the kernel itself failed (memory fault, ...): a FAIL
        print(f"FAIL: the run raised {type(e).__name__}: {e}")
        return EXIT_FAIL
    res = checks.compare(got, expected(), _tol(args, tol))
    print(res)
    return EXIT_OK if res.ok else EXIT_FAIL


def _tol(args, default):
    from .perf.checks import Tolerance

    return Tolerance(args.max_rel if args.max_rel is not None else default.max_rel,
                     args.rms_rel if args.rms_rel is not None else default.rms_rel)


# ---------------------------------------------------------------------------------------------
# trace


def cmd_trace(args) -> int:
    from . import backend
    from .emu import launch
    from .perf import tracing

    if args.json:
        _check_writable(args.json)  # before a run that can take minutes
    backend.set_backend("emu")  # the access trace exists only in the emulator
    arch = args.arch or launch.current_arch()
    if args.kernel:
        target, run_it = "tiny", lambda: tracing.trace_tiny(arch)
    else:
        from .perf import adapters

        ad = adapters.get(_check_stage(args.stage))
        shape = _shape(args, ad.default_shape())
        target, run_it = f"stage {ad.name}", lambda: tracing.trace_stage(ad.name, shape, arch, seed=args.seed)
    try:
        rep = run_it()
    except _not_kernel_failures():
        raise  # refused arguments or a broken setup: a usage error, not a failed check
    except Exception as e:  # noqa: BLE001 - the kernel failed in the emulator (memory fault, ...)
        print(f"{target} on emu {arch}\nFAIL: the run raised {type(e).__name__}: {e}")
        return EXIT_FAIL
    print(rep.format(), flush=True)  # first: a failing write must not lose the report
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.to_dict(), f, indent=1, default=str)
    return EXIT_OK if rep.check is None or rep.check.ok else EXIT_FAIL


def _check_writable(path: str) -> None:
    import os

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"--json {path}: is a folder")
    if not os.path.isdir(parent):
        raise CliError(f"--json {path}: folder {parent} does not exist")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise CliError(f"--json {path}: not writable")


# ---------------------------------------------------------------------------------------------
# bench


def cmd_bench(args) -> int:
    from .perf import bench, roofline

    if args.show:
        print(bench.format_results(args.show))
        return EXIT_OK
    try:
        bench.require_gpu()
    except bench.GpuRequired as e:
        print(f"pa_tile bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    stages = None
    if args.stages is not None:
        stages = [_check_stage(s) for s in args.stages.split(",") if s]
    overrides = {}
    if args.batch:
        overrides["batches"] = tuple(args.batch)
    if args.context:
        overrides["contexts"] = tuple(args.context)
    if args.head_dim:
        overrides["head_dims"] = tuple(args.head_dim)
    if args.q_heads or args.kv_heads:
        overrides["heads"] = ((args.q_heads or 8 * (args.kv_heads or 8), args.kv_heads or 8),)
    extra = dict(block_size=args.block_size, query_length=args.query_length, scales=args.scales)
    shapes = bench.shape_set(args.shapes, **overrides, **extra)
    settings = bench.Settings(warmup=args.warmup, iters=args.iters, graph=not args.no_graph, cold_cache=not args.hot)
    peak = None
    if args.peak_tbs:
        from .perf.roofline import GpuSpec

        base = roofline.GPUS["MI300X"]
        peak = GpuSpec(f"given {args.peak_tbs} TB/s", "", args.peak_tbs * 1e12, base.compute_units,
                       base.peak_clock_mhz, base.fp8_flops_per_clock_per_cu, "--peak-tbs")
    results = bench.run(stages, shapes, baseline=not args.no_baseline, external=not args.no_external,
                        settings=settings, seed=args.seed, out_path=args.out, peak=peak)
    print(bench.format_results(results))
    print(f"results written to {args.out}")
    bad = bench.failures(results)
    if bad:
        print(f"pa_tile bench: {len(bad)} of {len(results['results'])} runs failed their check or errored "
              f"(first: {bad[0].get('impl')} {bad[0].get('status')}: {(bad[0].get('reason') or '')[:100]})",
              file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# roofline


def cmd_roofline(args) -> int:
    from .perf import roofline

    gpus = [g for g in args.gpu.split(",") if g]
    try:
        specs = [roofline.gpu_spec(g) for g in gpus]
        shapes = roofline.upstream_shapes(
            batches=args.batch or roofline.BATCHES, contexts=args.context or roofline.CONTEXTS,
            head_dims=args.head_dim or roofline.HEAD_DIMS,
            heads=((args.q_heads, args.kv_heads),), block_size=args.block_size,
            query_length=args.query_length, scales=args.scales)
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    rows = roofline.table(shapes, specs, whole_pages=args.whole_pages)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(roofline.format_table(rows))
        for s in specs:
            print(f"{s.name}: {s.hbm_tb_s:g} TB/s HBM, {s.compute_units} CUs, {s.fp8_dense_flops / 1e12:.0f} TFLOP/s "
                  f"dense fp8 (ridge {s.ridge_flops_per_byte:.0f} flop/B) [{s.source}]")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install 'pa_tile[plot]'") from None

        matplotlib.use("Agg")
        roofline.plot(shapes, specs, whole_pages=args.whole_pages).savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")
    return EXIT_OK


def cmd_overhead(args) -> int:
    from . import backend
    from .perf import overhead

    backend.set_backend("emu")  # the emulator stands in for the device; on a GPU, `bench` times real calls
    backend.ensure_backend()
    result = overhead.measure(calls=args.calls, repeats=args.repeats, arch=args.arch)
    if args.json:
        print(json.dumps({"us": result.us, "ratios": result.ratios, "stub": result.stub,
                          "targets": overhead.TARGETS,
                          "op_to_direct": result.op_to_direct, "op_to_direct_target": overhead.OP_TO_DIRECT,
                          "met": result.meets_targets()}, indent=1))
    else:
        print(result.report())
    return EXIT_OK if result.meets_targets() else EXIT_FAIL


# ---------------------------------------------------------------------------------------------
# predict (the timing model, pa_tile.perf.model)


def _add_predict_parser(add_parser) -> None:
    s = add_parser("predict", help="PREDICTED kernel time on MI300X / MI355X from the timing model "
                                   "(compiled code + an emulated sample), with the HBM floor",
                   description="Predict one stage's kernel time at a problem shape with pa_tile.perf.model: "
                               "it emulates one sequence of one KV head at two short contexts, walks the "
                               "compiled code, and combines occupancy, issue, waitcnt latency, LDS, grid "
                               "waves, HBM and the reduce kernel. A model, not a measurement (its validation: "
                               "pa_tile/data/model_validation.md). Last line: predicted_us=<float> floor_us=<float>.")
    s.add_argument("--stage", metavar="NAME", required=True, help=_stage_help())
    s.add_argument("--gpu", choices=["mi300x", "mi308x", "mi355x"], default="mi300x",
                   help="default mi300x; mi308x (80 CUs) is the part the model's validation timings were measured on")
    _add_shape(s)
    s.add_argument("--partitions", type=_pos_int, help="split-K count (default: the stage's own choice)")
    s.add_argument("--schedule", choices=["balanced", "uniform"],
                   help="stage 6: how the split lays out its work (default: the stage's choice, balanced when "
                        "it splits); a ragged batch is --context L1,L2,...")
    s.add_argument("--json", action="store_true", help="print the prediction as JSON before the last line")
    s.set_defaults(func=cmd_predict)


def cmd_predict(args) -> int:
    from . import backend
    from .perf import adapters, model

    backend.set_backend("emu")  # the sample runs in the emulator
    ad = adapters.get(_check_stage(args.stage))
    shape = _shape(args, ad.default_shape())
    pred = model.predict_stage(ad.name, shape, args.gpu, partitions=args.partitions, schedule=args.schedule)
    if args.json:
        print(json.dumps(pred.to_dict(), indent=1, default=str))
        print(f"predicted_us={pred.predicted_us:.3f} floor_us={pred.floor_us:.3f}")
    else:
        print(model.format_prediction(pred))
    return EXIT_OK


def _add_validate_parser(add_parser) -> None:
    s = add_parser("validate", help="the timing model against your measurements: every stage timed in a "
                                    "`pa_tile bench` results file, PREDICTED beside MEASURED",
                   description="Predict every stage launch a `pa_tile bench` results file timed (status ok), at "
                               "its shape, on the GPU it ran on (by device name, else arch; its CU count as "
                               "recorded), with pa_tile.perf.model, and print both with the error. Runs the "
                               "model's samples in the emulator, in this process. Last line: "
                               "within_15=<n>/<points> median_abs_err=<float>.")
    s.add_argument("results", metavar="FILE", help="a results JSON written by `python -m pa_tile bench --out FILE`")
    s.add_argument("--stages", metavar="NAMES", help="comma-separated stages to compare (default: every stage timed)")
    s.add_argument("--json", metavar="OUT", help="also write the comparison rows and summary as JSON to OUT")
    s.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    from . import backend
    from .perf import bench, validation

    backend.set_backend("emu")  # the model's samples run in the emulator
    data = bench.load_results(args.results)
    stages = [_check_stage(n) for n in args.stages.split(",")] if args.stages else None
    _, note = validation.model_hardware(data)
    rows = validation.compare(data, stages=stages)
    print(validation.format_comparison(rows, note=f"{args.results}: measured on {note}; PREDICTED by pa_tile.perf.model"))
    s = validation.summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(note=note, summary=s, rows=[r.to_dict() for r in rows]), indent=1))
    print(f"within_15={s['within']}/{s['points']} median_abs_err={s['median_abs_err']:.4f}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option with a real default shows it, once (not "default: None", and not where the
    help already states it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if any(action.default is d for d in (None, False, argparse.SUPPRESS)) or "default" in text:  # not ==: 0 == False
            return text
        return super()._get_help_string(action)


class _MainHelpFormatter(argparse.RawDescriptionHelpFormatter, _HelpFormatter):
    """The examples in the epilog keep their line breaks."""


def _common_options() -> argparse.ArgumentParser:
    # Also accepted after the verb; SUPPRESS keeps a subcommand from resetting the value
    # given before it.
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                   help="show Python tracebacks for errors")
    return c


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    common = _common_options()
    p = argparse.ArgumentParser(
        prog="python -m pa_tile",
        description="pa_tile: fp8 paged-attention decode kernels for MI300 (gfx942) / MI355 (gfx950).\n"
                    "Inspect compiled code, check kernels against the reference, trace memory accesses\n"
                    "in the emulator, benchmark on a ROCm GPU, print roofline time floors.\n"
                    "Exit codes: 0 success, 1 a check failed, 2 bad arguments or a setup that cannot\n"
                    "do what was asked.",
        epilog="Examples:\n"
               "  python -m pa_tile isa --kernel tiny --arch gfx942 --diff gfx950\n"
               "  python -m pa_tile check --stage s2 --context 300,129\n"
               "  python -m pa_tile trace --stage s2 --arch gfx950\n"
               "  python -m pa_tile roofline --batch 1,64 --context 2048,16384\n"
               "  python -m pa_tile bench --shapes quick --out bench.json   (ROCm GPU only)\n"
               "  python -m pa_tile validate bench.json   (the timing model against those timings)",
        formatter_class=_MainHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"pa_tile {__version__}")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add_parser(name, **kw):
        return sub.add_parser(name, parents=[common], formatter_class=_HelpFormatter, **kw)

    s = add_parser("isa", help="static facts of a kernel's compiled code (registers, LDS, occupancy, "
                                   "instruction mix), or a diff of two",
                       description="Compile a stage (or the tiny kernel) for an arch on this machine and print its "
                                   "static facts; --diff compares with another arch or another stage.")
    _add_target(s)
    s.add_argument("--arch", choices=ARCHS, default="gfx942", help="target")
    s.add_argument("--diff", metavar="ARCH|STAGE",
                   help="compare with the same kernel on another arch (gfx942/gfx950) or with another stage (or 'tiny')")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_shape(s)
    s.set_defaults(func=cmd_isa)

    s = add_parser("check", help="run a kernel on the chosen backend and compare with the reference "
                                     "(exit 1 on mismatch)",
                       description="Run a stage (or the tiny kernel) on one case and compare with the float32 "
                                   "reference. Exit 0 when within tolerance, 1 when not.")
    _add_target(s)
    s.add_argument("--backend", choices=["auto", "emu", "gpu"], help="where to run (default: PA_TILE_BACKEND or auto)")
    s.add_argument("--arch", choices=ARCHS, help="target (default: the GPU's, or gfx942 in the emulator)")
    s.add_argument("--max-rel", type=float, help="tolerance on max|out-ref| / max|ref| (default: the stage's)")
    s.add_argument("--rms-rel", type=float, help="tolerance on ||out-ref|| / ||ref|| (default: the stage's)")
    _add_shape(s)
    s.set_defaults(func=cmd_check)

    s = add_parser("trace", help="memory-access report from the emulator: bytes and 128-byte lines per "
                                     "load, LDS bank conflicts, instructions per tile",
                       description="Run a kernel once in the CPU emulator with an access trace and report "
                                   "coalescing, LDS bank conflicts and the dynamic instruction mix.")
    _add_target(s)
    s.add_argument("--arch", choices=ARCHS, help="target (default gfx942, or ARCH)")
    s.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    _add_shape(s)
    s.set_defaults(func=cmd_trace)

    s = add_parser("bench", help="time stages, the PyTorch baseline and installed kernels on a ROCm GPU "
                                     "(refuses elsewhere, exit 2)",
                       description="Check, then time (CUDA graph replay, GPU events, min of N) every stage, the "
                                   "PyTorch baseline and installed paged-attention kernels; results to JSON. "
                                   "Needs a ROCm GPU: elsewhere it says so and exits 2 (nothing is invented).")
    s.add_argument("--show", metavar="JSON", help="print a results file from an earlier run and exit (any machine)")
    s.add_argument("--stages", metavar="S1,S2", help="stages to time (default: all present)")
    s.add_argument("--shapes", choices=["quick", "upstream"], default="quick",
                   help="quick: 9 shapes at head_dim 128; upstream: the full roofline grid")
    s.add_argument("--batch", type=_int_list, metavar="B,...", help="override the batches of the shape set")
    s.add_argument("--context", type=_int_list, metavar="L,...", help="override the context lengths")
    s.add_argument("--head-dim", type=_int_list, metavar="D,...", help="override the head dims")
    s.add_argument("--q-heads", type=_pos_int, help="query heads (default: the shape set's; 8 per KV head with --kv-heads)")
    s.add_argument("--kv-heads", type=_pos_int, help="KV heads (default: the shape set's; 8 with --q-heads)")
    s.add_argument("--block-size", type=_pos_int, default=16, help="tokens per page")
    s.add_argument("--query-length", type=_pos_int, default=1, help="query tokens per sequence (MTP)")
    s.add_argument("--scales", choices=["per-tensor", "per-token"], default="per-tensor", help="K/V scale granularity")
    s.add_argument("--warmup", type=int, default=10, help="untimed runs first")
    s.add_argument("--iters", type=_pos_int, default=50, help="timed samples; the minimum is reported")
    s.add_argument("--hot", action="store_true", help="keep caches warm (default: flush 512 MiB before each sample)")
    s.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA graph replays")
    s.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baseline")
    s.add_argument("--no-external", action="store_true", help="skip aiter / vLLM kernels even if installed")
    s.add_argument("--peak-tbs", type=float, help="HBM peak (TB/s) for %% of peak, instead of the data-sheet figure")
    s.add_argument("--seed", type=int, default=0, help="random seed of the cases' tensors")
    s.add_argument("--out", default="pa_tile_bench.json", help="results file")
    s.set_defaults(func=cmd_bench)

    s = add_parser("roofline", help="bytes, flops and HBM time floor of decode calls on MI300X / MI355X",
                       description="Bytes moved, flops, arithmetic intensity and time floor (bytes / HBM "
                                   "bandwidth) of one decode call over a grid of shapes.")
    s.add_argument("--gpu", default="MI300X,MI355X", help="comma-separated, of MI300X and MI355X")
    s.add_argument("--batch", type=_int_list, metavar="B,...", help="batches (default 1,4,16,64,128,256)")
    s.add_argument("--context", type=_int_list, metavar="L,...", help="context lengths (default 129..16384)")
    s.add_argument("--head-dim", type=_int_list, metavar="D,...", help="head dims (default 64,128)")
    s.add_argument("--q-heads", type=_pos_int, default=64, help="query heads")
    s.add_argument("--kv-heads", type=_pos_int, default=8, help="KV heads")
    s.add_argument("--block-size", type=_pos_int, default=16, help="tokens per page")
    s.add_argument("--query-length", type=_pos_int, default=1, help="query tokens per sequence (MTP)")
    s.add_argument("--scales", choices=["per-tensor", "per-token"], default="per-tensor", help="K/V scale granularity")
    s.add_argument("--whole-pages", action="store_true", help="count K/V of whole pages (the last page's tail too)")
    s.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    s.add_argument("--plot", metavar="PNG", help="also save a log-log plot of the floors")
    s.set_defaults(func=cmd_roofline)

    s = add_parser("overhead", help="host time per call of paged_decode, Plan.run and the op, device work "
                                    "skipped, against a tiny torch SDPA call",
                   description="Steady-state host time per call with the kernel's execution replaced by a "
                               "no-op at the launch boundary (the emulator stands in for the device); exits 1 "
                               "when Plan.run exceeds 5x or paged_decode 10x the SDPA call.")
    s.add_argument("--arch", choices=["gfx942", "gfx950"], default="gfx942", help="target arch")
    s.add_argument("--calls", type=_pos_int, default=300, help="calls per timing sample")
    s.add_argument("--repeats", type=_pos_int, default=5, help="samples (the median is reported)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a report")
    s.set_defaults(func=cmd_overhead)
    _add_predict_parser(add_parser)
    _add_validate_parser(add_parser)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return EXIT_OK
    except _not_kernel_failures() as e:
        if args.traceback:
            raise
        print(f"pa_tile {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
