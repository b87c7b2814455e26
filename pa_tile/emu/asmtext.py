"""The one reader of AMDGPU assembly text structure: statements, blocks and ``.amdgpu_metadata``.

LLVM prints a kernel as lines of labels, instructions and directives, plus two blocks whose lines
are not statements: the ``.amdhsa_kernel`` descriptor and the ``.amdgpu_metadata`` YAML document.
:func:`scan` turns the lines into statements, in text order, and is shared by every reader of
assembly in pa_tile: the emulator's parser (:mod:`pa_tile.emu.asm`, strict: it turns each
instruction into operands and raises on anything it does not understand), the launch path's
metadata reader (:func:`pa_tile.emu.launch.parse_amdgpu_metadata`) and the static facts of
:mod:`pa_tile.isa` (lenient: it reads what it can). Comments, label syntax, the blocks and the YAML
loader live here only; what a statement means is each reader's business.

Statements are tuples ``(kind, line, a, b)`` with a 1-based source ``line``:

* ``(INSTRUCTION, line, text, None)``: the instruction text, comment and label removed;
* ``(LABEL, line, name, None)``: ``name:`` (also GNU-as numeric labels such as ``1:``); an
  instruction after the colon on the same line follows as its own statement;
* ``(DIRECTIVE, line, name, argument)``: every directive outside the two blocks (``.amdgcn_target``,
  ``.type``, ``.set``, ``.size``, ``.section``, ``.p2align``, ...), ``argument`` stripped;
* ``(DESCRIPTOR, line, kernel, entries)``: one whole ``.amdhsa_kernel`` block (``line`` of its
  first line), ``entries`` its inner lines as ``[(line, text)]``, comments removed;
* ``(METADATA, line, document, None)``: one ``.amdgpu_metadata`` block's YAML document (a dict,
  ``{}`` when empty; ``line`` of ``.end_amdgpu_metadata``). Bad YAML raises
  :class:`AsmSyntaxError` naming the line;
* ``(UNTERMINATED, line, directive, None)``: the text ended inside the block ``directive`` opened.

A new file of a concatenated text (``compile_isa`` joins one per launched kernel) starts at its
``.amdgcn_target`` directive.
"""

from __future__ import annotations

import re
from typing import Iterator, List, Tuple

__all__ = [
    "AsmSyntaxError", "INSTRUCTION", "LABEL", "DIRECTIVE", "DESCRIPTOR", "METADATA", "UNTERMINATED",
    "LABEL_LINE_RE", "strip_comment", "load_metadata", "scan",
]

INSTRUCTION = "instruction"
LABEL = "label"
DIRECTIVE = "directive"
DESCRIPTOR = "descriptor"
METADATA = "metadata"
UNTERMINATED = "unterminated"

Statement = Tuple[str, int, object, object]


class AsmSyntaxError(ValueError):
    """The text contains something this parser does not understand (message names the line)."""


#: a label definition and what follows it on the line (numeric labels ``1:`` included)
LABEL_LINE_RE = re.compile(r"^([A-Za-z_.$][\w.$]*|\d+):(.*)$")


def strip_comment(s: str) -> str:
    """*s* without its ``;`` or ``//`` comment; one inside a quoted string (a swizzle
    ``BITMASK_PERM`` pattern, a section name) starts no comment."""
    semi = s.find(";")
    slash = s.find("//")
    if semi < 0 and slash < 0:
        return s
    if '"' not in s:
        return s[:min(i for i in (semi, slash) if i >= 0)]
    quote = False
    for i, ch in enumerate(s):
        if ch == '"':
            quote = not quote
        elif not quote and (ch == ";" or s.startswith("//", i)):
            return s[:i]
    return s


_LOADER = None


def _yaml_loader():
    global _LOADER
    if _LOADER is None:
        import yaml

        _LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return _LOADER


def load_metadata(text: str, line: int = 0) -> dict:
    """The YAML document of one ``.amdgpu_metadata`` block (``{}`` when empty)."""
    import yaml

    try:
        doc = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as e:
        raise AsmSyntaxError(f"line {line}: bad .amdgpu_metadata YAML: {e}") from e
    return doc or {}


def scan(lines: List[str]) -> Iterator[Statement]:
    """The statements of assembly *lines* (``text.splitlines()``), in order; see the module doc."""
    meta: List[str] | None = None  # inside .amdgpu_metadata: its raw lines
    desc: List[Tuple[int, str]] | None = None  # inside .amdhsa_kernel: its entries
    desc_head: Tuple[int, str] = (0, "")
    for lineno, raw in enumerate(lines, 1):
        if meta is not None:
            if raw.strip() == ".end_amdgpu_metadata":
                yield METADATA, lineno, load_metadata("\n".join(meta), lineno), None
                meta = None
            else:
                meta.append(raw)
            continue
        s = strip_comment(raw).strip()
        if not s:
            continue
        if desc is not None:
            if s == ".end_amdhsa_kernel":
                yield DESCRIPTOR, desc_head[0], desc_head[1], desc
                desc = None
            else:
                desc.append((lineno, s))
            continue
        if ":" in s:
            m = LABEL_LINE_RE.match(s)
            if m and not s.startswith(".amdhsa"):
                yield LABEL, lineno, m.group(1), None
                s = m.group(2).strip()
                if not s:
                    continue
        if s[0] == ".":
            head = s.split(None, 1)
            d = head[0]
            arg = head[1].strip() if len(head) > 1 else ""
            if d == ".amdgpu_metadata":
                meta = []
            elif d == ".amdhsa_kernel":
                desc, desc_head = [], (lineno, arg)
            else:
                yield DIRECTIVE, lineno, d, arg
            continue
        yield INSTRUCTION, lineno, s, None
    if meta is not None:
        yield UNTERMINATED, len(lines), ".amdgpu_metadata", None
    if desc is not None:
        yield DESCRIPTOR, desc_head[0], desc_head[1], desc
        yield UNTERMINATED, len(lines), ".amdhsa_kernel", None
