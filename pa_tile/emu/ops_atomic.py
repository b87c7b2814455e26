"""Atomic read-modify-write instructions: GLOBAL (``global_atomic_*``), MUBUF (``buffer_atomic_*``)
and LDS (``ds_<op>_*``, ``ds_<op>_rtn_*``).

Semantics: CDNA3 ISA guide §12.12 (MUBUF atomics: "RETURN_DATA = tmp" pre-op value; CMPSWAP takes
DATA[0] = source, DATA[1] = compare), §12.14 (FLAT/GLOBAL atomics, same op table), §12.13 (DS
atomics; DS_CMPST takes DATA0 = compare, DATA1 = source). The returning forms are spelled with
``sc0`` on gfx940+ (``glc`` before): MUBUF atomics then write the pre-op value back into VDATA's
first register(s), GLOBAL and DS ``_rtn`` forms into their VDST.

Defined order where several lanes or waves hit one address (hardware gives no order; an emulator
must pick one and say so): within one instruction the active lanes are applied one at a time in
ascending lane order, so each returning lane sees the values of the lanes below it; between waves
the emulator's schedule orders whole instructions (``run_kernel``'s round-robin, or ``quantum``).
Integer results are therefore exact whatever the order; float adds (``*_add_f32``,
``*_pk_add_f16``/``bf16``, ``*_add_f64``) depend on it, as on hardware. Float adds round to
nearest even with denormals kept (an assumption: the guide does not state the float atomic
denormal mode for gfx942/gfx950). LDS atomics are exempt from the LDS race detector: an atomic is
a well-defined access between waves.

Out-of-range MUBUF atomics (buffer range check) are dropped and return 0, like loads/stores.
"""

from __future__ import annotations

import numpy as np

from . import memory as mm
from . import numerics as nx
from .ops_base import LANES, op
from .ops_vmem import _buffer_operands, _global_addr

U32, U64 = np.uint32, np.uint64


def _f16add(a, b):
    return (a.view(np.float16).astype(np.float32) + b.view(np.float16).astype(np.float32)).astype(np.float16).view(np.uint16)


def _bf16add(a, b):
    s = nx.bf16_bits_to_f32(a) + nx.bf16_bits_to_f32(b)
    return nx.f32_to_bf16_bits(s).astype(np.uint16)


def _fmin(a, b):
    return nx.min_f32(a.view(np.float32), b.view(np.float32)).view(U32)


def _fmax(a, b):
    return nx.max_f32(a.view(np.float32), b.view(np.float32)).view(U32)


# op -> fn(old, src, cmp) on arrays of the element type (unsigned bit views), by width
def _table(bits):
    ut = U32 if bits == 32 else U64
    st = np.int32 if bits == 32 else np.int64
    one = ut(1)
    return {
        "add": lambda o, s, c: o + s,
        "sub": lambda o, s, c: o - s,
        "rsub": lambda o, s, c: s - o,
        "smin": lambda o, s, c: np.minimum(o.view(st), s.view(st)).view(ut),
        "smax": lambda o, s, c: np.maximum(o.view(st), s.view(st)).view(ut),
        "umin": lambda o, s, c: np.minimum(o, s),
        "umax": lambda o, s, c: np.maximum(o, s),
        "and": lambda o, s, c: o & s,
        "or": lambda o, s, c: o | s,
        "xor": lambda o, s, c: o ^ s,
        "swap": lambda o, s, c: s,
        "inc": lambda o, s, c: np.where(o >= s, ut(0), o + one),
        "dec": lambda o, s, c: np.where((o == 0) | (o > s), s, o - one),
        "cmpswap": lambda o, s, c: np.where(o == c, s, o),
    }


_INT32, _INT64 = _table(32), _table(64)
# name suffix (after the op) -> (bytes, fn); filled per family below
_FLOAT = {
    "add_f32": (4, lambda o, s, c: (o.view(np.float32) + s.view(np.float32)).view(U32)),
    "pk_add_f16": (4, lambda o, s, c: _pk(o, s, _f16add)),
    "pk_add_bf16": (4, lambda o, s, c: _pk(o, s, _bf16add)),
    "add_f64": (8, lambda o, s, c: (o.view(np.float64) + s.view(np.float64)).view(U64)),
    "min_f64": (8, lambda o, s, c: np.fmin(o.view(np.float64), s.view(np.float64)).view(U64)),
    "max_f64": (8, lambda o, s, c: np.fmax(o.view(np.float64), s.view(np.float64)).view(U64)),
}


def _pk(o, s, f):
    lo = f((o & U32(0xFFFF)).astype(np.uint16), (s & U32(0xFFFF)).astype(np.uint16)).astype(U32)
    hi = f((o >> U32(16)).astype(np.uint16), (s >> U32(16)).astype(np.uint16)).astype(U32)
    return lo | (hi << U32(16))


def _rmw(load, store, addrs, mask, src, cmp, fn, nbytes):
    """Apply fn to memory at addrs for the lanes in mask; returns the pre-op values (u8[64, n]).
    Lanes sharing an address are applied one by one in lane order."""
    ut = U32 if nbytes == 4 else U64
    old = np.zeros((LANES, nbytes), np.uint8)
    lanes = np.flatnonzero(mask)
    if lanes.size == 0:
        return old
    a = addrs[lanes]
    if np.unique(a).size == a.size:
        cur = load(addrs, mask, nbytes)
        new = fn(cur.view(ut)[:, 0], src, cmp)
        store(addrs, mask, np.ascontiguousarray(np.asarray(new, ut).reshape(LANES, 1)).view(np.uint8))
        return cur
    for ln in lanes:
        m = np.zeros(LANES, bool)
        m[ln] = True
        cur = load(addrs, m, nbytes)
        new = np.asarray(fn(cur.view(ut)[:, 0], src, cmp), ut)
        store(addrs, m, np.ascontiguousarray(new.reshape(LANES, 1)).view(np.uint8))
        old[ln] = cur[ln]
    return old


def _split(name, prefix):
    """``<prefix><op>[_rtn]_<type>`` -> (op key, bytes, fn, returning-by-name)."""
    rest = name[len(prefix):]
    rtn = "_rtn_" in rest
    rest = rest.replace("_rtn", "")
    if rest in _FLOAT:
        nb, fn = _FLOAT[rest]
        return rest, nb, fn, rtn
    x2 = rest.endswith("_x2")
    body = rest[:-3] if x2 else rest
    return body, (8 if x2 else 4), (_INT64 if x2 else _INT32)[body], rtn


def _vals(ctx, o, nbytes, n):
    """Reader of n consecutive data registers as the element type."""
    row = ctx.vrow(o)
    words = nbytes // 4
    if o.count != words * n:
        raise ctx.fail(f"data {o} should be {words * n} registers")

    def rd(w):
        regs = w.v[row:row + words * n]
        if words == 1:
            return [regs[i] for i in range(n)]
        return [regs[2 * i].astype(U64) | (regs[2 * i + 1].astype(U64) << U64(32)) for i in range(n)]
    return rd


def _ret_writer(ctx, o, nbytes):
    row = ctx.vrow(o)
    words = nbytes // 4
    if o.count != words:
        raise ctx.fail(f"return register {o} should be {words} registers")

    def wr(w, old_u8, m):
        np.copyto(w.v[row:row + words], old_u8.view(U32).T, where=m[None, :])
    return wr


# --------------------------------------------------------------------------- GLOBAL

def _returns(ctx):
    return bool(ctx.mods.get("sc0") or ctx.mods.get("glc"))


def _global_atomic(ctx):
    key, nbytes, fn, _ = _split(ctx.base, "global_atomic_")
    extra = set(ctx.mods) - {"offset", "glc", "slc", "nt", "sc0", "sc1"}
    if extra:
        raise ctx.fail(f"modifiers {sorted(extra)}")
    rtn = len(ctx.ops) == 4
    if rtn != _returns(ctx):
        raise ctx.fail("a returning atomic needs a destination and sc0/glc, and only then")
    o = ctx.ops[1:] if rtn else ctx.ops
    if len(o) != 3:
        raise ctx.fail(f"expected {4 if rtn else 3} operands")
    addr = _global_addr(ctx, o[0], o[2], int(ctx.mods.get("offset", 0)))
    cmpswap = key == "cmpswap"
    data = _vals(ctx, o[1], nbytes, 2 if cmpswap else 1)
    wr = _ret_writer(ctx, ctx.ops[0], nbytes) if rtn else None
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        a = np.ascontiguousarray(np.broadcast_to(addr(w), (LANES,)))
        m = w.em
        d = data(w)
        src, cmp = d[0], (d[1] if cmpswap else None)
        old = _rmw(lambda ad, mk, n: w.mem.load(ad, mk, n, origin), lambda ad, mk, v: w.mem.store(ad, mk, v, origin),
                   a, m, src, cmp, fn, nbytes)
        if w.trace is not None:
            w.trace.global_access(mnem, line, a, m, nbytes, kind="global", write=True, wave=w.uid)
        if wr is not None:
            wr(w, old, m)
    return h


# --------------------------------------------------------------------------- MUBUF

def _buffer_atomic(ctx):
    key, nbytes, fn, _ = _split(ctx.base, "buffer_atomic_")
    ctx.need(4)
    rsrc, kw = _buffer_operands(ctx, ctx.ops[1], ctx.ops[2], ctx.ops[3])
    cmpswap = key == "cmpswap"
    data = _vals(ctx, ctx.ops[0], nbytes, 2 if cmpswap else 1)
    rtn = _returns(ctx)
    vrow = ctx.vrow(ctx.ops[0])
    words = nbytes // 4
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        m = w.em
        r = rsrc(w)
        k = kw(w)
        addrs, in_range = mm.buffer_addresses(r, nbytes=nbytes, lanes=LANES, **k)
        live = m & in_range.all(axis=1)   # an atomic is one access: all of it in range, or dropped
        d = data(w)
        src, cmp = d[0], (d[1] if cmpswap else None)
        old = _rmw(lambda ad, mk, n: w.mem.load(ad, mk, n, origin), lambda ad, mk, v: w.mem.store(ad, mk, v, origin),
                   addrs, live, src, cmp, fn, nbytes)
        if w.trace is not None:
            w.trace.global_access(mnem, line, addrs, live, nbytes, kind="buffer", write=True, wave=w.uid)
        if rtn:
            np.copyto(w.v[vrow:vrow + words], old.view(U32).T, where=m[None, :])
    return h


# --------------------------------------------------------------------------- DS

_DS_OPS = {  # DS spelling -> generic key
    "add": "add", "sub": "sub", "rsub": "rsub", "inc": "inc", "dec": "dec",
    "min_i": "smin", "max_i": "smax", "min_u": "umin", "max_u": "umax",
    "and_b": "and", "or_b": "or", "xor_b": "xor", "wrxchg": "swap", "cmpst_b": "cmpswap",
}


def _ds_atomic(ctx):
    base = ctx.base[len("ds_"):]
    rtn = "_rtn_" in base
    core = base.replace("_rtn", "")
    fl = {"add_f32": (4, _FLOAT["add_f32"][1]), "pk_add_f16": (4, _FLOAT["pk_add_f16"][1]),
          "pk_add_bf16": (4, _FLOAT["pk_add_bf16"][1]), "min_f32": (4, lambda o, s, c: _fmin(o, s)),
          "max_f32": (4, lambda o, s, c: _fmax(o, s)), "add_f64": _FLOAT["add_f64"]}
    if core in fl:
        nbytes, fn = fl[core]
        key = core
    else:
        name, typ = core.rsplit("_", 1)        # e.g. add_u32, min_i32, and_b64, cmpst_b32, wrxchg_b32
        width = int(typ[1:])
        k = name if name in _DS_OPS else f"{name}_{typ[0]}"
        if k not in _DS_OPS or width not in (32, 64):
            raise ctx.fail("unknown DS atomic")
        key = _DS_OPS[k]
        nbytes = width // 8
        fn = (_INT32 if width == 32 else _INT64)[key]
    extra = set(ctx.mods) - {"offset", "gds"}
    if extra or ctx.mods.get("gds"):
        raise ctx.fail(f"modifiers {sorted(extra) or ['gds']}")
    off = int(ctx.mods.get("offset", 0))
    ops = ctx.ops[1:] if rtn else ctx.ops
    cmpswap = key == "cmpswap"
    if len(ops) != (3 if cmpswap else 2):
        raise ctx.fail("wrong operand count")
    if ops[0].kind != "v" or ops[0].count != 1:
        raise ctx.fail(f"address {ops[0]} must be one VGPR")
    arow = ops[0].index
    r_a = _vals(ctx, ops[1], nbytes, 1)
    r_b = _vals(ctx, ops[2], nbytes, 1) if cmpswap else None
    wr = _ret_writer(ctx, ctx.ops[0], nbytes) if rtn else None
    origin, mnem, line = ctx.origin, ctx.ins.mnemonic, ctx.ins.line

    def h(w):
        a = (w.v[arow] + U32(off)).astype(U32)
        m = w.em
        if cmpswap:   # DS_CMPST: DATA0 is the compare value, DATA1 the source
            cmp, src = r_a(w)[0], r_b(w)[0]
        else:
            src, cmp = r_a(w)[0], None
        old = _rmw(lambda ad, mk, n: w.lds.read(ad, mk, n, origin), lambda ad, mk, v: w.lds.write(ad, mk, v, origin),
                   a, m, src, cmp, fn, nbytes)
        if w.trace is not None:
            w.trace.lds_access(mnem, line, a, m, nbytes, write=True, wave=w.uid)
        if wr is not None:
            wr(w, old, m)
    return h


def _register():
    ints = ["add", "sub", "smin", "umin", "smax", "umax", "and", "or", "xor", "inc", "dec", "swap", "cmpswap"]
    names = [f"{k}{x}" for k in ints for x in ("", "_x2")] + list(_FLOAT)
    for n in names:
        op(f"global_atomic_{n}")(_global_atomic)
        op(f"buffer_atomic_{n}")(_buffer_atomic)
    ds = []
    for k in ("add", "sub", "rsub", "inc", "dec"):
        ds += [f"{k}_u32", f"{k}_u64"]
    for k in ("min", "max"):
        ds += [f"{k}_i32", f"{k}_u32", f"{k}_i64", f"{k}_u64", f"{k}_f32"]
    for k in ("and", "or", "xor", "cmpst"):
        ds += [f"{k}_b32", f"{k}_b64"]
    ds += ["add_f32", "pk_add_f16", "pk_add_bf16", "add_f64"]
    for n in ds:
        op(f"ds_{n}")(_ds_atomic)
        r = n.rsplit("_", 1)
        op(f"ds_{r[0]}_rtn_{r[1]}")(_ds_atomic)
    op("ds_wrxchg_rtn_b32", "ds_wrxchg_rtn_b64")(_ds_atomic)


_register()
