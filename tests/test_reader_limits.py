"""The course's reader limits, held over the committed notebooks (executes nothing).

Every main chapter (``notebooks/[0-9][0-9]_*.ipynb``, found by glob: a new or renamed chapter is
held to the same rules without editing this file):

* opens with the three bold labels ``**You'll learn**`` (3-5 bullets), ``**You need**`` and
  ``**Runs on**`` in its first or second markdown cell;
* closes with a markdown cell starting ``## What you built`` holding one fenced block of
  pseudo-code (at most 30 lines), followed by a code cell calling ``show.measured(``;
* has at most 3,500 words of prose (whitespace-separated tokens of its markdown cells, fenced
  code blocks removed), and the main path at most 20,000;
* has no line over 100 characters in a code cell's source, its printed output or the text it
  displays;
* has no code cell a reader must scroll past (45 lines), no wall of printed numbers (30 lines)
  and no displayed listing over 45 lines: a long piece of kernel is shown in named pieces.

Every appendix (``notebooks/appendix_<name>``) is a pair (``.py`` + ``.ipynb``) and is linked
from at least one main chapter by a Markdown link whose target contains ``appendix_<name>``.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))

#: lines of a code cell's source (a screen of a notebook at GitHub's width)
MAX_CODE_LINES = 45
#: lines of text one code cell prints (a table a reader takes in, not a listing)
MAX_OUTPUT_LINES = 30
#: lines of text one code cell displays (a ``source(...)`` listing, fences included)
MAX_DISPLAY_LINES = 45
#: characters of any line a reader sees: code, printed output, displayed text
MAX_LINE = 100
#: prose words of one main chapter, and of the whole main path
MAX_CHAPTER_WORDS = 3500
MAX_TOTAL_WORDS = 20000
#: lines of the "What you built" pseudo-code
MAX_BUILT_LINES = 30
OPENING_LABELS = ("**You'll learn**", "**You need**", "**Runs on**")
CLOSING_HEADING = "## What you built"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _src(cell):
    return "".join(cell["source"])


def _code_cells(path):
    return [c for c in _cells(path) if c["cell_type"] == "code"]


def _markdown(path):
    return [_src(c) for c in _cells(path) if c["cell_type"] == "markdown"]


def prose_words(path) -> int:
    """Whitespace-separated tokens of the markdown cells, fenced code blocks removed."""
    return sum(len(FENCE.sub("", text).split()) for text in _markdown(path))


def _printed(cell):
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _displayed(cell):
    """The text a cell displays: each rich output's markdown (what a notebook viewer renders),
    else its plain text; a figure counts as its one-line text stand-in."""
    texts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") in ("display_data", "execute_result"):
            data = o.get("data", {})
            texts.append("".join(data.get("text/markdown", data.get("text/plain", ""))))
    return "\n".join(texts)


def _name(path):
    return path.stem


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_no_code_cell_to_scroll_past(path):
    long = [(i, len(_src(c).splitlines())) for i, c in enumerate(_code_cells(path))
            if len(_src(c).splitlines()) > MAX_CODE_LINES]
    assert not long, f"{_name(path)}: code cells (index, lines) over {MAX_CODE_LINES} lines: {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_no_wall_of_printed_numbers(path):
    long = [(i, len(_printed(c).splitlines())) for i, c in enumerate(_code_cells(path))
            if len(_printed(c).splitlines()) > MAX_OUTPUT_LINES]
    assert not long, f"{_name(path)}: code cells (index, printed lines) over {MAX_OUTPUT_LINES} lines: {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_no_listing_to_scroll_past(path):
    long = [(i, len(_displayed(c).splitlines())) for i, c in enumerate(_code_cells(path))
            if len(_displayed(c).splitlines()) > MAX_DISPLAY_LINES]
    assert not long, f"{_name(path)}: code cells (index, displayed lines) over {MAX_DISPLAY_LINES} lines: {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_no_line_wider_than_a_reader_sees(path):
    wide = []
    for i, c in enumerate(_code_cells(path)):
        for what, text in (("source", _src(c)), ("printed", _printed(c)), ("displayed", _displayed(c))):
            for line in text.splitlines():
                if len(line) > MAX_LINE:
                    wide.append(f"code cell {i} {what} ({len(line)} chars): {line[:60]}...")
    assert not wide, (f"{_name(path)}: {len(wide)} lines over {MAX_LINE} characters:\n" + "\n".join(wide[:12]))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_opens_with_learn_need_runs_on(path):
    md = _markdown(path)
    head = "\n".join(md[:2])
    missing = [label for label in OPENING_LABELS if label not in head]
    assert not missing, f"{_name(path)}: the first two markdown cells lack the opening label(s) {missing}"
    learn = head.split(OPENING_LABELS[0], 1)[1].split(OPENING_LABELS[1], 1)[0]
    bullets = [ln for ln in learn.splitlines() if re.match(r"\s{0,3}([-*+]|\d+\.)\s", ln)]
    assert 3 <= len(bullets) <= 5, (f"{_name(path)}: **You'll learn** has {len(bullets)} bullets "
                                    "before **You need**; want 3-5")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_closes_with_what_you_built(path):
    cells = _cells(path)
    md_idx = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    built = [i for i in md_idx if _src(cells[i]).lstrip().startswith(CLOSING_HEADING)]
    assert built, f"{_name(path)}: no markdown cell starts with '{CLOSING_HEADING}'"
    assert len(built) == 1, f"{_name(path)}: {len(built)} cells start with '{CLOSING_HEADING}'; want one"
    i = built[0]
    assert i == md_idx[-1], (f"{_name(path)}: '{CLOSING_HEADING}' (cell {i}) is not the last markdown "
                             f"cell (cell {md_idx[-1]} is): the chapter must close with it")
    fences = FENCE.findall(_src(cells[i]))
    blocks = [m.group(0) for m in FENCE.finditer(_src(cells[i]))]
    assert len(fences) == 1, (f"{_name(path)}: '{CLOSING_HEADING}' holds {len(fences)} fenced blocks; "
                              "want one block of pseudo-code")
    lines = len(blocks[0].splitlines()) - 2
    assert lines <= MAX_BUILT_LINES, (f"{_name(path)}: the '{CLOSING_HEADING}' pseudo-code is {lines} "
                                      f"lines; at most {MAX_BUILT_LINES}")
    after = cells[i + 1] if i + 1 < len(cells) else None
    assert after is not None and after["cell_type"] == "code" and "show.measured(" in _src(after), (
        f"{_name(path)}: the cell after '{CLOSING_HEADING}' must be a code cell calling show.measured(")
    assert after.get("outputs"), f"{_name(path)}: the show.measured( cell has no output (not executed?)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_chapter_prose_within_budget(path):
    n = prose_words(path)
    assert n <= MAX_CHAPTER_WORDS, f"{_name(path)}: {n} words of prose; at most {MAX_CHAPTER_WORDS}"


def test_main_path_prose_within_budget():
    words = {_name(p): prose_words(p) for p in NOTEBOOKS}
    total = sum(words.values())
    assert total <= MAX_TOTAL_WORDS, (f"main path: {total} words of prose over {len(words)} chapters; at most "
                                      f"{MAX_TOTAL_WORDS} ({words})")


def test_every_appendix_is_a_pair_linked_from_a_chapter():
    stems = {p.stem for p in NB_DIR.glob("appendix_*.py")} | {p.stem for p in NB_DIR.glob("appendix_*.ipynb")}
    unpaired = sorted(s for s in stems if not ((NB_DIR / f"{s}.py").exists() and (NB_DIR / f"{s}.ipynb").exists()))
    assert not unpaired, f"appendices without both a .py and an .ipynb: {unpaired}"
    links = []
    for p in NOTEBOOKS:
        for text in _markdown(p):
            links += re.findall(r"\]\(([^)\s]+)", text)
    unlinked = sorted(s for s in stems if not any(s in target for target in links))
    assert not unlinked, (f"appendices no main chapter links to (a Markdown link whose target contains "
                          f"the name): {unlinked}")
