#!/bin/bash
# The H200 runs that code on main waits for, in priority order. The stages of issues 16-22 ran
# at bae7d40 (records in benchmarks/results/); what changed after that run, unmeasured, is here.
# Run from the repository root on the device, where the serve extra's packages (fastapi,
# uvicorn, pydantic, outlines-core, llguidance, jsonschema, gguf; cp312 wheels) are installed
# first, outlines-core and llguidance into the interpreter itself (the grammar compile child
# runs `python -I`):
#
#   LORAPLEX_BENCH_COMMIT=<commit> bash benchmarks/h200_pending.sh <stage> [<stage> ...]
#
# Stages and their wall time on the H200 (the device's 10-minute limit per call fits 2-3 of them):
#   grammar   ~2 min   issue 16: cold TTFT with the bitmask kernel compiled at start-up (the
#                      first schema waited 1-2 s for it), greedy / t1 / mixed by turns
#   lora_kernels ~5 min issue 36: every LoRA kernel regime per layer against the reference,
#                      the base GEMMs and the byte floor (pick the defaults of LoRAKernelConfig)
#   lora      ~6 min   issue 36: multi_lora 8, 64 and 256-on-64 adapters and the LoRA engine with
#                      no adapter, bf16 base (greedy, t1, mixed)
#   lora_awq  ~3.5 min issue 36: the same 8 / 64 / no-adapter figures on the AWQ base (awq_)
#   quant     ~6 min   issue 18: quant_e2e with the sweep's winners now in TUNED_CONFIGS (no
#                      table file), FP8 beside AWQ (greedy, t1, mixed)
#   serving   ~6 min   issue 19: the server with two API processes at concurrency 1, 64 and
#                      256 (one stream's TPOT was not in the bae7d40 run)
#   forms     ~1 min   issue 21: every adapter form on CUDA graphs equals PEFT (passed at bae7d40)
#   spec      ~3 min   issue 22: graphed verification (ran at bae7d40)
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
    timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/grammar/test_bitmask.py \
        2>&1 | tail -5 | tee "$O/grammar_tests.txt"
    timeout 150 python -m benchmarks.grammar_cold_ttft --tokenizer-dir .bench_tokenizer \
        --settings on --no-warm --max-tokens 16 2>&1 | tee "$O/grammar_cold_ttft.log" | tail -30
}

lora() {
    # 257 random rank-16 adapters of ~84 MB are written to the adapter dir (~21.6 GB, ~40 s)
    timeout 400 python -m benchmarks.multi_lora --adapters 8,64,256 --num-prompts 128 \
        --no-registration --adapter-dir /tmp/ml_adapters --out "$O/h200_multi_lora.json" 2>&1 \
        | tee "$O/multi_lora.log" | tail -25
    rm -rf /tmp/ml_adapters
}

lora_awq() {
    timeout 330 python -m benchmarks.multi_lora --base awq --adapters 8,64 --num-prompts 128 \
        --no-registration --adapter-dir /tmp/ml_adapters --out "$O/h200_multi_lora_awq.json" \
        2>&1 | tee "$O/multi_lora_awq.log" | tail -25
    rm -rf /tmp/ml_adapters
}

lora_kernels() {
    # needs no wheels: the kernel family, torch and Triton only
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_lora.py 2>&1 \
        | tail -3 | tee "$O/lora_kernel_tests.txt"
    timeout 300 python -m benchmarks.lora_kernels --budget-s 210 --out "$O/h200_lora_kernels.json" \
        2>&1 | tee "$O/lora_kernels.log" | cut -c1-1000 | grep -v '^ \|^{\|^}'
}

quant() {
    timeout 420 python -m benchmarks.quant_e2e --fp8 2>&1 | tee "$O/quant_e2e.log" | tail -60
}

serving() {
    timeout 450 python -m benchmarks.serving --gpu-record --num-prompts 512 --input-len 256 \
        --output-len 256 --concurrency 1 64 256 --api-server-count 2 \
        --out h200_serving_api2.json 2>&1 | tee "$O/serving.log" \
        | grep -E "^server |^offline |wrote|Error|Traceback"
}

if [ $# -eq 0 ]; then
    sed -n '2,26p' "$0"
    exit 2
fi
for stage in "$@"; do
    case $stage in
        forms | spec | grammar | lora_kernels | lora | lora_awq | quant | serving)
            echo "=== $stage $(date -u +%T)"
            $stage
            ;;
        *)
            echo "unknown stage: $stage" >&2
            exit 2
            ;;
    esac
done
