// wide_qmm.metal - one-pass quantized matmul for 6..16 rows (DFlash verification).
//
// y[R, N] = x[R, K] @ dequant(w)[N, K]^T, affine quantization (w = scale * q + bias), 4 or 8 bits,
// group size 32/64/128, activations/outputs float16/bfloat16/float32, float32 accumulation.
//
// This file is NOT a standalone Metal library: it is the `header` and `source` (kernel body) of one
// `mx.fast.metal_kernel`. MLX writes the `[[kernel]]` signature around the body (see
// mlx_dflash/kernels.py). The two parts are separated by the `//@@ header` / `//@@ body` markers.
//
// Design choice: multi-row qmv (SIMT), not a 16-row simdgroup_matrix tile.
//   * MLX's vector path (qmv_wide) reuses each decoded weight chunk for at most 5 rows, so 6..16 rows
//     stream W 2-4 times; its matrix path (qmm_t) always computes a 32-row tile. Here every lane decodes
//     its weight chunk once and applies it to all R rows, so W is read exactly once for any R <= 16,
//     with no padded rows and no second (split-K reduce) kernel.
//   * One kernel covers the whole 6..16 range (R is a template parameter, loops fully unrolled) and
//     ragged N (edge features are clamped for loads and masked for stores), with no N % 32 gate.
//   * It stays in the plain SIMT MSL subset (scalars, threadgroup array, threadgroup_barrier,
//     simd_shuffle_down), so the exact source runs in the CPU emulator under tests/metal_emulator;
//     a simdgroup_matrix tile needs fragment-layout emulation that does not exist yet, and its gain
//     (MMA throughput at 12..16 rows) can only be measured on Apple hardware.
//   * Cost: at 12..16 rows the kernel does R*8 FMAs per decoded 8-value chunk on the SIMT units, so on
//     large GPUs it may become ALU-bound rather than bandwidth-bound; a BM=16 MMA tile is the follow-up
//     if measurements on a Mac show that.
//
// Layout (threadgroup = 2 simdgroups = 64 threads, grid = 64 * ceil(N / 16) threads along x):
//   * a simdgroup is 4 segments of 8 lanes; a segment owns 2 adjacent output features (FL), its 8 lanes
//     split K into interleaved 8-value chunks (lane kl takes chunks kl, kl+8, ... of each tile), so the
//     8 lanes read 32 (4-bit) or 64 (8-bit) consecutive bytes of a weight row;
//   * a threadgroup owns 16 output features; x tiles (R x 128 values, converted to float) are staged
//     once per threadgroup in threadgroup memory and shared by all 64 threads (<= 8 KiB at R = 16),
//     stored chunk-interleaved (element e of chunk ch at e * 16 + ch) so that the 8 lanes of a segment
//     read 8 consecutive words (no bank conflicts) and the 4 segments read the same words (broadcast);
//   * per chunk: load 1 (4-bit) or 2 (8-bit) uint32 words per feature, dequantize 8 values in float,
//     then 8 FMAs per row per feature into acc[R][FL];
//   * end: a shuffle-down ladder (4, 2, 1) reduces each segment, lane kl == 0 stores R x FL outputs.
// Inputs: x (R, K) T, w (N, K*BITS/32) uint32, scales/biases (N, K/GS) float16/bfloat16/float32,
// K and N as int32 scalars; output y (R, N) T.
// Template parameters: T (activation/output type), R (rows), GS, BITS. The scale/bias type comes from the
// generated signature (MLX names each input-dtype combination separately).

//@@ header
// (no helpers: everything is in the body so that `constant` / `device` inputs both work)

//@@ body
  // ---- tuning knobs (measure on hardware before changing) ----
  constexpr int SIMD = 32;
  constexpr int NSG = 2;                  // simdgroups per threadgroup
  constexpr int KL = 8;                   // lanes splitting K for one feature pair
  constexpr int SEGS = SIMD / KL;         // segments per simdgroup
  constexpr int FL = 2;                   // output features per segment
  constexpr int FPT = NSG * SEGS * FL;    // output features per threadgroup (16)
  constexpr int CV = 8;                   // K values per lane chunk
  constexpr int CPT = 2;                  // chunks per lane per tile
  constexpr int NCH = KL * CPT;           // chunks per tile (16)
  constexpr int BK = NCH * CV;            // K values per staged tile (128)
  constexpr int NT = NSG * SIMD;          // threads per threadgroup
  constexpr int WPC = CV * BITS / 32;     // uint32 words per chunk (1 or 2)
  constexpr uint QMASK = (1u << BITS) - 1u;
  static_assert(BITS == 4 || BITS == 8, "bits must be 4 or 8");
  static_assert(GS == 32 || GS == 64 || GS == 128, "group size must be 32, 64 or 128");
  static_assert(R >= 1 && R <= 16, "rows must be 1..16");

  threadgroup float xs[R * BK];

  const int tid = int(thread_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int seg = lane / KL;
  const int kl = lane % KL;

  const int kw = K * BITS / 32;  // uint32 words per weight row
  const int kg = K / GS;         // groups per weight row
  const int feat0 = int(threadgroup_position_in_grid.x) * FPT + (sg * SEGS + seg) * FL;

  // Rows past N (ragged edge) load the last valid row and are never stored: every lane stays
  // active through the barriers and shuffles.
  int wrow[FL];
  for (int j = 0; j < FL; j++) {
    wrow[j] = min(feat0 + j, N - 1);
  }

  float acc[R][FL];
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < FL; j++) {
      acc[r][j] = 0.0f;
    }
  }

  for (int k0 = 0; k0 < K; k0 += BK) {
    // Stage x[:, k0:k0+BK] as float (zeros past K), chunk-interleaved: consecutive threads write
    // consecutive words.
    for (int d = tid; d < R * BK; d += NT) {
      const int r = d / BK;
      const int e = (d % BK) / NCH;
      const int ch = d % NCH;
      const int k = k0 + ch * CV + e;
      xs[d] = (k < K) ? float(x[r * K + k]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int c = 0; c < CPT; c++) {
      const int ch = c * KL + kl;  // chunk index inside the tile
      const int k = k0 + ch * CV;
      if (k < K) {  // K is a multiple of GS >= 32, so a chunk is entirely in or out
        const int g = k / GS;
        float wv[FL][CV];
        for (int j = 0; j < FL; j++) {
          const float s = float(scales[wrow[j] * kg + g]);
          const float b = float(biases[wrow[j] * kg + g]);
          const int wbase = wrow[j] * kw + k * BITS / 32;
          for (int p = 0; p < WPC; p++) {
            const uint word = w[wbase + p];
            for (int i = 0; i < 32 / BITS; i++) {
              wv[j][p * (32 / BITS) + i] = s * float((word >> (i * BITS)) & QMASK) + b;
            }
          }
        }
        for (int r = 0; r < R; r++) {
          float xv[CV];
          for (int i = 0; i < CV; i++) {
            xv[i] = xs[r * BK + i * NCH + ch];
          }
          for (int j = 0; j < FL; j++) {
            float a = acc[r][j];
            for (int i = 0; i < CV; i++) {
              a = fma(xv[i], wv[j][i], a);
            }
            acc[r][j] = a;
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile consumed before it is restaged
  }

  // Reduce over the 8 lanes of each segment (lanes kl..kl+7 are contiguous in the simdgroup).
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < FL; j++) {
      float a = acc[r][j];
      a += simd_shuffle_down(a, ushort(4));
      a += simd_shuffle_down(a, ushort(2));
      a += simd_shuffle_down(a, ushort(1));
      acc[r][j] = a;
    }
  }

  if (kl == 0) {
    for (int j = 0; j < FL; j++) {
      const int f = feat0 + j;
      if (f < N) {
        for (int r = 0; r < R; r++) {
          y[r * N + f] = static_cast<T>(acc[r][j]);
        }
      }
    }
  }
