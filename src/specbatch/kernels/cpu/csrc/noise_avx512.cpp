#define W 16
#define GUMBEL_ROW gumbel_row_avx512
#define SAMPLE_SPAN sample_span_avx512
#include "noise_impl.h"
