#define W 8
#define GEMV gemv_avx2
#define ATTENTION attention_avx2
#include "attention_impl.h"
