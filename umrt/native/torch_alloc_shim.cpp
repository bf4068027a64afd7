// umrt's torch allocator shim: lets an out-of-memory reach Python as
// torch.cuda.OutOfMemoryError.
//
// torch's CUDAPluggableAllocator calls
//     void* alloc(size_t size, int device, cudaStream_t stream);
//     void  free(void* ptr, size_t size, int device, cudaStream_t stream);
// (torch/csrc/cuda/CUDAPluggableAllocator.h) and does not check the pointer
// alloc returns. umrt's allocator is Python (ctypes callbacks), and a ctypes
// callback cannot throw. So torch gets umrt_alloc / umrt_free from this
// library instead: they forward to the ctypes callbacks set once with
// umrt_set_callbacks, and when the alloc callback returns NULL for a non-empty
// request, umrt_alloc throws c10::OutOfMemoryError. It unwinds through torch's
// C++ frames to the binding that started the allocation, whose handler
// (CATCH_CORE_ERRORS in torch/csrc/Exceptions.h) raises
// torch.cuda.OutOfMemoryError.
//
// cudaStream_t is only passed through, so it is an opaque pointer here and
// the shim compiles without the CUDA headers (and against a CPU-only torch).
// Built by umrt/allocators/torch.py with torch.utils.cpp_extension.load.
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <pybind11/pybind11.h>

#define UMRT_EXPORT extern "C" __attribute__((visibility("default")))

typedef void* umrt_stream_t;  // cudaStream_t, passed through untouched
typedef void* (*umrt_alloc_fn)(ssize_t, int, umrt_stream_t);
typedef void (*umrt_free_fn)(void*, ssize_t, int, umrt_stream_t);
typedef void (*umrt_record_fn)(void*, umrt_stream_t);

namespace {
std::atomic<umrt_alloc_fn> g_alloc{nullptr};
std::atomic<umrt_free_fn> g_free{nullptr};
std::atomic<umrt_record_fn> g_record{nullptr};
// Why the last allocation on this thread failed (set by the Python callback).
thread_local std::string t_error;
}  // namespace

// Point the shim at umrt's allocation callbacks (the ctypes function pointers).
UMRT_EXPORT void umrt_set_callbacks(umrt_alloc_fn alloc_fp, umrt_free_fn free_fp) {
  g_alloc.store(alloc_fp);
  g_free.store(free_fp);
}

// Where umrt_record_stream forwards (umrt's record-stream callback; NULL: nowhere).
UMRT_EXPORT void umrt_set_record_stream(umrt_record_fn record_fp) { g_record.store(record_fp); }

// Called by the alloc callback, before it returns NULL, with the pool's error.
UMRT_EXPORT void umrt_set_error(const char* message) {
  t_error = message ? message : "";
}

UMRT_EXPORT void* umrt_alloc(ssize_t size, int device, umrt_stream_t stream) {
  umrt_alloc_fn alloc_fp = g_alloc.load();
  TORCH_CHECK(alloc_fp != nullptr, "umrt allocator shim: umrt_alloc called before umrt_set_callbacks");
  if (size <= 0) {
    return nullptr;  // torch asks for zero bytes and expects NULL
  }
  t_error.clear();
  void* ptr = alloc_fp(size, device, stream);
  if (ptr == nullptr) {
    std::string why = t_error.empty() ? std::string("the pool returned no memory") : t_error;
    t_error.clear();
    TORCH_CHECK_WITH(
        OutOfMemoryError, false,
        "umrt: out of managed memory: allocating ", size, " bytes on cuda:", device,
        " failed: ", why,
        ". Managed memory runs out only when host memory does: lower the batch size or free host memory.");
  }
  return ptr;
}

// Never throws: torch frees from destructors.
UMRT_EXPORT void umrt_free(void* ptr, ssize_t size, int device, umrt_stream_t stream) noexcept {
  umrt_free_fn free_fp = g_free.load();
  if (ptr != nullptr && free_fp != nullptr) {
    free_fp(ptr, size, device, stream);
  }
}

// torch's Tensor.record_stream(stream) on a block of this allocator: CUDAPluggableAllocator::
// recordStream calls the function given to set_record_stream_fn (torch/csrc/cuda/
// CUDAPluggableAllocator.cpp) with the block's pointer and the stream. Never throws.
UMRT_EXPORT void umrt_record_stream(void* ptr, umrt_stream_t stream) noexcept {
  umrt_record_fn record_fp = g_record.load();
  if (ptr != nullptr && record_fp != nullptr) {
    record_fp(ptr, stream);
  }
}

// Test hook: umrt_alloc called the way CUDAPluggableAllocator::malloc calls
// it (through a std::function<void*(size_t, int, cudaStream_t)>), inside
// torch's own error translation (the HANDLE_TH_ERRORS / CATCH_CORE_ERRORS
// that torch's tensor bindings use), so a test without a GPU sees the Python
// exception torch would raise.
static int64_t try_alloc(int64_t size, int64_t device) {
  HANDLE_TH_ERRORS
  std::function<void*(size_t, int, umrt_stream_t)> alloc_fn =
      reinterpret_cast<void* (*)(size_t, int, umrt_stream_t)>(&umrt_alloc);
  return reinterpret_cast<int64_t>(alloc_fn(static_cast<size_t>(size), static_cast<int>(device), nullptr));
  END_HANDLE_TH_ERRORS_PYBIND
}

static void try_free(int64_t ptr, int64_t size, int64_t device) {
  umrt_free(reinterpret_cast<void*>(ptr), static_cast<ssize_t>(size), static_cast<int>(device), nullptr);
}

static void try_record_stream(int64_t ptr, int64_t stream) {
  std::function<void(void*, umrt_stream_t)> record_fn = &umrt_record_stream;  // as torch holds it
  record_fn(reinterpret_cast<void*>(ptr), reinterpret_cast<umrt_stream_t>(stream));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "umrt's torch allocator shim (umrt_alloc / umrt_free for CUDAPluggableAllocator)";
  m.def("_try_alloc", &try_alloc, "umrt_alloc(size, device, NULL) under torch's error translation",
        pybind11::arg("size"), pybind11::arg("device") = 0);
  m.def("_try_free", &try_free, "umrt_free(ptr, size, device, NULL)",
        pybind11::arg("ptr"), pybind11::arg("size"), pybind11::arg("device") = 0);
  m.def("_try_record_stream", &try_record_stream, "umrt_record_stream(ptr, stream) as torch's recordStream calls it",
        pybind11::arg("ptr"), pybind11::arg("stream"));
}
