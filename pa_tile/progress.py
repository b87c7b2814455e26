"""Progress bars: one decision, made here, for every bar pa_tile draws.

A bar helps a person watching a terminal or a JupyterLab notebook. Anywhere else it is noise
that gets recorded: ``jupyter nbconvert --execute`` and nbval capture stderr into the notebook,
where dozens of ``\\r``-separated frames would be committed, and nbval would compare them.

``PA_TILE_PROGRESS=1`` / ``0`` forces bars on / off. Otherwise they are on when stderr is a
terminal, or inside a kernel that a Jupyter server started (it sets ``JPY_SESSION_NAME``; the
kernels of nbconvert and nbval are started without it), and off otherwise.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Optional

ENV_VAR = "PA_TILE_PROGRESS"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _in_ipykernel(stream) -> bool:
    return type(stream).__module__.startswith("ipykernel")


def progress_enabled(stream: Any = None) -> bool:
    """Whether a progress bar on *stream* (default ``sys.stderr``) should be drawn."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in _ON:
        return True
    if forced in _OFF:
        return False
    stream = sys.stderr if stream is None else stream
    if stream is None:
        return False
    if _in_ipykernel(stream):
        return "JPY_SESSION_NAME" in os.environ
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(iterable: Optional[Iterable] = None, *, desc: Optional[str] = None, total: Optional[float] = None,
             unit: str = "it", enabled: Optional[bool] = None, delay: float = 0.0, nested: bool = True,
             **kwargs):
    """A tqdm bar on stderr, drawn only when :func:`progress_enabled` (or *enabled*) says so.

    Use it like ``tqdm``: ``for x in progress(xs, desc="emulate"): ...`` or as a context manager
    with ``.update(n)``. When off it is tqdm's own disabled bar, so callers need no branches.
    ``delay``: draw nothing until the work has taken this many seconds (short runs stay silent).
    ``nested=False``: stay off while another bar is drawn (an emulator launch inside a
    notebook's loop over cases), because a text bar inside another's line garbles both.
    The bar is cleared when done (``leave=False``) unless the caller asks otherwise.
    """
    from tqdm import tqdm

    on = progress_enabled() if enabled is None else bool(enabled)
    if on and not nested and any(not getattr(b, "disable", True) for b in list(getattr(tqdm, "_instances", ()))):
        on = False
    kwargs.setdefault("leave", False)
    kwargs.setdefault("mininterval", 0.5)
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=not on, delay=delay, **kwargs)
