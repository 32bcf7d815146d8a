"""benchmarks.quant_sass: the loop of a W4A16 kernel found in its sm_90 SASS and costed per
weight, without a GPU."""

from __future__ import annotations

import os

import pytest
import triton

from benchmarks.quant_sass import figures, loop_opcodes

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R6.64] ;
        /*0030*/                   HGMMA.64x16x16.F32.BF16 R8, R4, gdesc[UR4], RZ ;
        /*0040*/              @!P1 BRA 0x10 ;
        /*0050*/                   SHF.R.U32.HI R2, RZ, 0x4, R3 ;
        /*0060*/              @!P2 BRA 0x50 ;
        /*0070*/                   EXIT ;
"""
_CUOBJDUMP = os.path.join(
    os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
)


def test_the_largest_backward_branch_is_the_loop() -> None:
    assert loop_opcodes(_SASS) == ["LOP3", "LDG", "HGMMA", "BRA"]
    assert loop_opcodes("        /*0000*/                   EXIT ;") == []


@pytest.mark.skipif(not os.path.exists(_CUOBJDUMP), reason="Triton without its CUDA tools")
def test_stream_pair_loop_costs_under_four_instructions_per_weight() -> None:
    # NOTE: a model of the issue cost (compiled for sm_90 on the CPU), not a timing; today's
    # FMA and sliced kernels run 5.2-5.8 per weight.
    f = figures("stream_pair", (256, 128, 8, 1))
    assert f.spills == 0
    assert "HGMMA" in dict(f.top)  # the warpgroup MMA, fed from registers
    assert f.per_weight < 4.0
