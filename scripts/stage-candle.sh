#!/usr/bin/env bash
# Builds the GPU tests of sdpa-candle and of its call-site crate (the `cuda` feature, outside
# `cargo test --workspace`) here and packs their executables into .gpu/candle.txz (xz: each
# carries the CUDA core; about 62 MB, so carry it alone), beside what ../shared/gpu/stage packs,
# so that scripts/gpu-check.sh runs them on the GPU machine (its `candle` step). Run after stage
# (which empties .gpu/). candle's CUDA backend needs a toolkit: scripts/candle-cuda-env.sh makes one.
#
#   bash scripts/stage-candle.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .gpu/candle && mkdir -p .gpu/candle
bash scripts/candle-cuda-env.sh cargo test -p sdpa-candle -p sdpa-candle-callsites \
  --features sdpa-candle/cuda,sdpa-candle-callsites/cuda --release --no-run \
  --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' | while read -r exe; do
  cp "$exe" .gpu/candle/
  strip --strip-debug ".gpu/candle/$(basename "$exe")"
done
ls .gpu/candle | grep -q . || { echo "stage-candle: no test executables built" >&2; exit 1; }
tar -C .gpu/candle -cf - . | xz -T0 -6 > .gpu/candle.txz
rm -rf .gpu/candle
ls -la .gpu/candle.txz
