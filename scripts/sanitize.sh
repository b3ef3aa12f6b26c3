#!/usr/bin/env bash
# Runs compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every GPU backend on
# a small problem and odd-sized ones (seq 77, seq_q != seq_k, causal and not, GQA; 150 x 300 at
# D = 64 takes cutlass's small-problem kernel, three key slices a cluster) and fails on any
# report. Needs a GPU and compute-sanitizer (the GPU machine has both).
#
#   scripts/sanitize.sh [path/to/sdpa [path/to/concurrency-test [path/to/seqs-test]]]
#                                                     # default: target/release/sdpa
# SANITIZE_TOOLS and SANITIZE_BACKENDS (space-separated) narrow the run, e.g. to the backends a
# change touched: SANITIZE_TOOLS="memcheck racecheck" SANITIZE_BACKENDS="cutlass-sm80".
# On the GPU machine with .gpu/ carried:  bash .gpu/run bin sdpa info >/dev/null;
#   bash scripts/sanitize.sh /tmp/gpu-bundle/bin/sdpa /tmp/gpu-bundle/tests/concurrency-*
# With the concurrency test executable given, its cross-stream test (tensors made and freed on
# one stream, used on another) runs under memcheck too; with the seqs test executable, its
# lying-metadata tests (unchecked block tables, lengths and offsets that lie, in attention and
# in append_kv), which must touch nothing outside the call's buffers.
set -uo pipefail
sdpa=${1:-target/release/sdpa}
concurrency=${2:-}
seqs=${3:-}
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$cs" ] || { echo "sanitize: compute-sanitizer not found" >&2; exit 2; }
args=(validate --dtype f16,bf16 --causal both --seed 7
      --shape 1,2,64,64,64 --shape 1,2,77,77,64 --shape 1,4,77,130,128 --shape 1,2,150,300,64)
tools=${SANITIZE_TOOLS:-"memcheck racecheck synccheck initcheck"}
backends=${SANITIZE_BACKENDS:-"scalar wmma cublas cutlass cutlass-sm80"}
has_backend() { [[ " $backends " == *" $1 "* ]]; }
rc=0
for tool in $tools; do
  for backend in $backends; do
    echo "== $tool $backend"
    log=/tmp/sanitize-$tool-$backend.log
    if "$cs" --tool "$tool" --error-exitcode 99 --print-limit 10 "$sdpa" "${args[@]}" \
        --backend "$backend" > "$log" 2>&1; then
      grep -E "ERROR SUMMARY|checks passed" "$log" | tail -2
    else
      echo "sanitize: $tool on $backend reported problems (or the run failed); first reports:"
      grep -v "Host Frame" "$log" | grep -m3 -A8 -E "^========= [A-Z]" ; tail -3 "$log"; rc=1
    fi
  done
done
# Head dims only some backends have (crates/sdpa-sys/cpp/kernels.txt): cutlass-sm80 at 96.
if has_backend cutlass-sm80; then
  for tool in $tools; do
    echo "== $tool cutlass-sm80 (head_dim 96)"
    "$cs" --tool "$tool" --error-exitcode 99 --print-limit 10 "$sdpa" validate --backend cutlass-sm80 \
      --dtype f16,bf16 --causal both --seed 10 --shape 1,2,77,77,96 --shape 1,4,77,130,96 \
      --shape 1,2,150,300,96 > /tmp/sanitize-$tool-d96.log 2>&1 \
      && grep -E "ERROR SUMMARY|checks passed" /tmp/sanitize-$tool-d96.log | tail -2 \
      || { echo "sanitize: $tool on cutlass-sm80 d96 failed"; grep -v "Host Frame" /tmp/sanitize-$tool-d96.log \
           | grep -m3 -A8 -E "^========= [A-Z]"; tail -5 /tmp/sanitize-$tool-d96.log; rc=1; }
  done
fi
# GQA through the same path (kv_heads 1 of 4).
echo "== memcheck (GQA)"
"$cs" --tool memcheck --error-exitcode 99 "$sdpa" validate --backend "$(echo $backends | tr ' ' ,)" \
  --dtype f16 --causal both --seed 8 --shape 2,4,77,77,128 --kv-heads 1 > /tmp/sanitize-gqa.log 2>&1 \
  && grep -E "ERROR SUMMARY|checks passed" /tmp/sanitize-gqa.log | tail -2 \
  || { echo "sanitize: GQA memcheck failed"; tail -40 /tmp/sanitize-gqa.log; rc=1; }
# e4m3 inputs: the native kernel (cutlass, with its f16 V pre-pass) and one simulated path.
for tool in $tools; do
  has_backend cutlass || has_backend cutlass-sm80 || break
  echo "== $tool (e4m3)"
  "$cs" --tool "$tool" --error-exitcode 99 "$sdpa" validate --backend cutlass,cutlass-sm80 \
    --dtype e4m3 --causal both --seed 9 --shape 1,2,77,77,64 --shape 1,4,77,130,128 --kv-heads 2 \
    > /tmp/sanitize-fp8-$tool.log 2>&1 \
    && grep -E "ERROR SUMMARY|checks passed" /tmp/sanitize-fp8-$tool.log | tail -2 \
    || { echo "sanitize: $tool on e4m3 failed"; grep -v "Host Frame" /tmp/sanitize-fp8-$tool.log \
         | grep -m3 -A8 -E "^========= [A-Z]"; tail -5 /tmp/sanitize-fp8-$tool.log; rc=1; }
done
# The variants (a band, softcap, ALiBi, the log-sum-exp) and head dims 192 and 256 (at 256 cutlass
# stages its output in Q's buffer, cutlass-sm80 runs two K/V stages).
for backend in scalar cutlass cutlass-sm80; do
  has_backend $backend || continue
  for tool in $tools; do
    echo "== $tool $backend (variants)"
    "$cs" --tool "$tool" --error-exitcode 99 --print-limit 10 "$sdpa" validate --backend $backend \
      --dtype f16,bf16 --seed 11 --window 150,20 --softcap 20 --alibi head --lse \
      --shape 1,2,77,300,64 --shape 1,2,200,130,128 --shape 1,2,150,200,192 --shape 1,2,130,260,256 \
      > /tmp/sanitize-$tool-$backend-variants.log 2>&1 \
      && grep -E "ERROR SUMMARY|checks passed" /tmp/sanitize-$tool-$backend-variants.log | tail -2 \
      || { echo "sanitize: $tool on $backend variants failed"; \
           grep -v "Host Frame" /tmp/sanitize-$tool-$backend-variants.log \
           | grep -m3 -A8 -E "^========= [A-Z]"; tail -5 /tmp/sanitize-$tool-$backend-variants.log; rc=1; }
    echo "== $tool $backend (head dims 192, 256)"
    "$cs" --tool "$tool" --error-exitcode 99 --print-limit 10 "$sdpa" validate --backend $backend \
      --dtype bf16 --causal both --seed 12 --shape 2,2,150,300,192 --shape 1,2,200,130,256 \
      > /tmp/sanitize-$tool-$backend-dims.log 2>&1 \
      && grep -E "ERROR SUMMARY|checks passed" /tmp/sanitize-$tool-$backend-dims.log | tail -2 \
      || { echo "sanitize: $tool on $backend head dims failed"; \
           grep -v "Host Frame" /tmp/sanitize-$tool-$backend-dims.log \
           | grep -m3 -A8 -E "^========= [A-Z]"; tail -5 /tmp/sanitize-$tool-$backend-dims.log; rc=1; }
  done
done
if [ -n "$concurrency" ]; then
  # memcheck only: a kernel running before an upload finished or after a free is a global memory
  # error; racecheck looks at shared memory within one kernel, which the per-backend runs above
  # already cover (here it only adds cuBLAS's own GEMM kernels, docs/log/).
  echo "== memcheck (tensors across streams)"
  SDPA_REQUIRE_GPU=1 "$cs" --tool memcheck --error-exitcode 99 "$concurrency" \
    tensors_used_across_streams_stay_ordered > /tmp/sanitize-streams.log 2>&1 \
    && grep -E "ERROR SUMMARY|test result" /tmp/sanitize-streams.log | tail -2 \
    || { echo "sanitize: memcheck on the cross-stream test failed"; tail -30 /tmp/sanitize-streams.log; rc=1; }
fi
if [ -n "$seqs" ]; then
  echo "== memcheck (metadata that lies)"
  SDPA_REQUIRE_GPU=1 "$cs" --tool memcheck --error-exitcode 99 "$seqs" lying \
    > /tmp/sanitize-lying.log 2>&1 \
    && grep -E "ERROR SUMMARY|test result" /tmp/sanitize-lying.log | tail -2 \
    || { echo "sanitize: memcheck on the lying-metadata tests failed"; tail -30 /tmp/sanitize-lying.log; rc=1; }
fi
exit $rc
