// Float32 rows to GGUF block formats on CPU threads: the K-quants' reference searches and MXFP4.
//
// The torch quantizers in kernels/quantize.py define the bytes (ggml's reference quantizers
// without an importance matrix, in strict IEEE float32); this file computes the same bytes
// operation for operation, one block a thread at a time, for ftw-convert --quantize: in torch a
// qwen3-30b-a3b expert matrix (2048 x 768) took 3.4 s as Q4_K on the dev box's two threads,
// which made a 30B model's conversion a matter of hours. Built with -ffp-contract=off, so no
// multiply-add is fused, and every sum is added in the torch version's order (the first term,
// then each next one).
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int QK = 256;

uint16_t f16_bits(float f) {  // round to nearest even, as torch's float -> half
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return sign | (ax > 0x7f800000 ? 0x7e00 : 0x7c00);
    if (ax >= 0x477ff000) return sign | 0x7c00;  // 65520 and up round to infinity
    if (ax < 0x38800000) {  // a half subnormal: the nearest multiple of 2**-24
        float v;
        std::memcpy(&v, &ax, 4);
        return sign | (uint16_t)std::nearbyint(v * 16777216.0f);
    }
    uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffff) >> 13)), rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return sign | h;
}

float f16_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2**-24, exact
        return sign ? -v : v;
    }
    bits = e == 31 ? (sign | 0x7f800000 | (m << 13)) : (sign | ((e - 15 + 127) << 23) | (m << 13));
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

float f16_round(float v) { return f16_float(f16_bits(v)); }

void put_f16(uint8_t* p, float v) {
    uint16_t h = f16_bits(v);
    std::memcpy(p, &h, 2);
}

int nearest(float v) { return (int)std::nearbyint(v); }  // half to even, as torch.round

int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// make_qkx2_quants over n weights: x ~ scale * L - min, L in [0, nmax]; returns scale, sets min.
float fit_scale_min(const float* x, const float* w, int n, int nmax, float rmin, float rdelta, int nstep,
                    uint8_t* L, float* the_min) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; ++i) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        std::memset(L, 0, n);
        *the_min = -lo;
        return 0.0f;
    }
    float sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; ++i) {
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    float iscale = (float)nmax / (hi - lo), scale = 1.0f / iscale, best = 0.0f;
    for (int i = 0; i < n; ++i) {
        L[i] = (uint8_t)clampi(nearest(iscale * (x[i] - lo)), 0, nmax);
        float diff = scale * (float)L[i] + lo - x[i], e = w[i] * (diff * diff);
        best = i ? best + e : e;
    }
    uint8_t trial[32];
    for (int step = 0; step <= nstep; ++step) {
        float c = (rmin + rdelta * (float)step) + (float)nmax, is = c / (hi - lo);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            trial[i] = (uint8_t)clampi(nearest(is * (x[i] - lo)), 0, nmax);
            float t = (float)trial[i], wl = w[i] * t;
            sum_l = i ? sum_l + wl : wl;
            sum_l2 = i ? sum_l2 + wl * t : wl * t;
            sum_xl = i ? sum_xl + wl * x[i] : wl * x[i];
        }
        float det = sum_w * sum_l2 - sum_l * sum_l;
        if (!(det > 0)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if (this_min > 0) {
            this_scale = sum_xl / sum_l2;
            this_min = 0.0f;
        }
        float err = 0.0f;
        for (int i = 0; i < n; ++i) {
            float diff = this_scale * (float)trial[i] + this_min - x[i], e = w[i] * (diff * diff);
            err = i ? err + e : e;
        }
        if (err < best) {
            std::memcpy(L, trial, n);
            best = err;
            scale = this_scale;
            lo = this_min;
        }
    }
    *the_min = -lo;
    return scale;
}

uint8_t six_bits(float v, float top) {
    float inv = top > 0 ? 63.0f / top : 0.0f;
    int l = nearest(inv * v) & 0xFF;
    return (uint8_t)(l > 63 ? 63 : l);
}

// Q4_K (nmax 15) and Q5_K (nmax 31): the 16-byte head, each weight's level in L[256].
void q45_k(const float* x, int nmax, float rmin, int nstep, uint8_t* head, uint8_t* L) {
    float scales[8], mins[8], w[32];
    for (int j = 0; j < 8; ++j) {
        const float* s = x + 32 * j;
        float sq = s[0] * s[0];
        for (int i = 1; i < 32; ++i) sq += s[i] * s[i];
        float av = std::sqrt(sq / 32.0f);
        for (int i = 0; i < 32; ++i) w[i] = av + std::fabs(s[i]);
        scales[j] = fit_scale_min(s, w, 32, nmax, rmin, 0.1f, nstep, L + 32 * j, &mins[j]);
    }
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
        max_scale = scales[j] > max_scale ? scales[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; ++j) {
        ls[j] = six_bits(scales[j], max_scale);
        lm[j] = six_bits(mins[j], max_min);
    }
    for (int j = 0; j < 4; ++j) {
        head[4 + j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        head[8 + j] = lm[j] | ((lm[j + 4] >> 4) << 6);
        head[12 + j] = (ls[j + 4] & 0x0F) | ((lm[j + 4] & 0x0F) << 4);
    }
    float d = max_scale / 63.0f, dmin = max_min / 63.0f;
    put_f16(head, d);
    put_f16(head + 2, dmin);
    float dr = f16_round(d), mr = f16_round(dmin);
    for (int j = 0; j < 8; ++j) {  // against the scales as stored; a scale that rounds to 0 keeps its fit
        float sd = dr * (float)ls[j], sm = mr * (float)lm[j];
        if (sd == 0) continue;
        for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)clampi(nearest((x[32 * j + i] + sm) / sd), 0, nmax);
    }
}

void low_nibbles(const uint8_t* L, uint8_t* qs) {  // per 64 weights: j low, j + 32 high
    for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 32; ++j) qs[32 * c + j] = (L[64 * c + j] & 0x0F) | ((L[64 * c + 32 + j] & 0x0F) << 4);
}

void q4_k(const float* x, uint8_t* out) {
    uint8_t L[QK];
    q45_k(x, 15, -1.0f, 20, out, L);
    low_nibbles(L, out + 16);
}

void q5_k(const float* x, uint8_t* out) {
    uint8_t L[QK];
    q45_k(x, 31, -0.5f, 15, out, L);
    for (int j = 0; j < 32; ++j) {
        uint8_t b = 0;
        for (int k = 0; k < 8; ++k) b |= ((L[32 * k + j] >> 4) & 1) << k;
        out[16 + j] = b;
    }
    low_nibbles(L, out + 48);
}

// make_qx_quants (rmse_type 1, weights x**2) over 16 weights: x ~ scale * (L - nmax).
float fit_symmetric(const float* x, int nmax, uint8_t* L) {
    float amax = std::fabs(x[0]), mx = x[0];
    for (int i = 1; i < 16; ++i)
        if (std::fabs(x[i]) > amax) {
            amax = std::fabs(x[i]);
            mx = x[i];
        }
    if (amax < 1e-15f) {
        std::memset(L, 0, 16);
        return 0.0f;
    }
    int q[16], best_q[16];
    auto fit = [&](float iscale, float& sumlx, float& suml2) {
        for (int i = 0; i < 16; ++i) {
            q[i] = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i], l = (float)q[i];
            sumlx = i ? sumlx + w * x[i] * l : w * x[i] * l;
            suml2 = i ? suml2 + w * l * l : w * l * l;
        }
    };
    float sumlx = 0, suml2 = 0;
    fit((float)-nmax / mx, sumlx, suml2);
    std::memcpy(best_q, q, sizeof q);
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        fit(-((float)nmax + 0.1f * (float)is) / mx, sumlx, suml2);
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            std::memcpy(best_q, q, sizeof q);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    for (int i = 0; i < 16; ++i) L[i] = (uint8_t)(best_q[i] + nmax);
    return scale;
}

void q6_k(const float* x, uint8_t* out) {
    uint8_t L[QK];
    float scales[16];
    for (int j = 0; j < 16; ++j) scales[j] = fit_symmetric(x + 16 * j, 32, L + 16 * j);
    float amax = std::fabs(scales[0]), top = scales[0];
    for (int j = 1; j < 16; ++j)
        if (std::fabs(scales[j]) > amax) {
            amax = std::fabs(scales[j]);
            top = scales[j];
        }
    if (amax < 1e-15f) {  // the whole super-block is zero
        std::memset(out, 0, 210);
        return;
    }
    float iscale = -128.0f / top, d = 1.0f / iscale, dr;
    int8_t sc[16];
    for (int j = 0; j < 16; ++j) sc[j] = (int8_t)(nearest(iscale * scales[j]) > 127 ? 127 : nearest(iscale * scales[j]));
    dr = f16_round(d);
    for (int j = 0; j < 16; ++j) {
        float sd = dr * (float)sc[j];
        if (sd == 0) continue;
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (uint8_t)(clampi(nearest(x[16 * j + i] / sd), -32, 31) + 32);
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int h = 0; h < 2; ++h) {
        const uint8_t* q = L + 128 * h;
        for (int j = 0; j < 64; ++j) ql[64 * h + j] = (q[j] & 0x0F) | ((q[64 + j] & 0x0F) << 4);
        for (int l = 0; l < 32; ++l)
            qh[32 * h + l] = (q[l] >> 4) | ((q[32 + l] >> 4) << 2) | ((q[64 + l] >> 4) << 4) | ((q[96 + l] >> 4) << 6);
    }
    std::memcpy(out + 192, sc, 16);
    put_f16(out + 208, d);
}

const float E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

void mxfp4(const float* x, uint8_t* out) {  // 32 weights: an e8m0 byte, 16 bytes of e2m1 codes
    float amax = std::fabs(x[0]);
    for (int i = 1; i < 32; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    uint8_t e = 0;
    if (amax > 0) e = (uint8_t)(int32_t)(std::floor((float)std::log2((double)amax)) - 2 + 127);
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float half;
    std::memcpy(&half, &bits, 4);
    uint8_t q[32];
    for (int i = 0; i < 32; ++i) {
        int best = 0;
        float err = std::fabs(half * E2M1_X2[0] - x[i]);
        for (int k = 1; k < 16; ++k) {
            float e2 = std::fabs(half * E2M1_X2[k] - x[i]);
            if (e2 < err) {
                err = e2;
                best = k;
            }
        }
        q[i] = (uint8_t)best;
    }
    out[0] = e;
    for (int j = 0; j < 16; ++j) out[1 + j] = q[j] | (q[j + 16] << 4);
}

}  // namespace

// fmt: 0 q4_k, 1 q5_k, 2 q6_k (256 weights a block), 3 mxfp4 (32); returns 1 for an unknown one.
extern "C" int ftq_quantize(int fmt, const float* x, int64_t blocks, uint8_t* out, int threads) {
    static const int weights[] = {256, 256, 256, 32}, bytes[] = {144, 176, 210, 17};
    static void (*const fns[])(const float*, uint8_t*) = {q4_k, q5_k, q6_k, mxfp4};
    if (fmt < 0 || fmt > 3) return 1;
    int n = weights[fmt], b = bytes[fmt];
    auto fn = fns[fmt];
#pragma omp parallel for num_threads(threads) schedule(dynamic, 64)
    for (int64_t i = 0; i < blocks; ++i) fn(x + i * n, out + i * b);
    return 0;
}
