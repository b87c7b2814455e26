#!/usr/bin/env python
"""Record the static figures of upstream FlyDSL's ``pa_decode_tile`` into
``pa_tile/data/upstream_pa_decode_tile_isa.md`` (the table ``pa_tile.upstream`` reads).

One command::

    python scripts/record_upstream_isa.py --flydsl PATH_TO_FLYDSL_GIT [--commit 11c4174d] [--out FILE] [--check]

``PATH_TO_FLYDSL_GIT``: a clone (or bare git dir) of ROCm/FlyDSL holding ``--commit``. Nothing from
it is copied into this repository: ``kernels/attention/pa_decode_tile.py`` and the upstream modules
it imports at module level (found by reading their ``import`` statements, transitively, plus the
package ``__init__.py`` files) are written at run time to a temporary directory and imported from
there. Imports inside functions (the host wrapper ``pa_decode_tile`` imports ``pa_decode_fp8`` and
``pa_decode_swa`` for the partition heuristic and the reduce kernel) are not extracted: this
script never calls the host wrapper, only ``compile_pa_decode_tile``, so with one partition
(NP=1) they are never reached and nothing needs stubbing.

Per configuration (arch gfx942/gfx950 x block 16/64 x head_dim 64/128/256 x query_length 1/4 x
group 8/16 x per-tensor/per-token scales; bf16 query, trans-blocked V, NP=1, default softmax
scale), under ``pa_tile.toolchain.target_arch(arch)`` (upstream reads the arch with
``get_rocm_arch()`` when it builds):

1. ``compile_pa_decode_tile.__wrapped__(...)`` builds the launcher (the ``lru_cache`` around it
   does not key on the arch, so it is bypassed);
2. ``pa_tile.toolchain.compile_isa`` compiles that launcher on the CPU with small CPU torch
   tensors laid out as upstream's docstring says (FlyDSL marks torch tensors layout-dynamic, so
   their sizes do not enter the code) and returns the final assembly;
3. ``pa_tile.isa.IsaStats.from_asm`` and ``pa_tile.isa.occupancy`` read the figures.

A configuration upstream rejects (an ``AssertionError`` from its own argument checks) is listed
in the header instead of the table; any other error stops the script. ``--check`` compares with
the rows already in ``--out`` and writes nothing; the exit status is 1 if any recorded row differs.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import itertools
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_COMMIT = "11c4174d"  # upstream main, the flydsl 0.5.0 release commit
KERNEL_PATH = "kernels/attention/pa_decode_tile.py"
KERNEL_MODULE = "kernels.attention.pa_decode_tile"
OUT = ROOT / "pa_tile" / "data" / "upstream_pa_decode_tile_isa.md"

ARCHS = ("gfx942", "gfx950")
BLOCKS = (16, 64)
HEAD_DIMS = (64, 128, 256)
QUERY_LENGTHS = (1, 4)
GROUPS = (8, 16)
SCALES = ("per-tensor", "per-token")


def _git(gitdir: Path, *args: str) -> str:
    return subprocess.check_output(["git", "--git-dir", str(gitdir), *args], text=True)


def _git_dir(path: Path) -> Path:
    """The git directory of a clone or of a bare repository."""
    return Path(subprocess.check_output(["git", "-C", str(path), "rev-parse", "--absolute-git-dir"],
                                        text=True).strip())


def _on_main(gitdir: Path, commit: str) -> bool:
    """Whether *commit* is on upstream's main branch (a local or remote-tracking ``main``)."""
    for ref in ("refs/heads/main", "refs/remotes/origin/main"):
        if subprocess.run(["git", "--git-dir", str(gitdir), "rev-parse", "-q", "--verify", ref],
                          capture_output=True).returncode == 0:
            return subprocess.run(["git", "--git-dir", str(gitdir), "merge-base", "--is-ancestor", commit, ref],
                                  capture_output=True).returncode == 0
    return False


# ---------------------------------------------------------------------------------------------
# extraction


def _module_level_imports(source: str) -> tuple[list[str], list[str]]:
    """(module-level imported modules, modules imported inside functions/classes) of *source*."""
    tree = ast.parse(source)
    top, nested = [], []

    def names(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from kernels.common import buffer_ops" may name submodules: try both
            return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        return []

    def walk(body, inside):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (nested if inside else top).extend(names(node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(node.body, True)
            else:  # module-level if/try/with blocks still run at import
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        walk([s for s in sub if isinstance(s, ast.AST)], inside)

    walk(tree.body, False)
    return top, nested


def extract(gitdir: Path, commit: str, dest: Path) -> dict:
    """Write the kernel module and its module-level upstream imports at *commit* under *dest*.

    Returns {"files": [paths], "external": sorted top-level third-party modules, "skipped":
    upstream modules imported only inside functions (not extracted)}.
    """
    tree = set(_git(gitdir, "ls-tree", "-r", "--name-only", commit, "kernels").split())

    def path_of(module: str):
        base = module.replace(".", "/")
        for p in (base + ".py", base + "/__init__.py"):
            if p in tree:
                return p
        return None

    files, external, skipped = [], set(), set()
    todo = [KERNEL_PATH]
    while todo:
        p = todo.pop()
        if p in files:
            continue
        files.append(p)
        parts = p.split("/")
        for i in range(1, len(parts)):  # the packages above it
            init = "/".join(parts[:i]) + "/__init__.py"
            if init in tree and init not in files:
                todo.append(init)
        top, nested = _module_level_imports(_git(gitdir, "show", f"{commit}:{p}"))
        for m in top:
            if m.split(".")[0] == "kernels":
                q = path_of(m)
                if q:
                    todo.append(q)
            elif m.split(".")[0] not in sys.stdlib_module_names:
                external.add(m.split(".")[0])
        for m in nested:
            if m.split(".")[0] == "kernels" and path_of(m):
                skipped.add(m)
    for p in files:
        out = dest / p
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_git(gitdir, "show", f"{commit}:{p}"))
    return {"files": sorted(files), "external": sorted(external),
            "skipped": sorted(m for m in skipped if path_of(m) not in files)}


def import_upstream(dest: Path):
    if "kernels" in sys.modules:
        raise RuntimeError("a module named 'kernels' is already imported; run this script in a fresh interpreter")
    sys.path.insert(0, str(dest))
    mod = importlib.import_module(KERNEL_MODULE)
    if not Path(mod.__file__).resolve().is_relative_to(dest.resolve()):
        raise RuntimeError(f"imported {mod.__file__}, not the extracted copy under {dest}")
    return mod


# ---------------------------------------------------------------------------------------------
# one configuration


def launch_args(arch: str, block: int, head_dim: int, query_len: int, group: int, per_token: bool):
    """CPU tensors and scalars in the order of upstream's ``pa_decode_tile_launch`` (NP=1)."""
    import torch

    from pa_tile import arch as pa_arch

    seqs, kv_heads, num_blocks, max_blocks = 2, 2, 8, 4
    fp8 = pa_arch.fp8_torch_dtype(arch)
    query = torch.zeros(seqs * query_len, kv_heads * group, head_dim, dtype=torch.bfloat16)
    output = torch.zeros_like(query)
    key_cache = torch.zeros(num_blocks, kv_heads, head_dim // 16, block, 16, dtype=torch.uint8).view(fp8)
    value_cache = torch.zeros(num_blocks, kv_heads, block // 16, head_dim, 16, dtype=torch.uint8).view(fp8)
    block_tables = torch.zeros(seqs, max_blocks, dtype=torch.int32)
    context_lengths = torch.full((seqs,), 2 * block, dtype=torch.int32)
    if per_token:
        key_scale = torch.ones(num_blocks, kv_heads, block, dtype=torch.float32)
        stride_ks_block, stride_ks_head = key_scale.stride(0), key_scale.stride(1)
    else:
        key_scale = torch.ones(1, dtype=torch.float32)
        stride_ks_block = stride_ks_head = 0
    value_scale = key_scale.clone()
    partial = torch.empty(1, dtype=torch.float32)  # pmax/psum/pout: unused with NP=1 (as upstream passes them)
    return (output, partial, partial, partial, query, key_cache, value_cache, block_tables, context_lengths,
            key_scale, value_scale, max_blocks, seqs, kv_heads, stride_ks_block, stride_ks_head,
            query.stride(0), query.stride(1))


def measure(mod, arch: str, block: int, head_dim: int, query_len: int, group: int, per_token: bool) -> dict:
    from pa_tile import isa, toolchain

    with toolchain.target_arch(arch):
        compiled = mod.compile_pa_decode_tile.__wrapped__(
            head_dim=head_dim, query_group_size=group, block_size=block, num_partitions=1,
            query_dtype="bf16", per_token_kv=per_token, query_length=query_len, trans_v=True)
    asm = toolchain.compile_isa(compiled["launch"], *launch_args(arch, block, head_dim, query_len, group, per_token),
                                arch=arch)
    names = isa.kernel_names(asm)
    if len(names) != 1:
        raise RuntimeError(f"expected one kernel in the assembly, found {names}")
    st = isa.IsaStats.from_asm(asm)
    if st.arch != arch:
        raise RuntimeError(f"compiled for {st.arch}, wanted {arch}")
    occ = isa.occupancy(st)
    if not float(occ.waves_per_simd).is_integer():
        raise RuntimeError(f"non-integer occupancy {occ.waves_per_simd}")
    return dict(vgpr=st.vgpr_unified, agpr=st.agpr, lds=st.lds_bytes, instr=st.n_instructions,
                gx4=st.count("global_load_dwordx4"), ds=st.families["ds"], bar=st.count("s_barrier"),
                mfma=st.families["mfma"], occ=int(occ.waves_per_simd),
                _vspill=st.vgpr_spill, _sspill=st.sgpr_spill, _scratch=st.scratch_bytes, _bound=occ.bound_by)


# ---------------------------------------------------------------------------------------------
# the file


def _row_line(key: tuple, fig: dict) -> str:
    cells = list(key) + [fig[c] for c in ("vgpr", "agpr", "lds", "instr", "gx4", "ds", "bar", "mfma", "occ")]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(info: dict, rows: dict, rejected: dict) -> str:
    from pa_tile import upstream

    c = info
    bound = Counter("+".join(fig["_bound"]) for fig in rows.values())
    spilled = {k: fig for k, fig in rows.items() if fig["_vspill"] or fig["_sspill"] or fig["_scratch"]}
    hds = sorted({k[2] for k in rows})
    lines = [
        "# Reference figures: upstream FlyDSL `pa_decode_tile` (compiled, not run)",
        "",
        "Generated by `python scripts/record_upstream_isa.py --flydsl <ROCm/FlyDSL git>`; do not edit by hand.",
        "",
        f"- upstream commit: `{c['commit']}` (ROCm/FlyDSL{' main' if c['on_main'] else ''}, {c['date']}, "
        f"\"{c['subject']}\"), "
        f"file `{KERNEL_PATH}`",
        f"- flydsl version: `{c['flydsl']}` (the installed wheel that compiled every row, on the CPU, through "
        "`pa_tile.toolchain.compile_isa`)",
        f"- extracted from that commit to a temporary directory and imported from there: "
        + ", ".join(f"`{p}`" for p in c["files"]) + "; nothing was stubbed or edited. "
        + ("Imported only inside the host wrapper, never called here, so not extracted: "
           + ", ".join(f"`{m}`" for m in c["skipped"]) + ". " if c["skipped"] else "")
        + "Third-party modules imported: " + ", ".join(f"`{m}`" for m in c["external"]),
        "- each row: `compile_pa_decode_tile(head_dim=, query_group_size=group, block_size=block, "
        "num_partitions=1, query_dtype=\"bf16\", per_token_kv=, query_length=, trans_v=True)` "
        "(default softmax scale) built under `FLYDSL_GPU_ARCH=<arch>`, its launcher compiled with CPU torch "
        "tensors (fp8 K/V in the arch's flavour, trans-blocked V, bf16 query, `[1]` or "
        "`[num_blocks, kv_heads, block]` float32 scales); one kernel per row",
        f"- {len(rows)} configurations: arch {'/'.join(ARCHS)} x block {'/'.join(map(str, BLOCKS))} x head_dim "
        f"{'/'.join(map(str, hds))} x query_len {'/'.join(map(str, QUERY_LENGTHS))} x group "
        f"{'/'.join(map(str, GROUPS))} x scales {'/'.join(SCALES)}",
    ]
    if rejected:
        lines.append("- rejected by upstream (not in the table): " + "; ".join(
            f"{' '.join(map(str, k))}: {msg}" for k, msg in sorted(rejected.items(), key=lambda kv: _order(kv[0]))))
    else:
        lines.append("- upstream accepted and compiled every configuration of the grid")
    lines += [
        "",
        "Columns, all read by `pa_tile.isa` from the final assembly (`IsaStats.from_asm`):",
        "",
        "- `vgpr`: unified VGPR+AGPR count, `IsaStats.vgpr_unified` (`.vgpr_count` of `.amdgpu_metadata`); "
        "`agpr`: AGPRs, `IsaStats.agpr` (`.agpr_count`)",
        "- `lds`: bytes of LDS, `IsaStats.lds_bytes` (`.group_segment_fixed_size`); `instr`: static "
        "instructions in the kernel, `IsaStats.n_instructions`",
        "- `gx4`: `IsaStats.count(\"global_load_dwordx4\")`; `ds`: LDS instructions, `IsaStats.families[\"ds\"]` "
        "(every `ds_*` mnemonic); `bar`: `IsaStats.count(\"s_barrier\")`; `mfma`: `IsaStats.families[\"mfma\"]`",
        "- `occ`: waves per SIMD, `pa_tile.isa.occupancy(stats).waves_per_simd` (unified 512-entry file per lane, "
        "8-register granule; LDS 64 KiB/CU on gfx942, 160 KiB/CU on gfx950; 4 waves per 256-thread workgroup); "
        "the bounding resource (`Occupancy.bound_by`): "
        + ", ".join(f"{b} in {n} of {_rows_word(len(rows))}" for b, n in bound.most_common()),
        "- scratch bytes and spill counts (`IsaStats.scratch_bytes`, `vgpr_spill`, `sgpr_spill`; LLVM's "
        "`.vgpr_spill_count`/`.sgpr_spill_count` of `.amdgpu_metadata`): "
        + ("0 in every row" if not spilled else f"0 except in {_rows_word(len(spilled))}: " + "; ".join(
            f"{' '.join(map(str, k))}: {fig['_vspill']} VGPR and {fig['_sspill']} SGPR spills, "
            f"{fig['_scratch']} B scratch" for k, fig in sorted(spilled.items(), key=lambda kv: _order(kv[0])))),
        "",
        "| " + " | ".join(upstream.COLUMNS) + " |",
        "|" + "---|" * len(upstream.COLUMNS),
    ]
    lines += [_row_line(k, rows[k]) for k in sorted(rows, key=_order)]
    return "\n".join(lines) + "\n"


def _rows_word(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _order(key):
    arch, block, hd, ql, g, scales = key
    return (ARCHS.index(arch), block, hd, ql, g, SCALES.index(scales))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flydsl", required=True, help="a ROCm/FlyDSL clone or bare git dir holding --commit")
    ap.add_argument("--commit", default=DEFAULT_COMMIT, help=f"upstream commit (default {DEFAULT_COMMIT})")
    ap.add_argument("--out", type=Path, default=OUT, help="the markdown file to write (default: the shipped table)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    ap.add_argument("--check", action="store_true", help="compare with the rows already in --out; write nothing")
    args = ap.parse_args(argv)
    from pa_tile import upstream  # noqa: F401  (fail before compiling, not after)

    gitdir = _git_dir(Path(args.flydsl))
    commit = _git(gitdir, "rev-parse", "--verify", f"{args.commit}^{{commit}}").strip()
    date, subject = _git(gitdir, "show", "-s", "--format=%cs%x00%s", commit).strip().split("\x00")
    with tempfile.TemporaryDirectory(prefix="pa_tile_upstream_") as tmp:
        dest = Path(tmp)
        info = extract(gitdir, commit, dest)
        info.update(commit=commit, date=date, subject=subject, on_main=_on_main(gitdir, commit),
                    flydsl=importlib.metadata.version("flydsl"))
        mod = import_upstream(dest)
        rows, rejected = {}, {}
        grid = list(itertools.product(ARCHS, BLOCKS, args.head_dims, QUERY_LENGTHS, GROUPS, SCALES))
        t0 = time.time()
        for n, key in enumerate(grid, 1):
            arch, block, hd, ql, g, scales = key
            try:
                rows[key] = measure(mod, arch, block, hd, ql, g, scales == "per-token")
            except AssertionError as e:  # upstream's own argument checks
                rejected[key] = f"AssertionError: {e}"
            status = _row_line(key, rows[key]) if key in rows else "REJECTED " + rejected[key]
            print(f"[{n}/{len(grid)} {time.time() - t0:.0f}s] {status}", file=sys.stderr, flush=True)

    if args.check:
        from pa_tile import upstream

        old = {(r["arch"], r["block"], r["head_dim"], r["query_len"], r["group"], r["scales"]): r
               for r in upstream._parse(args.out.read_text(), args.out.name)}
        cols = upstream.COLUMNS[6:]
        bad = 0
        for key, r in old.items():
            if key not in rows:
                print(f"{key}: recorded but not produced")
                bad += 1
                continue
            diff = {c: (r[c], rows[key][c]) for c in cols if r[c] != rows[key][c]}
            if diff:
                print(f"{key}: " + ", ".join(f"{c} {a} -> {b}" for c, (a, b) in diff.items()))
                bad += 1
        new = [k for k in rows if k not in old]
        print(f"{len(old) - bad} of {len(old)} recorded rows reproduce exactly; {len(new)} produced rows are not recorded")
        return 1 if bad else 0
    args.out.write_text(render(info, rows, rejected))
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
