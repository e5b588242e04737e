// Finds and loads the CUDA plugin (_cuda_backend.so beside the native module) on first use, after the
// libraries it needs (cuBLASLt, NCCL) from the folders Python found them in (pip's nvidia-* packages).
#include <dlfcn.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/plugin.h"
#include "backend/ops.h"
#include "core/error.h"
#include "dist/comm.h"

// Why the build has no plugin (cmake/cuda.cmake says it; empty when it built one).
#ifndef QRT_CUDA_BUILD_NOTE
#define QRT_CUDA_BUILD_NOTE ""
#endif

namespace qrt {
namespace {

// The plugin's libraries by soname, and the pip package that ships each.
struct NeededLibrary {
  const char* soname;
  const char* package;
};
constexpr NeededLibrary kNeededLibraries[] = {{"libcublasLt.so.13", "nvidia-cublas"},
                                             {"libnccl.so.2", "nvidia-nccl-cu13"}};

std::mutex library_dirs_mu;
std::vector<std::string> library_dirs;

// Loads each needed library from the first folder that holds it, so that the plugin's own dlopen finds it
// loaded by its soname; one found nowhere is left to the plugin's RPATH and the system's search path.
void preload_needed_libraries() {
  std::lock_guard<std::mutex> lock(library_dirs_mu);
  for (const NeededLibrary& lib : kNeededLibraries) {
    for (const std::string& dir : library_dirs) {
      const std::string path = dir + "/" + lib.soname;
      if (access(path.c_str(), R_OK) == 0 && dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) break;
    }
  }
}

// The reason a plugin that exists did not load, with what to do about it.
std::string load_failure(const std::string& path, const char* dlerror_text) {
  const std::string e = dlerror_text ? dlerror_text : path + ": unknown error";
  for (const NeededLibrary& lib : kNeededLibraries)
    if (e.find(lib.soname) != std::string::npos)
      return str_cat("the CUDA plugin cannot load: ", lib.soname, " was not found (pip install ", lib.package, "): ", e);
  if (e.find("libcuda.so") != std::string::npos)
    return str_cat("the CUDA plugin cannot load: no NVIDIA driver (libcuda.so.1) on this machine: ", e);
  return str_cat("the CUDA plugin cannot load: ", e);
}

struct Plugin {
  void* handle = nullptr;
  std::string error;
  decltype(&qrt_cuda_device_count) device_count = nullptr;
  decltype(&qrt_cuda_make_backend) make_backend = nullptr;
  decltype(&qrt_cuda_nccl_unique_id) nccl_unique_id = nullptr;
  decltype(&qrt_cuda_make_nccl_comm) make_nccl_comm = nullptr;
  decltype(&qrt_cuda_device_error) device_error = nullptr;
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
    if (access(path.c_str(), F_OK) != 0) {
      const std::string note = QRT_CUDA_BUILD_NOTE;
      p.error = "this qwen_rt was built without the CUDA backend (" +
                (note.empty() ? std::string("no ") + path : note) + ")";
      return;
    }
    preload_needed_libraries();
    p.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!p.handle) {
      p.error = load_failure(path, dlerror());  // dlerror() names the library the plugin lacks, if that is why
      return;
    }
    p.device_count = reinterpret_cast<decltype(p.device_count)>(dlsym(p.handle, "qrt_cuda_device_count"));
    p.make_backend = reinterpret_cast<decltype(p.make_backend)>(dlsym(p.handle, "qrt_cuda_make_backend"));
    p.nccl_unique_id = reinterpret_cast<decltype(p.nccl_unique_id)>(dlsym(p.handle, "qrt_cuda_nccl_unique_id"));
    p.make_nccl_comm = reinterpret_cast<decltype(p.make_nccl_comm)>(dlsym(p.handle, "qrt_cuda_make_nccl_comm"));
    p.device_error = reinterpret_cast<decltype(p.device_error)>(dlsym(p.handle, "qrt_cuda_device_error"));
    if (!p.device_count || !p.make_backend || !p.nccl_unique_id || !p.make_nccl_comm || !p.device_error) {
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

std::string cuda_unavailable_reason() {
  const Plugin& p = plugin();
  if (!p.handle) return p.error;
  char err[512] = {0};
  if (p.device_error(err, sizeof(err)) == 0) return "";
  return str_cat("the CUDA driver reports no usable device: ", err);
}

void set_cuda_library_dirs(const std::vector<std::string>& dirs) {
  std::lock_guard<std::mutex> lock(library_dirs_mu);
  library_dirs = dirs;
}

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
