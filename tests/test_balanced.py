"""Chapter 6's balanced split for ragged batches: the work list (every tile once, equal chunks,
built on the device without a host read), the kernel and reduce that run it against the float32
reference on both archs, what the API does with it, its bytes, and the timing model's verdict."""

import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pa_tile
from pa_tile import backend, cache
from pa_tile.perf import model
from pa_tile.perf.roofline import DecodeShape
from pa_tile.stages import s6_split_k as s6

ARCHS = ("gfx942", "gfx950")
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
TILE = 256
# as tests/test_stage6.py: the fp8 bound per element (pa_tile.reference.fp8_error_bound; a split
# keeps it: float32 partials, one float32 combine) and the mean error at most REF_MEAN
REF_MEAN = 0.012
SKEWED = [3000, 40, 300, 1027, 17]  # one long sequence beside short ones


@pytest.fixture(scope="module")
def device():
    backend.ensure_backend()
    return backend.device_for_tensors()


def _covered(work, offsets, ctx, window=0, ql=1):
    """Per sequence, the tiles its entries cover, in order; checks entries stay in their sequence."""
    S = len(ctx)
    seen = {s: [] for s in range(S)}
    for x, (s, t0, t1, pad) in enumerate(work.tolist()):
        assert pad == 0 and t1 >= t0
        if t1 > t0:
            assert offsets[s] <= x < offsets[s + 1], "a live entry outside its sequence's range"
            seen[s] += list(range(t0, t1))
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_work_list_covers_every_tile_once_in_equal_chunks(seed):
    rng = random.Random(seed)
    S = rng.choice([1, 2, 5, 17, 64])
    ctx = [rng.choice([1, 17, 255, 256, 257, 1027, 4096, 33000]) for _ in range(S)]
    P, floor = rng.choice([1, 2, 5, 16]), rng.choice([2, 3, 19])
    window = rng.choice([0, 0, 300])
    work, offsets = s6.work_list(torch.tensor(ctx, dtype=torch.int32), P, floor, sliding_window=window)
    offsets = offsets.tolist()
    assert work.dtype == torch.int32 and work.shape == (s6.work_entries(S, P), 4)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= work.shape[0]
    first = [max(c - window, 0) // TILE if window else 0 for c in ctx]
    units = [-(-c // TILE) - f for c, f in zip(ctx, first)]
    per = max(floor, -(-sum(units) // (S * P)))
    seen = _covered(work, offsets, ctx, window)
    for s in range(S):
        assert seen[s] == list(range(first[s], first[s] + units[s]))  # every tile once, none skipped
        assert offsets[s + 1] - offsets[s] == -(-units[s] // per)
    sizes = (work[:, 2] - work[:, 1]).tolist()
    for s in range(S):  # every chunk of a sequence is the even share but its last, which may be shorter
        mine = sizes[offsets[s]:offsets[s + 1]]
        assert all(t == per for t in mine[:-1]) and all(0 < t <= per for t in mine[-1:])
    assert all(t == 0 for t in sizes[offsets[-1]:])  # past the last chunk: empty entries


def test_work_list_is_built_on_the_device_without_reading_a_value():
    """Under FakeTensorMode any host read of a cuda tensor raises: the list is device ops only."""
    with FakeTensorMode():
        ctx = torch.empty(7, dtype=torch.int32, device="cuda")
        work, offsets = s6.work_list(ctx, 4, 3, query_length=2, sliding_window=100)
        assert work.device.type == "cuda" and work.shape == (35, 4) and offsets.shape == (8,)


def test_chunk_floor_is_the_traffic_cap_in_tiles():
    """A chunk's extra bytes (query re-read + partials round trip, with the margin) within 5 % of
    its tiles' compulsory bytes: 8 rows need 3 tiles, 64 rows (MTP 4 x group 16) 19."""
    assert s6.chunk_floor(128, 8, 1) == 3 and s6.chunk_floor(128, 16, 4) == 19
    for hd, g, ql in ((64, 8, 1), (128, 16, 4), (256, 32, 2)):
        per = s6.chunk_floor(hd, g, ql)
        tile = 2 * TILE * hd  # fp8 K and V of one tile, one KV head
        extra = s6.SPLIT_EXTRA_MARGIN * (g * ql * hd * 2 + g * ql * (hd + 2) * 4)
        assert extra <= (s6.TRAFFIC_CAP - 1) * per * tile * 1.001
        assert per == s6.MIN_TILES_PER_PARTITION or extra > (s6.TRAFFIC_CAP - 1) * (per - 1) * tile


def test_schedule_choice():
    assert s6.choose_schedule(4) == s6.DEFAULT_SCHEDULE == "balanced"
    assert s6.choose_schedule(1) == "uniform"  # an unsplit call is balanced only on request
    assert s6.choose_schedule(1, "balanced") == "balanced" and s6.choose_schedule(5, "uniform") == "uniform"
    with pytest.raises(ValueError, match="schedule"):
        s6.choose_schedule(2, "even")


def _case(arch, contexts, g=8, ql=1, kvh=2, hd=128, bs=16, scales="per-tensor", seed=3):
    return cache.make_case(len(contexts), g * kvh, kvh, hd, bs, [max(c, ql) for c in contexts], query_length=ql,
                           fp8_format=FMT[arch], scales=scales, seed=seed, pad_block_id=-1)


def _args(case, device):
    a = (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
         case.k_scale, case.v_scale)
    return tuple(x.to(device) for x in a)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("P,ql,g,scales,window", [
    (4, 1, 8, "per-tensor", 0),
    (3, 3, 4, "per-token", 0),
    (1, 2, 8, "per-tensor", 0),  # balanced on request at no split: one chunk per sequence's share
    (5, 1, 8, "per-token", 700),  # the window's skipped tiles are not in the list
])
def test_balanced_matches_reference(arch, P, ql, g, scales, window, device):
    case = _case(arch, SKEWED, g=g, ql=ql, scales=scales)
    pl = pa_tile.plan(*_args(case, device), num_partitions=P, schedule="balanced", sliding_window=window, arch=arch)
    assert pl.schedule == "balanced" and pl.splits
    work, offsets = pl.work_list()
    assert (offsets[1:] - offsets[:-1]).max() > 1  # the long sequence really is cut into chunks
    out = pl.run(*_args(case, device)[:3])
    case.assert_matches(out, mean_err=REF_MEAN, sliding_window=window)


@pytest.mark.parametrize("arch", ARCHS)
def test_balanced_equals_uniform_and_is_the_default_split(arch, device):
    """Other chunk edges change only the float32 partials' rounding (the fp8 P of a chunk is
    scaled by its own running max: the same bound as any split)."""
    case = _case(arch, SKEWED, seed=5)
    args = _args(case, device)
    assert pa_tile.plan(*args, num_partitions=3, arch=arch).schedule == "balanced"
    bal = pa_tile.paged_decode(*args, num_partitions=3, arch=arch).float().cpu()
    uni = pa_tile.paged_decode(*args, num_partitions=3, schedule="uniform", arch=arch).float().cpu()
    torch.testing.assert_close(bal, uni, atol=2e-2, rtol=2**-8)


def test_lengths_changed_in_place_are_followed_after_refresh(device):
    """A plan lays its work out when made; ``refresh`` redoes it in its own buffers after the
    lengths change in place (the one-shot call does so on every call)."""
    case = _case("gfx942", [2000, 1500, 40])
    args = _args(case, device)
    pl = pa_tile.plan(*args, num_partitions=4, arch="gfx942")
    work, offsets = pl.work_list()
    before = offsets.tolist()
    pl.run(*args[:3])
    case.context_lengths[1] = 300  # the case's reference reads the same tensor
    args[4].copy_(case.context_lengths.to(device))
    assert pl.work_list()[1].tolist() == before  # run does not redo it: layers of a step share it
    assert pl.refresh() is pl and pl.work_list()[0] is work  # the same buffers, new contents
    assert pl.work_list()[1].tolist() != before
    case.assert_matches(pl.run(*args[:3]), mean_err=REF_MEAN)
    case.context_lengths[0] = 700
    args[4].copy_(case.context_lengths.to(device))
    case.assert_matches(pa_tile.paged_decode(*args, num_partitions=4, arch="gfx942"), mean_err=REF_MEAN)


def test_bad_schedule_is_refused_before_any_launch(monkeypatch, device):
    from pa_tile.stages import s5_phase_split_mtp as s5

    monkeypatch.setattr(s5, "build_launcher", lambda *a, **k: pytest.fail("launcher built"))
    case = _case("gfx942", [300, 40])
    with pytest.raises(ValueError, match="schedule"):
        pa_tile.paged_decode(*_args(case, device), num_partitions=2, schedule="round-robin", arch="gfx942")
    ws = pa_tile.make_workspace(case.query, case.k_blocked(), case.block_tables, num_partitions=4, arch="gfx942",
                                schedule="uniform")
    with pytest.raises(ValueError, match="workspace"):  # a uniform split's workspace is too small for balanced
        pa_tile.plan(*_args(case, device), num_partitions=4, workspace=ws, arch="gfx942")


def test_fake_cuda_balanced_call_launches_both_kernels_and_reads_nothing():
    case = _case("gfx950", SKEWED)
    real = _args(case, "cpu")
    with backend.simulate_gpu("gfx950") as gpu, FakeTensorMode(allow_non_fake_inputs=False):
        args = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in real)
        out = pa_tile.paged_decode(*args, num_partitions=3, schedule="balanced")
        assert out.device.type == "cuda"
    assert len(gpu.launches) == 2 and all(a == "gfx950" for _, a, _ in gpu.launches)


# ---------------------------------------------------------------------------- bytes and the model


def test_balanced_loads_no_more_than_uniform_on_a_ragged_batch():
    """Emulator-measured bytes: the balanced split's partials (one per chunk, not P per
    sequence) keep a ragged batch's loads at or under the uniform split's, within the cap."""
    from pa_tile.perf import tracing

    sh = DecodeShape(batch=5, context=tuple(SKEWED), num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    loads = {}
    for sched in ("uniform", "balanced"):
        rep = tracing.trace_stage("s6", sh, "gfx942", num_partitions=4, schedule=sched)
        assert rep.check.ok
        loads[sched] = rep.traffic()["loaded_bytes"]
    need = tracing.compulsory_bytes(sh)
    assert loads["balanced"] <= loads["uniform"]
    assert loads["balanced"] <= s6.TRAFFIC_CAP * need


@pytest.fixture(scope="module")
def sample():
    probe = DecodeShape(batch=1, context=1024, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    return model.sample_stage("s6", probe, "gfx942")


def _predict(sample, contexts, partitions, schedule):
    shape = DecodeShape(batch=len(contexts), context=tuple(contexts), num_q_heads=64, num_kv_heads=8, head_dim=128,
                        block_size=16)
    return model.predict_stage("s6", shape, "mi300x", sample=sample, partitions=partitions, schedule=schedule)


def test_model_predicts_the_balanced_split_faster_on_skewed_batches(sample):
    """PREDICTED (model): one 32k conversation beside 15 1k ones, and 4 x 16k beside 60 x 512."""
    skew = [32768] + [1024] * 15
    uni, bal = _predict(sample, skew, 3, "uniform"), _predict(sample, skew, 3, "balanced")
    assert uni.details["tiles_per_workgroup"] == 43 and bal.details["tiles_per_workgroup"] <= 4
    assert bal.predicted_us < 0.5 * uni.predicted_us
    big = [16384] * 4 + [512] * 60  # the chooser splits nothing here (64 x 8 KV heads fill the GPU)
    assert s6.choose_num_partitions(64, 8, 16384, arch="gfx942") == 1
    assert _predict(sample, big, 1, "balanced").predicted_us < 0.5 * _predict(sample, big, 1, "uniform").predicted_us


def test_model_costs_the_balanced_split_little_on_even_batches(sample):
    """Where nothing is ragged the work list changes nothing but empty entries and, unsplit, a
    reduce: within 2 % (model; the split 16 x 16 tiles / 3 is list-scheduled when balanced, a
    little under the closed form's every-workgroup-at-6-tiles)."""
    for contexts, P in (([4096] * 16, 3), ([16384] * 64, 1), ([2048] * 256, 1)):
        uni, bal = _predict(sample, contexts, P, "uniform"), _predict(sample, contexts, P, "balanced")
        assert bal.predicted_us == pytest.approx(uni.predicted_us, rel=0.02)


def test_list_schedule_agrees_with_the_closed_form_on_a_regular_grid(sample):
    """The dispatcher's list schedule (ragged grids) and the generations' closed form (regular
    ones) are the same model: on an even grid they agree to the tail generation's refinement."""
    shape = DecodeShape(batch=64, context=4096, num_q_heads=64, num_kv_heads=8, head_dim=128, block_size=16)
    main = model.kernel_code(sample.main_asm, hw="mi300x", vmem_segments=model.vmem_segments(sample.per_tile),
                             line_counts=sample.line_per_tile or None)
    kw = dict(shape=shape, hw="mi300x", per_tile=sample.per_tile, fixed=sample.fixed, main=main,
              waves_per_workgroup=sample.waves_per_workgroup, m_groups=sample.m_groups)
    closed = model.predict(**kw)
    g = model.grid_of(shape)
    listed = model.predict(**kw, grid=model.Grid(g.x_tiles, g.slots, g.reduce_loops, regular=False))
    assert not closed.details["list_scheduled"] and listed.details["list_scheduled"]
    assert listed.predicted_us == pytest.approx(closed.predicted_us, rel=0.03)


def test_the_chosen_split_keeps_the_chunk_floor_an_explicit_one_is_honoured(device):
    case = _case("gfx942", [1027, 40, 300], g=8, ql=2)
    args = _args(case, device)
    auto = pa_tile.plan(*args, arch="gfx942", schedule="balanced")
    assert auto.chunk_tiles == s6.chunk_floor(128, 8, 2) > 1
    assert pa_tile.plan(*args, num_partitions=5, arch="gfx942").chunk_tiles == 1
    assert pa_tile.plan(*args, num_partitions=5, chunk_tiles=4, arch="gfx942").work_list()[1].tolist() == [0, 2, 3, 4]
    with pytest.raises(ValueError, match="chunk_tiles"):
        pa_tile.plan(*args, num_partitions=5, chunk_tiles=0, arch="gfx942")


def test_predict_verb_takes_a_ragged_batch_and_a_schedule(capsys):
    """``python -m pa_tile predict --context L1,L2,... --schedule``: the balanced layout is the
    default split's and predicted faster than the uniform one on a skewed batch (MODEL)."""
    from pa_tile.__main__ import main

    got = {}
    for sched in ("uniform", "balanced"):
        rc = main(["predict", "--stage", "s6", "--gpu", "mi300x", "--context", "32768," + ",".join(["1024"] * 7),
                   "--q-heads", "64", "--kv-heads", "8", "--head-dim", "128", "--schedule", sched])
        out = capsys.readouterr().out.strip().splitlines()
        assert rc == 0 and out[-1].startswith("predicted_us=")
        got[sched] = float(out[-1].split()[0].split("=")[1])
        assert any("list-scheduled" in line for line in out)
    assert got["balanced"] < 0.6 * got["uniform"]


def test_splits_past_the_kernels_32_bit_partial_offsets_are_refused_by_name():
    """Both schedules' partial outputs are addressed with 32-bit byte offsets: a split whose
    partials would reach 2 GiB is refused (one check, ``s5.check_partial_offsets``), and one just
    below it is not."""
    import types

    from pa_tile import api
    from pa_tile.stages import s5_phase_split_mtp as s5

    def prob(num_seqs):
        return types.SimpleNamespace(num_seqs=num_seqs, num_kv_heads=8, head_dim=128, group=8, query_length=1,
                                     torch_device=torch.device("meta"), device="meta")

    rows = s5.plan(128, 8, 1)[0]
    per_slot = 8 * rows * 128 * 4  # bytes of one slot's partial outputs over the KV heads
    limit = (2**31 - 1) // per_slot  # slots that still fit
    parts = 64
    seqs_ok = limit // parts
    assert s5.partial_shapes(prob(seqs_ok), parts)[2][2] == parts
    with pytest.raises(ValueError, match=r"num_partitions: 64 partitions of \d+ sequences .*32-bit"):
        s5.partial_shapes(prob(seqs_ok + 1), parts)
    # the balanced list has S·(P+1) slots: refused at fewer sequences than the uniform split
    seqs = next(s for s in range(seqs_ok, 0, -1) if s6.work_entries(s, parts) * per_slot < 2**31)
    api._workspace(prob(seqs), parts, None, None, "balanced")
    with pytest.raises(ValueError, match="num_partitions: a balanced split of .* 32-bit"):
        api._workspace(prob(seqs + 1), parts, None, None, "balanced")


def test_fake_tensors_are_never_a_plan_cache_key():
    """A fake's data_ptr is 0 for every tensor (and deprecated): two calls on different fake
    buffers would share one key, so a fake call is planned anew and nothing reads its pointer."""
    import warnings

    from pa_tile import api

    case = _case("gfx950", SKEWED)
    real = _args(case, "cpu")
    with backend.simulate_gpu("gfx950"), FakeTensorMode(allow_non_fake_inputs=False):
        args = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in real)
        assert api._call_key(args, (None,)) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # PyTorch's data_ptr deprecation would raise here
            pa_tile.paged_decode(*args, num_partitions=3, schedule="balanced")
    assert api._call_key(real, (None,)) is not None  # real tensors still key the cache
