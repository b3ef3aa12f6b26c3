#!/usr/bin/env bash
# The published crates (sdpa-sys, sdpa, sdpa-candle) package, and each builds from its package
# alone, as crates.io would build it: `cargo publish --dry-run` packages the three together,
# resolves their path dependencies among the fresh packages (a local registry in the target
# folder), and builds each package unpacked, in a target folder of its own
# (target/package-check).
#
# The CUDA core is built there once, from sdpa-sys's package, with the README's smallest build
# (features sm90, bf16, hdim128: three kernels, for sm_90a): that proves the package holds the
# build (build.rs, the CMake project and modules, the toolchain pins, the bridge, the shared
# headers). sdpa and sdpa-candle then build from their packages with default features, on
# sdpa-sys's, without compiling the core again. That the package holds every other kernel's
# sources too is the list check at the end; CI's workspace build compiles every kernel from
# those same files. FULL=1 verifies
# with the default features instead (every kernel, compiled twice: once from sdpa-sys's
# package, once from the copy sdpa's build unpacks).
#
#   bash scripts/package-check.sh          # what CI runs
#   FULL=1 bash scripts/package-check.sh   # every kernel, from the packages
set -euo pipefail
cd "$(dirname "$0")/.."
target=target/package-check
# Cargo takes a registry package of a given version as immutable: a copy it unpacked (under
# $CARGO_HOME/registry/src/, in a folder named after the local registry's path) or compiled in
# an earlier run is reused as it was, though this run's package differs. Remove both first,
# and the CUDA core's CMake trees: the unpacked copy's files carry the package's fixed old
# timestamps, so make would take an earlier run's objects for up to date.
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/sdpa{,-sys,-candle}-[0-9]*
cargo clean --target-dir "$target" -p sdpa-sys -p sdpa -p sdpa-candle
rm -rf "$target"/sdpa-core-*
if [ "${FULL:-0}" = 1 ]; then
  cargo publish --dry-run --target-dir "$target" -p sdpa-sys -p sdpa -p sdpa-candle
else
  # sdpa-sys builds its core from its package. Then the three build from theirs, as a user's
  # default build resolves them, without CUDA (DOCS_RS: sdpa-sys's build script compiles no
  # kernels): the core was just built from the same files, and sdpa's and sdpa-candle's builds
  # would each compile it again from an unpacked copy of sdpa-sys (two more trees, ~2 minutes
  # on CI's 2 cores).
  cargo publish --dry-run --target-dir "$target" -p sdpa-sys \
    --no-default-features --features sm90,bf16,hdim128
  DOCS_RS=1 cargo publish --dry-run --target-dir "$target" -p sdpa-sys -p sdpa -p sdpa-candle
fi
# Every tracked file of the core is in sdpa-sys's package.
diff <(git ls-files crates/sdpa-sys/cpp crates/sdpa-sys/cmake crates/sdpa-sys/third_party |
  sed 's|^crates/sdpa-sys/||' | sort) \
  <(cargo package -p sdpa-sys --list | grep -E '^(cpp|cmake|third_party)/' | sort)
echo "package-check: sdpa-sys, sdpa and sdpa-candle package and build from their packages"
