// NVFP4 x BF16 GEMM for few rows of x (M <= 16): out[M, N] = x[M, K] @ W[N, K]^T.
// Compiled at run time by NVRTC (qerl_lib/kernels/mma.py), once per launch shape; the shape
// comes in as the macros T_TILES, WARPS_R, WARPS_K, NB, DEPTH, MIN_CTAS, PREFETCH, L2_HINT, LORA_R,
// LORA_EXPAND, LORA_GIVEN, LORA_MAX_SLICES and KERNEL_NAME.
//
// Layout read in place (compressed-tensors): W codes as u32 words [N, K/8] (code k of a row is
// nibble k%8 of word k/8), E4M3 block scales as bytes [N, K/16], fp32 global scale gs[1]
// (the encode factor: w = fp4 * s / gs). x bf16 [M, ldx], out bf16 [M, ldo]. K % 128 == 0.
//
// Loads: each warp keeps DEPTH - 1 chunks of weights and scales in flight in a register ring,
// addressed with immediate offsets from pointers that advance once per DEPTH chunks; x is read
// per chunk through L1 (every warp on the same K columns reads it). Decoding is kept to two
// integer-pipe ops per code pair (mask, final mask; the multiply runs on the FMA pipe), and the
// E4M3 scales come from a 256-entry table in shared memory: the kernel is bound by the integer
// pipe as much as by DRAM (Nsight Compute on an H200; dev/LOG.md), so every op counts.
//
// Work split. A CTA owns ROWS_PER_CTA = 16 * T_TILES * WARPS_R output rows and a K-slice of
// `chunks_per_split` chunks of 128 (blockIdx.y picks the slice; the grid is n_row_blocks x n_split).
// Warp (wr, wk) owns T_TILES m16-tiles of rows and every WARPS_K-th chunk of the slice; the WARPS_K
// partial sums meet in shared memory and are added in a fixed order. Slices (n_split > 1) write fp32 partials;
// the last CTA of a row block to finish (atomic counter, reset afterwards) adds them in slice
// order and writes bf16. Every sum has a fixed order, so results are deterministic.
//
// Swap-AB mma.sync.m16n8k16: the weights are operand A (16 rows x 16 k, from registers), x is
// operand B (16 k x 8 tokens). K is relabelled so that each thread's A fragment comes from one
// 16-byte load per row and chunk: thread (g = lane/4, t = lane%4) reads codes 32t..32t+31 of
// rows g and g+8 (four u32 words). Word w feeds two MMA steps; step P (0 or 2) uses the code
// pairs (P, P+4) and (P+1, P+5) of the word, because a pair (i, i+4) sits 16 bits apart and
// becomes one bf16x2 register with a mask, a multiply and a mask (code_pair_even/odd; the odd
// pair's multiplier absorbs its 4-bit offset, and v >> 8 serves pairs 2 and 3). x is permuted the same way
// (prmt), so the dot product is unchanged: only the order of its terms moves.
//
// Launch order (qerl_lib/kernels/pdl.py): the kernel may start while the previous one in the stream runs
// (programmatic dependent launch). Until griddepcontrol.wait it reads only weights, scales and
// constants; after it, it lets the next kernel launch (griddepcontrol.launch_dependents).
//
// LoRA (LORA_R > 0: the group's stacked adapter ranks, R; the device functions are in mma_lora.cuh). The launch is
// 1-D: LoRA CTAs (K-slices x blocks of 16 ranks) and the GEMM's row blocks x K-slices. Each CTA first draws a
// ticket (atomic counter): the first tickets go to LoRA CTAs, which compute xa = bf16(x @ A^T) (lora_shrink); the
// others are GEMM CTAs (tile = ticket - LoRA CTAs). A GEMM CTA's epilogue waits until every rank block of xa is
// written -- the LoRA CTAs drew their tickets first, so they are running and wait on nothing: no deadlock whatever
// the scheduling order -- and adds scale * xa @ B^T to each of its outputs, rounding once (as addmm). The last CTA
// to finish resets the counters.
// With LORA_EXPAND 0 the launch only makes xa ("shrink in the GEMM"): the LoRA CTAs are the first blockIdx.x
// (no tickets: nobody waits on them), the GEMM CTAs are the plain kernel's, and the expand is the next
// launch's job (kernels/lora.py's, which waits for this whole grid, LoRA CTAs included).
// With LORA_GIVEN 1 (and LORA_EXPAND 1) xa [M][R] (float32 holding bf16 values) was written by an earlier kernel
// of the stream: no LoRA CTAs, no tickets, no wait; the epilogue reads xa after griddepcontrol.wait, as it reads x.
// An epilogue that adds the adapters gives each thread whole rows of the CTA (lora_store_rows): the row's B is read
// once for every token, a few 16-byte words in flight at a time, after the CTA asked L2 for its rows of B at the
// start (a prefetch hint; B is read only after griddepcontrol.wait). Each token's dot is a chain of fmaf in rank
// order, rounded once into the output, as addmm does.
#ifndef LORA_R
#define LORA_R 0
#endif
#ifndef LORA_EXPAND
#define LORA_EXPAND 1
#endif
#ifndef LORA_GIVEN
#define LORA_GIVEN 0
#endif
#define LORA_ADDS (LORA_R > 0 && LORA_EXPAND)    // the epilogue adds scale * xa @ B^T
#define LORA_TICKETS (LORA_ADDS && !LORA_GIVEN)  // ... to an xa that this launch's LoRA CTAs make
#ifndef PREFETCH
#define PREFETCH 0  // chunks (of this warp's own, after the register ring's) prefetched into L2 before griddepcontrol.wait
#endif
#ifndef L2_HINT
#define L2_HINT 1  // weight loads: 0 plain, 1 L2::128B (MmaConfig's default), 2 L2::256B (L2 fetch size on a miss)
#endif
#include "fp4_device.cuh"  // u32/u16/u8, U4, scale_bits, mul_bf16x2, prmt, bf16 casts, epilogue

#define ROWS_PER_WARP (16 * T_TILES)
#define ROWS_PER_CTA (ROWS_PER_WARP * WARPS_R)
#define NWARPS (WARPS_R * WARPS_K)
#define MAXTOK (8 * NB)
#define RED_STRIDE (ROWS_PER_CTA + 4)

#if L2_HINT == 2
#define LOAD_STREAM_OP "ld.global.nc.L1::no_allocate.L2::256B.v4.u32"
#elif L2_HINT == 1
#define LOAD_STREAM_OP "ld.global.nc.L1::no_allocate.L2::128B.v4.u32"
#else
#define LOAD_STREAM_OP "ld.global.nc.L1::no_allocate.v4.u32"
#endif
__device__ __forceinline__ U4 load_stream(const U4* p) {  // weights: read once, keep out of L1
  U4 r;
  asm volatile(LOAD_STREAM_OP " {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p) : "memory");
}

__device__ __forceinline__ U4 load_shared_x(const U4* p) {  // x: reused by every CTA, keep in L1
  U4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ u16 load_scale_pair(const u16* p) {  // 8 B per row and chunk: the
  u16 r;                                                             // warps on the next chunks
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));    // read the same sector
  return r;
}

// Codes i and i+4 of a word as a bf16x2 holding fp4(code) * 2^-126 each: s<<15 | e1 e0 m<<6 is
// exactly that bf16 (code 1 = 0.5 lands on a subnormal). One multiply places both nibbles.
// Codes (0, 4) and (1, 5) are masked in place (the multiplier absorbs nibble 1's offset);
// codes (2, 6) and (3, 7) the same way from v >> 8. (Pair i in general: ((v >> 4i) & 0x000F000F)
// * 0x1040 & 0x81C081C0; tests/test_fp4_kernel_mma.py checks both forms agree on every code.)
__device__ __forceinline__ u32 code_pair_even(u32 v) { return ((v & 0x000F000Fu) * 0x1040u) & 0x81C081C0u; }
__device__ __forceinline__ u32 code_pair_odd(u32 v) { return ((v & 0x00F000F0u) * 0x104u) & 0x81C081C0u; }

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#include "mma_lora.cuh"  // LORA_R > 0: the LoRA CTAs and the epilogue that adds the adapters

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_CTAS)
KERNEL_NAME(const u16* __restrict__ x, const u32* __restrict__ wq, const u8* __restrict__ sc,
            const float* __restrict__ gs, const u16* __restrict__ bias, u16* __restrict__ out,
            float* __restrict__ ws, int* __restrict__ counters,
            int M, int N, int K, int ldx, int ldo, int chunks_per_split, int n_row_blocks, int n_split,
            const u16* __restrict__ la, const u16* __restrict__ lb, float* __restrict__ lxa,
            int* __restrict__ lsync, const int* __restrict__ lmem, const float* __restrict__ lscale,
            int l_members, int l_slices, int l_k_per_slice, int l_rp) {
  __shared__ float red[WARPS_K][MAXTOK][RED_STRIDE];
  __shared__ u32 scale_lut[256];  // E4M3 byte -> bf16x2 (s * 2^118, twice)
  __shared__ int is_last;
#if LORA_R > 0 && !LORA_EXPAND
  const int l_ctas = l_slices * ((LORA_R + LORA_RB - 1) / LORA_RB);
  if ((int)blockIdx.x < l_ctas) {
    lora_shrink(x, la, lxa, lsync, M, K, ldx, blockIdx.x % l_slices, l_slices, blockIdx.x / l_slices, l_k_per_slice);
    return;
  }
  const int bx = (blockIdx.x - l_ctas) % n_row_blocks, by = (blockIdx.x - l_ctas) / n_row_blocks;
#elif LORA_TICKETS
  __shared__ int ticket_sh;
  if (threadIdx.x == 0) ticket_sh = atomicAdd(&lsync[0], 1);
  __syncthreads();
  const int ticket = ticket_sh;
  const int l_blocks = (LORA_R + LORA_RB - 1) / LORA_RB, l_ctas = l_slices * l_blocks;
  const int total_ctas = l_ctas + n_row_blocks * n_split;
  if (ticket < l_ctas) {
    lora_shrink(x, la, lxa, lsync, M, K, ldx, ticket % l_slices, l_slices, ticket / l_slices, l_k_per_slice);
    lora_finish(lsync, total_ctas);
    return;
  }
  const int bx = (ticket - l_ctas) % n_row_blocks, by = (ticket - l_ctas) / n_row_blocks;
#else
  const int bx = blockIdx.x, by = blockIdx.y;
#endif
  for (int b = threadIdx.x; b < 256; b += NWARPS * 32) {
    const u32 s = scale_bits(b);
    scale_lut[b] = s | (s << 16);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wr = warp % WARPS_R, wk = warp / WARPS_R;
  const int g = lane >> 2, t = lane & 3;
  const int row_cta = bx * ROWS_PER_CTA;
  const int row_warp = row_cta + wr * ROWS_PER_WARP;
#if LORA_ADDS
  {  // this CTA's rows of B, one 128-byte line a thread, into L2 for the epilogue (a hint: read after the wait)
    const char* b_rows = reinterpret_cast<const char*>(lb + (long)row_cta * l_rp);
    const int b_bytes = (min(N, row_cta + ROWS_PER_CTA) - row_cta) * l_rp * 2;
    for (int off = threadIdx.x * 128; off < b_bytes; off += NWARPS * 32 * 128) prefetch_l2(b_rows + off);
  }
#endif
  const long words_per_row = K >> 3, scales_per_row = K >> 4;
  const int n_chunks = K >> 7;
  const int c_begin = by * chunks_per_split;
  const int c_end = min(c_begin + chunks_per_split, n_chunks);
  const int n_mine = c_end - c_begin > wk ? (c_end - c_begin - wk + WARPS_K - 1) / WARPS_K : 0;
  const int c0 = c_begin + wk;  // this warp's chunks: c0, c0 + WARPS_K, ...

  // pointers at chunk c0; chunk c0 + j * WARPS_K sits j * (4 * WARPS_K) U4 further (weights),
  // j * (4 * WARPS_K) u16 further (scales), j * (16 * WARPS_K) U4 further (x)
  const U4* wp[T_TILES][2];
  const u16* sp[T_TILES][2];
#pragma unroll
  for (int i = 0; i < T_TILES; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row_warp + i * 16 + g + 8 * h, N - 1);  // rows past N: read, never stored
      wp[i][h] = reinterpret_cast<const U4*>(wq + r * words_per_row) + t + 4 * c0;
      sp[i][h] = reinterpret_cast<const u16*>(sc + r * scales_per_row) + t + 4 * c0;
    }
  const U4* xp[NB];
  bool x_valid[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int tok = nb * 8 + g;
    x_valid[nb] = tok < M;
    xp[nb] = reinterpret_cast<const U4*>(x + (long)min(tok, M - 1) * ldx) + 4 * t + 16 * c0;
  }

  float acc[T_TILES][NB][4];
#pragma unroll
  for (int i = 0; i < T_TILES; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][nb][q] = 0.f;

  // register ring: chunk j of this warp lives in slot j % DEPTH
  U4 wbuf[DEPTH][T_TILES][2];
  u16 sbuf[DEPTH][T_TILES][2];

#define LOAD_CHUNK(slot, j, rel)                                                            \
  if ((j) < n_mine) {                                                                       \
    _Pragma("unroll") for (int i = 0; i < T_TILES; ++i)                                     \
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {                                         \
      wbuf[slot][i][h] = load_stream(wp[i][h] + (rel) * 4 * WARPS_K);                       \
      sbuf[slot][i][h] = load_scale_pair(sp[i][h] + (rel) * 4 * WARPS_K);                   \
    }                                                                                       \
  }

#pragma unroll
  for (int d = 0; d < DEPTH - 1; ++d) { LOAD_CHUNK(d, d, d) }
#if PREFETCH > 0
  if ((t & 1) == 0) {  // lanes t = 0 and 2 point at the two 32-byte sectors of their rows' chunks
#pragma unroll
    for (int j = DEPTH - 1; j < DEPTH - 1 + PREFETCH; ++j)
      if (j < n_mine) {
#pragma unroll
        for (int i = 0; i < T_TILES; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) prefetch_l2(wp[i][h] + j * 4 * WARPS_K);
      }
  }
#endif
  // Everything above reads only weights, scales and constants. With programmatic dependent
  // launch (mma_linear(pdl=True)) this CTA may be running while the previous kernel in the
  // stream still writes x: wait for it here, before the first read of x or any write.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may launch (and wait)
  __syncthreads();  // scale_lut ready

  for (int j0 = 0; j0 < n_mine; j0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int j = j0 + d;
      if (j < n_mine) {
        LOAD_CHUNK((d + DEPTH - 1) % DEPTH, j + DEPTH - 1, d + DEPTH - 1)
        // x of this chunk (L1/L2 hits: every warp on these K columns reads it), loaded here
        // rather than in the ring so that it costs no registers while in flight
        U4 xv[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int w = 0; w < 4; ++w)
            xv[nb][w] = x_valid[nb] ? load_shared_x(xp[nb] + d * 16 * WARPS_K + w) : U4{0u, 0u, 0u, 0u};
        // block scales of this chunk: groups 2t (words 0, 1) and 2t+1 (words 2, 3) per row
        u32 s2[T_TILES][2][2];
#pragma unroll
        for (int i = 0; i < T_TILES; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 pair = sbuf[d][i][h];
            s2[i][h][0] = scale_lut[pair & 0xFFu];
            s2[i][h][1] = scale_lut[pair >> 8];
          }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          u32 b[NB][2][2];  // [n8 block][step P/2][b0, b1]
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            b[nb][0][0] = prmt(xv[nb][w].x, xv[nb][w].z, 0x5410u);  // x codes (0, 4)
            b[nb][0][1] = prmt(xv[nb][w].x, xv[nb][w].z, 0x7632u);  // (1, 5)
            b[nb][1][0] = prmt(xv[nb][w].y, xv[nb][w].w, 0x5410u);  // (2, 6)
            b[nb][1][1] = prmt(xv[nb][w].y, xv[nb][w].w, 0x7632u);  // (3, 7)
          }
#pragma unroll
          for (int i = 0; i < T_TILES; ++i) {
            const u32 v0 = w == 0 ? wbuf[d][i][0].x : w == 1 ? wbuf[d][i][0].y : w == 2 ? wbuf[d][i][0].z : wbuf[d][i][0].w;
            const u32 v1 = w == 0 ? wbuf[d][i][1].x : w == 1 ? wbuf[d][i][1].y : w == 2 ? wbuf[d][i][1].z : wbuf[d][i][1].w;
            const u32 sg = s2[i][0][w >> 1], sg8 = s2[i][1][w >> 1];
#pragma unroll
            for (int p = 0; p < 2; ++p) {  // step P = 2p: code pairs (P, P+4) and (P+1, P+5)
              const u32 u0 = p ? v0 >> 8 : v0, u1 = p ? v1 >> 8 : v1;
              const u32 a0 = mul_bf16x2(code_pair_even(u0), sg);
              const u32 a1 = mul_bf16x2(code_pair_even(u1), sg8);
              const u32 a2 = mul_bf16x2(code_pair_odd(u0), sg);
              const u32 a3 = mul_bf16x2(code_pair_odd(u1), sg8);
#pragma unroll
              for (int nb = 0; nb < NB; ++nb) mma16816(acc[i][nb], a0, a1, a2, a3, b[nb][p][0], b[nb][p][1]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < T_TILES; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wp[i][h] += DEPTH * 4 * WARPS_K;
        sp[i][h] += DEPTH * 4 * WARPS_K;
      }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xp[nb] += DEPTH * 16 * WARPS_K;
  }
#undef LOAD_CHUNK

  // C fragment: c0, c1 = (row g, tokens 2t, 2t+1); c2, c3 = (row g+8, same tokens)
#pragma unroll
  for (int i = 0; i < T_TILES; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int rl = wr * ROWS_PER_WARP + i * 16 + g + (q >= 2 ? 8 : 0);
        red[wk][nb * 8 + 2 * t + (q & 1)][rl] = acc[i][nb][q];
      }
  __syncthreads();

  const float factor = __fdiv_rn(256.0f, gs[0]);
  const int m_rows = min(M, MAXTOK);
  const bool split = n_split > 1;
#if LORA_ADDS
  __shared__ float xa_sh[MAXTOK][LORA_R];
#if LORA_GIVEN
  if (!split) lora_copy_xa(lxa, &xa_sh[0][0], m_rows);
#else
  if (!split) lora_stage_xa(lsync, lxa, &xa_sh[0][0], m_rows, M, l_blocks, l_slices);
#endif
#endif
#if LORA_ADDS
  auto warp_sum = [&](int tok, int rl) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS_K; ++w) s += red[w][tok][rl];
    return s;
  };
  if (!split) {
    lora_store_rows(warp_sum, &xa_sh[0][0], lb, lmem, lscale, l_members, l_rp, factor, bias, out, ldo, row_cta, N, m_rows);
  } else
#endif
  for (int e = threadIdx.x; e < m_rows * ROWS_PER_CTA; e += NWARPS * 32) {
    const int tok = e / ROWS_PER_CTA, rl = e % ROWS_PER_CTA, row = row_cta + rl;
    if (row >= N) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS_K; ++w) s += red[w][tok][rl];
    if (split) { ws[((long)by * M + tok) * N + row] = s; continue; }
    out[(long)tok * ldo + row] = epilogue(s, factor, bias, row);
  }
  if (!split) {
#if LORA_TICKETS
    lora_finish(lsync, total_ctas);
#endif
    return;
  }

  // K-slices: the last CTA of this row block adds the partials in slice order
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&counters[bx], 1) == n_split - 1;
  __syncthreads();
  if (!is_last) {
#if LORA_TICKETS
    lora_finish(lsync, total_ctas);
#endif
    return;
  }
  __threadfence();
#if LORA_GIVEN
  lora_copy_xa(lxa, &xa_sh[0][0], m_rows);
#elif LORA_ADDS
  lora_stage_xa(lsync, lxa, &xa_sh[0][0], m_rows, M, l_blocks, l_slices);
#endif
#if LORA_ADDS
  auto slice_sum = [&](int tok, int rl) {
    float s = 0.f;
    for (int sl = 0; sl < n_split; ++sl) s += __ldcg(&ws[((long)sl * M + tok) * N + row_cta + rl]);
    return s;
  };
  lora_store_rows(slice_sum, &xa_sh[0][0], lb, lmem, lscale, l_members, l_rp, factor, bias, out, ldo, row_cta, N, m_rows);
#else
  for (int e = threadIdx.x; e < m_rows * ROWS_PER_CTA; e += NWARPS * 32) {
    const int tok = e / ROWS_PER_CTA, row = row_cta + e % ROWS_PER_CTA;
    if (row >= N) continue;
    float s = 0.f;
    for (int sl = 0; sl < n_split; ++sl) s += __ldcg(&ws[((long)sl * M + tok) * N + row]);
    out[(long)tok * ldo + row] = epilogue(s, factor, bias, row);
  }
#endif
  if (threadIdx.x == 0) counters[bx] = 0;  // ready for the next launch (and graph replay)
#if LORA_TICKETS
  lora_finish(lsync, total_ctas);
#endif
}
