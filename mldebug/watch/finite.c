/* The watch's NaN/Inf check of a CPU tensor without a torch op (watch/native_check.py).
 *
 * A floating value is NaN or +-Inf exactly when all its exponent bits are set, so the
 * check is a bit test on each value read as an unsigned integer of its width: exact for
 * every value (a sum, the torch path, can overflow to Inf on finite values and then has
 * to be counted again), one pass, no temporary, nothing written. The tensor is read in
 * blocks, and the first block with a non-finite value ends the scan.
 *
 * mld_nonfinite_{f64,f32,f16,bf16}(p, n): 1 when one of the N values at P is NaN or
 * +-Inf, else 0. P points to N contiguous values (the caller checks that).
 */
#include <stdint.h>

#define BLOCK 4096

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(MLD_NO_CLONES)
#define MLD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MLD_CLONES
#endif

#define NONFINITE(NAME, UINT, MASK)                                            \
    MLD_CLONES int NAME(const UINT *p, int64_t n) {                            \
        for (int64_t start = 0; start < n; start += BLOCK) {                   \
            int64_t end = start + BLOCK < n ? start + BLOCK : n;               \
            UINT bad = 0;                                                      \
            for (int64_t i = start; i < end; i++)                              \
                bad |= (UINT)((p[i] & (UINT)(MASK)) == (UINT)(MASK));          \
            if (bad)                                                           \
                return 1;                                                      \
        }                                                                      \
        return 0;                                                              \
    }

NONFINITE(mld_nonfinite_f64, uint64_t, 0x7ff0000000000000ULL)
NONFINITE(mld_nonfinite_f32, uint32_t, 0x7f800000U)
NONFINITE(mld_nonfinite_f16, uint16_t, 0x7c00U)
NONFINITE(mld_nonfinite_bf16, uint16_t, 0x7f80U)
