# Generates the fused-kernel instantiations this build compiles: SDPA_KERNELS, the lines of
# cpp/kernels.txt that crates/sdpa-sys/build.rs chose from the crate's features, as
# `backend/dtype/head_dim` entries. One .cu per entry (from the backend folder's
# instantiate.cu.in or its instantiate_d<head_dim>.cu.in, or instantiate_e4m3.cu.in for e4m3, with its fast-mode sibling
# instantiate_e4m3_fast.cu.in where the folder has one) into ${CMAKE_CURRENT_BINARY_DIR}/gen,
# and gen/registry.inc, one SDPA_INSTANCE(...) per line, which src/api.cu expands into
# declarations and its dispatch table. Sets SDPA_KERNEL_SOURCES.
# Files are rewritten only when their text changes, so a re-configure rebuilds nothing.

# Per backend: source folder, C++ namespace, sdpa::Kernel enumerator, needs CUTLASS.
set(_sdpa_scalar "scalar;scalar;Scalar;0")
set(_sdpa_wmma "wmma;wmma_backend;Wmma;0")
set(_sdpa_cutlass "cutlass/sm90;cutlass_sm90;Cutlass;1")
set(_sdpa_cutlass-sm80 "cutlass/sm80;cutlass_sm80;CutlassSm80;1")

# Per dtype: the sdpa::Dtype enumerator, and the element type of the kernels without CUTLASS
# (_0_) and with it (_1_); e4m3 kernels name their element types themselves.
set(_sdpa_enum_f16 F16)
set(_sdpa_enum_bf16 BF16)
set(_sdpa_enum_e4m3 E4M3)
set(_sdpa_elem_0_f16 "__half")
set(_sdpa_elem_0_bf16 "__nv_bfloat16")
set(_sdpa_elem_1_f16 "cute::half_t")
set(_sdpa_elem_1_bf16 "cute::bfloat16_t")

function(sdpa_generate_kernels kernels out_sources)
  set(gen "${CMAKE_CURRENT_BINARY_DIR}/gen")
  set(sources "")
  set(registry "// Generated from cpp/kernels.txt by cmake/SdpaKernels.cmake; do not edit.\n")
  foreach(entry IN LISTS kernels)
    string(REPLACE "/" ";" fields "${entry}")
    list(GET fields 0 backend)
    list(GET fields 1 dtype)
    list(GET fields 2 head_dim)
    if(NOT DEFINED _sdpa_${backend})
      message(FATAL_ERROR "SDPA_KERNELS: unknown backend '${backend}' in '${entry}'")
    endif()
    list(GET _sdpa_${backend} 0 folder)
    list(GET _sdpa_${backend} 1 ns)
    list(GET _sdpa_${backend} 2 kernel)
    list(GET _sdpa_${backend} 3 needs_cutlass)
    if(needs_cutlass AND NOT SDPA_HAVE_CUTLASS)
      continue()
    endif()
    if(NOT DEFINED _sdpa_enum_${dtype})
      message(FATAL_ERROR "SDPA_KERNELS: unknown dtype '${dtype}' in '${entry}'")
    endif()
    set(enum "${_sdpa_enum_${dtype}}")
    set(SDPA_ELEM "${_sdpa_elem_${needs_cutlass}_${dtype}}")
    set(template "${CMAKE_CURRENT_SOURCE_DIR}/src/${folder}/instantiate.cu.in")
    # A head dim with a kernel of its own (cutlass's 576: MLA decode) has a template of its own.
    set(own "${CMAKE_CURRENT_SOURCE_DIR}/src/${folder}/instantiate_d${head_dim}.cu.in")
    if(EXISTS "${own}")
      set(template "${own}")
    endif()
    if(dtype STREQUAL "e4m3")
      set(template "${CMAKE_CURRENT_SOURCE_DIR}/src/${folder}/instantiate_e4m3.cu.in")
    endif()
    if(NOT EXISTS "${template}")
      message(FATAL_ERROR "SDPA_KERNELS: ${backend} has no ${template} for '${entry}'")
    endif()
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${template}")
    set(SDPA_DTYPE "${dtype}")
    set(SDPA_D "${head_dim}")
    set(out "${gen}/${folder}/fwd_${dtype}_d${head_dim}.cu")
    configure_file("${template}" "${out}" @ONLY)
    list(APPEND sources "${out}")
    # A backend's e4m3 fast mode, where it has one: a sibling source the e4m3 one calls.
    set(fast "${CMAKE_CURRENT_SOURCE_DIR}/src/${folder}/instantiate_e4m3_fast.cu.in")
    if(dtype STREQUAL "e4m3" AND EXISTS "${fast}")
      set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${fast}")
      set(out "${gen}/${folder}/fwd_e4m3_fast_d${head_dim}.cu")
      configure_file("${fast}" "${out}" @ONLY)
      list(APPEND sources "${out}")
    endif()
    string(APPEND registry "SDPA_INSTANCE(${ns}, ${kernel}, ${enum}, ${head_dim}, ${dtype})\n")
  endforeach()
  file(CONFIGURE OUTPUT "${gen}/registry.inc" CONTENT "${registry}")
  # Instantiations taken out of the list: their generated sources go too.
  file(GLOB_RECURSE old "${gen}/*.cu")
  foreach(f IN LISTS old)
    if(NOT f IN_LIST sources)
      file(REMOVE "${f}")
    endif()
  endforeach()
  set(${out_sources} "${sources}" PARENT_SCOPE)
endfunction()
