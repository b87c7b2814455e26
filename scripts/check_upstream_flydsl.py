"""Run FlyDSL's own examples in pa_tile's emulator, on CPU tensors, for gfx942 and gfx950.

Usage: python scripts/check_upstream_flydsl.py [-h | --help] /path/to/FlyDSL-checkout [example.py ... | --kernels [warn] |
       --tests test_file.py ... [-k SUBSTR ...] [--set NAME=VALUE ...] [--arch ARCH] [--lds-races warn]
       [--skip SUBSTR ...] [--lds-oob hardware] [--quantum N] [--timeout SECONDS] [--dump-asm DIR]
       [--raw-ptr-load] [--overread BYTES] [--bench-by-instructions]]

``--tests`` options: ``-k`` keeps only cases whose label (``test_name[params] arch``) contains
every given substring, ``--skip`` drops those containing any given one (``--skip large_shape``); ``--set NAME=VALUE`` (VALUE a Python literal) replaces that parameter's
parametrize values by one value, or passes it as a keyword (small shapes, ``bench_iters=1``);
``--lds-oob hardware`` lets LDS accesses past the allocation read 0 (after a reported fault:
does the kernel compute the right thing on a GPU?); ``--quantum N`` interleaves a workgroup's waves every N instructions instead of
running each to its next barrier (with ``--lds-races warn``: does a racy kernel give the right
answer under a schedule closer to a CU's?); ``CHECK_UPSTREAM_TRACEBACK=1`` prints each failure's traceback and the test's last printed lines on stderr; ``--timeout S`` ends a case after S seconds (reported as FAIL CaseTimeout); ``--dump-asm DIR`` writes the assembly of every kernel a case launches to
``DIR/<kernel>.<arch>.s`` (to read what the emulator ran, e.g. for a reported race);
``--overread BYTES`` lets a global or buffer load that starts inside a tensor run up to BYTES
past its end, those bytes reading 0xFF (after a reported over-read by design: are the bytes
past the end really unused?); ``--raw-ptr-load`` gives ``fx.ptr_load(ptr, result_type=C)`` with ``C`` a plain class holding an
``ir_type`` the raw loaded value, as the ``flydsl`` of FlyDSL's own tree (0.3.2 at 11c4174d) does,
where flydsl 0.5.0 calls ``C(value)`` and fails (``BF16Ty() takes no arguments``: the bf16 conv3d
kernel); ``--sub 'OLD=>NEW'`` replaces text in the test module's source before it runs (shapes a test
hard-codes, e.g. ``--sub 'M, N, K = 16, 5120, 8192=>M, N, K = 16, 128, 1024'``); ``--arch`` runs
one arch only. FlyDSL's ``run_perftest`` helper calls its function once (the
emulator measures no time). ``--bench-by-instructions`` answers ``flydsl.autotune.do_bench`` (which
times with device events the emulator refuses: ``NoDeviceClock``) with the number of instructions
the emulator executed in one call of the benchmarked function: a deterministic ranking proxy, NOT a
time, so an autotuning test's correctness and caching assertions get a verdict while which
candidate is fastest on hardware stays unanswered.

A check of the emulator's reach, not part of the test suite. Nothing of FlyDSL is copied: each
example file is read from the given checkout and executed with its CUDA device strings mapped to
CPU at run time (``"cuda"`` -> ``"cpu"``, ``torch.cuda.Stream()`` -> the default stream,
``torch.cuda.current_stream()`` -> the null stream, ``cuda_stream`` 0, ``torch.cuda.synchronize()`` -> no-op); the example's own PASS/FAIL check decides. Prints one
line per example and arch: PASS, FAIL, or the first error line.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import traceback
import types
from pathlib import Path

DEFAULT = ["examples/01-vectorAdd.py", "examples/02-tiledCopy.py", "examples/03-tiledMma.py",
           "examples/04-preshuffle_gemm.py", "examples/05-gather_scatter.py",
           "examples/extension/coop/01-warp_collectives.py", "examples/extension/coop/02-block_scan.py"]


class _HostStream:
    """What ``torch.cuda.current_stream()`` returns here: the null stream (``cuda_stream`` 0,
    which FlyDSL's ``fx.Stream`` takes like ``None``); work is synchronous, so it orders nothing.
    Launchers that pass ``torch.cuda.current_stream(i).cuda_stream`` (FlyDSL's norm wrappers
    do, when torch has no ``_cuda_getCurrentRawStream``) need the attribute."""

    cuda_stream = 0

    def __init__(self, *args, **kwargs):   # torch.cuda.Stream(device=...) makes one too
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


_HOST_STREAM = _HostStream()


def _cpu_source(text: str) -> str:
    text = re.sub(r"torch\.cuda\.Stream\(\)", "None", text)
    return text.replace('"cuda"', '"cpu"').replace("'cuda'", "'cpu'")


def run_one(root: Path, rel: str, arch: str) -> str:
    import torch

    from pa_tile import toolchain

    path = root / rel
    src = _cpu_source(path.read_text())
    out = io.StringIO()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    sys.path.insert(0, str(root))
    try:
        with toolchain.target_arch(arch), contextlib.redirect_stdout(out):
            exec(compile(src, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})
    except SystemExit as e:
        if e.code not in (0, None):
            return f"FAIL (exit {e.code}) {out.getvalue().strip().splitlines()[-1:]}"
    except Exception as e:  # report and go on with the next example
        while e.__cause__ is not None and "re-raised" in str(e):
            e = e.__cause__
        last = " ".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " ")
        return f"ERROR {last[:400]}"
    finally:
        sys.path.remove(str(root))
    text = out.getvalue()
    if "FAIL" in text:
        return "FAIL " + " | ".join(text.strip().splitlines()[-3:])[:300]
    return "PASS" if "PASS" in text or text else "ran (no verdict printed)"


# ----------------------------------------------------------------------------- kernel builders
# FlyDSL's kernel tests are GPU pytest modules; these call the same builders directly with small
# CPU tensors and compare with torch, the way those tests do (``--kernels``).

def _softmax(dtype):
    import torch
    from kernels.norm.softmax_kernel import build_softmax_module

    M, N = 4, 256
    torch.manual_seed(0)
    a = (torch.rand(M, N) * 4 - 2).to(dtype)
    c = torch.empty(M, N, dtype=dtype)
    build_softmax_module(M, N, {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype])(a, c, M)
    return (c.float() - torch.softmax(a.float(), 1)).abs().max().item(), 1e-5 if dtype == torch.float32 else 1e-2


def _rmsnorm(dtype):
    import torch
    import flydsl.compiler as flyc
    from kernels.norm.rmsnorm_kernel import build_rmsnorm_module

    M, N = 4, 256
    torch.manual_seed(0)
    x, g = torch.randn(M, N).to(dtype), torch.rand(N).to(dtype)
    out = torch.empty(M, N, dtype=dtype)
    fn = build_rmsnorm_module(N, {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype])
    flyc.compile(fn, x, g, out, M, None)(x, g, out, M, None)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-5) * g.float()
    return (out.float() - ref).abs().max().item(), 1e-4 if dtype == torch.float32 else 2e-2


def kernel_checks():
    import torch

    return {f"softmax {d}": (lambda d=d: _softmax(d)) for d in (torch.float32, torch.float16, torch.bfloat16)} | \
        {f"rmsnorm {d}": (lambda d=d: _rmsnorm(d)) for d in (torch.float32, torch.bfloat16)}


def run_kernels(root: Path, lds_races: str = "raise") -> None:
    from pa_tile import toolchain
    from pa_tile.emu import launch

    sys.path.insert(0, str(root))
    for name, fn in kernel_checks().items():
        for arch in ("gfx942", "gfx950"):
            captured = io.StringIO()
            try:
                with toolchain.target_arch(arch), contextlib.redirect_stdout(captured), \
                        launch.launch_options(lds_races=lds_races):
                    err, tol = fn()
                verdict = f"{'PASS' if err <= tol else 'FAIL'} (max abs err {err:.3g}, tol {tol:g})"
            except Exception as e:
                while e.__cause__ is not None and "re-raised" in str(e):
                    e = e.__cause__
                verdict = "ERROR " + " ".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " ")[:400]
            print(f"{name:55s} {arch}: {verdict}", flush=True)


# ----------------------------------------------------------------------------- test modules
# ``--tests file.py ...``: a FlyDSL pytest module read with the same CUDA -> CPU mapping (and
# ``torch.cuda.is_available()`` answering True, so GPU-only tests are not skipped, and
# ``torch.cuda.mem_get_info()`` the host's free/total memory); every test
# function is called once per ``pytest.mark.parametrize`` combination. Of the fixtures only
# pytest's ``monkeypatch`` and ``tmp_path`` are provided (``FIXTURES``); tests that need others
# are reported as such.

def _cpu_factories(torch) -> None:
    """Helper modules imported by the tests are not rewritten; their tensor factories get
    ``device="cuda"`` mapped to CPU here instead."""
    import functools

    def cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped
    for name in ("empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "tensor", "empty_like",
                 "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "randperm",
                 "linspace", "eye", "as_tensor", "empty_strided"):
        if not getattr(getattr(torch, name), "_pa_tile_cpu", False):
            f = cpu(getattr(torch, name))
            f._pa_tile_cpu = True
            setattr(torch, name, f)


def _param_sets(fn):
    import itertools

    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
    axes = []
    for m in marks:
        names = [n.strip() for n in (m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])]
        vals = [tuple(v.values) if hasattr(v, "values") else (v if len(names) > 1 else (v,)) for v in m.args[1]]
        axes.append([dict(zip(names, v)) for v in vals])
    for combo in itertools.product(*axes):
        kw = {}
        for d in combo:
            kw.update(d)
        yield kw


def _literal(text):
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _once_perftest(root: Path) -> None:
    """FlyDSL's ``run_perftest(func, *args, num_iters=..)`` times many launches; here it calls
    ``func`` once and reports 1 us, so a benchmark-wrapped check costs one launch."""
    try:
        import tests.test_common as tc
    except Exception:  # noqa: BLE001 - the helper module may need things we do not have
        return

    def run_perftest(func, *args, num_iters=20, num_warmup=3, testGraph=False, num_rotate_args=0,
                     needTrace=False, **kwargs):
        return func(*args, **kwargs), 1.0
    tc.run_perftest = run_perftest


def _stub_triton() -> None:
    """Some FlyDSL test helpers import triton for their fp4 quantizers only. Without triton, a
    stand-in lets those modules load; a test that really launches a triton kernel fails with
    "needs triton" (reported as outside the emulator's job)."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass

    class _Any:
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any()

        def __call__(self, *a, **k):
            return _Any()

        def __getitem__(self, item):
            raise RuntimeError("needs triton (not installed): a triton kernel was launched")

    def jit(fn=None, **kw):
        return _Any() if fn is not None else (lambda f: _Any())

    tr = types.ModuleType("triton")
    tr.jit, tr.cdiv, tr.language = jit, (lambda a, b: -(-a // b)), types.ModuleType("triton.language")
    def attr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()
    tr.language.__getattr__ = attr
    tr.next_power_of_2 = lambda n: 1 << max(0, (int(n) - 1).bit_length())
    tr.__getattr__ = attr
    sys.modules["triton"], sys.modules["triton.language"] = tr, tr.language


def _host_mem_info(*_a, **_k):
    """``torch.cuda.mem_get_info()`` answered for the host: (free, total) bytes of physical
    memory, which is where the emulated device's tensors live (a test checking that a rejected
    input was not materialized compares two of these)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _host_torch_cuda(torch) -> None:
    """``torch.cuda``'s host API answered for one device whose memory is the host's (the CPU
    tensors the tests make): available, synchronous, the null stream, the CPU's device index."""
    torch.cuda.is_available = lambda: True
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()   # launchers pin the tensor's device
    torch.cuda.mem_get_info = _host_mem_info   # under the emulator host memory is device memory
    # one device, the one the CPU tensors are on: its index is theirs (None), so a test's
    # torch.device("cuda" -> "cpu", torch.cuda.current_device()) equals their .device (FlyDSL's
    # rmsnorm launcher caches are keyed by it)
    torch.cuda.current_device = lambda: None
    # streams of a synchronous device: each launch completes before the next starts, so two
    # "overlapping" streams run one after the other here
    torch.cuda.Stream = _HostStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # launchers and references assert ``t.is_cuda``; here the CPU is the device
    torch.Tensor.is_cuda = property(lambda self: self.device.type in ("cpu", "cuda"))


def _is_plain_type_holder(result_type) -> bool:
    """A class that only names an ``ir_type`` (``class BF16Ty: ir_type = ...``) and cannot wrap a
    value: neither ``__new__`` nor ``__init__`` of its own anywhere in its MRO."""
    import inspect

    return (inspect.isclass(result_type) and result_type.__new__ is object.__new__
            and result_type.__init__ is object.__init__ and hasattr(result_type, "ir_type"))


def _raw_ptr_load() -> None:
    """``--raw-ptr-load``: FlyDSL's kernels up to at least 11c4174d (its in-tree ``flydsl`` 0.3.2)
    pass ``fx.ptr_load(ptr, result_type=C)`` a plain class ``C`` holding an ``ir_type`` (the bf16
    conv3d transpose and vec8 loads); their ``ptr_load`` returns the loaded ``ir.Value`` as it
    is. flydsl 0.5.0's wraps it as ``C(value)`` (``as_dsl_value``), and such a ``C`` takes no
    arguments (``TypeError: BF16Ty() takes no arguments``). This restores the 0.3.2 result for
    such holders only; every DSL type still goes through 0.5.0's own ``ptr_load``. Host-side
    tracing only: the kernel's IR is the same op, ``fly.ptr_load`` of ``C.ir_type``."""
    import flydsl.expr as fx
    from flydsl.expr import primitive

    orig = primitive.ptr_load
    if getattr(orig, "_pa_tile_raw", False):
        return

    @primitive.dsl_loc_tracing
    def ptr_load(ptr, result_type=None):
        if _is_plain_type_holder(result_type):
            return primitive.fly.ptr_load(result_type.ir_type, ptr)
        return orig(ptr, result_type)
    ptr_load._pa_tile_raw = True
    primitive.ptr_load = ptr_load
    if getattr(fx, "ptr_load", None) is orig:
        fx.ptr_load = ptr_load


def _instruction_bench(fn, warmup=5, rep=25, quantiles=None, **_ignored):
    """``--bench-by-instructions``: ``flydsl.autotune.do_bench``'s signature, answered with the
    number of instructions the emulator executed while ``fn()`` ran once (every launch in it, all
    waves), as a float where do_bench returns milliseconds. A ranking proxy, not a time: no
    warmup or repeats (the count is deterministic)."""
    from pa_tile.emu import launch, memory

    class _Count(memory.Trace):  # counts only: an autotuning sweep's access records would fill memory
        def global_access(self, *a, **k):
            pass

        def lds_access(self, *a, **k):
            pass

    trace = _Count(launch.current_arch())
    # in place, not a copy: the case's other options and the regions _raw_pointer_regions adds stay
    opts = launch._local.options
    saved = opts["trace"]
    opts["trace"] = trace
    try:
        fn()
    finally:
        opts["trace"] = saved
    n = float(trace.seq)
    return [n for _ in quantiles] if quantiles else n


def _bench_by_instructions() -> None:
    """Install :func:`_instruction_bench` as ``flydsl.autotune.do_bench``, and in every module
    already holding the original (``from flydsl.autotune import do_bench``)."""
    import importlib

    # the module itself: `import flydsl.autotune as m` binds flydsl's `autotune` decorator instead
    autotune = importlib.import_module("flydsl.autotune")
    orig = autotune.do_bench
    if orig is _instruction_bench:
        return
    for mod in [autotune, *list(sys.modules.values())]:
        if getattr(mod, "do_bench", None) is orig:
            mod.do_bench = _instruction_bench


def run_tests(root: Path, files, lds_races: str = "raise", select=(), overrides=None, archs=("gfx942", "gfx950"),
              subs=(), dump_asm=None, skip=(), timeout=0, quantum=None) -> None:
    import inspect
    import time

    import torch

    from pa_tile import toolchain
    from pa_tile.emu import launch

    overrides = overrides or {}
    _cpu_factories(torch)
    _host_torch_cuda(torch)
    sys.path.insert(0, str(root))
    try:
        import pandas  # noqa: F401
    except ImportError:  # FlyDSL's test helpers import it for their perf tables only
        stub = types.ModuleType("pandas")
        def attr(name):
            if name.startswith("__"):   # inspect reads __file__ of every module
                raise AttributeError(name)
            return lambda *a, **k: None
        stub.__getattr__ = attr
        sys.modules["pandas"] = stub
    _stub_triton()
    # kernels size their grids by the CU count
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=256, gcnArchName=os.environ.get("FLYDSL_GPU_ARCH", "gfx942"), name="pa_tile emulator")
    for arch in archs:
        # Test modules (and the helpers they import) compute arch-dependent constants at import
        # (e.g. ``DTYPE_FP8 = e4m3fn if "gfx95" in ARCH else e4m3fnuz``): load them afresh
        # for each arch, inside its target.
        for mod in [m for m, v in sys.modules.items() if str(getattr(v, "__file__", "") or "").startswith(str(root))]:
            del sys.modules[mod]
        with toolchain.target_arch(arch):
            _once_perftest(root)
            for rel in files:
                _run_file(root, rel, arch, lds_races, select, overrides, subs, dump_asm, skip, timeout, quantum)


@contextlib.contextmanager
def _raw_pointer_regions():
    """Kernels taking ``fx.Pointer``s / ``data_ptr()`` ints name no tensor the emulator can see:
    every tensor whose ``data_ptr()`` the test takes becomes an allowed region (its view), the
    same as ``launch_options(regions=[...])`` listing them by hand."""
    import torch

    from pa_tile.emu import launch

    seen, orig = [], torch.Tensor.data_ptr

    def data_ptr(self):
        if self.device.type == "cpu" and self.numel() and not any(t is self for t in seen):
            seen.append(self)
            launch._local.options["regions"] = tuple(seen)
        return orig(self)
    torch.Tensor.data_ptr = data_ptr
    try:
        yield
    finally:
        torch.Tensor.data_ptr = orig


def _dump(launches, where, arch):
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    for ln in launches:
        (out / f"{ln.kernel}.{arch}.s").write_text(ln.asm)


LDS_OOB = "raise"   # --lds-oob hardware: LDS over-reads read 0 (as on a GPU) instead of faulting
OVERREAD = 0        # --overread N: global/buffer loads may run N bytes past a tensor's end (read 0xFF)


class _TmpPath(contextlib.AbstractContextManager):
    def __enter__(self):
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="upstream_")
        return Path(self._dir.name)

    def __exit__(self, *exc):
        self._dir.cleanup()
        return False


def _monkeypatch():
    import pytest

    return pytest.MonkeyPatch.context()


# pytest's built-in fixtures the upstream tests take, each a context manager per case (undone after it)
FIXTURES = {"monkeypatch": _monkeypatch, "tmp_path": _TmpPath}


class CaseTimeout(BaseException):
    """Raised by the --timeout alarm wherever the case is. Not an ``Exception``, like
    ``KeyboardInterrupt``: the emulator reports an ``Exception`` from inside an instruction as an
    "internal emulator error", which a timeout is not (pa_tile.emu's launch boundary passes any
    ``BaseException`` through to the @flyc.jit call)."""


def _alarm(signum, frame):
    raise CaseTimeout("case ran past --timeout (a shape too large to emulate quickly?)")


def _run_file(root, rel, arch, lds_races, select, overrides, subs=(), dump_asm=None, skip=(), timeout=0,
              quantum=None):
    import inspect
    import time

    from pa_tile import toolchain
    from pa_tile.emu import launch

    path = root / rel
    sys.path.insert(0, str(path.parent))   # sibling helper modules (coop_common, ...)
    # a real module in sys.modules: dataclasses (and anything else resolving ``cls.__module__``)
    # look the defining module up there, and a bare namespace dict made them fail to load
    module = types.ModuleType("upstream_test")
    module.__file__ = str(path)
    sys.modules["upstream_test"] = module
    ns = module.__dict__
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            text = path.read_text()
            for old, new in subs:
                if old not in text:
                    raise ValueError(f"--sub: {old!r} not in {rel}")
                text = text.replace(old, new)
            exec(compile(_cpu_source(text), str(path), "exec"), ns)
    except Exception as e:
        print(f"{rel} {arch}: not loaded ({type(e).__name__}: {e})")
        return
    for name, fn in list(ns.items()):
        if not name.startswith("test_") or not callable(fn) or name.endswith("_full") or "perf" in name:
            continue   # the exhaustive "_full" sweeps and benchmarks are too big to emulate
        if any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0]) for m in getattr(fn, "pytestmark", [])):
            print(f"{rel}::{name} {arch}: skipped by its own marker")
            continue
        params = inspect.signature(fn).parameters
        seen = set()
        for kw in _param_sets(fn):
            kw.update({k: v for k, v in overrides.items() if k in params})
            key = repr(sorted(kw.items(), key=lambda kv: kv[0]))
            if key in seen:
                continue
            seen.add(key)
            missing = [p for p, d in params.items()
                       if p not in kw and p not in FIXTURES and d.default is inspect.Parameter.empty]
            label = f"{rel}::{name}{'[' + ','.join(map(str, kw.values())) + ']' if kw else ''} {arch}"
            if select and not all(k in label for k in select) or any(k in label for k in skip):
                continue
            if missing:
                print(f"{label}: not run (needs fixtures {missing})")
                continue
            t0 = time.perf_counter()
            print(f"{label}: ...", file=sys.stderr, flush=True)   # shows which case a long run is in
            if timeout:
                signal.signal(signal.SIGALRM, _alarm)
                signal.alarm(timeout)
            captured = io.StringIO()
            try:
                with toolchain.target_arch(arch), contextlib.redirect_stdout(captured), \
                        launch.launch_options(lds_races=lds_races, quantum=quantum, lds_oob=LDS_OOB,
                                              overread=OVERREAD), _raw_pointer_regions(), \
                        launch.record_launches() as launches, contextlib.ExitStack() as fixtures:
                    try:
                        fn(**kw, **{p: fixtures.enter_context(FIXTURES[p]()) for p in params if p in FIXTURES and p not in kw})
                    finally:
                        if dump_asm:
                            _dump(launches, dump_asm, arch)
                verdict = "PASS"
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # pytest.skip/fail raise BaseExceptions
                if type(e).__name__ in ("Skipped", "XFailed"):
                    verdict = f"SKIP {e}"[:300]
                else:
                    while e.__cause__ is not None and "re-raised" in str(e):
                        e = e.__cause__
                    verdict = "FAIL " + " ".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " ")[:600]
                    if os.environ.get("CHECK_UPSTREAM_TRACEBACK"):
                        sys.stderr.write("".join(captured.getvalue().splitlines(True)[-40:]))
                        traceback.print_exception(e, file=sys.stderr)
            finally:
                signal.alarm(0)
            over = sum(getattr(ln, "overreads", 0) for ln in launches)
            if over:   # --overread: say that the slack was used (the case over-reads by design)
                verdict += f" [over-read: {over} lane loads ran past a tensor's end, read 0xFF]"
            print(f"{label}: {verdict} ({time.perf_counter() - t0:.0f} s)", flush=True)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    root = Path(argv[0])
    from pa_tile import backend

    backend.set_backend("emu")
    backend.ensure_backend()
    if argv[1:2] == ["--kernels"]:
        # --kernels warn: report LDS races as warnings and still compare the results
        run_kernels(root, *argv[2:3])
        return 0
    if argv[1:2] == ["--tests"]:
        files, select, overrides, archs, races, subs, dump, skip, limit, quantum = \
            [], [], {}, ("gfx942", "gfx950"), "raise", [], None, [], 0, None
        rest = iter(argv[2:])
        for a in rest:
            if a == "-k":
                select.append(next(rest))
            elif a == "--set":
                k, _, v = next(rest).partition("=")
                overrides[k] = _literal(v)
            elif a == "--sub":
                subs.append(tuple(next(rest).split("=>", 1)))
            elif a == "--arch":
                archs = (next(rest),)
            elif a == "--lds-races":
                races = next(rest)
            elif a == "--lds-oob":
                global LDS_OOB
                LDS_OOB = next(rest)
            elif a == "--quantum":
                quantum = int(next(rest))
            elif a == "--timeout":
                limit = int(next(rest))
            elif a == "--skip":
                skip.append(next(rest))
            elif a == "--dump-asm":
                dump = next(rest)
            elif a == "--overread":
                global OVERREAD
                OVERREAD = int(next(rest))
            elif a == "--raw-ptr-load":
                _raw_ptr_load()
            elif a == "--bench-by-instructions":
                _bench_by_instructions()
            else:
                files.append(a)
        run_tests(root, files, races, select, overrides, archs, subs, dump, skip, limit, quantum)
        return 0
    files = argv[1:] or DEFAULT
    for rel in files:
        for arch in ("gfx942", "gfx950"):
            print(f"{rel:55s} {arch}: {run_one(root, rel, arch)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


