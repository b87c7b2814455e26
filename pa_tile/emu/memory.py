"""Memory as a wave sees it: global memory (with a sanitizer), buffer resources, LDS, and an access trace.

Everything works on whole waves: addresses are ``[64]`` arrays, masks are ``bool[64]``, data is
``uint8[64, nbytes]`` (view it as ``uint32`` for register rows). Nothing here knows about registers or
instructions; the emulator core composes an ``origin`` string ("kernel:line mnemonic") for messages.

Sanitizer
    Global memory is a set of *regions* (the storages of the tensors a launch was given, the kernarg
    segment, emulator-owned buffers). Any active lane whose ``[addr, addr + nbytes)`` is not inside
    one region raises :class:`MemoryFault` naming the origin, lane, address and the nearest region.
    Real hardware would read or scribble over whatever is mapped there; here it is always an error.

Buffer resources (V#)
    Layout of the 128-bit descriptor: CDNA3 ISA guide ("AMD Instinct MI300" Instruction Set
    Architecture), chapter "Vector Memory Buffer Instructions", table "Buffer Resource Descriptor".
    The PDF itself could not be re-read while writing this module; the bit positions below were
    checked against two independent public encodings of the GFX9/CDNA descriptor (gem5's Vega model,
    Tensile's SRD comments) and against the descriptor FlyDSL builds (word3 = 0x27000 decodes to
    DATA_FORMAT 4 = "32", NUM_FORMAT 7 = FLOAT, all DST_SEL 0)::

        word0        base[31:0]
        word1[15:0]  base[47:32]      word1[29:16] stride (14 bits)
        word1[30]    cache_swizzle    word1[31]    swizzle_enable
        word2        num_records
        word3[11:0]  dst_sel_x/y/z/w (3 bits each)   [14:12] num_format   [18:15] data_format
        word3[20:19] element_size (GFX8 meaning)     [22:21] index_stride [23] add_tid_enable
        word3[31:30] type (0 = buffer)

    Range checking (CDNA1-4), as documented in the ISA guide's "Range checking" notes and as AMD's
    own simulator models it after validating against gfx950 hardware (ROCm/rocm-systems PR #10928,
    "Model GFX9/CDNA buffer range check"; same formula in llvm/llvm-project PR #207796):

    * out-of-range reads return 0, out-of-range writes are dropped (no fault);
    * ``offset = (voffset if offen else 0) + inst_offset`` wraps at 32 bits; ``soffset`` is added
      outside the wrap and *does* count toward the check;
    * raw access (stride == 0, or no ``idxen``): a piece of the access is in range iff
      ``offset + soffset + piece_end <= num_records``;
    * ``dwordx2/x3/x4`` are checked **per dword**: a dwordx4 straddling ``num_records`` returns its
      leading in-range dwords and zeros for the rest (format ops and atomics are all-or-nothing;
      none occur in our kernels);
    * strided access with ``idxen``: the whole lane is out of range iff ``index >= num_records``;
    * ``add_tid_enable`` (scratch-style): address adds ``lane * stride`` with the stride extended by
      ``data_format`` as bits [17:14]; no range check.
    * ``swizzle_enable`` is not modelled (raises ``NotImplementedError``); our kernels never set it.

    FlyDSL builds every V# with num_records = 0xFFFFFFFF, so this check never fires for its
    kernels: the sanitizer's region check on the final address is what catches bad indexing.

LDS
    gfx942 (CDNA3): 64 KiB per workgroup, 32 banks x 4 bytes. gfx950 (CDNA4): 160 KiB per
    workgroup (LLVM's gfx950 LDS-size tests), 64 banks x 4 bytes (CDNA4 white paper, as summarised
    in nod-ai/amd-shark-ai docs/amdgpu_kernel_optimization_guide.md; measured in
    docs/empirical-lds/cdna4info.md).
    Out-of-range DS addresses: on GCN the limit was M0; since GFX9 it is the wave's LDS allocation
    (granules of 512 bytes on gfx942, 1280 on gfx950: :data:`LDS_GRANULE`), and an out-of-range read returns 0 while an out-of-range write is
    dropped. That is the classic GCN rule; a CDNA3-specific sentence for it could not be checked
    here. The emulator raises :class:`MemoryFault` by default (an out-of-range LDS access is a bug
    in our kernels); ``LDS(..., oob="hardware")`` follows the hardware rule instead, per byte,
    against the allocation rounded up to the granule.

Bank conflicts
    A wave's LDS access is served in *phases*; only lanes in the same phase can conflict. AMD's ISA
    guides do not state the lane-to-phase mapping. The tables below are the ones measured on MI300X
    and MI350X (nod-ai/amd-shark-ai docs/empirical-lds/cdna3info.md and cdna4info.md, from
    rocprof SQ_LDS_BANK_CONFLICT counts and latency), agreeing with composable_kernel's
    "lds_bank_conflicts" note (ds_write_b128 in eight phases of lanes 0-7, 8-15, ...):

    ======  ==========  ==================================================================
    arch    access      phases (lanes served together)
    ======  ==========  ==================================================================
    gfx942  b32 (<=4B)  2 x 32 contiguous lanes, 32 banks
    gfx942  b64         4 x 16 contiguous lanes, 32 banks
    gfx942  read b128   8 x 8 lanes: {0-3,20-23} {32-35,52-55} {4-7,16-19} {36-39,48-51}
                        {8-11,28-31} {40-43,60-63} {12-15,24-27} {44-47,56-59}
    gfx942  write b128  8 x 8 contiguous lanes
    gfx950  read b32    1 x 64 lanes, 64 banks
    gfx950  read b64    2 x 32 contiguous lanes, 64 banks
    gfx950  read b128   4 x 16 lanes: {0-3,12-15,20-23,24-27} {32-35,44-47,52-55,56-59}
                        {4-7,8-11,16-19,28-31} {36-39,40-43,48-51,60-63}
    ======  ==========  ==================================================================

    Not measured anywhere we could find, so *assumed*: writes on gfx950 behave like gfx942 writes
    (32-bank model; AMD's rocRoller LDSBankModel makes the same choice, noting the doubled bandwidth
    is for reads), and b96 uses the b128 grouping of the same arch (gfx950: its 32-bank gfx942 form).
    Note rocRoller models gfx950 b32 reads with 32 banks too; we follow the measurements instead.
    ``ds_read2*/ds_write2*`` are recorded as two accesses (the measured read2_b64 runs its two
    halves as two b64 passes).

    Conflict degree of a phase = the largest number of *distinct* dword addresses that map to one
    bank (the same dword read by several lanes is a broadcast, not a conflict); the degree of an
    access is the max over its phases, and ``conflict_cycles`` is the sum over phases of
    (degree - 1).

Coalescing
    For each global/buffer access the trace records how many distinct 128-byte lines the active
    lanes touch (``lines_128B``), against the minimum ``ceil(active_lanes * bytes_per_lane / 128)``
    (a perfectly contiguous access, ``min_lines_128B``). 128 bytes is the line of the vL1D and of
    the L2 on both targets (AMD CDNA 3 and CDNA 4 white papers), so it is what a wave's load
    fetches. Lines are counted from the start of the memory region (the tensor) an address lies
    in, once a launch has named its regions (:meth:`Trace.set_regions`): a GPU allocation starts
    at least 256-byte aligned (ASSUMED for HIP from CUDA's documented 256 bytes and torch's
    512-byte caching-allocator blocks), while a host tensor the emulator reads may start at any
    multiple of 64, which would make the count depend on where the host allocator put it.
    Broadcast loads can go below the "minimum".
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from .. import arch as _arch

WAVE = 64  # the emulator models wave64 only (every arch.INFO[...].wave_size; tests/test_one_home.py)
# views of pa_tile.arch, the one home of arch facts (kept as names: callers and Trace use them)
LDS_MAX_BYTES = {name: a.lds_per_workgroup for name, a in _arch.INFO.items()}
LDS_BANKS = {name: a.lds_banks for name, a in _arch.INFO.items()}
# bytes a workgroup's LDS is allocated in: 512 on gfx942 (128 dwords), 1280 on gfx950 (320 dwords,
# 160 KiB / 128; LLVM PR 208046 stopped rounding gfx950's block up to 2048, and PRs 205637/219172
# round occupancy and alloca budgets to this granule)
LDS_GRANULE = {name: a.lds_granule for name, a in _arch.INFO.items()}
#: bytes of a vL1D / L2 cache line on gfx942 and gfx950 ([CDNA3-WP], [CDNA4-WP]: 128-byte lines)
LINE_BYTES = 128

_U32 = 0xFFFFFFFF
_ARANGE = {}


def _arange(n: int) -> np.ndarray:
    a = _ARANGE.get(n)
    if a is None:
        a = _ARANGE[n] = np.arange(n, dtype=np.int64)
    return a


class MemoryFault(RuntimeError):
    """An access outside the memory the kernel was given (global, scalar or LDS)."""

    def __init__(self, message, *, origin, space, lane, address, nbytes, nearest=None, bad_lanes=()):
        super().__init__(message)
        self.origin = origin
        self.space = space
        self.lane = lane
        self.address = address
        self.nbytes = nbytes
        self.nearest = nearest
        self.bad_lanes = tuple(bad_lanes)


def _as_mask(mask, n=WAVE) -> np.ndarray:
    m = np.asarray(mask, dtype=bool)
    if m.shape != (n,):
        raise ValueError(f"mask must have shape ({n},), got {m.shape}")
    return m


# --------------------------------------------------------------------------------------------
# global memory
# --------------------------------------------------------------------------------------------


#: what the bytes of an over-read (``GlobalMemory(overread=...)``) read: 0xFF, so that a kernel
#: that uses them sees NaN (f32, f16, bf16) or -1, not a plausible 0
OVERREAD_POISON = 0xFF


class GlobalMemory:
    """Host memory regions seen through numpy views; every access is bounds checked.

    ``regions``: ``(base_address, nbytes, name)`` of memory that really exists in this process
    (CPU tensor storages: ``t.untyped_storage().data_ptr()``, ``nbytes()``). The caller keeps that
    memory alive for as long as this object is used; emulator-owned buffers from :meth:`alloc` are
    kept alive here.
    """

    #: bytes a load may run past the end of the region it starts in (``overread=``); they read
    #: :data:`OVERREAD_POISON`, never host memory. Stores get no such slack.
    overread: int = 0

    def __init__(self, regions: Sequence[tuple[int, int, str]] = (), *, overread: int = 0):
        if isinstance(overread, bool) or not isinstance(overread, int) or overread < 0:
            raise ValueError(f"overread must be a byte count >= 0, got {overread!r}")
        self.overread = overread
        self.overreads = 0   # lane loads that used the slack (read poison past a region's end)
        self._spans: list[tuple[int, int, str, np.ndarray]] = []
        self._owned: list[np.ndarray] = []
        self._bases = np.zeros(0, np.uint64)
        self._ends = np.zeros(0, np.uint64)
        self._last = -1
        for base, nbytes, name in regions:
            self.add_region(base, nbytes, name)

    # -- regions ---------------------------------------------------------------------------

    def add_region(self, base: int, nbytes: int, name: str) -> None:
        """Allow ``[base, base + nbytes)``. Overlapping regions (views of one storage) are merged;
        touching ones are not, so an access spanning two allocations still faults."""
        base, nbytes = int(base), int(nbytes)
        if nbytes < 0 or base <= 0:
            raise ValueError(f"region {name!r}: bad base {base:#x} / size {nbytes}")
        if nbytes == 0:
            return
        end = base + nbytes
        keep, names = [], [(base, name)]
        for b, e, n, v in self._spans:
            if b < end and base < e:
                names.append((b, n))
                base, end = min(base, b), max(end, e)
            else:
                keep.append((b, e, n, v))
        view = np.ctypeslib.as_array((ctypes.c_uint8 * (end - base)).from_address(base))
        keep.append((base, end, "+".join(n for _, n in sorted(names)), view))
        keep.sort(key=lambda s: s[0])
        self._spans = keep
        self._bases = np.array([s[0] for s in keep], np.uint64)
        self._ends = np.array([s[1] for s in keep], np.uint64)
        self._last = -1
        self.__dict__.pop("_base_spans", None)

    def alloc(self, nbytes: int, name: str, *, align: int = 256, fill: int = 0) -> tuple[int, np.ndarray]:
        """Emulator-owned buffer (kernarg segment, tests) registered as a region.

        Returns ``(address, uint8 array)``; writes through either are the same memory. Pad the
        kernarg segment yourself if the kernel's ``s_load`` can read past its declared size.
        """
        raw = np.full(int(nbytes) + align, fill, np.uint8)
        skip = (-raw.ctypes.data) % align
        buf = raw[skip:skip + int(nbytes)]
        self._owned.append(raw)
        addr = buf.ctypes.data
        self.add_region(addr, int(nbytes), name)
        return addr, buf

    @property
    def regions(self) -> list[tuple[int, int, str]]:
        return [(b, e - b, n) for b, e, n, _ in self._spans]

    def find(self, address: int) -> tuple[str, int] | None:
        """``(region name, offset)`` of a byte address, or None."""
        for b, e, n, _ in self._spans:
            if b <= address < e:
                return n, address - b
        return None

    # -- checks ----------------------------------------------------------------------------

    def _nearest(self, addr: int, nbytes: int):
        best = None
        for b, e, n, _ in self._spans:
            if addr < b:
                dist, rel = b - addr, f"the access starts {b - addr} B before it"
            elif addr >= e:
                dist, rel = addr - e + 1, f"the access starts {addr - e} B past its end"
            else:
                dist, rel = 0, f"the access runs {addr + nbytes - e} B past its end"
            if best is None or dist < best[0]:
                best = (dist, n, b, e, rel)
        return best

    def _fault(self, origin, what, lanes, addrs, nbytes, n_active):
        lane = None if lanes is None else int(lanes[0])
        addr = int(addrs[0])
        near = self._nearest(addr, nbytes)
        who = "" if lane is None else f" by lane {lane}"
        count = "" if lanes is None else f" ({len(lanes)} of {n_active} active lanes out of bounds)"
        if near is None:
            where = "no memory regions are registered"
            nearest = None
        else:
            _, n, b, e, rel = near
            where = f"nearest region {n!r} [{b:#x}, {e:#x}): {rel}"
            nearest = (n, b, e)
        msg = (f"{origin or '<unknown origin>'}: {what} of {nbytes} B{who} at {addr:#x} is outside "
               f"every allowed region{count}; {where}")
        raise MemoryFault(msg, origin=origin, space="global", lane=lane, address=addr, nbytes=nbytes,
                          nearest=nearest, bad_lanes=() if lanes is None else lanes.tolist())

    def _resolve(self, a: np.ndarray, nbytes: int, lanes, origin: str, what: str):
        """Region index for every address (an int when they all share one region)."""
        n = np.uint64(nbytes)
        r = self._last
        if r >= 0:
            b, e = self._spans[r][0], self._spans[r][1]
            if int(a.min()) >= b and int(a.max()) <= e - nbytes:
                return r
        if len(self._spans) == 0:
            self._fault(origin, what, lanes, a, nbytes, len(a))
        idx = np.searchsorted(self._bases, a, side="right").astype(np.int64) - 1
        ok = idx >= 0
        idc = np.where(ok, idx, 0)
        ends = self._ends[idc]
        if self.overread and what == "load":
            # starts inside the region, ends at most ``overread`` bytes past it (read as poison)
            ok &= (a < ends) & (a + n <= ends + np.uint64(self.overread))
        else:
            ok &= (ends >= n) & (a <= ends - n)
        if not ok.all():
            bad = ~ok
            self._fault(origin, what, lanes[bad], a[bad], nbytes, len(a))
        first = int(idc[0])
        if (idc == first).all():
            self._last = first
            return first
        return idc

    def check_derived(self, base: int, addrs, mask, nbytes: int, origin: str = "", what: str = "load") -> None:
        """Fault unless every active lane's access stays in the region that *base* lies in.

        Buffer accesses carry their provenance in the V#: the descriptor's base points into the
        tensor it was built from. Checking against that one region (not against any region)
        catches an index that runs from one view into a neighbouring one, e.g. from K's pages
        into V's when both are views of one cache allocation. A base inside no region (a
        descriptor built below its buffer) leaves the ordinary any-region check in charge.
        """
        # A kernel builds few descriptors: remember the region of each base (None: in none).
        cache = self.__dict__.setdefault("_base_spans", {})
        span = cache.get(base, False)
        if span is False:
            i = int(np.searchsorted(self._bases, np.uint64(base), side="right")) - 1
            ok = i >= 0 and int(self._bases[i]) <= base < int(self._ends[i])
            span = cache[base] = self._spans[i][:3] if ok else None
        if span is None:
            return
        b, e, name = span
        mask = np.asarray(mask, bool)
        a = np.asarray(addrs, np.uint64)
        if mask.all():
            lanes = None
        else:
            lanes = np.flatnonzero(mask)
            if lanes.size == 0:
                return
            a = a[lanes]
        slack = self.overread if what == "load" else 0
        if int(a.min()) >= b and int(a.max()) + nbytes <= e + slack:
            return
        if lanes is None:
            lanes = np.arange(len(a))
        bad = (a < np.uint64(b)) | (a + np.uint64(nbytes) > np.uint64(e + slack))
        if slack:
            bad |= a >= np.uint64(e)  # an over-read starts inside the region
        lane, addr = int(lanes[bad][0]), int(a[bad][0])
        inside = self.find(addr)
        if inside is None:
            return  # outside every region: the ordinary check reports it, nearest region and all
        rel = f"{b - addr} B before it" if addr < b else f"{addr - e} B past its end" if addr >= e else \
            f"and runs {addr + nbytes - e} B past its end"
        other = f" (into region {inside[0]!r})"
        raise MemoryFault(
            f"{origin or '<unknown origin>'}: {what} of {nbytes} B by lane {lane} at {addr:#x} leaves the "
            f"region its descriptor's base {base:#x} points into, {name!r} [{b:#x}, {e:#x}): the access starts "
            f"{rel}{other} ({int(bad.sum())} of {lanes.size} active lanes)",
            origin=origin, space="global", lane=lane, address=addr, nbytes=nbytes, nearest=(name, b, e),
            bad_lanes=lanes[bad].tolist())

    # -- vector access ---------------------------------------------------------------------

    def load(self, addrs, mask, nbytes: int, origin: str = "") -> np.ndarray:
        """Gather ``nbytes`` per active lane -> ``uint8[64, nbytes]`` (inactive lanes are 0)."""
        if not 1 <= nbytes <= 64:
            raise ValueError(f"load of {nbytes} bytes per lane")
        addrs = np.asarray(addrs, dtype=np.uint64)
        mask = _as_mask(mask, addrs.shape[0])
        out = np.zeros((addrs.shape[0], nbytes), np.uint8)
        lanes = np.flatnonzero(mask)
        if lanes.size == 0:
            return out
        a = addrs[lanes]
        r = self._resolve(a, nbytes, lanes, origin, "load")
        ar = _arange(nbytes)
        if self.overread:
            over = a + np.uint64(nbytes) > self._ends[r]
            if over.any():
                self._load_over(out, lanes, a, r, ar)
                return out
        if isinstance(r, int):
            b, _, _, view = self._spans[r]
            out[lanes] = view[(a - np.uint64(b)).astype(np.int64)[:, None] + ar]
        else:
            for ri in np.unique(r):
                sel = r == ri
                b, _, _, view = self._spans[ri]
                out[lanes[sel]] = view[(a[sel] - np.uint64(b)).astype(np.int64)[:, None] + ar]
        return out

    def _load_over(self, out, lanes, a, r, ar) -> None:
        """``load`` when some lane runs past its region's end (``overread``): bytes inside the
        region come from it, bytes past it read :data:`OVERREAD_POISON`."""
        self.overreads += int((a + np.uint64(len(ar)) > self._ends[r]).sum())
        rs = np.broadcast_to(np.asarray(r, np.int64), a.shape)
        for ri in np.unique(rs):
            sel = rs == ri
            b, e, _, view = self._spans[int(ri)]
            idx = (a[sel] - np.uint64(b)).astype(np.int64)[:, None] + ar
            inside = idx < e - b
            out[lanes[sel]] = np.where(inside, view[np.minimum(idx, e - b - 1)], np.uint8(OVERREAD_POISON))

    def store(self, addrs, mask, data, origin: str = "") -> None:
        """Scatter ``data[lane, :]`` for active lanes. Lanes hitting the same byte: highest lane wins."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        data = np.asarray(data, dtype=np.uint8)
        mask = _as_mask(mask, addrs.shape[0])
        if data.ndim != 2 or data.shape[0] != addrs.shape[0]:
            raise ValueError(f"store data must be [{addrs.shape[0]}, nbytes], got {data.shape}")
        nbytes = data.shape[1]
        lanes = np.flatnonzero(mask)
        if lanes.size == 0:
            return
        a = addrs[lanes]
        r = self._resolve(a, nbytes, lanes, origin, "store")
        ar = _arange(nbytes)
        if isinstance(r, int):
            b, _, _, view = self._spans[r]
            view[(a - np.uint64(b)).astype(np.int64)[:, None] + ar] = data[lanes]
        else:
            for ri in np.unique(r):
                sel = r == ri
                b, _, _, view = self._spans[ri]
                view[(a[sel] - np.uint64(b)).astype(np.int64)[:, None] + ar] = data[lanes[sel]]

    # -- scalar access ---------------------------------------------------------------------

    def load_scalar(self, addr: int, ndwords: int, origin: str = "") -> np.ndarray:
        """``s_load_dword*``: ``uint32[ndwords]`` from ``addr``. SMEM ignores the two low address
        bits, so the read starts at ``addr & ~3``; the whole range must lie in one region."""
        a = int(addr) & ~3
        nbytes = 4 * int(ndwords)
        for b, e, _, view in self._spans:
            if b <= a and a + nbytes <= e:
                return view[a - b:a - b + nbytes].copy().view(np.uint32)
        self._fault(origin, "scalar load", None, np.array([a], np.uint64), nbytes, 1)


# --------------------------------------------------------------------------------------------
# buffer resources
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferResource:
    """A decoded V# (see the module docstring for the bit layout and its sources)."""

    base: int
    stride: int
    cache_swizzle: bool
    swizzle_enable: bool
    num_records: int
    dst_sel: tuple[int, int, int, int]
    num_format: int
    data_format: int
    element_size: int
    index_stride: int
    add_tid_enable: bool
    type: int
    words: tuple[int, int, int, int]


def decode_vsharp(words) -> BufferResource:
    """Decode four dwords (``s[n:n+3]``) into a :class:`BufferResource`."""
    w = [int(x) & _U32 for x in words]
    if len(w) != 4:
        raise ValueError(f"a V# is 4 dwords, got {len(w)}")
    w0, w1, w2, w3 = w
    return BufferResource(
        base=w0 | (w1 & 0xFFFF) << 32,
        stride=(w1 >> 16) & 0x3FFF,
        cache_swizzle=bool(w1 >> 30 & 1),
        swizzle_enable=bool(w1 >> 31 & 1),
        num_records=w2,
        dst_sel=(w3 & 7, w3 >> 3 & 7, w3 >> 6 & 7, w3 >> 9 & 7),
        num_format=w3 >> 12 & 7,
        data_format=w3 >> 15 & 0xF,
        element_size=w3 >> 19 & 3,
        index_stride=w3 >> 21 & 3,
        add_tid_enable=bool(w3 >> 23 & 1),
        type=w3 >> 30 & 3,
        words=tuple(w),
    )


def encode_vsharp(base: int, num_records: int, *, stride: int = 0, word3: int = 0x27000,
                  swizzle_enable: bool = False, cache_swizzle: bool = False) -> tuple[int, int, int, int]:
    """Four dwords of a V# (default word3 is FlyDSL's: DATA_FORMAT 32, NUM_FORMAT FLOAT)."""
    if not 0 <= base < 1 << 48 or not 0 <= stride < 1 << 14:
        raise ValueError("base must fit 48 bits and stride 14 bits")
    w1 = (base >> 32) | stride << 16 | int(cache_swizzle) << 30 | int(swizzle_enable) << 31
    return base & _U32, w1, num_records & _U32, word3 & _U32


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    """(start, size) of the parts a buffer access is range-checked in: dwords, or one sub-dword."""
    return [(s, min(4, nbytes - s)) for s in range(0, nbytes, 4)]


def buffer_addresses(rsrc: BufferResource, vaddr_offset=None, vaddr_index=None, soffset: int = 0,
                     inst_offset: int = 0, offen: bool = False, idxen: bool = False, nbytes: int = 4,
                     lanes: int = WAVE) -> tuple[np.ndarray, np.ndarray]:
    """Per-lane addresses and range check of a MUBUF access.

    Returns ``(addrs uint64[lanes], in_range bool[lanes, ceil(nbytes/4)])``: one column per dword
    (a sub-dword access has one column). Addresses are computed even for out-of-range lanes.
    """
    if rsrc.swizzle_enable:
        raise NotImplementedError("swizzled buffer addressing (V# swizzle_enable) is not modelled")
    off = np.zeros(lanes, np.uint64)
    if offen:
        off = np.asarray(vaddr_offset, dtype=np.uint64) & np.uint64(_U32)
    off = (off + np.uint64(int(inst_offset) & _U32)) & np.uint64(_U32)
    idx = np.zeros(lanes, np.uint64)
    if idxen:
        idx = np.asarray(vaddr_index, dtype=np.uint64) & np.uint64(_U32)
    stride = rsrc.stride
    if rsrc.add_tid_enable:
        idx = idx + np.arange(lanes, dtype=np.uint64)
        stride |= rsrc.data_format << 14
    soff = np.uint64(int(soffset) & _U32)
    addrs = np.uint64(rsrc.base) + soff + off + idx * np.uint64(stride)
    pieces = _pieces(nbytes)
    if rsrc.add_tid_enable:
        in_range = np.ones((lanes, len(pieces)), bool)
    elif rsrc.stride != 0 and idxen:
        in_range = np.repeat((idx < np.uint64(rsrc.num_records))[:, None], len(pieces), axis=1)
    else:
        ends = np.array([s + n for s, n in pieces], np.uint64)
        in_range = (off + soff)[:, None] + ends[None, :] <= np.uint64(rsrc.num_records)
    return addrs, in_range


class BufferAccess(NamedTuple):
    data: np.ndarray | None  # uint8[64, nbytes] for loads, None for stores
    addrs: np.ndarray        # uint64[64] per-lane start addresses
    touched: np.ndarray      # bool[64]: active lanes with at least one in-range piece (for the trace)


def _live(rsrc, mask, nbytes, kw):
    addrs, in_range = buffer_addresses(rsrc, nbytes=nbytes, lanes=len(mask), **kw)
    return addrs, in_range & mask[:, None]


def _check_derived(mem, rsrc, addrs, live, nbytes: int, origin: str, what: str) -> None:
    """The provenance check of the bytes a MUBUF access really touches: its in-range dwords only
    (an out-of-range dword of a partly in-range access reads 0 / is dropped, so it touches nothing)."""
    if not hasattr(mem, "check_derived"):
        return
    touched = live.any(axis=1)
    if (live.all(axis=1) == touched).all():  # every touched lane whole: one check
        mem.check_derived(rsrc.base, addrs, touched, nbytes, origin, what)
        return
    for k, (s, n) in enumerate(_pieces(nbytes)):
        if live[:, k].any():
            mem.check_derived(rsrc.base, addrs + np.uint64(s), live[:, k], n, origin, what)


def _raw_in_range(rsrc: BufferResource, mask, nbytes: int, vaddr_offset, soffset: int, inst_offset: int,
                  offen: bool, idxen: bool):
    """Per-lane addresses of a raw (no ``idxen``, no swizzle, no ``add_tid``) MUBUF access whose
    every lane is wholly in range, or None (then :func:`buffer_addresses` does the general
    per-dword check). The same addresses and verdict as that check, at a fraction of the cost:
    one bound for the largest offset instead of one per lane and dword."""
    if idxen or rsrc.swizzle_enable or rsrc.add_tid_enable:
        return None
    inst = np.uint64(int(inst_offset) & _U32)
    if offen:
        off = np.asarray(vaddr_offset, dtype=np.uint64)
        if off.shape != mask.shape:
            return None
        off = (off & np.uint64(_U32)) + inst
        if int(off.max()) > _U32:
            return None   # a wrapped offset: the general path
    else:
        off = np.full(len(mask), inst, np.uint64)
    soff = int(soffset) & _U32
    if int(off.max()) + soff + nbytes > rsrc.num_records:
        return None
    return off + np.uint64(rsrc.base + soff)


def buffer_load(mem: GlobalMemory, rsrc: BufferResource, mask, nbytes: int, *, vaddr_offset=None,
                vaddr_index=None, soffset: int = 0, inst_offset: int = 0, offen: bool = False,
                idxen: bool = False, origin: str = "") -> BufferAccess:
    """MUBUF load: out-of-range dwords read 0; the in-range ones go through the sanitizer."""
    mask = _as_mask(mask)
    addrs = _raw_in_range(rsrc, mask, nbytes, vaddr_offset, soffset, inst_offset, offen, idxen)
    if addrs is not None:   # every lane in range: the whole access of every active lane
        if hasattr(mem, "check_derived"):
            mem.check_derived(rsrc.base, addrs, mask, nbytes, origin, "load")
        return BufferAccess(mem.load(addrs, mask, nbytes, origin), addrs, mask.copy())
    addrs, live = _live(rsrc, mask, nbytes, dict(
        vaddr_offset=vaddr_offset, vaddr_index=vaddr_index, soffset=soffset,
        inst_offset=inst_offset, offen=offen, idxen=idxen))
    _check_derived(mem, rsrc, addrs, live, nbytes, origin, "load")
    full = live.all(axis=1)
    if (full == mask).all():
        data = mem.load(addrs, mask, nbytes, origin)
    else:
        data = np.zeros((len(mask), nbytes), np.uint8)
        for k, (s, n) in enumerate(_pieces(nbytes)):
            if live[:, k].any():
                data[:, s:s + n] = mem.load(addrs + np.uint64(s), live[:, k], n, origin)
    return BufferAccess(data, addrs, live.any(axis=1))


def buffer_store(mem: GlobalMemory, rsrc: BufferResource, mask, data, *, vaddr_offset=None,
                 vaddr_index=None, soffset: int = 0, inst_offset: int = 0, offen: bool = False,
                 idxen: bool = False, origin: str = "") -> BufferAccess:
    """MUBUF store: out-of-range dwords are dropped; the in-range ones go through the sanitizer."""
    mask = _as_mask(mask)
    data = np.asarray(data, dtype=np.uint8)
    nbytes = data.shape[1]
    addrs = _raw_in_range(rsrc, mask, nbytes, vaddr_offset, soffset, inst_offset, offen, idxen)
    if addrs is not None:
        if hasattr(mem, "check_derived"):
            mem.check_derived(rsrc.base, addrs, mask, nbytes, origin, "store")
        mem.store(addrs, mask, data, origin)
        return BufferAccess(None, addrs, mask.copy())
    addrs, live = _live(rsrc, mask, nbytes, dict(
        vaddr_offset=vaddr_offset, vaddr_index=vaddr_index, soffset=soffset,
        inst_offset=inst_offset, offen=offen, idxen=idxen))
    _check_derived(mem, rsrc, addrs, live, nbytes, origin, "store")
    full = live.all(axis=1)
    if (full == mask).all():
        mem.store(addrs, mask, data, origin)
    else:
        for k, (s, n) in enumerate(_pieces(nbytes)):
            if live[:, k].any():
                mem.store(addrs + np.uint64(s), live[:, k], data[:, s:s + n], origin)
    return BufferAccess(None, addrs, live.any(axis=1))


def scalar_buffer_load(mem: GlobalMemory, rsrc: BufferResource, offset: int, ndwords: int,
                       origin: str = "") -> np.ndarray:
    """``s_buffer_load_dword*``: dwords at ``base + (offset & ~3)``; dwords past the buffer's byte
    size (``num_records * max(stride, 1)``) read 0, per dword like the vector path (an assumption:
    the scalar range rule is not spelled out in the sources we could check)."""
    off = int(offset) & _U32 & ~3
    limit = rsrc.num_records * max(rsrc.stride, 1)
    n_in = max(0, min(int(ndwords), (limit - off) // 4))
    out = np.zeros(int(ndwords), np.uint32)
    if n_in:
        out[:n_in] = mem.load_scalar(rsrc.base + off, n_in, origin)
    return out


# --------------------------------------------------------------------------------------------
# LDS
# --------------------------------------------------------------------------------------------


class LDS:
    """One workgroup's LDS: ``nbytes`` (static + dynamic group segment).

    ``oob="raise"`` (default): any active lane touching a byte at or past ``nbytes`` raises
    :class:`MemoryFault`. ``oob="hardware"``: such bytes read 0 and writes to them are dropped,
    the limit being ``nbytes`` rounded up to *arch*'s allocation granule (:data:`LDS_GRANULE`;
    without *arch*, the first of ``pa_tile.arch.ARCHS``), since the hardware gives the workgroup
    the whole last granule.
    ``fill`` is the initial byte (hardware LDS starts with garbage; a loud pattern helps).
    """

    def __init__(self, nbytes: int, *, oob: str = "raise", fill: int = 0, arch: str | None = None):
        if oob not in ("raise", "hardware"):
            raise ValueError(f"oob must be 'raise' or 'hardware', got {oob!r}")
        if arch is not None and nbytes > LDS_MAX_BYTES[arch]:
            raise ValueError(f"{nbytes} B of LDS exceeds {arch}'s {LDS_MAX_BYTES[arch]} B per workgroup")
        self.nbytes = int(nbytes)
        self.oob = oob
        granule = LDS_GRANULE[arch or _arch.ARCHS[0]]
        self.limit = self.nbytes if oob == "raise" else -(-self.nbytes // granule) * granule
        self.data = np.full(self.limit, fill, np.uint8)

    def _check(self, a, lanes, nbytes, origin, what):
        bad = a + nbytes > self.limit
        if bad.any():
            lane, addr = int(lanes[bad][0]), int(a[bad][0])
            msg = (f"{origin or '<unknown origin>'}: LDS {what} of {nbytes} B by lane {lane} at "
                   f"{addr:#x} is outside the workgroup's {self.nbytes}-byte LDS allocation "
                   f"({int(bad.sum())} of {len(a)} active lanes out of bounds)")
            raise MemoryFault(msg, origin=origin, space="lds", lane=lane, address=addr, nbytes=nbytes,
                              bad_lanes=lanes[bad].tolist())

    def read(self, addrs, mask, nbytes: int, origin: str = "") -> np.ndarray:
        """``uint8[64, nbytes]`` from byte addresses (inactive lanes are 0)."""
        addrs = np.asarray(addrs).astype(np.int64)
        mask = _as_mask(mask, addrs.shape[0])
        out = np.zeros((addrs.shape[0], nbytes), np.uint8)
        lanes = np.flatnonzero(mask)
        if lanes.size == 0:
            return out
        a = addrs[lanes]
        idx = a[:, None] + _arange(nbytes)
        if self.oob == "raise":
            self._check(a, lanes, nbytes, origin, "read")
            out[lanes] = self.data[idx]
        else:
            ok = (idx >= 0) & (idx < self.limit)
            out[lanes] = np.where(ok, self.data[np.where(ok, idx, 0)], 0)
        return out

    def write(self, addrs, mask, data, origin: str = "") -> None:
        """Store ``data[lane, :]`` for active lanes; same byte from several lanes: highest lane wins."""
        addrs = np.asarray(addrs).astype(np.int64)
        mask = _as_mask(mask, addrs.shape[0])
        data = np.asarray(data, dtype=np.uint8)
        nbytes = data.shape[1]
        lanes = np.flatnonzero(mask)
        if lanes.size == 0:
            return
        a = addrs[lanes]
        idx = a[:, None] + _arange(nbytes)
        if self.oob == "raise":
            self._check(a, lanes, nbytes, origin, "write")
            self.data[idx] = data[lanes]
        else:
            ok = (idx >= 0) & (idx < self.limit)
            self.data[idx[ok]] = data[lanes][ok]


# --------------------------------------------------------------------------------------------
# bank-conflict model
# --------------------------------------------------------------------------------------------


def _groups(*ranges) -> list[list[int]]:
    return [[lane for lo, hi in g for lane in range(lo, hi + 1)] for g in ranges]


_GFX942_READ_B128 = _groups(
    ((0, 3), (20, 23)), ((32, 35), (52, 55)), ((4, 7), (16, 19)), ((36, 39), (48, 51)),
    ((8, 11), (28, 31)), ((40, 43), (60, 63)), ((12, 15), (24, 27)), ((44, 47), (56, 59)))
_GFX950_READ_B128 = _groups(
    ((0, 3), (12, 15), (20, 23), (24, 27)), ((32, 35), (44, 47), (52, 55), (56, 59)),
    ((4, 7), (8, 11), (16, 19), (28, 31)), ((36, 39), (40, 43), (48, 51), (60, 63)))


def _contiguous(size: int) -> list[list[int]]:
    return [list(range(s, s + size)) for s in range(0, WAVE, size)]


def _phase_model(arch: str, ndwords: int, write: bool) -> tuple[int, list[list[int]]]:
    """(banks, lane groups served together) for an access of ``ndwords`` dwords per lane."""
    if arch == "gfx950" and not write and ndwords != 3:
        return 64, {1: _contiguous(64), 2: _contiguous(32), 4: _GFX950_READ_B128}[ndwords]
    if arch not in LDS_BANKS:
        raise ValueError(f"no LDS bank model for {arch!r}")
    if ndwords == 1:
        return 32, _contiguous(32)
    if ndwords == 2:
        return 32, _contiguous(16)
    return 32, _contiguous(8) if write else _GFX942_READ_B128


_PHASE_CACHE: dict = {}


def _phase_table(arch, ndwords, write):
    key = (arch, ndwords, write)
    t = _PHASE_CACHE.get(key)
    if t is None:
        banks, groups = _phase_model(arch, ndwords, write)
        phase = np.empty(WAVE, np.int64)
        for p, g in enumerate(groups):
            phase[g] = p
        t = _PHASE_CACHE[key] = (banks, len(groups), phase)
    return t


def bank_conflicts(addrs, mask, nbytes: int, *, arch: str = "gfx942", write: bool = False) -> np.ndarray:
    """Per-phase conflict degree (``int[phases]``, 0 for phases with no active lane)."""
    mask = _as_mask(mask)
    ndw = min(4, max(1, -(-nbytes // 4)))
    banks, nph, phase = _phase_table(arch, ndw, write)
    lanes = np.flatnonzero(mask)
    if lanes.size == 0:
        return np.zeros(nph, np.int64)
    a = np.asarray(addrs).astype(np.int64)[lanes]
    first = a >> 2
    if nbytes % 4 == 0 and not (a & 3).any():
        key = ((phase[lanes] << 40)[:, None] + first[:, None] + _arange(nbytes // 4)).ravel()
    else:
        last = (a + nbytes - 1) >> 2
        d = first[:, None] + _arange(int((last - first).max()) + 1)
        valid = d <= last[:, None]
        key = ((phase[lanes] << 40)[:, None] + d)[valid]
    key.sort()
    key = key[np.concatenate(([True], key[1:] != key[:-1]))]
    ph_u, d_u = key >> 40, key & ((1 << 40) - 1)
    counts = np.bincount(ph_u * banks + d_u % banks, minlength=nph * banks)
    return counts.reshape(nph, banks).max(axis=1)


# --------------------------------------------------------------------------------------------
# trace
# --------------------------------------------------------------------------------------------


def distinct_bytes(addrs, mask, nbytes: int) -> int:
    """Bytes in the union of the active lanes' ``[addr, addr + nbytes)``: what one wave instruction
    asks the memory system for (lanes reading the same bytes, e.g. a wave-uniform page id, are
    one request, as the texture unit merges them)."""
    lanes = np.flatnonzero(_as_mask(mask))
    if lanes.size == 0:
        return 0
    a = np.sort(np.asarray(addrs, dtype=np.int64)[lanes])
    return int(nbytes + np.minimum(np.diff(a), nbytes).sum())


def coalescing_lines(addrs, mask, nbytes: int, bases=None) -> int:
    """Distinct 128-byte lines (:data:`LINE_BYTES`) touched by the active lanes, counted from the
    start of the region each address lies in (``bases``: the regions' sorted start addresses, as
    :meth:`Trace.set_regions` keeps them) or from address 0 (``bases=None``)."""
    lanes = np.flatnonzero(_as_mask(mask))
    if lanes.size == 0:
        return 0
    a = np.asarray(addrs, dtype=np.uint64)[lanes]
    tag = np.zeros_like(a)
    if bases is not None and len(bases):
        idx = np.searchsorted(bases, a, side="right") - 1
        inside = idx >= 0
        base = np.where(inside, bases[np.maximum(idx, 0)], np.uint64(0))
        tag = np.where(inside, (idx + 1).astype(np.uint64), np.uint64(0)) << np.uint64(48)
        a = a - base
    seven = np.uint64(7)
    first, last = a >> seven, (a + np.uint64(nbytes - 1)) >> seven
    return int(np.unique(np.concatenate([tag | first, tag | last])).size)


class Trace:
    """Dynamic instruction counts and per-access memory statistics.

    The core calls :meth:`count` once per executed instruction, then :meth:`global_access` /
    :meth:`lds_access` for the memory instructions (ds_read2/write2: once per address).
    Scalar memory loads (``s_load_*``, ``s_buffer_load_*``; ``global_access(kind="scalar")`` or
    :meth:`scalar_access`) are one address per wave, not a per-lane access pattern: they are kept
    apart (:meth:`scalar_accesses`, rows with ``space="scalar"`` and no coalescing figures in
    :meth:`summary`) so they never dilute the global/buffer coalescing statistics. Every record
    carries ``seq``, the number of instructions counted so far, so any window of the dynamic stream
    can be summarised: place :meth:`mark` calls (e.g. from a breakpoint on a label, or by the
    notebook between launches) and ask for ``summary(*trace.window("tile", i))``.
    :meth:`grouped_summary` / :meth:`grouped_table` merge the lines of one instruction that access
    memory alike (optionally per prologue / loop / epilogue): the short form a chapter prints.
    :meth:`stop`/:meth:`start` pause recording; ``waves`` restricts recording to some wave ids
    (only when the core passes ``wave=``). ``keep_stream=True`` also stores the mnemonic of every
    instruction so counts over arbitrary windows are available. ``count_lines=True`` also counts
    executions of every instruction by its assembly line and wave (:attr:`line_counts`,
    ``(line, wave) -> n``): which basic blocks ran, and how often.
    """

    def __init__(self, arch: str = "gfx942", *, waves=None, keep_stream: bool = False, count_lines: bool = False):
        if arch not in LDS_BANKS:
            raise ValueError(f"unknown arch {arch!r}")
        self.arch = arch
        self.seq = 0
        self.counts: dict[str, int] = {}
        self.recording = True
        self.waves = None if waves is None else set(waves)
        self.stream: list[str] | None = [] if keep_stream else None
        self.stream_seq: list[int] | None = [] if keep_stream else None
        self.marks: list[tuple[str, int, dict]] = []
        self.global_records: list[tuple] = []
        self.lds_records: list[tuple] = []
        self.scalar_records: list[tuple] = []
        self.line_counts: dict[tuple, int] | None = {} if count_lines else None
        #: sorted start addresses of the current launch's memory regions (:meth:`set_regions`)
        self.bases: np.ndarray | None = None

    def set_regions(self, regions) -> None:
        """Count the next accesses' 128-byte lines from the start of the region each lies in.
        ``regions``: ``(base, nbytes, name)`` items (a launch's ``regions``); the emulator's
        launcher calls this before each launch it traces."""
        self.bases = np.array(sorted({int(r[0]) for r in regions}), dtype=np.uint64)

    def _on(self, wave) -> bool:
        return self.recording and (self.waves is None or wave is None or wave in self.waves)

    # -- recording -------------------------------------------------------------------------

    def count(self, mnemonic: str, wave=None, line=None) -> None:
        self.seq += 1
        if self.recording and (self.waves is None or wave is None or wave in self.waves):
            c = self.counts
            c[mnemonic] = c.get(mnemonic, 0) + 1
            if self.line_counts is not None and line is not None:
                lc = self.line_counts
                lc[(line, wave)] = lc.get((line, wave), 0) + 1
            if self.stream is not None:
                self.stream.append(mnemonic)
                self.stream_seq.append(self.seq)

    def start(self) -> None:
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    def mark(self, name: str) -> int:
        """Remember the current point of the stream (and the counts so far) under ``name``."""
        self.marks.append((name, self.seq, dict(self.counts)))
        return self.seq

    def global_access(self, mnemonic: str, line, addrs, mask, nbytes: int, *, kind: str = "global",
                      write: bool = False, wave=None) -> None:
        """One global_/buffer_ access: ``mask`` = lanes that really touch memory.

        ``kind="scalar"`` (the core's SMEM loads: the address in lane 0) goes to
        :meth:`scalar_access` instead."""
        if kind == "scalar":
            a = np.asarray(addrs).reshape(-1)
            lanes = np.flatnonzero(_as_mask(mask, a.size)) if a.size > 1 else np.zeros(1, np.int64)
            self.scalar_access(mnemonic, line, int(a[lanes[0]]) if lanes.size else int(a[0]), nbytes, wave=wave)
            return
        if kind not in ("global", "buffer"):
            raise ValueError(f"kind must be 'global', 'buffer' or 'scalar', got {kind!r}")
        if not self._on(wave):
            return
        mask = _as_mask(mask)
        lanes = int(mask.sum())
        n_lines = coalescing_lines(addrs, mask, nbytes, self.bases) if lanes else 0
        distinct = distinct_bytes(addrs, mask, nbytes) if lanes else 0
        self.global_records.append((self.seq, wave, mnemonic, line, kind, write, lanes, nbytes, n_lines, distinct))

    def scalar_access(self, mnemonic: str, line, addr: int, nbytes: int, *, wave=None) -> None:
        """One scalar memory load: ``nbytes`` from one address for the whole wave."""
        if self._on(wave):
            self.scalar_records.append((self.seq, wave, mnemonic, line, int(addr), int(nbytes)))

    def lds_access(self, mnemonic: str, line, addrs, mask, nbytes: int, *, write: bool = False,
                   wave=None) -> None:
        if not self._on(wave):
            return
        mask = _as_mask(mask)
        per_phase = bank_conflicts(addrs, mask, nbytes, arch=self.arch, write=write)
        degree = int(per_phase.max()) if per_phase.size else 0
        cycles = int(np.maximum(per_phase - 1, 0).sum())
        self.lds_records.append((self.seq, wave, mnemonic, line, write, int(mask.sum()), nbytes,
                                 degree, cycles))

    # -- windows ---------------------------------------------------------------------------

    def windows(self, name: str) -> list[tuple[int, int]]:
        """``(start, stop)`` between consecutive marks called ``name`` (last one runs to now)."""
        seqs = [s for n, s, _ in self.marks if n == name]
        return [(s, seqs[i + 1] if i + 1 < len(seqs) else self.seq) for i, s in enumerate(seqs)]

    def window(self, name: str, index: int = 0) -> tuple[int, int]:
        return self.windows(name)[index]

    @staticmethod
    def _inside(seq, start, stop) -> bool:
        return (start is None or seq > start) and (stop is None or seq <= stop)

    # -- reports ---------------------------------------------------------------------------

    def instruction_counts(self, start: int | None = None, stop: int | None = None) -> list[dict]:
        """``[{mnemonic, count}]``, most frequent first, for instructions with start < seq <= stop."""
        if start is None and stop is None:
            counts = self.counts
        elif self.stream is not None:
            counts = {}
            for s, m in zip(self.stream_seq, self.stream):
                if self._inside(s, start, stop):
                    counts[m] = counts.get(m, 0) + 1
        else:
            counts = self._counts_from_marks(start, stop)
        return [{"mnemonic": m, "count": c}
                for m, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c]

    def _counts_from_marks(self, start, stop):
        snaps = {s: c for _, s, c in self.marks}
        snaps.setdefault(self.seq, self.counts)
        if (start is not None and start not in snaps) or (stop is not None and stop not in snaps):
            raise ValueError("counts over a window need marks at both ends (or Trace(keep_stream=True))")
        lo = snaps[start] if start is not None else {}
        hi = snaps[stop] if stop is not None else self.counts
        return {m: c - lo.get(m, 0) for m, c in hi.items()}

    def accesses(self, start: int | None = None, stop: int | None = None) -> list[dict]:
        """Every recorded vector memory access (global, buffer, LDS) as a dict, in execution
        order. Scalar loads are in :meth:`scalar_accesses`."""
        rows = []
        for seq, wave, m, line, kind, write, lanes, nb, n_lines, distinct in self.global_records:
            if self._inside(seq, start, stop):
                rows.append(dict(seq=seq, wave=wave, mnemonic=m, line=line, space=kind, write=write,
                                 lanes=lanes, bytes_per_lane=nb, bytes=lanes * nb, distinct_bytes=distinct,
                                 lines_128B=n_lines,
                                 min_lines_128B=-(-lanes * nb // LINE_BYTES)))
        for seq, wave, m, line, write, lanes, nb, degree, cycles in self.lds_records:
            if self._inside(seq, start, stop):
                rows.append(dict(seq=seq, wave=wave, mnemonic=m, line=line, space="lds", write=write,
                                 lanes=lanes, bytes_per_lane=nb, bytes=lanes * nb,
                                 conflict_degree=degree, conflict_cycles=cycles))
        rows.sort(key=lambda r: r["seq"])
        return rows

    def scalar_accesses(self, start: int | None = None, stop: int | None = None) -> list[dict]:
        """Every recorded scalar memory load as a dict (``space="scalar"``), in execution order."""
        return [dict(seq=seq, wave=wave, mnemonic=m, line=line, space="scalar", write=False, address=addr,
                     bytes=nb)
                for seq, wave, m, line, addr, nb in self.scalar_records if self._inside(seq, start, stop)]

    def summary(self, start: int | None = None, stop: int | None = None) -> list[dict]:
        """Per-instruction aggregates keyed by ``(mnemonic, line)``, sorted by line.

        Global/buffer rows: executions, active lanes (mean), bytes (active lanes x width),
        distinct_bytes (per execution, lanes reading the same bytes counted once), lines_128B
        (128-byte lines touched), min_lines_128B and ``efficiency = min_lines_128B / lines_128B``. LDS rows: executions, bytes, max/mean conflict
        degree and total conflict cycles. Scalar rows (``space="scalar"``): executions and bytes
        only, since one scalar load is not a coalescing event.
        """
        agg: dict = {}
        for r in self.accesses(start, stop) + self.scalar_accesses(start, stop):
            key = (r["space"], r["mnemonic"], r["line"])
            a = agg.get(key)
            if a is None:
                a = agg[key] = dict(mnemonic=r["mnemonic"], line=r["line"], space=r["space"],
                                    executions=0, lanes=0, bytes=0)
                if r["space"] == "lds":
                    a.update(max_degree=0, degree_sum=0, conflict_cycles=0)
                elif r["space"] != "scalar":
                    a.update(lines_128B=0, min_lines_128B=0, distinct_bytes=0)
            a["executions"] += 1
            a["lanes"] += r.get("lanes", 0)
            a["bytes"] += r["bytes"]
            if r["space"] == "scalar":
                pass
            elif r["space"] == "lds":
                a["max_degree"] = max(a["max_degree"], r["conflict_degree"])
                a["degree_sum"] += r["conflict_degree"]
                a["conflict_cycles"] += r["conflict_cycles"]
            else:
                a["lines_128B"] += r["lines_128B"]
                a["min_lines_128B"] += r["min_lines_128B"]
                a["distinct_bytes"] += r["distinct_bytes"]
        out = []
        for a in agg.values():
            n = a["executions"]
            lanes = a.pop("lanes")
            if a["space"] == "scalar":
                out.append(a)
                continue
            a["mean_lanes"] = lanes / n
            if a["space"] == "lds":
                a["mean_degree"] = a.pop("degree_sum") / n
            else:
                a["efficiency"] = a["min_lines_128B"] / a["lines_128B"] if a["lines_128B"] else 1.0
            out.append(a)
        out.sort(key=lambda a: (a["line"] is not None, a["line"] if isinstance(a["line"], int) else 0,
                                str(a["line"]), a["mnemonic"], a["space"]))
        return out

    def grouped_summary(self, start: int | None = None, stop: int | None = None, *, phases=None,
                        shapes: bool = True, merge_scalar: bool = False) -> list[dict]:
        """:meth:`summary` with the instruction lines that do the same thing merged into one row.

        A kernel issues the same access from many lines (16 ``buffer_load_dwordx4`` of K and V, a
        dozen ``ds_read_b128``); this is the short table that says what they do. Lines are grouped
        by ``(phase, space, mnemonic, shape)``:

        * ``phases``: ``None`` (no phase) or a sequence of ``(name, first_line, last_line)`` ranges
          (inclusive; e.g. prologue / loop / epilogue from ``pa_tile.isa.loop_phases``). A line in
          no range has phase ``None``.
        * ``shapes=True`` keeps lines apart whose access differs per execution: bytes, 128-byte
          lines and minimum lines (global/buffer), bytes and worst conflict degree (LDS).
          A broadcast load then never hides among coalesced ones. ``shapes=False`` merges them
          (the per-execution figures become means). Scalar loads group by mnemonic only, or
          all into one row per phase named ``"scalar loads"`` with ``merge_scalar=True``.

        Each row: ``phase`` (only with ``phases``), ``space``, ``mnemonic``, ``lines`` (how many
        instruction lines), ``first_line``/``last_line`` (integer lines only, else None),
        ``executions``, ``bytes`` and ``bytes_per_exec``; global/buffer rows add ``lines_128B``,
        ``min_lines_128B`` (totals), ``lines_128B_per_exec``, ``min_lines_128B_per_exec``,
        ``efficiency`` (``min_lines_128B / lines_128B``) and ``distinct_bytes``; LDS rows ``max_degree``,
        ``mean_degree`` (per execution) and ``conflict_cycles``. Per-execution figures are ints
        when whole. Totals equal those of :meth:`summary`. Rows are ordered by phase (the order
        of ``phases``, lines in no range last), then global, buffer, LDS, scalar, then first line.
        """
        ranges = [(name, int(lo), int(hi)) for name, lo, hi in (phases or ())]
        order = {name: i for i, (name, _, _) in reversed(list(enumerate(ranges)))}  # a name's first range

        def phase_of(line):
            if isinstance(line, int):
                for name, lo, hi in ranges:
                    if lo <= line <= hi:
                        return name
            return None

        def per(total, n):
            return total // n if total % n == 0 else total / n

        groups: dict = {}
        for r in self.summary(start, stop):
            n, space = r["executions"], r["space"]
            if not shapes or space == "scalar":
                shape = ()
            elif space == "lds":
                shape = (per(r["bytes"], n), r["max_degree"])
            else:
                shape = (per(r["bytes"], n), per(r["lines_128B"], n), per(r["min_lines_128B"], n))
            phase = phase_of(r["line"])
            mnemonic = "scalar loads" if merge_scalar and space == "scalar" else r["mnemonic"]
            groups.setdefault((phase, space, mnemonic, shape), []).append(r)
        out = []
        for (phase, space, mnemonic, _), rows in groups.items():
            ints = [r["line"] for r in rows if isinstance(r["line"], int)]
            n = sum(r["executions"] for r in rows)
            a = dict(phase=phase, space=space, mnemonic=mnemonic, lines=len(rows),
                     first_line=min(ints) if ints else None, last_line=max(ints) if ints else None,
                     executions=n, bytes=sum(r["bytes"] for r in rows))
            a["bytes_per_exec"] = per(a["bytes"], n)
            if mnemonic == "scalar loads" and not isinstance(a["bytes_per_exec"], int):
                a["bytes_per_exec"] = None  # loads of several widths: no one figure per execution
            if space == "lds":
                a["max_degree"] = max(r["max_degree"] for r in rows)
                a["mean_degree"] = sum(r["mean_degree"] * r["executions"] for r in rows) / n
                a["conflict_cycles"] = sum(r["conflict_cycles"] for r in rows)
            elif space != "scalar":
                for k in ("lines_128B", "min_lines_128B", "distinct_bytes"):
                    a[k] = sum(r[k] for r in rows)
                a["lines_128B_per_exec"] = per(a["lines_128B"], n)
                a["min_lines_128B_per_exec"] = per(a["min_lines_128B"], n)
                a["efficiency"] = a["min_lines_128B"] / a["lines_128B"] if a["lines_128B"] else 1.0
            if phases is None:
                del a["phase"]
            out.append(a)
        rank = {"global": 0, "buffer": 1, "lds": 2, "scalar": 3}
        out.sort(key=lambda a: (order.get(a.get("phase"), len(order)), rank.get(a["space"], 4), a["first_line"] is None,
                                a["first_line"] or 0, a["mnemonic"]))
        return out

    #: the columns of :meth:`grouped_table`, and their headers
    #: (``instrs``: instruction lines merged; ``lines/exec``: 128-byte lines; ``conflict``: the worst
    #: LDS bank-conflict degree; ``extra cycles``: what conflicts cost, all executions)
    GROUPED_COLUMNS = {"phase": "phase", "mnemonic": "mnemonic", "lines": "instrs", "executions": "execs",
                       "bytes_per_exec": "B/exec", "lines_128B_per_exec": "lines/exec",
                       "min_lines_128B_per_exec": "min lines", "max_degree": "conflict",
                       "conflict_cycles": "extra cycles"}

    def grouped_table(self, start: int | None = None, stop: int | None = None, *, phases=None,
                      shapes: bool = True, merge_scalar: bool = True) -> str:
        """:meth:`grouped_summary` as a plain-text table (scalar loads merged by default): per
        row the instruction lines it merges and their executions, then per execution the bytes,
        the 128-byte lines touched and the fewest possible (global/buffer), or the worst bank
        conflict degree and the conflict cycles of all executions (LDS)."""
        rows = self.grouped_summary(start, stop, phases=phases, shapes=shapes, merge_scalar=merge_scalar)
        cols = [c for c in self.GROUPED_COLUMNS if c != "phase" or phases is not None]
        return format_table(rows, cols, headers=self.GROUPED_COLUMNS)


class AddressTrace(Trace):
    """A :class:`Trace` that also keeps the active lanes' byte addresses of every global access,
    ``addresses``: ``[(mnemonic, int64 array), ...]`` in execution order (chapters 03 and 04 draw
    where one load's lanes fall)."""

    def __init__(self, arch):
        super().__init__(arch)
        self.addresses = []

    def global_access(self, mnemonic, line, addrs, mask, nbytes, **kw):
        super().global_access(mnemonic, line, addrs, mask, nbytes, **kw)
        self.addresses.append((mnemonic, np.asarray(addrs, np.int64)[np.asarray(mask, bool)]))


def format_table(rows: list[dict], columns: Sequence[str] | None = None, floatfmt: str = ".2f",
                 headers: dict | None = None) -> str:
    """Plain-text table of a list of dicts (no pandas needed); ``headers`` renames columns."""
    if not rows:
        return "(empty)"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))

    def cell(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    names = [(headers or {}).get(c, c) for c in cols]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(names)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(names, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) if v[:1].isdigit() or v[:1] == "-" else v.ljust(w)
                        for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
