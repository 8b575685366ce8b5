#define W 8
#define GUMBEL_ROW gumbel_row_avx2
#include "noise_impl.h"
