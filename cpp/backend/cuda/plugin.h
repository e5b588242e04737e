// C entry points of the CUDA plugin (_cuda_backend.so), loaded with dlopen by cpp/backend/plugin_loader.cpp
// so that the CPU build and CPU-only users never need CUDA libraries.
// Each returns null / a negative value on failure and writes the reason into err.
#pragma once
#include <cstddef>

namespace qrt { class Backend; class Comm; }

extern "C" {
int qrt_cuda_device_count();
// 0 when the driver reports at least one device; else -1 and the driver's reason in err.
int qrt_cuda_device_error(char* err, size_t err_len);
qrt::Backend* qrt_cuda_make_backend(int device, int act_dtype, char* err, size_t err_len);
// 128-byte NCCL unique id, made once per group by rank 0's thread.
int qrt_cuda_nccl_unique_id(void* out128, char* err, size_t err_len);
// Creates rank's communicator (ncclCommInitRank) bound to backend's device and stream.
qrt::Comm* qrt_cuda_make_nccl_comm(qrt::Backend* backend, const void* unique_id, int rank, int size,
                                   char* err, size_t err_len);
}
