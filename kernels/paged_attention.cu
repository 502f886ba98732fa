// Paged attention for decode: one query token per sequence against its paged K/V cache.
//
// Math (per sequence s, query head h, kv head g = h / (num_heads / num_kv_heads), tokens t < len_s):
//   logit_t = (q_h . k_{t,g}) * scale,   out_h = sum_t softmax(logit)_t * v_{t,g}
// Softmax and accumulation are fp32. Logits are kept in the log2 domain (multiplied by log2(e)) so
// every exponential is one exp2f; partial maxima written for the reduce kernel are in that domain too.
//
// Split-K: the launcher cuts each sequence into partitions of `partition_size` tokens (grid.z). With
// one partition the decode kernel writes the output directly; with several it writes a normalized
// partial output plus (max, sum) per partition and paged_attention_reduce_kernel merges them.
//
// Compiled two ways: by nvcc in CI (all explicit instantiations at the end, so ptxas reports registers
// and spills for every configuration the launcher can ask for), and by NVRTC through CuPy at run time,
// where only the requested instantiation is compiled (name_expressions; __CUDACC_RTC__ is defined).
#include "common.cuh"

namespace kvstore {

constexpr int kDecodeThreads = 128;  // 4 warps: enough loads in flight per SM at ~4 resident blocks
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr int kReduceThreads = 128;

// Compile-time geometry of the decode kernel for one (element type, head_dim, heads per block).
//
// A "token group" is kLanesPerToken adjacent lanes that together read one token's head_dim row with
// 16-byte loads (kChunks loads per lane), so a warp reads kTokensPerWarp rows per round: for fp16 and
// head_dim 128, 16 lanes per row, 2 rows per round, 256 contiguous bytes per row. Each warp step
// covers kRounds rounds: kRounds * kChunks 16-byte loads of K and as many of V in flight per lane.
template <typename scalar_t, int HEAD_DIM, int HEADS_PER_BLOCK>
struct DecodeGeometry {
  static constexpr int kVec = VecTraits<scalar_t>::kVec;
  static constexpr int kVecsPerRow = HEAD_DIM / kVec;
  static constexpr int kLanesPerToken = kVecsPerRow < kWarpSize ? kVecsPerRow : kWarpSize;
  static constexpr int kChunks = kVecsPerRow / kLanesPerToken;
  static constexpr int kElemsPerLane = kChunks * kVec;
  static constexpr int kTokensPerWarp = kWarpSize / kLanesPerToken;
  // 16-byte loads per lane per step, for K and for V each. NOTE: the fp32 accumulator already takes
  // HEADS_PER_BLOCK * kElemsPerLane registers per lane (64 for 8 heads of fp16 at head_dim 128), so
  // 8-head tiles issue fewer loads per step to stay within their register budget without spills.
  static constexpr int kLoadsPerStep = HEADS_PER_BLOCK >= 8 ? 2 : 4;
  static constexpr int kRounds = kLoadsPerStep / kChunks > 0 ? kLoadsPerStep / kChunks : 1;
  static constexpr int kTokensPerStep = kTokensPerWarp * kRounds;
  // Resident blocks per SM promised to ptxas through __launch_bounds__, i.e. a register budget of
  // 65536 / (kMinBlocks * 128): 128 registers (4 blocks, 16 warps per SM) for tiles of up to 4 heads.
  // 8-head tiles need ~160-180 (their query slice is hoisted into registers) and get 2 blocks' worth.
  // Without an explicit minimum ptxas picked its own target and spilled some configurations.
  static constexpr int kMinBlocks = HEADS_PER_BLOCK >= 8 ? 2 : 4;

  static_assert(HEAD_DIM % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
  static_assert((kLanesPerToken & (kLanesPerToken - 1)) == 0, "lanes per token must be a power of two");
  static_assert(kVecsPerRow % kLanesPerToken == 0, "head_dim row must split evenly over the lanes");
};

// Grid:  x = num_heads / HEADS_PER_BLOCK (a tile of query heads that share one kv head),
//        y = num_seqs, z = num_partitions.
// Block: kDecodeThreads threads. Warp w handles warp steps w, w + 4, w + 8, ... of the partition's
//        tokens with its own online-softmax state (max, sum, accumulator); the four warps are merged
//        once through shared memory at the end, so the token loop has no __syncthreads.
// Shared memory (static): the scaled query tile [HEADS_PER_BLOCK, HEAD_DIM] fp32 and the per-warp
//        partial results; 40 KiB at most (HEAD_DIM 256, 8 heads).
// Contract: num_heads % HEADS_PER_BLOCK == 0; the HEADS_PER_BLOCK heads of a tile share a kv head;
//        key/value rows are 16-byte aligned (base pointers and strides multiples of 16 bytes); block
//        table entries below ceil(len / block_size) are valid block ids (not checked here).
template <typename scalar_t, int HEAD_DIM, int HEADS_PER_BLOCK>
__global__ void __launch_bounds__(kDecodeThreads, (DecodeGeometry<scalar_t, HEAD_DIM, HEADS_PER_BLOCK>::kMinBlocks))
    paged_attention_decode_kernel(
    scalar_t* __restrict__ out,               // [num_seqs, num_heads, HEAD_DIM], written when gridDim.z == 1
    float* __restrict__ partial_out,          // [num_seqs, num_heads, num_partitions, HEAD_DIM], when gridDim.z > 1
    float* __restrict__ partial_max,          // [num_seqs, num_heads, num_partitions] (log2 domain)
    float* __restrict__ partial_sum,          // [num_seqs, num_heads, num_partitions]
    const scalar_t* __restrict__ query,       // [num_seqs, num_heads, HEAD_DIM] (strides q_stride_seq, q_stride_head)
    const scalar_t* __restrict__ key_cache,   // [num_blocks, block_size, num_kv_heads, HEAD_DIM] (strides k_stride_*)
    const scalar_t* __restrict__ value_cache, // [num_blocks, block_size, num_kv_heads, HEAD_DIM] (strides v_stride_*)
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks_per_seq] (row stride bt_stride_seq)
    const int* __restrict__ seq_lens,         // [num_seqs]; 0 gives a zero output
    const int num_heads,                      // query heads
    const int queries_per_kv,                 // num_heads / num_kv_heads
    const int block_size,                     // tokens per cache block
    const int partition_size,                 // tokens per partition (grid.z)
    const float scale_log2,                   // softmax scale * log2(e)
    const int q_stride_seq, const int q_stride_head,
    const int k_stride_block, const int k_stride_token, const int k_stride_head,
    const int v_stride_block, const int v_stride_token, const int v_stride_head,
    const int bt_stride_seq,
    const int out_stride_seq, const int out_stride_head) {
  using Traits = VecTraits<scalar_t>;
  using G = DecodeGeometry<scalar_t, HEAD_DIM, HEADS_PER_BLOCK>;
  constexpr int kVec = G::kVec;
  constexpr int kChunks = G::kChunks;
  constexpr int kRounds = G::kRounds;
  constexpr int kElems = G::kElemsPerLane;
  constexpr int kLanes = G::kLanesPerToken;

  const int head0 = blockIdx.x * HEADS_PER_BLOCK;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int num_partitions = gridDim.z;
  const int seq_len = seq_lens[seq];
  const int start = part * partition_size;

  if (start >= seq_len) {
    // Nothing to attend to. A single-pass launch still owns the output: zeros (an empty sequence, as
    // the reference defines it). In a split launch the reduce kernel never reads this partition.
    if (num_partitions == 1) {
      for (int i = threadIdx.x; i < HEADS_PER_BLOCK * HEAD_DIM; i += kDecodeThreads) {
        const int h = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        out[static_cast<long long>(seq) * out_stride_seq + static_cast<long long>(head0 + h) * out_stride_head + d] =
            Traits::from_float(0.0f);
      }
    }
    return;
  }
  const int end = min(seq_len, start + partition_size);
  const int kv_head = head0 / queries_per_kv;

  __shared__ __align__(16) float s_q[HEADS_PER_BLOCK][HEAD_DIM];
  __shared__ __align__(16) float s_acc[kDecodeWarps][HEADS_PER_BLOCK][HEAD_DIM];
  __shared__ float s_max[kDecodeWarps][HEADS_PER_BLOCK];
  __shared__ float s_sum[kDecodeWarps][HEADS_PER_BLOCK];

  // Stage the query tile once, pre-scaled, in fp32. Each lane needs the slice matching the K vectors
  // it loads, not the rows it was loaded by; the reads are loop-invariant, so ptxas keeps them in
  // registers where the budget allows.
  for (int i = threadIdx.x; i < HEADS_PER_BLOCK * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    const scalar_t q = query[static_cast<long long>(seq) * q_stride_seq + static_cast<long long>(head0 + h) * q_stride_head + d];
    s_q[h][d] = Traits::to_float(q) * scale_log2;
  }
  __syncthreads();

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int token_lane = lane / kLanes;  // which row of a round this lane reads
  const int dim_lane = lane % kLanes;    // which 16-byte vectors of the row: dim_lane + c * kLanes

  float acc[HEADS_PER_BLOCK][kElems];
  float run_max[HEADS_PER_BLOCK];
  float run_sum[HEADS_PER_BLOCK];  // this token group's share; summed over groups after the loop
#pragma unroll
  for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
    run_max[h] = neg_inf();
    run_sum[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[h][e] = 0.0f;
  }

  const int* __restrict__ table = block_tables + static_cast<long long>(seq) * bt_stride_seq;
  const scalar_t* __restrict__ k_head = key_cache + static_cast<long long>(kv_head) * k_stride_head;
  const scalar_t* __restrict__ v_head = value_cache + static_cast<long long>(kv_head) * v_stride_head;

  for (int step = start + warp * G::kTokensPerStep; step < end; step += kDecodeWarps * G::kTokensPerStep) {
    // Issue every K and V load of the step before any math: 2 * kRounds * kChunks 16-byte loads per
    // lane in flight. A row past `end` re-reads the partition's first row instead of branching (its
    // probability is forced to 0 below): branch-free loads let ptxas keep everything in registers.
    uint4 k_raw[kRounds][kChunks];
    uint4 v_raw[kRounds][kChunks];
    bool valid[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const int t = step + r * G::kTokensPerWarp + token_lane;
      valid[r] = t < end;
      const int token = valid[r] ? t : start;
      const int logical = token / block_size;
      const int offset = token - logical * block_size;
      const long long block = table[logical];
      const scalar_t* k_row = k_head + block * k_stride_block + static_cast<long long>(offset) * k_stride_token;
      const scalar_t* v_row = v_head + block * v_stride_block + static_cast<long long>(offset) * v_stride_token;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int d = (dim_lane + c * kLanes) * kVec;
        k_raw[r][c] = __ldg(reinterpret_cast<const uint4*>(k_row + d));
        v_raw[r][c] = __ldg(reinterpret_cast<const uint4*>(v_row + d));
      }
    }

    // q . k for every head of the tile and every row of the step: lane-partial dot products, then a
    // butterfly over the kLanes lanes of the token group (every lane ends with the full dot).
    float logit[HEADS_PER_BLOCK][kRounds];
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
      for (int r = 0; r < kRounds; ++r) logit[h][r] = 0.0f;
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float kf[kRounds][kVec];
#pragma unroll
      for (int r = 0; r < kRounds; ++r) Traits::unpack(k_raw[r][c], kf[r]);
      const int d0 = (dim_lane + c * kLanes) * kVec;
#pragma unroll
      for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          const float4 q4 = *reinterpret_cast<const float4*>(&s_q[h][d0 + e]);
#pragma unroll
          for (int r = 0; r < kRounds; ++r) {
            logit[h][r] = fmaf(q4.x, kf[r][e], logit[h][r]);
            logit[h][r] = fmaf(q4.y, kf[r][e + 1], logit[h][r]);
            logit[h][r] = fmaf(q4.z, kf[r][e + 2], logit[h][r]);
            logit[h][r] = fmaf(q4.w, kf[r][e + 3], logit[h][r]);
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
#pragma unroll
        for (int off = kLanes / 2; off > 0; off /= 2) logit[h][r] += __shfl_xor_sync(kFullMask, logit[h][r], off);
      }
    }

    // Online softmax, warp-uniform per head: the step maximum is reduced over the token groups, so
    // every lane of the warp holds the same running max and the rescale branch never diverges.
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
      float step_max = neg_inf();
#pragma unroll
      for (int r = 0; r < kRounds; ++r) step_max = valid[r] ? fmaxf(step_max, logit[h][r]) : step_max;
#pragma unroll
      for (int off = kLanes; off < kWarpSize; off *= 2) step_max = fmaxf(step_max, __shfl_xor_sync(kFullMask, step_max, off));
      if (step_max > run_max[h]) {
        // exp2f(-inf) == 0 on the first step, and acc/run_sum are still 0 then.
        const float alpha = exp2f(run_max[h] - step_max);
        run_max[h] = step_max;
        run_sum[h] *= alpha;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[h][e] *= alpha;
      }
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const float p = valid[r] ? exp2f(logit[h][r] - run_max[h]) : 0.0f;
        logit[h][r] = p;  // reuse: probabilities from here on
        run_sum[h] += p;
      }
    }

    // acc += p * v, converting each V vector to fp32 once for all heads of the tile.
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float vf[kVec];
        Traits::unpack(v_raw[r][c], vf);
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[h][c * kVec + e] = fmaf(logit[h][r], vf[e], acc[h][c * kVec + e]);
        }
      }
    }
  }

  // Merge the token groups of each warp (they share the warp-uniform running max), then publish the
  // warp's (max, sum, acc) for the cross-warp merge. A warp that saw no token has max -inf and adds 0.
#pragma unroll
  for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
    for (int off = kLanes; off < kWarpSize; off *= 2) {
      run_sum[h] += __shfl_xor_sync(kFullMask, run_sum[h], off);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[h][e] += __shfl_xor_sync(kFullMask, acc[h][e], off);
    }
  }
  if (token_lane == 0) {
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int d0 = (dim_lane + c * kLanes) * kVec;
#pragma unroll
        for (int e = 0; e < kVec; ++e) s_acc[warp][h][d0 + e] = acc[h][c * kVec + e];
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
      s_max[warp][h] = run_max[h];
      s_sum[warp][h] = run_sum[h];
    }
  }
  __syncthreads();

  // Cross-warp merge. Warp 0 always saw the partition's first token, so the block max is finite and
  // the block sum is >= 1.
  for (int i = threadIdx.x; i < HEADS_PER_BLOCK * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float block_max = s_max[0][h];
#pragma unroll
    for (int w = 1; w < kDecodeWarps; ++w) block_max = fmaxf(block_max, s_max[w][h]);
    float total = 0.0f;
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float weight = exp2f(s_max[w][h] - block_max);
      total = fmaf(s_sum[w][h], weight, total);
      value = fmaf(s_acc[w][h][d], weight, value);
    }
    const float result = value / total;
    if (num_partitions == 1) {
      out[static_cast<long long>(seq) * out_stride_seq + static_cast<long long>(head0 + h) * out_stride_head + d] =
          Traits::from_float(result);
    } else {
      const long long row = (static_cast<long long>(seq) * num_heads + head0 + h) * num_partitions + part;
      partial_out[row * HEAD_DIM + d] = result;
      if (d == 0) {
        partial_max[row] = block_max;
        partial_sum[row] = total;
      }
    }
  }
}

// Merge the split-K partitions of one (sequence, head):
//   M = max_p m_p,  w_p = s_p * 2^(m_p - M),  out = sum_p w_p * o_p / sum_p w_p
// over the partitions that hold tokens (p < ceil(len / partition_size)); o_p is already normalized by
// s_p, so w_p re-weights each partition by its share of the softmax mass.
// Grid:  x = num_heads, y = num_seqs.  Block: kReduceThreads threads; thread i owns dims i, i + 128, ...
// Dynamic shared memory: num_partitions floats (the weights w_p).
template <typename scalar_t>
__global__ void __launch_bounds__(kReduceThreads) paged_attention_reduce_kernel(
    scalar_t* __restrict__ out,               // [num_seqs, num_heads, head_dim] (strides out_stride_seq, out_stride_head)
    const float* __restrict__ partial_out,    // [num_seqs, num_heads, num_partitions, head_dim]
    const float* __restrict__ partial_max,    // [num_seqs, num_heads, num_partitions] (log2 domain)
    const float* __restrict__ partial_sum,    // [num_seqs, num_heads, num_partitions]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int num_heads, const int head_dim, const int num_partitions, const int partition_size,
    const int out_stride_seq, const int out_stride_head) {
  using Traits = VecTraits<scalar_t>;
  extern __shared__ float s_weight[];  // [num_partitions]
  __shared__ float s_scratch[kReduceThreads / kWarpSize];

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = seq_lens[seq];
  scalar_t* out_row = out + static_cast<long long>(seq) * out_stride_seq + static_cast<long long>(head) * out_stride_head;
  const int used = min(num_partitions, (seq_len + partition_size - 1) / partition_size);
  if (used <= 0) {
    for (int d = threadIdx.x; d < head_dim; d += kReduceThreads) out_row[d] = Traits::from_float(0.0f);
    return;
  }
  const long long row0 = (static_cast<long long>(seq) * num_heads + head) * num_partitions;

  float local_max = neg_inf();
  for (int p = threadIdx.x; p < used; p += kReduceThreads) local_max = fmaxf(local_max, partial_max[row0 + p]);
  const float global_max = block_max<kReduceThreads>(local_max, s_scratch);

  float local_total = 0.0f;
  for (int p = threadIdx.x; p < used; p += kReduceThreads) {
    const float w = partial_sum[row0 + p] * exp2f(partial_max[row0 + p] - global_max);
    s_weight[p] = w;
    local_total += w;
  }
  const float total = block_sum<kReduceThreads>(local_total, s_scratch);  // also orders s_weight writes
  const float inv_total = 1.0f / total;

  for (int d = threadIdx.x; d < head_dim; d += kReduceThreads) {
    float value = 0.0f;
    for (int p = 0; p < used; ++p) value = fmaf(s_weight[p], partial_out[(row0 + p) * head_dim + d], value);
    out_row[d] = Traits::from_float(value * inv_total);
  }
}

}  // namespace kvstore

#ifndef __CUDACC_RTC__
// Every configuration the launcher can request (kernels/cuda.py: decode_kernel_name), instantiated for
// the nvcc check in CI. tests/kernels/test_planning.py keeps this list and the launcher in step.
#define KV_INSTANTIATE_DECODE(T, D, H)                                                                            \
  template __global__ void kvstore::paged_attention_decode_kernel<T, D, H>(                                      \
      T*, float*, float*, float*, const T*, const T*, const T*, const int*, const int*, int, int, int, int, float, \
      int, int, int, int, int, int, int, int, int, int, int);
#define KV_INSTANTIATE_DECODE_HEADS(T, D) \
  KV_INSTANTIATE_DECODE(T, D, 1)          \
  KV_INSTANTIATE_DECODE(T, D, 2)          \
  KV_INSTANTIATE_DECODE(T, D, 4)          \
  KV_INSTANTIATE_DECODE(T, D, 8)
#define KV_INSTANTIATE_DECODE_DTYPE(T) \
  KV_INSTANTIATE_DECODE_HEADS(T, 64)   \
  KV_INSTANTIATE_DECODE_HEADS(T, 128)  \
  KV_INSTANTIATE_DECODE_HEADS(T, 256)
#define KV_INSTANTIATE_REDUCE(T)                                                                              \
  template __global__ void kvstore::paged_attention_reduce_kernel<T>(T*, const float*, const float*, const float*, \
                                                                     const int*, int, int, int, int, int, int);

KV_INSTANTIATE_DECODE_DTYPE(float)
KV_INSTANTIATE_DECODE_DTYPE(__half)
KV_INSTANTIATE_DECODE_DTYPE(__nv_bfloat16)
KV_INSTANTIATE_REDUCE(float)
KV_INSTANTIATE_REDUCE(__half)
KV_INSTANTIATE_REDUCE(__nv_bfloat16)
#endif
