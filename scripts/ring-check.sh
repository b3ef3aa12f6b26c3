#!/usr/bin/env bash
# Ring attention (`sdpa ring`, sdpa::distributed) on a machine of several GPUs in one command:
# after `../shared/gpu/stage --only test:ring,test:errors,bin:sdpa` here, with .gpu/ carried.
#
#   topo      the GPUs and their links, torch and NCCL versions
#   tests     tests/ring.rs and tests/errors.rs with every GPU and NCCL required
#   validate  `sdpa ring validate` over every GPU: one process, then one process a GPU (torchrun)
#   faults    a rank given another problem, a rank that never joins, a rank killed mid-call:
#             every other rank must end with a typed error within its timeout
#   bench     `sdpa ring bench` (and the one-GPU kernel on the whole problem, for the scaling
#             efficiency), with the GPUs' memory sampled; the torchrun form on the first problem
#   anchor    PyTorch's context parallelism on the same problems (scripts/ring_anchor.py), on one
#             GPU and on all of them
#
#   bash scripts/ring-check.sh $OUT
#   STEPS="validate bench" PROBLEMS=s128k-d128-causal RANKS=2 bash scripts/ring-check.sh $OUT
#
# All steps take about ten minutes on two H100s, the device tool's limit for one command: run
# them as two calls on the same machine, STEPS="topo tests validate faults", then
# STEPS="topo bench anchor" (the figures to compare come from one call).
#
# $OUT gets summary.txt and ring-check.tgz (every log and JSON record: the device tool returns
# at most eight files).
set -uo pipefail
out=${1:-${OUT:-/tmp/ring-check}}
mkdir -p "$out"
work=$(mktemp -d /tmp/ring-check.XXXX)
steps=${STEPS:-"topo tests validate faults bench anchor"}
ranks=${RANKS:-$(nvidia-smi -L | wc -l)}
problems=${PROBLEMS:-s128k-d128-causal,s128k-d128,s512k-d128-causal}
here=$(pwd)
run="$here/.gpu/run"
bash "$run" bin sdpa --version > /dev/null  # unpacks the bundle
sdpa=/tmp/gpu-bundle/bin/sdpa
# NCCL and the CUDA libraries where .gpu/run finds them (the PyTorch venv's nvidia packages).
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # the NCCL rings require the choice
# The rendezvous's shared secret, one per check, as a launcher would give every rank of a job.
export SDPA_RING_TOKEN=${SDPA_RING_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
torchrun=(python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks")
summary=()
has() { [[ " $steps " == *" $1 "* ]]; }
note() { summary+=("$1"); echo "$1"; }

# Starts one rank of a world of `ranks` as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), in the background: launch RANK PORT LOG CMD... A rank still running
# after 150 s is killed (exit status 124): a hang shows as that, and the check goes on.
launch() {
  local r=$1 port=$2 log=$3; shift 3
  RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout 150 "$@" > "$log" 2>&1 &
}
# Waits for each pid (after $1, the epoch seconds to count from) and sets `res` to its "rc
# seconds" pairs.
finish() {
  local t0=$1 pid rc; shift
  res=()
  for pid in "$@"; do
    wait "$pid"; rc=$?
    res+=("($rc, $(( $(date +%s) - t0 )) s)")
  done
}

if has topo; then
  { nvidia-smi -L; nvidia-smi topo -m; nvidia-smi --query-gpu=index,name,memory.total,power.limit \
      --format=csv; python3 -c 'import torch; print("torch", torch.__version__, "NCCL",
      torch.cuda.nccl.version(), "GPUs", torch.cuda.device_count())'; } > "$work/topo.txt" 2>&1
  note "topo: $ranks GPU(s); $(tail -1 "$work/topo.txt")"
fi

if has tests; then
  SDPA_REQUIRE_GPU=1 SDPA_REQUIRE_MULTI_GPU=1 timeout 300 bash "$run" tests --nocapture \
    > "$work/tests.log" 2>&1; rc=$?
  note "tests: rc=$rc, $(grep -c '^test .* ok$' "$work/tests.log") ok, $(grep -cE '^test .* FAILED$' "$work/tests.log") failed, $(grep -c 'skipped' "$work/tests.log") skip lines"
fi

if has validate; then
  timeout 300 "$sdpa" ring validate --ranks "$ranks" > "$work/validate.txt" 2>&1; rc=$?
  note "validate (one process, $ranks GPUs): rc=$rc, $(grep -c ' ok$' "$work/validate.txt") ok, $(grep -c FAIL "$work/validate.txt") FAIL"
  timeout 300 "${torchrun[@]}" --no-python "$sdpa" ring validate \
    > "$work/validate-torchrun.txt" 2>&1; rc=$?
  note "validate (torchrun, a process a GPU): rc=$rc, $(grep -c ' ok$' "$work/validate-torchrun.txt") ok, $(grep -c FAIL "$work/validate-torchrun.txt") FAIL"
fi

if has faults && [ "$ranks" -ge 2 ]; then
  f=$work/faults; mkdir -p "$f"
  # Another problem on the last rank: every rank ends, each saying so.
  t0=$(date +%s); pids=()
  for ((r = 0; r < ranks; r++)); do
    p=v4k-d128-causal-gqa; [ $r -eq $((ranks - 1)) ] && p=v2k-d128
    launch $r 29611 "$f/mismatch-$r.log" "$sdpa" ring validate --problem $p --timeout-s 60
    pids+=($!)
  done
  finish "$t0" "${pids[@]}"
  note "faults, another problem on rank $((ranks - 1)): (exit status, time) per rank: ${res[*]}; $(grep -l 'another problem' "$f"/mismatch-*.log | wc -l)/$ranks ranks name it"
  # The last rank never joins: the others fail the rendezvous within --timeout-s 20.
  t0=$(date +%s); pids=()
  for ((r = 0; r < ranks - 1; r++)); do
    launch $r 29612 "$f/absent-$r.log" "$sdpa" ring validate --timeout-s 20
    pids+=($!)
  done
  finish "$t0" "${pids[@]}"
  note "faults, rank $((ranks - 1)) never joins (timeout 20 s): (exit status, time) per rank: ${res[*]}; $(tail -qn1 "$f"/absent-0.log | cut -c1-160)"
  # The last rank killed in the middle of a run of calls: the others end within --timeout-s 30
  # of the kill.
  pids=()
  for ((r = 0; r < ranks; r++)); do
    launch $r 29613 "$f/killed-$r.log" "$sdpa" ring bench --problem s128k-d128-causal \
      --iters 1000 --baseline false --timeout-s 30
    pids+=($!)
  done
  sleep 45
  pkill -9 -P "${pids[$((ranks - 1))]}"; t0=$(date +%s)  # the rank under its `timeout`
  finish "$t0" "${pids[@]:0:$((ranks - 1))}"
  wait "${pids[$((ranks - 1))]}" 2> /dev/null
  note "faults, rank $((ranks - 1)) killed mid-run (timeout 30 s): (exit status, time after the kill) per other rank: ${res[*]}; $(tail -qn1 "$f"/killed-0.log | cut -c1-160)"
fi

if has bench; then
  nvidia-smi --query-gpu=timestamp,index,memory.used,power.draw,clocks.sm --format=csv \
    -lms 250 > "$work/gpu-samples.csv" 2>&1 &
  smi=$!
  timeout 500 "$sdpa" ring bench --ranks "$ranks" --problem "$problems" --iters 5 \
    --json "$work/ring.json" > "$work/bench.txt" 2>&1; rc=$?
  kill $smi 2> /dev/null
  note "bench (one process): rc=$rc"
  summary+=("$(sed 's/^/  /' "$work/bench.txt")")
  first=${problems%%,*}
  timeout 300 "${torchrun[@]}" --no-python "$sdpa" ring bench --problem "$first" --iters 5 \
    --baseline false --json "$work/ring-torchrun.json" > "$work/bench-torchrun.txt" 2>&1; rc=$?
  note "bench (torchrun): rc=$rc; $(grep "^$first" "$work/bench-torchrun.txt" | head -1)"
fi

if has anchor; then
  timeout 400 python3 scripts/ring_anchor.py --problem "$problems" --json "$work/cp-x1.json" \
    > "$work/anchor-x1.txt" 2>&1; rc=$?
  note "anchor, one GPU: rc=$rc"
  summary+=("$(sed 's/^/  /' "$work/anchor-x1.txt")")
  timeout 500 "${torchrun[@]}" scripts/ring_anchor.py --problem "$problems" \
    --json "$work/cp-x$ranks.json" > "$work/anchor-x$ranks.txt" 2>&1; rc=$?
  note "anchor, torch context_parallel on $ranks GPUs: rc=$rc"
  summary+=("$(grep -E '^s[0-9]' "$work/anchor-x$ranks.txt" | sed 's/^/  /')")
fi

printf '%s\n' "${summary[@]}" > "$out/summary.txt"
tar -C "$work" -czf "$out/ring-check.tgz" .
echo "== summary"
cat "$out/summary.txt"
