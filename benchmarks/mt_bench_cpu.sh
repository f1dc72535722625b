#!/usr/bin/env bash
# MT-Bench on the embedded default (SmolLM2-135M-Instruct), greedy, 256 new tokens per turn: MEDUSA vs plain
# decoding vs transformers generate. Writes benchmarks/results/mt_bench_<machine>.json and .png.
# All 80 questions take 65-95 minutes on a 2-core Xeon; `--per-category 3` (48 turns) 20-28 minutes. Extra
# arguments go to `medusa bench` (later ones win), e.g. a smoke run:
#   OUT=benchmarks/results/smoke_cpu benchmarks/mt_bench_cpu.sh --limit 2 --max-new-tokens 32
# --engine compiled runs MEDUSA and plain decoding through torch.compile (a few minutes of compiling first).
# On a shared, busy CPU add --threads 1 (torch's default, one per core, spin-waits against other processes).
# Default heads: the shipped hydra heads (MODEL_CARD.md); other heads: --heads DIR, or beside them: --rival.
set -euo pipefail
cd "$(dirname "$0")/.."
MACHINE="${MACHINE:-$(hostname -s)}"
OUT="${OUT:-benchmarks/results/mt_bench_${MACHINE}}"
.venv/bin/medusa bench --questions ../shared/data/mt_bench_question.jsonl \
    --temperature 0 --max-new-tokens 256 --json "$OUT.json" --plot "$OUT.png" "$@"
