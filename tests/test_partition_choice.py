"""The default split-K partition count is the timing model's (``s6.choose_num_partitions``,
looked up in ``pa_tile/data/partition_table.json``, written by ``scripts/partition_table.py``):
pinned choices, the lookup's rules, and (in the emulator) that the table is the model's argmin."""

import pytest

from pa_tile import backend
from pa_tile.perf import hw
from pa_tile.stages import s6_split_k as s6

ARCHS = ("gfx942", "gfx950")


def test_table_covers_both_parts_and_says_what_it_is():
    t = s6.partition_table()
    assert "PREDICTIONS" in t["model"]
    for arch, gpu in (("gfx942", "mi300x"), ("gfx942", "mi308x"), ("gfx950", "mi355x")):
        configs = [c for c in t["configs"] if c["gpu"] == gpu]
        assert configs and all(c["arch"] == arch and c["cu_count"] == hw.HARDWARE[gpu].compute_units
                               for c in configs)
        for c in configs:
            assert len(c["best"]) == len(t["seq_heads"]) and all(len(r) == len(t["tiles"]) for r in c["best"])
            assert all(1 <= p <= min(s6.MAX_PARTITIONS, tl) for r in c["best"] for p, tl in zip(r, t["tiles"]))


@pytest.mark.parametrize("arch", ARCHS)
def test_pinned_model_choices(arch):
    # 3 sequences x 1027 tokens, 16 heads over 1 KV head, 4 query tokens (64 rows): the model
    # predicts one tile per partition (5) ~1.5x faster than none ("fastest"), but its partials
    # would load 1.58x the compulsory bytes: the default, capped at 1.05x, does not split; nor
    # does the rule of thumb's budget
    assert s6.choose_num_partitions(3, 1, 1027, arch=arch, group=16, query_length=4, policy="fastest") == 5
    assert s6.choose_num_partitions(3, 1, 1027, arch=arch, group=16, query_length=4) == 1
    assert s6.choose_num_partitions(3, 1, 1027, arch=arch, group=16, query_length=4, policy="budget") == 1
    # 8 rows: the cap allows 2 of the model's 5
    assert s6.choose_num_partitions(3, 1, 1027, arch=arch, group=8) == 2
    # one long sequence on 8 KV heads (128 tiles): a wide split, three tiles a partition, not the
    # kernel's 64: past that the reduce's grouped loads and the partials' bytes win nothing
    # (predicted on MI300X 506 us unsplit, 47.3 at 22, 41.2 at 32, 39.6 at 43, 41.3 at 64; MI355X
    # 431 / 39.1 / 33.8 / 32.6 / 32.3, 64 within MIN_GAIN). Before the reduce waited once per four
    # partitions (chapter 07), its per-partition wait held this at 22 (MI300X) and 32 (MI355X)
    assert s6.choose_num_partitions(1, 8, 32768, arch=arch) == 43
    # nothing to split
    assert s6.choose_num_partitions(1, 1, 256, arch=arch) == 1
    assert s6.choose_num_partitions(1, 1, 1, arch=arch) == 1
    # a big batch of short contexts: the grid is full, partials would only add bytes
    assert s6.choose_num_partitions(1024, 8, 1024, arch=arch) == 1


def test_a_part_between_tabled_ones_is_read_at_its_workgroups_per_cu():
    """A 228-CU gfx942 part (MI300A) is read off the nearest tabled part, the 304-CU MI300X, at
    304/228 times the sequences: 3 sequences there are 4 on the MI300X."""
    for n, ctx in ((8, 4096), (64, 16384), (3, 1027)):
        assert (s6.choose_num_partitions(3 * n, 1, ctx, arch="gfx942", cu_count=228)
                == s6.choose_num_partitions(4 * n, 1, ctx, arch="gfx942"))


def test_an_80_cu_gfx942_part_has_its_own_table():
    """The MI308X has the MI300X's HBM on 80 CUs (3.8x the bandwidth per CU), so the model does
    not see it as a MI300X with 3.8x the sequences: at 16 x 16k tokens it predicts 16 partitions
    (39 us) where the MI300X's block read at 61 sequences gives 5 (71 us on the MI308X)."""
    assert s6.choose_num_partitions(16, 1, 16384, arch="gfx942", cu_count=80) == 16
    assert s6.choose_num_partitions(61, 1, 16384, arch="gfx942") == 5


def test_the_cap_takes_the_largest_even_split_within_it():
    for n, kvh, ctx, g, ql in ((3, 1, 1027, 8, 1), (81, 1, 1027, 32, 4), (4, 8, 4096, 8, 2), (1, 8, 32768, 8, 1)):
        fastest = s6.choose_num_partitions(n, kvh, ctx, arch="gfx942", group=g, query_length=ql, policy="fastest")
        p = s6.choose_num_partitions(n, kvh, ctx, arch="gfx942", group=g, query_length=ql)
        assert p <= fastest and (p == 1 or s6.within_traffic_cap(n, kvh, ctx, p, group=g, query_length=ql))
        tiles = -(-ctx // 256)
        larger = [q for q in range(p + 1, fastest + 1) if -(-tiles // -(-tiles // q)) == q]
        assert not any(s6.within_traffic_cap(n, kvh, ctx, q, group=g, query_length=ql) for q in larger)


def test_policy_is_checked():
    with pytest.raises(ValueError, match="policy"):
        s6.choose_num_partitions(1, 1, 1000, arch="gfx942", policy="quickest")
    with pytest.raises(ValueError, match="arch"):
        s6.choose_num_partitions(1, 1, 1000, arch="gfx90a")


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the model samples the kernel in the emulator")
def test_table_is_the_models_argmin():
    """At a few grid points of MI300X and one of MI308X, head_dim 128, group 8: the table's pick
    is the fastest the model predicts (larger counts must win by more than the table's MIN_GAIN)."""
    from pa_tile.perf import model
    from pa_tile.perf.roofline import DecodeShape

    t = s6.partition_table()
    probe = DecodeShape(batch=1, context=1024, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    smp = model.sample_stage("s6", probe, "gfx942")
    for gpu, n, tiles in (("mi300x", 1, 16), ("mi300x", 4, 5), ("mi300x", 64, 64), ("mi300x", 1024, 4),
                          ("mi308x", 16, 64)):
        c = next(c for c in t["configs"] if c["gpu"] == gpu and c["head_dim"] == 128 and c["group"] == 8
                 and c["query_length"] == 1)
        i, j = t["seq_heads"].index(n), t["tiles"].index(tiles)
        shape = DecodeShape(batch=n, context=tiles * 256, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
        times = {}
        for p in sorted({-(-tiles // -(-tiles // p)) for p in t["candidates"] if p <= tiles}):
            # the table is made over the uniform split (scripts/partition_table.py: model.predict's
            # default grid); on these even batches a balanced split cuts the same chunks
            times[p] = model.predict_stage("s6", shape, gpu, sample=smp, partitions=p,
                                           schedule="uniform").predicted_us
        pick = 1
        for p in sorted(times):
            if times[p] < times[pick] * (1 - t["min_gain"]):
                pick = p
        assert c["best"][i][j] == pick, (gpu, n, tiles, times)


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the model samples the kernel in the emulator")
def test_m_tile_split_verdict_of_the_model():
    """Chapter 06, "M-tiles per workgroup" (MODEL predictions): with 64 query rows a KV head
    (4 tokens x group 16) over 8k tokens, one M-tile per workgroup (4 M-groups, K/V read 4x) is
    predicted faster at one sequence and slower at 64, and the default keeps them together."""
    from pa_tile.perf import model
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.stages import s5_phase_split_mtp as s5

    probe = DecodeShape(batch=1, context=1024, num_q_heads=16, num_kv_heads=1, head_dim=128, block_size=16,
                        query_length=4)
    assert s5.plan(128, 16, 4)[2:] == (4, 1)  # the default: all 4 M-tiles in one workgroup
    us = {}
    for cap in (4, 1):
        smp = model.sample_stage("s6", probe, "gfx942", m_tiles=cap)
        assert smp.m_groups == 4 // cap
        for b in (1, 64):
            shape = DecodeShape(batch=b, context=8192, num_q_heads=128, num_kv_heads=8, head_dim=128, block_size=16,
                                query_length=4)
            us[cap, b] = model.predict_stage("s6", shape, "mi300x", sample=smp).predicted_us
    assert us[1, 1] < 0.7 * us[4, 1] and us[1, 64] > 1.1 * us[4, 64]


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the model samples the kernel in the emulator")
def test_v_with_k_verdict_of_the_model(monkeypatch):
    """Chapter 05, "When to load V" (MODEL predictions): V issued with K waits for memory once a
    tile instead of twice, and the finished kernel with it is predicted faster where latency bounds
    the launch (batch 16 x 16k, batch 128 x 4k) and no slower where HBM does (batch 1024 x 2k),
    per-token scales too (which cost a wave per SIMD there): the default takes it."""
    from pa_tile.perf import model
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.stages import s5_phase_split_mtp as s5

    assert s5.v_with_k(128, 16, False) and s5.v_with_k(128, 16, True) and not s5.v_with_k(256, 16, False)
    keep = s5.v_with_k
    for scales in ("per-tensor", "per-token"):
        probe = DecodeShape(batch=1, context=1024, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16,
                            scales=scales)
        us, lat = {}, {}
        for with_k in (False, True):
            monkeypatch.setattr(s5, "v_with_k", keep if with_k else (lambda *a: False))
            s5.build_launcher.cache_clear()
            smp = model.sample_stage("s6", probe, "gfx942")
            lat[with_k] = model.kernel_code(smp.main_asm, hw="mi300x", line_counts=smp.line_per_tile).latency_exposures
            for b, ctx in ((16, 16384), (128, 4096), (1024, 2048)):
                shape = DecodeShape(batch=b, context=ctx, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16,
                                    scales=scales)
                us[with_k, b] = model.predict_stage("s6", shape, "mi300x", sample=smp).predicted_us
        s5.build_launcher.cache_clear()
        assert lat[False] == pytest.approx(2.0, abs=0.1) and lat[True] == pytest.approx(1.0, abs=0.1), lat
        assert us[True, 16] < 0.8 * us[False, 16] and us[True, 128] < 0.8 * us[False, 128], us
        assert us[True, 1024] <= us[False, 1024] * 1.001, us
    monkeypatch.setattr(s5, "v_with_k", keep)
    s5.build_launcher.cache_clear()
