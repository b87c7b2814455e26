"""Show things in a chapter.

``source(kernel_lib.buffer_load, ...)`` renders the functions' source as one highlighted block
(plain text outside a notebook), so a chapter teaches a helper where it first matters while the
helper itself has one home in the library. ``md(...)`` and ``measured(...)`` render prose and
figures *from* computed results, so a number the prose restates is the number the cell computed."""

from __future__ import annotations

import inspect
from typing import Mapping

__all__ = ["source", "md", "measured"]


class _Text:
    """Text that a notebook renders as Markdown and a terminal prints as it is."""

    def __init__(self, text: str, markdown: str | None = None):
        self.text = text
        self.markdown = text if markdown is None else markdown

    def __repr__(self) -> str:
        return self.text

    def _repr_markdown_(self) -> str:
        return self.markdown


def source(*objs) -> _Text:
    """The source of each function or class in ``objs``, in order, as one displayable block."""
    text = "\n\n".join(inspect.getsource(o).rstrip() for o in objs)
    return _Text(text, "```python\n" + text + "\n```")


def md(text: str) -> _Text:
    """Markdown prose built from computed values (an f-string in the cell), displayed as Markdown."""
    return _Text(inspect.cleandoc(text))


def measured(figures: Mapping[str, object], title: str = "Measured") -> _Text:
    """A chapter's closing figures as a two-column table: ``{"VGPRs (gfx942)": 106, ...}``.

    Every value comes from a result the chapter computed; this only lays them out."""
    rows = [f"| {name} | {value} |" for name, value in figures.items()]
    return _Text("\n".join([f"| {title} | |", "|---|---|", *rows]))
