// W4A16 split-K GEMV for small M (M <= 16): the CuPy backend of codesign::w4a16_gemm.
//
// out_acc[m, n] += sum_k x[m, k] * W[n, k] over this block's K slice, with
//   W[n, k] = (code(k, n) - zero[k / group, n]) * scale[k / group, n]
// in codesign's native layout: qweight int32 [K / 8, N], code(k, n) = (qweight[k / 8, n] >> 4 * (k % 8)) & 15,
// scales/zeros fp16 [K / group, N] (zero = 8 when has_zeros == 0).
//
// One thread owns one output column n for all M rows: a warp reads 32 consecutive int32 words of a
// qweight row (coalesced, 128 B), each word gives 8 k-steps of one group (group % 8 == 0), so the
// scale and zero are loaded once per word. x is tiny (M * K halves) and read through the cache.
// Partial sums go to an fp32 [M, N] buffer with atomicAdd (grid.y = split-K); the bias is added
// by the split-0 block; the host casts the buffer to fp16.
#include <cuda_fp16.h>

#define MAX_M 16

extern "C" __global__ void w4a16_gemv_splitk(
    const __half* __restrict__ x, const int* __restrict__ qweight, const __half* __restrict__ scales,
    const __half* __restrict__ zeros, const __half* __restrict__ bias, float* __restrict__ out_acc,
    int M, int N, int K, int group, int k_words_per_split, int has_zeros, int has_bias) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int kw_begin = blockIdx.y * k_words_per_split;
  int kw_end = kw_begin + k_words_per_split;
  if (kw_end > K / 8) kw_end = K / 8;

  float acc[MAX_M];
#pragma unroll
  for (int m = 0; m < MAX_M; ++m) acc[m] = 0.0f;

  for (int kw = kw_begin; kw < kw_end; ++kw) {
    const unsigned int word = static_cast<unsigned int>(qweight[(long long)kw * N + n]);
    const int g = (kw * 8) / group;
    const float s = __half2float(scales[(long long)g * N + n]);
    const float z = has_zeros ? __half2float(zeros[(long long)g * N + n]) : 8.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float w = (static_cast<float>((word >> (4 * j)) & 15u) - z) * s;
      const int k = kw * 8 + j;
#pragma unroll
      for (int m = 0; m < MAX_M; ++m) {
        if (m < M) acc[m] += __half2float(x[(long long)m * K + k]) * w;
      }
    }
  }
  const float b = (has_bias && blockIdx.y == 0) ? __half2float(bias[n]) : 0.0f;
#pragma unroll
  for (int m = 0; m < MAX_M; ++m) {
    if (m < M) atomicAdd(&out_acc[(long long)m * N + n], acc[m] + b);
  }
}
