/* A fake libcudart for tests/test_steady.py: exports the entry points that
 * umrt_steady_cudart_table (kernels/steady_alloc.cpp) looks up, with the CUDA
 * signatures, and logs each call's arguments as one text line (no GPU needed).
 *
 * Built at test time by the system C compiler, in three variants:
 *   -DFAKE_VERSION=13000              CUDA 13 shapes (cuda_runtime_api.h 13.0)
 *   -DFAKE_VERSION=12080 -DFAKE_V2    CUDA 12.2+: _v2 location shapes and the old device-id shapes
 *   -DFAKE_VERSION=12010              CUDA 12.0/12.1: only the device-id shapes
 * Every variant also exports the batch discards, so a test can see a CUDA 12 table leave them out.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#ifndef FAKE_VERSION
#define FAKE_VERSION 13000
#endif

struct fake_location { int type; int id; }; /* struct cudaMemLocation */

static char g_log[1 << 16];
static size_t g_len;
static int g_fail; /* every call returns this (0: cudaSuccess) */
/* The calling thread's last error, as the CUDA runtime keeps it (cuda_runtime_api.h,
 * cudaGetLastError: "Returns the last error that has been produced by any of the runtime
 * calls in the same instance of the CUDA Runtime library in the host thread and resets it
 * to cudaSuccess"): a failed call sets it, a later successful call leaves it set. */
static __thread int t_last_error;

static int logged(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (g_len < sizeof g_log) {
    int k = vsnprintf(g_log + g_len, sizeof g_log - g_len, fmt, ap);
    if (k > 0) g_len += (size_t)k;
    if (g_len > sizeof g_log - 1) g_len = sizeof g_log - 1;
  }
  va_end(ap);
  if (g_fail) t_last_error = g_fail;
  return g_fail;
}

/* cudaGetLastError: returns the thread's last error and resets it. */
int cudaGetLastError(void) {
  int e = t_last_error;
  t_last_error = 0;
  return e;
}

/* cudaPeekAtLastError: returns it without resetting (what a test reads; and what torch's
 * launch check, cudaGetLastError after each kernel launch, would find). */
int cudaPeekAtLastError(void) { return t_last_error; }

/* The lines logged since the last take (each ends in '\n'); clears the log. */
size_t fake_cudart_take(char* out, size_t n) {
  size_t k = g_len < n - 1 ? g_len : n - 1;
  memcpy(out, g_log, k);
  out[k] = 0;
  g_len = 0;
  return k;
}

void fake_cudart_fail(int code) { g_fail = code; }

int cudaRuntimeGetVersion(int* version) {
  *version = FAKE_VERSION;
  return 0;
}

#if FAKE_VERSION >= 13000
int cudaMemPrefetchAsync(const void* ptr, size_t count, struct fake_location loc, unsigned int flags, void* stream) {
  return logged("cudaMemPrefetchAsync %p %zu loc=%d:%d flags=%u stream=%p\n", ptr, count, loc.type, loc.id, flags,
                stream);
}

int cudaMemAdvise(const void* ptr, size_t count, int advice, struct fake_location loc) {
  return logged("cudaMemAdvise %p %zu advice=%d loc=%d:%d\n", ptr, count, advice, loc.type, loc.id);
}
#else
int cudaMemPrefetchAsync(const void* ptr, size_t count, int device, void* stream) {
  return logged("cudaMemPrefetchAsync(device) %p %zu device=%d stream=%p\n", ptr, count, device, stream);
}

int cudaMemAdvise(const void* ptr, size_t count, int advice, int device) {
  return logged("cudaMemAdvise(device) %p %zu advice=%d device=%d\n", ptr, count, advice, device);
}
#endif

#ifdef FAKE_V2
int cudaMemPrefetchAsync_v2(const void* ptr, size_t count, struct fake_location loc, unsigned int flags,
                            void* stream) {
  return logged("cudaMemPrefetchAsync_v2 %p %zu loc=%d:%d flags=%u stream=%p\n", ptr, count, loc.type, loc.id,
                flags, stream);
}

int cudaMemAdvise_v2(const void* ptr, size_t count, int advice, struct fake_location loc) {
  return logged("cudaMemAdvise_v2 %p %zu advice=%d loc=%d:%d\n", ptr, count, advice, loc.type, loc.id);
}
#endif

static void log_ranges(void** dptrs, size_t* sizes, size_t count) {
  for (size_t i = 0; i < count; ++i) logged(" %p+%zu", dptrs[i], sizes[i]);
}

int cudaMemDiscardBatchAsync(void** dptrs, size_t* sizes, size_t count, unsigned long long flags, void* stream) {
  logged("cudaMemDiscardBatchAsync count=%zu flags=%llu stream=%p ranges=", count, flags, stream);
  log_ranges(dptrs, sizes, count);
  return logged("\n");
}

int cudaMemDiscardAndPrefetchBatchAsync(void** dptrs, size_t* sizes, size_t count, struct fake_location* locs,
                                        size_t* loc_idxs, size_t num_locs, unsigned long long flags, void* stream) {
  logged("cudaMemDiscardAndPrefetchBatchAsync count=%zu locs=%zu", count, num_locs);
  for (size_t i = 0; i < num_locs; ++i) logged(" loc=%d:%d@%zu", locs[i].type, locs[i].id, loc_idxs[i]);
  logged(" flags=%llu stream=%p ranges=", flags, stream);
  log_ranges(dptrs, sizes, count);
  return logged("\n");
}

int cudaEventRecord(void* event, void* stream) { return logged("cudaEventRecord event=%p stream=%p\n", event, stream); }

int cudaStreamWaitEvent(void* stream, void* event, unsigned int flags) {
  return logged("cudaStreamWaitEvent stream=%p event=%p flags=%u\n", stream, event, flags);
}
