#!/usr/bin/env bash
# The whole GPU check in one command on the GPU machine (after ../shared/gpu/stage here, with
# .gpu/ carried): tests with SDPA_REQUIRE_GPU=1, `sdpa info`, `sdpa validate`,
# compute-sanitizer, `sdpa bench` next to the PyTorch anchors of the same run, and the
# criterion benches on the small problems. Everything lands in $1 (default $OUT); the tail of
# the output is a short summary.
#
#   bash scripts/gpu-check.sh $OUT            # all steps
#   STEPS="tests bench" bash scripts/gpu-check.sh $OUT
# The candle step runs what scripts/stage-candle.sh packed into .gpu/candle.txz (after the stage).
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
steps=${STEPS:-"tests candle info sass validate sanitize bench criterion"}
export SDPA_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
run=".gpu/run"
summary=()
has() { [[ " $steps " == *" $1 "* ]]; }
note() { summary+=("$1"); }

if has tests; then
  timeout 300 bash $run all > "$out/tests.log" 2>&1; rc=$?
  note "tests: rc=$rc, $(grep -c '^test .* ok$' "$out/tests.log") ok, $(grep -cE '^test .* FAILED$' "$out/tests.log") failed"
fi
if has candle; then
  # sdpa-candle's GPU tests (the `cuda` feature), staged by scripts/stage-candle.sh: a missing
  # stage fails the step rather than skipping it.
  rc=0; n=0
  mkdir -p /tmp/gpu-candle
  [ -f .gpu/candle.txz ] && xz -dc .gpu/candle.txz | tar -C /tmp/gpu-candle -xf -
  for t in /tmp/gpu-candle/*; do
    [ -x "$t" ] || continue
    n=$((n + 1))
    LD_LIBRARY_PATH=/usr/local/cuda-13.0/lib64:${LD_LIBRARY_PATH:-} timeout 300 "$t" \
      >> "$out/candle.log" 2>&1 || rc=1
  done
  [ $n -gt 0 ] || { echo "no candle tests staged (bash scripts/stage-candle.sh)" > "$out/candle.log"; rc=1; }
  note "candle: rc=$rc, $n test executables, $(grep -c '^test .* ok$' "$out/candle.log") ok, $(grep -cE '^test .* FAILED$' "$out/candle.log") failed"
fi
bin=/tmp/gpu-bundle/bin/sdpa  # unpacked by the first .gpu/run call
has info && { bash $run bin sdpa info > "$out/info.txt" 2>&1; note "info: rc=$?"; }
if has sass; then
  # Tensor-core instructions per kernel in the SASS (HGMMA = wgmma f16/bf16 and fp8 on sm_90a,
  # HMMA = mma.sync): proof that each backend runs on the instructions it claims.
  [ -x $bin ] || bash $run bin sdpa --version > /dev/null
  od=$(command -v cuobjdump || echo /usr/local/cuda-13.0/bin/cuobjdump)
  "$od" -sass "$bin" 2>/dev/null | awk '/Function :/ {f=$3} /HGMMA|HMMA|QGMMA/ {for (i=1;i<=NF;i++) if ($i ~ /^(HGMMA|HMMA|QGMMA)/) {split($i,a,"."); c[f" "a[1]]++}} END {for (k in c) print c[k], k}' \
    | sort -k2 > "$out/sass.txt"
  note "sass: $(wc -l < "$out/sass.txt") (kernel, instruction) pairs; $(grep -c HGMMA "$out/sass.txt") with HGMMA"
fi
if has validate; then
  timeout 300 bash $run bin sdpa validate > "$out/validate.txt" 2>&1; rc=$?
  note "validate: rc=$rc, $(tail -1 "$out/validate.txt")"
  # e4m3 inputs: per-head scales to f16, per-tensor scales to bf16 (each backend's fp8 path).
  timeout 200 bash $run bin sdpa validate --dtype e4m3 --problem mission,s1k-d64 \
    > "$out/validate-fp8.txt" 2>&1; rc=$?
  timeout 200 bash $run bin sdpa validate --dtype e4m3 --scaling tensor --out-dtype bf16 \
    --shape 1,4,77,130,128 --kv-heads 2 >> "$out/validate-fp8.txt" 2>&1; rc2=$?
  note "validate e4m3: rc=$rc/$rc2, $(grep -c ' pass' "$out/validate-fp8.txt") pass, $(grep -c FAIL "$out/validate-fp8.txt") FAIL"
fi
if has sanitize; then
  [ -x $bin ] || bash $run bin sdpa --version > /dev/null
  timeout 500 bash scripts/sanitize.sh $bin "$(ls /tmp/gpu-bundle/tests/concurrency-* | head -1)" \
    "$(ls /tmp/gpu-bundle/tests/seqs-* | head -1)" > "$out/sanitize.txt" 2>&1; rc=$?
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
  # e4m3 inputs next to the f16 rows above (native kernel where built, else simulated).
  timeout 200 bash $run bin sdpa bench --budget-ms 300 --dtype e4m3 \
    --problem mission,s2k-d128,s8k-d128,s16k-d128-causal --backend cutlass,cutlass-sm80,wmma \
    --json "$out/fp8.json" > "$out/bench-fp8.txt" 2>&1
  note "bench e4m3: rc=$?"
  note "anchor: $(head -1 "$out/anchor.txt")"
fi
if has criterion; then
  timeout 300 bash $run benches 'mission' > "$out/criterion.txt" 2>&1
  note "criterion: rc=$?, $(grep -c 'time:' "$out/criterion.txt") benchmarks"
fi
printf '%s\n' "${summary[@]}"
