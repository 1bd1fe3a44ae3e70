// Float vectors of the CPU's own width (GCC vector extensions): 16 floats, one register, where
// it has AVX-512; 8 floats, one AVX2 register, otherwise (GCC keeps wider vectors in memory, not
// in register pairs: a few GFLOP/s). Loops step by kLanes, so a sum's order follows the width:
// the same on every machine of one kind, and whatever the rows batched together.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int vi __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes), aligned(2)));
typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));

inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }

// kLanes bfloat16 values widened to float32 (a bfloat16 is the upper half of a float32's bits).
inline vf load(const at::BFloat16* p) {
  const vu32 bits = __builtin_convertvector(*reinterpret_cast<const vu16*>(p), vu32) << 16;
  vf out;
  __builtin_memcpy(&out, &bits, sizeof out);
  return out;
}

// a + b * c in one rounding, spelled out: left to the compiler's contraction, some tiles'
// multiply-adds were fused and others not (a row's sums then depend on the rows beside it).
inline vf madd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c),
                                              reinterpret_cast<__m512>(a)));
#elif defined(__FMA__)
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c),
                                              reinterpret_cast<__m256>(a)));
#else
  return a + b * c;
#endif
}

inline float hsum(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

inline void store(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }

// kLanes copies of *p: one broadcast load (x - +0 is x, a -0 included; `vf{} + *p` would turn
// a -0 into +0).
inline vf splat(const float* p) { return *p - vf{}; }

// e^x for kLanes floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n put in
// the exponent bits); relative error about 1e-7. libm's expf is called one float at a time.
inline vf vexp(vf x) {
  const vf hi = vf{} + 88.3762626647949f, lo = vf{} - 87.3365447504f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  n += __builtin_convertvector(n > fx, vf);  // truncation to floor: -1 where n rounded up
  const vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vf y = vf{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

}  // namespace
