#!/usr/bin/env bash
# Runs compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every GPU backend on
# a small problem and odd-sized ones (seq 77, seq_q != seq_k, causal and not, GQA; 150 x 300 at
# D = 64 takes cutlass's small-problem kernel, three key slices a cluster) and fails on any
# report. Needs a GPU and compute-sanitizer (the GPU machine has both).
#
#   scripts/sanitize.sh [path/to/sdpa [path/to/concurrency-test [path/to/seqs-test]]]
#                                                     # default: target/release/sdpa
# SANITIZE_TOOLS, SANITIZE_BACKENDS and SANITIZE_PARTS (forward, backward; space-separated) narrow
# the run, e.g. to the backends a change touched: SANITIZE_TOOLS="memcheck racecheck"
# SANITIZE_BACKENDS="cutlass-sm80" SANITIZE_PARTS=forward.
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
parts=${SANITIZE_PARTS:-"forward backward"}
has_backend() { [[ " $backends " == *" $1 "* ]]; }
has_part() { [[ " $parts " == *" $1 "* ]]; }
rc=0
# check TOOL NAME COMMAND...: COMMAND under TOOL, logged to /tmp/sanitize-NAME.log; prints its
# summary, or the first reports and rc=1.
check() {
  local tool=$1 name=$2 log=/tmp/sanitize-$2.log
  shift 2
  echo "== $tool $name"
  if "$cs" --tool "$tool" --error-exitcode 99 --print-limit 10 "$@" > "$log" 2>&1; then
    grep -E "ERROR SUMMARY|checks passed|test result" "$log" | tail -2
  else
    echo "sanitize: $tool on $name reported problems (or the run failed); first reports:"
    grep -v "Host Frame" "$log" | grep -m3 -A8 -E "^========= [A-Z]"; tail -5 "$log"; rc=1
  fi
}
if has_part forward; then
for tool in $tools; do
  for backend in $backends; do
    check "$tool" "$tool-$backend" "$sdpa" "${args[@]}" --backend "$backend"
  done
done
# Head dims only some backends have (crates/sdpa-sys/cpp/kernels.txt): cutlass-sm80 at 96.
if has_backend cutlass-sm80; then
  for tool in $tools; do
    check "$tool" "$tool-d96" "$sdpa" validate --backend cutlass-sm80 --dtype f16,bf16 \
      --causal both --seed 10 --shape 1,2,77,77,96 --shape 1,4,77,130,96 --shape 1,2,150,300,96
  done
fi
# GQA through the same path (kv_heads 1 of 4).
check memcheck gqa "$sdpa" validate --backend "$(echo $backends | tr ' ' ,)" \
  --dtype f16 --causal both --seed 8 --shape 2,4,77,77,128 --kv-heads 1
# e4m3 inputs: the native kernel (cutlass, with its f16 V pre-pass) and one simulated path.
for tool in $tools; do
  has_backend cutlass || has_backend cutlass-sm80 || break
  check "$tool" "fp8-$tool" "$sdpa" validate --backend cutlass,cutlass-sm80 --dtype e4m3 \
    --causal both --seed 9 --shape 1,2,77,77,64 --shape 1,4,77,130,128 --kv-heads 2
done
# The variants (a band, softcap, ALiBi, the log-sum-exp) and head dims 192 and 256 (at 256 cutlass
# stages its output in Q's buffer, cutlass-sm80 runs two K/V stages).
for backend in scalar cutlass cutlass-sm80; do
  has_backend $backend || continue
  for tool in $tools; do
    check "$tool" "$tool-$backend-variants" "$sdpa" validate --backend $backend \
      --dtype f16,bf16 --seed 11 --window 150,20 --softcap 20 --alibi head --lse \
      --shape 1,2,77,300,64 --shape 1,2,200,130,128 --shape 1,2,150,200,192 --shape 1,2,130,260,256
    check "$tool" "$tool-$backend-dims" "$sdpa" validate --backend $backend \
      --dtype bf16 --causal both --seed 12 --shape 2,2,150,300,192 --shape 1,2,200,130,256
  done
done
fi
# The backward (the backends that have one): odd lengths, GQA, a band with softcap and ALiBi,
# head dims 64 to 256, both dQ reductions.
for backend in scalar cutlass-sm80 cutlass; do
  has_part backward && has_backend $backend || continue
  for tool in $tools; do
    for mode in "" --deterministic; do
      check "$tool" "$tool-$backend-backward$mode" "$sdpa" validate --backward $mode \
        --backend $backend --dtype bf16 --causal both --seed 13 --shape 1,2,77,130,64 \
        --shape 2,4,170,150,128 --kv-heads 2 --shape 1,2,40,45,256
    done
    check "$tool" "$tool-$backend-backward-variants" "$sdpa" validate --backward \
      --backend $backend --dtype f16 --seed 14 --window 30,5 --softcap 20 --alibi head \
      --shape 1,2,77,90,64 --shape 1,2,50,60,192
  done
done
if [ -n "$concurrency" ]; then
  # memcheck only: a kernel running before an upload finished or after a free is a global memory
  # error; racecheck looks at shared memory within one kernel, which the per-backend runs above
  # already cover (here it only adds cuBLAS's own GEMM kernels, docs/log/).
  SDPA_REQUIRE_GPU=1 check memcheck streams "$concurrency" tensors_used_across_streams_stay_ordered
fi
if [ -n "$seqs" ]; then
  SDPA_REQUIRE_GPU=1 check memcheck lying "$seqs" lying
fi
exit $rc
