// Shared device helpers for the kvstore kernels: 16-byte vector <-> fp32 conversion per element type,
// warp and block reductions.
//
// Included by every kernels/*.cu. The Python launcher (kernels/cuda.py) pastes this file in place of
// its #include line before handing the source to NVRTC, so CuPy's compile cache (keyed on the source
// text) sees every change here. No standard-library headers: NVRTC has none of them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kvstore {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

// -inf without <cmath>: INFINITY is not defined under NVRTC.
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// VecTraits<T>: one 16-byte vector (uint4) holds kVec elements of T; unpack converts them to fp32
// exactly (fp16 and bf16 widen losslessly), to_float / from_float convert one element (from_float
// rounds to nearest even).
template <typename T>
struct VecTraits;

template <>
struct VecTraits<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <>
struct VecTraits<__half> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __half22float2(h[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct VecTraits<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __bfloat1622float2(h[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// max that propagates NaN (fmaxf returns the other operand): a NaN anywhere makes the result NaN.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v = nan_max(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// Block-wide max / sum for a block of NUM_THREADS (a multiple of 32, at most 1024). Every thread gets
// the result. `scratch` holds NUM_THREADS / 32 floats; it may be reused once this returns.
template <int NUM_THREADS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  constexpr int kWarps = NUM_THREADS / kWarpSize;
  v = warp_max(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();
  return r;
}

// block_max, NaN-propagating (nan_max): a NaN in any thread's v makes every thread's result NaN.
template <int NUM_THREADS>
__device__ __forceinline__ float block_max_nan(float v, float* scratch) {
  constexpr int kWarps = NUM_THREADS / kWarpSize;
  v = warp_max_nan(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = nan_max(r, scratch[w]);
  __syncthreads();
  return r;
}

template <int NUM_THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  constexpr int kWarps = NUM_THREADS / kWarpSize;
  v = warp_sum(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

}  // namespace kvstore
