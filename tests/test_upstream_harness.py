"""scripts/run_upstream_pa.py, the upstream-style harness for FlyDSL's paged-attention kernels: its
own helpers (inputs, reference, comparison, case matrix) on tiny CPU inputs, and its refusal of a
path that is not a FlyDSL checkout. Needs no checkout and launches no kernel."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pa_tile import cache

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_upstream_pa.py"


@pytest.fixture(scope="module")
def up():
    spec = importlib.util.spec_from_file_location("run_upstream_pa", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_upstream_pa"] = mod
    spec.loader.exec_module(mod)
    return mod


def _case(up, **kw):
    base = dict(path="split", num_heads=(8, 1), query_length=2, block_size=16, quant="per_token",
                context_lengths=(20, 3), head_size=32)
    base.update(kw)
    return up.Case(**base)


@pytest.mark.parametrize("quant", ["per_tensor", "per_token"])
def test_inputs_have_upstreams_layouts_and_scales(up, quant):
    case = _case(up, quant=quant)
    inp = up.make_inputs(case, "fnuz", device="cpu")
    nb = inp.k_logical.shape[0]
    assert inp.query.shape == (2 * 2, 8, 32) and inp.query.dtype == torch.bfloat16
    assert inp.key_cache.shape == (nb, 1, 32 // 16, 16, 16)  # [nb, kvh, d/16, bs, 16]
    assert inp.value_cache.shape == (nb, 1, 16 // 16, 32, 16)  # trans_v: [nb, kvh, bs/16, d, 16]
    assert torch.equal(cache.from_k_blocked(inp.key_cache).view(torch.uint8), inp.k_logical.view(torch.uint8))
    assert torch.equal(cache.from_v_trans_blocked(inp.value_cache).view(torch.uint8),
                       inp.v_logical.view(torch.uint8))
    want = (nb, 1, 16, 1) if quant == "per_token" else (1,)  # as pertoken_quant / per_tensor_quant
    assert inp.key_scale.shape == want and inp.value_scale.shape == want
    # amax scaling: the largest |value| of each row (or of the tensor) lands on FP8_MAX
    top = cache.fp8_decode(inp.k_logical).abs()
    top = top.amax(dim=-1) if quant == "per_token" else top.amax()
    assert torch.all(top == cache.FP8_MAX["fnuz"])
    # page data as test_pa.py's build_ps_page_data: the first ceil(L/bs) entries of each table row
    assert inp.kv_indptr.tolist() == [0, 2, 3]
    assert inp.kv_page_indices.tolist() == inp.block_tables_list[0][:2] + inp.block_tables_list[1][:1]
    again = up.make_inputs(case, "fnuz", device="cpu")
    assert torch.equal(again.query, inp.query) and again.block_tables_list == inp.block_tables_list


def test_reference_of_a_single_visible_token_is_its_value(up):
    case = _case(up, query_length=1, context_lengths=(1, 1), quant="per_token")
    inp = up.make_inputs(case, "ocp", device="cpu")
    ref = up.reference(case, inp)
    for s in range(2):
        page = inp.block_tables_list[s][0]
        v = cache.fp8_decode(inp.v_logical[page, 0, 0]) * inp.value_scale[page, 0, 0, 0]
        assert torch.allclose(ref[s], v.expand(8, -1), rtol=2**-8, atol=0)  # bf16 output


def test_sliding_window_reference_keeps_upstreams_w_plus_one_tokens(up):
    # upstream keeps tokens j >= pos - W: with W = 1 the last query sees exactly 2 tokens
    case = _case(up, path="sliding", query_length=1, context_lengths=(16, 16), sliding_window=1)
    inp = up.make_inputs(case, "fnuz", device="cpu")
    ref = up.reference(case, inp)
    full = up.reference(_case(up, query_length=1, context_lengths=(16, 16)), inp)
    assert not torch.allclose(ref, full)
    # W = 15 keeps 16 tokens: all of a 16-token context
    whole = up.reference(_case(up, path="sliding", query_length=1, context_lengths=(16, 16), sliding_window=15), inp)
    assert torch.equal(whole, full)


def test_compare_tolerates_fp8_rounding_and_refuses_a_missing_token_or_nan(up):
    case = _case(up, query_length=1, context_lengths=(17, 9))
    inp = up.make_inputs(case, "fnuz", device="cpu")
    ref = up.reference(case, inp)
    ok, max_err, _ = up.compare(ref.to(torch.bfloat16), ref)
    assert ok and max_err <= 2**-8 * float(ref.abs().max())
    # the query rounded to fp8 (what the kernels do) stays inside the tolerance
    q8 = cache.quantize_fp8(inp.query.float(), "fnuz", 1.0)
    rounded = up.Inputs(**{**inp.__dict__, "query": cache.fp8_decode(q8).to(torch.bfloat16)})
    assert up.compare(up.reference(case, rounded), ref)[0]
    # one token less (context 16 instead of 17): the output moves past the tolerance
    short = up.Inputs(**{**inp.__dict__, "context_lengths": torch.tensor([16, 9], dtype=torch.int32)})
    assert not up.compare(up.reference(case, short), ref)[0]
    nan = ref.clone()
    nan[0, 0, 0] = math.nan
    ok, max_err, _ = up.compare(nan, ref)
    assert not ok and math.isnan(max_err)


def test_case_matrix_covers_upstreams_grid(up):
    cases = up.build_cases()
    labels = [c.label for c in cases]
    assert len(set(labels)) == len(labels)
    paths = {c.path for c in cases}
    assert paths == {"tile", "split", "metadata", "sliding"}
    split = [c for c in cases if c.path in ("tile", "split")]
    assert {c.query_length for c in split} == {1, 2, 3, 4}
    assert {c.num_heads for c in split} >= {(8, 1), (16, 1), (4, 1)}
    assert {c.quant for c in split} == {"per_tensor", "per_token"} and {c.block_size for c in split} == {16, 64}
    assert {c.head_size for c in split} == {128, 256} and {c.trans_v for c in split} == {True, False}
    meta = [c for c in cases if c.path == "metadata"]
    assert {(c.query_length, c.quant) for c in meta} >= {(1, "per_tensor"), (4, "per_token")}  # test_pa's two
    assert all(c.block_size == 1024 for c in meta)
    sw = [c for c in cases if c.path == "sliding"]
    assert {c.query_length for c in sw} == {1, 2, 3, 4} and all(c.block_size == 1024 for c in sw)
    assert {(c.num_heads, c.query_length) for c in sw if c.sliding_window == 1023 and c.quant == "per_token"} >= {
        (h, ql) for h in ((8, 1), (16, 1)) for ql in (1, 2, 3, 4)}  # test_sliding_window_accuracy's grid
    for c in cases:  # every context holds its queries
        assert min(c.context_lengths) >= c.query_length


def test_script_refuses_a_path_that_is_not_a_flydsl_checkout(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nowhere")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    assert "is not a FlyDSL checkout" in res.stderr and "kernels/attention/pa_decode_fp8.py" in res.stderr


def test_few_token_bound_covers_only_rows_that_see_few_tokens(up):
    case = _case(up, query_length=2, context_lengths=(40, 2), quant="per_tensor")
    inp = up.make_inputs(case, "fnuz", device="cpu")
    bound = up.few_token_bound(case, inp)
    assert bound[:2].abs().max() == 0  # sequence 0's rows see 39 and 40 tokens: the atol regime
    # sequence 1, row 0 sees one token (position 0): 2 eta |v_0| per channel
    page = inp.block_tables_list[1][0]
    v0 = cache.fp8_decode(inp.v_logical[page, 0, 0]).abs() * inp.value_scale
    assert torch.allclose(bound[2, 0], 2 * up.FEW_ETA * v0)
    assert torch.all(bound[3] >= bound[2])  # row 1 sees tokens 0 and 1
