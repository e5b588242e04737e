# Builds the CUDA plugin (_cuda_backend.so): with QWEN_RT_CUDA=ON, or AUTO (the default) when nvcc is found.
# An nvcc that is found but cannot build the plugin (cuBLASLt or NCCL missing) stops the build with the reason,
# also under AUTO: a CPU-only library the user did not ask for is worse than an error (QWEN_RT_CUDA=OFF asks).
# cuBLASLt and NCCL come from pip's nvidia-cublas / nvidia-nccl-cu13 (or a CUDA toolkit's copies); at run time
# the plugin finds them through its RPATH (the packages beside qwen_rt in site-packages) or where Python finds
# the packages (qwen_rt/_native_libraries.py).

# No plugin: the reason is compiled into the native module, which reports it (`qwen-rt info`).
macro(qrt_cpu_only reason)
  message(STATUS "qwen_rt: CPU-only build: ${reason}")
  target_compile_definitions(qrt_base PRIVATE "QRT_CUDA_BUILD_NOTE=\"${reason}\"")
  return()
endmacro()

if(QWEN_RT_CUDA STREQUAL "OFF")
  qrt_cpu_only("QWEN_RT_CUDA=OFF")
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(QWEN_RT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "qwen_rt: QWEN_RT_CUDA=ON but no CUDA compiler (nvcc) was found (PATH, CUDACXX)")
  endif()
  qrt_cpu_only("no CUDA compiler (nvcc) was found when it was built")
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  # A100 (sm_80) and H100/H200 (sm_90a: Hopper-only instructions, the wgmma prefill attention) machine code,
  # plus compute_90 PTX that the driver compiles for newer GPUs.
  set(CMAKE_CUDA_ARCHITECTURES 80-real 90a-real 90-virtual)
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
find_package(CUDAToolkit REQUIRED)

# Folders of pip's NVIDIA packages, as hints: those the building Python sees, and (-I: without pip's build
# isolation) those of the environment the package is being installed into.
set(QRT_FIND_NVIDIA "import importlib.util as u\ntry:\n    s = u.find_spec('nvidia')\nexcept Exception:\n    s = None\nfor d in (s.submodule_search_locations if s else []):\n    print(d)")
execute_process(COMMAND "${Python_EXECUTABLE}" -c "${QRT_FIND_NVIDIA}"
                OUTPUT_VARIABLE QRT_NVIDIA_ROOTS OUTPUT_STRIP_TRAILING_WHITESPACE)
execute_process(COMMAND "${Python_EXECUTABLE}" -I -c "${QRT_FIND_NVIDIA}"
                OUTPUT_VARIABLE QRT_NVIDIA_ROOTS_TARGET OUTPUT_STRIP_TRAILING_WHITESPACE)
string(REPLACE "\n" ";" QRT_NVIDIA_ROOTS "${QRT_NVIDIA_ROOTS}\n${QRT_NVIDIA_ROOTS_TARGET}")
set(QRT_NV_INC "")
set(QRT_NV_LIB "")
foreach(root ${QRT_NVIDIA_ROOTS})
  foreach(pkg cu13 cublas nccl)
    list(APPEND QRT_NV_INC "${root}/${pkg}/include")
    list(APPEND QRT_NV_LIB "${root}/${pkg}/lib")
  endforeach()
endforeach()

find_path(QRT_CUBLASLT_INCLUDE cublasLt.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${QRT_NV_INC})
find_library(QRT_CUBLASLT_LIB NAMES cublasLt libcublasLt.so.13 HINTS ${CUDAToolkit_LIBRARY_DIR} ${QRT_NV_LIB})
find_path(QRT_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${QRT_NV_INC} /usr/include)
find_library(QRT_NCCL_LIB NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR} ${QRT_NV_LIB} /usr/lib/x86_64-linux-gnu)
if(NOT QRT_CUBLASLT_INCLUDE OR NOT QRT_CUBLASLT_LIB OR NOT QRT_NCCL_INCLUDE OR NOT QRT_NCCL_LIB)
  message(FATAL_ERROR "qwen_rt: nvcc (${CMAKE_CUDA_COMPILER}) was found, but the CUDA plugin also needs cuBLASLt "
    "(found: ${QRT_CUBLASLT_INCLUDE}, ${QRT_CUBLASLT_LIB}) and NCCL (found: ${QRT_NCCL_INCLUDE}, ${QRT_NCCL_LIB}). "
    "Install them into the environment qwen_rt goes into (pip install nvidia-cublas nvidia-nccl-cu13) and build "
    "again, or build for the CPU only with QWEN_RT_CUDA=OFF.")
endif()
message(STATUS "qwen_rt: CUDA backend on (archs ${CMAKE_CUDA_ARCHITECTURES}); cuBLASLt ${QRT_CUBLASLT_LIB}; NCCL ${QRT_NCCL_LIB}")

file(GLOB QRT_CUDA_SOURCES CONFIGURE_DEPENDS cpp/backend/cuda/*.cu cpp/backend/cuda/*.cpp)
# The CUTLASS FP8 GEMM is built apart (sm_90a only, CUTLASS's headers): below.
list(REMOVE_ITEM QRT_CUDA_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/cpp/backend/cuda/fp8_gemm_sm90.cu")
add_library(_cuda_backend MODULE ${QRT_CUDA_SOURCES} cpp/core/dtype.cpp)
set_target_properties(_cuda_backend PROPERTIES PREFIX "" CUDA_SEPARABLE_COMPILATION OFF)
target_include_directories(_cuda_backend PRIVATE cpp ${QRT_CUBLASLT_INCLUDE} ${QRT_NCCL_INCLUDE})
target_compile_options(_cuda_backend PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -Xcompiler=-fvisibility=hidden --expt-relaxed-constexpr>
  $<$<COMPILE_LANGUAGE:CXX>:-O2 -fvisibility=hidden>)
if(CMAKE_CUDA_ARCHITECTURES MATCHES "90a")
  target_compile_definitions(_cuda_backend PRIVATE QRT_HAVE_SM90A=1)
endif()
target_link_libraries(_cuda_backend PRIVATE CUDA::cudart_static ${QRT_CUBLASLT_LIB} ${QRT_NCCL_LIB})

# CUTLASS's headers (pip's nvidia-cutlass, or $CUTLASS_DIR/include): the W8A8 FP8 GEMM on sm_90a
# (fp8_gemm_sm90.cu), compiled for sm_90a alone. Without them (or without an sm_90a image) the file builds as a
# stub that declines, and FP8 linears take the other paths.
execute_process(COMMAND "${Python_EXECUTABLE}" -c
  "import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), 'source', 'include'))"
  OUTPUT_VARIABLE QRT_CUTLASS_HINT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
find_path(QRT_CUTLASS_INCLUDE cutlass/gemm/collective/collective_builder.hpp
          HINTS "$ENV{CUTLASS_DIR}/include" "${QRT_CUTLASS_HINT}")
if(QRT_CUTLASS_INCLUDE AND CMAKE_CUDA_ARCHITECTURES MATCHES "90a")
  message(STATUS "qwen_rt: CUTLASS ${QRT_CUTLASS_INCLUDE}: the sm_90a W8A8 FP8 GEMM is built")
  add_library(qrt_fp8_sm90 OBJECT cpp/backend/cuda/fp8_gemm_sm90.cu)
  set_target_properties(qrt_fp8_sm90 PROPERTIES CUDA_ARCHITECTURES 90a-real POSITION_INDEPENDENT_CODE ON)
  target_include_directories(qrt_fp8_sm90 PRIVATE cpp ${QRT_CUTLASS_INCLUDE} ${QRT_CUBLASLT_INCLUDE}
                             ${QRT_NCCL_INCLUDE})
  target_compile_definitions(qrt_fp8_sm90 PRIVATE QRT_HAVE_CUTLASS=1 QRT_HAVE_SM90A=1)
  target_compile_options(qrt_fp8_sm90 PRIVATE -O3 -Xcompiler=-fvisibility=hidden --expt-relaxed-constexpr)
  target_sources(_cuda_backend PRIVATE $<TARGET_OBJECTS:qrt_fp8_sm90>)
else()
  message(STATUS "qwen_rt: no CUTLASS headers (pip install nvidia-cutlass) or no sm_90a image: no CUTLASS FP8 GEMM")
  target_sources(_cuda_backend PRIVATE cpp/backend/cuda/fp8_gemm_sm90.cu)
endif()
# At run time: pip's packages beside qwen_rt/ in the same site-packages (no absolute paths of this machine);
# elsewhere qwen_rt/_native_libraries.py loads them first from where Python finds them.
set_target_properties(_cuda_backend PROPERTIES
  INSTALL_RPATH "$ORIGIN/../nvidia/cu13/lib;$ORIGIN/../nvidia/cublas/lib;$ORIGIN/../nvidia/nccl/lib"
  BUILD_WITH_INSTALL_RPATH ON)
install(TARGETS _cuda_backend LIBRARY DESTINATION qwen_rt)
