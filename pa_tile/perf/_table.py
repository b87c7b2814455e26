"""Plain-text tables of row dicts (no pandas): shared by the roofline, trace and bench reports."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence


def _cell(v, floatfmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if floatfmt == "auto":  # whole numbers once they are large, 3 significant digits below
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return format(v, floatfmt)
    return str(v)


def format_rows(rows: List[Dict], columns: Optional[Sequence[str]] = None, floatfmt: str = "auto",
                headers: Optional[Dict[str, str]] = None) -> str:
    """Columns aligned; numbers right-aligned. ``headers`` renames columns for display."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    heads = [(headers or {}).get(c, c) for c in cols]
    body = [[_cell(r.get(c), floatfmt) for c in cols] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in cols]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(heads)]

    def line(cells):
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(b) for b in body])
