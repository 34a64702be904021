// BF16-weight GEMV / small-batch GEMM: y[r, n] = sum_k W[row(n), k] * x[r, k].
// One warp per output row; every activation row runs the same fmaf sequence, so a row's result
// does not depend on how many rows share the launch (batch invariance).
// row_ids (optional) restricts the rows read, e.g. the 4097 lm_head candidates.
// PLANT 1: drops the last 8-wide column group (dense) or reads candidate id + 1 (row_ids).
// LOWP: accumulators rounded to bf16 after each step.
#define ROWS_MAX 8
#define UNROLL 8
// O consecutive outputs per warp (O = 1, or 4 for several rows: each activation load then feeds
// four weight rows). A lane accumulates its weight vectors lane, lane + 32, ... in that order,
// eight fmaf per vector, then the warp sums: the same sequence for every O, UNROLL and row count,
// so an output's bits depend on neither.
template <int O>
__device__ __forceinline__ void gemv_bf16_body(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                               float* __restrict__ y, const unsigned int* __restrict__ row_ids,
                                               int n_out, int K, int rows, long long warp) {
    constexpr int U = UNROLL / O;
    int lane = threadIdx.x & 31;
    long long o0 = warp * O;
    if (o0 >= n_out) return;
    const uint4* wp[O];
    bool live[O];
#pragma unroll
    for (int o = 0; o < O; ++o) {
        live[o] = o0 + o < n_out;
        long long n = live[o] ? o0 + o : o0;
        long long wrow = row_ids ? (long long)row_ids[n] : n;
#if PLANT == 1
        if (row_ids) wrow += 1;
#endif
        wp[o] = (const uint4*)(W + wrow * (long long)K);
    }
    int nvec = K >> 3;
#if PLANT == 1
    if (!row_ids) nvec -= 1;
#endif
    for (int r0 = 0; r0 < rows; r0 += ROWS_MAX) {
        float acc[ROWS_MAX][O];
#pragma unroll
        for (int r = 0; r < ROWS_MAX; ++r)
#pragma unroll
            for (int o = 0; o < O; ++o) acc[r][o] = 0.0f;
        for (int base = 0; base < nvec; base += 32 * U) {
            uint4 wv[U][O];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int idx = base + u * 32 + lane;
#pragma unroll
                for (int o = 0; o < O; ++o)
                    if (idx < nvec) wv[u][o] = ld_stream(wp[o] + idx);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int idx = base + u * 32 + lane;
                if (idx < nvec) {
                    float2 w[O][4];
#pragma unroll
                    for (int o = 0; o < O; ++o) {
                        w[o][0] = bf16x2_to_f32(wv[u][o].x);
                        w[o][1] = bf16x2_to_f32(wv[u][o].y);
                        w[o][2] = bf16x2_to_f32(wv[u][o].z);
                        w[o][3] = bf16x2_to_f32(wv[u][o].w);
                    }
#pragma unroll
                    for (int r = 0; r < ROWS_MAX; ++r) {
                        if (r0 + r < rows) {
                            const float4* xp = (const float4*)(x + (long long)(r0 + r) * K) + 2 * idx;
                            float4 xa = __ldg(xp), xb = __ldg(xp + 1);
#pragma unroll
                            for (int o = 0; o < O; ++o) {
                                float a = acc[r][o];
                                a = fmaf(w[o][0].x, xa.x, a); a = fmaf(w[o][0].y, xa.y, a);
                                a = fmaf(w[o][1].x, xa.z, a); a = fmaf(w[o][1].y, xa.w, a);
                                a = fmaf(w[o][2].x, xb.x, a); a = fmaf(w[o][2].y, xb.y, a);
                                a = fmaf(w[o][3].x, xb.z, a); a = fmaf(w[o][3].y, xb.w, a);
#ifdef LOWP
                                a = round_bf16(a);
#endif
                                acc[r][o] = a;
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_MAX; ++r)
#pragma unroll
            for (int o = 0; o < O; ++o) {
                float s = warp_sum(acc[r][o]);
                if (lane == 0 && r0 + r < rows && live[o]) y[(long long)(r0 + r) * n_out + o0 + o] = s;
            }
    }
}

extern "C" __global__ void __launch_bounds__(256) gemv_bf16(
    const bf16_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
    const unsigned int* __restrict__ row_ids, int n_out, int K, int rows) {
    gemv_bf16_body<1>(W, x, y, row_ids, n_out, K, rows, ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
}

// gemv_bf16 with four outputs per warp (32 per block): the same bits, a quarter of the
// activation loads; for several rows.
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_w4(
    const bf16_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
    const unsigned int* __restrict__ row_ids, int n_out, int K, int rows) {
    gemv_bf16_body<4>(W, x, y, row_ids, n_out, K, rows, ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
}

// Up to 8 BF16 GEMVs of one input x [rows, K] in one launch: weight j [n_out[j], K] writes
// y[j] [rows, n_out[j]] from blocks start[j] .. start[j+1] (8 outputs per block, 32 for _w4). Each output is
// the same arithmetic as gemv_bf16's, so the results equal separate launches bit for bit.
struct Multi {
    unsigned long long w[8];
    unsigned long long y[8];
    int n_out[8];
    int start[9];
    int count;
};
template <int O>
__device__ __forceinline__ void gemv_bf16_multi_body(const Multi& m, const float* __restrict__ x, int K, int rows) {
    int j = 0;
    while (j + 1 < m.count && (int)blockIdx.x >= m.start[j + 1]) ++j;
    long long warp = ((long long)(blockIdx.x - m.start[j]) * blockDim.x + threadIdx.x) >> 5;
    gemv_bf16_body<O>((const bf16_t*)m.w[j], x, (float*)m.y[j], nullptr, m.n_out[j], K, rows, warp);
}
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_multi(Multi m, const float* __restrict__ x, int K,
                                                                  int rows) {
    gemv_bf16_multi_body<1>(m, x, K, rows);
}
// four outputs per warp: weight j's blocks cover 32 outputs each
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_multi_w4(Multi m, const float* __restrict__ x, int K,
                                                                     int rows) {
    gemv_bf16_multi_body<4>(m, x, K, rows);
}
