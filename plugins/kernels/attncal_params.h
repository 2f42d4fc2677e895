/* The calibration op's attributes as one plain C struct, shared by the CPU
 * implementation, the CUDA launcher, the ORT custom ops and the TensorRT
 * plugin, so that every backend validates and reads them the same way.
 *
 * Contract: domain ai.attncal, version 1, ops PooledRowCalibration and
 * AllRowsCalibration (see attncal/graphs/contract.py). */
#ifndef ATTNCAL_PARAMS_H_
#define ATTNCAL_PARAMS_H_

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { ATTNCAL_MODE_EQUAL = 0, ATTNCAL_MODE_ORIGINAL = 1, ATTNCAL_MODE_FIXED = 2 };
enum { ATTNCAL_DTYPE_FLOAT32 = 0, ATTNCAL_DTYPE_FLOAT16 = 1, ATTNCAL_DTYPE_BFLOAT16 = 2 };

/* Status codes of the C ABI (0 = success). */
enum {
  ATTNCAL_OK = 0,
  ATTNCAL_ERR_INVALID_ARGUMENT = 1,
  ATTNCAL_ERR_UNSUPPORTED = 2,
  ATTNCAL_ERR_CUDA = 3
};

typedef struct AttncalParams {
  int32_t all_rows;      /* 1 = AllRowsCalibration, 0 = PooledRowCalibration */
  int32_t pool_last;     /* pooled op only: 0 = first valid token's row, 1 = last */
  int32_t basket_size;   /* >= 1 */
  int32_t isolate_first; /* 0/1 */
  int32_t isolate_last;  /* 0/1 */
  int32_t first_mode;    /* ATTNCAL_MODE_* */
  int32_t last_mode;     /* ATTNCAL_MODE_* */
  int32_t skip_short;    /* 0/1 */
  float strength;        /* lambda in [0, 1] */
  float first_weight;    /* share used by MODE_FIXED */
  float last_weight;
} AttncalParams;

/* Checks the attribute values; on failure writes a one-line reason into msg. */
static inline int attncal_validate_params(const AttncalParams* p, char* msg, size_t msg_len) {
  const char* why = NULL;
  char buf[160];
  if (p->basket_size < 1) {
    snprintf(buf, sizeof buf, "basket_size must be >= 1, got %d", (int)p->basket_size);
    why = buf;
  } else if (p->first_mode < 0 || p->first_mode > 2) {
    snprintf(buf, sizeof buf, "first_mode must be 0 (equal), 1 (original) or 2 (fixed), got %d", (int)p->first_mode);
    why = buf;
  } else if (p->last_mode < 0 || p->last_mode > 2) {
    snprintf(buf, sizeof buf, "last_mode must be 0 (equal), 1 (original) or 2 (fixed), got %d", (int)p->last_mode);
    why = buf;
  } else if (!(p->strength >= 0.0f && p->strength <= 1.0f)) {
    snprintf(buf, sizeof buf, "strength must be in [0, 1], got %g", (double)p->strength);
    why = buf;
  } else if ((p->pool_last | p->isolate_first | p->isolate_last | p->skip_short | p->all_rows) & ~1) {
    snprintf(buf, sizeof buf, "pool_last, isolate_first, isolate_last and skip_short must be 0 or 1");
    why = buf;
  }
  if (why == NULL) return ATTNCAL_OK;
  if (msg != NULL && msg_len > 0) snprintf(msg, msg_len, "%s", why);
  return ATTNCAL_ERR_INVALID_ARGUMENT;
}

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_PARAMS_H_ */
