"""The numbers chapters 05 and 06 state in their prose (markdown cells) are the ones the code and
the committed, executed notebooks hold. Numbers the chapters *render* (``show.md``) come from the
cell that computed them; this file holds the ones written in markdown, and the few relations
between a rendered sentence and the table beside it. Reads the committed notebooks; compiles and
launches nothing."""

import json
import re
from pathlib import Path

import pytest

from pa_tile import arch, cache, isa, kernel_lib
from pa_tile.stages import s5_phase_split_mtp as s5

NB = Path(__file__).resolve().parent.parent / "notebooks"
CH05 = NB / "05_phase_split_mtp.ipynb"
CH06 = NB / "06_head_dim_split_pv.ipynb"
APPENDIX = NB / "appendix_register_resident_loop.ipynb"


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _text(cell):
    return "".join(cell["source"])


def _prose(path):
    """The markdown of a chapter, fenced code blocks removed (what a reader reads as prose)."""
    md = "\n".join(_text(c) for c in _cells(path) if c["cell_type"] == "markdown")
    return re.sub(r"```.*?```", "", md, flags=re.S)


def _outputs(path):
    """Every output of the chapter, as text: printed streams and displayed Markdown."""
    out = []
    for c in _cells(path):
        for o in c.get("outputs", []):
            if o["output_type"] == "stream":
                out.append("".join(o["text"]))
            elif "data" in o:
                data = o["data"]
                out.append("".join(data.get("text/markdown", data.get("text/plain", ""))))
    return out


def _table_after(path, first_header, has=None):
    """The rows of the first printed ``format_table`` whose header starts with ``first_header``
    (and names the column ``has``, if given)."""
    for text in _outputs(path):
        lines = text.splitlines()
        if lines and lines[0].split()[:1] == [first_header] and (has is None or has in lines[0].split()):
            keys = lines[0].split()
            return [dict(zip(keys, line.split())) for line in lines[2:] if line.strip()]
    raise AssertionError(f"no table headed {first_header!r} in {path.name}")


def _words(path):
    return len(_prose(path).split())


@pytest.mark.parametrize("path", [CH05, CH06], ids=lambda p: p.stem)
def test_chapter_is_well_under_the_word_limit(path):
    assert _words(path) <= 3500


def test_05_states_the_limits_the_module_has():
    prose = _prose(CH05)
    lim = s5.LIMITS
    assert lim.max_query_length == 8 and "`query_length` = 1..8" in prose
    assert lim.max_group == 128 and "up to 128 query heads" in prose
    assert lim.max_rows == 128 and "(`group · query_length` <= 128 rows)" in prose
    assert lim.max_m_tiles == 8 and "up to 8 (128 rows)" in prose and 8 * 16 == 128
    assert kernel_lib.MASKED == -1e30 and "`MASKED = −1e30`" in prose


def test_05_ragged_contexts_are_the_ones_it_runs():
    assert tuple(cache.RAGGED_CONTEXTS) == (1, 17, 256, 1027)
    assert "(1, 17, 256,\n# 1027" in (NB / "05_phase_split_mtp.py").read_text() or \
        "(1, 17, 256, 1027" in _prose(CH05).replace("\n", " ")


def test_05_prefetched_k_is_32_registers_per_lane_at_head_dim_128():
    # one wave's span of K: 64 tokens x 128 fp8 channels, over 64 lanes, in 4-byte registers
    assert kernel_lib.SPAN * 128 // (kernel_lib.WAVE * 4) == 32
    assert "(32 registers per lane at head_dim 128)" in _prose(CH05)


def test_05_checks_pass_and_the_default_plan_reads_each_byte_once():
    rows = _table_after(CH05, "arch")
    assert len(rows) == 16 and all(r["ok"] == "True" for r in rows)
    measured = [t for t in _outputs(CH05) if t.startswith("| Measured")]
    assert measured, "the closing figures table is missing"
    once = re.search(r"8 M-tiles in one workgroup \| ([0-9.]+)", measured[0])
    re_read = re.search(r"8 M-tiles, 1 per workgroup \| ([0-9.]+)", measured[0])
    assert once and re_read
    assert float(once.group(1)) <= 1.0 < 5.0 < float(re_read.group(1))


def test_06_slab_is_4_kb():
    assert kernel_lib.WAVES * kernel_lib.WAVE * 16 == 4096
    assert "a 4 KB slab `[wave][lane] × 16` bytes" in _prose(CH06)


def test_06_barriers_are_two_per_m_tile_and_phase_groups_keep_3_waves_at_head_dim_64():
    rows = _table_after(CH06, "head_dim", has="barriers_in_loop")
    assert rows, "the registers table is missing"
    for r in rows:
        assert int(r["barriers_in_loop"]) == 2 * int(r["m_tiles_per_wg"]), r
    four_64 = next(r for r in rows if r["head_dim"] == "64" and r["m_tiles_per_wg"] == "4")
    assert float(four_64["waves"]) == 3
    prose = _prose(CH06)
    assert "`2 · MT` barriers" in prose and "one M-tile per group keeps 3 waves per SIMD" in prose
    assert s5.PHASE_GROUP == {64: 1, 128: 4, 256: 4}


def test_06_v_with_k_everywhere_but_the_two_cases_named():
    assert not s5.v_with_k(256, 16, False) and not s5.v_with_k(256, 64, True)
    assert not s5.v_with_k(128, 64, True) and not s5.v_with_k(64, 64, True)
    assert all(s5.v_with_k(hd, bs, tok) for hd in (64, 128) for bs in (16, 64) for tok in (False, True)
               if not (tok and bs == 64))
    assert "head_dim 256, and per-token\n# scales on 64-token pages" in (NB / "06_head_dim_split_pv.py").read_text() \
        or "head_dim 256, and per-token scales on 64-token pages" in _prose(CH06).replace("\n", " ")


def test_06_empty_partition_pmax_is_masked_times_ln2():
    text = "\n".join(_outputs(CH06))
    m = re.search(r"The empty partition's `pmax` is (-?[0-9.e+]+)", text)
    assert m, "the empty-partition sentence is missing"
    assert float(m.group(1)) == pytest.approx(kernel_lib.MASKED / kernel_lib.LOG2E, rel=1e-3)
    assert "`MASKED · ln 2`" in text


def test_06_every_upstream_configuration_is_met():
    text = "\n".join(_outputs(CH06))
    m = re.search(r"(\d+) of (\d+) meet or beat upstream", text)
    assert m and m.group(1) == m.group(2) == "48"


def test_06_head_dim_256_sentence_agrees_with_its_table():
    rows = _table_after(CH06, "block", has="waves_256")
    one = [r for r in rows if r["query_len"] == "1"]
    waves = {float(r["waves_256"]) for r in one}
    text = "\n".join(_outputs(CH06))
    m = re.search(r"With one\s+M-tile the peak is [0-9–]+ registers:\s+([0-9–]+) waves per SIMD", text)
    assert m, "the head_dim 256 sentence is missing"
    assert m.group(1) == "–".join(f"{w:.0f}" for w in sorted(waves))
    assert waves == {3.0}  # issue 36: the chapter once said 2 beside a table showing 3


def test_06_max_table_bank_arithmetic():
    # the 16 rows' words 4*row + wave land on 8 of gfx942's 32 banks, two rows to a bank
    banks = arch.INFO["gfx942"].lds_banks
    assert banks == 32
    for wave in range(kernel_lib.WAVES):
        hit = [(4 * row + wave) % banks for row in range(16)]
        assert len(set(hit)) == 8 and max(hit.count(b) for b in set(hit)) == 2
    assert "fall on 8 of gfx942's 32 banks" in _prose(CH06).replace("\n# ", " ").replace("\n", " ")


def test_06_output_registers_sentence():
    text = "\n".join(_outputs(CH06))
    m = re.search(r"with (\d+) registers a SIMD holds at most\s+(\d+) waves", text)
    assert m and int(m.group(1)) == 8 * 128 // 4
    assert int(m.group(2)) == isa.occupancy_for("gfx942", int(m.group(1))).waves_per_simd


@pytest.mark.parametrize("path", [CH05, CH06], ids=lambda p: p.stem)
def test_appendix_is_linked(path):
    assert "appendix_register_resident_loop" in _prose(path)


def test_appendix_history_table_has_the_19_configurations():
    rows = [line for line in _prose(APPENDIX).splitlines() if re.match(r"\| gfx9(42|50) \|", line)]
    assert len(rows) == 19 and "short on 19 of the 64" in _prose(APPENDIX)
