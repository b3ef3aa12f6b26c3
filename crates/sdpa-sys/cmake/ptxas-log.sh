#!/usr/bin/env bash
# CMAKE_CUDA_COMPILER_LAUNCHER: runs the nvcc command it is given, passes its output through,
# and keeps the ptxas resource report (-Xptxas=-v) beside the object as <object>.ptxas.
# crates/sdpa-sys/build.rs gathers these so `sdpa info` can show registers/smem/spills per
# kernel. Only the recompiled object's report changes: the build stays incremental.
set -u
obj=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && obj="$a"
  prev="$a"
done
log=$(mktemp)
"$@" 2> "$log"
rc=$?
cat "$log" >&2
if [ $rc -eq 0 ] && [ -n "$obj" ]; then
  if command -v c++filt >/dev/null 2>&1; then
    grep -E 'ptxas|bytes stack frame' "$log" | c++filt > "$obj.ptxas"
  else
    grep -E 'ptxas|bytes stack frame' "$log" > "$obj.ptxas"
  fi
fi
rm -f "$log"
exit $rc
