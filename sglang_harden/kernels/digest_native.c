/* Native CPU path of the per-KV-head digest (definition: digest_spec.py). Built on first use by
 * digest_native.py with the system C compiler and called through ctypes, which releases the GIL, so
 * callers split the layer halves over threads. Bit-identical to digest_ref.py. */
#include <stdint.h>

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* r = sum_w sext64(x_w) * M[w] mod 2^64, computed as A + (B << 32) so that it vectorises without 64-bit
 * multiplies: with x_w = u_w - neg_w * 2^32 (u_w the unsigned bits, neg_w its sign bit) and
 * M[w] = lo_w + hi_w * 2^32, the product mod 2^64 is u_w * lo_w + ((u_w * hi_w - neg_w * lo_w) << 32),
 * and only the low 32 bits of the second term survive the shift. */
static inline uint64_t row_hash(const int32_t *x, const uint32_t *mult_lo, const uint32_t *mult_hi,
                                int64_t words) {
    uint64_t a = 0;
    uint32_t b = 0;
    for (int64_t w = 0; w < words; w++) {
        uint32_t u = (uint32_t)x[w];
        uint32_t neg_lo = (uint32_t)(x[w] >> 31) & mult_lo[w];
        a += (uint64_t)u * mult_lo[w];
        b += u * mult_hi[w] - neg_lo;
    }
    return a + ((uint64_t)b << 32);
}

/* Scattered slots (page size 1) defeat the hardware prefetcher: ask for a later token's rows early. */
#define PREFETCH_AHEAD 8
#define CACHE_LINE_WORDS 16

static inline void prefetch_slot(const int32_t *slot_row, int64_t heads, int64_t stride_head, int64_t words) {
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t w = 0; w < words; w += CACHE_LINE_WORDS) {
            __builtin_prefetch(slot_row + h * stride_head + w, 0, 3);
        }
    }
}

/* Adds, for layer halves [first_lh, first_lh + n_halves), every row's mix64(r + key) into sums[head].
 * bases[i] is layer half first_lh + i as int32 words laid out [slot][head][word] with the given strides
 * (in words). Row j reads pool slot slots[j] and holds token order[j] of the send (absolute position
 * start_token + order[j]); the head sums do not depend on the order rows are visited in, so callers pass
 * the slots sorted by address (order says where each came from), which keeps scattered page-size-1 sends
 * close to sequential for the prefetcher and the TLB. order == NULL means order[j] = j.
 * mult_lo / mult_hi are the low and high 32 bits of the row multipliers M[w]. */
void sgh_digest_sums(const int32_t *const *bases, int64_t first_lh, int64_t n_halves, const int64_t *slots,
                     const int64_t *order, int64_t n_tokens, int64_t start_token, int64_t heads, int64_t words,
                     int64_t stride_slot, int64_t stride_head, const uint32_t *mult_lo, const uint32_t *mult_hi,
                     uint64_t key_salt, int64_t shift, uint64_t *sums) {
    for (int64_t i = 0; i < n_halves; i++) {
        const int32_t *base = bases[i];
        uint64_t lh_bits = (uint64_t)(first_lh + i) << shift;
        for (int64_t j = 0; j < n_tokens; j++) {
            if (j + PREFETCH_AHEAD < n_tokens) {
                prefetch_slot(base + slots[j + PREFETCH_AHEAD] * stride_slot, heads, stride_head, words);
            }
            int64_t t = order ? order[j] : j;
            uint64_t key = mix64(key_salt ^ lh_bits ^ (uint64_t)(start_token + t));
            const int32_t *slot_row = base + slots[j] * stride_slot;
            for (int64_t h = 0; h < heads; h++) {
                sums[h] += mix64(row_hash(slot_row + h * stride_head, mult_lo, mult_hi, words) + key);
            }
        }
    }
}
