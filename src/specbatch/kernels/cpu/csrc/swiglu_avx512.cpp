#define W 16
#define SWIGLU swiglu_avx512
#include "swiglu_impl.h"
