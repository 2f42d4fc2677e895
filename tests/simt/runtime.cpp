// The SIMT runtime of the CUDA simulator (the design: include/simt/runtime.h) and its CPU models of the
// inline PTX (include/simt/ptx.h), with the host API of include/cuda_runtime.h.
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <semaphore>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

#define SIMT_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" char __start_simt_shared[] __attribute__((weak));
extern "C" char __stop_simt_shared[] __attribute__((weak));

namespace simt {

thread_local ThreadCtx* t_ctx = nullptr;
thread_local uint3 t_threadIdx{0, 0, 0}, t_blockIdx{0, 0, 0};
thread_local dim3 t_blockDim, t_gridDim;

namespace {

struct Abort {};  // unwinds a CUDA thread after an error of its block

double timeout_s() {
  static const double t = [] {
    const char* e = std::getenv("SIMT_TIMEOUT_S");
    return e ? std::atof(e) : 60.0;
  }();
  return t;
}

std::string site(const Loc& loc) {
  std::string f = loc.file_name();
  // the last two path components: cuda/calibration_kernels.cuh
  size_t cut = f.rfind('/');
  if (cut != std::string::npos && cut > 0) {
    const size_t prev = f.rfind('/', cut - 1);
    if (prev != std::string::npos) f = f.substr(prev + 1);
  }
  return f + ":" + std::to_string(loc.line());
}

// Waiters sleep on a 32-bit generation (a futex: no mutex to take again when released); the arrival
// bookkeeping is under the mutex.
struct WarpState {
  std::mutex m;
  uint32_t arrived = 0, mask = 0, exited = 0, exists = 0;
  Loc where;  // the pending collective's site
  const char* what = "";
  std::atomic<uint32_t> gen{0};
  Slot slot[2][32];
};

struct BlockState {
  const char* kernel = "";
  uint3 idx{0, 0, 0};
  unsigned nthreads = 0;
  std::mutex m;
  unsigned arrived = 0, exited = 0;
  std::atomic<uint32_t> gen{0};
  Loc where;  // the pending barrier's site
  unsigned first_tid = 0;
  std::unique_ptr<WarpState[]> warps;
  unsigned nwarps = 0;
  std::atomic<bool> failed{false};
  std::mutex err_m;
  std::string error;
  unsigned char* dyn = nullptr;
  size_t dyn_size = 0;
};

struct CpAsync {
  uint32_t dst;
  const void* src;
  int cp_size, src_size, group;
  Loc where;
};

}  // namespace

struct ThreadCtx {
  BlockState* blk;
  unsigned tid;
  uint64_t rng;
  std::vector<CpAsync> cp;
  int cp_next_group = 0;
  sigjmp_buf jmp;
};

namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t next_rand(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}
// A seeded chance (1 in 32) to let another thread run at a synchronisation point: enough to vary the
// interleavings from block to block, where every yield is one more thread switch.
void maybe_yield() {
  if (t_ctx != nullptr && (next_rand(t_ctx->rng) & 31u) == 0) sched_yield();
}

bool same_site(const Loc& a, const Loc& b) {
  return a.line() == b.line() && (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

std::string where_am_i() {
  char buf[160];
  const BlockState* b = t_ctx->blk;
  snprintf(buf, sizeof buf, "%s block (%u,%u,%u) thread %u", b->kernel, b->idx.x, b->idx.y, b->idx.z, t_ctx->tid);
  return buf;
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, 0x7fffffff, nullptr, nullptr, 0);
}

void notify_all_waiters(BlockState& b) {
  futex_wake_all(b.gen);
  for (unsigned w = 0; w < b.nwarps; ++w) futex_wake_all(b.warps[w].gen);
}

// Waits until `word` moves on from g (true), the block fails or the timeout passes (false).
bool wait_gen(std::atomic<uint32_t>& word, uint32_t g, const std::atomic<bool>& failed) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s());
  for (;;) {
    if (word.load(std::memory_order_acquire) != g) return true;
    if (failed.load()) return false;
    if (std::chrono::steady_clock::now() > end) return false;
    timespec slice{0, 200 * 1000 * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, g, &slice, nullptr, 0);
  }
}

void record_error(BlockState& b, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(b.err_m);
    if (b.error.empty()) b.error = msg;
  }
  b.failed.store(true);
}

[[noreturn]] void abort_thread(const std::string& msg) {
  record_error(*t_ctx->blk, msg);
  throw Abort{};
}


}  // namespace

[[noreturn]] void fail(const char* what, const Loc& loc) { abort_thread(where_am_i() + ": " + what + " at " + site(loc)); }

void syncthreads(const Loc& loc) {
  BlockState& b = *t_ctx->blk;
  std::unique_lock<std::mutex> lk(b.m);
  if (b.failed.load()) throw Abort{};
  if (b.exited > 0) {
    lk.unlock();
    abort_thread(where_am_i() + ": __syncthreads at " + site(loc) + " reached after " + std::to_string(b.exited) +
                 " thread(s) of the block exited (divergent barrier)");
  }
  if (b.arrived == 0) {
    b.where = loc;
    b.first_tid = t_ctx->tid;
  } else if (!same_site(b.where, loc)) {
    const std::string other = site(b.where);
    const unsigned ot = b.first_tid;
    lk.unlock();
    abort_thread(where_am_i() + ": divergent __syncthreads: this thread waits at " + site(loc) + ", thread " +
                 std::to_string(ot) + " at " + other);
  }
  const uint32_t g = b.gen.load();
  if (++b.arrived == b.nthreads) {
    b.arrived = 0;
    b.gen.store(g + 1, std::memory_order_release);
    lk.unlock();
    futex_wake_all(b.gen);
  } else {
    lk.unlock();
    if (!wait_gen(b.gen, g, b.failed)) {
      if (b.failed.load()) throw Abort{};  // released by another thread's error
      lk.lock();
      const unsigned n = b.arrived;
      lk.unlock();
      record_error(b, where_am_i() + ": deadlock: __syncthreads at " + site(loc) + " waited " +
                          std::to_string(static_cast<int>(timeout_s())) + " s with " + std::to_string(n) + " of " +
                          std::to_string(b.nthreads) + " threads arrived");
      notify_all_waiters(b);
      throw Abort{};
    }
  }
  maybe_yield();
}

void check_lane_in(unsigned mask, int lane, const char* what, const Loc& loc) {
  if (lane < 0 || lane > 31 || !((mask >> lane) & 1u)) {
    char buf[160];
    snprintf(buf, sizeof buf, "%s reads lane %d, which is not in its mask 0x%08x", what, lane, mask);
    fail(buf, loc);
  }
}

const Slot* warp_exchange(unsigned mask, const Slot& mine, const char* what, const Loc& loc) {
  BlockState& b = *t_ctx->blk;
  const unsigned lane = t_ctx->tid & 31u;
  WarpState& w = b.warps[t_ctx->tid >> 5];
  char buf[200];
  if (!((mask >> lane) & 1u)) {
    snprintf(buf, sizeof buf, "%s called by lane %u, which is not in its mask 0x%08x", what, lane, mask);
    fail(buf, loc);
  }
  if (mask & ~w.exists) {
    snprintf(buf, sizeof buf, "%s with mask 0x%08x names lanes that do not exist in this warp (0x%08x)", what, mask,
             w.exists);
    fail(buf, loc);
  }
  std::unique_lock<std::mutex> lk(w.m);
  if (b.failed.load()) throw Abort{};
  if (w.exited & mask) {
    snprintf(buf, sizeof buf, " with mask 0x%08x: lane(s) 0x%08x of the mask exited", mask, w.exited & mask);
    lk.unlock();
    abort_thread(where_am_i() + ": " + what + " at " + site(loc) + buf);
  }
  if (w.arrived == 0) {
    w.mask = mask;
    w.where = loc;
    w.what = what;
  } else if (w.mask != mask || !same_site(w.where, loc) || std::strcmp(w.what, what) != 0) {
    snprintf(buf, sizeof buf, " with mask 0x%08x while lanes 0x%08x wait at ", mask, w.arrived);
    const std::string other = site(w.where) + " (" + w.what + ")";
    const std::string here = site(loc) + " (" + what + ")";
    char m2[40];
    snprintf(m2, sizeof m2, " with mask 0x%08x", w.mask);
    lk.unlock();
    abort_thread(where_am_i() + ": divergent warp collective: " + here + buf + other + m2);
  }
  const uint32_t g = w.gen.load();
  const unsigned parity = g & 1u;
  w.slot[parity][lane] = mine;
  w.arrived |= 1u << lane;
  if (w.arrived == mask) {
    w.arrived = 0;
    w.gen.store(g + 1, std::memory_order_release);
    lk.unlock();
    futex_wake_all(w.gen);
  } else {
    lk.unlock();
    if (!wait_gen(w.gen, g, b.failed)) {
      if (b.failed.load()) throw Abort{};
      lk.lock();
      snprintf(buf, sizeof buf, " waited with lanes 0x%08x of mask 0x%08x arrived", w.arrived, mask);
      lk.unlock();
      record_error(b, where_am_i() + ": deadlock: " + site(loc) + " (" + what + ")" + buf);
      notify_all_waiters(b);
      throw Abort{};
    }
  }
  maybe_yield();
  return w.slot[parity];
}

unsigned char* dynamic_shared_base() { return t_ctx->blk->dyn; }
size_t dynamic_shared_size() { return t_ctx->blk->dyn_size; }

// ------------------------------------------------------------------ PTX models
namespace ptx {

uint32_t cvta_generic_to_shared(const void* p, const Loc& loc) {
  const BlockState& b = *t_ctx->blk;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (b.dyn == nullptr || c < b.dyn || c > b.dyn + b.dyn_size)
    fail("__cvta_generic_to_shared of a pointer outside the block's dynamic shared memory", loc);
  return static_cast<uint32_t>(c - b.dyn);
}

unsigned char* shared_at(uint32_t addr, size_t bytes, size_t align, const char* what, const Loc& loc) {
  const BlockState& b = *t_ctx->blk;
  char buf[200];
  if (addr % align != 0) {
    snprintf(buf, sizeof buf, "%s: shared address %u is not %zu-byte aligned", what, addr, align);
    fail(buf, loc);
  }
  if (static_cast<size_t>(addr) + bytes > b.dyn_size) {
    snprintf(buf, sizeof buf, "%s: shared bytes [%u, %zu) beyond the %zu bytes of dynamic shared memory", what, addr,
             addr + bytes, b.dyn_size);
    fail(buf, loc);
  }
  return b.dyn + addr;
}

void cp_async_cg_shared_global(uint32_t dst, const void* src, int cp_size, int src_size, const Loc& loc) {
  if (cp_size != 16) fail("cp.async.cg takes a cp-size of 16 bytes", loc);
  if (src_size < 0 || src_size > cp_size) fail("cp.async src-size outside [0, cp-size]", loc);
  shared_at(dst, 16, 16, "cp.async destination", loc);
  if (src_size > 0 && reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("cp.async source not 16-byte aligned", loc);
  t_ctx->cp.push_back(CpAsync{dst, src, cp_size, src_size, -1, loc});
}

void cp_async_commit_group(const Loc&) {
  const int g = t_ctx->cp_next_group++;
  for (CpAsync& c : t_ctx->cp)
    if (c.group < 0) c.group = g;
}

void cp_async_wait_group(int n, const Loc& loc) {
  if (n < 0) fail("cp.async.wait_group with a negative count", loc);
  const int done_below = t_ctx->cp_next_group - n;  // groups [0, done_below) must be complete
  std::vector<CpAsync>& q = t_ctx->cp;
  size_t keep = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    CpAsync& c = q[i];
    if (c.group >= 0 && c.group < done_below) {
      unsigned char* d = t_ctx->blk->dyn + c.dst;
      if (c.src_size > 0) std::memcpy(d, c.src, static_cast<size_t>(c.src_size));
      std::memset(d + c.src_size, 0, static_cast<size_t>(c.cp_size - c.src_size));
    } else {
      q[keep++] = q[i];
    }
  }
  q.resize(keep);
}

void cp_async_drop_pending() {
  if (t_ctx != nullptr) t_ctx->cp.clear();
}

void ldmatrix_m8n8_x4_b16(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr, bool trans,
                          const Loc& loc) {
  Slot mine{};
  mine.w[0] = addr;
  const char* what = trans ? "ldmatrix.m8n8.x4.trans" : "ldmatrix.m8n8.x4";
  const Slot* all = warp_exchange(0xffffffffu, mine, what, loc);
  const unsigned lane = t_ctx->tid & 31u;
  uint32_t r[4];
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {  // thread t: row t/4 of matrix i, elements 2*(t%4), +1
      const uint16_t* row = reinterpret_cast<const uint16_t*>(shared_at(all[8 * i + lane / 4].w[0], 16, 16, what, loc));
      lo = row[2 * (lane % 4)];
      hi = row[2 * (lane % 4) + 1];
    } else {  // column-major: thread t: column t/4, rows 2*(t%4), +1
      const uint16_t* row0 =
          reinterpret_cast<const uint16_t*>(shared_at(all[8 * i + 2 * (lane % 4)].w[0], 16, 16, what, loc));
      const uint16_t* row1 =
          reinterpret_cast<const uint16_t*>(shared_at(all[8 * i + 2 * (lane % 4) + 1].w[0], 16, 16, what, loc));
      lo = row0[lane / 4];
      hi = row1[lane / 4];
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}

void mma_m16n8k16_row_col_f32(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], bool bf16,
                              const Loc& loc) {
  Slot mine{};
  for (int i = 0; i < 4; ++i) mine.w[i] = a[i];
  mine.w[4] = b[0];
  mine.w[5] = b[1];
  const Slot* all = warp_exchange(0xffffffffu, mine, bf16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16", loc);
  auto elem = [&](uint32_t reg, int half) {
    const uint16_t bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu);
    return static_cast<double>(bf16 ? bf16_to_f32(bits) : f16_to_f32(bits));
  };
  double A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    const int groupID = L >> 2, tig = L % 4;
    for (int i = 0; i < 8; ++i) {  // a_i: register i/2, half i&1
      const int row = (i < 2 || (i >= 4 && i < 6)) ? groupID : groupID + 8;
      const int col = (i < 4) ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
      A[row][col] = elem(all[L].w[i / 2], i & 1);
    }
    for (int i = 0; i < 4; ++i) {  // b_i: register 4 + i/2, half i&1
      const int row = (i < 2) ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
      B[row][groupID] = elem(all[L].w[4 + i / 2], i & 1);
    }
  }
  const int lane = static_cast<int>(t_ctx->tid & 31u), groupID = lane >> 2, tig = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? groupID : groupID + 8, col = tig * 2 + (i & 1);
    double s = static_cast<double>(c[i]);
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] = static_cast<float>(s);
  }
}

}  // namespace ptx

// ------------------------------------------------------------------ the device and the launch
namespace {

struct Device {
  int id = 0;
  int smem_optin = 227 * 1024;  // sm_90
  int sms = 2;
};
Device g_dev;
std::mutex g_launch_mutex;
std::unordered_map<const void*, int> g_max_dynamic;  // cudaFuncAttributeMaxDynamicSharedMemorySize
uint64_t g_seed = 1, g_launches = 0;
std::string g_log;
thread_local cudaError_t t_last = cudaSuccess;
thread_local std::string t_last_msg;

void set_error(cudaError_t e, const std::string& msg) {
  if (t_last == cudaSuccess) {
    t_last = e;
    t_last_msg = msg;
  }
}

// The dynamic shared memory of a launch: `size` bytes ending at a PROT_NONE page (and one before the
// start), the start rounded down to 16 bytes; the slack below the boundary holds a canary.
struct Arena {
  unsigned char* map = nullptr;
  size_t map_len = 0;
  unsigned char* base = nullptr;
  size_t size = 0, slack = 0;
  unsigned char* lo_guard = nullptr;
  unsigned char* hi_guard = nullptr;
  explicit Arena(size_t n) : size(n) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t body = ((n + 15 + page - 1) / page) * page + page;
    map_len = body + 2 * page;
    map = static_cast<unsigned char*>(mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (map == MAP_FAILED) {
      map = nullptr;
      return;
    }
    lo_guard = map;
    hi_guard = map + page + body;
    mprotect(lo_guard, page, PROT_NONE);
    mprotect(hi_guard, page, PROT_NONE);
    unsigned char* end = hi_guard;
    base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(end - n)) & ~static_cast<uintptr_t>(15));
    slack = static_cast<size_t>(end - base) - n;
  }
  ~Arena() {
    if (map) munmap(map, map_len);
  }
  void poison() {
    std::memset(base, 0xff, size);
    std::memset(base + size, 0xa5, slack);
  }
  bool canary_ok() const {
    for (size_t i = 0; i < slack; ++i)
      if (base[size + i] != 0xa5) return false;
    return true;
  }
};
Arena* g_arena = nullptr;  // the running launch's (the launch mutex is held)

// The worker pool: worker i runs the i-th CUDA thread (in a seeded order) of each block.
struct Job {
  BlockState* blk;
  const std::vector<unsigned>* order;
  void (*body)(void*);
  void* arg;
  uint64_t seed;
  dim3 grid, block;
};

// The CPU the workers share (-1: no pinning).  A block's threads synchronise at every barrier and warp
// collective, so most of a launch is thread switches: on one CPU each switch stays on its core (no
// cross-core wake-up).  SIMT_CPU=<n> picks the CPU (tests/simt/conftest.py gives each pytest-xdist worker its
// own), SIMT_CPU=none lets the threads run on every CPU (the ThreadSanitizer target, for preemption across
// cores); otherwise a process takes one by its process id.
int pool_cpu() {
  const char* e = std::getenv("SIMT_CPU");
  if (e != nullptr && std::strcmp(e, "none") == 0) return -1;
  if (e != nullptr) return std::atoi(e);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0 || CPU_COUNT(&set) < 2) return -1;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus[static_cast<size_t>(getpid()) % cpus.size()];
}

class Pool {
 public:
  void run(const Job& job, unsigned n) {
    while (workers_.size() < n) {
      const unsigned i = static_cast<unsigned>(workers_.size());
      auto w = std::make_unique<Worker>();
      w->index = i;
      Worker* raw = w.get();
      workers_.push_back(std::move(w));
      raw->th = std::thread([this, raw] { loop(raw); });
      if (cpu_ >= 0) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu_, &one);
        pthread_setaffinity_np(raw->th.native_handle(), sizeof one, &one);
      }
      raw->th.detach();
    }
    job_ = job;
    remaining_.store(n);
    for (unsigned i = 0; i < n; ++i) workers_[i]->go.release();
    done_.acquire();
  }

 private:
  struct Worker {
    unsigned index = 0;
    std::thread th;
    std::binary_semaphore go{0};
  };
  void loop(Worker* w) {
    for (;;) {
      w->go.acquire();
      run_thread((*job_.order)[w->index]);
      if (remaining_.fetch_sub(1) == 1) done_.release();
    }
  }
  void run_thread(unsigned tid);
  std::vector<std::unique_ptr<Worker>> workers_;
  const int cpu_ = pool_cpu();
  Job job_{};
  std::atomic<unsigned> remaining_{0};
  std::binary_semaphore done_{0};
};
Pool* g_pool = nullptr;

void thread_exit(BlockState& b, unsigned tid) {
  ptx::cp_async_drop_pending();
  const bool failed = b.failed.load();
  {
    std::unique_lock<std::mutex> lk(b.m);
    ++b.exited;
    if (b.arrived > 0 && !failed) {
      const std::string w = site(b.where);
      const unsigned n = b.arrived;
      lk.unlock();
      record_error(b, std::string(b.kernel) + " block (" + std::to_string(b.idx.x) + "," + std::to_string(b.idx.y) +
                          "," + std::to_string(b.idx.z) + ") thread " + std::to_string(tid) + ": exited while " +
                          std::to_string(n) + " thread(s) wait at __syncthreads at " + w + " (divergent barrier)");
      lk.lock();
    }
  }
  futex_wake_all(b.gen);
  WarpState& w = b.warps[tid >> 5];
  {
    std::unique_lock<std::mutex> lk(w.m);
    w.exited |= 1u << (tid & 31u);
    if (w.arrived != 0 && ((w.mask >> (tid & 31u)) & 1u) && !failed) {
      const std::string where = site(w.where) + " (" + w.what + ")";
      lk.unlock();
      record_error(b, std::string(b.kernel) + " thread " + std::to_string(tid) + ": exited while its warp waits at " +
                          where + " with it in the mask");
      lk.lock();
    }
  }
  futex_wake_all(w.gen);
  if (b.failed.load()) notify_all_waiters(b);
}

// The SIGSEGV handler: a fault inside a CUDA thread becomes that block's error (the guard pages of
// dynamic shared memory name the offset); any other fault goes to the previous handler.
struct sigaction g_old_segv;
void on_segv(int sig, siginfo_t* info, void* uc) {
  ThreadCtx* ctx = t_ctx;
  if (ctx == nullptr) {
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    if (g_old_segv.sa_flags & SA_SIGINFO) {
      if (g_old_segv.sa_sigaction) g_old_segv.sa_sigaction(sig, info, uc);
    } else if (g_old_segv.sa_handler != SIG_DFL && g_old_segv.sa_handler != SIG_IGN) {
      g_old_segv.sa_handler(sig);
    }
    raise(sig);
    return;
  }
  const BlockState& b = *ctx->blk;
  const unsigned char* a = static_cast<const unsigned char*>(info->si_addr);
  char buf[320];
  if (g_arena && a >= g_arena->hi_guard && a < g_arena->hi_guard + 4096) {
    snprintf(buf, sizeof buf, "%s block (%u,%u,%u) thread %u: dynamic shared memory access at byte %td of a %zu-byte "
             "allocation (out of bounds)", b.kernel, b.idx.x, b.idx.y, b.idx.z, ctx->tid, a - b.dyn, b.dyn_size);
  } else if (g_arena && a >= g_arena->lo_guard && a < g_arena->lo_guard + 4096) {
    snprintf(buf, sizeof buf, "%s block (%u,%u,%u) thread %u: dynamic shared memory access before its start "
             "(out of bounds)", b.kernel, b.idx.x, b.idx.y, b.idx.z, ctx->tid);
  } else {
    snprintf(buf, sizeof buf, "%s block (%u,%u,%u) thread %u: segmentation fault at address %p", b.kernel, b.idx.x,
             b.idx.y, b.idx.z, ctx->tid, info->si_addr);
  }
  // record_error takes a mutex: acceptable here, the fault is synchronous in a thread that holds none.
  record_error(*ctx->blk, buf);
  siglongjmp(ctx->jmp, 1);
}

// The SIGILL handler: the trap of -fsanitize=bounds (build.py) in a CUDA thread, an index past the end of a
// fixed-size array, becomes that block's error; any other SIGILL goes to the previous handler.
struct sigaction g_old_ill;
void on_trap(int sig, siginfo_t* info, void* uc) {
  ThreadCtx* ctx = t_ctx;
  if (ctx == nullptr) {
    sigaction(SIGILL, &g_old_ill, nullptr);
    raise(sig);
    return;
  }
  const BlockState& b = *ctx->blk;
  char buf[320];
  snprintf(buf, sizeof buf, "%s block (%u,%u,%u) thread %u: index out of the bounds of a fixed-size array (static "
           "shared memory or a local array; trap at %p)", b.kernel, b.idx.x, b.idx.y, b.idx.z, ctx->tid,
           info->si_addr);
  record_error(*ctx->blk, buf);
  siglongjmp(ctx->jmp, 1);
}

struct InstallHandler {
  InstallHandler() {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sa.sa_sigaction = on_trap;
    sigaction(SIGILL, &sa, &g_old_ill);
  }
} g_install;

void Pool::run_thread(unsigned tid) {
  BlockState& b = *job_.blk;
  ThreadCtx ctx;
  ctx.blk = &b;
  ctx.tid = tid;
  ctx.rng = splitmix(job_.seed ^ (static_cast<uint64_t>(tid) * 0x100000001b3ull)) | 1u;
  t_ctx = &ctx;
  t_threadIdx = uint3{tid, 0, 0};
  t_blockIdx = b.idx;
  t_blockDim = job_.block;
  t_gridDim = job_.grid;
  if (sigsetjmp(ctx.jmp, 1) == 0) {
    try {
      maybe_yield();
      job_.body(job_.arg);
    } catch (const Abort&) {
    }
  }
  notify_all_waiters(b);
  thread_exit(b, tid);
  t_ctx = nullptr;
}

}  // namespace

void run_grid(const char* name, const void* fn, dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* arg) {
  std::lock_guard<std::mutex> launch_lock(g_launch_mutex);
  char buf[300];
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.y != 1 || block.z != 1) {
    snprintf(buf, sizeof buf, "%s: block (%u,%u,%u): the simulator runs 1-D blocks of 1 to 1024 threads", name, block.x,
             block.y, block.z);
    return set_error(cudaErrorInvalidConfiguration, buf);
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu) {
    snprintf(buf, sizeof buf, "%s: invalid grid (%u,%u,%u)", name, grid.x, grid.y, grid.z);
    return set_error(cudaErrorInvalidConfiguration, buf);
  }
  auto it = g_max_dynamic.find(fn);
  const size_t allowed = it == g_max_dynamic.end() ? 48 * 1024 : static_cast<size_t>(it->second);
  if (smem > allowed) {
    snprintf(buf, sizeof buf, "%s: %zu bytes of dynamic shared memory above the kernel's %zu "
             "(cudaFuncAttributeMaxDynamicSharedMemorySize)", name, smem, allowed);
    return set_error(cudaErrorInvalidValue, buf);
  }
  ++g_launches;
  g_log += std::string(name) + " grid=" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
           std::to_string(grid.z) + " block=" + std::to_string(block.x) + " smem=" + std::to_string(smem) + "\n";
  if (!g_pool) g_pool = new Pool();
  Arena arena(smem);
  if (arena.map == nullptr) return set_error(cudaErrorMemoryAllocation, "simulator: mmap of shared memory failed");
  g_arena = &arena;
  const size_t static_bytes =
      (__start_simt_shared && __stop_simt_shared) ? static_cast<size_t>(__stop_simt_shared - __start_simt_shared) : 0;
  std::vector<unsigned> order(threads);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        BlockState b;
        b.kernel = name;
        b.idx = uint3{x, y, z};
        b.nthreads = static_cast<unsigned>(threads);
        b.nwarps = (b.nthreads + 31) / 32;
        b.warps.reset(new WarpState[b.nwarps]);
        for (unsigned w = 0; w < b.nwarps; ++w) {
          const unsigned n = b.nthreads - 32 * w >= 32 ? 32 : b.nthreads - 32 * w;
          b.warps[w].exists = n == 32 ? 0xffffffffu : ((1u << n) - 1);
        }
        b.dyn = arena.base;
        b.dyn_size = smem;
        arena.poison();
        if (static_bytes) std::memset(__start_simt_shared, 0xff, static_bytes);
        const uint64_t seed = splitmix(g_seed ^ splitmix(g_launches) ^ splitmix((uint64_t(z) << 40) ^ (uint64_t(y) << 20) ^ x));
        uint64_t s = seed | 1u;
        for (unsigned i = 0; i < threads; ++i) order[i] = i;
        for (unsigned i = static_cast<unsigned>(threads) - 1; i > 0; --i) std::swap(order[i], order[next_rand(s) % (i + 1)]);
        Job job{&b, &order, body, arg, seed, grid, block};
        g_pool->run(job, static_cast<unsigned>(threads));
        if (!b.failed.load() && !arena.canary_ok()) {
          snprintf(buf, sizeof buf, "%s block (%u,%u,%u): a write past the %zu bytes of dynamic shared memory", name, x,
                   y, z, smem);
          record_error(b, buf);
        }
        if (b.failed.load()) {
          g_arena = nullptr;
          return set_error(cudaErrorLaunchFailure, "simt: " + b.error);
        }
      }
    }
  }
  g_arena = nullptr;
}

}  // namespace simt

// ------------------------------------------------------------------ the host API
using simt::g_dev;

cudaError_t cudaGetLastError() {
  const cudaError_t e = simt::t_last;
  simt::t_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return simt::t_last; }
const char* cudaGetErrorString(cudaError_t e) {
  static thread_local std::string msg;
  msg = e == cudaSuccess ? "no error" : (simt::t_last_msg.empty() ? "simulated CUDA error" : simt::t_last_msg);
  return msg.c_str();
}
cudaError_t cudaGetDevice(int* device) {
  *device = g_dev.id;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != g_dev.id) return cudaErrorInvalidValue;
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = g_dev.smem_optin;
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = g_dev.sms;
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
  std::lock_guard<std::mutex> lk(simt::g_launch_mutex);
  auto it = simt::g_max_dynamic.find(func);
  attr->sharedSizeBytes = 0;
  attr->maxThreadsPerBlock = 1024;
  attr->maxDynamicSharedSizeBytes = it == simt::g_max_dynamic.end() ? 48 * 1024 : it->second;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > g_dev.smem_optin)
    return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lk(simt::g_launch_mutex);
  simt::g_max_dynamic[func] = value;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  // Poisoned (0xff: NaN floats, -1 ints), so that a read of memory nothing wrote shows.
  *ptr = std::malloc(bytes > 0 ? bytes : 1);
  if (*ptr == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*ptr, 0xff, bytes);
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t) { return cudaMalloc(ptr, bytes); }
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) { return cudaFree(ptr); }
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// ------------------------------------------------------------------ the simulator's own controls
// A new simulated device (a new device number, so that the launchers' per-device caches ask again): its
// opt-in shared memory per block and its SM count.
SIMT_EXPORT void simt_configure_device(int smem_optin, int sms) {
  std::lock_guard<std::mutex> lk(simt::g_launch_mutex);
  ++g_dev.id;
  g_dev.smem_optin = smem_optin;
  g_dev.sms = sms;
  simt::g_max_dynamic.clear();
}
SIMT_EXPORT void simt_set_seed(unsigned long long seed) {
  std::lock_guard<std::mutex> lk(simt::g_launch_mutex);
  simt::g_seed = seed;
}
// The kernels launched since the last call, one line each: name, grid, block, dynamic shared memory.
SIMT_EXPORT const char* simt_take_launch_log() {
  static thread_local std::string out;
  std::lock_guard<std::mutex> lk(simt::g_launch_mutex);
  out.swap(simt::g_log);
  simt::g_log.clear();
  return out.c_str();
}
