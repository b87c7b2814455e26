"""Parse AMDGPU assembly text, as LLVM prints it, into a :class:`Program`.

The input is the ``22_final_isa.s`` text FlyDSL dumps (or any ``llc`` output for gfx9-family
targets). We keep what an emulator needs and nothing else:

* every instruction with its mnemonic, typed operands, modifiers and source line;
* labels mapped to instruction indices (branch targets and kernel entries);
* per kernel, the ``.amdhsa_*`` descriptor directives and its ``.amdgpu_metadata`` entry.

The text's structure (comments, labels, directives, the descriptor and metadata blocks, the YAML)
is read by :mod:`pa_tile.emu.asmtext`, the one scanner :mod:`pa_tile.isa` shares; this module
gives the statements their meaning.

Special scalar registers are turned into SGPR numbers as the hardware encodes them
(``vcc`` = s[106:107], ``m0`` = s124, ``exec`` = s[126:127]), so the emulator can keep one
scalar register file. Syntax we do not understand raises :class:`AsmSyntaxError` with the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from .asmtext import DESCRIPTOR, DIRECTIVE, INSTRUCTION, LABEL, METADATA, UNTERMINATED, AsmSyntaxError, scan

__all__ = [
    "AsmSyntaxError",
    "Operand",
    "Instruction",
    "Kernel",
    "Program",
    "parse_asm",
    "parse",
    "load_program",
    "SGPR_VCC",
    "SGPR_M0",
    "SGPR_EXEC",
]

SGPR_VCC = 106
SGPR_M0 = 124
SGPR_EXEC = 126

# name -> (sgpr index, number of dwords)
_SPECIAL_SGPRS = {
    "vcc": (SGPR_VCC, 2),
    "vcc_lo": (SGPR_VCC, 1),
    "vcc_hi": (SGPR_VCC + 1, 1),
    "m0": (SGPR_M0, 1),
    "exec": (SGPR_EXEC, 2),
    "exec_lo": (SGPR_EXEC, 1),
    "exec_hi": (SGPR_EXEC + 1, 1),
}
# Operands that are not registers of a file: condition sources and the "no address" marker.
_SPECIAL_NAMES = {"scc", "src_scc", "src_vccz", "src_execz", "vccz", "execz", "off"}


@dataclass(frozen=True)
class Operand:
    """One instruction operand.

    ``kind`` is ``'s'``/``'v'``/``'a'`` (register range ``index .. index+count-1``), ``'imm'``
    (``value`` is an int or float; ``literal`` when written as ``lit(...)`` or too wide to be an
    inline constant), ``'special'`` (``name``: scc, off, ...), ``'label'`` (``name``) or
    ``'swizzle'`` (``value`` is the encoded 16-bit ds_swizzle offset).
    ``neg``/``abs``/``sext`` are the VOP3/SDWA source modifiers.
    """

    kind: str
    index: int = 0
    count: int = 1
    value: Union[int, float, None] = None
    name: str = ""
    neg: bool = False
    abs: bool = False
    sext: bool = False
    literal: bool = False

    @property
    def is_reg(self) -> bool:
        return self.kind in ("s", "v", "a")

    def __str__(self) -> str:
        if self.kind in ("s", "v", "a"):
            core = self.name or (
                f"{self.kind}{self.index}" if self.count == 1 else f"{self.kind}[{self.index}:{self.index + self.count - 1}]"
            )
        elif self.kind in ("special", "label"):
            core = self.name
        else:
            core = repr(self.value)
        if self.abs:
            core = f"|{core}|"
        if self.neg:
            core = f"-{core}"
        if self.sext:
            core = f"sext({core})"
        return core


@dataclass
class Instruction:
    mnemonic: str
    operands: Tuple[Operand, ...]
    mods: Dict[str, object]
    line: int
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class Kernel:
    name: str
    entry: int  # index of the first instruction
    descriptor: Dict[str, int] = field(default_factory=dict)  # .amdhsa_* without the prefix
    metadata: Dict[str, object] = field(default_factory=dict)  # this kernel's amdhsa.kernels entry

    def desc(self, key: str, default: int = 0) -> int:
        return self.descriptor.get(key, default)


@dataclass
class Program:
    instructions: List[Instruction]
    labels: Dict[str, int]
    kernels: Dict[str, Kernel]
    metadata: Dict[str, object]
    target: str = ""

    @property
    def arch(self) -> str:
        m = re.search(r"gfx\w+", self.target)
        return m.group(0) if m else ""

    def kernel(self, name: Optional[str] = None) -> Kernel:
        if name is None:
            if len(self.kernels) != 1:
                raise KeyError(f"program has {len(self.kernels)} kernels {sorted(self.kernels)}; name one")
            return next(iter(self.kernels.values()))
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"no kernel {name!r} in program (have {sorted(self.kernels)})") from None


# --------------------------------------------------------------------------- operands

_INT_RE = re.compile(r"^-?(0x[0-9a-fA-F]+|\d+)$")
_FLOAT_RE = re.compile(r"^-?(\d+\.\d*([eE][-+]?\d+)?|\d+[eE][-+]?\d+|inf|nan)$")
_REG_RE = re.compile(r"^([sva])(\d+)$")
_RANGE_RE = re.compile(r"^([sva])\[(\d+):(\d+)\]$")
_LABEL_RE = re.compile(r"^[A-Za-z_.$][\w.$]*$")
# GNU-as numeric local labels: "1:" defines, "1b" / "1f" name the nearest one before / after.
_NUM_REF_RE = re.compile(r"^(\d+)([bf])$")


def _parse_int(tok: str) -> int:
    neg = tok.startswith("-")
    body = tok[1:] if neg else tok
    v = int(body, 16) if body.lower().startswith("0x") else int(body)
    return -v if neg else v


def parse_operand(tok: str) -> Operand:
    """Parse one operand token (no surrounding whitespace)."""
    if not tok:
        raise AsmSyntaxError("empty operand")
    # Source modifiers wrap the core operand; peel them from the outside in.
    if tok.startswith("neg(") and tok.endswith(")"):
        inner = parse_operand(tok[4:-1])
        return _with(inner, neg=not inner.neg)
    if tok.startswith("abs(") and tok.endswith(")"):
        return _with(parse_operand(tok[4:-1]), abs=True)
    if tok.startswith("sext(") and tok.endswith(")"):
        return _with(parse_operand(tok[5:-1]), sext=True)
    if tok.startswith("-|") and tok.endswith("|"):
        return _with(parse_operand(tok[2:-1]), abs=True, neg=True)
    if tok.startswith("|") and tok.endswith("|") and len(tok) > 2:
        return _with(parse_operand(tok[1:-1]), abs=True)
    if tok.startswith(("lit(", "lit64(")) and tok.endswith(")"):
        inner = parse_operand(tok[tok.index("(") + 1 : -1])
        if inner.kind != "imm":
            raise AsmSyntaxError(f"lit() of a non-constant: {tok}")
        return _with(inner, literal=True)
    if _INT_RE.match(tok):
        return Operand("imm", value=_parse_int(tok))
    if _FLOAT_RE.match(tok):
        return Operand("imm", value=float(tok))
    if tok.startswith("-") and len(tok) > 1:
        inner = parse_operand(tok[1:])
        if inner.kind in ("label", "special", "swizzle"):
            raise AsmSyntaxError(f"cannot negate {tok}")
        return _with(inner, neg=not inner.neg)
    m = _REG_RE.match(tok)
    if m:
        return Operand(m.group(1), index=int(m.group(2)))
    m = _RANGE_RE.match(tok)
    if m:
        lo, hi = int(m.group(2)), int(m.group(3))
        if hi < lo:
            raise AsmSyntaxError(f"bad register range {tok}")
        return Operand(m.group(1), index=lo, count=hi - lo + 1)
    if tok in _SPECIAL_SGPRS:
        idx, cnt = _SPECIAL_SGPRS[tok]
        return Operand("s", index=idx, count=cnt, name=tok)
    if tok in _SPECIAL_NAMES:
        return Operand("special", name=tok)
    if tok.startswith("swizzle(") and tok.endswith(")"):
        return Operand("swizzle", value=parse_swizzle(tok))
    if _LABEL_RE.match(tok) or _NUM_REF_RE.match(tok):
        return Operand("label", name=tok)
    raise AsmSyntaxError(f"unknown operand syntax {tok!r}")


def _with(op: Operand, **kw) -> Operand:
    d = op.__dict__.copy()
    d.update(kw)
    return Operand(**d)


def parse_swizzle(tok: str) -> int:
    """Encode ``swizzle(MODE,...)`` as the ds_swizzle_b32 16-bit offset (LLVM's macro forms).

    Offset encoding (CDNA3 ISA, DS_SWIZZLE_B32): bit15 = 1 -> QDMode (4 x 2-bit lane selects);
    bit15 = 0 -> bitmask mode with and_mask = [4:0], or_mask = [9:5], xor_mask = [14:10].
    """
    body = tok[len("swizzle(") : -1]
    parts = [p.strip() for p in body.split(",")]
    mode = parts[0].upper()
    args = parts[1:]

    def bitmask(and_m: int, or_m: int, xor_m: int) -> int:
        return (and_m & 31) | ((or_m & 31) << 5) | ((xor_m & 31) << 10)

    try:
        if mode == "QUAD_PERM":
            sel = [int(a, 0) for a in args]
            if len(sel) != 4 or any(not 0 <= s < 4 for s in sel):
                raise ValueError
            return 0x8000 | sel[0] | (sel[1] << 2) | (sel[2] << 4) | (sel[3] << 6)
        if mode == "SWAP":
            (n,) = [int(a, 0) for a in args]
            return bitmask(0x1F, 0, n)
        if mode == "REVERSE":
            (n,) = [int(a, 0) for a in args]
            return bitmask(0x1F, 0, n - 1)
        if mode == "BROADCAST":
            size, lane = [int(a, 0) for a in args]
            return bitmask(0x1F & ~(size - 1), lane, 0)
        if mode == "BITMASK_PERM":
            (pat,) = args
            pat = pat.strip('"')
            if len(pat) != 5:
                raise ValueError
            and_m = or_m = xor_m = 0
            # The pattern is written MSB (bit 4) first.
            for i, c in enumerate(pat):
                bit = 1 << (4 - i)
                if c == "0":
                    pass
                elif c == "1":
                    or_m |= bit
                elif c == "p":
                    and_m |= bit
                elif c == "i":
                    and_m |= bit
                    xor_m |= bit
                else:
                    raise ValueError
            return bitmask(and_m, or_m, xor_m)
    except ValueError:
        pass
    raise AsmSyntaxError(f"unsupported swizzle form {tok!r}")


# --------------------------------------------------------------------------- modifiers

_FLAG_MODS = {
    "offen", "idxen", "glc", "slc", "dlc", "nt", "sc0", "sc1", "lds", "clamp", "gds", "tfe", "addr64",
    "row_mirror", "row_half_mirror", "wave_shl:1", "wave_rol:1", "wave_shr:1", "wave_ror:1",
}


def _parse_mod(tok: str) -> Tuple[str, object]:
    if tok in _FLAG_MODS:
        if ":" in tok:  # the wave_* DPP controls spell their only value
            return tok.split(":")[0], 1
        return tok, True
    if ":" not in tok:
        raise AsmSyntaxError(f"unknown modifier {tok!r}")
    key, val = tok.split(":", 1)
    if val.startswith("[") and val.endswith("]"):
        items = [x.strip() for x in val[1:-1].split(",")]
        if all(_INT_RE.match(x) for x in items):
            return key, tuple(_parse_int(x) for x in items)
        if all(re.match(r"^[A-Z_0-9]+$", x) for x in items):  # e.g. format:[BUF_FMT_32_FLOAT]
            return key, tuple(items)
        raise AsmSyntaxError(f"unknown modifier value {tok!r}")
    if val.startswith("swizzle("):
        return key, parse_swizzle(val)
    if _INT_RE.match(val):
        return key, _parse_int(val)
    if re.match(r"^[A-Z_0-9]+$", val):
        return key, val
    raise AsmSyntaxError(f"unknown modifier value {tok!r}")


# --------------------------------------------------------------------------- statements

def _split_top(text: str) -> List[str]:
    """Split on commas that are not inside (), [] or quotes."""
    out, depth, cur, quote = [], 0, [], False
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote:
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif ch == "," and depth == 0:
                out.append("".join(cur).strip())
                cur = []
                continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


_MOD_KEY_RE = re.compile(r"^[a-z_0-9]+:")
_WAITCNT_RE = re.compile(r"(vmcnt|expcnt|lgkmcnt|vscnt)\((\d+)\)")


def parse_instruction(text: str, line: int = 0) -> Instruction:
    text = text.strip()
    parts = text.split(None, 1)
    mnem = parts[0]
    rest = parts[1] if len(parts) > 1 else ""
    mods: Dict[str, object] = {}
    operands: List[Operand] = []
    if mnem == "s_waitcnt":
        # Either counters by name or a raw 16-bit immediate; only the counts are kept.
        for name, val in _WAITCNT_RE.findall(rest):
            mods[name] = int(val)
        if not mods and rest.strip():
            operands.append(parse_operand(rest.strip()))
        return Instruction(mnem, tuple(operands), mods, line, text)
    if rest:
        pieces = _split_top(rest)
        for i, piece in enumerate(pieces):
            toks = piece.split()
            if not toks:
                raise AsmSyntaxError(f"empty operand in {text!r}")
            last = i == len(pieces) - 1
            if not last and len(toks) > 1:
                raise AsmSyntaxError(f"unexpected tokens {toks[1:]} in {text!r}")
            start = 0
            # A lone modifier list (no operands) only happens for operand-less instructions.
            if not (len(pieces) == 1 and (toks[0] in _FLAG_MODS or _MOD_KEY_RE.match(toks[0]))):
                operands.append(parse_operand(toks[0]))
                start = 1
            for t in toks[start:]:
                k, v = _parse_mod(t)
                mods[k] = v
    return Instruction(mnem, tuple(operands), mods, line, text)


_DIRECTIVE_VALUE_RE = re.compile(r"^\.amdhsa_(\w+)\s+(-?(?:0x[0-9a-fA-F]+|\d+))\s*$")


def parse_asm(text: str) -> Program:
    """Parse assembly text (one or several concatenated ``.s`` files) into a Program."""
    instructions: List[Instruction] = []
    labels: Dict[str, int] = {}
    descriptors: Dict[str, Dict[str, int]] = {}
    function_syms: List[str] = []
    metadata_docs: List[dict] = []
    target = ""
    # compile_isa concatenates one file per kernel; each reuses local labels (.LBB0_1, ...),
    # so local labels are scoped to the file they appear in (a new .amdgcn_target starts one).
    file_idx = -1

    def scoped(name: str) -> str:
        return f"{name}@{file_idx}" if name.startswith(".L") and file_idx > 0 else name

    # numeric labels: each definition gets a unique internal name; "Nb" resolves at once to the
    # latest definition, "Nf" waits for the next one (a new file starts afresh)
    num_defs: Dict[str, int] = {}
    num_count = [0]
    pending: Dict[str, List[Tuple[int, int]]] = {}  # N -> [(instruction index, line)]

    def define_numeric(n: str, lineno: int) -> str:
        num_count[0] += 1
        name = f"{n}$num{num_count[0]}"
        num_defs[n] = num_count[0]
        for idx, _ in pending.pop(n, []):
            ins = instructions[idx]
            ins.operands = tuple(_with(o, name=name) if o.kind == "label" and o.name == f"{n}f" else o
                                 for o in ins.operands)
        return name

    def resolve_numeric(ins: Instruction, lineno: int) -> None:
        ops = []
        for o in ins.operands:
            m_ = _NUM_REF_RE.match(o.name) if o.kind == "label" else None
            if m_ and m_.group(2) == "b":
                if m_.group(1) not in num_defs:
                    raise AsmSyntaxError(f"line {lineno}: no label {m_.group(1)}: before {o.name!r}")
                o = _with(o, name=f"{m_.group(1)}$num{num_defs[m_.group(1)]}")
            elif m_:
                pending.setdefault(m_.group(1), []).append((len(instructions), lineno))
            ops.append(o)
        ins.operands = tuple(ops)

    def check_pending() -> None:
        for n, refs in pending.items():
            raise AsmSyntaxError(f"line {refs[0][1]}: no label {n}: after {n}f")

    lines = text.splitlines()
    unterminated = None
    for kind, lineno, a, b in scan(lines):
        if kind is INSTRUCTION:
            try:
                ins = parse_instruction(a, lineno)
            except AsmSyntaxError as e:
                raise AsmSyntaxError(f"line {lineno}: {e}: {lines[lineno - 1].strip()!r}") from None
            if file_idx > 0 and any(o.kind == "label" for o in ins.operands):
                ins.operands = tuple(_with(o, name=scoped(o.name)) if o.kind == "label" else o for o in ins.operands)
            if any(o.kind == "label" and _NUM_REF_RE.match(o.name) for o in ins.operands):
                resolve_numeric(ins, lineno)
            instructions.append(ins)
        elif kind is LABEL:
            name = define_numeric(a, lineno) if a.isdigit() else scoped(a)
            if name in labels:
                raise AsmSyntaxError(f"line {lineno}: label {name!r} defined twice")
            labels[name] = len(instructions)
        elif kind is DIRECTIVE:
            if a == ".amdgcn_target":
                target = b.strip('"')
                file_idx += 1
                check_pending()
                num_defs.clear()
            elif a == ".type" and b.endswith("@function"):
                function_syms.append(b.split(",")[0].strip())
            # other directives (.text, .p2align, .set, .fill, ...) carry no semantics for us
        elif kind is DESCRIPTOR:
            cur_desc = descriptors.setdefault(a, {})
            for ln, entry in b:
                m = _DIRECTIVE_VALUE_RE.match(entry)
                if not m:
                    raise AsmSyntaxError(f"line {ln}: unexpected line in .amdhsa_kernel block: {entry!r}")
                cur_desc[m.group(1)] = _parse_int(m.group(2))
        elif kind is METADATA:
            metadata_docs.append(a)
        elif kind is UNTERMINATED:
            unterminated = unterminated or a
    check_pending()
    if unterminated is not None:
        raise AsmSyntaxError(f"unterminated {unterminated} block")

    meta_by_name: Dict[str, dict] = {}
    merged_meta: Dict[str, object] = {}
    for doc in metadata_docs:
        for k in doc.get("amdhsa.kernels", []) or []:
            meta_by_name[str(k.get(".name"))] = k
        merged_meta.update({k: v for k, v in doc.items() if k != "amdhsa.kernels"})
    merged_meta["amdhsa.kernels"] = list(meta_by_name.values())

    kernels: Dict[str, Kernel] = {}
    for name in list(descriptors) or function_syms:
        if name not in labels:
            raise AsmSyntaxError(f"kernel {name!r} has a descriptor but no code label")
        kernels[name] = Kernel(name, labels[name], descriptors.get(name, {}), meta_by_name.get(name, {}))
    return Program(instructions, labels, kernels, merged_meta, target)


parse = parse_asm


def load_program(src: Union[str, Path]) -> Program:
    """Parse a Program from assembly text or from a path to a ``.s`` file."""
    if isinstance(src, Path) or (isinstance(src, str) and "\n" not in src and src.endswith(".s")):
        return parse_asm(Path(src).read_text())
    return parse_asm(src)
