/*
 * The kernels' entry points, as C callers see them: the fused decoder layers (decoder_layers.c) and the test
 * driver (tests/csrc/kernel_driver.c) include this, and each kernel's own file too, so the compiler holds the
 * definitions to these declarations. Python binds the same functions through ctypes (toolkit/native/library.py's
 * SIGNATURES).
 */
#ifndef TOOLKIT_KERNELS_H
#define TOOLKIT_KERNELS_H

#include <stdint.h>

int toolkit_matmul_invariant_f32(const float *, int64_t, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                                 int, int);
int toolkit_matmul_schedules(void);
void toolkit_matmul_layout(int64_t *);
int toolkit_matmul_invariant_h16(const float *, int64_t, const uint16_t *, float *, int64_t, int64_t, int64_t,
                                 int64_t, int, int, int);
int toolkit_paged_attention_h16(const float *, int64_t, const uint16_t *, const uint16_t *, const int64_t *, int64_t,
                                const int64_t *, const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                float, int, int);
int toolkit_round_h16(float *, int64_t, int, int);
void toolkit_kernel_profile(int64_t *);
int toolkit_paged_attention_f32(const float *, int64_t, const float *, const float *, const int64_t *, int64_t,
                                const int64_t *, const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                float, int);
int toolkit_paged_attention_q8(const float *, int64_t, const uint8_t *, const uint8_t *, const int64_t *, int64_t,
                               const int64_t *, const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                               float, int, const float *, const float *, int64_t, const float *);
int toolkit_rope_f32(const float *, int64_t, float *, const float *, const float *, int64_t, const int64_t *, int64_t,
                     int64_t, int64_t, int);
int toolkit_add_rms_norm_f32(float *, int64_t, const float *, int64_t, const float *, float, float *, int64_t, int64_t,
                             int64_t, int);
int toolkit_silu_mul_f32(const float *, int64_t, float *, int64_t, int64_t, int64_t, int);
int toolkit_logsumexp_f32(const float *, int64_t, int64_t, int64_t, float *, int);
int toolkit_argmax_f32(const float *, int64_t, int64_t, int64_t, int64_t *, int);
int toolkit_sha256_rows(const uint8_t *, const int64_t *, int64_t, int64_t, uint8_t *, int);
int toolkit_gumbel_sample_rows(const float *, int64_t, int64_t, int64_t, const uint32_t *, const int8_t *, int64_t *,
                               double *, int64_t *, int);
int toolkit_gumbel_noise(const int32_t *, int64_t, uint32_t, uint32_t, double *);
int toolkit_truncate_f32(const float *, int64_t, int64_t, int64_t, int, const float *, float *, int64_t, float *, int);
int toolkit_sample_tail_rows(const float *, int64_t, int64_t, int64_t, const int32_t *, const float *,
                             const int64_t *, const int32_t *, const float *, const uint32_t *, const int8_t *,
                             float *, int64_t, float *, float *, int64_t *, double *, int64_t *, float *, uint8_t *,
                             int64_t, int);
int toolkit_paged_attention_supports(int64_t, int64_t, int64_t, int64_t, int);
int toolkit_decoder_layers(const int64_t *, int64_t, const int64_t *, float *, const int64_t *, const int64_t *,
                           const int64_t *, const float *, const float *, const int64_t *, const int64_t *,
                           const int64_t *, float, float, int, int, int, const void *, const void *);

#endif
