"""The recorded resource figures of upstream FlyDSL's ``pa_decode_tile``, from one file.

``pa_tile/data/upstream_pa_decode_tile_isa.md`` is the only copy of the figures (its header says
how they were measured); tests and notebooks compare against them through this module, so a
correction lands everywhere at once. ``scripts/record_upstream_isa.py`` writes that file: it
compiles upstream's kernel at one commit with the installed flydsl and reads the figures with
``pa_tile.isa``. The header's provenance is exposed as ``UPSTREAM_COMMIT`` (full hash of the
ROCm/FlyDSL commit) and ``FLYDSL_VERSION`` (the flydsl that compiled every row), also as
``provenance()``.

``tile_isa_figures()`` returns every row of its table as a dict keyed by the table's column
names (``arch``, ``block``, ``head_dim``, ``query_len``, ``group``, ``scales``, ``vgpr``, ``agpr``,
``lds``, ``instr``, ``gx4``, ``ds``, ``bar``, ``mfma``, ``occ``; numbers as ``int``) plus
``per_token`` (``bool``, from ``scales``). ``tile_isa_figure(...)`` looks one configuration up.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parent / "data" / "upstream_pa_decode_tile_isa.md"

COLUMNS = ("arch", "block", "head_dim", "query_len", "group", "scales",
           "vgpr", "agpr", "lds", "instr", "gx4", "ds", "bar", "mfma", "occ")
SCALES = ("per-tensor", "per-token")
_TEXT_COLUMNS = ("arch", "scales")
_PROVENANCE = {"commit": re.compile(r"^- upstream commit: `([0-9a-f]{40})`", re.M),
               "flydsl": re.compile(r"^- flydsl version: `([^`\s]+)`", re.M)}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _parse(text: str, source: str) -> tuple[dict, ...]:
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("|") and _cells(ln)[:1] == ["arch"]]
    if len(starts) != 1:
        raise ValueError(f"{source}: expected exactly one table with an 'arch' column, found {len(starts)}")
    head = starts[0]
    if tuple(_cells(lines[head])) != COLUMNS:
        raise ValueError(f"{source}: table columns {_cells(lines[head])} are not {list(COLUMNS)}")
    rows, seen = [], set()
    for n, line in enumerate(lines[head + 2:], start=head + 3):
        if not line.startswith("|"):
            break
        cells = _cells(line)
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{source}:{n}: {len(cells)} cells, expected {len(COLUMNS)}")
        row = {}
        for col, cell in zip(COLUMNS, cells):
            try:
                row[col] = cell if col in _TEXT_COLUMNS else int(cell)
            except ValueError:
                raise ValueError(f"{source}:{n}: column {col!r} is not an integer: {cell!r}") from None
        if row["scales"] not in SCALES:
            raise ValueError(f"{source}:{n}: scales {row['scales']!r} is not one of {SCALES}")
        row["per_token"] = row["scales"] == "per-token"
        key = _key(row)
        if key in seen:
            raise ValueError(f"{source}:{n}: configuration {key} appears twice")
        seen.add(key)
        rows.append(row)
    if not rows:
        raise ValueError(f"{source}: the table has no rows")
    return tuple(rows)


def _provenance(text: str, source: str) -> dict:
    """{"commit": full upstream hash, "flydsl": version} from the header lines the recorder writes."""
    head = text.split("\n|", 1)[0]  # the prose above the table
    out = {}
    for name, pattern in _PROVENANCE.items():
        found = pattern.findall(head)
        if len(found) != 1:
            raise ValueError(f"{source}: expected one header line matching {pattern.pattern!r}, found {len(found)}")
        out[name] = found[0]
    return out


def _key(row: dict) -> tuple:
    return (row["arch"], row["block"], row["head_dim"], row["query_len"], row["group"], row["per_token"])


@functools.lru_cache(maxsize=None)
def _rows() -> tuple[dict, ...]:
    return _parse(TABLE_PATH.read_text(), TABLE_PATH.name)


@functools.lru_cache(maxsize=None)
def provenance() -> dict:
    """The table's provenance: ``{"commit": full ROCm/FlyDSL hash, "flydsl": version}``."""
    return _provenance(TABLE_PATH.read_text(), TABLE_PATH.name)


_CONSTANTS = {"UPSTREAM_COMMIT": "commit", "FLYDSL_VERSION": "flydsl"}


def __getattr__(name: str):
    # UPSTREAM_COMMIT / FLYDSL_VERSION: read from the header on first use, like the rows, so
    # importing this module never reads (or fails on) the file
    if name in _CONSTANTS:
        return provenance()[_CONSTANTS[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tile_isa_figures() -> list[dict]:
    """Every row of the upstream table, in file order (fresh dicts: the cache stays untouched)."""
    return [dict(r) for r in _rows()]


def tile_isa_figure(arch: str, block_size: int, head_dim: int, query_length: int, group: int,
                    per_token: bool) -> dict:
    """The upstream row of one configuration; ``per_token`` picks per-token (True) or per-tensor
    (False) scales. Raises ValueError naming the first argument with no recorded value."""
    if not isinstance(per_token, bool) and per_token not in (0, 1):
        raise TypeError(f"per_token must be a bool, got {per_token!r}")
    wanted = (("arch", "arch", arch), ("block_size", "block", block_size), ("head_dim", "head_dim", head_dim),
              ("query_length", "query_len", query_length), ("group", "group", group),
              ("per_token", "per_token", bool(per_token)))
    rows = _rows()
    for name, col, value in wanted:
        match = [r for r in rows if r[col] == value]
        if not match:
            known = sorted({r[col] for r in rows})
            raise ValueError(f"no upstream pa_decode_tile figure for {name}={value!r} "
                             f"(given the arguments before it); recorded: {known}")
        rows = match
    (row,) = rows  # _parse rejects duplicate configurations
    return dict(row)
