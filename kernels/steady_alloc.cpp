// umrt's native steady state: one iteration's allocation stream, served without Python.
//
// A *steady schedule* is compiled in Python (umrt/allocators/steady.py) from a recorded
// steady iteration: for allocation ordinal i its expected size and its planned address,
// and the runtime's decisions (prefetch, discard, discard-and-prefetch, populate, advise),
// coalesced and keyed by position: "at allocation i" (run before the address is returned)
// or "at the free of allocation i's block". umrt_steady_malloc / umrt_steady_free serve
// that stream, run the decisions through a table of C function pointers that Python sets
// (the CUDA calls; tests fill it with the fake runtime), and append events (Alloc, Free,
// Boundary) to a bounded buffer that Python drains. Anything the schedule does not expect
// (a size, a device, a stream, a planned block overlapping a live one, a full buffer, a
// failed call) disarms it: malloc returns NULL and the caller falls back to Python.
//
// PythonSteadySchedule (same module) is the pure-Python twin; every rule here has its
// line there, and tests/test_steady.py holds both to the same addresses, events and calls.
//
// No CUDA headers: streams are opaque pointers. No Python API: the hot path never takes
// the GIL. One std::mutex per schedule (autograd's backward thread allocates too).
// Built by umrt/allocators/steady.py with torch.utils.cpp_extension.load (a plain library).
#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#define UMRT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// The runtime's running hash (umrt/policy/runtime/policy.py, an allocation's step):
// h = ((h * 1000003) ^ (size << 1)) & (2^63 - 1). Restarts at 0 every iteration.
constexpr uint64_t kHashMul = 1000003ULL;
constexpr uint64_t kHashMask = (1ULL << 63) - 1;

inline uint64_t mix(uint64_t h, uint64_t size) { return ((h * kHashMul) ^ (size << 1)) & kHashMask; }

// Decision kinds (steady.py: DecisionKind).
enum Kind : int32_t { PREFETCH = 0, DISCARD = 1, DISCARD_PREFETCH = 2, POPULATE = 3, ADVISE = 4 };
// Event kinds (steady.py: EV_ALLOC, EV_FREE, EV_BOUNDARY).
enum Ev : int32_t { EV_ALLOC = 0, EV_FREE = 1, EV_BOUNDARY = 2 };
// Deviation codes (steady.py: Deviation).
enum Dev : int32_t {
  DEV_NONE = 0, DEV_SIZE = 1, DEV_HASH = 2, DEV_LIVE = 3, DEV_BUFFER = 4, DEV_CALL = 5, DEV_DEVICE = 6,
  DEV_STREAM = 7, DEV_NO_TABLE = 8
};

}  // namespace

// The CUDA calls decisions make; each returns the CUDA error code (0: cudaSuccess).
// A NULL entry with a decision due disarms the schedule. copy_stream: where prefetches
// go (NULL: the caller's stream); discard_stream: where discards and discard-and-
// prefetches go (NULL: the caller's stream). Populates run on the caller's stream.
struct umrt_cuda_table {
  int (*prefetch)(uint64_t ptr, uint64_t nbytes, int device, void* stream);
  int (*discard)(uint64_t ptr, uint64_t nbytes, void* stream);
  int (*discard_prefetch)(uint64_t ptr, uint64_t nbytes, int device, void* stream);
  int (*populate)(uint64_t ptr, uint64_t nbytes, int device, void* stream);
  int (*advise)(uint64_t ptr, uint64_t nbytes, int advice, int device);
  void* copy_stream;
  void* discard_stream;
};

namespace {

struct Event {
  int32_t kind;
  int64_t ordinal;  // the allocation ordinal (EV_BOUNDARY: the iteration that starts)
  uint64_t ptr;
  uint64_t size;
};

struct Schedule {
  std::mutex mu;
  // The allocation stream.
  std::vector<uint64_t> sizes, addrs, hashes;
  // Decisions: those at allocation i are [alloc_begin[i], alloc_begin[i+1]), at its free
  // [free_begin[i], free_begin[i+1]); decision d's ranges are [range_begin[d], range_begin[d+1]).
  std::vector<int64_t> alloc_begin, free_begin, range_begin;
  std::vector<int32_t> dec_kind, dec_device, dec_advice;
  std::vector<uint64_t> range_ptr, range_len;
  umrt_cuda_table table{};
  // State.
  bool armed = false;
  void* stream = nullptr;
  int device = 0;
  int64_t position = 0;   // the next allocation ordinal
  int64_t iteration = 0;  // wraps so far
  uint64_t hash = 0;
  std::map<uint64_t, std::pair<uint64_t, int64_t>> live;  // start -> (end, ordinal)
  std::vector<Event> events;
  size_t capacity = 0;
  int32_t deviation = DEV_NONE;
  int64_t deviation_position = -1;
  std::string reason;
};

void deviate(Schedule* s, int32_t code, int64_t position, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

void deviate(Schedule* s, int32_t code, int64_t position, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  s->armed = false;
  s->deviation = code;
  s->deviation_position = position;
  s->reason = buf;
}

const char* call_name(int32_t kind) {
  switch (kind) {
    case PREFETCH: return "prefetch";
    case DISCARD: return "discard";
    case DISCARD_PREFETCH: return "discard_prefetch";
    case POPULATE: return "populate";
    default: return "advise";
  }
}

// Run decisions [begin, end) on `stream`; false (disarmed) at the first that fails.
bool run_decisions(Schedule* s, int64_t begin, int64_t end, void* stream, const char* where, int64_t ordinal) {
  const umrt_cuda_table& t = s->table;
  for (int64_t d = begin; d < end; ++d) {
    const int32_t kind = s->dec_kind[d], device = s->dec_device[d], advice = s->dec_advice[d];
    bool has = (kind == PREFETCH && t.prefetch) || (kind == DISCARD && t.discard) ||
               (kind == DISCARD_PREFETCH && t.discard_prefetch) || (kind == POPULATE && t.populate) ||
               (kind == ADVISE && t.advise);
    if (!has) {
      deviate(s, DEV_NO_TABLE, ordinal, "%s of allocation %lld: the CUDA table has no %s", where,
              static_cast<long long>(ordinal), call_name(kind));
      return false;
    }
    for (int64_t r = s->range_begin[d]; r < s->range_begin[d + 1]; ++r) {
      const uint64_t p = s->range_ptr[r], n = s->range_len[r];
      int rc = 0;
      switch (kind) {
        case PREFETCH: rc = t.prefetch(p, n, device, t.copy_stream ? t.copy_stream : stream); break;
        case DISCARD: rc = t.discard(p, n, t.discard_stream ? t.discard_stream : stream); break;
        case DISCARD_PREFETCH:
          rc = t.discard_prefetch(p, n, device, t.discard_stream ? t.discard_stream : stream); break;
        case POPULATE: rc = t.populate(p, n, device, stream); break;
        default: rc = t.advise(p, n, advice, device); break;
      }
      if (rc != 0) {
        deviate(s, DEV_CALL, ordinal, "%s of allocation %lld: %s(0x%llx, %llu) failed with CUDA error %d", where,
                static_cast<long long>(ordinal), call_name(kind), static_cast<unsigned long long>(p),
                static_cast<unsigned long long>(n), rc);
        return false;
      }
    }
  }
  return true;
}

// The live block overlapping [start, end), or live.end().
std::map<uint64_t, std::pair<uint64_t, int64_t>>::iterator overlapping(Schedule* s, uint64_t start, uint64_t end) {
  auto it = s->live.upper_bound(start);
  if (it != s->live.begin()) {
    auto prev = std::prev(it);
    if (prev->second.first > start) return prev;
  }
  if (it != s->live.end() && it->first < end) return it;
  return s->live.end();
}

void* serve_malloc(Schedule* s, uint64_t size, int device, void* stream) {
  if (!s->armed) return nullptr;
  const int64_t n = static_cast<int64_t>(s->sizes.size());
  const int64_t p = s->position == n ? 0 : s->position;  // the end of the stream wraps
  if (device != s->device) {
    deviate(s, DEV_DEVICE, p, "allocation %lld: device %d, the schedule serves device %d",
            static_cast<long long>(p), device, s->device);
    return nullptr;
  }
  if (stream != s->stream) {
    deviate(s, DEV_STREAM, p, "allocation %lld: stream 0x%llx, the schedule serves stream 0x%llx",
            static_cast<long long>(p), static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream)),
            static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(s->stream)));
    return nullptr;
  }
  // Room for this allocation, a boundary, and the free of every live block (frees always fit).
  if (s->events.size() + s->live.size() + 3 > s->capacity) {
    deviate(s, DEV_BUFFER, p, "allocation %lld: the event buffer is full (%zu events not drained, capacity %zu)",
            static_cast<long long>(p), s->events.size(), s->capacity);
    return nullptr;
  }
  if (size != s->sizes[p]) {
    deviate(s, DEV_SIZE, p, "allocation %lld: %llu bytes, the schedule expects %llu", static_cast<long long>(p),
            static_cast<unsigned long long>(size), static_cast<unsigned long long>(s->sizes[p]));
    return nullptr;
  }
  const uint64_t h = mix(p == 0 ? 0 : s->hash, size);
  if (h != s->hashes[p]) {
    deviate(s, DEV_HASH, p, "allocation %lld: running hash %llu, the schedule expects %llu",
            static_cast<long long>(p), static_cast<unsigned long long>(h),
            static_cast<unsigned long long>(s->hashes[p]));
    return nullptr;
  }
  const uint64_t addr = s->addrs[p];
  auto hit = overlapping(s, addr, addr + size);
  if (hit != s->live.end()) {
    deviate(s, DEV_LIVE, p, "allocation %lld: its block 0x%llx (+%llu) overlaps live block 0x%llx of allocation %lld",
            static_cast<long long>(p), static_cast<unsigned long long>(addr), static_cast<unsigned long long>(size),
            static_cast<unsigned long long>(hit->first), static_cast<long long>(hit->second.second));
    return nullptr;
  }
  if (p == 0 && s->position == n) {
    s->iteration += 1;
    s->events.push_back(Event{EV_BOUNDARY, s->iteration, 0, 0});
  }
  s->position = p + 1;
  s->hash = h;
  s->live.emplace(addr, std::make_pair(addr + size, p));
  s->events.push_back(Event{EV_ALLOC, p, addr, size});
  run_decisions(s, s->alloc_begin[p], s->alloc_begin[p + 1], stream, "allocation", p);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(addr));
}

int serve_free(Schedule* s, uint64_t ptr, void* stream) {
  auto it = s->live.find(ptr);
  if (it == s->live.end()) return 0;
  const int64_t ordinal = it->second.second;
  s->live.erase(it);
  s->events.push_back(Event{EV_FREE, ordinal, ptr, s->sizes[ordinal]});
  if (s->armed) run_decisions(s, s->free_begin[ordinal], s->free_begin[ordinal + 1], stream, "free", ordinal);
  return 1;
}

}  // namespace

// A schedule (see the file comment for the arrays); NULL if an array is inconsistent.
UMRT_EXPORT void* umrt_steady_create(int64_t n, const uint64_t* sizes, const uint64_t* addrs,
                                     const int64_t* alloc_begin, const int64_t* free_begin, int64_t n_decisions,
                                     const int32_t* dec_kind, const int32_t* dec_device, const int32_t* dec_advice,
                                     const int64_t* range_begin, int64_t n_ranges, const uint64_t* range_ptr,
                                     const uint64_t* range_len, int64_t capacity) {
  if (n <= 0 || n_decisions < 0 || n_ranges < 0 || capacity < 3) return nullptr;
  Schedule* s = new (std::nothrow) Schedule();
  if (!s) return nullptr;
  s->sizes.assign(sizes, sizes + n);
  s->addrs.assign(addrs, addrs + n);
  s->alloc_begin.assign(alloc_begin, alloc_begin + n + 1);
  s->free_begin.assign(free_begin, free_begin + n + 1);
  s->dec_kind.assign(dec_kind, dec_kind + n_decisions);
  s->dec_device.assign(dec_device, dec_device + n_decisions);
  s->dec_advice.assign(dec_advice, dec_advice + n_decisions);
  s->range_begin.assign(range_begin, range_begin + n_decisions + 1);
  s->range_ptr.assign(range_ptr, range_ptr + n_ranges);
  s->range_len.assign(range_len, range_len + n_ranges);
  bool ok = s->alloc_begin[n] <= n_decisions && s->free_begin[n] <= n_decisions && s->range_begin[n_decisions] <= n_ranges;
  for (int64_t i = 0; ok && i < n; ++i) {
    ok = s->alloc_begin[i] <= s->alloc_begin[i + 1] && s->free_begin[i] <= s->free_begin[i + 1] && sizes[i] > 0;
  }
  for (int64_t d = 0; ok && d < n_decisions; ++d) ok = s->range_begin[d] <= s->range_begin[d + 1];
  if (!ok) {
    delete s;
    return nullptr;
  }
  uint64_t h = 0;
  s->hashes.resize(n);
  for (int64_t i = 0; i < n; ++i) s->hashes[i] = h = mix(h, sizes[i]);
  s->capacity = static_cast<size_t>(capacity);
  s->events.reserve(s->capacity);
  return s;
}

UMRT_EXPORT void umrt_steady_destroy(void* handle) { delete static_cast<Schedule*>(handle); }

UMRT_EXPORT void umrt_steady_set_table(void* handle, const umrt_cuda_table* table) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  s->table = table ? *table : umrt_cuda_table{};
}

// Serve the stream from its start (allocation 0, hash 0) on `device` and `stream`.
// Blocks still live stay live; the deviation is cleared.
UMRT_EXPORT void umrt_steady_arm(void* handle, int device, void* stream) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  s->armed = true;
  s->device = device;
  s->stream = stream;
  s->position = 0;
  s->hash = 0;
  s->deviation = DEV_NONE;
  s->deviation_position = -1;
  s->reason.clear();
}

UMRT_EXPORT int umrt_steady_armed(void* handle) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->armed ? 1 : 0;
}

// The planned block for this allocation, or NULL (disarmed: the caller falls back).
UMRT_EXPORT void* umrt_steady_malloc(void* handle, uint64_t size, int device, void* stream) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  return serve_malloc(s, size, device, stream);
}

// 1: a block this schedule handed out (freed here); 0: not ours (the caller frees it).
UMRT_EXPORT int umrt_steady_free(void* handle, uint64_t ptr, uint64_t size, int device, void* stream) {
  (void)size;
  (void)device;
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  return serve_free(s, ptr, stream);
}

// Move up to `max` buffered events, oldest first, into the arrays; returns how many.
UMRT_EXPORT int64_t umrt_steady_drain(void* handle, int32_t* kinds, int64_t* ordinals, uint64_t* ptrs,
                                      uint64_t* sizes, int64_t max) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  const size_t k = std::min(s->events.size(), static_cast<size_t>(max < 0 ? 0 : max));
  for (size_t i = 0; i < k; ++i) {
    const Event& e = s->events[i];
    kinds[i] = e.kind;
    ordinals[i] = e.ordinal;
    ptrs[i] = e.ptr;
    sizes[i] = e.size;
  }
  s->events.erase(s->events.begin(), s->events.begin() + static_cast<std::ptrdiff_t>(k));
  return static_cast<int64_t>(k);
}

// The deviation that disarmed the schedule (0: none); its message and position.
UMRT_EXPORT int32_t umrt_steady_deviation(void* handle, char* message, int64_t length, int64_t* position) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  if (message && length > 0) snprintf(message, static_cast<size_t>(length), "%s", s->reason.c_str());
  if (position) *position = s->deviation_position;
  return s->deviation;
}

// position (next ordinal), iteration (wraps so far), live blocks, buffered events.
UMRT_EXPORT void umrt_steady_state(void* handle, int64_t* out4) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  out4[0] = s->position;
  out4[1] = s->iteration;
  out4[2] = static_cast<int64_t>(s->live.size());
  out4[3] = static_cast<int64_t>(s->events.size());
}

// Bench baselines: empty functions with the signatures of malloc and free (a ctypes
// call's own cost). The empty malloc returns the handle (a non-NULL pointer, as a served one).
UMRT_EXPORT void* umrt_steady_noop_malloc(void* handle, uint64_t size, int device, void* stream) {
  (void)size; (void)device; (void)stream;
  return handle;  // non-NULL, like a served allocation
}

UMRT_EXPORT int umrt_steady_noop_free(void* handle, uint64_t ptr, uint64_t size, int device, void* stream) {
  (void)handle; (void)ptr; (void)size; (void)device; (void)stream;
  return 0;
}

// Bench harness (no ctypes in the loop): run `repeat` times a stream of `n_ops`
// operations through umrt_steady_malloc / umrt_steady_free, the way torch's allocator
// calls them (through C function pointers); op[k] = 0: malloc of arg[k] bytes; 1: free of
// the block returned by operation arg[k] (in this repeat if it came earlier, else in the
// last one: got[] holds each operation's block and persists across calls; zeros at first).
// Events are drained (dropped) after each repeat.
// Returns the nanoseconds spent, or -1 if a malloc returned NULL.
UMRT_EXPORT int64_t umrt_steady_run(void* handle, int64_t n_ops, const int32_t* op, const uint64_t* arg,
                                    uint64_t* got, int64_t repeat, int device, void* stream) {
  Schedule* s = static_cast<Schedule*>(handle);
  void* (*volatile do_malloc)(void*, uint64_t, int, void*) = &umrt_steady_malloc;
  int (*volatile do_free)(void*, uint64_t, uint64_t, int, void*) = &umrt_steady_free;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < repeat; ++r) {
    for (int64_t k = 0; k < n_ops; ++k) {
      if (op[k] == 0) {
        void* p = do_malloc(handle, arg[k], device, stream);
        if (!p) return -1;
        got[k] = reinterpret_cast<uintptr_t>(p);
      } else {
        do_free(handle, got[arg[k]], 0, device, stream);
      }
    }
    std::lock_guard<std::mutex> lock(s->mu);
    s->events.clear();
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}
