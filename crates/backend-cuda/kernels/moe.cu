// MoE: router (softmax over E, top-k with ties to the lower index, renormalise) and FP8 E4M3
// routed experts with 128x128 F32 block scales, w = fp8 * scale_inv[r/128, c/128], read only
// for the selected experts. Weights of one layer are stacked per expert:
// gate, up [E, I, H]; down [E, H, I]; scales [E, ceil(rows/128), ceil(cols/128)].

#if PLANT == 1
#define TIE_INIT (-1)
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i > bi); }
#else
#define TIE_INIT 0x7fffffff
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }
#endif

// ---- router: one block per row, logits [rows, E] f32 -> ids [rows, k] u32, weights [rows, k].
// PLANT 1: ties go to the higher index. LOWP: probabilities rounded to bf16.
// keep (optional, one byte per expert): experts with keep[e] == 0 get probability 0 before the
// normalisation and are never chosen.
extern "C" __global__ void moe_router(const float* __restrict__ logits, unsigned int* __restrict__ ids,
                                      float* __restrict__ weights, int E, int k,
                                      const unsigned char* __restrict__ keep) {
    extern __shared__ float p[];  // E floats
    __shared__ float scratch[32];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* l = logits + (size_t)blockIdx.x * E;
    float m = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (!keep || keep[e]) m = fmaxf(m, l[e]);
    // block max through the sum scratch pattern
    {
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        m = warp_max(m);
        __syncthreads();
        if (lane == 0) scratch[warp] = m;
        __syncthreads();
        m = warp_max(lane < nw ? scratch[lane] : -INFINITY);
    }
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = (!keep || keep[e]) ? expf(l[e] - m) : 0.0f;
        p[e] = v;
        s += v;
    }
    s = block_sum(s, scratch);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = p[e] / s;
#ifdef LOWP
        v = round_bf16(v);
#endif
        p[e] = (!keep || keep[e]) ? v : -3.0f;  // dropped experts are never chosen
    }
    __syncthreads();
    float tot = 0.0f;
    for (int j = 0; j < k; ++j) {
        float bv = -1.0f;
        int bi = TIE_INIT;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (better(p[e], e, bv, bi)) { bv = p[e]; bi = e; }
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v0 = best_v[0];
            int i0 = best_i[0];
            for (int w = 1; w < nw; ++w)
                if (better(best_v[w], best_i[w], v0, i0)) { v0 = best_v[w]; i0 = best_i[w]; }
            ids[(size_t)blockIdx.x * k + j] = (unsigned int)i0;
            weights[(size_t)blockIdx.x * k + j] = v0;
            tot += v0;
            p[i0] = -2.0f;  // taken
        }
        __syncthreads();
    }
    if (threadIdx.x == 0)
        for (int j = 0; j < k; ++j) weights[(size_t)blockIdx.x * k + j] /= tot;
}

// Dot of one FP8 weight row (length n, multiple of 512) with x, applying the row's block scales.
// Each lane reads 16 bytes per step; 16 divides 128, so one lane's bytes share one scale block.
__device__ __forceinline__ float fp8_row_dot(const fp8_t* __restrict__ row, const float* __restrict__ x,
                                             const float* __restrict__ srow, int n, int lane) {
    float acc = 0.0f;
    const uint4* rp = (const uint4*)row;
    int nvec = n >> 4;
#pragma unroll 4
    for (int v = lane; v < nvec; v += 32) {
        uint4 q = ld_stream(rp + v);
        int col = v << 4;
        const float4* xp = (const float4*)(x + col);
        float part = 0.0f;
        unsigned int words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float4 xv = __ldg(xp + j);
            float2 a = fp8x2_to_f32((unsigned short)(words[j] & 0xffffu));
            float2 b = fp8x2_to_f32((unsigned short)(words[j] >> 16));
            part = fmaf(a.x, xv.x, part); part = fmaf(a.y, xv.y, part);
            part = fmaf(b.x, xv.z, part); part = fmaf(b.y, xv.w, part);
        }
#if PLANT == 1
        float sc = srow[(col >> 7) / 4];  // wrong scale block index
#else
        float sc = srow[col >> 7];
#endif
        acc = fmaf(sc, part, acc);
    }
    return acc;
}

// ---- gate/up + SiLU-mul: h[j, i] = silu(gate_e . x) * (up_e . x), e = ids[j]; one warp per (j, i).
// x [H] f32 (one row); h [k, I]. PLANT 1: wrong scale block. LOWP: h rounded to bf16.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_fp8(
    const fp8_t* __restrict__ gate, const fp8_t* __restrict__ up, const float* __restrict__ gate_s,
    const float* __restrict__ up_s, const unsigned int* __restrict__ ids, const float* __restrict__ x,
    float* __restrict__ h, int I, int H, int k) {
    int lane = threadIdx.x & 31;
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp >= (long long)k * I) return;
    int j = (int)(warp / I), i = (int)(warp % I);
    long long e = ids[j];
    int sb_cols = (H + 127) >> 7, sb_rows = (I + 127) >> 7;
    long long row_off = (e * I + i) * (long long)H;
    long long s_off = (e * sb_rows + (i >> 7)) * (long long)sb_cols;
    float g = fp8_row_dot(gate + row_off, x, gate_s + s_off, H, lane);
    float u = fp8_row_dot(up + row_off, x, up_s + s_off, H, lane);
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) {
        float v = silu(g) * u;
#ifdef LOWP
        v = round_bf16(v);
#endif
        h[(long long)j * I + i] = v;
    }
}

// ---- down: y[n] = sum_j w[j] * (down_e . h[j]), e = ids[j]; one warp per output n, experts summed
// in order j = 0..k-1. PLANT 1: wrong scale block. LOWP: each expert's output rounded to bf16.
extern "C" __global__ void __launch_bounds__(256) moe_down_fp8(
    const fp8_t* __restrict__ down, const float* __restrict__ down_s, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k) {
    int lane = threadIdx.x & 31;
    long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (n >= H) return;
    int sb_cols = (I + 127) >> 7, sb_rows = (H + 127) >> 7;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        long long e = ids[j];
        long long row_off = (e * H + n) * (long long)I;
        long long s_off = (e * sb_rows + (n >> 7)) * (long long)sb_cols;
        float d = fp8_row_dot(down + row_off, h + (long long)j * I, down_s + s_off, I, lane);
        float dj = warp_sum(d);
#ifdef LOWP
        dj = round_bf16(dj);
#endif
        acc = fmaf(wts[j], dj, acc);
    }
    if (lane == 0) y[n] = acc;
}

// ---- multi-row experts over a pointer table: tab[6 e + {0..5}] = gate, up, down (fp8) and their
// block scales (f32) of expert e, each expert stored on its own. Row = blockIdx.y; every row runs
// the single-row arithmetic, so a row's result does not depend on the rows beside it.
// gate/up: h[row, j, i] = silu(gate_e . x[row]) * (up_e . x[row]), e = ids[row, j].
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_tab(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ x, float* __restrict__ h, int I, int H, int k) {
    int lane = threadIdx.x & 31;
    long long row = blockIdx.y;
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp >= (long long)k * I) return;
    int j = (int)(warp / I), i = (int)(warp % I);
    long long e = ids[row * k + j];
    const fp8_t* gate = (const fp8_t*)tab[6 * e + 0];
    const fp8_t* up = (const fp8_t*)tab[6 * e + 1];
    const float* gate_s = (const float*)tab[6 * e + 3];
    const float* up_s = (const float*)tab[6 * e + 4];
    int sb_cols = (H + 127) >> 7;
    long long row_off = (long long)i * H;
    long long s_off = (long long)(i >> 7) * sb_cols;
    const float* xr = x + row * H;
    float g = fp8_row_dot(gate + row_off, xr, gate_s + s_off, H, lane);
    float u = fp8_row_dot(up + row_off, xr, up_s + s_off, H, lane);
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) {
        float v = silu(g) * u;
#ifdef LOWP
        v = round_bf16(v);
#endif
        h[(row * k + j) * I + i] = v;
    }
}

// down: y[row, n] = sum_j w[row, j] * (down_e . h[row, j]), experts summed in rank order.
extern "C" __global__ void __launch_bounds__(256) moe_down_tab(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k) {
    int lane = threadIdx.x & 31;
    long long row = blockIdx.y;
    long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (n >= H) return;
    int sb_cols = (I + 127) >> 7;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        long long e = ids[row * k + j];
        const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
        const float* down_s = (const float*)tab[6 * e + 5];
        float d = fp8_row_dot(down + n * I, h + (row * k + j) * I, down_s + (n >> 7) * sb_cols, I, lane);
        float dj = warp_sum(d);
#ifdef LOWP
        dj = round_bf16(dj);
#endif
        acc = fmaf(wts[row * k + j], dj, acc);
    }
    if (lane == 0) y[row * H + n] = acc;
}

// A plain linear with an FP8 block-scaled weight W [n_out, K]: y[r, n] = W[n] . x[r].
// One warp per output, rows looped (batch-invariant).
extern "C" __global__ void __launch_bounds__(256) gemv_fp8(
    const fp8_t* __restrict__ W, const float* __restrict__ S, const float* __restrict__ x,
    float* __restrict__ y, int n_out, int K, int rows) {
    int lane = threadIdx.x & 31;
    long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (n >= n_out) return;
    int sb_cols = (K + 127) >> 7;
    for (int r = 0; r < rows; ++r) {
        float d = fp8_row_dot(W + n * K, x + (long long)r * K, S + (n >> 7) * sb_cols, K, lane);
        d = warp_sum(d);
#ifdef LOWP
        d = round_bf16(d);
#endif
        if (lane == 0) y[(long long)r * n_out + n] = d;
    }
}
