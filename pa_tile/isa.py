"""Static facts about a compiled kernel, read from the AMDGPU assembly text FlyDSL/LLVM prints.

``IsaStats.from_asm(text)`` reads one kernel: register and LDS budgets (from the
``.amdgpu_metadata`` YAML, the ``.amdhsa_kernel`` descriptor and LLVM's ``.set .L<kernel>.*``
symbols), the static instruction stream (counts by family and mnemonic, load/store widths) and
the loops (back edges to earlier labels). ``occupancy(stats)`` turns the budgets into waves per
SIMD on gfx942 / gfx950 and names the resource that bounds it; ``summary``, ``diff``, ``table``
and ``histogram_plot`` present the facts in a terminal or a notebook.

Nothing here runs code: "static" counts are instructions in the text, not instructions executed.
The text's structure (comments, labels, directives, descriptor and metadata blocks, the YAML) is
read by :mod:`pa_tile.emu.asmtext`, the one scanner the emulator's parser uses too.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
from collections import Counter
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .emu import asmtext as _asmtext

__all__ = [
    "FAMILIES",
    "ArchLimits",
    "ARCH_LIMITS",
    "IsaStats",
    "Loop",
    "Occupancy",
    "kernel_names",
    "instruction_family",
    "occupancy",
    "occupancy_for",
    "summary",
    "table",
    "diff",
    "diff_rows",
    "diff_side_by_side",
    "loop_phases",
    "histogram_plot",
]

#: Instruction families, in the order reports list them.
FAMILIES = ("global", "buffer", "smem", "ds", "mfma", "valu", "salu", "waitcnt", "barrier", "branch", "other")

# ---------------------------------------------------------------------------------------------
# instruction classification

# SOPP-style control instructions that neither compute nor move data nor branch.
_CONTROL = {
    "s_nop", "s_endpgm", "s_endpgm_saved", "s_endpgm_ordered_ps_done", "s_code_end", "s_sleep",
    "s_setprio", "s_sethalt", "s_setkill", "s_trap", "s_rfe_b64", "s_icache_inv", "s_incperflevel",
    "s_decperflevel", "s_ttracedata", "s_ttracedata_imm", "s_wakeup", "s_sendmsg", "s_sendmsghalt",
    "s_sendmsg_rtn_b32", "s_sendmsg_rtn_b64", "s_set_inst_prefetch_distance",
}
# buffer_* mnemonics that are cache maintenance, not memory accesses.
_CACHE_OPS = {"buffer_wbinvl1", "buffer_wbinvl1_vol", "buffer_inv", "buffer_wbl2", "buffer_gl0_inv", "buffer_gl1_inv"}
_SMEM_PREFIXES = (
    "s_load_", "s_buffer_load_", "s_store_", "s_buffer_store_", "s_scratch_", "s_dcache_", "s_atomic_",
    "s_buffer_atomic_", "s_memtime", "s_memrealtime", "s_atc_probe",
)
_BRANCH_PREFIXES = ("s_cbranch_", "s_setpc_", "s_swappc_", "s_call_", "s_subvector_loop_")


def instruction_family(mnemonic: str) -> str:
    """The family (one of ``FAMILIES``) of an instruction mnemonic such as ``'global_load_dwordx4'``.

    flat_/scratch_ instructions count as ``global``: all three are FLAT-encoded vector memory.
    MFMA and sparse MFMA (``v_smfmac``) are ``mfma``; every other ``v_`` op, including
    ``v_accvgpr_read/write``, is ``valu``.
    """
    m = mnemonic.lower()
    if m.startswith(("global_", "flat_", "scratch_")):
        return "global"
    if m.startswith(("buffer_", "tbuffer_")):
        return "other" if m in _CACHE_OPS else "buffer"
    if m.startswith("ds_"):
        return "ds"
    if m.startswith(("v_mfma", "v_smfmac")):
        return "mfma"
    if m.startswith("v_"):
        return "valu"
    if m.startswith("s_waitcnt"):
        return "waitcnt"
    if m.startswith("s_barrier"):
        return "barrier"
    if m == "s_branch" or m.startswith(_BRANCH_PREFIXES):
        return "branch"
    if m.startswith(_SMEM_PREFIXES):
        return "smem"
    if m in _CONTROL:
        return "other"
    if m.startswith("s_"):
        return "salu"
    return "other"


_VMEM_ACCESS = re.compile(r"^(global|buffer|flat|scratch)_(load|store)_(?:lds_)?([a-z0-9_]+)$")
_DS_ACCESS = re.compile(r"^ds_(read|load|write|store)(2st64|2)?_([a-z0-9_]+)$")


def _access_width(mnemonic: str) -> Optional[Tuple[str, str, str]]:
    """(space, 'load'|'store', width) for a plain memory load/store, else None (atomics, permutes)."""
    m = _VMEM_ACCESS.match(mnemonic)
    if m:
        space = "global" if m.group(1) in ("global", "flat", "scratch") else "buffer"
        return space, m.group(2), m.group(3)
    m = _DS_ACCESS.match(mnemonic)
    if m:
        kind = "load" if m.group(1) in ("read", "load") else "store"
        # read2/write2 move two elements of the named width per lane: "2xb32" keeps that visible.
        width = ("2x" if m.group(2) else "") + m.group(3)
        return "ds", kind, width
    return None


# ---------------------------------------------------------------------------------------------
# parsing


@dataclasses.dataclass(frozen=True)
class _Instr:
    mnemonic: str
    operands: str
    line: int  # 1-based line in the text handed to from_asm


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop found from back edges: branches to a label at or before the branch.

    The body is the contiguous instruction range from the header label to the last branch back
    to it (indices into the kernel's instruction list). Blocks LLVM placed outside that range
    (rare for FlyDSL's structured loops) are not counted.
    """

    header: str
    start: int
    end: int
    start_line: int
    end_line: int
    depth: int
    innermost: bool
    families: Dict[str, int]

    @property
    def n_instructions(self) -> int:
        return self.end - self.start + 1

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["n_instructions"] = self.n_instructions
        return d


_SET = re.compile(r"^\.L(.+)\.(\w+)\s*,\s*(.+)$")  # the argument of ".set .L<kernel>.<field>, <value>"
_TARGET = re.compile(r"gfx[0-9a-f]+")
_CODE_ENDS = (".size", ".section")  # directives after a function's last instruction


class _Module:
    """One assembly file: its kernels' metadata, descriptors, ``.set`` symbols and code.

    ``instrs`` holds every instruction of the file; ``marks`` the labels ``(name, index)`` and the
    ends of code ``(None, index)`` (``.size``/``.section``, the descriptor and metadata blocks) in
    text order, the index being the instruction that follows.
    """

    def __init__(self) -> None:
        self.target: Optional[str] = None
        self.metadata: Dict[str, Dict[str, Any]] = {}
        self.descriptors: Dict[str, Dict[str, str]] = {}
        self.symbols: Dict[str, Dict[str, str]] = {}
        self.functions: List[str] = []
        self.instrs: List[_Instr] = []
        self.marks: List[Tuple[Optional[str], int]] = []
        self.code_start: Dict[str, int] = {}  # non-local label -> its position in marks

    def _read_metadata(self, doc: Dict[str, Any]) -> None:
        if not self.target and isinstance(doc.get("amdhsa.target"), str):
            m = _TARGET.search(doc["amdhsa.target"])
            self.target = m.group(0) if m else None
        for k in doc.get("amdhsa.kernels") or []:
            self.metadata[str(k.get(".name"))] = k

    def kernel_names(self) -> List[str]:
        names = list(self.metadata) or list(self.descriptors) or [f for f in self.functions if f in self.code_start]
        return [n for n in names if n in self.code_start] or names

    def code(self, name: str) -> Tuple[List[_Instr], Dict[str, int]]:
        """Instructions of *name* (label to ``.Lfunc_end``) and each label's instruction index."""
        if name not in self.code_start:
            raise ValueError(f"kernel {name!r} has metadata but no code label in the assembly")
        others = set(self.functions) | set(self.metadata) | set(self.descriptors)
        p = self.code_start[name]
        start, end = self.marks[p][1], len(self.instrs)
        labels: Dict[str, int] = {}
        for label, idx in self.marks[p + 1:]:
            if label is None or label.startswith(".Lfunc_end") or (label in others and label != name):
                end = idx
                break
            labels[label] = idx - start
        return _drop_padding(self.instrs[start:end]), labels


def _modules(text: str) -> List[_Module]:
    """The files of an assembly text (``compile_isa`` joins one per launched kernel), read with
    the one scanner of assembly structure, :func:`pa_tile.emu.asmtext.scan`."""
    mod = _Module()
    mods = [mod]
    instrs, marks = mod.instrs, mod.marks
    for kind, line, a, b in _asmtext.scan(text.splitlines()):
        if kind is _asmtext.INSTRUCTION:
            parts = a.split(None, 1)
            instrs.append(_Instr(parts[0].lower(), parts[1].strip() if len(parts) > 1 else "", line))
        elif kind is _asmtext.LABEL:
            if not a.startswith(".L"):
                mod.code_start.setdefault(a, len(marks))
            marks.append((a, len(instrs)))
        elif kind is _asmtext.DIRECTIVE:
            if a == ".amdgcn_target":
                mod = _Module()
                mods.append(mod)
                instrs, marks = mod.instrs, mod.marks
                m = _TARGET.search(b)
                mod.target = m.group(0) if m else None
            elif a == ".type" and "@function" in b:
                mod.functions.append(b.split(",")[0].strip())
            elif a == ".set":
                m = _SET.match(b)
                if m:
                    mod.symbols.setdefault(m.group(1), {})[m.group(2)] = m.group(3).strip()
            elif a.startswith(_CODE_ENDS):
                marks.append((None, len(instrs)))
        elif kind is _asmtext.DESCRIPTOR:
            desc = mod.descriptors.setdefault(a, {})
            for _, entry in b:
                if entry.startswith(".amdhsa_"):
                    key, _, value = entry.partition(" ")
                    desc[key[len(".amdhsa_"):]] = value.strip()
            marks.append((None, len(instrs)))
        elif kind is _asmtext.METADATA:
            mod._read_metadata(a)
            marks.append((None, len(instrs)))
    return mods


def _drop_padding(instrs: List[_Instr]) -> List[_Instr]:
    """Drop the s_nop/s_code_end run LLVM may print after the final s_endpgm (prefetch padding)."""
    n = len(instrs)
    while n and instrs[n - 1].mnemonic in ("s_nop", "s_code_end"):
        n -= 1
    if n < len(instrs) and n and instrs[n - 1].mnemonic.startswith("s_endpgm"):
        return instrs[:n]
    return instrs


def _find_loops(instrs: List[_Instr], labels: Dict[str, int]) -> List[Loop]:
    ends: Dict[str, int] = {}
    for idx, ins in enumerate(instrs):
        if instruction_family(ins.mnemonic) != "branch" or not ins.operands:
            continue
        target = ins.operands.split(",")[0].split()[0]
        start = labels.get(target)
        if start is not None and start <= idx:
            ends[target] = max(ends.get(target, idx), idx)  # several back edges: one loop
    spans = sorted(((labels[h], e, h) for h, e in ends.items()), key=lambda t: (t[0], -t[1]))
    loops = []
    for s, e, h in spans:
        depth = sum(1 for s2, e2, _ in spans if s2 <= s and e <= e2)
        inner = not any((s <= s2 and e2 <= e) and (s2, e2) != (s, e) for s2, e2, _ in spans)
        fam = Counter(instruction_family(x.mnemonic) for x in instrs[s:e + 1])
        loops.append(Loop(h, s, e, instrs[s].line, instrs[e].line, depth, inner, {f: fam.get(f, 0) for f in FAMILIES}))
    return loops


def instruction_fingerprint(text: str) -> str:
    """sha256 (16 hex digits) of every kernel's instructions in an assembly text (``compile_isa``'s,
    kernels in launch order), mnemonics and operands only: metadata such as the kernel-argument
    block's size is left out, so an unused trailing argument does not change it."""
    import hashlib

    parts = []
    for mod in _modules(text):
        for name in mod.kernel_names():
            instrs, _ = mod.code(name)
            parts.append(name + "\n" + "\n".join(f"{i.mnemonic} {i.operands}" for i in instrs))
    return hashlib.sha256("\n\n".join(parts).encode()).hexdigest()[:16]


def kernel_names(text: str) -> List[str]:
    """Names of the kernels in an assembly text, in order of appearance."""
    return [n for mod in _modules(text) for n in mod.kernel_names()]


# ---------------------------------------------------------------------------------------------
# the facts


def _int(v: Any) -> Optional[int]:
    """An integer directive/metadata value (decimal or 0x-hex), None for absent or symbolic ones."""
    if v is None or isinstance(v, bool):
        return None
    text = str(v).strip()
    for base in (10, 0):
        try:
            return int(text, base)
        except ValueError:
            pass
    return None


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclasses.dataclass
class IsaStats:
    """Static facts of one kernel. Build with ``IsaStats.from_asm(text)``.

    Register counts are per lane (VGPR/AGPR) or per wave (SGPR). ``vgpr_unified`` is the
    combined VGPR+AGPR allocation that the register file actually holds on gfx90a and later
    (``.vgpr_count`` in the metadata): ``vgpr`` when no AGPR is used, else
    ``align(vgpr, 4) + agpr`` (AGPRs start at the 4-aligned ``accum_offset``). ``sgpr`` is
    ``.sgpr_count``, which includes VCC, FLAT_SCRATCH and XNACK_MASK.
    """

    kernel: str = ""
    arch: Optional[str] = None
    vgpr: int = 0
    agpr: int = 0
    vgpr_unified: int = 0
    sgpr: int = 0
    vgpr_spill: int = 0
    sgpr_spill: int = 0
    lds_bytes: int = 0
    scratch_bytes: int = 0
    wavefront_size: int = 64
    workgroup_size: Optional[int] = None
    reqd_workgroup_size: Optional[Tuple[int, int, int]] = None
    max_flat_workgroup_size: Optional[int] = None
    kernarg_bytes: Optional[int] = None
    n_instructions: int = 0
    families: Dict[str, int] = dataclasses.field(default_factory=lambda: {f: 0 for f in FAMILIES})
    mnemonics: Dict[str, int] = dataclasses.field(default_factory=dict)
    load_widths: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)
    store_widths: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)
    loops: List[Loop] = dataclasses.field(default_factory=list)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path, kernel: Union[str, int, None] = None) -> "IsaStats":
        with open(path) as f:
            return cls.from_asm(f.read(), kernel)

    @classmethod
    def from_asm(cls, text: str, kernel: Union[str, int, None] = None) -> "IsaStats":
        """Read one kernel from assembly *text*.

        With several kernels in the text, *kernel* picks one by name (or by position); without
        it, a ValueError lists the names.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be assembly text (str), got {type(text).__name__}")
        modules = _modules(text)
        found = [(mod, n) for mod in modules for n in mod.kernel_names()]
        names = [n for _, n in found]
        if not found:
            raise ValueError("no kernel found in the assembly (no .amdgpu_metadata, .amdhsa_kernel or @function label)")
        if kernel is None:
            if len(found) > 1:
                raise ValueError(f"the assembly holds {len(found)} kernels, pick one with kernel=: {names}")
            mod, name = found[0]
        elif isinstance(kernel, int) and not isinstance(kernel, bool):
            if not -len(found) <= kernel < len(found):
                raise ValueError(f"kernel index {kernel} out of range for kernels {names}")
            mod, name = found[kernel]
        else:
            hits = [f for f in found if f[1] == kernel]
            if not hits:
                raise ValueError(f"no kernel named {kernel!r}; kernels in the assembly: {names}")
            if len(hits) > 1:
                raise ValueError(f"kernel {kernel!r} appears {len(hits)} times; pick one by position (kernel=<int>)")
            mod, name = hits[0]
        return cls._build(mod, name)

    @classmethod
    def _build(cls, mod: _Module, name: str) -> "IsaStats":
        md = mod.metadata.get(name, {})
        desc = mod.descriptors.get(name, {})
        sym = mod.symbols.get(name, {})

        agpr = _int(md.get(".agpr_count"))
        if agpr is None:
            agpr = _int(sym.get("num_agpr")) or 0
        unified = _int(md.get(".vgpr_count"))
        vgpr = _int(sym.get("num_vgpr"))
        if vgpr is None:  # no LLVM symbols: recover arch VGPRs from the descriptor
            if agpr and _int(desc.get("accum_offset")) is not None:
                vgpr = _int(desc["accum_offset"])
            else:
                vgpr = (unified if unified is not None else _int(desc.get("next_free_vgpr")) or 0) - agpr
        if unified is None:
            unified = _align(vgpr, 4) + agpr if agpr else vgpr
        sgpr = _int(md.get(".sgpr_count"))
        if sgpr is None:
            sgpr = _int(desc.get("next_free_sgpr")) or 0

        lds = _int(md.get(".group_segment_fixed_size"))
        if lds is None:
            lds = _int(desc.get("group_segment_fixed_size")) or 0
        scratch = _int(md.get(".private_segment_fixed_size"))
        if scratch is None:
            scratch = _int(desc.get("private_segment_fixed_size")) or 0
        wave = _int(md.get(".wavefront_size")) or (32 if desc.get("wavefront_size32") == "1" else 64)
        reqd = md.get(".reqd_workgroup_size")
        reqd = tuple(int(x) for x in reqd) if reqd else None
        max_flat = _int(md.get(".max_flat_workgroup_size"))
        wg = math.prod(reqd) if reqd else max_flat

        instrs, labels = mod.code(name)
        mn = Counter(i.mnemonic for i in instrs)
        fam = Counter()
        loads: Dict[str, Counter] = {}
        stores: Dict[str, Counter] = {}
        for m, c in mn.items():
            fam[instruction_family(m)] += c
            acc = _access_width(m)
            if acc:
                space, kind, width = acc
                (loads if kind == "load" else stores).setdefault(space, Counter())[width] += c
        return cls(
            kernel=name,
            arch=mod.target,
            vgpr=vgpr,
            agpr=agpr,
            vgpr_unified=unified,
            sgpr=sgpr,
            vgpr_spill=_int(md.get(".vgpr_spill_count")) or 0,
            sgpr_spill=_int(md.get(".sgpr_spill_count")) or 0,
            lds_bytes=lds,
            scratch_bytes=scratch,
            wavefront_size=wave,
            workgroup_size=wg,
            reqd_workgroup_size=reqd,
            max_flat_workgroup_size=max_flat,
            kernarg_bytes=_int(md.get(".kernarg_segment_size")),
            n_instructions=len(instrs),
            families={f: fam.get(f, 0) for f in FAMILIES},
            mnemonics=dict(sorted(mn.items(), key=lambda kv: (-kv[1], kv[0]))),
            load_widths={k: dict(sorted(v.items())) for k, v in sorted(loads.items())},
            store_widths={k: dict(sorted(v.items())) for k, v in sorted(stores.items())},
            loops=_find_loops(instrs, labels),
        )

    # -- derived ------------------------------------------------------------------------------

    @property
    def vgpr_unified_computed(self) -> int:
        """The unified count rebuilt from ``vgpr``/``agpr`` (should equal ``vgpr_unified``)."""
        return _align(self.vgpr, 4) + self.agpr if self.agpr else self.vgpr

    @property
    def main_loop(self) -> Optional[Loop]:
        """The largest innermost loop (the hot loop of a kernel like paged attention), or None."""
        inner = [lp for lp in self.loops if lp.innermost]
        return max(inner, key=lambda lp: (lp.n_instructions, -lp.start)) if inner else None

    @property
    def main_loop_instructions(self) -> int:
        lp = self.main_loop
        return lp.n_instructions if lp else 0

    def count(self, mnemonic: str) -> int:
        """How many times *mnemonic* appears (exact spelling, e.g. ``'v_add_f32_e32'``)."""
        return self.mnemonics.get(mnemonic.lower(), 0)

    def count_prefix(self, prefix: str) -> int:
        """Instructions whose mnemonic starts with *prefix* (e.g. ``'ds_read'``)."""
        p = prefix.lower()
        return sum(c for m, c in self.mnemonics.items() if m.startswith(p))

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["reqd_workgroup_size"] = list(self.reqd_workgroup_size) if self.reqd_workgroup_size else None
        d["loops"] = [lp.to_dict() for lp in self.loops]
        d["main_loop_instructions"] = self.main_loop_instructions
        return d

    # -- notebook display ---------------------------------------------------------------------

    def table(self) -> List[Tuple[str, str]]:
        return table(self)

    def __str__(self) -> str:
        return summary(self)

    def _repr_markdown_(self) -> str:
        rows = self.table()
        return "| fact | value |\n|---|---|\n" + "\n".join(f"| {k} | {v.replace('|', '/')} |" for k, v in rows)

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                       f"{html.escape(v)}</td></tr>" for k, v in self.table())
        return f"<table>{body}</table>"


# ---------------------------------------------------------------------------------------------
# occupancy


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-CU resources that bound how many waves can be resident (CDNA3 / CDNA4 figures).

    VGPR and AGPR share one 512-entry-per-lane file per SIMD on gfx90a and later, allocated in
    granules of 8; SGPRs come from an 800-entry file per SIMD in granules of 16 (LLVM's
    ``getOccupancyWithNumSGPRs`` closed form; its older step table differs only for 97-100
    SGPRs). A workgroup of more than one wave also needs a barrier slot, 16 per CU (LLVM's
    ``getMaxWorkGroupsPerCU``). LDS is allocated in blocks of 128 dwords (gfx942) or 320 dwords
    (gfx950, LLVM ``getLdsDwGranularity``).
    """

    name: str
    lds_per_cu: int
    lds_granule: int
    simds_per_cu: int = 4
    max_waves_per_simd: int = 8
    vgprs_per_lane: int = 512
    vgpr_granule: int = 8
    sgprs_per_simd: int = 800
    sgpr_granule: int = 16
    max_workgroups_per_cu: int = 16


def _limits_from_arch_facts() -> Dict[str, ArchLimits]:
    from . import arch as _arch

    return {name: ArchLimits(name, **{f.name: getattr(a, f.name) for f in dataclasses.fields(ArchLimits)
                                      if f.name != "name"})
            for name, a in _arch.INFO.items()}


#: occupancy limits of each target, from the one home of arch facts (``pa_tile.arch``)
ARCH_LIMITS: Dict[str, ArchLimits] = _limits_from_arch_facts()


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """Resident waves for one kernel on one architecture.

    ``waves_per_simd`` is the average over the CU's SIMDs (an integer whenever a workgroup has
    a multiple of 4 waves). ``limits`` gives, for each resource alone, how many waves per SIMD
    it would allow; ``bound_by`` names the resources that reach the minimum.
    """

    arch: str
    waves_per_simd: float
    workgroups_per_cu: int
    waves_per_workgroup: int
    limits: Dict[str, float]
    bound_by: Tuple[str, ...]

    @property
    def waves_per_cu(self) -> int:
        return self.workgroups_per_cu * self.waves_per_workgroup

    def __str__(self) -> str:
        lim = ", ".join(f"{k} {_num(v)}" for k, v in self.limits.items())
        return (f"{_num(self.waves_per_simd)} waves/SIMD ({self.workgroups_per_cu} workgroups/CU of "
                f"{self.waves_per_workgroup} waves) on {self.arch}, bound by {'+'.join(self.bound_by)} [{lim}]")


def _num(x: float) -> str:
    if x == math.inf:
        return "inf"
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def _limits_for(arch: str) -> ArchLimits:
    if isinstance(arch, ArchLimits):
        return arch
    if arch not in ARCH_LIMITS:
        raise ValueError(f"occupancy knows arch {sorted(ARCH_LIMITS)}, got {arch!r}")
    return ARCH_LIMITS[arch]


def occupancy_for(arch: Union[str, ArchLimits], vgpr_unified: int, sgpr: int = 0, lds_bytes: int = 0,
                  workgroup_size: int = 256, wavefront_size: int = 64) -> Occupancy:
    """Occupancy from raw budgets (see ``occupancy`` for a compiled kernel)."""
    lim = _limits_for(arch)
    if workgroup_size is None or workgroup_size <= 0:
        raise ValueError(f"workgroup_size must be a positive thread count, got {workgroup_size!r}")
    wpw = -(-workgroup_size // wavefront_size)
    per_simd = {
        "vgpr": lim.vgprs_per_lane // _align(vgpr_unified, lim.vgpr_granule) if vgpr_unified > 0 else math.inf,
        "sgpr": lim.sgprs_per_simd // _align(sgpr, lim.sgpr_granule) if sgpr > 0 else math.inf,
        "waves": lim.max_waves_per_simd,
    }
    # Waves of a workgroup are spread over the SIMDs, so per-SIMD budgets pool across the CU.
    wg_limits = {k: (math.inf if v == math.inf else (lim.simds_per_cu * v) // wpw) for k, v in per_simd.items()}
    wg_limits["lds"] = lim.lds_per_cu // _align(lds_bytes, lim.lds_granule) if lds_bytes > 0 else math.inf
    wg_limits["workgroups"] = lim.max_workgroups_per_cu if wpw > 1 else math.inf
    wg = min(wg_limits.values())
    bound = tuple(k for k, v in wg_limits.items() if v == wg)
    as_waves = {k: (v if v == math.inf else v * wpw / lim.simds_per_cu) for k, v in wg_limits.items()}
    return Occupancy(lim.name, wg * wpw / lim.simds_per_cu, int(wg), wpw, as_waves, bound)


def occupancy(stats: IsaStats, arch: Optional[str] = None) -> Occupancy:
    """Waves per SIMD (and workgroups per CU) for a compiled kernel on gfx942 or gfx950.

    *arch* defaults to the arch the kernel was compiled for. The workgroup size is the
    required one when the kernel declares it, else its maximum flat size (256 if unknown).
    """
    arch = arch or stats.arch
    if arch is None:
        raise ValueError("the kernel's arch is unknown; pass arch='gfx942' or 'gfx950'")
    return occupancy_for(arch, stats.vgpr_unified, stats.sgpr, stats.lds_bytes,
                         stats.workgroup_size or 256, stats.wavefront_size)


def loop_phases(stats: Union[IsaStats, str], kernel: Union[str, int, None] = None) -> List[Tuple[str, int, int]]:
    """``(name, first_line, last_line)`` of the code before, in and after the kernel's main loop
    (:attr:`IsaStats.main_loop`), in lines of the assembly text the stats were read from: the
    lines the emulator's trace records, so ``Trace.grouped_summary(phases=loop_phases(...))``
    sorts every memory instruction into prologue, loop and epilogue. *stats* may also be that
    text (then *kernel* picks the kernel, as in :meth:`IsaStats.from_asm`). Without a loop the
    whole text is one phase, ``"prologue"``.
    """
    if isinstance(stats, str):
        stats = IsaStats.from_asm(stats, kernel)
    lp = stats.main_loop
    if lp is None:
        return [("prologue", 1, _LAST_LINE)]
    return [("prologue", 1, lp.start_line - 1), ("loop", lp.start_line, lp.end_line),
            ("epilogue", lp.end_line + 1, _LAST_LINE)]


_LAST_LINE = 2 ** 31 - 1  # "to the end of the text"


# ---------------------------------------------------------------------------------------------
# presentation


def _fmt_counts(d: Dict[str, int], sep: str = " ") -> str:
    return sep.join(f"{k} {v}" for k, v in d.items() if v) or "-"


def _occ_or_none(stats: IsaStats) -> Optional[Occupancy]:
    try:
        return occupancy(stats)
    except ValueError:
        return None


def table(stats: IsaStats) -> List[Tuple[str, str]]:
    """(fact, value) rows: what ``summary`` prints, in a shape notebooks can render."""
    occ = _occ_or_none(stats)
    wg = stats.reqd_workgroup_size or stats.workgroup_size
    rows = [
        ("kernel", stats.kernel),
        ("arch", f"{stats.arch or '?'} wave{stats.wavefront_size} workgroup {wg}"),
        ("registers", f"vgpr {stats.vgpr} + agpr {stats.agpr} = unified {stats.vgpr_unified}, sgpr {stats.sgpr}"),
        ("spills", f"vgpr {stats.vgpr_spill}, sgpr {stats.sgpr_spill}, scratch {stats.scratch_bytes} B"),
        ("LDS", f"{stats.lds_bytes} B"),
        ("occupancy", str(occ) if occ else "n/a (unknown arch)"),
        ("instructions", f"{stats.n_instructions} static"),
        ("families", _fmt_counts(stats.families, ", ")),
        ("loads", "; ".join(f"{s}: {_fmt_counts(w, ', ')}" for s, w in stats.load_widths.items()) or "-"),
        ("stores", "; ".join(f"{s}: {_fmt_counts(w, ', ')}" for s, w in stats.store_widths.items()) or "-"),
    ]
    lp = stats.main_loop
    if lp:
        rows.append(("main loop", f"{lp.n_instructions} instructions from {lp.header} (lines {lp.start_line}-"
                                  f"{lp.end_line}): {_fmt_counts(lp.families, ', ')}"))
    else:
        rows.append(("main loop", "none (no backward branch)"))
    if len(stats.loops) > 1:
        rows.append(("loops", "; ".join(f"{x.header} {x.n_instructions} instr depth {x.depth}"
                                        f"{' innermost' if x.innermost else ''}" for x in stats.loops)))
    return rows


def summary(stats: IsaStats) -> str:
    """A readable multi-line summary of one kernel."""
    rows = table(stats)
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _delta(x: Any, y: Any) -> str:
    if x is None or y is None:
        return ""
    d = y - x
    if d == 0:
        return "0"
    return f"{int(d):+d}" if float(d).is_integer() else f"{d:+.2f}"


def diff_rows(a: IsaStats, b: IsaStats, mnemonics: bool = True) -> List[Tuple[str, str, Any, Any, str]]:
    """(section, metric, a, b, delta) rows comparing two kernels (delta = b - a).

    Sections: ``budget`` (registers, memory, occupancy, sizes), ``family``, ``width`` (loads
    and stores by width) and, with *mnemonics*, ``mnemonic`` rows for counts that differ.
    """
    def occ_val(s):
        o = _occ_or_none(s)
        return o.waves_per_simd if o else None

    metrics: List[Tuple[str, str, Any, Any]] = [("budget", k, x, y) for k, x, y in (
        ("vgpr", a.vgpr, b.vgpr), ("agpr", a.agpr, b.agpr), ("vgpr unified", a.vgpr_unified, b.vgpr_unified),
        ("sgpr", a.sgpr, b.sgpr), ("vgpr spill", a.vgpr_spill, b.vgpr_spill),
        ("sgpr spill", a.sgpr_spill, b.sgpr_spill), ("LDS bytes", a.lds_bytes, b.lds_bytes),
        ("scratch bytes", a.scratch_bytes, b.scratch_bytes), ("waves/SIMD", occ_val(a), occ_val(b)),
        ("instructions", a.n_instructions, b.n_instructions),
        ("main loop instr", a.main_loop_instructions, b.main_loop_instructions),
    )]
    metrics += [("family", f, a.families.get(f, 0), b.families.get(f, 0)) for f in FAMILIES]
    for kind, attr in (("load", "load_widths"), ("store", "store_widths")):
        wa, wb = getattr(a, attr), getattr(b, attr)
        for space in sorted(set(wa) | set(wb)):
            for width in sorted(set(wa.get(space, {})) | set(wb.get(space, {}))):
                metrics.append(("width", f"{space} {kind} {width}",
                                wa.get(space, {}).get(width, 0), wb.get(space, {}).get(width, 0)))
    if mnemonics:
        for m in sorted(set(a.mnemonics) | set(b.mnemonics)):
            ca, cb = a.mnemonics.get(m, 0), b.mnemonics.get(m, 0)
            if ca != cb:
                metrics.append(("mnemonic", m, ca, cb))
    return [(sec, k, x, y, _delta(x, y)) for sec, k, x, y in metrics]


_SECTION_TITLES = {"family": "by family", "width": "loads/stores by width", "mnemonic": "mnemonics that differ"}
_SECTIONS = ("budget", "family", "width", "mnemonic")

#: the rows ``compact=True`` keeps even when nothing changed: the facts a reader checks first
HEADLINE = ("vgpr unified", "LDS bytes", "waves/SIMD", "instructions", "main loop instr")


def _missing_value(s: IsaStats, sec: str, metric: str) -> Any:
    """A width or mnemonic count that ``diff_rows`` left out of one pair (0, or equal on both sides)."""
    if sec == "width":
        space, kind, width = metric.split(" ")
        return getattr(s, f"{kind}_widths").get(space, {}).get(width, 0)
    return s.mnemonics.get(metric, 0)


def _diff_table(pairs: Mapping[str, Tuple[IsaStats, IsaStats]], labels: Sequence[str], mnemonics: bool,
                compact: bool, group_header: bool) -> str:
    if len(labels) != 2:
        raise ValueError(f"labels must name the two kernels, got {labels!r}")
    if not pairs:
        raise ValueError("no pair of kernels to compare")
    per = {g: {(sec, k): (x, y, d) for sec, k, x, y, d in diff_rows(a, b, mnemonics)} for g, (a, b) in pairs.items()}
    order: Dict[Tuple[str, str], Tuple] = {}
    for rows in per.values():
        for i, (sec, k) in enumerate(rows):
            if (sec, k) not in order:  # budget and family rows: every pair's, in diff_rows' order
                tail = (k.split(" ")[1] != "load", k) if sec == "width" else (k,) if sec == "mnemonic" else (i,)
                order[(sec, k)] = (_SECTIONS.index(sec),) + tail
    keys = sorted(order, key=order.get)
    cells: Dict[Tuple[str, str], List[Tuple[Any, Any, str]]] = {}
    for key in keys:
        cells[key] = []
        for g, (a, b) in pairs.items():
            if key in per[g]:
                cells[key].append(per[g][key])
            else:
                x, y = _missing_value(a, *key), _missing_value(b, *key)
                cells[key].append((x, y, _delta(x, y)))
    if compact:
        stats = [s for pair in pairs.values() for s in pair]
        same_vgpr = all(s.vgpr == s.vgpr_unified for s in stats)
        no_agpr = all(s.agpr == 0 for s in stats)

        def keep(key):
            sec, k = key
            if (k == "vgpr" and same_vgpr) or (k == "agpr" and no_agpr):
                return False
            return (sec == "budget" and k in HEADLINE) or any(d != "0" for _, _, d in cells[key])

        keys = [key for key in keys if keep(key)]
    head = ["metric"] + [c for _ in pairs for c in (str(labels[0]), str(labels[1]), "delta")]
    rows: List[Tuple[str, ...]] = [tuple(head)]
    section = "budget"
    for sec, k in keys:
        if sec != section:
            rows.append((_SECTION_TITLES[sec] + ":",))
            section = sec
        indent = "" if sec == "budget" else "  "
        rows.append((indent + k,) + tuple(c for x, y, d in cells[(sec, k)]
                                           for c in ("-" if x is None else _num(x), "-" if y is None else _num(y), d)))
    n = len(head)
    widths = [max(len(r[i]) for r in rows if len(r) == n) for i in range(n)]
    out = []
    if group_header:
        spans = [f"{g:^{widths[1 + 3 * j] + widths[2 + 3 * j] + widths[3 + 3 * j] + 4}}" for j, g in enumerate(pairs)]
        out.append((" " * widths[0] + "  " + "  ".join(spans)).rstrip())
    for r in rows:
        if len(r) == 1:
            out.append(r[0])
            continue
        out.append(f"{r[0]:<{widths[0]}}  " + "  ".join(f"{c:>{widths[i + 1]}}" for i, c in enumerate(r[1:])))
        if r is rows[0]:
            out.append("-" * len(out[-1]))
    return "\n".join(out)


def diff(a: IsaStats, b: IsaStats, labels: Sequence[str] = ("before", "after"), mnemonics: bool = True,
         compact: bool = False) -> str:
    """A side-by-side table of two kernels' facts with deltas (after - before).

    ``compact=True`` keeps only the rows that changed, plus the :data:`HEADLINE` facts (registers,
    LDS, occupancy, instruction counts) whatever they did; ``vgpr`` and ``agpr`` are left out when
    they add nothing to ``vgpr unified`` (no AGPR used on either side).
    """
    return _diff_table({"": (a, b)}, labels, mnemonics, compact, group_header=False)


def diff_side_by_side(pairs: Mapping[str, Tuple[IsaStats, IsaStats]], labels: Sequence[str] = ("before", "after"),
                      mnemonics: bool = False, compact: bool = True) -> str:
    """:func:`diff` of several pairs in one table: one row per metric, three columns (before,
    after, delta) per pair, under the pair's name (e.g. ``{"gfx942": (a, b), "gfx950": (c, d)}``).

    A row is there when any pair has it; with ``compact`` (the default) when any pair's delta is
    not 0, or it is a :data:`HEADLINE` fact.
    """
    return _diff_table(dict(pairs), labels, mnemonics, compact, group_header=True)


def histogram_plot(stats_list: Iterable[IsaStats], labels: Optional[Sequence[str]] = None,
                   by: str = "family", top: int = 20, ax=None):
    """Grouped bar chart of instruction counts per kernel; returns the matplotlib Figure.

    ``by='family'`` plots ``FAMILIES``; ``by='mnemonic'`` the *top* most frequent mnemonics
    over all kernels; ``by='main_loop'`` the families inside each kernel's main loop.
    """
    import matplotlib.pyplot as plt  # lazily: the rest of this module works without matplotlib

    stats_list = list(stats_list)
    labels = list(labels) if labels is not None else [s.kernel for s in stats_list]
    if len(labels) != len(stats_list):
        raise ValueError(f"{len(labels)} labels for {len(stats_list)} kernels")
    if by == "family":
        keys = list(FAMILIES)
        data = [[s.families.get(k, 0) for k in keys] for s in stats_list]
    elif by == "main_loop":
        keys = list(FAMILIES)
        data = [[(s.main_loop.families.get(k, 0) if s.main_loop else 0) for k in keys] for s in stats_list]
    elif by == "mnemonic":
        total = Counter()
        for s in stats_list:
            total.update(s.mnemonics)
        keys = [m for m, _ in total.most_common(top)]
        data = [[s.mnemonics.get(k, 0) for k in keys] for s in stats_list]
    else:
        raise ValueError(f"by must be 'family', 'mnemonic' or 'main_loop', got {by!r}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(keys) * max(1, len(stats_list)) ** 0.5), 3.5))
    else:
        fig = ax.figure
    n = max(1, len(stats_list))
    width = 0.8 / n
    for i, (row, lab) in enumerate(zip(data, labels)):
        ax.bar([j + (i - (n - 1) / 2) * width for j in range(len(keys))], row, width, label=lab)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys, rotation=45 if by == "mnemonic" else 0, ha="right" if by == "mnemonic" else "center")
    ax.set_ylabel("static instructions")
    ax.set_title({"family": "instructions by family", "mnemonic": f"top {len(keys)} mnemonics",
                  "main_loop": "main loop instructions by family"}[by])
    ax.legend()
    fig.tight_layout()
    return fig
