"""Notebook -> package export, and the check CI runs so the two never disagree.

The walkthrough's notebooks are the source of truth for every stage kernel. A code cell tagged
``export`` (``# %% tags=["export"]`` in the jupytext ``py:percent`` source) belongs to the module
named for that notebook in ``EXPORTS``; the module is the concatenation of those cells, in order,
under a header saying where it came from.

    python -m pa_tile._export           # regenerate every exported module
    python -m pa_tile._export --check   # exit 1 if a module, or a paired .ipynb, is out of date

Both need the repository's notebooks/ folder (exit 2 without it, e.g. from an installed wheel).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from pa_tile.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

#: notebook stem -> module path (relative to the repository root), from the one stage registry
EXPORTS = {nb: module.replace(".", "/") + ".py" for module, nb in STAGES.values()}

HEADER = (
    "# GENERATED from notebooks/{nb}.py by `python -m pa_tile._export`.\n"
    "# Do not edit: change the cells tagged `export` in the notebook and re-run the export.\n\n"
)


def _read(path: Path):
    import jupytext

    return jupytext.read(path)


def exported_source(nb_py: Path) -> str:
    """The module text built from *nb_py*'s ``export`` cells."""
    nb = _read(nb_py)
    cells = [
        c.source.strip("\n")
        for c in nb.cells
        if c.cell_type == "code" and "export" in c.metadata.get("tags", [])
    ]
    if not cells:
        raise ValueError(f"{nb_py.name} has no cells tagged 'export'")
    return HEADER.format(nb=nb_py.stem) + "\n\n\n".join(cells) + "\n"


def _pairs():
    for stem, module in EXPORTS.items():
        nb_py = NOTEBOOKS / f"{stem}.py"
        if nb_py.exists():
            yield nb_py, ROOT / module


def export_all() -> list[Path]:
    written = []
    for nb_py, module in _pairs():
        text = exported_source(nb_py)
        module.parent.mkdir(parents=True, exist_ok=True)
        if not module.exists() or module.read_text() != text:
            module.write_text(text)
            written.append(module)
    return written


def _cell_sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def check() -> list[str]:
    """Problems found: stale exported modules, and .ipynb files whose cells differ from their .py source."""
    problems = []
    for nb_py, module in _pairs():
        want = exported_source(nb_py)
        have = module.read_text() if module.exists() else ""
        if want != have:
            diff = "".join(
                difflib.unified_diff(
                    have.splitlines(True), want.splitlines(True), str(module.relative_to(ROOT)), f"from {nb_py.name}", n=1
                )
            )
            problems.append(f"{module.relative_to(ROOT)} is out of date with {nb_py.name}:\n{diff[:4000]}")
    for nb_py in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py")):
        ipynb = nb_py.with_suffix(".ipynb")
        if not ipynb.exists():
            problems.append(f"{ipynb.relative_to(ROOT)} is missing (run: jupytext --sync {nb_py.relative_to(ROOT)})")
        elif _cell_sources(_read(nb_py)) != _cell_sources(_read(ipynb)):
            problems.append(f"{ipynb.name} and {nb_py.name} have different cells (run jupytext --sync and re-execute)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pa_tile._export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 if anything is out of date")
    args = ap.parse_args(argv)
    if not NOTEBOOKS.is_dir():
        # An installed wheel carries the exported modules but not the notebooks they came from:
        # there is nothing to compare, and saying "ok" would claim a check that never ran.
        print(f"export{' check' if args.check else ''}: cannot run: there is no notebooks/ folder next to the "
              f"package ({NOTEBOOKS}); run it in a clone of the repository, not an installed pa_tile",
              file=sys.stderr)
        return 2
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        print("export check:", "FAILED" if problems else "ok")
        return 1 if problems else 0
    for m in export_all():
        print("wrote", m.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
