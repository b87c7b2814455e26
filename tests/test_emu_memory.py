"""pa_tile.emu.memory: sanitizer regions and faults, buffer range checks, V# decode, LDS, trace."""

import numpy as np
import pytest
import torch

from pa_tile import arch as pa_arch
from pa_tile.emu.memory import (
    LDS, OVERREAD_POISON, GlobalMemory, MemoryFault, Trace, bank_conflicts, buffer_addresses, buffer_load, buffer_store,
    coalescing_lines, decode_vsharp, encode_vsharp, format_table, scalar_buffer_load)

ALL = np.ones(64, bool)
LANE = np.arange(64)


def _region(t: torch.Tensor, name: str):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes(), name


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


@pytest.fixture
def arena():
    """Two regions with a known gap, so 'nearest region' is deterministic."""
    buf = np.zeros(16384, np.uint8)
    base = buf.ctypes.data
    mem = GlobalMemory([(base, 4096, "a"), (base + 8192, 1024, "b")])
    return buf, base, mem


@pytest.fixture
def tensors():
    a = torch.arange(1024, dtype=torch.int32)            # 4096 B
    b = torch.arange(256, dtype=torch.float32) * 0.5     # 1024 B
    return a, b, GlobalMemory([_region(a, "a"), _region(b, "b")])


# ---------------------------------------------------------------- global memory


@pytest.mark.parametrize("nbytes", [1, 2, 4, 8, 12, 16])
def test_load_matches_tensor_bytes(tensors, nbytes):
    a, _, mem = tensors
    base = a.data_ptr()
    offs = (LANE * 37) % (4096 - nbytes)
    mask = LANE % 3 != 0
    got = mem.load(base + offs.astype(np.uint64), mask, nbytes, "k:1 global_load")
    raw = _bytes(a)
    want = np.stack([raw[o:o + nbytes] for o in offs])
    assert got.dtype == np.uint8 and got.shape == (64, nbytes)
    np.testing.assert_array_equal(got[mask], want[mask])
    assert not got[~mask].any()


def test_dword_view_of_load(tensors):
    a, _, mem = tensors
    got = mem.load(a.data_ptr() + LANE.astype(np.uint64) * 16, ALL, 16).view(np.uint32)
    np.testing.assert_array_equal(got, a.numpy().reshape(-1, 4)[:64].astype(np.uint32))


def test_store_writes_tensor_and_respects_mask(tensors):
    a, _, mem = tensors
    before = a.clone()
    mask = LANE < 32
    data = np.repeat(np.arange(64, dtype=np.uint32)[:, None] + 1000, 2, axis=1).view(np.uint8)
    mem.store(a.data_ptr() + LANE.astype(np.uint64) * 8, mask, data, "k:2 global_store_dwordx2")
    got = a.numpy()
    np.testing.assert_array_equal(got[:64], np.repeat(np.arange(32) + 1000, 2))
    np.testing.assert_array_equal(got[64:], before.numpy()[64:])


def test_one_access_spanning_two_tensors(tensors):
    a, b, mem = tensors
    addrs = np.where(LANE < 32, a.data_ptr() + LANE * 4, b.data_ptr() + (LANE - 32) * 4).astype(np.uint64)
    got = mem.load(addrs, ALL, 4).view(np.uint32)[:, 0]
    np.testing.assert_array_equal(got[:32], np.arange(32))
    np.testing.assert_array_equal(got[32:].view(np.float32), np.arange(32) * 0.5)
    mem.store(addrs, ALL, np.zeros((64, 4), np.uint8))
    assert (a[:32] == 0).all() and (b[:32] == 0).all() and a[32] == 32


def test_planted_out_of_bounds_load_names_lane_and_address(arena):
    _, base, mem = arena
    end = base + 4096
    addrs = (base + LANE * 16).astype(np.uint64)
    addrs[37] = end + 48
    with pytest.raises(MemoryFault) as ei:
        mem.load(addrs, ALL, 16, "pa_decode:123 global_load_dwordx4")
    f = ei.value
    msg = str(f)
    assert f.lane == 37 and f.address == end + 48 and f.space == "global"
    assert "pa_decode:123 global_load_dwordx4" in msg
    assert "lane 37" in msg and f"{end + 48:#x}" in msg
    assert "'a'" in msg and "48 B past its end" in msg
    assert "1 of 64 active lanes" in msg
    assert f.nearest[0] == "a"


def test_fault_only_for_active_lanes_and_straddles(arena):
    buf, base, mem = arena
    end = base + 4096
    addrs = (base + LANE * 16).astype(np.uint64)
    addrs[5] = 16  # garbage address in an inactive lane is fine
    mask = LANE != 5
    mem.load(addrs, mask, 16)
    addrs[9] = end - 8  # starts inside, runs 8 B past the end
    with pytest.raises(MemoryFault, match="lane 9") as ei:
        mem.store(addrs, mask, np.ones((64, 16), np.uint8), "k:7 global_store_dwordx4")
    assert "runs 8 B past its end" in str(ei.value)
    assert not buf.any()  # a faulting store writes nothing, not even the good lanes
    mem.load(addrs, mask, 8)  # the same address is fine for 8 bytes
    addrs[9] = base + 7000    # in the gap between 'a' and 'b'
    with pytest.raises(MemoryFault, match="nearest region 'b'.*starts 1192 B before it"):
        mem.load(addrs, mask, 4)


def test_touching_regions_do_not_merge():
    mem = GlobalMemory()
    base, buf = mem.alloc(256, "lo", align=256)
    mem.add_region(base + 256, 0, "empty")   # empty regions are ignored
    other = np.zeros(512, np.uint8)
    hi = other.ctypes.data
    lo = GlobalMemory([(hi, 256, "x"), (hi + 256, 256, "y")])
    lo.load(np.full(64, hi + 240, np.uint64), ALL, 16)
    with pytest.raises(MemoryFault, match="'x'"):
        lo.load(np.full(64, hi + 248, np.uint64), ALL, 16)
    # overlapping registrations (two views of one storage) merge into one region
    lo.add_region(hi + 200, 100, "view")
    assert [n for _, _, n in lo.regions] == ["x+view+y"]
    lo.load(np.full(64, hi + 248, np.uint64), ALL, 16)


def test_alloc_and_scalar_loads():
    mem = GlobalMemory()
    addr, buf = mem.alloc(64, "kernarg")
    assert addr % 256 == 0 and mem.find(addr + 5) == ("kernarg", 5)
    buf[:] = np.arange(64, dtype=np.uint8)
    got = mem.load_scalar(addr + 8, 4, "k:0 s_load_dwordx4")
    np.testing.assert_array_equal(got, buf[8:24].view(np.uint32))
    np.testing.assert_array_equal(mem.load_scalar(addr + 10, 1), buf[8:12].view(np.uint32))  # low bits ignored
    with pytest.raises(MemoryFault, match=r"k:9 s_load_dwordx8: scalar load of 32 B at") as ei:
        mem.load_scalar(addr + 48, 8, "k:9 s_load_dwordx8")
    assert ei.value.lane is None and "'kernarg'" in str(ei.value)


def test_no_regions_faults():
    with pytest.raises(MemoryFault, match="no memory regions"):
        GlobalMemory().load(np.full(64, 4096, np.uint64), ALL, 4, "k:1 x")


# ---------------------------------------------------------------- buffer resources


def test_decode_flydsl_vsharp():
    r = decode_vsharp([0x12345678, 0x00009ABC, 0xFFFFFFFF, 0x00027000])
    assert r.base == 0x9ABC12345678 and r.stride == 0 and r.num_records == 0xFFFFFFFF
    assert r.num_format == 7 and r.data_format == 4   # FLOAT, 32
    assert r.dst_sel == (0, 0, 0, 0) and not r.add_tid_enable and not r.swizzle_enable and r.type == 0


def test_decode_fields_roundtrip():
    w3 = 4 | 5 << 3 | 6 << 6 | 7 << 9 | 2 << 12 | 0xB << 15 | 3 << 21 | 1 << 23 | 0 << 30
    words = encode_vsharp(0xFEDC_BA98_7654, 1000, stride=0x2ABC, word3=w3, swizzle_enable=True,
                          cache_swizzle=True)
    r = decode_vsharp(np.array(words, np.uint32))
    assert (r.base, r.stride, r.num_records) == (0xFEDC_BA98_7654, 0x2ABC, 1000)
    assert r.swizzle_enable and r.cache_swizzle
    assert r.dst_sel == (4, 5, 6, 7) and r.num_format == 2 and r.data_format == 0xB
    assert r.index_stride == 3 and r.add_tid_enable
    assert words[1] >> 16 & 0x3FFF == 0x2ABC


def test_raw_buffer_range_is_per_dword():
    base = 0x1000
    r = decode_vsharp(encode_vsharp(base, 64))
    voff = np.array([0, 48, 52, 56, 60, 64] + [0] * 58, np.uint32)
    addrs, ok = buffer_addresses(r, voff, None, soffset=0, inst_offset=0, offen=True, nbytes=16)
    assert addrs[3] == base + 56
    assert ok[:6].tolist() == [[True] * 4, [True] * 4, [True, True, True, False],
                              [True, True, False, False], [True, False, False, False], [False] * 4]
    # soffset counts toward the limit, inst_offset too; voffset + inst_offset wraps at 32 bits
    _, ok = buffer_addresses(r, voff, None, soffset=8, inst_offset=0, offen=True, nbytes=4)
    assert ok[:6, 0].tolist() == [True, True, True, False, False, False]
    addrs, ok = buffer_addresses(r, np.full(64, 0xFFFFFFF0, np.uint32), None, 0, 0x20, True, False, 4)
    assert addrs[0] == base + 0x10 and ok[0, 0]
    # sub-dword: the whole access must fit
    _, ok = buffer_addresses(r, np.full(64, 63, np.uint32), None, 0, 0, True, False, 2)
    assert ok.shape == (64, 1) and not ok[0, 0]


def test_strided_buffer_checks_index_only():
    r = decode_vsharp(encode_vsharp(0x2000, 10, stride=48))
    idx = np.arange(64, dtype=np.uint32)
    addrs, ok = buffer_addresses(r, np.full(64, 100, np.uint32), idx, 4, 8, offen=True, idxen=True,
                                 nbytes=8)
    assert addrs[3] == 0x2000 + 4 + 108 + 3 * 48
    assert ok[:, 0].tolist() == (idx < 10).tolist() and (ok[:, 0] == ok[:, 1]).all()
    # a strided buffer addressed by offset only is checked in bytes
    _, ok = buffer_addresses(r, np.full(64, 6, np.uint32), None, 0, 0, True, False, 8)
    assert ok[0].tolist() == [True, False]


def test_add_tid_buffer():
    r = decode_vsharp(encode_vsharp(0x4000, 0, stride=16, word3=0x27000 | 1 << 23))
    addrs, ok = buffer_addresses(r, None, None, 0, 4, False, False, 4)
    assert addrs[5] == 0x4000 + 4 + 5 * (16 | 4 << 14) and ok.all()
    with pytest.raises(NotImplementedError):
        buffer_addresses(decode_vsharp(encode_vsharp(0, 4, swizzle_enable=True)))


def test_buffer_load_store_oob_semantics():
    data = np.arange(256, dtype=np.uint8)
    mem = GlobalMemory()
    addr, buf = mem.alloc(256, "t")
    buf[:] = data
    rsrc = decode_vsharp(encode_vsharp(addr, 72))   # only the first 72 of 256 bytes are "the buffer"
    voff = (LANE * 8).astype(np.uint32)
    mask = LANE % 2 == 0
    res = buffer_load(mem, rsrc, mask, 16, vaddr_offset=voff, offen=True, origin="k:3 buffer_load_dwordx4")
    for lane in range(12):
        o = lane * 8
        want = np.zeros(16, np.uint8)
        if mask[lane]:
            n = max(0, min(16, (72 - o) // 4 * 4))
            want[:n] = data[o:o + n]
        np.testing.assert_array_equal(res.data[lane], want, err_msg=f"lane {lane}")
    assert not res.data[12:].any()
    assert res.touched.tolist() == (mask & (voff < 72)).tolist()
    # lane 8 (offset 64) straddles: dwords at 64, 68 land, 72 and 76 are dropped
    src = np.full((64, 16), 0xEE, np.uint8)
    st = buffer_store(mem, rsrc, LANE == 8, src, vaddr_offset=voff, offen=True, origin="k:4 buffer_store_dwordx4")
    assert (buf[64:72] == 0xEE).all() and (buf[72:80] == data[72:80]).all()
    assert st.data is None and st.touched.sum() == 1
    # fully out-of-range lanes never reach memory, even far outside any region
    far = np.full(64, 1 << 30, np.uint32)
    assert not buffer_load(mem, rsrc, ALL, 4, vaddr_offset=far, offen=True).data.any()


def test_flydsl_vsharp_still_sanitized():
    mem = GlobalMemory()
    addr, buf = mem.alloc(128, "k_cache")
    rsrc = decode_vsharp(encode_vsharp(addr, 0xFFFFFFFF))
    voff = (LANE * 16).astype(np.uint32)   # 64 lanes x 16 B = 1024 B > 128 B tensor
    with pytest.raises(MemoryFault, match=r"k:9 buffer_load_dwordx4: load of 16 B by lane 8 .*'k_cache'"):
        buffer_load(mem, rsrc, ALL, 16, vaddr_offset=voff, offen=True, origin="k:9 buffer_load_dwordx4")
    res = buffer_load(mem, rsrc, LANE < 8, 16, vaddr_offset=voff, offen=True)
    np.testing.assert_array_equal(res.data[:8].reshape(-1), buf)


def test_overread_lets_a_load_run_past_its_region_and_reads_poison(arena):
    # GlobalMemory(overread=n): a load that starts inside a region may run up to n bytes past its
    # end; those bytes read OVERREAD_POISON (0xFF), never the host memory that follows
    buf, base, _ = arena
    buf[:] = np.arange(16384) % 251
    mem = GlobalMemory([(base, 4096, "a"), (base + 8192, 1024, "b")], overread=8)
    addrs = (base + LANE * 16).astype(np.uint64)
    addrs[9] = base + 4096 - 8          # straddles a's end by 8 B: allowed
    addrs[10] = base + 8192 + 1024 - 4  # straddles b's end by 12 B in a 16-B load...
    with pytest.raises(MemoryFault, match="lane 10"):   # ...is 4 B more than the slack
        mem.load(addrs, ALL, 16)
    addrs[10] = base + 8192 + 1024 - 12  # b's last 12 B and 4 B past it
    d = mem.load(addrs, ALL, 16)
    np.testing.assert_array_equal(d[9, :8], buf[4088:4096])
    assert (d[9, 8:] == OVERREAD_POISON).all() and OVERREAD_POISON == 0xFF
    np.testing.assert_array_equal(d[10, :12], buf[9204:9216])
    assert (d[10, 12:] == 0xFF).all()
    assert mem.overreads == 2   # lanes 9 and 10 used the slack
    for lane in (0, 8, 63):   # lanes inside 'a' read it as before
        np.testing.assert_array_equal(d[lane], buf[lane * 16:lane * 16 + 16])
    # only loads: the same straddling store is a fault and writes nothing
    with pytest.raises(MemoryFault, match="lane 9"):
        mem.store(addrs, LANE == 9, np.zeros((64, 16), np.uint8))
    assert buf[4088] == 4088 % 251
    # a load that starts at or past the end is no over-read: still a fault
    with pytest.raises(MemoryFault, match="0 B past its end"):
        mem.load(np.full(64, base + 4096, np.uint64), LANE == 3, 4)
    # the default is no slack at all
    with pytest.raises(MemoryFault, match="runs 8 B past its end"):
        GlobalMemory([(base, 4096, "a")]).load(np.full(64, base + 4088, np.uint64), ALL, 16)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="overread"):
            GlobalMemory([], overread=bad)


def test_overread_of_a_buffer_load_past_its_descriptors_region():
    # a full-size V# (FlyDSL's max_size buffers) over a 100-B tensor: a vec4 load by a lane whose
    # first bytes are the tensor's last ones straddles the tensor's end. With no slack that is the
    # descriptor-provenance fault; with overread it reads the tensor's bytes, then poison.
    mem0 = GlobalMemory()
    addr, buf = mem0.alloc(100, "inp")
    buf[:] = np.arange(100)
    rsrc = decode_vsharp(encode_vsharp(addr, 0xFFFFFFFF))
    voff = np.zeros(64, np.uint32)
    voff[5] = 88
    with pytest.raises(MemoryFault, match="lane 5 .*leaves the region its descriptor's base"):
        buffer_load(mem0, rsrc, LANE == 5, 16, vaddr_offset=voff, offen=True, origin="k:1 buffer_load_dwordx4")
    mem = GlobalMemory(mem0.regions, overread=14)
    mem._owned = mem0._owned
    res = buffer_load(mem, rsrc, LANE == 5, 16, vaddr_offset=voff, offen=True)
    np.testing.assert_array_equal(res.data[5, :12], np.arange(88, 100))
    assert (res.data[5, 12:] == 0xFF).all() and not res.data[4].any()
    voff[5] = 92   # 8 B of tensor, 8 past: within 14
    assert (buffer_load(mem, rsrc, LANE == 5, 16, vaddr_offset=voff, offen=True).data[5, 8:] == 0xFF).all()
    voff[5] = 84 + 16 - 1   # starts 1 B before the end, runs 15 B past: more than the slack
    with pytest.raises(MemoryFault):
        buffer_load(mem, rsrc, LANE == 5, 16, vaddr_offset=voff, offen=True)
    with pytest.raises(MemoryFault):   # stores never get the slack
        buffer_store(mem, rsrc, LANE == 5, np.zeros((64, 16), np.uint8), vaddr_offset=np.full(64, 92, np.uint32),
                     offen=True)


def test_scalar_buffer_load():
    mem = GlobalMemory()
    addr, buf = mem.alloc(64, "params")
    buf[:] = np.arange(64, dtype=np.uint8)
    rsrc = decode_vsharp(encode_vsharp(addr, 24))
    got = scalar_buffer_load(mem, rsrc, 17, 4, "k:1 s_buffer_load_dwordx4")
    np.testing.assert_array_equal(got, np.r_[buf[16:24].view(np.uint32), 0, 0])


# ---------------------------------------------------------------- LDS


def test_lds_roundtrip_and_bounds():
    lds = LDS(1024, arch="gfx942")
    addrs = (LANE * 16).astype(np.uint32)
    data = np.arange(64 * 16, dtype=np.uint32).astype(np.uint8).reshape(64, 16)
    lds.write(addrs, ALL, data, "k:5 ds_write_b128")
    np.testing.assert_array_equal(lds.read(addrs, ALL, 16), data)
    np.testing.assert_array_equal(lds.read(addrs + 4, LANE < 63, 4)[:63], data[:63, 4:8])
    bad = addrs.copy()
    bad[63] = 1016   # 1016 + 16 > 1024
    with pytest.raises(MemoryFault) as ei:
        lds.read(bad, ALL, 16, "k:6 ds_read_b128")
    f = ei.value
    assert f.space == "lds" and f.lane == 63 and f.address == 1016
    assert "k:6 ds_read_b128" in str(f) and "lane 63" in str(f) and "0x3f8" in str(f)
    assert "1024-byte LDS allocation" in str(f)
    lds.read(bad, LANE != 63, 16)
    with pytest.raises(MemoryFault, match="lane 0"):
        lds.write(np.full(64, 4096, np.uint32), ALL, data)
    with pytest.raises(ValueError):
        LDS(65 * 1024, arch="gfx942")
    LDS(160 * 1024, arch="gfx950")


def test_lds_hardware_mode():
    lds = LDS(1000, oob="hardware", fill=0xAB)
    assert lds.limit == 1024
    addrs = np.full(64, 1016, np.uint32)
    got = lds.read(addrs, ALL, 16)
    assert (got[:, :8] == 0xAB).all() and (got[:, 8:] == 0).all()
    lds.write(np.full(64, 1020, np.uint32), LANE == 0, np.full((64, 8), 7, np.uint8))
    assert (lds.data[1020:1024] == 7).all() and lds.data.size == 1024


@pytest.mark.parametrize("arch, limit", [("gfx942", 1024), ("gfx950", 1280)])
def test_lds_hardware_mode_rounds_to_the_arch_granule(arch, limit):
    # gfx942 allocates LDS in 128-dword blocks, gfx950 in 320-dword ones (LLVM getLdsDwGranularity;
    # llvm-project PR 208046): bytes up to the block's end are the workgroup's own on hardware
    lds = LDS(1000, oob="hardware", arch=arch)
    assert lds.limit == limit == -(-1000 // pa_arch.INFO[arch].lds_granule) * pa_arch.INFO[arch].lds_granule
    lds.write(np.full(64, limit - 4, np.uint32), LANE == 0, np.full((64, 4), 9, np.uint8))
    assert (lds.data[limit - 4:limit] == 9).all()
    assert (lds.read(np.full(64, limit, np.uint32), ALL, 4) == 0).all()
    assert LDS(1000, arch=arch).limit == 1000     # the default mode faults past the allocation


# ---------------------------------------------------------------- coalescing and banks


def test_line_counts():
    """128-byte lines (the vL1D / L2 line of both targets) a wave's access touches."""
    base = 1 << 20
    assert coalescing_lines(base + LANE * 16, ALL, 16) == 8      # 1 KiB contiguous
    assert coalescing_lines(base + LANE * 4, ALL, 4) == 2
    assert coalescing_lines(base + LANE * 64, ALL, 4) == 32      # a dword every 64 B: two per line
    assert coalescing_lines(base + LANE * 256, ALL, 16) == 64
    assert coalescing_lines(base + 8 + LANE * 16, ALL, 16) == 9   # misaligned by 8 B
    assert coalescing_lines(np.full(64, base, np.uint64), ALL, 16) == 1
    assert coalescing_lines(base + LANE * 16, LANE < 8, 16) == 1
    assert coalescing_lines(base + LANE * 16, np.zeros(64, bool), 16) == 0


def test_lines_are_counted_from_the_start_of_each_region():
    """A tensor the host put 64 bytes past a line boundary still reads 1 KiB as 8 lines once its
    region is known (a GPU allocation starts line-aligned); two regions' lines never merge."""
    base = (1 << 20) + 64
    assert coalescing_lines(base + LANE * 16, ALL, 16) == 9
    bases = np.array([base, base + 4096], np.uint64)
    assert coalescing_lines(base + LANE * 16, ALL, 16, bases) == 8
    two = np.where(LANE < 32, base + 4096 - 64 + LANE * 2, base + 4096 + LANE * 2).astype(np.uint64)
    assert coalescing_lines(two, ALL, 2, bases) == 2
    t = Trace("gfx942")
    t.set_regions([(base, 4096, "k"), (base + 4096, 4096, "v")])
    t.global_access("global_load_dwordx4", 1, base + LANE * 16, ALL, 16)
    assert t.summary()[0]["lines_128B"] == 8


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_bank_conflicts_b32(arch):
    def deg(addrs, nbytes=4, write=False, mask=ALL):
        return int(bank_conflicts(addrs, mask, nbytes, arch=arch, write=write).max())
    assert deg(LANE * 4) == 1
    assert deg(LANE * 128) == 32          # stride 32 dwords
    assert deg(LANE * 132) == 1           # padded stride 33
    assert deg(np.zeros(64)) == 1         # broadcast
    assert deg(LANE * 8) == 2             # stride 2 dwords
    assert deg(LANE * 256, mask=LANE < 4) == 4
    assert deg(LANE * 128, mask=LANE < 4) == {"gfx942": 4, "gfx950": 2}[arch]   # 32 vs 64 banks
    assert deg(LANE * 128, write=True) == 32


def test_bank_conflicts_sub_dword_and_unaligned():
    deg = lambda a, n: int(bank_conflicts(a, ALL, n, arch="gfx942").max())
    assert deg(LANE * 2, 2) == 1            # two lanes per dword: same dword, no conflict
    assert deg(LANE * 128, 1) == 32         # distinct dwords, all on bank 0
    assert deg(LANE * 8 + 2, 8) == 2        # each lane touches 3 dwords; dwords 0 and 32 meet
    assert deg(LANE * 8, 8) == 1


def test_bank_conflict_phase_models_differ_by_arch():
    b942 = lambda a, n, w=False: int(bank_conflicts(a, ALL, n, arch="gfx942", write=w).max())
    b950 = lambda a, n, w=False: int(bank_conflicts(a, ALL, n, arch="gfx950", write=w).max())
    for f in (b942, b950):
        assert f(LANE * 16, 16) == 1 and f(LANE * 16, 16, True) == 1 and f(LANE * 8, 8) == 1
    assert b942(LANE * 128, 8) == 16 and b950(LANE * 128, 8) == 16
    assert b942(LANE * 256, 16) == 8 and b950(LANE * 256, 16) == 16
    # gfx942 ds_read_b128 serves quads {0,5},{1,4},{2,7},{3,6} together, ds_write_b128 octets:
    q = LANE // 4
    half = ((q % 8) + (q % 8 >= 4)) % 2
    addrs = (LANE % 4) * 16 + half * 64 + q * 128
    assert b942(addrs, 16, True) == 1
    assert b942(addrs, 16) == 2
    assert int(bank_conflicts(LANE * 4, ALL, 4, arch="gfx950").size) == 1   # one 64-lane phase


# ---------------------------------------------------------------- trace


def _run_fake_kernel(t: Trace):
    base = 1 << 24
    for tile in range(2):
        t.mark("tile")
        for _ in range(3):
            t.count("v_add_u32")
        t.count("global_load_dwordx4")
        t.global_access("global_load_dwordx4", 10, base + LANE * 16, ALL, 16)
        t.count("buffer_load_dword")
        t.global_access("buffer_load_dword", 11, base + LANE * 64, LANE < (32 if tile else 64), 4,
                        kind="buffer")
        t.count("ds_read_b32")
        t.lds_access("ds_read_b32", 12, LANE * (128 if tile else 4), ALL, 4)
        t.count("ds_write_b128")
        t.lds_access("ds_write_b128", 13, LANE * 16, ALL, 16, write=True)


def test_trace_summary_and_windows():
    t = Trace("gfx942")
    _run_fake_kernel(t)
    assert t.seq == 14
    assert t.instruction_counts()[0] == {"mnemonic": "v_add_u32", "count": 6}
    rows = {(r["mnemonic"], r["line"]): r for r in t.summary()}
    g = rows[("global_load_dwordx4", 10)]
    assert (g["executions"], g["bytes"], g["lines_128B"], g["min_lines_128B"], g["efficiency"]) == (2, 2048, 16, 16, 1.0)
    b = rows[("buffer_load_dword", 11)]
    assert b["space"] == "buffer" and b["lines_128B"] == 32 + 16 and b["min_lines_128B"] == 2 + 1
    assert b["mean_lanes"] == 48
    r = rows[("ds_read_b32", 12)]
    assert (r["max_degree"], r["mean_degree"], r["conflict_cycles"]) == (32, 16.5, 62)
    assert rows[("ds_write_b128", 13)]["max_degree"] == 1
    assert [x["line"] for x in t.summary()] == [10, 11, 12, 13]
    # second tile only
    w = t.window("tile", 1)
    assert w == (7, 14)
    rows1 = {(r["mnemonic"], r["line"]): r for r in t.summary(*w)}
    assert rows1[("ds_read_b32", 12)]["executions"] == 1 and rows1[("ds_read_b32", 12)]["max_degree"] == 32
    assert rows1[("buffer_load_dword", 11)]["bytes"] == 128
    counts = {c["mnemonic"]: c["count"] for c in t.instruction_counts(*t.window("tile", 0))}
    assert counts == {"v_add_u32": 3, "global_load_dwordx4": 1, "buffer_load_dword": 1,
                      "ds_read_b32": 1, "ds_write_b128": 1}
    with pytest.raises(ValueError, match="marks"):
        t.instruction_counts(3, 9)
    assert len(t.accesses(*w)) == 4 and t.accesses()[0]["seq"] == 4
    table = format_table(t.summary(), ["mnemonic", "line", "lines_128B", "efficiency"])
    assert "global_load_dwordx4" in table and "0.06" in table.splitlines()[3]


def test_trace_stream_waves_and_pause():
    t = Trace("gfx950", keep_stream=True, waves={0})
    t.count("s_mov_b32", wave=0)
    t.count("s_mov_b32", wave=1)            # other wave: counted in seq, not recorded
    t.global_access("global_load_dwordx4", 1, LANE * 16, ALL, 16, wave=1)
    t.stop()
    t.count("v_mov_b32", wave=0)
    t.lds_access("ds_read_b32", 2, LANE * 4, ALL, 4, wave=0)
    t.start()
    t.count("v_mov_b32", wave=0)
    assert t.seq == 4 and t.counts == {"s_mov_b32": 1, "v_mov_b32": 1}
    assert not t.global_records and not t.lds_records
    assert t.instruction_counts(2, 4) == [{"mnemonic": "v_mov_b32", "count": 1}]
    t.lds_access("ds_read_b32", 2, LANE * 256, ALL, 4, wave=0)
    assert t.lds_records[-1][7] == 64    # 64 banks, one phase: all lanes on bank 0


def test_scalar_loads_are_reported_apart_from_vector_coalescing():
    t = Trace("gfx942")
    _run_fake_kernel(t)
    vector_summary = t.summary()
    # the core reports SMEM loads through global_access(kind="scalar"), address in lane 0 only
    lane0 = np.zeros(64, bool)
    lane0[0] = True
    addrs = np.zeros(64, np.uint64)
    addrs[0] = 0x1000
    for _ in range(3):
        t.count("s_load_dwordx4")
        t.global_access("s_load_dwordx4", 5, addrs, lane0, 16, kind="scalar", wave=0)
    t.count("s_load_dword")
    t.scalar_access("s_load_dword", 6, 0x1010, 4)
    assert len(t.scalar_records) == 4 and len(t.global_records) == 4  # vector records unchanged
    assert all(a["space"] != "scalar" for a in t.accesses())
    sc = t.scalar_accesses()
    assert [(a["mnemonic"], a["address"], a["bytes"], a["wave"]) for a in sc] == (
        [("s_load_dwordx4", 0x1000, 16, 0)] * 3 + [("s_load_dword", 0x1010, 4, None)])
    rows = t.summary()
    scalar_rows = [r for r in rows if r["space"] == "scalar"]
    assert scalar_rows == [dict(mnemonic="s_load_dwordx4", line=5, space="scalar", executions=3, bytes=48),
                           dict(mnemonic="s_load_dword", line=6, space="scalar", executions=1, bytes=4)]
    # vector rows are exactly what they were before any scalar load
    assert [r for r in rows if r["space"] != "scalar"] == vector_summary
    assert "scalar" in format_table(rows)
    # windows apply to scalar loads too; a paused trace records none
    assert len(t.scalar_accesses(t.seq - 1, t.seq)) == 1
    t.stop()
    t.scalar_access("s_load_dword", 6, 0x1010, 4)
    assert len(t.scalar_records) == 4
    with pytest.raises(ValueError, match="kind"):
        t.global_access("global_load_dword", 7, LANE * 4, ALL, 4, kind="flat")


def _run_grouped_kernel(t: Trace):
    """Lines 20-22: three coalesced dwordx4 loads; 23: the same instruction, every lane reading one
    16-byte piece (a broadcast); 30-31: two conflict-free ds_read_b32; 32: a 32-way conflicting one;
    5-6: scalar loads. Two waves, so every line runs twice."""
    base = 1 << 24
    for wave in range(2):
        for line in (20, 21, 22):
            t.global_access("buffer_load_dwordx4", line, base + line * 1024 + LANE * 16, ALL, 16, kind="buffer",
                            wave=wave)
        t.global_access("buffer_load_dwordx4", 23, np.full(64, base, np.uint64), ALL, 16, kind="buffer", wave=wave)
        for line in (30, 31):
            t.lds_access("ds_read_b32", line, LANE * 4, ALL, 4, wave=wave)
        t.lds_access("ds_read_b32", 32, LANE * 128, ALL, 4, wave=wave)
        t.scalar_access("s_load_dwordx4", 5, 0x1000, 16, wave=wave)
        t.scalar_access("s_load_dword", 6, 0x1010, 4, wave=wave)


def _totals(rows, space):
    keys = ("executions", "bytes") + (("max_degree", "conflict_cycles") if space == "lds" else
                                      ("lines_128B", "min_lines_128B", "distinct_bytes") if space != "scalar" else ())
    picked = [r for r in rows if r["space"] == space]
    return {k: (max if k == "max_degree" else sum)(r[k] for r in picked) for k in keys}


@pytest.mark.parametrize("kernel", [_run_fake_kernel, _run_grouped_kernel])
@pytest.mark.parametrize("kw", [{}, dict(shapes=False), dict(phases=[("a", 0, 11), ("b", 12, 99)]),
                                dict(merge_scalar=True)])
def test_grouped_summary_totals_equal_the_per_line_summary(kernel, kw):
    t = Trace("gfx942")
    kernel(t)
    lines, grouped = t.summary(), t.grouped_summary(**kw)
    assert sum(g["lines"] for g in grouped) == len(lines)
    for space in ("global", "buffer", "lds", "scalar"):
        assert _totals(grouped, space) == _totals(lines, space), space


def test_grouped_summary_merges_lines_of_one_shape_and_shows_conflicts():
    t = Trace("gfx942")
    _run_grouped_kernel(t)
    rows = t.grouped_summary()
    assert [(r["mnemonic"], r["lines"], r["executions"]) for r in rows] == [
        ("buffer_load_dwordx4", 3, 6), ("buffer_load_dwordx4", 1, 2), ("ds_read_b32", 2, 4), ("ds_read_b32", 1, 2),
        ("s_load_dwordx4", 1, 2), ("s_load_dword", 1, 2)]
    coalesced, broadcast, lds_ok, lds_bad = rows[:4]
    assert (coalesced["bytes_per_exec"], coalesced["lines_128B_per_exec"], coalesced["min_lines_128B_per_exec"],
            coalesced["efficiency"], coalesced["first_line"], coalesced["last_line"]) == (1024, 8, 8, 1.0, 20, 22)
    assert (broadcast["lines_128B_per_exec"], broadcast["min_lines_128B_per_exec"], broadcast["distinct_bytes"]) == (1, 8, 32)
    assert (lds_ok["max_degree"], lds_ok["conflict_cycles"]) == (1, 0)
    # lanes 128 B apart: every dword on bank 0, two 32-lane phases on gfx942
    assert (lds_bad["max_degree"], lds_bad["mean_degree"], lds_bad["conflict_cycles"]) == (32, 32.0, 2 * 2 * 31)
    assert "phase" not in coalesced and "lines_128B" not in lds_bad and "max_degree" not in coalesced
    # shapes=False: one row per mnemonic, the per-execution figures become means
    merged = {r["mnemonic"]: r for r in t.grouped_summary(shapes=False)}
    assert merged["buffer_load_dwordx4"]["lines"] == 4 and merged["buffer_load_dwordx4"]["lines_128B_per_exec"] == 6.25
    assert merged["ds_read_b32"]["max_degree"] == 32 and merged["ds_read_b32"]["mean_degree"] == 34 / 3
    # merge_scalar: one row for every scalar load, no per-execution width when widths differ
    sc = [r for r in t.grouped_summary(merge_scalar=True) if r["space"] == "scalar"]
    assert [(r["mnemonic"], r["lines"], r["executions"], r["bytes"], r["bytes_per_exec"]) for r in sc] == [
        ("scalar loads", 2, 4, 40, 10)]
    t.scalar_access("s_load_dwordx2", 7, 0x1020, 8)
    sc = [r for r in t.grouped_summary(merge_scalar=True) if r["space"] == "scalar"]
    assert [(r["lines"], r["executions"], r["bytes"], r["bytes_per_exec"]) for r in sc] == [(3, 5, 48, None)]


def test_grouped_summary_phases():
    t = Trace("gfx942")
    _run_grouped_kernel(t)
    ranges = [("loop", 21, 31), ("prologue", 0, 20)]  # the order given is the order of the rows
    rows = t.grouped_summary(phases=ranges)
    assert [(r["phase"], r["mnemonic"], r["lines"], r["first_line"]) for r in rows] == [
        ("loop", "buffer_load_dwordx4", 2, 21), ("loop", "buffer_load_dwordx4", 1, 23), ("loop", "ds_read_b32", 2, 30),
        ("prologue", "buffer_load_dwordx4", 1, 20), ("prologue", "s_load_dwordx4", 1, 5),
        ("prologue", "s_load_dword", 1, 6),
        (None, "ds_read_b32", 1, 32)]   # outside every range: last
    halves = t.grouped_summary(phases=[("early", 0, 29), ("late", 30, 99)])
    assert [r["phase"] for r in halves] == ["early"] * 4 + ["late"] * 2
    assert halves[-1]["max_degree"] == 32 and halves[-2]["max_degree"] == 1
    # a window selects executions, as in summary
    assert all(r["executions"] == 1 for r in t.grouped_summary(0, 8))


def test_grouped_table_and_headers():
    t = Trace("gfx942")
    _run_grouped_kernel(t)
    text = t.grouped_table()
    head = text.splitlines()[0].split()
    assert head[:4] == ["mnemonic", "instrs", "execs", "B/exec"] and "phase" not in head
    assert head[4:] == ["lines/exec", "min", "lines", "conflict", "extra", "cycles"]  # 128-byte lines
    assert len(text.splitlines()) == 2 + 5   # two dwordx4 shapes, two ds_read_b32 shapes, one scalar row
    row = next(ln for ln in text.splitlines() if ln.startswith("ds_read_b32") and " 32 " in ln)
    assert row.split()[-2:] == ["32", "124"]
    phased = t.grouped_table(phases=[("prologue", 0, 20), ("loop", 21, 99)])
    assert phased.splitlines()[0].startswith("phase") and phased.splitlines()[2].startswith("prologue")
    assert format_table([dict(a=1)], ["a"], headers=dict(a="the a")).splitlines()[0] == "the a"


@pytest.mark.parametrize("nbytes", [1, 2, 4, 8, 12, 16])
def test_buffer_fast_path_agrees_with_the_per_dword_check(nbytes):
    # buffer_load/store take a shortcut when every lane of a raw access is wholly in range; near
    # num_records, with soffset, inst_offset and wrapping offsets they must give what the general
    # per-dword path gives (buffer_addresses + per-piece loads)
    from pa_tile.emu import memory as mm

    rng = np.random.default_rng(nbytes)
    mem = GlobalMemory()
    addr, buf = mem.alloc(4096, "t")
    buf[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    for num_records, soff, inst, offen, spread in [(4096, 0, 0, True, 4000), (300, 4, 8, True, 320),
                                                    (300, 16, 0, False, 0), (0xFFFFFFFF, 0, 64, True, 2000),
                                                    (1000, 0, 4, True, 1100)]:
        rsrc = decode_vsharp(encode_vsharp(addr, num_records))
        voff = (rng.integers(0, max(spread, 1), 64) & ~3).astype(np.uint32) if offen else None
        if voff is not None and num_records == 0xFFFFFFFF:
            voff[7] = 0xFFFFFFF0   # wraps with inst_offset 64 -> offset 48
        mask = rng.random(64) < 0.8
        kw = dict(vaddr_offset=voff, soffset=soff, inst_offset=inst, offen=offen)
        got = buffer_load(mem, rsrc, mask, nbytes, **kw)
        addrs, in_range = buffer_addresses(rsrc, nbytes=nbytes, **kw)
        live = in_range & mask[:, None]
        want = np.zeros((64, nbytes), np.uint8)
        for k, (s, n) in enumerate(mm._pieces(nbytes)):
            for lane in np.flatnonzero(live[:, k]):
                o = int(addrs[lane]) - addr + s
                want[lane, s:s + n] = buf[o:o + n]
        np.testing.assert_array_equal(got.data, want)
        np.testing.assert_array_equal(got.addrs, addrs)
        assert got.touched.tolist() == live.any(axis=1).tolist()
    # a wholly in-range store (the shortcut) writes exactly the active lanes' bytes
    rsrc = decode_vsharp(encode_vsharp(addr, 4096))
    voff = (LANE * 32).astype(np.uint32)
    data = np.full((64, nbytes), 0xAB, np.uint8)
    before = buf.copy()
    st = buffer_store(mem, rsrc, LANE % 3 == 0, data, vaddr_offset=voff, offen=True)
    for lane in range(64):
        seg = buf[lane * 32:lane * 32 + nbytes]
        assert (seg == 0xAB).all() if lane % 3 == 0 else (seg == before[lane * 32:lane * 32 + nbytes]).all()
    assert st.touched.tolist() == (LANE % 3 == 0).tolist()
