#define W 8
#define GUMBEL_ROW gumbel_row_avx2
#define SAMPLE_SPAN sample_span_avx2
#include "noise_impl.h"
