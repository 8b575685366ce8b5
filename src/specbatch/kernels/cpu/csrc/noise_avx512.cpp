#define W 16
#define GUMBEL_ROW gumbel_row_avx512
#include "noise_impl.h"
