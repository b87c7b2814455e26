"""The numbers chapters 00-02 state in their prose hold against the outputs beside them.

Most of those chapters' numbers are rendered from computed values (``show.md``); these are the
ones written into the markdown, each checked here against the committed notebook's outputs (or,
for the flops-per-byte column, against the table's own figures). Reads the committed notebooks;
executes nothing. A failure names the chapter, the sentence and what the output says instead."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks"


def _cells(stem):
    return json.loads((NB / f"{stem}.ipynb").read_text(encoding="utf-8"))["cells"]


def _markdown(stem):
    return "\n".join("".join(c["source"]) for c in _cells(stem) if c["cell_type"] == "markdown")


def _output_of(stem, needle):
    """The text (printed and displayed) of the one code cell whose source contains ``needle``."""
    hits = [c for c in _cells(stem) if c["cell_type"] == "code" and needle in "".join(c["source"])]
    assert len(hits) == 1, f"{stem}: {len(hits)} code cells contain {needle!r}; the test expects one"
    parts = []
    for o in hits[0].get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append("".join(o["text"]))
        elif o.get("output_type") in ("display_data", "execute_result"):
            data = o.get("data", {})
            parts.append("".join(data.get("text/markdown", data.get("text/plain", ""))))
    return "\n".join(parts)


def _table(text):
    """Rows of a plain-text table printed by ``format_table`` (header, dashes, rows) as dicts."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip() and set(ln.replace(" ", "")) == {"-"})
    head, rows = lines[i - 1].split(), []
    for ln in lines[i + 1:]:
        if not ln.strip():  # the table ends at the first blank line
            break
        if len(ln.split()) >= len(head):
            rows.append(dict(zip(head, ln.split())))
    return rows


# -- chapter 00 ---------------------------------------------------------------------------------

def test_00_balance_points_follow_from_the_table():
    md = _markdown("00_paged_decode")
    rows = re.findall(r"\| (MI\d+X)[^|]*\| ([\d.]+) TB/s \| ([\d.]+) PFLOP/s \| ≈ (\d+) \|", md)
    assert len(rows) == 2, f"00: the bandwidth/peak table has {len(rows)} parsable rows; want 2"
    for gpu, tbs, pflops, stated in rows:
        balance = float(pflops) * 1e15 / (float(tbs) * 1e12)
        assert abs(balance - int(stated)) <= 10, (f"00: {gpu} is stated ≈ {stated} flops/byte; "
                                                  f"its own figures give {balance:.0f}")


def test_00_one_trace_two_launches():
    out = _output_of("00_paged_decode", "def row_sums_kernel")
    assert out.count("tracing row_sums_kernel") == 1, f"00: 'one trace, two launches' but the cell printed:\n{out}"
    assert len(re.findall(r"^n=\d+:", out, re.M)) == 2, f"00: 'two launches' but the cell printed:\n{out}"
    for got, want in re.findall(r"Out\[:3\] = (\[.*?\]), want (\[.*?\])", out):
        assert got == want, f"00: row_sums gave {got}, the reference {want}"


def test_00_scale_add_loads_one_dwordx4_per_input():
    out = _output_of("00_paged_decode", "asm = {arch: toolchain.compile_isa(tiny_kernels.scale_add")
    assert out.count("global_load_dwordx4") == 2, (f"00: 'one global_load_dwordx4 per input' (two inputs), "
                                                   f"the listing has {out.count('global_load_dwordx4')}")


def test_00_plain_helper_fails_rewritten_helper_branches():
    out = _output_of("00_paged_decode", "def store_inside(")
    assert "store_inside: RuntimeError" in out, f"00: the plain helper is said to fail; it printed:\n{out}"
    m = re.search(r"store_inside_rewritten: Out\[:5\] = \[(.*?)\]", out)
    assert m, f"00: the rewritten helper printed no values:\n{out}"
    vals = [float(v) for v in m.group(1).split(",")]
    assert vals[3:] == [0.0, 0.0] and vals[1:3] != [0.0, 0.0], f"00: lanes >= n=3 must be untouched: {vals}"


def test_00_second_page_starts_96_elements_on():
    md = _markdown("00_paged_decode")
    assert "token 4 starts the second page, 96 elements on" in md
    out = _output_of("00_paged_decode", "def layout_kernel")
    rows = [[int(v) for v in re.findall(r"\d+", ln)] for ln in out.splitlines() if ln.strip().startswith(("tensor([[", "["))]
    rows = [r for r in rows if len(r) >= 8]
    assert [r[0] for r in rows[:5]] == [0, 8, 16, 24, 96], f"00: token rows start at {[r[0] for r in rows]}"


# -- chapter 01 ---------------------------------------------------------------------------------

def _static_01():
    return {r["arch"]: r for r in _table(_output_of("01_tile_qk", "def stage1_isa"))}


def test_01_lds_is_query_scores_p_and_row_floats():
    md = _markdown("01_tile_qk")
    assert "fp8 query (2 KB), one tile of f32 scores (16 KB), one tile of fp8 `P` (4 KB)" in md
    stated = 16 * 128 + 16 * 256 * 4 + 16 * 256 + 16 * 4  # query, scores, P, 16 per-row floats
    for arch, row in _static_01().items():
        assert int(row["lds"]) == stated, f"01 ({arch}): the prose's LDS adds up to {stated} B, the kernel has {row['lds']}"


def test_01_three_barriers_and_sixteen_mfmas_per_product():
    md = _markdown("01_tile_qk")
    assert "Each tile has three barriers" in md and md.count("16 MFMAs per wave") == 2
    for arch, row in _static_01().items():
        assert int(row["loop_barriers"]) == 3, f"01 ({arch}): 'three barriers', the loop has {row['loop_barriers']}"
        assert int(row["loop_mfma"]) == 32, f"01 ({arch}): '16 MFMAs per wave' per product, the loop has {row['loop_mfma']}"


def test_01_trace_patterns_the_prose_names():
    md = _markdown("01_tile_qk")
    out = _output_of("01_tile_qk", "def access_patterns")
    rows = _table(out.replace(" of min ", "_of_min_").replace("conflict x", "conflict_x"))
    per = {(r["instruction"], r["per_execution"]) for r in rows}
    assert ("buffer_load_dword", "1_of_min_2") in per, "01: 'one address per wave' for the page-table reads"
    assert "16 token rows" in md and ("buffer_load_dwordx2", "16_of_min_4") in per, (
        f"01: K gathers said to touch 16 lines (one per token row); the trace has {sorted(per)}")
    assert "all 16 start in the same bank" in md and ("ds_read2_b64", "conflict_x16") in per, (
        f"01: Q/P reads said to conflict 16-way; the trace has {sorted(per)}")


# -- chapter 02 ---------------------------------------------------------------------------------

def _loop_rows_02():
    return _table(_output_of("02_register_softmax", "def loop_row"))


def test_02_chapter_01_pays_three_barriers_chapter_02_none():
    md = _markdown("02_register_softmax")
    assert "Every tile pays three\nbarriers" in md or "Every tile pays three barriers" in md
    for r in _loop_rows_02():
        want = 3 if r["stage"] == "1" else 0
        assert int(r["loop_barriers"]) == want, f"02: stage {r['stage']} ({r['arch']}) loop barriers {r['loop_barriers']}"


def test_02_k_loads_read_half_of_each_line_v_loads_whole_lines():
    md = _markdown("02_register_softmax")
    assert "half of each row's 128-byte line" in md
    assert "16 `dwordx4` per lane" in md
    out = _output_of("02_register_softmax", "trace.grouped_summary(")
    loop = [ln.split() for ln in out.splitlines() if ln.startswith("loop") and "buffer_load_dwordx4" in ln]
    assert loop, f"02: no loop buffer_load_dwordx4 row in the trace:\n{out}"
    # columns: phase mnemonic instrs execs B/exec lines/exec min-lines/exec
    instrs = sum(int(r[2]) for r in loop)
    assert instrs == 16, f"02: '16 dwordx4 per lane' a tile; the loop issues {instrs} instruction lines"
    shapes = sorted((float(r[5]), float(r[6])) for r in loop)
    assert (16.0, 8.0) in shapes, f"02: K loads said to use half of 16 lines; the trace has {shapes}"
    assert any(a == b for a, b in shapes), f"02: V loads said to read whole lines; the trace has {shapes}"


def test_02_kernel_agrees_with_its_numerics_model_to_about_an_f16_ulp():
    md = _markdown("02_register_softmax")
    assert "the kernel agrees to about one f16 ulp" in md
    rows = [r for r in _table(_output_of("02_register_softmax", "def check(arch")) if r["ok"] in ("True", "False")]
    worst = max(float(r["err_vs_model"]) for r in rows)
    assert rows and worst <= 2 ** -10, f"02: 'about one f16 ulp' (2^-10 at |o| < 2), the worst is {worst}"
