// umrt's allocation front: the functions torch's pluggable allocator (through the
// shim, torch_alloc_shim.cpp) and umrt's CuPy allocator call (with the stream
// CuPy runs on, read in Python: umrt/allocators/cupy.py).
//
// Each allocation first asks the installed steady schedule (steady_alloc.cpp,
// reached through the function pointers Python installs with umrt_front_install): a
// planned address comes back without entering Python. When no schedule is installed, or
// it returns NULL (it disarmed: a deviation), the allocation goes to the fallback, umrt's
// Python callbacks (ctypes function pointers set with umrt_front_set_fallback), which
// catch Python up and serve it from the pool. A free goes to the schedule first (1: its
// block), else to the fallback.
//
// No CUDA, torch or Python headers: streams are opaque pointers. Lock-free: the
// schedule has its own mutex. A schedule handle stays valid while installed (Python
// keeps every schedule it installed alive for the life of the process).
// Built by umrt/native/front.py with torch.utils.cpp_extension.load (a plain library).
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#define UMRT_EXPORT extern "C" __attribute__((visibility("default")))

typedef void* (*umrt_alloc_fn)(ssize_t, int, void*);
typedef void (*umrt_free_fn)(void*, ssize_t, int, void*);
typedef void* (*umrt_steady_malloc_fn)(void*, uint64_t, int, void*);
typedef int (*umrt_steady_free_fn)(void*, uint64_t, uint64_t, int, void*);
typedef void (*umrt_record_fn)(void*, void*);
typedef int (*umrt_steady_record_fn)(void*, uint64_t, void*);

namespace {

struct Installed {
  void* handle;
  umrt_steady_malloc_fn malloc_fn;
  umrt_steady_free_fn free_fn;
  umrt_steady_record_fn record_fn;
};

std::atomic<umrt_alloc_fn> g_fallback_alloc{nullptr};
std::atomic<umrt_free_fn> g_fallback_free{nullptr};
std::atomic<umrt_record_fn> g_fallback_record{nullptr};
std::atomic<Installed*> g_installed{nullptr};
// Counters: allocations and frees served by the schedule, and those that went to Python.
std::atomic<int64_t> g_native_allocs{0}, g_native_frees{0}, g_fallback_allocs{0}, g_fallback_frees{0};

}  // namespace

// The Python callbacks every allocation falls back to, and every record_stream goes to
// (record_fp NULL: none).
UMRT_EXPORT void umrt_front_set_fallback(umrt_alloc_fn alloc_fp, umrt_free_fn free_fp, umrt_record_fn record_fp) {
  g_fallback_alloc.store(alloc_fp);
  g_fallback_free.store(free_fp);
  g_fallback_record.store(record_fp);
}

// Serve allocations from `handle` (NULL handle: none). `slot` is storage Python keeps
// alive for as long as the process runs (the record the front reads).
UMRT_EXPORT void umrt_front_install(void* slot, void* handle, umrt_steady_malloc_fn malloc_fp,
                                    umrt_steady_free_fn free_fp, umrt_steady_record_fn record_fp) {
  if (handle == nullptr || slot == nullptr) {
    g_installed.store(nullptr);
    return;
  }
  Installed* rec = static_cast<Installed*>(slot);
  rec->handle = handle;
  rec->malloc_fn = malloc_fp;
  rec->free_fn = free_fp;
  rec->record_fn = record_fp;
  g_installed.store(rec);
}

UMRT_EXPORT int64_t umrt_front_slot_size() { return static_cast<int64_t>(sizeof(Installed)); }

UMRT_EXPORT void* umrt_front_malloc(ssize_t size, int device, void* stream) {
  if (size <= 0) return nullptr;
  Installed* rec = g_installed.load();
  if (rec != nullptr) {
    void* ptr = rec->malloc_fn(rec->handle, static_cast<uint64_t>(size), device, stream);
    if (ptr != nullptr) {
      g_native_allocs.fetch_add(1, std::memory_order_relaxed);
      return ptr;
    }
  }
  g_fallback_allocs.fetch_add(1, std::memory_order_relaxed);
  umrt_alloc_fn fallback = g_fallback_alloc.load();
  return fallback ? fallback(size, device, stream) : nullptr;
}

UMRT_EXPORT void umrt_front_free(void* ptr, ssize_t size, int device, void* stream) {
  if (ptr == nullptr) return;
  Installed* rec = g_installed.load();
  if (rec != nullptr &&
      rec->free_fn(rec->handle, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)), static_cast<uint64_t>(size),
                   device, stream)) {
    g_native_frees.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_fallback_frees.fetch_add(1, std::memory_order_relaxed);
  umrt_free_fn fallback = g_fallback_free.load();
  if (fallback) fallback(ptr, size, device, stream);
}

// torch's Tensor.record_stream (through the shim's umrt_record_stream): the block is used on
// `stream` too. A block the schedule serves makes it deviate (it serves one stream); then
// Python hears of it (the fallback), hands back if the schedule deviated, and orders the
// block's next use and discard after that stream's work (ManagedPool.record_stream).
UMRT_EXPORT void umrt_front_record_stream(void* ptr, void* stream) {
  if (ptr == nullptr) return;
  Installed* rec = g_installed.load();
  if (rec != nullptr && rec->record_fn != nullptr) {
    rec->record_fn(rec->handle, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)), stream);
  }
  umrt_record_fn fallback = g_fallback_record.load();
  if (fallback) fallback(ptr, stream);
}

// native allocations, native frees, fallback allocations, fallback frees.
UMRT_EXPORT void umrt_front_counters(int64_t* out4) {
  out4[0] = g_native_allocs.load();
  out4[1] = g_native_frees.load();
  out4[2] = g_fallback_allocs.load();
  out4[3] = g_fallback_frees.load();
}

// Bench harness: `repeat` times a stream of `n_ops` operations through umrt_front_malloc /
// umrt_front_free, called through function pointers as torch's allocator (via the shim)
// calls them. op[k] = 0: malloc of arg[k] bytes; 1: free of the block operation arg[k]
// returned (this repeat's if it came earlier, else the last one's: got[] persists across
// calls). Returns the nanoseconds spent, or -1 if a malloc returned NULL.
UMRT_EXPORT int64_t umrt_front_run(int64_t n_ops, const int32_t* op, const uint64_t* arg, uint64_t* got,
                                   int64_t repeat, int device, void* stream) {
  void* (*volatile do_malloc)(ssize_t, int, void*) = &umrt_front_malloc;
  void (*volatile do_free)(void*, ssize_t, int, void*) = &umrt_front_free;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < repeat; ++r) {
    for (int64_t k = 0; k < n_ops; ++k) {
      if (op[k] == 0) {
        void* p = do_malloc(static_cast<ssize_t>(arg[k]), device, stream);
        if (!p) return -1;
        got[k] = reinterpret_cast<uintptr_t>(p);
      } else {
        do_free(reinterpret_cast<void*>(static_cast<uintptr_t>(got[arg[k]])), 0, device, stream);
      }
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}
