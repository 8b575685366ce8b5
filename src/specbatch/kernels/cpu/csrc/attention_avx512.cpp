#define W 16
#define GEMV gemv_avx512
#define ATTENTION attention_avx512
#include "attention_impl.h"
