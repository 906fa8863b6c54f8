#!/usr/bin/env bash
# Tensor parallelism on a two-GPU host, in one go (issue 13), from the repository root:
#   bash benchmarks/run_tp_gpu.sh OUT MODEL_DIR CODEBOOKS [SCRATCH]
# OUT: results (small files). MODEL_DIR: evalmodel; CODEBOOKS: its 2-bit codebook file.
# SCRATCH: where the random-weight checkpoints go (default /tmp/vecinfer-tp: 16 GB for the 8B
# geometry, 18 GB for 70B with 8 layers); a checkpoint already there is reused.
# Steps, in this order (STEPS picks a subset, e.g. STEPS="tp1-70b tp2-70b" for a second call):
#   equal    greedy tokens of examples/tensor_parallel.py on evalmodel, nproc 2 (NCCL) vs nproc 1,
#            CUDA, float32, R=16 so decode reads codes -> OUT/equal.txt: EQUAL or DIFFER (and where);
#            float32 because in bf16 the first decode step of this prompt is a near-tie (364 vs 323:
#            10.721 vs 10.697 in float32, one bf16 ulp at that size is 0.0625)
#            (the 8B checkpoint is written on GPU 1 meanwhile)
#   tp1-8b   bench_generate.py under torchrun --nproc-per-node 1 (TP=1), methods ours and fp16, N=16
#            new tokens, 8B geometry: B=1/T=131072 on GPU 0 while B=16/T=32768 runs on GPU 1 (one
#            process per method there: the full-precision cache needs the whole GPU)
#   tp2-8b   the same under --nproc-per-node 2 (TP=2, NCCL), both cases in one process
#   tp1-70b, tp2-70b   the same on the 70B geometry with 8 layers (checkpoint written first), each
#            only when at least 240 s are left
# -> OUT/tp{1,2}_{8b,70b}*.json (rows), OUT/*.txt (tables, logs). Every step is time-boxed so the
# whole run ends within BUDGET seconds (default 520); a step that no longer fits is skipped with a
# note. At the end, one table of every bench row in OUT, TP=2 against TP=1.
# Estimated on two H200s: equal ~1.5 min, tp1-8b ~3 min, tp2-8b ~4.5 min; the 70B steps then
# wait for a second call. SMOKE=1 BUDGET=900: the same steps on the CPU (gloo) with tiny models
# and cases (~6 min on 2 cores): checks the flow and the flags, not speed.
set -u
OUT=${1:?OUT}; M=${2:?MODEL_DIR}; CB=${3:?CODEBOOKS}; S=${4:-/tmp/vecinfer-tp}
mkdir -p "$OUT" "$S"
export PYTHONPATH=${PYTHONPATH:-}:$(pwd) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
T0=$(date +%s); BUDGET=${BUDGET:-520}
left() { echo $((BUDGET - $(date +%s) + T0)); }
sec() { echo; echo "=== $* (t=$(( $(date +%s) - T0 )) s, $(date +%T))"; }
# box CAP CMD...: CMD under `timeout`, at most CAP s and never past the budget (skipped under 30 s)
box() {
    local cap=$1 t rc; shift
    t=$(( $(left) - 5 )); [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 30 ]; then echo "skipped, $(left) s left: $*"; return 124; fi
    timeout -k 10 "$t" "$@"; rc=$?
    [ $rc -eq 124 ] && echo "timed out after $t s: $*"
    return $rc
}
if [ "${SMOKE:-0}" = 1 ]; then X=--smoke DEV=cpu LONG=1x24 WIDE=2x16; else X="" DEV=cuda LONG=1x131072 WIDE=16x32768; fi
TR="python -m torch.distributed.run --standalone"
BENCH="benchmarks/bench_generate.py $X"
RUN="--methods ours,fp16 --new-tokens 16"
ROW='^\| [0-9]+ \|.*\| [0-9]+ \|$'  # a bench row (its last column is the TP size), not its summary

equal() {
    sec "equal: evalmodel greedy tokens, nproc 1 (GPU 0) and nproc 2 (GPUs 0,1, NCCL); 8B checkpoint on GPU 1"
    [ -f "$S/8b/config.json" ] || box 200 env CUDA_VISIBLE_DEVICES=1 python $BENCH --save-model "$S/8b" &
    for n in 1 2; do
        gpus=0; [ $n = 2 ] && gpus=0,1
        box 240 env CUDA_VISIBLE_DEVICES=$gpus $TR --nproc-per-node $n examples/tensor_parallel.py --model "$M" \
            --codebooks "$CB" --device $DEV --dtype float32 --residual 16 --max-new-tokens 64 --json \
            > "$OUT/equal_tp$n.json" 2> "$OUT/equal_tp$n.log" &
    done
    wait
    python - "$OUT" <<'PY' | tee "$OUT/equal.txt"
import json, sys
def report(n):
    lines = [l for l in open(f"{sys.argv[1]}/equal_tp{n}.json") if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None
one, two = report(1), report(2)
if one is None or two is None:
    sys.exit(f"no result from nproc {1 if one is None else 2}: see equal_tp*.log")
a, b = one["tokens"], two["tokens"]
first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
print("EQUAL" if a == b else f"DIFFER: first at new token {first} of {len(a)}")
print(f"nproc 1: {a}\nnproc 2: {b}\ndecode rewrites {one['decode_rewrites']} / {two['decode_rewrites']}; "
      f"KV bytes: 1 GPU {one['kv_bytes_total']:,}; 2 GPUs {two['kv_bytes_rank']:,} per GPU, {two['kv_bytes_total']:,} total")
PY
}

# checkpoint NAME: the random-weight model NAME (8b, 70b) in $S/NAME, written once
checkpoint() {
    [ -f "$S/$1/config.json" ] && return 0
    local geo=""; [ "$1" = 70b ] && geo="--geometry 70b --layers 8"
    sec "$1: writing the random-weight checkpoint"; box 200 python $BENCH --save-model "$S/$1" $geo
}

tp1() {
    checkpoint "$1"
    sec "$1: TP=1, BxT=$LONG on GPU 0 | $WIDE on GPU 1 (ours, then fp16, one process each)"
    box 300 env CUDA_VISIBLE_DEVICES=0 $TR --nproc-per-node 1 $BENCH --tp-model "$S/$1" $RUN --cases $LONG \
        --json "$OUT/tp1_$1_$LONG.json" > "$OUT/tp1_$1_$LONG.txt" 2>&1 &
    (for m in ours fp16; do
        box 150 env CUDA_VISIBLE_DEVICES=1 $TR --nproc-per-node 1 $BENCH --tp-model "$S/$1" $RUN --methods $m \
            --cases $WIDE --json "$OUT/tp1_$1_${WIDE}_$m.json"
    done) > "$OUT/tp1_$1_$WIDE.txt" 2>&1 &
    wait
    grep -hE "$ROW|^timed out|^skipped" "$OUT"/tp1_$1_*.txt
}

tp2() {
    checkpoint "$1"
    sec "$1: TP=2, BxT=$LONG then $WIDE (one process)"
    box 400 $TR --nproc-per-node 2 $BENCH --tp-model "$S/$1" $RUN --cases $LONG,$WIDE \
        --json "$OUT/tp2_$1.json" > "$OUT/tp2_$1.txt" 2>&1
    grep -hE "$ROW|^timed out|^skipped" "$OUT/tp2_$1.txt"
}

sec env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
python -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)"
for step in ${STEPS:-equal tp1-8b tp2-8b tp1-70b tp2-70b}; do
    case $step in
        equal) equal ;;
        tp1-8b) tp1 8b ;;
        tp2-8b) tp2 8b ;;
        tp1-70b|tp2-70b)
            if [ "$(left)" -ge 240 ]; then ${step%-70b} 70b
            else sec "$step skipped: $(left) s left (run it with STEPS=$step in another call)"; fi ;;
        *) echo "unknown step $step (equal, tp1-8b, tp2-8b, tp1-70b, tp2-70b)" ;;
    esac
done

sec "all rows; tok/s = B*(N-1)/(t(N)-t(1)); in-run from per-step stamps; x TP=1 = in-run tok/s over TP=1's"
python - "$OUT" <<'PY'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(f"{sys.argv[1]}/tp[12]_*.json")):
    model = os.path.basename(f).split("_")[1].removesuffix(".json")
    rows += [dict(r, model=model) for r in json.load(open(f))]
num = lambda x, f="{:.1f}": "n/a" if x is None else f.format(x)
def size(n):
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10), ("B", 0)):
        if n is not None and n >= 2**k:
            return f"{n / 2**k:.2f} {unit}"
    return "n/a"
key = lambda r: (r["model"], r["B"], r["T"], r["method"])
tp1 = {key(r): r for r in rows if r["tp"] == 1 and "error" not in r}
print("| model | B | T | method | TP | decode tok/s | in-run tok/s | x TP=1 | ms/step | prefill s | KV/GPU | KV total | peak/GPU |")
print("|---" * 13 + "|")
for r in sorted(rows, key=lambda r: (*key(r), r["tp"])):
    head = f"| {r['model']} | {r['B']} | {r['T']} | {r['method']} | {r['tp']} |"
    if "error" in r:
        print(f"{head} {r['error']} |" + " |" * 7)
        continue
    base = tp1.get(key(r), {}).get("in_run_tok_s")
    ratio = f"{r['in_run_tok_s'] / base:.2f}x" if base and r.get("in_run_tok_s") else "n/a"
    per_rank = r.get("kv_bytes_per_rank") or [None]
    print(f"{head} {num(r['tok_s'])} | {num(r.get('in_run_tok_s'))} | {ratio} | {num(r.get('step_ms'), '{:.2f}')} | "
          f"{r['time_1_s']:.2f} | {size(per_rank[0])} | {size(r.get('kv_bytes_total'))} | {size(r.get('peak_bytes'))} |")
PY
sec done
