"""Wave and workgroup state, decoding, and the executor loop.

``run_kernel`` executes a grid workgroup by workgroup. Waves of one workgroup run round-robin:
each runs until it reaches ``s_barrier`` or ``s_endpgm``; when every live wave has arrived the
barrier releases and the pass repeats. That is the simplest schedule that is correct for code
that synchronises only through barriers. Code that does not (two waves touching the same LDS
bytes between two barriers, one of them writing) has no defined result on hardware, so such
accesses are detected and reported (``ops_ds.LdsRaceChecker``) instead of silently resolved in
this schedule's order. ``quantum=1`` interleaves the waves instruction by instruction instead,
which is how a racy kernel most likely behaves on a real CU.

Every instruction of the kernel is decoded once (per program and arch) into a handler closure
(see ``ops_base``); an instruction without semantics fails at decode time, before anything runs.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import ops_ds, ops_mfma, ops_salu, ops_scratch, ops_valu, ops_vmem  # noqa: F401  (register semantics)
from . import ops_atomic, ops_lds_ext, ops_valu16  # noqa: F401  (after the modules whose builders they extend)
from . import ops_fast
from .memory import LDS
from .ops_ds import LdsRaceChecker
from .asm import SGPR_EXEC, SGPR_M0, SGPR_VCC, Kernel, Program
from .ops_base import (
    ARCHS,
    BARRIER,
    END,
    LANES,
    M32,
    OPS,
    DecodeCtx,
    EmulationError,
    UnsupportedInstruction,
    mask_from_words,
)

__all__ = ["Wave", "run_kernel", "run_wave", "decode_kernel", "UnsupportedInstruction", "EmulationError"]

def _named_errors():
    from .asm import AsmSyntaxError
    from .memory import MemoryFault

    return (EmulationError, UnsupportedInstruction, MemoryFault, AsmSyntaxError)


_NAMED_ERRORS = _named_errors()

#: Backward branches one wave may take before we call it a hang.
MAX_LOOP_ITERATIONS = 50_000_000


class Wave:
    """Architectural state of one wavefront."""

    __slots__ = ("v", "s", "scc", "em", "eall", "pc", "lds", "races", "mem", "wg_id", "wave_id", "uid", "trace",
                 "arch", "done", "scratch", "cptr", "fctx")

    def __init__(self, arch: str = "gfx942"):
        self.v = np.zeros((512, LANES), np.uint32)
        self.s = np.zeros(128, np.uint32)
        self.scc = 0
        self.em = np.zeros(LANES, bool)
        self.eall = False
        self.pc = 0
        self.lds = None
        self.races = None  # ops_ds.LdsRaceChecker of the workgroup, or None
        self.mem = None
        self.trace = None
        self.wg_id = (0, 0, 0)
        self.wave_id = 0  # index within the workgroup
        self.uid = 0  # index within the launch (flat workgroup id * waves per group + wave_id)
        self.arch = arch
        self.done = False
        self.scratch = None  # ops_scratch.PrivateSegment when the kernel has a private segment
        self.cptr = None  # the fast engine's raw register-file pointers (fastpath.pointers)
        self.fctx = None  # the fast engine's memory context for blocks (ops_fast._memory_context)
        self.exec = (1 << LANES) - 1  # a fresh wave has all lanes on

    def sync_exec(self) -> None:
        """Refresh the cached lane mask after anything wrote EXEC."""
        self.em = mask_from_words(self.s[SGPR_EXEC:SGPR_EXEC + 2]).copy()
        self.eall = bool(self.em.all())

    def exec_mask(self) -> np.ndarray:
        return self.em

    @property
    def exec(self) -> int:
        return int(self.s[SGPR_EXEC]) | (int(self.s[SGPR_EXEC + 1]) << 32)

    @exec.setter
    def exec(self, x: int) -> None:
        self.s[SGPR_EXEC] = x & M32
        self.s[SGPR_EXEC + 1] = (x >> 32) & M32
        self.sync_exec()

    @property
    def vcc(self) -> int:
        return int(self.s[SGPR_VCC]) | (int(self.s[SGPR_VCC + 1]) << 32)

    @vcc.setter
    def vcc(self, x: int) -> None:
        self.s[SGPR_VCC] = x & M32
        self.s[SGPR_VCC + 1] = (x >> 32) & M32

    @property
    def m0(self) -> int:
        return int(self.s[SGPR_M0])

    @m0.setter
    def m0(self, x: int) -> None:
        self.s[SGPR_M0] = x & M32

    def where(self) -> str:
        return f"workgroup {self.wg_id} wave {self.wave_id}"


# --------------------------------------------------------------------------- engines

#: ``fast`` (default): the reference handlers, with the hottest instructions' common forms
#: replaced by ``ops_fast`` ones that compute the same bits faster; ``reference``: the numpy
#: semantics alone (what the fast ones are tested against).
ENGINES = ("fast", "reference")
ENGINE_ENV = "PA_TILE_EMU_ENGINE"


def default_engine() -> str:
    """The engine launches use when none is named: ``$PA_TILE_EMU_ENGINE`` (read at each
    launch, so it can be switched inside one process), else ``fast``."""
    import os

    return check_engine(os.environ.get(ENGINE_ENV) or "fast")


def check_engine(engine: Optional[str]) -> str:
    if engine is None:
        return default_engine()
    if engine not in ENGINES:
        raise ValueError(f"emulator engine must be one of {ENGINES}, got {engine!r} (${ENGINE_ENV})")
    return engine


# --------------------------------------------------------------------------- decoding

def _kernel_range(program: Program, kernel: Kernel) -> Tuple[int, int]:
    starts = sorted(k.entry for k in program.kernels.values())
    nxt = [s for s in starts if s > kernel.entry]
    return kernel.entry, (nxt[0] if nxt else len(program.instructions))


def decode_kernel(program: Program, kernel_name: Optional[str] = None, arch: Optional[str] = None,
                  engine: Optional[str] = None) -> List:
    """Handlers for every instruction of a kernel (cached on the program per kernel, arch and
    engine; *engine* defaults to :func:`default_engine`).

    The list is indexed like ``program.instructions``; entries outside the kernel are ``None``.
    Raises :class:`UnsupportedInstruction` for the first instruction without semantics.
    """
    kernel = program.kernel(kernel_name)
    arch = arch or program.arch or "gfx942"
    engine = check_engine(engine)
    cache = program.__dict__.setdefault("_decoded", {})
    key = (kernel.name, arch, engine)
    if key in cache:
        return cache[key]
    fast = ops_fast.FAST if engine == "fast" and ops_fast.available() else {}
    lo, hi = _kernel_range(program, kernel)
    code: List = [None] * len(program.instructions)
    for i in range(lo, hi):
        ins = program.instructions[i]
        ctx = DecodeCtx(ins, kernel, arch, program.labels, i)
        builder = OPS.get(ctx.base)
        if builder is None:
            raise UnsupportedInstruction(
                f"no semantics for {ins.mnemonic} (kernel {kernel.name}, line {ins.line}: {ins.text})"
            )
        if arch not in ARCHS.get(ctx.base, (arch,)):
            raise UnsupportedInstruction(
                f"{ins.mnemonic} does not exist on {arch} (kernel {kernel.name}, line {ins.line}: {ins.text})"
            )
        try:
            code[i] = builder(ctx)
            if ctx.base in fast:
                # a fresh context: some reference builders rewrite theirs (operands, base name)
                fctx = DecodeCtx(ins, kernel, arch, program.labels, i)
                if fctx.base in fast:
                    code[i] = fast[fctx.base](fctx, code[i])
        except UnsupportedInstruction:
            raise
        except Exception as e:  # a builder tripping over an operand form it did not expect
            raise UnsupportedInstruction(
                f"cannot decode {ins.mnemonic} ({type(e).__name__}: {e}) (kernel {kernel.name}, line {ins.line}: "
                f"{ins.text})"
            ) from e
    cache[key] = code
    return code


def run_code(program: Program, kernel_name: Optional[str], arch: str, engine: Optional[str] = None) -> List:
    """The handlers the run-to-barrier loop uses when nothing counts single instructions (no
    trace, no ``quantum``): under the fast engine, runs of straight-line instructions the C
    library covers become one handler each (``ops_fast.block_code``); otherwise
    :func:`decode_kernel`'s list itself."""
    engine = check_engine(engine)
    code = decode_kernel(program, kernel_name, arch, engine)
    if engine != "fast" or not ops_fast.available():
        return code
    kernel = program.kernel(kernel_name)
    cache = program.__dict__.setdefault("_decoded", {})
    key = (kernel.name, arch, "fast-blocks")
    if key not in cache:
        cache[key] = ops_fast.block_code(
            program, kernel, arch, code,
            lambda i: DecodeCtx(program.instructions[i], kernel, arch, program.labels, i))
    return cache[key]


# --------------------------------------------------------------------------- execution

def private_segment_size(k: Kernel) -> int:
    """Bytes of scratch each work-item of kernel *k* owns (``.amdhsa_private_segment_fixed_size``)."""
    return int(k.descriptor.get("private_segment_fixed_size", k.metadata.get(".private_segment_fixed_size", 0)))


def _check_private_segment_setup(k: Kernel) -> None:
    """Refuse scratch setups a HIP runtime would not give a gfx942/gfx950 kernel.

    Both archs have architected flat scratch: the hardware sets FLAT_SCRATCH, and the private
    segment buffer / flat scratch init user SGPRs "must be 0" (LLVM AMDGPUUsage, kernel
    descriptor). A dynamic stack would need a size the runtime picks at launch.
    """
    d = k.descriptor
    for flag in ("user_sgpr_private_segment_buffer", "user_sgpr_flat_scratch_init"):
        if d.get(flag, 0):
            raise UnsupportedInstruction(
                f"kernel {k.name}: .amdhsa_{flag} is set, which gfx942/gfx950 (architected flat scratch) "
                "do not support")
    if d.get("uses_dynamic_stack", 0) or k.metadata.get(".uses_dynamic_stack", False):
        raise UnsupportedInstruction(f"kernel {k.name}: a dynamic stack (.amdhsa_uses_dynamic_stack) is not emulated")


def _init_wave_sgprs(w: Wave, k: Kernel, kernarg_addr: int, wg: Tuple[int, int, int]) -> None:
    d = k.descriptor
    n = 0
    for flag in ("user_sgpr_dispatch_ptr", "user_sgpr_queue_ptr"):
        if d.get(flag, 0):
            raise UnsupportedInstruction(f"kernel {k.name}: .amdhsa_{flag} is not emulated")
    if d.get("user_sgpr_kernarg_segment_ptr", 1):
        w.s[n] = kernarg_addr & M32
        w.s[n + 1] = kernarg_addr >> 32
        n += 2
    if d.get("user_sgpr_dispatch_id", 0):
        n += 2
    if d.get("user_sgpr_private_segment_size", 0):
        # The CP writes the per-work-item private size rounded up to a dword.
        w.s[n] = -(-private_segment_size(k) // 4) * 4
        n += 1
    if d.get("user_sgpr_kernarg_preload_length", 0):
        raise UnsupportedInstruction(f"kernel {k.name}: kernarg preloading is not emulated")
    n = d.get("user_sgpr_count", n)
    for axis, gid in zip("xyz", wg):
        if d.get(f"system_sgpr_workgroup_id_{axis}", 1 if axis == "x" else 0):
            w.s[n] = gid
            n += 1
    if d.get("system_sgpr_workgroup_info", 0):
        n += 1


def _run_wave(w: Wave, code: List, mnemonics: Optional[List[str]], lines: Optional[List[int]] = None) -> int:
    """Run one wave until s_barrier or s_endpgm; returns BARRIER or END."""
    pc = w.pc
    back = 0
    try:
        if mnemonics is None:
            while True:
                r = code[pc](w)
                if r is None:
                    pc += 1
                elif r >= 0:
                    if r <= pc:
                        back += 1
                        if back > MAX_LOOP_ITERATIONS:
                            raise EmulationError(f"{w.where()}: more than {MAX_LOOP_ITERATIONS} backward branches; hang?")
                    pc = r
                else:
                    w.pc = pc + 1
                    return r
        else:
            count = w.trace.count
            uid = w.uid
            while True:
                count(mnemonics[pc], uid, lines[pc])
                r = code[pc](w)
                if r is None:
                    pc += 1
                elif r >= 0:
                    if r <= pc:
                        back += 1
                        if back > MAX_LOOP_ITERATIONS:
                            raise EmulationError(f"{w.where()}: more than {MAX_LOOP_ITERATIONS} backward branches; hang?")
                    pc = r
                else:
                    w.pc = pc + 1
                    return r
    except BaseException:
        w.pc = pc  # where it failed, for the caller's message
        raise


def _run_quantum(w: Wave, code: List, mnemonics: Optional[List[str]], n: int,
                 lines: Optional[List[int]] = None) -> Optional[int]:
    """Run at most n instructions of one wave; BARRIER/END if it got there, else None."""
    pc = w.pc
    try:
        for _ in range(n):
            if mnemonics is not None:
                w.trace.count(mnemonics[pc], w.uid, lines[pc])
            r = code[pc](w)
            if r is None:
                pc += 1
            elif r >= 0:
                pc = r
            else:
                w.pc = pc + 1
                return r
        w.pc = pc
        return None
    except BaseException:
        w.pc = pc
        raise


def _run_workgroup(waves: List[Wave], code: List, mnemonics, races, quantum: Optional[int], describe,
                   lines=None) -> None:
    """Waves take turns; a wave that reaches s_barrier waits until every live wave has."""
    live = list(waves)
    waiting = set()
    while live:
        for w in live:
            if w.wave_id in waiting:
                continue
            try:
                r = (_run_wave(w, code, mnemonics, lines) if quantum is None
                     else _run_quantum(w, code, mnemonics, quantum, lines))
            except Exception as e:
                if not 0 <= w.pc < len(code) or code[w.pc] is None:
                    raise EmulationError(f"{w.where()}: execution left the kernel (instruction index {w.pc})") from e
                if not isinstance(e, _NAMED_ERRORS):
                    # a bug of the emulator itself (a numpy TypeError, an IndexError, ...): the
                    # caller still gets one of our errors, naming the instruction
                    raise EmulationError(
                        f"internal emulator error {type(e).__name__}: {e} while executing {describe(w.pc)} "
                        f"in {w.where()}"
                    ) from e
                e.add_note(f"[emu] while executing {describe(w.pc)} in {w.where()}")
                raise
            if r == END:
                w.done = True
            elif r == BARRIER:
                waiting.add(w.wave_id)
        live = [w for w in live if not w.done]
        if live and all(w.wave_id in waiting for w in live):
            waiting.clear()
            if races is not None:
                races.barrier()


def run_wave(program: Program, wave: Wave, kernel_name: Optional[str] = None, arch: Optional[str] = None,
             engine: Optional[str] = None) -> Wave:
    """Run one prepared wave from its kernel's entry to ``s_endpgm`` (a lone wave passes every
    ``s_barrier``). The caller sets up registers, EXEC (``wave.exec = ...``) and, if the code
    touches memory, ``wave.mem`` / ``wave.lds`` (and ``wave.scratch``, an
    ``ops_scratch.PrivateSegment``, for scratch). For unit tests and demonstrations."""
    kernel = program.kernel(kernel_name)
    code = run_code(program, kernel.name, arch or wave.arch, engine)
    wave.pc = kernel.entry
    with np.errstate(all="ignore"):
        while _run_wave(wave, code, None) != END:
            pass
    return wave


def _warn_races(found: List[str]) -> None:
    import warnings

    for msg in dict.fromkeys(found):
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _dims(x, what: str) -> Tuple[int, int, int]:
    if isinstance(x, int):
        x = (x,)
    x = tuple(int(v) for v in x)
    if not 1 <= len(x) <= 3 or any(v < 1 for v in x):
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {x}")
    return x + (1,) * (3 - len(x))


def _make_lds(nbytes: int, arch: str, oob: str = "raise"):
    return LDS(nbytes, arch=arch, oob=oob)


def _progress_bar(name: str, ngroups: int, progress: Optional[bool]):
    """A bar over workgroups on the current ``sys.stderr`` (looked up per launch, so redirected
    or captured stderr gets it). ``True`` draws it; ``None`` leaves the choice to
    ``pa_tile.progress`` and waits a few seconds first, so only long launches show one."""
    from ..progress import progress as bar

    if progress:
        return bar(total=ngroups, desc=f"[emu] {name}", unit="wg", enabled=True, leave=True)
    return bar(total=ngroups, desc=f"[emu] {name}", unit="wg", delay=3.0, nested=False)


def run_kernel(
    program: Program,
    kernel_name: Optional[str],
    grid: Sequence[int],
    block: Sequence[int],
    kernarg: bytes,
    memory,
    dynamic_lds: int = 0,
    arch: str = "gfx942",
    trace=None,
    progress: Optional[bool] = None,
    lds_races: str = "raise",
    quantum: Optional[int] = None,
    lds_oob: str = "raise",
    engine: Optional[str] = None,
) -> None:
    """Execute *kernel_name* of *program* over *grid* x *block* against *memory*.

    ``kernarg`` is the kernarg segment (bytes); it is copied into its own region of ``memory``
    (``memory.GlobalMemory``: ``alloc``, ``load``, ``store``, ``load_scalar``) and s[0:1] points
    at it. ``trace`` (``memory.Trace``), if given, is told every executed instruction
    (``count(mnemonic, wave)``) and every memory access; ``wave`` is the launch-wide wave index
    (flat workgroup id x waves per workgroup + wave in the workgroup).

    Waves of a workgroup run round-robin, each until its next ``s_barrier`` (or, with
    ``quantum=n``, for n instructions at a time: ``quantum=1`` runs them in lock-step, closer to
    how a CU interleaves them, at some speed cost). ``lds_races``
    (``'raise'``, ``'warn'``, ``'off'``) controls the check that no two waves touch the same LDS
    bytes between two barriers with at least one write (see ``ops_ds.LdsRaceChecker``): such
    code has no defined result on hardware, and this schedule would silently pick one order.
    ``'warn'`` reports each distinct race with ``warnings.warn`` and goes on.
    ``lds_oob``: ``'raise'`` (default) faults on an LDS access past the workgroup's allocation;
    ``'hardware'`` follows the hardware instead (reads 0, drops writes, within the allocation
    rounded up to the arch's granule: ``memory.LDS``), to see what a kernel that over-reads LDS
    computes on a GPU once the fault is known.
    ``engine``: ``'fast'`` or ``'reference'`` (see :data:`ENGINES`); ``None`` reads
    ``$PA_TILE_EMU_ENGINE`` (default ``'fast'``). Both give the same bits, traces and findings.
    ``progress=True`` shows a tqdm bar over the workgroups on stderr; ``None`` (the default) shows
    one on launches longer than 3 s when ``pa_tile.progress`` says a person is watching;
    ``False`` never.
    """
    kernel = program.kernel(kernel_name)
    code = (run_code(program, kernel.name, arch, engine) if trace is None and quantum is None
            else decode_kernel(program, kernel.name, arch, engine))
    grid3, block3 = _dims(grid, "grid"), _dims(block, "block")
    threads = block3[0] * block3[1] * block3[2]
    if threads > 1024:
        raise ValueError(f"block {block3} has {threads} threads; at most 1024")
    d = kernel.descriptor
    if d.get("system_vgpr_workitem_id", 0) < (2 if block3[2] > 1 else 1 if block3[1] > 1 else 0):
        raise ValueError(
            f"kernel {kernel.name} reads workitem ids up to axis {d.get('system_vgpr_workitem_id', 0)} "
            f"but block is {block3}"
        )
    lds_bytes = int(d.get("group_segment_fixed_size", kernel.metadata.get(".group_segment_fixed_size", 0))) + int(dynamic_lds)
    # The kernarg segment gets its own region; padded to whole 64-byte lines because the
    # compiler may fetch argument dwords in wide s_load_dwordx* groups.
    kernarg = bytes(kernarg)
    ka_addr, ka_buf = memory.alloc(max(64, -(-len(kernarg) // 64) * 64), f"kernarg segment of {kernel.name}")
    ka_buf[: len(kernarg)] = np.frombuffer(kernarg, np.uint8)
    nwaves = (threads + LANES - 1) // LANES
    tid = np.arange(nwaves * LANES)
    tx = tid % block3[0]
    ty = (tid // block3[0]) % block3[1]
    tz = tid // (block3[0] * block3[1])
    packed_ids = (tx | (ty << 10) | (tz << 20)).astype(np.uint32).reshape(nwaves, LANES)
    mnemonics = [ins.mnemonic for ins in program.instructions] if trace is not None else None
    # the source line of each instruction, for a trace that counts executions by line
    lines = [ins.line for ins in program.instructions] if trace is not None else None

    if quantum is not None and (not isinstance(quantum, int) or quantum < 1):
        raise ValueError(f"quantum must be None or a positive int, got {quantum!r}")
    if lds_races not in ("raise", "warn", "off"):
        raise ValueError(f"lds_races must be 'raise', 'warn' or 'off', got {lds_races!r}")
    if lds_oob not in ("raise", "hardware"):
        raise ValueError(f"lds_oob must be 'raise' or 'hardware', got {lds_oob!r}")

    def describe(pc: int) -> str:
        ins = program.instructions[pc]
        return f"line {ins.line} ({ins.text})"

    waves = [Wave(arch) for _ in range(nwaves)]
    _check_private_segment_setup(kernel)
    scratch_bytes = private_segment_size(kernel)
    if scratch_bytes:
        from .ops_scratch import PrivateSegment

        for w in waves:
            w.scratch = PrivateSegment(scratch_bytes)
    ngroups = grid3[0] * grid3[1] * grid3[2]
    bar = None if progress is False else _progress_bar(kernel.name, ngroups, progress)
    try:
        with np.errstate(all="ignore"):
            for g in range(ngroups):
                wg = (g % grid3[0], (g // grid3[0]) % grid3[1], g // (grid3[0] * grid3[1]))
                lds = _make_lds(lds_bytes, arch, lds_oob)
                races = None if lds_races == "off" or nwaves == 1 else LdsRaceChecker(lds_bytes, lds_races, describe)
                for wi, w in enumerate(waves):
                    w.v.fill(0)
                    w.s.fill(0)
                    w.scc = 0
                    w.pc = kernel.entry
                    w.lds = lds
                    w.races = races
                    w.mem = memory
                    w.trace = trace
                    w.wg_id = wg
                    w.wave_id = wi
                    w.uid = g * nwaves + wi
                    w.done = False
                    if w.scratch is not None:
                        w.scratch.reset()
                    n_live = min(LANES, threads - wi * LANES)
                    w.v[0] = packed_ids[wi]
                    w.exec = (1 << n_live) - 1
                    _init_wave_sgprs(w, kernel, ka_addr, wg)
                _run_workgroup(waves, code, mnemonics, races, quantum, describe, lines)
                if races is not None and races.races:
                    _warn_races(races.races)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
