#!/bin/bash
# The W4A16 kernel run on one H200, ~6 minutes, from the repository root:
#
#   LORAPLEX_BENCH_COMMIT=<commit> OUT=<dir> bash benchmarks/h200_w4a16.sh
#
# 1. benchmarks.quant_gemm: every W4A16 launch checked against the dequantized reference at the
#    8B shapes, then timed beside bf16 cuBLAS, torch's int4 and FP8 (ours, _scaled_mm) at
#    M = 1 .. 4096; writes $OUT/h200_quant.json and the selection table
#    $OUT/h200_w4a16_table.json (copy both to benchmarks/results/);
# 2. ncu (clocks left alone) of the M = 1 and M = 128 winners of the 28672 x 4096 shape;
# 3. the GPU tests of the family.
# The short table of step 1 is printed last.
set -u
O=${OUT:-/tmp/h200_out}
mkdir -p "$O"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$O/gpu.txt"
timeout 260 python3 -m benchmarks.quant_gemm --out "$O/h200_quant.json" \
    --table "$O/h200_w4a16_table.json" > "$O/quant_gemm.log" 2>&1
echo "quant_gemm exit $?"
grep -E "compiled|failed|FAILED|Error|copy:" "$O/quant_gemm.log" | head -20
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 70 "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --print-details all --kernel-name regex:w4a16 --launch-count 2 \
    python3 -m benchmarks.quant_gemm_profile --table "$O/h200_w4a16_table.json" \
    > "$O/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "^M=|w4a16_|DRAM Throughput|Memory Throughput|Compute \(SM\) T|Duration|Warp Cycles Per Issued|Tensor|ERROR" \
    "$O/ncu.txt" | head -30
grep -iE "stall" "$O/ncu.txt" | grep -E "[0-9]" | sort -t' ' -k2 | head -30
timeout 55 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16.py \
    -k "dispatch or fp16-g32-act" > "$O/gpu_tests.txt" 2>&1
echo "gpu tests exit $?"; tail -3 "$O/gpu_tests.txt"
grep -E "^N=" "$O/quant_gemm.log" | cut -c1-150
sed -n '/^   M  w4a16/,$p' "$O/quant_gemm.log"
