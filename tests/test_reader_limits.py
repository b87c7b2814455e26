"""No code cell a reader must scroll past, no wall of printed numbers: the walkthrough's cells stay
at the length of a CuTe DSL notebook's (~30-40 lines) and a printed output at the length of a
table, so a long piece of kernel is shown in named pieces and a long listing becomes a summary
or a figure. The same holds for what a cell displays: a library listing (``pa_tile.show.source``)
is shown a few helpers at a time, each after the prose that motivates it. Reads the committed
notebooks; executes nothing."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

#: lines of a code cell's source (a screen of a notebook at GitHub's width)
MAX_CODE_LINES = 45
#: lines of text one code cell prints (a table a reader takes in, not a listing)
MAX_OUTPUT_LINES = 30
#: lines of text one code cell displays (a ``source(...)`` listing, fences included)
MAX_DISPLAY_LINES = 45


def _code_cells(path):
    return [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]


def _printed(cell):
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _displayed_lines(cell):
    """Lines of the text a cell displays: each rich output's markdown (what a notebook viewer
    renders), else its plain text; figures count their one-line text stand-in."""
    n = 0
    for o in cell.get("outputs", []):
        if o.get("output_type") in ("display_data", "execute_result"):
            data = o.get("data", {})
            text = data.get("text/markdown", data.get("text/plain", ""))
            n += len("".join(text).splitlines())
    return n


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_code_cell_to_scroll_past(path):
    long = [(i, len("".join(c["source"]).splitlines())) for i, c in enumerate(_code_cells(path))
            if len("".join(c["source"]).splitlines()) > MAX_CODE_LINES]
    assert not long, f"code cells (index, lines) over {MAX_CODE_LINES} lines: {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_wall_of_printed_numbers(path):
    long = [(i, len(_printed(c).splitlines())) for i, c in enumerate(_code_cells(path))
            if len(_printed(c).splitlines()) > MAX_OUTPUT_LINES]
    assert not long, f"code cells (index, printed lines) over {MAX_OUTPUT_LINES} lines: {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_listing_to_scroll_past(path):
    long = [(i, _displayed_lines(c)) for i, c in enumerate(_code_cells(path)) if _displayed_lines(c) > MAX_DISPLAY_LINES]
    assert not long, f"code cells (index, displayed lines) over {MAX_DISPLAY_LINES} lines: {long}"
