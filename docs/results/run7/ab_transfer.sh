#!/usr/bin/env bash
# Old (run 6, 80c5dc9, checked out at $OLD) and new `bench transfer`, interleaved, 3 rounds.
#   git worktree add /tmp/old7 80c5dc9 && OLD=/tmp/old7 bash docs/results/run7/ab_transfer.sh
# The old run starts in $OLD: `python -m` puts the working directory first on sys.path.
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=$PWD
OLD=${OLD:-/tmp/old7}
OUT=${OUT:-$REPO/docs/results/run7}
for round in 1 2 3; do
  (cd "$OLD" && PYTHONPATH=$OLD TORCH_EXTENSIONS_DIR=$OLD/.torch_ext python -m pdserve.bench \
    transfer --transports grpc,torch_dist,local --ttft-transports '' \
    --json "$OUT/ab_old_$round.json" > "$OUT/ab_old_$round.txt" 2>/dev/null)
  python -m pdserve.bench transfer --transports grpc,flight,torch_dist,local --ttft-transports '' \
    --json "$OUT/ab_new_$round.json" > "$OUT/ab_new_$round.txt" 2>/dev/null
done
