#!/bin/bash
# The H200 runs of issues 16-22, in priority order (built in a session lent no GPU; all ran at
# bae7d40, records in benchmarks/results/). Run from the repository root
# on the device, where the serve extra's packages (fastapi, uvicorn, pydantic, outlines-core,
# llguidance, jsonschema, gguf; cp312 wheels) are installed first, outlines-core and llguidance
# into the interpreter itself (the grammar compile child runs `python -I`):
#
#   LORAPLEX_BENCH_COMMIT=<commit> bash benchmarks/h200_pending.sh <stage> [<stage> ...]
#
# Stages and their wall time on the H200 (the device's 10-minute limit per call fits 2-3 of them):
#   forms     ~1 min   issue 21: every adapter form (DoRA, vocab LoRA, module copies, trained
#                      token rows) on CUDA graphs equals PEFT
#   spec      ~3 min   issue 22: graphed verification equals eager; verify forward eager vs
#                      graphed; n-gram / oracle speculation end to end (greedy, t1, mixed)
#   grammar   ~3.5 min issue 16: JSON-schema throughput beside unconstrained (greedy, t1,
#                      mixed) and cold TTFT of never-seen schemas
#   lora      ~5.5 min issue 17: LoRA kernel GPU tests, fused vs shrink+expand per projection,
#                      multi_lora 64 and 256-on-64 adapters (greedy, t1, mixed)
#   quant     ~7 min   issue 18: stream kernels' GPU tests, W4A16 decode sweep writing a
#                      selection table, quant_e2e dispatching from it (greedy, t1, mixed)
#   serving   ~5 min   issue 19: the HTTP server against the engine at c64 / c256 with two API
#                      processes, the core shipping token ids (greedy, t1, mixed)
# Records land in benchmarks/results/; logs and tables under $OUT (default /tmp/h200_out).
set -u
O=${OUT:-/tmp/h200_out}
mkdir -p "$O"

forms() {
    timeout 300 python -m pytest -q -p no:cacheprovider -m gpu -rA \
        tests/adapters/test_adapter_forms.py::test_every_form_on_cuda_graphs_equals_peft \
        2>&1 | tail -60 | tee "$O/gpu_forms.txt"
}

spec() {
    timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention.py \
        -k "verification_layout_on_gpu or graph_capture" 2>&1 | tail -5 | tee "$O/spec_tests.txt"
    timeout 360 python -m benchmarks.spec_graphs --out h200_spec_graphs.json 2>&1 \
        | tee "$O/spec_graphs.log" | tail -60
}

grammar() {
    timeout 240 python -m benchmarks.grammar_throughput --tokenizer-dir .bench_tokenizer \
        --repeats 2 2>&1 | tee "$O/grammar_throughput.log" | tail -30
    timeout 150 python -m benchmarks.grammar_cold_ttft --tokenizer-dir .bench_tokenizer \
        --settings on --no-warm --max-tokens 16 2>&1 | tee "$O/grammar_cold_ttft.log" | tail -30
}

lora() {
    timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_lora.py \
        tests/adapters/test_manager.py 2>&1 | tail -15 | tee "$O/lora_tests.txt"
    timeout 150 python -m benchmarks.lora_fused --out h200_lora_fused.json 2>&1 \
        | tee "$O/lora_fused.log" | tail -12
    # 257 random rank-16 adapters of ~84 MB are written to the adapter dir (~21.6 GB, ~40 s)
    timeout 300 python -m benchmarks.multi_lora --adapters 64,256 --num-prompts 128 \
        --adapter-dir /tmp/ml17_adapters 2>&1 | tee "$O/multi_lora.log" | tail -25
    rm -rf /tmp/ml17_adapters
}

quant() {
    timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_quant_gemm.py \
        -k "small_m_kernels and stream" 2>&1 | tail -25 | tee "$O/quant_tests.txt"
    timeout 270 python -m benchmarks.quant_gemm --sweep-w4a16 --tokens 1,4,16,64 --rep-ms 10 \
        --table "$O/w4a16_table.json" --out "$O/h200_quant_decode.json" 2>&1 \
        | tee "$O/quant_sweep.log" | grep -v "^    " | tail -45
    LORAPLEX_QUANT_GEMM_TABLE="$O/w4a16_table.json" timeout 330 python -m benchmarks.quant_e2e \
        --out h200_quant_e2e_stream.json 2>&1 | tee "$O/quant_e2e.log" | tail -60
}

serving() {
    timeout 450 python -m benchmarks.serving --gpu-record --num-prompts 512 --input-len 256 \
        --output-len 256 --concurrency 64 256 --api-server-count 2 \
        --out h200_serving_api2.json 2>&1 | tee "$O/serving.log" \
        | grep -E "^server |^offline |wrote|Error|Traceback"
}

if [ $# -eq 0 ]; then
    sed -n '2,22p' "$0"
    exit 2
fi
for stage in "$@"; do
    case $stage in
        forms | spec | grammar | lora | quant | serving)
            echo "=== $stage $(date -u +%T)"
            $stage
            ;;
        *)
            echo "unknown stage: $stage" >&2
            exit 2
            ;;
    esac
done
