#!/usr/bin/env bash
# Everything that needs the GPU, in one go (a GPU lease is short: batch it):
#   bash benchmarks/run_gpu_suite.sh OUT_DIR MODEL_DIR CALIB_TEXT EVAL_TEXT
# Writes OUT_DIR/log.txt (all output), decode.json, ablation.json, ablation.png,
# cuda_tests.txt and the 2 / 1.5-bit VecInfer codebooks; each step is time-boxed so that a slow
# step cannot eat the rest.
set -u
OUT=${1:?OUT_DIR}; M=${2:?MODEL_DIR}; C=${3:?CALIB_TEXT}; W=${4:?EVAL_TEXT}
mkdir -p "$OUT"; CB=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-}:$(pwd) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec > "$OUT/log.txt" 2>&1
sec() { echo; echo "=== $* ($(date +%T))"; }
sec env; nvidia-smi --query-gpu=name,driver_version --format=csv
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
sec cuda tests
timeout 300 python -m pytest -q -m cuda -p no:cacheprovider tests > "$OUT/cuda_tests.txt" 2>&1; tail -5 "$OUT/cuda_tests.txt"
sec decode attention; timeout 150 python benchmarks/bench_decode_attention.py --json "$OUT/decode.json"
sec simulate attention; timeout 90 python benchmarks/bench_simulate_attention.py
sec memory; timeout 120 python benchmarks/bench_memory.py
sec ablation
timeout 240 python -m vecinfer_compile ablation --model "$M" --text "$W" --calib-text "$C" --windows 16 \
    --window-len 1024 --device cuda --out-codebooks "$CB" --out "$OUT/ablation.json" --plot "$OUT/ablation.png" --no-progress
cp "$CB"/vecinfer-2bit.safetensors "$CB"/vecinfer-1.5bit.safetensors "$OUT"/
sec perplexity, eager vs compile
for b in 2 1.5; do for be in eager compile; do
    timeout 120 python -m vecinfer_compile eval-ppl --model "$M" --text "$W" --method vecinfer --bits $b \
        --codebooks "$CB/vecinfer-${b}bit.safetensors" --windows 16 --window-len 1024 --device cuda --backend $be --json --no-progress
done; done
sec generate; timeout 590 python benchmarks/bench_generate.py --cases 1x32768
sec done
