#define W 8
#define ATTENTION attention_avx2
#define FOLD attention_fold_avx2
#include "attention_impl.h"
