"""Notebook -> package export, and the check CI runs so the two never disagree.

The walkthrough's notebooks are the source of truth for every stage kernel. A code cell tagged
``export`` (``# %% tags=["export"]`` in the jupytext ``py:percent`` source) belongs to the module
named for that notebook in ``EXPORTS``; the module is the concatenation of those cells, in order,
under a header saying where it came from. A module may come from several notebooks (a stage taught
over two chapters, its baseline in an appendix): their cells are concatenated in the order the
stage registry lists them (``SOURCES``).

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


def _stems(nbs) -> tuple:
    return (nbs,) if isinstance(nbs, str) else tuple(nbs)


#: module path (relative to the repository root) -> the notebook stems it is exported from, in
#: order, from the one stage registry
SOURCES = {module.replace(".", "/") + ".py": _stems(nbs) for module, nbs in STAGES.values()}
#: notebook stem -> the module path its cells tagged ``export`` belong to
EXPORTS = {nb: module for module, stems in SOURCES.items() for nb in stems}

HEADER = (
    "# GENERATED from {sources} by `python -m pa_tile._export`.\n"
    "# Do not edit: change the cells tagged `export` in the {notebook} and re-run the export.\n\n"
)


def _read(path: Path):
    import jupytext

    return jupytext.read(path)


def exported_source(*nb_pys: Path) -> str:
    """The module text built from the ``export`` cells of *nb_pys*, in order."""
    cells = []
    for nb_py in nb_pys:
        found = [
            c.source.strip("\n")
            for c in _read(nb_py).cells
            if c.cell_type == "code" and "export" in c.metadata.get("tags", [])
        ]
        if not found:
            raise ValueError(f"{nb_py.name} has no cells tagged 'export'")
        cells += found
    sources = ", ".join(f"notebooks/{p.stem}.py" for p in nb_pys)
    notebook = "notebook" if len(nb_pys) == 1 else "notebooks"
    return HEADER.format(sources=sources, notebook=notebook) + "\n\n\n".join(cells) + "\n"


def _pairs():
    """``(notebook sources, module)`` of every module whose notebooks are all in this checkout."""
    for module, stems in SOURCES.items():
        nb_pys = [NOTEBOOKS / f"{stem}.py" for stem in stems]
        if all(p.exists() for p in nb_pys):
            yield nb_pys, ROOT / module


def export_all() -> list[Path]:
    written = []
    for nb_pys, module in _pairs():
        text = exported_source(*nb_pys)
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
    for nb_pys, module in _pairs():
        want = exported_source(*nb_pys)
        names = ", ".join(p.name for p in nb_pys)
        have = module.read_text() if module.exists() else ""
        if want != have:
            diff = "".join(
                difflib.unified_diff(
                    have.splitlines(True), want.splitlines(True), str(module.relative_to(ROOT)), f"from {names}", n=1
                )
            )
            problems.append(f"{module.relative_to(ROOT)} is out of date with {names}:\n{diff[:4000]}")
    # every chapter, and every appendix a module is exported from, is paired with its .ipynb
    exporting = {p for nb_pys, _ in _pairs() for p in nb_pys}
    for nb_py in sorted(set(NOTEBOOKS.glob("[0-9][0-9]_*.py")) | exporting):
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
