"""Show library code in a chapter: ``source(kernel_lib.buffer_load, ...)`` renders the functions'
source as one highlighted block (plain text outside a notebook), so a chapter teaches a helper
where it first matters while the helper itself has one home in the library."""

from __future__ import annotations

import inspect

__all__ = ["source"]


class _Source:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_markdown_(self) -> str:
        return "```python\n" + self.text + "\n```"


def source(*objs) -> _Source:
    """The source of each function or class in ``objs``, in order, as one displayable block."""
    return _Source("\n\n".join(inspect.getsource(o).rstrip() for o in objs))
