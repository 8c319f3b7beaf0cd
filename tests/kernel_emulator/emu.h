// Runs a GPU kernel's source on the CPU, for tests: every thread of a thread group is a fiber on
// one OS thread; SIMD-group shuffles and group barriers switch fibers until every live lane of the
// SIMD group (or thread group) has arrived. Thread groups run one after another, so shared
// (threadgroup) arrays are function-static. Then the backend's names: EMU_METAL spells MLX's
// Metal kernels (address spaces erased, metal:: math, simd_shuffle_xor), EMU_CUDA MLX's CUDA ones.
// A shuffle or barrier reached by some lanes only is a deadlock: the launch fails with -1.
#pragma once
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>

namespace emu {
struct Dim3 { unsigned x, y, z; };
enum State { RUN, WAIT_SIMD, WAIT_GROUP, DONE };
struct Lane { State state; bool started; jmp_buf jb; ucontext_t uc; };
struct Ctx {
  Dim3 grid{}, tg{}, groups{}, group{}, full_tg{};  // tg: this group's threads (a partial group at the edge has fewer)
  unsigned n = 0, cur = 0;
  std::vector<Lane> lanes;
  std::vector<char> stacks;
  jmp_buf sched;
  ucontext_t sched_uc;
  uint64_t xchg[1024];
  std::function<void()> body;
};
inline Ctx& C() { static Ctx c; return c; }
constexpr size_t STACK = 256 * 1024;

inline void park(State s) {
  Ctx& c = C();
  c.lanes[c.cur].state = s;
  if (!_setjmp(c.lanes[c.cur].jb)) _longjmp(c.sched, 1);
}
inline void trampoline() {
  C().body();
  C().lanes[C().cur].state = DONE;
  _longjmp(C().sched, 1);
}
inline unsigned tid() { return C().cur; }
inline unsigned lane() { return C().cur % 32; }
inline unsigned simd() { return C().cur / 32; }
inline Dim3 tid3() { return {C().cur % C().tg.x, (C().cur / C().tg.x) % C().tg.y, C().cur / (C().tg.x * C().tg.y)}; }
inline Dim3 group3() { return C().group; }
inline Dim3 groups3() { return C().groups; }
inline Dim3 tg3() { return C().tg; }
inline Dim3 pos3() {  // a partial group at the grid's edge starts where a whole one would
  Dim3 t = tid3(), g = C().group, s = C().full_tg;
  return {g.x * s.x + t.x, g.y * s.y + t.y, g.z * s.z + t.z};
}

template <class T> T shuffle_xor(T v, unsigned mask) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  Ctx& c = C();
  std::memcpy(&c.xchg[c.cur], &v, sizeof(T));
  park(WAIT_SIMD);
  T r;
  std::memcpy(&r, &c.xchg[simd() * 32 + (lane() ^ mask)], sizeof(T));
  park(WAIT_SIMD);  // nobody overwrites a slot before every lane has read
  return r;
}
inline void barrier() { park(WAIT_GROUP); }

// Releases the lanes waiting on a SIMD group or the thread group once every live lane waits there.
inline bool release() {
  Ctx& c = C();
  bool any = false;
  for (unsigned s = 0; s * 32 < c.n; ++s) {
    unsigned lo = s * 32, hi = lo + 32 < c.n ? lo + 32 : c.n, waiting = 0, live = 0;
    for (unsigned i = lo; i < hi; ++i) {
      live += c.lanes[i].state != DONE;
      waiting += c.lanes[i].state == WAIT_SIMD;
    }
    if (waiting && waiting == live) {
      for (unsigned i = lo; i < hi; ++i) if (c.lanes[i].state == WAIT_SIMD) c.lanes[i].state = RUN;
      any = true;
    }
  }
  unsigned waiting = 0, live = 0;
  for (unsigned i = 0; i < c.n; ++i) {
    live += c.lanes[i].state != DONE;
    waiting += c.lanes[i].state == WAIT_GROUP;
  }
  if (waiting && waiting == live) {
    for (unsigned i = 0; i < c.n; ++i) if (c.lanes[i].state == WAIT_GROUP) c.lanes[i].state = RUN;
    any = true;
  }
  return any;
}

inline int run_group(unsigned n) {
  Ctx& c = C();
  c.n = n;
  c.lanes.assign(n, Lane{});
  if (c.stacks.size() < n * STACK) c.stacks.resize(n * STACK);
  for (unsigned i = 0; i < n; ++i) {
    Lane& l = c.lanes[i];
    l.state = RUN;
    getcontext(&l.uc);
    l.uc.uc_stack.ss_sp = c.stacks.data() + i * STACK;
    l.uc.uc_stack.ss_size = STACK;
    l.uc.uc_link = nullptr;
    makecontext(&l.uc, trampoline, 0);
  }
  while (true) {
    for (unsigned i = 0; i < n; ++i) {
      if (c.lanes[i].state != RUN) continue;
      c.cur = i;
      if (!_setjmp(c.sched)) {
        if (!c.lanes[i].started) {
          c.lanes[i].started = true;
          swapcontext(&c.sched_uc, &c.lanes[i].uc);
        } else {
          _longjmp(c.lanes[i].jb, 1);
        }
      }
    }
    if (release()) continue;
    for (unsigned i = 0; i < n; ++i) if (c.lanes[i].state != DONE) return -1;  // deadlock
    return 0;
  }
}

// grid: threads per dimension, as MLX's kernel call takes it. Metal runs partial thread groups at
// the grid's edge with fewer threads; CUDA runs whole blocks.
inline int launch(const unsigned* grid, const unsigned* tg, bool partial_groups, std::function<void()> body) {
  Ctx& c = C();
  c.grid = {grid[0], grid[1], grid[2]};
  c.full_tg = {tg[0], tg[1], tg[2]};
  c.groups = {(grid[0] + tg[0] - 1) / tg[0], (grid[1] + tg[1] - 1) / tg[1], (grid[2] + tg[2] - 1) / tg[2]};
  c.body = std::move(body);
  for (unsigned z = 0; z < c.groups.z; ++z)
    for (unsigned y = 0; y < c.groups.y; ++y)
      for (unsigned x = 0; x < c.groups.x; ++x) {
        c.group = {x, y, z};
        c.tg = {tg[0], tg[1], tg[2]};
        if (partial_groups) {
          if (grid[0] - x * tg[0] < tg[0]) c.tg.x = grid[0] - x * tg[0];
          if (grid[1] - y * tg[1] < tg[1]) c.tg.y = grid[1] - y * tg[1];
          if (grid[2] - z * tg[2] < tg[2]) c.tg.z = grid[2] - z * tg[2];
        }
        if (run_group(c.tg.x * c.tg.y * c.tg.z)) return -1;
      }
  return 0;
}

// bfloat16 as both backends round it: to nearest even.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? 0x7FC0 : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
}  // namespace emu

// 16-byte vectors; no alignas: MLX's CPU buffers are 8-byte aligned, GPU buffers far more.
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }

#ifdef EMU_METAL
#define device
#define constant
#define thread
#define threadgroup static
#define kernel
using uint = unsigned;
struct uint3 { unsigned x, y, z; uint3(emu::Dim3 d) : x(d.x), y(d.y), z(d.z) {} };
typedef emu::bf16 bfloat16_t;
typedef _Float16 float16_t;
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float exp(float x) { return std::exp(x); }
inline float abs(float x) { return std::fabs(x); }
inline float round(float x) { return std::round(x); }
namespace precise { inline float rsqrt(float x) { return 1.0f / std::sqrt(x); } }
template <class T> T simd_shuffle_xor(T v, unsigned short mask) { return emu::shuffle_xor(v, mask); }
inline void threadgroup_barrier(mem_flags) { emu::barrier(); }
}  // namespace metal
template <class To, class From> To as_type(From x) { static_assert(sizeof(To) == sizeof(From)); To t; std::memcpy(&t, &x, sizeof(To)); return t; }
using namespace metal;
#endif

#ifdef EMU_CUDA
#define __device__
#define __global__
#define __shared__ static
#define __grid_constant__
#define threadIdx (emu::tid3())
#define blockIdx (emu::group3())
#define blockDim (emu::tg3())
#define gridDim (emu::groups3())
typedef emu::bf16 __nv_bfloat16;
typedef _Float16 __half;
struct Shape { int d[10]; int operator[](int i) const { return d[i]; } };
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) { return emu::shuffle_xor(v, mask); }
inline void __syncthreads() { emu::barrier(); }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
template <class T> T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }  // fibers switch at waits only
inline void __threadfence() {}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#endif
