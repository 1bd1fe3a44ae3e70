// 16-float vectors (GCC vector extensions: one AVX-512 register where the CPU has it, pairs of
// AVX2 registers otherwise) and the few operations the kernels share on them.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }

// 16 bfloat16 values widened to float32 (a bfloat16 is the upper half of a float32's bits).
inline v16 load(const at::BFloat16* p) {
  const u32x16 bits = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16;
  v16 out;
  __builtin_memcpy(&out, &bits, sizeof out);
  return out;
}

inline float hsum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

inline void store(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }

// 16 copies of *p (one broadcast load; `v16{} + *p` would add, for the sign of a zero).
inline v16 splat(const float* p) {
#ifdef __AVX512F__
  return reinterpret_cast<v16>(_mm512_set1_ps(*p));
#else
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = *p;
  return v;
#endif
}

typedef int vi16 __attribute__((vector_size(64), aligned(4)));

// e^x for 16 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n put in
// the exponent bits); relative error about 1e-7. libm's expf is called one float at a time.
inline v16 vexp(v16 x) {
  const v16 hi = v16{} + 88.3762626647949f, lo = v16{} - 87.3365447504f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  v16 n = __builtin_convertvector(__builtin_convertvector(fx, vi16), v16);
  n += __builtin_convertvector(n > fx, v16);  // truncation to floor: -1 where n rounded up
  const v16 r = x - n * 0.693359375f - n * -2.12194440e-4f;
  v16 y = v16{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

}  // namespace
