"""pa_tile.emu.asm parses AMDGPU assembly as LLVM prints it (FlyDSL's 22_final_isa.s)."""

import pytest
import torch

from pa_tile import toolchain
from pa_tile.emu import AsmSyntaxError, decode_kernel, load_program, parse_asm
from pa_tile.emu.asm import SGPR_EXEC, SGPR_M0, SGPR_VCC, parse_instruction, parse_operand, parse_swizzle
from pa_tile.tiny_kernels import scale_add

KERNEL = """\
\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-gfx942"
\t.text
\t.globl\tk0
\t.type\tk0,@function
k0:                                  ; @k0
; %bb.0:
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\tv_mov_b32_e32 v1, 0.5            ; comment after an instruction
\ts_cbranch_scc1 .LBB0_2
.LBB0_1:
\tv_add_f32_e64 v2, -|v3|, s4 clamp
\ts_branch .LBB0_1
.LBB0_2:
\ts_endpgm
.Lfunc_end0:
\t.section\t.rodata,"a",@progbits
\t.amdhsa_kernel k0
\t\t.amdhsa_group_segment_fixed_size 1024
\t\t.amdhsa_kernarg_size 16
\t\t.amdhsa_user_sgpr_count 2
\t\t.amdhsa_system_sgpr_workgroup_id_x 1
\t\t.amdhsa_system_sgpr_workgroup_id_y 0
\t\t.amdhsa_next_free_vgpr 4
\t.end_amdhsa_kernel
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .args:
      - .address_space:  global
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
    .kernarg_segment_size: 16
    .name:           k0
    .group_segment_fixed_size: 1024
amdhsa.target:   amdgcn-amd-amdhsa-unknown-gfx942
...
\t.end_amdgpu_metadata
"""


def test_program_structure_labels_directives_metadata():
    p = parse_asm(KERNEL)
    assert p.arch == "gfx942"
    assert [i.mnemonic for i in p.instructions] == [
        "s_load_dwordx2", "v_mov_b32_e32", "s_cbranch_scc1", "v_add_f32_e64", "s_branch", "s_endpgm"]
    assert p.labels["k0"] == 0 and p.labels[".LBB0_1"] == 3 and p.labels[".LBB0_2"] == 5
    k = p.kernel("k0")
    assert k.entry == 0
    assert k.descriptor["group_segment_fixed_size"] == 1024
    assert k.desc("system_sgpr_workgroup_id_y") == 0 and k.desc("missing", 7) == 7
    assert k.metadata[".kernarg_segment_size"] == 16 and k.metadata[".args"][0][".size"] == 8
    assert p.metadata["amdhsa.target"].endswith("gfx942")
    add = p.instructions[3]
    assert add.line == 11  # 1-based source line
    src = add.operands[1]
    assert (src.kind, src.index, src.neg, src.abs) == ("v", 3, True, True)
    assert add.mods == {"clamp": True}
    assert p.instructions[1].operands[1].value == 0.5


def test_register_and_special_operands():
    assert parse_operand("s[4:7]").__dict__ == parse_operand("s[4:7]").__dict__
    r = parse_operand("v[0:3]")
    assert (r.kind, r.index, r.count) == ("v", 0, 4)
    a = parse_operand("a5")
    assert (a.kind, a.index, a.count) == ("a", 5, 1)
    # specials become the SGPR numbers the hardware uses for them
    assert (parse_operand("vcc").index, parse_operand("vcc").count) == (SGPR_VCC, 2)
    assert parse_operand("vcc_hi").index == SGPR_VCC + 1
    assert (parse_operand("exec").index, parse_operand("exec_lo").count) == (SGPR_EXEC, 1)
    assert parse_operand("m0").index == SGPR_M0
    assert parse_operand("scc").kind == "special" and parse_operand("off").name == "off"
    assert parse_operand(".LBB0_3").kind == "label"


@pytest.mark.parametrize(
    "tok, value",
    [("-16", -16), ("64", 64), ("0x4f7ffffe", 0x4F7FFFFE), ("-4.0", -4.0), ("0.15915494", 0.15915494),
     ("lit(0x1)", 1)],
)
def test_constants(tok, value):
    o = parse_operand(tok)
    assert o.kind == "imm" and o.value == value
    assert o.literal == tok.startswith("lit(")


def test_source_modifiers():
    for tok, neg, ab in (("-v1", True, False), ("|v1|", False, True), ("-|v1|", True, True),
                         ("neg(v1)", True, False), ("abs(v1)", False, True)):
        o = parse_operand(tok)
        assert (o.kind, o.index, o.neg, o.abs) == ("v", 1, neg, ab), tok
    assert parse_operand("sext(v2)").sext


def test_modifier_forms():
    i = parse_instruction("v_mov_b32_dpp v1, v0 quad_perm:[1,0,3,2] row_mask:0xf bank_mask:0xa bound_ctrl:1")
    assert i.mods == {"quad_perm": (1, 0, 3, 2), "row_mask": 15, "bank_mask": 10, "bound_ctrl": 1}
    i = parse_instruction("v_add_u32_sdwa v1, v2, v3 dst_sel:WORD_1 dst_unused:UNUSED_PAD src0_sel:DWORD src1_sel:BYTE_3")
    assert i.mods["dst_sel"] == "WORD_1" and i.mods["src1_sel"] == "BYTE_3"
    i = parse_instruction("v_pk_fma_f32 v[0:1], v[4:5], v[8:9], v[2:3] op_sel_hi:[0,1,0] neg_lo:[0,0,1] neg_hi:[0,0,1]")
    assert i.mods == {"op_sel_hi": (0, 1, 0), "neg_lo": (0, 0, 1), "neg_hi": (0, 0, 1)}
    assert len(i.operands) == 4
    i = parse_instruction("buffer_load_dwordx4 v[0:3], v4, s[8:11], 0 offen offset:16")
    assert [o.kind for o in i.operands] == ["v", "v", "s", "imm"] and i.mods == {"offen": True, "offset": 16}
    i = parse_instruction("ds_read2st64_b32 v[0:1], v2 offset0:8 offset1:12")
    assert i.mods == {"offset0": 8, "offset1": 12}
    i = parse_instruction("global_load_dwordx4 v[0:3], v[10:11], off")
    assert i.operands[2].name == "off"
    i = parse_instruction("s_waitcnt vmcnt(0) lgkmcnt(3)")
    assert i.mods == {"vmcnt": 0, "lgkmcnt": 3} and i.operands == ()
    i = parse_instruction("v_mul_f32_e64 v0, v1, v2 mul:2")
    assert i.mods == {"mul": 2}


def test_swizzle_encodings():
    # ds_swizzle_b32 offset encoding (bitmask mode: and [4:0], or [9:5], xor [14:10]; QDMode bit 15)
    assert parse_swizzle("swizzle(SWAP,16)") == (16 << 10) | 0x1F == 16415  # LLVM prints this as-is
    assert parse_swizzle("swizzle(REVERSE,8)") == (7 << 10) | 0x1F
    assert parse_swizzle("swizzle(BROADCAST,4,1)") == (1 << 5) | 0x1C
    assert parse_swizzle("swizzle(QUAD_PERM,0,1,2,3)") == 0x8000 | (1 << 2) | (2 << 4) | (3 << 6)
    # "01pip": bit4 forced 0, bit3 forced 1, bit2 kept, bit1 inverted, bit0 kept
    assert parse_swizzle('swizzle(BITMASK_PERM,"01pip")') == 0b00111 | (0b01000 << 5) | (0b00010 << 10)
    i = parse_instruction("ds_swizzle_b32 v3, v2 offset:swizzle(SWAP,1)")
    assert i.mods["offset"] == (1 << 10) | 0x1F


def test_concatenated_files_scope_local_labels():
    two = KERNEL + KERNEL.replace("k0", "k1")
    p = parse_asm(two)
    assert set(p.kernels) == {"k0", "k1"}
    k1 = p.kernel("k1")
    br = p.instructions[k1.entry + 4]
    assert br.mnemonic == "s_branch"
    assert p.labels[br.operands[0].name] == k1.entry + 3  # its own loop, not k0's


@pytest.mark.parametrize(
    "line, what",
    [("v_mov_b32 v1, v[2:", "unknown operand"), ("v_mov_b32_dpp v1, v0 frobnicate", "unknown modifier"),
     ("v_add_f32 v1, v2 v3, v4", "unexpected tokens")],
)
def test_unknown_syntax_is_a_clear_error(line, what):
    text = KERNEL.replace("\ts_endpgm\n", f"\t{line}\n\ts_endpgm\n", 1)
    with pytest.raises(AsmSyntaxError, match=what) as e:
        parse_asm(text)
    assert "line 14" in str(e.value)


def test_unknown_kernel_name_lists_the_ones_present():
    with pytest.raises(KeyError, match="k0"):
        parse_asm(KERNEL).kernel("nope")


@pytest.fixture(scope="module", params=["gfx942", "gfx950"])
def real_dump(request):
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    return request.param, toolchain.compile_isa(scale_add, x, y, out, 2.0, arch=request.param)


def test_real_flydsl_dump_parses_and_decodes(real_dump):
    arch, text = real_dump
    p = load_program(text)
    assert p.arch == arch
    k = p.kernel()
    assert k.name.startswith("scale_add_kernel")
    assert k.desc("system_sgpr_workgroup_id_x") == 1 and k.desc("system_sgpr_workgroup_id_y") == 1
    # metadata: X, Y, Out (pointer + layout each) and alpha
    kinds = [a[".value_kind"] for a in k.metadata[".args"]]
    assert kinds[:2] == ["global_buffer", "by_value"] and kinds.count("global_buffer") == 3
    mnems = [i.mnemonic for i in p.instructions]
    assert mnems.count("global_load_dwordx4") == 2 and mnems.count("global_store_dwordx4") == 1
    assert "s_endpgm" in mnems
    # every instruction of the kernel has semantics
    code = decode_kernel(p, k.name, arch)
    assert all(h is not None for h in code[k.entry:mnems.index("s_endpgm") + 1])
