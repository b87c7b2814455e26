// pa_tile emulator fast paths: the hottest instructions of pa_tile's kernels, run on a wave's
// register file in place (pa_tile.emu.fastpath loads this library; pa_tile.emu.ops_fast decodes
// instructions into calls of it).
//
// Every function here computes, bit for bit, what the numpy semantics in pa_tile.emu.numerics
// compute (the reference the tests hold them to): the same IEEE double/float operations in the
// same order, never an approximation. Built with -ffp-contract=off so the compiler fuses no
// multiply-add, and without -ffast-math.
//
// Register file layout (pa_tile.emu.machine.Wave): v is uint32[512][64] (row = register, column =
// lane), s is uint32[128]; EXEC is s[126] (lanes 0-31) and s[127] (lanes 32-63).
//
// A source operand is one int64 (pa_tile.emu.ops_fast.src_code): bits 0-1 kind (0 VGPR row, 1 SGPR,
// 2 constant), bit 2 abs, bit 3 neg, bits 8-23 row/SGPR index, bits 32-63 the constant's bits.

#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define LANES 64
#define SGPR_EXEC 126

// Bumped whenever a signature below changes; Python refuses a mismatch.
EXPORT int pa_fast_abi_version(void) { return 8; }

typedef union { uint32_t u; float f; } f32u;
typedef union { uint64_t u; double d; } f64u;

static inline float asf(uint32_t u) { f32u x; x.u = u; return x.f; }
static inline uint32_t asu(float f) { f32u x; x.f = f; return x.u; }
static inline int is_nan_bits(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }
static inline int is_snan_bits(uint32_t b) { return is_nan_bits(b) && !(b & 0x00400000u); }
static inline uint32_t quiet(uint32_t b) { return b | 0x00400000u; }

static inline uint64_t exec_mask(const uint32_t *s) {
    return (uint64_t)s[SGPR_EXEC] | ((uint64_t)s[SGPR_EXEC + 1] << 32);
}

// The 64 lanes of one 32-bit source, modifiers applied (abs clears the sign, then neg flips it,
// as ops_base.DecodeCtx.vread does on the raw bits).
static void read_src(const uint32_t *v, const uint32_t *s, int64_t code, uint32_t *out) {
    int kind = (int)(code & 3), idx = (int)((code >> 8) & 0xFFFF);
    uint32_t andm = (code & 4) ? 0x7FFFFFFFu : 0xFFFFFFFFu, xorm = (code & 8) ? 0x80000000u : 0;
    if (kind == 0) {
        const uint32_t *row = v + (size_t)idx * LANES;
        for (int l = 0; l < LANES; l++) out[l] = (row[l] & andm) ^ xorm;
    } else {
        uint32_t x = kind == 1 ? s[idx] : (uint32_t)((uint64_t)code >> 32);
        x = (x & andm) ^ xorm;
        for (int l = 0; l < LANES; l++) out[l] = x;
    }
}

static void write_rows(uint32_t *v, const uint32_t *s, int dst, const uint32_t *val) {
    uint64_t em = exec_mask(s);
    uint32_t *row = v + (size_t)dst * LANES;
    for (int l = 0; l < LANES; l++)
        if ((em >> l) & 1) row[l] = val[l];
}

// ---------------------------------------------------------------- round to odd (numerics._add_round_to_odd)

static inline double add_round_to_odd(double p, double c) {
    double s = p + c;
    double bp = s - p;
    double err = (p - (s - bp)) + (c - bp);
    f64u su; su.d = s;
    if (isfinite(s) && err != 0 && (su.u & 1) == 0) {
        // nextafter(s, err > 0 ? +inf : -inf) on the bits: s != 0 here (a zero sum is exact), so
        // one step away from zero is +1 on the magnitude bits, toward zero -1
        su.u += ((err > 0) == (s > 0)) ? 1 : (uint64_t)-1;
        s = su.d;
    }
    return s;
}

// ---------------------------------------------------------------- f32 min/max (numerics._minmax, ieee=True)

static inline uint32_t minmax(uint32_t a, uint32_t b, int want_max) {
    double af = (double)asf(a), bf = (double)asf(b);
    int pick_a = want_max ? (af >= bf) : (af < bf);
    uint32_t r = pick_a ? a : b;
    if (af == 0 && bf == 0) {
        int neg_a = a >> 31;
        r = want_max ? (neg_a ? b : a) : (neg_a ? a : b);
    }
    if (is_nan_bits(b)) r = a;
    if (is_nan_bits(a)) r = b;
    if (is_snan_bits(b)) r = quiet(b);
    if (is_snan_bits(a)) r = quiet(a);
    return r;
}

// ---------------------------------------------------------------- f32 fma (numerics.fma_f32)

static inline uint32_t fma_bits(uint32_t a, uint32_t b, uint32_t c) {
    double p = (double)asf(a) * (double)asf(b);   // exact: 24 x 24 significant bits
    uint32_t r = asu((float)add_round_to_odd(p, (double)asf(c)));
    if (is_nan_bits(r)) r = 0xFFC00000u;           // inf*0, inf-inf: the VALU default NaN
    if (is_nan_bits(c)) r = quiet(c);              // an input NaN comes back quieted: S0 first,
    if (is_nan_bits(b)) r = quiet(b);              // then S1, then S2
    if (is_nan_bits(a)) r = quiet(a);
    return r;
}

enum { OP_MAX = 0, OP_MIN = 1, OP_MAX3 = 2, OP_MIN3 = 3, OP_FMA = 4 };

// D = op(S0, S1[, S2]) on the lanes on in EXEC.
EXPORT int pa_valu_f32(int op, uint32_t *v, const uint32_t *s, int dst, int64_t c0, int64_t c1, int64_t c2) {
    uint32_t a[LANES], b[LANES], c[LANES], r[LANES];
    read_src(v, s, c0, a);
    read_src(v, s, c1, b);
    if (op >= OP_MAX3) read_src(v, s, c2, c);
    for (int l = 0; l < LANES; l++) {
        switch (op) {
        case OP_MAX: r[l] = minmax(a[l], b[l], 1); break;
        case OP_MIN: r[l] = minmax(a[l], b[l], 0); break;
        case OP_MAX3: r[l] = minmax(minmax(a[l], b[l], 1), c[l], 1); break;
        case OP_MIN3: r[l] = minmax(minmax(a[l], b[l], 0), c[l], 0); break;
        case OP_FMA: r[l] = fma_bits(a[l], b[l], c[l]); break;
        default: return -1;
        }
    }
    write_rows(v, s, dst, r);
    return 0;
}

// v_pk_fma_f32: dst pair = fma of the selected dwords. A pair source code names its low dword
// (VGPR row / SGPR); a constant supplies the same dword to both halves. sel: bit i = op_sel[i],
// bit 4+i = op_sel_hi[i], bit 8+i = neg_lo[i], bit 12+i = neg_hi[i].
EXPORT int pa_pk_fma_f32(uint32_t *v, const uint32_t *s, int dst, int64_t c0, int64_t c1, int64_t c2, int sel) {
    int64_t codes[3] = {c0, c1, c2};
    uint32_t src[3][2][LANES], lo[LANES], hi[LANES];
    for (int i = 0; i < 3; i++) {
        int64_t code = codes[i] & ~(int64_t)0xC;   // pair sources carry no abs/neg of their own
        read_src(v, s, code, src[i][0]);
        if ((code & 3) == 2) memcpy(src[i][1], src[i][0], sizeof src[i][0]);
        else read_src(v, s, code + (1 << 8), src[i][1]);
    }
    for (int l = 0; l < LANES; l++) {
        uint32_t x[3], y[3];
        for (int i = 0; i < 3; i++) {
            x[i] = src[i][(sel >> i) & 1][l] ^ (((sel >> (8 + i)) & 1) ? 0x80000000u : 0);
            y[i] = src[i][(sel >> (4 + i)) & 1][l] ^ (((sel >> (12 + i)) & 1) ? 0x80000000u : 0);
        }
        lo[l] = fma_bits(x[0], x[1], x[2]);
        hi[l] = fma_bits(y[0], y[1], y[2]);
    }
    write_rows(v, s, dst, lo);
    write_rows(v, s, dst + 1, hi);
    return 0;
}

// ---------------------------------------------------------------- f32 -> fp8/bf8 (numerics._encode)

// fmt: mbits | emin << 4 (signed, biased by 64) | max_mag << 12 | fnuz << 20 | has_inf << 21
//      | saturate << 22
static uint32_t encode8(uint32_t bits, int fmt) {
    int mbits = fmt & 0xF, emin = ((fmt >> 4) & 0xFF) - 64, max_mag = (fmt >> 12) & 0xFF;
    int fnuz = (fmt >> 20) & 1, has_inf = (fmt >> 21) & 1, saturate = (fmt >> 22) & 1;
    uint32_t sign = bits >> 31, mag_bits = bits & 0x7FFFFFFFu;
    int is_nan = mag_bits > 0x7F800000u, is_inf = mag_bits == 0x7F800000u;
    double a = (is_nan || is_inf) ? 0.0 : fabs((double)asf(bits));
    int ex;
    frexp(a, &ex);
    int64_t e_eff = a > 0 ? (ex - 1 > emin ? ex - 1 : emin) : emin;
    int64_t n = (int64_t)rint(ldexp(a, -(int)(e_eff - mbits)));
    int64_t code_mag = ((e_eff - emin) << mbits) + n;
    int over = code_mag > max_mag;
    uint32_t mag8 = (uint32_t)(code_mag < max_mag ? code_mag : max_mag) & 0xFF;
    uint32_t out = ((sign << 7) | mag8) & 0xFF;
    if (fnuz && mag8 == 0) out = 0;
    if (over || is_inf) {
        if (saturate) out = ((sign << 7) | (uint32_t)max_mag) & 0xFF;
        else if (fnuz) out = 0x80;
        else out = ((sign << 7) | (has_inf ? 0x7Cu : 0x7Fu)) & 0xFF;
    }
    if (is_nan) out = fnuz ? 0x80 : (((sign << 7) | 0x7Fu) & 0xFF);
    return out;
}

// v_cvt_pk_{fp8,bf8}_f32: two sources -> two bytes, in the low word or (word_hi) the high one.
EXPORT int pa_cvt_pk_8(uint32_t *v, const uint32_t *s, int dst, int64_t c0, int64_t c1, int word_hi, int fmt) {
    uint32_t a[LANES], b[LANES], r[LANES];
    const uint32_t *old = v + (size_t)dst * LANES;
    read_src(v, s, c0, a);
    read_src(v, s, c1, b);
    for (int l = 0; l < LANES; l++) {
        uint32_t pair = encode8(a[l], fmt) | (encode8(b[l], fmt) << 8);
        r[l] = word_hi ? ((old[l] & 0x0000FFFFu) | (pair << 16)) : ((old[l] & 0xFFFF0000u) | pair);
    }
    write_rows(v, s, dst, r);
    return 0;
}

// ---------------------------------------------------------------- fp8 x fp8 MFMA (numerics.mfma)

// D = A x B + C for one wave, both operands e4m3 (decode table: 256 f32 bit patterns). Every
// product is exact and every partial sum of one output is a multiple of 2^-20 below 2^23, so the
// double sum is exact in any order (the numpy reference's matmul order does not matter; here each
// output's sum runs over k in order, 32 outputs of a row side by side so the compiler can use
// vector instructions); NaN codes give NaN products as in the reference. C is added with
// round-to-odd and the result rounded once to f32. EXEC is ignored (all lanes). Layouts:
// CDNA3/CDNA4 §7.1.4 as numerics._layout builds them.
static inline __attribute__((always_inline)) void mfma_fp8(uint32_t *v, const int M, const int N, const int K,
                                                            int rd, int ra, int rb, int rc, uint32_t cconst,
                                                            const uint32_t *table, int fp16_ovfl) {
    double A[512], B[512];               // A[i][k], B[k][j]
    uint32_t out[16 * LANES];
    int kl = K * M / 64;                 // items per lane (one byte each)
    int c_regs = M * N / 64, m_i = 64 / N;
    const uint8_t *va = (const uint8_t *)(v + (size_t)ra * LANES);
    const uint8_t *vb = (const uint8_t *)(v + (size_t)rb * LANES);
    for (int lane = 0; lane < LANES; lane++) {
        for (int t = 0; t < kl; t++) {
            // item t of a lane: register t/4, byte t%4 (little-endian)
            size_t off = ((size_t)(t / 4) * LANES + lane) * 4 + (t % 4);
            int ai = lane % M, ak = (lane / M) * kl + t;
            int bj = lane % N, bk = (lane / N) * kl + t;
            A[ai * K + ak] = (double)asf(table[va[off]]);
            B[bk * N + bj] = (double)asf(table[vb[off]]);
        }
    }
    for (int i = 0; i < M; i++) {
        int reg = i % 4 + 4 * (i / (4 * m_i));
        double acc[32];
        for (int j = 0; j < N; j++) acc[j] = 0.0;
        for (int k = 0; k < K; k++) {
            double a = A[i * K + k];
            const double *brow = B + k * N;
            for (int j = 0; j < N; j++) acc[j] += a * brow[j];
        }
        for (int j = 0; j < N; j++) {
            int lane = j + N * ((i / 4) % m_i);
            uint32_t cb = rc >= 0 ? v[(size_t)(rc + reg) * LANES + lane] : cconst;
            double d64 = add_round_to_odd(acc[j], (double)asf(cb));
            float d32 = (float)d64;
            if (fp16_ovfl && isfinite(d64) && isinf(d32)) d32 = d64 < 0 ? -3.4028234663852886e38f : 3.4028234663852886e38f;
            out[reg * LANES + lane] = isnan(d32) ? 0x7FC00000u : asu(d32);
        }
    }
    memcpy(v + (size_t)rd * LANES, out, sizeof(uint32_t) * (size_t)c_regs * LANES);
}

// The two fp8 shapes, with constant sizes (so the loops above vectorize). On x86-64 an AVX2 clone
// is picked at load time where the CPU has it: wider vectors, the same IEEE double operations
// (no contraction into fused multiply-adds: -ffp-contract=off), so the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
EXPORT int pa_mfma_fp8(uint32_t *v, int M, int N, int K, int rd, int ra, int rb, int rc, uint32_t cconst,
                       const uint32_t *table, int fp16_ovfl) {
    if (M == 16 && N == 16 && K == 32) mfma_fp8(v, 16, 16, 32, rd, ra, rb, rc, cconst, table, fp16_ovfl);
    else if (M == 32 && N == 32 && K == 16) mfma_fp8(v, 32, 32, 16, rd, ra, rb, rc, cconst, table, fp16_ovfl);
    else return -1;
    return 0;
}

// ---------------------------------------------------------------- MUBUF dword loads (memory.buffer_load)

// The addressing pa_buffer_load and pa_buffer_store share: each active lane's byte address into
// addr and the EXEC mask into *exec; returns the region's index, or -2 / -1 as they do.
static int buffer_addresses(const uint32_t *v, const uint32_t *s, int nregs, int vrow, uint32_t inst,
                            int64_t soff_code, int ri, const uint64_t *bases, const uint64_t *ends, int nspans,
                            uint64_t *exec, uint64_t addr[LANES]) {
    uint64_t em = exec_mask(s);
    if (!em) return -2;
    uint32_t w0 = s[ri], w1 = s[ri + 1], w2 = s[ri + 2], w3 = s[ri + 3];
    if ((w1 >> 31) & 1) return -1;                 // swizzled addressing
    if ((w3 >> 23) & 1) return -1;                 // add_tid
    uint64_t base = (uint64_t)w0 | ((uint64_t)(w1 & 0xFFFF) << 32), num_records = w2;
    uint64_t soff = ((soff_code & 3) == 1) ? s[(soff_code >> 8) & 0xFFFF] : (uint32_t)((uint64_t)soff_code >> 32);
    uint64_t nbytes = (uint64_t)nregs * 4;
    int region = -1;
    for (int i = 0; i < nspans; i++)
        if (bases[i] <= base && base < ends[i]) { region = i; break; }
    if (region < 0) return -1;
    uint64_t rb = bases[region], re = ends[region];
    for (int l = 0; l < LANES; l++) {
        if (!((em >> l) & 1)) continue;
        uint64_t off = (uint64_t)(vrow >= 0 ? v[(size_t)vrow * LANES + l] : 0) + inst;
        if (off > 0xFFFFFFFFull || off + soff + nbytes > num_records) return -1;
        uint64_t a = base + soff + off;
        if (a < rb || a + nbytes > re) return -1;
        addr[l] = a;
    }
    *exec = em;
    return region;
}

// buffer_load_dword{,x2,x3,x4} with offen or no address VGPR, no idxen, nothing traced: the
// common case of memory.buffer_load, where every active lane's whole access is in the V#'s range
// and inside the allowed region its base points into (bases/ends: GlobalMemory's sorted region
// spans, whose addresses are this process's own memory). Returns that region's index after
// loading, -2 when no lane is active (nothing happens), -1 when any of that does not hold: the
// caller then runs the reference handler, which has seen no change.
EXPORT int pa_buffer_load(uint32_t *v, const uint32_t *s, int dst, int nregs, int vrow, uint32_t inst,
                          int64_t soff_code, int ri, const uint64_t *bases, const uint64_t *ends, int nspans) {
    uint64_t em, addr[LANES], nbytes = (uint64_t)nregs * 4;
    int region = buffer_addresses(v, s, nregs, vrow, inst, soff_code, ri, bases, ends, nspans, &em, addr);
    if (region < 0) return region;
    for (int l = 0; l < LANES; l++) {
        if (!((em >> l) & 1)) continue;
        uint32_t words[4];
        memcpy(words, (const void *)(uintptr_t)addr[l], (size_t)nbytes);
        for (int k = 0; k < nregs; k++) v[(size_t)(dst + k) * LANES + l] = words[k];
    }
    return region;
}

// buffer_store_dword{,x2,x3,x4}: as pa_buffer_load, the other way (memory.buffer_store); lanes
// storing to the same bytes: the highest lane wins, as numpy's assignment in lane order.
EXPORT int pa_buffer_store(const uint32_t *v, const uint32_t *s, int src, int nregs, int vrow, uint32_t inst,
                           int64_t soff_code, int ri, const uint64_t *bases, const uint64_t *ends, int nspans) {
    uint64_t em, addr[LANES], nbytes = (uint64_t)nregs * 4;
    int region = buffer_addresses(v, s, nregs, vrow, inst, soff_code, ri, bases, ends, nspans, &em, addr);
    if (region < 0) return region;
    for (int l = 0; l < LANES; l++) {
        if (!((em >> l) & 1)) continue;
        uint32_t words[4];
        for (int k = 0; k < nregs; k++) words[k] = v[(size_t)(src + k) * LANES + l];
        memcpy((void *)(uintptr_t)addr[l], words, (size_t)nbytes);
    }
    return region;
}

// ---------------------------------------------------------------- LDS dword reads/writes (ops_ds, memory.LDS)

// The race checker's per-byte arrays (ops_ds.LdsRaceChecker), in this order.
typedef struct {
    int16_t *w_wave; int32_t *w_epoch; int32_t *w_pc;
    int16_t *r_wave; int32_t *r_epoch; int32_t *r_pc;
    uint8_t *w_val; uint8_t *w_known;
    int16_t *c_wave; int32_t *c_epoch; int32_t *c_pc;
} races_t;

#define RACE_MANY (-2)
#define MAX_BYTES (LANES * 16)

// Byte indices of the active lanes' accesses (lane-major, as ops_ds.LdsRaceChecker.access
// flattens them); -1 when a lane is past the allocation (the reference then faults).
static int lds_bytes(const uint32_t *v, uint64_t em, int arow, uint32_t off, int nbytes, int64_t limit,
                     int64_t *idx, int *lane_of) {
    int n = 0;
    for (int l = 0; l < LANES; l++) {
        if (!((em >> l) & 1)) continue;
        int64_t a = (int64_t)(uint32_t)(v[(size_t)arow * LANES + l] + off);
        if (a + nbytes > limit) return -1;
        for (int j = 0; j < nbytes; j++) { idx[n] = a + j; lane_of[n] = l; n++; }
    }
    return n;
}

// ds_read_b32/b64/b96/b128 in an LDS with oob="raise", untraced. races: NULL when unchecked.
// Returns 0 when done, -1 (nothing changed) for a lane past the allocation or a race to report:
// the reference handler then faults or reports.
EXPORT int pa_ds_read(uint32_t *v, const uint32_t *s, int dst, int nregs, int arow, uint32_t off, uint8_t *lds,
                      int64_t limit, const races_t *races, int wave, int pc, int epoch) {
    uint64_t em = exec_mask(s);
    int nbytes = nregs * 4;
    int64_t idx[MAX_BYTES];
    int lane_of[MAX_BYTES];
    int n = lds_bytes(v, em, arow, off, nbytes, limit, idx, lane_of);
    if (n < 0) return -1;
    if (races) {
        for (int k = 0; k < n; k++) {
            int64_t b = idx[k];
            if (races->c_epoch[b] == epoch && races->c_wave[b] != wave) return -1;   // read-after-write
        }
    }
    uint32_t words[LANES][4];
    for (int k = 0; k < n; k += nbytes) memcpy(words[lane_of[k]], lds + idx[k], (size_t)nbytes);
    if (races) {
        int16_t neww[MAX_BYTES];
        for (int k = 0; k < n; k++) {          // from the state before this access, as numpy does
            int64_t b = idx[k];
            neww[k] = (races->r_epoch[b] == epoch && races->r_wave[b] != wave) ? RACE_MANY : (int16_t)wave;
        }
        for (int k = 0; k < n; k++) {
            int64_t b = idx[k];
            races->r_wave[b] = neww[k];
            races->r_epoch[b] = epoch;
            races->r_pc[b] = pc;
        }
    }
    for (int k = 0; k < n; k += nbytes) {
        int l = lane_of[k];
        for (int r = 0; r < nregs; r++) v[(size_t)(dst + r) * LANES + l] = words[l][r];
    }
    return 0;
}

// ds_write_b32/b64/b96/b128, as pa_ds_read. The race check sees the LDS before the write (equal
// values commute: ops_ds.LdsRaceChecker); the highest lane writing a byte wins.
EXPORT int pa_ds_write(const uint32_t *v, const uint32_t *s, int src, int nregs, int arow, uint32_t off,
                       uint8_t *lds, int64_t limit, const races_t *races, int wave, int pc, int epoch) {
    uint64_t em = exec_mask(s);
    int nbytes = nregs * 4;
    int64_t idx[MAX_BYTES];
    int lane_of[MAX_BYTES];
    uint8_t val[MAX_BYTES];
    int n = lds_bytes(v, em, arow, off, nbytes, limit, idx, lane_of);
    if (n < 0) return -1;
    for (int k = 0; k < n; k++) {
        int j = k % nbytes, l = lane_of[k];
        uint32_t word = v[(size_t)(src + j / 4) * LANES + l];
        val[k] = (uint8_t)(word >> (8 * (j % 4)));
    }
    if (races) {
        uint8_t same_r[MAX_BYTES];
        for (int k = 0; k < n; k++) {
            int64_t b = idx[k];
            int same_w = races->w_known[b] && races->w_val[b] == val[k];
            same_r[k] = lds[b] == val[k];
            if (races->w_epoch[b] == epoch && races->w_wave[b] != wave && !same_w) return -1;   // write-write
        }
        for (int k = 0; k < n; k++) {
            int64_t b = idx[k];
            if (races->r_epoch[b] == epoch && races->r_wave[b] != wave && !same_r[k]) return -1;  // write-after-read
        }
        for (int k = 0; k < n; k++) {
            int64_t b = idx[k];
            races->w_wave[b] = (int16_t)wave;
            races->w_epoch[b] = epoch;
            races->w_pc[b] = pc;
            races->w_val[b] = val[k];
            races->w_known[b] = 1;
        }
        for (int k = 0; k < n; k++) {
            if (same_r[k]) continue;
            int64_t b = idx[k];
            races->c_wave[b] = (int16_t)wave;
            races->c_epoch[b] = epoch;
            races->c_pc[b] = pc;
        }
    }
    for (int k = 0; k < n; k++) lds[idx[k]] = val[k];
    return 0;
}

// ---------------------------------------------------------------- straight-line blocks

// A run of consecutive instructions with no label inside, each one of the operations below,
// executed in one call (ops_fast.block_code builds the runs; each entry mirrors the reference
// handler of its instruction: ops_salu, ops_valu). VALU sources are src codes (header); SALU
// sources are codes in a/b with their constants (up to 64 bits) in d/e.
typedef struct { int32_t op, dst; int64_t a, b, c, d, e; } insn_t;

enum {
    B_NOP = 0,
    // VALU, 32-bit, written under EXEC
    B_V_MOV, B_V_NOT, B_V_ADD, B_V_SUB, B_V_SUBREV, B_V_AND, B_V_OR, B_V_XOR, B_V_LSHLREV, B_V_LSHRREV,
    B_V_ASHRREV, B_V_MAX_I32, B_V_MIN_I32, B_V_MAX_U32, B_V_MIN_U32, B_V_MED3_I32, B_V_MUL_LO, B_V_ADD3,
    B_V_LSHL_ADD, B_V_ADD_LSHL, B_V_LSHL_OR, B_V_AND_OR, B_V_OR3, B_V_BFE_U32, B_V_CNDMASK,
    // VOPC integer compares -> an SGPR pair (inactive lanes 0); c: 0 signed, 1 unsigned
    B_V_CMP_LT, B_V_CMP_EQ, B_V_CMP_LE, B_V_CMP_GT, B_V_CMP_NE, B_V_CMP_GE,
    // SALU
    B_S_MOV32, B_S_MOV64, B_S_ADD_U32, B_S_SUB_U32, B_S_ADD_I32, B_S_SUB_I32, B_S_MUL_I32,
    B_S_AND32, B_S_OR32, B_S_XOR32, B_S_ANDN2_32, B_S_AND64, B_S_OR64, B_S_XOR64, B_S_ANDN2_64,
    B_S_LSHL32, B_S_LSHR32, B_S_ASHR32, B_S_LSHL64, B_S_LSHR64,
    B_S_MIN_I32, B_S_MAX_I32, B_S_MIN_U32, B_S_MAX_U32, B_S_CSELECT32, B_S_CSELECT64,
    B_S_CMP_EQ_I, B_S_CMP_LG_I, B_S_CMP_GT_I, B_S_CMP_GE_I, B_S_CMP_LT_I, B_S_CMP_LE_I,
    B_S_CMP_EQ_U, B_S_CMP_LG_U, B_S_CMP_GT_U, B_S_CMP_GE_U, B_S_CMP_LT_U, B_S_CMP_LE_U,
    // the single-instruction fast paths above
    B_VALU_F32, B_PK_FMA, B_CVT_PK8, B_MFMA_FP8,
    // f32 arithmetic as numpy's float32 ufuncs compute it; a NaN input stops the block (numpy's
    // NaN payload choice is left to the reference handler). d: 0 add, 1 sub, 2 subrev, 3 mul
    B_F_ARITH, B_PK_ARITH, B_CVT_F32_F16,   // cvt: c = the source word's bit offset (SDWA WORD_1: 16)
    // memory: the single-instruction paths above (a refusal stops the block; ops_fast makes
    // each of these the first entry of its block, so its own handler then runs as that
    // instruction), and s_load_dword*
    B_BUF_LOAD, B_DS_READ, B_DS_WRITE, B_S_LOAD,
    // SALU with carry in SCC, the saveexec family (d: which), and a branch ending the block (a:
    // 0 always, 1 scc0, 2 scc1, 3 vccz, 4 vccnz, 5 execz, 6 execnz)
    B_S_ADDC_U32, B_S_SUBB_U32, B_S_SAVEEXEC, B_BRANCH,
    // lane permutes through the LDS crossbar (ops_ds): a source lane off in EXEC gives 0.
    // bpermute: a = address row, b = data row, c = offset; swizzle: b = data row, e = the 64
    // source lanes (uint8)
    B_DS_BPERMUTE, B_DS_SWIZZLE,
    B_BUF_STORE,      // as B_BUF_LOAD (a memory entry)
};

#define BRANCH_TAKEN 0xFFFFF   // returned as (BRANCH_TAKEN << 1) | SCC

// What memory entries need (ops_fast fills it per call): 0 bases, 1 ends, 2 span count, 3 global
// memory usable (a plain GlobalMemory without over-read slack), 4 region of the last buffer load
// (out; -1: none), 5 LDS bytes (0: refuse LDS entries), 6 LDS limit, 7 race checker arrays (0:
// none), 8 wave id, 9 barrier epoch.
enum { CX_BASES, CX_ENDS, CX_NSPANS, CX_MEM_OK, CX_LAST, CX_LDS, CX_LIMIT, CX_RACES, CX_WAVE, CX_EPOCH };

// s_load_dword{,x2,x4,x8,x16}: n dwords from (base + offset) & ~3, which must lie in one region
// (memory.GlobalMemory.load_scalar); else refused (the reference faults).
static int s_load(uint32_t *s, int dst, int n, uint64_t addr, const int64_t *ctx) {
    const uint64_t *bases = (const uint64_t *)(uintptr_t)ctx[CX_BASES], *ends = (const uint64_t *)(uintptr_t)ctx[CX_ENDS];
    uint64_t a = addr & ~3ull, nbytes = 4ull * (uint64_t)n;
    for (int i = 0; i < (int)ctx[CX_NSPANS]; i++) {
        if (bases[i] <= a && a + nbytes <= ends[i]) {
            memcpy(s + dst, (const void *)(uintptr_t)a, (size_t)nbytes);
            return 0;
        }
    }
    return -1;
}

static inline float arith(int kind, float x, float y) {
    switch (kind) {
    case 0: return x + y;
    case 1: return x - y;
    case 2: return y - x;
    default: return x * y;
    }
}

static inline uint64_t sread(const uint32_t *s, int64_t code, int64_t cst, int bits) {
    if ((code & 3) != 1) return bits == 64 ? (uint64_t)cst : ((uint64_t)cst & 0xFFFFFFFFull);
    int i = (int)((code >> 8) & 0xFFFF);
    return bits == 64 ? ((uint64_t)s[i] | ((uint64_t)s[i + 1] << 32)) : s[i];
}

static inline void swrite(uint32_t *s, int dst, uint64_t x, int bits) {
    s[dst] = (uint32_t)x;
    if (bits == 64) s[dst + 1] = (uint32_t)(x >> 32);
}

static inline int64_t sx32(uint64_t x) { return (int64_t)(int32_t)(uint32_t)x; }

// Returns SCC (bit 0) | (k + 1) << 1 when entry k must run in Python instead (a NaN input to f32
// arithmetic; entries before it are done, it and those after are not), or -(k + 1) if entry k has
// an unknown operation.
EXPORT int pa_run_block(uint32_t *v, uint32_t *s, const insn_t *code, int n, int scc, int64_t *ctx) {
    uint32_t a[LANES], b[LANES], c[LANES], r[LANES];
    for (int k = 0; k < n; k++) {
        const insn_t *p = &code[k];
        int op = p->op;
        if (op == B_NOP) continue;
        if (op >= B_V_MOV && op <= B_V_CNDMASK) {
            read_src(v, s, p->a, a);
            if (op >= B_V_ADD) read_src(v, s, p->b, b);
            if (op >= B_V_MED3_I32 && op != B_V_MUL_LO && op != B_V_CNDMASK) read_src(v, s, p->c, c);
            uint64_t m = 0;
            if (op == B_V_CNDMASK) m = (uint64_t)s[p->c] | ((uint64_t)s[p->c + 1] << 32);
            for (int l = 0; l < LANES; l++) {
                uint32_t x = a[l], y = b[l], z = c[l];
                int32_t xi = (int32_t)x, yi = (int32_t)y, zi = (int32_t)z;
                switch (op) {
                case B_V_MOV: r[l] = x; break;
                case B_V_NOT: r[l] = ~x; break;
                case B_V_ADD: r[l] = x + y; break;
                case B_V_SUB: r[l] = x - y; break;
                case B_V_SUBREV: r[l] = y - x; break;
                case B_V_AND: r[l] = x & y; break;
                case B_V_OR: r[l] = x | y; break;
                case B_V_XOR: r[l] = x ^ y; break;
                case B_V_LSHLREV: r[l] = y << (x & 31); break;
                case B_V_LSHRREV: r[l] = y >> (x & 31); break;
                case B_V_ASHRREV: r[l] = (uint32_t)(yi >> (x & 31)); break;
                case B_V_MAX_I32: r[l] = (uint32_t)(xi > yi ? xi : yi); break;
                case B_V_MIN_I32: r[l] = (uint32_t)(xi < yi ? xi : yi); break;
                case B_V_MAX_U32: r[l] = x > y ? x : y; break;
                case B_V_MIN_U32: r[l] = x < y ? x : y; break;
                case B_V_MED3_I32: {
                    int32_t lo = xi < yi ? xi : yi, hi = xi > yi ? xi : yi;
                    int32_t t = hi < zi ? hi : zi;
                    r[l] = (uint32_t)(lo > t ? lo : t);
                    break;
                }
                case B_V_MUL_LO: r[l] = x * y; break;
                case B_V_ADD3: r[l] = x + y + z; break;
                case B_V_LSHL_ADD: r[l] = (x << (y & 31)) + z; break;
                case B_V_ADD_LSHL: r[l] = (x + y) << (z & 31); break;
                case B_V_LSHL_OR: r[l] = (x << (y & 31)) | z; break;
                case B_V_AND_OR: r[l] = (x & y) | z; break;
                case B_V_OR3: r[l] = x | y | z; break;
                case B_V_BFE_U32: r[l] = (uint32_t)(((uint64_t)x >> (y & 31)) & ((1ull << (z & 31)) - 1)); break;
                case B_V_CNDMASK: r[l] = ((m >> l) & 1) ? y : x; break;
                }
            }
            write_rows(v, s, p->dst, r);
            continue;
        }
        if (op >= B_V_CMP_LT && op <= B_V_CMP_GE) {
            read_src(v, s, p->a, a);
            read_src(v, s, p->b, b);
            uint64_t em = exec_mask(s), bits = 0;
            for (int l = 0; l < LANES; l++) {
                int t;
                if (p->c) {
                    uint32_t x = a[l], y = b[l];
                    t = op == B_V_CMP_LT ? x < y : op == B_V_CMP_EQ ? x == y : op == B_V_CMP_LE ? x <= y
                      : op == B_V_CMP_GT ? x > y : op == B_V_CMP_NE ? x != y : x >= y;
                } else {
                    int32_t x = (int32_t)a[l], y = (int32_t)b[l];
                    t = op == B_V_CMP_LT ? x < y : op == B_V_CMP_EQ ? x == y : op == B_V_CMP_LE ? x <= y
                      : op == B_V_CMP_GT ? x > y : op == B_V_CMP_NE ? x != y : x >= y;
                }
                if (t) bits |= 1ull << l;
            }
            swrite(s, p->dst, bits & em, 64);
            continue;
        }
        if (op >= B_S_MOV32 && op <= B_S_CMP_LE_U) {
            int w64 = op == B_S_MOV64 || (op >= B_S_AND64 && op <= B_S_ANDN2_64) || op == B_S_CSELECT64;
            int a64 = w64 || op == B_S_LSHL64 || op == B_S_LSHR64;
            uint64_t x = sread(s, p->a, p->d, a64 ? 64 : 32), y = sread(s, p->b, p->e, w64 ? 64 : 32);
            uint64_t res = 0;
            int wr = 1, bits = w64 || op == B_S_LSHL64 || op == B_S_LSHR64 ? 64 : 32;
            uint64_t mask = bits == 64 ? ~0ull : 0xFFFFFFFFull;
            switch (op) {
            case B_S_MOV32: case B_S_MOV64: res = x; break;
            case B_S_ADD_U32: res = (x + y) & mask; scc = x + y > 0xFFFFFFFFull; break;
            case B_S_SUB_U32: res = (x - y) & mask; scc = y > x; break;
            case B_S_ADD_I32: { int64_t t = sx32(x) + sx32(y); res = (uint64_t)t & mask;
                                scc = !(t >= -2147483648LL && t < 2147483648LL); break; }
            case B_S_SUB_I32: { int64_t t = sx32(x) - sx32(y); res = (uint64_t)t & mask;
                                scc = !(t >= -2147483648LL && t < 2147483648LL); break; }
            case B_S_MUL_I32: res = (x * y) & mask; break;
            case B_S_AND32: case B_S_AND64: res = (x & y) & mask; scc = res != 0; break;
            case B_S_OR32: case B_S_OR64: res = (x | y) & mask; scc = res != 0; break;
            case B_S_XOR32: case B_S_XOR64: res = (x ^ y) & mask; scc = res != 0; break;
            case B_S_ANDN2_32: case B_S_ANDN2_64: res = (x & ~y) & mask; scc = res != 0; break;
            case B_S_LSHL32: res = (x << (y & 31)) & mask; scc = res != 0; break;
            case B_S_LSHR32: res = x >> (y & 31); scc = res != 0; break;
            case B_S_ASHR32: res = (uint64_t)(sx32(x) >> (y & 31)) & mask; scc = res != 0; break;
            case B_S_LSHL64: res = x << (y & 63); scc = res != 0; break;
            case B_S_LSHR64: res = x >> (y & 63); scc = res != 0; break;
            case B_S_MIN_I32: { int f = sx32(x) < sx32(y); res = f ? x : y; scc = f; break; }
            case B_S_MAX_I32: { int f = sx32(x) > sx32(y); res = f ? x : y; scc = f; break; }
            case B_S_MIN_U32: { int f = x < y; res = f ? x : y; scc = f; break; }
            case B_S_MAX_U32: { int f = x > y; res = f ? x : y; scc = f; break; }
            case B_S_CSELECT32: case B_S_CSELECT64: res = scc ? x : y; break;
            default: {
                wr = 0;
                int sg = op <= B_S_CMP_LE_I;
                int kind = sg ? op - B_S_CMP_EQ_I : op - B_S_CMP_EQ_U;   // eq lg gt ge lt le
                if (sg) {
                    int64_t xi = sx32(x), yi = sx32(y);
                    scc = kind == 0 ? xi == yi : kind == 1 ? xi != yi : kind == 2 ? xi > yi
                        : kind == 3 ? xi >= yi : kind == 4 ? xi < yi : xi <= yi;
                } else {
                    scc = kind == 0 ? x == y : kind == 1 ? x != y : kind == 2 ? x > y
                        : kind == 3 ? x >= y : kind == 4 ? x < y : x <= y;
                }
            }
            }
            if (wr) swrite(s, p->dst, res, bits);
            continue;
        }
        if (op == B_F_ARITH || op == B_CVT_F32_F16) {
            read_src(v, s, p->a, a);
            if (op == B_F_ARITH) read_src(v, s, p->b, b);
            for (int l = 0; l < LANES; l++) {
                if (op == B_F_ARITH) {
                    if (is_nan_bits(a[l]) || is_nan_bits(b[l])) return (scc ? 1 : 0) | ((k + 1) << 1);
                    r[l] = asu(arith((int)p->d, asf(a[l]), asf(b[l])));
                } else {
                    uint32_t h = (a[l] >> (p->c & 31)) & 0xFFFF, sign = (h >> 15) << 31, e = (h >> 10) & 0x1F, m = h & 0x3FF;
                    if (e == 31 && m) return (scc ? 1 : 0) | ((k + 1) << 1);
                    if (e == 31) r[l] = sign | 0x7F800000u;
                    else if (e == 0) r[l] = sign | asu((float)m * 0x1p-24f);
                    else r[l] = sign | ((e - 15 + 127) << 23) | (m << 13);
                }
            }
            write_rows(v, s, p->dst, r);
            continue;
        }
        if (op == B_PK_ARITH) {
            int64_t codes[2] = {p->a, p->b};
            int sel = (int)p->c, kind = (int)p->d;
            uint32_t src[2][2][LANES], lo[LANES], hi[LANES];
            for (int i = 0; i < 2; i++) {
                read_src(v, s, codes[i], src[i][0]);
                if ((codes[i] & 3) == 2) memcpy(src[i][1], src[i][0], sizeof src[i][0]);
                else read_src(v, s, codes[i] + (1 << 8), src[i][1]);
            }
            for (int l = 0; l < LANES; l++) {
                uint32_t x[2], y[2];
                for (int i = 0; i < 2; i++) {
                    x[i] = src[i][(sel >> i) & 1][l] ^ (((sel >> (8 + i)) & 1) ? 0x80000000u : 0);
                    y[i] = src[i][(sel >> (4 + i)) & 1][l] ^ (((sel >> (12 + i)) & 1) ? 0x80000000u : 0);
                    if (is_nan_bits(x[i]) || is_nan_bits(y[i])) return (scc ? 1 : 0) | ((k + 1) << 1);
                }
                lo[l] = asu(arith(kind, asf(x[0]), asf(x[1])));
                hi[l] = asu(arith(kind, asf(y[0]), asf(y[1])));
            }
            write_rows(v, s, p->dst, lo);
            write_rows(v, s, p->dst + 1, hi);
            continue;
        }
        if ((op >= B_BUF_LOAD && op <= B_S_LOAD) || op == B_BUF_STORE) {
            int done = -1;
            if (op == B_BUF_STORE) {
                done = -1;
                if (ctx[CX_MEM_OK]) {
                    done = pa_buffer_store(v, s, p->dst, (int)p->e, (int)p->a, (uint32_t)p->d, p->b, (int)p->c,
                                           (const uint64_t *)(uintptr_t)ctx[CX_BASES],
                                           (const uint64_t *)(uintptr_t)ctx[CX_ENDS], (int)ctx[CX_NSPANS]);
                    if (done >= 0) ctx[CX_LAST] = done;
                    done = done == -1 ? -1 : 0;
                }
                if (done != 0) return (scc ? 1 : 0) | ((k + 1) << 1);
                continue;
            }
            if (op == B_BUF_LOAD && ctx[CX_MEM_OK]) {
                done = pa_buffer_load(v, s, p->dst, (int)p->e, (int)p->a, (uint32_t)p->d, p->b, (int)p->c,
                                      (const uint64_t *)(uintptr_t)ctx[CX_BASES], (const uint64_t *)(uintptr_t)ctx[CX_ENDS],
                                      (int)ctx[CX_NSPANS]);
                if (done >= 0) ctx[CX_LAST] = done;
                done = done == -1 ? -1 : 0;
            } else if ((op == B_DS_READ || op == B_DS_WRITE) && ctx[CX_LDS]) {
                const races_t *rp = (const races_t *)(uintptr_t)ctx[CX_RACES];
                uint8_t *lds = (uint8_t *)(uintptr_t)ctx[CX_LDS];
                if (op == B_DS_READ)
                    done = pa_ds_read(v, s, p->dst, (int)p->c, (int)p->a, (uint32_t)p->b, lds, ctx[CX_LIMIT], rp,
                                      (int)ctx[CX_WAVE], (int)p->d, (int)ctx[CX_EPOCH]);
                else
                    done = pa_ds_write(v, s, p->dst, (int)p->c, (int)p->a, (uint32_t)p->b, lds, ctx[CX_LIMIT], rp,
                                       (int)ctx[CX_WAVE], (int)p->d, (int)ctx[CX_EPOCH]);
            } else if (op == B_S_LOAD) {
                int i = (int)p->a;
                uint64_t base = (uint64_t)s[i] | ((uint64_t)s[i + 1] << 32);
                uint64_t off = ((p->b & 3) == 1) ? (uint64_t)s[(p->b >> 8) & 0xFFFF] + (uint64_t)p->d : (uint64_t)p->d;
                done = s_load(s, p->dst, (int)p->c, base + off, ctx);
            }
            if (done != 0) return (scc ? 1 : 0) | ((k + 1) << 1);
            continue;
        }
        if (op == B_S_ADDC_U32 || op == B_S_SUBB_U32) {
            uint64_t x = sread(s, p->a, p->d, 32), y = sread(s, p->b, p->e, 32), c0 = scc ? 1 : 0;
            if (op == B_S_ADDC_U32) { swrite(s, p->dst, (x + y + c0) & 0xFFFFFFFFull, 32); scc = x + y + c0 > 0xFFFFFFFFull; }
            else { swrite(s, p->dst, (x - y - c0) & 0xFFFFFFFFull, 32); scc = y + c0 > x; }
            continue;
        }
        if (op == B_S_SAVEEXEC) {
            uint64_t x = sread(s, p->a, p->e, 64), e = exec_mask(s), nw;
            swrite(s, p->dst, e, 64);
            switch ((int)p->d) {
            case 0: nw = x & e; break;
            case 1: nw = x | e; break;
            case 2: nw = x ^ e; break;
            case 3: nw = x & ~e; break;
            case 4: nw = x | ~e; break;
            case 5: nw = ~(x & e); break;
            case 6: nw = ~(x | e); break;
            case 7: nw = ~(x ^ e); break;
            case 8: nw = ~x & e; break;
            default: nw = ~x | e; break;
            }
            s[SGPR_EXEC] = (uint32_t)nw;
            s[SGPR_EXEC + 1] = (uint32_t)(nw >> 32);
            scc = nw != 0;
            continue;
        }
        if (op == B_DS_BPERMUTE || op == B_DS_SWIZZLE) {
            uint64_t em = exec_mask(s);
            const uint32_t *data = v + (size_t)p->b * LANES;
            const uint8_t *pattern = (const uint8_t *)(uintptr_t)p->e;
            for (int l = 0; l < LANES; l++) {
                int src = op == B_DS_SWIZZLE ? pattern[l]
                                             : (int)(((v[(size_t)p->a * LANES + l] + (uint32_t)p->c) >> 2) & 63);
                r[l] = ((em >> src) & 1) ? data[src] : 0;
            }
            write_rows(v, s, p->dst, r);
            continue;
        }
        if (op == B_BRANCH) {
            int taken;
            switch ((int)p->a) {
            case 0: taken = 1; break;
            case 1: taken = !scc; break;
            case 2: taken = scc != 0; break;
            case 3: taken = !(s[106] | s[107]); break;
            case 4: taken = (s[106] | s[107]) != 0; break;
            case 5: taken = !(s[SGPR_EXEC] | s[SGPR_EXEC + 1]); break;
            default: taken = (s[SGPR_EXEC] | s[SGPR_EXEC + 1]) != 0; break;
            }
            if (taken) return (scc ? 1 : 0) | (BRANCH_TAKEN << 1);
            continue;
        }
        int rc = 0;
        switch (op) {
        case B_VALU_F32: rc = pa_valu_f32((int)p->d, v, s, p->dst, p->a, p->b, p->c); break;
        case B_PK_FMA: rc = pa_pk_fma_f32(v, s, p->dst, p->a, p->b, p->c, (int)p->d); break;
        case B_CVT_PK8: rc = pa_cvt_pk_8(v, s, p->dst, p->a, p->b, (int)p->c, (int)p->d); break;
        case B_MFMA_FP8:
            rc = pa_mfma_fp8(v, (int)((p->d >> 40) & 0xFF), (int)((p->d >> 40) & 0xFF), (int)((p->d >> 48) & 0xFF),
                             p->dst, (int)p->a, (int)p->b, (int)p->c, (uint32_t)p->d, (const uint32_t *)(uintptr_t)p->e,
                             (int)((p->d >> 32) & 1));
            break;
        default: rc = -1;
        }
        if (rc != 0) return -(k + 1);
    }
    return scc ? 1 : 0;
}

// ---------------------------------------------------------------- v_exp_f32 around numpy's exp2

// numerics.exp2_f32 is numpy's float64 exp2 rounded to f32 with the ISA's special cases; the
// exp2 itself stays numpy's (ops_fast calls it between these two). Prep: the 64 lanes of a VGPR
// source as doubles, or -1 if any is a NaN or a denormal (the reference's own path handles
// those). Finish: round to f32, flush results below the f32 normal range to +0 (exp2 is
// positive), write under EXEC.
EXPORT int pa_exp_prep(const uint32_t *v, const uint32_t *s, int64_t code, double *x64) {
    uint32_t a[LANES];
    read_src(v, s, code, a);
    for (int l = 0; l < LANES; l++) {
        uint32_t m = a[l] & 0x7FFFFFFFu;
        if (m > 0x7F800000u || (m != 0 && m < 0x00800000u)) return -1;
        x64[l] = (double)asf(a[l]);
    }
    return 0;
}

EXPORT int pa_exp_finish(uint32_t *v, const uint32_t *s, int dst, const double *r64) {
    uint32_t r[LANES];
    for (int l = 0; l < LANES; l++) {
        uint32_t b = asu((float)r64[l]);
        if (is_nan_bits(b)) return -1;
        r[l] = (b & 0x7FFFFFFFu) < 0x00800000u ? (b & 0x80000000u) : b;
    }
    write_rows(v, s, dst, r);
    return 0;
}
