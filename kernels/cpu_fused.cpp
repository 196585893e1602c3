// The fused pass on the CPU: same inputs and result as kernels/reference/fused.py (see kernels/cpu.py,
// which compiles this file once per machine and calls it through ctypes).
//
// Requests are taken in groups of up to 64. For a group, the request side of the match is turned around first:
// held[ref] is a word with bit b set when request b's user satisfies the ref (clause c or "not c"; from the
// bit-packed `truth`; a lone request gets a bit per ref, which stays in L2). The slots are then cut into `tasks`
// ranges run on OpenMP threads. Per ad, one pass over its refs gives the word of every request it matches at once
// (a load and an and per ref, whatever the group's size), and a shared test of the window against the group's
// earliest and latest `now`. Matched rows are prefetched a few blocks of ads ahead of their scoring. Only an ad
// some request matched is decoded (int8 with block scales, fp16 or fp32; AVX-512 or AVX2 where the CPU has it),
// once, then scored for each request it matched: the request's experts and gating keys are one (D + G, 16) matrix,
// so the similarities of every expert and the gating logits of every expert are 16-lane multiply-adds over the ad's
// dims (no horizontal sums). A block's pairs are screened first, their similarities against the bar of the
// request's heap, with no branch on a pair's outcome; only those screened in get their gating logits, the top-n
// logits, their softmax and the gated sum. Each task keeps a bounded heap
// of its m best (score, slot) per request; the tasks' heaps are merged at the end. Nothing of the table's size is
// allocated.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, fraction = h & 0x3ffu;
    float value;
    if (exponent == 0) value = std::ldexp(static_cast<float>(fraction), -24);
    else if (exponent == 31) value = fraction ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    else value = std::ldexp(static_cast<float>(fraction | 0x400u), static_cast<int>(exponent) - 25);
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    bits |= sign;
    std::memcpy(&value, &bits, 4);
    return value;
}
#endif

namespace {

constexpr int32_t ALWAYS = 1;    // the ref that pads a row
constexpr int SERVABLE = 7;      // LIVE | ACTIVE | SATISFIABLE
constexpr int64_t SCALE_BLOCK = 16;
enum Storage { F32 = 0, F16 = 1, I8 = 2 };

struct Table {
    int64_t n, C, S, n_scales;
    const int8_t* status;
    const int64_t* start;
    const int64_t* end;
    const int32_t* refs;
    const void* vectors;
    int kind;
    const float* scales;
};

constexpr int64_t LANES = 16;  // experts per request at most: one SIMD register holds a value per expert

// The request side packs P = 16 / (E rounded up to a power of two) consecutive dims per 16-lane row, lane
// e * P + h holding dim r * P + h of expert e in row r (kernels/cpu.py expert_weights): with E = 6, P = 2.
struct Requests {
    int64_t B, E, D, G, P, bias_col, top_n;
    const int64_t* now;
    const float* weights;  // (B, ceil(D / P) + ceil(G / P), LANES): the experts' rows, then the gating keys'; with
                           // E = 1 and G = 0, (B, D) the one expert (a dot product, no gating)
    const uint8_t* mask;   // (B, LANES): lane e * P set when expert e is usable
    int64_t stride;        // floats of weights per request: ceil(D / P) + ceil(G / P) rows of LANES (or D)
};

// 16 int8 values times their block's scale into 16 floats (compilers do not vectorise the widening well).
inline void int8_block(const int8_t* v, float scale, float* x) {
#if defined(__AVX512F__)
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
    _mm512_storeu_ps(x, _mm512_mul_ps(values, _mm512_set1_ps(scale)));
#elif defined(__AVX2__)
    for (int half = 0; half < 2; ++half) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * half));
        const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        _mm256_storeu_ps(x + 8 * half, _mm256_mul_ps(values, _mm256_set1_ps(scale)));
    }
#else
    for (int64_t d = 0; d < SCALE_BLOCK; ++d) x[d] = static_cast<float>(v[d]) * scale;
#endif
}

// Row i's first `width` dims into x as float32; returns its bias (0 when bias_col < 0).
inline float decode(const Table& t, int64_t i, int64_t width, int64_t bias_col, float* x) {
    if (t.kind == I8) {
        const int8_t* v = static_cast<const int8_t*>(t.vectors) + i * t.S;
        const float* s = t.scales + i * t.n_scales;
        int64_t first = 0;
        for (; first + SCALE_BLOCK <= width; first += SCALE_BLOCK) int8_block(v + first, s[first / SCALE_BLOCK], x + first);
        for (int64_t d = first; d < width; ++d) x[d] = static_cast<float>(v[d]) * s[first / SCALE_BLOCK];
        return bias_col >= 0 ? static_cast<float>(v[bias_col]) * s[bias_col / SCALE_BLOCK] : 0.0f;
    }
    if (t.kind == F16) {
        const uint16_t* v = static_cast<const uint16_t*>(t.vectors) + i * t.S;
        int64_t first = 0;
#if defined(__AVX512F__)
        for (; first + 16 <= width; first += 16)
            _mm512_storeu_ps(x + first, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + first))));
#elif defined(__F16C__) && defined(__AVX__)
        for (; first + 8 <= width; first += 8)
            _mm256_storeu_ps(x + first, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + first))));
#endif
        for (int64_t d = first; d < width; ++d) x[d] = half_to_float(v[d]);
        return bias_col >= 0 ? half_to_float(v[bias_col]) : 0.0f;
    }
    const float* v = static_cast<const float*>(t.vectors) + i * t.S;
    if (width > 0) std::memcpy(x, v, width * sizeof(float));  // a table of no columns has no data (null)
    return bias_col >= 0 ? v[bias_col] : 0.0f;
}

inline float dot(const float* a, const float* b, int64_t n) {
    float acc = 0.0f;
    int64_t d = 0;
#if defined(__AVX512F__)
    __m512 lanes = _mm512_setzero_ps();
    for (; d + 16 <= n; d += 16) lanes = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), lanes);
    acc = _mm512_reduce_add_ps(lanes);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; d + 16 <= n; d += 16)
        for (int j = 0; j < 2; ++j) lanes[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8 * j), _mm256_loadu_ps(b + d + 8 * j), lanes[j]);
    for (; d + 8 <= n; d += 8) lanes[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lanes[0]);
    alignas(32) float sums[8];
    _mm256_store_ps(sums, _mm256_add_ps(lanes[0], lanes[1]));
    for (const float sum : sums) acc += sum;
#endif
    for (; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

// The experts a candidate's gating chose, in order of their logits (the first the largest): each one's softmax
// weight exp(logit - first) and similarity. The gated sum normalises the gates first, as the reference does: a gate
// that rounds to 0 adds nothing whatever its similarity (an inf or NaN one too), and no partial sum of
// weight x similarity can overflow where the gated one would not (similarities near float32's largest).
struct Chosen {
    float weight[LANES], sim[LANES], first = 0.0f, total = 0.0f;
    int64_t count = 0;
    void add(float logit, float similarity) {
        first = count ? first : logit;
        weight[count] = count ? std::exp(logit - first) : 1.0f;
        sim[count] = similarity;
        total += weight[count++];
    }
    float gated_sum() const {
        float score = 0.0f;
        for (int64_t j = 0; j < count; ++j)
            if (const float gate = weight[j] / total; gate > 0.0f) score += gate * sim[j];
        return score;
    }
};

#if defined(__AVX512F__)
// The lanes whose expert is usable (usable: 16 bytes, nonzero where set).
inline __mmask16 usable_lanes(const uint8_t* usable) {
    return _mm_cmpneq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(usable)), _mm_setzero_si128());
}

// The mixture of logits from every expert's similarity (sims) and gating logit (logits), one lane each: the
// top_n usable experts by logit (of equal logits, the lower expert), their softmax, the gated sum.
inline float mixture(__m512 sims, __m512 logits, const uint8_t* usable, int64_t top_n) {
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __mmask16 ok = usable_lanes(usable);
    const __mmask16 bad = (_mm512_cmp_ps_mask(logits, logits, _CMP_UNORD_Q) |
                           _mm512_cmp_ps_mask(logits, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ)) & ok;
    if (bad) return 0.0f;  // a NaN or +inf logit is chosen first and makes every gate NaN: all 0 (the reference)
    logits = _mm512_mask_blend_ps(ok, none, logits);
    Chosen chosen;
    for (int64_t n = 0; n < top_n; ++n) {  // the lane maximum, then its lowest lane
        const float best = _mm512_reduce_max_ps(logits);
        if (best == -std::numeric_limits<float>::infinity()) break;
        const int at = __builtin_ctz(_mm512_cmp_ps_mask(logits, _mm512_set1_ps(best), _CMP_EQ_OQ));
        chosen.add(best, _mm_cvtss_f32(_mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set1_epi32(at), sims))));
        logits = _mm512_mask_mov_ps(logits, static_cast<__mmask16>(1u << at), none);
    }
    return chosen.gated_sum();
}
#else
inline float mixture(const float* sims, float* logits, const uint8_t* usable, int64_t top_n) {
    constexpr float NONE = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < LANES; ++e) {
        if (usable[e] && !(logits[e] < std::numeric_limits<float>::infinity())) return 0.0f;  // NaN or +inf: gates 0
        logits[e] = usable[e] ? logits[e] : NONE;
    }
    Chosen chosen;
    for (int64_t n = 0; n < top_n; ++n) {
        int64_t at = 0;
        for (int64_t e = 1; e < LANES; ++e) at = logits[e] > logits[at] ? e : at;
        if (logits[at] == NONE) break;
        chosen.add(logits[at], sims[at]);
        logits[at] = NONE;
    }
    return chosen.gated_sum();
}
#endif

#if defined(__AVX512F__)
// P consecutive floats from x repeated over the 16 lanes.
template <int P>
inline __m512 repeated(const float* x) {
    if constexpr (P == 1) return _mm512_set1_ps(*x);
    if constexpr (P == 2) {
        double pair;
        std::memcpy(&pair, x, sizeof pair);
        return _mm512_castpd_ps(_mm512_set1_pd(pair));
    }
    if constexpr (P == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(x));
}

// sum_r x[r P : r P + P] (repeated) * w[r] over the rows of `dims` dims, each expert's P lanes then summed
// (lane e * P holds expert e's product). x must be readable P floats past dims (the last row's lanes past dims
// are masked out, so what they read never counts).
template <int P>
inline __m512 products(const float* w, const float* x, int64_t dims) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t full = dims / P;
    int64_t r = 0;  // four accumulators: independent chains of multiply-adds
    for (; r + 4 <= full; r += 4)
        for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(repeated<P>(x + (r + j) * P), _mm512_loadu_ps(w + (r + j) * LANES), acc[j]);
    for (; r < full; ++r) acc[0] = _mm512_fmadd_ps(repeated<P>(x + r * P), _mm512_loadu_ps(w + r * LANES), acc[0]);
    if (dims % P) {  // lanes e * P + h with h < dims % P
        const __mmask16 lanes = static_cast<__mmask16>((P == 2 ? 0x5555u : 0x1111u) * ((1u << (dims % P)) - 1u));
        acc[1] = _mm512_mask3_fmadd_ps(repeated<P>(x + r * P), _mm512_loadu_ps(w + r * LANES), acc[1], lanes);
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    if constexpr (P >= 2) sum = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0xB1));  // lanes 2k + 1 into 2k
    if constexpr (P == 4) sum = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0x4E));  // lanes 4k + 2 into 4k
    return sum;
}

// Every expert's similarity into sims (LANES floats, lane e * P); false when the ad cannot reach bar. The gates are
// >= 0 and sum to 1 (or are all 0): the mixture is at most max(0, the largest usable similarity). A NaN similarity
// makes a NaN score (-inf) if its expert is chosen, and else does not count; a NaN bar bounds nothing.
template <int P>
inline bool packed_screen(const Requests& r, const float* w, const float* x, const uint8_t* usable, float bar,
                          float* sims) {
    const __m512 s = products<P>(w, x, r.D);
    _mm512_storeu_ps(sims, s);
    return !(bar > 0.0f) | (_mm512_mask_cmp_ps_mask(usable_lanes(usable), s, _mm512_set1_ps(bar), _CMP_GE_OQ) != 0);
}

// The mixture of the screened ad x: its gating logits, then mixture() with its similarities (sims).
template <int P>
inline float packed_finish(const Requests& r, const float* w, const float* x, const uint8_t* usable, const float* sims) {
    return mixture(_mm512_loadu_ps(sims), products<P>(w + (r.D + P - 1) / P * LANES, x + r.D, r.G), usable, r.top_n);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX-512 path above with the 16 lanes in two 8-lane halves (lo: lanes 0-7, hi: 8-15), then the portable mixture.
struct Lanes {
    __m256 lo, hi;
};

// P consecutive floats from x repeated over 8 lanes.
template <int P>
inline __m256 repeated(const float* x) {
    if constexpr (P == 1) return _mm256_broadcast_ss(x);
    if constexpr (P == 2) {
        double pair;
        std::memcpy(&pair, x, sizeof pair);
        return _mm256_castpd_ps(_mm256_set1_pd(pair));
    }
    if constexpr (P == 4) {
        const __m128 four = _mm_loadu_ps(x);  // x + D need not be 16-byte aligned
        return _mm256_set_m128(four, four);
    }
}

// All ones in the lanes whose bit of `bits` (8 of them) is set.
inline __m256 lane_mask(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit));
}

// As the AVX-512 products: sum_r x[r P : r P + P] (repeated) * w[r], each expert's P lanes summed into lane e * P.
template <int P>
inline Lanes products(const float* w, const float* x, int64_t dims) {
    __m256 lo[4], hi[4];  // eight independent chains of multiply-adds
    for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    const int64_t full = dims / P;
    int64_t r = 0;
    for (; r + 4 <= full; r += 4)
        for (int j = 0; j < 4; ++j) {
            const __m256 v = repeated<P>(x + (r + j) * P);
            lo[j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + (r + j) * LANES), lo[j]);
            hi[j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + (r + j) * LANES + 8), hi[j]);
        }
    for (; r < full; ++r) {
        const __m256 v = repeated<P>(x + r * P);
        lo[0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + r * LANES), lo[0]);
        hi[0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + r * LANES + 8), hi[0]);
    }
    if (dims % P) {  // lanes e * P + h with h < dims % P
        const unsigned lanes = (P == 2 ? 0x5555u : 0x1111u) * ((1u << (dims % P)) - 1u);
        const __m256 v = repeated<P>(x + r * P);
        lo[1] = _mm256_blendv_ps(lo[1], _mm256_fmadd_ps(v, _mm256_loadu_ps(w + r * LANES), lo[1]), lane_mask(lanes & 0xffu));
        hi[1] = _mm256_blendv_ps(hi[1], _mm256_fmadd_ps(v, _mm256_loadu_ps(w + r * LANES + 8), hi[1]), lane_mask(lanes >> 8));
    }
    Lanes sum{_mm256_add_ps(_mm256_add_ps(lo[0], lo[1]), _mm256_add_ps(lo[2], lo[3])),
              _mm256_add_ps(_mm256_add_ps(hi[0], hi[1]), _mm256_add_ps(hi[2], hi[3]))};
    for (__m256* half : {&sum.lo, &sum.hi}) {
        if constexpr (P >= 2) *half = _mm256_add_ps(*half, _mm256_permute_ps(*half, 0xB1));  // lanes 2k + 1 into 2k
        if constexpr (P == 4) *half = _mm256_add_ps(*half, _mm256_permute_ps(*half, 0x4E));  // lanes 4k + 2 into 4k
    }
    return sum;
}

// As the AVX-512 packed_screen.
template <int P>
inline bool packed_screen(const Requests& r, const float* w, const float* x, const uint8_t* usable, float bar,
                          float* sims) {
    const Lanes s = products<P>(w, x, r.D);
    _mm256_storeu_ps(sims, s.lo);
    _mm256_storeu_ps(sims + 8, s.hi);
    const __m256 level = _mm256_set1_ps(bar);  // ordered: a NaN similarity never reaches it
    const unsigned reached = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(s.lo, level, _CMP_GE_OQ))) |
                             static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(s.hi, level, _CMP_GE_OQ))) << 8;
    const unsigned usable_bits = ~static_cast<unsigned>(_mm_movemask_epi8(
        _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(usable)), _mm_setzero_si128())));
    return !(bar > 0.0f) | ((reached & usable_bits & 0xffffu) != 0);
}

// As the AVX-512 packed_finish.
template <int P>
inline float packed_finish(const Requests& r, const float* w, const float* x, const uint8_t* usable, const float* sims) {
    const Lanes logits = products<P>(w + (r.D + P - 1) / P * LANES, x + r.D, r.G);
    alignas(32) float l[LANES];
    _mm256_store_ps(l, logits.lo);
    _mm256_store_ps(l + 8, logits.hi);
    return mixture(sims, l, usable, r.top_n);
}
#else
// Without AVX2 every ad passes the screen: its similarities, lane by lane.
inline bool packed_screen(const Requests& r, const float* w, const float* x, const uint8_t*, float, float* sims) {
    for (int64_t lane = 0; lane < LANES; ++lane) sims[lane] = 0.0f;
    for (int64_t lane = 0; lane < LANES; ++lane) {
        const int64_t h = lane % r.P;
        for (int64_t d = h; d < r.D; d += r.P) sims[lane - h] += x[d] * w[d / r.P * LANES + lane];
    }
    return true;
}

inline float packed_finish(const Requests& r, const float* w, const float* x, const uint8_t* usable, const float* sims) {
    float logits[LANES] = {};
    for (int64_t lane = 0; lane < LANES; ++lane) {
        const int64_t h = lane % r.P;
        for (int64_t g = h; g < r.G; g += r.P) logits[lane - h] += x[r.D + g] * w[((r.D + r.P - 1) / r.P + g / r.P) * LANES + lane];
    }
    return mixture(sims, logits, usable, r.top_n);
}
#endif

// The mixture-of-logits score of the decoded ad x for request b (without its bias) in two steps. screen: every
// expert's similarity <expert e, x[:D]> (16-lane multiply-adds over x's dims) into sims (LANES floats); false when
// (with AVX-512 or AVX2) they show the ad below bar, a score it could not enter the heap with. finish: every
// expert's gating logit <key e, x[D:D + G]>, then mixture(). A dot-product head (one expert, no gating) is its
// similarity.
inline bool screen(const Requests& r, int64_t b, const float* x, float bar, float* sims) {
    const uint8_t* usable = r.mask + b * LANES;
    const float* w = r.weights + b * r.stride;
    if (r.E == 1 && r.G == 0) {
        sims[0] = usable[0] ? dot(w, x, r.D) : 0.0f;
        return true;
    }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (r.P == 4) return packed_screen<4>(r, w, x, usable, bar, sims);
    if (r.P == 2) return packed_screen<2>(r, w, x, usable, bar, sims);
    return packed_screen<1>(r, w, x, usable, bar, sims);
#else
    return packed_screen(r, w, x, usable, bar, sims);
#endif
}

inline float finish(const Requests& r, int64_t b, const float* x, const float* sims) {
    const uint8_t* usable = r.mask + b * LANES;
    const float* w = r.weights + b * r.stride;
    if (r.E == 1 && r.G == 0) return sims[0];
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (r.P == 4) return packed_finish<4>(r, w, x, usable, sims);
    if (r.P == 2) return packed_finish<2>(r, w, x, usable, sims);
    return packed_finish<1>(r, w, x, usable, sims);
#else
    return packed_finish(r, w, x, usable, sims);
#endif
}

// What the mixture of an ad with this bias must reach to enter a full heap whose worst score is root, less
// a margin far above the rounding of the few operations between the bound and the score (-inf: no bar).
inline float entry_bar(float root, float bias) {
    return root - bias - (1e-5f * (std::fabs(root) + std::fabs(bias)) + std::numeric_limits<float>::min());
}

inline bool better(float a, int64_t slot_a, float b, int64_t slot_b) {
    return a > b || (a == b && slot_a < slot_b);
}

// Offer (score, slot) to a min-heap (root = worst) of capacity m holding `size` entries; returns the new size.
inline int64_t push(float* score, int64_t* slot, int64_t size, int64_t m, float s, int64_t i) {
    if (size < m) {
        int64_t j = size;
        score[j] = s;
        slot[j] = i;
        while (j > 0) {
            const int64_t parent = (j - 1) / 2;
            if (!better(score[parent], slot[parent], score[j], slot[j])) break;
            std::swap(score[j], score[parent]);
            std::swap(slot[j], slot[parent]);
            j = parent;
        }
        return size + 1;
    }
    if (!better(s, i, score[0], slot[0])) return size;
    score[0] = s;
    slot[0] = i;
    int64_t j = 0;
    while (true) {
        int64_t worst = j;
        const int64_t left = 2 * j + 1, right = 2 * j + 2;
        if (left < m && better(score[worst], slot[worst], score[left], slot[left])) worst = left;
        if (right < m && better(score[worst], slot[worst], score[right], slot[right])) worst = right;
        if (worst == j) return size;
        std::swap(score[j], score[worst]);
        std::swap(slot[j], slot[worst]);
        j = worst;
    }
}

}  // namespace

namespace {

// What each request of a group holds, as the match reads it: held[ref] is a Word with bit b set when request
// first + b holds the ref (ref 2 c: clause c; 2 c + 1: "not c"), from the bit-packed truth (W words per request).
// HeldWords keeps a Word per ref; HeldBits, for a group of one, a bit per ref: an eighth of the bytes (84 KB for
// the 1M-ad world's 335k clauses, within a core's L2, where the byte per ref is not).
template <typename Word>
struct HeldWords {
    std::vector<Word> words;  // (W * 64,)
    HeldWords(const int32_t* truth, int64_t W, int64_t first, int64_t count) : words(W * 64, 0) {
        for (int64_t c = 0; c < W * 32; ++c) words[2 * c + 1] = static_cast<Word>(~Word(0));
        for (int64_t b = 0; b < count; ++b) {
            const uint32_t* truth_words = reinterpret_cast<const uint32_t*>(truth) + (first + b) * W;
            for (int64_t w = 0; w < W; ++w)
                for (uint32_t bits = truth_words[w]; bits; bits &= bits - 1) {
                    const int64_t c = w * 32 + __builtin_ctz(bits);
                    words[2 * c] |= static_cast<Word>(Word(1) << b);
                    words[2 * c + 1] &= static_cast<Word>(~(Word(1) << b));
                }
        }
    }
    struct View {
        const Word* words;
        Word operator[](int32_t ref) const { return words[ref]; }
    };
    View view() const { return {words.data()}; }
};

struct HeldBits {
    std::vector<uint64_t> bits;  // (W,): bit ref % 64 of bits[ref / 64]; "not c" (odd refs) set but where c holds
    HeldBits(const int32_t* truth, int64_t W, int64_t first, int64_t) : bits(W, 0xAAAAAAAAAAAAAAAAull) {
        const uint32_t* truth_words = reinterpret_cast<const uint32_t*>(truth) + first * W;
        for (int64_t w = 0; w < W; ++w)
            for (uint32_t held = truth_words[w]; held; held &= held - 1)
                bits[w] ^= 3ull << (2 * __builtin_ctz(held));  // clause c of the word: ref 2 c set, 2 c + 1 cleared
    }
    struct View {
        const uint64_t* bits;
        uint8_t operator[](int32_t ref) const { return static_cast<uint8_t>((bits[ref >> 6] >> (ref & 63)) & 1); }
    };
    View view() const { return {bits.data()}; }
};

// The requests of the group (now: theirs, count of them) that may be served ad i, one bit each. COLUMNS: the
// table's refs per row when known at compile time, else 0.
template <typename Word, int COLUMNS, typename View>
inline Word matches(const Table& t, View held, Word all, const int64_t* now, int64_t count, int64_t earliest,
                    int64_t latest, int64_t i) {
    const int64_t start = t.start[i], end = t.end[i];
    Word ok = (start <= earliest) & (latest < end) ? all : Word(0);  // the window holds for the whole group
    if (!ok)  // rare: then request by request
        for (int64_t b = 0; b < count; ++b) ok |= static_cast<Word>(((start <= now[b]) & (now[b] < end)) ? Word(1) << b : 0);
    ok = ((t.status[i] & SERVABLE) == SERVABLE) ? ok : Word(0);
    const int64_t columns = COLUMNS ? COLUMNS : t.C;
    const int32_t* row = t.refs + i * columns;
    for (int64_t c = 0; c < columns; ++c) ok &= held[row[c]];  // padding (clause 0, negated) holds for everyone
    return ok;
}

// matches() of the `size` ads from `first` into out.
template <typename Word, int COLUMNS, typename View>
void match_run(const Table& t, View held, Word all, const int64_t* now, int64_t count, int64_t earliest,
               int64_t latest, int64_t first, int64_t size, Word* out) {
    for (int64_t k = 0; k < size; ++k)
        out[k] = matches<Word, COLUMNS, View>(t, held, all, now, count, earliest, latest, first + k);
}

template <typename Word, typename View>
using MatchRun = void (*)(const Table&, View, Word, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, Word*);

// match_run for a table of C refs per row: the loop over them unrolled for the usual widths (at B = 1, 4-7% faster
// than a loop to t.C; chosen once, so the scan itself is compiled once per Word).
template <typename Word, typename View>
MatchRun<Word, View> match_run_for(int64_t C) {
    switch (C) {
        case 1: return match_run<Word, 1, View>;
        case 2: return match_run<Word, 2, View>;
        case 3: return match_run<Word, 3, View>;
        case 4: return match_run<Word, 4, View>;
        case 5: return match_run<Word, 5, View>;
        case 6: return match_run<Word, 6, View>;
        case 7: return match_run<Word, 7, View>;
        case 8: return match_run<Word, 8, View>;
        default: return match_run<Word, 0, View>;
    }
}

constexpr int64_t BLOCK = 16;  // ads matched at once
constexpr int AHEAD = 3;        // blocks matched, and their matched rows prefetched, ahead of the one scored: a block's
                                // scoring is shorter than a row's trip from memory (measured at B = 1, 1M ads, 2 threads:
                                // 3 ahead with prefetcht2 15% faster than 1 ahead with prefetcht0, whose requests stalled
                                // on a full miss queue; 2 to 8 ahead, prefetcht1 or blocks of 8 or 32 within 5% of it)

// Asks for the cache lines of row i that decode reads: its first `width` dims, its bias, its scales.
inline void prefetch_row(const Table& t, int64_t i, int64_t width, int64_t bias_col) {
    const int64_t size = t.kind == I8 ? 1 : t.kind == F16 ? 2 : 4;
    const char* row = static_cast<const char*>(t.vectors) + i * t.S * size;
    for (int64_t at = 0; at < width * size + (reinterpret_cast<uintptr_t>(row) & 63); at += 64) {
        __builtin_prefetch(row + at, 0, 1);  // low locality: prefetcht2
        asm volatile("" : : "r"(row + at));  // GCC deletes a loop of prefetches alone as free of side effects
    }
    if (bias_col >= 0) __builtin_prefetch(row + bias_col * size, 0, 1);
    if (t.kind == I8) __builtin_prefetch(t.scales + i * t.n_scales, 0, 1);
}

struct Group {
    int64_t first, count, earliest, latest;
};

Group group_of(const int64_t* now, int64_t first, int64_t count) {
    Group g{first, count, now[first], now[first]};
    for (int64_t b = first; b < first + count; ++b) {
        g.earliest = now[b] < g.earliest ? now[b] : g.earliest;
        g.latest = now[b] > g.latest ? now[b] : g.latest;
    }
    return g;
}

template <typename Word, typename Held>
void scan_group(const Table& t, const Requests& r, const int32_t* truth, int64_t W, const Group& g, int64_t m,
                int64_t tasks, int threads, float* out_score, int64_t* out_slot, int64_t* counts) {
    const Held held(truth, W, g.first, g.count);
    const Word all = static_cast<Word>(g.count == 8 * int64_t(sizeof(Word)) ? ~Word(0) : (Word(1) << g.count) - 1);
    const int64_t* now = r.now + g.first;
    const int64_t per = (t.n + tasks - 1) / tasks;
    const MatchRun<Word, typename Held::View> match = match_run_for<Word, typename Held::View>(t.C);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; ++task) {
        // A decoded row per ad of a block (a multiple of 16 floats), with LANES floats past the dims (packed rows
        // may read them, and mask them out).
        const int64_t stride = (r.D + r.G + LANES + 15) / 16 * 16;
        std::vector<float> xs(BLOCK * stride);
        std::vector<int64_t> sizes(g.count, 0), eligible(g.count, 0);
        // A block's (ad, request) pairs, and those screened in, with their similarities.
        std::vector<int32_t> pair_ad(BLOCK * g.count), pair_request(BLOCK * g.count), kept(BLOCK * g.count);
        std::vector<float> sims(BLOCK * g.count * LANES);
        float* scores = out_score + (task * r.B + g.first) * m;
        int64_t* slots = out_slot + (task * r.B + g.first) * m;
        const int64_t first = task * per, last = (task + 1) * per < t.n ? (task + 1) * per : t.n;
        // AHEAD + 1 blocks in flight: the one scored, and the next AHEAD, matched and their matched rows prefetched.
        Word words[AHEAD + 1][BLOCK];
        int64_t matched[AHEAD + 1][BLOCK], n_matched[AHEAD + 1] = {};
        auto match_block = [&](int64_t block, int j) {
            const int64_t count = last - block < BLOCK ? last - block : BLOCK;
            match(t, held.view(), all, now, g.count, g.earliest, g.latest, block, count, words[j]);
            int64_t n = 0;
            for (int64_t k = 0; k < count; ++k) {  // the ads some request matched, without a branch on the data
                matched[j][n] = block + k;
                n += words[j][k] != 0;
            }
            for (int64_t k = 0; k < n; ++k) prefetch_row(t, matched[j][k], r.D + r.G, r.bias_col);
            n_matched[j] = n;
        };
        for (int a = 0; a < AHEAD; ++a) if (first + a * BLOCK < last) match_block(first + a * BLOCK, a);
        for (int64_t block = first, j = 0; block < last; block += BLOCK, j = (j + 1) % (AHEAD + 1)) {
            if (block + AHEAD * BLOCK < last) match_block(block + AHEAD * BLOCK, (j + AHEAD) % (AHEAD + 1));
            // The vector's bytes are read only for these ads, all the block's before any is scored: their loads
            // overlap (measured 5-13% faster at 2 threads than decoding each just before its scoring).
            float biases[BLOCK];
            for (int64_t k = 0; k < n_matched[j]; ++k)
                biases[k] = decode(t, matched[j][k], r.D + r.G, r.bias_col, xs.data() + k * stride);
            // Scored in three steps, so that no branch on one pair's outcome stands between its similarities and
            // the next pair's: the block's (ad, request) pairs; each pair's similarities, screened against the
            // request's heap as the block found it (its bar only rises: a pair screened in may still not enter, and
            // none that could is screened out); the mixtures of those screened in, offered to the heaps.
            int64_t n_pairs = 0, n_kept = 0;
            for (int64_t k = 0; k < n_matched[j]; ++k)
                for (Word word = words[j][matched[j][k] - block]; word; word &= static_cast<Word>(word - 1)) {
                    const int64_t b = __builtin_ctzll(static_cast<uint64_t>(word));
                    pair_ad[n_pairs] = static_cast<int32_t>(k);
                    pair_request[n_pairs++] = static_cast<int32_t>(b);
                    ++eligible[b];
                }
            for (int64_t p = 0; p < n_pairs; ++p) {
                const int64_t k = pair_ad[p], b = pair_request[p];
                const float bar = sizes[b] == m ? entry_bar(scores[b * m], biases[k])
                                                : -std::numeric_limits<float>::infinity();
                kept[n_kept] = static_cast<int32_t>(p);
                n_kept += screen(r, g.first + b, xs.data() + k * stride, bar, sims.data() + n_kept * LANES);
            }
            for (int64_t q = 0; q < n_kept; ++q) {
                const int64_t k = pair_ad[kept[q]], b = pair_request[kept[q]];
                float s = finish(r, g.first + b, xs.data() + k * stride, sims.data() + q * LANES) + biases[k];
                if (std::isnan(s)) s = -std::numeric_limits<float>::infinity();  // NaN ranks as -inf
                sizes[b] = push(scores + b * m, slots + b * m, sizes[b], m, s, matched[j][k]);
            }
        }
        for (int64_t b = 0; b < g.count; ++b) counts[task * r.B + g.first + b] = eligible[b];
    }
}

// Calls fn.template operator()<Word, Held>(group) for each group of up to 64 requests, with the narrowest word that
// holds a bit per request of the group (the transposed truth table then stays small: cache-resident), and for a
// group of one request a bit per ref (HeldBits).
template <typename Fn>
void for_each_group(const int64_t* now, int64_t B, Fn&& fn) {
    for (int64_t first = 0; first < B; first += 64) {
        const Group g = group_of(now, first, B - first < 64 ? B - first : 64);
        if (g.count == 1) fn.template operator()<uint8_t, HeldBits>(g);
        else if (g.count <= 8) fn.template operator()<uint8_t, HeldWords<uint8_t>>(g);
        else if (g.count <= 16) fn.template operator()<uint16_t, HeldWords<uint16_t>>(g);
        else if (g.count <= 32) fn.template operator()<uint32_t, HeldWords<uint32_t>>(g);
        else fn.template operator()<uint64_t, HeldWords<uint64_t>>(g);
    }
}

}  // namespace

namespace {

// The m best of the tasks' heaps (capacity h each) for request b into score, slot (m each): by score descending,
// then slot ascending, empty places (slot -1, score -inf) after every ad.
void merge_heaps(const float* heap_score, const int64_t* heap_slot, int64_t tasks, int64_t B, int64_t h, int64_t m,
                 int64_t b, float* score, int64_t* slot) {
    std::vector<int64_t> order;  // places in the (tasks, B, h) heaps that hold an ad
    for (int64_t task = 0; task < tasks; ++task)
        for (int64_t at = (task * B + b) * h; at < (task * B + b + 1) * h; ++at)
            if (heap_slot[at] >= 0) order.push_back(at);
    const int64_t kept = static_cast<int64_t>(order.size()) < m ? static_cast<int64_t>(order.size()) : m;
    std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&](int64_t x, int64_t y) {
        return better(heap_score[x], heap_slot[x], heap_score[y], heap_slot[y]);
    });
    for (int64_t k = 0; k < m; ++k) {
        score[k] = k < kept ? heap_score[order[k]] : -std::numeric_limits<float>::infinity();
        slot[k] = k < kept ? heap_slot[order[k]] : -1;
    }
}

}  // namespace

// S: the row stride of vectors (dims are contiguous). out_score, out_slot (B, m); counts (B,). The slots are cut
// into `tasks` ranges, each with a heap per request of min(m, its slots) places, merged at the end. Returns 0, or 1
// when memory for the heaps ran out (nothing written).
extern "C" int fused_scan(int64_t n, int64_t C, int64_t S, int64_t n_scales, const int8_t* status,
                          const int64_t* start, const int64_t* end, const int32_t* refs, const void* vectors,
                          int kind, const float* scales, int64_t B, int64_t W, int64_t E, int64_t D, int64_t G,
                          int64_t P, const int64_t* now, const int32_t* truth, const float* weights, const uint8_t* mask,
                          int64_t bias_col, int64_t top_n, int64_t m, int64_t tasks, int threads, float* out_score,
                          int64_t* out_slot, int64_t* counts) {
    const Table t{n, C, S, n_scales, status, start, end, refs, vectors, kind, scales};
    const int64_t stride = E == 1 && G == 0 ? D : ((D + P - 1) / P + (G + P - 1) / P) * LANES;
    const Requests r{B, E, D, G, P, bias_col, top_n < E ? top_n : E, now, weights, mask, stride};
    const int64_t per = (n + tasks - 1) / tasks, h = per < m ? per : m;  // a task keeps no more than it scans
    try {
        std::vector<float> heap_score(tasks * B * h, -std::numeric_limits<float>::infinity());
        std::vector<int64_t> heap_slot(tasks * B * h, -1), heap_counts(tasks * B, 0);
        for_each_group(now, B, [&]<typename Word, typename Held>(const Group& g) {
            scan_group<Word, Held>(t, r, truth, W, g, h, tasks, threads, heap_score.data(), heap_slot.data(), heap_counts.data());
        });
        for (int64_t b = 0; b < B; ++b) {
            merge_heaps(heap_score.data(), heap_slot.data(), tasks, B, h, m, b, out_score + b * m, out_slot + b * m);
            counts[b] = 0;
            for (int64_t task = 0; task < tasks; ++task) counts[b] += heap_counts[task * B + b];
        }
    } catch (const std::bad_alloc&) {
        return 1;
    }
    return 0;
}

// out (B, n) bytes, 1 where request b may be served slot i.
extern "C" void clause_match(int64_t n, int64_t C, const int8_t* status, const int64_t* start, const int64_t* end,
                             const int32_t* refs, int64_t B, int64_t W, const int64_t* now, const int32_t* truth,
                             int threads, uint8_t* out) {
    const Table t{n, C, 0, 0, status, start, end, refs, nullptr, F32, nullptr};
    for_each_group(now, B, [&]<typename Word, typename Held>(const Group& g) {
        const Held held(truth, W, g.first, g.count);
        const Word all = static_cast<Word>(g.count == 8 * int64_t(sizeof(Word)) ? ~Word(0) : (Word(1) << g.count) - 1);
        const MatchRun<Word, typename Held::View> match = match_run_for<Word, typename Held::View>(C);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t block = 0; block < n; block += BLOCK) {
            Word words[BLOCK];
            const int64_t size = n - block < BLOCK ? n - block : BLOCK;
            match(t, held.view(), all, now + g.first, g.count, g.earliest, g.latest, block, size, words);
            for (int64_t b = 0; b < g.count; ++b)
                for (int64_t k = 0; k < size; ++k) out[(g.first + b) * n + block + k] = (words[k] >> b) & 1;
        }
    });
}
