"""Run upstream FlyDSL's paged-attention decode kernels, GPU-harness style, in pa_tile's emulator.

Usage: python scripts/run_upstream_pa.py /path/to/FlyDSL [--arch gfx942|gfx950|both] [-k SUBSTR ...]
       [--lds-races raise|warn] [--list]

Written the way a GPU harness is (upstream's ``tests/kernels/test_pa.py`` is the model; nothing is
copied from it): tensors are made with ``device="cuda"``, launches get
``torch.cuda.current_stream()``, and upstream's launchers are called with their own signatures,
as test_pa.py calls them: ``get_recommended_splits``, ``get_pa_metadata`` and
``pa_decode_ps_launch`` from ``kernels.attention.pa_decode_fp8`` (which dispatches to the tile
kernel ``pa_decode_tile`` + its split reduce for block sizes 16/64, to the persistent metadata
kernel + ``pa_metadata_reduce`` for block size 1024, and to the sliding-window kernel + its reduce
when ``sliding_window > 0``), and ``pa_decode_tile`` itself for one partition. The only stand-in
is the device: ``pa_tile.emu.device.simulated_device(arch, cu_count)`` (a ``cuda`` device whose
memory is the host's, its CU count and its default stream). No launch handler, no re-launch, no
rewriting of upstream's source: its modules are imported from the checkout.

test_pa.py itself needs aiter (ROCm-only) for quantization and its Gluon reference; here K/V are
quantized with pa_tile's fp8 helpers (``pa_tile.cache.amax_scale`` / ``quantize_fp8``: the same
amax/FP8_MAX scales aiter's ``per_tensor_quant`` / ``pertoken_quant`` compute) and every output is
compared with ``pa_tile.reference.paged_attention_reference`` in float32 (see ``TOLERANCE``).

One line per case: PASS (max error), FAIL (max error), ERROR (first line), and any sanitizer
finding (out-of-bounds access, LDS race). With the default race policy (``raise``) a race stops
the launch; the case is then run again with races as warnings so its result is still compared.
Each arch runs in its own process (upstream's modules read the arch when imported).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

ARCHS = ("gfx942", "gfx950")
FP8_FORMAT = {"gfx942": "fnuz", "gfx950": "ocp"}
CU_COUNT = {"gfx942": 304, "gfx950": 256}  # MI300X, MI355X

# Tolerance against the float32 reference (the derivation of tests/test_stage2.py, which holds for
# these kernels too): the data are N(0, 1) (query bf16, K/V quantized to fp8 with amax scales), the
# kernels round the query (unit scale) and the probabilities P to fp8 e4m3, 3 mantissa bits,
# relative error <= 2^-4. An output is a convex combination sum_t w_t v_t, so relative weight
# errors eta_t move it by sum_t w_t (eta_t - mean eta) v_t: at most 2 max|eta| max|v|, a random
# walk in practice. P's rounding gives |eta| <= 2^-4; the query's shifts a score by a sum of
# head_dim rounding errors (about 3% of a unit at softmax scale 1/sqrt(128), worst realistic ~10%).
# A model of exactly these roundings is off the reference by <= 0.07 on pa_tile's case matrix
# (17-token context: few, large weights); atol 0.1 + rtol 2^-4 keeps a margin over that while one
# extra or missing token in a short context (|v|/L >= 0.2 at L <= 20) fails. The bf16 output adds
# 2^-9 relative. The mean error bound (0.01) catches a small bias over many outputs.
# A query row that sees few tokens gets no random-walk averaging: there the worst case is the bound,
# 2 max|eta| max_t |v_t| per channel over the tokens it sees, with eta = 2^-4 (P) + 2^-5 (the
# query's share, half a rounding step at these scales); applied to rows seeing <= FEW_TOKENS.
# Per-token scales: upstream folds each token's V scale into P before the fp8 cast
# (P'_t = P_t vs_t FP8_MAX / max vs), so even an exact P (a single visible token) is rounded, by
# up to 2^-4, and the normalization (by the unrounded sum) does not cancel it: a second rounding
# of P's size, independent of the first, so the mean error grows by about sqrt(2): 0.015.
# (Seen directly: one visible token, per-tensor error 0.006 = bf16 output, per-token 0.05.)
TOLERANCE = dict(atol=0.1, rtol=2.0**-4, mean=0.01)
TOLERANCE_PER_TOKEN = dict(TOLERANCE, mean=0.015)
FEW_TOKENS, FEW_ETA = 16, 2.0**-4 + 2.0**-5


@dataclasses.dataclass(frozen=True)
class Case:
    path: str  # "tile" (pa_decode_tile, 1 partition), "split" (pa_decode_ps_launch, bs 16/64),
    #            "metadata" (block 1024), "sliding" (sliding window)
    num_heads: tuple  # (q heads, kv heads)
    query_length: int
    block_size: int
    quant: str  # "per_tensor" | "per_token"
    context_lengths: tuple
    sliding_window: int = 0
    head_size: int = 128
    trans_v: bool = True  # V in [nb, kvh, bs/16, d, 16] (upstream's shuffle), else [nb, kvh, d, bs]
    seed: int = 123

    @property
    def label(self) -> str:
        q, kv = self.num_heads
        sw = f" sw={self.sliding_window}" if self.sliding_window else ""
        extra = (f" d={self.head_size}" if self.head_size != 128 else "") + ("" if self.trans_v else " v=plain")
        return (f"{self.path} heads={q}/{kv} ql={self.query_length} bs={self.block_size} {self.quant} "
                f"ctx={list(self.context_lengths)}{sw}{extra}")


def build_cases() -> List[Case]:
    """The case matrix: upstream's grids (test_pa.py) at small shapes.

    test_normal_accuracy: block 16/64, heads (8,1) (16,1) (4,1), query_length 1-4, per-token and
    per-tensor (the split path: pa_decode_ps_launch always splits into 4-8 partitions); the tile
    kernel alone (one partition, pa_decode_tile called directly) for heads (8,1) (16,1);
    test_metadata_accuracy: block 1024, heads (16,1), (ql 1, per-tensor) and (ql 4, per-token);
    test_sliding_window_accuracy: block 1024, window 1023, heads (8,1) (16,1), ql 1-4, per-token.
    Contexts are short (the emulator runs ~1e5-1e6 wave instructions/s) but keep the awkward
    edges: a partial page, one token past a 256-token partition, a sequence of a single page.
    """
    cases: List[Case] = []
    for heads in ((8, 1), (16, 1)):
        for ql in (1, 2, 3, 4):
            quant = ("per_tensor", "per_token")[ql % 2]
            cases.append(Case("tile", heads, ql, 16, quant, (ql + 16, 77, ql)))
    for heads in ((8, 1), (16, 1), (4, 1)):
        for ql in (1, 2, 3, 4):
            for quant in ("per_tensor", "per_token"):
                cases.append(Case("split", heads, ql, 16, quant, (257, 40, ql + 1)))
    for heads in ((8, 1), (16, 1)):
        for ql in (1, 2, 3, 4):
            quant = ("per_tensor", "per_token")[ql % 2]
            cases.append(Case("split", heads, ql, 64, quant, (300, 65)))
    # head_dim 256 and the plain V layout (trans_v=False), both in test_normal_accuracy's grid
    for ql, quant in ((1, "per_tensor"), (4, "per_token")):
        cases.append(Case("split", (8, 1), ql, 16, quant, (257, 40, ql + 1), head_size=256))
        cases.append(Case("split", (16, 1), ql, 64, quant, (300, 65, ql), trans_v=False))
    # 12 q heads per KV head: not in test_pa.py's grid, but the configuration issue 13 found
    # v_mul_lo_u16 in (query_length 3-4); two KV heads
    for ql in (3, 4):
        cases.append(Case("split", (24, 2), ql, 16, "per_token", (100, 33)))
    cases.append(Case("metadata", (16, 1), 1, 1024, "per_tensor", (1027, 300, 5)))
    cases.append(Case("metadata", (16, 1), 4, 1024, "per_token", (1027, 300, 5)))
    # beyond test_metadata_accuracy: 8 heads, query lengths 2-3, sequences of several pages
    cases.append(Case("metadata", (8, 1), 2, 1024, "per_token", (2100, 700, 3)))
    cases.append(Case("metadata", (16, 1), 3, 1024, "per_tensor", (4100, 9)))
    for heads in ((8, 1), (16, 1)):
        for ql in (1, 2, 3, 4):
            cases.append(Case("sliding", heads, ql, 1024, "per_token", (1100, 400), sliding_window=1023))
    # beyond test_sliding_window_accuracy: per-tensor scales, a window shorter than a partition
    cases.append(Case("sliding", (16, 1), 1, 1024, "per_tensor", (1100, 400), sliding_window=1023))
    cases.append(Case("sliding", (8, 1), 2, 1024, "per_token", (1500, 90), sliding_window=100))
    return cases


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    query: "object"  # [batch*ql, q_heads, d] bf16
    k_logical: "object"  # [nb, kvh, bs, d] fp8 (for the reference)
    v_logical: "object"
    key_cache: "object"  # [nb, kvh, d//16, bs, 16] fp8 (upstream's K layout)
    value_cache: "object"  # [nb, kvh, bs//16, d, 16] fp8 (trans_v), else [nb, kvh, d, bs]
    key_scale: "object"  # per tensor [1], per token [nb, kvh, bs, 1] (as pertoken_quant returns)
    value_scale: "object"
    block_tables: "object"  # [batch, max_blocks] int32
    block_tables_list: list
    context_lengths: "object"  # [batch] int32
    kv_page_indices: "object"
    kv_indptr: "object"


def make_inputs(case: Case, fmt: str, device: str = "cuda") -> Inputs:
    """Upstream-style inputs on ``device``: random bf16 query, K/V drawn N(0, 1) and quantized to
    fp8 (``fmt``) with pa_tile's helpers, random page ids (with replacement, as test_pa.py)."""
    import torch

    from pa_tile import cache

    random.seed(case.seed)
    torch.manual_seed(case.seed)
    q_heads, kv_heads = case.num_heads
    batch, d, bs = len(case.context_lengths), case.head_size, case.block_size
    blocks_per_seq = -(-max(case.context_lengths) // bs)
    num_blocks = max(4, 2 * batch * blocks_per_seq)
    query = torch.randn(batch * case.query_length, q_heads, d, device=device).to(torch.bfloat16)
    k = torch.randn(num_blocks, kv_heads, bs, d, device=device)
    v = torch.randn(num_blocks, kv_heads, bs, d, device=device)
    per_row = case.quant == "per_token"
    ks, vs = cache.amax_scale(k, fmt, per_row), cache.amax_scale(v, fmt, per_row)
    k8, v8 = cache.quantize_fp8(k, fmt, ks), cache.quantize_fp8(v, fmt, vs)
    tables = [[random.randint(0, num_blocks - 1) for _ in range(blocks_per_seq)] for _ in range(batch)]
    ctx = torch.tensor(case.context_lengths, dtype=torch.int32, device=device)
    pages = [-(-n // bs) for n in case.context_lengths]
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32, device=device), dim=0)
    flat = [p for row, n in zip(tables, pages) for p in row[:n]]
    return Inputs(
        query=query, k_logical=k8, v_logical=v8,
        key_cache=cache.to_k_blocked(k8),
        value_cache=cache.to_v_trans_blocked(v8) if case.trans_v else cache.to_v_plain(v8),
        key_scale=ks.unsqueeze(-1) if per_row else ks, value_scale=vs.unsqueeze(-1) if per_row else vs,
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device), block_tables_list=tables,
        context_lengths=ctx, kv_page_indices=torch.tensor(flat, dtype=torch.int32, device=device),
        kv_indptr=indptr,
    )


def reference(case: Case, inp: Inputs):
    """float32 reference of the case (pa_tile.reference), as a CPU float32 tensor."""
    from pa_tile.reference import paged_attention_reference

    per_row = case.quant == "per_token"
    ks = inp.key_scale.squeeze(-1) if per_row else inp.key_scale
    vs = inp.value_scale.squeeze(-1) if per_row else inp.value_scale
    # upstream's window keeps j >= pos - W, i.e. W + 1 tokens (pa_tile.reference's docstring)
    sw = case.sliding_window + 1 if case.sliding_window else 0
    ref = paged_attention_reference(
        inp.query.float().cpu(), inp.k_logical.cpu(), inp.v_logical.cpu(), inp.block_tables.cpu(),
        inp.context_lengths.cpu(), ks.cpu(), vs.cpu(), query_length=case.query_length, sliding_window=sw)
    return ref.float()


def few_token_bound(case: Case, inp: Inputs):
    """Per-element worst-case bound for query rows that see <= FEW_TOKENS tokens (0 elsewhere):
    ``2 FEW_ETA max_t |v_t|`` over the tokens the row sees, per channel (CPU float32, like ``ref``)."""
    import torch

    from pa_tile import cache

    q_heads, kv_heads = case.num_heads
    group, ql, bs = q_heads // kv_heads, case.query_length, case.block_size
    per_row = case.quant == "per_token"
    v = cache.fp8_decode(inp.v_logical.cpu())  # [nb, kvh, bs, d]
    scale = inp.value_scale.cpu()
    v = v * (scale if per_row else scale.reshape(1, 1, 1, 1))
    sw = case.sliding_window + 1 if case.sliding_window else 0  # upstream's window: W + 1 tokens
    bound = torch.zeros(len(case.context_lengths) * ql, q_heads, case.head_size)
    for s, L in enumerate(case.context_lengths):
        for i in range(ql):
            pos = L - ql + i
            first = max(0, pos - sw + 1) if sw else 0
            if pos - first + 1 > FEW_TOKENS:
                continue
            toks = torch.arange(first, pos + 1)
            pages = torch.tensor(inp.block_tables_list[s])[toks // bs]
            vals = v[pages, :, toks % bs, :].abs().amax(dim=0)  # [kvh, d]
            bound[s * ql + i] = 2 * FEW_ETA * vals.repeat_interleave(group, dim=0)
    return bound


def tolerance(case: Case) -> dict:
    return TOLERANCE_PER_TOKEN if case.quant == "per_token" else TOLERANCE


def compare(out, ref, tol=TOLERANCE, few=None):
    """(ok, max error, mean error) of ``out`` against the float32 ``ref`` (NaN never passes);
    ``few``: the per-element few-token bound (``few_token_bound``), which widens the tolerance."""
    import torch

    out = out.float().cpu()
    err = (out - ref).abs()
    limit = tol["atol"] + tol["rtol"] * ref.abs()
    if few is not None:
        limit = torch.maximum(limit, few)
    bad = ~(err <= limit)  # NaN compares False: bad
    max_err = float("nan") if torch.isnan(err).any() else float(err.max())
    mean_err = float(err.nanmean())
    # the mean bound belongs to the random-walk regime: rows under the few-token bound are out of it
    walk = err if few is None else err[few.flatten(1).amax(dim=1) == 0]
    walk_mean = float(walk.mean()) if walk.numel() else 0.0
    ok = not bool(bad.any()) and not math.isnan(walk_mean) and walk_mean <= tol["mean"]
    return ok, max_err, mean_err


# ----------------------------------------------------------------------------- running upstream


def run_case(case: Case, arch: str) -> "object":
    """Run one case through upstream's launchers on the simulated device; the output (device tensor)."""
    import torch

    from kernels.attention import pa_decode_fp8 as ps

    inp = make_inputs(case, FP8_FORMAT[arch])
    q_heads, kv_heads = case.num_heads
    batch, ql, d = len(case.context_lengths), case.query_length, case.head_size
    softmax_scale = 1.0 / math.sqrt(d)
    output = torch.empty(batch * ql, q_heads, d, dtype=torch.bfloat16, device="cuda")
    if case.path == "tile":
        from kernels.attention.pa_decode_tile import pa_decode_tile

        ks = inp.key_scale.reshape(-1, kv_heads, case.block_size) if case.quant == "per_token" else inp.key_scale
        vs = inp.value_scale.reshape(-1, kv_heads, case.block_size) if case.quant == "per_token" else inp.value_scale
        pa_decode_tile(output, inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.context_lengths,
                       ks, vs, softmax_scale=softmax_scale, stream=torch.cuda.current_stream(), num_partitions=1)
        torch.cuda.synchronize()
        return output, inp
    metadata = None
    if case.path == "metadata":
        metadata = ps.get_pa_metadata(inp.query, inp.key_cache, inp.context_lengths, inp.kv_indptr, q_heads,
                                      kv_heads, per_token_kv=case.quant == "per_token")
    partition = 256
    splits = ps.get_recommended_splits(batch, kv_heads, partition // case.block_size,
                                       sliding_window=case.sliding_window, context_partition_size=partition,
                                       query_length=ql)
    shape = (batch, kv_heads, splits, ql * (q_heads // kv_heads))
    exp_sums = torch.empty(shape, dtype=torch.float32, device="cuda")
    max_logits = torch.empty(shape, dtype=torch.float32, device="cuda")
    temporary_output = torch.empty(*shape, d, dtype=torch.bfloat16, device="cuda")
    ps.pa_decode_ps_launch(
        output, inp.query, inp.key_cache, inp.value_cache, inp.context_lengths, inp.kv_page_indices,
        inp.kv_indptr, softmax_scale, key_scale=inp.key_scale, value_scale=inp.value_scale,
        sliding_window=case.sliding_window, metadata=metadata, block_tables=inp.block_tables,
        max_context_partition_num=splits, exp_sums=exp_sums, max_logits=max_logits,
        temporary_output=temporary_output)
    torch.cuda.synchronize()
    return output, inp


def _first_line(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def run_arch(root: Path, arch: str, keys: Sequence[str], lds_races: str) -> int:
    from pa_tile import backend, toolchain
    from pa_tile.emu import device, launch, memory

    sys.path.insert(0, str(root))
    failures = 0
    with toolchain.target_arch(arch), device.simulated_device(arch, CU_COUNT[arch]):
        backend.ensure_backend()
        for case in build_cases():
            label = f"{case.label} {arch}"
            if not all(k in label for k in keys):
                continue
            t0 = time.time()
            findings: List[str] = []
            result = None
            interleaved = None
            for policy in ([lds_races] if lds_races == "warn" else ["raise", "warn"]):
                try:
                    with warnings.catch_warnings(record=True) as caught, launch.record_launches() as log, \
                            launch.launch_options(lds_races=policy):
                        warnings.simplefilter("always")
                        out = run_case(case, arch)
                    for w in caught:
                        if "race" in str(w.message).lower():
                            findings.append(f"LDS race (warned): {str(w.message).splitlines()[0][:300]}")
                    result = out
                    if any(f.startswith("LDS race") for f in findings):
                        # run-to-barrier makes a race one definite (possibly wrong) answer; waves
                        # interleaved instruction by instruction are closer to a CU: compare that too
                        with launch.launch_options(lds_races="off", quantum=1):
                            interleaved = run_case(case, arch)
                    break
                except Exception as e:  # noqa: BLE001 - report and go on
                    root_e = e
                    while getattr(root_e, "__cause__", None) is not None and "re-raised" in str(root_e):
                        root_e = root_e.__cause__
                    name = type(root_e).__name__
                    if name == "LdsRaceError":
                        kernel = log[-1].kernel if log else "?"
                        findings.append(f"LDS race (raised) in {kernel}: {_first_line(root_e)}")
                        continue
                    if isinstance(root_e, memory.MemoryFault):
                        findings.append(f"out-of-bounds: {_first_line(root_e)}")
                    result = e
                    break
            dt = time.time() - t0
            if isinstance(result, BaseException):
                line = f"ERROR {label}: {_first_line(result)}"
                failures += 1
            elif result is None:
                line = f"ERROR {label}: no result"
                failures += 1
            else:
                out, inp = result
                ok, max_err, mean_err = compare(out, reference(case, inp), tolerance(case),
                                                few=few_token_bound(case, inp))
                line = f"{'PASS' if ok else 'FAIL'} {label} (max err {max_err:.4f}, mean {mean_err:.5f})"
                failures += not ok
                if interleaved is not None:
                    o2, i2 = interleaved
                    ok2, m2, _ = compare(o2, reference(case, i2), tolerance(case), few=few_token_bound(case, i2))
                    line += f"; with quantum=1: {'PASS' if ok2 else 'FAIL'} (max err {m2:.4f})"
            print(f"{line} [{dt:.0f}s]", flush=True)
            for f in dict.fromkeys(findings):
                print(f"    sanitizer: {f}", flush=True)
    return failures


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("flydsl", help="path to a FlyDSL checkout (its kernels/attention is imported)")
    ap.add_argument("--arch", default="both", choices=[*ARCHS, "both"])
    ap.add_argument("-k", action="append", default=[], help="keep cases whose label contains this (repeatable)")
    ap.add_argument("--lds-races", default="raise", choices=["raise", "warn"],
                    help="raise (default; a racy case is re-run with warnings to compare it) or warn")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)
    root = Path(args.flydsl).expanduser().resolve()
    if not (root / "kernels" / "attention" / "pa_decode_fp8.py").is_file():
        print(f"error: {root} is not a FlyDSL checkout (no kernels/attention/pa_decode_fp8.py); "
              "pass the path of a clone of https://github.com/ROCm/FlyDSL", file=sys.stderr)
        return 2
    archs = ARCHS if args.arch == "both" else (args.arch,)
    if args.list:
        for case in build_cases():
            for arch in archs:
                label = f"{case.label} {arch}"
                if all(k in label for k in args.k):
                    print(label)
        return 0
    if len(archs) > 1:  # one process per arch: upstream's modules read the arch when imported
        rc = 0
        for arch in archs:
            cmd = [sys.executable, __file__, str(root), "--arch", arch, "--lds-races", args.lds_races]
            for k in args.k:
                cmd += ["-k", k]
            rc |= subprocess.call(cmd)
        return rc
    return 1 if run_arch(root, archs[0], args.k, args.lds_races) else 0


if __name__ == "__main__":
    sys.exit(main())
