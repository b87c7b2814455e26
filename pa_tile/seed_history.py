"""The seed kernel's measured times: what each idea bought on a real GPU, attributed.

``pa_tile/data/pr825_mi300x_timings.json`` is the only copy: times and ratios that the commit
messages (and one code comment) of ROCm/FlyDSL's ``pr-825`` branch quote for upstream's tile
kernel, the kernel pa_tile's stages retrace. They are MEASUREMENTS of that kernel, not of
pa_tile's, on a gfx942 GPU: the file records an MI300X, while pa_tile's model validation reads
the author's other messages as an 80-CU MI308X (``pa_tile/data/model_validation.md``, "Device").
The messages name batch and context only; the rest of each shape is the file's stated
ASSUMPTION (``attribution()`` says which). A chapter shows them with ``markdown_table``, beside
its own static and emulator figures.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import textwrap

__all__ = ["data", "steps", "attribution", "markdown_table"]


@functools.lru_cache(maxsize=None)
def data() -> dict:
    """The whole file, parsed."""
    return json.loads((importlib.resources.files("pa_tile") / "data" / "pr825_mi300x_timings.json").read_text())


def _shape(s: dict) -> str:
    sh = s["shape"]
    ctx = sh["context"]
    ctx = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
    return f"b{sh['batch']} × {ctx}, d{sh['head_dim']}, {sh['num_q_heads']}/{sh['num_kv_heads']} heads"


def _effect(s: dict) -> tuple[str, str]:
    """``(before -> after, effect)`` of a step: times in µs where quoted, else the quoted ratio."""
    if "before_us" in s:
        return f"{s['before_us']:g} → {s['after_us']:g} µs", f"{s['before_us'] / s['after_us']:.2f}x"
    if "ratio" in s:  # after / before time of one kernel at two partition counts
        what = f"P {s['before_partitions']} → {s['after_partitions']}"
        return what, f"{1 / s['ratio']:.2f}x"
    if "before_gap" in s:  # both quoted as multiples of production's kernel
        return f"{s['before_gap']:g}x → {s['after_gap']:g}x production", f"{s['before_gap'] / s['after_gap']:.2f}x"
    return s["quote"], ""


def steps(commits=(), subject: str = "") -> list[dict]:
    """The quoted steps whose commit starts with one of ``commits`` or whose subject contains
    ``subject`` (case-insensitive), in the file's order, each as a row: ``commit`` (8 hex
    digits), ``change`` (the quoted subject), ``shape``, ``measured`` (before -> after),
    ``speedup`` (before / after time; below 1: slower) and ``quote`` (the message's words)."""
    rows = []
    for s in data()["steps"]:
        hit = any(s["quoted_in"].startswith(c) for c in commits)
        hit = hit or bool(subject) and subject.lower() in s["subject"].lower()
        if hit:
            measured, effect = _effect(s)
            change = s["subject"].removeprefix("perf(pa tile): ")
            rows.append(dict(commit=s["quoted_in"][:8], change=change, shape=_shape(s), measured=measured,
                             speedup=effect, quote=s["quote"]))
    return rows


def attribution() -> str:
    """Where the figures come from and what is assumed: one paragraph of Markdown, lines of at
    most 96 characters."""
    d = data()
    text = (f"Measured by upstream, not by pa_tile: {d['source']} (`pa_tile/data/pr825_mi300x_timings.json`). "
            f"GPU: {d['arch']}; the file records an {d['gpu']}, pa_tile's model validation reads the author's "
            "other messages as an 80-CU MI308X (`pa_tile/data/model_validation.md`, \"Device\"). "
            "Shapes: the messages name batch and context; heads, head_dim, block size and scales are the "
            "branch's test defaults, an ASSUMPTION of the file. Timing: " + d["timing"].split(";")[0] + ".")
    return "\n".join(textwrap.wrap(text, 96, break_on_hyphens=False))


def markdown_table(rows: list[dict], columns=("commit", "change", "shape", "measured", "speedup")) -> str:
    """``rows`` (from :func:`steps`) as a Markdown table of ``columns``."""
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "\n".join("| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows)
