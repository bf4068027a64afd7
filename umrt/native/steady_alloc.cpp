// umrt's native steady state: one iteration's allocation stream, served without Python.
//
// A *steady schedule* is compiled in Python (umrt/native/schedule.py) from a recorded
// steady iteration: for allocation ordinal i its expected size and its planned address,
// and the runtime's decisions (prefetch, discard, discard-and-prefetch, populate, advise,
// and the stream ordering: record an event, make a stream wait for one), keyed by position: "at allocation i" (run before the address is returned)
// or "at the free of allocation i's block". umrt_steady_malloc / umrt_steady_free serve
// that stream, run the decisions through a table of C function pointers that Python sets
// (the CUDA calls; tests fill it with the fake runtime), and append events (Alloc, Free,
// Boundary) to a bounded buffer that Python drains. Anything the schedule does not expect
// (a size, a device, a stream, a planned block overlapping a live one, a decision touching a
// live block that was dead there in the recorded window, a full buffer, a failed call)
// disarms it: malloc returns NULL and the caller falls back to Python.
// Blocks live before arming can be handed to the schedule (umrt_steady_adopt), and every
// live block handed back at once (umrt_steady_disown, which disarms).
//
// Decisions recorded at the CUDA API level (umrt.native.recorder.RecordingApi) carry
// their stream and event handles and replay verbatim; stream 0 means "the table's copy /
// discard stream, else the caller's stream". Besides the schedule, this file has two C
// tables: one over the real libcudart (umrt_steady_cudart_table, dlopen, no CUDA headers)
// and one that only counts calls (umrt_steady_counting_table, for benches and tests).
//
// PythonSteadySchedule (umrt/native/twin.py) is the pure-Python twin; every rule here has its
// line there, and tests/test_steady.py holds both to the same addresses, events and calls.
//
// No CUDA headers: streams are opaque pointers. No Python API: the hot path never takes
// the GIL. One std::mutex per schedule (autograd's backward thread allocates too).
// Built by umrt/native/binding.py with torch.utils.cpp_extension.load (a plain library).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
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

// The constants Python shares with this file, generated from umrt/native/constants.py into
// the build's include path (umrt.native.binding.build_library): kHashMul and kHashMask (the
// running hash), enum Kind (DecisionKind) with kKinds and kCallNames (CALL_NAMES), enum Ev
// (EV_ALLOC, EV_FREE, EV_BOUNDARY) and enum Dev (Deviation: DEV_ + the name).
#include "umrt_steady_constants.h"
// struct umrt_cuda_table, the CUDA calls decisions make (each returns the CUDA error code,
// 0: cudaSuccess; a NULL entry with a decision due disarms the schedule) and the copy /
// discard streams: generated from its ctypes declaration, umrt/native/tables.py's CTable
// (what each field means is said there), into the same include path.
#include "umrt_cuda_table.h"

namespace {

// One allocation's step of the runtime's running hash (umrt.native.constants.mix):
// h = ((h * kHashMul) ^ (size << 1)) & kHashMask. Restarts at 0 every iteration.
inline uint64_t mix(uint64_t h, uint64_t size) { return ((h * kHashMul) ^ (size << 1)) & kHashMask; }

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
  std::vector<uint8_t> starts_iteration;  // 1 at each iteration's first allocation (a cycle of several)
  // Decisions: those at allocation i are [alloc_begin[i], alloc_begin[i+1]), at its free
  // [free_begin[i], free_begin[i+1]); decision d's ranges are [range_begin[d], range_begin[d+1]).
  std::vector<int64_t> alloc_begin, free_begin, range_begin;
  std::vector<int32_t> dec_kind, dec_device, dec_advice;
  std::vector<uint64_t> dec_stream, dec_event;  // 0: the table's / caller's stream; the event handle
  std::vector<uint64_t> range_ptr, range_len;
  // Decision d may touch, of the live blocks, only those of the allocations
  // guard_ordinal[guard_begin[d], guard_begin[d+1]) (live there in the recorded window).
  std::vector<int64_t> guard_begin, guard_ordinal;
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
  // Frees that arrived on the thread running this schedule's decisions (a callback of a
  // Python table can run the garbage collector, which frees a tensor): served after them.
  std::vector<std::pair<uint64_t, void*>> deferred;
};

// Test only: bugs the Hypothesis state machine of tests/test_page_state_machine.py must find,
// planted with umrt_steady_plant_bugs (0 in any real run): 1 drops the live-block check of
// decisions, 2 skips the last-error reset after a failed call.
std::atomic<int> g_planted{0};
constexpr int kBugNoLiveCheck = 1, kBugNoErrorClear = 2;

// The schedule whose decisions this thread is running. Its mutex is held further up this
// thread's stack, so an entry point called again from inside a decision's call must not
// lock it (std::mutex is not recursive): a free is deferred, an allocation declined.
thread_local Schedule* t_inside = nullptr;

struct Inside {
  Schedule* prev;
  explicit Inside(Schedule* s) : prev(t_inside) { t_inside = s; }
  ~Inside() { t_inside = prev; }
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
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

const char* call_name(int32_t kind) { return kCallNames[kind]; }  // kind: checked at creation

void* as_stream(uint64_t handle) { return reinterpret_cast<void*>(static_cast<uintptr_t>(handle)); }

bool table_has(const umrt_cuda_table& t, int32_t kind) {
  switch (kind) {
    case PREFETCH: return t.prefetch != nullptr;
    case DISCARD: return t.discard != nullptr;
    case DISCARD_PREFETCH: return t.discard_prefetch != nullptr;
    case POPULATE: return t.populate != nullptr;
    case ADVISE: return t.advise != nullptr;
    case RECORD_EVENT: return t.record_event != nullptr;
    default: return t.wait_event != nullptr;
  }
}

// Run decisions [begin, end) for a call on `stream`; false (disarmed) at the first that fails.
bool run_decisions(Schedule* s, int64_t begin, int64_t end, void* stream, const char* where, int64_t ordinal) {
  const umrt_cuda_table& t = s->table;
  Inside inside(s);
  for (int64_t d = begin; d < end; ++d) {
    const int32_t kind = s->dec_kind[d], device = s->dec_device[d], advice = s->dec_advice[d];
    const uint64_t own = s->dec_stream[d], event = s->dec_event[d];
    if (!table_has(t, kind)) {
      deviate(s, DEV_NO_TABLE, ordinal, "%s of allocation %lld: the CUDA table has no %s", where,
              static_cast<long long>(ordinal), call_name(kind));
      return false;
    }
    const int64_t r0 = s->range_begin[d], r1 = s->range_begin[d + 1];
    int rc = 0;
    char what[128];
    if (kind == DISCARD || kind == DISCARD_PREFETCH) {
      void* on = own ? as_stream(own) : (t.discard_stream ? t.discard_stream : stream);
      rc = kind == DISCARD ? t.discard(s->range_ptr.data() + r0, s->range_len.data() + r0, r1 - r0, on)
                           : t.discard_prefetch(s->range_ptr.data() + r0, s->range_len.data() + r0, r1 - r0, device, on);
      snprintf(what, sizeof what, "%s(%lld ranges from 0x%llx)", call_name(kind), static_cast<long long>(r1 - r0),
               static_cast<unsigned long long>(r1 > r0 ? s->range_ptr[r0] : 0));
    } else if (kind == RECORD_EVENT || kind == WAIT_EVENT) {
      void* on = own ? as_stream(own) : stream;
      rc = kind == RECORD_EVENT ? t.record_event(event, on) : t.wait_event(on, event);
      snprintf(what, sizeof what, "%s(event 0x%llx, stream 0x%llx)", call_name(kind),
               static_cast<unsigned long long>(event),
               static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(on)));
    } else {
      for (int64_t r = r0; r < r1 && rc == 0; ++r) {
        const uint64_t p = s->range_ptr[r], n = s->range_len[r];
        switch (kind) {
          case PREFETCH:
            rc = t.prefetch(p, n, device, own ? as_stream(own) : (t.copy_stream ? t.copy_stream : stream));
            break;
          case POPULATE: rc = t.populate(p, n, device, own ? as_stream(own) : stream); break;
          default: rc = t.advise(p, n, advice, device); break;
        }
        if (rc != 0) {
          snprintf(what, sizeof what, "%s(0x%llx, %llu)", call_name(kind), static_cast<unsigned long long>(p),
                   static_cast<unsigned long long>(n));
        }
      }
    }
    if (rc != 0) {
      // The error is ours: torch's next launch check must not see it.
      if (t.clear_error && !(g_planted.load(std::memory_order_relaxed) & kBugNoErrorClear)) t.clear_error();
      deviate(s, DEV_CALL, ordinal, "%s of allocation %lld: %s failed with CUDA error %d", where,
              static_cast<long long>(ordinal), what, rc);
      return false;
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

// Decisions [begin, end) touch no live block but those live where they ran in the recorded
// window (a block freed later than recorded is live now, dead there: a discard would destroy
// its data); else deviate (DEV_TOUCH) before any of them runs. Event records and waits touch
// no memory.
bool check_decisions(Schedule* s, int64_t begin, int64_t end, const char* where, int64_t ordinal) {
  if (g_planted.load(std::memory_order_relaxed) & kBugNoLiveCheck) return true;
  for (int64_t d = begin; d < end; ++d) {
    const int32_t kind = s->dec_kind[d];
    if (kind == RECORD_EVENT || kind == WAIT_EVENT) continue;
    const int64_t* g0 = s->guard_ordinal.data() + s->guard_begin[d];
    const int64_t* g1 = s->guard_ordinal.data() + s->guard_begin[d + 1];
    for (int64_t r = s->range_begin[d]; r < s->range_begin[d + 1]; ++r) {
      const uint64_t p = s->range_ptr[r], n = s->range_len[r];
      auto it = s->live.upper_bound(p);
      if (it != s->live.begin()) --it;
      for (; it != s->live.end() && it->first < p + n; ++it) {
        if (it->second.first <= p) continue;
        const int64_t block = it->second.second;
        if (std::find(g0, g1, block) == g1) {
          deviate(s, DEV_TOUCH, ordinal,
                  "%s of allocation %lld: its %s of (0x%llx, %llu) would touch live block 0x%llx of allocation "
                  "%lld, dead at that point of the recorded window",
                  where, static_cast<long long>(ordinal), call_name(kind), static_cast<unsigned long long>(p),
                  static_cast<unsigned long long>(n), static_cast<unsigned long long>(it->first),
                  static_cast<long long>(block));
          return false;
        }
      }
    }
  }
  return true;
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
  const uint64_t h = mix(s->starts_iteration[p] ? 0 : s->hash, size);
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
  auto born = s->live.emplace(addr, std::make_pair(addr + size, p)).first;
  if (!check_decisions(s, s->alloc_begin[p], s->alloc_begin[p + 1], "allocation", p)) {
    s->live.erase(born);
    return nullptr;
  }
  if (s->starts_iteration[p] && (p != 0 || s->position == n)) {  // not the first allocation after arming
    s->iteration += 1;
    s->events.push_back(Event{EV_BOUNDARY, s->iteration, 0, 0});
  }
  s->position = p + 1;
  s->hash = h;
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
  const int64_t begin = s->free_begin[ordinal], end = s->free_begin[ordinal + 1];
  if (s->armed && check_decisions(s, begin, end, "free", ordinal)) run_decisions(s, begin, end, stream, "free", ordinal);
  return 1;
}

}  // namespace

// A schedule (see the file comment for the arrays); NULL if an array is inconsistent.
// iteration_starts: the ordinals where the iterations of the schedule start, ascending,
// the first 0 (one iteration: {0}; a cycle of several when CUDA handles repeat only
// every few iterations). The running hash restarts and EV_BOUNDARY is emitted at each.
// guard_begin (n_decisions + 1 offsets) / guard_ordinal: per decision, the allocations whose
// blocks it may touch (see check_decisions).
UMRT_EXPORT void* umrt_steady_create(int64_t n, const uint64_t* sizes, const uint64_t* addrs,
                                     const int64_t* alloc_begin, const int64_t* free_begin, int64_t n_decisions,
                                     const int32_t* dec_kind, const int32_t* dec_device, const int32_t* dec_advice,
                                     const uint64_t* dec_stream, const uint64_t* dec_event, const int64_t* range_begin, int64_t n_ranges, const uint64_t* range_ptr,
                                     const uint64_t* range_len, int64_t n_starts, const int64_t* iteration_starts,
                                     const int64_t* guard_begin, int64_t n_guards, const int64_t* guard_ordinal,
                                     int64_t capacity) {
  if (n <= 0 || n_decisions < 0 || n_ranges < 0 || n_guards < 0 || capacity < 3 || n_starts < 1 ||
      iteration_starts[0] != 0) {
    return nullptr;
  }
  Schedule* s = new (std::nothrow) Schedule();
  if (!s) return nullptr;
  s->sizes.assign(sizes, sizes + n);
  s->addrs.assign(addrs, addrs + n);
  s->alloc_begin.assign(alloc_begin, alloc_begin + n + 1);
  s->free_begin.assign(free_begin, free_begin + n + 1);
  s->dec_kind.assign(dec_kind, dec_kind + n_decisions);
  s->dec_device.assign(dec_device, dec_device + n_decisions);
  s->dec_advice.assign(dec_advice, dec_advice + n_decisions);
  s->dec_stream.assign(dec_stream, dec_stream + n_decisions);
  s->dec_event.assign(dec_event, dec_event + n_decisions);
  s->range_begin.assign(range_begin, range_begin + n_decisions + 1);
  s->range_ptr.assign(range_ptr, range_ptr + n_ranges);
  s->range_len.assign(range_len, range_len + n_ranges);
  s->guard_begin.assign(guard_begin, guard_begin + n_decisions + 1);
  s->guard_ordinal.assign(guard_ordinal, guard_ordinal + n_guards);
  bool ok = s->alloc_begin[n] <= n_decisions && s->free_begin[n] <= n_decisions &&
            s->range_begin[n_decisions] <= n_ranges && s->guard_begin[0] == 0 && s->guard_begin[n_decisions] <= n_guards;
  for (int64_t i = 0; ok && i < n; ++i) {
    ok = s->alloc_begin[i] <= s->alloc_begin[i + 1] && s->free_begin[i] <= s->free_begin[i + 1] && sizes[i] > 0;
  }
  for (int64_t d = 0; ok && d < n_decisions; ++d) {
    ok = s->range_begin[d] <= s->range_begin[d + 1] && s->guard_begin[d] <= s->guard_begin[d + 1] &&
         dec_kind[d] >= 0 && dec_kind[d] < kKinds;
  }
  s->starts_iteration.assign(static_cast<size_t>(n), 0);
  for (int64_t k = 0; ok && k < n_starts; ++k) {
    ok = iteration_starts[k] >= 0 && iteration_starts[k] < n && (k == 0 || iteration_starts[k] > iteration_starts[k - 1]);
    if (ok) s->starts_iteration[iteration_starts[k]] = 1;
  }
  if (!ok) {
    delete s;
    return nullptr;
  }
  uint64_t h = 0;
  s->hashes.resize(n);
  for (int64_t i = 0; i < n; ++i) s->hashes[i] = h = mix(s->starts_iteration[i] ? 0 : h, sizes[i]);
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

// The decision kinds the schedule has and its table lacks, as a bit mask (1 << kind): a
// schedule with any would disarm at the first such decision, every time it is armed.
UMRT_EXPORT int32_t umrt_steady_missing(void* handle) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  int32_t mask = 0;
  for (const int32_t kind : s->dec_kind) {
    if (!table_has(s->table, kind)) mask |= 1 << kind;
  }
  return mask;
}

UMRT_EXPORT int umrt_steady_armed(void* handle) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->armed ? 1 : 0;
}

namespace {

// The frees deferred while this thread ran the schedule's decisions (called once they ran).
void serve_deferred(Schedule* s) {
  while (!s->deferred.empty() && t_inside != s) {
    const auto [ptr, stream] = s->deferred.front();
    s->deferred.erase(s->deferred.begin());
    serve_free(s, ptr, stream);
  }
}

}  // namespace

// The planned block for this allocation, or NULL (disarmed: the caller falls back).
UMRT_EXPORT void* umrt_steady_malloc(void* handle, uint64_t size, int device, void* stream) {
  Schedule* s = static_cast<Schedule*>(handle);
  if (t_inside == s) {  // from inside one of its own decisions' calls: the lock is ours already
    if (s->armed) {
      const int64_t n = static_cast<int64_t>(s->sizes.size());
      deviate(s, DEV_REENTERED, s->position == n ? 0 : s->position,
              "an allocation of %llu bytes from inside a decision's CUDA call", static_cast<unsigned long long>(size));
    }
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(s->mu);
  void* out = serve_malloc(s, size, device, stream);
  serve_deferred(s);
  return out;
}

// 1: a block this schedule handed out (freed here); 0: not ours (the caller frees it).
UMRT_EXPORT int umrt_steady_free(void* handle, uint64_t ptr, uint64_t size, int device, void* stream) {
  (void)size;
  (void)device;
  Schedule* s = static_cast<Schedule*>(handle);
  if (t_inside == s) {  // from inside one of its own decisions' calls: served once they ran
    if (s->live.find(ptr) == s->live.end()) return 0;
    s->deferred.emplace_back(ptr, stream);
    return 1;
  }
  std::lock_guard<std::mutex> lock(s->mu);
  const int out = serve_free(s, ptr, stream);
  serve_deferred(s);
  return out;
}

// torch's record_stream: the block at `ptr` is used on `stream` too. A schedule serves one
// stream and orders nothing across streams: for a block of its own (live) used on another
// stream it deviates (DEV_STREAM, if armed) and returns 1, so that Python hands back and
// orders the block's next use after that stream; 0 for a block not its own.
UMRT_EXPORT int umrt_steady_record_stream(void* handle, uint64_t ptr, void* stream) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::unique_lock<std::mutex> lock(s->mu, std::defer_lock);
  if (t_inside != s) lock.lock();  // (from inside its decisions' calls the lock is this thread's)
  auto it = s->live.find(ptr);
  if (it == s->live.end()) return 0;
  if (stream == s->stream) return 1;
  if (s->armed) {
    const int64_t n = static_cast<int64_t>(s->sizes.size());
    deviate(s, DEV_STREAM, s->position == n ? 0 : s->position,
            "record_stream: block 0x%llx of allocation %lld is used on stream 0x%llx too",
            static_cast<unsigned long long>(ptr), static_cast<long long>(it->second.second),
            static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream)));
  }
  return 1;
}

// Hand blocks live before arming to the schedule: block k at addrs[k] was allocation
// ordinals[k] of the recorded iteration (its size: that allocation's). Their frees then
// run their free decisions and emit EV_FREE. All or nothing: returns 0, or k + 1 for the
// first block rejected (an ordinal outside the schedule, or overlapping a live block or
// an earlier block of the call), adopting none.
UMRT_EXPORT int64_t umrt_steady_adopt(void* handle, int64_t n, const uint64_t* addrs, const int64_t* ordinals) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  const int64_t total = static_cast<int64_t>(s->sizes.size());
  std::map<uint64_t, std::pair<uint64_t, int64_t>> added;
  for (int64_t k = 0; k < n; ++k) {
    if (ordinals[k] < 0 || ordinals[k] >= total) return k + 1;
    const uint64_t start = addrs[k], end = start + s->sizes[ordinals[k]];
    if (overlapping(s, start, end) != s->live.end()) return k + 1;
    auto it = added.upper_bound(start);
    if (it != added.begin() && std::prev(it)->second.first > start) return k + 1;
    if (it != added.end() && it->first < end) return k + 1;
    added.emplace(start, std::make_pair(end, ordinals[k]));
  }
  s->live.insert(added.begin(), added.end());
  return 0;
}

// Stop serving and hand every live block back (ascending addresses): disarms (if armed:
// deviation STOPPED, "stopped by Python") and empties the live map, so later frees of
// those blocks return 0 (the caller frees them). Buffered events stay drainable. Returns
// how many blocks; if more than `max` are live, returns minus that count and changes nothing.
UMRT_EXPORT int64_t umrt_steady_disown(void* handle, int64_t max, uint64_t* out_addrs, uint64_t* out_sizes,
                                       int64_t* out_ordinals) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  const int64_t live = static_cast<int64_t>(s->live.size());
  if (live > max) return -live;
  if (s->armed) {
    const int64_t n = static_cast<int64_t>(s->sizes.size());
    deviate(s, DEV_STOPPED, s->position == n ? 0 : s->position, "stopped by Python");
  }
  int64_t k = 0;
  for (const auto& [start, entry] : s->live) {
    out_addrs[k] = start;
    out_sizes[k] = entry.first - start;
    out_ordinals[k] = entry.second;
    ++k;
  }
  s->live.clear();
  return k;
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

// Drop every buffered event; returns how many there were (a step's drain when nothing
// in Python reads the events one by one).
UMRT_EXPORT int64_t umrt_steady_clear_events(void* handle) {
  Schedule* s = static_cast<Schedule*>(handle);
  std::lock_guard<std::mutex> lock(s->mu);
  const int64_t n = static_cast<int64_t>(s->events.size());
  s->events.clear();
  return n;
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

// Test only (see g_planted): plant the bugs in `mask` in every schedule of the process.
UMRT_EXPORT void umrt_steady_plant_bugs(int mask) { g_planted.store(mask); }

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

// ---------------------------------------------------------------------------
// A table over the real CUDA runtime (libcudart), found with dlopen: no CUDA headers.
// The few CUDA types, with the values of the CUDA 13.0 headers in /usr/local/cuda/include:
// ---------------------------------------------------------------------------
namespace {

using cudaError = int;  // cudaError_t (driver_types.h): an enum, 0 = cudaSuccess
// enum cudaMemLocationType (driver_types.h:2132): cudaMemLocationTypeDevice = 1, cudaMemLocationTypeHost = 2.
constexpr int kLocationDevice = 1;
constexpr int kLocationHost = 2;
// struct cudaMemLocation (driver_types.h:2147): { enum cudaMemLocationType type; int id; }.
struct CudaMemLocation {
  int type;
  int id;
};
static_assert(sizeof(CudaMemLocation) == 8, "cudaMemLocation is two ints");
static_assert(sizeof(void*) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
              "the batch calls take the range arrays as void** / size_t* directly");

// cuda_runtime_api.h (13.0), the lines named:
// 7152: cudaMemPrefetchAsync(const void*, size_t, struct cudaMemLocation, unsigned int flags, cudaStream_t)
//       (CUDA 12.2+: the same shape is cudaMemPrefetchAsync_v2)
using PrefetchLocFn = cudaError (*)(const void*, size_t, CudaMemLocation, unsigned int, void*);
// 7399: cudaMemAdvise(const void*, size_t, enum cudaMemoryAdvise, struct cudaMemLocation)  (12.2+: _v2)
using AdviseLocFn = cudaError (*)(const void*, size_t, int, CudaMemLocation);
// CUDA 12 before 12.2: cudaMemPrefetchAsync(const void*, size_t, int dstDevice, cudaStream_t) and
// cudaMemAdvise(const void*, size_t, enum cudaMemoryAdvise, int device); -1 = cudaCpuDeviceId
// (driver_types.h:165), what umrt's CUDA 12 adapter (CupyApi) passes.
using PrefetchDevFn = cudaError (*)(const void*, size_t, int, void*);
using AdviseDevFn = cudaError (*)(const void*, size_t, int, int);
// 7226: cudaMemDiscardBatchAsync(void** dptrs, size_t* sizes, size_t count, unsigned long long flags, cudaStream_t)
using DiscardFn = cudaError (*)(void**, size_t*, size_t, unsigned long long, void*);
// 7274: cudaMemDiscardAndPrefetchBatchAsync(void** dptrs, size_t* sizes, size_t count, struct cudaMemLocation*
//       prefetchLocs, size_t* prefetchLocIdxs, size_t numPrefetchLocs, unsigned long long flags, cudaStream_t)
using DiscardPrefetchFn = cudaError (*)(void**, size_t*, size_t, CudaMemLocation*, size_t*, size_t, unsigned long long,
                                        void*);
// 2839: cudaEventRecord(cudaEvent_t, cudaStream_t); 2221: cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int)
using RecordFn = cudaError (*)(void*, void*);
using WaitFn = cudaError (*)(void*, void*, unsigned int);
using VersionFn = cudaError (*)(int*);
// cudaGetLastError(void): returns and resets the calling thread's last error.
using LastErrorFn = cudaError (*)();

// The entry points of the runtime last given to umrt_steady_cudart_table (one per process).
struct Cudart {
  PrefetchLocFn prefetch_loc = nullptr;
  AdviseLocFn advise_loc = nullptr;
  PrefetchDevFn prefetch_dev = nullptr;
  AdviseDevFn advise_dev = nullptr;
  DiscardFn discard = nullptr;
  DiscardPrefetchFn discard_prefetch = nullptr;
  RecordFn record = nullptr;
  WaitFn wait = nullptr;
  LastErrorFn last_error = nullptr;
};
Cudart g_cudart;

// umrt's device -> cudaMemLocation, as BindingsApi._location: -1 (HOST) -> {Host, 0}, else {Device, id}.
CudaMemLocation location_of(int device) {
  return device == -1 ? CudaMemLocation{kLocationHost, 0} : CudaMemLocation{kLocationDevice, device};
}

void* as_ptr(uint64_t p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

int cudart_prefetch(uint64_t ptr, uint64_t nbytes, int device, void* stream) {
  if (g_cudart.prefetch_loc) return g_cudart.prefetch_loc(as_ptr(ptr), nbytes, location_of(device), 0, stream);
  return g_cudart.prefetch_dev(as_ptr(ptr), nbytes, device, stream);
}

int cudart_advise(uint64_t ptr, uint64_t nbytes, int advice, int device) {
  if (g_cudart.advise_loc) return g_cudart.advise_loc(as_ptr(ptr), nbytes, advice, location_of(device));
  return g_cudart.advise_dev(as_ptr(ptr), nbytes, advice, device);
}

int cudart_discard(const uint64_t* ptrs, const uint64_t* lens, int64_t n, void* stream) {
  return g_cudart.discard(reinterpret_cast<void**>(const_cast<uint64_t*>(ptrs)),
                          reinterpret_cast<size_t*>(const_cast<uint64_t*>(lens)), static_cast<size_t>(n), 0, stream);
}

int cudart_discard_prefetch(const uint64_t* ptrs, const uint64_t* lens, int64_t n, int device, void* stream) {
  // As BindingsApi.discard_and_prefetch_batch: one location for all ranges, index 0, flags 0.
  CudaMemLocation loc = location_of(device);
  size_t first = 0;
  return g_cudart.discard_prefetch(reinterpret_cast<void**>(const_cast<uint64_t*>(ptrs)),
                                   reinterpret_cast<size_t*>(const_cast<uint64_t*>(lens)), static_cast<size_t>(n),
                                   &loc, &first, 1, 0, stream);
}

int cudart_record_event(uint64_t event, void* stream) { return g_cudart.record(as_ptr(event), stream); }

int cudart_wait_event(void* stream, uint64_t event) { return g_cudart.wait(stream, as_ptr(event), 0); }

int cudart_clear_error() { return g_cudart.last_error(); }

void put_error(char* err, int64_t errlen, const char* fmt, const char* a, const char* b) {
  if (err && errlen > 0) snprintf(err, static_cast<size_t>(errlen), fmt, a, b);
}

}  // namespace

// Fill `out` with adapters over the libcudart at `path` (the one the process loaded:
// dlopen RTLD_NOLOAD first, else loaded now). CUDA 13 runtimes: the cudaMemLocation
// shapes and both batch discards; CUDA 12 (cudaRuntimeGetVersion < 13000): the _v2
// location shapes where present (12.2+), else the device-id shapes, and no discards
// (NULL: a due discard disarms the schedule). copy_stream / discard_stream are NULL.
// Returns the runtime version, or 0 with a message in `err`. The adapters are
// process-wide: a later call points every table it filled at the new runtime.
UMRT_EXPORT int umrt_steady_cudart_table(const char* libcudart_path, umrt_cuda_table* out, char* err,
                                         int64_t errlen) {
  if (!libcudart_path || !out) {
    put_error(err, errlen, "%s%s", "no libcudart path or no table to fill", "");
    return 0;
  }
  void* lib = dlopen(libcudart_path, RTLD_NOW | RTLD_NOLOAD);
  if (!lib) lib = dlopen(libcudart_path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    put_error(err, errlen, "dlopen(%s) failed: %s", libcudart_path, why ? why : "unknown error");
    return 0;
  }
  auto get_version = reinterpret_cast<VersionFn>(dlsym(lib, "cudaRuntimeGetVersion"));
  int version = 0;
  if (!get_version || get_version(&version) != 0 || version <= 0) {
    put_error(err, errlen, "%s: %s", libcudart_path, "cudaRuntimeGetVersion is missing or failed");
    return 0;
  }
  Cudart c;
  if (version >= 13000) {
    c.prefetch_loc = reinterpret_cast<PrefetchLocFn>(dlsym(lib, "cudaMemPrefetchAsync"));
    c.advise_loc = reinterpret_cast<AdviseLocFn>(dlsym(lib, "cudaMemAdvise"));
    c.discard = reinterpret_cast<DiscardFn>(dlsym(lib, "cudaMemDiscardBatchAsync"));
    c.discard_prefetch = reinterpret_cast<DiscardPrefetchFn>(dlsym(lib, "cudaMemDiscardAndPrefetchBatchAsync"));
  } else {
    c.prefetch_loc = reinterpret_cast<PrefetchLocFn>(dlsym(lib, "cudaMemPrefetchAsync_v2"));
    c.advise_loc = reinterpret_cast<AdviseLocFn>(dlsym(lib, "cudaMemAdvise_v2"));
    if (!c.prefetch_loc) c.prefetch_dev = reinterpret_cast<PrefetchDevFn>(dlsym(lib, "cudaMemPrefetchAsync"));
    if (!c.advise_loc) c.advise_dev = reinterpret_cast<AdviseDevFn>(dlsym(lib, "cudaMemAdvise"));
  }
  c.record = reinterpret_cast<RecordFn>(dlsym(lib, "cudaEventRecord"));
  c.wait = reinterpret_cast<WaitFn>(dlsym(lib, "cudaStreamWaitEvent"));
  c.last_error = reinterpret_cast<LastErrorFn>(dlsym(lib, "cudaGetLastError"));
  const char* missing = nullptr;
  if (!c.prefetch_loc && !c.prefetch_dev) missing = "cudaMemPrefetchAsync";
  else if (!c.advise_loc && !c.advise_dev) missing = "cudaMemAdvise";
  else if (version >= 13000 && !c.discard) missing = "cudaMemDiscardBatchAsync";
  else if (version >= 13000 && !c.discard_prefetch) missing = "cudaMemDiscardAndPrefetchBatchAsync";
  else if (!c.record) missing = "cudaEventRecord";
  else if (!c.wait) missing = "cudaStreamWaitEvent";
  else if (!c.last_error) missing = "cudaGetLastError";
  if (missing) {
    put_error(err, errlen, "%s has no %s", libcudart_path, missing);
    return 0;
  }
  g_cudart = c;
  *out = umrt_cuda_table{};
  out->prefetch = &cudart_prefetch;
  out->populate = &cudart_prefetch;
  out->advise = &cudart_advise;
  out->discard = c.discard ? &cudart_discard : nullptr;
  out->discard_prefetch = c.discard_prefetch ? &cudart_discard_prefetch : nullptr;
  out->record_event = &cudart_record_event;
  out->wait_event = &cudart_wait_event;
  out->clear_error = &cudart_clear_error;
  return version;
}

// ---------------------------------------------------------------------------
// A table that only counts its calls (per kind, atomically) and succeeds: benches and tests.
// ---------------------------------------------------------------------------
namespace {

std::atomic<int64_t> g_counted[kKinds];

int count_prefetch(uint64_t, uint64_t, int, void*) { g_counted[PREFETCH].fetch_add(1, std::memory_order_relaxed); return 0; }
int count_discard(const uint64_t*, const uint64_t*, int64_t, void*) {
  g_counted[DISCARD].fetch_add(1, std::memory_order_relaxed);
  return 0;
}
int count_discard_prefetch(const uint64_t*, const uint64_t*, int64_t, int, void*) {
  g_counted[DISCARD_PREFETCH].fetch_add(1, std::memory_order_relaxed);
  return 0;
}
int count_populate(uint64_t, uint64_t, int, void*) { g_counted[POPULATE].fetch_add(1, std::memory_order_relaxed); return 0; }
int count_advise(uint64_t, uint64_t, int, int) { g_counted[ADVISE].fetch_add(1, std::memory_order_relaxed); return 0; }
int count_record(uint64_t, void*) { g_counted[RECORD_EVENT].fetch_add(1, std::memory_order_relaxed); return 0; }
int count_wait(void*, uint64_t) { g_counted[WAIT_EVENT].fetch_add(1, std::memory_order_relaxed); return 0; }

}  // namespace

// Fill `out` with the counting functions (streams NULL).
UMRT_EXPORT void umrt_steady_counting_table(umrt_cuda_table* out) {
  *out = umrt_cuda_table{&count_prefetch, &count_discard, &count_discard_prefetch, &count_populate, &count_advise,
                         &count_record, &count_wait, nullptr, nullptr, nullptr};
}

// The calls counted per kind (Kind order: prefetch, discard, discard_prefetch, populate,
// advise, record_event, wait_event) since the last reset.
UMRT_EXPORT void umrt_steady_counted(int64_t* out7) {
  for (int k = 0; k < kKinds; ++k) out7[k] = g_counted[k].load(std::memory_order_relaxed);
}

UMRT_EXPORT void umrt_steady_counted_reset() {
  for (int k = 0; k < kKinds; ++k) g_counted[k].store(0, std::memory_order_relaxed);
}
