"""pa_tile.upstream: the upstream pa_decode_tile figures, parsed from the package's markdown table.

Spot values are copied by hand from pa_tile/data/upstream_pa_decode_tile_isa.md.
"""

import itertools
import tomllib
from pathlib import Path

import pytest

from pa_tile import upstream

ROOT = Path(__file__).resolve().parent.parent


def test_ninety_six_rows_one_per_configuration():
    rows = upstream.tile_isa_figures()
    assert len(rows) == 96
    keys = [(r["arch"], r["block"], r["head_dim"], r["query_len"], r["group"], r["scales"]) for r in rows]
    # the full grid, each configuration once, in the file's (sorted) order
    assert keys == list(itertools.product(("gfx942", "gfx950"), (16, 64), (64, 128, 256), (1, 4), (8, 16),
                                          ("per-tensor", "per-token")))
    assert sum(r["head_dim"] == 256 for r in rows) == 32


def test_provenance_constants():
    # upstream main's flydsl 0.5.0 release commit, compiled with flydsl 0.5.0 (the table's header)
    assert upstream.UPSTREAM_COMMIT == "11c4174d82b7491c2d08d5828a254183f2a8b959"
    assert upstream.FLYDSL_VERSION == "0.5.0"
    text = upstream.TABLE_PATH.read_text()
    assert "scripts/record_upstream_isa.py" in text
    assert "#825" not in text and "pr-825" not in text.lower()  # upstream main's figures, not PR #825's


@pytest.mark.parametrize("args,expected", [
    (("gfx942", 16, 64, 1, 8, False),
     dict(scales="per-tensor", vgpr=86, agpr=0, lds=6144, instr=660, gx4=12, ds=26, bar=3, mfma=16, occ=5)),
    (("gfx942", 16, 128, 4, 16, True),
     dict(scales="per-token", vgpr=262, agpr=6, lds=18580, instr=2343, gx4=24, ds=116, bar=9, mfma=128, occ=1)),
    (("gfx950", 64, 64, 1, 16, False),
     dict(scales="per-tensor", vgpr=92, agpr=0, lds=6096, instr=588, gx4=12, ds=20, bar=3, mfma=16, occ=5)),
    (("gfx950", 64, 128, 4, 16, True),
     dict(scales="per-token", vgpr=266, agpr=10, lds=18532, instr=2096, gx4=24, ds=100, bar=9, mfma=128, occ=1)),
    (("gfx950", 16, 64, 4, 8, True),
     dict(scales="per-token", vgpr=144, agpr=0, lds=11668, instr=1018, gx4=12, ds=51, bar=5, mfma=32, occ=3)),
    # head_dim 256 (upstream compiles it; rows added by scripts/record_upstream_isa.py)
    (("gfx942", 16, 256, 1, 8, False),
     dict(scales="per-tensor", vgpr=188, agpr=0, lds=9216, instr=1184, gx4=48, ds=29, bar=3, mfma=64, occ=2)),
    (("gfx942", 64, 256, 4, 16, True),
     dict(scales="per-token", vgpr=399, agpr=143, lds=26724, instr=3255, gx4=48, ds=126, bar=9, mfma=256, occ=1)),
    (("gfx950", 16, 256, 4, 8, True),
     dict(scales="per-token", vgpr=302, agpr=46, lds=17812, instr=1655, gx4=48, ds=57, bar=5, mfma=128, occ=1)),
    (("gfx950", 64, 256, 1, 16, False),
     dict(scales="per-tensor", vgpr=192, agpr=0, lds=9168, instr=1018, gx4=48, ds=23, bar=3, mfma=64, occ=2)),
])
def test_spot_values(args, expected):
    r = upstream.tile_isa_figure(*args)
    assert (r["arch"], r["block"], r["head_dim"], r["query_len"], r["group"], r["per_token"]) == args
    assert {k: r[k] for k in expected} == expected


def test_scale_kinds_are_distinct_rows():
    ten = upstream.tile_isa_figure("gfx942", 64, 128, 1, 16, per_token=False)
    tok = upstream.tile_isa_figure("gfx942", 64, 128, 1, 16, per_token=True)
    assert (ten["scales"], ten["vgpr"], ten["lds"]) == ("per-tensor", 122, 7120)
    assert (tok["scales"], tok["vgpr"], tok["lds"]) == ("per-token", 128, 11236)
    # 0/1 work as flags (notebook keys use them)
    assert upstream.tile_isa_figure("gfx942", 64, 128, 1, 16, 1) == tok


@pytest.mark.parametrize("args,name", [
    (("gfx90a", 16, 64, 1, 8, False), "arch"),
    (("gfx942", 32, 64, 1, 8, False), "block_size"),
    (("gfx942", 16, 96, 1, 8, False), "head_dim"),
    (("gfx950", 16, 64, 2, 8, False), "query_length"),
    (("gfx950", 16, 64, 1, 4, True), "group"),
])
def test_unknown_configuration_names_the_argument(args, name):
    with pytest.raises(ValueError, match=rf"{name}=.*recorded: \["):
        upstream.tile_isa_figure(*args)


def test_per_token_must_be_a_flag():
    with pytest.raises(TypeError, match="per_token"):
        upstream.tile_isa_figure("gfx942", 16, 64, 1, 8, "per-token")


def test_results_are_copies():
    upstream.tile_isa_figures()[0]["vgpr"] = -1
    upstream.tile_isa_figure("gfx942", 16, 64, 1, 8, False)["occ"] = -1
    r = upstream.tile_isa_figure("gfx942", 16, 64, 1, 8, False)
    assert (r["vgpr"], r["occ"]) == (86, 5)


_HEAD = "| " + " | ".join(upstream.COLUMNS) + " |\n|" + "---|" * len(upstream.COLUMNS) + "\n"
_ROW = "| gfx942 | 16 | 64 | 1 | 8 | per-tensor | 86 | 0 | 6144 | 660 | 12 | 26 | 3 | 16 | 5 |\n"


@pytest.mark.parametrize("text,match", [
    ("no table here\n", "exactly one table"),
    (_HEAD.replace("| occ |", "| waves |"), "columns"),
    (_HEAD, "no rows"),
    (_HEAD + _ROW.replace("| 5 |", "| 5 | 9 |"), "16 cells"),
    (_HEAD + _ROW.replace("| 86 |", "| 8x6 |"), "'vgpr' is not an integer"),
    (_HEAD + _ROW.replace("per-tensor", "per-channel"), "scales"),
    (_HEAD + _ROW + _ROW, "appears twice"),
])
def test_malformed_tables_are_rejected(text, match):
    with pytest.raises(ValueError, match=match):
        upstream._parse("# title\n\n" + text + "\nafter\n", "t.md")


def test_parse_stops_at_the_end_of_the_table():
    (row,) = upstream._parse(_HEAD + _ROW + "\n| not | part |\n", "t.md")
    assert row["vgpr"] == 86 and row["per_token"] is False


def test_table_ships_with_the_package():
    assert upstream.TABLE_PATH == ROOT / "pa_tile" / "data" / "upstream_pa_decode_tile_isa.md"
    assert upstream.TABLE_PATH.is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/*.md" in data["pa_tile"]


@pytest.mark.parametrize("text,match", [
    ("# t\n\n- flydsl version: `0.5.0`\n", "upstream commit"),
    ("# t\n\n- upstream commit: `" + "a" * 40 + "`\n", "flydsl version"),
    ("# t\n\n- upstream commit: `11c4174d`\n- flydsl version: `0.5.0`\n", "upstream commit"),  # not a full hash
])
def test_provenance_lines_are_required(text, match):
    with pytest.raises(ValueError, match=match):
        upstream._provenance(text + _HEAD + _ROW, "t.md")


def test_provenance_is_read_above_the_table():
    head = "- upstream commit: `" + "b" * 40 + "`\n- flydsl version: `9.9`\n\n"
    assert upstream._provenance(head + _HEAD + _ROW, "t.md") == {"commit": "b" * 40, "flydsl": "9.9"}


def test_fields_are_typed():
    for r in upstream.tile_isa_figures():
        assert set(r) == set(upstream.COLUMNS) | {"per_token"}
        assert isinstance(r["arch"], str) and isinstance(r["scales"], str)
        assert r["per_token"] is (r["scales"] == "per-token")
        for col in upstream.COLUMNS:
            if col not in ("arch", "scales"):
                assert type(r[col]) is int, (col, r[col])


def _recorder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_upstream_isa", ROOT / "scripts" / "record_upstream_isa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recorder_writes_what_this_module_parses():
    rec = _recorder()
    fig = dict(vgpr=90, agpr=0, lds=6144, instr=600, gx4=12, ds=20, bar=3, mfma=16, occ=5,
               _vspill=0, _sspill=0, _scratch=0, _bound=("vgpr",))
    keys = [("gfx950", 16, 64, 1, 8, "per-token"), ("gfx942", 16, 64, 1, 8, "per-tensor")]
    info = dict(commit="c" * 40, date="2026-08-21", subject="s", on_main=True, flydsl="0.5.0",
                files=[rec.KERNEL_PATH], external=["flydsl", "torch"], skipped=[])
    text = rec.render(info, {k: fig for k in keys}, {("gfx942", 16, 96, 1, 8, "per-tensor"): "AssertionError: x"})
    spilled = rec.render(info, {keys[0]: dict(fig, _vspill=4)}, {})
    assert upstream._provenance(text, "t.md") == {"commit": "c" * 40, "flydsl": "0.5.0"}
    rows = upstream._parse(text, "t.md")
    assert [(r["arch"], r["scales"]) for r in rows] == [("gfx942", "per-tensor"), ("gfx950", "per-token")]  # sorted
    assert rows[0]["vgpr"] == 90 and rows[0]["occ"] == 5
    assert "rejected by upstream" in text and "vgpr in 2 of 2 rows" in text and "0 in every row" in text
    assert "0 except in 1 row: gfx950 16 64 1 8 per-token: 4 VGPR and 0 SGPR spills, 0 B scratch" in spilled
    assert "accepted and compiled every configuration" in spilled


def test_recorder_reads_module_level_imports_only():
    top, nested = _recorder()._module_level_imports(
        "import torch\nfrom kernels.common import utils\ntry:\n    import numpy\nexcept ImportError:\n    pass\n"
        "def f():\n    from kernels.attention.pa_decode_fp8 import X\n")
    assert "torch" in top and "kernels.common.utils" in top and "numpy" in top
    assert nested == ["kernels.attention.pa_decode_fp8", "kernels.attention.pa_decode_fp8.X"]
