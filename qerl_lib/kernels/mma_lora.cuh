// The LoRA parts of kernels/mma.cu's GEMM (included by it; NVRTC gets this file as a header, kernels/mma.py):
// the LoRA CTAs' shrink (xa = bf16(x @ A^T) by K-slices and rank blocks), the counters that order them, and the
// epilogue that adds scale * xa @ B^T to the GEMM's outputs. mma.cu's header comment says how a launch uses them.
// Needs mma.cu's launch-shape macros (NWARPS, MAXTOK, ROWS_PER_CTA), types (u16, u32, U4) and helpers
// (load_shared_x, to_bf16, from_bf16, epilogue), defined before the include.
#if LORA_R > 0
#define LORA_RB 16          // ranks per LoRA CTA
// LORA_MAX_SLICES: the most K-slices of the LoRA CTAs, defined by kernel_source (mma.py's LORA_SLICES)
#define LORA_RPW ((LORA_RB + NWARPS - 1) / NWARPS)  // ranks per warp, all at once
#if LORA_RPW >= 4
#define LORA_K_UNROLL 1     // 4 ranks' loads already in flight; two steps' would outgrow the wide shapes' registers
#else
#define LORA_K_UNROLL 2
#endif
// A LoRA CTA (K-slice `slice`, ranks 16 rb ...): fp32 partials of xa = x @ A^T over its slice, all M
// rows, into lxa[slice][tok][r]. Warp w takes the block's ranks w, w + NWARPS, ... together (LORA_RPW
// accumulators per token, each x load serving all of them); lane l the 8 columns 8l + 256i of the slice
// (16-byte loads of A and x), with 8 warps two steps' loads issued before their multiply-adds, so a warp
// waits about one memory latency per 512 columns of 2 ranks (with 4 warps: per 256 columns of 4 ranks), not
// per 256 columns of one rank. Then the warp adds its lanes'
// sums (a fixed butterfly: deterministic). The last slice of a rank block to finish (lsync[4 + rb]) adds
// the block's partials in slice order, rounds to bf16 (as the torch path's xa tensor) and writes them as
// floats after the partials (xa[tok][r] at lxa + slices * M * R), then (LORA_EXPAND) counts the block ready
// (lsync[1]).
__device__ __forceinline__ void lora_shrink_step(const u16* __restrict__ x, const u16* __restrict__ la,
                                                 float (&acc)[LORA_RPW][MAXTOK], int M, int K, int ldx,
                                                 int r0, int r_end, int k) {
  u32 aw[LORA_RPW][4];
#pragma unroll
  for (int j = 0; j < LORA_RPW; ++j) {
    const int r = r0 + j * NWARPS;
    const U4 av = r < r_end ? *reinterpret_cast<const U4*>(la + (long)r * K + k) : U4{0u, 0u, 0u, 0u};
    aw[j][0] = av.x; aw[j][1] = av.y; aw[j][2] = av.z; aw[j][3] = av.w;
  }
#pragma unroll
  for (int tk = 0; tk < MAXTOK; ++tk) {
    if (tk < M) {
      const U4 xv = load_shared_x(reinterpret_cast<const U4*>(x + (long)tk * ldx + k));
      const u32 xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int j = 0; j < LORA_RPW; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[j][tk] = fmaf(__uint_as_float(aw[j][q] << 16), __uint_as_float(xw[q] << 16), acc[j][tk]);
          acc[j][tk] = fmaf(__uint_as_float(aw[j][q] & 0xFFFF0000u), __uint_as_float(xw[q] & 0xFFFF0000u),
                            acc[j][tk]);
        }
      }
    }
  }
}

__device__ void lora_shrink(const u16* __restrict__ x, const u16* __restrict__ la, float* __restrict__ lxa,
                            int* lsync, int M, int K, int ldx, int slice, int slices, int rb, int kps) {
  __shared__ int last_sh;
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x comes from the previous kernel
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k_lo = slice * kps, k_hi = min(K, k_lo + kps);
  const int r_end = min(LORA_R, (rb + 1) * LORA_RB);
  const int r0 = rb * LORA_RB + warp;
  if (r0 < r_end) {
    float acc[LORA_RPW][MAXTOK];
#pragma unroll
    for (int j = 0; j < LORA_RPW; ++j)
#pragma unroll
      for (int tk = 0; tk < MAXTOK; ++tk) acc[j][tk] = 0.f;
#pragma unroll LORA_K_UNROLL
    for (int k = k_lo + 8 * lane; k < k_hi; k += 256) lora_shrink_step(x, la, acc, M, K, ldx, r0, r_end, k);
#pragma unroll
    for (int j = 0; j < LORA_RPW; ++j) {
      const int r = r0 + j * NWARPS;
#pragma unroll
      for (int tk = 0; tk < MAXTOK; ++tk) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[j][tk] += __shfl_xor_sync(0xFFFFFFFFu, acc[j][tk], o);
        if (lane == 0 && tk < M && r < r_end) lxa[((long)slice * M + tk) * LORA_R + r] = acc[j][tk];
      }
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_sh = atomicAdd(&lsync[4 + rb], 1) == slices - 1;
  __syncthreads();
  if (!last_sh) return;
  __threadfence();
  float* xa = lxa + (long)slices * M * LORA_R;
  const int width = r_end - rb * LORA_RB;
  for (int e = threadIdx.x; e < M * width; e += NWARPS * 32) {
    const int tk = e / width, r = rb * LORA_RB + e % width;
    float v[LORA_MAX_SLICES];
#pragma unroll
    for (int sl = 0; sl < LORA_MAX_SLICES; ++sl)  // all loads in flight at once, then the ordered sum
      v[sl] = sl < slices ? __ldcg(&lxa[((long)sl * M + tk) * LORA_R + r]) : 0.f;
    float s = 0.f;
#pragma unroll
    for (int sl = 0; sl < LORA_MAX_SLICES; ++sl) s += v[sl];
    xa[tk * LORA_R + r] = from_bf16(to_bf16(s));
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    lsync[4 + rb] = 0;
#if LORA_EXPAND
    atomicAdd(&lsync[1], 1);
#endif
  }
}

// Every CTA counts itself at its end; the last CTA of the launch (lsync[2]) resets the counters for
// the next launch and for graph replay.
__device__ void lora_finish(int* lsync, int total_ctas) {
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&lsync[2], 1) == total_ctas - 1) {
    lsync[0] = 0;
    lsync[1] = 0;
    lsync[2] = 0;
    __threadfence();
  }
}

// Wait until every rank block's xa is written, then copy xa[:m_rows] into shared memory.
__device__ void lora_stage_xa(int* lsync, const float* lxa, float* xa_sh, int m_rows, int M, int blocks, int slices) {
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<volatile int*>(&lsync[1]) < blocks) __nanosleep(32);
    __threadfence();
  }
  __syncthreads();
  const float* xa = lxa + (long)slices * M * LORA_R;
  for (int e = threadIdx.x; e < m_rows * LORA_R; e += NWARPS * 32) xa_sh[e] = __ldcg(&xa[e]);
  __syncthreads();
}

// LORA_GIVEN: copy xa[:m_rows] (written before this launch) into shared memory.
__device__ void lora_copy_xa(const float* lxa, float* xa_sh, int m_rows) {
  for (int e = threadIdx.x; e < m_rows * LORA_R; e += NWARPS * 32) xa_sh[e] = __ldcg(&lxa[e]);
  __syncthreads();
}

// The member whose output columns hold `row` (lmem: per member n0, n1, r0, rank): its first stacked rank, its rank
// and its scale; false for a row of no member (left as the GEMM made it).
__device__ __forceinline__ bool lora_member(int row, const int* __restrict__ lmem, const float* __restrict__ lscale,
                                            int l_members, int& r0, int& rank, float& scale) {
  for (int j = 0; j < l_members; ++j) {
    if (row < __ldg(&lmem[4 * j]) || row >= __ldg(&lmem[4 * j + 1])) continue;
    r0 = __ldg(&lmem[4 * j + 2]);
    rank = __ldg(&lmem[4 * j + 3]);
    scale = __ldg(&lscale[j]);
    return true;
  }
  return false;
}

#define LORA_B_GROUP 4  // 16-byte words of a B row (8 ranks each) whose loads are in flight together

// d[tok] = xa[tok][r0 : r0 + rank] . B[row][:rank] in fp32, each a chain of fmaf in rank order (addmm's terms, one
// rounding later). The row's B is read once for all tokens, LORA_B_GROUP words at a time; B rows are l_rp wide,
// zero-padded past the member's rank.
__device__ __forceinline__ void lora_dots(float (&d)[MAXTOK], const float* xa_sh, const u16* __restrict__ lb,
                                          int row, int r0, int rank, int l_rp, int m_rows) {
#pragma unroll
  for (int tok = 0; tok < MAXTOK; ++tok) d[tok] = 0.f;
  const U4* bp = reinterpret_cast<const U4*>(lb + (long)row * l_rp);
  for (int q0 = 0; q0 * 8 < rank; q0 += LORA_B_GROUP) {
    U4 bv[LORA_B_GROUP];
#pragma unroll
    for (int u = 0; u < LORA_B_GROUP; ++u) bv[u] = (q0 + u) * 8 < rank ? load_shared_x(bp + q0 + u) : U4{0u, 0u, 0u, 0u};
#pragma unroll
    for (int u = 0; u < LORA_B_GROUP; ++u) {
      const u32 bw[4] = {bv[u].x, bv[u].y, bv[u].z, bv[u].w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = 8 * (q0 + u) + i;
        if (r >= rank) continue;
        const float b = __uint_as_float(i & 1 ? bw[i >> 1] & 0xFFFF0000u : bw[i >> 1] << 16);
#pragma unroll
        for (int tok = 0; tok < MAXTOK; ++tok)
          if (tok < m_rows) d[tok] = fmaf(xa_sh[tok * LORA_R + r0 + r], b, d[tok]);
      }
    }
  }
}

// The epilogue of a launch that adds the adapters: one thread a row of the CTA, every token of it; sum(tok, rl)
// is the GEMM's fp32 result (from the warps' partials, or from the K-slices'), then the base epilogue, then
// + scale * d rounded once, as addmm does.
template <typename Sum>
__device__ __forceinline__ void lora_store_rows(Sum sum, const float* xa_sh, const u16* __restrict__ lb,
                                                const int* __restrict__ lmem, const float* __restrict__ lscale,
                                                int l_members, int l_rp, float factor, const u16* bias,
                                                u16* __restrict__ out, int ldo, int row_cta, int N, int m_rows) {
  for (int rl = threadIdx.x; rl < ROWS_PER_CTA; rl += NWARPS * 32) {
    const int row = row_cta + rl;
    if (row >= N) continue;
    int r0 = 0, rank = 0;
    float scale = 0.f, d[MAXTOK];
    const bool adapted = lora_member(row, lmem, lscale, l_members, r0, rank, scale);
    if (adapted) lora_dots(d, xa_sh, lb, row, r0, rank, l_rp, m_rows);
#pragma unroll
    for (int tok = 0; tok < MAXTOK; ++tok) {
      if (tok >= m_rows) break;
      u16 y = epilogue(sum(tok, rl), factor, bias, row);
      if (adapted) y = to_bf16(from_bf16(y) + scale * d[tok]);
      out[(long)tok * ldo + row] = y;
    }
  }
}
#endif
