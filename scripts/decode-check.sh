#!/usr/bin/env bash
# Decode on the GPU machine in one call: its tests, a before/after against an older `sdpa`, the
# split count at short contexts, and ours next to cuDNN and FlashInfer. After every step the
# results so far are packed into $OUT/decode.tgz and a line is added to $OUT/summary.txt, so a
# call cut short by its time limit still returns what it did (a call returns few files: the
# details stay in the archive).
#
#   here:  ../shared/gpu/stage --xz --only seqs,fp8kv,mla,cache,bin:sdpa && scripts/bundle-repack
#          mkdir -p .gpu-fi && scripts/flashinfer-pack .gpu-fi/flashinfer.txz      # anchors step
#          xz -c OLD_SDPA_BINARY > .gpu-fi/sdpa-old.xz                            # ab step
#   there, carry [".gpu", ".gpu-fi"]:  bash scripts/decode-check.sh $OUT
#   STEPS="tests ab splits anchors" (the default) narrows it, e.g. STEPS="ab anchors".
# The before/after names the latency problems by shape, so an older binary without their names
# runs them too.
set -uo pipefail
out=${1:?usage: decode-check.sh OUT}
steps=${STEPS:-"tests ab splits anchors"}
work=/tmp/decode-check
rm -rf "$work" && mkdir -p "$work" "$out"
export SDPA_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
bundle=/tmp/gpu-bundle
sdpa=$bundle/bin/sdpa
has() { [[ " $steps " == *" $1 "* ]]; }
done_step() {  # a summary line, then everything so far into the archive
  echo "$1" | tee -a "$out/summary.txt"
  tar -C "$work" -czf "$out/decode.tgz.tmp" . && mv "$out/decode.tgz.tmp" "$out/decode.tgz"
}
named="decode-b1-k32k,decode-b16-k8k,decode-b64-k4k,decode-b16-k8k-paged,spec-b16-q8-k8k,\
gptoss-decode-b32-k8k-sink,decode-b16-k8k-fp8kv,mla-decode-b64-k4k"
latency=(--causal no --kv-heads 8 --shape 1,32,1,1024,128 --shape 1,32,1,4096,128
  --shape 8,32,1,2048,128)
short="decode-b1-k1k,decode-b1-k4k,decode-b8-k2k"

nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader > "$work/gpu.txt"
bash .gpu/run shell true || { done_step "setup: the bundle did not unpack"; exit 1; }

if has tests; then
  for t in seqs fp8kv mla cache; do
    exe=$(ls $bundle/tests/$t-* 2>/dev/null | head -1)
    [ -n "$exe" ] || { done_step "tests $t: not staged"; continue; }
    timeout 120 "$exe" > "$work/test-$t.txt" 2>&1
    done_step "tests $t: rc $? $(grep 'test result' "$work/test-$t.txt" | tail -1)"
  done
fi

if has ab; then
  if [ -f .gpu-fi/sdpa-old.xz ]; then
    xz -dc .gpu-fi/sdpa-old.xz > /tmp/sdpa-old && chmod +x /tmp/sdpa-old
    for part in named latency; do
      if [ $part = named ]; then args=(--problem "$named"); else args=("${latency[@]}"); fi
      ROUNDS=2 timeout 240 bash scripts/before-after.sh /tmp/sdpa-old "$sdpa" "$work/ab-$part" \
        --backend cutlass --dtype bf16 --budget-ms 120 "${args[@]}" > "$work/ab-$part.txt" 2>&1
      done_step "ab $part: rc $? $(grep 'largest new/old' "$work/ab-$part.txt")"
    done
  else
    done_step "ab: no .gpu-fi/sdpa-old.xz"
  fi
fi

if has splits; then
  for n in 0 1 2 4 8 16 32; do  # 0: the heuristic's count
    SDPA_DECODE_SPLITS=$n timeout 60 "$sdpa" bench --backend cutlass --dtype bf16 --budget-ms 120 \
      --problem "$short" --json "$work/splits-$n.json" > "$work/splits-$n.txt" 2>&1
  done
  SDPA_PDL=0 timeout 60 "$sdpa" bench --backend cutlass --dtype bf16 --budget-ms 120 \
    --problem "$short,decode-b16-k8k" --json "$work/pdl-off.json" > "$work/pdl-off.txt" 2>&1
  done_step "splits: $(grep -hE '^decode-' "$work"/splits-0.txt | awk '{print $1 " " $4}' | paste -sd' ')"
fi

if has anchors; then
  problems="$short,decode-b1-k32k,decode-b16-k8k,decode-b64-k4k,decode-b16-k8k-paged"
  timeout 120 "$sdpa" bench --backend cutlass --dtype bf16 --budget-ms 150 \
    --problem "$problems,decode-b16-k8k-fp8kv,decode-b64-k4k-fp8kv" --json "$work/ours.json" \
    > "$work/ours.txt" 2>&1
  done_step "ours: rc $?"
  timeout 240 bash .gpu/run anchor --backends cudnn --shapes "$problems" --dtypes bf16 \
    --json "$work/cudnn.json" > "$work/cudnn.txt" 2>&1
  done_step "cudnn: rc $?"
  if [ -f .gpu-fi/flashinfer.txz ]; then
    mkdir -p /tmp/flashinfer && tar -C /tmp/flashinfer -xf .gpu-fi/flashinfer.txz
    PYTHONPATH=/tmp/flashinfer timeout 240 python3 scripts/flashinfer_anchor.py \
      --problems "$problems,decode-b16-k8k-fp8kv,decode-b64-k4k-fp8kv" --dtype bf16 \
      --json "$work/flashinfer.json" > "$work/flashinfer.txt" 2>&1
    done_step "flashinfer: rc $?"
  fi
fi
