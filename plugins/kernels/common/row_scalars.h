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
  double t;         /* the row's t: the item's, plus 1 where its own key left its basket (ATTNCAL_OWN_CONTENT) */
  double first_out; /* the isolated first key's output (when isolate_first) */
  double last_out;  /* the isolated last key's output (when isolate_last) */
  double own_out;   /* the row's own key's output (when isolate_self; written last, over first_out or last_out) */
} AttncalRowScalars;

static inline ATTNCAL_HD double attncal_share(int mode, double inv_t, double z, float weight) {
  return mode == ATTNCAL_MODE_EQUAL ? inv_t : mode == ATTNCAL_MODE_ORIGINAL ? z : (double)weight;
}

/* t_item = the item's content baskets + isolated keys; nonempty = baskets of nonzero mass (the own key's basket
 * summed without it); z_first, z_last, z_own = the row's (masked) probabilities at the first and last valid keys
 * and at its own key; own = where the own key sits (ATTNCAL_OWN_*, common/span_geometry.h: own_key). */
static inline ATTNCAL_HD AttncalRowScalars attncal_row_scalars(const AttncalParams* p, int64_t nonempty, double t_item,
                                                              double z_first, double z_last, int own, double z_own) {
  const double t = t_item + (own == ATTNCAL_OWN_CONTENT ? 1.0 : 0.0);
  const double inv_t = 1.0 / t;
  /* The own key takes the self share, in place of the first or last key's where it is that key. */
  const int first_on = p->isolate_first && own != ATTNCAL_OWN_FIRST;
  const int last_on = p->isolate_last && own != ATTNCAL_OWN_LAST;
  const int own_on = own != ATTNCAL_OWN_NONE;
  const double fs = first_on ? attncal_share(p->first_mode, inv_t, z_first, p->first_weight) : 0.0;
  const double ls = last_on ? attncal_share(p->last_mode, inv_t, z_last, p->last_weight) : 0.0;
  const double os = own_on ? attncal_share(p->self_mode, inv_t, z_own, p->self_weight) : 0.0;
  const int non_equal = (first_on && p->first_mode != ATTNCAL_MODE_EQUAL) ||
                        (last_on && p->last_mode != ATTNCAL_MODE_EQUAL) ||
                        (own_on && p->self_mode != ATTNCAL_MODE_EQUAL);
  double content_mass = (double)nonempty * inv_t;
  double scale = 1.0;
  if (non_equal && content_mass != 0.0) {
    const double budget = 1.0 - (fs + ls + os) > 0.0 ? 1.0 - (fs + ls + os) : 0.0;
    scale = budget / content_mass;
    content_mass = budget;
  }
  double total = content_mass + fs + ls + os;
  if (total == 0.0) total = 1.0; /* a zero total skips normalisation */
  const double lam = p->strength;
  AttncalRowScalars r;
  r.keep = 1.0 - lam;
  r.coef = scale / total * lam;
  r.t = t;
  r.first_out = lam * (fs / total) + r.keep * z_first;
  r.last_out = lam * (ls / total) + r.keep * z_last;
  r.own_out = lam * (os / total) + r.keep * z_own;
  return r;
}

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_ROW_SCALARS_H_ */
