// Device helpers shared by the NVFP4 kernels compiled with NVRTC (mma.cu, fp4_ra.cu): types, the exact E4M3
// block scale as bf16 bits, packed bf16 arithmetic and the output rounding of nvfp4.reference_matmul.
#pragma once
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
struct __align__(16) U4 { u32 x, y, z, w; };

// E4M3 byte -> bf16 bits of s * 2^118 (exact; E4M3 subnormals via an exact float product).
__device__ __forceinline__ u32 scale_bits(u32 b) {
  u32 mag = b & 0x7Fu;
  u32 normal = (mag << 4) + 0x7700u;
  u32 sub = __float_as_uint((float)mag * 6.49037107316853453566e32f) >> 16;  // 2^109
  return (mag >= 8u ? normal : sub) | ((b & 0x80u) << 8);
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ float from_bf16(u16 v) { return __uint_as_float(((u32)v) << 16); }

// The bias, added after the output's cast and rounded again, as the oracle (nvfp4.reference_matmul) adds it.
__device__ __forceinline__ u16 add_bias(u16 y, u16 b) { return to_bf16(from_bf16(y) + from_bf16(b)); }

// bf16(acc * 2^8/gs) (2^8 undoes the W' scaling), then + bias after the cast, as the oracle.
__device__ __forceinline__ u16 epilogue(float acc, float factor, const u16* bias, int row) {
  u16 y = to_bf16(acc * factor);
  if (bias != 0) y = add_bias(y, bias[row]);
  return y;
}

