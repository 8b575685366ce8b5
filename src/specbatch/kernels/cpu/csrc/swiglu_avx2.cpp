#define W 8
#define SWIGLU swiglu_avx2
#include "swiglu_impl.h"
