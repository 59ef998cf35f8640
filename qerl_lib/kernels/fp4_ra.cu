// NVFP4 x BF16 GEMM at training sizes, register-A wgmma (Hopper): out[M, N] = x[M, K] @ W[N, K]^T.
// Compiled at run time by NVRTC for sm_90a (qerl_lib/kernels/fp4_ra.py, which explains the design); the launch
// shape comes in as TOK (rows of x per CTA: wgmma's N), STAGES and KERNEL_NAME, and the macro WGMMA (the wgmma
// instruction with its TOK / 2 accumulator operands, generated in Python).
//
// Layout read in place (compressed-tensors): W codes as bytes [N, K/2] (code k of a row is nibble k%2 of byte
// k/2), E4M3 block scales as bytes [N, K/16], fp32 global scale gs[1] (w = fp4 * s / gs). x bf16 [M, ldx],
// out bf16 [M, ldo], scale rows ldsc bytes apart. K % 64 == 0, N % 8 == 0. x and W arrive by TMA through the two
// tensor maps.
//
// One CTA: 3 warpgroups. Warpgroup 0 is the producer: one thread waits for a stage's "empty" mbarrier and issues
// the TMA copies of a K-step of 64 (the x tile [TOK, 64] with the 128-byte swizzle wgmma reads, and the W tile
// [128 rows, 32 bytes] with the 32-byte swizzle) that complete its "full" mbarrier. Warpgroups 1 and 2 are the
// consumers, 64 weight rows each (swap-AB: the weights are wgmma's A operand, in registers; x is B, in shared
// memory). Per K-step a consumer waits for "full" of the next step, reads its rows' 32 bytes from shared memory
// and decodes its 4 k16 fragments in natural K order, issues this step's 4 wgmma (decoded the step before) as one
// group, waits until only that group is in flight, and then each of its warps arrives on the "empty" barrier of
// the step before (count 8: one arrive per consumer warp, no barrier between the two warpgroups). A registers
// rotate through three sets (the loop is unrolled by three), so no set an MMA in flight reads is rewritten.
//
// Natural K order: fragment register (row r, k pair 2t, 2t+1 of k16 step s) holds the two nibbles of byte 8s + t
// of the row's 32 bytes, (row r, pair 2t+8, 2t+9) those of byte 8s + t + 4. A 64 KB table in shared memory turns a
// byte into its two codes as bf16 bits of fp4 * 2^-126 (natural_pair: mma.cu's pair trick) and an E4M3 byte into
// its exact scale s * 2^118 (twice); it is replicated per lane, so every lane reads its own bank, and one prmt
// makes the address (the byte, above the lane's offset). A fragment register is then prmt, ld.shared and one packed
// mul.rn.bf16x2 by the scale: fp4 * s * 2^-8, exact.
//
// Epilogue: out = bf16(acc * 2^8/gs) (+ bias after the cast), staged through shared memory as [TOK][128 + 8] bf16
// and stored as 16-byte rows; rows of x past M and weight rows past N are not stored (TMA read them as zeros).
#include "fp4_device.cuh"
typedef unsigned long long u64;
struct __align__(64) TensorMap { u64 v[16]; };  // CUtensorMap, filled on the host (cuTensorMapEncodeTiled)

#define BK 64                          // K per stage (4 wgmma k16 steps)
#define ROWS 128                       // weight rows per CTA: two consumer warpgroups of 64
#define X_BYTES (TOK * BK * 2)         // x tile of a stage
#define W_BYTES (ROWS * BK / 2)        // weight tile of a stage
#define STAGE_BYTES (X_BYTES + W_BYTES)
#define OUT_STRIDE (ROWS + 8)          // bf16 per staged output row (the padding spreads the banks)
#define TABLE_BYTES (256 * 256)        // decode table: 256 entries x (32 lanes' code words, 32 lanes' scale words)
#ifndef PROBE
#define PROBE 0  // diagnostics only (dev/LOG.md section 72): 1 = no weight decode (A from the scale table), 2 = no MMA
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
__device__ __forceinline__ U4 lds128(u32 addr) {
  U4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}

// wgmma B descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart, start address >> 4.
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

extern "C" __global__ void __launch_bounds__(384, 1)
KERNEL_NAME(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map,
            const u8* __restrict__ sc, const float* __restrict__ gs, const u16* __restrict__ bias,
            u16* __restrict__ out, int M, int N, int K, int ldo, int ldsc) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;  // 128-byte swizzled tiles want 1024-byte alignment
  const u32 table = base + STAGES * STAGE_BYTES;  // TABLE_BYTES: the decode table (below)
  const u32 bars = table + TABLE_BYTES;           // full[STAGES], empty[STAGES]
  const int n0 = blockIdx.x * ROWS, tok0 = blockIdx.y * TOK;
  const int n_steps = K / BK;
  const int wg = threadIdx.x >> 7;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (STAGES + s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      for (int i = 0; i < n_steps; ++i) {
        const int slot = i % STAGES;
        mbar_wait(bars + 8 * (STAGES + slot), ((i / STAGES) & 1) ^ 1);
        const u32 full = bars + 8 * slot, tile = base + slot * STAGE_BYTES;
        mbar_expect_tx(full, STAGE_BYTES);
        tma_load_2d(tile, &x_map, i * BK, tok0, full);
        tma_load_2d(tile + X_BYTES, &w_map, i * (BK / 2), n0, full);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

  // The decode table, built while the producer's first copies fly: entry b (256 bytes) holds, for each lane l, the
  // codes of byte b as bf16x2 (natural_pair) at 4l and the E4M3 byte b as a bf16x2 scale (s * 2^118, twice) at
  // 128 + 4l. Each lane reads only its own bank, and one prmt gives a lane's address: byte b above lane * 4.
  {
    u32* tab = reinterpret_cast<u32*>(smem_raw + (table - raw));
    for (int idx = threadIdx.x - 128; idx < TABLE_BYTES / 4; idx += 256) {
      const u32 b = (u32)idx >> 6, scale = scale_bits(b);
      tab[idx] = (idx & 32) ? scale | (scale << 16) : natural_pair(b, 0);
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
  }

  // consumer warpgroup c (0, 1): weight rows 64c .. 64c + 63 of the CTA's tile
  const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rl0 = 64 * c + 16 * warp + g;  // rows rl0 and rl0 + 8 (same 32-byte swizzle phase)
  const u32 swz = (u32)((rl0 >> 2) & 1);
  const u32 code_lane = 4u * lane, scale_lane = 128u + 4u * lane;  // the low byte of a table address
  const u32 code_sel = 0x5504u | (t << 4);  // prmt: byte t of a word above code_lane / scale_lane
  const u8* sp0 = sc + (long)min(n0 + rl0, N - 1) * ldsc;
  const u8* sp1 = sc + (long)min(n0 + rl0 + 8, N - 1) * ldsc;

  float acc[TOK / 2];
#pragma unroll
  for (int i = 0; i < TOK / 2; ++i) acc[i] = 0.f;

  // Step j's fragments go to register set j % 3 and are decoded one step before its MMAs are issued: ptxas
  // serializes every wgmma (C7513) when a register that a wgmma reads is written while an earlier wgmma whose
  // wait comes after that wgmma is in flight. So while step i - 1's MMAs run, step i + 1 decodes and step i's
  // (decoded the step before) issue; three sets are live at once.
  u32 scl[3][2];    // block-scale bytes (4 steps per u32) of the next step to decode into each set, rows rl0, rl0 + 8
  u32 a[3][4][4];   // [set][k16 step][fragment register]
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    scl[q][0] = q < n_steps ? *reinterpret_cast<const u32*>(sp0 + 4 * q) : 0u;
    scl[q][1] = q < n_steps ? *reinterpret_cast<const u32*>(sp1 + 4 * q) : 0u;
  }

#define DECODE(Q, J)                                                                                    \
  {                                                                                                     \
    const int slot = (J) % STAGES;                                                                      \
    mbar_wait(bars + 8 * slot, ((J) / STAGES) & 1);                                                     \
    const u32 wrow = base + slot * STAGE_BYTES + X_BYTES + 32 * rl0;                                    \
    const U4 w00 = lds128(wrow + 16 * (0 ^ swz)), w01 = lds128(wrow + 16 * (1 ^ swz));                  \
    const U4 w10 = lds128(wrow + 256 + 16 * (0 ^ swz)), w11 = lds128(wrow + 256 + 16 * (1 ^ swz));     \
    const u32 lo0[4] = {w00.x, w00.z, w01.x, w01.z}, hi0[4] = {w00.y, w00.w, w01.y, w01.w};             \
    const u32 lo1[4] = {w10.x, w10.z, w11.x, w11.z}, hi1[4] = {w10.y, w10.w, w11.y, w11.w};             \
    _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                                     \
      const u32 s0 = lds32(table + prmt(scl[Q][0], scale_lane, 0x5504u | (s << 4)));                   \
      const u32 s1 = lds32(table + prmt(scl[Q][1], scale_lane, 0x5504u | (s << 4)));                   \
      a[Q][s][0] = PROBE == 1 ? s0 : mul_bf16x2(lds32(table + prmt(lo0[s], code_lane, code_sel)), s0); \
      a[Q][s][1] = PROBE == 1 ? s1 : mul_bf16x2(lds32(table + prmt(lo1[s], code_lane, code_sel)), s1); \
      a[Q][s][2] = PROBE == 1 ? s0 ^ lo0[0] : mul_bf16x2(lds32(table + prmt(hi0[s], code_lane, code_sel)), s0); \
      a[Q][s][3] = PROBE == 1 ? s1 ^ lo1[0] : mul_bf16x2(lds32(table + prmt(hi1[s], code_lane, code_sel)), s1); \
    }                                                                                                   \
    if ((J) + 3 < n_steps) {                                                                            \
      scl[Q][0] = *reinterpret_cast<const u32*>(sp0 + 4 * ((J) + 3));                                   \
      scl[Q][1] = *reinterpret_cast<const u32*>(sp1 + 4 * ((J) + 3));                                   \
    }                                                                                                   \
  }

#define CONSUME(P)                                                                                      \
  {                                                                                                     \
    const int i = i0 + (P);                                                                             \
    if (i + 1 < n_steps) DECODE(((P) + 1) % 3, i + 1)                                                   \
    const u32 tile = base + (i % STAGES) * STAGE_BYTES;                                                 \
    u64 desc[4];                                                                                        \
    _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                                     \
      desc[s] = x_desc(tile + 32 * s);                                                                  \
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
    if (i > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + (i - 1) % STAGES));                       \
  }

  DECODE(0, 0)
  for (int i0 = 0; i0 < n_steps; i0 += 3) {
    CONSUME(0)
    if (i0 + 1 < n_steps) CONSUME(1)
    if (i0 + 2 < n_steps) CONSUME(2)
  }
#undef CONSUME
#undef DECODE
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
  for (int r = 0; r < TOK / 2; ++r) fence_acc(acc[r]);

  // epilogue: both consumer warpgroups are done with the stages; stage the tile as [TOK][OUT_STRIDE] bf16
  asm volatile("bar.sync 1, 256;" ::: "memory");
  u16* staged = reinterpret_cast<u16*>(smem_raw + (base - raw));
  const float factor = __fdiv_rn(256.0f, gs[0]);
  const u16 b0 = bias != 0 && n0 + rl0 < N ? bias[n0 + rl0] : (u16)0;
  const u16 b1 = bias != 0 && n0 + rl0 + 8 < N ? bias[n0 + rl0 + 8] : (u16)0;
#pragma unroll
  for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = 8 * j + 2 * t + e;
      u16 y0 = to_bf16(acc[4 * j + e] * factor), y1 = to_bf16(acc[4 * j + 2 + e] * factor);
      if (bias != 0) {
        y0 = add_bias(y0, b0);
        y1 = add_bias(y1, b1);
      }
      staged[tok * OUT_STRIDE + rl0] = y0;
      staged[tok * OUT_STRIDE + rl0 + 8] = y1;
    }
  asm volatile("bar.sync 1, 256;" ::: "memory");
  const int ct = threadIdx.x - 128;
  for (int v = ct; v < TOK * (ROWS / 8); v += 256) {
    const int tok = v / (ROWS / 8), col = 8 * (v % (ROWS / 8));
    if (tok0 + tok < M && n0 + col < N)
      *reinterpret_cast<U4*>(out + (long)(tok0 + tok) * ldo + n0 + col) =
          *reinterpret_cast<const U4*>(staged + tok * OUT_STRIDE + col);
  }
}
