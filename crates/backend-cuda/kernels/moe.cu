// MoE: router (softmax over E, top-k by logit with ties to the lower index, renormalise) and
// routed experts, read only for the selected experts: FP8 E4M3 with 128x128 F32 block scales,
// w = fp8 * scale_inv[r/128, c/128], and NVFP4 (at the end of this file). Weights of one layer are stacked per expert:
// gate, up [E, I, H]; down [E, H, I]; scales [E, ceil(rows/128), ceil(cols/128)].

// Ranking order of the router: a higher key first, equal keys to the lower index (PLANT 1: to
// the higher index). NaN marks an expert that cannot be chosen (pruned, or taken already); a NaN
// best-so-far loses to any candidate.
#if PLANT == 1
#define TIE_INIT (-1)
__device__ __forceinline__ bool tie_first(int i, int bi) { return i > bi; }
#else
#define TIE_INIT 0x7fffffff
__device__ __forceinline__ bool tie_first(int i, int bi) { return i < bi; }
#endif
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    if (v != v) return false;
    if (bv != bv) return true;
    return v > bv || (v == bv && tie_first(i, bi));
}

// ---- router: one block per row, logits [rows, E] f32 -> ids [rows, k] u32, weights [rows, k].
// The policy of model::Backend::route (the CPU's route_row is the reference):
//  - keep (optional, one byte per expert): experts with keep[e] == 0 get probability 0 before
//    the normalisation and are never chosen;
//  - NaN counts as -inf; the top k kept experts by logit, ties to the lower index (a -inf expert
//    ranks after every finite one and has weight 0);
//  - softmax over the kept experts; when some are +inf they share the mass equally;
//  - the chosen weights renormalised over the k;
//  - a row whose kept logits are all NaN/-inf gets ids 0xffffffff and NaN weights, and sets bit 0
//    of *err (when err is not null); the host reports it as NonFinite at its next download.
// PLANT 1: ties go to the higher index. LOWP: probabilities rounded to bf16.
extern "C" __global__ void moe_router(const float* __restrict__ logits, unsigned int* __restrict__ ids,
                                      float* __restrict__ weights, int E, int k,
                                      const unsigned char* __restrict__ keep, int* __restrict__ err) {
    extern __shared__ float sm[];  // key[E], p[E], then the k picked probabilities
    float* key = sm;
    float* p = sm + E;
    float* pk = sm + 2 * E;
    __shared__ float scratch[32];
    const float* l = logits + (size_t)blockIdx.x * E;
    const float qnan = __int_as_float(0x7fc00000);
    float m = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = l[e];
        if (v != v) v = -INFINITY;
        bool kept = !keep || keep[e];
        key[e] = kept ? v : qnan;
        if (kept) m = fmaxf(m, v);
    }
    {
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        m = warp_max(m);
        __syncthreads();
        if (lane == 0) scratch[warp] = m;
        __syncthreads();
        m = warp_max(lane < nw ? scratch[lane] : -INFINITY);
    }
    if (m == -INFINITY) {  // block-uniform: every kept logit is NaN or -inf
        if (threadIdx.x == 0 && err) atomicOr(err, 1);
        for (int j = threadIdx.x; j < k; j += blockDim.x) {
            ids[(size_t)blockIdx.x * k + j] = 0xffffffffu;
            weights[(size_t)blockIdx.x * k + j] = qnan;
        }
        return;
    }
    const bool inf_top = m == INFINITY;
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = key[e];
        float pv = (v != v) ? 0.0f : inf_top ? (v == INFINITY ? 1.0f : 0.0f) : expf(v - m);
        p[e] = pv;
        s += pv;
    }
    s = block_sum(s, scratch);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = p[e] / s;
        v = lowp(v);
        p[e] = v;
    }
    __syncthreads();
    // The top k by one warp, shuffles only (no block barrier per pick): the ranking is a strict
    // order, so the pick is the one a block-wide search makes.
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    float tot = 0.0f;
    for (int j = 0; j < k; ++j) {
        float bv = qnan;
        int bi = TIE_INIT;
        for (int e = lane; e < E; e += 32)
            if (better(key[e], e, bv, bi)) { bv = key[e]; bi = e; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        // the host checked k <= kept experts, so bi is a kept expert (every lane holds it)
        if (lane == 0) {
            float pw = p[bi];
            ids[(size_t)blockIdx.x * k + j] = (unsigned int)bi;
            pk[j] = pw;
            tot += pw;
            key[bi] = qnan;  // taken
        }
        __syncwarp();
    }
    // renormalised from shared memory by the whole warp (a read-modify-write of each global
    // weight in turn, one load round trip apiece, was most of the kernel's 10.8 us in session 10)
    tot = __shfl_sync(0xffffffffu, tot, 0);
    for (int j = lane; j < k; j += 32) weights[(size_t)blockIdx.x * k + j] = pk[j] / tot;
}

// Dots of O FP8 weight rows wr[o] (length n, multiple of 512), each with its block-scale row sr[o],
// with one x: acc[o] before the warp sum. Each lane reads 16 bytes per row per step; 16 divides
// 128, so one lane's bytes share one scale block. x is loaded once per step for all O rows; each
// row's arithmetic is the same for every O (the one-row dot is O = 1) and every unroll U (the
// steps' loads may be issued together, the sums keep their order).
template <int O, int U = (O >= 4 ? 1 : 4 / O)>
__device__ __forceinline__ void fp8_rows_dot(const fp8_t* const (&wr)[O], const float* __restrict__ x,
                                             const float* const (&sr)[O], int n, int lane, float (&acc)[O]) {
#pragma unroll
    for (int o = 0; o < O; ++o) acc[o] = 0.0f;
    int nvec = n >> 4;
#pragma unroll(U)
    for (int v = lane; v < nvec; v += 32) {
        int col = v << 4;
        const float4* xp = (const float4*)(x + col);
        float4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = __ldg(xp + j);
#pragma unroll
        for (int o = 0; o < O; ++o) {
            uint4 q = ld_stream((const uint4*)wr[o] + v);
            unsigned int words[4] = {q.x, q.y, q.z, q.w};
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float2 a = fp8x2_to_f32((unsigned short)(words[j] & 0xffffu));
                float2 b = fp8x2_to_f32((unsigned short)(words[j] >> 16));
                part = fmaf(a.x, xv[j].x, part); part = fmaf(a.y, xv[j].y, part);
                part = fmaf(b.x, xv[j].z, part); part = fmaf(b.y, xv[j].w, part);
            }
#if PLANT == 1
            float sc = sr[o][(col >> 7) / 4];  // wrong scale block index
#else
            float sc = sr[o][col >> 7];
#endif
            acc[o] = fmaf(sc, part, acc[o]);
        }
    }
}

// Dot of one FP8 weight row with x (fp8_rows_dot of one row), before the warp sum.
__device__ __forceinline__ float fp8_row_dot(const fp8_t* __restrict__ row, const float* __restrict__ x,
                                             const float* __restrict__ srow, int n, int lane) {
    const fp8_t* wr[1] = {row};
    const float* sr[1] = {srow};
    float acc[1];
    fp8_rows_dot<1>(wr, x, sr, n, lane, acc);
    return acc[0];
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
        v = lowp(v);
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
        dj = lowp(dj);
        acc = fmaf(wts[j], dj, acc);
    }
    if (lane == 0) y[n] = acc;
}

// Whether routed expert e of a table with `per` entries per expert has weights: the id is in
// range and its first pointer is set (a pruned expert has null pointers). If not, bit 1 of *err
// is set and the caller writes NaN: a routing that names a pruned expert never reads memory.
__device__ __forceinline__ bool expert_ok(const unsigned long long* __restrict__ tab, int per, long long e,
                                          int E, int* __restrict__ err, int lane) {
    if (e >= 0 && e < E && tab[per * e] != 0ull) return true;
    if (lane == 0 && err) atomicOr(err, 2);
    return false;
}

// ---- multi-row experts over a pointer table: tab[6 e + {0..5}] = gate, up, down (fp8) and their
// block scales (f32) of expert e, each expert stored on its own. Every row runs
// the single-row arithmetic, so a row's result does not depend on the rows beside it. A warp
// takes O consecutive outputs (O = 1, or 4 from a few rows on, with I and H multiples of 4:
// one activation load then feeds 4 rows of gate and of up), each with the same arithmetic.
// gate/up: h[row, j, i] = silu(gate_e . x[row]) * (up_e . x[row]), e = ids[row, j].
template <int O, int U = (2 * O >= 4 ? 1 : 4 / (2 * O))>
__device__ __forceinline__ void moe_gate_up_tab_body(const unsigned long long* __restrict__ tab,
                                                     const unsigned int* __restrict__ ids,
                                                     const float* __restrict__ x, float* __restrict__ h, int I,
                                                     int H, int k, int E, int* __restrict__ err) {
    // Grid (rows * k slots, output tiles of 8 O): the slot is the fast index, so the blocks in
    // flight together take one tile of every slot, and the slots routed to one expert read its
    // rows while L2 still holds them (with rows as the slow index, session 10's ncu saw 7.9% L2
    // hits at 32 rows). Each warp's outputs and arithmetic are as before.
    int lane = threadIdx.x & 31;
    const long long row = blockIdx.x / k;
    const int j = (int)(blockIdx.x % k);
    const long long i0l = ((long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5)) * O;
    if (i0l >= I) return;
    const int i0 = (int)i0l;
    float* hout = h + (row * k + j) * I + i0;
    long long e = ids[row * k + j];
    if (!expert_ok(tab, 6, e, E, err, lane)) {
        if (lane == 0)
#pragma unroll
            for (int o = 0; o < O; ++o) hout[o] = __int_as_float(0x7fc00000);
        return;
    }
    const fp8_t* gate = (const fp8_t*)tab[6 * e + 0];
    const fp8_t* up = (const fp8_t*)tab[6 * e + 1];
    const float* gate_s = (const float*)tab[6 * e + 3];
    const float* up_s = (const float*)tab[6 * e + 4];
    int sb_cols = (H + 127) >> 7;
    const fp8_t* wr[2 * O];
    const float* sr[2 * O];
#pragma unroll
    for (int o = 0; o < O; ++o) {
        long long i = i0 + o;
        long long s_off = (i >> 7) * sb_cols;
        wr[o] = gate + i * H;
        sr[o] = gate_s + s_off;
        wr[O + o] = up + i * H;
        sr[O + o] = up_s + s_off;
    }
    float acc[2 * O];
    fp8_rows_dot<2 * O, U>(wr, x + row * H, sr, H, lane, acc);
#pragma unroll
    for (int o = 0; o < O; ++o) {
        float g = warp_sum(acc[o]);
        float u = warp_sum(acc[O + o]);
        if (lane == 0) {
            float v = silu(g) * u;
            v = lowp(v);
            hout[o] = v;
        }
    }
}

// down: y[row, n] = sum_j w[row, j] * (down_e . h[row, j]), experts summed in rank order.
template <int O>
__device__ __forceinline__ void moe_down_tab_body(const unsigned long long* __restrict__ tab,
                                                  const unsigned int* __restrict__ ids,
                                                  const float* __restrict__ wts, const float* __restrict__ h,
                                                  float* __restrict__ y, int I, int H, int k, int E,
                                                  int* __restrict__ err) {
    // Grid (rows, output tiles of 8 O): the row is the fast index, so the blocks in flight take
    // one tile of every row, and rows that share an expert read its rows while L2 holds them.
    int lane = threadIdx.x & 31;
    const long long row = blockIdx.x;
    const long long n0 = ((long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5)) * O;
    if (n0 >= H) return;
    int sb_cols = (I + 127) >> 7;
    float acc[O];
#pragma unroll
    for (int o = 0; o < O; ++o) acc[o] = 0.0f;
    bool bad = false;
    for (int j = 0; j < k; ++j) {
        long long e = ids[row * k + j];
        if (!expert_ok(tab, 6, e, E, err, lane)) {
            bad = true;
            break;
        }
        const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
        const float* down_s = (const float*)tab[6 * e + 5];
        const fp8_t* wr[O];
        const float* sr[O];
#pragma unroll
        for (int o = 0; o < O; ++o) {
            wr[o] = down + (n0 + o) * I;
            sr[o] = down_s + ((n0 + o) >> 7) * sb_cols;
        }
        float d[O];
        fp8_rows_dot<O>(wr, h + (row * k + j) * I, sr, I, lane, d);
#pragma unroll
        for (int o = 0; o < O; ++o) {
            float dj = warp_sum(d[o]);
            dj = lowp(dj);
            acc[o] = fmaf(wts[row * k + j], dj, acc[o]);
        }
    }
    if (lane == 0)
#pragma unroll
        for (int o = 0; o < O; ++o) y[row * H + n0 + o] = bad ? __int_as_float(0x7fc00000) : acc[o];
}

// moe_down_tab with its k experts in k warps of one block per (output, row), so the k dots
// load at once instead of one after another; warp 0 then sums them in rank order with the same
// fmaf chain: bit for bit moe_down_tab. Block 32 k threads (k <= 32); grid (H, rows).
extern "C" __global__ void __launch_bounds__(1024) moe_down_tab_split(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k,
    int E, int* __restrict__ err) {
    __shared__ float dsh[32];
    __shared__ int bad_sh;
    const int lane = threadIdx.x & 31, j = threadIdx.x >> 5;
    const long long row = blockIdx.y, n = blockIdx.x;
    if (threadIdx.x == 0) bad_sh = 0;
    __syncthreads();
    const long long e = ids[row * k + j];
    float dj = 0.0f;
    if (expert_ok(tab, 6, e, E, err, lane)) {
        const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
        const float* down_s = (const float*)tab[6 * e + 5];
        const fp8_t* wr[1] = {down + n * I};
        const float* sr[1] = {down_s + (n >> 7) * ((I + 127) >> 7)};
        float d[1];
        fp8_rows_dot<1>(wr, h + (row * k + j) * I, sr, I, lane, d);
        dj = warp_sum(d[0]);
        dj = lowp(dj);
    } else if (lane == 0) {
        atomicOr(&bad_sh, 1);
    }
    if (lane == 0) dsh[j] = dj;
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int jj = 0; jj < k; ++jj) acc = fmaf(wts[row * k + jj], dsh[jj], acc);
        y[row * H + n] = bad_sh ? __int_as_float(0x7fc00000) : acc;
    }
}

// moe_down_tab4 with its k experts in k warps of one block per (row, 4-output tile): each warp
// makes one expert's four dots (moe_down_tab4's fp8_rows_dot<4>, warp sum and rounding), so
// the k experts' loads are in flight at once instead of one after another; four threads then
// sum them in rank order with the same fmaf chain: bit for bit moe_down_tab4. Block 32 k
// threads (k <= 32); grid (rows, H / 4): the row is the fast index, as in moe_down_tab4, so
// the blocks in flight take one tile of every row and rows sharing an expert read it from L2.
extern "C" __global__ void __launch_bounds__(1024) moe_down_tab4_split(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k,
    int E, int* __restrict__ err) {
    __shared__ float dsh[32][4];
    __shared__ int bad_sh;
    const int lane = threadIdx.x & 31, j = threadIdx.x >> 5;
    const long long row = blockIdx.x, n0 = (long long)blockIdx.y * 4;
    if (threadIdx.x == 0) bad_sh = 0;
    __syncthreads();
    const long long e = ids[row * k + j];
    float dj[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (expert_ok(tab, 6, e, E, err, lane)) {
        const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
        const float* down_s = (const float*)tab[6 * e + 5];
        const int sb_cols = (I + 127) >> 7;
        const fp8_t* wr[4];
        const float* sr[4];
#pragma unroll
        for (int o = 0; o < 4; ++o) {
            wr[o] = down + (n0 + o) * I;
            sr[o] = down_s + ((n0 + o) >> 7) * sb_cols;
        }
        float d[4];
        fp8_rows_dot<4>(wr, h + (row * k + j) * I, sr, I, lane, d);
#pragma unroll
        for (int o = 0; o < 4; ++o) {
            float v = warp_sum(d[o]);
            dj[o] = lowp(v);
        }
    } else if (lane == 0) {
        atomicOr(&bad_sh, 1);
    }
    if (lane == 0)
#pragma unroll
        for (int o = 0; o < 4; ++o) dsh[j][o] = dj[o];
    __syncthreads();
    if (threadIdx.x < 4) {
        const int o = threadIdx.x;
        float acc = 0.0f;
#if PLANT == 1
        // planted: reverse rank order too, so the contract can tell this kernel ran
        for (int jj = k - 1; jj >= 0; --jj) acc = fmaf(wts[row * k + jj], dsh[jj][o], acc);
#else
        for (int jj = 0; jj < k; ++jj) acc = fmaf(wts[row * k + jj], dsh[jj][o], acc);
#endif
        y[row * H + n0 + o] = bad_sh ? __int_as_float(0x7fc00000) : acc;
    }
}

extern "C" __global__ void LB_MOE moe_gate_up_tab(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ x, float* __restrict__ h, int I, int H, int k, int E, int* __restrict__ err) {
    moe_gate_up_tab_body<1>(tab, ids, x, h, I, H, k, E, err);
}
extern "C" __global__ void LB_MOE moe_gate_up_tab4(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ x, float* __restrict__ h, int I, int H, int k, int E, int* __restrict__ err) {
    moe_gate_up_tab_body<4>(tab, ids, x, h, I, H, k, E, err);
}
// moe_gate_up_tab4 with two key steps a lane unrolled, so a warp has the next step's weight
// loads in flight with this step's (128 registers, no spills): the same operations in the same
// order, so the same bits.
extern "C" __global__ void LB_MOE moe_gate_up_tab4u2(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ x, float* __restrict__ h, int I, int H, int k, int E, int* __restrict__ err) {
    moe_gate_up_tab_body<4, 2>(tab, ids, x, h, I, H, k, E, err);
}
extern "C" __global__ void LB_MOE moe_down_tab(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k,
    int E, int* __restrict__ err) {
    moe_down_tab_body<1>(tab, ids, wts, h, y, I, H, k, E, err);
}
extern "C" __global__ void LB_MOE moe_down_tab4(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k,
    int E, int* __restrict__ err) {
    moe_down_tab_body<4>(tab, ids, wts, h, y, I, H, k, E, err);
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
        d = lowp(d);
        if (lane == 0) y[(long long)r * n_out + n] = d;
    }
}

// ---------------------------------------------------------------- NVFP4
// ModelOpt NVFP4, kept packed: codes [rows, cols/2] (two E2M1 per byte, low nibble = even
// column), E4M3 scales [rows, cols/16] (one per 16 consecutive columns of a row), one f32 global.
// Each weight is dequantised in registers as (e2m1 * e4m3) * global, in that order: the first
// product is exact in f32 (2 x 4 significant bits), the second rounds once, as on the CPU. The dot
// is an f32 fma chain per lane, then a warp tree.

// E2M1 code (bit 3 sign, 2 exponent bits, 1 mantissa bit) to f32: the code's bits placed at the
// top of an f32 give the value times 2^-126 (subnormal for codes 1 and 9), rescaled exactly.
__device__ __forceinline__ float e2m1_to_f32(unsigned int q) {
    return __fmul_rn(__uint_as_float(((q & 8u) << 28) | ((q & 7u) << 22)), 0x1p126f);
}

__device__ __forceinline__ uint2 ld_stream2(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// One scale group: 16 columns in two words (8 codes each, low nibble first), scale s, global g.
// PLANT 1: the two nibbles of every byte are swapped.
__device__ __forceinline__ float nvfp4_group(unsigned int w0, unsigned int w1, float s, float g,
                                             const float* __restrict__ x, float acc) {
    unsigned int words[2] = {w0, w1};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float4 xa = __ldg((const float4*)(x + 8 * h));
        float4 xb = __ldg((const float4*)(x + 8 * h) + 1);
        float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        unsigned int w = words[h];
#if PLANT == 1
        w = ((w & 0x0f0f0f0fu) << 4) | ((w >> 4) & 0x0f0f0f0fu);
#endif
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            float v = __fmul_rn(__fmul_rn(e2m1_to_f32((w >> (4 * t)) & 15u), s), g);
            acc = fmaf(v, xv[t], acc);
        }
    }
    return acc;
}

// Lane's part of the dot of one NVFP4 row (n columns, a multiple of 16) with x. Rows of a
// multiple of 32 columns read 16 code bytes (two groups) per lane and step; others 8 (one group).
__device__ __forceinline__ float nvfp4_row_dot(const unsigned char* __restrict__ row,
                                               const unsigned char* __restrict__ srow, float g,
                                               const float* __restrict__ x, int n, int lane) {
    float acc = 0.0f;
    if ((n & 31) == 0) {
        const uint4* rp = (const uint4*)row;
        int nvec = n >> 5;
#pragma unroll 2
        for (int v = lane; v < nvec; v += 32) {
            uint4 q = ld_stream(rp + v);
            float2 sc = fp8x2_to_f32(__ldg((const unsigned short*)srow + v));
            acc = nvfp4_group(q.x, q.y, sc.x, g, x + 32 * v, acc);
            acc = nvfp4_group(q.z, q.w, sc.y, g, x + 32 * v + 16, acc);
        }
    } else {
        const uint2* rp = (const uint2*)row;
        int ng = n >> 4;
        for (int v = lane; v < ng; v += 32) {
            uint2 q = ld_stream2(rp + v);
            float sc = fp8x2_to_f32((unsigned short)__ldg(srow + v)).x;
            acc = nvfp4_group(q.x, q.y, sc, g, x + 16 * v, acc);
        }
    }
    return acc;
}

// tab[9 e + {0..8}] = gate, up, down codes; their E4M3 scales; pointers to their f32 globals.
// gate/up + SiLU-mul: h[row, j, i] = silu(gate_e . x[row]) * (up_e . x[row]), e = ids[row, j];
// one warp per (j, i), row = blockIdx.y (each row the single-row arithmetic: batch invariant).
// LOWP: h rounded to bf16. PLANT 1: swapped nibbles.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_nvfp4(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ x, float* __restrict__ h, int I, int H, int k, int E, int* __restrict__ err) {
    int lane = threadIdx.x & 31;
    long long row = blockIdx.y;
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp >= (long long)k * I) return;
    int j = (int)(warp / I), i = (int)(warp % I);
    long long e = ids[row * k + j];
    if (!expert_ok(tab, 9, e, E, err, lane)) {
        if (lane == 0) h[(row * k + j) * I + i] = __int_as_float(0x7fc00000);
        return;
    }
    const unsigned long long* t = tab + 9 * e;
    const unsigned char* gate = (const unsigned char*)t[0] + (long long)i * (H >> 1);
    const unsigned char* up = (const unsigned char*)t[1] + (long long)i * (H >> 1);
    const unsigned char* gate_s = (const unsigned char*)t[3] + (long long)i * (H >> 4);
    const unsigned char* up_s = (const unsigned char*)t[4] + (long long)i * (H >> 4);
    float gg = __ldg((const float*)t[6]), ug = __ldg((const float*)t[7]);
    const float* xr = x + row * H;
    float gv = nvfp4_row_dot(gate, gate_s, gg, xr, H, lane);
    float uv = nvfp4_row_dot(up, up_s, ug, xr, H, lane);
    gv = warp_sum(gv);
    uv = warp_sum(uv);
    if (lane == 0) {
        float v = silu(gv) * uv;
        v = lowp(v);
        h[(row * k + j) * I + i] = v;
    }
}

// down: y[row, n] = sum_j w[row, j] * (down_e . h[row, j]), experts summed in rank order.
// LOWP: each expert's output rounded to bf16. PLANT 1: swapped nibbles.
extern "C" __global__ void __launch_bounds__(256) moe_down_nvfp4(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ h, float* __restrict__ y, int I, int H, int k,
    int E, int* __restrict__ err) {
    int lane = threadIdx.x & 31;
    long long row = blockIdx.y;
    long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (n >= H) return;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        long long e = ids[row * k + j];
        if (!expert_ok(tab, 9, e, E, err, lane)) { acc = __int_as_float(0x7fc00000); break; }
        const unsigned long long* t = tab + 9 * e;
        const unsigned char* down = (const unsigned char*)t[2] + n * (I >> 1);
        const unsigned char* down_s = (const unsigned char*)t[5] + n * (I >> 4);
        float dg = __ldg((const float*)t[8]);
        float d = nvfp4_row_dot(down, down_s, dg, h + (row * k + j) * I, I, lane);
        float dj = warp_sum(d);
        dj = lowp(dj);
        acc = fmaf(wts[row * k + j], dj, acc);
    }
    if (lane == 0) y[row * H + n] = acc;
}

// A plain linear with an NVFP4 weight [n_out, K]: y[r, n] = W[n] . x[r]; one warp per output,
// rows looped (batch-invariant). G points to the f32 global. LOWP: outputs rounded to bf16.
extern "C" __global__ void __launch_bounds__(256) gemv_nvfp4(
    const unsigned char* __restrict__ W, const unsigned char* __restrict__ S, const float* __restrict__ G,
    const float* __restrict__ x, float* __restrict__ y, int n_out, int K, int rows) {
    int lane = threadIdx.x & 31;
    long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (n >= n_out) return;
    float g = __ldg(G);
    for (int r = 0; r < rows; ++r) {
        float d = nvfp4_row_dot(W + n * (K >> 1), S + n * (K >> 4), g, x + (long long)r * K, K, lane);
        d = warp_sum(d);
        d = lowp(d);
        if (lane == 0) y[(long long)r * n_out + n] = d;
    }
}

// ---- routed experts grouped by expert with the per-row kernels' arithmetic: slots are grouped
// by expert (moe_group_count / scan / fill with SR-slot tiles), and a warp takes SO consecutive
// outputs of one expert for up to SR of its slots. Each (slot, output) is exactly
// moe_*_tab_body's sequence (fp8_rows_dot's per-lane chain, then warp_sum), so the results equal
// the per-row kernels' bit for bit at any row count; the weight rows are read once per SR slots of
// their expert instead of once per slot. down writes each slot's dot to obuf, and
// moe_group_combine sums a row's experts in rank order with moe_down_tab_body's fmaf chain.
// PLANT 1 and LOWP as fp8_rows_dot / moe_*_tab_body.
#define SR 8
#define SO 4

// acc[r][o] = fp8_rows_dot of weight row o with slot r's activations (r < count), before the warp
// sum. Weights are loaded once per step for all slots.
template <int O>
__device__ __forceinline__ void fp8_rows_dot_slots(const fp8_t* const (&wr)[O], const float* const (&xs)[SR],
                                                   int count, const float* const (&sr)[O], int n, int lane,
                                                   float (&acc)[SR][O]) {
#pragma unroll
    for (int r = 0; r < SR; ++r)
#pragma unroll
        for (int o = 0; o < O; ++o) acc[r][o] = 0.0f;
    int nvec = n >> 4;
    for (int v = lane; v < nvec; v += 32) {
        int col = v << 4;
        uint4 q[O];
        float sc[O];
#pragma unroll
        for (int o = 0; o < O; ++o) {
            q[o] = ld_stream((const uint4*)wr[o] + v);
#if PLANT == 1
            sc[o] = sr[o][(col >> 7) / 4];  // wrong scale block index
#else
            sc[o] = sr[o][col >> 7];
#endif
        }
#pragma unroll
        for (int r = 0; r < SR; ++r) {
            if (r >= count) break;  // uniform across the warp
            const float4* xp = (const float4*)(xs[r] + col);
            float4 xv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) xv[j] = __ldg(xp + j);
#pragma unroll
            for (int o = 0; o < O; ++o) {
                unsigned int words[4] = {q[o].x, q[o].y, q[o].z, q[o].w};
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float2 a = fp8x2_to_f32((unsigned short)(words[j] & 0xffffu));
                    float2 b = fp8x2_to_f32((unsigned short)(words[j] >> 16));
                    part = fmaf(a.x, xv[j].x, part); part = fmaf(a.y, xv[j].y, part);
                    part = fmaf(b.x, xv[j].z, part); part = fmaf(b.y, xv[j].w, part);
                }
                acc[r][o] = fmaf(sc[o], part, acc[r][o]);
            }
        }
    }
}

// hbuf[s, i] = silu(gate_e . x[s / k]) * (up_e . x[s / k]). Grid (ceil(I / (8 SO)), tile bound),
// block 256; I a multiple of SO.
extern "C" __global__ void __launch_bounds__(256) moe_slots_gate_up(
    const unsigned long long* __restrict__ tab, const float* __restrict__ x, const int* __restrict__ order,
    const int* __restrict__ offsets, const int* __restrict__ tiles, float* __restrict__ hbuf, int I, int H, int k,
    int E) {
    int first, count;
    int e = group_tile<SR>(offsets, tiles, E, first, count);
    int lane = threadIdx.x & 31;
    long long i0 = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * SO;
    if (e < 0 || i0 >= I) return;
    const fp8_t* gate = (const fp8_t*)tab[6 * e + 0];
    const fp8_t* up = (const fp8_t*)tab[6 * e + 1];
    const float* gate_s = (const float*)tab[6 * e + 3];
    const float* up_s = (const float*)tab[6 * e + 4];
    int sb_cols = (H + 127) >> 7;
    const fp8_t* wr[2 * SO];
    const float* sr[2 * SO];
#pragma unroll
    for (int o = 0; o < SO; ++o) {
        long long i = i0 + o;
        long long s_off = (i >> 7) * sb_cols;
        wr[o] = gate + i * H;
        sr[o] = gate_s + s_off;
        wr[SO + o] = up + i * H;
        sr[SO + o] = up_s + s_off;
    }
    const float* xs[SR];
#pragma unroll
    for (int r = 0; r < SR; ++r) xs[r] = x + (long long)(r < count ? order[first + r] / k : 0) * H;
    float acc[SR][2 * SO];
    fp8_rows_dot_slots<2 * SO>(wr, xs, count, sr, H, lane, acc);
#pragma unroll
    for (int r = 0; r < SR; ++r) {
        if (r >= count) break;
        float* hout = hbuf + (long long)order[first + r] * I + i0;
#pragma unroll
        for (int o = 0; o < SO; ++o) {
            float g = warp_sum(acc[r][o]);
            float u = warp_sum(acc[r][SO + o]);
            if (lane == 0) {
                float v = silu(g) * u;
                v = lowp(v);
                hout[o] = v;
            }
        }
    }
}

// obuf[s, n] = down_e . hbuf[s] (the warp-summed dot, as moe_down_tab_body's dj). Grid
// (ceil(H / (8 SO)), tile bound), block 256; H a multiple of SO.
extern "C" __global__ void __launch_bounds__(256) moe_slots_down(
    const unsigned long long* __restrict__ tab, const float* __restrict__ hbuf, const int* __restrict__ order,
    const int* __restrict__ offsets, const int* __restrict__ tiles, float* __restrict__ obuf, int I, int H, int E) {
    int first, count;
    int e = group_tile<SR>(offsets, tiles, E, first, count);
    int lane = threadIdx.x & 31;
    long long n0 = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * SO;
    if (e < 0 || n0 >= H) return;
    const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
    const float* down_s = (const float*)tab[6 * e + 5];
    int sb_cols = (I + 127) >> 7;
    const fp8_t* wr[SO];
    const float* sr[SO];
#pragma unroll
    for (int o = 0; o < SO; ++o) {
        wr[o] = down + (n0 + o) * I;
        sr[o] = down_s + ((n0 + o) >> 7) * sb_cols;
    }
    const float* xs[SR];
#pragma unroll
    for (int r = 0; r < SR; ++r) xs[r] = hbuf + (long long)(r < count ? order[first + r] : 0) * I;
    float acc[SR][SO];
    fp8_rows_dot_slots<SO>(wr, xs, count, sr, I, lane, acc);
#pragma unroll
    for (int r = 0; r < SR; ++r) {
        if (r >= count) break;
        float* out = obuf + (long long)order[first + r] * H + n0;
#pragma unroll
        for (int o = 0; o < SO; ++o) {
            float dj = warp_sum(acc[r][o]);
            dj = lowp(dj);
            if (lane == 0) out[o] = dj;
        }
    }
}

// ---------------------------------------------------------------- routed FP8 experts on tensor cores
// One arithmetic for every row count, so that a slot's result never depends on the batch. A
// warp tile is 16 outputs (weight rows n0..n0+15 of one expert) by up to 8 slots routed to that
// expert, as m16n8k8 TF32 MMAs with outputs as M and slots as N. Keys go in 128-key blocks b
// (the FP8 scale blocks): in block b, thread (g, t) holds keys 128 b + 32 t .. + 31 of weight
// rows n0 + g and n0 + g + 8 (two 16-byte loads each) and of slot column g's activations, and
// MMA s (0..15) takes keys 32 t + 2 s and 32 t + 2 s + 1. e4m3 is exact in TF32; activations are
// split hi + lo (as gemv_tc2), each MMA starts from zero and is added in f32 into a hi and a lo
// sum, and the block's partial is p_b = hi + lo. An output is then sum_b s_b p_b as an fmaf chain
// in b order (s_b its 128x128 block scale). A CUDA block's warps take key blocks warp,
// warp + nw, ...; the partials meet in shared memory and one warp runs the chains, so the bits
// do not depend on the warp count either. An MMA's columns are independent, so the slots beside
// a slot in its tile do not change its bits: the direct launches (one slot a tile, for few rows)
// and the grouped ones (up to 8 slots of one expert a tile) agree bit for bit, as does
// moe_tc_down_rows (the down projection and the rank-ordered sum of a row in one launch) with
// moe_tc_down + moe_group_combine. H and I multiples of 128, at most XT_MAX_KB key blocks.
// PLANT 1: each chain takes the scale of the next key block. LOWP: lo dropped (one TF32 MMA).
#define XT_MAX_KB 32
#define XT_MAX_PAIRS 64

// The scale index of key block b of nkb (PLANT 1: the next block's).
__device__ __forceinline__ int xt_sb(int b, int nkb) {
#if PLANT == 1
    return (b + 1) % nkb;
#else
    return b;
#endif
}

// The 32 activations of thread t in a key block (xr points at them), zeros without a slot.
__device__ __forceinline__ void xt_load_x(const float* __restrict__ xr, float (&xs)[32]) {
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        float4 f = xr ? __ldg((const float4*)xr + v) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        xs[4 * v] = f.x; xs[4 * v + 1] = f.y; xs[4 * v + 2] = f.z; xs[4 * v + 3] = f.w;
    }
}

// 32 e4m3 weights of one row (this thread's keys of a block) as 8 words.
__device__ __forceinline__ void xt_load_w(const fp8_t* __restrict__ w, unsigned int (&v)[8]) {
    const uint4 a = ld_stream(w), b = ld_stream(w + 16);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// The A fragment of MMA s from rows a (g) and b (g + 8): keys 2 s and 2 s + 1 of each.
__device__ __forceinline__ void xt_frag(const unsigned int (&wa)[8], const unsigned int (&wb)[8], int s,
                                        unsigned int (&a)[4]) {
    const float2 fa = fp8x2_to_f32((unsigned short)(wa[s >> 1] >> (16 * (s & 1))));
    const float2 fb = fp8x2_to_f32((unsigned short)(wb[s >> 1] >> (16 * (s & 1))));
    a[0] = __float_as_uint(fa.x);
    a[1] = __float_as_uint(fb.x);
    a[2] = __float_as_uint(fa.y);
    a[3] = __float_as_uint(fb.y);
}

// xt_block's MMAs over weights already in registers (va, vb) and the block's activations xs.
template <int NM>
__device__ __forceinline__ void xt_mma(const unsigned int (&va)[NM][8], const unsigned int (&vb)[NM][8],
                                       const float (&xs)[32], float (&p)[NM][4]) {
    float hi[NM][4], lo[NM][4];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) hi[m][e] = lo[m][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < 16; ++s) {
        const unsigned int h0 = tf32_hi(xs[2 * s]), h1 = tf32_hi(xs[2 * s + 1]);
#ifndef LOWP
        const unsigned int l0 = to_tf32(xs[2 * s] - __uint_as_float(h0));
        const unsigned int l1 = to_tf32(xs[2 * s + 1] - __uint_as_float(h1));
#endif
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            unsigned int a[4];
            xt_frag(va[m], vb[m], s, a);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32(d, a, h0, h1);
#pragma unroll
            for (int e = 0; e < 4; ++e) hi[m][e] += d[e];
#ifndef LOWP
            float dl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32(dl, a, l0, l1);
#pragma unroll
            for (int e = 0; e < 4; ++e) lo[m][e] += dl[e];
#endif
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[m][e] = hi[m][e] + lo[m][e];
}

// The NM weight matrices' rows wa[m], wb[m] of one key block into registers.
template <int NM>
__device__ __forceinline__ void xt_load_ws(const fp8_t* const (&wa)[NM], const fp8_t* const (&wb)[NM],
                                          unsigned int (&va)[NM][8], unsigned int (&vb)[NM][8]) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        xt_load_w(wa[m], va[m]);
        xt_load_w(wb[m], vb[m]);
    }
}

// One key block of NM weight matrices (rows wa[m], wb[m]) against one activation block:
// p[m][e] = hi + lo, as the header says.
template <int NM>
__device__ __forceinline__ void xt_block(const fp8_t* const (&wa)[NM], const fp8_t* const (&wb)[NM],
                                         const float* __restrict__ xr, float (&p)[NM][4]) {
    unsigned int va[NM][8], vb[NM][8];
    xt_load_ws<NM>(wa, wb, va, vb);
    float xs[32];
    xt_load_x(xr, xs);
    xt_mma<NM>(va, vb, xs, p);
}

// tinfo[3 b + {0, 1, 2}] = the expert, first slot (in `order`) and slot count of 8-slot tile b
// of a grouped launch (-1, 0, 0 past the last tile): the tile's binary search over the experts
// once per tile, not once per block of each tile. Grid ceil(bound / 256), block 256.
extern "C" __global__ void moe_tc_tiles(const int* __restrict__ offsets, const int* __restrict__ tiles,
                                        int* __restrict__ tinfo, int E, int bound) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= bound) return;
    const int e = tile_expert(tiles, E, b);
    int first = 0, count = 0;
    if (e >= 0) {
        first = offsets[e] + (b - tiles[e]) * 8;
        count = min(offsets[e + 1] - first, 8);
    }
    tinfo[3 * b] = e;
    tinfo[3 * b + 1] = first;
    tinfo[3 * b + 2] = count;
}

// This block's tile: grouped (order set), up to 8 slots of one expert from moe_tc_tiles' table;
// direct, slot blockIdx.y alone. Returns the expert (-1: nothing to do); slot c of the tile is
// order[first + c] (grouped) or first (direct, c = 0).
__device__ __forceinline__ long long xt_tile(const unsigned int* __restrict__ ids, const int* __restrict__ order,
                                             const int* __restrict__ tinfo, int& first, int& count) {
    if (order) {
        const int* ti = tinfo + 3 * blockIdx.y;
        first = ti[1];
        count = ti[2];
        return ti[0];
    }
    first = blockIdx.y;
    count = 1;
    return ids[blockIdx.y];
}

// h[s, i] = silu(gate_e . x[s / k]) * (up_e . x[s / k]) for the tile's slots. Grid (I / 16,
// slots (direct) or an upper bound on the 8-slot tiles (grouped)), block 32 w threads, w from
// ceil(H / 2048) (the 2 H / 128 scales are staged one a thread) to min(16, H / 128).
// A direct slot naming an expert without weights gets NaN and sets bit 1 of *err (grouped
// launches never list one: moe_group_count reports it and moe_group_combine writes the NaN).
// PF: each warp loads its next key block's weights while the current one's MMAs run (two key
// blocks' loads in flight a warp; the same operations on the same values, so the same bits).
template <bool PF>
__device__ __forceinline__ void moe_tc_gate_up_body(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids, const float* __restrict__ x,
    const int* __restrict__ order, const int* __restrict__ tinfo, float* __restrict__ h, int I, int H, int k,
    int E, int* __restrict__ err) {
    __shared__ float red[XT_MAX_KB][2][32][4];
    __shared__ float scale_sh[2][XT_MAX_KB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    int first, count;
    const long long e = xt_tile(ids, order, tinfo, first, count);
    if (e < 0) return;
    if (!order && !expert_ok(tab, 6, e, E, err, lane)) {
        if (threadIdx.x < 16) h[(long long)first * I + n0 + threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    const fp8_t* gate = (const fp8_t*)tab[6 * e];
    const fp8_t* up = (const fp8_t*)tab[6 * e + 1];
    const int nkb = H >> 7;
    // the 16 outputs share one 128-row scale block: its nkb scales of each matrix, staged
    // while the MMAs run, so the chains below read no global memory
    if (threadIdx.x < 2 * nkb) {
        const int m = threadIdx.x / nkb, b = threadIdx.x - m * nkb;
        const float* sc = (const float*)tab[6 * e + 3 + m];
        scale_sh[m][b] = sc[(long long)(n0 >> 7) * nkb + xt_sb(b, nkb)];
    }
    const long long ra = n0 + g, rb = n0 + g + 8;
    const float* xr = nullptr;
    if (g < count) xr = x + (long long)((order ? order[first + g] : first) / k) * H + 32 * t;
    auto rows_of = [&](int b, const fp8_t* (&wa)[2], const fp8_t* (&wb)[2]) {
        const long long kk = 128LL * b + 32 * t;
        wa[0] = gate + ra * H + kk;
        wa[1] = up + ra * H + kk;
        wb[0] = gate + rb * H + kk;
        wb[1] = up + rb * H + kk;
    };
    if (PF) {
        unsigned int va[2][8], vb[2][8];
        if (warp < nkb) {
            const fp8_t* wa[2];
            const fp8_t* wb[2];
            rows_of(warp, wa, wb);
            xt_load_ws<2>(wa, wb, va, vb);
        }
        for (int b = warp; b < nkb; b += nw) {
            unsigned int na[2][8], nb[2][8];
            if (b + nw < nkb) {
                const fp8_t* wa[2];
                const fp8_t* wb[2];
                rows_of(b + nw, wa, wb);
                xt_load_ws<2>(wa, wb, na, nb);
            }
            float xs[32];
            xt_load_x(xr ? xr + 128 * b : nullptr, xs);
            float p[2][4];
            xt_mma<2>(va, vb, xs, p);
#pragma unroll
            for (int e4 = 0; e4 < 4; ++e4) {
                red[b][0][lane][e4] = p[0][e4];
                red[b][1][lane][e4] = p[1][e4];
            }
            if (b + nw < nkb) {
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        va[m][q] = na[m][q];
                        vb[m][q] = nb[m][q];
                    }
            }
        }
    } else {
        for (int b = warp; b < nkb; b += nw) {
            const fp8_t* wa[2];
            const fp8_t* wb[2];
            rows_of(b, wa, wb);
            float p[2][4];
            xt_block<2>(wa, wb, xr ? xr + 128 * b : nullptr, p);
#pragma unroll
            for (int e4 = 0; e4 < 4; ++e4) {
                red[b][0][lane][e4] = p[0][e4];
                red[b][1][lane][e4] = p[1][e4];
            }
        }
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int e4 = 0; e4 < 4; ++e4) {
        const int c = 2 * t + (e4 & 1);
        if (c >= count) continue;
        const long long n = e4 < 2 ? ra : rb;
        float ag = 0.0f, au = 0.0f;
        for (int b = 0; b < nkb; ++b) {
            ag = fmaf(scale_sh[0][b], red[b][0][lane][e4], ag);
            au = fmaf(scale_sh[1][b], red[b][1][lane][e4], au);
        }
        const long long s = order ? order[first + c] : first;
        h[s * I + n] = lowp(silu(ag) * au);
    }
}
extern "C" __global__ void __launch_bounds__(512) moe_tc_gate_up(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids, const float* __restrict__ x,
    const int* __restrict__ order, const int* __restrict__ tinfo, float* __restrict__ h, int I, int H, int k,
    int E, int* __restrict__ err) {
    moe_tc_gate_up_body<false>(tab, ids, x, order, tinfo, h, I, H, k, E, err);
}
// moe_tc_gate_up with the next key block's weights loaded a step ahead (the same bits)
extern "C" __global__ void __launch_bounds__(512) moe_tc_gate_up_pf(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids, const float* __restrict__ x,
    const int* __restrict__ order, const int* __restrict__ tinfo, float* __restrict__ h, int I, int H, int k,
    int E, int* __restrict__ err) {
    moe_tc_gate_up_body<true>(tab, ids, x, order, tinfo, h, I, H, k, E, err);
}

// The chain of one output over its key blocks' partials (stride between blocks' partials: st),
// with the blocks' scales sc[0..nkb) as staged (in block order, the plant applied).
__device__ __forceinline__ float xt_chain(const float* sc, const float* part, int st, int nkb) {
    float acc = 0.0f;
    for (int b = 0; b < nkb; ++b) acc = fmaf(sc[b], part[b * st], acc);
    return acc;
}

// obuf[s, n] = down_e . h[s] for the tile's slots (the per-slot dot the rank-ordered sum takes).
// Grid (H / 16, tiles as moe_tc_gate_up), block 32 w threads, w up to min(16, I / 128).
extern "C" __global__ void __launch_bounds__(512) moe_tc_down(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids, const float* __restrict__ hbuf,
    const int* __restrict__ order, const int* __restrict__ tinfo, float* __restrict__ obuf, int I, int H, int E,
    int* __restrict__ err) {
    __shared__ float red[XT_MAX_KB][32][4];
    __shared__ float scale_sh[XT_MAX_KB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    int first, count;
    const long long e = xt_tile(ids, order, tinfo, first, count);
    if (e < 0) return;
    if (!order && !expert_ok(tab, 6, e, E, err, lane)) {
        if (threadIdx.x < 16) obuf[(long long)first * H + n0 + threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
    const int nkb = I >> 7;
    if (threadIdx.x < nkb)
        scale_sh[threadIdx.x] = ((const float*)tab[6 * e + 5])[(long long)(n0 >> 7) * nkb + xt_sb(threadIdx.x, nkb)];
    const long long ra = n0 + g, rb = n0 + g + 8;
    const float* xr = nullptr;
    if (g < count) xr = hbuf + (long long)(order ? order[first + g] : first) * I + 32 * t;
    for (int b = warp; b < nkb; b += nw) {
        const long long kk = 128LL * b + 32 * t;
        const fp8_t* const wa[1] = {down + ra * I + kk};
        const fp8_t* const wb[1] = {down + rb * I + kk};
        float p[1][4];
        xt_block<1>(wa, wb, xr ? xr + 128 * b : nullptr, p);
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) red[b][lane][e4] = p[0][e4];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int e4 = 0; e4 < 4; ++e4) {
        const int c = 2 * t + (e4 & 1);
        if (c >= count) continue;
        const long long n = e4 < 2 ? ra : rb;
        const float d = xt_chain(scale_sh, &red[0][lane][e4], 32 * 4, nkb);
        const long long s = order ? order[first + c] : first;
        obuf[s * H + n] = lowp(d);
    }
}

// moe_tc_down with four 16-output tiles a block (64 outputs, grid (H / 64, tiles)): one
// activation fragment a key block feeds the four tiles' MMAs (xt_block<4>), so a block's table,
// pointer and activation loads serve four times the outputs. Each output's MMAs, partials and
// chain are moe_tc_down's, so the same bits. The 64 outputs share one 128-row scale block (64
// divides 128). I / 128 <= XT_DN4_KB; block 32 w threads, w up to min(16, I / 128); warp m < 4
// (and m + w ...) runs tile m's chains.
#define XT_DN4_KB 8  // backend.rs DN4_MAX_KB: the host picks this kernel only up to it
extern "C" __global__ void __launch_bounds__(512) moe_tc_down4(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids, const float* __restrict__ hbuf,
    const int* __restrict__ order, const int* __restrict__ tinfo, float* __restrict__ obuf, int I, int H, int E,
    int* __restrict__ err) {
    __shared__ float red[XT_DN4_KB][4][32][4];
    __shared__ float scale_sh[XT_DN4_KB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 64;
    int first, count;
    const long long e = xt_tile(ids, order, tinfo, first, count);
    if (e < 0) return;
    if (!order && !expert_ok(tab, 6, e, E, err, lane)) {
        for (int q = threadIdx.x; q < 64; q += blockDim.x) obuf[(long long)first * H + n0 + q] = __int_as_float(0x7fc00000);
        return;
    }
    const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
    const int nkb = I >> 7;
    for (int q = threadIdx.x; q < nkb; q += blockDim.x)
        scale_sh[q] = ((const float*)tab[6 * e + 5])[(long long)(n0 >> 7) * nkb + xt_sb(q, nkb)];
    const float* xr = nullptr;
    if (g < count) xr = hbuf + (long long)(order ? order[first + g] : first) * I + 32 * t;
    for (int b = warp; b < nkb; b += nw) {
        const long long kk = 128LL * b + 32 * t;
        const fp8_t* const wa[4] = {down + (long long)(n0 + g) * I + kk, down + (long long)(n0 + 16 + g) * I + kk,
                                    down + (long long)(n0 + 32 + g) * I + kk, down + (long long)(n0 + 48 + g) * I + kk};
        const fp8_t* const wb[4] = {down + (long long)(n0 + 8 + g) * I + kk, down + (long long)(n0 + 24 + g) * I + kk,
                                    down + (long long)(n0 + 40 + g) * I + kk, down + (long long)(n0 + 56 + g) * I + kk};
        float p[4][4];
        xt_block<4>(wa, wb, xr ? xr + 128 * b : nullptr, p);
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int e4 = 0; e4 < 4; ++e4) red[b][m][lane][e4] = p[m][e4];
    }
    __syncthreads();
    for (int m = warp; m < 4; m += nw) {
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) {
            const int c = 2 * t + (e4 & 1);
            if (c >= count) continue;
            const long long n = n0 + 16 * m + g + (e4 < 2 ? 0 : 8);
            const float d = xt_chain(scale_sh, &red[0][m][lane][e4], 4 * 32 * 4, nkb);
            const long long s = order ? order[first + c] : first;
            obuf[s * H + n] = lowp(d);
        }
    }
}

// y[row, n] = sum_j wts[row, j] (down_{e_j} . h[row, j]), j in rank order: moe_tc_down then
// moe_group_combine in one launch, bit for bit, for rows whose slots go one a tile. Grid
// (H / 16, rows), block 32 min(32, k I / 128); k I / 128 <= XT_MAX_PAIRS. Warp w takes the
// (slot j, key block b) pairs w, w + nw, ... with the slot in MMA column 0.
extern "C" __global__ void __launch_bounds__(1024) moe_tc_down_rows(
    const unsigned long long* __restrict__ tab, const unsigned int* __restrict__ ids,
    const float* __restrict__ wts, const float* __restrict__ hbuf, float* __restrict__ y, int I, int H, int k,
    int E, int* __restrict__ err) {
    __shared__ float red[XT_MAX_PAIRS][16];
    __shared__ float scale_sh[XT_MAX_PAIRS];
    __shared__ float w_sh[XT_MAX_PAIRS];
    __shared__ int bad_sh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long row = blockIdx.y;
    const int n0 = blockIdx.x * 16;
    const int nkb = I >> 7, np = k * nkb;
    if (threadIdx.x == 0) bad_sh = 0;
    if (threadIdx.x < k) w_sh[threadIdx.x] = wts[row * k + threadIdx.x];
    __syncthreads();
    for (int p = warp; p < np; p += nw) {
        const int j = p / nkb, b = p - j * nkb;
        const long long e = ids[row * k + j];
        if (!expert_ok(tab, 6, e, E, err, lane)) {
            if (lane == 0) bad_sh = 1;
            continue;
        }
        const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
        // the pair's scale (the 16 outputs share one 128-row block), for the chains below
        if (lane == 0) scale_sh[p] = ((const float*)tab[6 * e + 5])[(long long)(n0 >> 7) * nkb + xt_sb(b, nkb)];
        const long long kk = 128LL * b + 32 * t;
        const fp8_t* const wa[1] = {down + (long long)(n0 + g) * I + kk};
        const fp8_t* const wb[1] = {down + (long long)(n0 + g + 8) * I + kk};
        const float* xr = g == 0 ? hbuf + (row * k + j) * I + kk : nullptr;
        float part[1][4];
        xt_block<1>(wa, wb, xr, part);
        // column 0 (the slot) is held by the t = 0 threads: rows g (d[0]) and g + 8 (d[2])
        if (t == 0) {
            red[p][g] = part[0][0];
            red[p][g + 8] = part[0][2];
        }
    }
    __syncthreads();
    if (threadIdx.x >= 16) return;
    const int o = threadIdx.x;
    const long long n = n0 + o;
    float acc = 0.0f;
    for (int j = 0; j < k && !bad_sh; ++j) {
        const float d = xt_chain(&scale_sh[j * nkb], &red[j * nkb][o], 16, nkb);
        acc = fmaf(w_sh[j], lowp(d), acc);
    }
    y[row * H + n] = bad_sh ? __int_as_float(0x7fc00000) : acc;
}
