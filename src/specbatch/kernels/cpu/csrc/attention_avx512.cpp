#define W 16
#define ATTENTION attention_avx512
#define FOLD attention_fold_avx512
#include "attention_impl.h"
