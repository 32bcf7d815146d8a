"""benchmarks.quant_sass: the loop of a W4A16 kernel found in its sm_90 SASS and costed per
weight, without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

from benchmarks.quant_sass import loop_opcodes

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
def test_decode_kernel_loop_feeds_hgmma_at_under_three_instructions_per_weight() -> None:
    # NOTE: a model of the issue cost (compiled for sm_90 on the CPU), not a timing: the M = 1
    # launch the dispatch table picks for 4096 x 4096 (the kernels it replaced ran 5.2-5.8
    # instructions per weight). In a process of its own: the suite's kernels are decorated for
    # the CPU interpreter (TRITON_INTERPRET=1), which cannot compile.
    code = (
        "import json; from benchmarks.quant_sass import figures; "
        "from loraplex.kernels.w4a16.dispatch import TUNED_CONFIGS; "
        "f = figures(TUNED_CONFIGS[(4, 1, 4096, 4096)], 'bf16', 128); "
        "print(json.dumps([f.spills, dict(f.top), f.per_weight]))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    spills, top, per_weight = json.loads(done.stdout.strip().splitlines()[-1])
    assert spills == 0
    assert "HGMMA" in top  # the warpgroup MMA, its weight operand from registers
    assert per_weight < 3.0
