// Gated full attention: q/k (1+w) RMSNorm + partial NeoX RoPE + BF16 KV-cache append, and a
// split-key (flash-decoding) kernel with per-row causal limits used for decode (one row) and
// causal prefill (many rows), plus the combine that applies the sigmoid output gate.
// Cache layout: K, V [nkv, cap, hd] bf16. All offsets into the cache are 64-bit.

// Grid.x = T * (nh + nkv), block = hd threads. Block (t, h): h < nh is query head h of row t,
// taken from qg [T, nh, 2*hd] (per head [q ; gate]); else kv head h - nh from k/v [T, nkv, hd].
// Position of row t is pos0 + t. PLANT 1: GPT-J (interleaved) pairs. LOWP: angle in f32.
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const bf16_t* __restrict__ q_norm,
                                     const bf16_t* __restrict__ k_norm, float* __restrict__ q_out,
                                     bf16_t* __restrict__ kc, bf16_t* __restrict__ vc, int nh, int nkv,
                                     int hd, int rot, long long cap, long long pos0, float theta, float eps) {
    extern __shared__ float xs[];  // hd
    __shared__ float scratch[32];
    int heads = nh + nkv;
    long long t = blockIdx.x / heads;
    int h = blockIdx.x % heads;
    int d = threadIdx.x;
    bool is_q = h < nh;
    int kvh = h - nh;
    const float* src = is_q ? qg + (t * nh + h) * 2LL * hd : k + (t * nkv + kvh) * (long long)hd;
    float x = d < hd ? src[d] : 0.0f;
    float r = rsqrtf(block_sum(x * x, scratch) / (float)hd + eps);
    float wv = d < hd ? bf16_to_f32((is_q ? q_norm : k_norm)[d]) : 0.0f;
    float xn = x * r * (1.0f + wv);
    if (d < hd) xs[d] = xn;
    __syncthreads();
    long long pos = pos0 + t;
    float out = xn;
    if (d < rot) {
        int half = rot / 2;
#if PLANT == 1
        int i = d / 2;
        float partner = (d & 1) ? xs[d - 1] : -xs[d + 1];
#else
        int i = d < half ? d : d - half;
        float partner = d < half ? -xs[d + half] : xs[d - half];
#endif
#ifdef LOWP
        float ang = (float)pos * powf(theta, -2.0f * (float)i / (float)rot);
        float c = cosf(ang), s = sinf(ang);
#else
        double ang = (double)pos * pow((double)theta, -2.0 * (double)i / (double)rot);
        float c = (float)cos(ang), s = (float)sin(ang);
#endif
        out = fmaf(xn, c, partner * s);
    }
    if (d >= hd) return;
    if (is_q) {
        q_out[(t * nh + h) * (long long)hd + d] = out;
    } else {
        long long off = ((long long)kvh * cap + pos) * hd + d;
        kc[off] = f32_to_bf16(out);
        vc[off] = f32_to_bf16(v[(t * nkv + kvh) * (long long)hd + d]);
    }
}

// Split-key attention over the cache. Grid.x = T * nchunks, grid.y = nkv, block = 128 (4 warps).
// Row t sees keys [0, base_len + t). Block (t, c, kvh) covers keys [c*chunk, (c+1)*chunk) for the
// G = 8 query heads of kv head kvh, writing an unnormalised partial (m, l, acc[hd]) per head.
// Each warp takes 32-key tiles (one key per lane for the scores, one 8-dim slice per lane for PV).
// PLANT 1: sees one key past the causal limit. LOWP: q rounded to bf16.
#define AG 8
#define AHD 256
#define AKP 136  // staged half-row of 128 bf16 plus 8 pad, in bf16 units (272 bytes)
extern "C" __global__ void __launch_bounds__(128) attn_split(
    const float* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
    int nh, long long cap, long long base_len, int chunk, int nchunks, float scale) {
    __shared__ __align__(16) float qs[AG][AHD];
    __shared__ __align__(16) unsigned short ks[4][32 * AKP];
    __shared__ __align__(16) float ps[4][32][AG];
    __shared__ float wm[4][AG], wl[4][AG];
    int nkv = gridDim.y;
    long long t = blockIdx.x / nchunks;
    int c = blockIdx.x % nchunks;
    int kvh = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long limit = base_len + t;
#if PLANT == 1
    limit += 1;
#endif
    if (limit > cap) limit = cap;
    long long k0 = (long long)c * chunk, k1 = k0 + chunk;
    if (k1 > limit) k1 = limit;
    long long pbase = (t * nh + (long long)kvh * AG) * nchunks + c;  // head stride nchunks
    if (k0 >= k1) {
        for (int i = threadIdx.x; i < AG * AHD; i += blockDim.x) {
            int hh = i / AHD, dd = i % AHD;
            part_acc[(pbase + (long long)hh * nchunks) * AHD + dd] = 0.0f;
        }
        if (threadIdx.x < AG) {
            part_m[pbase + (long long)threadIdx.x * nchunks] = -INFINITY;
            part_l[pbase + (long long)threadIdx.x * nchunks] = 0.0f;
        }
        return;
    }
    for (int i = threadIdx.x; i < AG * AHD; i += blockDim.x) {
        int hh = i / AHD, dd = i % AHD;
        float qv = q[(t * nh + (long long)kvh * AG + hh) * AHD + dd] * scale;
#ifdef LOWP
        qv = round_bf16(q[(t * nh + (long long)kvh * AG + hh) * AHD + dd]) * scale;
#endif
        qs[hh][dd] = qv;
    }
    __syncthreads();
    const bf16_t* kbase = kc + (long long)kvh * cap * AHD;
    const bf16_t* vbase = vc + (long long)kvh * cap * AHD;
    float m[AG], l[AG], acc[AG][8];
#pragma unroll
    for (int hh = 0; hh < AG; ++hh) {
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[hh][e] = 0.0f;
    }
    unsigned short* kw = ks[warp];
    for (long long tile = k0 + 32LL * warp; tile < k1; tile += 128) {
        long long key = tile + lane;
        bool valid = key < k1;
        float s[AG];
#pragma unroll
        for (int hh = 0; hh < AG; ++hh) s[hh] = 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // stage 32 keys x 128 dims: each instruction moves two half-rows (16 lanes each)
#pragma unroll 4
            for (int rr = 0; rr < 16; ++rr) {
                int row = rr * 2 + (lane >> 4);
                long long kk = tile + row;
                uint4 val = make_uint4(0, 0, 0, 0);
                if (kk < k1) val = ld_stream(kbase + kk * AHD + half * 128 + (lane & 15) * 8);
                *(uint4*)(kw + row * AKP + (lane & 15) * 8) = val;
            }
            __syncwarp();
#pragma unroll 2
            for (int d8 = 0; d8 < 16; ++d8) {
                uint4 kv = *(const uint4*)(kw + lane * AKP + d8 * 8);
                float2 a0 = bf16x2_to_f32(kv.x), a1 = bf16x2_to_f32(kv.y);
                float2 a2 = bf16x2_to_f32(kv.z), a3 = bf16x2_to_f32(kv.w);
                int dd = half * 128 + d8 * 8;
#pragma unroll
                for (int hh = 0; hh < AG; ++hh) {
                    float4 qa = *(const float4*)(&qs[hh][dd]);
                    float4 qb = *(const float4*)(&qs[hh][dd + 4]);
                    float acc_s = s[hh];
                    acc_s = fmaf(a0.x, qa.x, acc_s); acc_s = fmaf(a0.y, qa.y, acc_s);
                    acc_s = fmaf(a1.x, qa.z, acc_s); acc_s = fmaf(a1.y, qa.w, acc_s);
                    acc_s = fmaf(a2.x, qb.x, acc_s); acc_s = fmaf(a2.y, qb.y, acc_s);
                    acc_s = fmaf(a3.x, qb.z, acc_s); acc_s = fmaf(a3.y, qb.w, acc_s);
                    s[hh] = acc_s;
                }
            }
            __syncwarp();
        }
#pragma unroll
        for (int hh = 0; hh < AG; ++hh) {
            float mt = warp_max(valid ? s[hh] : -INFINITY);
            float mn = fmaxf(m[hh], mt);
            float corr = expf(m[hh] - mn);
            float p = valid ? expf(s[hh] - mn) : 0.0f;
            l[hh] = l[hh] * corr + warp_sum(p);
            m[hh] = mn;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[hh][e] *= corr;
            ps[warp][lane][hh] = p;
        }
        __syncwarp();
        int nvalid = (int)(k1 - tile < 32 ? k1 - tile : 32);
        for (int j = 0; j < nvalid; ++j) {
            uint4 vv = ld_stream(vbase + (tile + j) * AHD + lane * 8);
            float2 b0 = bf16x2_to_f32(vv.x), b1 = bf16x2_to_f32(vv.y);
            float2 b2 = bf16x2_to_f32(vv.z), b3 = bf16x2_to_f32(vv.w);
            float4 pa = *(const float4*)(&ps[warp][j][0]);
            float4 pb = *(const float4*)(&ps[warp][j][4]);
            float pj[AG] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
            for (int hh = 0; hh < AG; ++hh) {
                acc[hh][0] = fmaf(pj[hh], b0.x, acc[hh][0]); acc[hh][1] = fmaf(pj[hh], b0.y, acc[hh][1]);
                acc[hh][2] = fmaf(pj[hh], b1.x, acc[hh][2]); acc[hh][3] = fmaf(pj[hh], b1.y, acc[hh][3]);
                acc[hh][4] = fmaf(pj[hh], b2.x, acc[hh][4]); acc[hh][5] = fmaf(pj[hh], b2.y, acc[hh][5]);
                acc[hh][6] = fmaf(pj[hh], b3.x, acc[hh][6]); acc[hh][7] = fmaf(pj[hh], b3.y, acc[hh][7]);
            }
        }
        __syncwarp();
    }
    // combine the 4 warps of the block; the staging area is reused for the accumulators
    if (lane < AG) { wm[warp][lane] = -INFINITY; wl[warp][lane] = 0.0f; }
    __syncwarp();
#pragma unroll
    for (int hh = 0; hh < AG; ++hh)
        if (lane == 0) { wm[warp][hh] = m[hh]; wl[warp][hh] = l[hh]; }
    __syncthreads();
    float* red = (float*)&ks[0][0];  // [4][AG][AHD] floats = 32 KiB, fits in ks (34 KiB)
#pragma unroll
    for (int hh = 0; hh < AG; ++hh)
#pragma unroll
        for (int e = 0; e < 8; ++e) red[(warp * AG + hh) * AHD + lane * 8 + e] = acc[hh][e];
    __syncthreads();
    for (int i = threadIdx.x; i < AG * AHD; i += blockDim.x) {
        int hh = i / AHD, dd = i % AHD;
        float M = fmaxf(fmaxf(wm[0][hh], wm[1][hh]), fmaxf(wm[2][hh], wm[3][hh]));
        float a = 0.0f, L = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float f = wm[w][hh] == -INFINITY ? 0.0f : expf(wm[w][hh] - M);
            a = fmaf(f, red[(w * AG + hh) * AHD + dd], a);
            L = fmaf(f, wl[w][hh], L);
        }
        part_acc[(pbase + (long long)hh * nchunks) * AHD + dd] = a;
        if (dd == 0) {
            part_m[pbase + (long long)hh * nchunks] = M;
            part_l[pbase + (long long)hh * nchunks] = L;
        }
    }
}

// out[t, h, :] = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, times sigmoid(gate) when a gate
// is given (qg layout [T, nh, 2*hd], gate in the second half). Grid.x = T * nh, block = hd.
extern "C" __global__ void attn_combine(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                        const float* __restrict__ part_acc, const float* __restrict__ qg,
                                        float* __restrict__ out, int nh, int hd, int nchunks) {
    long long row = blockIdx.x;  // t * nh + h
    int d = threadIdx.x;
    const float* pm = part_m + row * nchunks;
    const float* pl = part_l + row * nchunks;
    float M = -INFINITY;
    for (int c = 0; c < nchunks; ++c) M = fmaxf(M, pm[c]);
    float a = 0.0f, L = 0.0f;
    for (int c = 0; c < nchunks; ++c) {
        float f = pm[c] == -INFINITY ? 0.0f : expf(pm[c] - M);
        L = fmaf(f, pl[c], L);
        if (d < hd) a = fmaf(f, part_acc[(row * nchunks + c) * hd + d], a);
    }
    if (d >= hd) return;
    float o = a / L;
    if (qg) {
        long long t = row / nh;
        int h = (int)(row % nh);
        o *= sigmoidf(qg[(t * nh + h) * 2LL * hd + hd + d]);
    }
    out[row * hd + d] = o;
}
