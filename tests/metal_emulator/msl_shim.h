// msl_shim.h - just enough of the Metal Shading Language, in C++17, to run MLX `metal_kernel` sources on
// the CPU (g++ >= 12). Test-support code for mlx-dflash; see metal_kernels/README.md ("Emulator").
//
// Execution model: the kernels of one launch run threadgroup after threadgroup; inside a threadgroup
// every GPU thread is a ucontext fiber. A fiber runs until it reaches threadgroup_barrier, a SIMD-group
// collective (simd_sum, simd_shuffle_*, ...) or the end of the kernel. When no fiber can run, the
// scheduler resolves the meeting points:
//   * a collective resolves when every lane of the SIMD group waits on the same call site (results are
//     computed centrally); otherwise -> "divergent collective" error;
//   * a barrier releases when every thread of the threadgroup waits on the same barrier call site;
//     a barrier reached by only part of the threadgroup (others exited or elsewhere) -> "divergent barrier".
// Threadgroup memory is re-poisoned with 0xFF bytes (NaN for float types) before every threadgroup, and
// each fiber runs as far as it can before the next one starts, so reading data another thread has not
// written yet (a missing barrier) reads poison or stale data deterministically.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include <csetjmp>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

// ------------------------------------------------------------------------------------------------
// Scalar types
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef _Float16 float16_t;

struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
  }
  template <class U, class = std::enable_if_t<std::is_arithmetic<U>::value>>
  bfloat16_t(U v) : bits_(from_float(float(v))) {}
  operator float() const {
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  template <class U> bfloat16_t& operator+=(U v) { return *this = float(*this) + float(v); }
  template <class U> bfloat16_t& operator-=(U v) { return *this = float(*this) - float(v); }
  template <class U> bfloat16_t& operator*=(U v) { return *this = float(*this) * float(v); }
  template <class U> bfloat16_t& operator/=(U v) { return *this = float(*this) / float(v); }
};
typedef bfloat16_t bfloat;

template <class T>
struct vec3_ {
  T x, y, z;
};
template <class T>
struct vec2_ {
  T x, y;
};
// 4-vectors: components, [] and dot() only (what the kernels use); no swizzles or vector arithmetic.
template <class T>
struct vec4_ {
  T x, y, z, w;
  vec4_() = default;
  vec4_(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
typedef vec4_<float> float4;
typedef vec4_<uint> uint4;
typedef vec3_<uint> uint3;
typedef vec2_<uint> uint2;
typedef vec3_<ushort> ushort3;
typedef vec2_<ushort> ushort2;

// ------------------------------------------------------------------------------------------------
// Traffic counting (EMU_TRAFFIC builds): the kernel is compiled with -fsanitize=thread, which makes g++
// call __tsan_readN / __tsan_writeN(address) at every memory access; no TSan runtime is linked, these
// definitions count the bytes that fall into a registered buffer or the threadgroup arena. They must not
// be instrumented themselves (no_sanitize_thread), so they touch only the plain globals below.
#ifdef EMU_TRAFFIC
#define EMU_NO_TSAN __attribute__((no_sanitize_thread))
namespace emu_traffic {
static uintptr_t lo[32], hi[32], arena_lo, arena_hi, all_lo, all_hi;
static int nbufs;
static int64_t* read_ = nullptr;  // -> Shared::traffic.read / written / tg_read / tg_written
static int64_t* written_ = nullptr;
static int64_t* tg_ = nullptr;
EMU_NO_TSAN inline __attribute__((always_inline)) void count(void* p, size_t n, int write) {
  const uintptr_t a = (uintptr_t)p;
  if (a - arena_lo < arena_hi - arena_lo) {
    if (tg_) tg_[write] += (int64_t)n;
    return;
  }
  if (a - all_lo >= all_hi - all_lo || !read_) return;
  for (int i = 0; i < nbufs; i++)
    if (a - lo[i] < hi[i] - lo[i]) {
      (write ? written_ : read_)[i] += (int64_t)n;
      return;
    }
}
}  // namespace emu_traffic
extern "C" {
#define EMU_TSAN_N(N)                                                                              \
  EMU_NO_TSAN void __tsan_read##N(void* p) { emu_traffic::count(p, N, 0); }                        \
  EMU_NO_TSAN void __tsan_write##N(void* p) { emu_traffic::count(p, N, 1); }                       \
  EMU_NO_TSAN void __tsan_unaligned_read##N(void* p) { emu_traffic::count(p, N, 0); }              \
  EMU_NO_TSAN void __tsan_unaligned_write##N(void* p) { emu_traffic::count(p, N, 1); }             \
  EMU_NO_TSAN void __tsan_volatile_read##N(void* p) { emu_traffic::count(p, N, 0); }               \
  EMU_NO_TSAN void __tsan_volatile_write##N(void* p) { emu_traffic::count(p, N, 1); }
EMU_TSAN_N(1) EMU_TSAN_N(2) EMU_TSAN_N(4) EMU_TSAN_N(8) EMU_TSAN_N(16)
#undef EMU_TSAN_N
EMU_NO_TSAN void __tsan_read_range(void* p, size_t n) { emu_traffic::count(p, n, 0); }
EMU_NO_TSAN void __tsan_write_range(void* p, size_t n) { emu_traffic::count(p, n, 1); }
EMU_NO_TSAN void __tsan_init() {}
EMU_NO_TSAN void __tsan_func_entry(void*) {}
EMU_NO_TSAN void __tsan_func_exit() {}
EMU_NO_TSAN void __tsan_vptr_update(void*, void*) {}
// Static-local guards (`static Runtime r;`) load their guard byte atomically.
EMU_NO_TSAN unsigned char __tsan_atomic8_load(const volatile unsigned char* a, int) { return *a; }
// Buffers of the next launch: n address ranges [lo, hi), counters (read[n], written[n], tg[2]).
EMU_NO_TSAN void emu_set_regions(int n, const uint64_t* los, const uint64_t* his, int64_t* read, int64_t* written,
                                 int64_t* tg) {
  emu_traffic::nbufs = n < 32 ? n : 32;
  emu_traffic::all_lo = ~uintptr_t(0);
  emu_traffic::all_hi = 0;
  for (int i = 0; i < emu_traffic::nbufs; i++) {
    emu_traffic::lo[i] = (uintptr_t)los[i];
    emu_traffic::hi[i] = (uintptr_t)his[i];
    if (los[i] < emu_traffic::all_lo) emu_traffic::all_lo = (uintptr_t)los[i];
    if (his[i] > emu_traffic::all_hi) emu_traffic::all_hi = (uintptr_t)his[i];
  }
  emu_traffic::read_ = read;
  emu_traffic::written_ = written;
  emu_traffic::tg_ = tg;
}
}
namespace emu {
EMU_NO_TSAN inline void note_arena(void* p, size_t n) {
  emu_traffic::arena_lo = (uintptr_t)p;
  emu_traffic::arena_hi = (uintptr_t)p + n;
}
}  // namespace emu
#else
namespace emu {
inline void note_arena(void*, size_t) {}
}  // namespace emu
#endif

// ------------------------------------------------------------------------------------------------
// Runtime: fibers, scheduler, threadgroup memory
namespace emu {

enum State { RUNNABLE = 0, AT_BARRIER, AT_COLLECTIVE, DONE };
enum Status { OK = 0, DIVERGENT_BARRIER = 1, DIVERGENT_COLLECTIVE = 2, DEADLOCK = 3, CRASH = 4,
              TG_MEMORY = 5, INTERNAL = 6 };

struct Attrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin,
      dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width,
      quadgroup_index_in_threadgroup, thread_index_in_quadgroup, quadgroups_per_threadgroup,
      dispatch_simdgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

constexpr int SIMD = 32;
constexpr int MAX_THREADS = 1024;
constexpr size_t TG_LIMIT = 32768;        // Metal's threadgroup memory limit
constexpr size_t ARENA = 1 << 20;
constexpr size_t STACK = 256 * 1024;
constexpr int SLOT_BYTES = 64;

typedef void (*Resolver)(int n, const unsigned char* in, const int* params, unsigned char* out);

struct Fiber {
  ucontext_t ctx;
  int state;
  long site;  // source call site of the barrier/collective (line * 1000 + occurrence in the line)
  int op;
  Resolver resolve;
  int param;
  alignas(16) unsigned char in[SLOT_BYTES];
  alignas(16) unsigned char out[SLOT_BYTES];
};

struct Stats {
  int64_t threadgroups, switches, barriers, collectives, tg_bytes;
};

// Traffic counters (builds with EMU_TRAFFIC only): bytes loaded from / stored to each kernel buffer and to
// threadgroup memory, counted at every access the compiled kernel makes (no cache model).
constexpr int MAX_BUFS = 32;
struct Traffic {
  int64_t read[MAX_BUFS], written[MAX_BUFS], tg_read, tg_written;
};

struct Site {
  long id;
  explicit Site(long i) : id(i) {}
};

struct TgSlot {
  int64_t launch = -1;
  size_t offset = 0;
};

struct Runtime {
  Fiber* fibers = nullptr;
  char* stacks = nullptr;
  int n = 0;
  int cur = -1;
  ucontext_t sched;
  unsigned char* arena = nullptr;
  bool in_child = false;
  jmp_buf exit_jmp;
  size_t arena_used = 0;
  int64_t launch = 0;
  Stats* stats = nullptr;
  Attrs* attrs = nullptr;
  void* const* bufs = nullptr;
};

inline Runtime& rt() {
  static Runtime r;
  return r;
}

[[noreturn]] inline void fatal(int status, const char* msg);

// The kernel launcher generated by the runner.
extern "C" void emu_kernel_entry(void* const* bufs, const Attrs* a);

inline void yield_blocked() {
  Runtime& r = rt();
  r.stats->switches++;
  swapcontext(&r.fibers[r.cur].ctx, &r.sched);
}

// Threadgroup variables: the runner rewrites `threadgroup T name[D];` into a reference into this arena.
inline void* tg_alloc(TgSlot& slot, size_t bytes, size_t align) {
  Runtime& r = rt();
  if (slot.launch != r.launch) {
    size_t off = (r.arena_used + align - 1) / align * align;
    if (off + bytes > TG_LIMIT) fatal(TG_MEMORY, "threadgroup memory exceeds Metal's 32 KiB limit");
    slot.launch = r.launch;
    slot.offset = off;
    r.arena_used = off + bytes;
    if ((int64_t)r.arena_used > r.stats->tg_bytes) r.stats->tg_bytes = (int64_t)r.arena_used;
  }
  return r.arena + slot.offset;
}

// Meeting point for a SIMD-group collective; returns this lane's result slot.
template <class T>
inline T collective(long site, int op, Resolver res, T value, int param) {
  static_assert(sizeof(T) <= SLOT_BYTES, "collective operand too large");
  Runtime& r = rt();
  Fiber& f = r.fibers[r.cur];
  std::memcpy(f.in, &value, sizeof(T));
  f.param = param;
  f.op = op;
  f.resolve = res;
  f.site = site;
  f.state = AT_COLLECTIVE;
  yield_blocked();
  T out;
  std::memcpy(&out, r.fibers[r.cur].out, sizeof(T));
  return out;
}

inline void barrier(long site) {
  Runtime& r = rt();
  Fiber& f = r.fibers[r.cur];
  f.site = site;
  f.state = AT_BARRIER;
  yield_blocked();
}

// ---- launch ----
struct Shared {  // lives in MAP_SHARED memory so a forked child can report back
  int status;
  Stats stats;
  char msg[2048];
  Traffic traffic;
};
inline Shared*& shared() {
  static Shared* s = nullptr;
  return s;
}

inline void fatal(int status, const char* msg) {
  Shared* s = shared();
  s->status = status;
  std::snprintf(s->msg, sizeof(s->msg), "%s", msg);
  if (rt().in_child) _exit(0);
  longjmp(rt().exit_jmp, 1);  // inline run (use_fork=0): back to emu_run
}

inline void fiber_main() {
  Runtime& r = rt();
  emu_kernel_entry(r.bufs, &r.attrs[r.cur]);
  r.fibers[r.cur].state = DONE;
  swapcontext(&r.fibers[r.cur].ctx, &r.sched);
}

inline const char* state_name(const Fiber& f) {
  switch (f.state) {
    case RUNNABLE: return "running";
    case AT_BARRIER: return "at a threadgroup_barrier";
    case AT_COLLECTIVE: return "at a SIMD collective";
    default: return "exited";
  }
}

inline void describe(char* buf, size_t len, int first, int count) {
  Runtime& r = rt();
  size_t used = std::strlen(buf);
  int i = first;
  while (i < first + count && used + 80 < len) {
    int j = i;
    while (j + 1 < first + count && r.fibers[j + 1].state == r.fibers[i].state &&
           r.fibers[j + 1].site == r.fibers[i].site)
      j++;
    static const char* ops[] = {"?", "simd_sum", "simd_product", "simd_max", "simd_min", "simd_shuffle",
                                "simd_shuffle_down", "simd_shuffle_up", "simd_shuffle_xor", "simd_broadcast",
                                "simd_broadcast_first", "simd_prefix_exclusive_sum",
                                "simd_prefix_inclusive_sum", "simd_all", "simd_any", "simdgroup_barrier"};
    const Fiber& f = r.fibers[i];
    if (f.state == AT_BARRIER)
      used += std::snprintf(buf + used, len - used, "  threads %d-%d at threadgroup_barrier, line %ld #%ld\n",
                            i, j, f.site / 1000, f.site % 1000);
    else if (f.state == AT_COLLECTIVE)
      used += std::snprintf(buf + used, len - used, "  threads %d-%d at %s, line %ld #%ld\n", i, j,
                            ops[(f.op >= 0 && f.op < 16) ? f.op : 0], f.site / 1000, f.site % 1000);
    else
      used += std::snprintf(buf + used, len - used, "  threads %d-%d %s\n", i, j, state_name(r.fibers[i]));
    i = j + 1;
  }
}

// Runs one threadgroup to completion (or reports the first synchronisation error).
inline void run_threadgroup(int n, int reverse) {
  Runtime& r = rt();
  std::memset(r.arena, 0xFF, ARENA);
  r.stats->threadgroups++;
  for (int i = 0; i < n; i++) {
    Fiber& f = r.fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = r.stacks + (size_t)i * STACK;
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = RUNNABLE;
    f.site = 0;
  }
  char msg[2048];
  for (;;) {
    for (int k = 0; k < n; k++) {
      int i = reverse ? n - 1 - k : k;
      if (r.fibers[i].state != RUNNABLE) continue;
      r.cur = i;
      swapcontext(&r.sched, &r.fibers[i].ctx);
    }
    r.cur = -1;
    bool progress = false;
    for (int s0 = 0; s0 < n; s0 += SIMD) {
      int cnt = n - s0 < SIMD ? n - s0 : SIMD;
      int waiting = 0;
      bool same = true;
      const Fiber& lead = r.fibers[s0];
      for (int l = 0; l < cnt; l++) {
        const Fiber& f = r.fibers[s0 + l];
        if (f.state == AT_COLLECTIVE) waiting++;
        if (f.state != AT_COLLECTIVE || f.site != lead.site || f.op != lead.op || f.resolve != lead.resolve)
          same = false;
      }
      if (waiting == 0) continue;
      if (!same) {
        std::snprintf(msg, sizeof(msg),
                      "divergent SIMD collective: simdgroup %d of threadgroup (%u,%u,%u) - %d of %d lanes "
                      "wait on a collective, the lanes are at different points:\n",
                      s0 / SIMD, r.attrs[s0].threadgroup_position_in_grid.x,
                      r.attrs[s0].threadgroup_position_in_grid.y, r.attrs[s0].threadgroup_position_in_grid.z,
                      waiting, cnt);
        describe(msg, sizeof(msg), s0, cnt);
        fatal(DIVERGENT_COLLECTIVE, msg);
      }
      unsigned char in[SIMD * SLOT_BYTES], out[SIMD * SLOT_BYTES];
      int params[SIMD];
      for (int l = 0; l < cnt; l++) {
        std::memcpy(in + l * SLOT_BYTES, r.fibers[s0 + l].in, SLOT_BYTES);
        params[l] = r.fibers[s0 + l].param;
      }
      lead.resolve(cnt, in, params, out);
      for (int l = 0; l < cnt; l++) {
        std::memcpy(r.fibers[s0 + l].out, out + l * SLOT_BYTES, SLOT_BYTES);
        r.fibers[s0 + l].state = RUNNABLE;
      }
      r.stats->collectives++;
      progress = true;
    }
    if (progress) continue;
    int at_barrier = 0, done = 0;
    bool same = true;
    long site = 0;
    for (int i = 0; i < n; i++) {
      const Fiber& f = r.fibers[i];
      if (f.state == DONE) done++;
      if (f.state == AT_BARRIER) {
        if (at_barrier == 0) site = f.site;
        else if (f.site != site) same = false;
        at_barrier++;
      }
    }
    if (done == n) return;
    const uint3 tg = r.attrs[0].threadgroup_position_in_grid;
    if (at_barrier + done == n) {
      if (done == 0 && same) {
        for (int i = 0; i < n; i++) r.fibers[i].state = RUNNABLE;
        r.stats->barriers++;
        continue;
      }
      std::snprintf(msg, sizeof(msg),
                    "divergent threadgroup_barrier in threadgroup (%u,%u,%u): %d of %d threads wait at a "
                    "barrier, %d exited, %s:\n",
                    tg.x, tg.y, tg.z, at_barrier, n, done,
                    same ? "all at the same barrier" : "at different barriers");
      describe(msg, sizeof(msg), 0, n);
      fatal(DIVERGENT_BARRIER, msg);
    }
    std::snprintf(msg, sizeof(msg), "deadlock in threadgroup (%u,%u,%u): no thread can progress:\n", tg.x,
                  tg.y, tg.z);
    describe(msg, sizeof(msg), 0, n);
    fatal(DEADLOCK, msg);
  }
}

inline void release() {
  Runtime& r = rt();
  std::free(r.fibers);
  std::free(r.attrs);
  std::free(r.arena);
  if (r.stacks && r.stacks != MAP_FAILED) munmap(r.stacks, STACK * MAX_THREADS);
  r.fibers = nullptr;
  r.attrs = nullptr;
  r.arena = nullptr;
  r.stacks = nullptr;
}

// In the forked child: an invalid access (e.g. into the PROT_NONE page after a buffer) is reported with the
// faulting address and the GPU thread that made it.
inline void on_fault(int sig, siginfo_t* info, void*) {
  Runtime& r = rt();
  Shared* s = shared();
  s->status = CRASH;
  if (r.cur >= 0 && r.attrs) {
    const Attrs& a = r.attrs[r.cur];
    std::snprintf(s->msg, sizeof(s->msg),
                  "signal %d: invalid memory access at address %p by thread %d of threadgroup (%u,%u,%u)", sig,
                  info->si_addr, r.cur, a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y,
                  a.threadgroup_position_in_grid.z);
  } else {
    std::snprintf(s->msg, sizeof(s->msg), "signal %d: invalid memory access at address %p", sig, info->si_addr);
  }
  _exit(0);
}

inline void install_fault_handler() {
  static char altstack[1 << 16];
  stack_t ss;
  ss.ss_sp = altstack;
  ss.ss_size = sizeof(altstack);
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

inline void run_grid(const unsigned* grid, const unsigned* tgsize, int reverse) {
  Runtime& r = rt();
  unsigned g[3], t[3], ntg[3];
  for (int d = 0; d < 3; d++) {
    g[d] = grid[d] ? grid[d] : 1;
    t[d] = tgsize[d] ? tgsize[d] : 1;
    if (t[d] > g[d]) t[d] = g[d];  // MLX dispatches min(threadgroup, grid)
    ntg[d] = (g[d] + t[d] - 1) / t[d];
  }
  if ((size_t)t[0] * t[1] * t[2] > (size_t)MAX_THREADS) fatal(INTERNAL, "threadgroup larger than 1024 threads");
  r.fibers = (Fiber*)std::calloc(MAX_THREADS, sizeof(Fiber));
  r.attrs = (Attrs*)std::calloc(MAX_THREADS, sizeof(Attrs));
  r.stacks = (char*)mmap(nullptr, STACK * MAX_THREADS, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  r.arena = (unsigned char*)std::aligned_alloc(64, ARENA);
  note_arena(r.arena, ARENA);
  if (!r.fibers || !r.attrs || r.stacks == MAP_FAILED || !r.arena) fatal(INTERNAL, "out of memory");
  r.launch++;
  r.arena_used = 0;
  for (unsigned bz = 0; bz < ntg[2]; bz++)
    for (unsigned by = 0; by < ntg[1]; by++)
      for (unsigned bx = 0; bx < ntg[0]; bx++) {
        unsigned a[3] = {t[0], t[1], t[2]}, b[3] = {bx, by, bz};
        for (int d = 0; d < 3; d++)
          if (b[d] * t[d] + a[d] > g[d]) a[d] = g[d] - b[d] * t[d];  // partial edge threadgroup
        int n = int(a[0] * a[1] * a[2]);
        int i = 0;
        for (unsigned lz = 0; lz < a[2]; lz++)
          for (unsigned ly = 0; ly < a[1]; ly++)
            for (unsigned lx = 0; lx < a[0]; lx++, i++) {
              Attrs& A = r.attrs[i];
              A.thread_position_in_threadgroup = {lx, ly, lz};
              A.threadgroup_position_in_grid = {bx, by, bz};
              A.thread_position_in_grid = {bx * t[0] + lx, by * t[1] + ly, bz * t[2] + lz};
              A.threads_per_threadgroup = {a[0], a[1], a[2]};
              A.dispatch_threads_per_threadgroup = {t[0], t[1], t[2]};
              A.threadgroups_per_grid = {ntg[0], ntg[1], ntg[2]};
              A.threads_per_grid = {g[0], g[1], g[2]};
              A.grid_size = {g[0], g[1], g[2]};
              A.grid_origin = {0, 0, 0};
              A.thread_index_in_threadgroup = uint(i);
              A.thread_index_in_simdgroup = uint(i % SIMD);
              A.simdgroup_index_in_threadgroup = uint(i / SIMD);
              A.simdgroups_per_threadgroup = uint((n + SIMD - 1) / SIMD);
              A.dispatch_simdgroups_per_threadgroup = uint((t[0] * t[1] * t[2] + SIMD - 1) / SIMD);
              A.threads_per_simdgroup = SIMD;
              A.thread_execution_width = SIMD;
              A.quadgroup_index_in_threadgroup = uint(i / 4);
              A.thread_index_in_quadgroup = uint(i % 4);
              A.quadgroups_per_threadgroup = uint((n + 3) / 4);
              A.dispatch_quadgroups_per_threadgroup = uint((t[0] * t[1] * t[2] + 3) / 4);
            }
        r.n = n;
        run_threadgroup(n, reverse);
      }
}

}  // namespace emu

// Entry point called from Python (ctypes). Returns an emu::Status; message/stats in `out_shared`.
// With use_fork the launch runs in a forked child (crash and hang protection, `timeout_s`); buffers and
// `out_shared` must then be MAP_SHARED memory.
extern "C" int emu_run(void* const* bufs, const unsigned* grid, const unsigned* tg, int reverse, int use_fork,
                       double timeout_s, void* out_shared) {
  emu::Shared* sh = (emu::Shared*)out_shared;
  emu::shared() = sh;
  std::memset(sh, 0, sizeof(emu::Shared));
  emu::Runtime& r = emu::rt();
  r.bufs = bufs;
  r.stats = &sh->stats;
  if (!use_fork) {  // no crash/hang protection: for debugging
    r.in_child = false;
    if (setjmp(r.exit_jmp) == 0) {
      emu::run_grid(grid, tg, reverse);
      sh->status = emu::OK;
    }
    emu::release();
    return sh->status;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return emu::INTERNAL;
  if (pid == 0) {
    r.in_child = true;
    emu::install_fault_handler();
    emu::run_grid(grid, tg, reverse);
    sh->status = emu::OK;
    _exit(0);
  }
  struct timespec start, now, pause = {0, 200000};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    int wstatus = 0;
    pid_t got = waitpid(pid, &wstatus, WNOHANG);
    if (got == pid) {
      if (WIFSIGNALED(wstatus)) {
        sh->status = emu::CRASH;
        std::snprintf(sh->msg, sizeof(sh->msg), "kernel crashed with signal %d (%s)", WTERMSIG(wstatus),
                      strsignal(WTERMSIG(wstatus)));
      }
      return sh->status;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    double el = (now.tv_sec - start.tv_sec) + 1e-9 * (now.tv_nsec - start.tv_nsec);
    if (el > timeout_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &wstatus, 0);
      sh->status = emu::DEADLOCK;
      std::snprintf(sh->msg, sizeof(sh->msg),
                    "deadlock: the launch did not finish within %.1f s (a thread spins without reaching a "
                    "barrier or collective, or waits on another threadgroup)",
                    timeout_s);
      return sh->status;
    }
    nanosleep(&pause, nullptr);
  }
}

// ------------------------------------------------------------------------------------------------
// MSL built-ins
namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

// The runner rewrites every call `f(args)` of a barrier/collective into `metal::f(emu::Site(id), args)`
// with id = source line * 1000 + occurrence in that line, so that meeting points compare source sites.
inline void threadgroup_barrier(emu::Site s, mem_flags) { emu::barrier(s.id); }

template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T> inline T abs(T x) { return x < T(0) ? T(-x) : x; }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float dot(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
inline half fma(half a, half b, half c) { return half(std::fma(float(a), float(b), float(c))); }
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float round(float x) { return std::round(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float pow(float x, float y) { return std::pow(x, y); }
inline float fabs(float x) { return std::fabs(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
template <class To, class From> inline To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To t;
  std::memcpy(&t, &v, sizeof(To));
  return t;
}
namespace fast { using metal::exp; using metal::exp2; using metal::log; using metal::rsqrt; using metal::sqrt; using metal::tanh; using metal::pow; }
namespace precise { using metal::exp; using metal::exp2; using metal::log; using metal::rsqrt; using metal::sqrt; using metal::tanh; using metal::pow; }

// ---- SIMD-group collectives (resolved by the scheduler over the lanes present) ----
namespace detail {
enum Op { SUM = 1, PROD, MAX, MIN, SHUFFLE, SHUFFLE_DOWN, SHUFFLE_UP, SHUFFLE_XOR, BROADCAST, BROADCAST_FIRST,
          PREFIX_EXCL, PREFIX_INCL, ALL, ANY, SIMD_BARRIER };

template <class T> inline const T& lane_in(const unsigned char* in, int l) {
  return *reinterpret_cast<const T*>(in + l * emu::SLOT_BYTES);
}
template <class T> inline void lane_out(unsigned char* out, int l, T v) {
  std::memcpy(out + l * emu::SLOT_BYTES, &v, sizeof(T));
}
template <class T> inline void poison_out(unsigned char* out, int l) {
  std::memset(out + l * emu::SLOT_BYTES, 0xFF, sizeof(T));  // NaN for float types
}

template <class T, int OP>
void resolve(int n, const unsigned char* in, const int* p, unsigned char* out) {
  if constexpr (OP == SUM || OP == PROD || OP == MAX || OP == MIN || OP == ALL || OP == ANY) {
    T acc = lane_in<T>(in, 0);
    for (int l = 1; l < n; l++) {
      const T v = lane_in<T>(in, l);
      if constexpr (OP == SUM) acc = T(acc + v);
      if constexpr (OP == PROD) acc = T(acc * v);
      if constexpr (OP == MAX) acc = v > acc ? v : acc;
      if constexpr (OP == MIN) acc = v < acc ? v : acc;
      if constexpr (OP == ALL) acc = T(acc && v);
      if constexpr (OP == ANY) acc = T(acc || v);
    }
    for (int l = 0; l < n; l++) lane_out<T>(out, l, acc);
    return;
  }
  if constexpr (OP == PREFIX_EXCL || OP == PREFIX_INCL) {
    T acc = T(0);
    for (int l = 0; l < n; l++) {
      const T v = lane_in<T>(in, l);
      if constexpr (OP == PREFIX_INCL) acc = T(acc + v);
      lane_out<T>(out, l, acc);
      if constexpr (OP == PREFIX_EXCL) acc = T(acc + v);
    }
    return;
  }
  for (int l = 0; l < n; l++) {
    int src = -1;
    if constexpr (OP == SHUFFLE || OP == BROADCAST) src = p[l];
    if constexpr (OP == SHUFFLE_DOWN) src = l + p[l];
    if constexpr (OP == SHUFFLE_UP) src = l - p[l];
    if constexpr (OP == SHUFFLE_XOR) src = l ^ p[l];
    if constexpr (OP == BROADCAST_FIRST) src = 0;
    if constexpr (OP == SIMD_BARRIER) src = l;
    // Lanes outside the SIMD group (or past a partial group) give poison: do not use those values.
    if (src < 0 || src >= n) poison_out<T>(out, l);
    else lane_out<T>(out, l, lane_in<T>(in, src));
  }
}
}  // namespace detail

#define EMU_COLLECTIVE(NAME, OP)                                                           \
  template <class T> T NAME(emu::Site s, T v) {                                            \
    return emu::collective<T>(s.id, detail::OP, &detail::resolve<T, detail::OP>, v, 0);    \
  }
#define EMU_COLLECTIVE_P(NAME, OP)                                                         \
  template <class T, class I> T NAME(emu::Site s, T v, I p) {                              \
    return emu::collective<T>(s.id, detail::OP, &detail::resolve<T, detail::OP>, v, int(p)); \
  }
EMU_COLLECTIVE(simd_sum, SUM)
EMU_COLLECTIVE(simd_product, PROD)
EMU_COLLECTIVE(simd_max, MAX)
EMU_COLLECTIVE(simd_min, MIN)
EMU_COLLECTIVE(simd_broadcast_first, BROADCAST_FIRST)
EMU_COLLECTIVE(simd_prefix_exclusive_sum, PREFIX_EXCL)
EMU_COLLECTIVE(simd_prefix_inclusive_sum, PREFIX_INCL)
EMU_COLLECTIVE_P(simd_shuffle, SHUFFLE)
EMU_COLLECTIVE_P(simd_shuffle_down, SHUFFLE_DOWN)
EMU_COLLECTIVE_P(simd_shuffle_up, SHUFFLE_UP)
EMU_COLLECTIVE_P(simd_shuffle_xor, SHUFFLE_XOR)
EMU_COLLECTIVE_P(simd_broadcast, BROADCAST)
#undef EMU_COLLECTIVE
#undef EMU_COLLECTIVE_P

inline bool simd_all(emu::Site s, bool v) {
  return emu::collective<bool>(s.id, detail::ALL, &detail::resolve<bool, detail::ALL>, v, 0);
}
inline bool simd_any(emu::Site s, bool v) {
  return emu::collective<bool>(s.id, detail::ANY, &detail::resolve<bool, detail::ANY>, v, 0);
}
inline void simdgroup_barrier(emu::Site s, mem_flags) {
  emu::collective<int>(s.id, detail::SIMD_BARRIER, &detail::resolve<int, detail::SIMD_BARRIER>, 0, 0);
}

// ---- atomics (cooperative fibers on one OS thread: plain read-modify-write is atomic) ----
enum memory_order { memory_order_relaxed = 0 };
template <class T> struct atomic { T v; };
template <class T, class U> inline T atomic_fetch_add_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v; a->v = T(old + x); return old;
}
template <class T, class U> inline T atomic_fetch_max_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v; if (T(x) > old) a->v = T(x); return old;
}
template <class T, class U> inline T atomic_fetch_min_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v; if (T(x) < old) a->v = T(x); return old;
}
template <class T, class U> inline void atomic_store_explicit(atomic<T>* a, U x, memory_order) { a->v = T(x); }
template <class T> inline T atomic_load_explicit(atomic<T>* a, memory_order) { return a->v; }
template <class T, class U> inline T atomic_exchange_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v; a->v = T(x); return old;
}

}  // namespace metal

using namespace metal;

#define METAL_FUNC inline
// Address-space qualifiers vanish (the emulator does not check address spaces).
#define device
#define constant
#define thread
#define threadgroup
