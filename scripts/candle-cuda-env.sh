#!/usr/bin/env bash
# Builds sdpa-candle's `cuda` feature on a machine without a system CUDA toolkit: candle's CUDA
# backend compiles its kernels with nvcc and links libcuda, libcublas(Lt), libcurand and
# libnvrtc, more than the toolkit sdpa-sys downloads holds. This assembles a CUDA root from that
# toolkit, the three PyPI wheels it lacks (nvrtc, curand, cublas) and a link-time stub of libcuda (as a
# toolkit's lib64/stubs has; the driver's real libcuda.so.1 is what runs), then runs the given
# command with CUDA_ROOT, NVCC and CUDA_COMPUTE_CAP set. With a system toolkit, skip this and
# build as candle says.
#
#   bash scripts/candle-cuda-env.sh cargo test -p sdpa-candle --features cuda --release --no-run
#
# CUDA_COMPUTE_CAP (default 90) is the GPU candle's kernels are compiled for.
set -euo pipefail
cache=${SDPA_TOOLCHAIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sdpa}
tc=$(ls -d "$cache"/cuda-*/nvidia/cu13 2>/dev/null | head -1)
if [ -z "$tc" ]; then
  echo "candle-cuda-env: no sdpa toolchain in $cache; run 'cargo build' once first" >&2
  exit 1
fi
nvrtc=13.0.88 curand=10.4.5.25 cublas=13.0.2.14
home=$cache/candle-cuda-$nvrtc-$curand-$cublas
if [ ! -f "$home/.done" ]; then
  rm -rf "$home" && mkdir -p "$home/lib64/stubs" "$home/wheels"
  python3 -m pip install --quiet --no-deps --target "$home/wheels" \
    "nvidia-cuda-nvrtc==$nvrtc" "nvidia-curand==$curand" "nvidia-cublas==$cublas"
  for d in bin include nvvm; do ln -s "$tc/$d" "$home/$d"; done
  for lib in "$tc"/lib/*.so* "$home"/wheels/nvidia/cu13/lib/*.so*; do
    ln -sf "$lib" "$home/lib64/$(basename "$lib")"
  done
  # Unversioned names for the linker.
  for name in nvrtc curand cublas cublasLt; do
    ln -sf "$(ls "$home"/lib64/lib$name.so.* | grep -v alt | head -1)" "$home/lib64/lib$name.so"
  done
  # libcuda stub: every driver entry point cudarc declares, as empty functions; soname
  # libcuda.so.1 so the executable loads the driver's library at run time.
  cudarc=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.* | tail -1)
  grep -ohE '\bfn cu[A-Za-z0-9_]+' "$cudarc"/src/driver/sys/*.rs | awk '{print $2}' | sort -u \
    | sed 's/.*/void &(void) {}/' > "$home/lib64/stubs/cuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" \
    "$home/lib64/stubs/cuda_stub.c"
  touch "$home/.done"
fi
# CUDA_ROOT (cudarc's link paths) and NVCC (candle's kernel build), not CUDA_HOME or PATH: those
# would make sdpa-sys take this assembly for a full toolkit.
export CUDA_ROOT=$home NVCC=$home/bin/nvcc
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
exec "$@"
