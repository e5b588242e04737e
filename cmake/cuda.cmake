# Builds the CUDA plugin when QWEN_RT_CUDA is ON, or AUTO and nvcc is found.
# cuBLASLt and NCCL may come from the CUDA toolkit or from the pip packages nvidia-cublas / nvidia-nccl-cu13.
if(QWEN_RT_CUDA STREQUAL "OFF")
  message(STATUS "qwen_rt: CUDA backend off")
  return()
endif()

# Something the plugin needs is missing: an error with QWEN_RT_CUDA=ON, else a CPU-only build.
macro(qrt_no_cuda level reason)
  if(QWEN_RT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "qwen_rt: QWEN_RT_CUDA=ON but ${reason}")
  endif()
  message(${level} "qwen_rt: CPU-only build: ${reason}")
  return()
endmacro()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  qrt_no_cuda(STATUS "no CUDA compiler (nvcc) was found")
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90a)  # 90a: Hopper-only instructions (wgmma prefill attention)
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
find_package(CUDAToolkit REQUIRED)

# Folders of pip's NVIDIA packages in the building Python, as hints.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import importlib.util as u, os\nfor m in ('nvidia.cu13', 'nvidia.cublas', 'nvidia.nccl'):\n    try:\n        s = u.find_spec(m)\n    except Exception:\n        s = None\n    if s and s.submodule_search_locations:\n        print(list(s.submodule_search_locations)[0])"
  OUTPUT_VARIABLE QRT_PIP_NVIDIA OUTPUT_STRIP_TRAILING_WHITESPACE)
string(REPLACE "\n" ";" QRT_PIP_NVIDIA "${QRT_PIP_NVIDIA}")
# Under pip's build isolation the building Python does not see the user's environment: look there too.
if(DEFINED ENV{VIRTUAL_ENV})
  file(GLOB QRT_VENV_NVIDIA "$ENV{VIRTUAL_ENV}/lib/python*/site-packages/nvidia/cu13"
       "$ENV{VIRTUAL_ENV}/lib/python*/site-packages/nvidia/cublas" "$ENV{VIRTUAL_ENV}/lib/python*/site-packages/nvidia/nccl")
  list(APPEND QRT_PIP_NVIDIA ${QRT_VENV_NVIDIA})
endif()
set(QRT_NV_INC "")
set(QRT_NV_LIB "")
foreach(d ${QRT_PIP_NVIDIA})
  list(APPEND QRT_NV_INC "${d}/include")
  list(APPEND QRT_NV_LIB "${d}/lib")
endforeach()

find_path(QRT_CUBLASLT_INCLUDE cublasLt.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${QRT_NV_INC})
find_library(QRT_CUBLASLT_LIB NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
             HINTS ${CUDAToolkit_LIBRARY_DIR} ${QRT_NV_LIB})
find_path(QRT_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${QRT_NV_INC} /usr/include)
find_library(QRT_NCCL_LIB NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR} ${QRT_NV_LIB} /usr/lib/x86_64-linux-gnu)
if(NOT QRT_CUBLASLT_INCLUDE OR NOT QRT_CUBLASLT_LIB OR NOT QRT_NCCL_INCLUDE OR NOT QRT_NCCL_LIB)
  qrt_no_cuda(WARNING "cuBLASLt (${QRT_CUBLASLT_INCLUDE}, ${QRT_CUBLASLT_LIB}) or NCCL (${QRT_NCCL_INCLUDE}, ${QRT_NCCL_LIB}) not found; pip install nvidia-cublas nvidia-nccl-cu13")
endif()
message(STATUS "qwen_rt: CUDA backend on (archs ${CMAKE_CUDA_ARCHITECTURES}); cuBLASLt ${QRT_CUBLASLT_LIB}; NCCL ${QRT_NCCL_LIB}")

file(GLOB QRT_CUDA_SOURCES CONFIGURE_DEPENDS cpp/backend/cuda/*.cu cpp/backend/cuda/*.cpp)
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
# Find cuBLASLt and NCCL where they were found at build time (pip folders have no standard path).
get_filename_component(QRT_CUBLASLT_DIR "${QRT_CUBLASLT_LIB}" DIRECTORY)
get_filename_component(QRT_NCCL_DIR "${QRT_NCCL_LIB}" DIRECTORY)
set_target_properties(_cuda_backend PROPERTIES INSTALL_RPATH "${QRT_CUBLASLT_DIR};${QRT_NCCL_DIR}"
                      BUILD_WITH_INSTALL_RPATH ON)
install(TARGETS _cuda_backend LIBRARY DESTINATION qwen_rt)
