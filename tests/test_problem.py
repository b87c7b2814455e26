"""One problem description (pa_tile.problem): every class of bad input is refused with an error
naming the argument, the same way by every entry point (stage launchers, plan/paged_decode and
make_workspace), before anything is built."""

import math

import pytest
import torch

import pa_tile
from pa_tile import api, arch, cache, problem
from pa_tile.stages import s2_register_softmax as s2
from pa_tile.stages import s5_phase_split_mtp as s5


def _case(**kw):
    args = dict(num_seqs=2, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16, context_lengths=[20, 70],
                pad_block_id=-1)
    args.update(kw)
    return cache.make_case(**args)


def _kw(case):
    return dict(query=case.query, key_cache=case.k_blocked(), value_cache=case.v_trans_blocked(),
                block_tables=case.block_tables, context_lengths=case.context_lengths, key_scale=case.k_scale,
                value_scale=case.v_scale)


@pytest.fixture
def nothing_built(monkeypatch):
    monkeypatch.setattr(s5, "build_launcher", lambda *a, **k: pytest.fail("partial kernel built"))
    monkeypatch.setattr(s2, "build_launcher", lambda *a, **k: pytest.fail("kernel built"))


SCALES = [0.0, -0.02, float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("value", SCALES)
@pytest.mark.parametrize("name", ["key_scale", "value_scale"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_scales_must_be_finite_and_positive(name, value, as_tensor, nothing_built):
    """A zero key scale turns masked scores into 0·-inf = NaN, a negative one breaks the max taken
    before scaling; both used to give all-NaN output with no error."""
    kw = _kw(_case())
    kw[name] = torch.tensor([value], dtype=torch.float32) if as_tensor else value
    with pytest.raises(ValueError, match=f"^{name}: "):
        pa_tile.paged_decode(**kw)
    with pytest.raises(ValueError, match=f"^{name}: "):
        s2.paged_decode(**dict(kw, key_cache=_case().k_cache, value_cache=_case().v_plain()))


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_per_token_scales_with_one_bad_entry_inside_a_context_are_refused(value, nothing_built):
    case = _case(scales="per-token")
    kw = _kw(case)
    bad = case.v_scale.clone()
    page = int(case.block_tables[1, 0])  # sequence 1's first page: every slot inside its 70 tokens
    bad[page, 0, 3] = value
    with pytest.raises(ValueError, match="^value_scale: every scale inside a context must be finite and >= 0"):
        pa_tile.paged_decode(**dict(kw, value_scale=bad))


@pytest.mark.parametrize("value", [1e-50, 1e-39, 0.0, -1.0, float("nan"), 1e39])
def test_softmax_scale_must_be_a_normal_float32_after_log2e(value, nothing_built):
    with pytest.raises(ValueError, match="^softmax_scale: "):
        pa_tile.paged_decode(**_kw(_case()), softmax_scale=value)


def test_softmax_scale_bounds_are_exactly_float32s_normal_range():
    tiny = 2.0**-126 / problem.LOG2E
    kw = _kw(_case())
    problem.describe(**kw, limits=api.LIMITS, softmax_scale=tiny * 1.0001)
    with pytest.raises(ValueError, match="softmax_scale"):
        problem.describe(**kw, limits=api.LIMITS, softmax_scale=tiny * 0.999)


@pytest.mark.parametrize("window,exc", [(2**31, ValueError), (2**32 + 5, ValueError), (-1, ValueError),
                                        (1.5, TypeError), (True, TypeError)])
def test_sliding_window_has_a_checked_range(window, exc, nothing_built):
    """The kernel compares positions in 32-bit arithmetic: a window >= 2**32 used to wrap silently."""
    with pytest.raises(exc, match="^sliding_window: "):
        pa_tile.paged_decode(**_kw(_case()), sliding_window=window)


def test_stage_without_a_window_refuses_one(nothing_built):
    case = _case()
    with pytest.raises(ValueError, match="^sliding_window: stage s2 has no sliding window"):
        problem.describe(case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
                         case.k_scale, case.v_scale, limits=s2.LIMITS, sliding_window=4)


# ------------------------------------------------------------------------- make_workspace = paged_decode

def _ws(case, **kw):
    return pa_tile.make_workspace(kw.pop("query", case.query), kw.pop("key_cache", case.k_blocked()),
                                  kw.pop("block_tables", case.block_tables), **kw)


WORKSPACE_BAD = [
    ("key_cache", ValueError, lambda c: dict(key_cache=torch.empty(4, 0, 8, 16, 16, dtype=c.k_cache.dtype))),
    ("query_length", ValueError, lambda c: dict(query_length=0)),
    ("query_length", ValueError, lambda c: dict(query_length=-1)),
    ("query_length", ValueError, lambda c: dict(query_length=9)),
    ("query_length", TypeError, lambda c: dict(query_length=2.5)),
    ("query", TypeError, lambda c: dict(query=c.query.float())),
    ("query", ValueError, lambda c: dict(query=torch.zeros(2, 8, 96, dtype=torch.float16))),
    ("query", ValueError, lambda c: dict(query=torch.zeros(2, 12, 128, dtype=torch.float16),
                                         key_cache=torch.zeros(7, 8, 8, 16, 16, dtype=c.k_cache.dtype))),
    ("query", ValueError, lambda c: dict(query=torch.zeros(2, 136, 128, dtype=torch.float16))),  # group 136
    ("key_cache", ValueError, lambda c: dict(key_cache=torch.zeros(7, 1, 8, 8, 16, dtype=c.k_cache.dtype))),
    ("block_tables", TypeError, lambda c: dict(block_tables=c.block_tables.long())),
    ("query", ValueError, lambda c: dict(query=torch.zeros(3, 8, 128, dtype=torch.float16))),  # 3 rows, 2 seqs
    ("num_partitions", ValueError, lambda c: dict(num_partitions=0)),
    ("arch", ValueError, lambda c: dict(arch="gfx90a")),
]


@pytest.mark.parametrize("name,exc,change", WORKSPACE_BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(WORKSPACE_BAD)])
def test_make_workspace_validates_what_paged_decode_validates(name, exc, change):
    case = _case()
    with pytest.raises(exc, match=f"^{name}: "):
        _ws(case, **change(case))


def test_make_workspace_and_paged_decode_agree_on_the_error():
    """The same bad query is refused with the same message by both."""
    case = _case()
    q = torch.zeros(2, 136, 128, dtype=torch.float16)
    with pytest.raises(ValueError) as a:
        _ws(case, query=q)
    with pytest.raises(ValueError) as b:
        pa_tile.paged_decode(**dict(_kw(case), query=q))
    assert str(a.value) == str(b.value)


def test_a_split_past_32_bit_offsets_is_refused(nothing_built):
    """pout of 64 partitions x 4096 sequences x 8 KV heads x 16 rows x 128 floats is 2 GiB."""
    case = _case(num_seqs=1, context_lengths=[40])
    p = problem.describe(**_kw(case), limits=s5.LIMITS)
    big = problem.Problem(**{**p.__dict__, "num_seqs": 4096, "num_kv_heads": 8, "num_q_heads": 64})
    with pytest.raises(ValueError, match="^num_partitions: 64 partitions"):
        s5.partial_shapes(big, 64)


# ----------------------------------------------------------------------------------- one home per fact

def test_arch_facts_have_one_home():
    assert arch.ARCHS == ("gfx942", "gfx950")
    assert (arch.fp8_max("gfx942"), arch.fp8_max("gfx950")) == (240.0, 448.0)
    assert arch.fp8_torch_dtype("gfx942") is torch.float8_e4m3fnuz
    assert arch.fp8_torch_dtype("gfx950") is torch.float8_e4m3fn
    assert arch.check_arch("gfx942:sramecc+:xnack-") == "gfx942"
    for a in arch.ARCHS:  # the e4m3 maxima the torch dtypes themselves report
        assert torch.finfo(arch.fp8_torch_dtype(a)).max == arch.fp8_max(a)
    with pytest.raises(TypeError, match="^arch: "):
        arch.check_arch(942)


def test_no_stage_module_imports_another_stages_private_names():
    import ast
    import pathlib

    for path in sorted(pathlib.Path(pa_tile.__file__).parent.joinpath("stages").glob("s*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pa_tile.stages"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                    and node.value.id in ("s1", "s2", "s3", "s4", "s5", "s6", "_s2") and not node.attr.startswith("__"):
                pytest.fail(f"{path.name} uses {node.value.id}.{node.attr}")


def test_every_stage_declares_its_limits():
    from pa_tile import stages

    for name in stages.available():
        lim = stages.get(name).LIMITS
        assert isinstance(lim, problem.Limits) and lim.stage == name
        assert math.prod(lim.block_sizes) > 0
