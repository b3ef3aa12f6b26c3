#!/usr/bin/env bash
# Ours next to FlashAttention-4 and cuDNN on one warm GPU machine, in two device calls: fa4's pack
# (57 MB), an `sdpa` bundle and the working tree do not fit one 64 MiB carry together.
#
#   here:    ../shared/gpu/stage --xz --only bin:sdpa      # .gpu/: the sdpa bundle
#            mkdir -p .gpu-fa4 && ../shared/anchors/fa4-pack .gpu-fa4/fa4.txz
#            cp ../shared/anchors/sdpa_anchor.py .gpu-fa4/
#            scripts/flashinfer-pack .gpu-fa4/flashinfer.txz   # optional: FlashInfer on the decode problems
#   call 1, carry [".gpu"]:      bash scripts/anchor-table.sh ours $OUT PROBLEMS [bench args]
#   call 2, carry [".gpu-fa4"], right after (the machine is given back after ~30 s idle):
#                                bash scripts/anchor-table.sh anchors $OUT PROBLEMS [bench args]
#
# PROBLEMS: named problems, comma-separated (the same names in `sdpa bench` and the anchor
# script); bench args, e.g. `--dtype bf16`, go to `sdpa bench` (the first --dtype's types also
# to the anchors). Call 1 unpacks the bundle into /tmp/gpu-bundle and benches ours; call 2 runs
# the anchors, then ours again from call 1's bundle: ours and the anchors share call 2, and the
# two passes of ours show the spread between calls. Call 2 stops (status 3) if the machine was
# given back in between. With .gpu-fa4/flashinfer.txz, call 2 also times FlashInfer on the
# decode-* problems (scripts/flashinfer_anchor.py). Outputs: ours1.json, ours2.json,
# anchors.json (flashinfer.json) and their .txt under $OUT.
set -uo pipefail
mode=${1:?usage: anchor-table.sh ours|anchors OUT PROBLEMS [sdpa bench args]}
out=${2:?usage: anchor-table.sh ours|anchors OUT PROBLEMS [sdpa bench args]}
problems=${3:?usage: anchor-table.sh ours|anchors OUT PROBLEMS [sdpa bench args]}
shift 3
mkdir -p "$out"
sdpa=/tmp/gpu-bundle/bin/sdpa
bench() { "$sdpa" bench --backend cutlass --problem "$problems" --json "$out/$1.json" "${@:2}"; }
case $mode in
  ours)
    bash .gpu/run shell true || exit 1  # unpacks the bundle into /tmp/gpu-bundle
    bench ours1 "$@" 2>&1 | tee "$out/ours1.txt"
    ;;
  anchors)
    [ -x "$sdpa" ] || {
      echo "anchor-table: call 1's bundle is gone (the machine was given back between the calls)" >&2
      exit 3
    }
    mkdir -p /tmp/fa4 && tar -C /tmp/fa4 -xf .gpu-fa4/fa4.txz || exit 1
    export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages
    for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
      [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    dtypes=bf16
    for ((i = 1; i < $#; i++)); do [ "${!i}" = --dtype ] && { j=$((i + 1)); dtypes=${!j}; }; done
    dtypes=$(tr , '\n' <<< "$dtypes" | grep -xE 'f16|bf16' | paste -sd, -)  # the anchors' types
    [ -n "$dtypes" ] || dtypes=bf16
    python3 .gpu-fa4/sdpa_anchor.py --backends fa4,cudnn --shapes "$problems" --dtypes "$dtypes" \
      --json "$out/anchors.json" 2>&1 | tee "$out/anchors.txt"
    decode=$(tr , '\n' <<< "$problems" | grep -E '^decode-' | paste -sd, -)
    if [ -f .gpu-fa4/flashinfer.txz ] && [ -n "$decode" ]; then
      mkdir -p /tmp/flashinfer && tar -C /tmp/flashinfer -xf .gpu-fa4/flashinfer.txz
      PYTHONPATH=/tmp/flashinfer python3 scripts/flashinfer_anchor.py --problems "$decode" \
        --dtype bf16 --json "$out/flashinfer.json" 2>&1 | tee "$out/flashinfer.txt"
    fi
    bench ours2 "$@" 2>&1 | tee "$out/ours2.txt"
    ;;
  *)
    echo "anchor-table: the first argument is ours (call 1) or anchors (call 2), not $mode" >&2
    exit 2
    ;;
esac
