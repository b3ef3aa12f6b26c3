#!/usr/bin/env bash
# The whole GPU check in one command on the GPU machine (after ../shared/gpu/stage here, with
# .gpu/ carried): tests with SDPA_REQUIRE_GPU=1, `sdpa info`, `sdpa validate`,
# compute-sanitizer, `sdpa bench` next to the PyTorch anchors of the same run, and the
# criterion benches on the small problems. Everything lands in $1 (default $OUT); the tail of
# the output is a short summary.
#
#   bash scripts/gpu-check.sh $OUT            # all steps
#   STEPS="tests bench" bash scripts/gpu-check.sh $OUT
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
steps=${STEPS:-"tests info validate sanitize bench criterion"}
export SDPA_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
run=".gpu/run"
summary=()
has() { [[ " $steps " == *" $1 "* ]]; }
note() { summary+=("$1"); }

if has tests; then
  timeout 300 bash $run all > "$out/tests.log" 2>&1; rc=$?
  note "tests: rc=$rc, $(grep -c '^test .* ok$' "$out/tests.log") ok, $(grep -cE '^test .* FAILED$' "$out/tests.log") failed"
fi
bin=/tmp/gpu-bundle/bin/sdpa  # unpacked by the first .gpu/run call
has info && { bash $run bin sdpa info > "$out/info.txt" 2>&1; note "info: rc=$?"; }
if has validate; then
  timeout 300 bash $run bin sdpa validate > "$out/validate.txt" 2>&1; rc=$?
  note "validate: rc=$rc, $(tail -1 "$out/validate.txt")"
fi
if has sanitize; then
  [ -x $bin ] || bash $run bin sdpa --version > /dev/null
  timeout 400 bash scripts/sanitize.sh $bin > "$out/sanitize.txt" 2>&1; rc=$?
  note "sanitize: rc=$rc ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitize.txt") clean tool runs)"
fi
if has bench; then
  shapes=mission,mission-causal,s1k-d64,s2k-d128,s4k-d128-causal,s8k-d128,s16k-d128-causal
  timeout 300 bash $run bin sdpa bench --budget-ms 300 --json "$out/ours.json" > "$out/bench.txt" 2>&1
  note "bench: rc=$?, $(head -1 "$out/bench.txt")"
  timeout 200 bash $run anchor --shapes $shapes --json "$out/torch.json" > "$out/anchor.txt" 2>&1
  # torch's unfused "math" path, the comparison point for our cublas backend (small shapes:
  # it materializes the score matrix in f32 and is slow beyond them).
  timeout 200 bash $run anchor --shapes mission,mission-causal,s1k-d64,s2k-d128 --backends math \
    --json "$out/torch-math.json" > "$out/anchor-math.txt" 2>&1
  bash $run compare "$out/ours.json" "$out/torch.json" > "$out/compare.txt" 2>&1
  note "anchor: $(head -1 "$out/anchor.txt")"
fi
if has criterion; then
  timeout 300 bash $run benches 'mission' > "$out/criterion.txt" 2>&1
  note "criterion: rc=$?, $(grep -c 'time:' "$out/criterion.txt") benchmarks"
fi
printf '%s\n' "${summary[@]}"
