#!/usr/bin/env python
"""Validate the timing model (pa_tile.perf.model) against the gfx942 kernel times quoted in the
commit messages of ROCm/FlyDSL's ``pr-825`` branch (``pa_tile/data/pr825_mi300x_timings.json``; the
file says MI300X, the messages' own arithmetic says an 80-CU MI308X: ``--gpu``, and the report's
'Device' section).

One command::

    python scripts/validate_model.py --flydsl PATH_TO_FLYDSL_GIT [--out pa_tile/data/model_validation.md]

``PATH_TO_FLYDSL_GIT``: a clone (or bare git dir) of ROCm/FlyDSL that has the ``pr-825`` commits
and main's ``11c4174d`` (the flydsl 0.5.0 release commit). Nothing from it is copied into this
repository: each seed version's ``kernels/`` tree is written at run time to a temporary directory
(``--work``, default a fresh temp dir) and imported from there.

Per seed version (a commit the data file quotes a time or a step for), in a subprocess of its own
(built with flydsl 0.5.0, or, where 0.5.0 cannot trace it, with the release of its date,
``--fallback-flydsl``, default 0.2.2, pip-installed into the work dir):

1. ``git archive <sha> kernels`` into the work dir; flydsl 0.5.0 lacks two modules those July
   2026 kernels import (``flydsl.expr.vector``, removed, and ``flydsl.expr.buffer_ops``, moved to
   ``kernels.common`` by upstream commit 7dac0826): they are loaded from the seed commit's own
   ``python/flydsl/expr/vector.py`` and from 11c4174d's ``kernels/common/buffer_ops.py``.
   ``torch.cuda.get_device_properties`` (and, for the early versions, aiter's ``get_cu_num``) are
   faked (``--gpu``'s CU count, 80 for the default mi308x; gfx942): the host code reads them to pick
   the partition count, so each quoted time is compiled with the grid it ran with.
2. compile only, at every quoted shape (points' and steps'): a launch handler records each launch's grid and
   assembly and runs nothing (so the full-size tensors are never touched);
3. emulate a sample: one sequence, one KV head, contexts 1024 and 2048 (4 and 8 tiles); the
   difference of the two runs gives per-tile and per-workgroup figures (see pa_tile.perf.model).
   Only the main (partial) kernel is emulated; the reduce kernel is modelled from its code.
   The emulator lacks three IEEE-division helpers the seeds use (``v_div_scale_f32``,
   ``v_div_fmas_f32``, ``v_div_fixup_f32``) and reads ``v_cvt_f32_f16``'s source as an integer
   (so ``|x|`` on it is refused): this script registers stand-ins for them (normal-range
   semantics: timing only, numerics not checked) in its own worker process.

Then the FITTED constants of ``pa_tile.perf.hw`` are fitted (three by default, the CU's cap on bytes in
flight too with ``--memory-parallelism``; grid search on the mean
|log(predicted/measured)|) on every third point of the versions 0.5.0 builds (at most a third of
all points; the fallback-built versions' points are all held out and reported apart as fresh), and
the report gives the held-out per-point error, the sign agreement of every quoted before->after
step, Spearman's rank correlation and the errors by latency regime (and the same figures with the fit
on each of the other two thirds: a three-fold cross-validation), written to ``--out``
(markdown) and ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "pa_tile" / "data" / "pr825_mi300x_timings.json"
RELEASE_COMMIT = "11c4174d82b7491c2d08d5828a254183f2a8b959"  # flydsl 0.5.0 (main, 2026-08-21)
SAMPLE_CONTEXTS = (1024, 2048)


def _git(gitdir, *args) -> str:
    return subprocess.check_output(["git", "-C", str(gitdir), *args], text=True)


def _git_bytes(gitdir, *args) -> bytes:
    return subprocess.check_output(["git", "-C", str(gitdir), *args])


# =============================================================================================
# worker: one seed version, in its own process (each version has its own `kernels` package)


def _install_worker_patches(seed_root: Path):
    import importlib.util
    import types

    import numpy as np
    import torch

    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=int(os.environ.get("PM_FAKE_CUS", "304")), gcnArchName="gfx942",
        name="AMD Instinct " + os.environ.get("PM_FAKE_NAME", "MI300X"))

    # early versions ask aiter for the CU count (falling back to 304 without it): answer the same way
    for name in ("aiter", "aiter.jit", "aiter.jit.utils", "aiter.jit.utils.chip_info"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["aiter.jit.utils.chip_info"].get_cu_num = lambda: int(os.environ.get("PM_FAKE_CUS", "304"))

    import flydsl.expr as fx

    for name in ("vector", "buffer_ops"):
        if hasattr(fx, name):
            continue
        path = seed_root / "shim" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"flydsl.expr.{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"flydsl.expr.{name}"] = mod
        spec.loader.exec_module(mod)
        setattr(fx, name, mod)

    from pa_tile.emu import ops_base as ob
    from pa_tile.emu import ops_valu as ov

    F = "f32"
    ob.OPS.pop("v_cvt_f32_f16", None)
    ov._reg("v_cvt_f32_f16", F, ("f16",), lambda a: a.astype(np.float32))
    if "v_div_fmas_f32" not in ob.OPS:
        ov._reg("v_div_fmas_f32", F, (F, F, F), lambda a, b, c: (a * b + c).astype(np.float32))
    if "v_div_fixup_f32" not in ob.OPS:
        ov._reg("v_div_fixup_f32", F, (F, F, F), lambda q, d, n: q)
    if "v_div_scale_f32" not in ob.OPS:
        @ob.op("v_div_scale_f32")
        def _div_scale(ctx):
            ctx.need(5)
            o = ctx.ops
            ra = ctx.vread(o[2], F)
            wr = ctx.vwrite(o[0], F)
            wc = ctx.mask_write(o[1])

            def h(w):
                wr(w, np.broadcast_to(ra(w), (64,)).astype(np.float32))
                wc(w, np.zeros(64, dtype=bool))
            return h


def _seed_inputs(src: str, test_src: str, batch, context, q_heads, kv_heads, head_dim, block_size, *, fill: bool,
                 query_length: int = 1, scales: str = "per-tensor"):
    """Tensors in the layout this seed version reads (read off its host code and its test)."""
    import torch

    nq = q_heads
    mb = -(-context // block_size)
    f8 = torch.float8_e4m3fnuz
    make = (lambda *s: (torch.randn(*s) * 4).clamp(-240, 240).to(f8)) if fill else (lambda *s: torch.empty(*s, dtype=f8))
    if "hgroup_width == 16" in src:  # 2026-07-08 on: production's layouts, block 16/64, query rows = seqs x query_length
        return _late_inputs(torch, make, batch, context, nq, kv_heads, head_dim, block_size, fill, query_length, scales)
    if query_length != 1 or scales != "per-tensor":
        raise SystemExit(f"this version's host code takes query_length 1 and per-tensor scales only (asked {query_length}, {scales})")
    if block_size <= 64:  # 2026-07-06's small-block kernel addresses whole 256-token tiles of pages
        mb = -(-context // 256) * 256 // block_size
    nb = batch * mb
    k_blocked = "hgroup_width = key_cache.shape" in src
    v_blocked = "value_cache_plain.view(num_blocks, num_kv_heads, head_dim // 16, 16, block_size // 64, 64)" in test_src
    if k_blocked:
        k = make(nb, kv_heads, head_dim // 32, block_size, 32)
    else:
        k = make(nb, kv_heads, block_size, head_dim)
    if v_blocked:
        v = make(nb, kv_heads, head_dim // 16, block_size // 64, 16, 64)
    else:
        v = make(nb, kv_heads, head_dim, block_size)
    q = (torch.randn(batch, nq, head_dim) * 0.3).half() if fill else torch.empty(batch, nq, head_dim, dtype=torch.float16)
    bt = torch.arange(nb, dtype=torch.int32).view(batch, mb)
    cl = torch.full((batch,), context, dtype=torch.int32)
    out = torch.zeros(batch, nq, head_dim, dtype=torch.float16)
    return out, q, k, v, bt, cl, dict(k_blocked=k_blocked, v_blocked=v_blocked), 0.04, 0.04


def _late_inputs(torch, make, batch, context, nq, kv_heads, head_dim, block_size, fill, query_length, scales):
    """The 2026-07-08+ versions' tensors, as their test harness builds them: K [nb, kvh, hd/16, bs, 16], V
    'trans_v' [nb, kvh, bs/16, hd, 16], block tables covering whole 256-token tiles, the query
    [seqs x query_length, q_heads, hd], per-token scales [nb, kvh, bs] float32 or a float."""
    mb = -(-context // 256) * 256 // block_size
    nb = batch * mb
    k = make(nb, kv_heads, head_dim // 16, block_size, 16)
    v = make(nb, kv_heads, block_size // 16, head_dim, 16)
    rows = batch * query_length
    q = (torch.randn(rows, nq, head_dim) * 0.3).half() if fill else torch.empty(rows, nq, head_dim, dtype=torch.float16)
    bt = torch.arange(nb, dtype=torch.int32).view(batch, mb)
    cl = torch.full((batch,), context, dtype=torch.int32)
    out = torch.zeros(rows, nq, head_dim, dtype=torch.float16)
    if scales == "per-token":
        ks = (torch.rand(nb, kv_heads, block_size) * 0.02 + 0.03) if fill else torch.empty(nb, kv_heads, block_size)
        vs = ks.clone()
    else:
        ks = vs = 0.04
    return out, q, k, v, bt, cl, dict(k_blocked=True, v_blocked=True, production_layout=True), ks, vs


def _family_counts(counts):
    from pa_tile.isa import instruction_family

    fam = {}
    for mn, c in counts.items():
        f = instruction_family(mn)
        fam[f] = fam.get(f, 0) + c
    return fam


def _trace_figures(trace):
    fam = _family_counts(trace.counts)
    other = dict(bytes=0.0, store_bytes=0.0, lines=float(getattr(trace, "lines", 0)),
                 ta_cycles=float(getattr(trace, "ta_cycles", 0)))
    lds = dict(bytes=0.0, conflict_cycles=0.0)
    for r in trace.summary():
        if r["space"] in ("global", "buffer"):
            if "_store" in r["mnemonic"]:
                other["store_bytes"] += r["bytes"]
            other["bytes"] += r["bytes"]
        elif r["space"] == "lds":
            lds["bytes"] += r["bytes"]
            lds["conflict_cycles"] += r["conflict_cycles"]
    d = dict(fam)
    d.update({f"other_{k}": v for k, v in other.items()})
    d.update({f"lds_{k}": v for k, v in lds.items()})
    from pa_tile.perf.model import line_executions

    d.update({f"line:{n}": float(c) for n, c in line_executions(trace).items()})
    return d


def _fit_hook_to_seed_flydsl() -> None:
    """Let the emulator hook run under a flydsl release older than it supports (the fallback).

    Harness-only, and only below ``launch.SUPPORTED_FLYDSL``'s floor; the product keeps its checks.
    Two of the hook's self-test checks do not apply to what this worker does with flydsl 0.2.2:
    its placeholder hooks serve ``flyc.compile()`` with CPU tensors (the seeds call their jit
    function directly, and 0.2.2 has neither function), and the emulator shim exporting runtime
    symbols 0.2.2's runtime lacks (occupancy query, trace buffer) adds entry points nothing calls.
    Every other check (backend registry, pipeline, runtime resolution, the symbols both export)
    still runs, and the sanitizer still checks every access of the sampled launches.
    """
    import flydsl

    from pa_tile.emu import launch as L

    ver = L._version_tuple(getattr(flydsl, "__version__", "0"))
    if ver >= L.SUPPORTED_FLYDSL[0]:
        return
    L.SUPPORTED_FLYDSL = (ver, L.SUPPORTED_FLYDSL[1])
    L._PLACEHOLDER_HOOKS = tuple(n for n in L._PLACEHOLDER_HOOKS if hasattr(__import__(
        "flydsl.compiler.jit_function", fromlist=["x"]), n))
    strict = L.compare_exports
    L.compare_exports = lambda real, shim: [m for m in strict(real, shim) if "no longer has" not in m]


def worker(args) -> int:
    seed_root = Path(args.work)
    sha = args.worker
    vdir = seed_root / sha
    sys.path.insert(0, str(vdir))
    os.environ["PA_TILE_BACKEND"] = "emu"
    from pa_tile import backend

    backend.set_backend("emu")
    _fit_hook_to_seed_flydsl()
    backend.ensure_backend()
    _install_worker_patches(seed_root)
    import dataclasses as dc

    import flydsl.expr as fx

    from pa_tile.emu import launch
    from pa_tile.perf.model import aligned_lines, line_trace

    import importlib

    rel = "kernels/pa_decode_tile.py" if (vdir / "kernels" / "pa_decode_tile.py").exists() else \
        "kernels/attention/pa_decode_tile.py"  # moved on 2026-07-16
    tile_mod = importlib.import_module(rel[:-3].replace("/", "."))
    pa_decode_tile = tile_mod.pa_decode_tile  # the seed version's
    compile_tile = tile_mod.compile_pa_decode_tile

    def forcing(partitions):  # a quoted partition count: compile with it, whatever the host heuristic picks
        def compile_with(*a, **kw):
            if partitions is not None:
                kw["num_partitions"] = int(partitions)
            return compile_tile(*a, **kw)
        tile_mod.compile_pa_decode_tile = compile_with

    src = (vdir / rel).read_text()
    test_src = (vdir / "test_pa.py").read_text() if (vdir / "test_pa.py").exists() else ""
    shapes = json.loads(args.shapes)
    out = dict(sha=sha, shapes=[], sample=None, error=None)
    asm_store = {}

    def record_only(lg):  # compile-only: remember, run nothing
        recorded.append((lg.kernel, list(lg.grid), lg.asm))

    for sh in shapes:
        recorded = []
        prev = launch.set_launch_handler(record_only)
        try:
            o, q, k, v, bt, cl, lay, ks, vs = _seed_inputs(
                src, test_src, sh["batch"], sh["context"], sh["num_q_heads"], sh["num_kv_heads"], sh["head_dim"],
                sh["block_size"], fill=False, query_length=sh["query_length"], scales=sh["scales"])
            forcing(sh.get("partitions"))
            pa_decode_tile(o, q, k, v, bt, cl, ks, vs, stream=fx.Stream(None))
        finally:
            forcing(None)
            launch.set_launch_handler(prev)
        launches = []
        for kern, grid, asm in recorded:
            hsh = hashlib.sha1(asm.encode()).hexdigest()[:12]
            asm_store[hsh] = asm
            launches.append(dict(kernel=kern, grid=grid, asm=hsh))
        out["shapes"].append(dict(shape=sh, launches=launches, layout=lay))

    # the sample: per-launch traces (main kernel and reduce apart)
    os.environ["PM_FAKE_CUS"] = "1"  # the smallest split the host heuristic allows: fewer tiles to emulate

    def run(ctx, partitions=None):
        traces = []

        def handler(lg):
            tr = line_trace("gfx942")
            traces.append((lg.kernel, list(lg.grid), tr, hashlib.sha1(lg.asm.encode()).hexdigest()[:12]))
            asm_store.setdefault(traces[-1][3], lg.asm)
            if len(traces) == 1:  # only the main kernel is sampled; the reduce is modelled from its code
                lg2 = dc.replace(lg, trace=tr, lds_races="off")
                aligned_lines(lg2)  # 128-byte lines counted from each tensor's base (see line_trace)
                launch.run_on_emulator(lg2)

        sh = shapes[0]
        o, q, k, v, bt, cl, _, ks, vs = _seed_inputs(src, test_src, 1, ctx, sh["num_q_heads"], 1, sh["head_dim"],
                                                     sh["block_size"], fill=True, query_length=sh["query_length"],
                                                     scales=sh["scales"])
        prev = launch.set_launch_handler(handler)
        forcing(partitions)
        try:
            pa_decode_tile(o, q, k, v, bt, cl, ks, vs, stream=fx.Stream(None))
        finally:
            forcing(None)
            launch.set_launch_handler(prev)
        return traces

    t0 = time.time()
    import numpy as np

    runs = [(ctx, run(ctx)) for ctx in SAMPLE_CONTEXTS]
    if runs[0][1][0][1] != runs[1][1][0][1]:  # the host heuristic split the two differently: one more run
        runs.append((4096, run(4096)))
    tiles_per_wg = {ctx // 256 / tr[0][1][2] for ctx, tr in runs}
    if len(tiles_per_wg) == 1:  # the 2026-07 heuristics split in proportion to the context: the runs cannot
        # separate per-tile from per-workgroup cost, so the sample is split 2 ways whatever the context
        runs = [(ctx, run(ctx, partitions=2)) for ctx in SAMPLE_CONTEXTS]
    # total(run) = tiles * m_groups * per_tile + workgroups * fixed, solved over the runs (least squares)
    figs = [(ctx // 256, tr[0][1], _trace_figures(tr[0][2])) for ctx, tr in runs]
    grid0 = figs[0][1]
    m_groups = max(1, grid0[1])  # one KV head in the sample
    A = np.array([[t * m_groups, g[0] * g[1] * g[2]] for t, g, _ in figs], dtype=float)
    if np.linalg.matrix_rank(A) < 2:
        raise SystemExit(f"{sha}: sample runs cannot separate per-tile from per-workgroup cost (grids {[f[1] for f in figs]})")
    per_tile, fixed, line_per_tile = split_sample(A, [f[2] for f in figs])
    out["sample"] = dict(contexts=[r[0] for r in runs], grids=[f[1] for f in figs], m_groups=m_groups,
                         per_tile=per_tile, fixed=fixed, line_per_tile=line_per_tile,
                         asm=runs[0][1][0][3], seconds=time.time() - t0, kernel=runs[0][1][0][0],
                         reduce_kernel=runs[0][1][1][0] if len(runs[0][1]) > 1 else None)
    out["asm"] = asm_store
    Path(args.result).write_text(json.dumps(out))
    return 0


def split_sample(A, figures):
    """Per-tile and per-workgroup figures of a sample's runs: each run's total = A's row . (per tile,
    per workgroup), solved by least squares for every counted figure (clipped at 0); the executions
    by assembly line ('line:N', the loop's branch frequencies) are kept apart, per tile only.
    Returns (per_tile, fixed, line_per_tile)."""
    import numpy as np

    per_tile, fixed = {}, {}
    for key in set().union(*figures):
        y = np.array([f.get(key, 0.0) for f in figures], dtype=float)
        (c, f_), *_ = np.linalg.lstsq(A, y, rcond=None)
        per_tile[key], fixed[key] = max(0.0, float(c)), max(0.0, float(f_))
    line_per_tile = {k.split(":", 1)[1]: per_tile.pop(k) for k in list(per_tile) if k.startswith("line:")}
    for k in [k for k in fixed if k.startswith("line:")]:
        fixed.pop(k)
    return per_tile, fixed, line_per_tile


# =============================================================================================
# driver


def _prepare(gitdir: Path, work: Path, sha: str) -> None:
    vdir = work / sha
    if (vdir / "kernels").is_dir():
        return
    vdir.mkdir(parents=True, exist_ok=True)
    tar = _git_bytes(gitdir, "archive", sha, "kernels")
    subprocess.run(["tar", "-x", "-C", str(vdir)], input=tar, check=True)
    try:
        (vdir / "test_pa.py").write_bytes(_git_bytes(gitdir, "show", f"{sha}:tests/kernels/test_pa.py"))
    except subprocess.CalledProcessError:
        pass
    shim = work / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "buffer_ops.py").write_bytes(_git_bytes(gitdir, "show", f"{RELEASE_COMMIT}:kernels/common/buffer_ops.py"))
    (shim / "vector.py").write_bytes(_git_bytes(gitdir, "show", f"{sha}:python/flydsl/expr/vector.py"))


def _run_worker(gitdir: Path, work: Path, sha: str, shapes, log, fallback=None, release=None, tag="") -> dict:
    """Build one version at ``shapes`` and sample it. ``release``: a directory holding the one flydsl
    release to build it with (no 0.5.0 first); ``tag``: a name for this (version, sample
    configuration) pair's cached result, for a version sampled in more than one configuration."""
    hwc = _gpu()
    res = work / f"{sha}{tag}.cus{hwc.compute_units}.json"  # the host heuristics split by the CU count
    if res.exists():
        cached = json.loads(res.read_text())
        if all(any(r["shape"] == sh for r in cached.get("shapes", [])) for sh in shapes):
            return cached  # else a shape was added since: build again
    failed = work / f"{sha}{tag}.cus{hwc.compute_units}.failed.json"  # a version that did not build, remembered
    if failed.exists() and not fallback:
        return json.loads(failed.read_text())
    _prepare(gitdir, work, sha)
    cmd = ["nice", "-n", "10", sys.executable, str(Path(__file__).resolve()), "--worker", sha, "--work", str(work),
           "--shapes", json.dumps(shapes), "--result", str(res)]
    errors = []
    builds = [(f"flydsl {_dist_version(release)}", release)] if release else \
        [("flydsl 0.5.0", None)] + ([(f"flydsl {_dist_version(fallback)}", fallback)] if fallback else [])
    for label, path in builds:
        t = time.time()
        pp = str(ROOT) if path is None else f"{path}{os.pathsep}{ROOT}"
        env = dict(os.environ, PYTHONPATH=pp, PM_FAKE_CUS=str(hwc.compute_units), PM_FAKE_NAME=hwc.name)
        p = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True)
        if p.returncode == 0 and res.exists():
            out = json.loads(res.read_text())
            out["flydsl"] = label
            res.write_text(json.dumps(out))
            log(f"  {sha[:8]}: {label}: compiled {len(shapes)} shape(s) + emulated sample in {time.time() - t:.0f} s")
            return out
        err = (p.stderr or p.stdout)[-1500:].strip()
        last = err.splitlines()[-1] if err else "?"
        errors.append(f"{label}: {last}")
        log(f"  {sha[:8]}: {label}: FAILED ({time.time() - t:.0f} s): {last}")
    out = dict(sha=sha, error="; ".join(errors))
    if not fallback:
        failed.write_text(json.dumps(out))
    return out


#: the flydsl release of the seeds' date: pr-825 forked from main at f5c50f45 (2026-06-28), after
#: v0.2.2 (2026-06-17) and before v0.2.3 (2026-07-08). The earliest seed versions (2026-06-29/30)
#: build with it and with neither 0.4.2 nor 0.5.0.
FALLBACK_FLYDSL = "0.2.2"


def _dist_version(path: Path) -> str:
    dists = sorted(Path(path).glob("flydsl-*.dist-info"))
    return dists[0].name[len("flydsl-"):-len(".dist-info")] if dists else f"at {path}"


def _fallback_dir(spec: str, work: Path, log) -> Path | None:
    """``--fallback-flydsl``: a directory holding a flydsl install, a release to pip-install into the
    work dir (once; the wheel only, its dependencies are this environment's), or 'none'."""
    if not spec or spec == "none":
        return None
    if Path(spec).is_dir():
        return Path(spec)
    target = work / f"flydsl-{spec}"
    if not (target / "flydsl").is_dir():
        log(f"installing flydsl {spec} (the fallback release) into {target}")
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                               f"flydsl=={spec}"])
    return target


#: the GPU the quoted times were measured on (``--gpu``): its CU count is what the seed versions'
#: host code reads to choose the partition count (grid.z), and the model predicts on it
GPU = "mi308x"


def _gpu():
    from pa_tile.perf import hw as hwm

    return hwm.hardware(GPU)


_CODE_CACHE: dict = {}
_LINE_CACHE: dict = {}
#: walk the loop's blocks as often as the sample ran them (False: walk every block, the old model)
USE_BRANCH_FREQUENCIES = os.environ.get("PA_TILE_MODEL_BRANCHES", "1") != "0"


def _code(vres, launch_rec, hwc, cached, segs=16.0, line_counts=None):
    from pa_tile.perf import model

    key = (launch_rec["asm"], launch_rec["kernel"], hwc.mem_latency_cycles, hwc.cu_bytes_in_flight, cached, segs,
           line_counts is not None)
    if key not in _CODE_CACHE:  # the walk depends on the code, the latency, the coalescing and the branches
        _CODE_CACHE[key] = model.kernel_code(vres["asm"][launch_rec["asm"]], launch_rec["kernel"], hw=hwc,
                                             cached=cached, vmem_segments=segs, line_counts=line_counts)
    return _CODE_CACHE[key]


def _predict_point(vres: dict, shape: dict, overrides: dict) -> dict:
    from pa_tile.perf import hw as hwm
    from pa_tile.perf import model
    from pa_tile.perf.roofline import DecodeShape

    hwc = hwm.with_fitted(_gpu(), overrides)
    rec = next(r for r in vres["shapes"] if r["shape"] == shape)
    main_l = rec["launches"][0]
    red_l = rec["launches"][1] if len(rec["launches"]) > 1 else None
    # the sample's branch frequencies apply where the sampled code is the code of this shape
    s_ = vres["sample"]
    lines = None
    if USE_BRANCH_FREQUENCIES and s_.get("line_per_tile") and s_.get("asm") in vres["asm"]:
        key = (vres["sha"], s_["asm"], main_l["asm"])
        if key not in _LINE_CACHE:
            _LINE_CACHE[key] = model.map_lines(s_["line_per_tile"], vres["asm"][s_["asm"]], vres["asm"][main_l["asm"]],
                                               s_.get("kernel"), main_l["kernel"])
        lines = _LINE_CACHE[key]
    main = _code(vres, main_l, hwc, False, model.vmem_segments(s_["per_tile"]), lines)
    red = _code(vres, red_l, hwc, True) if red_l else None
    gx, gy, gz = main_l["grid"]
    ds = DecodeShape(batch=shape["batch"], context=shape["context"], num_q_heads=shape["num_q_heads"],
                     num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], block_size=shape["block_size"],
                     query_length=shape["query_length"], scales=shape["scales"])
    s = vres["sample"]
    p = model.predict(shape=ds, hw=hwc, per_tile=s["per_tile"], fixed=s["fixed"], main=main, waves_per_workgroup=4,
                      m_groups=max(1, gy // ds.num_kv_heads), partitions=gz, reduce=red)
    return dict(predicted_us=p.predicted_us, floor_us=p.floor_us, bound=p.bound, partitions=gz,
                workgroups=p.details["workgroups"], occupancy_wgs=main.workgroups_per_cu,
                round=p.details["round_terms"], vgpr=main.vgpr_unified, lds=main.lds_bytes,
                demands=p.details["demands"], tiles=p.details["tiles_per_workgroup"], per_cu=p.details["per_cu"],
                resident=p.details["resident_workgroups"], round_cycles=p.details["round_cycles"],
                overhead_us=p.terms_us["launch"] + p.terms_us.get("reduce", 0.0),
                exposures=p.details["latency_exposures_per_tile"], walk_scale=p.details["walk_scale"],
                zero_latency_tile_cycles=_zero_latency_tile(main, p.details),
                fixed_cycles=p.details["fixed_cycles"])


def _zero_latency_tile(main, details) -> float:
    """One wave's tile with the memory latency taken out (the re-walk curve, piecewise linear in
    the latency, continued to zero along its first segment), in cycles per tile."""
    c = main.latency_curve
    if main.loop is None or len(c) < 2 or not details["latency_tile_cycles"]:
        return 0.0
    scale = details["latency_tile_cycles"] / max(1e-9, main.loop.cycles)
    return max(0.0, c[0][1] - main.latency_exposures * c[0][0]) * scale


# ---------------------------------------------------------------------------------------------
# which CU count the quotes were measured at: the seeds' own partition heuristics (transcribed from
# kernels/pa_decode_tile.py's host code at these commits, 64 tiles = context 16384) against what
# the messages of 879c2e69 and 48b7b9c7 say changed


def _np_2fc39dc7(batch, cus, tiles=64):  # f44f95f5 .. 2fc39dc7: fill the CUs, powers of two
    want = max(1, min(-(-cus // batch), tiles))
    return max(c for c in (1, 2, 4, 8, 16, 32, 64) if c <= want)


def _np_879c2e69(batch, cus, tiles=64):  # + a ~24-tiles-per-partition floor, candidates 3 and 6
    want = max(1, min(max(-(-cus // batch), -(-tiles // 24)), tiles))
    return max(c for c in (1, 2, 3, 4, 6, 8, 16, 32, 64) if c <= want)


def _np_recommended(batch, cus):  # 48b7b9c7 on: production's get_recommended_splits (occupancy 2)
    return max(4, min(-(-(2 * cus) // batch), 8))


def cu_count_statements(cus: int) -> dict:
    """The messages' statements about partition counts, true or false at ``cus`` CUs."""
    old, new = (lambda b: _np_2fc39dc7(b, cus)), (lambda b: _np_879c2e69(b, cus))
    return {
        "879c2e69 changes the kernel at b96 (quoted 445 -> 329 us)": old(96) != new(96),
        "879c2e69 changes the kernel at b128 (442 -> 392)": old(128) != new(128),
        "879c2e69 changes the kernel at b256 (905 -> 757)": old(256) != new(256),
        "879c2e69 changes the kernel at b32 (-10%)": old(32) != new(32),
        "879c2e69 leaves b1-16 unchanged": all(old(b) == new(b) for b in (1, 8, 16)),
        "before 879c2e69, 'one coarse CTA per sequence' (NP=1) at high batch (b128)": old(128) == 1,
        "2fc39dc7 ran b96 and b128 with the same per-workgroup work (both quoted 445 us)": old(96) == old(128),
        "48b7b9c7: production's [4, 8] floor binds at b128 ('overshoots')": -(-(2 * cus) // 128) < 4,
        "879c2e69's bespoke count at b128 is the 'NP=3 sweet spot'": new(128) == 3,
    }


#: The fit's search grid. Widened for issue 14's follow-up (after seeing the held-out errors of the
#: previous report, which fitted mem_latency_cycles at the old top, 6400, and launch_us at the old
#: bottom, 1 us): hbm_efficiency 0.30-0.95, latency 200-12800 cycles, launch 0.25-16 us, so that a
#: fitted constant at an edge says the model wants a value no physical reading allows, not that the
#: grid stopped. (Before: 0.45-0.95 / 800-6400 / 1-8, chosen after a wider 304-CU run fitted 0.35 /
#: 0.5 us and predicted the held-out points worse.)
#: hbm_efficiency starts at 0.50: the production kernel the data file quotes (pa_decode_ps_kernel,
#: "~190-214us" at b128 ctx16384, ecbc2d6b's message) read the same bytes on the same machine at
#: >= floor / 214 us = 0.47 of peak (0.53 at 190 us), so the achievable fraction is at least that
#: (``production_bound``; checked in main). Chosen after seeing a fit at 0.30 predict ecbc2d6b b128
#: memory-bound and 38% slow, i.e. after seeing held-out errors; the bound itself uses no held-out point.
GRID = dict(
    hbm_efficiency=(0.50, 0.55, 0.60, 0.65, 0.75, 0.85, 0.95),
    mem_latency_cycles=(200.0, 400.0, 800.0, 1200.0, 1600.0, 2400.0, 3200.0, 4000.0, 4800.0, 6400.0, 9600.0, 12800.0),
    launch_us=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
    cu_bytes_in_flight=(0.0,),
)
#: ``--memory-parallelism``: the CU's outstanding-request cap is fitted too (0 = no cap stays a
#: candidate), 32 KiB to 2 MiB in powers of two. The first grid stopped at 128 KiB and fitted its
#: top; this one was widened after seeing that (and the held-out errors of both): its optimum, 512 KiB,
#: is interior
MEMORY_PARALLELISM_GRID = (0.0, 32768.0, 65536.0, 131072.0, 262144.0, 524288.0, 1048576.0, 2097152.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flydsl", help="path to a ROCm/FlyDSL clone or git dir with the pr-825 commits")
    ap.add_argument("--work", help="scratch dir for the seed versions (default: a new temp dir); results are cached there")
    ap.add_argument("--out", default=str(ROOT / "pa_tile" / "data" / "model_validation.md"))
    ap.add_argument("--json", default=str(ROOT / "pa_tile" / "data" / "model_validation.json"),
                    help="also write the summary and the per-point table as JSON here (chapter 07 reads it)")
    ap.add_argument("--fallback-flydsl", default=FALLBACK_FLYDSL,
                    help="the flydsl release (pip-installed into the work dir) or a directory holding one, to "
                         f"retry the versions 0.5.0 cannot build (default {FALLBACK_FLYDSL}, the release of their "
                         "date; 'none' to skip them)")
    ap.add_argument("--loaded-latency", choices=("rewalk", "count"), default="rewalk",
                    help="how the model applies the loaded latency (pa_tile.perf.model.LOADED_LATENCY)")
    ap.add_argument("--cu-contention", choices=("mva", "max", "serial", "shared"), default="mva",
                    help="how resident workgroups share a CU's units (pa_tile.perf.model.CU_CONTENTION)")
    ap.add_argument("--utilisation-of", choices=("achievable", "peak"), default="peak",
                    help="what the loaded latency's HBM utilisation is a fraction of (model.UTILISATION_OF)")
    ap.add_argument("--gpu", default="mi308x", choices=("mi308x", "mi300x"),
                    help="the device of the quoted times (default mi308x, 80 CUs: see the report's 'Device' "
                         "section); the seed host code picks its partition count from this CU count")
    ap.add_argument("--memory-parallelism", action="store_true",
                    help="also fit hw.cu_bytes_in_flight, the CU's cap on outstanding vector-memory bytes "
                         "(default: no cap, the model as it stands)")
    ap.add_argument("--fit-offset", type=int, choices=(0, 1, 2), default=0,
                    help="which third of the 0.5.0-built points to fit on (default 0, the set of every round; "
                         "1 and 2 give the other two folds of a three-fold cross-validation)")
    ap.add_argument("--only", help="comma-separated sha prefixes: validate only these versions")
    # worker mode (internal)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.flydsl:
        ap.error("--flydsl PATH is required")
    from pa_tile.perf import model as _model
    from pa_tile.perf.validation import spearman

    global GPU
    GPU = args.gpu
    _model.LOADED_LATENCY = args.loaded_latency
    _model.CU_CONTENTION = args.cu_contention
    _model.UTILISATION_OF = args.utilisation_of
    if args.memory_parallelism:
        GRID["cu_bytes_in_flight"] = MEMORY_PARALLELISM_GRID
    gitdir = Path(args.flydsl)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="pa_tile_seeds_"))
    work.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    data = json.loads(DATA.read_text())

    # 1. every quote is in its commit's message (or, for a quote from a source comment, in that file)
    bad = []
    for st in data["steps"]:
        if st.get("quoted_file"):
            text = _git(gitdir, "show", f"{st['quoted_in']}:{st['quoted_file']}")
            msg = " ".join(" ".join(ln.strip().lstrip("#") for ln in text.splitlines()).split())
        else:
            msg = " ".join(_git(gitdir, "log", "-1", "--format=%B", st["quoted_in"]).split())
        if st["quote"] not in msg:
            bad.append(st["quoted_in"][:8])
    log(f"quotes checked against the checkout: {len(data['steps']) - len(bad)}/{len(data['steps'])} found"
        + (f"; missing in {bad}" if bad else ""))

    # 2. compile + sample every version (a version sampled in more than one configuration, one build each)
    points = data["points"]
    old_steps = [st for st in data["steps"] if not st.get("round")]
    new_steps = [st for st in data["steps"] if st.get("round")]
    versions = {}
    for sha, shape in [(p["commit"], p["shape"]) for p in points] + \
            [(st[k], st["shape"]) for st in old_steps for k in ("before_version", "after_version")]:
        versions.setdefault(sha, [])
        if shape not in versions[sha]:
            versions[sha].append(shape)
    builds = {}  # (sha, configuration tag) -> (release, shapes): the later history's versions
    for st in new_steps:
        for _, pairs in _step_shapes(st):
            for sha, shape in pairs:
                _, shapes = builds.setdefault((sha, _config_tag(shape)), (st["flydsl"], []))
                if shape not in shapes:
                    shapes.append(shape)
    if args.only:
        keep = tuple(args.only.split(","))
        versions = {k: v for k, v in versions.items() if k.startswith(keep)}
        builds = {k: v for k, v in builds.items() if k[0].startswith(keep)}
    when = lambda s: int(_git(gitdir, "log", "-1", "--format=%ct", s))  # noqa: E731
    order = sorted(versions, key=when)
    log(f"{len(order)} seed versions, {sum(len(v) for v in versions.values())} (version, shape) pairs; "
        f"{len(builds)} (version, configuration) builds of the later history; work dir {work}")
    fallback = _fallback_dir(args.fallback_flydsl, work, log)
    results = {sha: _run_worker(gitdir, work, sha, versions[sha], log, fallback) for sha in order}
    ok = {sha for sha, r in results.items() if not r.get("error")}
    late = {key: _run_worker(gitdir, work, key[0], shapes, log, release=_fallback_dir(rel, work, log), tag=key[1])
            for key, (rel, shapes) in sorted(builds.items(), key=lambda kv: (when(kv[0][0]), kv[0][1]))}

    # 3. fit on every third point (by version order, then batch/context), report the rest
    usable = [p for p in points if p["commit"] in ok]
    usable.sort(key=lambda p: (order.index(p["commit"]), p["shape"]["batch"], p["shape"]["context"]))
    # The fit set is every third point of the versions flydsl 0.5.0 builds: the same 11 points as in
    # every earlier round. The points only the fallback release builds were first predicted after this
    # rule was fixed (committed before their first run); all of them are held out, and reported apart
    # as the only held-out points no earlier model change was made after seeing.
    fresh = {sha for sha in ok if results[sha].get("flydsl", "flydsl 0.5.0") != "flydsl 0.5.0"}

    def loss(ov, pts):
        errs = [abs(math.log(_predict_point(results[p["commit"]], p["shape"], ov)["predicted_us"] / p["measured_us"]))
                for p in pts]
        return sum(errs) / max(1, len(errs))

    from pa_tile.perf import hw as hwm

    lo_eff = production_bound(data)
    if lo_eff is not None and min(GRID["hbm_efficiency"]) < lo_eff[0]:
        raise SystemExit(f"GRID hbm_efficiency starts below what the production kernel achieved ({lo_eff[0]:.2f})")
    priors = dict(hwm.PRIORS)

    def evaluate(offset):
        """Fit on every third point from ``offset`` of the 0.5.0-built versions, hold out the rest."""
        fit_set = [p for p in usable if p["commit"] not in fresh][offset::3]
        best, best_loss = dict(priors), loss(priors, fit_set) if fit_set else float("nan")
        prior_loss = best_loss
        if fit_set:
            for combo in itertools.product(*GRID.values()):
                ov = dict(zip(GRID, combo))
                lo_ = loss(ov, fit_set)
                if lo_ < best_loss:
                    best, best_loss = ov, lo_
        log(f"fold {offset}: fitted on {len(fit_set)} points: {best} "
            f"(mean |log err| {prior_loss:.3f} at priors -> {best_loss:.3f})")

        rows = []
        for p in usable:
            r = _predict_point(results[p["commit"]], p["shape"], best)
            r0 = _predict_point(results[p["commit"]], p["shape"], priors)
            rows.append(dict(commit=p["commit"], batch=p["shape"]["batch"], context=p["shape"]["context"],
                             measured_us=p["measured_us"], predicted_us=r["predicted_us"], prior_us=r0["predicted_us"],
                             floor_us=r["floor_us"], err=r["predicted_us"] / p["measured_us"] - 1, bound=r["bound"],
                             partitions=r["partitions"], occ=r["occupancy_wgs"], vgpr=r["vgpr"],
                             role="fit" if p in fit_set else "held-out", fresh=p["commit"] in fresh,
                             flydsl=results[p["commit"]].get("flydsl", "flydsl 0.5.0"),
                             quote=p["quote"], quoted_in=p["quoted_in"],
                             demands=r["demands"], tiles=r["tiles"], per_cu=r["per_cu"], resident=r["resident"],
                             overhead_us=r["overhead_us"], exposures=r["exposures"], walk_scale=r["walk_scale"],
                             zero_latency_tile_cycles=r["zero_latency_tile_cycles"], fixed_cycles=r["fixed_cycles"]))
        held_rows = [r for r in rows if r["role"] == "held-out"]
        steps = []
        for st in old_steps:
            if st["before_version"] in ok and st["after_version"] in ok:
                mr = measured_ratio(st)
                pa_ = _predict_point(results[st["after_version"]], st["shape"], best)
                pb_ = _predict_point(results[st["before_version"]], st["shape"], best)
                pr = pa_["predicted_us"] / pb_["predicted_us"]
                same = _same_direction(mr, pr)
                steps.append(dict(quoted_in=st["quoted_in"], batch=st["shape"]["batch"], context=st["shape"]["context"],
                                  measured_ratio=mr, predicted_ratio=pr, sign_ok=bool(same), subject=st["subject"],
                                  before=st["before_version"], after=st["after_version"], gap=bool(st.get("before_gap")),
                                  serial=_serial(pa_) and _serial(pb_),
                                  fresh=st["before_version"] in fresh or st["after_version"] in fresh))
        later = _later_steps(new_steps, late, best)
        summary = dict(
            versions=len(order), versions_ok=len(ok), points=len(usable), fit_points=len(fit_set),
            held_out=len(held_rows), fitted={k: v for k, v in best.items() if len(GRID[k]) > 1},
            held_constants={k: v for k, v in best.items() if len(GRID[k]) == 1}, priors=priors,
            held_within_15=sum(abs(r["err"]) <= 0.15 for r in held_rows),
            held_median_abs_err=sorted(abs(r["err"]) for r in held_rows)[len(held_rows) // 2] if held_rows else float("nan"),
            held_mean_abs_err=sum(abs(r["err"]) for r in held_rows) / max(1, len(held_rows)),
            spearman_held=spearman([r["predicted_us"] for r in held_rows], [r["measured_us"] for r in held_rows]),
            spearman_all=spearman([r["predicted_us"] for r in rows], [r["measured_us"] for r in rows]),
            steps=len(steps), steps_sign_ok=sum(s["sign_ok"] for s in steps),
            **_fresh_summary(rows, steps), latency_regime=_latency_regime(rows, steps),
            **_later_summary(later, late),
            failures={sha[:8]: (r.get("error") or "")[-400:] for sha, r in results.items() if r.get("error")}
            | {f"{k[0][:8]}{k[1]}": (r.get("error") or "")[-400:] for k, r in late.items() if r.get("error")},
        )
        return best, rows, steps, later, summary

    best, rows, steps, later, summary = evaluate(args.fit_offset)
    # the other two folds of a three-fold cross-validation, the same model form and grid
    summary["fit_offset"] = args.fit_offset
    summary["folds"] = {str(args.fit_offset): _fold_figures(summary)}
    for other in (o for o in range(3) if o != args.fit_offset):
        summary["folds"][str(other)] = _fold_figures(evaluate(other)[4])
    summary["verdict"] = _verdict(summary)
    summary["loaded_latency"] = args.loaded_latency
    summary["cu_contention"] = args.cu_contention
    summary["utilisation_of"] = args.utilisation_of
    summary.update(gpu=GPU, gpu_name=_gpu().name, gpu_cus=_gpu().compute_units)
    summary["branch_frequencies"] = USE_BRANCH_FREQUENCIES
    Path(args.out).write_text(_report(summary, rows, steps, data, later))
    if args.json:
        slim = [{k: v for k, v in r.items() if k not in ("quote",)} for r in rows]
        Path(args.json).write_text(json.dumps(dict(summary=summary, rows=slim, steps=steps, later_steps=later),
                                              indent=1, sort_keys=True) + "\n")
    log(f"report written to {args.out}")
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, default=str))
    return 0


def _same_direction(measured, predicted) -> bool:
    """A measured change of more than 2% needs a predicted change of more than 1% the same way; a
    smaller one, a predicted change within 5%."""
    if measured < 0.98:
        return predicted < 0.99
    if measured > 1.02:
        return predicted > 1.01
    return abs(predicted - 1) <= 0.05


#: the configuration every point and step of the first rounds has (the tile kernel's test defaults then)
LEGACY_CONFIG = (8, 1, 128, 1024, 1, "per-tensor")


def _config_tag(shape) -> str:
    """A name for a shape's sample configuration (what the emulated sample depends on): '' for the
    first rounds' one, so their cached results keep their names."""
    c = (shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"], shape["block_size"], shape["query_length"],
         shape["scales"])
    return "" if c == LEGACY_CONFIG else f".h{c[0]}x{c[1]}.d{c[2]}.b{c[3]}.q{c[4]}.{c[5]}"


def _step_shapes(st) -> list:
    """(label, [(before version, shape), (after version, shape)]) per assumption a later step is
    predicted under: each block size it names when its quote states none, each with the partition
    counts it forces (a partition-count step: one version, two counts)."""
    out = []
    for bs in st.get("assume_block_sizes") or [st["shape"]["block_size"]]:
        b = dict(st["shape"], block_size=bs)
        a = dict(b)
        if "before_partitions" in st:
            b["partitions"], a["partitions"] = st["before_partitions"], st["after_partitions"]
        out.append((f"block {bs}" if st.get("assume_block_sizes") else "", [(st["before_version"], b),
                                                                              (st["after_version"], a)]))
    return out


def _later_steps(new_steps, late, fitted) -> list:
    """The later history's steps predicted by this model at the fitted constants: one row per step,
    with its prediction under each assumption, right only if right under every one."""
    rows = []
    for st in new_steps:
        mr = measured_ratio(st)
        alts = []
        for label, ((bsha, bshape), (asha, ashape)) in _step_shapes(st):
            rb, ra = late.get((bsha, _config_tag(bshape))), late.get((asha, _config_tag(ashape)))
            if not rb or not ra or rb.get("error") or ra.get("error"):
                alts.append(dict(label=label, error=(rb or {}).get("error") or (ra or {}).get("error") or "not built"))
                continue
            pb, pa = _predict_point(rb, bshape, fitted), _predict_point(ra, ashape, fitted)
            pr = pa["predicted_us"] / pb["predicted_us"]
            alts.append(dict(label=label, predicted_ratio=pr, sign_ok=_same_direction(mr, pr),
                             ratio_err=pr / mr - 1, before_us=pb["predicted_us"], after_us=pa["predicted_us"],
                             vgpr=[pb["vgpr"], pa["vgpr"]], occupancy=[pb["occupancy_wgs"], pa["occupancy_wgs"]],
                             partitions=[pb["partitions"], pa["partitions"]], bound=[pb["bound"], pa["bound"]],
                             exposures=[pb["exposures"], pa["exposures"]], serial=[_serial(pb), _serial(pa)],
                             flydsl=ra.get("flydsl")))
        built = [a for a in alts if "error" not in a]
        rows.append(dict(quoted_in=st["quoted_in"], before=st["before_version"], after=st["after_version"],
                         quote=st["quote"], subject=st["subject"], shape=st["shape"], measured_ratio=mr,
                         partition_step=[st["before_partitions"], st["after_partitions"]] if "before_partitions" in st
                         else None, vgpr_quoted=st.get("vgpr_quoted"), alternatives=alts,
                         built=len(built) == len(alts), sign_ok=bool(built) and all(a["sign_ok"] for a in built)
                         and len(built) == len(alts)))
    return rows


_FOLD_KEYS = ("fitted", "fit_points", "held_out", "held_within_15", "held_median_abs_err", "spearman_held", "steps",
              "steps_sign_ok", "fresh_points", "fresh_within_15", "later_built", "later_sign_ok", "later_within_15",
              "later_median_ratio_err")


def _fold_figures(summary) -> dict:
    """What one fold of the cross-validation reports: its fit and its held-out figures."""
    return {k: summary[k] for k in _FOLD_KEYS if k in summary}


def _folds_section(s) -> list:
    folds = s.get("folds") or {}
    if len(folds) < 2:
        return []
    names = list(s["fitted"])
    out = [
        "## Cross-validation: the fit on each third",
        "",
        "The fit rule takes every third of the points the flydsl 0.5.0 builds give (the same 11 points in every "
        "round: fold 0). The same fit on the other two thirds (folds 1 and 2, `--fit-offset`), each holding out "
        "the rest, the fresh points and every step, says how much the figures above owe to which points were "
        f"fitted. The report above is fold {s.get('fit_offset', 0)}.",
        "",
        "| fold | fitted " + " / ".join(names) + " | held-out within 15% | median abs error | Spearman held-out | "
        "quoted steps right | fresh within 15% | later steps right, within 15%, median abs ratio error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in sorted(folds):
        f = folds[k]
        fit = " / ".join(f"{f['fitted'].get(n, float('nan')):g}" for n in names)
        out.append(f"| {k} | {fit} | "
                   f"{f['held_within_15']}/{f['held_out']} | {f['held_median_abs_err']:.1%} | {f['spearman_held']:.3f} | "
                   f"{f['steps_sign_ok']}/{f['steps']} | {f.get('fresh_within_15', 0)}/{f.get('fresh_points', 0)} | "
                   f"{f.get('later_sign_ok', 0)}/{f.get('later_built', 0)}, {f.get('later_within_15', 0)}/"
                   f"{f.get('later_built', 0)}, {f.get('later_median_ratio_err', float('nan')):.0%} |")
    out.append("")
    return out


def _later_summary(later, late) -> dict:
    built = [r for r in later if r["built"]]
    errs = sorted(abs(a["ratio_err"]) for r in built for a in r["alternatives"])
    vg = [(q, a["vgpr"][i]) for r in built for a in r["alternatives"][:1] if r["vgpr_quoted"]
          for i, k in enumerate(("before", "after")) if (q := r["vgpr_quoted"].get(k)) is not None]
    return dict(later_steps=len(later), later_built=len(built), later_sign_ok=sum(r["sign_ok"] for r in later),
                later_within_15=sum(all(abs(a["ratio_err"]) <= 0.15 for a in r["alternatives"]) for r in built),
                later_median_ratio_err=errs[len(errs) // 2] if errs else float("nan"),
                later_flydsl=sorted({r.get("flydsl", "?") for r in late.values() if not r.get("error")}),
                later_vgpr_checks=len(vg), later_vgpr_match=sum(q == o for q, o in vg))


def measured_ratio(st) -> float:
    """after / before of a quoted step: its ratio, of its times, or of its 'gap to production'
    multiples (the production kernel's time, measured in the same session at the same shape, cancels)."""
    if "ratio" in st:
        return st["ratio"]
    if st.get("before_gap"):
        return st["after_gap"] / st["before_gap"]
    return st["after_us"] / st["before_us"]


def _fresh_summary(rows, steps) -> dict:
    """The held-out figures of the fresh points alone (and of the steps that touch them)."""
    from pa_tile.perf.validation import spearman

    fr = [r for r in rows if r["fresh"]]
    fs = [s for s in steps if s["fresh"]]
    errs = sorted(abs(r["err"]) for r in fr)
    return dict(
        fresh_versions=sorted({r["commit"][:8] for r in fr}), fresh_flydsl=sorted({r["flydsl"] for r in fr}),
        fresh_points=len(fr), fresh_within_15=sum(e <= 0.15 for e in errs),
        fresh_median_abs_err=errs[len(errs) // 2] if errs else float("nan"),
        spearman_fresh=spearman([r["predicted_us"] for r in fr], [r["measured_us"] for r in fr]) if len(fr) > 1
        else float("nan"),
        fresh_steps=len(fs), fresh_steps_sign_ok=sum(s["sign_ok"] for s in fs))


def production_bound(data):
    """(slowest, fastest) fraction of peak HBM the quoted production kernel achieved on the same
    machine: the HBM floor of its shape over its quoted time range; None without the quote."""
    pr = data.get("production")
    if not pr or not pr.get("measured_us_range"):
        return None
    from pa_tile.perf import model as _m
    from pa_tile.perf.roofline import DecodeShape, time_floor

    sh = pr["shape"]
    ds = DecodeShape(batch=sh["batch"], context=sh["context"], num_q_heads=sh["num_q_heads"],
                     num_kv_heads=sh["num_kv_heads"], head_dim=sh["head_dim"], block_size=sh["block_size"],
                     query_length=sh["query_length"], scales=sh["scales"])
    floor = time_floor(ds, _m._floor_spec(_gpu())).time_us
    lo, hi = pr["measured_us_range"]
    return floor / hi, floor / lo


PRODUCTION = ROOT / "pa_tile" / "data" / "production_prediction.json"


def _production_summary() -> list:
    """The Summary's line on upstream's production kernel (its section: 'Upstream's production kernel')."""
    if not PRODUCTION.exists():
        return []
    r = next((r for r in json.loads(PRODUCTION.read_text())["rows"] if r.get("measured_us")), None)
    if r is None:
        return []
    lo, hi = r["measured_us"]
    return [f"- upstream's production kernel (ecbc2d6b's pa_decode_ps, first predicted 2026-12-06, the fit unchanged): "
            f"b{r['shape']['batch']} ctx{r['shape']['context']} measured {lo}-{hi} us, PREDICTED {r['predicted_us']:.0f} us "
            f"({r['predicted_us'] / hi - 1:+.0%} to {r['predicted_us'] / lo - 1:+.0%}; {r['exposures']:.0f} serial "
            "latencies a partition: outside the calibrated regime)"]


def _production_section(rows=()) -> list:
    """Upstream's production kernel, predicted by ``scripts/predict_production.py`` (its JSON)."""
    if not PRODUCTION.exists():
        return []
    pp = json.loads(PRODUCTION.read_text())
    lines = [
        "## Upstream's production kernel (first predicted 2026-12-06)",
        "",
        f"`python scripts/predict_production.py --flydsl PATH` builds the production `pa_decode_ps_launch` of "
        f"`kernels/pa_decode_fp8.py` at {pp['sha'][:8]} (the code ecbc2d6b's message timed) with flydsl {pp['flydsl']}, "
        "samples it in the emulator (contexts " + "/".join(str(c) for c in pp["sample_contexts"]) + ", one sequence, "
        "one KV head; the work-list kernel at block 1024, the partition kernel at block 16/64) and predicts it on the "
        f"{pp['gpu'].upper()} with this report's fitted constants, unchanged. The quotes were recorded in the data file "
        "before the first prediction (the production quote since the first round, the bandwidth reading on 2026-12-06); "
        "the model and its constants were not changed after it. The harness was, once: its first run timed the "
        "block-16/64 shapes with the block-1024 work-list kernel's sample and grid, though at those blocks upstream "
        "launches its partition kernel and FlyDSL reduce (3610/3597 us then; the block-1024 row is unchanged). At block 1024 the reduce is aiter's `pa_reduce_v1` "
        "(HIP, outside the checkout): charged one launch plus its bytes, a lower bound; the worker stubs it, so the "
        "block-1024 sample's output is not checked. At block 16/64 the same build, run with its FlyDSL reduce on one "
        "CU (contexts 1024 and 300), passes `scripts/run_upstream_pa.py`'s tolerance against the float32 reference "
        "(max error 0.010; checked by hand on 2026-12-06, not by this script).",
        "",
        "| shape | quoted in | measured | PREDICTED | predicted fraction of peak | error | bound | layout | serial latencies / partition | VGPRs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in pp["rows"]:
        sh = r["shape"]
        if r.get("measured_us"):
            lo, hi = r["measured_us"]
            meas, err = f"{lo}-{hi} us", f"{r['predicted_us'] / hi - 1:+.0%} to {r['predicted_us'] / lo - 1:+.0%}"
        elif r.get("fraction_of_peak"):
            meas = f"{r['fraction_of_peak']:.2f} of peak"
            err = f"{r['fraction_of_peak'] / r['predicted_fraction_of_peak'] - 1:+.0%} (time)"
        else:
            meas, err = "(no quote)", ""
        lay = r["layout"]
        where = (f"{lay['bins']} bins of {lay['partitions_per_bin'][0]}-{lay['partitions_per_bin'][1]} partitions"
                 if lay["path"] == "work list" else f"{lay['partitions']} partitions + {lay['reduce']}")
        lines.append(f"| b{sh['batch']} ctx{sh['context']} {sh['num_q_heads']}/{sh['num_kv_heads']} d{sh['head_dim']} "
                     f"block {sh['block_size']} | `{r['quoted_in'][:8]}`{'' if r['same_version'] else ' (another version)'} "
                     f"| {meas} | {r['predicted_us']:.0f} us | {r['predicted_fraction_of_peak']:.2f} | {err} | {r['bound']} "
                     f"| {where} | {r['exposures']:.1f} | {r['vgpr']} |")
    same = next((r for r in pp["rows"] if r.get("measured_us")), None)
    blocks = {r["shape"]["block_size"]: r for r in pp["rows"] if not r["same_version"]}
    lines.append("")
    if same:
        lines.append(
            f"Reading it: at the quoted shape the model puts the production kernel {same['predicted_us'] / same['measured_us'][1] - 1:.0%}-"
            f"{same['predicted_us'] / same['measured_us'][0] - 1:.0%} slow, the largest miss of any point here, in the regime "
            f"the report already flags: its loop waits out {same['exposures']:.0f} memory latencies a partition in series "
            "(28a3bb1e's message: production prefetches K and loads V in place), and the walk charges each the fitted "
            "6400 cycles, which the one-latency loops it was fitted on carry per tile ('Where it misses' above). The "
            f"measured time is close to the model's own HBM term at the fitted efficiency ({same['terms_us']['memory']:.0f} us): "
            "on the hardware those waits hide behind the bandwidth, in the model three resident workgroups' walks do not. "
            "The same defect as the seed versions' batch-16 points, now on code that is not a seed version; the model "
            "was not changed for it.")
    tile = next((r for r in rows if same and r["commit"].startswith(same["quoted_in"][:8])
                 and r["batch"] == same["shape"]["batch"] and r["context"] == same["shape"]["context"]), None)
    if tile:
        lo, hi = same["measured_us"]
        lines.append("")
        lines.append(
            f"Read as a step, the message's own 'gap to production': the tile kernel ecbc2d6b at the same shape measured "
            f"{tile['measured_us']:g} us, {tile['measured_us'] / hi:.2f}-{tile['measured_us'] / lo:.2f} x production's time; "
            f"predicted {tile['predicted_us']:.0f} us, {tile['predicted_us'] / same['predicted_us']:.2f} x production's "
            f"prediction: the model ranks the two kernels the WRONG way round, because it over-predicts the one whose loop "
            "waits out two latencies a partition.")
    if 16 in blocks and 64 in blocks:
        b16, b64 = blocks[16], blocks[64]
        lines.append("")
        lines.append(
            f"The second reading is of main's kernel of 2026-05-29 (another version than the one built here; its heads are "
            f"not stated, 8/1 assumed) at a shape the model predicts in its calibrated regime (one latency a partition): "
            f"{b16['predicted_fraction_of_peak']:.2f} of peak predicted against {b16['fraction_of_peak']:.2f} quoted, and "
            f"block 16 -> 64 predicted {b64['predicted_us'] / b16['predicted_us']:.3f} against the quoted 1.078 (the right "
            "direction, a smaller step). Indicative only: the version differs.")
    if same and same.get("alternatives"):
        alt = same["alternatives"]
        lo, hi = same["measured_us"]
        best = min(alt, key=lambda k: abs(math.log(alt[k] / math.sqrt(lo * hi))))
        f = pp["cap_fits"][best]
        step = {n: blocks[64]["alternatives"][n] / blocks[16]["alternatives"][n] for n in alt} if 16 in blocks and 64 in blocks else {}
        lines.append("")
        lines.append(
            "The same kernel under the per-CU cap on bytes in flight as each fold fitted it ('Memory-level parallelism': "
            f"not the default, chosen after every seed point was seen, fitted before this kernel was predicted): b{same['shape']['batch']} "
            f"ctx{same['shape']['context']} " + ", ".join(f"{alt[n]:.0f} us ({n})" for n in alt) + f" against {lo}-{hi} us. "
            f"The {best.split(', ')[-1]} fit ({f['mem_latency_cycles']:.0f}-cycle latency, {f['cu_bytes_in_flight'] / 1024:.0f} KiB a CU: "
            f"a short latency, the cap carrying the bytes) comes within {alt[best] / hi - 1:+.0%} to {alt[best] / lo - 1:+.0%}"
            + (f"; it calls the other reading's block 16 -> 64 step {step[best]:.3f} (quoted 1.078)" if step else "")
            + ". A lead for a hardware measurement to settle (a CU's bandwidth against its bytes in flight), not a "
            "validation of that form.")
    lines.append("")
    return lines


def _bandwidth_reading_lines(data, s) -> list:
    """The achieved fractions of peak HBM that upstream quotes outside the points (recorded on
    2026-12-06, after the fit: they check hbm_efficiency, they do not set it)."""
    out = []
    for r in data.get("bandwidth_readings", []):
        fit = s["fitted"].get("hbm_efficiency")
        sh = r["shape"]
        gap = (f"; the fitted hbm_efficiency ({fit:.2f}) is below it, so the model would time a memory-bound launch "
               f"of a kernel that good {r['fraction_of_peak'] / fit - 1:.0%} slow" if fit else "")
        out.append(
            f"- a check, not a fit input: {r['quoted_in'][:8]} ({r['date']}, `{r['file']}`, by {r['author'].split(' ')[0]}) "
            f"quotes a counter reading of paged decode on gfx942 at block {sh['block_size']}, context {sh['context']}, "
            f"batch {sh['batch']}: {r['achieved_bytes_per_s'] / 1e12:.2f} TB/s of compulsory bytes, "
            f"{r['fraction_of_peak']:.2f} of peak{gap}; its heads and launch path are not stated, and it is one reading")
    return out


def session_spread(data) -> list:
    """Every figure the messages quote for one (version, shape): its own point and the 'before' of
    each step whose before-version it is (a later commit's A/B re-measures its parent)."""
    def key(sha, sh):  # every field but the block size, which a quote may leave open
        return (sha, sh["batch"], sh["context"], sh["num_q_heads"], sh["head_dim"], sh.get("query_length", 1),
                sh.get("scales", "per-tensor"))

    figs = {}
    for p in data["points"]:
        figs.setdefault(key(p["commit"], p["shape"]), []).append(
            (p["measured_us"], "its point, quoted in " + p["quoted_in"][:8]))
    for st in data["steps"]:
        if "before_us" not in st:  # a ratio (a multiple of production's time, a partition sweep), not a time
            continue
        figs.setdefault(key(st["before_version"], st["shape"]), []).append((st["before_us"], "'before' of the step quoted in " + st["quoted_in"][:8]))
    out = []
    for (sha, b, c, *_), v in figs.items():
        vals = sorted({x for x, _ in v})
        if len(vals) > 1:
            out.append(dict(commit=sha, batch=b, context=c, figures=v, spread=vals[-1] / vals[0] - 1))
    return sorted(out, key=lambda r: -r["spread"])


def _diagnostics(rows, data) -> list:
    """What the measured times imply per workgroup-tile on the busiest CU, against the sampled
    per-tile demands on its units (the evidence behind the contention forms)."""
    from pa_tile.perf import hw as hwm

    clk = _gpu().clock_hz
    out = ["## Evidence: measured cycles per workgroup-tile against the sampled unit demands", "",
           "Measured CU cycles per workgroup-tile = (measured time - this model's launch and reduce) x clock / "
           "(tiles per workgroup x workgroups on the busiest CU). Demands per workgroup-tile from the emulator "
           "sample: SIMD issue (the busiest unit of one SIMD), LDS (bytes / 128 B/clk + conflicts), vector-memory "
           "addresser (clocks per lane group and line). A derived figure, read off the measurements: it is "
           "what any model of the CU must reproduce.", "",
           "| commit | batch | WG/CU busiest | resident | measured cycles/WG-tile | issue | LDS | addresser | sum | measured / sum |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["demands"]
        tot = d["issue"] + d["lds"] + d["vmem_addresser"]
        meas = (r["measured_us"] - r["overhead_us"]) * 1e-6 * clk / max(1, r["tiles"] * r["per_cu"])
        out.append(f"| `{r['commit'][:8]}` | {r['batch']} | {r['per_cu']} | {r['resident']} | {meas:.0f} | "
                   f"{d['issue']:.0f} | {d['lds']:.0f} | {d['vmem_addresser']:.0f} | {tot:.0f} | {meas / tot:.2f} |")
    out += ["", "## Evidence: one version, one shape, several quoted times", "",
            "The messages re-measure a parent in a later session ('sessions differ', the data file says). "
            "Where a version's own quote and a later commit's 'before' figure for it disagree, a step quoted "
            "across that gap can have the opposite sign to the difference of the two versions' own points:", ""]
    for sp in session_spread(data):
        out.append(f"- `{sp['commit'][:8]}` b{sp['batch']} ctx{sp['context']}: "
                   + ", ".join(f"{x:g} us ({w})" for x, w in sp["figures"]) + f": spread {sp['spread']:.1%}")
    out.append("")
    return out


def _ranges(xs) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(f"{xs[i]}" if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _verdict(s) -> str:
    met = (s["held_out"] and s["held_within_15"] == s["held_out"] and s["steps_sign_ok"] == s["steps"]
           and s.get("later_sign_ok", 0) == s.get("later_steps", 0) and s["spearman_held"] >= 0.9)
    return "MET" if met else "NOT MET"


def _fresh_lines(s) -> list:
    if not s.get("fresh_points"):
        return ["- fresh held-out points (never seen by an earlier round): none built"]
    return [
        f"- FRESH held-out points: {s['fresh_points']} of {', '.join(s['fresh_versions'])} (built with "
        f"{', '.join(s['fresh_flydsl'])}, the release of their date; first predicted after the fit rule and the "
        f"model were fixed; the walk changed once since, after seeing them: 'The walk's branches'): within 15%: "
        f"{s['fresh_within_15']}/{s['fresh_points']}; median |error| {s['fresh_median_abs_err']:.1%}; Spearman "
        f"{s['spearman_fresh']:.3f}; steps touching them with the right direction: "
        f"{s['fresh_steps_sign_ok']}/{s['fresh_steps']}",
    ]


def _later_lines(s) -> list:
    if not s.get("later_steps"):
        return []
    return [f"- FRESH steps of the later history (2026-07-06..07-20, first predicted by this model, nothing changed "
            f"after): {s['later_sign_ok']}/{s['later_steps']} in the right direction under every shape assumption; "
            f"after/before within 15% of the measured ratio under every assumption: {s['later_within_15']}/"
            f"{s['later_built']}; median |ratio error| {s['later_median_ratio_err']:.0%}; built with "
            f"{', '.join(s['later_flydsl'])} (the releases of their dates), which reproduce "
            f"{s['later_vgpr_match']}/{s['later_vgpr_checks']} register counts their messages quote"]


def _later_section(s, later) -> list:
    if not later:
        return []
    out = [
        "## Fresh steps from the later history (2026-07-06..07-20), first predicted on 2026-12-04",
        "",
        "The versions after 2026-07-03 quote mostly ratios, which earlier rounds set aside. Read again, "
        f"{len(later)} steps come with enough of a shape to predict (`round` in the data file; each step's `note` says what is "
        "assumed):",
        "",
        "- four partition-count steps, from the comment 2154f0cf put on its split heuristic: the same kernel "
        "launched with two partition counts, 'measured directly on an 80-CU MI308X' (which also confirms the "
        "'Device' below). The harness compiles the version with each count forced;",
        "- seven steps quoted as multiples of production's `pa_decode_ps_kernel` at the same shape ('vs baseline', "
        "'vs production'; production's time cancels): head_dim 64 (1f52610e), and multi-token decode with 64 query "
        "rows a KV head (M_TILES = 4), per-token and per-tensor scales, block 16 and 64, across two occupancy "
        "cliffs (63e97d4b .. b1517f1c);",
        "- three absolute-time steps (a second read of the same history, round `2026-12-04b`): 81f14e5c quotes "
        "'settled-GPU' times against its parent 1b3509bd for head_dim 64, per-token scales, 48 and 64 query rows a "
        "KV head (M_TILES 3 and 4) at contexts 1027 and 8192; recorded (the commit after bc6c1b8) before they were "
        "first predicted, with bc6c1b8's model unchanged. The message says 'occ 2 both ways'; the 0.2.4 build "
        "gives 2 -> 3 workgroups a CU at M_TILES 3 (the after's 166 registers), so at least that one is not what "
        "was measured, or the quote's 'occ' is the M4 case's.",
        "",
        "Protocol: the steps, their quotes, their shape assumptions and the flydsl release each is built with were "
        "committed (7cd83bc) before any of them was predicted; the model and the fit are 6db3a52's, unchanged (the "
        "fit uses points only). Where a quote names no block size the step is predicted at 16 and at 64 and counts "
        "right only if right at both. Nothing was changed after seeing these figures.",
        "",
        "Build: each version with the flydsl release of its date, pip-installed into the work dir: 0.2.4 "
        "(2026-07-12) for 2026-07-17..20, 0.2.3 (2026-07-08) for 2026-07-09/10, and 0.2.3 for 2154f0cf "
        "(2026-07-06), which 0.2.2, its date's release, cannot build (`buffer_load(is_scalar=...)`). The check: "
        "the register counts the messages quote are reproduced exactly (table). With flydsl 0.5.0 the same "
        "versions compile to different counts (63e97d4b at block 16: 263 registers instead of 256; 24f89c69: 260 "
        "instead of 244; checked by hand when the rule was chosen, before any prediction), so the occupancy "
        "cliffs those steps cross would not reproduce with it.",
        "",
        "| step | quoted | shape | measured after/before | predicted | ratio error | direction | registers quoted -> built "
        "| WG/CU | bound before -> after | serial latencies / tile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in later:
        sh = r["shape"]
        shape = (f"b{sh['batch']} ctx{sh['context']} {sh['num_q_heads']}/{sh['num_kv_heads']} d{sh['head_dim']} "
                 f"ql{sh['query_length']} {sh['scales']}")
        step = (f"`{r['before'][:8]}` NP {r['partition_step'][0]} -> {r['partition_step'][1]}" if r["partition_step"]
                else f"`{r['before'][:8]}` -> `{r['after'][:8]}`")
        q = r["vgpr_quoted"] or {}
        for a in r["alternatives"]:
            if "error" in a:
                out.append(f"| {step} | '{r['quote']}' | {shape} {a['label']} | {r['measured_ratio']:.3f} | not built: "
                           f"{a['error'][-120:]} | | | | | | |")
                continue
            regs = (f"{q.get('before', '?')} -> {q.get('after', '?')} / {a['vgpr'][0]} -> {a['vgpr'][1]}" if q
                    else f"(none) / {a['vgpr'][0]} -> {a['vgpr'][1]}")
            bs = a["label"] or f"block {sh['block_size']}"
            out.append(f"| {step} | '{r['quote']}' | {shape} {bs} | {r['measured_ratio']:.3f} | "
                       f"{a['predicted_ratio']:.3f} | {a['ratio_err']:+.0%} | {'right' if a['sign_ok'] else 'WRONG'} | "
                       f"{regs} | {a['occupancy'][0]} -> {a['occupancy'][1]} | {a['bound'][0]} -> {a['bound'][1]} | "
                       f"{a['exposures'][0]:.2f} -> {a['exposures'][1]:.2f} |")
    out += ["", *_later_reading(later), ""]
    return out


def _later_reading(later) -> list:
    """What the later steps say, from their own figures."""
    alts = [(r, a) for r in later for a in r["alternatives"] if "error" not in a]
    if not alts:
        return []
    big = [(r, a) for r, a in alts if abs(a["ratio_err"]) > 0.15]
    serial = [(r, a) for r, a in big if any(a["serial"])]
    few = [(r, a) for r, a in big if not any(a["serial"]) and r["partition_step"]]
    rest = [(r, a) for r, a in big if not any(a["serial"]) and not r["partition_step"]]

    def names(xs):
        return ", ".join(f"`{r['after'][:8]}`" + (f" NP {r['partition_step'][0]} -> {r['partition_step'][1]} b"
                                                   f"{r['shape']['batch']} ctx{r['shape']['context']}"
                                                   if r["partition_step"] else "") + (f" ({a['label']})" if a["label"]
                                                                                      else "")
                         for r, a in xs) or "none"
    return [
        "Reading them: every direction is right, both occupancy cliffs and all four partition counts included "
        "(the model sees a cliff through the built register count). The size of a step is less sure: "
        f"{len(big)} of the {len(alts)} predictions (step x assumption) miss the measured ratio by more than 15%.",
        "",
        f"- {len(serial)} have a side the model times outside its calibrated regime (a latency-bound loop waiting "
        f"out more than 1.5 memory latencies a tile in series, where the points below show it over-predicting), "
        f"and each predicts {'a larger' if all(a['ratio_err'] < 0 for _, a in serial) else 'a different'} gain "
        f"than measured: {names(serial)};",
        f"- {len(few)} are partition-count steps in the calibrated regime: {names(few)};",
        f"- the rest: {names(rest)}.",
        "",
        "So on this evidence the model ranks two variants the right way, and sizes the gain within 15% on "
        f"{sum(abs(a['ratio_err']) <= 0.15 for _, a in alts)} of {len(alts)} predictions; read a predicted gain as a "
        "direction first, above all across a change of latency regime. Seen after the predictions, not used: "
        "1f52610e's message gives its parent's register count at head_dim 64 ('drops VGPR 92->84'), and the "
        "block-16 build has 92 (the block-64 one 90); at block 16 that step is predicted at its measured ratio.",
    ]


def _serial(r) -> bool:
    """Outside the regime the fitted latency was calibrated on (``model.outside_calibration``)."""
    from pa_tile.perf import model

    return model.outside_calibration(r["bound"], r["exposures"])


def _latency_regime(rows, steps=()) -> dict:
    """Held-out errors (and steps) split by whether a point is in the regime the fitted latency was
    calibrated on (:func:`_serial`)."""
    fit_exp = [r["exposures"] for r in rows if r["role"] == "fit"]
    out = dict(fit_exposures=[min(fit_exp), max(fit_exp)] if fit_exp else [])
    for name, serial in (("serial", True), ("calibrated", False)):
        e = sorted(r["err"] for r in rows if r["role"] == "held-out" and _serial(r) == serial)
        st = [x for x in steps if x["serial"] == serial]
        out[name] = dict(points=len(e), within_15=sum(abs(x) <= 0.15 for x in e),
                         err_range=[e[0], e[-1]] if e else [], errors=e,
                         steps=len(st), steps_sign_ok=sum(x["sign_ok"] for x in st))
    return out


def _implied_latency(r, clk) -> float | None:
    """The load-to-use latency a latency-bound point's measured time implies, per serial exposure:
    (measured CU cycles per tile - the walk with no latency) / exposures; one resident workgroup."""
    if not (r["bound"].startswith("memory latency") and r["resident"] == 1 and r["exposures"] > 0.5):
        return None
    cu_cycles = (r["measured_us"] - r["overhead_us"]) * 1e-6 * clk - r["fixed_cycles"]
    return (cu_cycles / max(1, r["tiles"]) - r["zero_latency_tile_cycles"]) / r["exposures"]


def _walk_section(s, rows) -> list:
    scales = [r["walk_scale"] for r in rows if r.get("walk_scale")]
    if not scales:
        return []
    return [
        "## The walk's branches (2026-12-03; changed after every held-out point was seen)",
        "",
        "The walk of a loop visits each basic block as often as the sample ran it "
        "(`model.block_frequencies`). Until then the sample counted only memory instructions by line, so "
        "a block without one had no count and was walked every iteration, and the model then scaled the walked "
        "iteration by (dynamic instructions per tile) / (walked instructions): the whole iteration, its waits "
        "for memory included. pa_tile's own s5/s6 loop broke both: half its static instructions sit in blocks "
        "that run only on a sequence's last tile (masking, zeroing V past the context), one of them waits for "
        "V, and the ratio there is about 0.51. The scale halved the loop's two waits a tile (K, then V) into "
        "'one latency per tile', the calibrated regime; and with V issued with K the walk would have charged "
        "that last-tile wait every tile. Three changes: the emulator's trace counts every instruction by line "
        "(`Trace(count_lines=True)`; `model.line_trace`), so every block has its frequency; a workgroup's last "
        "tile walks the blocks the steady state skips once, as part of its fixed cost (`model._excess`); the "
        "remaining instruction ratio takes out skipped instructions' issue time, not waits (`predict`, "
        "`skipped`; a skipped block of VALU work makes no load return sooner). And a fourth, found on the same "
        "loop: the walk's two warm-up iterations were dropped, so a workgroup's first tile, which waits for the "
        "page ids its prologue issued where a steady tile finds them ready, cost nothing anywhere; their excess "
        "over a steady tile is now the workgroup's fixed cost (`kernel_code`, 'fill'), paid once per workgroup, "
        "so more often by a split into short workgroups.",
        "",
        "They were made for pa_tile's kernels, not to fit these points, but after all of them had been seen, so "
        "nothing below is an unseen validation of them. On the seed versions the first two change nothing (their "
        "loops have no such blocks: the same figures with and without), the third little: their ratio is "
        f"{min(scales):.3f}-{max(scales):.3f} (`walk_scale` per point in the JSON); with those three and the fit "
        "unchanged (0.50 / 6400 cycles / 2 us) 27/34 held-out within 15%, median |error| 7.6%, Spearman 0.978, "
        "29/33 steps. Before these changes: 27/34, 6.5%, 0.979, 29/33. With the fourth, refitted by the same "
        "rule on the same 11 points: the Summary's figures. What they change is pa_tile's "
        "own predictions: its s5 and s6 loops show the two latencies a tile they wait out, and chapter 5 "
        "then issues V with K (`s5.v_with_k`, 'When to load V'), one latency a tile, the calibrated regime, "
        "and the first tile's page ids before it stages the query (what the fill charges it for).",
        "",
    ]


def _mlp_section() -> list:
    """Memory-level parallelism (2026-12-06): a model form tried after every point had been seen, and not
    adopted; its figures are from runs of this script (the commands are in the text), not this run."""
    return [
        "## Memory-level parallelism (2026-12-06; tried after every point was seen, not adopted)",
        "",
        "Where the model misses most, a loop waits for several memory latencies a tile in series (the earliest "
        "versions at batch 16; the multi-token 'before' builds of the later history, which wait out 4-8 and whose "
        "gains the model over-predicts by 25-58%): the walk charges every wait a whole fitted latency (6400 "
        "cycles), while the measured times imply about 2500-3400 cycles a wait ('Where it misses', below). One "
        "reading is Little's law on one CU: a CU keeps a bounded number of bytes of requests outstanding, so a "
        "wait for a large batch of loads costs one latency plus the batch's bytes at (cap / latency), and a loop "
        "that waits for K and V apart pays the latency twice but the bytes once. `hw.cu_bytes_in_flight` is that "
        "cap: the walk holds a request at the addresser until the bytes in flight leave room for it "
        "(`model._Walker._admit`), and R resident workgroups share it as a fourth queueing station of the "
        "mean-value analysis, each tile holding its bytes for one loaded latency. It is 0 (no cap) by default; "
        "`--memory-parallelism` fits it with the other three on the same points (grid 32 KiB-2 MiB and 0; the first "
        "grid, 8-128 KiB, fitted its top, and was widened after seeing that). Nothing else changed.",
        "",
        "Three-fold cross-validation ('Cross-validation' above: the no-cap column is what this run prints there, "
        "the cap column what a `--memory-parallelism` run prints there; the fresh points and steps are held out in "
        "every fold). Figures: held-out "
        "within 15% / median |error| / Spearman held-out / quoted steps right / later-history steps right, "
        "within 15%, median |ratio error|; fitted hbm_efficiency / mem_latency_cycles / launch_us / cap:",
        "",
        "| fold | no cap (the default) | fit | with the cap fitted | fit |",
        "|---|---|---|---|---|",
        "| 0 (every round's fit set) | 27/34, 8.2%, 0.978, 29/33; 14/14, 5/14, 25% | 0.50 / 6400 / 2 | "
        "31/34, 6.5%, 0.989, 27/33; 14/14, 7/14, 19% | 0.50 / 4800 / 4 / 512 KiB |",
        "| 1 | 27/34, 6.8%, 0.983, 29/33; 14/14, 5/14, 26% | 0.50 / 6400 / 0.5 | "
        "29/34, 9.4%, 0.988, 28/33; 14/14, 5/14, 22% | 0.50 / 4800 / 1 / 512 KiB |",
        "| 2 | 27/34, 6.3%, 0.969, 29/33; 14/14, 5/14, 25% | 0.50 / 6400 / 2 | "
        "29/34, 7.4%, 0.978, 28/33; 11/14, 10/14, 9% | 0.50 / 800 / 8 / 64 KiB |",
        "",
        "Reading it: with the cap, more held-out points fall within 15% in every fold (+4, +2, +2) and the rank "
        "correlation rises in every fold, but the quoted steps lose one or two in every fold (latency-only changes "
        "such as 2fc39dc7's carried page and 67047563's skipped reload, predicted exactly flat once the shared cap "
        "binds), the median error rises in two folds of three, and the fitted constants do not agree between "
        "folds (cap 64 KiB-512 KiB, latency 800-4800 cycles, launch 1-8 us): four constants on eleven points are "
        "not identified by these data. Fold 2's fit sizes the later history's gains best (median 9%) and gets "
        "three of their directions wrong. The earliest versions at batch 16 stay the worst points with the cap "
        "too (+27% to +40% in fold 0). Tried as well, not kept (a quick variant, not a flag of this script): the cap "
        "in the walk alone, each workgroup with its own and no shared station: worse in every fold (held-out 24, 26, "
        "28 of 34; steps 27, 26, 27 of 33) and the batch-16 points still +55% to +82%, so what the shared form gains "
        "comes from the lower latency it fits once the station carries the loaded throughput, not from the bytes a "
        "lone workgroup keeps in flight. So the default stays without a cap; the mechanism stays in the model, off, "
        "for a hardware measurement to decide (a per-CU bandwidth-vs-bytes-in-flight microbenchmark would fix "
        "the cap without fitting it). Rerun: `python scripts/validate_model.py --flydsl PATH --memory-parallelism "
        "[--fit-offset 1|2]`.",
        "",
    ]


def _fresh_section(s, rows, steps) -> list:
    if not s.get("fresh_points"):
        return []
    clk = _gpu().clock_hz
    lat = s["fitted"]["mem_latency_cycles"]
    reg = s["latency_regime"]
    out = [
        "## The first fresh points: the six earliest versions, built with flydsl 0.2.2",
        "",
        "The six earliest versions (2026-06-29/30, the tile-API kernel: fx.gemm, tiled copies; e9e28750, the first, "
        "has no quoted time, only 'gap to production' multiples, so it enters as four ratio steps) trace with "
        "neither flydsl 0.5.0 nor 0.4.2. They build with flydsl 0.2.2, the release of their date: pr-825 forked from main "
        "at f5c50f45 (2026-06-28), after v0.2.2 (2026-06-17) and before v0.2.3 (2026-07-08). This script "
        "pip-installs it into the work dir (`--fallback-flydsl`, default 0.2.2) and, in its worker only, lets the "
        "emulator hook run under it (`_fit_hook_to_seed_flydsl`: two self-test checks that do not apply are "
        "skipped; the sanitizer still checks every access of the sampled launches).",
        "",
        "Protocol: the fit rule (every third point of the versions 0.5.0 builds: the same 11 points as every "
        "earlier round) and the model were committed (76e0cc4; e9e28750's ratio steps in 67a7a28) before these "
        "versions were first predicted, and nothing was changed in that round after seeing them. A later round changed "
        "the model once more ('The walk's branches' above); as first predicted, before it, these points were 9/12 within 15%, "
        "median |error| 5.9%, Spearman 0.991, steps 10/13 the right way. The figures below are this model's.",
        "",
        *_fresh_lines(s),
        "",
        "| commit | batch | context | measured us | predicted us | error | bound | serial latencies / tile | resident WGs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["fresh"]:
            out.append(f"| `{r['commit'][:8]}` | {r['batch']} | {r['context']} | {r['measured_us']:g} | "
                       f"{r['predicted_us']:.0f} | {r['err']:+.0%} | {r['bound']} | {r['exposures']:.2f} | "
                       f"{r['resident']} |")
    out += ["", "| step | batch | measured after/before | predicted | direction | both in the serial regime |",
            "|---|---|---|---|---|---|"]
    for st in steps:
        if st["fresh"]:
            out.append(f"| `{st['before'][:8]}` -> `{st['after'][:8]}`{' (gap ratio)' if st['gap'] else ''} | "
                       f"{st['batch']} | {st['measured_ratio']:.3f} | {st['predicted_ratio']:.3f} | "
                       f"{'right' if st['sign_ok'] else 'WRONG'} | {'yes' if st['serial'] else 'no'} |")
    ser, cal = reg["serial"], reg["calibrated"]
    imp = sorted(x for x in (_implied_latency(r, clk) for r in rows if r["role"] == "held-out") if x is not None)
    imp_serial = sorted(x for x in (_implied_latency(r, clk) for r in rows if r["role"] == "held-out"
                                    and _serial(r)) if x is not None)
    out += [
        "",
        "Where it misses. 'Serial latencies / tile' is how many memory latencies one wave's walked tile waits "
        "out in series (`KernelCode.latency_exposures`: the slope of the walk in the latency). Every fit point "
        f"has {reg['fit_exposures'][0]:.2f}-{reg['fit_exposures'][1]:.2f}: the fitted latency ({lat:.0f} cycles) is "
        "calibrated on loops that prefetch a tile ahead. The early versions wait out about three per tile (load, "
        "wait, compute, load again). Held-out points split by that regime:",
        "",
        f"- latency-bound with more than 1.5 serial latencies per tile: {ser['within_15']}/{ser['points']} within "
        "15%, errors " + ", ".join(f"{e:+.0%}" for e in ser["errors"])
        + f"; steps between two such predictions with the right direction: {ser['steps_sign_ok']}/{ser['steps']}",
        (f"- every other held-out point: {cal['within_15']}/{cal['points']} within 15%, errors "
         f"{cal['err_range'][0]:+.0%} to {cal['err_range'][1]:+.0%}" if cal["points"] else "- every other held-out point: none")
        + f"; every other step: {cal['steps_sign_ok']}/{cal['steps']}",
        "- the latency per serial exposure the measured times imply, latency-bound points with one resident "
        "workgroup ((measured CU cycles per tile - the walk with no latency) / exposures): "
        + ", ".join(f"{x:.0f}" for x in imp) + " cycles"
        + (f"; of those with about three per tile: {', '.join(f'{x:.0f}' for x in imp_serial)}" if imp_serial else ""),
        "",
        f"So the fitted {lat:.0f} cycles is an effective per-tile figure more than a per-load one: of the "
        f"{len(imp_serial)} latency-bound points whose loop waits out several latencies in series, "
        f"{sum(x < 0.75 * lat for x in imp_serial)} imply less than three quarters of it per exposure, and the model "
        "over-predicts them (at high batch the same versions are addresser-bound and predicted well). What the "
        "effective figure carries per tile that is not per load is not established "
        "(candidates, untested: the dependent block-table -> address -> K/V chain the walk charges at SMEM "
        "latency; TLB misses). The model was NOT changed for this: every held-out point has now been seen, and a "
        "change made now would be fitted on all of them. Instead `pa_tile predict` prints the serial latencies "
        "per tile and warns when a latency-bound prediction is outside the calibrated regime, quoting these "
        "errors (`pa_tile/data/model_validation.json`, `latency_regime`). pa_tile's s5 and s6 loops wait out "
        "one per tile (the calibrated regime, since chapter 5 issues V with K: 'The walk's branches' above); s1 (the "
        "naive kernel) about five.",
        "",
    ]
    return out


def _report(s, rows, steps, data, later=()) -> str:
    subj = {}
    out = [
        "# Timing model validation: predicted vs measured gfx942 times of the pr-825 seed versions",
        "",
        "Generated by `python scripts/validate_model.py --flydsl <ROCm/FlyDSL git>`; do not edit by hand.",
        f"Device the quoted times are predicted on: {s['gpu_name']} ({s['gpu_cus']} CUs, `--gpu {s['gpu']}`; "
        "see 'Device' below: the data file calls it MI300X, the evidence says an 80-CU MI308X).",
        "The model is `pa_tile.perf.model` (constants: `pa_tile.perf.hw`). Measured times are the ones the",
        "pr-825 commit messages quote (`pa_tile/data/pr825_mi300x_timings.json`, each with its commit and quote).",
        "",
        f"Shape assumption (not a quote): {data['shape_assumption']}",
        "",
        "## Summary",
        "",
        f"- seed versions compiled with flydsl 0.5.0 (+ the two-module shim described in the script), or where it "
        f"cannot build them with {', '.join(s.get('fresh_flydsl') or ['no fallback'])}, and sampled in the "
        f"emulator: {s['versions_ok']}/{s['versions']}",
        f"- points: {s['points']}; fitted on {s['fit_points']} (every third of the 0.5.0-built versions' points), "
        f"held out {s['held_out']}",
        "- fit: grid search (scripts/validate_model.py GRID: hbm_efficiency 0.50-0.95, mem_latency_cycles 200-12800, "
        "launch_us 0.25-16) on the mean |log(predicted/measured)| of the fit points; the grid was widened in an "
        "earlier round, after seeing that round's earlier held-out errors and its two fitted constants at the old "
        "grid's edges (see 'Contention and utilisation')",
        (f"- lower bound of the hbm_efficiency grid: the production pa_decode_ps_kernel quote (~{data['production']['measured_us_range'][0]}-"
         f"{data['production']['measured_us_range'][1]} us at b128 ctx16384, ecbc2d6b's message) reads the same bytes at "
         f"{production_bound(data)[0]:.2f}-{production_bound(data)[1]:.2f} of peak on the same machine, so the achievable "
         "fraction is at least 0.47; the grid starts at 0.50 (chosen after seeing a fit at 0.30 predict ecbc2d6b b128 "
         "memory-bound, i.e. after seeing a held-out error; the bound uses no held-out point)"
         if production_bound(data) else "- no production bound on hbm_efficiency"),
        *_bandwidth_reading_lines(data, s),
        f"- FITTED constants: " + ", ".join(f"`{k}` = {v:g} (prior {s['priors'][k]:g})" for k, v in s["fitted"].items())
        + "".join(f"; `{k}` held at {v:g} (not fitted in this run"
                  + ("; 0 = no cap, `--memory-parallelism` fits it: 'Memory-level parallelism'" if k == "cu_bytes_in_flight"
                     else "") + ")" for k, v in s.get("held_constants", {}).items()),
        "- fit at the grid's edge: " + (", ".join(f"`{k}` = {v:g} ({'lowest' if v == min(GRID[k]) else 'highest'}"
                                                 + ("; the physical bound above, not the grid's end"
                                                    if k == "hbm_efficiency" and v == min(GRID[k]) else "") + ")"
                                                 for k, v in s["fitted"].items() if v in (min(GRID[k]), max(GRID[k])))
                                       or "none") + " (effective values)",
        f"- held-out points within 15%: {s['held_within_15']}/{s['held_out']}; median |error| "
        f"{s['held_median_abs_err']:.1%}, mean |error| {s['held_mean_abs_err']:.1%}",
        f"- Spearman rank correlation, held-out: {s['spearman_held']:.3f}; all points: {s['spearman_all']:.3f}",
        *_fresh_lines(s),
        f"- quoted before->after steps with the right direction: {s['steps_sign_ok']}/{s['steps']}",
        *([f"- three-fold cross-validation (the same fit on each third, 'Cross-validation'): held-out within 15% "
           + ", ".join(f"{f['held_within_15']}/{f['held_out']}" for _, f in sorted(s["folds"].items()))
           + "; quoted steps right " + ", ".join(f"{f['steps_sign_ok']}/{f['steps']}" for _, f in sorted(s["folds"].items()))]
          if len(s.get("folds") or {}) > 1 else []),
        *_later_lines(s),
        "- held-out points outside 15%: " + (", ".join(f"`{r['commit'][:8]}` b{r['batch']} {r['err']:+.0%}"
                                                       for r in rows if r["role"] == "held-out" and abs(r["err"]) > 0.15)
                                             or "none"),
        "- steps with the wrong direction: " + (", ".join(f"`{st['quoted_in'][:8]}` b{st['batch']} (measured "
                                                          f"{st['measured_ratio']:.3f}, predicted {st['predicted_ratio']:.3f})"
                                                          for st in steps if not st["sign_ok"]) or "none"),
        *_production_summary(),
        f"- target (issue 14): held-out within 15%, step signs right (the later history's too), Spearman >= 0.9 "
        f"-- {s['verdict']}",
        f"- model form: loaded latency `{s['loaded_latency']}` (pa_tile.perf.model.LOADED_LATENCY), loop branches "
        f"{'as often as the sample ran them' if s['branch_frequencies'] else 'all walked'}; 128-byte lines counted "
        "from each tensor's base; addresser clocks per 64-byte lane group (model.TA_BYTES_PER_CLK); the grid's "
        "tail wave timed with its own residency; resident workgroups share the CU's units as "
        f"`{s.get('cu_contention', 'max')}` (pa_tile.perf.model.CU_CONTENTION: 'mva' = exact mean-value analysis, "
        "'max' = perfect overlap, the previous form); the loaded latency's HBM utilisation is of the "
        f"`{s.get('utilisation_of', 'achievable')}` bandwidth (pa_tile.perf.model.UTILISATION_OF)",
        "",
        *_later_section(s, later),
        *_production_section(rows),
        *_folds_section(s),
        *_mlp_section(),
        *_walk_section(s, rows),
        *_fresh_section(s, rows, steps),
        "## Contention and utilisation (issue 14 follow-up): what changed, and what was chosen after seeing held-out errors",
        "",
        "Every change below was made after the previous report's held-out errors had been seen (the brief named "
        "the misses); none of the 22 held-out points of that round was fresh. Figures are as this script printed them on the same "
        "emulator samples, the fit redone each time (held-out within 15% / median |error| / steps right / "
        "Spearman held-out; fit hbm_efficiency / mem_latency_cycles / launch_us).",
        "",
        "- Previous model (perfect overlap, `--cu-contention max`), old grid: 17/22, 8.1%, 19/20, 0.975; fit 0.55 / "
        "6400 / 1 (latency at the old top, launch at the old bottom). Same model, widened grid: 17/22, 8.0%, 19/20, "
        "0.975; fit 0.55 / 6400 / 0.25 (latency now interior; launch at the new bottom, 0.25 us: the overlap form "
        "wants no per-kernel cost at all).",
        "- ADDED (1, default): the R resident workgroups of a CU queue for its SIMD issue slots, LDS and "
        "vector-memory addresser, solved by exact mean-value analysis of a closed queueing network "
        "(`model.mva_round`; Reiser & Lavenberg, J. ACM 27(2), 1980; Lazowska et al., Quantitative System "
        "Performance, 1984). It has no constant of its own: the demands are the sample's per-tile counts already "
        "in the model, the delay station is the rest of one workgroup's walked tile. One workgroup alone is timed "
        "as before; the previous form (a round = the largest of the walk and R x each unit's demand) assumed "
        "the units overlap perfectly, which the evidence table below contradicts. Alone, on the widened grid "
        "(hbm_efficiency from 0.30): 16/22, 8.4%, 19/20, 0.982; fit 0.50 / 4800 / 1, no constant at an edge. It "
        "moved the dwordx2 versions from -30..-34% to -24..-28% and ecbc2d6b b128 from +49% to +42%, and lost "
        "1f75c079 b1 (-1% -> -17%: the lower fitted latency).",
        "- ADDED (2, default): the loaded latency's utilisation is the DRAM's: u = bytes / time / PEAK bandwidth "
        "(`--utilisation-of peak`, model.UTILISATION_OF) instead of a fraction of the fitted achievable bandwidth "
        "(hbm_efficiency x peak). M/M/1's utilisation is the arrival rate over the server's service rate, and "
        "the server the requests queue at is the DRAM; hbm_efficiency is an effective cap that absorbs other "
        "losses. The old form charged ecbc2d6b b128 (2.17 TB/s measured, 41% of peak) a utilisation of 0.82 "
        "of 0.5 x peak, i.e. 5.5x the unloaded latency. With (1), hbm_efficiency from 0.30: 18/22, 8.9%, 19/20, "
        "0.982, but fit 0.30 / 6400 / 2 with hbm_efficiency at the grid's bottom, and ecbc2d6b b128 then "
        "memory-bound at 1.59 TB/s, 38% slow: below the bandwidth that very point measured.",
        "- ADDED (3): the hbm_efficiency grid starts at 0.50, bounded by a measurement that is not one of the "
        "points: the production kernel's quoted ~190-214 us at b128 ctx16384 on the same machine (see the "
        "line above the FITTED constants). With (1) and (2): the figures of this report, 18/22, 7.0%, 19/20, "
        "0.983, fit 0.50 / 6400 / 2 (latency and launch inside the grid, hbm_efficiency at its physical bound). "
        "(1) with the old utilisation and this bound: unchanged, 16/22 (it had fitted 0.50 anyway).",
        "- Tried, NOT the default: `--cu-contention serial` (a round is at least R x the SUM of the three demands, "
        "no overlap between them), the form the evidence table suggests. That table reads all 33 points, the "
        "held-out ones included, so this form's figures are NOT a validation: with (2) and (3), 22/22 within 15%, "
        "median 4.1%, Spearman 0.992, but 17/20 steps (2fc39dc7's b64 and b128, a latency-only change, predicted "
        "flat, and 67047563 b128) and fit 0.50 / 800 / 8: a per-kernel constant four times its prior carries the "
        "low-batch time, and the latency (800 cycles, ~0.4 us) is too short for the walk to bind at 2-3 resident "
        "workgroups, so no latency-only change is visible. (With hbm_efficiency from 0.30 and the old "
        "utilisation: 21/22, 4.3%, 17/20, 0.995, fit 0.35 / 200 / 8.) The same no-overlap reading with the "
        "walk's latency still overlapping the units (`--cu-contention shared`, the mean-value analysis with the "
        "three units as one station): the same figures (22/22, 4.1%, 17/20, 0.992; fit 0.50 / 800 / 8): the fit "
        "again shortens the latency until the walk hides behind the units.",
        "- The previous perfect-overlap form with (2) and (3) (`--cu-contention max`): 12/22, 13.3%, 19/20, 0.979, "
        "fit 0.50 / 9600 / 0.25: the peak utilisation alone, without the queueing, makes it worse.",
        "- Tried, NOT kept (quick in-process fits on a smaller grid, not this script's run): two addresser clocks "
        "per (lane group, line), i.e. every line access moving a 128-byte line over the 64 B/clk path, with the "
        "queueing form: 3/22 (every plain-layout version 20-50% slow: the walk, which also charges it, and the "
        "CU term both double); M/D/1 instead of M/M/1 for the loaded latency (half the queueing delay at the "
        "same utilisation, the Pollaczek-Khinchine form for fixed-length DRAM bursts): no point moved by more "
        "than 5% after the refit. The same quick grid (hbm_efficiency 0.35-0.8) gave the queueing form 18/22 "
        "(fit 0.80 / 6400 / 1) where this script's grid gives 16/22: the fit's loss surface is flat, and the "
        "held-out count moves by about 2 with the grid's spacing.",
        "- Fresh held-out set: none found then (one had been found before: 'The first fresh points' above). Checked then: every later pr-825 commit message (2154f0cf .. 9ebfbeaa) -- "
        "they quote ratios against pa_decode_ps_kernel, or head_dim-64 MTP times (81f14e5c: 'M3 per_token "
        "ctx1027 57.1us->46.8us', 'M4 per_token ctx8192 386us->349us') without the batch or block size, which "
        "cannot be turned into a shape without inventing it; ROCm/FlyDSL commit messages on every other branch "
        "mentioning 'pa' since 2026-04 quote no paged-decode time. ROCm blogs and aiter's benchmarks were not "
        "searched (their kernels are not the seed versions this harness compiles). A later round read those ratios "
        "again and found eleven steps it could state a shape for, and a second read took 81f14e5c's three with the "
        "batch ASSUMED (128, of its sweep's 3/128) and both block sizes predicted ('Fresh steps from the later "
        "history').",
        "",
        "## Device: the quoted times are from an 80-CU MI308X, not a 304-CU MI300X",
        "",
        "The seed versions choose their partition count (grid.z) on the host from the CU count "
        "(`aiter`'s `get_cu_num` or torch's `multi_processor_count`), so the CU count decides which grid each "
        "quoted time belongs to. The messages never name the GPU (only 'gfx942'). Their own statements, read "
        "against each version's heuristic (2fc39dc7: NP = the largest of 1,2,4,8,.. <= ceil(CUs/batch); "
        "879c2e69: also >= ceil(64 tiles/24), candidates 3 and 6 added; 48b7b9c7: production's "
        "max(4, min(ceil(2*CUs/batch), 8))), fit 80 CUs and not 304:",
        "",
        "- 879c2e69 says b96 went 445 -> 329 us, b32 -10%, b64 a tie, b1-16 unchanged. At 304 CUs its heuristic "
        "gives b96 NP 4 -> 4 and b32 NP 8 -> 8 (the same kernel before and after: no step possible); at 80 CUs b96 "
        "NP 1 -> 3 and b32 2 -> 3 (and b64 2 -> 3, which the message calls a tie: a statement about time, "
        "not counted below). The nine statements of 879c2e69/48b7b9c7 about partition counts "
        "(`cu_count_statements` in this script), true at 304 / at 80 CUs:",
    ]
    st304, st80 = cu_count_statements(304), cu_count_statements(80)
    out += [f"  - {k}: {'yes' if st304[k] else 'NO'} / {'yes' if st80[k] else 'NO'}" for k in st80]
    all_true = [c for c in range(1, 513) if all(cu_count_statements(c).values())]
    out += [
        f"  - CU counts (1-512) at which all nine hold: {_ranges(all_true) or 'none'}",
        "- '~1.6 waves/SIMD at high batch' (879c2e69): NP=1 at b128 is 128 workgroups of 4 waves, 128/80 = 1.6 "
        "per SIMD; at 304 CUs that batch ran NP=2, 256/304 = 0.84.",
        "- 'NP=2 is a measured tail-effect trap at b128': 256 workgroups exceed 80 CUs x 3 resident (240), not "
        "304 CUs. 2fc39dc7's 445 us at both b96 and b128 (NP=1, at most 2 workgroups per CU either way) and its "
        "905 us at b256 (256 workgroups > 240 slots: two generations, 2 x 445) say the same.",
        "- The author's other gfx942 measurements name the machine: 'Verified on MI308X (gfx942)' (94b41abe), "
        "'Measured (softmax 8192^2, MI308X)' (34b5f488, e33eca2e). MI308X figures: `pa_tile.perf.hw` [FLYDSL-MI308X].",
        "",
        "So the harness fakes the CU count the seed host code reads as 80 (`--gpu mi308x`, the default) and the "
        "model predicts on `hw.HARDWARE['mi308x']`. This is a correction of the harness, not a fitted constant: "
        "the CU count is read off the messages and the seeds' code, before any prediction. "
        "`pa_tile/data/pr825_mi300x_timings.json` still says `gpu: MI300X` (not this script's file to change).",
        "",
    ]
    if s["failures"]:
        out += ["Versions that could not be compiled or sampled:", ""]
        out += [f"- `{k}`: {v}" for k, v in s["failures"].items()]
        out.append("")
    out += ["## What this does and does not show", "",
            "- The six earliest versions (the tile-API kernel of 2026-06-29/30: fx.gemm, tiled copies) do not trace "
            "with flydsl 0.5.0 nor 0.4.2 (a layout-broadcast error), nor with their own commit's Python sources over "
            "0.5.0's native library (an API mismatch); they build with flydsl 0.2.2, the release of their date "
            "('The first fresh points'). The points cover 2026-06-29 (the tile-API kernel) to 2026-07-03 (blocked K/V "
            "layouts); the later history's ratio steps, 2026-07-06 to 2026-07-20 ('Fresh steps from the later history').",
            "- Emulator stand-ins registered by the harness only: `v_div_scale/fmas/fixup_f32` (normal-range "
            "semantics) and `v_cvt_f32_f16` with an f16 source (so `|x|` is accepted); only the partial kernel is "
            "emulated, the reduce kernel is modelled from its code. Numerics of the seed runs are not checked.",
            "- Branches: the loop's basic blocks are walked as often as the emulator sample ran them (executions "
            "of each memory instruction by line, the busiest wave's; `model.block_frequencies`), mapped onto each "
            "shape's build by instruction sequence. On these versions it changes no figure (the same run with "
            "`PA_TILE_MODEL_BRANCHES=0`, every block walked, gives the same table; rechecked on this report's "
            "model): the blocks the sample skips "
            "are off the walked critical path. It did not rescue 67047563 (skip the block-table reload): "
            "at the sample's short contexts (4 and 8 tiles split 4 ways) no partition crosses a page, so the "
            "reload block never runs in the sample either way, and the version is still predicted slower: its "
            "split blocks leave more `s_waitcnt vmcnt` that stall at all (10 against 6 per iteration), and each "
            "of those grows with the loaded latency (below).",
            "- What changed with the device (each figure as this script printed it on the same samples, the fit "
            "redone each time; held-out within 15% / median |error| / steps right / Spearman held-out): the "
            "previous model at 304 CUs: 14/22, 13.5%, 9/20, 0.980; the same model at 80 CUs: 12/22, 13.3%, 14/20, "
            "0.980 (every partition-count step of 879c2e69 and 48b7b9c7 right: the 304-CU harness had "
            "compiled 879c2e69's b96 with the grid of its parent, and 48b7b9c7's b64/b128 with NP 8/5 instead "
            "of 4/4); + addresser clocks per lane group (below): 14/22, 9.0%, 16/20 (879c2e69's b96 wrong again), "
            "0.957; + the tail wave: "
            "15/22, 9.0%, 16/20, 0.962; + the re-walk form of the loaded latency (below): the previous report's "
            "figures (17/22, 8.1%, 19/20, 0.975; that round's changes are listed under 'Contention and utilisation'). The current model at 304 CUs (`--gpu mi300x`): 5/22, 26.7%, 10/20, 0.934 (fit 0.45 / 6400 "
            "cycles / 8 us); with the count form there: 14/22, 10.4%, 11/20, 0.980. With 8 XCDs "
            "of 10 CUs instead of 4 of 20 (the MI308X XCD count comes from a third-party note) no figure changed "
            "(checked on the 80-CU run of the previous model).",
            "- Addresser clocks per lane group: the addresser takes 64 bytes of request per clock, lanes in order "
            "([ROCPROF] gives the rate; charging each clock's lane group one clock per distinct 128-byte line is "
            "ASSUMED). The per-instruction line count it replaces could not see 61539270's blocked K layout: the "
            "whole wave touches the same lines in either layout (1536 per tile in the sample of 1f75c079, "
            "61539270 and ecbc2d6b alike), so the K step was predicted 1.000. Per lane group the sample gives 4096 "
            "(plain K and V: 4 consecutive lanes, 4 tokens, 4 lines), 2560 (K blocked: one line per 4 lanes) and "
            "1536 (V blocked too) clocks per tile, which is what those commit messages say about their lane "
            "strides; every K/V-layout step now has the right sign. A form chosen after seeing the 1.000.",
            "- Tail wave: the busiest CU's last generation has only the remaining workgroups resident, and its "
            "rounds are timed with that many (issue, LDS and addresser terms scale with residency; the per-wave "
            "latency walk does not).",
            "- Loaded latency, the two forms, on the corrected device: re-walking the loop at the loaded latency "
            "(each wait stalls exactly as long as the longer latency makes it; `--loaded-latency rewalk`) now "
            "validates better on every figure than counting stalled waits (`count`: 15/22, median 9.0%, 16/20 "
            "steps, Spearman 0.962, fit 0.45 / 1600 cycles / 8 us). With the previous model on the 304-CU harness "
            "it was the other way round (re-walk 5/22, median 24.8%, 5/20, 0.917), which is why `count` had been "
            "the default. The "
            "default is now `rewalk` (`model.LOADED_LATENCY` and this script): like the earlier choice, one made "
            "after seeing both. Without any loaded latency (utilisation held at 0, count form) the same samples "
            "gave 19/20 steps but 8/22 held-out within 15% (median 21%), fitted at the grid's edge (6400 cycles): "
            "the utilisation term carries the batch scaling the per-CU terms miss.",
            "- Where it is still wrong, and why (see the two evidence sections below the steps): (1) the "
            "dwordx2 V versions (f44f95f5, 3082ae81) are predicted ~25% fast and the blocked-V version at "
            "batch 64-128 (ecbc2d6b) 17-24% slow. Both are one question, how much the CU's units "
            "overlap: at batch 64-256 (2-3 resident workgroups on the busiest CU) the measured cycles per "
            "workgroup-tile are 1.04-1.15 x the SUM of the sampled issue, LDS and addresser demands for every "
            "code variant from f44f95f5 to ecbc2d6b (one exception, ecbc2d6b b64: 1.22; at batch 1-16, one or two "
            "workgroups and latency-bound, 1.35-2.27; the first table), i.e. at high residency the units hardly "
            "overlap at all, whatever their mix (the addresser is 36% of the sum in ecbc2d6b, 59% in 3082ae81); the measured 3082ae81/e4fcfb4d ratio "
            "(1.54) is the ratio of their addresser clocks (6144/4096 = 1.5: the dwordx2 V load takes twice the "
            "lane-group clocks of the dwordx4 one for the same bytes). A walk with a latency that also explains "
            "batch 1 (one workgroup per CU) leaves too little room for that: the fit either keeps the latency and "
            "under-weights the units (max, mva) or drops the latency (serial). The emulator sample and the "
            "published rates we have cannot say why the units do not overlap (a plausible reading: each wave's "
            "tile is a dependent chain load -> wait -> MFMA -> LDS exchange + barrier, so with 2-3 waves per "
            "SIMD the chains of different workgroups line up); a cycle-level CU model or a hardware counter "
            "trace (TA_BUSY, TD_BUSY, SQ_WAIT_INST_ANY) would. (2) 67047563 b128: the step it quotes (445 -> 421 "
            "us) runs across sessions: its parent's own quote is 388 us and the next commit re-measured "
            "67047563 at ~391 us (the second evidence section). A model that predicts the absolute points (388 "
            "-> 421, +8.5%) must call that step a slowdown; the quoted -5.4% cannot be met together with the "
            "two versions' own points except by error cancellation. The 'all steps right' target is not "
            "attainable on this data as recorded.",
            "- `pa_tile.perf.hw`'s FITTED defaults are this report's fit (they drive `python -m pa_tile predict`, "
            "chapter 07 and the split-K table's model). They are fitted on an 80-CU MI308X; predicting MI300X "
            "(304 CUs) with them assumes the same per-CU latency and the same fraction of peak HBM, an assumption. "
            "`pa_tile/data/partition_table.json` is computed with these defaults (scripts/partition_table.py; "
            "tests/test_partition_choice.py::test_table_is_the_models_argmin checks it is still the model's argmin).",
            "- Tried at 80 CUs and not kept: the walk's addresser shared by every wave resident on the CU (4 x "
            "resident workgroups, instead of the 4 waves of one workgroup issuing alike): 12/22 held-out within "
            "15%, median 14.9%, 15/20 steps, Spearman 0.939 (fit 0.45 / 3200 cycles / 4 us): waves of different "
            "workgroups do not issue their loads together, and charging them as if they did makes every "
            "partition step that raises residency look slower (not committed).",
            "- Earlier attempts, all on the 304-CU harness (their figures are of that harness): a GPU-wide "
            "memory-level-parallelism (Little's law) bound changed no figure (same 14/22, 9/20, 0.980: an "
            "aggregate bound can only bind where the average CU is worse than the busiest, and the per-wave walk "
            "already applies the law to the busiest CU's waves); counting only waits that stall more than a "
            "quarter latency (what a fixed-latency memory would give) predicted far worse (5/22, Spearman 0.917, "
            "11/20 steps). Neither was retried at 80 CUs.",
            "- Coalescing figure: 128-byte lines per vector access used to be counted from raw host addresses, so "
            "they depended on where the host allocator put each run's tensors (differences of two runs swung by "
            "up to 2.7x between runs of the same version; the committed report of the previous model could not "
            "be reproduced: 13/22, 9/20 steps, Spearman 0.973 on a fresh rerun). They are now counted from each "
            "tensor's base, as on a GPU where tensors start at least 256-byte aligned (see model.line_trace).",
            "- The FITTED constants are effective values: they "
            "absorb what the model leaves out, so they are not hardware measurements.",
            "- MI300X and MI355X predictions take the fitted constants as they are: the same per-CU latency in "
            "cycles and the same fraction of peak HBM. Every point here is gfx942, so neither is validated on "
            "gfx950. One published figure bears on the second: FlyDSL's own CI measured its streaming kernels "
            "(rmsnorm, layernorm, softmax, bf16 32768x8192; ROCm/FlyDSL branch `ci-dashboard-data`, first snapshot "
            "19b29885, 2026-06-11) at 3.94-4.18 TB/s on an MI325X (0.66-0.70 of its 6.0 TB/s) and 5.69-5.78 TB/s on "
            "an MI355X (0.71-0.72 of 8.0 TB/s): a streaming kernel's fraction of peak moves by a few points from "
            "gfx942 to gfx950, not by tens. The latency in cycles has no such check.",
            "",
            ]
    out += _diagnostics(rows, data)
    out += ["## Per point", "",
            "| commit | batch | context | measured µs | predicted µs | error | prior-constants µs | floor µs | NP | WG/CU | bound | role |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r['commit'][:8]}` | {r['batch']} | {r['context']} | {r['measured_us']:g} | {r['predicted_us']:.0f} | "
                   f"{r['err']:+.0%} | {r['prior_us']:.0f} | {r['floor_us']:.0f} | {r['partitions']} | {r['occ']} | "
                   f"{r['bound']} | {r['role']}{' (fresh)' if r.get('fresh') else ''} |")
    out += ["", "## Steps (each quoted before -> after pair)", "",
            "| quoted in | batch | context | measured after/before | predicted after/before | direction | commit subject |",
            "|---|---|---|---|---|---|---|"]
    for st in steps:
        out.append(f"| `{st['quoted_in'][:8]}` | {st['batch']} | {st['context']} | {st['measured_ratio']:.3f} | "
                   f"{st['predicted_ratio']:.3f} | {'ok' if st['sign_ok'] else 'WRONG'} | {st['subject'][:70]} |")
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
