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

// Four activations of row r at key off as the gated GEMVs load them: x, silu(x) * u (ACT 1) or
// x * sigmoid(u) (ACT 2), zeros for a row past `rows`. Each product is rounded on its own
// (__fmul_rn), as elementwise stores it: a plain * could be contracted with the lo split's
// subtraction that follows in the callers.
template <int ACT>
__device__ __forceinline__ float4 act_load4(const float* __restrict__ x, const float* __restrict__ u, int r, int rows,
                                            int K, int off) {
    float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < rows) {
        xv = __ldg((const float4*)(x + (long long)r * K + off));
        if (ACT == 1) {
            const float4 uv = __ldg((const float4*)(u + (long long)r * K + off));
            xv.x = lowp(__fmul_rn(silu(xv.x), uv.x));
            xv.y = lowp(__fmul_rn(silu(xv.y), uv.y));
            xv.z = lowp(__fmul_rn(silu(xv.z), uv.z));
            xv.w = lowp(__fmul_rn(silu(xv.w), uv.w));
        } else if (ACT == 2) {
            const float4 uv = __ldg((const float4*)(u + (long long)r * K + off));
            xv.x = lowp(__fmul_rn(xv.x, sigmoidf(uv.x)));
            xv.y = lowp(__fmul_rn(xv.y, sigmoidf(uv.y)));
            xv.z = lowp(__fmul_rn(xv.z, sigmoidf(uv.z)));
            xv.w = lowp(__fmul_rn(xv.w, sigmoidf(uv.w)));
        }
    }
    return xv;
}

// ---------------------------------------------------------------- tensor-core GEMV, short K per warp

// y[r, n] = sum_k W[n, k] x[r, k] for 16 outputs n0.. of one weight on tensor cores. BF16 weights
// are exact in TF32; each activation is split x = hi + lo into two TF32 values (hi = tf32(x),
// lo = tf32(x - hi)), and the two products run as separate MMAs into separate accumulators, so
// the result carries about 22 bits of x where one TF32 MMA would carry 11. Each MMA (8 keys)
// starts from zero and its result is added in f32, since chaining MMAs through the accumulator
// truncates at every step (the tiny fixture's teacher-forced codebook logits failed that way).
// K is cut into chunks [kc c, kc c + kc) (at most 16; kc a multiple of 32 V, set by the caller
// from K alone, so a row's bits depend on K and the weights, never on the rows beside it); a
// chunk's partial tile is its own sum in steps of 32 V keys, and the partials are summed in
// chunk order through shared memory. Every output of a row is the same sequence of operations
// whatever the other rows hold and however many there are, so the result does not depend on
// the batch. The block's warps take the chunks in runs of ceil(chunks / warps): one chunk a
// warp as the engine launches it (fewer warps, so that a multiprocessor's warps share one
// activation chunk in L1, measured slower: DRAMATIS_CUDA_GEMV_WARPS); the warp count changes
// only which warp computes a chunk, never the bits. In a step,
// thread (g, t) loads 8 V consecutive weights of rows n0 + g and n0 + g + 8 at key kb + 8 V t
// (V = 2: one 128-byte line per row and step) and the matching activations; MMA s (0 <= s < 4 V)
// takes keys 8 V t + 2 s and 8 V t + 2 s + 1 of each t. G row groups of 8 per pass (G = 1 for
// up to 8 rows: a quarter of the accumulators, the same bits). At most 16 chunks. kc = 512 with
// V = 1 is session 7's gemv_tc (DRAMATIS_CUDA_GEMV_KC=0).
// ACT 1: the input is silu(x) * u (elementwise op 1); ACT 2: x * sigmoid(u) (op 2); made as it
// is loaded with the elementwise op's bits, so the result equals the op then the linear bit for
// bit.
// PLANT 1: skips each chunk's last step. LOWP: one TF32 MMA (lo dropped).
// (Two other load layouts were measured and removed in session 8: two 8-key chunks 32 keys
// apart, so each load reads 64 contiguous bytes, was slower on most shapes at one row (GDN
// projections 23.5 -> 27.1 us); layout 2 with `L2::256B` loads was the same speed. NOTES.md,
// session 8.)
template <int G, int V, int ACT = 0>
__device__ __forceinline__ void gemv_tc2_body(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              float* __restrict__ y, int n_out, int K, int rows, int n0, int kc,
                                              const float* __restrict__ u = nullptr) {
    __shared__ float red[16][G][32][4];
    constexpr int SK = 32 * V;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ra = n0 + g, rb = n0 + g + 8;
    const int nc = (K + kc - 1) / kc;   // chunks, at most 16
    const int run = (nc + nw - 1) / nw;  // chunks a warp
    const int c0 = warp * run, c1 = c0 + run < nc ? c0 + run : nc;
    const bf16_t* wa = W + (long long)(ra < n_out ? ra : 0) * K;
    const bf16_t* wb = W + (long long)(rb < n_out ? rb : 0) * K;
    for (int r0 = 0; r0 < rows; r0 += 8 * G) {
#pragma unroll 1
        for (int c = c0; c < c1; ++c) {
            const int kb0 = c * kc;
            int kb1 = kb0 + kc < K ? kb0 + kc : K;
#if PLANT == 1
            kb1 -= SK;
#endif
            float hi[G][4], lo[G][4];
#pragma unroll
            for (int q = 0; q < G; ++q)
#pragma unroll
                for (int e = 0; e < 4; ++e) hi[q][e] = lo[q][e] = 0.0f;
#pragma unroll 4
            for (int kb = kb0; kb < kb1; kb += SK) {
                const int k = kb + 8 * V * t;
                unsigned int wav[4 * V], wbv[4 * V];
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    uint4 ua = ra < n_out ? ld_stream(wa + k + 8 * v) : make_uint4(0, 0, 0, 0);
                    uint4 ub = rb < n_out ? ld_stream(wb + k + 8 * v) : make_uint4(0, 0, 0, 0);
                    wav[4 * v] = ua.x; wav[4 * v + 1] = ua.y; wav[4 * v + 2] = ua.z; wav[4 * v + 3] = ua.w;
                    wbv[4 * v] = ub.x; wbv[4 * v + 1] = ub.y; wbv[4 * v + 2] = ub.z; wbv[4 * v + 3] = ub.w;
                }
#pragma unroll
                for (int q = 0; q < G; ++q) {
                    const int r = r0 + 8 * q + g;
                    if (r0 + 8 * q >= rows) break;  // uniform across the warp
                    float xs[8 * V];
#pragma unroll
                    for (int v = 0; v < 2 * V; ++v) {
                        const float4 xv = act_load4<ACT>(x, u, r, rows, K, k + 4 * v);
                        xs[4 * v] = xv.x; xs[4 * v + 1] = xv.y; xs[4 * v + 2] = xv.z; xs[4 * v + 3] = xv.w;
                    }
#pragma unroll
                    for (int s = 0; s < 4 * V; ++s) {
                        const unsigned int a[4] = {wav[s] << 16, wbv[s] << 16, wav[s] & 0xffff0000u,
                                                   wbv[s] & 0xffff0000u};
                        const unsigned int h0 = tf32_hi(xs[2 * s]), h1 = tf32_hi(xs[2 * s + 1]);
                        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        mma_tf32(d, a, h0, h1);
#pragma unroll
                        for (int e = 0; e < 4; ++e) hi[q][e] += d[e];
#ifndef LOWP
                        const unsigned int l0 = to_tf32(xs[2 * s] - __uint_as_float(h0));
                        const unsigned int l1 = to_tf32(xs[2 * s + 1] - __uint_as_float(h1));
                        float dl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        mma_tf32(dl, a, l0, l1);
#pragma unroll
                        for (int e = 0; e < 4; ++e) lo[q][e] += dl[e];
#endif
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < G; ++q)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[c][q][lane][e] = hi[q][e] + lo[q][e];
        }
        __syncthreads();
        // every thread sums outputs (it was warp 0 alone while the block's other warps waited at
        // the barrier: 40% of the stalls at 32 rows in session 14's ncu); an output's chunk
        // partials still add in chunk order, the same operations
        for (int i = threadIdx.x; i < G * 128; i += blockDim.x) {
            const int q = i >> 7, l = (i >> 2) & 31, e = i & 3;
            if (r0 + 8 * q >= rows) break;  // q only grows with i
            float acc = red[0][q][l][e];
            for (int w = 1; w < nc; ++w) acc += red[w][q][l][e];
            const int n = n0 + (l >> 2) + (e < 2 ? 0 : 8);
            const int r = r0 + 8 * q + 2 * (l & 3) + (e & 1);
            if (n < n_out && r < rows) y[(long long)r * n_out + n] = acc;
        }
        __syncthreads();
    }
}

// The rows a block takes: all of them (grid.y 1), or for many rows a slab of whole 32-row passes,
// grid.y slabs (blocks few against the multiprocessors then cover more of them). A row's
// operations are the same in any slab, so the bits are too.
__device__ __forceinline__ int gemv_slab(int rows) {
    const int passes = (rows + 31) >> 5;
    return 32 * ((passes + (int)gridDim.y - 1) / (int)gridDim.y);
}
#define GEMV_TC2(G, V)                                                                                    \
    extern "C" __global__ void LB_GEMV gemv_tc2_g##G##_v##V(                                              \
        const bf16_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int n_out, int K, \
        int rows, int kc) {                                                                               \
        const int slab = gemv_slab(rows), rs = blockIdx.y * slab;                                         \
        if (rs >= rows) return;                                                                           \
        gemv_tc2_body<G, V>(W, x + (long long)rs * K, y + (long long)rs * n_out, n_out, K,                \
                            min(slab, rows - rs), blockIdx.x * 16, kc);                                   \
    }                                                                                                     \
    extern "C" __global__ void LB_GEMV gemv_tc2_multi_g##G##_v##V(Multi m, const float* __restrict__ x,   \
                                                                  int K, int rows, int kc) {              \
        int j = 0;                                                                                        \
        while (j + 1 < m.count && (int)blockIdx.x >= m.start[j + 1]) ++j;                                 \
        const int slab = gemv_slab(rows), rs = blockIdx.y * slab;                                         \
        if (rs >= rows) return;                                                                           \
        gemv_tc2_body<G, V>((const bf16_t*)m.w[j], x + (long long)rs * K,                                 \
                            (float*)m.y[j] + (long long)rs * m.n_out[j], m.n_out[j], K,                   \
                            min(slab, rows - rs), (blockIdx.x - m.start[j]) * 16, kc);                    \
    }
GEMV_TC2(1, 1)
GEMV_TC2(4, 1)
GEMV_TC2(1, 2)
GEMV_TC2(4, 2)
// y = W (silu(x) * u) and y = W (x * sigmoid(u)): silu_mul / sigmoid_mul fused into the input
#define GEMV_TC2_SILU(G, V)                                                                               \
    extern "C" __global__ void LB_GEMV gemv_tc2_silu_g##G##_v##V(                                         \
        const bf16_t* __restrict__ W, const float* __restrict__ x, const float* __restrict__ u,           \
        float* __restrict__ y, int n_out, int K, int rows, int kc) {                                      \
        const int slab = gemv_slab(rows), rs = blockIdx.y * slab;                                         \
        if (rs >= rows) return;                                                                           \
        gemv_tc2_body<G, V, 1>(W, x + (long long)rs * K, y + (long long)rs * n_out, n_out, K,             \
                               min(slab, rows - rs), blockIdx.x * 16, kc, u + (long long)rs * K);         \
    }                                                                                                     \
    extern "C" __global__ void LB_GEMV gemv_tc2_sigm_g##G##_v##V(                                         \
        const bf16_t* __restrict__ W, const float* __restrict__ x, const float* __restrict__ u,           \
        float* __restrict__ y, int n_out, int K, int rows, int kc) {                                      \
        const int slab = gemv_slab(rows), rs = blockIdx.y * slab;                                         \
        if (rs >= rows) return;                                                                           \
        gemv_tc2_body<G, V, 2>(W, x + (long long)rs * K, y + (long long)rs * n_out, n_out, K,             \
                               min(slab, rows - rs), blockIdx.x * 16, kc, u + (long long)rs * K);         \
    }
GEMV_TC2_SILU(1, 1)
GEMV_TC2_SILU(4, 1)
GEMV_TC2_SILU(1, 2)
GEMV_TC2_SILU(4, 2)


// ---------------------------------------------------------------- many rows: gemv_tc2 bits, tiled
// gemv_tc2_body<G, 2, ACT>'s arithmetic for many rows, with the data moved once per block: a
// block takes 64 outputs x 64 rows and walks K in 64-key steps; each step's weight tile (BF16,
// 64 x 64) and activation tile (f32, made with the elementwise op as gemv_tc2 makes it, then
// split hi + lo once) go to shared memory in fragment order, and the next step's tiles are
// loaded into registers while this one computes. Every output is the same sequence of
// operations as gemv_tc2 (V = 2): in chunk c of kc keys, for each 64-key step kb and each
// s = 0..7, the MMA over keys {kb + 16 t + 2 s, + 1 : t = 0..3} from zero, added to the
// chunk's hi (activations' hi) and lo (their lo) sums; the chunk's hi + lo then added to the
// running total in chunk order (gemv_tc2's red[0] + red[1] + ...). So a row's result equals
// its one-row gemv_tc2 launch bit for bit, whatever the other rows and the tiling.
// Warp w: outputs 32 (w & 1) .. + 32 (two 16-output MMA tiles), rows 16 (w >> 1) .. + 16 (two
// 8-row tiles). Shared layout, one 16-byte read per fragment: the weight words (keys 16 t + 2 s,
// + 1) of outputs 32 h + g + 8 q, q = 0..3, at Wv[h][s][g][t].q (a thread's both MMA tiles); the
// activation words of keys 16 t + 2 s + b of row r at Xv[r][s][t] = (hi b 0, hi b 1, lo b 0,
// lo b 1) (row stride 36: the 8 threads of each quarter-warp read distinct 16-byte bank
// groups). (Session 12's layout read the same words one at a time: 12 reads a step s.)
// PLANT 1 skips each chunk's last step (as gemv_tc2's); LOWP: one TF32 MMA (lo dropped).
#define TT_XS 36
// Two blocks a multiprocessor (128 registers; a few addresses spill, reloaded once a 64-key
// step, outside the MMAs): at one block (148 registers) a multiprocessor held 8 warps, 2 a
// scheduler, and the tiles issued at ~18% of the rate (session 12's ncu). -DTT_OCC=0
// (DRAMATIS_CUDA_TT_OCC=0) builds the old bound (none). Register allocation moves no bits.
#ifndef TT_OCC
#define TT_OCC 2
#endif
#if TT_OCC
#define LB_TT __launch_bounds__(256, TT_OCC)
#else
#define LB_TT __launch_bounds__(256)
#endif
// One 64-key step's key pair s for a warp's 2 x 2 MMA tiles, as gemv_tc2 (V = 2) adds it: for
// output tile i (A registers from the bf16 words wa, wb: outputs g and g + 8) and row tile j,
// each MMA from zero, hi += A bh, lo += A bl (LOWP: no lo).
__device__ __forceinline__ void mma_hilo_2x2(float (&hi)[2][2][4], float (&lo)[2][2][4], const unsigned int (&wa)[2],
                                             const unsigned int (&wb)[2], const unsigned int (&bh)[2][2],
                                             const unsigned int (&bl)[2][2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int a[4] = {wa[i] << 16, wb[i] << 16, wa[i] & 0xffff0000u, wb[i] & 0xffff0000u};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32(d, a, bh[j][0], bh[j][1]);
#pragma unroll
            for (int e = 0; e < 4; ++e) hi[i][j][e] += d[e];
#ifndef LOWP
            float dl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32(dl, a, bl[j][0], bl[j][1]);
#pragma unroll
            for (int e = 0; e < 4; ++e) lo[i][j][e] += dl[e];
#endif
        }
    }
}

// A chunk's end in a warp's 2 x 2 MMA tiles: its hi + lo added to the running total in chunk
// order (gemv_tc2's red[0] + red[1] + ...; the first chunk's sum is the total), hi and lo zeroed.
__device__ __forceinline__ void tile_fold(float (&hi)[2][2][4], float (&lo)[2][2][4], float (&tot)[2][2][4],
                                          bool first) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float part = hi[i][j][e] + lo[i][j][e];
                tot[i][j][e] = first ? part : tot[i][j][e] + part;
                hi[i][j][e] = lo[i][j][e] = 0.0f;
            }
}
// A warp's 2 x 2 MMA tiles of totals into y [rows, n_out]: output n0 + 16 i (+ 8), row r0 + 8 j
// (+ 1) for tile (i, j) (n0, r0: this thread's first output and row).
__device__ __forceinline__ void tile_store(const float (&tot)[2][2][4], float* __restrict__ y, int n_out, int rows,
                                           int n0, int r0) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = n0 + 16 * i + (e >= 2 ? 8 : 0);
                const int r = r0 + 8 * j + (e & 1);
                if (n < n_out && r < rows) y[(long long)r * n_out + n] = tot[i][j][e];
            }
}

template <int ACT>
__device__ __forceinline__ void gemv_tt_body(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                             float* __restrict__ y, int n_out, int K, int rows, int o0,
                                             int kc, const float* __restrict__ u) {
    __shared__ uint4 Wv[2][8][8][4];
    __shared__ uint4 Xv[64][TT_XS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wo = warp & 1, wr = warp >> 1;
    const int r0 = blockIdx.y * 64;
    // this thread's loads: weight uint4 q = tid, tid + 256 (row q >> 3, keys 8 (q & 7) ..);
    // activation float4 q = tid + 256 i (row q >> 4, keys 4 (q & 15) ..)
    uint4 wreg[2];
    float4 xreg[4];
    auto load = [&](int kb) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int q = tid + 256 * i, o = o0 + (q >> 3);
            wreg[i] = o < n_out ? ld_stream(W + (long long)o * K + kb + 8 * (q & 7)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = tid + 256 * i, r = r0 + (q >> 4), off = kb + 4 * (q & 15);
            xreg[i] = act_load4<ACT>(x, u, r, rows, K, off);
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int q = tid + 256 * i, o = q >> 3, c = q & 7;
            const int h = o >> 5, oq = (o >> 3) & 3, og = o & 7;
            const unsigned int wv[4] = {wreg[i].x, wreg[i].y, wreg[i].z, wreg[i].w};
            unsigned int* base = (unsigned int*)&Wv[h][0][og][0] + oq;
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int wd = 4 * c + m;  // word of keys 2 wd, 2 wd + 1 = 16 t + 2 s
                base[4 * (32 * (wd & 7) + (wd >> 3))] = wv[m];  // Wv[h][s][og][t].oq
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = tid + 256 * i, r = q >> 4, c = q & 15;
            // keys 4 c .. 4 c + 3: s = (c & 3) * 2 + {0, 1} (two keys each), t = c >> 2
            const int tt = c >> 2, s0 = 2 * (c & 3);
            const unsigned int h0 = tf32_hi(xreg[i].x), h1 = tf32_hi(xreg[i].y);
            const unsigned int h2 = tf32_hi(xreg[i].z), h3 = tf32_hi(xreg[i].w);
            Xv[r][4 * s0 + tt] = make_uint4(h0, h1, to_tf32(xreg[i].x - __uint_as_float(h0)),
                                            to_tf32(xreg[i].y - __uint_as_float(h1)));
            Xv[r][4 * (s0 + 1) + tt] = make_uint4(h2, h3, to_tf32(xreg[i].z - __uint_as_float(h2)),
                                                  to_tf32(xreg[i].w - __uint_as_float(h3)));
        }
    };
    float hi[2][2][4], lo[2][2][4], tot[2][2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) hi[i][j][e] = lo[i][j][e] = tot[i][j][e] = 0.0f;
    load(0);
    bool first = true;
    for (int kb = 0; kb < K; kb += 64) {
        __syncthreads();
        store();
        __syncthreads();
        if (kb + 64 < K) load(kb + 64);
        const bool last = (kb + 64) % kc == 0 || kb + 64 >= K;  // this step ends its chunk
#if PLANT == 1
        const bool skip = last;
#else
        const bool skip = false;
#endif
        if (!skip) {
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                unsigned int bh[2][2], bl[2][2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint4 v = Xv[16 * wr + 8 * j + g][4 * s + t];
                    bh[j][0] = v.x;
                    bh[j][1] = v.y;
                    bl[j][0] = v.z;
                    bl[j][1] = v.w;
                }
                const uint4 wq = Wv[wo][s][g][t];
                const unsigned int wa[2] = {wq.x, wq.z}, wb[2] = {wq.y, wq.w};
                mma_hilo_2x2(hi, lo, wa, wb, bh, bl);
            }
        }
        if (last) {
            tile_fold(hi, lo, tot, first);
            first = false;
        }
    }
    tile_store(tot, y, n_out, rows, o0 + 32 * wo + g, r0 + 16 * wr + 2 * t);
}

extern "C" __global__ void LB_TT gemv_tt(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                         float* __restrict__ y, int n_out, int K, int rows, int kc) {
    gemv_tt_body<0>(W, x, y, n_out, K, rows, blockIdx.x * 64, kc, nullptr);
}
extern "C" __global__ void LB_TT gemv_tt_multi(Multi m, const float* __restrict__ x, int K, int rows, int kc) {
    int j = 0;
    while (j + 1 < m.count && (int)blockIdx.x >= m.start[j + 1]) ++j;
    gemv_tt_body<0>((const bf16_t*)m.w[j], x, (float*)m.y[j], m.n_out[j], K, rows, (blockIdx.x - m.start[j]) * 64,
                    kc, nullptr);
}
extern "C" __global__ void LB_TT gemv_tt_silu(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              const float* __restrict__ u, float* __restrict__ y, int n_out, int K,
                                              int rows, int kc) {
    gemv_tt_body<1>(W, x, y, n_out, K, rows, blockIdx.x * 64, kc, u);
}
extern "C" __global__ void LB_TT gemv_tt_sigm(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              const float* __restrict__ u, float* __restrict__ y, int n_out, int K,
                                              int rows, int kc) {
    gemv_tt_body<2>(W, x, y, n_out, K, rows, blockIdx.x * 64, kc, u);
}

// ---------------------------------------------------------------- a few tens of rows: tiles split over K
// gemv_tt's arithmetic in 64-output x 32-row tiles, each block one key chunk of kc keys (grid z):
// at 17-64 rows a 64-row tile does twice the work, and a tile walking all of K leaves most of
// the device idle (128 tiles for 8192 outputs, 32 for 2048). A block leaves its chunk's sums in
// `part` ([tiles][chunks][32][64] f32); the tile's last block adds them in chunk order
// (gemv_tc2's red[0] + red[1] + ...), so every row's bits are gemv_tc2's. `count` holds a
// ticket a tile, zero between launches (the last block resets it): launches that may run at
// once (a side branch's) take other counters.
// Four warps, warp w a 32-output x 16-row tile (outputs 32 (w & 1) .. + 32, rows 16 (w >> 1) ..
// + 16), so a warp reads 1 KB of shared memory a key step s for 8 MMAs (gemv_tt's layout, which
// gemv_ts used before, read it for 4: session 21's ncu had the L1/shared pipe at 79%, the
// bound). The 64-key steps go to shared memory by cp.async, TS_ST buffers (TS_ST - 1 steps in
// flight while a step's MMAs run: with 4-16 steps a block, one step ahead left the blocks
// waiting on DRAM latency, session 21's ncu), in row order: a weight row is 8 16-byte words, an
// activation row 16 words of 4 f32. Word w of row r sits at w ^ (r & 1) (activations
// ts_xsw(w) ^ (r & 1): ts_xsw swaps words 8, 9 with 10, 11 and 12, 13 with 14, 15), so every
// 8-thread phase of a fragment read (rows g = 0, 1 at keys 16 t + ...) hits 8 distinct bank
// groups, and a copy phase writes one 128-byte line. No padding: three buffers fill the 48 KB
// of static shared memory exactly (the last block's flag then reuses the first buffer).
// The activations' hi / lo TF32 split is made at the read, as gemv_tc2 makes it. The host
// gives whole 64-key steps: K and kc multiples of 64, grid z = ceil(K / kc) <= TS_MAXC, 128
// threads.
#ifndef TS_OCC
#define TS_OCC 4
#endif
// rows a gemv_ts tile (the host's GEMV_TS_ROWS sizes the chunk sums' workspace from it)
#define TS_RT 32
// most key chunks a tile adds (the host gives a weight at most 16)
#define TS_MAXC 16
// shared-memory buffers of 64-key steps (the host's DRAMATIS_CUDA_TS_STAGES: 2 or 3)
#ifndef TS_ST
#define TS_ST 3
#endif
#define LB_TS __launch_bounds__(128, TS_OCC)
__device__ __forceinline__ int ts_xsw(int w) { return w ^ (((w >> 3) & 1) << 1); }
// 16 bytes global -> shared, asynchronously; zeros when !ok (nothing read)
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    unsigned int d;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// wait until at most N of this thread's committed copy groups are pending
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ unsigned int u4c(const uint4& v, int c) {
    return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}
// WALK (gemv_tw*): the block walks all of K itself, adding each chunk's hi + lo to its running
// total at the chunk's end as gemv_tt does (tot = first ? part : tot + part), and writes y; no
// chunk sums leave the block. Otherwise one key chunk (grid z), its sums to `part`.
template <int ACT, bool WALK>
__device__ __forceinline__ void gemv_ts_body(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                             float* __restrict__ y, int n_out, int K, int rows, int o0, int r0,
                                             int kc, const float* __restrict__ u, float* __restrict__ part,
                                             int* __restrict__ count) {
    __shared__ uint4 Ws[TS_ST][64 * 8];
    __shared__ uint4 Xs[TS_ST][TS_RT * 16];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wo = warp & 1, wr = warp >> 1;
    const int kbeg = WALK ? 0 : (int)blockIdx.z * kc, kend = WALK ? K : min(K, kbeg + kc);
    const int steps = (kend - kbeg) / 64;
    // a step's 512 weight words (64 rows x 8) and 512 activation words (32 rows x 16): thread
    // tid copies words tid + 128 m of each
    float4 xreg[4];
    auto issue = [&](int b, int kb) {
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int q = tid + 128 * m, row = q >> 3, w = q & 7, o = o0 + row;
            const bool ok = o < n_out;
            cp_async16(&Ws[b][row * 8 + (w ^ (row & 1))], W + (long long)(ok ? o : o0) * K + kb + 8 * w, ok);
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int q = tid + 128 * m, r = q >> 4, w = q & 15;
            if (ACT == 0) {
                const bool ok = r0 + r < rows;
                cp_async16(&Xs[b][r * 16 + (ts_xsw(w) ^ (r & 1))], x + (long long)(ok ? r0 + r : 0) * K + kb + 4 * w,
                           ok);
            } else {
                xreg[m] = act_load4<ACT>(x, u, r0 + r, rows, K, kb + 4 * w);
            }
        }
        cp_async_commit();
    };
    auto put = [&](int b) {
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int q = tid + 128 * m, r = q >> 4, w = q & 15;
            Xs[b][r * 16 + (ts_xsw(w) ^ (r & 1))] =
                make_uint4(__float_as_uint(xreg[m].x), __float_as_uint(xreg[m].y), __float_as_uint(xreg[m].z),
                           __float_as_uint(xreg[m].w));
        }
    };
    float hi[2][2][4], lo[2][2][4], tot[2][2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) hi[i][j][e] = lo[i][j][e] = tot[i][j][e] = 0.0f;
    bool first = true;
    // TS_ST - 1 steps ahead; a group a step, empty past the chunk's end, so that step i's copies
    // are in once at most TS_ST - 2 groups are pending (st's wait)
#pragma unroll
    for (int s = 0; s < TS_ST - 1; ++s) {
        if (s < steps) {
            issue(s, kbeg + 64 * s);
            if (ACT != 0) put(s);
        } else {
            cp_async_commit();
        }
    }
    int b = 0, bn = TS_ST - 1;  // the buffers of step st and of step st + TS_ST - 1
    for (int st = 0; st < steps; ++st) {
        cp_async_wait<TS_ST - 2>();
        __syncthreads();  // step st's words in; every warp done with buffer bn (step st - 1's)
        const bool more = st + TS_ST - 1 < steps;
        if (more) {
            issue(bn, kbeg + 64 * (st + TS_ST - 1));
        } else {
            cp_async_commit();
        }
        // this step ends its key chunk (a block's one chunk; a walk's every kc keys and the last)
        const bool last = st + 1 == steps || (WALK && (64 * (st + 1)) % kc == 0);
#if PLANT == 1
        const bool skip = last;  // the chunk's last step
#else
        const bool skip = false;
#endif
        if (!skip) {
            // one half step at a time (unrolled, ptxas held both halves' fragments and spilled)
#pragma unroll 1
            for (int h = 0; h < 2; ++h) {
                // weight words 8 t + 4 h .. + 3 (keys 16 t + 2 s, + 1 for s = 4 h ..) of rows
                // 32 wo + 16 i + 8 q + g; activations keys 16 t + 8 h + 4 e .. of rows 16 wr + 8 j + g
                // (every fragment row has r & 1 = g & 1)
                uint4 wq[2][2], xq[2][2];
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int q = 0; q < 2; ++q)
                        wq[i][q] = Ws[b][(32 * wo + 16 * i + 8 * q + g) * 8 + ((2 * t + h) ^ (g & 1))];
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        xq[j][e] = Xs[b][(16 * wr + 8 * j + g) * 16 + (ts_xsw(4 * t + 2 * h + e) ^ (g & 1))];
#pragma unroll
                for (int s4 = 0; s4 < 4; ++s4) {
                    unsigned int bh[2][2], bl[2][2];
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float x0 = __uint_as_float(u4c(xq[j][s4 >> 1], 2 * (s4 & 1)));
                        const float x1 = __uint_as_float(u4c(xq[j][s4 >> 1], 2 * (s4 & 1) + 1));
                        bh[j][0] = tf32_hi(x0);
                        bh[j][1] = tf32_hi(x1);
                        bl[j][0] = to_tf32(x0 - __uint_as_float(bh[j][0]));
                        bl[j][1] = to_tf32(x1 - __uint_as_float(bh[j][1]));
                    }
                    const unsigned int wa[2] = {u4c(wq[0][0], s4), u4c(wq[1][0], s4)};
                    const unsigned int wb[2] = {u4c(wq[0][1], s4), u4c(wq[1][1], s4)};
                    mma_hilo_2x2(hi, lo, wa, wb, bh, bl);
                }
            }
        }
        if (WALK && last) {
            tile_fold(hi, lo, tot, first);
            first = false;
        }
        if (ACT != 0 && more) put(bn);
        b = b + 1 == TS_ST ? 0 : b + 1;
        bn = bn + 1 == TS_ST ? 0 : bn + 1;
    }
    if (WALK) {
        tile_store(tot, y, n_out, rows, o0 + 32 * wo + g, r0 + 16 * wr + 2 * t);
        return;
    }
    // this chunk's sums (the tile's 32 x 64, row-major) at chunk z of the tile's run in `part`
    constexpr int TS = 64 * TS_RT;
    const int nc = (int)gridDim.z;  // the chunks, as the host counted them
    const long long tile = (long long)blockIdx.y * gridDim.x + blockIdx.x;
    float* pt = part + tile * nc * TS;
    float* mine = pt + (long long)blockIdx.z * TS;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int nl = 32 * wo + 16 * i + g + (e >= 2 ? 8 : 0);
                const int rl = 16 * wr + 8 * j + 2 * t + (e & 1);
                mine[rl * 64 + nl] = hi[i][j][e] + lo[i][j][e];
            }
    // the flag in the first buffer: past this barrier no warp reads the buffers, and no copy is
    // pending (every step's group was waited for before its MMAs; later groups are empty)
    int& is_last = *reinterpret_cast<int*>(&Ws[0][0]);
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(count + tile, 1) == nc - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // the tile's last block: the chunk sums added in chunk order (the whole-K walk's tot),
    // an output's TS_MAXC loads issued together before the adds (one L2 round trip, not nc)
    for (int q = tid; q < TS; q += 128) {
        const int n = o0 + (q & 63), r = r0 + (q >> 6);
        float v[TS_MAXC];
#pragma unroll
        for (int c = 0; c < TS_MAXC; ++c) v[c] = c < nc ? __ldcg(pt + (long long)c * TS + q) : 0.0f;
        float acc = v[0];
#pragma unroll
        for (int c = 1; c < TS_MAXC; ++c)
            if (c < nc) acc += v[c];
        if (n < n_out && r < rows) y[(long long)r * n_out + n] = acc;
    }
    if (tid == 0) count[tile] = 0;
}
extern "C" __global__ void LB_TS gemv_ts(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                         float* __restrict__ y, int n_out, int K, int rows, int kc,
                                         float* __restrict__ part, int* __restrict__ count) {
    gemv_ts_body<0, false>(W, x, y, n_out, K, rows, blockIdx.x * 64, blockIdx.y * TS_RT, kc, nullptr, part, count);
}
extern "C" __global__ void LB_TS gemv_ts_multi(Multi m, const float* __restrict__ x, int K, int rows, int kc,
                                               float* __restrict__ part, int* __restrict__ count) {
    int j = 0;
    while (j + 1 < m.count && (int)blockIdx.x >= m.start[j + 1]) ++j;
    gemv_ts_body<0, false>((const bf16_t*)m.w[j], x, (float*)m.y[j], m.n_out[j], K, rows,
                           (blockIdx.x - m.start[j]) * 64, blockIdx.y * TS_RT, kc, nullptr, part, count);
}
extern "C" __global__ void LB_TS gemv_ts_silu(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              const float* __restrict__ u, float* __restrict__ y, int n_out, int K,
                                              int rows, int kc, float* __restrict__ part, int* __restrict__ count) {
    gemv_ts_body<1, false>(W, x, y, n_out, K, rows, blockIdx.x * 64, blockIdx.y * TS_RT, kc, u, part, count);
}
extern "C" __global__ void LB_TS gemv_ts_sigm(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              const float* __restrict__ u, float* __restrict__ y, int n_out, int K,
                                              int rows, int kc, float* __restrict__ part, int* __restrict__ count) {
    gemv_ts_body<2, false>(W, x, y, n_out, K, rows, blockIdx.x * 64, blockIdx.y * TS_RT, kc, u, part, count);
}

// ---------------------------------------------------------------- many rows: gemv_ts's tiles walking K
// gemv_tt's arithmetic (gemv_tc2's bits) in gemv_ts's 64-output x 32-row tiles of four warps fed by
// cp.async, each block walking all of K (WALK above): for prompts and joined prefills, in place of
// gemv_tt's 64 x 64 tiles, whose eight warps stage every step through registers between two
// barriers. The host's grid is gemv_tt's (x the output blocks, y the row tiles); blocks are taken in
// the other order, the row tiles of an output block one after another, so that its weights come
// from L2 after the first. The host gives K and kc multiples of 64, 128 threads.
#ifndef TW_OCC
#define TW_OCC 3
#endif
#define LB_TW __launch_bounds__(128, TW_OCC)
// this block's output block (of grid x) and row tile (of grid y)
__device__ __forceinline__ int2 tw_tile() {
    const int id = (int)(blockIdx.x + gridDim.x * blockIdx.y);
    return make_int2(id / (int)gridDim.y, id % (int)gridDim.y);
}
extern "C" __global__ void LB_TW gemv_tw(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                         float* __restrict__ y, int n_out, int K, int rows, int kc) {
    const int2 b = tw_tile();
    gemv_ts_body<0, true>(W, x, y, n_out, K, rows, b.x * 64, b.y * TS_RT, kc, nullptr, nullptr, nullptr);
}
extern "C" __global__ void LB_TW gemv_tw_multi(Multi m, const float* __restrict__ x, int K, int rows, int kc) {
    const int2 b = tw_tile();
    int j = 0;
    while (j + 1 < m.count && b.x >= m.start[j + 1]) ++j;
    gemv_ts_body<0, true>((const bf16_t*)m.w[j], x, (float*)m.y[j], m.n_out[j], K, rows, (b.x - m.start[j]) * 64,
                          b.y * TS_RT, kc, nullptr, nullptr, nullptr);
}
extern "C" __global__ void LB_TW gemv_tw_silu(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              const float* __restrict__ u, float* __restrict__ y, int n_out, int K,
                                              int rows, int kc) {
    const int2 b = tw_tile();
    gemv_ts_body<1, true>(W, x, y, n_out, K, rows, b.x * 64, b.y * TS_RT, kc, u, nullptr, nullptr);
}
extern "C" __global__ void LB_TW gemv_tw_sigm(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                              const float* __restrict__ u, float* __restrict__ y, int n_out, int K,
                                              int rows, int kc) {
    const int2 b = tw_tile();
    gemv_ts_body<2, true>(W, x, y, n_out, K, rows, b.x * 64, b.y * TS_RT, kc, u, nullptr, nullptr);
}
