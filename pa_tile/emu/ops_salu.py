"""Scalar ALU (SOP1/SOP2/SOPC/SOPK) and program control (SOPP).

Values are Python ints holding unsigned register contents; helpers reinterpret signedness.
SCC rules follow the CDNA3 ISA (section 4, "Scalar ALU Operations"): logical ops and shifts set
SCC = (result != 0); unsigned add/sub set the carry/borrow; signed add/sub set the signed
overflow; compares set the comparison result.
"""

from __future__ import annotations

from .ops_base import BARRIER, END, M32, M64, op

_MASK = {32: M32, 64: M64}


def _sx(x: int, bits: int) -> int:
    """Unsigned -> signed."""
    return x - (1 << bits) if x >> (bits - 1) & 1 else x


# --------------------------------------------------------------------------- SOP2

def _binop(ctx, fn, bits_d, bits_a=None, bits_b=None):
    """D = fn(w, a, b) -> (value, scc-or-None)."""
    ctx.need(3)
    bits_a = bits_a or bits_d
    bits_b = bits_b or bits_a
    ra = ctx.sread(ctx.ops[1], bits_a)
    rb = ctx.sread(ctx.ops[2], bits_b)
    wr = ctx.swrite(ctx.ops[0], bits_d)

    def h(w):
        v, scc = fn(w, ra(w), rb(w))
        wr(w, v)
        if scc is not None:
            w.scc = scc
    return h


def _logic(fn, bits):
    m = _MASK[bits]

    def f(w, a, b):
        r = fn(a, b) & m
        return r, int(r != 0)
    return f


_LOGIC = {
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "andn2": lambda a, b: a & ~b,
    "orn2": lambda a, b: a | ~b,
    "nand": lambda a, b: ~(a & b),
    "nor": lambda a, b: ~(a | b),
    "xnor": lambda a, b: ~(a ^ b),
}
for _name, _fn in _LOGIC.items():
    for _bits in (32, 64):
        op(f"s_{_name}_b{_bits}")(
            (lambda fn, bits: lambda ctx: _binop(ctx, _logic(fn, bits), bits))(_fn, _bits)
        )


def _shift(kind, bits):
    m = _MASK[bits]
    sh = bits - 1

    def f(w, a, b):
        n = b & sh
        if kind == "lshl":
            r = (a << n) & m
        elif kind == "lshr":
            r = a >> n
        else:
            r = (_sx(a, bits) >> n) & m
        return r, int(r != 0)
    return f


for _k in ("lshl", "lshr", "ashr"):
    op(f"s_{_k}_b32" if _k != "ashr" else "s_ashr_i32")((lambda k: lambda ctx: _binop(ctx, _shift(k, 32), 32))(_k))
    op(f"s_{_k}_b64" if _k != "ashr" else "s_ashr_i64")(
        (lambda k: lambda ctx: _binop(ctx, _shift(k, 64), 64, 64, 32))(_k)
    )


@op("s_add_u32")
def _s_add_u32(ctx):
    return _binop(ctx, lambda w, a, b: ((a + b) & M32, int(a + b > M32)), 32)


@op("s_sub_u32")
def _s_sub_u32(ctx):
    return _binop(ctx, lambda w, a, b: ((a - b) & M32, int(b > a)), 32)


@op("s_addc_u32")
def _s_addc_u32(ctx):
    return _binop(ctx, lambda w, a, b: ((a + b + w.scc) & M32, int(a + b + w.scc > M32)), 32)


@op("s_subb_u32")
def _s_subb_u32(ctx):
    return _binop(ctx, lambda w, a, b: ((a - b - w.scc) & M32, int(b + w.scc > a)), 32)


def _ovf_add(a, b):
    r = _sx(a, 32) + _sx(b, 32)
    return r & M32, int(not -(1 << 31) <= r < (1 << 31))


def _ovf_sub(a, b):
    r = _sx(a, 32) - _sx(b, 32)
    return r & M32, int(not -(1 << 31) <= r < (1 << 31))


@op("s_add_i32")
def _s_add_i32(ctx):
    return _binop(ctx, lambda w, a, b: _ovf_add(a, b), 32)


@op("s_sub_i32")
def _s_sub_i32(ctx):
    return _binop(ctx, lambda w, a, b: _ovf_sub(a, b), 32)


@op("s_mul_i32")
def _s_mul_i32(ctx):
    return _binop(ctx, lambda w, a, b: ((a * b) & M32, None), 32)


@op("s_mul_hi_u32")
def _s_mul_hi_u32(ctx):
    return _binop(ctx, lambda w, a, b: (((a * b) >> 32) & M32, None), 32)


@op("s_mul_hi_i32")
def _s_mul_hi_i32(ctx):
    return _binop(ctx, lambda w, a, b: (((_sx(a, 32) * _sx(b, 32)) >> 32) & M32, None), 32)


def _minmax(signed, want_min):
    def f(w, a, b):
        x, y = (_sx(a, 32), _sx(b, 32)) if signed else (a, b)
        first = x < y if want_min else x > y
        return (a if first else b), int(first)
    return f


for _s, _signed in (("i32", True), ("u32", False)):
    op(f"s_min_{_s}")((lambda sg: lambda ctx: _binop(ctx, _minmax(sg, True), 32))(_signed))
    op(f"s_max_{_s}")((lambda sg: lambda ctx: _binop(ctx, _minmax(sg, False), 32))(_signed))


@op("s_cselect_b32")
def _s_cselect_b32(ctx):
    return _binop(ctx, lambda w, a, b: (a if w.scc else b, None), 32)


@op("s_cselect_b64")
def _s_cselect_b64(ctx):
    return _binop(ctx, lambda w, a, b: (a if w.scc else b, None), 64)


def _bfe(bits, signed):
    m = _MASK[bits]

    def f(w, a, b):
        off = b & (bits - 1)
        width = (b >> 16) & 0x7F
        if width == 0:
            return 0, 0
        r = (a >> off) & ((1 << width) - 1)
        if signed and width < bits and (r >> (width - 1)) & 1:
            r -= 1 << width
        r &= m
        return r, int(r != 0)
    return f


op("s_bfe_u32")(lambda ctx: _binop(ctx, _bfe(32, False), 32))
op("s_bfe_i32")(lambda ctx: _binop(ctx, _bfe(32, True), 32))
op("s_bfe_u64")(lambda ctx: _binop(ctx, _bfe(64, False), 64, 64, 32))
op("s_bfe_i64")(lambda ctx: _binop(ctx, _bfe(64, True), 64, 64, 32))


@op("s_bfm_b32")
def _s_bfm_b32(ctx):
    return _binop(ctx, lambda w, a, b: ((((1 << (a & 31)) - 1) << (b & 31)) & M32, None), 32)


@op("s_bfm_b64")
def _s_bfm_b64(ctx):
    return _binop(ctx, lambda w, a, b: ((((1 << (a & 63)) - 1) << (b & 63)) & M64, None), 64, 32)


def _lshl_add(n):
    def f(w, a, b):
        r = (a << n) + b
        return r & M32, int(r > M32)
    return f


for _n in (1, 2, 3, 4):
    op(f"s_lshl{_n}_add_u32")((lambda n: lambda ctx: _binop(ctx, _lshl_add(n), 32))(_n))


@op("s_absdiff_i32")
def _s_absdiff_i32(ctx):
    def f(w, a, b):
        r = abs(_sx(a, 32) - _sx(b, 32)) & M32
        return r, int(r != 0)
    return _binop(ctx, f, 32)


@op("s_pack_ll_b32_b16")
def _s_pack_ll(ctx):
    return _binop(ctx, lambda w, a, b: ((a & 0xFFFF) | ((b & 0xFFFF) << 16), None), 32)


@op("s_pack_lh_b32_b16")
def _s_pack_lh(ctx):
    return _binop(ctx, lambda w, a, b: ((a & 0xFFFF) | (b & 0xFFFF0000), None), 32)


@op("s_pack_hh_b32_b16")
def _s_pack_hh(ctx):
    return _binop(ctx, lambda w, a, b: ((a >> 16) | (b & 0xFFFF0000), None), 32)


# --------------------------------------------------------------------------- SOP1

def _unop(ctx, fn, bits_d, bits_s=None):
    ctx.need(2)
    rs = ctx.sread(ctx.ops[1], bits_s or bits_d)
    wr = ctx.swrite(ctx.ops[0], bits_d)

    def h(w):
        v, scc = fn(w, rs(w))
        wr(w, v)
        if scc is not None:
            w.scc = scc
    return h


op("s_mov_b32")(lambda ctx: _unop(ctx, lambda w, a: (a, None), 32))
op("s_mov_b64")(lambda ctx: _unop(ctx, lambda w, a: (a, None), 64))


@op("s_cmov_b32", "s_cmov_b64")
def _s_cmov(ctx):
    bits = 64 if ctx.base.endswith("64") else 32
    ctx.need(2)
    rs = ctx.sread(ctx.ops[1], bits)
    wr = ctx.swrite(ctx.ops[0], bits)

    def h(w):
        if w.scc:
            wr(w, rs(w))
    return h


op("s_not_b32")(lambda ctx: _unop(ctx, lambda w, a: ((~a) & M32, int((~a) & M32 != 0)), 32))
op("s_not_b64")(lambda ctx: _unop(ctx, lambda w, a: ((~a) & M64, int((~a) & M64 != 0)), 64))
op("s_brev_b32")(lambda ctx: _unop(ctx, lambda w, a: (int(f"{a:032b}"[::-1], 2), None), 32))
op("s_bcnt1_i32_b32")(lambda ctx: _unop(ctx, lambda w, a: (bin(a).count("1"), int(a != 0)), 32))
op("s_bcnt1_i32_b64")(lambda ctx: _unop(ctx, lambda w, a: (bin(a).count("1"), int(a != 0)), 32, 64))
op("s_bcnt0_i32_b32")(lambda ctx: _unop(ctx, lambda w, a: (32 - bin(a).count("1"), int(a != M32)), 32))
op("s_bcnt0_i32_b64")(lambda ctx: _unop(ctx, lambda w, a: (64 - bin(a).count("1"), int(a != M64)), 32, 64))


def _ff1(a):
    return ((a & -a).bit_length() - 1) & M32 if a else M32


op("s_ff1_i32_b32")(lambda ctx: _unop(ctx, lambda w, a: (_ff1(a), None), 32))
op("s_ff1_i32_b64")(lambda ctx: _unop(ctx, lambda w, a: (_ff1(a), None), 32, 64))
op("s_ff0_i32_b32")(lambda ctx: _unop(ctx, lambda w, a: (_ff1(~a & M32), None), 32))
op("s_ff0_i32_b64")(lambda ctx: _unop(ctx, lambda w, a: (_ff1(~a & M64), None), 32, 64))
op("s_flbit_i32_b32")(lambda ctx: _unop(ctx, lambda w, a: ((32 - a.bit_length()) if a else M32, None), 32))
op("s_flbit_i32_b64")(lambda ctx: _unop(ctx, lambda w, a: ((64 - a.bit_length()) if a else M32, None), 32, 64))
op("s_sext_i32_i8")(lambda ctx: _unop(ctx, lambda w, a: (_sx(a & 0xFF, 8) & M32, None), 32))
op("s_sext_i32_i16")(lambda ctx: _unop(ctx, lambda w, a: (_sx(a & 0xFFFF, 16) & M32, None), 32))


@op("s_abs_i32")
def _s_abs_i32(ctx):
    def f(w, a):
        r = abs(_sx(a, 32)) & M32
        return r, int(r != 0)
    return _unop(ctx, f, 32)


@op("s_bitset0_b32", "s_bitset1_b32", "s_bitset0_b64", "s_bitset1_b64")
def _s_bitset(ctx):
    """CDNA3 SOP1: D.u[S0.u[4:0]] = 0/1 (b64: S0.u[5:0]); the other bits of D kept, SCC not
    changed."""
    bits = 64 if ctx.base.endswith("64") else 32
    one = "bitset1" in ctx.base
    ctx.need(2)
    rd = ctx.sread(ctx.ops[0], bits)
    rs = ctx.sread(ctx.ops[1], 32)
    wr = ctx.swrite(ctx.ops[0], bits)

    def h(w):
        m = 1 << (rs(w) & (bits - 1))
        wr(w, (rd(w) | m) if one else (rd(w) & ~m & _MASK[bits]))
    return h


# saveexec family: D = old EXEC; EXEC = f(S0, EXEC); SCC = (EXEC != 0). (CDNA3 ISA, SOP1 opcodes)
_SAVEEXEC = {
    "s_and_saveexec_b64": lambda s, e: s & e,
    "s_or_saveexec_b64": lambda s, e: s | e,
    "s_xor_saveexec_b64": lambda s, e: s ^ e,
    "s_andn2_saveexec_b64": lambda s, e: s & ~e,
    "s_orn2_saveexec_b64": lambda s, e: s | ~e,
    "s_nand_saveexec_b64": lambda s, e: ~(s & e),
    "s_nor_saveexec_b64": lambda s, e: ~(s | e),
    "s_xnor_saveexec_b64": lambda s, e: ~(s ^ e),
    "s_andn1_saveexec_b64": lambda s, e: ~s & e,
    "s_orn1_saveexec_b64": lambda s, e: ~s | e,
}


def _saveexec(ctx):
    fn = _SAVEEXEC[ctx.base]
    ctx.need(2)
    rs = ctx.sread(ctx.ops[1], 64)
    wr = ctx.swrite(ctx.ops[0], 64)

    def h(w):
        s0 = rs(w)  # read before D is written: D may alias S0
        old = w.exec
        wr(w, old)
        new = fn(s0, old) & M64
        w.exec = new
        w.scc = int(new != 0)
    return h


for _n in _SAVEEXEC:
    op(_n)(_saveexec)


@op("s_andn1_wrexec_b64", "s_andn2_wrexec_b64")
def _wrexec(ctx):
    ctx.need(2)
    rs = ctx.sread(ctx.ops[1], 64)
    wr = ctx.swrite(ctx.ops[0], 64)
    n1 = ctx.base == "s_andn1_wrexec_b64"

    def h(w):
        s0, e = rs(w), w.exec
        new = ((~s0 & e) if n1 else (s0 & ~e)) & M64
        w.exec = new
        wr(w, new)
        w.scc = int(new != 0)
    return h


@op("s_getpc_b64")
def _s_getpc(ctx):
    raise ctx.fail("program counter values are not emulated (no code addresses)")


# --------------------------------------------------------------------------- SOPC

_CMP = {
    "eq": lambda a, b: a == b,
    "lg": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
}


def _scmp(cmp, bits, signed):
    def build(ctx):
        ctx.need(2)
        ra = ctx.sread(ctx.ops[0], bits)
        rb = ctx.sread(ctx.ops[1], bits)
        if signed:
            def h(w):
                w.scc = int(cmp(_sx(ra(w), bits), _sx(rb(w), bits)))
        else:
            def h(w):
                w.scc = int(cmp(ra(w), rb(w)))
        return h
    return build


for _c, _f in _CMP.items():
    op(f"s_cmp_{_c}_i32")(_scmp(_f, 32, True))
    op(f"s_cmp_{_c}_u32")(_scmp(_f, 32, False))
op("s_cmp_eq_u64")(_scmp(_CMP["eq"], 64, False))
op("s_cmp_lg_u64")(_scmp(_CMP["lg"], 64, False))


@op("s_bitcmp0_b32", "s_bitcmp1_b32", "s_bitcmp0_b64", "s_bitcmp1_b64")
def _s_bitcmp(ctx):
    bits = 64 if ctx.base.endswith("64") else 32
    want = 1 if "bitcmp1" in ctx.base else 0
    ctx.need(2)
    ra = ctx.sread(ctx.ops[0], bits)
    rb = ctx.sread(ctx.ops[1], 32)

    def h(w):
        w.scc = int(((ra(w) >> (rb(w) & (bits - 1))) & 1) == want)
    return h


# --------------------------------------------------------------------------- SOPK

def _simm16(ctx, o):
    if o.kind != "imm" or not isinstance(o.value, int):
        raise ctx.fail(f"expected a 16-bit immediate, got {o}")
    return o.value & 0xFFFF


@op("s_movk_i32")
def _s_movk(ctx):
    ctx.need(2)
    v = _sx(_simm16(ctx, ctx.ops[1]), 16) & M32
    wr = ctx.swrite(ctx.ops[0])
    return lambda w: wr(w, v)


@op("s_cmovk_i32")
def _s_cmovk(ctx):
    ctx.need(2)
    v = _sx(_simm16(ctx, ctx.ops[1]), 16) & M32
    wr = ctx.swrite(ctx.ops[0])

    def h(w):
        if w.scc:
            wr(w, v)
    return h


@op("s_addk_i32")
def _s_addk(ctx):
    ctx.need(2)
    k = _simm16(ctx, ctx.ops[1])
    rd = ctx.sread(ctx.ops[0])
    wr = ctx.swrite(ctx.ops[0])
    kk = _sx(k, 16) & M32

    def h(w):
        v, w.scc = _ovf_add(rd(w), kk)
        wr(w, v)
    return h


@op("s_mulk_i32")
def _s_mulk(ctx):
    ctx.need(2)
    k = _sx(_simm16(ctx, ctx.ops[1]), 16)
    rd = ctx.sread(ctx.ops[0])
    wr = ctx.swrite(ctx.ops[0])
    return lambda w: wr(w, (_sx(rd(w), 32) * k) & M32)


def _scmpk(cmp, signed):
    def build(ctx):
        ctx.need(2)
        k = _simm16(ctx, ctx.ops[1])
        k = _sx(k, 16) if signed else k
        ra = ctx.sread(ctx.ops[0])
        if signed:
            return lambda w: setattr(w, "scc", int(cmp(_sx(ra(w), 32), k)))
        return lambda w: setattr(w, "scc", int(cmp(ra(w), k)))
    return build


for _c, _f in _CMP.items():
    op(f"s_cmpk_{_c}_i32")(_scmpk(_f, True))
    op(f"s_cmpk_{_c}_u32")(_scmpk(_f, False))


# --------------------------------------------------------------------------- SOPP

@op("s_endpgm")
def _s_endpgm(ctx):
    return lambda w: END


@op("s_barrier")
def _s_barrier(ctx):
    return lambda w: BARRIER


@op("s_nop", "s_waitcnt", "s_setprio", "s_sleep", "s_sched_barrier", "sched_barrier", "s_waitcnt_vscnt",
    "s_waitcnt_vmcnt", "s_waitcnt_lgkmcnt", "s_waitcnt_expcnt", "s_dcache_wb", "s_dcache_inv",
    "buffer_wbl2", "buffer_inv", "buffer_wbinvl1", "buffer_wbinvl1_vol", "s_icache_inv")
def _no_effect(ctx):
    # Memory is sequentially consistent in the emulator and waves run to completion between
    # barriers, so waits, priorities, hints and cache maintenance change nothing observable.
    return lambda w: None


@op("s_branch")
def _s_branch(ctx):
    ctx.need(1)
    t = ctx.label(ctx.ops[0])
    return lambda w: t


def _cbranch(cond):
    def build(ctx):
        ctx.need(1)
        t = ctx.label(ctx.ops[0])
        return lambda w: t if cond(w) else None
    return build


op("s_cbranch_scc0")(_cbranch(lambda w: not w.scc))
op("s_cbranch_scc1")(_cbranch(lambda w: w.scc))
op("s_cbranch_vccz")(_cbranch(lambda w: not (w.s[106] | w.s[107])))
op("s_cbranch_vccnz")(_cbranch(lambda w: bool(w.s[106] | w.s[107])))
op("s_cbranch_execz")(_cbranch(lambda w: not (w.s[126] | w.s[127])))
op("s_cbranch_execnz")(_cbranch(lambda w: bool(w.s[126] | w.s[127])))
