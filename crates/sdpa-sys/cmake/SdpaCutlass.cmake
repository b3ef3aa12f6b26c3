# Locates CUTLASS/CuTe headers: SDPA_CUTLASS_INCLUDE (set by crates/sdpa-sys/build.rs from
# CUTLASS_DIR or the pinned PyPI package), else CUTLASS_DIR from the environment.
if(NOT SDPA_CUTLASS_INCLUDE AND DEFINED ENV{CUTLASS_DIR})
  set(SDPA_CUTLASS_INCLUDE "$ENV{CUTLASS_DIR}/include")
endif()
if(SDPA_CUTLASS_INCLUDE AND EXISTS "${SDPA_CUTLASS_INCLUDE}/cute/tensor.hpp")
  set(SDPA_HAVE_CUTLASS ON)
  message(STATUS "sdpa: CUTLASS headers at ${SDPA_CUTLASS_INCLUDE}")
else()
  set(SDPA_HAVE_CUTLASS OFF)
  message(STATUS "sdpa: no CUTLASS headers found; the cutlass backend is not built")
endif()
