// FP8 (e4m3, "fn": finite, max 448) page quantization with one fp32 scale per (plane, kv head).
//
// Pages are viewed as planes: [num_planes, block_size, num_kv_heads, head_dim] with
// num_planes = num_pages * planes_per_page and planes_per_page = num_layers * 2 (a page is
// [num_layers, 2, block_size, num_kv_heads, head_dim], DESIGN.md section 4). Each (plane, head) slab,
// block_size x head_dim values, gets
//   scale = absmax / 448,   q = e4m3(x * (448 / absmax)) rounded to nearest even, saturating,
// and dequantizes as x' = float(q) * scale. An all-zero slab gets scale 0 and q 0, and so does a slab
// whose absmax is below kFp8MinAbsmax (2^-119, where 448 / absmax would overflow fp32 and turn its zeros
// into NaN; such values, bf16 / fp32 only, decode as 0, off by less than 2^-119).
// Non-finite input is not quantized: a NaN or inf anywhere in a slab makes its absmax, and so its scale,
// NaN or inf (the max below propagates NaN, unlike fmaxf), and the launcher (kernels/ops.py) refuses the
// pages when any scale is not finite. The values written for such a slab are meaningless.
//
// The e4m3 values and the scales are addressed per page through a page stride, so they can live in
// separate contiguous tensors (q [num_pages, ...], scales [num_pages, num_layers, 2, num_kv_heads]) or
// inside packed encoded pages (kvstore's fp8-e4m3 page: scales, then values, in one buffer per page;
// kvstore/layout.py). Within a page both are contiguous. The floating-point pages are contiguous.
//
// Compiled by nvcc in CI (explicit instantiations at the end) and by NVRTC at run time (CuPy,
// name_expressions; __CUDACC_RTC__ is defined there and the instantiation list is skipped).
#include "common.cuh"

#include <cuda_fp8.h>

namespace kvstore {

constexpr int kQuantThreads = 128;
constexpr int kDequantThreads = 256;
constexpr float kFp8E4m3Max = 448.0f;
constexpr float kFp8MinAbsmax = 0x1p-119f;  // smallest absmax with a finite 448 / absmax (FP8_MIN_ABSMAX)
constexpr int kFp8Group = 8;  // fp8 values per dequant step: one 8-byte load, kFp8Group outputs

// Grid:  x = num_planes * num_kv_heads; block x handles plane x / num_kv_heads, head x % num_kv_heads;
//        plane = page * planes_per_page + (layer * 2 + K/V).
// Block: kQuantThreads threads stride over the slab's block_size * head_dim / kVec 16-byte vectors:
//        a first pass finds the absmax, a second re-reads (from L1/L2) and quantizes.
// Contract: head_dim % kVec == 0 (a vector never straddles two heads); 16-byte aligned pages, out and
//           out_page_stride.
template <typename scalar_t>
__global__ void __launch_bounds__(kQuantThreads) quantize_fp8_kernel(
    unsigned char* __restrict__ out,         // page n at out + n * out_page_stride:
                                             //   [planes_per_page, block_size, num_kv_heads, head_dim] e4m3 bits
    float* __restrict__ scales,              // page n at scales + n * scales_page_stride:
                                             //   [planes_per_page, num_kv_heads]
    const scalar_t* __restrict__ pages,      // [num_planes, block_size, num_kv_heads, head_dim]
    const long long out_page_stride,         // bytes from one page of out to the next
    const long long scales_page_stride,      // floats from one page of scales to the next
    const int planes_per_page,               // num_layers * 2
    const int block_size, const int num_kv_heads, const int head_dim) {
  using Traits = VecTraits<scalar_t>;
  constexpr int kVec = Traits::kVec;
  __shared__ float s_scratch[kQuantThreads / kWarpSize];

  const long long plane = blockIdx.x / num_kv_heads;
  const int head = blockIdx.x % num_kv_heads;
  const long long page = plane / planes_per_page;
  const int plane_in_page = static_cast<int>(plane - page * planes_per_page);
  const int vecs_per_row = head_dim / kVec;
  const int num_vecs = block_size * vecs_per_row;
  const long long row_stride = static_cast<long long>(num_kv_heads) * head_dim;  // elements between tokens
  const long long plane_elems = block_size * row_stride;
  const long long base = plane * plane_elems + static_cast<long long>(head) * head_dim;
  const long long out_base =
      page * out_page_stride + plane_in_page * plane_elems + static_cast<long long>(head) * head_dim;

  float amax = 0.0f;
  for (int i = threadIdx.x; i < num_vecs; i += kQuantThreads) {
    const int token = i / vecs_per_row;
    const int col = (i - token * vecs_per_row) * kVec;
    float f[kVec];
    Traits::unpack(__ldg(reinterpret_cast<const uint4*>(pages + base + token * row_stride + col)), f);
#pragma unroll
    for (int e = 0; e < kVec; ++e) amax = nan_max(amax, fabsf(f[e]));
  }
  amax = block_max_nan<kQuantThreads>(amax, s_scratch);
  // IEEE division (not the reciprocal approximation): the torch reference computes the same quotient,
  // so the CUDA and reference bits agree exactly. A NaN absmax fails both tests: inv 0, scale NaN.
  const float inv = amax >= kFp8MinAbsmax ? kFp8E4m3Max / amax : 0.0f;
  if (threadIdx.x == 0) {
    scales[page * scales_page_stride + static_cast<long long>(plane_in_page) * num_kv_heads + head] =
        amax < kFp8MinAbsmax ? 0.0f : amax / kFp8E4m3Max;
  }

  for (int i = threadIdx.x; i < num_vecs; i += kQuantThreads) {
    const int token = i / vecs_per_row;
    const int col = (i - token * vecs_per_row) * kVec;
    const long long offset = token * row_stride + col;
    float f[kVec];
    Traits::unpack(__ldg(reinterpret_cast<const uint4*>(pages + base + offset)), f);
    unsigned char q[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) q[e] = __nv_cvt_float_to_fp8(f[e] * inv, __NV_SATFINITE, __NV_E4M3);
    // kVec bytes, kVec-aligned (head_dim, the offsets and out_page_stride are multiples of kVec): one store.
    unsigned char* at = out + out_base + offset;
    if constexpr (kVec == 8) {
      uint2 packed;
      packed.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<unsigned>(q[3]) << 24);
      packed.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<unsigned>(q[7]) << 24);
      *reinterpret_cast<uint2*>(at) = packed;
    } else {
      static_assert(kVec == 4, "16-byte vectors hold 4 or 8 elements");
      *reinterpret_cast<unsigned int*>(at) =
          q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<unsigned>(q[3]) << 24);
    }
  }
}

// Grid:  1-D, grid-stride over the num_planes * block_size * num_kv_heads * head_dim / kFp8Group groups
//        of kFp8Group consecutive values (one 8-byte load each), numbered in the order of `out`.
// Block: kDequantThreads threads.
// Contract: head_dim % kFp8Group == 0 (a group never straddles two heads); 16-byte aligned output;
//           q and q_page_stride 8-byte aligned.
template <typename scalar_t>
__global__ void __launch_bounds__(kDequantThreads) dequantize_fp8_kernel(
    scalar_t* __restrict__ out,              // [num_planes, block_size, num_kv_heads, head_dim]
    const unsigned char* __restrict__ q,     // page n at q + n * q_page_stride:
                                             //   [planes_per_page, block_size, num_kv_heads, head_dim] e4m3 bits
    const float* __restrict__ scales,        // page n at scales + n * scales_page_stride:
                                             //   [planes_per_page, num_kv_heads]
    const long long num_groups,              // total values / kFp8Group
    const long long q_page_stride,           // bytes from one page of q to the next
    const long long scales_page_stride,      // floats from one page of scales to the next
    const int planes_per_page,               // num_layers * 2
    const int block_size, const int num_kv_heads, const int head_dim) {
  using Traits = VecTraits<scalar_t>;
  const long long plane_elems = static_cast<long long>(block_size) * num_kv_heads * head_dim;
  const long long page_elems = plane_elems * planes_per_page;
  for (long long g = static_cast<long long>(blockIdx.x) * kDequantThreads + threadIdx.x; g < num_groups;
       g += static_cast<long long>(gridDim.x) * kDequantThreads) {
    const long long at = g * kFp8Group;
    const long long page = at / page_elems;
    const long long within = at - page * page_elems;
    const long long plane_in_page = within / plane_elems;
    const int head = static_cast<int>((at / head_dim) % num_kv_heads);
    const float scale = __ldg(scales + page * scales_page_stride + plane_in_page * num_kv_heads + head);
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(q + page * q_page_stride + within));
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&raw);
    __align__(16) scalar_t v[kFp8Group];  // stored as whole 16-byte vectors below
#pragma unroll
    for (int e = 0; e < kFp8Group; ++e) {
      // e4m3 -> fp16 is exact; the product is rounded once, to scalar_t, as in the torch reference.
      const __half h = __half(__nv_cvt_fp8_to_halfraw(bytes[e], __NV_E4M3));
      v[e] = Traits::from_float(__half2float(h) * scale);
    }
    // kFp8Group * sizeof(scalar_t) bytes (16 or 32): 16-byte stores.
    const uint4* src = reinterpret_cast<const uint4*>(v);
    uint4* dst = reinterpret_cast<uint4*>(out + at);
#pragma unroll
    for (int s = 0; s < static_cast<int>(sizeof(v) / sizeof(uint4)); ++s) dst[s] = src[s];
  }
}

}  // namespace kvstore

#ifndef __CUDACC_RTC__
// Every configuration the launcher can request (kernels/cuda.py), instantiated for the nvcc check in CI.
#define KV_INSTANTIATE_FP8(T)                                                                                 \
  template __global__ void kvstore::quantize_fp8_kernel<T>(unsigned char*, float*, const T*, long long, long long, \
                                                           int, int, int, int);                                 \
  template __global__ void kvstore::dequantize_fp8_kernel<T>(T*, const unsigned char*, const float*, long long,   \
                                                             long long, long long, int, int, int, int);

KV_INSTANTIATE_FP8(float)
KV_INSTANTIATE_FP8(__half)
KV_INSTANTIATE_FP8(__nv_bfloat16)
#endif
