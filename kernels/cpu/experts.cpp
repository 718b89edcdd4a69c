// CPU expert kernels: gate-weighted SwiGLU experts read straight from host-pool slots (with
// gpt-oss's biases and clamped SwiGLU where the slot layout has them).
//
// Built by ftkit.kernels.cpu with -O3 -march=native -fopenmp -ffp-contract=off and called through
// ctypes (plain C ABI, raw pointers, GIL released). Decode is memory-bound: each weight byte is
// read once per call, converted to float32 in registers, and used for every token of its expert.
// GGUF block formats (ggml's layouts, as kernels/dequant.py documents them) are decoded one block
// at a time into a few hundred floats in L1, then multiplied there: the weights cross DRAM as
// blocks. Each decoder computes kernels/dequant.py's float32 values operation for operation (no
// fused multiply-add: -ffp-contract=off), and the products run in the float32 path's order, so a
// block slot gives bit for bit what its dequantized float32 slot gives.
//
// Determinism: every (row, token) dot product is accumulated by one thread in one fixed order,
// whatever the thread count, the other tokens or the other experts of the call, so an assignment's
// result is bitwise reproducible however the runtime batches or splits a layer.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// Q4_K/Q5_K/Q6_K decoded in registers (see BQ45_K) take AVX-512 F and BW (every AVX-512 x86
// since Skylake-SP)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FUSED_BLOCKS 1
#else
#define FUSED_BLOCKS 0
#endif

namespace {

// Format codes (kernels/cpu/__init__.py's FORMAT_CODES); a call passes one per part, packed as
// gate | up << 8 | down << 16.
enum Dtype { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
             IQ4_XS, MXFP4, N_FORMATS };

float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {  // zero or subnormal: man * 2^-24 is exact in float32
    float f = std::ldexp(float(man), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One SIMD vector of W floats; the widest ISA the compiler was told about.
#if defined(__AVX512F__)
constexpr int W = 16, TBMAX = 8;  // 2 rows x 8 tokens = 16 accumulators of 32 registers
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float s) { return _mm512_set1_ps(s); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V load_bf16(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline V load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline V load_i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline V pin(V v) { asm("" : "+v"(v)); return v; }  // v, in a register (see `dot`)
const char* const ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int W = 8, TBMAX = 4;  // 2 rows x 4 tokens = 8 accumulators of 16 registers
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float s) { return _mm256_set1_ps(s); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V load_bf16(const uint8_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline V load_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline V load_i8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline V pin(V v) { asm("" : "+v"(v)); return v; }
const char* const ISA = "avx2";
#else
constexpr int W = 1, TBMAX = 4;  // portable scalar code (still correct, far from DRAM speed)
using V = float;
inline V vzero() { return 0.0f; }
inline V vset(float s) { return s; }
inline V vload(const float* p) { return *p; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline V vmul(V a, V b) { return a * b; }
inline V vadd(V a, V b) { return a + b; }
inline float vsum(V a) { return a; }
inline void vstore(float* p, V a) { *p = a; }
inline V load_bf16(const uint8_t* p) { uint16_t b; std::memcpy(&b, p, 2); return bf16_to_float(b); }
inline V load_f16(const uint8_t* p) { uint16_t b; std::memcpy(&b, p, 2); return half_to_float(b); }
inline V load_i8(const uint8_t* p) { return float(int8_t(*p)); }
inline V pin(V v) { return v; }
const char* const ISA = "scalar";
#endif

inline void pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// The graph-decode worker's threads: its own thread and n - 1 helpers, kept between calls.
// Not OpenMP's team there: a process has one libgomp, torch's, and once torch has made its own
// OpenMP team the process holds more libgomp threads than CPUs, so libgomp lets an idle team
// thread spin only ~100 times before it sleeps on a futex (GOMP_SPINCOUNT is read when libgomp
// loads, at torch's import). The worker gets a layer every few hundred microseconds, and every
// layer then woke 14 sleeping threads, some late: on Qwen3-Next's small experts the worker
// streamed 45 GB/s, 100 with this team (docs/benchmarks.md). A helper spins after its job,
// `pause` for ~1000 rounds, then yielding its core to anything runnable, and sleeps after IDLE.
// A team that with one more thread (the one driving the GPU) wants more cores than the process
// may use sleeps right after each job, as libgomp does then: a spinning thread would hold a core
// another one needs. The host-planned paths (`Runner`, direct calls) keep OpenMP: there torch's
// own threads run between calls, and libgomp's throttling keeps both teams from spinning at once.
class Team {
 public:
  static constexpr auto IDLE = std::chrono::milliseconds(50);

  explicit Team(int n) : spin_(n + 1 <= available_cpus()) {
    for (int t = 1; t < n; ++t) helpers_.emplace_back([this, t] { loop(t); });
  }
  ~Team() {
    stop_ = true;
    gen_.fetch_add(1);
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
    for (auto& h : helpers_) h.join();
  }

  // f(t) on every thread t of the team (0: the caller); returns once every call has returned.
  template <class F>
  void run(F& f) {
    job_ = [](void* ctx, int t) { (*static_cast<F*>(ctx))(t); };
    ctx_ = &f;
    left_.store(int(helpers_.size()), std::memory_order_relaxed);
    gen_.fetch_add(1);  // seq_cst, as the sleepers' count after it (see `loop`)
    if (sleepers_.load()) {
      { std::lock_guard<std::mutex> lock(mu_); }
      cv_.notify_all();
    }
    f(0);
    for (int spins = 0; left_.load(std::memory_order_acquire) > 0; ++spins)
      if (spins < 4096) pause();
      else std::this_thread::yield();  // a helper may be waiting for this core
  }

 private:
  static int available_cpus() {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
#endif
    return int(std::max(1u, std::thread::hardware_concurrency()));
  }

  void loop(int t) {
    uint64_t seen = 0;
    auto idle_since = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      const uint64_t g = gen_.load();
      if (g == seen) {
        if (spins < (spin_ ? 1024 : 100)) {
          pause();
        } else if (spin_ && std::chrono::steady_clock::now() - idle_since < IDLE) {
          std::this_thread::yield();
        } else {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleepers_;
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          --sleepers_;
        }
        continue;
      }
      seen = g;
      if (stop_) return;
      job_(ctx_, t);
      left_.fetch_sub(1, std::memory_order_release);
      idle_since = std::chrono::steady_clock::now();
      spins = 0;
    }
  }

  const bool spin_;
  std::vector<std::thread> helpers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> left_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
  void (*job_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Weight rows by stored dtype: `vec` loads W weights at element i as floats, `one` a single one.
struct LoadF32 {
  static size_t row_bytes(int n) { return size_t(n) * 4; }
  static V vec(const uint8_t* r, int i) { return vload((const float*)r + i); }
  static float one(const uint8_t* r, int i) { float f; std::memcpy(&f, r + 4 * size_t(i), 4); return f; }
};
struct LoadBF16 {
  static size_t row_bytes(int n) { return size_t(n) * 2; }
  static V vec(const uint8_t* r, int i) { return load_bf16(r + 2 * size_t(i)); }
  static float one(const uint8_t* r, int i) { uint16_t b; std::memcpy(&b, r + 2 * size_t(i), 2); return bf16_to_float(b); }
};
struct LoadF16 {
  static size_t row_bytes(int n) { return size_t(n) * 2; }
  static V vec(const uint8_t* r, int i) { return load_f16(r + 2 * size_t(i)); }
  static float one(const uint8_t* r, int i) { uint16_t b; std::memcpy(&b, r + 2 * size_t(i), 2); return half_to_float(b); }
};
// q8_0: blocks of 34 bytes, an fp16 scale then 32 int8. W divides 32, so a vector never crosses a
// block; q * scale is exact in float32 (8 + 11 significant bits), as in dequantize_q8_0.
struct LoadQ8 {
  static size_t row_bytes(int n) { return size_t(n / 32) * 34; }
  static float scale(const uint8_t* b) { uint16_t h; std::memcpy(&h, b, 2); return half_to_float(h); }
  static V vec(const uint8_t* r, int i) {
    const uint8_t* b = r + size_t(i / 32) * 34;
    return vmul(load_i8(b + 2 + i % 32), vset(scale(b)));
  }
  static float one(const uint8_t* r, int i) {
    const uint8_t* b = r + size_t(i / 32) * 34;
    return float(int8_t(b[2 + i % 32])) * scale(b);
  }
};

// Bytes ahead of the current load to prefetch: the hardware prefetchers alone left a third of
// DRAM bandwidth unused (H200 host, 16 threads: 61% of a plain read without, 75-90% with 4096;
// 512..2048 were in between). Past a row's end this prefetches the next row, which is read next.
constexpr size_t PREFETCH = 4096;

// The line at p into L2, not L1 (prefetcht1): a core has a few L1 miss buffers and many more
// L2 ones, so prefetches into L1 capped the lines in flight a thread could stream with; into L2
// the demand loads meet the lines there. Dev box (Zen 4), cpu_experts alternated in one
// process, GB/s at 1 / 2 threads: q4_k_m int8 14.5 / 19.5 -> 18.1 / 26.6 (90% of a plain read at
// 2), bf16 16.3 / 25.7 -> 21.1 / 29.8; its CPU-only decode of a 3-layer Q4_K_M file 114-119 ->
// 146-153 tok/s. The GPU machine's Xeon (H100 host, 15 threads, three rounds): q4_k_m int8 86.3 ->
// 89.8, bf16 108.0 -> 112.7: +4%, within the rounds' spread; no loss anywhere measured.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// The first PREFETCH bytes of a work item's rows (the loops' prefetch runs that far ahead of
// their loads, so without this an item's first 4 KB of each part come in as demand misses).
inline void prefetch_start(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < std::min(bytes, PREFETCH); o += 64) prefetch_l2(p + o);
}

// The lines of the block of BYTES at b + PREFETCH: every one (a Q4_K block spans 3 lines, a Q6_K
// block 4; one prefetch a block left the others to the hardware prefetchers and demand misses).
// q4km cpu decode, int8 path, alternated on two H100 hosts: 241-246 -> 268-290 tok/s; the
// kernel alone at 1 thread 7.6-7.8 -> 10.7-11.5 GB/s of blocks.
template <int BYTES>
inline void prefetch_block(const uint8_t* b) {
  for (int o = 0; o < BYTES; o += 64) prefetch_l2(b + PREFETCH + o);
}

// s[r][t] = dot(rows[r][0:n], xs[t][0:n]) for R weight rows and TB tokens: each weight vector is
// loaded once and used TB times; R independent rows keep the FMA units busy at TB = 1.
template <class L, int R, int TB>
void dot(const uint8_t* const* rows, int n, const float* const* xs, float (*s)[TBMAX]) {
  V acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = vzero();
  int i = 0;
  for (; i + W <= n; i += W) {
    V x[TB];
    // pin: else g++ folds the load into every row's FMA, R loads of each x (from L2 once
    // several tokens' x outgrow L1) instead of one
    for (int t = 0; t < TB; ++t) x[t] = pin(vload(xs[t] + i));
    for (int r = 0; r < R; ++r) {
      prefetch_l2(rows[r] + L::row_bytes(i) + PREFETCH);
      const V w = L::vec(rows[r], i);
      for (int t = 0; t < TB; ++t) acc[r][t] = vfma(w, x[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) s[r][t] = vsum(acc[r][t]);
  for (; i < n; ++i)  // the tail when n is not a multiple of W
    for (int r = 0; r < R; ++r) {
      const float w = L::one(rows[r], i);
      for (int t = 0; t < TB; ++t) s[r][t] += w * xs[t][i];
    }
}

// dot<L, R, tb> for a runtime tb in 1..TB.
template <class L, int R, int TB = TBMAX>
void dot_n(int tb, const uint8_t* const* rows, int n, const float* const* xs, float (*s)[TBMAX]) {
  if constexpr (TB > 1) {
    if (tb < TB) return dot_n<L, R, TB - 1>(tb, rows, n, xs, s);
  }
  dot<L, R, TB>(rows, n, xs, s);
}

// ---- GGUF blocks: decode(b, out) writes a block's weights as kernels/dequant.py computes them ----
inline float f16_at(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }
const float IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const float E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The loops below run over whole runs of 16 or 32 bytes with no per-weight branch, so the
// compiler vectorizes them; each output is the same expression of the same values as in
// kernels/dequant.py. 32-weight blocks keep weights 0..15 in the low nibbles of their 16 bytes
// and 16..31 in the high ones.
template <class F>
inline void nibbles32(const uint8_t* qs, float* o, F value) {
  for (int j = 0; j < 16; ++j) o[j] = value(qs[j] & 15, j);
  for (int j = 0; j < 16; ++j) o[j + 16] = value(qs[j] >> 4, j + 16);
}

// o[j] = scale * table[nibble j] for a 32-weight block's 16 nibble bytes (IQ4_NL, IQ4_XS, MXFP4):
// the 16-entry table is one AVX-512 register, each lookup one permute, where a plain loop is a
// gather per vector. Same product of the same two floats as the loop.
inline void lut32(const uint8_t* qs, float scale, const float* table, float* o) {
#if defined(__AVX512F__)
  const __m512 t = _mm512_loadu_ps(table), sv = _mm512_set1_ps(scale);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs)), low = _mm512_set1_epi32(15);
  _mm512_storeu_ps(o, _mm512_mul_ps(sv, _mm512_permutexvar_ps(_mm512_and_si512(q, low), t)));
  _mm512_storeu_ps(o + 16, _mm512_mul_ps(sv, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t)));
#else
  nibbles32(qs, o, [scale, table](int q, int) { return scale * table[q]; });
#endif
}

#if FUSED_BLOCKS
// Formats with a CHUNK hand their weights to `dot_blocks` a register at a time (`each`),
// multiplied as they are decoded instead of through a decoded block in L1: each register is the
// same expression of the same values as `decode`, so the same sums. Most look each weight up in
// a register of its block's (or sub-block's) 16 or 32 values, made once per 32 weights: one
// permute a vector instead of a convert and a product or two. Dev box, one thread, GFLOP/s
// (cpu_experts, a busy box): q4_0 16.9 -> 22.2, q5_0 2.7 -> 12.0 (its fifth bits were picked one
// weight at a time), mxfp4 22.6 -> 25.3.
using Vi = __m512i;
inline Vi u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline Vi i32(int v) { return _mm512_set1_epi32(v); }
// *p in every lane, loaded so: a broadcast from memory takes a load port, where g++ otherwise keeps
// the scales in registers and spends two shuffles of the permute's port on each
inline __m512 bcast(const float* p) {
  __m512 v;
  asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
  return v;
}
// (a & b) | c, one instruction
inline Vi and_or(Vi a, Vi b, Vi c) { return _mm512_ternarylogic_epi32(a, b, c, 0xEA); }
const __m512 Q0_15 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
             Q16_31 = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
// d * float(q[i]) for the 8 bytes of q (a u64, little-endian), into out[0..7]
inline void scaled8(uint64_t q, float d, float* out) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(q))));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), v));
}
const __m512 Q_8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
             Q_16 = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
const __m512i LANES = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
// f(0, weights 0..15), f(16, weights 16..31) of a 32-weight block whose 16 bytes at qs hold
// weight j's 4-bit index in the low (j < 16) or high nibble of byte j % 16: t[index]; with qh
// (bit j: weight j's fifth bit), the index's fifth bit picks hi over lo
template <class F>
inline void each32(const uint8_t* qs, V t, F f) {
  const Vi q = u8x16(qs);  // vpermps reads the low 4 bits of each index: the low nibble as it is
  f(0, _mm512_permutexvar_ps(q, t));
  f(16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t));
}
template <class F>
inline void each32(const uint8_t* qs, uint32_t qh, V lo, V hi, F f) {
  const Vi q = u8x16(qs), b4 = i32(16);
  const Vi h0 = _mm512_and_si512(_mm512_srlv_epi32(i32(int(qh << 4)), LANES), b4);   // bit j at bit 4
  const Vi h1 = _mm512_and_si512(_mm512_srlv_epi32(i32(int(qh >> 12)), LANES), b4);  // bit 16 + j
  f(0, _mm512_permutex2var_ps(lo, and_or(q, i32(15), h0), hi));
  f(16, _mm512_permutex2var_ps(lo, _mm512_or_si512(_mm512_srli_epi32(q, 4), h1), hi));
}
#endif

struct BQ4_0 {
  static constexpr int BLOCK = 32, BYTES = 18;
  static void decode(const uint8_t* b, float* o) {
    const float d = f16_at(b);
    nibbles32(b + 2, o, [d](int q, int) { return d * float(q - 8); });
  }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  struct Scales { V t; };  // the 16 values d * (q - 8)
  static void scales(const uint8_t* b, Scales& s) { s.t = _mm512_mul_ps(_mm512_set1_ps(f16_at(b)), Q_8); }
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int, F f) { each32(b + 2, s.t, f); }
#endif
};
struct BQ4_1 {
  static constexpr int BLOCK = 32, BYTES = 20;
  static void decode(const uint8_t* b, float* o) {
    const float d = f16_at(b), m = f16_at(b + 2);
    nibbles32(b + 4, o, [d, m](int q, int) { return d * float(q) + m; });
  }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  struct Scales { V t; };  // d * q + m
  static void scales(const uint8_t* b, Scales& s) {
    s.t = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16_at(b)), Q0_15), _mm512_set1_ps(f16_at(b + 2)));
  }
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int, F f) { each32(b + 4, s.t, f); }
#endif
};
// q5's fifth bits: bit j of the little-endian u32 before the nibbles is weight j's
inline uint32_t u32_at(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
struct BQ5_0 {
  static constexpr int BLOCK = 32, BYTES = 22;
  static void decode(const uint8_t* b, float* o) {
    const float d = f16_at(b);
    const uint32_t qh = u32_at(b + 2);
    nibbles32(b + 6, o, [d, qh](int q, int j) { return d * float((q | int((qh >> j) & 1) << 4) - 16); });
  }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  struct Scales { V lo, hi; };  // d * (q - 16) for q < 16, q >= 16
  static void scales(const uint8_t* b, Scales& s) {
    const V d = _mm512_set1_ps(f16_at(b));
    s.lo = _mm512_mul_ps(d, Q_16), s.hi = _mm512_mul_ps(d, Q0_15);
  }
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int, F f) { each32(b + 6, u32_at(b + 2), s.lo, s.hi, f); }
#endif
};
struct BQ5_1 {
  static constexpr int BLOCK = 32, BYTES = 24;
  static void decode(const uint8_t* b, float* o) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    nibbles32(b + 8, o, [d, m, qh](int q, int j) { return d * float(q | int((qh >> j) & 1) << 4) + m; });
  }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  struct Scales { V lo, hi; };  // d * q + m for q < 16, q >= 16
  static void scales(const uint8_t* b, Scales& s) {
    const V d = _mm512_set1_ps(f16_at(b)), m = _mm512_set1_ps(f16_at(b + 2));
    s.lo = _mm512_add_ps(_mm512_mul_ps(d, Q0_15), m), s.hi = _mm512_add_ps(_mm512_mul_ps(d, Q16_31), m);
  }
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int, F f) { each32(b + 8, u32_at(b + 4), s.lo, s.hi, f); }
#endif
};
struct BIQ4_NL {
  static constexpr int BLOCK = 32, BYTES = 18;
  static void decode(const uint8_t* b, float* o) {
    const float d = f16_at(b);
    lut32(b + 2, d, IQ4_LEVELS, o);
  }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  struct Scales { V t; };  // d * level
  static void scales(const uint8_t* b, Scales& s) {
    s.t = _mm512_mul_ps(_mm512_set1_ps(f16_at(b)), _mm512_loadu_ps(IQ4_LEVELS));
  }
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int, F f) { each32(b + 2, s.t, f); }
#endif
};
struct BMXFP4 {
  static constexpr int BLOCK = 32, BYTES = 17;
  // GGML_E8M0_TO_FP32_HALF: 2^(e - 128), the subnormals 2^-128 and 2^-127 for e < 2
  static float scale(const uint8_t* b) {
    const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float s;
    std::memcpy(&s, &bits, 4);
    return s;
  }
  static void decode(const uint8_t* b, float* o) { lut32(b + 1, scale(b), E2M1_X2, o); }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  struct Scales { V t; };  // scale * e2m1 value
  static void scales(const uint8_t* b, Scales& s) { s.t = _mm512_mul_ps(_mm512_set1_ps(scale(b)), _mm512_loadu_ps(E2M1_X2)); }
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int, F f) { each32(b + 1, s.t, f); }
#endif
};
// Q2_K and Q3_K: weight h * 128 + k * 32 + l (h < 2, k < 4, l < 32) is bits 2k..2k+1 of byte
// h * 32 + l of the 2-bit fields, in group (of 16 weights, one scale) h * 8 + 2k + l / 16. In
// registers (dev box, one thread, 8 qwen3-30b-a3b experts a call): Q2_K 6.1 -> 11.9 GFLOP/s,
// Q3_K 2.2 -> 6.7 (through L1 before).
struct BQ2_K {
  static constexpr int BLOCK = 256, BYTES = 84, CHUNK = 128;
  struct Scales {
    float d[16], m[16];  // per group of 16: d * scale, dmin * min
  };
  static void scales(const uint8_t* b, Scales& s) {
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
#if FUSED_BLOCKS
    const Vi sc = u8x16(b);
    _mm512_storeu_ps(s.d, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_and_si512(sc, i32(15)))));
    _mm512_storeu_ps(s.m, _mm512_mul_ps(_mm512_set1_ps(dmin), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4))));
#else
    for (int g = 0; g < 16; ++g) s.d[g] = d * float(b[g] & 15), s.m[g] = dmin * float(b[g] >> 4);
#endif
  }
  static void decode(const uint8_t* b, float* o) {
    Scales s;
    scales(b, s);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int half = 0; half < 2; ++half) {
          const int g = h * 8 + 2 * k + half;
          const float dl = s.d[g], ml = s.m[g];
          const uint8_t* qs = b + 16 + h * 32 + half * 16;
          float* out = o + h * 128 + k * 32 + half * 16;
          for (int l = 0; l < 16; ++l) out[l] = dl * float((qs[l] >> (2 * k)) & 3) - ml;
        }
  }
#if FUSED_BLOCKS
  // f(i, weights i .. i + 15) for the half of 128 weights from c, in order
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int c, F f) {
    const Vi q[2] = {u8x16(b + 16 + c / 4), u8x16(b + 32 + c / 4)};
    for (int k = 0; k < 4; ++k)
      for (int half = 0; half < 2; ++half) {
        const int g = c / 16 + 2 * k + half;
        const V v = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[half], 2 * k), i32(3)));
        f(c + k * 32 + half * 16, _mm512_sub_ps(_mm512_mul_ps(bcast(s.d + g), v), bcast(s.m + g)));
      }
  }
#endif
};
struct BQ3_K {
  static constexpr int BLOCK = 256, BYTES = 110, CHUNK = 128;
  struct Scales {
    float d[16];  // per group of 16: d * (6-bit scale - 32)
  };
  static void scales(const uint8_t* b, Scales& s) {
    const float d = f16_at(b + 108);
    const uint8_t* sc = b + 96;
    for (int g = 0; g < 16; ++g) {
      const int low4 = g < 8 ? sc[g] & 15 : sc[g - 8] >> 4, top2 = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
      s.d[g] = d * float(int8_t(low4 | (top2 << 4)) - 32);
    }
  }
  static void decode(const uint8_t* b, float* o) {
    Scales s;
    scales(b, s);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int half = 0; half < 2; ++half) {
          const float dl = s.d[h * 8 + 2 * k + half];
          const uint8_t *qs = b + 32 + h * 32 + half * 16, *hm = b + half * 16;  // weight f's high bit: byte f % 32, bit f / 32
          float* out = o + h * 128 + k * 32 + half * 16;
          for (int l = 0; l < 16; ++l)
            out[l] = dl * float(((qs[l] >> (2 * k)) & 3) - 4 * (1 - ((hm[l] >> (h * 4 + k)) & 1)));
        }
  }
#if FUSED_BLOCKS
  // f(i, weights i .. i + 15) for the half of 128 weights from c, in order: each group's 8
  // values dl * (q - 4) looked up by q's two low bits and its high bit (bit 2 of the index)
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int c, F f) {
    const int h = c / 128;
    const Vi q[2] = {u8x16(b + 32 + c / 4), u8x16(b + 48 + c / 4)};
    const Vi hm[2] = {_mm512_slli_epi32(u8x16(b), 2), _mm512_slli_epi32(u8x16(b + 16), 2)};  // bit j at j + 2
    const __m512 levels = _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int k = 0; k < 4; ++k)
      for (int half = 0; half < 2; ++half) {
        const Vi hb = _mm512_and_si512(_mm512_srli_epi32(hm[half], h * 4 + k), i32(4));
        const Vi idx = and_or(_mm512_srli_epi32(q[half], 2 * k), i32(3), hb);
        const V t = _mm512_mul_ps(bcast(s.d + c / 16 + 2 * k + half), levels);
        f(c + k * 32 + half * 16, _mm512_permutexvar_ps(idx, t));
      }
  }
#endif
};
// Q4_K, Q5_K and Q6_K (what llama-quantize's _K_M mixes are made of) in registers (`each`):
// Q4_K/Q5_K look each weight up in its sub-block's 16 (32) values d * q - dmin * m; Q6_K puts a
// half-block's 6-bit values together 64 bytes at a time. Scales are decoded a block at a time in
// vector registers and broadcast from memory. At one thread on the dev box (cpu_experts, 1 token,
// 8 experts a call), GFLOP/s: Q4_K 8.5 -> 23.5, Q6_K 8.4 -> 15.4 (4.0 through L1), q4_k_m 8.4 ->
// 19.4; bf16 reads DRAM at 12.8 there. On the GPU machine at 15 threads q4_k_m went 18.2 -> 33.2
// GB/s of blocks (docs/benchmarks.md).
// Q4_K/Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63, *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
// scale_min_k4 for the 8 sub-blocks at once from the 12 scale bytes at s: the 6-bit scales as the
// 8 bytes of *sc, the mins as those of *m. Bytes 0..3 hold the scales of 0..3 in their low 6 bits,
// 4..7 the mins; 4..7 take 4 low bits from bytes 8..11 and 2 high ones from bytes 0..7.
inline void scales_mins_k4(const uint8_t* s, uint64_t* sc, uint64_t* m) {
  const uint32_t w0 = u32_at(s), w1 = u32_at(s + 4), w2 = u32_at(s + 8);
  const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
  const uint32_t sc_hi = (w2 & lo4) | (((w0 >> 6) & lo2) << 4), m_hi = ((w2 >> 4) & lo4) | (((w1 >> 6) & lo2) << 4);
  *sc = uint64_t(w0 & lo6) | uint64_t(sc_hi) << 32;
  *m = uint64_t(w1 & lo6) | uint64_t(m_hi) << 32;
}
// Q4_K/Q5_K: 8 sub-blocks of 32; sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes
// c * 32 .. c * 32 + 31; Q5_K's fifth bit of weight l of sub-block j is bit j of high byte l.
template <bool FIFTH>
struct BQ45_K {
  static constexpr int BLOCK = 256, BYTES = FIFTH ? 176 : 144, CHUNK = 64;
  struct Scales {
    float d[8], dm[8];  // per sub-block: d * scale, dmin * min
  };
  static void scales(const uint8_t* b, Scales& s) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
#if FUSED_BLOCKS
    uint64_t sc, m;
    scales_mins_k4(b + 4, &sc, &m);
    scaled8(sc, d, s.d);
    scaled8(m, dmin, s.dm);
#else
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(b + 4, j, &sc, &m);
      s.d[j] = d * float(sc), s.dm[j] = dmin * float(m);
    }
#endif
  }
  static void decode(const uint8_t* b, float* o) {
    Scales s;
    scales(b, s);
    const uint8_t *qs = b + (FIFTH ? 48 : 16), *qh = b + 16;
    for (int c = 0; c < 4; ++c) {
      const float d0 = s.d[2 * c], dm0 = s.dm[2 * c], d1 = s.d[2 * c + 1], dm1 = s.dm[2 * c + 1];
      const uint8_t* q = qs + c * 32;
      float *lo = o + c * 64, *hi = lo + 32;
      for (int l = 0; l < 32; ++l) {
        const int h0 = FIFTH ? ((qh[l] >> (2 * c)) & 1) << 4 : 0, h1 = FIFTH ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
        lo[l] = d0 * float((q[l] & 15) | h0) - dm0;
        hi[l] = d1 * float((q[l] >> 4) | h1) - dm1;
      }
    }
  }
#if FUSED_BLOCKS
  // sub-block j's values d * q - dmin * m for the 16 q of `q`, as `decode` computes them
  static V values(const Scales& s, int j, V q) {
    return _mm512_sub_ps(_mm512_mul_ps(bcast(s.d + j), q), bcast(s.dm + j));
  }
  // f(i, weights i .. i + 15) for the 64 weights from c (sub-blocks c / 32 and c / 32 + 1), in order
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int c, F f) {
    const int j = c / 32;
    const uint8_t* q = b + (FIFTH ? 48 : 16) + c / 2;
    const Vi a = u8x16(q), a16 = u8x16(q + 16);
    if constexpr (!FIFTH) {  // vpermps reads the low 4 bits of each index: the low nibble as it is
      const V t0 = values(s, j, Q0_15), t1 = values(s, j + 1, Q0_15);
      f(c, _mm512_permutexvar_ps(a, t0));
      f(c + 16, _mm512_permutexvar_ps(a16, t0));
      f(c + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), t1));
      f(c + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(a16, 4), t1));
    } else {  // 32 values a sub-block, two registers; the index's bit 4 is the fifth bit
      const V t0 = values(s, j, Q0_15), t0h = values(s, j, Q16_31), t1 = values(s, j + 1, Q0_15), t1h = values(s, j + 1, Q16_31);
      const Vi h = _mm512_slli_epi32(u8x16(b + 16), 4), h16 = _mm512_slli_epi32(u8x16(b + 32), 4);
      const Vi b4 = i32(16), n4 = i32(15);
      auto fifth = [&](Vi hv, int bit) { return _mm512_and_si512(_mm512_srli_epi32(hv, bit), b4); };
      f(c, _mm512_permutex2var_ps(t0, and_or(a, n4, fifth(h, j)), t0h));
      f(c + 16, _mm512_permutex2var_ps(t0, and_or(a16, n4, fifth(h16, j)), t0h));
      f(c + 32, _mm512_permutex2var_ps(t1, _mm512_or_si512(_mm512_srli_epi32(a, 4), fifth(h, j + 1)), t1h));
      f(c + 48, _mm512_permutex2var_ps(t1, _mm512_or_si512(_mm512_srli_epi32(a16, 4), fifth(h16, j + 1)), t1h));
    }
  }
#endif
};
// Q6_K: two halves of 128; in half h, weights k * 32 + l take the low nibble (k < 2) or high
// (k >= 2) of byte h * 64 + (k % 2) * 32 + l and bits 2k..2k+1 of byte 128 + h * 32 + l; one int8
// scale per 16 weights.
struct BQ6_K {
  static constexpr int BLOCK = 256, BYTES = 210, CHUNK = 128;
  struct Scales {
    float d[16];  // per 16 weights: d * scale
  };
  static void scales(const uint8_t* b, Scales& s) {
    const float d = f16_at(b + 208);
#if defined(__AVX512F__)
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192))));
    _mm512_storeu_ps(s.d, _mm512_mul_ps(_mm512_set1_ps(d), sc));
#else
    for (int g = 0; g < 16; ++g) s.d[g] = d * float(int8_t(b[192 + g]));
#endif
  }
  static void decode(const uint8_t* b, float* o) {
    Scales s;
    scales(b, s);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int half = 0; half < 2; ++half) {
          const float dl = s.d[h * 8 + 2 * k + half];
          const uint8_t *ql = b + h * 64 + (k % 2) * 32 + half * 16, *qh = b + 128 + h * 32 + half * 16;
          float* out = o + h * 128 + k * 32 + half * 16;
          const int shift = k < 2 ? 0 : 4;
          for (int l = 0; l < 16; ++l)
            out[l] = dl * float((((ql[l] >> shift) & 15) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
        }
  }
#if FUSED_BLOCKS
  // f(i, weights i .. i + 15) for the half of 128 weights from c, in order. The half's 6-bit
  // values are put together as bytes, 64 at a time (its low nibbles are 64 bytes in a row, its
  // high bits 32), minus 32 as int8 in the weights' own order; each 16 then widen, convert and
  // take their scale.
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int c, F f) {
    const Vi ql = _mm512_loadu_si512(b + c / 2);  // k = 0 | k = 1 low nibbles; k = 2 | 3 high
    const Vi qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + c / 4)));
    // bits 2k, 2k + 1 of the high bytes moved to bits 4, 5: 16-bit shifts, bytes apart by the masks
    const Vi sh01 = _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
    const Vi sh23 = _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1));
    const Vi n4 = _mm512_set1_epi8(15), b45 = _mm512_set1_epi8(48), b32 = _mm512_set1_epi8(32);
    alignas(64) int8_t q[128];
    _mm512_store_si512(q, _mm512_sub_epi8(and_or(sh01, b45, _mm512_and_si512(ql, n4)), b32));
    _mm512_store_si512(q + 64, _mm512_sub_epi8(and_or(sh23, b45, _mm512_and_si512(_mm512_srli_epi16(ql, 4), n4)), b32));
    const float* d = s.d + c / 16;
    for (int v = 0; v < 8; ++v)
      f(c + 16 * v, _mm512_mul_ps(bcast(d + v), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(q + 16 * v))))));
  }
#endif
};
struct BIQ4_XS {
  static constexpr int BLOCK = 256, BYTES = 136;
  struct Scales {
    float d[8];  // per sub-block of 32
  };
  static void scales(const uint8_t* b, Scales& s) {
    const float d = f16_at(b);
    const int high_bits = b[2] | (b[3] << 8);
    for (int j = 0; j < 8; ++j) {
      const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 15, high = (high_bits >> (2 * j)) & 3;
      s.d[j] = d * float(int8_t(low | (high << 4)) - 32);
    }
  }
  static void decode(const uint8_t* b, float* o) {
    Scales s;
    scales(b, s);
    for (int j = 0; j < 8; ++j) lut32(b + 8 + j * 16, s.d[j], IQ4_LEVELS, o + j * 32);
  }
#if FUSED_BLOCKS
  static constexpr int CHUNK = 32;
  template <class F>
  static void each(const uint8_t* b, const Scales& s, int c, F f) {
    each32(b + 8 + c / 2, _mm512_mul_ps(bcast(s.d + c / 32), _mm512_loadu_ps(IQ4_LEVELS)),
           [&](int j, V w) { f(c + j, w); });
  }
#endif
};

// s[r][t] = dot(rows[r][0:n], xs[t][0:n]) for rows of D's blocks: each block decoded once into
// L1, then multiplied in the float32 path's order (`dot`: W at a time from element 0, one
// accumulator per row and token), so the result is dot<LoadF32>'s on the dequantized rows.
template <class D, class = void>
struct fused : std::false_type {};
#if FUSED_BLOCKS
template <class D>
struct fused<D, std::void_t<decltype(D::CHUNK)>> : std::true_type {};
#endif

template <class D, int R, int TB>
void dot_blocks(const uint8_t* const* rows, int n, const float* const* xs, float (*s)[TBMAX]) {
  V acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = vzero();
#if FUSED_BLOCKS
  if constexpr (fused<D>::value) {  // each vector of weights decoded where it is multiplied
    typename D::Scales sc[R];
    const uint8_t* b[R];
    for (int blk = 0; blk < n / D::BLOCK; ++blk) {
      for (int r = 0; r < R; ++r) {
        b[r] = rows[r] + size_t(blk) * D::BYTES;
        prefetch_block<D::BYTES>(b[r]);
        D::scales(b[r], sc[r]);
      }
      const int base = blk * D::BLOCK;
      for (int c = 0; c < D::BLOCK; c += D::CHUNK)
        for (int r = 0; r < R; ++r)
          D::each(b[r], sc[r], c, [&](int j, V w) {
            for (int t = 0; t < TB; ++t) acc[r][t] = vfma(w, vload(xs[t] + base + j), acc[r][t]);
          });
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t) s[r][t] = vsum(acc[r][t]);
    return;
  }
#endif
  alignas(64) float buf[R][D::BLOCK];
  for (int blk = 0; blk < n / D::BLOCK; ++blk) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = rows[r] + size_t(blk) * D::BYTES;
      prefetch_block<D::BYTES>(b);
      D::decode(b, buf[r]);
    }
    const int base = blk * D::BLOCK;
    for (int j = 0; j < D::BLOCK; j += W) {
      V x[TB];
      for (int t = 0; t < TB; ++t) x[t] = pin(vload(xs[t] + base + j));
      for (int r = 0; r < R; ++r) {
        const V w = vload(buf[r] + j);
        for (int t = 0; t < TB; ++t) acc[r][t] = vfma(w, x[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) s[r][t] = vsum(acc[r][t]);
}

template <class D>
void decode_row(const uint8_t* row, int n, float* out) {
  for (int blk = 0; blk < n / D::BLOCK; ++blk) D::decode(row + size_t(blk) * D::BYTES, out + size_t(blk) * D::BLOCK);
}

template <class D, int R, int TB = TBMAX>
void dot_blocks_n(int tb, const uint8_t* const* rows, int n, const float* const* xs, float (*s)[TBMAX]) {
  if constexpr (TB > 1) {
    if (tb < TB) return dot_blocks_n<D, R, TB - 1>(tb, rows, n, xs, s);
  }
  dot_blocks<D, R, TB>(rows, n, xs, s);
}

#include "int8_dots.h"
#include "decode_attention.h"

// What a part's format needs: its row size, its products of one and of two rows, (blocks) a row
// decoder for the multi-token path, and (formats the int8 path has) its products on quantized
// activations, which take rows of a multiple of `unit` weights.
using DotFn = void (*)(int, const uint8_t* const*, int, const float* const*, float (*)[TBMAX]);
struct Format {
  int block, bytes;  // weights per block and its bytes (a plain dtype: 1 and its size)
  DotFn dot1, dot2;
  void (*decode)(const uint8_t*, int, float*);  // null: read in place whatever the token count
  QDotFn qdot1 = nullptr, qdot2 = nullptr;
  int unit = 0;
  size_t row_bytes(int n) const { return size_t(n / block) * bytes; }
  bool int8(int n) const { return qdot1 && n % unit == 0; }
};
template <class L>
constexpr Format plain(int block, int bytes) { return {block, bytes, dot_n<L, 1>, dot_n<L, 2>, nullptr}; }
template <class D>
constexpr Format blocks() { return {D::BLOCK, D::BYTES, dot_blocks_n<D, 1>, dot_blocks_n<D, 2>, decode_row<D>}; }
// `f` with the int8 products of Q (where this build has the int8 path)
template <class Q>
constexpr Format with_int8(Format f) {
#if INT8_PATH
  f.qdot1 = qdot_n<Q, 1>, f.qdot2 = qdot_n<Q, 2>, f.unit = Q::UNIT;
#endif
  return f;
}
const Format FORMATS[N_FORMATS] = {
    plain<LoadF32>(1, 4), plain<LoadF16>(1, 2), plain<LoadBF16>(1, 2),
    with_int8<I32Blocks<S8_0>>(plain<LoadQ8>(32, 34)),
    with_int8<I32Blocks<S4_0>>(blocks<BQ4_0>()), blocks<BQ4_1>(), blocks<BQ5_0>(), blocks<BQ5_1>(), blocks<BQ2_K>(),
    blocks<BQ3_K>(), with_int8<IQ4_K>(blocks<BQ45_K<false>>()), blocks<BQ45_K<true>>(),
    with_int8<IQ6_K>(blocks<BQ6_K>()), with_int8<I32Blocks<SIQ4_NL>>(blocks<BIQ4_NL>()), blocks<BIQ4_XS>(),
    with_int8<I32Blocks<SMXFP4>>(blocks<BMXFP4>()),
};

struct Call {
  int H, I;
  // byte offsets within a slot of gate [I,H], up [I,H], down [H,I], then of the float32 biases
  // of gate [I], up [I], down [H], or -1 where the experts have none
  const int64_t* part_off;
  int n;                    // experts in this call
  const uint8_t* const* slots;
  const int64_t* start;    // [n + 1]: expert e owns assignments start[e] .. start[e+1]
  const int64_t* tok;      // per assignment: its row of x
  const float* weight;     // per assignment: its router weight
  const int64_t* out_row;  // per assignment: its row of out
  const float* x;          // [tokens, H] float32
  float* out;              // [rows, H] float32
  int threads;
  int64_t* claim;          // null: run every expert; else the split shared with the GPU (`take`)
  Team* team = nullptr;    // the threads to run on (the graph-decode worker's); null: OpenMP's
  const float* clamp = nullptr;  // null: silu(g) * u; else {alpha, limit} of gpt-oss's clamped SwiGLU
  const Format* fmt[3] = {};  // each part's format (set by `dispatch`)
  // The int8 path (set by `dispatch`; null: the float path): each token's row of x quantized
  // (q8_bytes(H) apart) where gate and up take it; room for each assignment's h quantized
  // (q8_bytes(I) apart) where down does, with its state (0 to do, 1 under way, 2 done)
  const uint8_t* xq = nullptr;
  uint8_t* hq = nullptr;
  std::atomic<int>* hq_state = nullptr;
};

// Part `p` of a slot as float32 biases, or null where the layout has none.
inline const float* bias(const Call& c, long e, int p) {
  return c.part_off[p] < 0 ? nullptr : (const float*)(c.slots[e] + c.part_off[p]);
}

// The activation of gate and up pre-activations g and u (transformers' order of operations).
inline float activate(const float* clamp, float g, float u) {
  if (!clamp) return g / (1.0f + std::exp(-g)) * u;
  const float alpha = clamp[0], limit = clamp[1];
  g = std::min(g, limit);
  u = std::max(-limit, std::min(u, limit));
  return (u + 1.0f) * (g / (1.0f + std::exp(-g * alpha)));
}

// A split of experts 0..n-1 shared by two branches while they run: the GPU's side takes fills
// from the front (the most-used experts first), the CPU takes experts from the back, one at a
// time, until the two meet. Whichever branch runs faster takes more, so neither waits for a
// split fixed in advance from estimated rates. One 64-bit word: front in the low half, back
// (exclusive) in the high half, changed only by compare-and-swap.
int take(int64_t* claim, bool front) {
  int64_t v = __atomic_load_n(claim, __ATOMIC_ACQUIRE);
  while (true) {
    const int64_t f = v & 0xffffffff, b = v >> 32;
    if (f >= b) return -1;
    const int64_t next = front ? (b << 32) | (f + 1) : ((b - 1) << 32) | f;
    if (__atomic_compare_exchange_n(claim, &v, next, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      return int(front ? f : b - 1);
  }
}

// Rows per work item: big enough to stream (at most 2 x 16 rows x H of gate+up, 64 rows x I of
// down), small enough that the dynamic schedule balances the experts in flight over every thread
// (~8 items per thread; a shared split has one expert in flight at a time).
int chunk_rows(int rows, long experts, int threads, int lo, int hi) {
  const long per = rows * experts / (8L * threads);
  return int(std::max<long>(lo, std::min<long>(hi, per))) & ~1;  // even: down rows go in pairs
}

// Expert e's assignments in blocks of at most TBMAX, as even as can be (9 = 5 + 4, not 8 + 1: a
// block of one runs the weights again at one FMA per load): f(a0, tb) for each block.
template <class F>
void token_blocks(const Call& c, long e, F f) {
  const int64_t n = c.start[e + 1] - c.start[e], blocks = (n + TBMAX - 1) / TBMAX;
  for (int64_t b = 0, a0 = c.start[e]; b < blocks; ++b) {
    const int tb = int(n / blocks + (b < n % blocks));
    f(a0, tb);
    a0 += tb;
  }
}

// A thread's float32 copy of the weight rows it works on, for experts with more tokens than one
// pass takes (prefill, a long extend): decoded once instead of once per TBMAX tokens.
float* tile(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// s[q][t] for r (1 or 2) rows of format f and tb tokens: on the quantized rows xq where given,
// else on the float32 rows xs
inline void dot_rows(const Format* f, int r, int tb, const uint8_t* const* rows, int n, const float* const* xs,
                     const uint8_t* const* xq, float (*s)[TBMAX]) {
  if (xq) (r == 2 ? f->qdot2 : f->qdot1)(tb, rows, n, xq, s);
  else (r == 2 ? f->dot2 : f->dot1)(tb, rows, n, xs, s);
}

#if INT8_PATH
// Assignment a's row of h quantized, by the first thread that needs it (the others wait the
// ~0.2 us it takes): every down item of the expert reads it, and its gate/up items are done.
const uint8_t* hq_row(const Call& c, int64_t a, const float* h) {
  uint8_t* p = c.hq + size_t(a) * q8_bytes(c.I);
  std::atomic<int>& state = c.hq_state[a];
  int v = state.load(std::memory_order_acquire);
  if (v == 0 && state.compare_exchange_strong(v, 1, std::memory_order_acq_rel)) {
    quantize_q8(h + size_t(a) * c.I, c.I, p);
    state.store(2, std::memory_order_release);
  }
  while (state.load(std::memory_order_acquire) != 2) pause();
  return p;
}
#endif

// Rows i0..i1-1 of a part (`n` weights each, stored in `f`) as float32 rows for `dot`: the decoded
// tile when the expert has more tokens than one pass and the format has blocks, else the part
// itself. Returns the format to read them in.
const Format* rows_for(const Format* f, const uint8_t* part, int n, int i0, int i1, bool many, const uint8_t** out,
                       float* t) {
  if (!many || !f->decode) {
    *out = part + size_t(i0) * f->row_bytes(n);
    return f;
  }
  for (int i = i0; i < i1; ++i) f->decode(part + size_t(i) * f->row_bytes(n), n, t + size_t(i - i0) * n);
  *out = (const uint8_t*)t;
  return &FORMATS[F32];
}

// h[a] = act(gate x + gate_bias, up x + up_bias) for expert e's assignments a, rows i0..i1-1 of
// gate and up (act: `activate`; the biases where the layout has them, whatever gate and up's
// formats).
void gate_up_rows(const Call& c, long e, int i0, int i1, float* h) {
  const int H = c.H, I = c.I;
  const bool q8 = c.xq != nullptr;  // the int8 path reads the blocks in place whatever the tokens
  const bool many = !q8 && c.start[e + 1] - c.start[e] > TBMAX;
  float* tl = many ? tile(2 * size_t(i1 - i0) * H) : nullptr;
  const uint8_t *gate, *up;
  const Format* fg = rows_for(c.fmt[0], c.slots[e] + c.part_off[0], H, i0, i1, many, &gate, tl);
  const Format* fu = rows_for(c.fmt[1], c.slots[e] + c.part_off[1], H, i0, i1, many, &up,
                              tl ? tl + size_t(i1 - i0) * H : nullptr);
  const size_t gb = fg->row_bytes(H), ub = fu->row_bytes(H);
  prefetch_start(gate, (i1 - i0) * gb);
  prefetch_start(up, (i1 - i0) * ub);
  const float *gbias = bias(c, e, 3), *ubias = bias(c, e, 4);
  token_blocks(c, e, [&](int64_t a0, int tb) {
    const float* xs[TBMAX];
    const uint8_t* xq[TBMAX];
    for (int t = 0; t < tb; ++t) {
      xs[t] = c.x + size_t(c.tok[a0 + t]) * H;
      if (q8) xq[t] = c.xq + size_t(c.tok[a0 + t]) * q8_bytes(H);
    }
    for (int i = i0; i < i1; ++i) {
      const uint8_t* rows[2] = {gate + (i - i0) * gb, up + (i - i0) * ub};
      float s[2][TBMAX];
      if (fg == fu) {
        dot_rows(fg, 2, tb, rows, H, xs, q8 ? xq : nullptr, s);
      } else {  // gate and up in different formats: one row each (a row's sums do not change)
        dot_rows(fg, 1, tb, rows, H, xs, q8 ? xq : nullptr, s);
        dot_rows(fu, 1, tb, rows + 1, H, xs, q8 ? xq : nullptr, s + 1);
      }
      if (gbias)
        for (int t = 0; t < tb; ++t) s[0][t] += gbias[i], s[1][t] += ubias[i];
      for (int t = 0; t < tb; ++t) h[size_t(a0 + t) * I + i] = activate(c.clamp, s[0][t], s[1][t]);
    }
  });
}

// out[out_row[a]][j0..j1-1] = weight[a] * (down h[a] + down_bias) for expert e's assignments a.
void down_rows(const Call& c, long e, int j0, int j1, const float* h) {
  const int H = c.H, I = c.I;
  const bool q8 = c.hq != nullptr, many = !q8 && c.start[e + 1] - c.start[e] > TBMAX;
  const uint8_t* down;
  const Format* f = rows_for(c.fmt[2], c.slots[e] + c.part_off[2], I, j0, j1, many, &down,
                             many ? tile(size_t(j1 - j0) * I) : nullptr);
  const size_t rb = f->row_bytes(I);
  prefetch_start(down, (j1 - j0) * rb);
  const float* db = bias(c, e, 5);
  token_blocks(c, e, [&](int64_t a0, int tb) {
    const float* hs[TBMAX];
    const uint8_t* hq[TBMAX];
    for (int t = 0; t < tb; ++t) {
      hs[t] = h + size_t(a0 + t) * I;
#if INT8_PATH
      if (q8) hq[t] = hq_row(c, a0 + t, h);
#endif
    }
    for (int j = j0; j < j1; j += 2) {
      const uint8_t* rows[2] = {down + (j - j0) * rb, down + (j + 1 - j0) * rb};
      float s[2][TBMAX];
      const int r = j + 1 < j1 ? 2 : 1;
      dot_rows(f, r, tb, rows, I, hs, q8 ? hq : nullptr, s);
      for (int t = 0; t < tb; ++t) {
        float* o = c.out + size_t(c.out_row[a0 + t]) * H;
        for (int q = 0; q < r; ++q) o[j + q] = c.weight[a0 + t] * (db ? s[q][t] + db[j + q] : s[q][t]);
      }
    }
  });
}

// The first bytes of the rows a work item reads (see `run_all`), so they arrive while the item
// before runs.
void prefetch_rows(const Format* f, const uint8_t* part, int n, int i0, int rows) {
  const size_t rb = f->row_bytes(n);
  prefetch_start(part + size_t(i0) * rb, size_t(rows) * rb);
}

// Every expert of the call: all gate/up items, then all down items, from one counter. A down item
// waits for its own expert's gate/up items only (they all went out before it, and no thread
// holding one waits), not for the whole call's; each thread claims its next item when it starts
// one and prefetches that item's first rows, so its reads do not stop and start again at every
// item. H100 host, 15 threads, q4_k_m int8, 8 experts a call, alternated in one process: 88.6 ->
// 94.2 GB/s (ahead in each of 4 rounds); without the claim ahead, the barrier alone gone: 87.9.
void run_all(const Call& c, float* h) {
  const int I = c.I, H = c.H;
  const int cg = chunk_rows(I, c.n, c.threads, 4, 16), cd = chunk_rows(H, c.n, c.threads, 16, 64);
  const long chunks_gu = (I + cg - 1) / cg, chunks_d = (H + cd - 1) / cd;
  const long n_gu = c.n * chunks_gu, total = n_gu + c.n * chunks_d;
  std::vector<std::atomic<long>> gu_left(c.n);
  for (long e = 0; e < c.n; ++e) gu_left[e].store(chunks_gu, std::memory_order_relaxed);
  std::atomic<long> next{0};
  auto prefetch = [&](long k) {
    if (k < n_gu) {
      const long e = k / chunks_gu;
      const int i0 = int(k % chunks_gu) * cg, rows = std::min(I, i0 + cg) - i0;
      prefetch_rows(c.fmt[0], c.slots[e] + c.part_off[0], H, i0, rows);
      prefetch_rows(c.fmt[1], c.slots[e] + c.part_off[1], H, i0, rows);
    } else {
      const long e = (k - n_gu) / chunks_d;
      const int j0 = int((k - n_gu) % chunks_d) * cd;
      prefetch_rows(c.fmt[2], c.slots[e] + c.part_off[2], I, j0, std::min(H, j0 + cd) - j0);
    }
  };
  auto run = [&](long k) {
    if (k < n_gu) {
      const long e = k / chunks_gu;
      const int i0 = int(k % chunks_gu) * cg;
      gate_up_rows(c, e, i0, std::min(I, i0 + cg), h);
      gu_left[e].fetch_sub(1, std::memory_order_acq_rel);
      return;
    }
    const long e = (k - n_gu) / chunks_d;
    for (int spins = 0; gu_left[e].load(std::memory_order_acquire) > 0; ++spins)
      if (spins < 4096) pause();
      else std::this_thread::yield();  // a holder of its gate/up items may be waiting for this core
    const int j0 = int((k - n_gu) % chunks_d) * cd;
    down_rows(c, e, j0, std::min(H, j0 + cd), h);
  };
  auto body = [&](int) {
    long k = next.fetch_add(1, std::memory_order_relaxed);
    while (k < total) {
      const long after = next.fetch_add(1, std::memory_order_relaxed);
      if (after < total) prefetch(after);
      run(k);
      k = after;
    }
  };
  if (c.team) {
    c.team->run(body);
    return;
  }
#pragma omp parallel num_threads(c.threads)
  body(0);
}

// The experts this call takes from a shared split, one at a time, with no barrier between them:
// a thread held up (the machine has no core to spare while the GPU's side waits on its copies)
// then stalls only the items that need its rows, not the whole team at every expert. Work items
// come in stages from one counter: stage s is the gate/up items of the s-th expert taken, then
// the down items of the one before, whose gate/up items all went out a stage earlier. The s-th
// expert is taken from the split by the first thread to reach its stage.
void run_shared(const Call& c, float* h) {
  const int I = c.I, H = c.H;
  const int cg = chunk_rows(I, 1, c.threads, 4, 16), cd = chunk_rows(H, 1, c.threads, 16, 64);
  const long n_gu = (I + cg - 1) / cg, n_d = (H + cd - 1) / cd, per_stage = n_gu + n_d;
  constexpr int UNTAKEN = -2, TAKING = -3;  // then the expert's index, or -1: the split is used up
  std::vector<std::atomic<int>> expert(c.n + 2);
  std::vector<std::atomic<long>> gu_left(c.n + 2);
  for (int s = 0; s < c.n + 2; ++s) expert[s] = UNTAKEN, gu_left[s] = n_gu;
  std::atomic<long> cursor{0};
  auto resolve = [&](long s) {  // the s-th expert taken, taking it if nobody has
    int e = expert[s].load(std::memory_order_acquire), want = UNTAKEN;
    if (e == UNTAKEN && expert[s].compare_exchange_strong(want, TAKING)) {
      e = s >= c.n ? -1 : take(c.claim, false);
      expert[s].store(e, std::memory_order_release);
    }
    while ((e = expert[s].load(std::memory_order_acquire)) == TAKING || e == UNTAKEN) pause();
    return e;
  };
#pragma omp parallel num_threads(c.threads)
  while (true) {
    const long k = cursor.fetch_add(1, std::memory_order_relaxed), s = k / per_stage, r = k % per_stage;
    if (s > c.n + 1) break;  // past the last stage that can hold work
    if (r < n_gu) {
      const int e = resolve(s);
      if (e < 0) continue;  // nothing left to take: this stage's down items end the loop
      const int i0 = int(r) * cg;
      gate_up_rows(c, e, i0, std::min(I, i0 + cg), h);
      gu_left[s].fetch_sub(1, std::memory_order_acq_rel);
    } else {
      const int e = s == 0 ? -1 : resolve(s - 1);
      if (e < 0) {
        if (s == 0) continue;
        break;  // the split was used up before this stage: no expert after it either
      }
      for (int spins = 0; gu_left[s - 1].load(std::memory_order_acquire) > 0; ++spins)
        if (spins < 4096) pause();
        else std::this_thread::yield();  // its holder may be waiting for this core
      const int j0 = int(r - n_gu) * cd;
      down_rows(c, e, j0, std::min(H, j0 + cd), h);
    }
  }
}

// 64-byte aligned room for `bytes`, kept in `buf`
uint8_t* aligned(std::vector<uint8_t>& buf, size_t bytes) {
  buf.resize(bytes + 64);
  return buf.data() + (64 - uintptr_t(buf.data()) % 64) % 64;
}

// `dtype`: the parts' format codes, gate | up << 8 | down << 16, and INT8 where the run computes in
// bf16 or fp16 (the parts whose formats have it take the int8 path). -1 for an unknown code or a
// row length that does not split into its format's blocks.
constexpr int INT8 = 1 << 24;
int dispatch(int dtype, const Call& call) {
  Call c = call;
  const int n[3] = {c.H, c.H, c.I};
  for (int p = 0; p < 3; ++p) {
    const int code = (dtype >> (8 * p)) & 0xff;
    if (code >= N_FORMATS || n[p] % FORMATS[code].block) return -1;
    c.fmt[p] = &FORMATS[code];
  }
  if (c.n <= 0) return 0;
  const int64_t m = c.start[c.n];
  std::vector<float> h(size_t(m) * c.I);  // silu(gate x) * (up x), one row per assignment
  std::vector<uint8_t> xq_buf, hq_buf;
  std::unique_ptr<std::atomic<int>[]> hq_state;
#if INT8_PATH
  if (dtype & INT8) {
    if (c.fmt[0]->int8(c.H) && c.fmt[1]->int8(c.H)) {
      const int64_t rows = *std::max_element(c.tok, c.tok + m) + 1;
      const size_t b = q8_bytes(c.H);
      uint8_t* xq = aligned(xq_buf, size_t(rows) * b);
      if (c.team || rows < 16) {  // decode: a few rows (the worker's own team may not use OpenMP)
        for (int64_t r = 0; r < rows; ++r) quantize_q8(c.x + size_t(r) * c.H, c.H, xq + size_t(r) * b);
      } else {
#pragma omp parallel for num_threads(c.threads)
        for (int64_t r = 0; r < rows; ++r) quantize_q8(c.x + size_t(r) * c.H, c.H, xq + size_t(r) * b);
      }
      c.xq = xq;
    }
    if (c.fmt[2]->int8(c.I)) {
      c.hq = aligned(hq_buf, size_t(m) * q8_bytes(c.I));
      hq_state.reset(new std::atomic<int>[size_t(m)]);
      for (int64_t a = 0; a < m; ++a) hq_state[a].store(0, std::memory_order_relaxed);
      c.hq_state = hq_state.get();
    }
  }
#endif
  if (c.claim) run_shared(c, h.data());
  else run_all(c, h.data());
  return 0;
}

// The CPU branch of device-planned layers (graph decode, and a short extend planned the same
// way). The GPU writes a layer's payload into mapped memory and rings `bell` with a nonzero
// value; the worker clears the bell, runs the flagged items from the host pool into `out`
// [items, H] (row j for item j) and writes the value to `done`, which the GPU polls. No Python
// on the way. The bell's value is the MoE layer's index + 1: layers may differ in format (a
// llama-quantize mix), so the worker keeps each layer's format codes and part offsets. Payload, all float32: x [tokens, H], then per item its weight, expert row, CPU
// flag and token (items sections of `items` each), then the number of valid items. Items of
// one expert (several tokens routed to it) are run as one expert, its weights read once.
struct Worker {
  int H, I, items, tokens, k, threads;
  std::vector<int> dtype;         // per MoE layer
  std::vector<int64_t> part_off;  // per MoE layer, 6 each (see Call)
  float clamp[2];
  bool clamped;
  std::vector<const uint8_t*> row_ptr;  // host address of every expert row
  volatile int32_t* bell;
  volatile int32_t* done;
  const float* payload;
  float* out;
  // [4]: compute time and count of the layers that had CPU items, for one-token layers (decode)
  // and for multi-token ones (the split's balance is kept apart for each)
  int64_t* busy_ns;
  std::atomic<bool> stop{false};
  std::thread thread;

  void loop() {
    Team team(threads);
    auto idle_since = std::chrono::steady_clock::now();
    std::vector<const uint8_t*> slots(items);
    std::vector<int64_t> start(items + 1), tok(items), row(items), expert(items);
    std::vector<float> w(items);
    std::vector<int> order(items);
    const float *x = payload, *weight = x + int64_t(tokens) * H, *rows = weight + items, *flag = rows + items,
                *token = flag + items, *valid = token + items;
    while (!stop.load(std::memory_order_relaxed)) {
      const int32_t v = *bell;
      if (v == 0) {
        // Spin while decode is running (a bell every few hundred microseconds); back off to
        // sleeping polls once idle, so an idle server does not burn a core.
        if (std::chrono::steady_clock::now() - idle_since > std::chrono::milliseconds(50))
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        else
          pause();
        continue;
      }
      *bell = 0;
      std::atomic_thread_fence(std::memory_order_acquire);
      const auto t0 = std::chrono::steady_clock::now();
      const int n_valid = std::min(items, int(*valid));
      int m = 0;
      for (int j = 0; j < n_valid; ++j)
        if (flag[j] != 0.0f) order[m++] = j;
      std::stable_sort(order.begin(), order.begin() + m,
                       [&](int a, int b) { return rows[a] < rows[b]; });  // an expert's items together
      int n = 0;
      for (int a = 0; a < m; ++a) {
        const int j = order[a];
        const int64_t r = int64_t(rows[j]);
        if (n == 0 || expert[n - 1] != r) {
          expert[n] = r, slots[n] = row_ptr[r], start[n] = a;
          ++n;
        }
        tok[a] = int64_t(token[j]), w[a] = weight[j], row[a] = j;
      }
      start[n] = m;
      const size_t layer = std::min(size_t(v - 1), dtype.size() - 1);
      const Call c{H, I, part_off.data() + 6 * layer, n, slots.data(), start.data(), tok.data(), w.data(),
                   row.data(), x, out, threads, nullptr, &team, clamped ? clamp : nullptr};
      dispatch(dtype[layer], c);
      const auto t1 = std::chrono::steady_clock::now();
      if (n > 0) {
        int64_t* b = busy_ns + (n_valid > k ? 2 : 0);
        b[0] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
        b[1] += 1;
      }
      std::atomic_thread_fence(std::memory_order_release);
      *done = v;
      idle_since = t1;
    }
  }
};

// One persistent native thread that runs `ftk_experts` calls handed to it, so the caller (Python)
// goes on at once and the call needs no GIL to start: a Python worker thread had to win the GIL
// from the thread issuing the GPU work first, which could take a switch interval (5 ms). The
// thread keeps one OpenMP team, as a single caller would.
//
// Both sides spin before they sleep: the runner for `SPIN` after its last call, the caller while
// the call runs. Every core is busy then (the team's threads spin between calls too, see
// GOMP_SPINCOUNT in __init__.py), and a sleeping thread was measured waking up to 2 ms late.
struct Runner {
  static constexpr auto SPIN = std::chrono::milliseconds(50);
  std::mutex mu;  // for the sleeping paths only
  std::condition_variable cv;
  std::atomic<bool> pending{false}, busy{false}, stop{false};
  int dtype = 0, rc = 0;
  Call call{};
  int64_t busy_ns = 0;
  volatile int32_t* done = nullptr;  // where to write `done_value` when the call ends (a GPU polls it)
  int32_t done_value = 0;
  std::thread thread;

  // Sleep on `cv` until `ready`, after spinning on it for SPIN.
  template <class F>
  void await(F ready) {
    const auto until = std::chrono::steady_clock::now() + SPIN;
    while (!ready()) {
      if (std::chrono::steady_clock::now() < until) {
        pause();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, ready);
    }
  }

  void wake() {
    { std::lock_guard<std::mutex> lock(mu); }  // a sleeper is either waiting or will see the flag
    cv.notify_all();
  }

  void loop() {
    while (true) {
      await([this] { return pending.load(std::memory_order_acquire) || stop.load(); });
      if (stop.load()) return;
      pending.store(false);
      const auto t0 = std::chrono::steady_clock::now();
      rc = dispatch(dtype, call);
      busy_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      if (done) {  // also after a failed call: a GPU waiting on the word must not hang
        std::atomic_thread_fence(std::memory_order_release);
        *done = done_value;
      }
      busy.store(false, std::memory_order_release);
      wake();
    }
  }
};

}  // namespace

extern "C" {

// dtype: `layers` format codes; part_off: 6 offsets per layer (see Call); clamp: null, or
// {alpha, limit}. All copied.
void* ftk_worker_start(int layers, const int* dtype, int H, int I, const int64_t* part_off, int64_t rows,
                       const int64_t* row_ptr, int items, int tokens, int k, int32_t* bell, int32_t* done,
                       const float* payload, float* out, int64_t* busy_ns, int threads, const float* clamp) {
  auto* w = new Worker();
  w->H = H, w->I = I, w->items = items, w->tokens = tokens, w->k = k;
  w->threads = std::max(1, threads);
  w->dtype.assign(dtype, dtype + layers);
  w->part_off.assign(part_off, part_off + 6 * int64_t(layers));
  w->clamped = clamp != nullptr;
  if (clamp) std::copy(clamp, clamp + 2, w->clamp);
  w->row_ptr.assign((const uint8_t* const*)row_ptr, (const uint8_t* const*)row_ptr + rows);
  w->bell = bell, w->done = done, w->payload = payload, w->out = out, w->busy_ns = busy_ns;
  w->thread = std::thread([w] { w->loop(); });
  return w;
}

void ftk_worker_stop(void* handle) {
  auto* w = static_cast<Worker*>(handle);
  w->stop.store(true);
  w->thread.join();
  delete w;
}

const char* ftk_isa() { return ISA; }

// out[out_row[a]] = weight[a] * down(silu(gate x[tok[a]]) * up x[tok[a]]) for every assignment a
// of every expert (with the biases part_off[3..5] names and, `clamp` not null, the clamped
// SwiGLU: see Call); rows of out that no assignment names are left untouched. Returns 0, or -1
// for an unknown dtype.
int ftk_experts(int dtype, int H, int I, const int64_t* part_off, int n, const uint8_t* const* slots,
                const int64_t* start, const int64_t* tok, const float* weight, const int64_t* out_row,
                const float* x, float* out, int threads, const float* clamp) {
  return dispatch(dtype, Call{H, I, part_off, n, slots, start, tok, weight, out_row, x, out, std::max(1, threads),
                              nullptr, nullptr, clamp});
}

// out[hq] = softmax(q[hq] . K[lo:S, hq / G] * scale) V[lo:S, hq / G] for each query head hq of q
// [heads, D] (float32; G = heads / kv_heads), into out [heads, Dv] (float32): one decode step's
// attention (decode_attention.h). K and V rows are `dtype` (F32, F16 or BF16), each contiguous,
// at strides in elements between positions and between heads. Returns 0, or -1 for what it does
// not take (another dtype, D or Dv not a multiple of the vector width, no keys).
int ftk_attention(int dtype, const float* q, const uint8_t* k, const uint8_t* v, int S, int lo, int heads,
                  int kv_heads, int D, int Dv, int64_t k_pos, int64_t k_head, int64_t v_pos, int64_t v_head,
                  float scale, float* out, int threads) {
  Attention a{dtype, S, lo, heads, kv_heads, D, Dv, k_pos, k_head, v_pos, v_head, scale, q, nullptr, k, v, out};
  return a.run(threads);
}

// out[t * N + j] = row j of an [N, K] weight . x[t] for T tokens of x [T, K] (float32): a dense
// projection on a CPU, the weight stored row after row in format `dtype`'s low byte (a GGUF
// block format as stored, or a float), on int8 activations where `dtype` has INT8 and the format
// has them (as the experts' int8 path). Pairs of rows shared over OpenMP's `threads`. Returns 0,
// or -1 for an unknown format or a K its blocks do not split.
int ftk_linear(int dtype, const uint8_t* w, int N, int K, const float* x, int T, float* out, int threads) {
  const int code = dtype & 0xff;
  if (code >= N_FORMATS || K % FORMATS[code].block) return -1;
  const Format* f = &FORMATS[code];
  const size_t rb = f->row_bytes(K);
  std::vector<uint8_t> xq_buf;
  const uint8_t* xq = nullptr;
  size_t qb = 0;
#if INT8_PATH
  if ((dtype & INT8) && f->int8(K)) {
    qb = q8_bytes(K);
    uint8_t* p = aligned(xq_buf, size_t(T) * qb);
    for (int t = 0; t < T; ++t) quantize_q8(x + size_t(t) * K, K, p + size_t(t) * qb);
    xq = p;
  }
#endif
  const int pairs = (N + 1) / 2;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int pr = 0; pr < pairs; ++pr) {
    const int j = 2 * pr, r = std::min(2, N - j);
    const uint8_t* rows[2] = {w + size_t(j) * rb, w + size_t(j + r - 1) * rb};
    for (int t0 = 0; t0 < T; t0 += TBMAX) {
      const int tb = std::min(TBMAX, T - t0);
      const float* xs[TBMAX];
      const uint8_t* xqs[TBMAX];
      for (int t = 0; t < tb; ++t) {
        xs[t] = x + size_t(t0 + t) * K;
        xqs[t] = xq ? xq + size_t(t0 + t) * qb : nullptr;
      }
      float s[2][TBMAX];
      dot_rows(f, r, tb, rows, K, xs, xq ? xqs : nullptr, s);
      for (int q = 0; q < r; ++q)
        for (int t = 0; t < tb; ++t) out[size_t(t0 + t) * N + j + q] = s[q][t];
    }
  }
  return 0;
}

// The GPU side's turn at a shared split (see `take`): the next expert to fill, or -1 once the
// CPU has taken the rest. `claim` starts as n << 32 (front 0, back n).
int ftk_take_front(int64_t* claim) { return take(claim, true); }

void* ftk_runner_start() {
  auto* r = new Runner();
  r->thread = std::thread([r] { r->loop(); });
  return r;
}

// Hand one `ftk_experts` call to the runner (which must be idle: submit, then wait, in turn). The
// arrays must stay valid until `ftk_runner_wait` returns. `claim`: null, or a split shared with
// the caller (`ftk_take_front`): the call then runs only the experts it takes from the back.
// `done`: null, or a word (in mapped memory) the call sets to `done_value` once its rows are
// written, so a GPU can wait for them with no host thread in between.
void ftk_runner_submit(void* handle, int dtype, int H, int I, const int64_t* part_off, int n,
                       const uint8_t* const* slots, const int64_t* start, const int64_t* tok, const float* weight,
                       const int64_t* out_row, const float* x, float* out, int threads, const float* clamp,
                       int64_t* claim, int32_t* done, int32_t done_value) {
  auto* r = static_cast<Runner*>(handle);
  r->dtype = dtype;
  r->done = done, r->done_value = done_value;
  r->call = Call{H, I, part_off, n, slots, start, tok, weight, out_row, x, out, std::max(1, threads), claim,
                 nullptr, clamp};
  r->busy.store(true);
  r->pending.store(true, std::memory_order_release);
  r->wake();
}

// Block until the submitted call is done; its return code, and its compute time in `busy_ns`.
int ftk_runner_wait(void* handle, int64_t* busy_ns) {
  auto* r = static_cast<Runner*>(handle);
  r->await([r] { return !r->busy.load(std::memory_order_acquire); });
  *busy_ns = r->busy_ns;
  return r->rc;
}

void ftk_runner_stop(void* handle) {
  auto* r = static_cast<Runner*>(handle);
  r->stop.store(true);
  r->wake();
  r->thread.join();
  delete r;
}

// The core's peak that the expert kernel's GFLOP/s are reported against (tools/bench/cpu_experts):
// `iters` rounds per thread of 12 independent multiply-adds on registers only, no memory. `int8`:
// the int8 path's byte products (VNNI's dpbusd where the CPU has it, else maddubs: 64 a 512-bit
// instruction), else float32 FMAs (W lanes). Returns the operations done (2 per multiply-add), or
// 0 for an int8 peak where the int8 path is not built.
static std::atomic<int64_t> peak_sink{0};  // the loops' results go somewhere, so they are not optimised away

double ftk_peak(int int8, int64_t iters, int threads) {
  constexpr int ACC = 12;  // enough in flight for two ports at a 4-5 cycle latency
  double total = 0;
  if (int8) {
#if INT8_PATH
#pragma omp parallel reduction(+ : total) num_threads(std::max(1, threads))
    {
      Vi acc[ACC];
      for (int u = 0; u < ACC; ++u) acc[u] = _mm512_set1_epi32(u);
      Vi a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
      asm("" : "+v"(a), "+v"(b));
      for (int64_t i = 0; i < iters; ++i)
        for (int u = 0; u < ACC; ++u) {
#if defined(__AVX512VNNI__)
          acc[u] = _mm512_dpbusd_epi32(acc[u], a, b);
#else
          acc[u] = _mm512_add_epi16(acc[u], _mm512_maddubs_epi16(a, b));
#endif
        }
      Vi s = acc[0];
      for (int u = 1; u < ACC; ++u) s = _mm512_add_epi32(s, acc[u]);
      peak_sink.fetch_add(_mm512_reduce_add_epi32(s), std::memory_order_relaxed);
      total += double(iters) * ACC * 64 * 2;
    }
#endif
    return total;
  }
#pragma omp parallel reduction(+ : total) num_threads(std::max(1, threads))
  {
    V acc[ACC];
    for (int u = 0; u < ACC; ++u) acc[u] = vset(float(u));
    V a = pin(vset(1.0f)), b = pin(vset(1e-9f));
    for (int64_t i = 0; i < iters; ++i)
      for (int u = 0; u < ACC; ++u) acc[u] = vfma(a, b, acc[u]);
    V s = acc[0];
    for (int u = 1; u < ACC; ++u) s = vadd(s, acc[u]);
    peak_sink.fetch_add(int64_t(vsum(s)), std::memory_order_relaxed);
    total += double(iters) * ACC * W * 2;
  }
  return total;
}

// A plain parallel read of `nbytes` (a multiple of 64) as floats: the DRAM bandwidth reference
// the expert kernel is measured against. Returns the sum so the reads cannot be optimised away.
double ftk_read(const uint8_t* p, int64_t nbytes, int threads) {
  const int64_t block = 1 << 16, blocks = (nbytes + block - 1) / block;
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(std::max(1, threads))
  for (int64_t b = 0; b < blocks; ++b) {
    const float* f = (const float*)(p + b * block);
    const int64_t n = std::min(block, nbytes - b * block) / 4;
    V acc[4] = {vzero(), vzero(), vzero(), vzero()};
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W)
      for (int u = 0; u < 4; ++u) acc[u] = vadd(acc[u], vload(f + i + u * W));
    for (; i + W <= n; i += W) acc[0] = vadd(acc[0], vload(f + i));
    total += vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
  }
  return total;
}

}  // extern "C"
