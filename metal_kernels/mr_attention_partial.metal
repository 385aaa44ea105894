// mr_attention_partial.metal - multi-row (2..16 query rows) decode attention, pass 1 of 2: one
// threadgroup per (batch x kv head, key chunk of SPLIT keys) computes, for every query row of that kv
// head (GQA: the G query heads that share it, x L rows), the chunk's softmax statistics (max m, sum l)
// and its unnormalised output o = sum_j exp(s_j - m) v_j. Pass 2 (mr_attention_combine.metal) merges
// the chunks. Within the block (its keys are the last L of the S keys), query row i sees block key j where
// bit j of its `sees` word is set: the rows before it and itself for a chain (causal), its ancestors and
// itself for a draft tree's node; every row sees all S - L keys before the block.
//
// Why this shape (metal_kernels/README.md, "Multi-row attention"): MLX's vector SDPA takes q_len <= 8
// only while q_len * GQA <= 32 and q_len 9..16 goes to a 32-row tile without a split over the keys; here
// the keys are split over ceil(S / SPLIT) threadgroups per kv head whatever L, and each K/V element is
// read from device memory once per kv head (shared by its G query heads), staged in threadgroup memory.
//
// Inputs: q (B, HQ, L, D), k / v (B, HKV, >= max S, D), any strides (a KV cache buffer or a slice of it is
// read in place), scale (float), lengths (B int32: S, the keys batch row b attends, its block the last L of
// them; rows of a batch cache each have their own, the rest of the buffer being padding), sees (B * L uint32:
// the block keys each query row of batch row b sees, one bit each), SPLIT (int32: keys per threadgroup, a
// multiple of CH; runtime, so a growing cache does not make new template instantiations).
// A chunk past a row's S computes nothing (m = -inf, l = 0) and weighs 0 in pass 2. Outputs: o_part
// (B * HQ * L, NC, D) float32, ml (B * HQ * L, NC, 2) float32 (m, l). Template: T, L, G (= HQ / HKV), D
// (64 or 128), HKV, CH (keys per staged tile), NS (simdgroups).
// Grid (32 * NS, B * HKV, NC) threads, threadgroup (32 * NS, 1, 1).

//@@ header

//@@ body
  constexpr int NT = 32 * NS;
  constexpr int DL = D / 32;               // head dims per lane: d = dl * 32 + lane
  constexpr int QR = G * L;                // query rows of one kv head
  constexpr int RPS = (QR + NS - 1) / NS;  // query rows per simdgroup
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(L >= 1 && L <= 16, "1..16 query rows");

  threadgroup float ks[CH * D];
  threadgroup float vs[CH * D];

  const int tid = int(thread_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int bh = int(threadgroup_position_in_grid.y);  // b * HKV + kv head
  const int b = bh / HKV;
  const int hkv = bh % HKV;
  const int S = lengths[b];
  const int c = int(threadgroup_position_in_grid.z);
  const int nc = int(threadgroups_per_grid.z);
  const int k_lo = c * SPLIT;
  const int k_hi = min(S, k_lo + SPLIT);
  const int64_t kb = b * k_strides[0] + hkv * k_strides[1];
  const int64_t vb = b * v_strides[0] + hkv * v_strides[1];

  float qv[RPS][DL];
  float o[RPS][DL];
  float m[RPS];
  float l[RPS];
#pragma unroll
  for (int t = 0; t < RPS; t++) {
    const int qr = min(sg + t * NS, QR - 1);  // rows past QR compute a copy of the last, never stored
    const int64_t qb = b * q_strides[0] + (hkv * G + qr / L) * q_strides[1] + (qr % L) * q_strides[2];
#pragma unroll
    for (int dl = 0; dl < DL; dl++) {
      qv[t][dl] = float(q[qb + (dl * 32 + lane) * q_strides[3]]) * scale;
      o[t][dl] = 0.0f;
    }
    m[t] = -INFINITY;
    l[t] = 0.0f;
  }

  for (int j0 = k_lo; j0 < k_hi; j0 += CH) {
    // Stage keys j0 .. j0 + CH (zeros past the chunk) as float.
    for (int e = tid; e < CH * D; e += NT) {
      const int j = j0 + e / D;
      const int d = e % D;
      ks[e] = j < k_hi ? float(k[kb + j * k_strides[2] + d * k_strides[3]]) : 0.0f;
      vs[e] = j < k_hi ? float(v[vb + j * v_strides[2] + d * v_strides[3]]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
#pragma unroll
    for (int t = 0; t < RPS; t++) {
      const int qr = min(sg + t * NS, QR - 1);
      const int before = S - L;  // keys before the block, seen by every row
      const uint seen = sees[b * L + qr % L];  // the block keys this row sees (uniform in the simdgroup)
      const int n = k_hi - j0;
      for (int j = 0; j < min(CH, n); j++) {
        const int key = j0 + j;
        if (key >= before && ((seen >> uint(key - before)) & 1u) == 0u) {
          continue;  // a block key it does not see: a later row's, or another branch's in a tree
        }
        float part = 0.0f;
#pragma unroll
        for (int dl = 0; dl < DL; dl++) {
          part += qv[t][dl] * ks[j * D + dl * 32 + lane];
        }
        const float s = metal::simd_sum(part);
        const float mn = max(m[t], s);
        const float corr = metal::exp(m[t] - mn);
        const float p = metal::exp(s - mn);
        l[t] = l[t] * corr + p;
#pragma unroll
        for (int dl = 0; dl < DL; dl++) {
          o[t][dl] = o[t][dl] * corr + p * vs[j * D + dl * 32 + lane];
        }
        m[t] = mn;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile consumed before it is restaged
  }

#pragma unroll
  for (int t = 0; t < RPS; t++) {
    const int qr = sg + t * NS;
    if (qr < QR) {
      const int row = (b * HKV * G + hkv * G + qr / L) * L + qr % L;  // (b, query head, i)
      const int64_t at = int64_t(row) * nc + c;
#pragma unroll
      for (int dl = 0; dl < DL; dl++) {
        o_part[at * D + dl * 32 + lane] = o[t][dl];
      }
      if (lane == 0) {
        ml[at * 2] = m[t];
        ml[at * 2 + 1] = l[t];
      }
    }
  }
