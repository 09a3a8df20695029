"""``benchmarks/sass_loops.py``'s reading of ``cuobjdump -sass`` output, which needs no GPU and no CUDA toolkit: the
functions, their loops (nested ones too, innermost first) and opcodes without predicates or modifiers (the kernel's
build and name match: tests/cuda/test_portable_build.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Two functions in cuobjdump's layout (encodings on their own lines); the first has a loop inside a loop.
SASS = """
\tcode for sm_90
\t\tFunction : _Z14moe_gate_up_i8I7IQ2_XXSEvPKh
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                 /* 0x00000a00ff017b82 */
                                                                                           /* 0x000fe20000000800 */
        /*0010*/                   IMAD.SHL.U32 R3, R2, 0x4, RZ ;                         /* 0x0000000402037824 */
        /*0020*/                   LDS R4, [R3] ;                                         /* 0x0000000003047984 */
        /*0030*/                   PRMT R5, R6, R4, 0xd5e7f8 ;                            /* 0x00d5e7f806057816 */
        /*0040*/                   IDP.4A.S8.S8 R7, R5, R8, R7 ;                          /* 0x0000000805077226 */
        /*0050*/               @!P0 BRA 0x20 ;                                            /* 0xfffffffc00008947 */
        /*0060*/                   ISETP.GE.AND P1, PT, R9, R10, PT ;                     /* 0x0000000a0900720c */
        /*0070*/               @!P1 BRA 0x10 ;                                            /* 0xfffffffc00009947 */
        /*0080*/               @P2 BRA 0xa0 ;                                             /* 0x0000001000002947 */
        /*0090*/                   BRA.DIV UR5, 0x10 ;                                    /* 0x0000000005007947 */
        /*00a0*/                   EXIT ;                                                 /* 0x000000000000794d */
\t\t..........


\t\tFunction : route_topk
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                 /* 0x00000a0000017a02 */
        /*0010*/                   EXIT ;                                                 /* 0x000000000000794d */
"""


@pytest.fixture(scope="module")
def sass_loops(load_script):
    return load_script(ROOT / "benchmarks" / "sass_loops.py", "_sass_loops")


def test_functions_hold_their_instructions_by_address(sass_loops):
    found = sass_loops.functions(SASS)
    assert list(found) == ["_Z14moe_gate_up_i8I7IQ2_XXSEvPKh", "route_topk"]
    code = found["_Z14moe_gate_up_i8I7IQ2_XXSEvPKh"]
    assert [a for a, _ in code] == list(range(0, 0xb0, 0x10))  # the encodings' own lines are not instructions
    assert code[5] == (0x50, "@!P0 BRA 0x20")
    assert found["route_topk"] == [(0, "MOV R1, c[0x0][0x28]"), (0x10, "EXIT")]


def test_loops_are_backward_branches_innermost_first(sass_loops):
    code = sass_loops.functions(SASS)["_Z14moe_gate_up_i8I7IQ2_XXSEvPKh"]
    loops = sass_loops.loops(code)
    assert [(start, end) for start, end, _ in loops] == [(0x20, 0x50), (0x10, 0x70)]  # not the forward BRA, BRA.DIV
    inner = loops[0][2]
    assert [sass_loops.opcode(i) for i in inner] == ["LDS", "PRMT", "IDP", "BRA"]
    assert len(loops[1][2]) == 7
    assert sass_loops.loops(sass_loops.functions(SASS)["route_topk"]) == []


def test_opcode_drops_predicate_and_modifiers(sass_loops):
    assert sass_loops.opcode("@!P0 LDG.E.128.CONSTANT R36, desc[UR12][R40.64]") == "LDG"
    assert sass_loops.opcode("IDP.4A.S8.S8 R75, R75, R32, RZ") == "IDP"
    assert sass_loops.opcode("EXIT") == "EXIT"
