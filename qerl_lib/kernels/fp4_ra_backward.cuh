// The backward layout's producer for fp4_ra.cu (BACKWARD = 1), which includes this file after its own helpers
// (mbarriers, TMA, Unit and unit_of) and layout macros; not a stand-alone header. dev/LOG.md section 76 measures it.
#pragma once
// A raw W tile: 64-byte rows with TMA's 64-byte swizzle (16-byte chunk c of row r lands at chunk c ^ ((r >> 1) & 3)).
// Where consumer lane ct's 16 bytes of a half stage go: ct with bits 1-2 XORed by bits 3-4. A consumer quarter-warp
// (8 lanes, bits 3-4 fixed) still reads 8 distinct 16-byte columns; a producer half-warp's 8-byte stores (t and gq
// varying, the k16 steps' order flipped for odd gq) land on 16 distinct bank pairs instead of 4.
__device__ __forceinline__ int packed_slot(int ct) { return ct ^ (((ct >> 3) & 3) << 1); }
__device__ __forceinline__ void sts64(u32 addr, u32 a, u32 b) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" :: "r"(addr), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ u32 lds32_fresh(u32 addr) {  // a ring's bytes: volatile, so it stays after the wait
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr) : "memory");
  return r;
}

// The backward layout's producer warpgroup (thread p). Thread 0 issues the TMA copies: dy into the stage, and the raw
// W tile with its rows' block scales (a [64 rows, 16 bytes] box from the 16-byte boundary at or below the tile's first
// block: TMA's narrowest) into the raw ring, RAW_SLOTS - 2 K-steps ahead (its own cursor over the units), into the
// slot of the step two before once all four warps have counted themselves out of it (raw_empty). Every thread then,
// per K-step, after waiting itself for the stage's "empty" barrier (no CTA barrier a step):
// - repacks the raw tile for lanes (g = 2 gq, t) and (2 gq + 1, t) of consumer warps 2 m and 2 m + 1, k16 steps 2 sh
//   and 2 sh + 1: the value of (k row r, pair column n) is nibble r of W row n (low) and of row n + 1 (high). Per k16
//   step it reads one 16-byte chunk (both warps' words) of each of its 4 rows, gathers byte gq of a warp's 4 words of
//   rows n and n + 1 with prmt, splits even k (lane 2 gq) from odd (2 gq + 1) with two masks, and writes each value as
//   the table address value << 7 | 4 lane;
// - pairs the block scales of rows n = 2 (p / 4) and n + 1 for blocks 2 (p % 4) and 2 (p % 4) + 1 as bf16x2 words.
__device__ __forceinline__ void backward_producer(const TensorMap& x_map, const TensorMap& w_map,
                                                  const TensorMap& s_map, int n_steps, int tiles, int m_tiles,
                                                  int dp_tiles, int sk_per, int sk_ctas, u32 base, u32 raw_ring,
                                                  u32 bars, u32 raw_full, u32 raw_empty, const unsigned char* smem,
                                                  u32 smem_base) {
  const int p = threadIdx.x, lane = p & 31;
  Unit lead = {0, 0, 0, 0};  // thread 0's cursor: the K-step whose raw tile it issues next
  int lead_u = 0, lead_i = 0;
  bool lead_ok = false;
  const auto issue_raw = [&](u32 pos) {
    const u32 slot = pos % RAW_SLOTS, bar = raw_full + 8 * slot, dst = raw_ring + slot * RAW_SLOT_BYTES;
    const int col_tile = lead.tile / m_tiles;
    mbar_expect_tx(bar, RAW_SLOT_BYTES);
    tma_load_2d(dst, &w_map, col_tile * (ROWS / 2), lead_i * BK, bar);
    tma_load_2d(dst + RAW_BYTES, &s_map, (col_tile >> 1) * 16, lead_i * BK, bar);
    if (++lead_i == lead.ke && (lead_ok = unit_of(++lead_u, n_steps, tiles, dp_tiles, sk_per, sk_ctas, lead)))
      lead_i = lead.kb;
  };
  if (p == 0) {
    lead_ok = unit_of(0, n_steps, tiles, dp_tiles, sk_per, sk_ctas, lead);
    lead_i = lead.kb;
    for (u32 pos = 0; pos + 2 < RAW_SLOTS && lead_ok; ++pos) issue_raw(pos);
  }
  // repack: consumer lanes (2 gq, t) and (2 gq + 1, t) of consumer warps 2 m and 2 m + 1, k16 steps 2 sh and 2 sh + 1
  const int t = p & 3, gq = (p >> 2) & 3, m = (p >> 4) & 3, sh = p >> 6;
  const u32 sel = gq | ((gq + 4) << 4), lane4 = 0x10001u * (32 * gq + 4 * t);  // 4 x lane (2 gq, t), twice
  const u32 chunk_base = 128 * t + 16 * (m ^ t);  // chunk m of raw row 2 t, swizzled
  const int sn = 2 * (p >> 2), sq = p & 3;  // scale rows sn, sn + 1; blocks 2 sq, 2 sq + 1
  const u32 sword = 4 * (8 * ((sn >> 1) & 3) + 2 * (sn >> 4) + ((sn >> 3) & 1));  // + 128 kb: block kb's pair
  Unit un;
  u32 g = 0;
  for (int u = 0; unit_of(u, n_steps, tiles, dp_tiles, sk_per, sk_ctas, un); ++u) {
    const int col_tile = un.tile / m_tiles, tok0 = (un.tile % m_tiles) * TOK;
    for (int i = un.kb; i < un.ke; ++i, ++g) {
      const u32 slot = g % STAGES, full = bars + 8 * slot, stage = base + slot * STAGE_BYTES;
      mbar_wait(bars + 8 * (STAGES + slot), ((g / STAGES) & 1) ^ 1);  // every thread: the stage is free
      if (p == 0) {
        mbar_expect_tx(full, X_BYTES);
        tma_load_2d(stage, &x_map, i * BK, tok0, full);
        if (lead_ok) {  // K-step g + RAW_SLOTS - 2 into the slot of step g - 2, once every warp has read it
          if (g >= 2) mbar_wait(raw_empty + 8 * ((g - 2) % RAW_SLOTS), ((g - 2) / RAW_SLOTS) & 1);
          issue_raw(g + RAW_SLOTS - 2);
        }
      }
      mbar_wait(raw_full + 8 * (g % RAW_SLOTS), (g / RAW_SLOTS) & 1);
      const u32 raw = raw_ring + (g % RAW_SLOTS) * RAW_SLOT_BYTES;
      if (PROBE != 4) {
#pragma unroll
        for (int ss = 0; ss < 2; ++ss) {
          const int s = 2 * sh + (ss ^ (gq & 1));  // odd gq take the two k16 steps in the other order (bank spread)
          // the 16-byte chunk m of W rows n = 16 s + 8 h + 2 t and n + 1: the swizzle makes it chunk m ^ t in all four
          // ((n >> 1) & 3 = t), so they are one base register and constant offsets
          const unsigned char* rows = smem + (raw - smem_base) + 1024 * s + chunk_base;
          U4 c[2][2];  // [h][row n or n + 1]
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 2; ++r) c[h][r] = *reinterpret_cast<const U4*>(rows + 64 * (8 * h + r));
#pragma unroll
          for (int b = 0; b < 2; ++b) {  // consumer warp wa = 2 m + b: words 2 b (khalf 0) and 2 b + 1 (khalf 1)
            const u32* r0h0 = &c[0][0].x + 2 * b, *r1h0 = &c[0][1].x + 2 * b;
            const u32* r0h1 = &c[1][0].x + 2 * b, *r1h1 = &c[1][1].x + 2 * b;
            // value j = khalf + 2 h: byte gq of (row n, khalf) gathered into byte j, rows n (A) and n + 1 (B)
            const u32 A = prmt(prmt(r0h0[0], r0h0[1], sel), prmt(r0h1[0], r0h1[1], sel), 0x5410u);
            const u32 B = prmt(prmt(r1h0[0], r1h0[1], sel), prmt(r1h1[0], r1h1[1], sel), 0x5410u);
            const u32 E = (A & 0x0F0F0F0Fu) | ((B << 4) & 0xF0F0F0F0u);  // even k: lane (2 gq, t), value j in byte j
            const u32 O = ((A >> 4) & 0x0F0F0F0Fu) | (B & 0xF0F0F0F0u);  // odd k: lane (2 gq + 1, t)
            const int ct = 32 * (2 * m + b) + 8 * gq + t;  // consumer lane (2 gq, t) of warp wa; (2 gq + 1, t) is 4 on
            const u32 dst = stage + X_BYTES + (s >> 1) * (W_BYTES / 2) + 8 * (s & 1);
            sts64(dst + 16 * packed_slot(ct), prmt(E, 0, 0x4140u) * 128u + lane4, prmt(E, 0, 0x4342u) * 128u + lane4);
            sts64(dst + 16 * packed_slot(ct + 4), prmt(O, 0, 0x4140u) * 128u + lane4 + 0x100010u,
                  prmt(O, 0, 0x4342u) * 128u + lane4 + 0x100010u);
          }
        }
        // scale pairs: the tile's 8 block bytes of a row start at byte 8 (col_tile % 2) of its 16-byte box row
        const u32 srow = raw + RAW_BYTES + 16 * sn + 8 * (col_tile & 1) + 4 * (sq >> 1);
        const u32 lo = lds32_fresh(srow), hi = lds32_fresh(srow + 16);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const u32 shift = 8 * (2 * (sq & 1) + q);
          const u32 v = scale_bits((lo >> shift) & 0xFFu) | (scale_bits((hi >> shift) & 0xFFu) << 16);
          asm volatile("st.shared.u32 [%0], %1;" :: "r"(stage + X_BYTES + W_BYTES + 128 * (2 * sq + q) + sword), "r"(v)
                       : "memory");
        }
      }
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(raw_empty + 8 * (g % RAW_SLOTS));
        mbar_arrive(full);
      }
    }
  }
}
