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
# # 00 · Paged decode attention, and the tools of this walkthrough
#
# This walkthrough builds one kernel: **fp8 paged-attention decode** for AMD Instinct MI300
# (gfx942) and MI355 (gfx950), written in FlyDSL. This chapter sets the problem up for a kernel
# engineer: what the kernel computes, where its bytes live, why its speed is set by memory
# bandwidth, and the three tools every later chapter leans on:
#
# 1. a float32 **reference** and seeded **cases** (`pa_tile.reference`, `pa_tile.cache`),
# 2. a **CPU toolchain** that compiles FlyDSL to real gfx942/gfx950 assembly (`pa_tile.toolchain`),
# 3. **ISA inspection**: registers, LDS, occupancy and instruction mix from that assembly (`pa_tile.isa`).
#
# and a fourth, introduced at the end: an **emulator** that *runs* that assembly on a CPU (`pa_tile.emu`).

# %%
import math

import matplotlib.pyplot as plt
import torch

import pa_tile
from pa_tile import cache, figures, isa, reference, toolchain

torch.set_printoptions(precision=3, linewidth=110)

# %% [markdown]
# ## What decode computes
#
# During generation each sequence adds `query_length` new tokens per step (1 for plain decode;
# 2–4 for multi-token / speculative decode, "MTP"). Each new token's query attends to every
# earlier token's key and value, which were computed in earlier steps and kept in the
# **KV cache**:
#
# $$o_{h} = \sum_{t \le \mathrm{pos}} \mathrm{softmax}_t\!\left(\tfrac{q_h\cdot k_{t}}{\sqrt{d}}\right) v_{t}$$
#
# * **Paging.** The cache is a pool of fixed-size *pages* (`block_size` = 16 or 64 tokens).
#   A sequence owns a list of page ids, its row of the **block table**; token `t` of sequence
#   `s` lives in page `block_tables[s, t // block_size]`, slot `t % block_size`. Pages are
#   handed out as memory frees up, so consecutive pages of one sequence are scattered.
# * **GQA.** `num_q_heads` query heads share `num_kv_heads` K/V heads; a *query group* of
#   `num_q_heads // num_kv_heads` (8 or 16 here) heads reads the same K/V. The kernel loads
#   each K/V byte once and uses it for the whole group.
# * **fp8 K/V.** The cache stores e4m3 codes; the real value is `decode(code) × scale`, with one
#   scale per tensor or one per token. gfx942 decodes codes as **FNUZ** (bias 8, max 240),
#   gfx950 as **OCP** e4m3fn (bias 7, max 448): the same byte means different numbers.
# * **MTP.** With `query_length = L_q`, query `i` of a sequence of context length `L` sits at
#   position `L − L_q + i` and must not see later positions (causal mask).
#
# A small case, with the page ids shuffled the way a real allocator leaves them:

# %%
case = cache.make_case(
    num_seqs=3, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16,
    context_lengths=[17, 40, 5], fp8_format="fnuz", scales="per-tensor", seed=0,
)
print(case)
print("block_tables (page ids; entries past a sequence's last page are padding):")
print(case.block_tables.cpu())
print("K cache (logical layout [num_blocks, kv_heads, block_size, head_dim]):", tuple(case.k_cache.shape), case.k_cache.dtype)

# %% [markdown]
# The reference gathers each sequence's pages, dequantizes, and runs an ordinary float32
# softmax attention. It is the ground truth every kernel in this walkthrough is tested against.
# Below, it is checked once more against the formula above written as a plain loop over tokens.

# %%
out = case.reference()
print("output:", tuple(out.shape), out.dtype)

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

err = max((one_head_by_hand(case, s, h) - out[s, h].float()).abs().max().item() for s in range(3) for h in range(8))
print(f"max |reference - by hand| = {err:.2e}  (fp16 output rounding: ~1e-3 of |o|)")
assert err < 2e-3

# %% [markdown]
# ## Why decode is memory-bound
#
# Per query token and KV head, the kernel reads `2·d` bytes of fp8 K and V per context token
# and does `4·d·G` flops with them (`q·k` and `p·v` for the `G` heads of the query group). Its
# arithmetic intensity is therefore about **2·G flops per byte**: 16 for G = 8, and
# `L_q` times more with MTP. The hardware balance point is two orders of magnitude higher:
#
# | | HBM bandwidth | dense fp8 MFMA peak | flops/byte to be compute-bound |
# |---|---|---|---|
# | MI300X (gfx942, 304 CUs) | 5.3 TB/s | 2.6 PFLOP/s | ≈ 490 |
# | MI355X (gfx950, 256 CUs) | 8.0 TB/s | 5.0 PFLOP/s | ≈ 630 |
#
# (AMD Instinct MI300X and MI355X data sheets.) So the time floor of a decode call is the
# time to stream its K/V bytes from HBM once: every chapter is, in the end, about moving bytes
# at full bandwidth and hiding everything else under those loads.

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

print(f"batch 128, context 16384: {decode_bytes(128, 16384) / 2**30:.2f} GiB per call -> "
      f"{decode_bytes(128, 16384) / HBM['MI300X'] * 1e3:.3f} ms on MI300X, "
      f"{decode_bytes(128, 16384) / HBM['MI355X'] * 1e3:.3f} ms on MI355X")

# %% [markdown]
# ## Cache layouts
#
# How the bytes of a page are laid out decides how many 64-byte memory segments a wave touches
# per load. The reference uses the *logical* layout; kernels read physical layouts built by
# `pa_tile.cache` (every builder has an exact inverse):
#
# | layout | shape | why |
# |---|---|---|
# | K plain | `[nb, kvh, block_size, head_dim]` | one token's channels contiguous |
# | K blocked | `[nb, kvh, head_dim/16, block_size, 16]` | 16 channels of a token = one 128-bit load, and neighbouring lanes read neighbouring tokens |
# | V plain | `[nb, kvh, head_dim, block_size]` | one channel's tokens contiguous |
# | V trans-blocked | `[nb, kvh, block_size/16, head_dim, 16]` | 16 tokens of a channel = one 128-bit load, the order P·V consumes |
#
# The picture shows one page of one KV head (block_size 32, head_dim 32 to keep it small).
# Each number marks one **16-byte chunk**, what a lane fetches with one 128-bit load, at its
# position in memory; colours are 64-byte memory segments (4 chunks, legend below). If lane `i` of a wave
# takes chunk `i`, a layout is good when the chunks a wave needs *together* are numbered
# consecutively.

# %%
import numpy as np  # noqa: E402


def chunk_of(layout, block_size=32, head_dim=32):
    """16-byte chunk index (memory order) of each logical (token, channel) element of page 0."""
    idx = torch.arange(block_size * head_dim, dtype=torch.int32).reshape(1, 1, block_size, head_dim)
    # idx[b,h,t,d] = t*head_dim + d; build the physical tensor, then read back where each element went
    phys = {"K plain": idx, "K blocked": cache.to_k_blocked(idx), "V plain": cache.to_v_plain(idx),
            "V trans-blocked": cache.to_v_trans_blocked(idx)}[layout].flatten()
    where = torch.empty_like(phys)
    where[phys.long()] = torch.arange(phys.numel(), dtype=torch.int32)
    return (where // 16).reshape(block_size, head_dim).numpy()


figures.cache_layouts({name: chunk_of(name) for name in ("K plain", "K blocked", "V plain", "V trans-blocked")})
plt.show()

# %% [markdown]
# * **K plain**: chunks 0 and 1 are one token's 32 channels, so lanes that need *the same
#   channels of different tokens* (what Q·Kᵀ's B operand wants) are a whole token row apart:
#   with head_dim 128 that is 128 bytes, and half of every 64-byte segment fetched is unused.
# * **K blocked**: chunk `i` is channels 0–15 of token `i`: lanes reading consecutive tokens
#   read consecutive 16 bytes, one fully used 64-byte segment per 4 lanes.
# * **V trans-blocked**: chunk `i` is tokens 0–15 of channel `i`, the k-major order the P·V
#   MFMA consumes, again contiguous across lanes.

# %% [markdown]
# ## Compiling FlyDSL on a CPU
#
# FlyDSL traces a Python function into MLIR and lowers it through LLVM's AMDGPU backend. Its
# last step wants a ROCm install: `ld.lld` and the device libraries `ockl.bc`/`ocml.bc`. On a
# CPU-only machine `pa_tile.toolchain` assembles a ROCm-shaped folder from ordinary packages
# (Debian `lld-19` + `rocm-device-libs`, or PyPI `ziglang` + `triton`) and never touches a
# real ROCm install:

# %% tags=["nbval-ignore-output"]
toolchain.describe_toolchain()

# %% [markdown]
# A tiny kernel, `out = alpha·x + y`, where each of 128 threads moves one 128-bit chunk
# (4 floats) per tensor. `compile_isa` compiles one specialization for a chosen arch and
# returns the assembly text; nothing runs.

# %%
from pa_tile.tiny_kernels import scale_add  # noqa: E402

x, y, o = torch.randn(64, 256), torch.randn(64, 256), torch.zeros(64, 256)
asm = {arch: toolchain.compile_isa(scale_add, x, y, o, 2.0, arch=arch) for arch in ("gfx942", "gfx950")}
body = asm["gfx942"].split("scale_add_kernel_0:\n", 1)[1].split("s_endpgm", 1)[0]
print("\n".join(line for line in body.splitlines() if "global_" in line or "v_pk" in line or "v_fma" in line))

# %% [markdown]
# The loads are `global_load_dwordx4`: 16 bytes per lane, the widest a lane can fetch in one
# instruction. `pa_tile.isa` reads the facts a kernel engineer checks first: registers, LDS,
# the occupancy they allow, and the instruction mix.

# %%
stats = {arch: isa.IsaStats.from_asm(text) for arch, text in asm.items()}
print(isa.summary(stats["gfx942"]))

# %%
print(isa.diff(stats["gfx942"], stats["gfx950"], labels=("gfx942", "gfx950")))

# %% [markdown]
# Occupancy is the number of waves each SIMD can keep resident; the scheduler hides memory
# latency by switching between them, which is what a memory-bound kernel needs. On both
# archs one SIMD has a 512-entry-per-lane register file shared by VGPRs and AGPRs and
# allocated in granules of 8, and a CU has 64 KiB (gfx942) or 160 KiB (gfx950) of LDS. The
# table shows waves per SIMD as the unified register count grows, for 256-thread workgroups
# and no LDS: the figure every later chapter fights for.

# %%
print(f"{'VGPR+AGPR':>10} | {'gfx942 waves/SIMD':>17} | {'gfx950 waves/SIMD':>17}")
for v in (64, 96, 128, 168, 256, 512):
    occ = [isa.occupancy_for(arch, vgpr_unified=v, workgroup_size=256).waves_per_simd for arch in ("gfx942", "gfx950")]
    print(f"{v:>10} | {occ[0]:>17g} | {occ[1]:>17g}")
print("scale_add:", isa.occupancy(stats["gfx942"]))

# %% [markdown]
# ## Running the assembly on a CPU
#
# Nobody writing this walkthrough has an AMD GPU, and neither does its CI. `pa_tile.emu` closes the
# gap: FlyDSL's ordinary launcher is routed to an emulator that executes the compiled gfx942 /
# gfx950 instructions, 64 lanes at a time, against the CPU tensors of the call; every memory access
# is checked against those tensors, and an instruction it does not know stops the run by name. On
# a ROCm machine `ensure_backend()` picks the GPU instead and the same call runs there.

# %% tags=["nbval-ignore-output"]
from pa_tile import backend  # noqa: E402

print("backend:", backend.ensure_backend())

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace, format_table  # noqa: E402

dev = backend.device_for_tensors()
xd, yd, od = x.to(dev), y.to(dev), torch.zeros_like(x, device=dev)
trace = Trace(backend.default_arch())
with emu_launch.launch_options(trace=trace):  # the trace is filled only by the emulator
    scale_add(xd, yd, od, 2.0)
print("max |out - (2x + y)| =", (od.cpu() - (2 * x + y)).abs().max().item())
if backend.current_backend() == "emu":
    executed = sum(row["count"] for row in trace.instruction_counts())
    print(f"{executed} wave-instructions executed by {(64 // 8) * (256 // 64)} workgroups; the memory ones:")
    print(format_table(trace.summary(), ["mnemonic", "space", "executions", "bytes", "segments", "min_segments"]))
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# Each row adds up its instruction's executions, one per wave: a `global_load_dwordx4` moves
# 65536 B / 64 = 1 KiB per wave and touches 1024 / 64 = 16 64-byte segments each time, exactly
# the segments that hold those bytes (the `min_segments` column): the ideal. Scalar loads (kernel
# arguments) are listed apart; they are one per wave, not per lane. Chapters 1–7 use the same trace to count segments and LDS bank
# conflicts of the attention kernels. What the emulator models exactly and what approximately
# is in `pa_tile/emu/README.md`.
#
# Next: chapter 01 writes the first attention kernel with FlyDSL's tile API and runs its
# compiled gfx942/gfx950 code in the emulator against this chapter's reference.
