// Vector helpers shared by the kernel bodies compiled once per ISA (W float lanes), included
// inside their anonymous namespace. Compiled with -ffp-contract=off: the same bits on AVX2
// and AVX-512, whatever lane an element falls in.
typedef float vf __attribute__((vector_size(W * 4)));
typedef int vi __attribute__((vector_size(W * 4)));

inline vf load(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof(v)); return v; }
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
// A broadcast (`vf{} + x` cost an add before each one: 0 + x, kept for x = -0; a loop over the
// lanes, an insert each).
inline vf splat(float x) {
#if W == 16
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return vf{x, x, x, x, x, x, x, x};
#endif
}

// exp(x) for x <= 0 (scores minus their row's max): 2^n * p(r), |rel err| < 2e-7.
inline vf exp_neg(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  vf t = x * 1.44269504088896341f;
  vi n = __builtin_convertvector(t - 0.5f, vi);  // round to nearest for t <= 0
  vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln2 split in two for accuracy
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

