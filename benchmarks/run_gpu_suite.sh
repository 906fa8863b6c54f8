#!/usr/bin/env bash
# Everything that needs the GPU, in one go (a GPU lease is short: batch it):
#   bash benchmarks/run_gpu_suite.sh OUT_DIR MODEL_DIR CALIB_TEXT EVAL_TEXT [CODEBOOK_DIR]
# Five independent streams, spread over the GPUs (see STREAMS below):
#   tests     -> OUT/tests.txt     every `cuda`-marked test, in named groups (TEST_GROUPS below)
#   kernels   -> OUT/kernels.txt   decode attention, CUDA and Triton kernels vs FP16 (OUT/decode.json;
#                                  every preset at a few sizes); a chunk's attention over codes vs FP16
#                                  flash (OUT/prefill.json); simulate attention with launch-shape
#                                  sweeps; the decode gather-ceiling probe; encode vs compiled torch
#   memory    -> OUT/memory.txt    KV bytes and peak memory at 4k/32k/128k
#   generate  -> OUT/generate.txt  end-to-end generate() tokens/s (OUT/generate.json at B=1,
#                                  OUT/generate-wide.json at B=16; every method prefills in 4096-token chunks)
#   maxbatch  -> OUT/maxbatch.txt  the largest batch at T=32k, FP16 then ours (OUT/maxbatch-{fp16,ours}.json;
#                                  synthetic prefill: random cache content; not in the default STREAMS)
#   accuracy  -> OUT/accuracy.txt  eval-ppl eager vs compile at 2 and 1.5 bits; greedy tokens through
#                                  the cache (eager and compiled) vs the simulate path
# CODEBOOK_DIR holds vecinfer-2bit.safetensors and vecinfer-1.5bit.safetensors for MODEL_DIR;
# without it they are calibrated on CALIB_TEXT first. Every step is time-boxed.
set -u
OUT=${1:?OUT_DIR}; M=${2:?MODEL_DIR}; C=${3:?CALIB_TEXT}; W=${4:?EVAL_TEXT}; CB=${5:-}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$(pwd) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
sec() { echo; echo "=== $* ($(date +%T))"; }
V="python -m vecinfer_compile"

# The `cuda` tests in named groups, each measured under 5 minutes on an H200 (decode ~1 min before
# the trellis kernels' two files joined it,
# triton ~1.7, cache ~2.9, windowed ~3.3, chunk: the chunk attention over codes, hybrid: models
# that mix attention kinds, ~2.4 before its Gemma 4 check became four processes of ~40-60 s each,
# so give it TEST_TIMEOUT=480); TEST_GROUPS picks some, e.g. TEST_GROUPS="decode windowed".
declare -A TEST_GROUP=(
    [decode]="tests/test_ops_cuda_decode.py tests/test_ops_cuda_append.py tests/test_ops_cuda_weigh.py tests/test_weighted_codes.py tests/test_ops_cuda_trellis_decode.py tests/test_ops_cuda_viterbi.py tests/test_ops_cuda_trellis_append.py"
    [triton]="tests/test_ops_triton.py tests/test_trellis_codec.py"
    [cache]="tests/test_attention_over_codes.py tests/test_cache_compile.py tests/test_deferred_stop.py tests/test_qaware.py tests/test_needle.py tests/test_ops_library.py tests/test_benchmarks_smoke.py"
    [windowed]="tests/test_windowed.py"
    [chunk]="tests/test_chunk_attention.py tests/test_codec_conformance.py"
    [hybrid]="tests/test_hybrid_cache.py"
)

tests() {
    sec env; nvidia-smi --query-gpu=name,driver_version --format=csv
    python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
    for g in ${TEST_GROUPS:-decode triton cache windowed chunk hybrid}; do
        # SIGINT first: pytest then still prints the failures so far (a falsifying example included)
        sec cuda tests: $g; timeout -s INT -k 20 ${TEST_TIMEOUT:-300} python -m pytest -q -m cuda -p no:cacheprovider -rf --tb=short \
            --durations=5 ${TEST_GROUP[$g]:?unknown test group $g}
    done
}

kernels() {
    sec decode attention; timeout 230 python benchmarks/bench_decode_attention.py --bits 2 --json "$OUT/decode.json"
    sec decode attention, other presets; timeout 200 python benchmarks/bench_decode_attention.py --bits 4,3,1.5,1.25,1 \
        --batches 1,8 --lengths 4096,131072
    sec chunk attention over codes vs FP16 flash; timeout 300 python benchmarks/bench_prefill_attention.py \
        --json "$OUT/prefill.json"
    sec simulate attention; timeout 180 python benchmarks/bench_simulate_attention.py --sweep --profile
    sec decode ceiling probe; timeout 90 python benchmarks/bench_gather_ceiling.py
    sec encode; timeout 120 python benchmarks/bench_encode.py --sweep
    sec cache append; timeout 120 python benchmarks/bench_append.py --bits 2,1.5
}

memory() {
    sec memory; timeout 150 python benchmarks/bench_memory.py
}

generate() {
    sec generate, B=1; timeout ${GEN_TIMEOUT:-560} python benchmarks/bench_generate.py --isolate \
        --cases ${GEN_CASES:-1x131072,1x32768} --prefill-chunk 4096 --json "$OUT/generate.json"
    # in-run step times only: next to a 16-row prefill (~30-90 s) the t(N) - t(1) subtraction is noise
    sec generate, B=16; timeout ${GEN_WIDE_TIMEOUT:-560} python benchmarks/bench_generate.py --isolate --in-run-only \
        --cases ${GEN_WIDE_CASES:-16x32768} --prefill-chunk 4096 --json "$OUT/generate-wide.json"
}

maxbatch() {
    # one list of batch sizes per method, each (case, method) in its own process. The prompt is a
    # synthetic prefill (1024 real tokens, the rest random cache content): a real one of 32 rows
    # takes minutes. FP16's cache fills the GPU near 30 rows at 32k (28 fit on an H200, 30 did not);
    # ours fit 224 and not 232 (generate()'s eager first step reads codes, so the cache is the limit)
    local m cases
    for m in fp16 ours; do
        if [ $m = fp16 ]; then cases=${MAXBATCH_FP16_CASES:-24x32768,28x32768,30x32768}
        else cases=${MAXBATCH_OURS_CASES:-160x32768,200x32768,224x32768,232x32768}; fi
        sec largest batch at T=32k: $m; timeout ${MAXBATCH_TIMEOUT:-560} python benchmarks/bench_generate.py --isolate \
            --until-error --in-run-only --synthetic-prefill 1024 --prefill-chunk 128 --warmup-len 128 --methods $m \
            --new-tokens 8 --json "$OUT/maxbatch-$m.json" --cases $cases
    done
}

accuracy() {
    if [ -z "$CB" ]; then
        CB=$(mktemp -d)
        for b in 2 1.5; do
            sec calibrate $b; timeout 120 $V calibrate --model "$M" --text "$C" --bits $b --device cuda \
                --out "$CB/vecinfer-${b}bit.safetensors" --no-progress
        done
    fi
    sec perplexity, eager vs compile
    for b in 2 1.5; do for be in eager compile; do
        timeout 150 $V eval-ppl --model "$M" --text "$W" --method vecinfer --bits $b --codebooks "$CB/vecinfer-${b}bit.safetensors" \
            --windows 16 --window-len 1024 --device cuda --backend $be --json --no-progress
    done; done
    for be in eager compile; do
        sec greedy tokens, cache $be vs simulate
        timeout 150 $V match --model "$M" --codebooks "$CB/vecinfer-2bit.safetensors" --text "$W" --device cuda \
            --backend $be --no-progress
    done
}

# STREAMS picks a subset; with G GPUs, entry k runs on GPU k mod G, entries sharing a GPU in
# turn; "a+b" runs a then b on one GPU.
STREAMS=${STREAMS:-tests kernels+memory generate accuracy}
GPUS=$(nvidia-smi -L | wc -l)
for g in $(seq 0 $((GPUS - 1))); do
    (
        k=0
        for entry in $STREAMS; do
            if [ $((k % GPUS)) -eq "$g" ]; then
                for s in ${entry//+/ }; do CUDA_VISIBLE_DEVICES=$g $s > "$OUT/$s.txt" 2>&1; done
            fi
            k=$((k + 1))
        done
    ) &
done
wait
sec done
