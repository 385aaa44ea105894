// mr_attention_combine.metal - multi-row decode attention, pass 2 of 2: one simdgroup per output row
// (b, query head, i) merges the NC key chunks of pass 1 (mr_attention_partial.metal):
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c with M = max_c m_c. Chunks a row cannot see
// (causal) have m = -inf, l = 0, o = 0 and weigh 0; chunk 0 always holds key 0, so M is finite.
// Inputs: o_part (rows, NC, D) float32, ml (rows, NC, 2) float32, NC (int32). Output: out (rows, D) T.
// Template: T, D. Grid (32, rows, 1), threadgroup (32, 1, 1).

//@@ header

//@@ body
  constexpr int DL = D / 32;
  constexpr int MAX_NC = 1024;  // key chunks (mlx_dflash/kernels/attention.py caps them)
  threadgroup float mls[2 * MAX_NC];
  const int lane = int(thread_index_in_simdgroup);
  const int64_t row = int64_t(threadgroup_position_in_grid.y);
  // m and l of every chunk, loaded once (not once per lane) and shared through threadgroup memory.
  for (int e = lane; e < 2 * NC; e += 32) {
    mls[e] = ml[row * NC * 2 + e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float mx_ = -INFINITY;
  for (int c = 0; c < NC; c++) {
    mx_ = max(mx_, mls[2 * c]);
  }
  float den = 0.0f;
  float acc[DL];
#pragma unroll
  for (int dl = 0; dl < DL; dl++) {
    acc[dl] = 0.0f;
  }
  for (int c = 0; c < NC; c++) {
    const float wgt = metal::exp(mls[2 * c] - mx_);
    den += wgt * mls[2 * c + 1];
#pragma unroll
    for (int dl = 0; dl < DL; dl++) {
      acc[dl] += wgt * o_part[(row * NC + c) * D + dl * 32 + lane];
    }
  }
#pragma unroll
  for (int dl = 0; dl < DL; dl++) {
    out[row * D + dl * 32 + lane] = static_cast<T>(acc[dl] / den);
  }
