/* The exact tail's low-bit screen on a CPU (tail_lowbit.py builds, loads and documents it).

   For every dropped row n and position m it writes
       est[m][n]   = sum_g s[n][g] t[m][g] (sum_{j in g} u[n][j] x[m][j] - corr[m][g])
       bound[m][n] = sum_g s[n][g] beta[m][g]                      (only where bound is not NULL)
       pass[m][n]  = est[m][n] + bound[m][n] >= thr[m]
   with u = q + L (q in -L..L, L = 7 for 4 bits, 15 for 5), s the row's group scale (fp16), x the position's int8
   activations (one scale t per group of 32), corr[m][g] = L sum_{j in g} x[m][j]. Integer sums are exact (at most
   32 * 30 * 127 per group); the caller's beta carries the float rounding of the rest.

   Layout (tail_lowbit.py packs it): rows in blocks of 16, a block's groups of 32 columns one after another. A group
   is 4 pairs; a pair is 64 bytes whose byte 4r+e holds the low 4 bits of u[row r][8p+e] in its low nibble and of
   u[row r][8p+4+e] in its high one, then (5 bits only) two 64-bit masks: bit i of the first is the fifth bit of the
   value in byte i's low nibble, of the second of the one in its high nibble. The scales of a block's group are 16
   fp16 values (rows 0..15). */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LAB_ISA 2
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LAB_ISA 1
#include <immintrin.h>
#else
#define LAB_ISA 0
#endif

#define MAXM 8

int lab_lowbit_isa(void) { return LAB_ISA; }

/* Where the outputs go: est/bound/pass as [M][N] arrays (any may be NULL); out, when not NULL, the served logits
   [M][ld] (bf16 where out_bf16, else float32), each row's estimate written at its id; pairs, when not NULL, every
   (position, row) that passes with its estimate, up to max_pairs (n_pairs counts them all, so a caller sees an
   overflow). */
typedef struct {
    float *est, *bound;
    uint8_t *pass;
    void *out;
    int out_bf16;
    const int64_t *ids;
    long ld;
    int32_t *pairs;
    float *pair_est;
    long max_pairs;
    long *n_pairs;
} lab_outputs;

static inline uint16_t to_bf16(float f) {  /* round to nearest even (no NaN here: sums of finite products) */
    uint32_t b;
    memcpy(&b, &f, 4);
    b += 0x7FFF + ((b >> 16) & 1);
    return (uint16_t)(b >> 16);
}

/* the outputs of rows row0.. (count of them, at most 16) at position m */
static inline void write_rows(const lab_outputs *o, int m, long N, long row0, int count, const float *e,
                              const float *b, float thr) {
    for (int r = 0; r < count; r++) {
        long n = row0 + r;
        int ok = e[r] + b[r] >= thr;
        if (o->est) o->est[m * N + n] = e[r];
        if (o->bound) o->bound[m * N + n] = b[r];
        if (o->pass) o->pass[m * N + n] = (uint8_t)ok;
        if (o->out) {
            if (o->out_bf16) ((uint16_t *)o->out)[m * o->ld + o->ids[n]] = to_bf16(e[r]);
            else ((float *)o->out)[m * o->ld + o->ids[n]] = e[r];
        }
        if (ok && o->pairs) {
            long i = __atomic_fetch_add(o->n_pairs, 1, __ATOMIC_RELAXED);
            if (i < o->max_pairs) {
                o->pairs[2 * i] = m;
                o->pairs[2 * i + 1] = (int32_t)n;
                o->pair_est[i] = e[r];
            }
        }
    }
}

#if LAB_ISA == 2
/* acc += w (u8) . x broadcast (4 s8 values): the broadcast folded into the instruction, which gcc does not do */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t(*)[1])x));
    return acc;
}

static inline __attribute__((always_inline)) void block16(
    const uint8_t *w, const uint16_t *sc, int G, const int8_t *x, int K, const float *t, const int32_t *corr,
    const float *beta, const float *thr, const lab_outputs *o, long N, long row0, const int M, const int five) {
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    const int pair = five ? 80 : 64;
    __m512 facc[MAXM], bacc[MAXM];
    for (int m = 0; m < M; m++) { facc[m] = _mm512_setzero_ps(); bacc[m] = _mm512_setzero_ps(); }
    for (int g = 0; g < G; g++) {
        __m512i iacc[MAXM];
        for (int m = 0; m < M; m++) iacc[m] = _mm512_setzero_si512();
        const uint8_t *wg = w + (long)g * 4 * pair;
        for (int p = 0; p < 4; p++) {
            const uint8_t *wp = wg + p * pair;
            __m512i v = _mm512_loadu_si512((const void *)wp);
            __m512i lo = _mm512_and_si512(v, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if (five) {
                uint64_t k0, k1;
                memcpy(&k0, wp + 64, 8);
                memcpy(&k1, wp + 72, 8);
                lo = _mm512_mask_add_epi8(lo, (__mmask64)k0, lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, (__mmask64)k1, hi, sixteen);
            }
            for (int m = 0; m < M; m++) {
                const int8_t *xm = x + (long)m * K + g * 32 + p * 8;
                iacc[m] = dpbusd_bcast(dpbusd_bcast(iacc[m], lo, xm), hi, xm + 4);
            }
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + g * 16)));
        for (int m = 0; m < M; m++) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[m], _mm512_set1_epi32(corr[m * G + g])));
            facc[m] = _mm512_fmadd_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(t[m * G + g])), facc[m]);
            bacc[m] = _mm512_fmadd_ps(s, _mm512_set1_ps(beta[m * G + g]), bacc[m]);
        }
    }
    long left = N - row0;
    int count = left >= 16 ? 16 : (int)left;
    __mmask16 k = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
    for (int m = 0; m < M; m++) {
        __mmask16 ok = _mm512_cmp_ps_mask(_mm512_add_ps(facc[m], bacc[m]), _mm512_set1_ps(thr[m]), _CMP_GE_OQ) & k;
        if (o->out || (ok && o->pairs)) {  /* scattered writes, or a row passing: one row at a time */
            float e[16], b[16];
            _mm512_storeu_ps(e, facc[m]);
            _mm512_storeu_ps(b, bacc[m]);
            lab_outputs rest = *o;
            rest.est = NULL; rest.bound = NULL; rest.pass = NULL;
            write_rows(&rest, m, N, row0, count, e, b, thr[m]);
        }
        if (o->est) _mm512_mask_storeu_ps(o->est + m * N + row0, k, facc[m]);
        if (o->bound) _mm512_mask_storeu_ps(o->bound + m * N + row0, k, bacc[m]);
        if (o->pass) _mm_mask_storeu_epi8(o->pass + m * N + row0, k, _mm_maskz_set1_epi8(ok, 1));
    }
}
#elif LAB_ISA == 1
/* 32 mask bits to 32 bytes of 16 (bit i -> byte i) */
static inline __m256i bits_to_16(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    b = _mm256_cmpeq_epi8(_mm256_and_si256(b, select), select);
    return _mm256_and_si256(b, _mm256_set1_epi8(16));
}

/* AVX2: u (0..30) times x (-127..127) in pairs fits a 16-bit lane (at most 7620), so vpmaddubsw cannot saturate. */
static inline __attribute__((always_inline)) void half8(
    const uint8_t *w, const uint16_t *sc, int G, const int8_t *x, int K, const float *t, const int32_t *corr,
    const float *beta, const float *thr, const lab_outputs *o, long N, long row0, int half, const int M,
    const int five) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const int pair = five ? 80 : 64;
    __m256 facc[MAXM], bacc[MAXM];
    for (int m = 0; m < M; m++) { facc[m] = _mm256_setzero_ps(); bacc[m] = _mm256_setzero_ps(); }
    for (int g = 0; g < G; g++) {
        __m256i iacc[MAXM];
        for (int m = 0; m < M; m++) iacc[m] = _mm256_setzero_si256();
        const uint8_t *wg = w + (long)g * 4 * pair;
        for (int p = 0; p < 4; p++) {
            const uint8_t *wp = wg + p * pair;
            __m256i v = _mm256_loadu_si256((const __m256i *)(wp + half * 32));
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five) {
                uint32_t k0, k1;
                memcpy(&k0, wp + 64 + half * 4, 4);
                memcpy(&k1, wp + 72 + half * 4, 4);
                lo = _mm256_or_si256(lo, bits_to_16(k0));
                hi = _mm256_or_si256(hi, bits_to_16(k1));
            }
            for (int m = 0; m < M; m++) {
                const int8_t *xm = x + (long)m * K + g * 32 + p * 8;
                int32_t a0, a1;
                memcpy(&a0, xm, 4);
                memcpy(&a1, xm + 4, 4);
                __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0)), ones);
                __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1)), ones);
                iacc[m] = _mm256_add_epi32(iacc[m], _mm256_add_epi32(p0, p1));
            }
        }
        __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * 16 + half * 8)));
        for (int m = 0; m < M; m++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[m], _mm256_set1_epi32(corr[m * G + g])));
            facc[m] = _mm256_fmadd_ps(v, _mm256_mul_ps(s, _mm256_set1_ps(t[m * G + g])), facc[m]);
            bacc[m] = _mm256_fmadd_ps(s, _mm256_set1_ps(beta[m * G + g]), bacc[m]);
        }
    }
    long r0 = row0 + half * 8;
    int count = N - r0 >= 8 ? 8 : (int)(N - r0);
    for (int m = 0; m < M; m++) {
        float e[8], b[8];
        _mm256_storeu_ps(e, facc[m]);
        _mm256_storeu_ps(b, bacc[m]);
        write_rows(o, m, N, r0, count, e, b, thr[m]);
    }
}

static inline __attribute__((always_inline)) void block16(
    const uint8_t *w, const uint16_t *sc, int G, const int8_t *x, int K, const float *t, const int32_t *corr,
    const float *beta, const float *thr, const lab_outputs *o, long N, long row0, const int M, const int five) {
    half8(w, sc, G, x, K, t, corr, beta, thr, o, N, row0, 0, M, five);
    if (row0 + 8 < N) half8(w, sc, G, x, K, t, corr, beta, thr, o, N, row0, 1, M, five);
}
#else
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7F800000u | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void block16(const uint8_t *w, const uint16_t *sc, int G, const int8_t *x, int K, const float *t,
                    const int32_t *corr, const float *beta, const float *thr, const lab_outputs *o, long N,
                    long row0, const int M, const int five) {
    const int pair = five ? 80 : 64;
    for (int r = 0; r < 16 && row0 + r < N; r++) {
        for (int m = 0; m < M; m++) {
            float f = 0.0f, b = 0.0f;
            for (int g = 0; g < G; g++) {
                int32_t acc = 0;
                for (int p = 0; p < 4; p++)
                    for (int e = 0; e < 4; e++) {
                        const uint8_t *wp = w + (long)g * 4 * pair + p * pair;
                        int i = r * 4 + e;
                        int u0 = wp[i] & 0x0F, u1 = wp[i] >> 4;
                        if (five) {
                            u0 |= ((wp[64 + i / 8] >> (i % 8)) & 1) << 4;
                            u1 |= ((wp[72 + i / 8] >> (i % 8)) & 1) << 4;
                        }
                        acc += u0 * x[(long)m * K + g * 32 + p * 8 + e];
                        acc += u1 * x[(long)m * K + g * 32 + p * 8 + 4 + e];
                    }
                float s = half_to_float(sc[g * 16 + r]);
                f += (float)(acc - corr[m * G + g]) * (s * t[m * G + g]);
                b += s * beta[m * G + g];
            }
            write_rows(o, m, N, row0 + r, 1, &f, &b, thr[m]);
        }
    }
}
#endif

/* M positions (1..8) against N rows of K values (K a multiple of 32), 4 or 5 bits a value; w and sc as packed, the
   rest row-major; the outputs as lab_outputs says. */
int lab_lowbit_screen(const uint8_t *w, const uint16_t *sc, long N, int K, int bits, const int8_t *x, const float *t,
                      const int32_t *corr, const float *beta, const float *thr, int M, float *est, float *bound,
                      uint8_t *pass, void *out, int out_bf16, const int64_t *ids, long ld, int32_t *pairs,
                      float *pair_est, long max_pairs, long *n_pairs) {
    if (M < 1 || M > MAXM || K % 32 || (bits != 4 && bits != 5) || (out && !ids) || (pairs && !n_pairs)) return 1;
    const lab_outputs o = {est, bound, pass, out, out_bf16, ids, ld, pairs, pair_est, max_pairs, n_pairs};
    const int G = K / 32, five = bits == 5;
    const long blocks = (N + 15) / 16, wstride = (long)G * 4 * (five ? 80 : 64);
    if (n_pairs) *n_pairs = 0;
#pragma omp parallel for schedule(static)
    for (long b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * wstride;
        const uint16_t *sb = sc + b * (long)G * 16;
        switch (M * 2 + five) {
#define LAB_CASE(n) \
    case 2 * n: block16(wb, sb, G, x, K, t, corr, beta, thr, &o, N, b * 16, n, 0); break; \
    case 2 * n + 1: block16(wb, sb, G, x, K, t, corr, beta, thr, &o, N, b * 16, n, 1); break;
            LAB_CASE(1) LAB_CASE(2) LAB_CASE(3) LAB_CASE(4) LAB_CASE(5) LAB_CASE(6) LAB_CASE(7) LAB_CASE(8)
#undef LAB_CASE
        }
    }
    return 0;
}
