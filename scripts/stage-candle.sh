#!/usr/bin/env bash
# Builds the GPU tests of sdpa-candle and of its call-site crate (the `cuda` feature, outside
# `cargo test --workspace`) here and packs their executables into .gpu/candle.txz (xz: each
# carries the CUDA core; about 62 MB, so carry it alone), beside what ../shared/gpu/stage packs,
# so that scripts/gpu-check.sh runs them on the GPU machine (its `candle` step). Run after stage
# (which empties .gpu/). candle's CUDA backend needs a toolkit: scripts/candle-cuda-env.sh makes one.
#
#   bash scripts/stage-candle.sh                   # every test executable
#   bash scripts/stage-candle.sh forms cache       # only these (test target names)
#
# Every executable carries the CUDA core: more than five of them no longer fit one carry
# (64 MiB), so stage a subset for a call and the rest for the next.
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
    # The integration tests (tests/*.rs): the libraries hold no GPU test of their own.
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  cp "$exe" .gpu/candle/
  strip --strip-debug ".gpu/candle/$(basename "$exe")"
done
ls .gpu/candle | grep -q . || { echo "stage-candle: no test executables built" >&2; exit 1; }
tar -C .gpu/candle -cf - . | xz -T0 -6 > .gpu/candle.txz
rm -rf .gpu/candle
ls -la .gpu/candle.txz
