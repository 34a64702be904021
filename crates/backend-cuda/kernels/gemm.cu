// Tiled GEMMs for many rows of one lane (the prefill, `Rows::Bulk`): a dense BF16-weight GEMM and
// the routed FP8 experts grouped by expert, so each weight tile is read once per 64 rows instead
// of once per row. f32 activations and accumulation; every output element is one thread's fmaf
// chain over k in ascending order, so it does not depend on the rows beside it or on the order in
// which rows were grouped (the grouping uses atomics).
//
// Tile: BM = 64 rows x BN = 64 outputs, BK = 32 deep; 256 threads, each 4 rows x 4 outputs.
// Shared memory holds the X and W tiles transposed ([k][m] and [k][n], f32).
// PLANT 1: the last 32-deep k tile is skipped (dense), the combine weights go in reverse rank
// order (experts). LOWP: X tile values rounded to bf16.

#define GM 64
#define GN 64
#define GK 32
#define GPAD 4


// Eight consecutive x values of row `row` at k (zeros past the tile's rows or K).
__device__ __forceinline__ void load_x8(const float* __restrict__ xr, bool ok, int k, int K, float* v) {
    if (ok && k < K) {
        float4 a = *(const float4*)(xr + k), b = *(const float4*)(xr + k + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
}

// acc[i][j] += Xs[kk][ty*4+i] * Ws[kk][tx*4+j] over the 32-deep tile.
__device__ __forceinline__ void tile_fma(const float (*Xs)[GM + GPAD], const float (*Ws)[GN + GPAD], int tx, int ty,
                                         float acc[4][4]) {
#pragma unroll 8
    for (int kk = 0; kk < GK; ++kk) {
        float4 a = *(const float4*)&Xs[kk][ty * 4];
        float4 b = *(const float4*)&Ws[kk][tx * 4];
        float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
}

// One k step of a tile loop: this thread's 8 activations (rounded by lowp) and 8 weights into
// the shared tiles at (lk.., lr), then acc += the tiles' product. The first barrier keeps the
// previous step's readers ahead of the writes.
__device__ __forceinline__ void stage_fma(float (*Xs)[GM + GPAD], float (*Ws)[GN + GPAD], int lk, int lr,
                                          const float (&xv)[8], const float (&wv)[8], int tx, int ty,
                                          float acc[4][4]) {
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        Xs[lk + i][lr] = lowp(xv[i]);
        Ws[lk + i][lr] = wv[i];
    }
    __syncthreads();
    tile_fma(Xs, Ws, tx, ty, acc);
}

// y[r, n] = sum_k x[r, k] W[n, k]. W bf16 [N, K], x [rows, K], K a multiple of 8.
// Grid (ceil(N / 64), ceil(rows / 64)), block 256.
extern "C" __global__ void __launch_bounds__(256) gemm_bf16_tiled(const bf16_t* __restrict__ W,
                                                                  const float* __restrict__ x,
                                                                  float* __restrict__ y, int N, int K,
                                                                  int rows) {
    __shared__ __align__(16) float Xs[GK][GM + GPAD];
    __shared__ __align__(16) float Ws[GK][GN + GPAD];
    int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    long long m0 = (long long)blockIdx.y * GM;
    int n0 = blockIdx.x * GN;
    int lr = t >> 2, lk = (t & 3) * 8;  // loader: row / output lr, k offset lk
    long long xrow = m0 + lr;
    const float* xr = x + xrow * K;
    bool xok = xrow < rows;
    int wn = n0 + lr;
    const bf16_t* wr = W + (long long)wn * K;
    bool wok = wn < N;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    int kend = K;
#if PLANT == 1
    kend = K > GK ? K - GK : K;
#endif
    for (int k0 = 0; k0 < kend; k0 += GK) {
        float xv[8];
        load_x8(xr, xok, k0 + lk, kend, xv);
        float wv[8];
        if (wok && k0 + lk < kend) {
            uint4 u = ld_stream(wr + k0 + lk);
            float2 a = bf16x2_to_f32(u.x), b = bf16x2_to_f32(u.y), c = bf16x2_to_f32(u.z), d = bf16x2_to_f32(u.w);
            wv[0] = a.x; wv[1] = a.y; wv[2] = b.x; wv[3] = b.y; wv[4] = c.x; wv[5] = c.y; wv[6] = d.x; wv[7] = d.y;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0.0f;
        }
        stage_fma(Xs, Ws, lk, lr, xv, wv, tx, ty, acc);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        long long r = m0 + ty * 4 + i;
        if (r >= rows) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int n = n0 + tx * 4 + j;
            if (n < N) y[r * N + n] = acc[i][j];
        }
    }
}

// ---------------------------------------------------------------- split for cuBLASLt

// x = hi + lo as two BF16 values (hi = bf16(x), lo = bf16(x - hi), both round to nearest even),
// for the BF16 tensor-core GEMMs of bulk linears through cuBLASLt (backend lt.rs): the two
// products with BF16 weights are exact, so their f32 sum carries about 16 bits of x (the
// residual is at most 2^-16 of it).
// LOWP: lo = 0 (x cast to BF16). PLANT 1: lo with the wrong sign.
extern "C" __global__ void split_bf16(const float* __restrict__ x, bf16_t* __restrict__ hi,
                                      bf16_t* __restrict__ lo, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    bf16_t h = f32_to_bf16(v);
    float r = v - bf16_to_f32(h);
#ifdef LOWP
    r = 0.0f;
#endif
#if PLANT == 1
    r = -r;
#endif
    hi[i] = h;
    lo[i] = f32_to_bf16(r);
}

// ---------------------------------------------------------------- routed experts, grouped

// Expert table: tab[6 e + {0..5}] = gate, up, down (fp8 e4m3) and their f32 128x128 block scales;
// gate/up [I, H], down [H, I]. A slot s = row * k + j is routed to e = ids[s].

// counts[e] += 1 per slot; a slot naming a pruned or out-of-range expert sets bit 1 of *err.
extern "C" __global__ void moe_group_count(const unsigned int* __restrict__ ids, const unsigned long long* __restrict__ tab,
                                           int* __restrict__ counts, int slots, int E, int* __restrict__ err) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slots) return;
    long long e = ids[s];
    if (e < 0 || e >= E || tab[6 * e] == 0ull) {
        if (err) atomicOr(err, 2);
        return;
    }
    atomicAdd(&counts[e], 1);
}

// Inclusive prefix sums of two values over a warp's lanes (all 32 lanes take part).
__device__ __forceinline__ void warp_scan2(int& a, int& b, int lane) {
    for (int d = 1; d < 32; d <<= 1) {
        const int pa = __shfl_up_sync(0xffffffffu, a, d), pb = __shfl_up_sync(0xffffffffu, b, d);
        if (lane >= d) {
            a += pa;
            b += pb;
        }
    }
}

// One block: offsets[e] = sum of counts before e, tiles[e] = sum of ceil(counts / tm) before e
// (tiles[E] = the total; tm slots a tile), cursor[e] = 0. E <= 1024; blockDim a multiple of 32.
// Thread i takes experts [i per, (i + 1) per): its sums, a warp scan and a scan of the warps'
// totals give its start, then it writes its experts' prefix sums in order (integers: the same
// values as one thread's walk, which took ~17 us at 256 experts).
extern "C" __global__ void moe_group_scan(const int* __restrict__ counts, int* __restrict__ offsets,
                                          int* __restrict__ tiles, int* __restrict__ cursor, int E, int tm) {
    __shared__ int wo[32], wt[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int e0 = threadIdx.x * per;
    int so = 0, st = 0;
    for (int i = 0; i < per; ++i) {
        const int e = e0 + i;
        if (e < E) {
            const int c = counts[e];
            so += c;
            st += (c + tm - 1) / tm;
        }
    }
    // inclusive scans within the warp, then over the warps' totals
    int io = so, it = st;
    warp_scan2(io, it, lane);
    if (lane == 31) {
        wo[w] = io;
        wt[w] = it;
    }
    __syncthreads();
    if (w == 0) {
        int a = lane < nw ? wo[lane] : 0, b = lane < nw ? wt[lane] : 0;
        warp_scan2(a, b, lane);
        if (lane < nw) {
            wo[lane] = a;
            wt[lane] = b;
        }
    }
    __syncthreads();
    int o = (w > 0 ? wo[w - 1] : 0) + io - so, tl = (w > 0 ? wt[w - 1] : 0) + it - st;
    for (int i = 0; i < per; ++i) {
        const int e = e0 + i;
        if (e < E) {
            offsets[e] = o;
            tiles[e] = tl;
            const int c = counts[e];
            o += c;
            tl += (c + tm - 1) / tm;
        }
    }
    if (threadIdx.x == blockDim.x - 1) {
        offsets[E] = o;
        tiles[E] = tl;
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) cursor[e] = 0;
}

// order[offsets[e] + c] = s for the slots of expert e (in no particular order within e).
extern "C" __global__ void moe_group_fill(const unsigned int* __restrict__ ids, const unsigned long long* __restrict__ tab,
                                          const int* __restrict__ offsets, int* __restrict__ cursor,
                                          int* __restrict__ order, int slots, int E) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slots) return;
    long long e = ids[s];
    if (e < 0 || e >= E || tab[6 * e] == 0ull) return;
    int p = offsets[e] + atomicAdd(&cursor[e], 1);
    order[p] = s;
}

// Eight e4m3 weights of row `r` at k, times the row's 128x128 block scale.
__device__ __forceinline__ void load_w8_fp8(const fp8_t* __restrict__ w, const float* __restrict__ sc, int rows_w,
                                            int K, int r, int k, float* v) {
    if (r < rows_w && k < K) {
        uint2 u = *(const uint2*)(w + (long long)r * K + k);
        float s = sc[(long long)(r >> 7) * ((K + 127) >> 7) + (k >> 7)];
        unsigned short p[4] = {(unsigned short)(u.x & 0xffff), (unsigned short)(u.x >> 16),
                               (unsigned short)(u.y & 0xffff), (unsigned short)(u.y >> 16)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = fp8x2_to_f32(p[i]);
            v[2 * i] = f.x * s;
            v[2 * i + 1] = f.y * s;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
}

// hbuf[s, i] = silu(gate_e . x[s / k]) * (up_e . x[s / k]) for the slots of each expert tile.
// Grid (ceil(I / 64), an upper bound on the tile count), block 256.
extern "C" __global__ void __launch_bounds__(256) moe_group_gate_up(
    const unsigned long long* __restrict__ tab, const float* __restrict__ x, const int* __restrict__ order,
    const int* __restrict__ offsets, const int* __restrict__ tiles, float* __restrict__ hbuf, int I, int H, int k,
    int E) {
    __shared__ __align__(16) float Xs[GK][GM + GPAD];
    __shared__ __align__(16) float Gs[GK][GN + GPAD];
    __shared__ __align__(16) float Us[GK][GN + GPAD];
    __shared__ int e_sh;
    int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    if (t == 0) e_sh = tile_expert(tiles, E, blockIdx.y);
    __syncthreads();
    int e = e_sh;
    if (e < 0) return;
    int first = offsets[e] + (blockIdx.y - tiles[e]) * GM;
    int count = offsets[e + 1] - first;
    if (count > GM) count = GM;
    const fp8_t* gate = (const fp8_t*)tab[6 * e];
    const fp8_t* up = (const fp8_t*)tab[6 * e + 1];
    const float* gs = (const float*)tab[6 * e + 3];
    const float* us = (const float*)tab[6 * e + 4];
    int n0 = blockIdx.x * GN;
    int lr = t >> 2, lk = (t & 3) * 8;
    bool xok = lr < count;
    const float* xr = x + (long long)(xok ? order[first + lr] / k : 0) * H;
    float ga[4][4], ua[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) ga[i][j] = ua[i][j] = 0.0f;
    for (int k0 = 0; k0 < H; k0 += GK) {
        float xv[8], gv[8], uv[8];
        load_x8(xr, xok, k0 + lk, H, xv);
        load_w8_fp8(gate, gs, I, H, n0 + lr, k0 + lk, gv);
        load_w8_fp8(up, us, I, H, n0 + lr, k0 + lk, uv);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            Xs[lk + i][lr] = lowp(xv[i]);
            Gs[lk + i][lr] = gv[i];
            Us[lk + i][lr] = uv[i];
        }
        __syncthreads();
        tile_fma(Xs, Gs, tx, ty, ga);
        tile_fma(Xs, Us, tx, ty, ua);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int m = ty * 4 + i;
        if (m >= count) continue;
        long long s = order[first + m];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int n = n0 + tx * 4 + j;
            if (n < I) hbuf[s * I + n] = silu(ga[i][j]) * ua[i][j];
        }
    }
}

// obuf[s, h] = down_e . hbuf[s] for the slots of each expert tile. Grid (ceil(H / 64), tile bound).
extern "C" __global__ void __launch_bounds__(256) moe_group_down(
    const unsigned long long* __restrict__ tab, const float* __restrict__ hbuf, const int* __restrict__ order,
    const int* __restrict__ offsets, const int* __restrict__ tiles, float* __restrict__ obuf, int I, int H, int E) {
    __shared__ __align__(16) float Xs[GK][GM + GPAD];
    __shared__ __align__(16) float Ws[GK][GN + GPAD];
    __shared__ int e_sh;
    int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    if (t == 0) e_sh = tile_expert(tiles, E, blockIdx.y);
    __syncthreads();
    int e = e_sh;
    if (e < 0) return;
    int first = offsets[e] + (blockIdx.y - tiles[e]) * GM;
    int count = offsets[e + 1] - first;
    if (count > GM) count = GM;
    const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
    const float* ds = (const float*)tab[6 * e + 5];
    int n0 = blockIdx.x * GN;
    int lr = t >> 2, lk = (t & 3) * 8;
    bool xok = lr < count;
    const float* xr = hbuf + (long long)(xok ? order[first + lr] : 0) * I;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < I; k0 += GK) {
        float xv[8], wv[8];
        load_x8(xr, xok, k0 + lk, I, xv);
        load_w8_fp8(down, ds, H, I, n0 + lr, k0 + lk, wv);
        stage_fma(Xs, Ws, lk, lr, xv, wv, tx, ty, acc);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int m = ty * 4 + i;
        if (m >= count) continue;
        long long s = order[first + m];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int n = n0 + tx * 4 + j;
            if (n < H) obuf[s * H + n] = acc[i][j];
        }
    }
}

// y[row, h] = sum_j wts[row, j] * obuf[row * k + j, h], j = 0..k-1 in rank order; NaN where a
// slot names an expert without weights (reported through the error flag by moe_group_count).
extern "C" __global__ void moe_group_combine(const unsigned int* __restrict__ ids, const unsigned long long* __restrict__ tab,
                                             const float* __restrict__ wts, const float* __restrict__ obuf,
                                             float* __restrict__ y, long long rows, int H, int k, int E) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * H;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = i / H;
        int h = (int)(i % H);
        float acc = 0.0f;
        for (int jj = 0; jj < k; ++jj) {
#if PLANT == 1
            int j = k - 1 - jj;
            float w = wts[row * k + jj];
#else
            int j = jj;
            float w = wts[row * k + j];
#endif
            long long e = ids[row * k + j];
            if (e < 0 || e >= E || tab[6 * e] == 0ull) {
                acc = __int_as_float(0x7fc00000);
                break;
            }
            acc = fmaf(w, obuf[(row * k + j) * H + h], acc);
        }
        y[i] = acc;
    }
}

// ---------------------------------------------------------------- the same tiles on tensor cores
// 64 rows x 64 outputs per block, 32 keys a step, as m16n8k8 TF32 MMAs with outputs as M and rows
// as N (warp w takes outputs 16 (w % 4).. and rows 32 (w / 4).., four groups of 8 rows). BF16 and
// e4m3 weights are exact in TF32; each activation is split x = hi + lo into two TF32 values (about
// 22 of its 24 bits kept) and each MMA starts from zero and is added in f32, as gemv_tc2 does (the
// tensor core's own accumulation truncates, which biases a sum over K). An FP8 weight enters raw
// and its 128x128 block scale multiplies each 128-key block's partial sum:
// y = sum_b s_b (sum_{k in b} w_k x_k). An output of a row depends on that row alone (an MMA's
// columns are independent) in a fixed key order, not on the rows beside it or their grouping.
// K a multiple of 32. PLANT 1: the scale of the next key block (experts) / the last 32-key step
// skipped (dense). LOWP: lo dropped (one TF32 MMA per step).
#define TK 32
#define TPAD 4

// Eight activations into the row-major hi/lo tiles at (row lr, key lk..).
__device__ __forceinline__ void stage_x_tf32(unsigned int (*Xh)[TK + TPAD], unsigned int (*Xl)[TK + TPAD], int lr,
                                             int lk, const float (&v)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned int h = tf32_hi(v[i]);
        Xh[lr][lk + i] = h;
#ifdef LOWP
        Xl[lr][lk + i] = 0u;
#else
        Xl[lr][lk + i] = to_tf32(v[i] - __uint_as_float(h));
#endif
    }
}

// The raw e4m3 values of 8 keys of weight row r (zeros past rows_w).
__device__ __forceinline__ void load_w8_fp8_raw(const fp8_t* __restrict__ w, int rows_w, int K, int r, int k,
                                                float (&v)[8]) {
    if (r < rows_w) {
        uint2 u = *(const uint2*)(w + (long long)r * K + k);
        unsigned short p[4] = {(unsigned short)(u.x & 0xffff), (unsigned short)(u.x >> 16),
                               (unsigned short)(u.y & 0xffff), (unsigned short)(u.y >> 16)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = fp8x2_to_f32(p[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
}

// blk[q][e] += (W tile rows mo.. x X rows rq..)'s MMAs over the 32 staged keys, hi then lo, each
// MMA from zero. Row groups at or past `count` are skipped (uniform across the warp).
__device__ __forceinline__ void tc_tile(const float (*Ws)[TK + TPAD], const unsigned int (*Xh)[TK + TPAD],
                                        const unsigned int (*Xl)[TK + TPAD], int mo, int half, int count,
                                        float (&blk)[4][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < TK; ks += 8) {
        const unsigned int a[4] = {__float_as_uint(Ws[mo + g][ks + t]), __float_as_uint(Ws[mo + g + 8][ks + t]),
                                   __float_as_uint(Ws[mo + g][ks + t + 4]),
                                   __float_as_uint(Ws[mo + g + 8][ks + t + 4])};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int rq = half + 8 * q;
            if (rq >= count) break;
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32(d, a, Xh[rq + g][ks + t], Xh[rq + g][ks + t + 4]);
#pragma unroll
            for (int e = 0; e < 4; ++e) blk[q][e] += d[e];
#ifndef LOWP
            float dl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32(dl, a, Xl[rq + g][ks + t], Xl[rq + g][ks + t + 4]);
#pragma unroll
            for (int e = 0; e < 4; ++e) blk[q][e] += dl[e];
#endif
        }
    }
}

// The 128x128 block scale of outputs n0.. (n0 a multiple of 64: one block row) at key block kb.
__device__ __forceinline__ float tile_scale(const float* __restrict__ sc, int n0, int K, int kb) {
    const int nkb = (K + 127) >> 7;
#if PLANT == 1
    kb = (kb + 1) % nkb;
#endif
    return sc[(long long)(n0 >> 7) * nkb + kb];
}

// y[r, n] = sum_k x[r, k] W[n, k] on tensor cores. W bf16 [N, K], x [rows, K], K a multiple of 32.
// Grid (ceil(N / 64), ceil(rows / 64)), block 256.
extern "C" __global__ void __launch_bounds__(256) gemm_bf16_tc(const bf16_t* __restrict__ W,
                                                               const float* __restrict__ x, float* __restrict__ y,
                                                               int N, int K, int rows) {
    __shared__ __align__(16) float Ws[GM][TK + TPAD];
    __shared__ __align__(16) unsigned int Xh[GM][TK + TPAD];
    __shared__ __align__(16) unsigned int Xl[GM][TK + TPAD];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int mo = (warp & 3) * 16, half = (warp >> 2) * 32;
    const int n0 = blockIdx.x * GN, r0 = blockIdx.y * GM;
    const int count = rows - r0 < GM ? rows - r0 : GM;
    const int lr = t >> 2, lk = (t & 3) * 8;
    const bool xok = lr < count, wok = n0 + lr < N;
    const float* xr = x + (long long)(r0 + (xok ? lr : 0)) * K;
    const bf16_t* wr = W + (long long)(wok ? n0 + lr : 0) * K;
    float acc[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[q][e] = 0.0f;
    int kend = K;
#if PLANT == 1
    kend -= TK;
#endif
    for (int k0 = 0; k0 < kend; k0 += TK) {
        float xv[8], wv[8];
        load_x8(xr, xok, k0 + lk, K, xv);
        if (wok) {
            uint4 u = *(const uint4*)(wr + k0 + lk);
            float2 a = bf16x2_to_f32(u.x), b = bf16x2_to_f32(u.y), c = bf16x2_to_f32(u.z), d = bf16x2_to_f32(u.w);
            wv[0] = a.x; wv[1] = a.y; wv[2] = b.x; wv[3] = b.y; wv[4] = c.x; wv[5] = c.y; wv[6] = d.x; wv[7] = d.y;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; ++i) Ws[lr][lk + i] = wv[i];
        stage_x_tf32(Xh, Xl, lr, lk, xv);
        __syncthreads();
        tc_tile(Ws, Xh, Xl, mo, half, count, acc);
    }
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = n0 + mo + g + (e >= 2 ? 8 : 0);
            const int m = half + 8 * q + 2 * tq + (e & 1);
            if (n < N && m < count) y[(long long)(r0 + m) * N + n] = acc[q][e];
        }
}

// moe_group_gate_up on tensor cores: hbuf[s, i] = silu(gate_e . x[s / k]) * (up_e . x[s / k]).
// Grid (ceil(I / 64), an upper bound on the tile count), block 256; H a multiple of 32.
extern "C" __global__ void __launch_bounds__(256) moe_group_gate_up_tc(
    const unsigned long long* __restrict__ tab, const float* __restrict__ x, const int* __restrict__ order,
    const int* __restrict__ offsets, const int* __restrict__ tiles, float* __restrict__ hbuf, int I, int H, int k,
    int E) {
    __shared__ __align__(16) float Gs[GM][TK + TPAD];
    __shared__ __align__(16) float Us[GM][TK + TPAD];
    __shared__ __align__(16) unsigned int Xh[GM][TK + TPAD];
    __shared__ __align__(16) unsigned int Xl[GM][TK + TPAD];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    int first, count;
    const int e = group_tile<GM>(offsets, tiles, E, first, count);
    if (e < 0) return;
    const fp8_t* gate = (const fp8_t*)tab[6 * e];
    const fp8_t* up = (const fp8_t*)tab[6 * e + 1];
    const float* gs = (const float*)tab[6 * e + 3];
    const float* us = (const float*)tab[6 * e + 4];
    const int mo = (warp & 3) * 16, half = (warp >> 2) * 32;
    const int n0 = blockIdx.x * GN;
    const int lr = t >> 2, lk = (t & 3) * 8;
    const bool xok = lr < count;
    const float* xr = x + (long long)(xok ? order[first + lr] / k : 0) * H;
    float ga[4][4], ua[4][4], gb[4][4], ub[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int j = 0; j < 4; ++j) ga[q][j] = ua[q][j] = gb[q][j] = ub[q][j] = 0.0f;
    for (int k0 = 0; k0 < H; k0 += TK) {
        float xv[8], gv[8], uv[8];
        load_x8(xr, xok, k0 + lk, H, xv);
        load_w8_fp8_raw(gate, I, H, n0 + lr, k0 + lk, gv);
        load_w8_fp8_raw(up, I, H, n0 + lr, k0 + lk, uv);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            Gs[lr][lk + i] = gv[i];
            Us[lr][lk + i] = uv[i];
        }
        stage_x_tf32(Xh, Xl, lr, lk, xv);
        __syncthreads();
        tc_tile(Gs, Xh, Xl, mo, half, count, gb);
        tc_tile(Us, Xh, Xl, mo, half, count, ub);
        if (((k0 + TK) & 127) == 0 || k0 + TK >= H) {
            const int kb = k0 >> 7;
            const float sg = tile_scale(gs, n0, H, kb), su = tile_scale(us, n0, H, kb);
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    ga[q][j] = fmaf(sg, gb[q][j], ga[q][j]);
                    ua[q][j] = fmaf(su, ub[q][j], ua[q][j]);
                    gb[q][j] = ub[q][j] = 0.0f;
                }
        }
    }
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + mo + g + (j >= 2 ? 8 : 0);
            const int m = half + 8 * q + 2 * tq + (j & 1);
            if (n < I && m < count) hbuf[(long long)order[first + m] * I + n] = silu(ga[q][j]) * ua[q][j];
        }
}

// moe_group_down on tensor cores: obuf[s, h] = down_e . hbuf[s]. Grid (ceil(H / 64), tile bound),
// block 256; I a multiple of 32.
extern "C" __global__ void __launch_bounds__(256) moe_group_down_tc(
    const unsigned long long* __restrict__ tab, const float* __restrict__ hbuf, const int* __restrict__ order,
    const int* __restrict__ offsets, const int* __restrict__ tiles, float* __restrict__ obuf, int I, int H, int E) {
    __shared__ __align__(16) float Ws[GM][TK + TPAD];
    __shared__ __align__(16) unsigned int Xh[GM][TK + TPAD];
    __shared__ __align__(16) unsigned int Xl[GM][TK + TPAD];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    int first, count;
    const int e = group_tile<GM>(offsets, tiles, E, first, count);
    if (e < 0) return;
    const fp8_t* down = (const fp8_t*)tab[6 * e + 2];
    const float* ds = (const float*)tab[6 * e + 5];
    const int mo = (warp & 3) * 16, half = (warp >> 2) * 32;
    const int n0 = blockIdx.x * GN;
    const int lr = t >> 2, lk = (t & 3) * 8;
    const bool xok = lr < count;
    const float* xr = hbuf + (long long)(xok ? order[first + lr] : 0) * I;
    float acc[4][4], blk[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[q][j] = blk[q][j] = 0.0f;
    for (int k0 = 0; k0 < I; k0 += TK) {
        float xv[8], wv[8];
        load_x8(xr, xok, k0 + lk, I, xv);
        load_w8_fp8_raw(down, H, I, n0 + lr, k0 + lk, wv);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; ++i) Ws[lr][lk + i] = wv[i];
        stage_x_tf32(Xh, Xl, lr, lk, xv);
        __syncthreads();
        tc_tile(Ws, Xh, Xl, mo, half, count, blk);
        if (((k0 + TK) & 127) == 0 || k0 + TK >= I) {
            const float s = tile_scale(ds, n0, I, k0 >> 7);
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[q][j] = fmaf(s, blk[q][j], acc[q][j]);
                    blk[q][j] = 0.0f;
                }
        }
    }
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + mo + g + (j >= 2 ? 8 : 0);
            const int m = half + 8 * q + 2 * tq + (j & 1);
            if (n < H && m < count) obuf[(long long)order[first + m] * H + n] = acc[q][j];
        }
}
