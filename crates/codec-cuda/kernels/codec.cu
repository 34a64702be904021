// The ModifiedDAC codec (decoder, and the encoder's VQ search) on the GPU (crate codec-cuda).
// No CUDA headers.
// Layout: time-major f32 activations [rows, channels]. Every GEMM output element's bits are
// fixed by K (and N) alone, whatever tile, row count or chunk computes it: the FMA tiles run the
// fma chain acc = fma(A[r,k], B[k,c], acc) over k = 0..K-1 in order; the tensor-core tiles
// (gemm_tc16 / gemm_tc64, the decoder's default) sum 3xTF32 k8 steps in order inside split-K
// segments fixed by K and N, then the segments in order. So streamed decoding is bit-identical
// to whole decoding.
#define CODEC_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : -CODEC_INF;
    return warp_max(t);
}

// A(r, kk) = A[r*rsa + (kk / cin)*jstride + kk % cin] (implicit im2col for convolutions).
__device__ __forceinline__ float load_a(const float* A, int r, int kk, long long rsa, int cin,
                                        long long jstride) {
    int j = kk / cin;
    int ci = kk - j * cin;
    return A[(long long)r * rsa + (long long)j * jstride + ci];
}

// v = acc (+ bias[c % bias_n]) (* gamma[c]); v = res[r, c] + v; tanh if act == 1.
__device__ __forceinline__ void epilogue(float acc, int r, int c, int N, float* C,
                                         const float* bias, int bias_n, const float* gamma,
                                         const float* res, int act) {
    float v = acc;
    if (bias) v = __fadd_rn(v, bias[c % bias_n]);
    if (gamma) v = __fmul_rn(v, gamma[c]);
    if (res) v = __fadd_rn(res[(long long)r * N + c], v);
    if (act == 1) v = tanhf(v);
    C[(long long)r * N + c] = v;
}

// An output: its K segment z's partial sum (segments split across blocks) or, summed whole,
// the epilogue into C. The tensor-core GEMMs' common store.
__device__ __forceinline__ void put_out(float v, bool split, int z, int r, int c, int M, int N, float* part,
                                        float* C, const float* bias, int bias_n, const float* gamma,
                                        const float* res, int act) {
    if (split) part[((long long)z * M + r) * N + c] = v;
    else epilogue(v, r, c, N, C, bias, bias_n, gamma, res, act);
}

template <int BM, int BN, int BK, int TM, int TN>
__device__ __forceinline__ void gemm_tile(int M, int N, int K, const float* A, long long rsa,
                                          int cin, long long jstride, const float* B, float* C,
                                          const float* bias, int bias_n, const float* gamma,
                                          const float* res, int act, int ks,
                                          float* part) {
    const int NT = (BM / TM) * (BN / TN);
    __shared__ float As[BK][BM + 1];
    __shared__ float Bs[BK][BN];
    int tid = threadIdx.x;
    int tx = tid % (BN / TN), ty = tid / (BN / TN);
    int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
    // K segment of this block (split-K: a fixed segment length per layer, never per row count).
    int kbeg = blockIdx.z * ks, kend = min(K, kbeg + ks);
    for (int k0 = kbeg; k0 < kend; k0 += BK) {
        for (int i = tid; i < BM * BK; i += NT) {
            int r = i / BK, kk = i % BK;
            int gr = row0 + r, gk = k0 + kk;
            As[kk][r] = (gr < M && gk < kend) ? load_a(A, gr, gk, rsa, cin, jstride) : 0.0f;
        }
        for (int i = tid; i < BK * BN; i += NT) {
            int kk = i / BN, c = i % BN;
            int gk = k0 + kk, gc = col0 + c;
            Bs[kk][c] = (gk < kend && gc < N) ? B[(long long)gk * N + gc] : 0.0f;
        }
        __syncthreads();
        int kmax = min(BK, kend - k0);
        for (int kk = 0; kk < kmax; kk++) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; i++) a[i] = As[kk][ty * TM + i];
#pragma unroll
            for (int j = 0; j < TN; j++) b[j] = Bs[kk][tx * TN + j];
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        int r = row0 + ty * TM + i;
        if (r >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            int c = col0 + tx * TN + j;
            if (c >= N) continue;
            if (gridDim.z == 1) epilogue(acc[i][j], r, c, N, C, bias, bias_n, gamma, res, act);
            else part[((long long)blockIdx.z * M + r) * N + c] = acc[i][j];
        }
    }
}

// 64x64 tiles, 256 threads, 4x4 outputs each: many rows.
extern "C" __global__ void __launch_bounds__(256)
gemm_big(int M, int N, int K, const float* A, long long rsa, int cin, long long jstride,
         const float* B, float* C, const float* bias, int bias_n, const float* gamma,
         const float* res, int act, int ks, float* part) {
    gemm_tile<64, 64, 16, 4, 4>(M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res,
                                act, ks, part);
}

// 8x128 tiles, 256 threads, 1x4 outputs each: few rows (frame-rate layers).
extern "C" __global__ void __launch_bounds__(256)
gemm_small(int M, int N, int K, const float* A, long long rsa, int cin, long long jstride,
           const float* B, float* C, const float* bias, int bias_n, const float* gamma,
           const float* res, int act, int ks, float* part) {
    gemm_tile<8, 128, 32, 1, 4>(M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res,
                                act, ks, part);
}

// ---------------------------------------------------------------- tensor-core GEMM (3xTF32)
// The decoder's GEMMs on tensor cores, with f32-class accuracy: each operand x is split into
// two TF32 values x = hi + lo (hi = tf32(x), lo = tf32(x - hi)), and a k8 step of an output is
// d = hi_a hi_b (one MMA from zero) + (lo_a hi_b + hi_a lo_b) (two chained MMAs from zero, the
// small terms), added to the segment's f32 sum as acc + (d_big + d_small). Chaining MMAs over
// K would truncate at every step (backend-cuda's gemv notes), so every step starts from zero.
// An output's bits are fixed by K's split-K segments (split_len: K and N only) and the k8 steps
// in order inside each; segments are summed in order, total = seg0 + seg1 + ..., then the
// epilogue, inside the block (gridDim.z == 1, every segment) or by gemm_reduce (one segment a
// block). Nothing depends on M, the row tile or the mode, so streamed decoding stays
// bit-identical to whole decoding. A row's result never depends on another row's values.
// Block: 4 warps, BM rows x 64 columns; warp w owns columns col0 + 16 w .. + 16 (two n8 tiles)
// of all BM rows (BM / 16 m16 tiles); a warp wholly past N stages A with the others and skips
// its MMAs. The A tile is split once into shared memory (shared by
// the warps); each warp loads its B fragments straight from global memory into registers.
// LOWP: drops the small terms (one TF32 MMA a step), the lower-precision twin a test must catch.
__device__ __forceinline__ unsigned int tf32_of(float f) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ void mma_tf32_acc(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                             unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One k8 step of a 16 x 8 output tile, the operation sequence every tensor-core GEMM here shares
// (it fixes the bits): big = hi_a hi_b from zero, small = lo_a hi_b + hi_a lo_b from zero, then
// acc + (big + small), each add rounded once. LOWP drops the small terms.
__device__ __forceinline__ void step3(float (&acc)[4], const unsigned int (&ah)[4], const unsigned int (&al)[4],
                                      unsigned int bh0, unsigned int bh1, unsigned int bl0, unsigned int bl1) {
    float big[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_tf32_acc(big, ah, bh0, bh1);
    float small[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifndef LOWP
    mma_tf32_acc(small, al, bh0, bh1);
    mma_tf32_acc(small, ah, bl0, bl1);
#endif
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], __fadd_rn(big[e], small[e]));
}

#define TC_BK 32
// x = hi + lo in TF32 (hi = tf32(x), lo = tf32(x - hi)): every tensor-core GEMM's split.
//
// hi is cvt.rna's value made on the bits (add half of the dropped 13 bits, clear them): for every
// finite x the same bits, in 2 instructions where ptxas's cvt.rna takes 4 (its select for inf and
// NaN). lo keeps cvt.rna, so a non-finite x still gives a NaN product: inf - inf, and for a NaN
// whose sum wraps to -0 in hi (CUDA's 0x7fffffff), x - hi is x itself.
__device__ __forceinline__ void tf32_split(float v, unsigned int& h, unsigned int& l) {
    h = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
    l = tf32_of(v - __uint_as_float(h));
}

// For the check (check::tf32_split): each x's split, and cvt.rna's hi for comparison.
extern "C" __global__ void tf32_split_check(const float* x, unsigned int* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int h, l;
    tf32_split(x[i], h, l);
    out[3 * i] = h;
    out[3 * i + 1] = l;
    out[3 * i + 2] = tf32_of(x[i]);
}

template <int BM>
__device__ __forceinline__ void gemm_tc_body(int M, int N, int K, const float* A, long long rsa, int cin,
                                             long long jstride, const float* B, float* C,
                                             const float* bias, int bias_n, const float* gamma,
                                             const float* res, int act, int ks, float* part) {
    constexpr int MT = BM / 16;
    __shared__ unsigned int Ah[TC_BK][BM + 4];
    __shared__ unsigned int Al[TC_BK][BM + 4];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * BM;
    const int colw = blockIdx.x * 64 + warp * 16;
    const bool idle = colw >= N;  // uniform across the warp
    const int nseg = (K + ks - 1) / ks;
    const bool split = gridDim.z > 1;
    const int z0 = split ? (int)blockIdx.z : 0, z1 = split ? z0 + 1 : nseg;
    float tot[MT][2][4];
    for (int z = z0; z < z1; ++z) {
        const int kbeg = z * ks, kend = min(K, kbeg + ks);
        float acc[MT][2][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
        // a chunk's B fragments are loaded one chunk ahead (in flight while A is staged and the
        // chunk before is multiplied): the frame-rate layers wait on these weight loads
        float bv[4][2][2], bnext[4][2][2];
        auto load_b = [&](float (&dst)[4][2][2], int k0) {
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int n = colw + 8 * j + g;
                    const int ka = k0 + 8 * s + t, kb = ka + 4;
                    dst[s][j][0] = (n < N && ka < kend) ? B[(long long)ka * N + n] : 0.0f;
                    dst[s][j][1] = (n < N && kb < kend) ? B[(long long)kb * N + n] : 0.0f;
                }
        };
        load_b(bnext, kbeg);
        for (int k0 = kbeg; k0 < kend; k0 += TC_BK) {
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    bv[s][j][0] = bnext[s][j][0];
                    bv[s][j][1] = bnext[s][j][1];
                }
            if (k0 + TC_BK < kend) load_b(bnext, k0 + TC_BK);
            __syncthreads();
            for (int i = tid; i < BM * TC_BK; i += 128) {
                const int r = i / TC_BK, kk = i - r * TC_BK;
                const int gr = row0 + r, gk = k0 + kk;
                const float v = (gr < M && gk < kend) ? load_a(A, gr, gk, rsa, cin, jstride) : 0.0f;
                tf32_split(v, Ah[kk][r], Al[kk][r]);
            }
            __syncthreads();
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                if (idle || k0 + 8 * s >= kend) break;  // uniform: no columns, or past the segment
                unsigned int bh[2][2], bl[2][2];
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        tf32_split(bv[s][j][q], bh[j][q], bl[j][q]);
                    }
                const int kk = 8 * s + t;
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const int r = 16 * i + g;
                    const unsigned int ah[4] = {Ah[kk][r], Ah[kk][r + 8], Ah[kk + 4][r], Ah[kk + 4][r + 8]};
                    const unsigned int al[4] = {Al[kk][r], Al[kk][r + 8], Al[kk + 4][r], Al[kk + 4][r + 8]};
#pragma unroll
                    for (int j = 0; j < 2; ++j) step3(acc[i][j], ah, al, bh[j][0], bh[j][1], bl[j][0], bl[j][1]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) tot[i][j][e] = z == z0 ? acc[i][j][e] : __fadd_rn(tot[i][j][e], acc[i][j][e]);
    }
    // c0 = (g, 2t), c1 = (g, 2t + 1), c2 = (g + 8, 2t), c3 = (g + 8, 2t + 1) of each 16 x 8 tile
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + 16 * i + g + (e >= 2 ? 8 : 0);
                const int c = colw + 8 * j + 2 * t + (e & 1);
                if (r >= M || c >= N) continue;
                put_out(tot[i][j][e], split, z0, r, c, M, N, part, C, bias, bias_n, gamma, res, act);
            }
}

// 16 rows a block (frame-rate layers: few rows) and 64 rows a block (many rows): the same bits.
// (Narrower blocks for more of them on the frame-rate layers, 16 and 32 columns, were 2.7x
// slower there: session 14, branch codec-narrow.)
extern "C" __global__ void __launch_bounds__(128)
gemm_tc16(int M, int N, int K, const float* A, long long rsa, int cin, long long jstride,
          const float* B, float* C, const float* bias, int bias_n, const float* gamma,
          const float* res, int act, int ks, float* part) {
    gemm_tc_body<16>(M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res, act, ks, part);
}
extern "C" __global__ void __launch_bounds__(128)
gemm_tc64(int M, int N, int K, const float* A, long long rsa, int cin, long long jstride,
          const float* B, float* C, const float* bias, int bias_n, const float* gamma,
          const float* res, int act, int ks, float* part) {
    gemm_tc_body<64>(M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res, act, ks, part);
}

// ------------------------------------------- tensor-core GEMM, wide tiles (3xTF32, same bits)
// gemm_tcw / gemm_tcw2 (many rows: the sample-rate layers) and gemm_tcs (up to 16 rows: the
// frame-rate layers): gemm_tc_body's arithmetic on other tiles. Every output is the same
// sequence of operations as gemm_tc16 / gemm_tc64 (k8 steps in order inside K's segments, each
// step big + small from zero added to the segment's sum, segments summed in order), so the bits
// are theirs and any dispatch keeps streaming bit-identical. What differs is the staging: the
// caller guarantees cin, K and the segment length ks multiples of 16, N of 4, and A, B, rsa and
// jstride 16-byte aligned (so every 16-key chunk lies inside one tap and one segment, and a
// row's 16 keys are contiguous): the chunks are copied global -> shared by cp.async, 16 bytes
// at a time with no index division, in ST shared-memory stages (up to ST - 1 copies in flight
// while a chunk is multiplied), and sit raw in shared memory (split into hi + lo as fragments
// are read).
#define TCW_BK 16
#define TCW_AS 20  // A row stride in floats: fragment reads (20g + t) hit 32 distinct banks
// 16 bytes global -> shared, asynchronously; src_bytes 0 fills the 16 bytes with zeros.
__device__ __forceinline__ void cp_async16(float* dst, const float* src, int src_bytes) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Warps WM x WN, each MT m16 x NT n8 tiles: a block of BM = 16 WM MT rows and BN = 8 WN NT
// columns, ST stages of TCW_BK keys (up to ST - 1 chunks in flight). The B row stride BN + 8
// floats makes the fragment reads (8t + g) hit 32 distinct banks. SEG1: the caller guarantees
// a block one segment (K's segments across blocks, or K one segment), so no sum of segments is
// kept (32 registers a thread fewer at 32 x 32 a warp).
template <int WM, int WN, int MT, int NT, int ST, bool SEG1 = false>
__device__ __forceinline__ void gemm_tcw_body(int M, int N, int K, const float* A, long long rsa,
                                              int cin, long long jstride, const float* B, float* C,
                                              const float* bias, int bias_n, const float* gamma,
                                              const float* res, int act, int ks, float* part) {
    constexpr int BM = 16 * WM * MT, BN = 8 * WN * NT, BS = BN + 8, T = 32 * WM * WN;
    __shared__ __align__(16) float As[ST][BM * TCW_AS];
    __shared__ __align__(16) float Bs[ST][TCW_BK * BS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int wm = (warp / WN) * 16 * MT, wn = (warp % WN) * 8 * NT;  // the warp's tiles
    const int nseg = (K + ks - 1) / ks;
    const bool split = gridDim.z > 1;
    const int z0 = split ? (int)blockIdx.z : 0, z1 = split ? z0 + 1 : nseg;
    const int k_first = z0 * ks, k_last = min(K, z1 * ks);  // this block's keys
    const int nchunks = (k_last - k_first) / TCW_BK;
    // a chunk: A's BM rows x 16 keys and B's 16 keys x BN columns, 16 bytes a copy. Every chunk
    // lies inside one tap, so the sources move by a chunk's keys a load (the tap's offset
    // kept as it goes: no division a chunk).
    int ld_ci = k_first % cin;  // the next chunk's first key inside its tap
    long long ld_off = (long long)(k_first / cin) * jstride + ld_ci, ld_boff = (long long)k_first * N;
    auto load = [&](int stage) {
#pragma unroll
        for (int u = 0; u < (BM * 4 + T - 1) / T; ++u) {
            const int i = tid + u * T;
            if (BM * 4 % T != 0 && i >= BM * 4) break;
            const int r = i >> 2, c = (i & 3) * 4, gr = row0 + r;
            cp_async16(&As[stage][r * TCW_AS + c], gr < M ? A + (long long)gr * rsa + ld_off + c : A,
                       gr < M ? 16 : 0);
        }
#pragma unroll
        for (int u = 0; u < (TCW_BK * BN / 4 + T - 1) / T; ++u) {
            const int i = tid + u * T;
            if (TCW_BK * BN / 4 % T != 0 && i >= TCW_BK * BN / 4) break;
            const int k = i / (BN / 4), c = (i % (BN / 4)) * 4, gc = col0 + c;
            cp_async16(&Bs[stage][k * BS + c], gc < N ? B + ld_boff + (long long)k * N + gc : B,
                       gc < N ? 16 : 0);
        }
        ld_ci += TCW_BK;
        ld_off += TCW_BK;
        ld_boff += (long long)TCW_BK * N;
        if (ld_ci == cin) {  // the next tap
            ld_ci = 0;
            ld_off += jstride - cin;
        }
    };
    float tot[SEG1 ? 1 : MT][SEG1 ? 1 : NT][4];
    float acc[MT][NT][4];
#pragma unroll
    for (int st = 0; st < ST - 1; ++st) {
        if (st < nchunks) load(st);
        cp_async_commit();
    }
    int cur = 0, nxt = ST - 1;  // the stage multiplied now and the one loaded next
    int seg_pos = 0;            // keys of the current segment before this chunk (SEG1: one segment)
    auto zero_acc = [&]() {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    };
    // SEG1: the block's one segment starts here (zeroing inside the loop compiled to 32
    // selects a chunk)
    if (SEG1) zero_acc();
    for (int ch = 0; ch < nchunks; ++ch) {
        const int k0 = k_first + ch * TCW_BK;
        if (!SEG1 && seg_pos == 0) zero_acc();  // a segment starts
        cp_async_wait<ST - 2>();
        __syncthreads();  // chunk ch has landed for every thread; chunk ch - 1 is read
        if (ch + ST - 1 < nchunks) load(nxt);
        cp_async_commit();
        const float* as = As[cur];
        const float* bs = Bs[cur];
        cur = cur + 1 == ST ? 0 : cur + 1;
        nxt = nxt + 1 == ST ? 0 : nxt + 1;
#pragma unroll
        for (int s = 0; s < TCW_BK / 8; ++s) {
            const int kk = 8 * s + t;
            unsigned int bh[NT][2], bl[NT][2];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = wn + 8 * j + g;
                tf32_split(bs[kk * BS + n], bh[j][0], bl[j][0]);
                tf32_split(bs[(kk + 4) * BS + n], bh[j][1], bl[j][1]);
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r = wm + 16 * i + g;
                unsigned int ah[4], al[4];
                tf32_split(as[r * TCW_AS + kk], ah[0], al[0]);
                tf32_split(as[(r + 8) * TCW_AS + kk], ah[1], al[1]);
                tf32_split(as[r * TCW_AS + kk + 4], ah[2], al[2]);
                tf32_split(as[(r + 8) * TCW_AS + kk + 4], ah[3], al[3]);
                // every n8 tile, with no branch: B past N is zero-filled, so a tile past N
                // multiplies zeros and put_out drops its outputs
#pragma unroll
                for (int j = 0; j < NT; ++j) step3(acc[i][j], ah, al, bh[j][0], bh[j][1], bl[j][0], bl[j][1]);
            }
        }
        seg_pos += TCW_BK;
        if (seg_pos == ks) seg_pos = 0;
        if (!SEG1 && (ch + 1 == nchunks || seg_pos == 0)) {  // a segment ends
            const bool first = k0 - k_first < ks;
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float& t_ = tot[SEG1 ? 0 : i][SEG1 ? 0 : j][e];
                        t_ = first ? acc[i][j][e] : __fadd_rn(t_, acc[i][j][e]);
                    }
        }
    }
    cp_async_wait<0>();
    // c0 = (g, 2t), c1 = (g, 2t + 1), c2 = (g + 8, 2t), c3 = (g + 8, 2t + 1) of each 16 x 8 tile
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + wm + 16 * i + g + (e >= 2 ? 8 : 0);
                const int c = col0 + wn + 8 * j + 2 * t + (e & 1);
                if (r >= M || c >= N) continue;
                const float v = SEG1 ? acc[i][j][e] : tot[SEG1 ? 0 : i][SEG1 ? 0 : j][e];
                put_out(v, split, z0, r, c, M, N, part, C, bias, bias_n, gamma, res, act);
            }
}

#define GEMM_TCW_ARGS                                                                                  \
    int M, int N, int K, const float *A, long long rsa, int cin, long long jstride, const float *B,    \
        float *C, const float *bias, int bias_n, const float *gamma, const float *res, int act, int ks, \
        float *part
#define GEMM_TCW_PASS M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res, act, ks, part
// Many rows: 128 x 64 tiles, 8 warps of 32 x 32, 3 stages. One block a
// multiprocessor with the registers the body wants (no spills), or two held to 128 registers
// each (a few spilled): the same bits, the faster one chosen by measurement.
extern "C" __global__ void __launch_bounds__(256, 1) gemm_tcw(GEMM_TCW_ARGS) {
    gemm_tcw_body<4, 2, 2, 4, 3>(GEMM_TCW_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tcw2(GEMM_TCW_ARGS) {
    gemm_tcw_body<4, 2, 2, 4, 3>(GEMM_TCW_PASS);
}
// gemm_tcw2 for one segment a block: two blocks a multiprocessor without spills, or three
// (the default: a 12-frame push 5875 against 6233 us, session 22).
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tcw2s(GEMM_TCW_ARGS) {
    gemm_tcw_body<4, 2, 2, 4, 3, true>(GEMM_TCW_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 3) gemm_tcw3s(GEMM_TCW_ARGS) {
    gemm_tcw_body<4, 2, 2, 4, 3, true>(GEMM_TCW_PASS);
}
// gemm_tcw3s's 128 x 64 tile as four warps of 64 x 32 (four blocks a multiprocessor, 128
// registers): per MMA a quarter fewer TF32 splits and half the shared-memory reads of a 32 x 32
// warp, from fewer warps. The same bits.
extern "C" __global__ void __launch_bounds__(128, 4) gemm_tcw4s(GEMM_TCW_ARGS) {
    gemm_tcw_body<2, 2, 4, 4, 3, true>(GEMM_TCW_PASS);
}
// One segment a block on 64 x 96 tiles, 6 warps of 32 x 32, four blocks a multiprocessor: for
// N = 96 (the last stage), which 64-column tiles pad to 128.
extern "C" __global__ void __launch_bounds__(192, 4) gemm_tcw96s(GEMM_TCW_ARGS) {
    gemm_tcw_body<2, 3, 2, 4, 3, true>(GEMM_TCW_PASS);
}
// Up to 16 rows (the frame-rate layers, weight-bound: ~436 MB of f32 weights a decoder call in
// the post-module alone): 16 x 64 tiles, 4 warps of 16 x 16, 6 stages. Opt-in
// (DRAMATIS_CODEC_TCS=1): faster than gemm_tc16 at 16 rows, slower at one (session 14).
extern "C" __global__ void __launch_bounds__(128) gemm_tcs(GEMM_TCW_ARGS) {
    gemm_tcw_body<1, 4, 1, 2, 6>(GEMM_TCW_PASS);
}

// ------------------------------------- tensor-core GEMM, up to 16 rows, weights in flight
// gemm_fr: the frame-rate layers (up to 16 rows: weight-bound, ~436 MB of f32 weights a decoder
// call in the post-module alone) on gemm_tc16's arithmetic, so its bits: k8 steps in order
// inside K's segments, each step3 from the same fragments, segments summed in order. What
// differs is what is in flight: gemm_tc16 holds one 32-key chunk of weights a warp ahead and
// stages A between two barriers a chunk (a 12-frame push's 33 launches moved 436 MB in 772 us,
// 0.56 TB/s). Here each warp is one n8 tile of a 32-column block and loads a whole 128-key
// piece of its B fragments (32 floats a lane) and the block the piece's A (16 rows, 16 floats a
// thread) while the piece before is multiplied. A sits raw in shared memory, split at the
// fragment read.
// gemm_fr4: the same for 17-64 rows (four m16 tiles a warp, 64-key pieces; the layers a
// push's frame-rate rows reach after the first upsampling: gemm_tc64's bits).
template <int MT, int PK>
__device__ __forceinline__ void gemm_fr_body(int M, int N, int K, const float* A, long long rsa,
                                             int cin, long long jstride, const float* B, float* C,
                                             const float* bias, int bias_n, const float* gamma,
                                             const float* res, int act, int ks, float* part) {
    constexpr int R = 16 * MT, AS = PK + 4;  // A row stride: fragment reads (4g + t) hit 32 banks
    constexpr int AN = R * PK / 128;          // A elements a thread stages
    __shared__ float As[R * AS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * R;
    const int col = blockIdx.x * 32 + warp * 8;
    const bool idle = col >= N;  // uniform across the warp
    const int n = col + g;
    const int nseg = (K + ks - 1) / ks;
    const bool split = gridDim.z > 1;
    const int z0 = split ? (int)blockIdx.z : 0, z1 = split ? z0 + 1 : nseg;
    // a piece: keys [k0, min(k0 + PK, kend)) of the segment ending at kend; bn[s][q] holds
    // B[k0 + 8s + t + 4q][n], an[u] A's element tid + 128u of the piece (row-major, PK keys a
    // row: key tid % PK of rows tid / PK + (128 / PK) u); zero past the segment, M or N
    float bv[PK / 8][2], bn[PK / 8][2], an[AN];
    auto load = [&](int k0, int kend) {
#pragma unroll
        for (int s = 0; s < PK / 8; ++s)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int k = k0 + 8 * s + t + 4 * q;
                bn[s][q] = (!idle && n < N && k < kend) ? B[(long long)k * N + n] : 0.0f;
            }
        const int k = k0 + tid % PK;
        const int j = k / cin;
        const long long off = (long long)j * jstride + (k - j * cin);  // load_a's column
#pragma unroll
        for (int u = 0; u < AN; ++u) {
            const int r = row0 + tid / PK + (128 / PK) * u;
            an[u] = (r < M && k < kend) ? A[(long long)r * rsa + off] : 0.0f;
        }
    };
    int z = z0, k0 = z0 * ks, kend = min(K, k0 + ks);
    load(k0, kend);
    float acc[MT][4], tot[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
    for (;;) {
        __syncthreads();  // the piece before is read
#pragma unroll
        for (int u = 0; u < AN; ++u) As[(tid / PK + (128 / PK) * u) * AS + tid % PK] = an[u];
#pragma unroll
        for (int s = 0; s < PK / 8; ++s) {
            bv[s][0] = bn[s][0];
            bv[s][1] = bn[s][1];
        }
        int nz = z, nk0 = k0 + PK, nkend = kend;
        if (nk0 >= kend) {  // the next piece starts the next segment
            nz = z + 1;
            nk0 = nz * ks;
            nkend = min(K, nk0 + ks);
        }
        const bool more = nz < z1;
        if (more) load(nk0, nkend);
        __syncthreads();  // the piece's A has landed
        if (!idle) {
#pragma unroll
            for (int s = 0; s < PK / 8; ++s) {
                if (k0 + 8 * s >= kend) break;  // uniform: past the segment
                const int kk = 8 * s + t;
                unsigned int bh[2], bl[2];
                tf32_split(bv[s][0], bh[0], bl[0]);
                tf32_split(bv[s][1], bh[1], bl[1]);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const int r = 16 * i + g;
                    unsigned int ah[4], al[4];
                    tf32_split(As[r * AS + kk], ah[0], al[0]);
                    tf32_split(As[(r + 8) * AS + kk], ah[1], al[1]);
                    tf32_split(As[r * AS + kk + 4], ah[2], al[2]);
                    tf32_split(As[(r + 8) * AS + kk + 4], ah[3], al[3]);
                    step3(acc[i], ah, al, bh[0], bh[1], bl[0], bl[1]);
                }
            }
        }
        if (nz != z || !more) {  // a segment ends
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    tot[i][e] = z == z0 ? acc[i][e] : __fadd_rn(tot[i][e], acc[i][e]);
                    acc[i][e] = 0.0f;
                }
        }
        if (!more) break;
        z = nz;
        k0 = nk0;
        kend = nkend;
    }
    // c0 = (g, 2t), c1 = (g, 2t + 1), c2 = (g + 8, 2t), c3 = (g + 8, 2t + 1) of each m16 tile
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row0 + 16 * i + g + (e >= 2 ? 8 : 0);
            const int c = col + 2 * t + (e & 1);
            if (r >= M || c >= N) continue;
            put_out(tot[i][e], split, z0, r, c, M, N, part, C, bias, bias_n, gamma, res, act);
        }
}
extern "C" __global__ void __launch_bounds__(128)
gemm_fr(int M, int N, int K, const float* A, long long rsa, int cin, long long jstride,
        const float* B, float* C, const float* bias, int bias_n, const float* gamma,
        const float* res, int act, int ks, float* part) {
    gemm_fr_body<1, 128>(M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res, act, ks, part);
}
extern "C" __global__ void __launch_bounds__(128)
gemm_fr4(int M, int N, int K, const float* A, long long rsa, int cin, long long jstride,
         const float* B, float* C, const float* bias, int bias_n, const float* gamma,
         const float* res, int act, int ks, float* part) {
    gemm_fr_body<4, 64>(M, N, K, A, rsa, cin, jstride, B, C, bias, bias_n, gamma, res, act, ks, part);
}

// Split-K combine: acc = part[0] + part[1] + ... in segment order, then the epilogue.
extern "C" __global__ void gemm_reduce(const float* part, int nseg, int M, int N, float* C,
                                       const float* bias, int bias_n, const float* gamma,
                                       const float* res, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long mn = (long long)M * N;
    if (i >= mn) return;
    float acc = part[i];
    for (int z = 1; z < nseg; z++) acc = __fadd_rn(acc, part[z * mn + i]);
    epilogue(acc, (int)(i / N), (int)(i % N), N, C, bias, bias_n, gamma, res, act);
}

// N == 1: one thread per row, the same fma chain.
extern "C" __global__ void gemm_n1(int M, int K, const float* A, long long rsa, int cin,
                                   long long jstride, const float* B, float* C,
                                   const float* bias, const float* gamma, const float* res,
                                   int act) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M) return;
    float acc = 0.0f;
    for (int kk = 0; kk < K; kk++) acc = fmaf(load_a(A, r, kk, rsa, cin, jstride), B[kk], acc);
    epilogue(acc, r, 0, 1, C, bias, 1, gamma, res, act);
}

// out = x + inv * sin(alpha x)^2, channel c = i % C.
extern "C" __global__ void snake(const float* x, const float* alpha, const float* inv,
                                 float* out, long long n, int C) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int c = (int)(i % C);
    float v = x[i];
    float s = sinf(__fmul_rn(alpha[c], v));
    out[i] = __fadd_rn(v, __fmul_rn(inv[c], __fmul_rn(s, s)));
}

// Causal depthwise conv: buf [K-1+L, C] -> out [L, C]; w [K, C].
extern "C" __global__ void dwconv(const float* buf, const float* w, const float* b, float* out,
                                  int L, int C, int K) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)L * C) return;
    int t = (int)(i / C), c = (int)(i % C);
    float acc = 0.0f;
    for (int j = 0; j < K; j++) acc = fmaf(buf[(long long)(t + j) * C + c], w[j * C + c], acc);
    out[i] = __fadd_rn(acc, b[c]);
}

// LayerNorm (biased variance) per row; one block per row.
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* out,
                                      int C, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * C;
    float* o = out + (long long)blockIdx.x * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
    float mean = block_sum(s, scratch) / (float)C;
    float v = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float d = xr[c] - mean;
        v = fmaf(d, d, v);
    }
    float var = block_sum(v, scratch) / (float)C;
    float inv = 1.0f / sqrtf(var + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        o[c] = __fadd_rn(__fmul_rn(__fmul_rn(xr[c] - mean, inv), w[c]), b[c]);
}

// RMSNorm per row; one block per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int C,
                                    float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * C;
    float* o = out + (long long)blockIdx.x * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s = fmaf(xr[c], xr[c], s);
    float ms = block_sum(s, scratch) / (float)C;
    float inv = 1.0f / sqrtf(ms + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = __fmul_rn(__fmul_rn(xr[c], inv), w[c]);
}

// Exact (erf) GELU in place.
extern "C" __global__ void gelu(float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

// ab [rows, 2F] -> out [rows, F]: silu(a) * b.
extern "C" __global__ void swiglu(const float* ab, float* out, int rows, int F) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * F) return;
    long long r = i / F;
    int j = (int)(i % F);
    float a = ab[r * 2 * F + j], b = ab[r * 2 * F + F + j];
    out[i] = __fmul_rn(a / (1.0f + expf(-a)), b);
}

// qkv [t, 3W] (W = heads*hd): rotate q in place (interleaved pairs), write rotated k and v to
// the rings at slot (pos0 + r) % ring. cs: cos [t, hd/2] then sin [t, hd/2]. Element pair i
// (row, head, pair): one thread's work in rope_kv_many.
__device__ __forceinline__ void rope_kv_at(float* qkv, const float* cs, float* kring, float* vring,
                                           int t, int heads, int hd, long long pos0, int ring,
                                           long long i) {
    int half = hd / 2, W = heads * hd;
    int p = (int)(i % half);
    int h = (int)((i / half) % heads);
    int r = (int)(i / ((long long)half * heads));
    float c = cs[(long long)r * half + p], s = cs[(long long)t * half + (long long)r * half + p];
    float* row = qkv + (long long)r * 3 * W;
    int o = h * hd + 2 * p;
    float a = row[o], b = row[o + 1];
    row[o] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    row[o + 1] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    long long slot = ((pos0 + r) % ring) * (long long)W;
    float ka = row[W + o], kb = row[W + o + 1];
    kring[slot + o] = __fsub_rn(__fmul_rn(ka, c), __fmul_rn(kb, s));
    kring[slot + o + 1] = __fadd_rn(__fmul_rn(kb, c), __fmul_rn(ka, s));
    vring[slot + o] = row[2 * W + o];
    vring[slot + o + 1] = row[2 * W + o + 1];
}

// Causal window attention of row r (absolute position pos0 + r), head h: one block, blockDim a
// multiple of 32; dynamic shared memory: window floats. Attends to the last `window` positions
// up to itself, read from the rings. The body of attention_many.
__device__ __forceinline__ void attention_at(const float* qkv, const float* kring, const float* vring,
                                             float* out, int r, int h, int heads, int hd, long long pos0,
                                             int window, int ring, float scale) {
    extern __shared__ float p[];
    __shared__ float scratch[32];
    int W = heads * hd;
    long long me = pos0 + r;
    long long lo = me + 1 - window;
    if (lo < 0) lo = 0;
    int n = (int)(me + 1 - lo);
    const float* q = qkv + (long long)r * 3 * W + h * hd;
    float mx = -CODEC_INF;
    for (int jj = threadIdx.x; jj < n; jj += blockDim.x) {
        const float* k = kring + ((lo + jj) % ring) * (long long)W + h * hd;
        float s = 0.0f;
        for (int d = 0; d < hd; d++) s = fmaf(q[d], k[d], s);
        s = __fmul_rn(s, scale);
        p[jj] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int jj = threadIdx.x; jj < n; jj += blockDim.x) {
        float e = expf(p[jj] - mx);
        p[jj] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int jj = 0; jj < n; jj++) {
            const float* v = vring + ((lo + jj) % ring) * (long long)W + h * hd;
            acc = fmaf(p[jj] / sum, v[d], acc);
        }
        out[(long long)r * W + h * hd + d] = acc;
    }
}

// Several streams in one launch (a decoder step over several streams): up to MANY entries,
// passed by value. Entry b of Segs: copy n[b] floats from src[b] to dst[b] (blockIdx.y = b).
#define MANY 64
struct Segs {
    long long dst[MANY];
    long long src[MANY];
    long long n[MANY];
    int count;
};
extern "C" __global__ void copy_many(Segs s) {
    const int b = blockIdx.y;
    if (b >= s.count) return;
    float* d = (float*)s.dst[b];
    const float* src = (const float*)s.src[b];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < s.n[b];
         i += (long long)gridDim.x * blockDim.x)
        d[i] = src[i];
}

// Entry b of Streams: stream b's rows row0[b].. row0[b] + rows[b] of the step's qkv / out, its
// RoPE table (rows[b] cos rows then rows[b] sin rows), rings (ring[b] slots) and first position.
struct Streams {
    long long k[MANY];
    long long v[MANY];
    long long cs[MANY];
    long long pos0[MANY];
    int row0[MANY];
    int rows[MANY];
    int ring[MANY];
    int count;
};
// RoPE and the ring writes over each stream's rows (blockIdx.y = stream, one thread an element pair).
extern "C" __global__ void rope_kv_many(float* qkv, Streams s, int heads, int hd) {
    const int b = blockIdx.y;
    if (b >= s.count) return;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)s.rows[b] * heads * (hd / 2)) return;
    rope_kv_at(qkv + (long long)s.row0[b] * 3 * heads * hd, (const float*)s.cs[b], (float*)s.k[b],
               (float*)s.v[b], s.rows[b], heads, hd, s.pos0[b], s.ring[b], i);
}
// Attention over each stream's rows (blockIdx.y = stream, blockIdx.x = row x heads + head).
extern "C" __global__ void attention_many(const float* qkv, float* out, Streams s, int heads,
                                          int hd, int window, float scale) {
    const int b = blockIdx.y;
    if (b >= s.count || (int)blockIdx.x >= s.rows[b] * heads) return;  // uniform in the block
    const long long W = (long long)heads * hd;
    attention_at(qkv + (long long)s.row0[b] * 3 * W, (const float*)s.k[b], (const float*)s.v[b],
                 out + (long long)s.row0[b] * W, blockIdx.x / heads, blockIdx.x % heads, heads, hd,
                 s.pos0[b], window, s.ring[b], scale);
}

// z = (e_0 W_0 + b_0) + sum_{q>=1} (e_q W_q + b_q); e [t, Q*cb] gathered codebook rows,
// W [Q, cb, dim], b [Q, dim], out [t, dim].
extern "C" __global__ void vq_sum(const float* e, const float* W, const float* b, float* out,
                                  int t, int Q, int cb, int dim) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * dim) return;
    int r = (int)(i / dim), c = (int)(i % dim);
    const float* er = e + (long long)r * Q * cb;
    float z = 0.0f, zr = 0.0f;
    for (int q = 0; q < Q; q++) {
        float a = 0.0f;
        for (int k = 0; k < cb; k++) a = fmaf(er[q * cb + k], W[((long long)q * cb + k) * dim + c], a);
        a = __fadd_rn(a, b[q * dim + c]);
        if (q == 0) z = a;
        else if (q == 1) zr = a;
        else zr = __fadd_rn(zr, a);
    }
    out[i] = Q > 1 ? __fadd_rn(z, zr) : z;
}

// Encoder VQ: nearest codebook row by cosine similarity, one block per row (blockDim a multiple
// of 32); dynamic shared memory: cb floats. en = e / max(|e|, 1e-12), dist_j = sum(en^2)
// - 2 (en . book_n[j]) + cn2[j] with every product and sum rounded in element order (no fma:
// the CPU codec's formula, so codes match it); the smallest dist_j wins, ties (and rows whose
// every dist is NaN) to the lower index. Writes the index to codes[r] (as a float) and
// st[r] = e + (book[j] - e).
extern "C" __global__ void vq_nearest(const float* ze, const float* book_n, const float* cn2,
                                      const float* book, float* codes, float* st, int n,
                                      int cb) {
    extern __shared__ float en[];
    __shared__ float en2_s;
    __shared__ float sd[32];
    __shared__ int sj[32];
    int r = blockIdx.x;
    const float* e = ze + (long long)r * cb;
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int k = 0; k < cb; k++) s = __fadd_rn(s, __fmul_rn(e[k], e[k]));
        float norm = fmaxf(__fsqrt_rn(s), 1e-12f);
        float s2 = 0.0f;
        for (int k = 0; k < cb; k++) {
            float v = __fdiv_rn(e[k], norm);
            en[k] = v;
            s2 = __fadd_rn(s2, __fmul_rn(v, v));
        }
        en2_s = s2;
    }
    __syncthreads();
    float en2 = en2_s;
    // Per thread: a strict-< scan of its codes in index order; n = none found.
    float best = CODEC_INF;
    int bj = n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float* c = book_n + (long long)j * cb;
        float dot = 0.0f;
        for (int k = 0; k < cb; k++) dot = __fadd_rn(dot, __fmul_rn(en[k], c[k]));
        float dist = __fadd_rn(__fsub_rn(en2, __fmul_rn(2.0f, dot)), cn2[j]);
        if (dist < best) {
            best = dist;
            bj = j;
        }
    }
    // (dist, index) minimum, the lower index on equal distances.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float od = __shfl_xor_sync(0xffffffffu, best, o);
        int oj = __shfl_xor_sync(0xffffffffu, bj, o);
        if (od < best || (od == best && oj < bj)) {
            best = od;
            bj = oj;
        }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sd[warp] = best;
        sj[warp] = bj;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? sd[lane] : CODEC_INF;
        bj = lane < nw ? sj[lane] : n;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float od = __shfl_xor_sync(0xffffffffu, best, o);
            int oj = __shfl_xor_sync(0xffffffffu, bj, o);
            if (od < best || (od == best && oj < bj)) {
                best = od;
                bj = oj;
            }
        }
        if (lane == 0) sj[0] = bj < n ? bj : 0;
    }
    __syncthreads();
    int j = sj[0];
    if (threadIdx.x == 0) codes[r] = (float)j;
    const float* q = book + (long long)j * cb;
    for (int k = threadIdx.x; k < cb; k += blockDim.x) {
        float v = e[k];
        st[(long long)r * cb + k] = __fadd_rn(v, __fsub_rn(q[k], v));
    }
}
