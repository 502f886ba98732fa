// Page movement: write new K/V into the paged cache, and copy whole pages between the per-layer paged
// caches and contiguous pages.
//
// These kernels only move bytes, so they are typed by a copy unit (unit_t: 16, 8, 4, 2 or 1 bytes),
// not by the element type: the launcher picks the widest unit that divides every row, stride and base
// address (16 bytes for any real model), and all sizes and strides below are counted in units.
//
// A page (DESIGN.md section 4) is [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim],
// contiguous. One "plane" is the [block_size, num_kv_heads, head_dim] slab of one block of one layer's
// K or V cache: contiguous in a contiguous cache, plane_units units long.
//
// Compiled by nvcc in CI (explicit instantiations at the end) and by NVRTC at run time (CuPy,
// name_expressions; __CUDACC_RTC__ is defined there and the instantiation list is skipped).
#include "common.cuh"

namespace kvstore {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // units loaded per thread before the first store: loads in flight

// Copy `units` units from src to dst with the whole block: kCopyUnroll coalesced loads per thread
// are issued before their stores.
template <typename unit_t>
__device__ __forceinline__ void block_copy(unit_t* __restrict__ dst, const unit_t* __restrict__ src, const int units) {
  for (int base = 0; base < units; base += kCopyThreads * kCopyUnroll) {
    unit_t buf[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + u * kCopyThreads + threadIdx.x;
      if (i < units) buf[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + u * kCopyThreads + threadIdx.x;
      if (i < units) dst[i] = buf[u];
    }
  }
}

// Write the K and V rows of new tokens into their cache slots (slot = block * block_size + offset).
// A negative slot (padding) is skipped; so is a slot >= num_slots, which the launcher never lets
// through on a CPU-validated path and which must not become an out-of-bounds write on the GPU.
// Grid:  x = num_tokens (one block per token).  Block: kCopyThreads threads; thread i copies units
//        i, i + kCopyThreads, ... of the token's [num_kv_heads, head_dim] row, K then V.
// Contract: within a token, [num_kv_heads, head_dim] is contiguous in key, value and both caches.
//        Duplicate slots race: which token lands is unspecified.
template <typename unit_t, typename slot_t>
__global__ void __launch_bounds__(kCopyThreads) reshape_and_cache_kernel(
    const unit_t* __restrict__ key,          // [num_tokens, row_units] (row stride key_stride_token)
    const unit_t* __restrict__ value,        // [num_tokens, row_units] (row stride value_stride_token)
    unit_t* __restrict__ key_cache,          // [num_blocks, block_size, row_units] (strides kc_stride_*)
    unit_t* __restrict__ value_cache,        // [num_blocks, block_size, row_units] (strides vc_stride_*)
    const slot_t* __restrict__ slot_mapping, // [num_tokens]: int32 or int64
    const int row_units,                     // num_kv_heads * head_dim elements, in units
    const int key_stride_token, const int value_stride_token,
    const int kc_stride_block, const int kc_stride_token,
    const int vc_stride_block, const int vc_stride_token,
    const int block_size,
    const long long num_slots) {             // num_blocks * block_size
  const int token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const long long offset = slot - block * block_size;
  const unit_t* k_src = key + static_cast<long long>(token) * key_stride_token;
  const unit_t* v_src = value + static_cast<long long>(token) * value_stride_token;
  unit_t* k_dst = key_cache + block * kc_stride_block + offset * kc_stride_token;
  unit_t* v_dst = value_cache + block * vc_stride_block + offset * vc_stride_token;
  for (int i = threadIdx.x; i < row_units; i += kCopyThreads) {
    // Both loads before either store: two requests in flight per thread.
    const unit_t k = k_src[i];
    const unit_t v = v_src[i];
    k_dst[i] = k;
    v_dst[i] = v;
  }
}

// Gather pages out of the per-layer caches, all layers in one launch.
// Grid:  x = num_pages * planes_per_page, plane index p = x % planes_per_page = 2 * layer + (0 K | 1 V),
//        page = x / planes_per_page.  Block: kCopyThreads threads copy one plane (block_copy).
// Contract: block_ids are in [0, num_blocks) (the launcher checks; an id outside is skipped here so a
//        bad id can never read out of bounds, and leaves that plane of the page unwritten).
template <typename unit_t>
__global__ void __launch_bounds__(kCopyThreads) gather_pages_kernel(
    unit_t* __restrict__ pages,                       // [num_pages, planes_per_page, plane_units]
    const unsigned long long* __restrict__ cache_ptrs, // [planes_per_page]: device address of layer l's
                                                       //   key cache at 2l, value cache at 2l + 1, each
                                                       //   [num_blocks, plane_units] (block stride cache_stride_block)
    const long long* __restrict__ block_ids,          // [num_pages]
    const int planes_per_page,                        // 2 * num_layers
    const int plane_units,                            // block_size * num_kv_heads * head_dim, in units
    const long long cache_stride_block,               // units between consecutive blocks of a cache
    const long long num_blocks) {
  const long long x = blockIdx.x;
  const long long page = x / planes_per_page;
  const int plane = static_cast<int>(x - page * planes_per_page);
  const long long block = block_ids[page];
  if (block < 0 || block >= num_blocks) return;
  const unit_t* src = reinterpret_cast<const unit_t*>(cache_ptrs[plane]) + block * cache_stride_block;
  unit_t* dst = pages + x * plane_units;
  block_copy(dst, src, plane_units);
}

// Scatter pages into the per-layer caches, all layers in one launch: the inverse of gather_pages_kernel.
// Grid, block and contract as for gather_pages_kernel. Duplicate block ids race: which page lands is
// unspecified.
template <typename unit_t>
__global__ void __launch_bounds__(kCopyThreads) scatter_pages_kernel(
    const unit_t* __restrict__ pages,                 // [num_pages, planes_per_page, plane_units]
    const unsigned long long* __restrict__ cache_ptrs, // [planes_per_page], as for gather_pages_kernel
    const long long* __restrict__ block_ids,          // [num_pages]
    const int planes_per_page, const int plane_units, const long long cache_stride_block,
    const long long num_blocks) {
  const long long x = blockIdx.x;
  const long long page = x / planes_per_page;
  const int plane = static_cast<int>(x - page * planes_per_page);
  const long long block = block_ids[page];
  if (block < 0 || block >= num_blocks) return;
  unit_t* dst = reinterpret_cast<unit_t*>(cache_ptrs[plane]) + block * cache_stride_block;
  const unit_t* src = pages + x * plane_units;
  block_copy(dst, src, plane_units);
}

}  // namespace kvstore

#ifndef __CUDACC_RTC__
// Every configuration the launcher can request (kernels/cuda.py), instantiated for the nvcc check in CI.
#define KV_INSTANTIATE_RESHAPE(U, S)                                                                     \
  template __global__ void kvstore::reshape_and_cache_kernel<U, S>(const U*, const U*, U*, U*, const S*, \
                                                                   int, int, int, int, int, int, int, int, long long);
#define KV_INSTANTIATE_PAGES(U)                                                                                   \
  template __global__ void kvstore::gather_pages_kernel<U>(U*, const unsigned long long*, const long long*, int, \
                                                           int, long long, long long);                            \
  template __global__ void kvstore::scatter_pages_kernel<U>(const U*, const unsigned long long*, const long long*, \
                                                            int, int, long long, long long);
#define KV_INSTANTIATE_UNIT(U)    \
  KV_INSTANTIATE_RESHAPE(U, int)  \
  KV_INSTANTIATE_RESHAPE(U, long long) \
  KV_INSTANTIATE_PAGES(U)

KV_INSTANTIATE_UNIT(uint4)
KV_INSTANTIATE_UNIT(uint2)
KV_INSTANTIATE_UNIT(unsigned int)
KV_INSTANTIATE_UNIT(unsigned short)
KV_INSTANTIATE_UNIT(unsigned char)
#endif
