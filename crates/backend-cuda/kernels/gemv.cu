// BF16-weight GEMV / small-batch GEMM: y[r, n] = sum_k W[row(n), k] * x[r, k].
// One warp per output row; every activation row runs the same fmaf sequence, so a row's result
// does not depend on how many rows share the launch (batch invariance).
// row_ids (optional) restricts the rows read, e.g. the 4097 lm_head candidates.
// PLANT 1: drops the last 8-wide column group (dense) or reads candidate id + 1 (row_ids).
// LOWP: accumulators rounded to bf16 after each step.
#define ROWS_MAX 8
#define UNROLL 8
__device__ __forceinline__ void gemv_bf16_body(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                               float* __restrict__ y, const unsigned int* __restrict__ row_ids,
                                               int n_out, int K, int rows, long long warp) {
    int lane = threadIdx.x & 31;
    if (warp >= n_out) return;
    long long wrow = row_ids ? (long long)row_ids[warp] : warp;
#if PLANT == 1
    if (row_ids) wrow += 1;
#endif
    const uint4* wp = (const uint4*)(W + wrow * (long long)K);
    int nvec = K >> 3;
#if PLANT == 1
    if (!row_ids) nvec -= 1;
#endif
    for (int r0 = 0; r0 < rows; r0 += ROWS_MAX) {
        float acc[ROWS_MAX];
#pragma unroll
        for (int r = 0; r < ROWS_MAX; ++r) acc[r] = 0.0f;
        for (int base = 0; base < nvec; base += 32 * UNROLL) {
            uint4 wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                int idx = base + u * 32 + lane;
                if (idx < nvec) wv[u] = ld_stream(wp + idx);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                int idx = base + u * 32 + lane;
                if (idx < nvec) {
                    float2 w0 = bf16x2_to_f32(wv[u].x), w1 = bf16x2_to_f32(wv[u].y);
                    float2 w2 = bf16x2_to_f32(wv[u].z), w3 = bf16x2_to_f32(wv[u].w);
#pragma unroll
                    for (int r = 0; r < ROWS_MAX; ++r) {
                        if (r0 + r < rows) {
                            const float4* xp = (const float4*)(x + (long long)(r0 + r) * K) + 2 * idx;
                            float4 xa = __ldg(xp), xb = __ldg(xp + 1);
                            float a = acc[r];
                            a = fmaf(w0.x, xa.x, a); a = fmaf(w0.y, xa.y, a);
                            a = fmaf(w1.x, xa.z, a); a = fmaf(w1.y, xa.w, a);
                            a = fmaf(w2.x, xb.x, a); a = fmaf(w2.y, xb.y, a);
                            a = fmaf(w3.x, xb.z, a); a = fmaf(w3.y, xb.w, a);
#ifdef LOWP
                            a = round_bf16(a);
#endif
                            acc[r] = a;
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_MAX; ++r) {
            float s = warp_sum(acc[r]);
            if (lane == 0 && r0 + r < rows) y[(long long)(r0 + r) * n_out + warp] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) gemv_bf16(
    const bf16_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
    const unsigned int* __restrict__ row_ids, int n_out, int K, int rows) {
    gemv_bf16_body(W, x, y, row_ids, n_out, K, rows, ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
}

// Up to 8 BF16 GEMVs of one input x [rows, K] in one launch: weight j [n_out[j], K] writes
// y[j] [rows, n_out[j]] from blocks start[j] .. start[j+1] (8 outputs per block). Each output is
// the same arithmetic as gemv_bf16's, so the results equal separate launches bit for bit.
struct Multi {
    unsigned long long w[8];
    unsigned long long y[8];
    int n_out[8];
    int start[9];
    int count;
};
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_multi(Multi m, const float* __restrict__ x, int K,
                                                                  int rows) {
    int j = 0;
    while (j + 1 < m.count && (int)blockIdx.x >= m.start[j + 1]) ++j;
    long long warp = ((long long)(blockIdx.x - m.start[j]) * blockDim.x + threadIdx.x) >> 5;
    gemv_bf16_body((const bf16_t*)m.w[j], x, (float*)m.y[j], nullptr, m.n_out[j], K, rows, warp);
}
