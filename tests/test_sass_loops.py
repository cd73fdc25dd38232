"""scripts/sass_loops.py finds a kernel's main loop in cuobjdump's SASS and counts its opcodes
(no GPU, no nvcc: a listing written out here in cuobjdump's format)."""

from __future__ import annotations

from scripts.sass_loops import functions, loop_mix

LISTING = """
	code for sm_90
		Function : _Z3fooPi
	.headerflags	@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;     /* 0x000000100000780c */
        /*0030*/               @P0 BRA 0x90 ;                              /* 0x0000000000140947 */
        /*0040*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ; /* 0x0000000402047981 */
        /*0050*/                   IDP.4A.S8.S8 R8, R4, R5, R8 ;           /* 0x0000000504087226 */
        /*0060*/                   IDP.4A.S8.S8 R8, R6, R7, R8 ;           /* 0x0000000706087226 */
        /*0070*/                   VIADD R0, R0, 0x20 ;                    /* 0x0000002000007836 */
        /*0080*/              @!P0 BRA 0x40 ;                              /* 0xfffffffc00ec8947 */
        /*0090*/                   @P1 BRA 0x60 ;                          /* 0xfffffffc00ec8947 */
        /*00a0*/                   EXIT ;                                  /* 0x000000000000794d */
		..........
		Function : _Z3barPi
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_the_widest_backward_branch_is_the_loop():
    fs = functions(LISTING)
    assert list(fs) == ["_Z3fooPi", "_Z3barPi"]
    start, end, ops = loop_mix(fs["_Z3fooPi"])
    # two backward branches, 0x80 -> 0x40 (five instructions) and 0x90 -> 0x60 (four): the wider
    # one is the loop; the forward branch at 0x30 is none
    assert (start, end) == (0x40, 0x80)
    assert ops == {"LDG": 1, "IDP": 2, "VIADD": 1, "BRA": 1}


def test_a_function_without_a_backward_branch_has_no_loop():
    assert loop_mix(functions(LISTING)["_Z3barPi"]) is None


def test_with_an_opcode_the_innermost_loop_holding_it():
    foo = functions(LISTING)["_Z3fooPi"]
    # IDP lies in both spans: the narrower, 0x60-0x90, is the innermost loop doing that work
    start, end, ops = loop_mix(foo, "IDP")
    assert (start, end) == (0x60, 0x90) and ops == {"IDP": 1, "VIADD": 1, "BRA": 2}
    assert loop_mix(foo, "LDG")[:2] == (0x40, 0x80)  # only the wide span holds the load
    assert loop_mix(foo, "IMMA") is None
