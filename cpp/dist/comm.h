// Comm: collectives among the ranks of one tensor-parallel group.
// Implementations: single rank (no-op), CPU threads (shared memory), NCCL (CUDA plugin).
// Every rank calls the same collectives in the same order; each call is stream-ordered on the
// rank's backend and returns once the result is ready to be used by that backend's next op.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "backend/ops.h"

namespace qrt {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place sum of x over all ranks (x contiguous).
  virtual void all_reduce_sum(Tensor& x) = 0;
  // recv [size * send.rows, send.cols] gets each rank's send rows, rank 0 first.
  virtual void all_gather_rows(const Tensor& send, Tensor& recv) = 0;
  // After a failure (a rank or the device timed out): ends every pending collective of the group and
  // makes later ones throw, so that no rank, thread or stream waits on it for ever. May be called from
  // any thread; the communicator is unusable afterwards.
  virtual void abort() {}
};

std::unique_ptr<Comm> make_single_comm();

// Shared-memory group for ranks that are threads of this process on the CPU backend.
// Bounded waits: a collective that does not complete within timeout_s throws std::runtime_error.
class ThreadGroup;
std::shared_ptr<ThreadGroup> make_thread_group(int size, double timeout_s);
std::unique_ptr<Comm> make_thread_comm(std::shared_ptr<ThreadGroup> group, int rank);

}  // namespace qrt

namespace qrt {
// NCCL through the CUDA plugin. Rank 0 makes the id; every rank's thread then makes its comm.
void nccl_unique_id(void* out128);
std::unique_ptr<Comm> make_nccl_comm(Backend& backend, const void* id128, int rank, int size);
std::string cuda_plugin_error();
}  // namespace qrt
