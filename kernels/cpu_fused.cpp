// The fused pass on the CPU: same inputs and result as kernels/reference/fused.py (see kernels/cpu.py,
// which compiles this file once per machine and calls it through ctypes).
//
// The slots are cut into `tasks` ranges run on OpenMP threads. A task walks its range in blocks of 64 ads:
// it tests each ad's status, window and refs against every request of the batch without branching on the
// data (a 64-bit mask per request), then visits only the ads some request matched: it decodes the ad's
// vector once (int8 with block scales, fp16 or fp32; AVX-512 where the CPU has it) and scores it for
// each request that matched: the gating logits of all experts at once (one SIMD lane each), the top-n,
// their softmax, and the similarities of the chosen experts alone. Each task keeps a bounded heap of its m best (score, slot) per
// request; kernels/cpu.py merges the tasks' heaps. Nothing of the table's size is allocated.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

constexpr int64_t LANES = 16;  // experts per request at most: one SIMD register of gating logits

struct Requests {
    int64_t B, W, E, D, G, bias_col, top_n;
    const int64_t* now;
    const int32_t* truth;
    const float* experts;  // (B, E, D)
    const float* keys_t;   // (B, G, LANES): keys transposed, zero past E
    const uint8_t* mask;   // (B, LANES): usable experts, zero past E
};

// Whether request b may be served ad i; no branch on the data (the outcomes are unpredictable).
inline uint64_t matches(const Table& t, const Requests& r, int64_t i, int64_t b) {
    const int64_t now = r.now[b];
    uint64_t ok = ((t.status[i] & SERVABLE) == SERVABLE) & (t.start[i] <= now) & (now < t.end[i]);
    const int32_t* row = t.refs + i * t.C;
    const int32_t* words = r.truth + b * r.W;
    for (int64_t c = 0; c < t.C; ++c) {  // padding (clause 0, negated) holds for everyone
        const int32_t ref = row[c], clause = ref >> 1;
        ok &= ((static_cast<uint32_t>(words[clause >> 5]) >> (clause & 31)) ^ static_cast<uint32_t>(ref)) & 1u;
    }
    return ok;
}

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
#endif
        for (int64_t d = first; d < width; ++d) x[d] = half_to_float(v[d]);
        return bias_col >= 0 ? half_to_float(v[bias_col]) : 0.0f;
    }
    const float* v = static_cast<const float*>(t.vectors) + i * t.S;
    std::memcpy(x, v, width * sizeof(float));
    return bias_col >= 0 ? v[bias_col] : 0.0f;
}

inline float dot(const float* a, const float* b, int64_t n) {
    float acc = 0.0f;
    int64_t d = 0;
#if defined(__AVX512F__)
    __m512 lanes = _mm512_setzero_ps();
    for (; d + 16 <= n; d += 16) lanes = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), lanes);
    acc = _mm512_reduce_add_ps(lanes);
#endif
    for (; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

// The top_n usable experts by gating logit, best first (of equal logits, the lower expert), into picked and
// picked_logit; returns how many (fewer when fewer are usable). keys_t (G, LANES), q (G,), usable (LANES,).
inline int64_t top_experts(const float* keys_t, const float* q, int64_t G, const uint8_t* usable, int64_t top_n,
                           int64_t* picked, float* picked_logit) {
    constexpr float NONE = -std::numeric_limits<float>::infinity();
    int64_t n = 0;
#if defined(__AVX512F__)
    __m512 logits = _mm512_setzero_ps();  // every expert's logit at once, one lane each
    for (int64_t g = 0; g < G; ++g) logits = _mm512_fmadd_ps(_mm512_set1_ps(q[g]), _mm512_loadu_ps(keys_t + g * LANES), logits);
    const __mmask16 ok = _mm_cmpneq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(usable)), _mm_setzero_si128());
    logits = _mm512_mask_blend_ps(ok, _mm512_set1_ps(NONE), logits);
    for (; n < top_n; ++n) {  // no branch on the data: lane maximum, then its lowest lane
        const float best = _mm512_reduce_max_ps(logits);
        if (best == NONE) break;
        const int at = __builtin_ctz(_mm512_cmp_ps_mask(logits, _mm512_set1_ps(best), _CMP_EQ_OQ));
        picked[n] = at;
        picked_logit[n] = best;
        logits = _mm512_mask_mov_ps(logits, static_cast<__mmask16>(1u << at), _mm512_set1_ps(NONE));
    }
#else
    float logits[LANES];
    for (int64_t e = 0; e < LANES; ++e) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) acc += q[g] * keys_t[g * LANES + e];
        logits[e] = usable[e] ? acc : NONE;
    }
    for (; n < top_n; ++n) {
        int64_t at = 0;
        for (int64_t e = 1; e < LANES; ++e) at = logits[e] > logits[at] ? e : at;
        if (logits[at] == NONE) break;
        picked[n] = at;
        picked_logit[n] = logits[at];
        logits[at] = NONE;
    }
#endif
    return n;
}

// The mixture-of-logits score of the decoded ad x for request b (without its bias).
inline float gated(const Requests& r, int64_t b, const float* x, int64_t* picked, float* picked_logit) {
    const float* keys_t = r.keys_t + b * r.G * LANES;
    const float* experts = r.experts + b * r.E * r.D;
    const uint8_t* mask = r.mask + b * LANES;
    if (r.E == 1) return mask[0] ? dot(experts, x, r.D) : 0.0f;  // a dot-product head: no gating
    const int64_t n = top_experts(keys_t, x + r.D, r.G, mask, r.top_n, picked, picked_logit);
    if (n == 0) return 0.0f;
    float total = 1.0f, score = dot(experts + picked[0] * r.D, x, r.D);
    for (int64_t j = 1; j < n; ++j) {
        const float weight = std::exp(picked_logit[j] - picked_logit[0]);
        total += weight;
        score += weight * dot(experts + picked[j] * r.D, x, r.D);
    }
    return score / total;
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

// S: the row stride of vectors (dims are contiguous).
extern "C" void fused_scan(int64_t n, int64_t C, int64_t S, int64_t n_scales, const int8_t* status,
                           const int64_t* start, const int64_t* end, const int32_t* refs, const void* vectors,
                           int kind, const float* scales, int64_t B, int64_t W, int64_t E, int64_t D, int64_t G,
                           const int64_t* now, const int32_t* truth, const float* experts, const float* keys_t,
                           const uint8_t* mask, int64_t bias_col, int64_t top_n, int64_t m, int64_t tasks,
                           int threads, float* out_score, int64_t* out_slot, int64_t* counts) {
    const Table t{n, C, S, n_scales, status, start, end, refs, vectors, kind, scales};
    const Requests r{B, W, E, D, G, bias_col, top_n < E ? top_n : E, now, truth, experts, keys_t, mask};
    const int64_t per = (n + tasks - 1) / tasks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; ++task) {
        std::vector<float> x(D + G + 1), picked_logit(E + 1);
        std::vector<int64_t> picked(E + 1), sizes(B, 0), eligible(B, 0);
        std::vector<uint64_t> ok(B);  // per request, a bit per ad of the block
        float* scores = out_score + task * B * m;
        int64_t* slots = out_slot + task * B * m;
        const int64_t last = (task + 1) * per < n ? (task + 1) * per : n;
        for (int64_t block = task * per; block < last; block += 64) {
            const int64_t count = last - block < 64 ? last - block : 64;
            uint64_t some = 0;
            for (int64_t b = 0; b < B; ++b) {
                uint64_t bits = 0;
                for (int64_t k = 0; k < count; ++k) bits |= matches(t, r, block + k, b) << k;
                ok[b] = bits;
                some |= bits;
                eligible[b] += __builtin_popcountll(bits);
            }
            for (; some; some &= some - 1) {  // the vector's bytes are read only for an ad some request matches
                const int k = __builtin_ctzll(some);
                const int64_t i = block + k;
                const float bias = decode(t, i, D + G, bias_col, x.data());
                for (int64_t b = 0; b < B; ++b) {
                    if (!((ok[b] >> k) & 1u)) continue;
                    float s = gated(r, b, x.data(), picked.data(), picked_logit.data()) + bias;
                    if (std::isnan(s)) s = -std::numeric_limits<float>::infinity();  // NaN ranks as -inf
                    sizes[b] = push(scores + b * m, slots + b * m, sizes[b], m, s, i);
                }
            }
        }
        for (int64_t b = 0; b < B; ++b) counts[task * B + b] = eligible[b];
    }
}

extern "C" void clause_match(int64_t n, int64_t C, const int8_t* status, const int64_t* start, const int64_t* end,
                             const int32_t* refs, int64_t B, int64_t W, const int64_t* now, const int32_t* truth,
                             int threads, uint8_t* out) {
    const Table t{n, C, 0, 0, status, start, end, refs, nullptr, F32, nullptr};
    const Requests r{B, W, 0, 0, 0, -1, 0, now, truth, nullptr, nullptr, nullptr};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < B; ++b) out[b * n + i] = matches(t, r, i, b);
}
