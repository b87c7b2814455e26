# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -all
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 00 · Paged decode attention, AMD's words, and the FlyDSL you need
#
# This course builds one kernel: **fp8 paged-attention decode** for AMD Instinct MI300 (gfx942)
# and MI355 (gfx950), written in FlyDSL. This chapter is the way in. It states the problem,
# names AMD's hardware in CUDA's words, and teaches the FlyDSL you need to read every later
# kernel.
#
# **You'll learn**
#
# - what paged decode computes, and why its speed is set by HBM bandwidth;
# - AMD's words for CUDA's: wave, SIMD, CU, LDS, VGPR/AGPR/SGPR, `s_waitcnt`, buffer loads;
# - FlyDSL: a kernel, its launch, trace time against run time, loops that carry state,
#   compile-time branches, where a branch on a device value may go;
# - shape:stride layouts (CuTe's algebra) and the cache layouts the kernels read;
# - what "upstream" is and why it is the yardstick.
#
# **You need** CUDA or Triton, and FlashAttention's online softmax. No AMD GPU and no FlyDSL.
#
# **Runs on** the CPU emulator (about a minute), or a ROCm GPU.

# %% tags=["nbval-ignore-output"]
import math
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import pa_tile
from pa_tile import backend, cache, figures, isa, seed_history, show, toolchain, upstream

torch.set_printoptions(precision=3, linewidth=100)
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"
dev = backend.device_for_tensors()  # where launches read their tensors

# %% [markdown]
# ## What decode computes
#
# Each generation step adds `query_length` new tokens per sequence: 1 for plain decode, up to 8
# for speculative decode ("MTP"; chapter 08 lets each sequence have its own count). Each new query attends to every earlier token's key and
# value, kept in the **KV cache**:
#
# $$o_{h} = \sum_{t \le \mathrm{pos}} \mathrm{softmax}_t\!\left(\tfrac{q_h\cdot k_{t}}{\sqrt{d}}\right) v_{t}$$
#
# * **Paging** (vLLM's PagedAttention). The cache is a pool of pages of `block_size` tokens
#   (16 to 128). Row `s` of the **block table** lists sequence `s`'s pages. Token `t` lives in
#   page `block_tables[s, t // block_size]`, slot `t % block_size`. Pages are scattered.
# * **GQA.** A *query group* of `num_q_heads // num_kv_heads` heads (8 or 16 here) shares one
#   K/V head. The kernel loads each K/V byte once for the whole group.
# * **fp8 K/V.** The cache holds e4m3 codes; a value is `decode(code) × scale`, with one scale
#   per tensor or per token. gfx942 reads codes as **FNUZ** (max 240), gfx950 as **OCP**
#   (max 448): the same byte means different numbers.
# * **MTP.** Query `i` of `L_q` sits at position `L − L_q + i` and sees no later token.
#
# A small case, pages shuffled as an allocator leaves them, and its float32 reference: the
# ground truth for every kernel here. The cell checks it against the formula, token by token.

# %%
case = cache.make_case(
    num_seqs=3, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16,
    context_lengths=[17, 40, 5], fp8_format="fnuz", scales="per-tensor", seed=0,
)
print("block_tables (page ids; entries past a sequence's last page are padding):")
print(case.block_tables.cpu())
out = case.reference()


def one_head_by_hand(case, seq, head):
    """The formula, token by token: no paging tricks, no vectorization."""
    L, bs = int(case.context_lengths[seq]), case.block_size
    kvh = head // case.query_group_size
    q = case.query[seq, head].float()
    ks, vs = [], []
    for t in range(L):
        page = int(case.block_tables[seq, t // bs])
        ks.append(cache.dequantize(case.k_cache[page, kvh, t % bs], scale=case.k_scale))
        vs.append(cache.dequantize(case.v_cache[page, kvh, t % bs], scale=case.v_scale))
    p = torch.softmax(torch.stack(ks) @ q / math.sqrt(case.head_dim), dim=0)
    return p @ torch.stack(vs)


err = max((one_head_by_hand(case, s, h) - out[s, h].float()).abs().max().item()
          for s in range(3) for h in range(8))
print(f"reference {tuple(out.shape)} {out.dtype}; max |reference - by hand| = {err:.1e}")
assert err < 2e-3  # fp16 output rounding: about 1e-3 of |o|

# %% [markdown]
# ## Why decode is memory-bound
#
# Per query token and KV head, each context token brings `2·d` bytes of fp8 K and V and
# `4·d·G` flops (`q·k` and `p·v` for the `G` heads of the group). That is about **2·G flops
# per byte**: 16 for G = 8. The hardware balance point is far higher:
#
# | | HBM bandwidth | dense fp8 MFMA peak | flops/byte to be compute-bound |
# |---|---|---|---|
# | MI300X (gfx942, 304 CUs) | 5.3 TB/s | 2.6 PFLOP/s | ≈ 490 |
# | MI355X (gfx950, 256 CUs) | 8.0 TB/s | 5.0 PFLOP/s | ≈ 630 |
#
# (AMD Instinct MI300X and MI355X data sheets.) A decode call's time floor is the time to
# stream its K/V bytes from HBM once. Every chapter is about reaching it.

# %%
HBM = {"MI300X": 5.3e12, "MI355X": 8.0e12}


def decode_bytes(batch, context, kv_heads=8, q_heads=64, head_dim=128, query_length=1):
    """Bytes one decode call must move: fp8 K and V once, plus bf16 queries in and outputs out."""
    kv = 2 * batch * context * kv_heads * head_dim
    q_and_o = 2 * 2 * batch * query_length * q_heads * head_dim
    return kv + q_and_o


contexts = [129, 512, 2048, 8192, 16384]
floors = {(batch, gpu): [decode_bytes(batch, c) / bw * 1e6 for c in contexts]
          for batch in (1, 16, 128) for gpu, bw in HBM.items()}
figures.decode_floor(contexts, floors)
plt.show()

# %% [markdown]
# How far from the floor does a real kernel sit? Upstream's production decode kernel, timed by
# its author on a gfx942 GPU ("Upstream" at the end of this chapter says whose kernel it is):

# %%
prod = seed_history.load()["production"]
sh = prod["shape"]
prod_bytes = decode_bytes(sh["batch"], sh["context"], sh["num_kv_heads"], sh["num_q_heads"],
                          sh["head_dim"], sh["query_length"])
prod_floor = prod_bytes / HBM["MI300X"] * 1e6
lo, hi = prod["measured_us_range"]
show.md(f"""
MEASURED (upstream, commit `{prod['quoted_in'][:8]}`): `{prod['kernel']}` at batch
{sh['batch']}, context {sh['context']} ({sh['num_q_heads']} query heads per KV head, assumed):
**{lo}-{hi} µs** ("{prod['quote']}").
Its compulsory bytes at 5.3 TB/s take **{prod_floor:.0f} µs**: the kernel reaches
{prod_floor / hi:.0%}-{prod_floor / lo:.0%} of HBM bandwidth.
""")

# %% [markdown]
# ## AMD's words for CUDA's
#
# The table is rendered from [docs/glossary.md](../docs/glossary.md), the course's one
# glossary, where every source is written out. Three rows matter at once. A **wave** is 64
# lanes, not 32. **LDS** is shared memory. **VGPRs** are per-lane registers; **SGPRs** hold one
# value for the whole wave, and the compiler puts there whatever it can prove is wave-uniform.

# %%
GLOSSARY = (Path(pa_tile.__file__).resolve().parents[1] / "docs" / "glossary.md").read_text()


def glossary_table(section):
    """The table of one section of docs/glossary.md, as Markdown."""
    body = GLOSSARY.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return show.md("\n".join(line for line in body.splitlines() if line.startswith("|")))


glossary_table("CUDA -> AMD")

# %% [markdown]
# The course's own words, from the same file:

# %%
glossary_table("pa_tile's own words")

# %% [markdown]
# ## A first FlyDSL kernel
#
# FlyDSL is AMD's Python DSL for GPU kernels. A `@flyc.kernel` function is *traced*: Python
# runs it once per specialization, and each `fx` call emits MLIR. LLVM's AMDGPU backend then
# compiles the MLIR to gfx942 or gfx950 machine code. A `@flyc.jit` function is the host
# launcher: it traces, compiles on first use, and launches.
#
# `scale_add` computes `out = alpha·x + y`. Each of 128 threads moves one 128-bit chunk (4
# floats) per tensor. The copy machinery is CuTe's: a *tiled copy* says which thread holds
# which values of a tile, and `partition_S`/`partition_D` cut a tensor into each thread's share.

# %%
from pa_tile import tiny_kernels  # noqa: E402

show.source(tiny_kernels)

# %% [markdown]
# Launching it is calling the launcher with tensors. On a CPU the emulator runs the compiled
# gfx942 code (`pa_tile.emu`, introduced below); on a ROCm GPU the same call runs there.

# %%
torch.manual_seed(0)
x, y = torch.randn(64, 256), torch.randn(64, 256)
o = torch.zeros(64, 256, device=dev)
tiny_kernels.scale_add(x.to(dev), y.to(dev), o, 2.0)
scale_add_err = (o.cpu() - (2 * x + y)).abs().max().item()
print(f"out[0, :4] = {o.cpu()[0, :4].tolist()}")
print(f"max |out - (2x + y)| = {scale_add_err}")
assert scale_add_err == 0.0

# %% [markdown]
# `pa_tile.toolchain.compile_isa` compiles one specialization for a chosen arch and returns
# its assembly; nothing runs. On a machine without ROCm it assembles the LLVM linker and
# device libraries from ordinary packages (`toolchain.describe_toolchain()` shows which).

# %%
asm = {arch: toolchain.compile_isa(tiny_kernels.scale_add, x, y, torch.zeros_like(x), 2.0,
                                   arch=arch) for arch in ("gfx942", "gfx950")}
body = asm["gfx942"].split("scale_add_kernel_0:\n", 1)[1].split("s_endpgm", 1)[0]
print("\n".join(ln for ln in body.splitlines() if "global_" in ln or "v_pk" in ln or "v_fma" in ln))
stats = {arch: isa.IsaStats.from_asm(text) for arch, text in asm.items()}
print("\n".join(isa.summary(stats["gfx942"]).splitlines()[:4]))  # kernel, arch, registers, spills

# %% [markdown]
# Each lane issues one `global_load_dwordx4` per input: 16 bytes, the widest load a lane has.
# `pa_tile.isa` reads the facts a kernel engineer checks first from the assembly: registers,
# LDS, the occupancy they allow and the instruction mix.

# %% [markdown]
# ## FlyDSL idioms, one cell each
#
# **Trace time and run time.** The kernel body is Python that runs *while tracing*, not once
# per lane: a `print` in it prints once for 64 lanes. Device values are placeholders for
# registers, so the print shows their type. Calling a `@flyc.jit` launcher traces again on
# every call; `pa_tile.launching.launch`, which every stage uses, compiles once per argument
# signature and relaunches the compiled code. Below: one trace, two launches.

# %%
import flydsl.compiler as flyc  # noqa: E402
import flydsl.expr as fx  # noqa: E402
from flydsl.expr import const_expr, range_constexpr  # noqa: E402

from pa_tile import launching  # noqa: E402


@flyc.kernel
def row_sums_kernel(X: fx.Tensor, Out: fx.Tensor, n: fx.Int32):
    lane = fx.thread_idx.x
    print("tracing row_sums_kernel; lane is a", type(lane).__name__)
    # a loop on the device: its state is carried explicitly (init= in, yield out)
    for j, acc in range(fx.Int32(0), n, fx.Int32(1), init=[fx.Float32(0.0)]):
        total = yield [fx.Float32(acc[0]) + fx.Float32(X[lane, j])]
    Out[lane] = fx.Float32(total)


@flyc.jit
def row_sums(X: fx.Tensor, Out: fx.Tensor, n: fx.Int32, stream: fx.Stream = fx.Stream(None)):
    row_sums_kernel(X, Out, n).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)


xs = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
sums = torch.zeros(64, device=dev)
for n in (5, 8):  # n is a runtime argument: one compiled kernel serves both
    launching.launch(row_sums, (xs.to(dev), sums, n), arch=backend.default_arch())
    print(f"n={n}: Out[:3] = {sums.cpu()[:3].tolist()}, want {xs[:3, :n].sum(1).tolist()}")

# %% [markdown]
# **`range(..., init=)` and `yield`.** A plain `range` in a kernel body becomes a loop on the
# device (`scf.for`); `n` is a runtime value. Values that change across iterations are passed
# in with `init=` and handed back with `yield`. The name bound by the last `yield` holds the
# final state after the loop (one value here; a list when several are carried). Every
# chapter's main loop has this form, carrying the online softmax's running max, sum and output.
#
# **`range_constexpr` and `const_expr`.** These run in Python at trace time.
# `range_constexpr(4)` unrolls: the body is traced four times. `if const_expr(c)` keeps or
# drops code for a compile-time `c`, which is how one kernel source serves many
# specializations (Triton's `tl.constexpr`).

# %%
def make_col_sum(scale):
    """A kernel specialized on ``scale`` (a Python value: part of the compiled kernel)."""

    @flyc.kernel
    def col_sum_kernel(X: fx.Tensor, Out: fx.Tensor):
        lane = fx.thread_idx.x
        acc = fx.Float32(0.0)
        for j in range_constexpr(4):  # unrolled while tracing: four loads, no loop
            print("  tracing column", j)
            acc = acc + fx.Float32(X[lane, j])
        if const_expr(scale is not None):  # decided while tracing: no branch in the code
            acc = acc * scale
        Out[lane] = acc

    @flyc.jit
    def launch(X: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        col_sum_kernel(X, Out).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)

    return launch


cols = torch.zeros(64)
col_sum_asm = toolchain.compile_isa(make_col_sum(0.5), xs, cols, arch="gfx942")
branches = [ln.split()[0] for ln in col_sum_asm.splitlines() if ln.strip().startswith("s_cbranch")]
loads = [ln.split()[0] for ln in col_sum_asm.splitlines() if "_load_" in ln and "s_load" not in ln]
show.md(f"""The compiled kernel has {len(branches)} conditional branches and
{len(loads)} vector load(s) (`{', '.join(loads)}`): the four unrolled loads of adjacent
floats merged.""")

# %% [markdown]
# **Where a branch on a device value may go.** `@flyc.kernel` rewrites its own body's `if` on
# a device value into a device branch (`scf.if`, then `s_cbranch_execz` around the lanes that
# skip it). A helper *called* from the kernel is plain Python: its `if` asks Python for a bool
# the tracer does not have, and fails. `pa_tile.kernel_lib.device_code` gives a helper the same
# rewrite; the split kernels of later chapters use it.

# %%
from pa_tile.kernel_lib import device_code  # noqa: E402


def store_inside(Out, lane, n, value):  # a plain helper
    if lane < n:
        Out[lane] = value


@device_code
def store_inside_rewritten(Out, lane, n, value):  # the same helper, rewritten
    if lane < n:
        Out[lane] = value


def make_masked_copy(helper):
    @flyc.kernel
    def masked_copy_kernel(X: fx.Tensor, Out: fx.Tensor, n: fx.Int32):
        lane = fx.thread_idx.x
        helper(Out, lane, n, fx.Float32(X[lane, 0]))

    @flyc.jit
    def launch(X: fx.Tensor, Out: fx.Tensor, n: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        masked_copy_kernel(X, Out, n).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)

    return launch


for helper in (store_inside, store_inside_rewritten):
    got = torch.zeros(64, device=dev)
    try:
        make_masked_copy(helper)(xs.to(dev), got, 3)
        print(f"{helper.__name__}: Out[:5] = {got.cpu()[:5].tolist()}")
    except RuntimeError as e:
        print(f"{helper.__name__}: RuntimeError: {e}")

# %% [markdown]
# ## Layouts: shape:stride, CuTe's algebra
#
# FlyDSL's layout algebra is CuTe's, names included: a **layout** maps a coordinate to an offset
# through a *shape* and a *stride*, written `shape:stride`, and nests. `make_layout`,
# `zipped_divide`, `flat_divide`, `make_tiled_mma`, `partition_S`/`partition_D` and
# `make_fragment_like` do what they do in CuTe, so a CuTe reader knows them already.
#
# Chapter 01 describes a tile of paged K as `((block_size, pages), 128) : ((128, page), 1)`.
# The token coordinate is split into (slot in page, page), each with its own stride. Below is a
# small one: pages of 4 tokens, 8 channels per token, the second page 96 elements after the
# first. The layouts print while tracing; each lane computes `L(lane)` on the device.

# %%
@flyc.kernel
def layout_kernel(Out: fx.Tensor):
    lane = fx.thread_idx.x
    L = fx.make_layout(((4, 2), 8), ((8, 96), 1))  # (token = (slot, page), channel) -> offset
    print("L                   =", L)
    print("zipped_divide(L, 4) =", fx.zipped_divide(L, (4, 8)), "(tile, which tile)")
    Out[lane] = fx.Int32(fx.get_scalar(fx.crd2idx(lane, L)))  # a 1-D index, first mode fastest


@flyc.jit
def layout_offsets(Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    layout_kernel(Out).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)


offsets = torch.zeros(64, dtype=torch.int32, device=dev)
layout_offsets(offsets)
print("offset of (token t, channel c): row t, column c")
print(offsets.cpu().reshape(8, 8).T)

# %% [markdown]
# Tokens 0-3 sit 8 apart in the first page; token 4 starts the second page, 96 elements on.
# `zipped_divide` cuts the layout into 4×8 tiles, one per page, and collects "which tile" in a
# second mode. Chapter 01 lays a tile of K out this way, its pages as if back to back, and
# translates each page through the block table.
#
# ## Cache layouts
#
# How a page's bytes are laid out decides how many 128-byte cache lines a wave touches per
# load (both targets fetch 128-byte lines into the vL1D and L2: CDNA3 and CDNA4 white papers).
# `pa_tile.cache` builds each layout with an exact inverse:
#
# | layout | shape | why |
# |---|---|---|
# | K plain | `[nb, kvh, block_size, head_dim]` | a token's channels contiguous |
# | K blocked | `[nb, kvh, head_dim/16, block_size, 16]` | lane `i` reads token `i`'s 16 B |
# | V plain | `[nb, kvh, head_dim, block_size]` | a channel's tokens contiguous |
# | V trans-blocked | `[nb, kvh, block_size/16, head_dim, 16]` | 16 tokens of a channel, in P·V order |
#
# The picture shows one page of one KV head at block_size 32 and head_dim 32, to stay small.
# Each outlined strip is one **16-byte chunk**, what a lane fetches with one `dwordx4`. Its
# number is its place in memory; its colour, the 128-byte line that holds it.

# %%
def chunk_of(layout, block_size=32, head_dim=32):
    """16-byte chunk index (memory order) of each logical (token, channel) element of page 0."""
    idx = torch.arange(block_size * head_dim, dtype=torch.int32).reshape(1, 1, block_size, head_dim)
    build = {"K plain": lambda t: t, "K blocked": cache.to_k_blocked, "V plain": cache.to_v_plain,
             "V trans-blocked": cache.to_v_trans_blocked}[layout]
    phys = build(idx).flatten()  # physical position p holds logical element phys[p]
    where = torch.empty_like(phys)
    where[phys.long()] = torch.arange(phys.numel(), dtype=torch.int32)
    return (where // 16).reshape(block_size, head_dim).numpy()


figures.cache_layouts({name: chunk_of(name) for name in
                       ("K plain", "K blocked", "V plain", "V trans-blocked")})
plt.show()

# %% [markdown]
# If lane `i` takes chunk `i`, a layout is good when the chunks a wave needs together are
# numbered consecutively, so 8 neighbouring lanes fill one line.
#
# * **K plain** with head_dim 128: a token's row is one 128-byte line. Q·Kᵀ wants the same
#   channels of many tokens at once, so each lane's 16 bytes come from a different line.
# * **K blocked**: chunk `i` is channels 0-15 of token `i`. Lanes reading neighbouring tokens
#   read neighbouring chunks.
# * **V trans-blocked**: chunk `i` is tokens 0-15 of channel `i`, the order P·V consumes: V
#   stored transposed, as in FlashAttention kernels that feed V to a matrix unit.
#
# Chapters 01-03 read the plain layouts; chapter 04 switches to the blocked ones.
#
# ## Running the assembly on a CPU
#
# No one writing this course has an AMD GPU, and neither has its CI. `pa_tile.emu` executes
# the compiled gfx942/gfx950 instructions 64 lanes at a time, against the CPU tensors of the
# call. It checks every memory access against those tensors and stops, by name, at an
# instruction it does not know. It can also record every memory instruction:

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace, format_table  # noqa: E402

trace = Trace(backend.default_arch())
with emu_launch.launch_options(trace=trace):  # the trace is filled only by the emulator
    tiny_kernels.scale_add(x.to(dev), y.to(dev), torch.zeros_like(o), 2.0)
if backend.current_backend() == "emu":
    print(format_table(trace.summary(), ["mnemonic", "space", "executions", "bytes", "lines_128B",
                                         "min_lines_128B"]))
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# Each row sums one instruction over the waves that ran it: the bytes moved, the 128-byte lines
# they touched, and the fewest lines those bytes fit in. Equal columns mean every byte fetched
# was used. Chapters 01-08 read the same trace for the attention kernels.
#
# ## Occupancy
#
# Occupancy is how many waves each SIMD keeps resident. A SIMD hides one wave's memory wait by
# issuing another's instructions, so a memory-bound kernel wants many. On both targets a
# SIMD's 512 registers per lane are shared by its waves' VGPRs and AGPRs, in granules of 8.
# For 256-thread workgroups and no LDS:

# %%
print(f"{'VGPR+AGPR':>10} | {'gfx942 waves/SIMD':>17} | {'gfx950 waves/SIMD':>17}")
for v in (64, 96, 128, 168, 256, 512):
    occ = [isa.occupancy_for(arch, vgpr_unified=v, workgroup_size=256).waves_per_simd
           for arch in ("gfx942", "gfx950")]
    print(f"{v:>10} | {occ[0]:>17g} | {occ[1]:>17g}")
occ = isa.occupancy(stats["gfx942"])
print(f"scale_add: {occ.waves_per_simd:g} waves/SIMD, bound by {' and '.join(occ.bound_by)}")

# %% [markdown]
# ## Upstream: the yardstick
#
# "Upstream" is FlyDSL's own paged-attention decode in ROCm/FlyDSL. `pa_decode_ps` is the
# production kernel (`kernels/pa_decode_fp8.py`), timed above. `pa_decode_tile`
# (`kernels/attention/pa_decode_tile.py`) is a tile kernel for the same problem. Its
# development branch, `pr-825`, introduced one idea per commit and quoted MI300-class times in
# the commit messages. pa_tile's stages retrace those ideas; the course calls that branch's
# kernel **the seed kernel**.
#
# Upstream is the yardstick for two reasons. It is the same language on the same hardware, so
# a gap is a design difference, not a toolchain one. And its times are the only hardware
# measurements this course has: each chapter shows what its idea bought the seed kernel.

# %%
prov = upstream.provenance()
show.md(f"""
pa_tile compares its compiled kernels with `pa_decode_tile` from ROCm/FlyDSL commit
`{prov['commit'][:12]}`, compiled by flydsl `{prov['flydsl']}` for both targets
(registers, LDS, waves per SIMD: `pa_tile.upstream`, not run).

{seed_history.attribution()}
""")

# %% [markdown]
# ## What you built
#
# ```
# reference(case):                          # float32, the ground truth of every chapter
#     for each sequence s, query head h:
#         kv = h // group
#         for token t < context[s]:
#             page = block_tables[s][t // block_size]; slot = t % block_size
#             k[t] = decode(K[page, kv, slot]) * k_scale   # FNUZ on gfx942, OCP on gfx950
#             v[t] = decode(V[page, kv, slot]) * v_scale
#         out[s, h] = softmax(q[s, h] · k / sqrt(d)) · v
#
# scale_add(X, Y, Out, alpha):              # the first FlyDSL kernel
#     one workgroup of 128 threads per [8, 64] tile
#     each thread: 4 floats of X and Y (one global_load_dwordx4 each)
#     Out = alpha * X + Y                    # one global_store_dwordx4
# ```
#
# Next: chapter 01 writes the first attention kernel with FlyDSL's tile API.

# %%
scale_add_bytes = 3 * x.numel() * x.element_size()
traced = [r for r in trace.summary() if r["space"] != "scalar"]  # empty on a GPU
moved = (f"{sum(r['bytes'] for r in traced):,} / {scale_add_bytes:,}" if traced
         else "recorded by the emulator only")
show.measured({
    "scale_add VGPRs (gfx942 / gfx950)":
        f"{stats['gfx942'].vgpr_unified} / {stats['gfx950'].vgpr_unified}",
    "scale_add waves per SIMD (gfx942)": f"{isa.occupancy(stats['gfx942']).waves_per_simd:g}",
    "scale_add bytes moved / compulsory": moved,
})
