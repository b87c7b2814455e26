"""The seed kernel's measured history, for the chapters: MI300X times quoted in the commit messages
of ROCm/FlyDSL's PR #825 branch (``pa_tile/data/pr825_mi300x_timings.json``, where each step keeps
its commit, quote and shape). The messages name batch and context only; the rest of each shape is
the branch's test-harness default, an assumption the data file states and :func:`table` repeats."""

from __future__ import annotations

import functools
import json
import textwrap
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "pr825_mi300x_timings.json"

__all__ = ["DATA", "load", "steps", "table", "rows", "attribution", "markdown_table"]


@functools.lru_cache(maxsize=None)
def load() -> dict:
    """The data file, parsed."""
    return json.loads(DATA.read_text())


def steps(commit: str) -> list:
    """The steps whose times the commit ``commit`` (a prefix of its hash) quotes."""
    found = [s for s in load()["steps"] if s["quoted_in"].startswith(commit)]
    if not found:
        raise KeyError(f"no step of {DATA.name} is quoted in a commit starting {commit!r}")
    return found


def table(commit: str, change: str) -> str:
    """A Markdown table of one commit's measured steps (batch, context, before/after µs, ratio) under
    a heading naming the commit, the GPU and ``change`` (what the commit did), and below it the
    shape the times assume (lines of at most 100 characters)."""
    rows = steps(commit)
    sh = rows[0]["shape"]
    head = f"| seed `{commit[:8]}` on {load()['gpu']}: {change} | before | after | after / before |"
    body = [f"| batch {s['shape']['batch']} × {s['shape']['context']} tokens | {s['before_us']} µs | "
            f"{s['after_us']} µs | {s['after_us'] / s['before_us']:.2f} |" for s in rows]
    note = (f"Times quoted in the commit message ({load()['timing'].split(';')[0]}). Assumed, not quoted: "
            f"{sh['num_q_heads']} query heads per KV head, head_dim {sh['head_dim']}, block size "
            f"{sh['block_size']}, {sh['scales']} scales, query_length {sh['query_length']} (the branch's "
            "test-harness defaults).")
    return "\n".join([head, "|---|---|---|---|", *body, "", textwrap.fill(note, 100)])


def _shape(s: dict) -> str:
    sh = s["shape"]
    ctx = sh["context"]
    ctx = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
    return f"b{sh['batch']} × {ctx}, d{sh['head_dim']}, {sh['num_q_heads']}/{sh['num_kv_heads']} heads"


def _effect(s: dict) -> tuple:
    """``(before -> after, speedup)`` of a step: times in µs where quoted, else the quoted ratio
    (a partition-count step: after / before time of one kernel; a gap: multiples of production's)."""
    if "before_us" in s:
        return f"{s['before_us']:g} → {s['after_us']:g} µs", f"{s['before_us'] / s['after_us']:.2f}x"
    if "ratio" in s:
        return f"P {s['before_partitions']} → {s['after_partitions']}", f"{1 / s['ratio']:.2f}x"
    if "before_gap" in s:
        return f"{s['before_gap']:g}x → {s['after_gap']:g}x production", f"{s['before_gap'] / s['after_gap']:.2f}x"
    return s["quote"], ""


def rows(*commits: str) -> list:
    """The steps every commit of ``commits`` (hash prefixes) quotes, times or ratios alike, as
    display rows: ``commit`` (8 hex digits), ``change`` (the quoted subject), ``shape``,
    ``measured`` (before -> after), ``speedup`` (before / after time; under 1: slower), ``quote``."""
    out = []
    for c in commits:
        for s in steps(c):
            measured, speedup = _effect(s)
            out.append(dict(commit=s["quoted_in"][:8], change=s["subject"].removeprefix("perf(pa tile): "),
                            shape=_shape(s), measured=measured, speedup=speedup, quote=s["quote"]))
    return out


def attribution() -> str:
    """Where the figures come from and what is assumed: one paragraph of Markdown, lines of at
    most 96 characters. The GPU: the data file records an MI300X; pa_tile's model validation
    reads the author's other messages as an 80-CU MI308X (``pa_tile/data/model_validation.md``)."""
    d = load()
    text = (f"Measured by upstream, not by pa_tile: {d['source']} (`pa_tile/data/pr825_mi300x_timings.json`). "
            f"GPU: {d['arch']}; the file records an {d['gpu']}, pa_tile's model validation reads the author's "
            "other messages as an 80-CU MI308X (`pa_tile/data/model_validation.md`, \"Device\"). "
            "Shapes: the messages name batch and context; heads, head_dim, block size and scales are the "
            "branch's test defaults, an ASSUMPTION of the file. Timing: " + d["timing"].split(";")[0] + ".")
    return "\n".join(textwrap.wrap(text, 96, break_on_hyphens=False))


def markdown_table(table_rows: list, columns=("commit", "shape", "measured", "speedup")) -> str:
    """``table_rows`` (from :func:`rows`) as a Markdown table of ``columns``."""
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "\n".join("| " + " | ".join(str(r[c]) for c in columns) + " |" for r in table_rows)
