/* Reading a sample as an SDPA call: where q/k/v are, and the typed value of each known keyword. */
#ifndef AF_PROVIDER_CALL_H
#define AF_PROVIDER_CALL_H
#include <stdbool.h>

#include "provider/sample.h"

/* The seed's _qkv_source: exactly three positionals, or none and the query/key/value keywords. */
bool af_sample_qkv_source(const af_sample *sample, af_qkv_source *source);
/* q, k and v of a sample whose source is known (never NULL then). */
void af_sample_qkv(const af_sample *sample, af_qkv_source source, const af_value *qkv[3]);
/* True for the keywords SDPA's subset reads: attn_mask, dropout_p, is_causal, scale, enable_gqa, and
 * query/key/value when they carry q/k/v. */
bool af_sample_kwarg_is_known(const char *name, af_qkv_source source);

/* Typed readers; `value` NULL means the keyword was not given. Each returns false on a wrong type. */
bool af_value_read_bool(const af_value *value, bool *out);                      /* absent: false */
bool af_value_read_scale(const af_value *value, bool *has_scale, double *scale);/* absent/None: no scale; finite */
bool af_value_read_number(const af_value *value, double *out);                  /* absent: 0; bool as 0/1 */

#endif
