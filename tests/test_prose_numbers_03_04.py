"""Chapters 03 and 04: every number their markdown prose restates from a computed result agrees
with the outputs of the committed notebooks (executes nothing). Numbers a chapter renders from
its results (``show.md``, ``show.measured``) need no test; these are the ones the prose states."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CH03 = ROOT / "notebooks" / "03_raw_dwordx4_loads.ipynb"
CH04 = ROOT / "notebooks" / "04_blocked_layouts.ipynb"


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _prose(path) -> str:
    """The markdown cells' text, every run of whitespace one space (line breaks do not matter)."""
    text = " ".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "markdown")
    return " ".join(text.split())


def _outputs(path) -> list:
    """Every printed or displayed text of the notebook, in order (figures left out)."""
    texts = []
    for c in _cells(path):
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                texts.append("".join(o["text"]))
            elif o.get("output_type") in ("display_data", "execute_result"):
                data = o.get("data", {})
                text = data.get("text/markdown", data.get("text/plain", ""))
                texts.append("".join(text))
    return texts


def _table(path, header_words) -> list:
    """The rows (dicts, by header) of the printed ``format_table`` whose header holds
    ``header_words``; columns are cut where the ``----`` rule under the header puts them."""
    for text in _outputs(path):
        lines = text.splitlines()
        for i, line in enumerate(lines[:-1]):
            rule = lines[i + 1]
            if not (all(w in line.split() for w in header_words) and rule and set(rule) <= {"-", " "}):
                continue
            spans = [(m.start(), m.end()) for m in re.finditer(r"-+", rule)]
            names = [line[a:b].strip() for a, b in spans]
            rows = []
            for body in lines[i + 2:]:
                if not body.strip():
                    break
                rows.append({n: body[a:b].strip() for n, (a, b) in zip(names, spans)})
            return rows
    raise AssertionError(f"{path.name}: no printed table with columns {header_words}")


def _output_with(path, needle) -> str:
    found = [t for t in _outputs(path) if needle in t]
    assert found, f"{path.name}: no output contains {needle!r}"
    return found[0]


@pytest.fixture(scope="module", params=[CH03, CH04], ids=["03", "04"])
def executed(request):
    if not request.param.exists():
        pytest.skip(f"{request.param.name} is not committed")
    return request.param


def test_both_chapters_were_executed_on_the_emulator(executed):
    # the traced figures and tables the prose reads exist only in an emulator run
    assert "backend: emu" in _outputs(executed)[0]


# ---------------------------------------------------------------- chapter 03


def test_03_stage_1_loads_k_and_v_eight_bytes_a_lane():
    prose = _prose(CH03)
    assert "`buffer_load_dwordx2`: 8 bytes per lane" in prose
    text = _output_with(CH03, "stage 1 loads:")
    assert "'dwordx2'" in text and all(ln.startswith("buffer_load_dwordx2") for ln in text.splitlines()[1:] if ln)


def test_03_the_query_read_element_by_element_is_eight_ushort_loads():
    assert "Eight `buffer_load_ushort` per lane instead of one `buffer_load_dwordx4`" in _prose(CH03)
    text = _output_with(CH03, "element reads")
    assert "{'buffer': {'ushort': 8}}" in text and "{'buffer': {'dwordx4': 1}}" in text


def test_03_the_loop_issues_8_kib_of_k_and_8_of_v_per_wave():
    """Prose: 16 KiB of K and V at the top of a chapter-02 tile, the next tile's 8 KiB of K; K is
    8 `dwordx4`, 32 registers per lane. The loop's rows of the traced tile: 8 instructions of
    1024 bytes each for V, and 8 for the (clamped) next K."""
    prose = _prose(CH03)
    assert "16 KiB of K and V" in prose and "next tile's 8 KiB of K" in prose
    assert "(8 `dwordx4`, 32 registers per lane)" in prose
    loop = [r for r in _table(CH03, ["phase", "mnemonic", "instrs"])
            if r["phase"] == "loop" and r["mnemonic"] == "buffer_load_dwordx4"]
    assert len(loop) == 2 and all(r["instrs"] == "8" and r["B/exec"] == "1024" for r in loop)
    cost = _table(CH03, ["loop", "loads_per_iter", "qk_waits_for"])
    assert {r["loads_per_iter"] for r in cost} == {"18"}  # 8 K + 8 V dwordx4 + 2 page ids


def test_03_the_prefetch_changes_no_arithmetic():
    assert "**bit-identical** to chapter 02's kernel" in _prose(CH03)
    assert "all bit-identical to stage 2" in _output_with(CH03, "configurations x 4 contexts")


def test_03_cross_lane_instructions_per_arch_and_no_dpp():
    prose = _prose(CH03)
    assert "`ds_swizzle` (`SWAP,16`)" in prose and "`ds_bpermute` on gfx942" in prose
    assert "gfx950 adds `v_permlane16_swap` and `v_permlane32_swap`" in prose
    rows = {r["arch"]: r for r in _table(CH03, ["arch", "ds_swizzle", "_dpp"])}
    whole = {a: {k: int(v.split("/")[1]) for k, v in r.items() if "/" in v} for a, r in rows.items()}
    assert whole["gfx942"]["ds_swizzle"] > 0 and whole["gfx942"]["ds_bpermute"] > 0
    assert whole["gfx942"]["permlane16_swap"] == whole["gfx942"]["permlane32_swap"] == 0
    assert whole["gfx950"]["permlane16_swap"] > 0 and whole["gfx950"]["permlane32_swap"] > 0
    assert whole["gfx950"]["ds_swizzle"] == whole["gfx950"]["ds_bpermute"] == 0
    assert whole["gfx942"]["_dpp"] == whole["gfx950"]["_dpp"] == 0


# ---------------------------------------------------------------- chapter 04


def _loads04():
    return {(r["stage"], r["tensor"]): r for r in _table(CH04, ["stage", "tensor", "group_line_pairs"])}


def test_04_a_wave_load_fits_in_8_lines_at_best():
    assert "64 lanes × 16 bytes = 1 KiB" in _prose(CH04) and "so 8 lines is the fewest" in _prose(CH04)
    assert {r["fewest"] for r in _loads04().values()} == {"8"}


def test_04_both_layouts_fetch_the_same_lines_and_plain_k_costs_4x_the_addresser_clocks():
    prose = _prose(CH04)
    assert "The memory system fetches the same lines either way" in prose
    assert "stage 3's K loads cost 4 times the addresser clocks of stage 4's" in prose
    t = _loads04()
    for tensor in ("K", "V"):
        assert t["3 plain", tensor]["lines_per_load"] == t["4 blocked", tensor]["lines_per_load"]
    assert float(t["3 plain", "K"]["group_line_pairs"]) == 4 * float(t["4 blocked", "K"]["group_line_pairs"])
    # the rendered sentence states one figure for both layouts of K's lines and of V's lines and pairs
    assert t["3 plain", "V"]["group_line_pairs"] == t["4 blocked", "V"]["group_line_pairs"]


def test_04_the_merge_table_conflicts_2_way_and_5_word_rows_remove_it():
    prose = _prose(CH04)
    assert "conflicts 2-way" in prose and "pads each head row to 5 words" in prose
    rows = _table(CH04, ["arch", "head_row_words", "max_degree"])
    degree = {(r["arch"], r["head_row_words"]): r["max_degree"] for r in rows}
    assert degree == {("gfx942", "4"): "2", ("gfx942", "5"): "1", ("gfx950", "4"): "2", ("gfx950", "5"): "1"}


def test_04_the_padded_table_is_read_back_with_read2_not_b128():
    assert "two `ds_read2_b32` instead of one `ds_read_b128`" in _prose(CH04)
    diff = _output_with(CH04, "ds load 2xb32").splitlines()
    row = {ln.split()[2]: ln.split() for ln in diff if ln.strip().startswith("ds load")}
    assert row["2xb32"][5] == "+4" and row["b128"][5] == "-2"  # gfx942: stage 3 -> 4


def test_04_blocked_layouts_change_addresses_not_arithmetic():
    assert "the output is **bit-identical** to chapter 03's kernel, for both V layouts" in _prose(CH04)
    text = _output_with(CH04, "stage 3 == stage 4")
    assert text.count("True") == 3 and "False" not in text
