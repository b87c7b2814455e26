"""docs/glossary.md, the course's one glossary (chapter 00 and the book render it): every AMD row
names a source, every source key it uses is defined under "Sources", and its tables fit the
100-character lines chapter 00 displays them in."""

import re
from pathlib import Path

GLOSSARY = Path(__file__).resolve().parent.parent / "docs" / "glossary.md"


def _section(text, title):
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _rows(section):
    return [ln for ln in section.splitlines() if ln.startswith("|") and not ln.startswith("|---")][1:]


def test_every_amd_row_names_a_defined_source():
    text = GLOSSARY.read_text(encoding="utf-8")
    defined = set(re.findall(r"^- \[([A-Z0-9]+)\]", _section(text, "Sources"), re.M))
    assert defined, "glossary: no source keys defined under '## Sources'"
    rows = _rows(_section(text, "CUDA -> AMD"))
    assert len(rows) >= 20, f"glossary: only {len(rows)} CUDA -> AMD rows"
    for row in rows:
        keys = re.findall(r"\[([A-Z0-9]+)\]", row.rstrip("|").rsplit("|", 1)[-1])
        assert keys, f"glossary: no source for the row {row!r}"
        assert set(keys) <= defined, f"glossary: {set(keys) - defined} used but not defined: {row!r}"


def test_tables_fit_the_chapter_width():
    text = GLOSSARY.read_text(encoding="utf-8")
    wide = [ln for ln in text.splitlines() if ln.startswith("|") and len(ln) > 100]
    assert not wide, f"glossary: table lines over 100 characters (chapter 00 shows them): {wide}"


def test_the_words_the_brief_names_are_there():
    text = GLOSSARY.read_text(encoding="utf-8")
    for word in ("wave", "SIMD", "CU", "workgroup", "LDS", "VGPR", "AGPR", "SGPR", "s_waitcnt", "vmcnt",
                 "lgkmcnt", "buffer load", "global load", "V#", "MFMA", "DPP", "ds_swizzle", "ds_bpermute",
                 "occupancy", "gfx942", "gfx950", "FNUZ", "OCP", "stage", "upstream", "partition",
                 "compulsory bytes", "PREDICTED"):
        assert word in text, f"glossary: no entry for {word!r}"
