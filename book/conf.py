"""Sphinx configuration of the book (``scripts/build_book.py`` runs it; ``./run.sh book``).

The source folder is the repository root; only the pages ``build_book.pages()`` lists are read
(``include_patterns``), and every other top-level folder is pruned from Sphinx's scan so that
``.venv`` is never walked. The sidebar's table of contents is written into the landing page
(``book/index.md``) as it is read, from the same list, so a chapter renamed, split or added
appears without an edit here.
"""

from __future__ import annotations

import importlib.util
import inspect
import posixpath
from pathlib import Path
from urllib.parse import urlsplit

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_book", ROOT / "scripts" / "build_book.py")
build_book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_book)
PAGES = build_book.pages(ROOT)

project = "pa_tile"
author = "the pa_tile authors"
copyright = "the pa_tile authors, Apache-2.0"
root_doc = build_book.docname(build_book.LANDING)

extensions = [
    "myst_nb",                 # .ipynb and .md pages (MyST Markdown)
    "sphinx.ext.autodoc",      # the API reference, from the docstrings
    "sphinx.ext.autosummary",  # its summary table
    "sphinx-mathjax-offline",  # MathJax 3 copied into _static, mathjax_path pointed at it
]

include_patterns = [build_book.LANDING, *(p for section in PAGES.values() for p in section)]
exclude_patterns = [p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in {"book", "notebooks", "docs"}]
exclude_patterns += ["book/_build", "**/.ipynb_checkpoints"]

# Notebooks are read as committed: their outputs are the walkthrough's, never re-made here.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 4  # `file.md#a-heading` links resolve, as on the code host
myst_dmath_double_inline = True

html_theme = "sphinx_book_theme"
html_title = "pa_tile: paged attention, tile by tile"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": False,  # the title above the sidebar links the landing page
    "use_download_button": True,
    "use_fullscreen_button": False,
    "navbar_persistent": [],  # the search field is in the sidebar; no second one in a header
}
html_context = {"default_mode": "auto"}  # with no mode, the theme logs an error on a first visit
html_extra_path = ["_extra"]  # index.html at the site's root: a redirect to the landing page
html_last_updated_fmt = None
html_show_sourcelink = False
html_show_search_summary = False  # a summary is fetched from the page: refused on file:// (CORS)

autodoc_typehints = "description"
autodoc_member_order = "bysource"


def _toctree(caption: str, paths: list[str]) -> str:
    entries = "\n".join("/" + build_book.docname(p) for p in paths)
    return f"\n```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n\n{entries}\n```\n"


def _api_reference() -> str:
    """autosummary table and one autodoc entry per name of ``pa_tile.__all__``, in its order."""
    import pa_tile

    names = list(pa_tile.__all__)
    lines = [".. currentmodule:: pa_tile", "", ".. autosummary::", ""]
    lines += [f"   {n}" for n in names]
    for n in names:
        obj = getattr(pa_tile, n)
        if inspect.isclass(obj):
            lines += ["", f".. autoclass:: pa_tile.{n}", "   :members:"]
        elif callable(obj):
            lines += ["", f".. autofunction:: pa_tile.{n}"]
        else:
            lines += ["", f".. autodata:: pa_tile.{n}"]
    return "\n```{eval-rst}\n" + "\n".join(lines) + "\n```\n"


def _fill_generated(app, docname: str, source: list[str]) -> None:
    if docname == root_doc:
        source[0] += "".join(_toctree(caption, paths) for caption, paths in PAGES.items() if paths)
    elif docname == build_book.docname(build_book.API):
        source[0] += _api_reference()


class _OutputLinksToPages(SphinxPostTransform):
    """A link in a notebook's Markdown *output* (``pa_tile.show.md``) to another page's source
    (``appendix_x.ipynb``, ``../docs/glossary.md#a``) points at that page's HTML. myst-nb leaves
    such links as written (an external reference), unlike the same link in a markdown cell."""

    default_priority = 5
    formats = ("html",)

    def run(self, **kwargs):
        here = self.env.docname
        for ref in self.document.findall(nodes.reference):
            uri = urlsplit(ref.get("refuri", ""))
            if uri.scheme or uri.netloc or not uri.path.endswith((".ipynb", ".md")):
                continue
            target = posixpath.normpath(posixpath.join(posixpath.dirname(here), uri.path)).rsplit(".", 1)[0]
            if target in self.env.found_docs:
                ref["refuri"] = self.app.builder.get_relative_uri(here, target) + (
                    f"#{uri.fragment}" if uri.fragment else "")


def setup(app):
    app.connect("source-read", _fill_generated)
    app.add_post_transform(_OutputLinksToPages)
