/* The per-row scalars of the calibration spec (steps 7-9 of
 * attncal.calibration.oracle: isolated shares, budget rescale, normalisation),
 * in double, shared by the CPU kernels (cpu/row_calibration.h) and the CUDA kernels
 * (cuda/calibration_kernels.cuh, cuda/attention_*.cuh, where it is a __host__ __device__
 * function).
 *
 * Divides by `total` rather than multiplying by its reciprocal: a subnormal
 * fixed weight makes total subnormal and 1/total overflow. */
#ifndef ATTNCAL_ROW_SCALARS_H_
#define ATTNCAL_ROW_SCALARS_H_

#include "common/attncal_params.h"
#include "common/host_device.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct AttncalRowScalars {
  double coef;      /* content key k of basket b: z_k * (coef / (A_b * t) + keep); keep for an empty basket */
  double keep;      /* 1 - lambda */
  double first_out; /* the isolated first key's output (when isolate_first) */
  double last_out;  /* the isolated last key's output (when isolate_last) */
} AttncalRowScalars;

/* t = content baskets + isolated keys; nonempty = baskets of nonzero mass; z_first, z_last = the
 * row's (masked) probabilities at the first and last valid keys. */
static inline ATTNCAL_HD AttncalRowScalars attncal_row_scalars(const AttncalParams* p, int64_t nonempty, double t,
                                                              double z_first, double z_last) {
  const double inv_t = 1.0 / t;
  double fs = 0.0, ls = 0.0;
  if (p->isolate_first) {
    fs = p->first_mode == ATTNCAL_MODE_EQUAL ? inv_t
         : p->first_mode == ATTNCAL_MODE_ORIGINAL ? z_first : (double)p->first_weight;
  }
  if (p->isolate_last) {
    ls = p->last_mode == ATTNCAL_MODE_EQUAL ? inv_t
         : p->last_mode == ATTNCAL_MODE_ORIGINAL ? z_last : (double)p->last_weight;
  }
  const int non_equal = (p->isolate_first && p->first_mode != ATTNCAL_MODE_EQUAL) ||
                        (p->isolate_last && p->last_mode != ATTNCAL_MODE_EQUAL);
  double content_mass = (double)nonempty * inv_t;
  double scale = 1.0;
  if (non_equal && content_mass != 0.0) {
    const double budget = 1.0 - (fs + ls) > 0.0 ? 1.0 - (fs + ls) : 0.0;
    scale = budget / content_mass;
    content_mass = budget;
  }
  double total = content_mass + fs + ls;
  if (total == 0.0) total = 1.0; /* a zero total skips normalisation */
  const double lam = p->strength;
  AttncalRowScalars r;
  r.keep = 1.0 - lam;
  r.coef = scale / total * lam;
  r.first_out = lam * (fs / total) + r.keep * z_first;
  r.last_out = lam * (ls / total) + r.keep * z_last;
  return r;
}

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_ROW_SCALARS_H_ */
