"""Hardware constants of the timing model (``pa_tile.perf.model``), one place, each with its source.

Every number here is either a published figure (the source is named beside it), a figure
*derived* from published ones (the derivation is written out), or a FITTED constant: those are
listed in :data:`FITTED`, start from the prior written here, and are overwritten only by the
validation harness (``scripts/validate_model.py``), which records what it fitted on which points
in ``pa_tile/data/model_validation.md``. Nothing else is tuned.

Sources (short names used below):

* [MI300X-DS] AMD Instinct MI300X accelerator data sheet: 304 CUs, 2100 MHz peak engine clock,
  5.3 TB/s HBM3, 2614.9 TFLOPS dense FP8.
* [MI355X-DS] AMD Instinct MI355X data sheet: 256 CUs, 2400 MHz, 8 TB/s HBM3E, ~5 PFLOPS dense FP8.
* [CDNA3-WP] AMD CDNA 3 architecture white paper: 8 XCDs of 38 active CUs, 4 MB L2 per XCD,
  256 MB AMD Infinity Cache (MALL), 64 KB LDS per CU, 4 SIMD16 units per CU.
* [CDNA4-WP] AMD CDNA 4 architecture white paper: 8 XCDs of 32 active CUs, 4 MB L2 per XCD,
  256 MB Infinity Cache, LDS grown to 160 KB per CU with doubled read bandwidth (256 bytes per
  clock, also in Chips and Cheese, "AMD's CDNA 4 Architecture Announcement", 2025), and twice
  CDNA3's rate for transcendental instructions (as issue 36 quotes the white paper; the stored
  copies searched here held no text of that sentence to check it against).
* [C&C-MI300X] Chips and Cheese, "Testing AMD's Giant MI300X" (2024): "Eight compute dies, each
  with 38 CDNA 3 compute units and 4 MB of L2, sit on top of a 256 MB Infinity Cache".
* [CDNA3-ISA] AMD "CDNA 3 Instruction Set Architecture" reference guide: wave64 executes a VALU
  instruction over 4 cycles on a 16-lane SIMD; transcendental ops (v_exp/v_log/v_rcp/v_sqrt/
  v_rsq) at quarter rate; s_nop N idles N+1 cycles; vmcnt counts vector memory loads *and*
  stores in order; lgkmcnt counts LDS, GDS, constant (SMEM) and message operations.
* [ROCPROF] rocprofiler-compute (Omniperf) performance model documentation, CDNA pages
  (pipeline descriptions, LDS, vL1D): the sequencer visits each SIMD once every 4 cycles and
  issues at most one instruction per wave per visit, up to one per functional unit
  (VALU, MFMA, SALU/SMEM, LDS, VMEM, branch) from different waves; LDS of 32 banks x 4 bytes
  serves 128 bytes per clock per CU; the vL1D/texture addresser processes one 64-byte request
  per clock per CU.
* [FLYDSL-MI308X] the gfx942 machine of the pr-825 author (fsx950223) is an MI308X: the same
  author's ROCm/FlyDSL commits of June 2026 say "Verified on MI308X (gfx942)" (94b41abe) and
  "Measured (softmax 8192^2, MI308X)" (34b5f488, e33eca2e). MI308X is a gfx942 (CDNA3) part with
  80 CUs; it is not in AMD's ROCm GPU-specifications table, so its figures here come from a
  public third-party tuning note ("MI308X: 80 CU, 4 XCD, 5.3 TB/s HBM3, 64 KB LDS/CU, 4 MB
  L2/XCD, 256 MB L3"; the CU count is also what the pr-825 host heuristics' own arithmetic
  implies, see scripts/validate_model.py). ASSUMED, not sourced: the same 2100 MHz peak clock
  and per-CU rates (MFMA, LDS, addresser) as MI300X, i.e. the same CDNA3 CU.
* [CDNA4-ISA] AMD "CDNA 4 Instruction Set Architecture" reference guide, ch. 7 (matrix
  instructions): ``v_mfma_f32_16x16x32_fp8_fp8`` is a 4-pass (16-cycle) instruction on gfx950 as
  on gfx942; the doubled fp8 rate of CDNA4 belongs to the new ``v_mfma_f32_16x16x128_f8f6f4``
  (32 cycles with an fp8 operand, for four times the K). The same figures in AMD's ROCm blog
  "Matrix Core Programming on AMD CDNA3 and CDNA4 architecture" (Salykov, Luo, Huang, Sun, 2025),
  whose cycle table lists FP8 16x16x32 at 16 cycles on both and FP8 16x16x128 at 32 (CDNA4 only).
  [MFMA-CALC] ROCm/amd_matrix_instruction_calculator ``-a CDNA3 -i v_mfma_f32_16x16x32_fp8_fp8``:
  16 execution cycles, 4096 FLOPs/CU/cycle (its stored copy has no CDNA4 table).
* [SC25-MALL] Tee, Curtis, Wolfe, Wong, "The MALL is Open: Exploring Shared Caches and Latency
  in AMD CDNA 3 GPUs", SC'25 workshops (pointer-chasing latency of L2 / MALL / HBM on MI300X).
  Its ordering (L2 < MALL < HBM, hundreds of ns to HBM) frames the latency prior; the value used
  is FITTED (see below) because we have not read the paper's exact figures here.

TB/s is 10^12 bytes per second, as in the data sheets.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

__all__ = ["Hardware", "HARDWARE", "FITTED", "hardware", "with_fitted"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    arch: str
    # -- published -----------------------------------------------------------------------------
    compute_units: int          # [MI300X-DS] / [MI355X-DS]
    xcds: int                   # [CDNA3-WP] / [CDNA4-WP]; [C&C-MI300X]
    clock_hz: float             # peak engine clock, data sheets
    hbm_bytes_per_s: float      # peak, data sheets
    infinity_cache_bytes: int   # [CDNA3-WP] / [CDNA4-WP]: 256 MB
    l2_bytes_per_xcd: int       # [CDNA3-WP] / [CDNA4-WP]: 4 MB
    #: [ROCPROF] 128 B/clk/CU (CDNA3); [CDNA4-WP] doubles the READ bandwidth -> 256. The model charges
    #: every ds_ instruction at this rate: gfx950's writes at 256 B/clk are ASSUMED (no source gives them)
    lds_bytes_per_clk: int
    #: [ROCPROF] the vL1D addresser takes one 64-byte *request* per clock per CU (a request size, not
    #: the cache line: vL1D and L2 lines are 128 bytes on both targets, [CDNA3-WP]/[CDNA4-WP])
    ta_bytes_per_clk: int
    # -- architectural (ISA guide) --------------------------------------------------------------
    #: cycles one v_mfma_f32_16x16x32_fp8_fp8 (the only MFMA pa_tile's kernels issue) keeps the
    #: SIMD's matrix core busy: 4 passes = 16 cycles on gfx942 ([CDNA3-ISA], [MFMA-CALC]) and on
    #: gfx950 ([CDNA4-ISA]). Not derived from the data sheets' peak fp8 rate: MI300X's
    #: 2614.9e12 / (304*4*2.1e9) = 1024 flop/clk/SIMD is this instruction's rate, but MI355X's
    #: ~2048 belongs to v_mfma_f32_16x16x128_f8f6f4, which these kernels do not use.
    mfma_cycles: int
    #: cycles a wave64 transcendental (v_exp/v_log/v_rcp/v_sqrt/v_rsq) keeps the VALU busy:
    #: quarter rate on CDNA3, 16 ([CDNA3-ISA]); twice that rate on CDNA4, 8 ([CDNA4-WP])
    trans_cycles: int
    simds_per_cu: int = 4                 # [CDNA3-WP]
    valu_cycles: int = 4                  # [CDNA3-ISA] wave64 over a 16-lane SIMD
    issue_interval: int = 4               # [ROCPROF] one instruction per wave per 4-cycle SIMD visit
    # -- FITTED (see FITTED, PRIORS and pa_tile/data/model_validation.md) -------------------------
    hbm_efficiency: float = 0.50          # FITTED: achievable / peak HBM bandwidth for these kernels' reads
    mem_latency_cycles: float = 6400.0    # FITTED: unloaded load-to-use latency of a K/V global load
    #: ASSUMED (not fitted): load-to-use latency of data resident in L2 / Infinity Cache (the
    #: split-K partials the reduce kernel re-reads); [SC25-MALL] places L2 and MALL hits well
    #: below HBM; 500 cycles (~240 ns at 2.1 GHz) is our round figure between them.
    cache_latency_cycles: float = 500.0
    lds_latency_cycles: float = 64.0      # FITTED prior only (not fitted by default): ds_read to use
    smem_latency_cycles: float = 200.0    # FITTED prior only (not fitted by default): s_load to use
    launch_us: float = 2.0                # FITTED: per-kernel dispatch gap in a CUDA-graph replay
    #: FITTED only by ``scripts/validate_model.py --memory-parallelism`` (prior 0: no limit, the
    #: default model): bytes of vector-memory requests one CU keeps outstanding. By Little's law a CU
    #: alone then receives at most this many bytes per memory latency, so a wait for a large batch of
    #: loads costs the latency plus their bytes at that rate, and a loop that waits for K and V apart
    #: pays the latency twice but the bytes once (model_validation.md, 'Memory-level parallelism')
    cu_bytes_in_flight: float = 0.0

    @property
    def cus_per_xcd(self) -> int:
        return self.compute_units // self.xcds

    @property
    def mall_bytes_per_s(self) -> float:
        """Infinity Cache bandwidth for re-read data. [CDNA3-WP] quotes 17.2 TB/s peak for MI300X;
        for MI355X we scale by the engine clock ratio (an assumption, said here)."""
        return 17.2e12 * (self.clock_hz / 2.1e9)

    @property
    def l2_bytes_per_s(self) -> float:
        """L2 read bandwidth: [CDNA3-WP] 16 channels x 128 B/clk per XCD, times XCDs and clock."""
        return self.xcds * 16 * 128 * self.clock_hz

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d.update(cus_per_xcd=self.cus_per_xcd, mall_bytes_per_s=self.mall_bytes_per_s,
                 l2_bytes_per_s=self.l2_bytes_per_s)
        return d


#: The constants the validation harness may fit (by name), and nothing else.
FITTED = ("hbm_efficiency", "mem_latency_cycles", "launch_us", "cu_bytes_in_flight")

#: Where the fit starts (what we would guess without hardware): ~80% of peak HBM is what streaming
#: reads reach on MI300X-class parts; ~1200 cycles (~570 ns) is our round figure for an HBM miss
#: below the SC25-MALL ordering; ~2 us between two graph-replayed kernels. The dataclass defaults
#: above are the values scripts/validate_model.py fitted from these on a third of the pr-825 points
#: (its report: pa_tile/data/model_validation.md), on the 80-CU MI308X those times were measured on
#: (see [FLYDSL-MI308X]); using them for MI300X assumes the same per-CU latency and fraction of peak
#: HBM. They sit far from the priors (0.50 of peak, 6400 cycles ~ 3 us; with the CU units' queueing
#: of ``model.mva_round`` and the loaded latency's utilisation taken of the peak, on the widened grid
#: of issue 14's follow-up: latency and launch inside it, hbm_efficiency at its lower bound 0.50, which
#: is physical, not the grid's: the production pa_decode_ps_kernel read the same bytes on the same
#: machine at >= 0.47 of peak, see scripts/validate_model.py production_bound): the fit
#: absorbs what the model does not see (how little the CU's units overlap, vL1D reuse, DRAM page
#: locality, L2/TLB misses, the latency of dependent address chains), so read them as effective
#: figures, not as hardware facts.
PRIORS = dict(hbm_efficiency=0.80, mem_latency_cycles=1200.0, launch_us=2.0, cu_bytes_in_flight=0.0)

HARDWARE: Dict[str, Hardware] = {
    "mi300x": Hardware(
        name="MI300X", arch="gfx942", compute_units=304, xcds=8, clock_hz=2.1e9, hbm_bytes_per_s=5.3e12,
        infinity_cache_bytes=256 << 20, l2_bytes_per_xcd=4 << 20, lds_bytes_per_clk=128, ta_bytes_per_clk=64,
        mfma_cycles=16, trans_cycles=16,
    ),
    # the pr-825 timings' device (see [FLYDSL-MI308X]); per-CU figures ASSUMED equal to MI300X's
    "mi308x": Hardware(
        name="MI308X", arch="gfx942", compute_units=80, xcds=4, clock_hz=2.1e9, hbm_bytes_per_s=5.3e12,
        infinity_cache_bytes=256 << 20, l2_bytes_per_xcd=4 << 20, lds_bytes_per_clk=128, ta_bytes_per_clk=64,
        mfma_cycles=16, trans_cycles=16,
    ),
    "mi355x": Hardware(
        name="MI355X", arch="gfx950", compute_units=256, xcds=8, clock_hz=2.4e9, hbm_bytes_per_s=8.0e12,
        infinity_cache_bytes=256 << 20, l2_bytes_per_xcd=4 << 20, lds_bytes_per_clk=256, ta_bytes_per_clk=64,
        mfma_cycles=16, trans_cycles=8,
    ),
}


def hardware(name) -> Hardware:
    """A :data:`HARDWARE` entry by GPU name (``mi300x``/``MI300X``) or arch (``gfx942``)."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    for hw in HARDWARE.values():
        if hw.arch == key:
            return hw
    raise ValueError(f"gpu: unknown {name!r}; known: {', '.join(HARDWARE)} (or gfx942 / gfx950)")


def with_fitted(hw: Hardware, values: Dict[str, float]) -> Hardware:
    """``hw`` with FITTED constants replaced; refuses to change anything not in :data:`FITTED`."""
    bad = sorted(set(values) - set(FITTED))
    if bad:
        raise ValueError(f"only the FITTED constants {FITTED} may be fitted, got {bad}")
    return dataclasses.replace(hw, **values)
