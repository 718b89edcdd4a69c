// The int8 path of experts.cpp (included there, inside its namespace, after the block formats):
// for runs that compute in bf16 or fp16, where exact float32 products of the dequantized weights
// buy nothing, each token's activations are quantized once a call to int8 (as ggml's Q8_K: one
// scale per 256 values, or per 32 where a row is not a multiple of 256, and the sum of each 16),
// and a block's weights stay integers until its sum: `maddubs` multiplies unsigned weights by
// signed activations into pairs, `madd` scales the pairs by the sub-block's integer scale (or adds
// them), one float multiply-add a block and token. Q4_K takes ~16 integer operations per 64
// weights and token where the float path decodes, converts and multiplies each weight. Dev box,
// one thread, 1 token, 8 experts a call, GFLOP/s: Q4_K 22.4 -> 42.9, Q6_K 17.0 -> 28.3, q4_k_m
// 22.2 -> 35.9. On an H200 host at 15 threads q4_k_m slots calibrated at 68.0 GB/s against 44.3,
// and the cpu strategy decoded 263.7 tok/s against 181.2 (docs/benchmarks.md).
//
// Error: the activations' rounding, at most half a step of max|x| / 127 per value: 1.2-2.2% of
// an expert's output on Gaussian rows (tests/test_cpu_int8_path.py checks the arithmetic against
// a float64 model of it and bounds that error). Float32 runs never take it.
//
// Formats: Q4_K and Q6_K (the _K_M mixes), Q8_0, Q4_0, IQ4_NL and MXFP4; the others
// (and rows whose length is not a multiple of the format's unit) keep the float path.
inline size_t pad64(size_t b) { return (b + 63) & ~size_t(63); }

// One quantized row of n activations (n % 32 == 0): n int8, then n / 32 float scales (equal within
// each 256 where n % 256 == 0, so 256-weight blocks read one), then n / 16 int16 sums, each part
// 64-byte aligned.
size_t q8_bytes(int n) { return pad64(size_t(n)) + pad64(size_t(n / 32) * 4) + pad64(size_t(n / 16) * 2); }

#if FUSED_BLOCKS
#define INT8_PATH 1

struct Q8 {
  const int8_t* q;
  const float* d;
  const int16_t* s;
  Q8(const uint8_t* p, int n)
      : q((const int8_t*)p), d((const float*)(p + pad64(size_t(n)))),
        s((const int16_t*)(p + pad64(size_t(n)) + pad64(size_t(n / 32) * 4))) {}
};

// x[0:n] into `p` (q8_bytes(n)): per group of 256 (or 32) values d = max|x| / 127 and
// q = round(x / d), ties to even.
void quantize_q8(const float* x, int n, uint8_t* p) {
  int8_t* q = (int8_t*)p;
  float* d = (float*)(p + pad64(size_t(n)));
  int16_t* s = (int16_t*)(p + pad64(size_t(n)) + pad64(size_t(n / 32) * 4));
  const int g = n % 256 == 0 ? 256 : 32;
  for (int b = 0; b < n; b += g) {
    __m512 m = _mm512_setzero_ps();
    for (int i = b; i < b + g; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = b; i < b + g; i += 32) d[i / 32] = amax / 127.0f;
    for (int i = b; i < b + g; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
      _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtsepi32_epi8(v));
      s[i / 16] = int16_t(_mm512_reduce_add_epi32(v));
    }
  }
}

inline Vi load64(const void* p) { return _mm512_loadu_si512(p); }
// 32 bytes at p in both halves of a register
inline Vi twice32(const uint8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)); }
// int16 lanes of a register picking lane `idx` of `v` (its first 16 int16)
inline Vi pick16(const Vi idx, __m256i v) { return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(v)); }
// per int32 lane: the sum of its 4 byte products, unsigned a times signed b
inline Vi dot4(Vi a, Vi b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1));
#endif
}
// acc + the sums of adjacent int16 products of a and b per int32 lane (VNNI's dpwssd: one op)
inline Vi madd_add(Vi acc, Vi a, Vi b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
const Vi NIBBLE = _mm512_set1_epi8(15);
// 16-bit shifts of 0 in the low 256 bits and 4 in the high ones: 32 bytes' low nibbles, then high
const Vi LOW_THEN_HIGH = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);

// Q4_K: sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes c * 32 .. c * 32 + 31, so
// register c holds weights c * 64 .. c * 64 + 63 in order: unsigned 0..15 with an int16 scale per
// lane pair and a min per sub-block, taken off through the activations' sums.
struct IQ4_K {
  static constexpr int UNIT = 256, BYTES = 144;
  struct Unit {
    Vi w[4], sc[4];
    __m256i mins;  // each sub-block's min twice: beside the 16 sums of 16
    float d, dmin;
  };
  static void load(const uint8_t* b, Unit& u) {
    u.d = f16_at(b), u.dmin = f16_at(b + 2);
    uint64_t sc8, m8;
    scales_mins_k4(b + 4, &sc8, &m8);
    const __m128i m = _mm_cvtsi64_si128(int64_t(m8));
    const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8)));
    u.mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
    for (int c = 0; c < 4; ++c) {
      u.sc[c] = pick16(_mm512_add_epi16(_mm512_set1_epi16(int16_t(2 * c)), HALF_ONES), sc16);
      u.w[c] = _mm512_and_si512(_mm512_srlv_epi16(twice32(b + 16 + 32 * c), LOW_THEN_HIGH), NIBBLE);
    }
  }
  // int16 lanes 0..15: 0, 16..31: 1
  static inline const Vi HALF_ONES = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
  static void dot(const Unit& u, const Q8& x, int i, __m512& acc, __m256& cor) {
    Vi s = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) s = madd_add(s, _mm512_maddubs_epi16(u.w[c], load64(x.q + i + 64 * c)), u.sc[c]);
    const float xd = x.d[i / 32];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(u.d * xd), acc);
    const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x.s + i / 16)), u.mins);
    cor = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(u.dmin * xd), cor);
  }
};

// Q6_K: in half h, 64 bytes of low nibbles and 32 of high bits make weights h * 128 .. + 63 and
// + 64 .. + 127 in order (as BQ6_K::each), unsigned 0..63; the -32 is taken off through the sums.
struct IQ6_K {
  static constexpr int UNIT = 256, BYTES = 210;
  struct Unit {
    Vi w[4], sc[4];
    __m256i sc16;
    float d;
  };
  static void load(const uint8_t* b, Unit& u) {
    u.d = f16_at(b + 208);
    u.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
    const Vi n4 = NIBBLE, b45 = _mm512_set1_epi8(48);
    const Vi up01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const Vi down23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; ++h) {
      const Vi ql = load64(b + 64 * h), qh = twice32(b + 128 + 32 * h);
      u.w[2 * h] = and_or(_mm512_sllv_epi16(qh, up01), b45, _mm512_and_si512(ql, n4));
      u.w[2 * h + 1] = and_or(_mm512_srlv_epi16(qh, down23), b45, _mm512_and_si512(_mm512_srli_epi16(ql, 4), n4));
    }
    for (int v = 0; v < 4; ++v)  // int16 lane l of register v: group 4v + l / 8
      u.sc[v] = pick16(_mm512_add_epi16(_mm512_set1_epi16(int16_t(4 * v)), EIGHTHS), u.sc16);
  }
  static inline const Vi EIGHTHS = _mm512_srli_epi16(
      _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                       7, 6, 5, 4, 3, 2, 1, 0),
      3);
  static void dot(const Unit& u, const Q8& x, int i, __m512& acc, __m256& cor) {
    Vi s = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) s = madd_add(s, _mm512_maddubs_epi16(u.w[v], load64(x.q + i + 64 * v)), u.sc[v]);
    const float dx = u.d * x.d[i / 32];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(dx), acc);
    const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x.s + i / 16)), u.sc16);
    cor = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(32.0f * dx), cor);
  }
};

// Formats of 32-weight blocks with one float scale and signed weights, two blocks a unit: S gives
// BYTES, scale(b) and weights(b), the block's 32 int8 in order (as __m256i). The product of
// signed weights and activations runs on |w| and the activations with w's sign.
template <class S>
struct I32Blocks {
  static constexpr int UNIT = 64, BYTES = 2 * S::BYTES;
  struct Unit {
    Vi w;
    __mmask64 neg;
    float d[2];
  };
  static void load(const uint8_t* b, Unit& u) {
    const Vi w = _mm512_inserti64x4(_mm512_castsi256_si512(S::weights(b)), S::weights(b + S::BYTES), 1);
    u.neg = _mm512_movepi8_mask(w);
    u.w = _mm512_abs_epi8(w);
    u.d[0] = S::scale(b), u.d[1] = S::scale(b + S::BYTES);
  }
  static void dot(const Unit& u, const Q8& x, int i, __m512& acc, __m256&) {
    const Vi q = load64(x.q + i);
    const Vi s = dot4(u.w, _mm512_mask_sub_epi8(q, u.neg, _mm512_setzero_si512(), q));
    const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(u.d[0] * x.d[i / 32]), _mm256_set1_ps(u.d[1] * x.d[i / 32 + 1]), 1);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc);
  }
};
// 16 nibble bytes as 32 bytes: the low nibbles (weights 0..15), then the high (16..31)
inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p), n = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), n), _mm_and_si128(v, n));
}
// a table of 16 int8 looked up by each nibble (in each 128-bit lane)
inline __m256i lookup(__m256i idx, __m128i table) { return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), idx); }
struct S8_0 {
  static constexpr int BYTES = 34;
  static float scale(const uint8_t* b) { return f16_at(b); }
  static __m256i weights(const uint8_t* b) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
};
struct S4_0 {
  static constexpr int BYTES = 18;
  static float scale(const uint8_t* b) { return f16_at(b); }
  static __m256i weights(const uint8_t* b) { return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)); }
};
struct SIQ4_NL {
  static constexpr int BYTES = 18;
  static float scale(const uint8_t* b) { return f16_at(b); }
  static __m256i weights(const uint8_t* b) {
    return lookup(nibbles(b + 2), _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
  }
};
struct SMXFP4 {  // the e2m1 values doubled, so the scale is BMXFP4's (2^(e - 128))
  static constexpr int BYTES = 17;
  static float scale(const uint8_t* b) { return BMXFP4::scale(b); }
  static __m256i weights(const uint8_t* b) {
    return lookup(nibbles(b + 1), _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
  }
};

// s[r][t] = dot(rows[r][0:n], x[t]) for R rows of Q's units and TB quantized tokens.
template <class Q, int R, int TB>
void qdot(const uint8_t* const* rows, int n, const uint8_t* const* xq, float (*s)[TBMAX]) {
  __m512 acc[R][TB];
  __m256 cor[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps(), cor[r][t] = _mm256_setzero_ps();
  for (int u = 0; u < n / Q::UNIT; ++u) {
    typename Q::Unit w[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = rows[r] + size_t(u) * Q::BYTES;
      prefetch_block<Q::BYTES>(b);
      Q::load(b, w[r]);
    }
    for (int t = 0; t < TB; ++t) {
      const Q8 xt(xq[t], n);
      for (int r = 0; r < R; ++r) Q::dot(w[r], xt, u * Q::UNIT, acc[r][t], cor[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) {
      const __m128 c = _mm_add_ps(_mm256_castps256_ps128(cor[r][t]), _mm256_extractf128_ps(cor[r][t], 1));
      const __m128 c2 = _mm_add_ps(c, _mm_movehl_ps(c, c));
      s[r][t] = _mm512_reduce_add_ps(acc[r][t]) - _mm_cvtss_f32(_mm_add_ss(c2, _mm_movehdup_ps(c2)));
    }
}

using QDotFn = void (*)(int, const uint8_t* const*, int, const uint8_t* const*, float (*)[TBMAX]);
template <class Q, int R, int TB = TBMAX>
void qdot_n(int tb, const uint8_t* const* rows, int n, const uint8_t* const* xq, float (*s)[TBMAX]) {
  if constexpr (TB > 1) {
    if (tb < TB) return qdot_n<Q, R, TB - 1>(tb, rows, n, xq, s);
  }
  qdot<Q, R, TB>(rows, n, xq, s);
}
#else  // no AVX-512 BW: every format keeps the float path (the names, for experts.cpp's table)
#define INT8_PATH 0
using QDotFn = void (*)(int, const uint8_t* const*, int, const uint8_t* const*, float (*)[TBMAX]);
struct IQ4_K {};
struct IQ6_K {};
template <class>
struct I32Blocks {};
struct S8_0 {};
struct S4_0 {};
struct SIQ4_NL {};
struct SMXFP4 {};
#endif
