// tpkit's shared-memory collectives for the ranks of one host (called through ctypes).
//
// One POSIX shm segment per group: one cache line per rank (arrival counters, pid, call
// signature, futex word), two buffers of `chunk` bytes per rank (double buffering),
// then one mailbox per (src, dst) for point-to-point. Round s of a collective uses
// buffer s % 2 of every rank:
//
//   write my piece into my buffer -> seq[me] = s -> wait until every seq >= s -> read
//
// A rank may write buffer s % 2 again at round s + 2 only after every peer arrived at
// round s + 1, which each did after it had finished reading round s: no other lock.
// Sums are taken in rank order with float accumulation (bf16/fp16 rounded once), so
// every rank gets the same bits whichever rank computed them. Above `split` bytes an
// all-reduce is a reduce-scatter (rank j sums slice j into its own buffer) then an
// all-gather (seq2 is the second arrival counter). A waiting rank spins briefly, then
// yields (unless a yield shows the core is shared), then sleeps on a futex its peer
// wakes; it checks its peers' pids every 100 ms
// (a dead or zombie peer ends the wait) and gives up after the timeout. Return codes: 0 done, 1 a peer died,
// 2 timed out, 3 the ranks called different collectives; `who` is the peer's index.
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shm_reduce.h"

namespace {

constexpr uint64_t kMagic = 0x74706b6974736d31ULL;  // "tpkitsm1"
constexpr int kMaxRanks = 64;
constexpr size_t kHeader = 64 * (kMaxRanks + 1);
constexpr double kSpinS = 5e-6, kYieldS = 1e-4;  // a wait spins, then yields, then sleeps
constexpr double kBusyYieldS = 2e-5;  // a yield this long ran someone else: the core is shared
constexpr uint64_t kEntries = 256;  // messages a point-to-point mailbox holds

struct alignas(64) Slot {
  std::atomic<uint64_t> seq;   // rounds this rank has published (phase 1)
  std::atomic<uint64_t> seq2;  // ... and finished reducing its slice (phase 2)
  std::atomic<uint64_t> sig[2];  // what it called in its latest rounds (by parity: a peer
                                 // may be one round ahead, never two)
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> wake;      // bumped after each publish while someone sleeps on it
  std::atomic<uint32_t> sleepers;  // ranks in futex_wait on `wake`
};

struct Header {
  uint64_t magic;
  uint64_t chunk;
  int32_t nranks;
  char pad[64 - 20];
  Slot slots[kMaxRanks];
};

struct Mailbox;

struct Group {
  Header* h;
  int rank, n;
  double timeout_s;
  char* buf(int r, uint64_t s) const {
    return reinterpret_cast<char*>(h) + kHeader + (2 * static_cast<size_t>(r) + (s & 1)) * h->chunk;
  }
  Mailbox* mailbox(int src, int dst) const;  // messages from src to dst
};

// Point-to-point: one single-producer single-consumer queue per (src, dst): a ring of
// entries (size, via_gloo) and a ring of data bytes. A message that does not fit the free
// bytes goes over gloo, its entry saying so, so the receiver takes it there, in order.
struct alignas(64) Mailbox {
  std::atomic<uint64_t> written, bytes_written;  // the sender's
  char pad1[48];
  std::atomic<uint64_t> read, bytes_read;  // the receiver's
  char pad2[48];
  uint64_t entry[kEntries];  // size << 1 | via_gloo
};

size_t mailbox_bytes(int n) {  // data bytes of each mailbox: 4 MiB at 2 ranks, 1 MiB at 4
  size_t q = (size_t(16) << 20) / (size_t(n) * n) / 64 * 64;
  return q < (size_t(256) << 10) ? size_t(256) << 10 : q;
}

size_t segment_bytes(int n, size_t chunk) {
  return kHeader + 2 * size_t(n) * chunk + size_t(n) * n * (sizeof(Mailbox) + mailbox_bytes(n));
}

Mailbox* Group::mailbox(int src, int dst) const {
  size_t one = sizeof(Mailbox) + mailbox_bytes(n);
  char* base = reinterpret_cast<char*>(h) + kHeader + 2 * size_t(n) * h->chunk;
  return reinterpret_cast<Mailbox*>(base + (size_t(src) * n + dst) * one);
}

char* ring(Mailbox* m) { return reinterpret_cast<char*>(m + 1); }

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

bool alive(int pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return true;
  size_t got = fread(line, 1, sizeof line - 1, f);
  fclose(f);
  line[got] = 0;
  const char* close = strrchr(line, ')');  // "pid (comm) S ...": the state after the name
  return !(close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* t) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, t, nullptr, 0);
}

// After rank r published a counter: wake whoever sleeps on it (a syscall only then).
void notify(Slot& me) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // publish before reading sleepers
  if (me.sleepers.load(std::memory_order_seq_cst) == 0) return;
  me.wake.fetch_add(1, std::memory_order_seq_cst);
  futex(&me.wake, FUTEX_WAKE, INT32_MAX, nullptr);
}

// Wait until counter c (published by peer j) reaches s: spin 5 us (pause), yield until
// 100 us, then sleep on the futex the peer's publish wakes. A yield that took >= 20 us
// ran another process (the core is shared): sleep at once, since a yielding rank queues
// behind it for a time slice where a woken one runs at once. Every 100 ms: is the peer
// alive, is the wait past the timeout?
int wait_until(const Group& g, const std::atomic<uint64_t>& c, uint64_t s, int j, int* who) {
  Slot& p = g.h->slots[j];
  double start = 0;
  long tries = 0;
  bool shared = false;  // a yield ran another process
  while (c.load(std::memory_order_acquire) < s) {
    if ((++tries & 31) != 0) { relax(); continue; }
    double t = now();
    if (start == 0) start = t;
    if (t - start < kSpinS) { relax(); continue; }
    if (t - start < kYieldS && !shared) { sched_yield(); shared = now() - t >= kBusyYieldS; continue; }
    p.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t w = p.wake.load(std::memory_order_seq_cst);
    if (c.load(std::memory_order_seq_cst) < s) {
      timespec ts{0, 100000000};  // 100 ms
      futex(&p.wake, FUTEX_WAIT, w, &ts);
    }
    p.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (c.load(std::memory_order_acquire) >= s) break;
    if (!alive(p.pid.load())) { *who = j; return 1; }
    if (now() - start > g.timeout_s) { *who = j; return 2; }
  }
  return 0;
}

// ... counter `which` (1: seq, 2: seq2) of every peer.
int wait_all(const Group& g, int which, uint64_t s, int* who) {
  for (int j = 0; j < g.n; ++j) {
    if (j == g.rank) continue;
    Slot& p = g.h->slots[j];
    int rc = wait_until(g, which == 1 ? p.seq : p.seq2, s, j, who);
    if (rc) return rc;
  }
  return 0;
}

// Publish round s (counter `which`) and wait for the peers; checks that everyone called
// the same thing (sig) in phase 1.
int arrive(const Group& g, int which, uint64_t s, uint64_t sig, int* who) {
  Slot& me = g.h->slots[g.rank];
  if (which == 1) {
    me.sig[s & 1].store(sig, std::memory_order_relaxed);
    me.seq.store(s, std::memory_order_release);
    notify(me);
  } else {
    me.seq2.store(s, std::memory_order_release);
    notify(me);
  }
  int rc = wait_all(g, which, s, who);
  if (rc || which != 1) return rc;
  for (int j = 0; j < g.n; ++j) {
    if (g.h->slots[j].sig[s & 1].load(std::memory_order_relaxed) != sig) { *who = j; return 3; }
  }
  return 0;
}

template <class T>
int all_reduce_t(const Group& g, T* x, size_t numel, int op, size_t split, int* who) {
  const size_t per_round = g.h->chunk / sizeof(T);
  Slot& me = g.h->slots[g.rank];
  for (size_t off = 0; off < numel; off += per_round) {
    size_t m = numel - off < per_round ? numel - off : per_round;
    uint64_t s = me.seq.load(std::memory_order_relaxed) + 1;
    T* mine = reinterpret_cast<T*>(g.buf(g.rank, s));
    memcpy(mine, x + off, m * sizeof(T));
    int rc = arrive(g, 1, s, (uint64_t(1) << 56) ^ (uint64_t(op) << 48) ^ m, who);
    if (rc) return rc;
    T* src[kMaxRanks];
    for (int j = 0; j < g.n; ++j) src[j] = reinterpret_cast<T*>(g.buf(j, s));
    if (m * sizeof(T) <= split) {  // every rank sums everything, the same way
      reduce_into(x + off, src, g.n, m, op);
      continue;
    }
    size_t slice = ((m + g.n - 1) / g.n + 31) / 32 * 32;  // 64-byte aligned slices
    size_t lo = g.rank * slice < m ? g.rank * slice : m;
    size_t hi = lo + slice < m ? lo + slice : m;
    T* part[kMaxRanks];
    for (int j = 0; j < g.n; ++j) part[j] = src[j] + lo;
    reduce_into(mine + lo, part, g.n, hi - lo, op);
    rc = arrive(g, 2, s, 0, who);
    if (rc) return rc;
    for (int j = 0; j < g.n; ++j) {
      size_t a = j * slice < m ? j * slice : m, b = a + slice < m ? a + slice : m;
      memcpy(x + off + a, src[j] + a, (b - a) * sizeof(T));
    }
  }
  return 0;
}

template <class T>
int reduce_scatter_t(const Group& g, const T* in, T* out, size_t count, int op, int* who) {
  const size_t per_round = g.h->chunk / sizeof(T) / g.n;  // of each rank's slice
  Slot& me = g.h->slots[g.rank];
  for (size_t off = 0; off < count; off += per_round) {
    size_t m = count - off < per_round ? count - off : per_round;
    uint64_t s = me.seq.load(std::memory_order_relaxed) + 1;
    T* mine = reinterpret_cast<T*>(g.buf(g.rank, s));
    for (int j = 0; j < g.n; ++j) memcpy(mine + j * m, in + j * count + off, m * sizeof(T));
    int rc = arrive(g, 1, s, (uint64_t(2) << 56) ^ (uint64_t(op) << 48) ^ m, who);
    if (rc) return rc;
    T* src[kMaxRanks];
    for (int j = 0; j < g.n; ++j) src[j] = reinterpret_cast<T*>(g.buf(j, s)) + g.rank * m;
    reduce_into(out + off, src, g.n, m, op);
  }
  return 0;
}

Group group_of(void* base, int rank, double timeout_s) {
  Header* h = static_cast<Header*>(base);
  return Group{h, rank, h->nranks, timeout_s};
}

}  // namespace

extern "C" {

// Create (create=1) or open a segment of `size` bytes and map it; NULL on failure.
void* tpk_map(const char* name, size_t size, int create) {
  int fd = shm_open(name, create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    shm_unlink(name);
    return nullptr;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return p == MAP_FAILED ? nullptr : p;
}

int tpk_unmap(void* p, size_t size) { return munmap(p, size); }
int tpk_unlink(const char* name) { return shm_unlink(name); }
size_t tpk_size(int nranks, size_t chunk) { return segment_bytes(nranks, chunk); }

// The creator writes the header once; every rank then joins with its pid.
int tpk_init(void* base, int nranks, size_t chunk) {
  if (nranks < 1 || nranks > kMaxRanks || chunk % 64) return -1;
  Header* h = static_cast<Header*>(base);
  h->chunk = chunk;
  h->nranks = nranks;
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return 0;
}

int tpk_join(void* base, int rank, int pid) {
  Header* h = static_cast<Header*>(base);
  if (h->magic != kMagic || rank < 0 || rank >= h->nranks) return -1;
  h->slots[rank].pid.store(pid);
  return 0;
}

// dtype: 0 float32, 1 bfloat16, 2 float16; op: 0 sum, 1 max, 2 min.
int tpk_all_reduce(void* base, int rank, void* x, size_t numel, int dtype, int op,
                   size_t split, double timeout_s, int* who) {
  Group g = group_of(base, rank, timeout_s);
  if (dtype == 0) return all_reduce_t(g, static_cast<float*>(x), numel, op, split, who);
  if (dtype == 1) return all_reduce_t(g, static_cast<uint16_t*>(x), numel, op, split, who);
  return all_reduce_t(g, static_cast<_Float16*>(x), numel, op, split, who);
}

int tpk_reduce_scatter(void* base, int rank, const void* in, void* out, size_t count,
                       int dtype, int op, double timeout_s, int* who) {
  Group g = group_of(base, rank, timeout_s);
  if (dtype == 0)
    return reduce_scatter_t(g, static_cast<const float*>(in), static_cast<float*>(out), count, op, who);
  if (dtype == 1)
    return reduce_scatter_t(g, static_cast<const uint16_t*>(in), static_cast<uint16_t*>(out), count,
                            op, who);
  return reduce_scatter_t(g, static_cast<const _Float16*>(in), static_cast<_Float16*>(out), count,
                          op, who);
}

// out = every rank's `nbytes` of `in`, in rank order.
int tpk_all_gather(void* base, int rank, const void* in, void* out, size_t nbytes,
                   double timeout_s, int* who) {
  Group g = group_of(base, rank, timeout_s);
  Slot& me = g.h->slots[rank];
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (size_t off = 0; off < nbytes; off += g.h->chunk) {
    size_t m = nbytes - off < g.h->chunk ? nbytes - off : g.h->chunk;
    uint64_t s = me.seq.load(std::memory_order_relaxed) + 1;
    memcpy(g.buf(rank, s), src + off, m);
    int rc = arrive(g, 1, s, (uint64_t(3) << 56) ^ m, who);
    if (rc) return rc;
    for (int j = 0; j < g.n; ++j) memcpy(dst + j * nbytes + off, g.buf(j, s), m);
  }
  return 0;
}

// Copy rank `root`'s `nbytes` of x into every rank's x.
int tpk_broadcast(void* base, int rank, void* x, size_t nbytes, int root, double timeout_s,
                  int* who) {
  Group g = group_of(base, rank, timeout_s);
  Slot& me = g.h->slots[rank];
  char* p = static_cast<char*>(x);
  for (size_t off = 0; off < nbytes; off += g.h->chunk) {
    size_t m = nbytes - off < g.h->chunk ? nbytes - off : g.h->chunk;
    uint64_t s = me.seq.load(std::memory_order_relaxed) + 1;
    if (rank == root) memcpy(g.buf(rank, s), p + off, m);
    int rc = arrive(g, 1, s, (uint64_t(4) << 56) ^ (uint64_t(root) << 48) ^ m, who);
    if (rc) return rc;
    if (rank != root) memcpy(p + off, g.buf(root, s), m);
  }
  return 0;
}

// Post `nbytes` to group rank dst without waiting for it to be received: 0 copied into
// the mailbox, 4 no room (the caller sends it over gloo: the entry says so).
int tpk_send(void* base, int rank, const void* x, size_t nbytes, int dst, double timeout_s,
             int* who) {
  Group g = group_of(base, rank, timeout_s);
  Mailbox* m = g.mailbox(rank, dst);
  const size_t q = mailbox_bytes(g.n);
  uint64_t k = m->written.load(std::memory_order_relaxed);
  if (k >= kEntries) {  // entry k reuses entry k - kEntries: wait until that one was read
    int rc = wait_until(g, m->read, k - kEntries + 1, dst, who);
    if (rc) return rc;
  }
  uint64_t at = m->bytes_written.load(std::memory_order_relaxed);
  bool fits = at + nbytes - m->bytes_read.load(std::memory_order_acquire) <= q;
  if (fits) {
    size_t off = at % q, first = nbytes < q - off ? nbytes : q - off;
    memcpy(ring(m) + off, x, first);
    memcpy(ring(m), static_cast<const char*>(x) + first, nbytes - first);
    m->bytes_written.store(at + nbytes, std::memory_order_relaxed);
  }
  m->entry[k % kEntries] = (uint64_t(nbytes) << 1) | (fits ? 0 : 1);
  m->written.store(k + 1, std::memory_order_release);
  notify(g.h->slots[rank]);
  return fits ? 0 : 4;
}

// Receive `nbytes` from group rank src into x: 0 done, 4 it comes over gloo (the caller
// receives it there), 3 the sizes differ, 1/2 the peer died / timed out.
int tpk_recv(void* base, int rank, void* x, size_t nbytes, int src, double timeout_s, int* who) {
  Group g = group_of(base, rank, timeout_s);
  Mailbox* m = g.mailbox(src, rank);
  const size_t q = mailbox_bytes(g.n);
  uint64_t k = m->read.load(std::memory_order_relaxed);
  int rc = wait_until(g, m->written, k + 1, src, who);
  if (rc) return rc;
  uint64_t e = m->entry[k % kEntries];
  if ((e >> 1) != nbytes) { *who = src; return 3; }
  if (e & 1) {
    m->read.store(k + 1, std::memory_order_release);
    notify(g.h->slots[rank]);
    return 4;
  }
  uint64_t at = m->bytes_read.load(std::memory_order_relaxed);
  size_t off = at % q, first = nbytes < q - off ? nbytes : q - off;
  memcpy(x, ring(m) + off, first);
  memcpy(static_cast<char*>(x) + first, ring(m), nbytes - first);
  m->bytes_read.store(at + nbytes, std::memory_order_release);
  m->read.store(k + 1, std::memory_order_release);
  notify(g.h->slots[rank]);
  return 0;
}

}  // extern "C"
