// NVFP4 x BF16 GEMM at training sizes, register-A wgmma (Hopper): out[M, N] = x[M, K] @ W[N, K]^T.
// Compiled at run time by NVRTC for sm_90a (qerl_lib/kernels/fp4_ra.py, which explains the design); the launch
// shape comes in as TOK (rows of x per tile: wgmma's N), STAGES and KERNEL_NAME, and the macro WGMMA (the wgmma
// instruction with its TOK / 2 accumulator operands, generated in Python).
//
// Layout read in place (compressed-tensors): W codes as bytes [N, K/2] (code k of a row is nibble k%2 of byte
// k/2), E4M3 block scales as bytes [N, K/16], fp32 global scale gs[1] (w = fp4 * s / gs). x bf16 [M, ldx],
// out bf16 [M, ldo], scale rows ldsc bytes apart. K % 64 == 0, N % 8 == 0. x and W arrive by TMA through the two
// tensor maps.
//
// Persistent: a CTA walks a list of units (unit_of: whole tiles of 128 weight rows x TOK rows of x, then a share of
// the K-steps of the tiles left over when they would fill only part of a last wave) and builds its decode table once.
//
// One CTA: 3 warpgroups. Warpgroup 0 is the producer: one thread waits for a stage's "empty" mbarrier and issues
// the TMA copies of a K-step of 64 (the x tile [TOK, 64] with the 128-byte swizzle wgmma reads, and the W tile
// [128 rows, 32 bytes] with the 32-byte swizzle) that complete its "full" mbarrier; its ring position runs on from
// unit to unit, so the next unit's first stages load while the consumers finish a tile. Warpgroups 1 and 2 are the
// consumers, 64 weight rows each (swap-AB: the weights are wgmma's A operand, in registers; x is B, in shared
// memory). Per K-step a consumer waits for "full" of the next step, reads its rows' 32 bytes from shared memory
// and decodes its 4 k16 fragments in natural K order, issues this step's 4 wgmma (decoded the step before) as one
// group, waits until only that group is in flight, and then each of its warps arrives on the "empty" barrier of
// the step before (count 8: one arrive per consumer warp, no barrier between the two warpgroups). A registers
// rotate through three sets (the loop is unrolled by three), so no set an MMA in flight reads is rewritten.
//
// Natural K order: fragment register (row r, k pair 2t, 2t+1 of k16 step s) holds the two nibbles of byte 8s + t
// of the row's 32 bytes, (row r, pair 2t+8, 2t+9) those of byte 8s + t + 4. A table in shared memory turns a byte
// into its two codes as bf16 bits of fp4 * 2^-126 (natural_pair: mma.cu's pair trick); it is replicated per lane,
// so every lane reads its own bank, and one prmt makes the address (the byte, above the lane's offset). The producer
// warpgroup writes each stage's block scales as bf16x2 words of the exact s * 2^118 (twice), one 16-byte row of 4
// per weight row. A fragment register is then prmt, ld.shared and one packed mul.rn.bf16x2 by the scale:
// fp4 * s * 2^-8, exact.
//
// Epilogue: out = bf16(acc * 2^8/gs) (+ bias after the cast), each consumer warpgroup staging its 64 columns through
// its own shared-memory buffer, EPI_TOK rows of x at a time, and storing 16-byte rows; rows of x past M and weight
// rows past N are not stored (TMA read them as zeros). A split tile's partial sums go through global memory
// (`partial`, fp32) and a per-tile arrival counter (`arrived`, zero before the launch and left zero after it).
// BACKWARD = 1 compiles the backward layout, dx[M, K] = dy[M, N] @ W[N, K] (the input gradient), from the same bytes:
// a tile is 128 columns of W (K, the output) x TOK rows of dy, a K-step is 64 rows of W (N, the reduction). The
// fragment pair (2t, 2t + 1) now comes from two rows of W with their own block scales, so the producer warpgroup
// repacks each step: the raw [64 rows, 64 bytes] W tile and its block scales arrive by TMA in a ring of RAW_SLOTS
// stages loaded RAW_SLOTS - 2 K-steps ahead, and the producer writes for each consumer lane its 16 byte values
// (row pair's two codes at one column) as halfword table addresses (value << 7 | 4 lane: the table is packed to
// 128-byte entries) and its 8 pairs of block scales as bf16x2 words. The consumer's decode is then one extraction,
// one table load and one multiply a fragment register, as in the forward. The producer's repack, ~180 instructions a
// K-step in each of its warps, is what bounds this layout (dev/LOG.md section 76): it is not on a default path.
#include "fp4_device.cuh"
typedef unsigned long long u64;
struct __align__(64) TensorMap { u64 v[16]; };  // CUtensorMap, filled on the host (cuTensorMapEncodeTiled)

// BK (K per stage), ROWS (weight rows per CTA), EPI_TOK (rows of x per epilogue chunk), STAGED_STRIDE (bf16 per
// staged output row of a warpgroup) and TABLE_BYTES (the decode table: 256 entries x 32 lanes' code words, the upper
// 128 B of each unused; the backward's is packed to 128-byte entries) come from fp4_ra.py, which sizes the shared
// memory from the same numbers.
#ifndef BACKWARD
#define BACKWARD 0
#endif
// Registers per thread after setmaxnreg (the CTA's pool is 384 x 168): the consumers need 128 for the accumulators of
// a 256-row tile of x; the backward's producer needs more than the forward's for its repack (its loads in flight).
#if BACKWARD
#define PRODUCER_REGS "56"
#define CONSUMER_REGS "224"
#else
#define PRODUCER_REGS "40"
#define CONSUMER_REGS "232"
#endif
#define X_BYTES (TOK * BK * 2)         // x tile of a stage
#if BACKWARD
#define W_BYTES (ROWS * BK)            // the repacked weights: 256 consumer lanes x 16 halfword table addresses
#define S_BYTES (ROWS * 8)             // 8 blocks x 4 lane columns x 8 bf16x2 scale pairs
#define RAW_BYTES (BK * ROWS / 2)      // a raw W tile: 64 rows x 64 bytes
#define RAW_SLOT_BYTES (RAW_BYTES + BK * 16)  // and its rows' block scales: 64 rows x 16 bytes
#else
#define W_BYTES (ROWS * BK / 2)        // weight tile of a stage
#define S_BYTES (ROWS * 16)            // the weight rows' 4 block scales of a stage, as bf16x2 words
#endif
#define STAGE_BYTES (X_BYTES + W_BYTES + S_BYTES)
#define STAGING_BYTES (EPI_TOK * STAGED_STRIDE * 2)
#ifndef PROBE
#define PROBE 0  // diagnostics only (dev/LOG.md sections 72, 74, 76): 1 = no weight decode, 2 = no MMA, 3 = no
                // epilogue, 4 = (backward) no repack by the producer
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(  // labels inside { } are local to the block, so every inlined copy may reuse them
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      :: "r"(dst), "l"((u64)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 r;
  asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr));  // the table: constant once built
  return r;
}
__device__ __forceinline__ void sts128(u32 addr, U4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void stsm_x4_trans(u32 addr, const u32* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// Two outputs of one weight row as bf16x2 (lo: the first row of x): bf16(acc * 2^8/gs), then + bias after the cast.
__device__ __forceinline__ u32 out_pair(float lo, float hi, float factor, bool has_bias, u16 b) {
  if (has_bias) return (u32)add_bias(to_bf16(lo * factor), b) | ((u32)add_bias(to_bf16(hi * factor), b) << 16);
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi * factor), "f"(lo * factor));
  return d;
}
__device__ __forceinline__ U4 lds128(u32 addr) {
  U4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}

// wgmma B descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart, start address >> 4 (shared memory
// addresses are below 2^18, so adding (offset >> 4) to a descriptor moves its start address without carrying).
__device__ __forceinline__ u64 x_desc(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// Byte t of w (shift = 8t) as a bf16x2 of its codes times 2^-126: low nibble -> low half, high -> high half.
__device__ __forceinline__ u32 natural_pair(u32 w, u32 shift) {
  const u32 u = w >> shift;
  const u32 both = (u & 0xFu) | ((u << 12) & 0xF0000u);
  return (both * 0x1040u) & 0x81C081C0u;
}

// Prevents the compiler from moving accumulator reads or writes across the asynchronous MMAs.
__device__ __forceinline__ void fence_acc(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Holds a step's fragment registers and B descriptor as computed before this point, the step's wgmma.fence: ptxas
// serializes every wgmma (C7513) when a register that a wgmma reads is written after the fence.
__device__ __forceinline__ void decoded(const u32* a, u64 desc) {
  asm volatile("" :: "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc) : "memory");
}

// One unit of a CTA's work: K-steps [kb, ke) of tile `tile` (tiles are numbered with the rows of x fastest: tile t
// covers weight rows 128 * (t / m_tiles) and rows of x TOK * (t % m_tiles)). A CTA first takes whole tiles
// blockIdx.x, blockIdx.x + gridDim.x, ... below dp_tiles; then, if blockIdx.x < sk_ctas, the K-steps
// [sk_per * blockIdx.x, sk_per * (blockIdx.x + 1)) of the tiles from dp_tiles on, flattened tile by tile (the split
// tail: a tile whose K-steps several CTAs share is summed by the last of them to finish). `slot` says which of the
// CTA's two partial-sum buffers a split unit uses (0: the first unit of its range, 1: the last).
struct Unit { int tile, kb, ke, slot; };

__device__ __forceinline__ bool unit_of(int u, int n_steps, int tiles, int dp_tiles, int sk_per, int sk_ctas,
                                        Unit& un) {
  const int cta = blockIdx.x, grid = gridDim.x;
  const int n_dp = cta < dp_tiles ? (dp_tiles - cta + grid - 1) / grid : 0;
  if (u < n_dp) {
    un.tile = cta + u * grid, un.kb = 0, un.ke = n_steps, un.slot = 0;
    return true;
  }
  const int v = u - n_dp;
  if (cta >= sk_ctas) return false;
  const int start = cta * sk_per, end = min(start + sk_per, (tiles - dp_tiles) * n_steps);
  const int pos = v == 0 ? start : (start / n_steps + v) * n_steps;
  if (pos >= end) return false;
  const int local = pos / n_steps;
  un.tile = dp_tiles + local, un.kb = pos - local * n_steps, un.ke = min(n_steps, un.kb + end - pos);
  un.slot = v == 0 ? 0 : 1;
  return true;
}

#if BACKWARD
#include "fp4_ra_backward.cuh"
#endif

extern "C" __global__ void __launch_bounds__(384, 1)
KERNEL_NAME(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map,
            const __grid_constant__ TensorMap s_map, const u8* __restrict__ sc, const float* __restrict__ gs,
            const u16* __restrict__ bias,
            u16* __restrict__ out, float* __restrict__ partial, int* __restrict__ arrived, int M, int N, int K,
            int ldo, int ldsc, int m_tiles, int dp_tiles, int sk_per, int sk_ctas) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;  // 128-byte swizzled tiles want 1024-byte alignment
  const u32 table = base + STAGES * STAGE_BYTES;  // TABLE_BYTES: the decode table (below)
  const u32 staging = table + TABLE_BYTES;        // STAGING_BYTES: the epilogue's, per consumer warpgroup
#if BACKWARD
  const u32 raw_ring = staging + 2 * STAGING_BYTES;  // RAW_SLOTS x RAW_BYTES (1024-byte aligned: the swizzle)
  const u32 bars = raw_ring + RAW_SLOTS * RAW_SLOT_BYTES;
  const u32 raw_full = bars + 16 * STAGES + 8;  // after full, empty and the flags; then raw_empty[RAW_SLOTS]
#else
  const u32 bars = staging + 2 * STAGING_BYTES;   // full[STAGES], empty[STAGES], then one flag per consumer
#endif
  const int n_steps = K / BK;
  const int tiles = m_tiles * ((N + ROWS - 1) / ROWS);
  const int wg = threadIdx.x >> 7;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 5);  // the TMA thread's expect_tx and one arrive per producer warp (the scales)
      mbar_init(bars + 8 * (STAGES + s), 8);
    }
#if BACKWARD
    for (int s = 0; s < RAW_SLOTS; ++s) {
      mbar_init(raw_full + 8 * s, 1);
      mbar_init(raw_full + 8 * (RAW_SLOTS + s), 4);  // raw_empty: one arrive per producer warp
    }
#endif
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

#if BACKWARD
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 " PRODUCER_REGS ";");
    backward_producer(x_map, w_map, s_map, n_steps, tiles, m_tiles, dp_tiles, sk_per, sk_ctas, base, raw_ring, bars,
                      raw_full, raw_full + 8 * RAW_SLOTS, smem_raw, raw);
    return;
  }
#else
  if (wg == 0) {  // producer: the ring position g runs on across units, so a unit's first stages load early
    asm volatile("setmaxnreg.dec.sync.aligned.u32 " PRODUCER_REGS ";");
    // Thread 0 issues the TMA copies; every thread also converts the 4 block scales of one weight row (its index)
    // for the stage into bf16x2 words (s * 2^118, twice), which the consumers read with one 16-byte load a row.
    Unit un;
    u32 g = 0;
    const int lane = threadIdx.x & 31;
    for (int u = 0; unit_of(u, n_steps, tiles, dp_tiles, sk_per, sk_ctas, un); ++u) {
      const int n0 = (un.tile / m_tiles) * ROWS, tok0 = (un.tile % m_tiles) * TOK;
      const u32* srow = reinterpret_cast<const u32*>(sc + (long)min(n0 + (int)threadIdx.x, N - 1) * ldsc);
      for (int i = un.kb; i < un.ke; ++i, ++g) {
        const int slot = g % STAGES;
        const u32 bytes4 = srow[i];
        const u32 full = bars + 8 * slot, tile = base + slot * STAGE_BYTES;
        if (threadIdx.x == 0) {  // one thread polls the stage's "empty" barrier; the others wait at a hardware barrier
          mbar_wait(bars + 8 * (STAGES + slot), ((g / STAGES) & 1) ^ 1);
          mbar_expect_tx(full, X_BYTES + W_BYTES);
          tma_load_2d(tile, &x_map, i * BK, tok0, full);
          tma_load_2d(tile + X_BYTES, &w_map, i * (BK / 2), n0, full);
        }
        asm volatile("bar.sync 4, 128;" ::: "memory");  // the stage is free: its scales may be written
        U4 v;
        v.x = scale_bits(bytes4 & 0xFFu), v.y = scale_bits((bytes4 >> 8) & 0xFFu);
        v.z = scale_bits((bytes4 >> 16) & 0xFFu), v.w = scale_bits(bytes4 >> 24);
        v.x |= v.x << 16, v.y |= v.y << 16, v.z |= v.z << 16, v.w |= v.w << 16;
        sts128(tile + X_BYTES + W_BYTES + 16 * threadIdx.x, v);
        __syncwarp();
        if (lane == 0) mbar_arrive(full);
      }
    }
    return;
  }
#endif
  asm volatile("setmaxnreg.inc.sync.aligned.u32 " CONSUMER_REGS ";");

  // The decode table, built once while the producer's first copies fly: entry b (256 bytes) holds, for each lane
  // l, the codes of byte b as bf16x2 (natural_pair) at 4l (the entry's second half is not used). Each lane reads
  // only its own bank, and one prmt gives a lane's address: byte b above lane * 4.
  {
    u32* tab = reinterpret_cast<u32*>(smem_raw + (table - raw));
#if BACKWARD  // packed: word (b, lane) at 32 b + lane (the producer writes the addresses)
    for (int idx = threadIdx.x - 128; idx < TABLE_BYTES / 4; idx += 256) tab[idx] = natural_pair((u32)idx >> 5, 0);
#else
    for (int idx = threadIdx.x - 128; idx < TABLE_BYTES / 8; idx += 256) {
      const u32 b = (u32)idx >> 5;
      tab[2 * idx - (idx & 31)] = natural_pair(b, 0);  // word (b, lane) at 64 b + lane
    }
#endif
    asm volatile("bar.sync 1, 256;" ::: "memory");
  }

  // consumer warpgroup c (0, 1): weight rows 64c .. 64c + 63 of each tile
  const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, ct = threadIdx.x & 127;
  const int g = lane >> 2, t = lane & 3;
  const int rl0 = 64 * c + 16 * warp + g;  // rows rl0 and rl0 + 8 (same 32-byte swizzle phase)
#if BACKWARD
  const int cb = threadIdx.x - 128;  // the consumer lane among both warpgroups' 256 (the producer's numbering)
#else
  const u32 swz = (u32)((rl0 >> 2) & 1);
  const u32 code_lane = 4u * lane;  // the low byte of a table address
  const u32 code_sel = 0x5504u | (t << 4);  // prmt: byte t of a word above code_lane
#endif

  float acc[TOK / 2];
  // Step j's fragments (j counted from the unit's first step) go to register set j % 3 and are decoded one step
  // before its MMAs are issued: ptxas serializes every wgmma (C7513) when a register that a wgmma reads is written
  // while an earlier wgmma whose wait comes after that wgmma is in flight. So while step i - 1's MMAs run, step
  // i + 1 decodes and step i's (decoded the step before) issue; three sets are live at once.
  u32 a[3][4][4];   // [set][k16 step][fragment register]

  const u64 desc_base = x_desc(base);
  Unit un;
  u32 g0 = 0;  // ring position of the unit's first K-step (unsigned: % and / by STAGES are then cheap)
  for (int u = 0; unit_of(u, n_steps, tiles, dp_tiles, sk_per, sk_ctas, un); ++u) {
    // the main loop counts the unit's steps from 0: len of them, the first is K-step un.kb, at ring position g0
    const int len = un.ke - un.kb;
#pragma unroll
    for (int i = 0; i < TOK / 2; ++i) acc[i] = 0.f;

#if BACKWARD
// Consumer lane cb's 16 halfword table addresses (2 per word: word 2s + h holds rows r and r + 8 of pair column
// 2t + 8h of k16 step s) and its warp's block's 8 scale pairs (word 2s + h, both rows) -> the 4 k16 fragments of the
// step.
#define DECODE(Q, J)                                                                                    \
  {                                                                                                     \
    const u32 ring = g0 + (J), slot = ring % STAGES;                                                    \
    mbar_wait(bars + 8 * slot, (ring / STAGES) & 1);                                                    \
    const u32 stage = base + slot * STAGE_BYTES;                                                        \
    const u32 mine = stage + X_BYTES + 16 * packed_slot(cb);                                          \
    const U4 q0 = lds128(mine), q1 = lds128(mine + W_BYTES / 2);                                      \
    const u32 sp = stage + X_BYTES + W_BYTES + 32 * (4 * (cb >> 5) + t);                                \
    const U4 p0 = lds128(sp), p1 = lds128(sp + 16);                                                     \
    const u32 hw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};                                 \
    const u32 ps[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};                                 \
    _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                                     \
      _Pragma("unroll") for (int h = 0; h < 2; ++h) {                                                   \
        const u32 w = hw[2 * s + h], sc2 = ps[2 * s + h];                                               \
        /* probe 4 leaves the addresses unwritten: keep them inside the table and 4-byte aligned */       \
        const u32 lo = PROBE == 4 ? w & 0x7FFCu : w & 0xFFFFu, hi = PROBE == 4 ? (w >> 16) & 0x7FFCu : w >> 16; \
        a[Q][s][2 * h] = PROBE == 1 ? w ^ sc2 : mul_bf16x2(lds32(table + lo), sc2);                     \
        a[Q][s][2 * h + 1] = PROBE == 1 ? sc2 : mul_bf16x2(lds32(table + hi), sc2);                     \
      }                                                                                                 \
    }                                                                                                   \
  }
#else
#define DECODE(Q, J)                                                                                    \
  {                                                                                                     \
    const u32 ring = g0 + (J), slot = ring % STAGES;                                                    \
    mbar_wait(bars + 8 * slot, (ring / STAGES) & 1);                                                    \
    const u32 wrow = base + slot * STAGE_BYTES + X_BYTES + 32 * rl0;                                    \
    const U4 w00 = lds128(wrow + 16 * (0 ^ swz)), w01 = lds128(wrow + 16 * (1 ^ swz));                  \
    const U4 w10 = lds128(wrow + 256 + 16 * (0 ^ swz)), w11 = lds128(wrow + 256 + 16 * (1 ^ swz));     \
    const u32 srow = base + slot * STAGE_BYTES + X_BYTES + W_BYTES + 16 * rl0;                          \
    const U4 sc0 = lds128(srow), sc1 = lds128(srow + 128);                                              \
    const u32 s0s[4] = {sc0.x, sc0.y, sc0.z, sc0.w}, s1s[4] = {sc1.x, sc1.y, sc1.z, sc1.w};             \
    const u32 lo0[4] = {w00.x, w00.z, w01.x, w01.z}, hi0[4] = {w00.y, w00.w, w01.y, w01.w};             \
    const u32 lo1[4] = {w10.x, w10.z, w11.x, w11.z}, hi1[4] = {w10.y, w10.w, w11.y, w11.w};             \
    _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                                     \
      const u32 s0 = s0s[s], s1 = s1s[s];                                                               \
      a[Q][s][0] = PROBE == 1 ? s0 : mul_bf16x2(lds32(table + prmt(lo0[s], code_lane, code_sel)), s0); \
      a[Q][s][1] = PROBE == 1 ? s1 : mul_bf16x2(lds32(table + prmt(lo1[s], code_lane, code_sel)), s1); \
      a[Q][s][2] = PROBE == 1 ? s0 ^ lo0[0] : mul_bf16x2(lds32(table + prmt(hi0[s], code_lane, code_sel)), s0); \
      a[Q][s][3] = PROBE == 1 ? s1 ^ lo1[0] : mul_bf16x2(lds32(table + prmt(hi1[s], code_lane, code_sel)), s1); \
    }                                                                                                   \
  }
#endif

#define CONSUME(P)                                                                                      \
  {                                                                                                     \
    const int i = i0 + (P);                                                                             \
    const u32 ring = g0 + i;                                                                            \
    if (i + 1 < len) DECODE(((P) + 1) % 3, i + 1)                                                        \
    const u64 desc0 = desc_base + (u32)((ring % STAGES) * (STAGE_BYTES >> 4));                          \
    u64 desc[4];                                                                                        \
    _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                                     \
      desc[s] = desc0 + 2 * s;  /* the start address field (bits 0-13) moves 32 bytes; it cannot carry */ \
      decoded(a[P][s], desc[s]);                                                                        \
    }                                                                                                   \
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");                                             \
    if (PROBE != 2) {                                                                                   \
      _Pragma("unroll") for (int s = 0; s < 4; ++s) WGMMA(acc, a[P][s], desc[s]);                       \
    } else {                                                                                            \
      _Pragma("unroll") for (int s = 0; s < 4; ++s) acc[s] += __uint_as_float(a[P][s][0] ^ a[P][s][3]); \
    }                                                                                                   \
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");                                      \
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");                                      \
    if (i > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + (ring - 1) % STAGES));                    \
  }

    DECODE(0, 0)
    for (int i0 = 0; i0 < len; i0 += 3) {
      CONSUME(0)
      if (i0 + 1 < len) CONSUME(1)
      if (i0 + 2 < len) CONSUME(2)
    }
#undef CONSUME
#undef DECODE
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int r = 0; r < TOK / 2; ++r) fence_acc(acc[r]);
    g0 += len;
    if (lane == 0) mbar_arrive(bars + 8 * (STAGES + (g0 - 1) % STAGES));
    {  // the unit again, from a copy of u that the compiler cannot see through: recomputing it is cheaper than
       // keeping its fields live through the main loop (they would take registers the accumulators need)
      int u_again;
      asm volatile("mov.b32 %0, %1;" : "=r"(u_again) : "r"(u));
      unit_of(u_again, n_steps, tiles, dp_tiles, sk_per, sk_ctas, un);
    }
    const int n0 = (un.tile / m_tiles) * ROWS, tok0 = (un.tile % m_tiles) * TOK;
    const u32 flag = bars + 16 * STAGES + 4 * c, staged = staging + c * STAGING_BYTES;

    bool store = true;
    if (un.kb != 0 || un.ke != n_steps) {
      // A split tile. Its K-steps belong to CTAs first..last; each counts itself in on the tile's counter as it
      // finishes, and the last to arrive (usually `first`, whose share of the tile is its last unit) writes the tile:
      // it waits until the others have written their partial sums (they are running: they arrived), then adds them
      // in CTA order, keeping its own in registers if it is `first` and otherwise writing it too, so the sum is the
      // same whichever CTA is last (launches are bit-equal). A warpgroup's buffer is [TOK / 8][128 threads][4]
      // floats, so that a warp's float4 accesses are contiguous; the two warpgroups keep separate counters.
      const int local = un.tile - dp_tiles, me = blockIdx.x;
      const int first = local * n_steps / sk_per, last = ((local + 1) * n_steps - 1) / sk_per;
      int* counters = arrived + 4 * local + 2 * c;  // [0]: CTAs arrived, [1]: partial sums written
      if (ct == 0) {
        const u32 is_last = atomicAdd(counters, 1) == last - first;
        asm volatile("st.shared.u32 [%0], %1;" :: "r"(flag), "r"(is_last) : "memory");
      }
      asm volatile("bar.sync %0, 128;" :: "r"(2 + c) : "memory");
      u32 flag_value;
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(flag_value) : "r"(flag) : "memory");
      // the same in every lane, and a shuffle from lane 0 tells ptxas so: a branch it must treat as divergent
      // around the epilogue costs the whole loop the uniform registers (the shared-memory base among them, which
      // then gets added to every table address: ~25 more instructions a K-step)
      const bool is_last = __shfl_sync(0xffffffffu, flag_value, 0) != 0;
      const int per_buf = (TOK / 8) * 128 * 4;
      if (!is_last || me != first) {
        float4* mine = reinterpret_cast<float4*>(partial + (long)((2 * me + un.slot) * 2 + c) * per_buf) + ct;
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j)
          __stcg(mine + 128 * j, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
        __threadfence();
        asm volatile("bar.sync %0, 128;" :: "r"(2 + c) : "memory");
        if (ct == 0 && !is_last) atomicAdd(counters + 1, 1);
      }
      if (is_last) {
        if (ct == 0) {
          u32 written;
          do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(written) : "l"(counters + 1) : "memory");
          } while (written < (u32)(last - first));
          counters[0] = counters[1] = 0;  // ready for the next launch
        }
        asm volatile("bar.sync %0, 128;" :: "r"(2 + c) : "memory");
        __threadfence();
        const auto buffer = [&](int j_cta) {
          const int slot = j_cta * sk_per / n_steps == local ? 0 : 1;
          return reinterpret_cast<const float4*>(partial + (long)((2 * j_cta + slot) * 2 + c) * per_buf) + ct;
        };
        if (me != first) {  // start from first's sums as they are (0 + p would turn a -0 into +0)
          const float4* buf = buffer(first);
#pragma unroll
          for (int j = 0; j < TOK / 8; ++j) {
            const float4 p = __ldcg(buf + 128 * j);
            acc[4 * j] = p.x, acc[4 * j + 1] = p.y, acc[4 * j + 2] = p.z, acc[4 * j + 3] = p.w;
          }
        }
        for (int j_cta = first + 1; j_cta <= last; ++j_cta) {
          const float4* buf = buffer(j_cta);
#pragma unroll
          for (int j = 0; j < TOK / 8; ++j) {
            const float4 p = __ldcg(buf + 128 * j);
            acc[4 * j] += p.x, acc[4 * j + 1] += p.y, acc[4 * j + 2] += p.z, acc[4 * j + 3] += p.w;
          }
        }
      }
      store = is_last;
    }

    // epilogue: out = bf16(acc * 2^8/gs) (+ bias), EPI_TOK rows of x at a time staged through this warpgroup's
    // [EPI_TOK][64 + 8] bf16 and stored as 16-byte runs; rows past M and weight rows past N are not stored
    if (!store || PROBE == 3) continue;
    const float factor = __fdiv_rn(256.0f, gs[0]);
    const u16 b0 = bias != 0 && n0 + rl0 < N ? bias[n0 + rl0] : (u16)0;
    const u16 b1 = bias != 0 && n0 + rl0 + 8 < N ? bias[n0 + rl0 + 8] : (u16)0;
    // stmatrix .trans writes 8x8 blocks of the accumulator fragment transposed: thread (g, t)'s pair (weight row g,
    // rows of x 2t and 2t + 1) of block m lands in rows of x 2t, 2t + 1 of the staged tile, and thread i names the
    // staged row (i % 8) of block i / 8; blocks 2q and 2q + 1 are weight rows 16 warp + 0..7 and 8..15 of rows of x
    // 8q .. 8q + 7 of the chunk (q = 0, 1 per instruction).
    const u32 block_row =
        staged + 2 * ((8 * (lane >> 4) + (lane & 7)) * STAGED_STRIDE + 16 * warp + 8 * ((lane >> 3) & 1));
#pragma unroll
    for (int chunk = 0; chunk < TOK / EPI_TOK; ++chunk) {
      asm volatile("bar.sync %0, 128;" :: "r"(2 + c) : "memory");  // the previous chunk's reads are done
#pragma unroll
      for (int jj = 0; jj < EPI_TOK / 8; jj += 2) {
        u32 r[4];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int j = chunk * (EPI_TOK / 8) + jj + q;
          r[2 * q] = out_pair(acc[4 * j], acc[4 * j + 1], factor, bias != 0, b0);
          r[2 * q + 1] = out_pair(acc[4 * j + 2], acc[4 * j + 3], factor, bias != 0, b1);
        }
        stsm_x4_trans(block_row + 2 * 8 * jj * STAGED_STRIDE, r);
      }
      asm volatile("bar.sync %0, 128;" :: "r"(2 + c) : "memory");
#pragma unroll
      for (int v = ct; v < EPI_TOK * 8; v += 128) {
        const int tok = v >> 3, col = 8 * (v & 7), row = tok0 + chunk * EPI_TOK + tok, n = n0 + 64 * c + col;
        if (row < M && n < N)
          *reinterpret_cast<U4*>(out + (long)row * ldo + n) = lds128(staged + 2 * (tok * STAGED_STRIDE + col));
      }
    }
  }
}
