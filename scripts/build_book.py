#!/usr/bin/env python3
"""Build the walkthrough as a static site (a book) from the committed notebooks; nothing is executed.

    python scripts/build_book.py            # -> book/_build/html/index.html
    python scripts/build_book.py --out DIR  # another output folder

Sphinx with myst-nb (``nb_execution_mode = "off"``: the outputs are the notebooks' committed ones)
and sphinx-book-theme; the configuration is ``book/conf.py``, the source folder is the repository
itself, so a link between chapters, appendices and ``docs/`` means the same on the code host and
in the book. The pages and their order are read off the files (``pages()``), never listed by
hand: chapters ``notebooks/[0-9][0-9]_*.ipynb`` sorted, then ``notebooks/appendix_*.ipynb``, then
the glossary ``docs/glossary.md`` when it exists, then the API reference ``book/api.md``.
Everything the pages load is in the output folder (MathJax included), so the site reads from disk
with no network. Needs the ``book`` extra (``pip install -e ".[book]"``; ``./run.sh book`` does it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
DEFAULT_OUT = BOOK / "_build" / "html"
GLOSSARY = "docs/glossary.md"
API = "book/api.md"
LANDING = "book/index.md"


def pages(root: Path = ROOT) -> dict[str, list[str]]:
    """The book's sidebar, section -> source paths relative to ``root``, in reading order."""
    nb = root / "notebooks"
    rel = lambda paths: [p.relative_to(root).as_posix() for p in sorted(paths)]  # noqa: E731
    return {
        "Chapters": rel(nb.glob("[0-9][0-9]_*.ipynb")),
        "Appendices": rel(nb.glob("appendix_*.ipynb")),
        "Reference": [p for p in (GLOSSARY, API) if (root / p).is_file()],
    }


def docname(path: str) -> str:
    """Sphinx's name of a source path (no suffix); the page is ``<docname>.html``."""
    return path.rsplit(".", 1)[0]


def build(out: Path = DEFAULT_OUT, *, doctrees: Path | None = None, warnings_file: Path | None = None,
          quiet: bool = True) -> subprocess.CompletedProcess:
    """Run sphinx-build (html) into ``out``; raises CalledProcessError with its output on failure.

    Always from scratch (a page of a renamed chapter would otherwise stay behind, and an edit of
    conf.py's code would not reach unchanged pages): an earlier build in ``out`` (a Sphinx
    output, it has ``.buildinfo``) is removed first.
    """
    out = Path(out)
    doctrees = Path(doctrees) if doctrees else out.parent / "doctrees"
    if (out / ".buildinfo").is_file():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "sphinx", "-E", "-b", "html", "-c", str(BOOK), "-d", str(doctrees)]
    if quiet:
        cmd.append("-q")
    if warnings_file:
        cmd += ["-w", str(warnings_file)]
    cmd += [str(ROOT), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=quiet, text=True)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)")
    args = ap.parse_args(argv)
    try:
        build(args.out, quiet=False)
    except subprocess.CalledProcessError as e:
        print(f"build_book: sphinx-build failed (exit {e.returncode})", file=sys.stderr)
        return 1
    print(f"book: {(args.out / 'index.html').resolve()}  (open it in a browser; it needs no network)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
