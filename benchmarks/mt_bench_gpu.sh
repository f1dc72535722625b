#!/usr/bin/env bash
# MT-Bench on a lent GPU (DEVELOPERS.md, "On a GPU"), greedy, 256 new tokens per turn, compiled engine (CUDA
# graphs), bfloat16: the shipped hydra heads with confident trees of 64 candidates (issue 21's GPU-sized budget),
# beside the same heads' static calibrated trees of 64 and 16 (static64, static16) and the MEDUSA heads' of 64
# (medusa64), plain decoding on the same engine and transformers generate. 16 turns (`--per-category 1`) take
# about 6 minutes on an H100, most of it generate's and compiling. Writes $OUT.json and $OUT.png; extra arguments
# go to `medusa bench` (later ones win), e.g. --sweep 4,8,16,32 --limit 4 for the static trees of other sizes,
# --dtype float32 for float32 (lossless on the H100's 8 turns: benchmarks/results/README.md; bfloat16's near-ties:
# benchmarks/bf16_lossless.py).
#   source /root/medusa-gpu/env.sh && QUESTIONS=<mt_bench_question.jsonl> benchmarks/mt_bench_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"  # the GPU machine's; our package runs from src/ there (no install, no network)
OUT="${OUT:-benchmarks/results/mt_bench_gpu}"
QUESTIONS="${QUESTIONS:-../shared/data/mt_bench_question.jsonl}"
ASSETS=src/medusa_decoding/assets
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
trees=$(mktemp -d)
"$PYTHON" - "$trees" <<'PY'
import json, sys
from medusa_decoding.calibrate import greedy_trees, read_accuracy
for kind in ("heads-hydra", "heads"):  # each heads' own greedy trees of 16 and 64 candidates from their calibration
    for tree in greedy_trees(read_accuracy(f"src/medusa_decoding/assets/{kind}").accuracy, [16, 64]):
        open(f"{sys.argv[1]}/{kind}{tree.num_nodes - 1}.json", "w").write(json.dumps([list(p) for p in tree.paths]))
PY
"$PYTHON" -c 'import sys; from medusa_decoding.cli import main; main(sys.argv[1:])' bench \
    --questions "$QUESTIONS" --per-category 1 --temperature 0 --max-new-tokens 256 --engine compiled \
    --heads $ASSETS/heads-hydra --tree confident:64 --rival "static64=@$trees/heads-hydra64.json" \
    --rival "static16=@$trees/heads-hydra16.json" --rival "medusa64=$ASSETS/heads@$trees/heads64.json" \
    --json "$OUT.json" --plot "$OUT.png" "$@"
