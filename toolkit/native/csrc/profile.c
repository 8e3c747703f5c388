/*
 * What this build of the kernels is: the numbers its bits depend on (simd.h) and how it runs.
 */
#include <stdint.h>

#include "simd.h"
#include "kernels.h" /* the entry points this file defines, declared once */

/* out = {lanes (VL), fused multiply-add (0 / 1), vector registers assumed, OpenMP threads (0 / 1)} */
void toolkit_kernel_profile(int64_t *out) {
    out[0] = VL;
    out[1] = TOOLKIT_FMA;
    out[2] = TOOLKIT_VREGS;
#ifdef _OPENMP
    out[3] = 1;
#else
    out[3] = 0;
#endif
}
