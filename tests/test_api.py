"""The public entry point ``pa_tile.paged_decode``: re-exports, input validation (every argument
named, nothing built before the inputs are known good), the workspace contract (no allocation
inside the call when ``out`` and ``workspace`` are given), and CUDA/HIP graph capture on a GPU."""

import pytest
import torch

import pa_tile
from pa_tile import backend, cache
from pa_tile.stages import s6_split_k as s6



@pytest.fixture(scope="module")
def device():
    backend.ensure_backend()
    return backend.device_for_tensors()


def _case(arch="gfx942", contexts=(5, 20, 600), ql=2, scales="per-tensor", seed=2):
    return cache.make_case(len(contexts), 8, 1, 128, 16, list(contexts), query_length=ql,
                           fp8_format={"gfx942": "fnuz", "gfx950": "ocp"}[arch], scales=scales,
                           query_dtype=torch.float16, seed=seed, pad_block_id=-1)


def _good(case=None, device="cpu"):
    case = case or _case()
    return dict(zip(("query", "key_cache", "value_cache", "block_tables", "context_lengths", "key_scale",
                     "value_scale"), (x.to(device) for x in (case.query, case.k_blocked(), case.v_trans_blocked(),
                                                             case.block_tables, case.context_lengths,
                                                             case.k_scale, case.v_scale))))



def test_reexports():
    from pa_tile import api

    assert pa_tile.paged_decode is api.paged_decode
    assert pa_tile.plan is api.plan
    assert pa_tile.make_workspace is api.make_workspace
    assert pa_tile.workspace_size is api.workspace_size  # s6's, with the call's default schedule
    with pytest.raises(AttributeError):
        pa_tile.no_such_thing


def _bad(**changes):
    kw = _good()
    kw.update(changes)
    return kw


BAD = [
    ("query", TypeError, lambda g: _bad(query=g["query"].float())),
    ("query", TypeError, lambda g: _bad(query=g["query"].numpy())),
    ("query", ValueError, lambda g: _bad(query=g["query"][:, :, :96])),
    ("query", ValueError, lambda g: _bad(query=g["query"][:5])),
    ("query", ValueError, lambda g: _bad(query=g["query"].transpose(1, 2).contiguous().transpose(1, 2))),
    ("query", ValueError, lambda g: _bad(query=g["query"].repeat(1, 9, 1))),  # group 72 x 2 queries > 128 rows
    ("query_length", ValueError, lambda g: _bad(query=g["query"].repeat(5, 1, 1))),  # 10 per sequence > 8
    ("key_cache", ValueError, lambda g: _bad(key_cache=g["key_cache"].view(torch.uint8).view(torch.float8_e4m3fn))),
    ("key_cache", ValueError, lambda g: _bad(key_cache=cache.from_k_blocked(g["key_cache"]))),
    ("key_cache", TypeError, lambda g: _bad(key_cache=g["key_cache"].float())),
    ("key_cache", ValueError, lambda g: _bad(key_cache=g["key_cache"].transpose(3, 4))),  # not contiguous
    ("value_cache", ValueError, lambda g: _bad(value_cache=g["value_cache"][:, :, :, :64])),
    ("value_cache", TypeError, lambda g: _bad(value_cache=g["value_cache"].view(torch.uint8))),
    ("block_tables", TypeError, lambda g: _bad(block_tables=g["block_tables"].long())),
    ("block_tables", ValueError, lambda g: _bad(block_tables=g["block_tables"] + 100)),
    ("block_tables", ValueError, lambda g: _bad(block_tables=g["block_tables"].t().contiguous().t())),
    ("block_tables", ValueError, lambda g: _bad(block_tables=g["block_tables"][:2])),
    ("context_lengths", TypeError, lambda g: _bad(context_lengths=g["context_lengths"].long())),
    ("context_lengths", ValueError, lambda g: _bad(context_lengths=torch.tensor([1, 20, 600], dtype=torch.int32))),
    ("context_lengths", ValueError, lambda g: _bad(context_lengths=torch.tensor([5, 20, 10**5], dtype=torch.int32))),
    ("key_scale", ValueError, lambda g: _bad(key_scale=torch.ones(3, dtype=torch.float32))),
    ("key_scale", TypeError, lambda g: _bad(key_scale="1.0")),
    ("value_scale", ValueError, lambda g: _bad(value_scale=torch.ones(g["key_cache"].shape[0], 1, 16))),
    ("value_scale", TypeError, lambda g: _bad(value_scale=torch.ones(1, dtype=torch.float64))),
]


@pytest.mark.parametrize("name,exc,make", BAD, ids=[f"{n}-{e.__name__}-{i}" for i, (n, e, _) in enumerate(BAD)])
def test_bad_input_is_named_before_anything_is_built(name, exc, make, nothing_built):
    with pytest.raises(exc, match=name):
        pa_tile.paged_decode(**make(_good()), arch="gfx942")


@pytest.mark.parametrize("kwargs,name,exc", [
    (dict(arch="gfx90a"), "arch", ValueError),
    (dict(arch=942), "arch", TypeError),
    (dict(sliding_window=-1), "sliding_window", ValueError),
    (dict(sliding_window=2.0), "sliding_window", TypeError),
    (dict(query_length=3), "query", ValueError),
    (dict(query_length=0), "query_length", ValueError),
    (dict(m_tiles=0), "m_tiles", ValueError),
    (dict(softmax_scale=0.0), "softmax_scale", ValueError),
    (dict(softmax_scale="x"), "softmax_scale", TypeError),
    (dict(num_partitions=0), "num_partitions", ValueError),
    (dict(num_partitions=65), "num_partitions", ValueError),
    (dict(num_partitions=2.0), "num_partitions", TypeError),
    (dict(out=torch.empty(6, 8, 128, dtype=torch.bfloat16)), "out", ValueError),
    (dict(out=torch.empty(6, 128, 8, dtype=torch.float16).transpose(1, 2)), "out", ValueError),
    (dict(out=[1, 2]), "out", TypeError),
    (dict(num_partitions=3, workspace=torch.empty(100)), "workspace", ValueError),
    (dict(num_partitions=3, workspace=torch.empty(10**6, dtype=torch.float64)), "workspace", ValueError),
    (dict(num_partitions=3, workspace=torch.empty(10**6).view(1000, 1000)), "workspace", ValueError),
    (dict(num_partitions=3, workspace="ws"), "workspace", TypeError),
])
def test_bad_options_are_named(kwargs, name, exc, nothing_built):
    kwargs.setdefault("arch", "gfx942")
    with pytest.raises(exc, match=name):
        pa_tile.paged_decode(**_good(), **kwargs)


def test_workspace_size_and_make_workspace():
    g = _good()
    # 3 sequences x 1 KV head x rows 16 (2 x 8) x (128 + 2) floats per partition
    assert s6.workspace_size(3, 1, 8, 2, 128, 4) == 3 * 4 * 16 * 130
    assert s6.workspace_size(3, 1, 8, 2, 128, 1) == 1
    ws = pa_tile.make_workspace(g["query"], g["key_cache"], g["block_tables"], num_partitions=4, arch="gfx942",
                                schedule="uniform")
    assert ws.dtype == torch.float32 and ws.numel() == 3 * 4 * 16 * 130
    # the default (balanced) split's partials are per work-list entry: 3 x (4 + 1) of them
    assert s6.workspace_size(3, 1, 8, 2, 128, 4, "balanced") == 3 * 5 * 16 * 130
    ws = pa_tile.make_workspace(g["query"], g["key_cache"], g["block_tables"], num_partitions=4, arch="gfx942")
    assert ws.numel() == 3 * 5 * 16 * 130
    # default: the heuristic's choice for these shapes (600 tokens -> 38 pages -> 608 slots -> 3 tiles -> 1)
    auto = pa_tile.make_workspace(g["query"], g["key_cache"], g["block_tables"], arch="gfx942")
    P = s6.choose_num_partitions(3, 1, g["block_tables"].shape[1] * 16, arch="gfx942", group=8, query_length=2)
    assert auto.numel() == s6.workspace_size(3, 1, 8, 2, 128, P, s6.choose_schedule(P))
    with pytest.raises(TypeError, match="block_tables"):
        pa_tile.make_workspace(g["query"], g["key_cache"], [1])


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_workspace_call_allocates_nothing(arch, device, monkeypatch):
    """With out and workspace given (and tensor scales), the call creates no tensor: every torch
    factory raises during the call. Warm-up first, as before a graph capture (compilation may allocate)."""
    case = _case(arch, contexts=(5, 300, 1100), scales="per-token")
    g = _good(case, device)
    P = 3
    ws = pa_tile.make_workspace(g["query"], g["key_cache"], g["block_tables"], num_partitions=P, arch=arch)
    ws.fill_(float("nan"))  # stale contents must not matter: every partial is written before it is read
    out = torch.full_like(g["query"], float("nan"))
    pa_tile.paged_decode(**g, out=out, workspace=ws, num_partitions=P, arch=arch)  # warm-up (compiles)
    out.fill_(float("nan"))

    def refuse(*a, **k):
        raise AssertionError("allocation inside paged_decode")

    for name in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
                 "full_like", "tensor", "as_tensor", "arange"):
        monkeypatch.setattr(torch, name, refuse)
    ret = pa_tile.paged_decode(**g, out=out, workspace=ws, num_partitions=P, arch=arch)
    monkeypatch.undo()
    assert ret is out
    case.assert_matches(out)


def test_workspace_too_small_for_the_automatic_split():
    """A workspace sized for no split cannot serve a problem the heuristic splits."""
    case = _case(contexts=(3000,), ql=1)
    g = _good(case)
    P = s6.choose_num_partitions(1, 1, g["block_tables"].shape[1] * 16, arch="gfx942")
    assert P > 1
    small = pa_tile.make_workspace(g["query"], g["key_cache"], g["block_tables"], num_partitions=1, arch="gfx942")
    with pytest.raises(ValueError, match="workspace"):
        pa_tile.paged_decode(**g, workspace=small, arch="gfx942")


def test_python_float_scales_and_softmax_scale(device):
    case = _case(contexts=(40, 700), ql=1)
    g = _good(case, device)
    g["key_scale"], g["value_scale"] = float(case.k_scale), float(case.v_scale)
    out = pa_tile.paged_decode(**g, softmax_scale=0.05, num_partitions=2, arch="gfx942")
    case.assert_matches(out, softmax_scale=0.05)


# ---------------------------------------------------------------------------- real GPU: graph capture


@pytest.mark.parametrize("arch,fmt", [("gfx942", "fnuz"), ("gfx950", "ocp")])
@pytest.mark.parametrize("scales", ["per-tensor", "per-token"])
def test_large_scores_stay_finite(arch, fmt, scales, device):
    """K scales of 1e4-1e5 make scores of ~1e4-1e5 (log2 units): the top P then came out just past
    FP8_MAX and the fp8 conversion made it NaN (25-70 % of the outputs). P is clamped at FP8_MAX.
    Both meet the fp8 bound: per tensor every score is scaled alike and the softmax is one-hot on
    the same token; per token the fp8 query's rounding (2^-4 of a score) times scores this large
    moves the softmax weights by whole factors, in the kernel as in any fp8-Q attention (max error
    2.3 already at 100x the case's scales), and the bound computes that move."""
    case = cache.make_case(2, 8, 1, 128, 16, [300, 40], fp8_format=fmt, scales=scales, seed=3)
    case.k_scale.mul_(1e4 if scales == "per-token" else 1e5)
    out = pa_tile.paged_decode(case.query.to(device), case.k_blocked().to(device), case.v_trans_blocked().to(device),
                               case.block_tables.to(device), case.context_lengths.to(device),
                               case.k_scale.to(device), case.v_scale.to(device), arch=arch)
    assert torch.isfinite(out.float()).all()
    case.assert_matches(out)


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the sanitizer that proves it is the emulator's")
@pytest.mark.parametrize("num_partitions", [1, 2])
def test_a_bad_page_id_unchecked_reads_zeros_inside_the_cache(num_partitions):
    """On a GPU ``run`` does not read the block table (no host sync), so a page id past the cache
    (or negative) reaches the kernel. Its buffer descriptors span each tensor's own bytes, so such
    a load returns zeros; with 4 GiB descriptors it read other memory (the emulator's sanitizer
    faulted on it). The output stays finite."""
    case = cache.make_case(2, 8, 1, 128, 16, [300, 40], fp8_format="fnuz", seed=3)
    k, v = case.k_blocked(), case.v_trans_blocked()
    bt = case.block_tables.clone()
    bt[0, 3] = k.shape[0] + 100000
    bt[1, 1] = -7
    pl = pa_tile.plan(case.query, k, v, bt, case.context_lengths, case.k_scale, case.v_scale, arch="gfx942",
                      num_partitions=num_partitions, check_values=False)
    out = pl.run(case.query, k, v)
    assert torch.isfinite(out).all() and out.shape == case.query.shape
    with pytest.raises(ValueError, match="block_tables"):  # checked where reading values is free
        pa_tile.plan(case.query, k, v, bt, case.context_lengths, case.k_scale, case.v_scale, arch="gfx942")


@pytest.mark.rocm
@pytest.mark.skipif(not backend.gpu_available(), reason="needs a ROCm GPU")
def test_gpu_graph_capture_and_replay():
    arch = backend.default_arch()
    if arch not in ("gfx942", "gfx950"):
        pytest.skip(f"pa_tile targets gfx942/gfx950, this GPU is {arch}")
    a = _case(arch, contexts=(5, 1000, 4099), seed=3)
    b = _case(arch, contexts=(5, 1000, 4099), seed=4)  # same shapes, new values
    g = _good(a, "cuda")
    ws = pa_tile.make_workspace(g["query"], g["key_cache"], g["block_tables"], arch=arch)
    out = torch.empty_like(g["query"])
    pa_tile.paged_decode(**g, out=out, workspace=ws, arch=arch)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa_tile.paged_decode(**g, out=out, workspace=ws, arch=arch)
    for case in (a, b):
        for name, x in _good(case, "cuda").items():
            g[name].copy_(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        case.assert_matches(out)
