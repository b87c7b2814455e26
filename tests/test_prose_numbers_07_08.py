"""Chapters 07 and 08 say only what their cells computed: the numbers their prose states are the
code's constants or the outputs beside them, predicted times are labelled and rare, the history
and validation live in the linked appendices, and the chapters open and close as every chapter
does. Reads the committed notebooks; executes nothing."""

import json
import re
from pathlib import Path

import pytest

from pa_tile import kernel_lib
from pa_tile.stages import s6_split_k as s6

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks"
CH07 = NB / "07_split_k_and_the_finished_kernel.ipynb"
CH08 = NB / "09_performance.ipynb"
APPENDICES = {CH07: "appendix_split_k_choices", CH08: "appendix_timing_model_validation"}
ALL = [CH07, CH08, *(NB / f"{a}.ipynb" for a in APPENDICES.values())]


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _src(cell):
    return "".join(cell["source"])


def _out_text(cell):
    """Everything a code cell printed or displayed (Markdown where it has it, else plain text)."""
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append("".join(o["text"]))
        elif "data" in o:
            d = o["data"]
            parts.append("".join(d.get("text/markdown", d.get("text/plain", ""))))
    return "\n".join(parts)


def _prose(path):
    """Markdown cells' text with fenced code blocks removed (the reader limits' word count)."""
    return [re.sub(r"^```.*?^```", "", _src(c), flags=re.S | re.M) for c in _cells(path)
            if c["cell_type"] == "markdown"]


def _rendered(path, start):
    """The displayed Markdown of the first code cell whose output starts with ``start``."""
    for c in _cells(path):
        if c["cell_type"] == "code" and _out_text(c).lstrip().startswith(start):
            return _out_text(c)
    raise AssertionError(f"{path.name}: no cell displays text starting {start!r}")


@pytest.mark.parametrize("path", [CH07, CH08], ids=lambda p: p.stem[:2])
def test_opens_and_closes_like_every_chapter(path):
    md = [c for c in _cells(path) if c["cell_type"] == "markdown"]
    head = "\n".join(_src(c) for c in md[:2])
    for label in ("**You'll learn**", "**You need**", "**Runs on**"):
        assert label in head, f"{path.name}: {label} missing from the opening"
    learn = head.split("**You'll learn**")[1].split("**You need**")[0]
    assert 3 <= len(re.findall(r"(?m)^\* ", learn)) <= 5
    cells = _cells(path)
    i = next(k for k, c in enumerate(cells) if c["cell_type"] == "markdown"
             and _src(c).startswith("## What you built"))
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", _src(cells[i]), flags=re.S | re.M)
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 30
    assert cells[i + 1]["cell_type"] == "code" and "show.measured(" in _src(cells[i + 1])
    assert _out_text(cells[i + 1]).startswith("| ")


@pytest.mark.parametrize("path", [CH07, CH08], ids=lambda p: p.stem[:2])
def test_words_within_the_course_limit(path):
    words = sum(len(p.split()) for p in _prose(path))
    assert words <= 3500, f"{path.name}: {words} words of prose"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_no_line_over_100_characters(path):
    long = []
    for k, c in enumerate(_cells(path)):
        if c["cell_type"] != "code":
            continue
        for line in _src(c).splitlines() + _out_text(c).splitlines():
            if len(line) > 100:
                long.append((k, line[:60]))
    assert not long, long


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_executed_without_error(path):
    errors = [k for k, c in enumerate(_cells(path)) if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors and (NB / f"{path.stem}.py").exists()


@pytest.mark.parametrize("path", [CH07, CH08], ids=lambda p: p.stem[:2])
def test_links_its_appendix(path):
    name = APPENDICES[path]
    assert any(re.search(rf"\]\([^)]*{name}[^)]*\)", p) for p in _prose(path)), name
    assert (NB / f"{name}.py").exists()


def test_07_predicts_a_time_once_and_labels_it():
    cells = [c for c in _cells(CH07) if c["cell_type"] == "code"]
    timed = [c for c in cells if re.search(r"\d\s*µs", _out_text(c))]
    predicted = [c for c in timed if "PREDICTED" in _out_text(c)]
    measured = [c for c in timed if "Measured by upstream" in _out_text(c)]
    assert len(predicted) <= 1 and set(map(id, timed)) <= set(map(id, predicted + measured))
    assert not any(re.search(r"\d\s*µs", p) for p in _prose(CH07)), "a time in 07's prose"


def test_07_prose_states_the_code_s_constants():
    prose = " ".join(" ".join(_prose(CH07)).split())
    assert s6.REDUCE_GROUP == 4 and "`REDUCE_GROUP` = 4" in prose
    assert "group's 12 loads" in prose and 3 * s6.REDUCE_GROUP == 12  # m, ℓ and o of each partition
    assert s6.REDUCE_THREADS == 256 and "a 256-thread workgroup merges 16, 8 or 4 rows" in prose
    lanes = [s6.reduce_geometry(hd, 8, 1).LPR for hd in (64, 128, 256)]
    rows = [s6.reduce_geometry(hd, 8, 1).RPW for hd in (64, 128, 256)]
    assert lanes == [16, 32, 64] and rows == [16, 8, 4] and "lanes (16, 32 or 64)" in prose
    assert s6.PAST_PARTIALS == -(2**31) and "byte offset 2^31" in prose
    assert (s6.WORKGROUPS_PER_CU, s6.MIN_TILES_PER_PARTITION, s6.PARTIAL_BYTES_BUDGET) == (4, 2, 0.03)
    assert "aims for 4 workgroups per CU" in prose and "least 2 tiles" in prose and "under 3 %" in prose


@pytest.mark.parametrize("path", [CH07, CH08], ids=lambda p: p.stem[:2])
def test_what_you_built_matches_the_kernel(path):
    code = next(re.findall(r"^```[^\n]*\n(.*?)^```", p, flags=re.S | re.M)[0]
                for p in (_src(c) for c in _cells(path) if c["cell_type"] == "markdown")
                if p.startswith("## What you built"))
    assert f"{kernel_lib.WAVES} waves x {kernel_lib.WAVE} lanes" in code
    assert f"{kernel_lib.TILE}-token tile" in code
    assert f"{s6.TRAFFIC_CAP}x the compulsory bytes" in code
    assert f"{s6.REDUCE_GROUP} partitions" in code and "4 channels a lane" in code


def test_07_head_dim_256_sentence_is_its_table():
    table = _rendered(CH07, "chapter 06's kernel accepts head_dim 256")
    rows = {}
    for line in table.splitlines():
        f = line.split()
        if f and f[0] in ("128", "256"):
            rows[(int(f[0]), f[1])] = dict(vgpr=int(f[2]), lds=int(f[6]), waves=float(f[7]))
    text = " ".join(_rendered(CH07, "head_dim 256 costs").split())
    a, b = rows[(128, "per-tensor")], rows[(256, "per-tensor")]
    assert f"costs {b['vgpr'] - a['vgpr']} more VGPRs than 128 ({a['vgpr']} → {b['vgpr']};" in text
    assert f"from {a['waves']:g} to {b['waves']:g} waves per SIMD" in text
    assert f"LDS grows by {b['lds'] - a['lds']:,} B" in text
    assert "splitting the output across waves" not in "\n".join(_prose(CH07))


def test_08_stage_5_registers_are_the_table_s():
    table = next(_out_text(c) for c in _cells(CH08) if c["cell_type"] == "code"
                 and _out_text(c).startswith("stage  arch"))
    s5 = sorted({int(line.split()[3]) for line in table.splitlines() if line.startswith("s5 ")})
    text = " ".join(_rendered(CH08, "What the compiled code says").split())
    assert f"{s5[0]}-{s5[-1]} VGPRs" in text
    assert "116-124" not in text


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_memory_is_counted_in_128_byte_lines(path):
    for p in _prose(path) + [_out_text(c) for c in _cells(path) if c["cell_type"] == "code"]:
        assert "64-byte" not in p and "64 B segment" not in p


def test_08_headline_figure_shows_the_floor_and_the_measured_bar():
    src = next(_src(c) for c in _cells(CH08) if "figures.stage_predictions(" in _src(c))
    assert "floors=" in src and '"measured"' in src
    printed = next(_out_text(c) for c in _cells(CH08) if "HBM floor (bytes / bandwidth)" in _out_text(c))
    assert "PREDICTED" in printed


def test_kernel_map_draws_every_region_passed_in():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pa_tile import figures

    regions = {"row max / sum": 256, "staged query": 2304, "P slab": 4096}
    fig = figures.kernel_map(head_dim=128, group=8, waves=4, wave_lanes=64, tile_tokens=256, lds_regions=regions,
                             lds_bytes=6656, reduce_group=4, reduce_threads=256)
    try:
        fig.canvas.draw()
        assert fig.get_size_inches()[0] <= figures.WIDTH + 1e-9
        text = " ".join(t.get_text() for t in fig.axes[0].texts)
        assert all(f"{name}\n{n:,} B" in text for name, n in regions.items()) and "6,656 B" in text
        assert "w3: 192-255" in text and "w3: d 96-127" in text  # tokens, then channels, per wave
        assert fig.axes[0].get_legend() is not None
    finally:
        plt.close(fig)


def test_stage_predictions_keeps_a_measured_bar_apart_from_a_predicted_one():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pa_tile import figures

    fig = figures.stage_predictions(["s1", "s2"], {"A": [100.0, 50.0], "B": [90.0, None]}, title="PREDICTED",
                                    floors={"floor A": (10.0, "A")},
                                    reference={"measured 58": (58.0, "measured"), "PREDICTED 58": (58.0, "A")})
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        heights = sorted(round(p.get_height()) for p in ax.patches if p.get_height() == p.get_height())
        assert heights.count(58) == 2, "equal measured and predicted times are two bars"
        assert [ln.get_ydata()[0] for ln in ax.get_lines()] == [10.0]  # the floor
        assert any(p.get_hatch() for p in ax.patches)  # the measured bar is hatched
    finally:
        plt.close(fig)
