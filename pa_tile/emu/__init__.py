"""pa_tile's instruction-level emulator for gfx942 (MI300) / gfx950 (MI355) assembly.

``load_program`` parses the assembly FlyDSL produces; ``run_kernel`` executes one kernel of it
over a grid against a :class:`GlobalMemory` (host tensors as allowed regions). See
``docs/DESIGN.md`` for the module map and the interfaces between the parts.
"""

from .asm import AsmSyntaxError, Instruction, Kernel, Operand, Program, load_program, parse_asm
from .machine import Wave, decode_kernel, run_kernel, run_wave
from .memory import LDS, GlobalMemory, MemoryFault, Trace
from .ops_base import EmulationError, UnsupportedInstruction

__all__ = [
    "AsmSyntaxError",
    "EmulationError",
    "GlobalMemory",
    "Instruction",
    "Kernel",
    "LDS",
    "MemoryFault",
    "Operand",
    "Program",
    "Trace",
    "UnsupportedInstruction",
    "Wave",
    "decode_kernel",
    "load_program",
    "parse_asm",
    "run_kernel",
    "run_wave",
]
