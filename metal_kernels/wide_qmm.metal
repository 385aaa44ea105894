// wide_qmm.metal - one-pass quantized matmul for 6..16 rows (DFlash verification).
//
// y[R, N] = x[R, K] @ dequant(w)[N, K]^T, affine quantization (w = scale * q + bias), 4 or 8 bits,
// group size 32/64/128, activations/outputs float16/bfloat16/float32, float32 accumulation.
//
// This file is NOT a standalone Metal library: it is the `header` and `source` (kernel body) of one
// `mx.fast.metal_kernel`. MLX writes the `[[kernel]]` signature around the body (see
// mlx_dflash/kernels/wide_qmm.py). The two parts are separated by the `//@@ header` / `//@@ body` markers.
//
// Design (metal_kernels/README.md has the traffic table and the reasoning):
//   * every weight byte, scale and bias is read from device memory once per launch, and each decoded
//     weight is applied to all R rows (MLX's qmv_wide reuses a weight for at most 5 rows);
//   * the activations are read once per threadgroup: a threadgroup owns FPT = 2 * NT output features
//     (512 with 256 threads for 16-bit activations, 1024 with 512 threads for float32), so the launch
//     reads x only ceil(N / FPT) times; that keeps device traffic within 1.15x of the unavoidable bytes
//     (weights + scales + biases + x once + y once) at every R in 6..16 (the emulator's traffic model
//     checks it, tests/test_metal_traffic.py);
//   * a thread owns 2 whole output features (no cross-lane reduction): 16-byte (uint4) weight loads,
//     one scale/bias load per group, accumulators acc[R][2] in registers (every loop over rows,
//     features and vector lanes has a template-constant bound and `#pragma unroll`);
//   * x is staged per K tile as float in threadgroup memory (row-major, read as float4 by every thread at
//     the same address: a broadcast), 2 barriers per tile; tiles are 512 values for R <= 8, 256 above
//     (16 KiB at most).
// Inputs: x (R, K) T, w (N, K*BITS/32) uint32, scales/biases (N, K/GS), K and N as int32 scalars;
// output y (R, N) T. Template parameters: T, R (rows), GS, BITS, NT (threads per threadgroup).
// Grid: (NT * ceil(N / FPT), ceil(R / RB), 1) threads, threadgroup (NT, 1, 1).

//@@ header
// (no helpers: everything is in the body so that `constant` / `device` inputs both work)

//@@ body
  constexpr int FL = 2;                     // adjacent output features per thread
  constexpr int FPT = NT * FL;              // output features per threadgroup
  constexpr int RB = R;                     // rows per threadgroup: all of them (grid.y == 1)
  constexpr int STEP = 32;                  // K values per weight load step
  constexpr int WPS = STEP * BITS / 128;    // uint4 loads per feature and step (1 or 2)
  constexpr int VPW = 32 / BITS;            // quantized values per uint32 word
  constexpr int BK = (RB <= 8) ? 512 : 256; // K values per staged x tile
  constexpr uint QMASK = (1u << BITS) - 1u;
  static_assert(BITS == 4 || BITS == 8, "bits must be 4 or 8");
  static_assert(GS == 32 || GS == 64 || GS == 128, "group size must be 32, 64 or 128");
  static_assert(R >= 1 && R <= 16, "rows must be 1..16");
  static_assert(NT % 32 == 0 && NT <= 1024, "threads per threadgroup");

  threadgroup float4 xs[RB * BK / 4];  // x[r0 + r, k0 + k] at float index r * BK + k
  threadgroup float* xsf = (threadgroup float*)xs;

  const int tid = int(thread_index_in_threadgroup);
  const int r0 = int(threadgroup_position_in_grid.y) * RB;
  const int f0 = int(threadgroup_position_in_grid.x) * FPT + tid * FL;  // features f0 .. f0 + FL - 1
  // Threads whose features are all past N only help stage x; features past N are neither loaded nor
  // stored (nf counts this thread's features below N).
  const int nf = min(FL, N - f0);
  const int kw4 = K * BITS / 128;  // uint4 per weight row (K is a multiple of 32)
  const int kg = K / GS;           // groups per weight row
  const device uint4* w4 = (const device uint4*)w;

  float acc[RB][FL];
  float sc[FL] = {0.0f};  // scale and bias of the current group, per feature
  float bi[FL] = {0.0f};
#pragma unroll
  for (int r = 0; r < RB; r++) {
    for (int j = 0; j < FL; j++) {
      acc[r][j] = 0.0f;
    }
  }

  for (int k0 = 0; k0 < K; k0 += BK) {
    const int tile = min(BK, K - k0);
    // Stage x[r0:r0+RB, k0:k0+tile] as float; consecutive threads read consecutive elements.
    for (int d = tid; d < RB * BK; d += NT) {
      const int r = d / BK;
      const int k = d % BK;
      xsf[d] = (k < tile && r0 + r < R) ? float(x[(r0 + r) * K + k0 + k]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (nf > 0) {
      for (int ks = 0; ks < tile; ks += STEP) {
        const int k = k0 + ks;
        uint4 wq[FL][WPS] = {};  // features past N stay zero (computed, never stored)
#pragma unroll
        for (int j = 0; j < FL; j++) {
          if (j < nf) {
            if (k % GS == 0) {  // STEP divides GS: a new group starts; its scale/bias stay in registers
              sc[j] = float(scales[(f0 + j) * kg + k / GS]);
              bi[j] = float(biases[(f0 + j) * kg + k / GS]);
            }
#pragma unroll
            for (int p = 0; p < WPS; p++) {
              wq[j][p] = w4[(f0 + j) * kw4 + k * BITS / 128 + p];
            }
          }
        }
#pragma unroll
        for (int q = 0; q < STEP / 4; q++) {  // 4 K values at a time
          float4 wv[FL];
#pragma unroll
          for (int j = 0; j < FL; j++) {
            for (int e = 0; e < 4; e++) {
              const int v = q * 4 + e;
              const uint word = wq[j][(v / VPW) / 4][(v / VPW) % 4];
              wv[j][e] = sc[j] * float((word >> ((v % VPW) * BITS)) & QMASK) + bi[j];
            }
          }
#pragma unroll
          for (int r = 0; r < RB; r++) {
            const float4 xv = xs[(r * BK + ks) / 4 + q];
#pragma unroll
            for (int j = 0; j < FL; j++) {
              acc[r][j] += dot(xv, wv[j]);
            }
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile consumed before it is restaged
  }

  for (int j = 0; j < nf; j++) {
    for (int r = 0; r < RB; r++) {
      if (r0 + r < R) {
        y[(r0 + r) * N + f0 + j] = static_cast<T>(acc[r][j]);
      }
    }
  }
