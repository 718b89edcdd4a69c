// One query's attention on a CPU (decode), read straight from the KV cache's rows (included by
// experts.cpp, inside its namespace, after its SIMD vocabulary `V`).
//
// torch took the cache through float32 copies of K and V and batched products shaped badly
// for one query: dev box (2 vCPUs), 32 bf16 query heads of 128 over 4 KV heads behind 64 / 1k /
// 8k / 32k keys, 87 / 317 / 3,100-3,800 / 49,000 us against 37 / 302 / 2,300-2,500 / 9,400-9,800
// here (`python -m ftkit.tools.bench.cpu_attention --threads 2`). The keys are split into fixed
// chunks; a chunk of one KV head is one work item: its G query heads' scores (float32 dots of
// the key row, converted once), their softmax against the chunk's own max, and the chunk's
// exponent-weighted sum of value rows. The chunks of a head are then merged in order (each
// rescaled by e^(its max - the head's max)), so the result depends on neither the thread count
// nor the schedule. The items run chunk by chunk (a chunk's KV heads together, so its pages are
// touched close in time), and prefetch the strided rows ahead: without, 3-7 GB/s from DRAM on
// the dev box, 7-18 with. A 16-bit run's bf16 query takes AVX-512 BF16's dot products on the
// key rows as stored where the CPU has them: dev box, 2 threads, behind 1k / 8k / 32k bf16 keys
// 323 / 2,617 / 10,647 -> 246 / 1,742 / 7,661 us (alternated in one process).
//
// The exponential is a polynomial after the usual reduction (e^x = 2^n e^r, |r| <= ln 2 / 2;
// Taylor to r^7, truncation under 1e-8 relative), as accurate as float32 allows: the result
// equals torch's softmax-and-product to float32 rounding (tests/test_cpu_attention.py).

constexpr int ATT_CHUNK = 256;  // keys a work item (one KV head): 128 KB of bf16 K and V 128 wide
constexpr int ATT_AHEAD = 8;    // keys ahead to prefetch

inline void prefetch_l2_span(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) prefetch_l2(p + o);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))  // experts.cpp's `V`
// e^r for x = n ln 2 + r: r from ln 2 in two parts (n * the high part is exact for |n| < 2^8),
// then the Taylor polynomial to r^7
inline V exp_reduced(V x, V n) {
  V r = vfma(n, vset(-0.693145751953125f), x);
  r = vfma(n, vset(-1.4286068203094172e-06f), r);
  V p = vset(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = vfma(p, r, vset(c));
  return p;
}
constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif

// e^x for x <= 0. Below -87 float32 goes subnormal (e^-87 is 1.6e-38), so x is clamped there;
// x is max's second operand, so a NaN comes through as itself.
#if defined(__AVX512F__)
inline V vexp_le0(V x) {
  x = _mm512_max_ps(vset(-87.0f), x);
  const V n = _mm512_roundscale_ps(vmul(x, vset(1.4426950408889634f)), ROUND);
  return _mm512_scalef_ps(exp_reduced(x, n), n);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline V vexp_le0(V x) {
  x = _mm256_max_ps(vset(-87.0f), x);
  const V n = _mm256_round_ps(vmul(x, vset(1.4426950408889634f)), ROUND);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return vmul(exp_reduced(x, n), _mm256_castsi256_ps(e));  // n >= -126 here: 2^n is a normal float
}
#else
inline V vexp_le0(V x) { return std::exp(x); }
#endif

// The float32 values of row p (n elements of `dtype`: F32, F16 or BF16, n % W == 0): p itself
// for float32, else converted into buf.
inline const float* att_row(int dtype, const uint8_t* p, int n, float* buf) {
  if (dtype == F32) return (const float*)p;
  for (int i = 0; i < n; i += W) vstore(buf + i, dtype == BF16 ? load_bf16(p + 2 * i) : load_f16(p + 2 * i));
  return buf;
}

// dot(a[0:n], b[0:n]), n % W == 0, in four independent chains (named: an array indexed in a
// loop would live on the stack)
inline float att_dot(const float* a, const float* b, int n) {
  V s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
  int i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    s0 = vfma(vload(a + i), vload(b + i), s0);
    s1 = vfma(vload(a + i + W), vload(b + i + W), s1);
    s2 = vfma(vload(a + i + 2 * W), vload(b + i + 2 * W), s2);
    s3 = vfma(vload(a + i + 3 * W), vload(b + i + 3 * W), s3);
  }
  for (; i < n; i += W) s0 = vfma(vload(a + i), vload(b + i), s0);
  return vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
}

#if defined(__AVX512BF16__)
// dot(a[0:n], b[0:n]) of bf16 rows (n % 32 == 0): AVX-512 BF16's dot products, two products a
// float lane an instruction, on the key row as stored (no conversion)
inline float att_dot_bf16(const uint16_t* a, const uint8_t* b, int n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  const auto bh = [](const void* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int i = 0;
  for (; i + 64 <= n; i += 64) {
    s0 = _mm512_dpbf16_ps(s0, bh(a + i), bh(b + 2 * i));
    s1 = _mm512_dpbf16_ps(s1, bh(a + i + 32), bh(b + 2 * i + 64));
  }
  for (; i < n; i += 32) s0 = _mm512_dpbf16_ps(s0, bh(a + i), bh(b + 2 * i));
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
#endif

// o[0:W * U] = sum over j < n of p[j] * rows[j][0:W * U]
template <int U>
inline void att_weighted(const float* p, const float* const* rows, int n, int off, float* o) {
  V acc[U];
  for (int u = 0; u < U; ++u) acc[u] = vzero();
  for (int j = 0; j < n; ++j) {
    const V w = vset(p[j]);
    for (int u = 0; u < U; ++u) acc[u] = vfma(w, vload(rows[j] + off + u * W), acc[u]);
  }
  for (int u = 0; u < U; ++u) vstore(o + off + u * W, acc[u]);
}

struct Attention {
  int dtype, S, lo, heads, kv_heads, D, Dv;
  int64_t k_pos, k_head, v_pos, v_head;  // strides in elements
  float scale;
  const float* q;  // [heads, D]
  const uint16_t* qb = nullptr;  // q as bf16 (`run`: where the keys are bf16 and q's values are bf16's)
  const uint8_t *k, *v;
  float* out;      // [heads, Dv]

  int group() const { return heads / kv_heads; }
  int chunks() const { return (S - lo + ATT_CHUNK - 1) / ATT_CHUNK; }
  size_t esize() const { return dtype == F32 ? 4 : 2; }

  // Item (h, c): for each of head h's G query heads g, its chunk max m, the sum l of
  // e^(score - m) and the e^(score - m)-weighted sum of the chunk's value rows, into
  // part[(g * 2 + Dv)...]: m, l, then Dv sums.
  void item(int h, int c, float* part) const {
    const int G = group(), a = lo + c * ATT_CHUNK, n = std::min(S, a + ATT_CHUNK) - a;
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(G) * ATT_CHUNK + size_t(ATT_CHUNK) * Dv + D);
    float *sc = scratch.data(), *vf = sc + size_t(G) * ATT_CHUNK, *kf = vf + size_t(ATT_CHUNK) * Dv;
    const float* qh = q + size_t(h) * G * D;
    const auto key = [&](int j) { return k + (int64_t(a + j) * k_pos + h * k_head) * esize(); };
    const auto value = [&](int j) { return v + (int64_t(a + j) * v_pos + h * v_head) * esize(); };
    for (int j = 0; j < n; ++j) {
      // a head's rows are strided (a slice of each position's): a few keys ahead, and the values
      if (j + ATT_AHEAD < n) prefetch_l2_span(key(j + ATT_AHEAD), size_t(D) * esize());
      prefetch_l2_span(value(j), size_t(Dv) * esize());
#if defined(__AVX512BF16__)
      if (qb) {
        const uint16_t* qbh = qb + size_t(h) * G * D;
        for (int g = 0; g < G; ++g) sc[g * ATT_CHUNK + j] = att_dot_bf16(qbh + size_t(g) * D, key(j), D) * scale;
        continue;
      }
#endif
      const float* kr = att_row(dtype, key(j), D, kf);
      for (int g = 0; g < G; ++g) sc[g * ATT_CHUNK + j] = att_dot(qh + size_t(g) * D, kr, D) * scale;
    }
    const float* vr[ATT_CHUNK];
    for (int j = 0; j < n; ++j) vr[j] = att_row(dtype, value(j), Dv, vf + size_t(j) * Dv);
    for (int g = 0; g < G; ++g) {
      float* s = sc + g * ATT_CHUNK;
      float m = s[0];
      for (int j = 1; j < n; ++j) m = std::max(m, s[j]);
      const int padded = (n + W - 1) / W * W;
      for (int j = n; j < padded; ++j) s[j] = m;  // e^0 past the end: finite, and unused
      for (int j = 0; j < padded; j += W) vstore(s + j, vexp_le0(vadd(vload(s + j), vset(-m))));
      float l = 0.0f;
      for (int j = 0; j < n; ++j) l += s[j];
      float* o = part + size_t(g) * (2 + Dv);
      o[0] = m, o[1] = l;
      int d = 0;
      for (; d + 4 * W <= Dv; d += 4 * W) att_weighted<4>(s, vr, n, d, o + 2);
      for (; d < Dv; d += W) att_weighted<1>(s, vr, n, d, o + 2);
    }
  }

  // Query head hq's output from its chunks' parts, merged in chunk order.
  void merge(int hq, const float* parts) const {
    const int G = group(), h = hq / G, g = hq % G, nc = chunks();
    const size_t stride = size_t(G) * (2 + Dv);
    const float* first = parts + size_t(h) * nc * stride + size_t(g) * (2 + Dv);
    float m = first[0];
    for (int c = 1; c < nc; ++c) m = std::max(m, first[c * stride]);
    float l = 0.0f;
    float* o = out + size_t(hq) * Dv;
    for (int d = 0; d < Dv; ++d) o[d] = 0.0f;
    for (int c = 0; c < nc; ++c) {
      const float* p = first + c * stride;
      const float w = std::exp(p[0] - m);
      l += w * p[1];
      for (int d = 0; d < Dv; d += W) vstore(o + d, vfma(vset(w), vload(p + 2 + d), vload(o + d)));
    }
    for (int d = 0; d < Dv; d += W) vstore(o + d, vmul(vload(o + d), vset(1.0f / l)));
  }

  int run(int threads) {
    if ((dtype != F32 && dtype != F16 && dtype != BF16) || S <= lo || lo < 0 || kv_heads <= 0 || heads % kv_heads ||
        D <= 0 || Dv <= 0 || D % W || Dv % W)
      return -1;
    const int nc = chunks(), items = kv_heads * nc, G = group();
    const size_t stride = size_t(G) * (2 + Dv);
#if defined(__AVX512BF16__)
    // a 16-bit run's query is bf16 (each float's low half zero): its scores then take the bf16
    // dot products, equal to the float32 ones up to the order of their sums
    thread_local std::vector<uint16_t> qbuf;
    qb = nullptr;
    if (dtype == BF16 && D % 32 == 0) {
      const size_t n = size_t(heads) * D;
      qbuf.resize(n);
      bool exact = true;
      for (size_t i = 0; i < n && exact; ++i) {
        uint32_t u;
        std::memcpy(&u, q + i, 4);
        exact = (u & 0xffffu) == 0;
        qbuf[i] = uint16_t(u >> 16);
      }
      if (exact) qb = qbuf.data();
    }
#endif
    thread_local std::vector<float> parts;
    parts.resize(size_t(items) * stride);
    float* pp = parts.data();
#pragma omp parallel num_threads(std::max(1, std::min(threads, std::max(items, heads))))
    {
#pragma omp for schedule(dynamic, 1)
      for (int it = 0; it < items; ++it) {  // chunk by chunk; parts head by head (`merge`)
        const int h = it % kv_heads, c = it / kv_heads;
        item(h, c, pp + (size_t(h) * nc + c) * stride);
      }
#pragma omp for schedule(static)
      for (int hq = 0; hq < heads; ++hq) merge(hq, pp);
    }
    return 0;
  }
};
