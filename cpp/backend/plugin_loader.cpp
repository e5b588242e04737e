// Finds and loads the CUDA plugin (_cuda_backend.so beside the native module) on first use.
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "backend/cuda/plugin.h"
#include "backend/ops.h"
#include "core/error.h"
#include "dist/comm.h"

namespace qrt {
namespace {

struct Plugin {
  void* handle = nullptr;
  std::string error;
  decltype(&qrt_cuda_device_count) device_count = nullptr;
  decltype(&qrt_cuda_make_backend) make_backend = nullptr;
  decltype(&qrt_cuda_nccl_unique_id) nccl_unique_id = nullptr;
  decltype(&qrt_cuda_make_nccl_comm) make_nccl_comm = nullptr;
};

const Plugin& plugin() {
  static Plugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&make_cpu_backend), &info) || !info.dli_fname) {
      p.error = "cannot locate the qwen_rt native module";
      return;
    }
    std::string dir(info.dli_fname);
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    const std::string path = dir + "_cuda_backend.so";
    p.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!p.handle) {
      const char* e = dlerror();
      // dlerror() names the file (and the library it lacks, if that is why).
      p.error = str_cat("qwen_rt was built without the CUDA backend or it cannot load (",
                        e ? std::string(e) : path + ": unknown error", ")");
      return;
    }
    p.device_count = reinterpret_cast<decltype(p.device_count)>(dlsym(p.handle, "qrt_cuda_device_count"));
    p.make_backend = reinterpret_cast<decltype(p.make_backend)>(dlsym(p.handle, "qrt_cuda_make_backend"));
    p.nccl_unique_id = reinterpret_cast<decltype(p.nccl_unique_id)>(dlsym(p.handle, "qrt_cuda_nccl_unique_id"));
    p.make_nccl_comm = reinterpret_cast<decltype(p.make_nccl_comm)>(dlsym(p.handle, "qrt_cuda_make_nccl_comm"));
    if (!p.device_count || !p.make_backend || !p.nccl_unique_id || !p.make_nccl_comm) {
      dlclose(p.handle);
      p = Plugin();
      p.error = "the CUDA plugin " + path + " lacks an entry point";
    }
  });
  return p;
}

}  // namespace

int cuda_device_count() {
  const Plugin& p = plugin();
  return p.handle ? p.device_count() : 0;
}

std::string cuda_plugin_error() { return plugin().error; }

std::unique_ptr<Backend> make_cuda_backend(int device, DType act_dtype) {
  const Plugin& p = plugin();
  QRT_CHECK(p.handle, p.error);
  char err[512] = {0};
  Backend* be = p.make_backend(device, int(act_dtype), err, sizeof(err));
  // The engine checks the device index first: what fails here is the device (out of memory, the driver).
  if (!be) throw std::runtime_error(err[0] ? err : "cannot create the CUDA backend");
  return std::unique_ptr<Backend>(be);
}

void nccl_unique_id(void* out128) {
  const Plugin& p = plugin();
  QRT_CHECK(p.handle, p.error);
  char err[512] = {0};
  QRT_CHECK(p.nccl_unique_id(out128, err, sizeof(err)) == 0, "NCCL: ", err);
}

std::unique_ptr<Comm> make_nccl_comm(Backend& be, const void* id128, int rank, int size) {
  const Plugin& p = plugin();
  QRT_CHECK(p.handle, p.error);
  char err[512] = {0};
  Comm* c = p.make_nccl_comm(&be, id128, rank, size, err, sizeof(err));
  QRT_CHECK(c, "NCCL: ", err);
  return std::unique_ptr<Comm>(c);
}

}  // namespace qrt
