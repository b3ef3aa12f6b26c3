#!/usr/bin/env bash
# Same-machine, same-call comparison of two `sdpa` builds: runs `sdpa bench` with the same
# arguments alternately on the old and the new binary (ROUNDS rounds, default 2, each round
# in the other order, so that clock and thermal drift hit both alike), then prints per
# (problem, dtype, causal, backend) the best median of each and the ratio new/old.
#
#   bash scripts/before-after.sh OLD_SDPA NEW_SDPA OUT_DIR [sdpa bench arguments...]
#   e.g. bash scripts/before-after.sh /tmp/sdpa-old .gpu-bin/sdpa $OUT --backend cutlass \
#          --dtype f16,bf16,e4m3 --budget-ms 300
set -uo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 OLD_SDPA NEW_SDPA OUT_DIR [sdpa bench arguments...]" >&2
  exit 2
fi
old=$1 new=$2 out=$3
shift 3
mkdir -p "$out"
rounds=${ROUNDS:-2}
rc=0
for r in $(seq 1 "$rounds"); do
  # The side that runs first meets a cooler GPU: odd rounds run the old binary first, even
  # rounds the new one.
  order="old new"
  [ $((r % 2)) -eq 0 ] && order="new old"
  for side in $order; do
    bin=$old
    [ $side = new ] && bin=$new
    "$bin" bench "$@" --json "$out/$side-$r.json" 2> "$out/$side-$r.log" || rc=1
  done
done
python3 - "$out" "$rounds" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
best = {}
for side in ("old", "new"):
    for r in range(1, rounds + 1):
        try:
            records = json.load(open(f"{out}/{side}-{r}.json"))
        except (OSError, ValueError):
            continue
        for x in records:
            # The element types as the bench prints them: e4m3's P·V mode, an output dtype that
            # differs from the input's, an e4m3 K/V cache.
            dtype = x["dtype"] + (f"/{x['fp8_mode']}" if x.get("fp8_mode") else "")
            if x.get("out_dtype") and x["out_dtype"] != x["dtype"]:
                dtype += f">{x['out_dtype']}"
            if x.get("kv_dtype") and x["kv_dtype"] != x["dtype"]:
                dtype += f" kv {x['kv_dtype']}"
            key = (x["name"], dtype, x.get("mask") or ("causal" if x["causal"] else "-"), x["backend"])
            t = best.setdefault(key, {})
            t[side] = min(t.get(side, float("inf")), x["us_graph"])
print(f"{'problem':<20} {'dtype':<18} {'mask':<7} {'backend':<14} {'old us':>9} {'new us':>9} {'new/old':>8}")
worst = 0.0
for key in sorted(best):
    t = best[key]
    if "old" not in t or "new" not in t:
        print(f"{key[0]:<20} {key[1]:<18} {key[2]:<7} {key[3]:<14} missing on one side")
        continue
    ratio = t["new"] / t["old"]
    worst = max(worst, ratio)
    print(f"{key[0]:<20} {key[1]:<18} {key[2]:<7} {key[3]:<14} {t['old']:9.2f} {t['new']:9.2f} {ratio:8.3f}")
print(f"largest new/old: {worst:.3f}")
EOF
exit $rc
