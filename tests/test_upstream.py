"""pa_tile.upstream: the upstream pa_decode_tile figures, parsed from the package's markdown table.

Spot values are copied by hand from pa_tile/data/upstream_pa_decode_tile_isa.md.
"""

import itertools
import tomllib
from pathlib import Path

import pytest

from pa_tile import upstream

ROOT = Path(__file__).resolve().parent.parent


def test_sixty_four_rows_one_per_configuration():
    rows = upstream.tile_isa_figures()
    assert len(rows) == 64
    keys = [(r["arch"], r["block"], r["head_dim"], r["query_len"], r["group"], r["scales"]) for r in rows]
    # the full grid, each configuration once, in the file's (sorted) order
    assert keys == list(itertools.product(("gfx942", "gfx950"), (16, 64), (64, 128), (1, 4), (8, 16),
                                          ("per-tensor", "per-token")))


def test_fields_are_typed():
    for r in upstream.tile_isa_figures():
        assert set(r) == set(upstream.COLUMNS) | {"per_token"}
        assert isinstance(r["arch"], str) and isinstance(r["scales"], str)
        assert r["per_token"] is (r["scales"] == "per-token")
        for col in upstream.COLUMNS:
            if col not in ("arch", "scales"):
                assert type(r[col]) is int, (col, r[col])


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
    (("gfx942", 16, 256, 1, 8, False), "head_dim"),
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
