// The op-level kernels of the `Backend` implementation (any geometry): buffer moves, embedding
// gather, RMSNorm with f32 weights, elementwise ops, rotary embedding (both layouts), the KV-cache
// append, a generic causal attention, a tiled flash-style causal prefill, and the Gated DeltaNet
// conv and recurrence over many rows and lanes. Activations are f32; per-lane state arrives as
// pointer tables passed by value.
// PLANT builds are deliberately wrong; LOWP builds round a stage to bf16 (or truncate), so the
// kernel contract can check that its cases tell precision apart.

#define MAX_LANES 32
struct PtrTab {
    unsigned long long p[MAX_LANES];
};
// Lane i's rows of a call: rows start[i] .. start[i] + len[i] of its buffers (prompts of several
// lengths in one launch; a uniform call has start[i] = i t, len[i] = t).
struct RowTab {
    int start[MAX_LANES];
    int len[MAX_LANES];
};
struct KvTab {
    unsigned long long k[MAX_LANES];
    unsigned long long v[MAX_LANES];
    long long len[MAX_LANES];  // rows in the cache before this call
    long long cap[MAX_LANES];  // each lane's capacity: its caches are [nkv, cap, hd]
    // A recorded frame round reads the lengths from device memory instead: lenp[lane * lstride]
    // + ladd (when lenp is not null), so a replay sees each round's counters.
    const long long* lenp;
    long long lstride;
    long long ladd;
};
__device__ __forceinline__ long long tab_len(const KvTab& t, int lane) {
    return t.lenp ? t.lenp[(long long)lane * t.lstride] + t.ladd : t.len[lane];
}
struct Tables {
    unsigned long long p[8];
};


// ---------------------------------------------------------------- buffer moves

// dst [rows, groups*len]: dst[r, g*len + c] = src[r, g*group + offset + c].
// PLANT 1: one column to the right (wrapping inside the group).
extern "C" __global__ void gather_cols(const float* __restrict__ src, float* __restrict__ dst, long long rows,
                                       int src_cols, int group, int offset, int len, int groups) {
    long long w = (long long)groups * len;
    long long total = rows * w;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / w;
        int j = (int)(i % w);
        int g = j / len, c = j % len;
#if PLANT == 1
        int col = g * group + (offset + c + 1) % group;
#else
        int col = g * group + offset + c;
#endif
        dst[i] = lowp(src[r * src_cols + col]);
    }
}

// dst[r, dst_off + c] = src[r, c] for c < src_cols. PLANT 1: reads column c+1 (wrapping).
extern "C" __global__ void place_cols(const float* __restrict__ src, float* __restrict__ dst, long long rows,
                                      int src_cols, int dst_cols, int dst_off) {
    long long total = rows * src_cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / src_cols;
        int c = (int)(i % src_cols);
#if PLANT == 1
        int sc = (c + 1) % src_cols;
#else
        int sc = c;
#endif
        dst[r * dst_cols + dst_off + c] = lowp(src[r * src_cols + sc]);
    }
}

// ---------------------------------------------------------------- embedding gather

// out[r, c] = scale[r] * sum over picks p in [start[r], start[r+1]) of table[pt[p]][prow[p], c],
// tables bf16 [*, cols], summed in pick order from 0. One block per row.
// PLANT 1: the last pick of each row is skipped. LOWP: the sum is rounded to bf16 per pick.
extern "C" __global__ void gather_sum(Tables tabs, const int* __restrict__ start, const int* __restrict__ pt,
                                      const unsigned int* __restrict__ prow, const float* __restrict__ scale,
                                      float* __restrict__ out, int cols) {
    long long r = blockIdx.x;
    int p0 = start[r], p1 = start[r + 1];
#if PLANT == 1
    if (p1 > p0) p1 -= 1;
#endif
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float acc = 0.0f;
        for (int p = p0; p < p1; ++p) {
            const bf16_t* t = (const bf16_t*)tabs.p[pt[p]];
            acc = lowp(acc + bf16_to_f32(t[(long long)prow[p] * cols + c]));
        }
        out[r * cols + c] = acc * scale[r];
    }
}

// ---------------------------------------------------------------- RMSNorm, f32 weights

// A thread's values of one group are held in registers: value j of the thread is element
// i = threadIdx.x + j * blockDim.x (the strided loop's order), for j < NORM_REG, so a group may
// hold up to NORM_REG * blockDim.x values (the host's norm_block sizes the block for that). Every
// load of a thread is issued before the first is used, and the output pass reads nothing back
// from memory: session 10's ncu had these kernels at 9-11 us a call for 2048 values, each
// strided loop iteration waiting on its own global load. The arithmetic and its order are the
// strided loop's, so the bits are unchanged.
#define NORM_REG 16
template <class F>
__device__ __forceinline__ void norm_each(int group, F f) {
#pragma unroll
    for (int j = 0; j < NORM_REG; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < group) f(j, i);
    }
}

// 1 / sqrt(mean(v^2) + eps) over a group held as above, for the whole block: each thread's fmaf
// sum in its values' order, then block_sum (so the bits depend on the block size). Every norm
// kernel below uses it, which keeps their bits equal to rmsnorm_groups'.
__device__ __forceinline__ float rms_inv_regs(const float (&v)[NORM_REG], int group, float eps, float* scratch) {
    float ss = 0.0f;
    norm_each(group, [&](int j, int) { ss = fmaf(v[j], v[j], ss); });
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)group + eps);
}

// The norm's weights held as the values: 1 + w or w.
__device__ __forceinline__ void norm_weights(float (&wv)[NORM_REG], const float* __restrict__ w, int group,
                                             int plus_one) {
    norm_each(group, [&](int j, int i) { wv[j] = plus_one ? 1.0f + w[i] : w[i]; });
}

// Over each consecutive group of `group` values: x / sqrt(mean(x^2) + eps) * (plus_one ? 1 + w : w).
// One block per group. PLANT 1: ignores plus_one. LOWP: output rounded to bf16.
extern "C" __global__ void rmsnorm_groups(const float* __restrict__ x, const float* __restrict__ w,
                                          float* __restrict__ out, int group, float eps, int plus_one) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * group;
    float* orow = out + (long long)blockIdx.x * group;
#if PLANT == 1
    plus_one = 0;
#endif
    float v[NORM_REG], wv[NORM_REG];
    norm_each(group, [&](int j, int i) { v[j] = xr[i]; });
    norm_weights(wv, w, group, plus_one);
    const float inv = rms_inv_regs(v, group, eps, scratch);
    norm_each(group, [&](int j, int i) { orow[i] = lowp(v[j] * inv * wv[j]); });
}

// The residual add fused with the norm after it: sum = a + b (as elementwise op 0) and out =
// rmsnorm_groups(sum), the same arithmetic in the same order as the two launches (bit for bit
// at the same block size). One block per group. PLANT 1: ignores plus_one. LOWP: the sum and
// the output rounded to bf16, as the two separate LOWP kernels do.
extern "C" __global__ void add_rmsnorm_groups(const float* __restrict__ a, const float* __restrict__ b,
                                              const float* __restrict__ w, float* __restrict__ sum,
                                              float* __restrict__ out, int group, float eps, int plus_one) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * group;
#if PLANT == 1
    plus_one = 0;
#endif
    float v[NORM_REG], wv[NORM_REG];
    norm_each(group, [&](int j, int i) { v[j] = lowp(a[off + i] + b[off + i]); });
    norm_weights(wv, w, group, plus_one);
    norm_each(group, [&](int j, int i) { sum[off + i] = v[j]; });
    const float inv = rms_inv_regs(v, group, eps, scratch);
    norm_each(group, [&](int j, int i) { out[off + i] = lowp(v[j] * inv * wv[j]); });
}

// The MoE's end fused with the residual add and the next norm: t = a2 + x * sigmoid(g) (as
// add_sigmoid_mul), sum = a + t and out = rmsnorm_groups(sum) (as add_rmsnorm_groups): the same
// arithmetic in the same order as the two launches, so bit for bit at the same block size. g is
// [rows, gcols] with gcols == cols or 1. One block per group. PLANT 1: sigmoid(-g). LOWP: each
// stage rounded to bf16, as the LOWP launches do.
extern "C" __global__ void add_gated_rmsnorm_groups(const float* __restrict__ a, const float* __restrict__ a2,
                                                    const float* __restrict__ x, const float* __restrict__ g,
                                                    const float* __restrict__ w, float* __restrict__ sum,
                                                    float* __restrict__ out, int group, int cols, int gcols,
                                                    float eps, int plus_one) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * group;
    float v[NORM_REG], wv[NORM_REG];
    norm_each(group, [&](int jj, int i) {
        const long long j = off + i;
        float gv = gcols == cols ? g[j] : g[(j / cols) * gcols];
#if PLANT == 1
        gv = -gv;
#endif
        const float t = lowp(__fmul_rn(x[j], sigmoidf(gv)));
        const float y = lowp(__fadd_rn(a2[j], t));
        v[jj] = lowp(a[j] + y);
    });
    norm_weights(wv, w, group, plus_one);
    norm_each(group, [&](int j, int i) { sum[off + i] = v[j]; });
    const float inv = rms_inv_regs(v, group, eps, scratch);
    norm_each(group, [&](int j, int i) { out[off + i] = lowp(v[j] * inv * wv[j]); });
}

// The tower's input: [rmsnorm(a) | rmsnorm(b)] row by row (a and b [rows, ca] and [rows, cb],
// each normalised over its whole row with its own weights), bit for bit rmsnorm_groups of each
// (the same block size) then concat_cols. Grid (rows, 2): block y = 0 takes a, 1 takes b.
// PLANT 1: ignores plus_one. LOWP: output rounded to bf16.
extern "C" __global__ void rmsnorm_concat(const float* __restrict__ a, const float* __restrict__ wa,
                                          const float* __restrict__ b, const float* __restrict__ wb,
                                          float* __restrict__ out, int ca, int cb, float eps, int plus_one) {
    __shared__ float scratch[32];
    const bool second = blockIdx.y == 1;
    const int group = second ? cb : ca;
    const float* xr = (second ? b : a) + (long long)blockIdx.x * group;
    float* orow = out + (long long)blockIdx.x * (ca + cb) + (second ? ca : 0);
#if PLANT == 1
    plus_one = 0;
#endif
    float v[NORM_REG], wv[NORM_REG];
    norm_each(group, [&](int j, int i) { v[j] = xr[i]; });
    norm_weights(wv, second ? wb : wa, group, plus_one);
    const float inv = rms_inv_regs(v, group, eps, scratch);
    norm_each(group, [&](int j, int i) { orow[i] = lowp(v[j] * inv * wv[j]); });
}

// The gated RMSNorm of the GDN output: out = silu(z) * rmsnorm_groups(x) (elementwise op 1 after
// the norm), bit for bit the two launches at the same block size. One block per group.
// PLANT 1: silu of the norm instead of z. LOWP: the norm and the product rounded to bf16.
extern "C" __global__ void rmsnorm_silu_groups(const float* __restrict__ x, const float* __restrict__ z,
                                               const float* __restrict__ w, float* __restrict__ out, int group,
                                               float eps, int plus_one) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * group;
    float v[NORM_REG], wv[NORM_REG], zv[NORM_REG];
    norm_each(group, [&](int j, int i) {
        v[j] = x[off + i];
        zv[j] = z[off + i];
    });
    norm_weights(wv, w, group, plus_one);
    const float inv = rms_inv_regs(v, group, eps, scratch);
    norm_each(group, [&](int j, int i) {
        const float n = lowp(v[j] * inv * wv[j]);
#if PLANT == 1
        out[off + i] = lowp(zv[j] * silu(n));
#else
        out[off + i] = lowp(silu(zv[j]) * n);
#endif
    });
}

// ---------------------------------------------------------------- elementwise

// op 0: a + b; op 1: silu(a) * b; op 2: a * sigmoid(b), b [rows, bcols] with bcols == cols or 1.
// PLANT 1: add subtracts, silu_mul takes silu of b, sigmoid_mul uses sigmoid(-b).
extern "C" __global__ void elementwise(const float* __restrict__ a, const float* __restrict__ b,
                                       float* __restrict__ out, long long n, int cols, int bcols, int op) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float av = a[i];
        float bv = bcols == cols ? b[i] : b[(i / cols) * bcols];
        float o;
#if PLANT == 1
        if (op == 0) o = av - bv;
        else if (op == 1) o = av * silu(bv);
        else o = av * sigmoidf(-bv);
#else
        if (op == 0) o = av + bv;
        else if (op == 1) o = silu(av) * bv;
        else o = av * sigmoidf(bv);
#endif
        out[i] = lowp(o);
    }
}

// out = a + x * sigmoid(g), g [rows, gcols] with gcols == cols or 1: elementwise op 2 then op 0
// in one launch, bit for bit (round-to-nearest intrinsics keep the compiler from contracting
// the product and the sum into one fma, which the two launches cannot do).
// PLANT 1: sigmoid(-g). LOWP: the product and the sum rounded to bf16, as the two LOWP launches.
extern "C" __global__ void add_sigmoid_mul(const float* __restrict__ a, const float* __restrict__ x,
                                           const float* __restrict__ g, float* __restrict__ out, long long n,
                                           int cols, int gcols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float gv = gcols == cols ? g[i] : g[(i / cols) * gcols];
#if PLANT == 1
        gv = -gv;
#endif
        float t = lowp(__fmul_rn(x[i], sigmoidf(gv)));
        out[i] = lowp(__fadd_rn(a[i], t));
    }
}

// ---------------------------------------------------------------- rotary embedding

#define ROPE_MAX_HALF 256

// The row's rot/2 angles pos * theta^(-2i/rot) (f64; LOWP: f32) as cos and sin in shared memory,
// one pass by the block. The caller synchronises before reading them.
__device__ __forceinline__ void rope_table(long long p, int rot, double theta, float* cs_s, float* sn_s) {
    const int half = rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
#ifdef LOWP
        float ang = (float)p * powf((float)theta, -2.0f * (float)i / (float)rot);
        cs_s[i] = cosf(ang);
        sn_s[i] = sinf(ang);
#else
        double ang = (double)p * pow(theta, -(double)(2 * i) / (double)rot);
        cs_s[i] = (float)cos(ang);
        sn_s[i] = (float)sin(ang);
#endif
    }
}

// One head of hd values: out[d] = xr[d] rotated by the table (dims past rot copied). NeoX pairs
// (i, i + rot/2), interleaved pairs (2i, 2i+1); products rounded separately (no fma).
__device__ __forceinline__ void rope_head(const float* xr, float* orow, int hd, int rot, int interleaved,
                                          const float* cs_s, const float* sn_s) {
    const int half = rot / 2;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        if (d >= rot) {
            orow[d] = xr[d];
            continue;
        }
        int i, a, b;
        bool first;
        if (interleaved) {
            i = d / 2;
            a = 2 * i;
            b = a + 1;
            first = (d & 1) == 0;
        } else {
            i = d < half ? d : d - half;
            a = i;
            b = i + half;
            first = d < half;
        }
        const float cs = cs_s[i], sn = sn_s[i];
        float x0 = xr[a], x1 = xr[b];
        orow[d] = first ? __fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn))
                        : __fadd_rn(__fmul_rn(x1, cs), __fmul_rn(x0, sn));
    }
}

// Rotary embedding of the first `rot` dims of each `hd` head of row r at position
// pos[r * pstride]; angle pos * theta^(-2i/rot) in f64. NeoX pairs (i, i + rot/2); interleaved
// pairs (2i, 2i+1). Products are rounded separately (no fused multiply-add) as the CPU reference
// does. Grid (rows, heads): each block computes the row's rot/2 angles into shared memory (rot
// <= 512; once per block, where each element used to compute its own) and rotates one head. PLANT 1: the other pairing. LOWP: angle and cos/sin in f32.
extern "C" __global__ void rope(const float* __restrict__ x, float* __restrict__ out,
                                const long long* __restrict__ pos, long long pstride, int cols, int hd, int rot,
                                double theta, int interleaved) {
    __shared__ float cs_s[ROPE_MAX_HALF], sn_s[ROPE_MAX_HALF];
    const long long r = blockIdx.x;
    const int base = blockIdx.y * hd;
#if PLANT == 1
    interleaved = !interleaved;
#endif
    rope_table(pos[r * pstride], rot, theta, cs_s, sn_s);
    __syncthreads();
    rope_head(x + r * cols + base, out + r * cols + base, hd, rot, interleaved, cs_s, sn_s);
}

// The q/k norm and rotary embedding of attention in one launch: head h of row r is read in place
// from x (the heads of [rows, groups * len] as gather_cols selects them: column c at
// (c / len) * group + offset + c % len, len a multiple of hd), normalised as rmsnorm_groups does
// over hd values (the same block size, so the same bits) and rotated as rope does (rope_table,
// rope_head). Output [rows, groups * len]. Grid (rows, heads), hd <= 512.
// PLANT 1: the other pairing. LOWP: the norm rounded to bf16, angles and cos/sin in f32.
extern "C" __global__ void rmsnorm_rope(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, const long long* __restrict__ pos,
                                        long long pstride, int src_cols, int group, int offset, int len, int hd,
                                        int rot, double theta, int interleaved, float eps, int plus_one) {
    __shared__ float scratch[32];
    __shared__ float nv[2 * ROPE_MAX_HALF];
    __shared__ float cs_s[ROPE_MAX_HALF], sn_s[ROPE_MAX_HALF];
    const long long r = blockIdx.x;
    const int d0 = blockIdx.y * hd;
    const float* xr = x + r * src_cols + (long long)(d0 / len) * group + offset + d0 % len;
    float* orow = out + r * ((long long)(src_cols / group) * len) + d0;
    float v[NORM_REG], wv[NORM_REG];
    norm_each(hd, [&](int j, int i) { v[j] = xr[i]; });
    norm_weights(wv, w, hd, plus_one);
    const float inv = rms_inv_regs(v, hd, eps, scratch);
    norm_each(hd, [&](int j, int i) { nv[i] = lowp(v[j] * inv * wv[j]); });
#if PLANT == 1
    interleaved = !interleaved;
#endif
    rope_table(pos[r * pstride], rot, theta, cs_s, sn_s);
    __syncthreads();
    rope_head(nv, orow, hd, rot, interleaved, cs_s, sn_s);
}

// ---------------------------------------------------------------- KV cache

// Appends t rows per lane: cache[kvh, len + r, d] = k/v[(lane * t + r), kvh * hd + d].
// Cache [nkv, cap, hd] in bf16 (round to nearest even) or f32. Grid (t * nkv, lanes).
// PLANT 1: v rows go to the K cache too. LOWP (bf16): truncates instead of rounding;
// (f32): rounds to bf16. The `_rows` forms append a joined call's lanes: lane L's len[L] rows
// from row start[L] (`RowTab`; grid (max t * nkv, lanes)).
__device__ __forceinline__ void kv_append_bf16_body(const KvTab& tab, const float* __restrict__ k,
                                                    const float* __restrict__ v, long long row0, int t, int nkv,
                                                    int hd) {
    int lane = blockIdx.y;
    long long cap = tab.cap[lane];
    int r = blockIdx.x / nkv, kvh = blockIdx.x % nkv;
    if (r >= t) return;  // a joined call's shorter lane
    long long row = row0 + r;
    bf16_t* kc = (bf16_t*)tab.k[lane];
    bf16_t* vc = (bf16_t*)tab.v[lane];
    long long dst = ((long long)kvh * cap + tab_len(tab, lane) + r) * hd;
    const float* ks = k + row * nkv * hd + (long long)kvh * hd;
    const float* vs = v + row * nkv * hd + (long long)kvh * hd;
#if PLANT == 1
    ks = vs;
#endif
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
#ifdef LOWP
        kc[dst + d] = (bf16_t)(__float_as_uint(ks[d]) >> 16);
        vc[dst + d] = (bf16_t)(__float_as_uint(vs[d]) >> 16);
#else
        kc[dst + d] = f32_to_bf16(ks[d]);
        vc[dst + d] = f32_to_bf16(vs[d]);
#endif
    }
}

__device__ __forceinline__ void kv_append_f32_body(const KvTab& tab, const float* __restrict__ k,
                                                   const float* __restrict__ v, long long row0, int t, int nkv,
                                                   int hd) {
    int lane = blockIdx.y;
    long long cap = tab.cap[lane];
    int r = blockIdx.x / nkv, kvh = blockIdx.x % nkv;
    if (r >= t) return;  // a joined call's shorter lane
    long long row = row0 + r;
    float* kc = (float*)tab.k[lane];
    float* vc = (float*)tab.v[lane];
    long long dst = ((long long)kvh * cap + tab_len(tab, lane) + r) * hd;
    const float* ks = k + row * nkv * hd + (long long)kvh * hd;
    const float* vs = v + row * nkv * hd + (long long)kvh * hd;
#if PLANT == 1
    ks = vs;
#endif
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        kc[dst + d] = lowp(ks[d]);
        vc[dst + d] = lowp(vs[d]);
    }
}

extern "C" __global__ void kv_append_bf16(KvTab tab, const float* __restrict__ k, const float* __restrict__ v,
                                          int t, int nkv, int hd, long long cap) {
    kv_append_bf16_body(tab, k, v, (long long)blockIdx.y * t, t, nkv, hd);
}

extern "C" __global__ void kv_append_f32(KvTab tab, const float* __restrict__ k, const float* __restrict__ v,
                                         int t, int nkv, int hd, long long cap) {
    kv_append_f32_body(tab, k, v, (long long)blockIdx.y * t, t, nkv, hd);
}

extern "C" __global__ void kv_append_rows_bf16(KvTab tab, RowTab rt, const float* __restrict__ k,
                                               const float* __restrict__ v, int nkv, int hd) {
    kv_append_bf16_body(tab, k, v, rt.start[blockIdx.y], rt.len[blockIdx.y], nkv, hd);
}

extern "C" __global__ void kv_append_rows_f32(KvTab tab, RowTab rt, const float* __restrict__ k,
                                              const float* __restrict__ v, int nkv, int hd) {
    kv_append_f32_body(tab, k, v, rt.start[blockIdx.y], rt.len[blockIdx.y], nkv, hd);
}

// ---------------------------------------------------------------- generic causal attention

__device__ __forceinline__ float kv_load(const bf16_t* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float kv_load(const float* p, long long i) { return p[i]; }

// Query row r of lane L (q [lanes * t, nh * hd]) sees cache rows [0, len_L + r + 1), len_L from
// the table (rows before this call's append). Head h uses kv head h / (nh / nkv); scale
// 1/sqrt(hd); online softmax in f32 over tiles of 128 keys (4 warps score 32 keys each, one warp
// per key, lanes over dims), then each thread accumulates its output dims. Grid (t * nh, lanes),
// block 128, dynamic shared memory hd floats. PLANT 1: sees one key past the causal limit.
// LOWP: q rounded to bf16.
template <typename T>
__device__ void attn_generic_body(const KvTab& tab, const float* __restrict__ q, float* __restrict__ out,
                                  int t, int nh, int nkv, int hd, long long cap, float scale) {
    extern __shared__ float qs[];  // hd
    __shared__ float sc[128];
    __shared__ float red[32];
    int lane_id = blockIdx.y;
    cap = tab.cap[lane_id];
    int r = blockIdx.x / nh, h = blockIdx.x % nh;
    int kvh = h / (nh / nkv);
    long long row = (long long)lane_id * t + r;
    long long limit = tab_len(tab, lane_id) + r + 1;
#if PLANT == 1
    limit += 1;
#endif
    if (limit > cap) limit = cap;
    const float* qr = q + (row * nh + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = lowp(qr[d]);
    __syncthreads();
    const T* kb = (const T*)tab.k[lane_id] + (long long)kvh * cap * hd;
    const T* vb = (const T*)tab.v[lane_id] + (long long)kvh * cap * hd;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m = -INFINITY, l = 0.0f;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // dims threadIdx.x + 128 * i, hd <= 512
    for (long long k0 = 0; k0 < limit; k0 += 128) {
        for (int i = 0; i < 32; ++i) {
            long long key = k0 + warp * 32 + i;
            float s = -INFINITY;
            if (key < limit) {
                float part = 0.0f;
                for (int d = lane; d < hd; d += 32) part = fmaf(qs[d], kv_load(kb, key * hd + d), part);
                s = warp_sum(part) * scale;
            }
            if (lane == 0) sc[warp * 32 + i] = s;
        }
        __syncthreads();
        float tmax = -INFINITY;
        for (int j = threadIdx.x; j < 128; j += blockDim.x) tmax = fmaxf(tmax, sc[j]);
        tmax = warp_max(tmax);
        if (lane == 0) red[warp] = tmax;
        __syncthreads();
        tmax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
        float mn = fmaxf(m, tmax);
        float corr = m == -INFINITY ? 0.0f : expf(m - mn);
        int nk = (int)(limit - k0 < 128 ? limit - k0 : 128);
        for (int j = threadIdx.x; j < 128; j += blockDim.x) sc[j] = j < nk ? expf(sc[j] - mn) : 0.0f;
        __syncthreads();
        float psum = 0.0f;
        for (int j = 0; j < nk; ++j) psum += sc[j];
        l = l * corr + psum;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int d = threadIdx.x + 128 * i;
            if (d < hd) {
                float a = acc[i] * corr;
                for (int j = 0; j < nk; ++j) a = fmaf(sc[j], kv_load(vb, (k0 + j) * hd + d), a);
                acc[i] = a;
            }
        }
        m = mn;
        __syncthreads();
    }
    float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int d = threadIdx.x + 128 * i;
        if (d < hd) out[(row * nh + h) * hd + d] = acc[i] * inv;
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_generic_bf16(KvTab tab, const float* __restrict__ q,
                                                                     float* __restrict__ out, int t, int nh,
                                                                     int nkv, int hd, long long cap,
                                                                     float scale) {
    attn_generic_body<bf16_t>(tab, q, out, t, nh, nkv, hd, cap, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_generic_f32(KvTab tab, const float* __restrict__ q,
                                                                    float* __restrict__ out, int t, int nh,
                                                                    int nkv, int hd, long long cap,
                                                                    float scale) {
    attn_generic_body<float>(tab, q, out, t, nh, nkv, hd, cap, scale);
}

// ---------------------------------------------------------------- flash-style causal prefill

// Four consecutive cache values as f32 (i a multiple of 4; the caller checks hd % 32 == 0).
__device__ __forceinline__ float4 kv_load4(const float* p, long long i) { return *(const float4*)(p + i); }
__device__ __forceinline__ float4 kv_load4(const bf16_t* p, long long i) {
    uint2 u = *(const uint2*)(p + i);
    float2 a = bf16x2_to_f32(u.x), b = bf16x2_to_f32(u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

#define FQ 32  // query rows per block
#define FK 32  // keys per tile
// Tiled causal attention over many query rows of one lane (the prefill): each block takes FQ = 32
// consecutive rows of one query head and walks the lane's cache in FK = 32-key tiles staged in
// shared memory, so each K/V tile is read once per 32 rows instead of once per row. Online
// softmax in f32 per row, as attn_generic_body. Row r (of t, lane blockIdx.z) sees keys
// [0, len + r + 1). Thread (ty, tx) = (tid / 8, tid % 8) scores rows ty and ty + 16 against keys
// tx + 8j (j < 4), and accumulates dims tx*4 + 32jj (jj < hd/32) of the same two rows.
// Grid (ceil(t / FQ), nh, lanes), block 128, dynamic shared memory
// ((FQ + 2 FK)(hd + 4) + FQ (FK + 1)) floats; hd a multiple of 32, at most 256. Blocks are
// issued longest (latest rows) first. PLANT 1: sees one key past the causal limit. LOWP: q
// rounded to bf16.
template <typename T>
__device__ void attn_flash_body(const KvTab& tab, const float* __restrict__ q, float* __restrict__ out,
                                long long row0, int t, int nh, int nkv, int hd, long long cap, float scale) {
    extern __shared__ __align__(16) float fsm[];
    const int ld = hd + 4, lp = FK + 1;
    float* Qs = fsm;
    float* Ks = Qs + FQ * ld;
    float* Vs = Ks + FK * ld;
    float* Ps = Vs + FK * ld;
    int lane_id = blockIdx.z, h = blockIdx.y;
    cap = tab.cap[lane_id];
    int kvh = h / (nh / nkv);
    long long q0 = (long long)(gridDim.x - 1 - blockIdx.x) * FQ;
    if (q0 >= t) return;  // past a joined call's shorter lane (the whole block)
    int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    long long base = tab_len(tab, lane_id);
    const T* kb = (const T*)tab.k[lane_id] + (long long)kvh * cap * hd;
    const T* vb = (const T*)tab.v[lane_id] + (long long)kvh * cap * hd;
    for (int i = tid; i < FQ * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd;
        long long row = q0 + r;
        Qs[r * ld + d] = row < t ? lowp(q[((row0 + row) * nh + h) * hd + d]) : 0.0f;
    }
    long long rows_here = t - q0 < FQ ? t - q0 : FQ;
    long long kend = base + q0 + rows_here;  // exclusive key limit of the block's last row
#if PLANT == 1
    kend += 1;
#endif
    if (kend > cap) kend = cap;
    int nj = hd >> 5;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][jj][e] = 0.0f;
    for (long long k0 = 0; k0 < kend; k0 += FK) {
        __syncthreads();  // the previous tile's readers are done (and Q is visible)
        for (int i = tid * 4; i < FK * hd; i += blockDim.x * 4) {
            int kk = i / hd, d = i % hd;
            long long key = k0 + kk;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
            if (key < kend) {
                a = kv_load4(kb, key * hd + d);
                b = kv_load4(vb, key * hd + d);
            }
            *(float4*)&Ks[kk * ld + d] = a;
            *(float4*)&Vs[kk * ld + d] = b;
        }
        __syncthreads();
        float s[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
        for (int d = 0; d < hd; d += 4) {
            float4 qa = *(const float4*)&Qs[ty * ld + d];
            float4 qb = *(const float4*)&Qs[(ty + 16) * ld + d];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4 kv = *(const float4*)&Ks[(tx + 8 * j) * ld + d];
                s[0][j] = fmaf(qa.x, kv.x, s[0][j]); s[0][j] = fmaf(qa.y, kv.y, s[0][j]);
                s[0][j] = fmaf(qa.z, kv.z, s[0][j]); s[0][j] = fmaf(qa.w, kv.w, s[0][j]);
                s[1][j] = fmaf(qb.x, kv.x, s[1][j]); s[1][j] = fmaf(qb.y, kv.y, s[1][j]);
                s[1][j] = fmaf(qb.z, kv.z, s[1][j]); s[1][j] = fmaf(qb.w, kv.w, s[1][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int r = ty + 16 * i;
            long long lim = base + q0 + r + 1;
#if PLANT == 1
            lim += 1;
#endif
            if (lim > cap) lim = cap;
            float mt = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                long long key = k0 + tx + 8 * j;
                s[i][j] = key < lim ? s[i][j] * scale : -INFINITY;
                mt = fmaxf(mt, s[i][j]);
            }
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
            float mn = fmaxf(m[i], mt);
            float corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - mn);
            float psum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float p = s[i][j] == -INFINITY ? 0.0f : expf(s[i][j] - mn);
                Ps[r * lp + tx + 8 * j] = p;
                psum += p;
            }
            psum += __shfl_xor_sync(0xffffffffu, psum, 1);
            psum += __shfl_xor_sync(0xffffffffu, psum, 2);
            psum += __shfl_xor_sync(0xffffffffu, psum, 4);
            l[i] = l[i] * corr + psum;
            m[i] = mn;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][jj][e] *= corr;
        }
        __syncthreads();
        int nk = (int)(kend - k0 < FK ? kend - k0 : FK);
        for (int kk = 0; kk < nk; ++kk) {
            float p0 = Ps[ty * lp + kk], p1 = Ps[(ty + 16) * lp + kk];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                if (jj < nj) {
                    float4 v = *(const float4*)&Vs[kk * ld + tx * 4 + 32 * jj];
                    acc[0][jj][0] = fmaf(p0, v.x, acc[0][jj][0]); acc[0][jj][1] = fmaf(p0, v.y, acc[0][jj][1]);
                    acc[0][jj][2] = fmaf(p0, v.z, acc[0][jj][2]); acc[0][jj][3] = fmaf(p0, v.w, acc[0][jj][3]);
                    acc[1][jj][0] = fmaf(p1, v.x, acc[1][jj][0]); acc[1][jj][1] = fmaf(p1, v.y, acc[1][jj][1]);
                    acc[1][jj][2] = fmaf(p1, v.z, acc[1][jj][2]); acc[1][jj][3] = fmaf(p1, v.w, acc[1][jj][3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        long long row = q0 + ty + 16 * i;
        if (row >= t) continue;
        float inv = 1.0f / l[i];
        float* o = out + ((row0 + row) * nh + h) * hd;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            if (jj < nj) {
                float4 r4 = make_float4(acc[i][jj][0] * inv, acc[i][jj][1] * inv, acc[i][jj][2] * inv,
                                        acc[i][jj][3] * inv);
                *(float4*)&o[tx * 4 + 32 * jj] = r4;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_flash_bf16(KvTab tab, const float* __restrict__ q,
                                                                   float* __restrict__ out, int t, int nh,
                                                                   int nkv, int hd, long long cap,
                                                                   float scale) {
    attn_flash_body<bf16_t>(tab, q, out, (long long)blockIdx.z * t, t, nh, nkv, hd, cap, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_flash_f32(KvTab tab, const float* __restrict__ q,
                                                                  float* __restrict__ out, int t, int nh,
                                                                  int nkv, int hd, long long cap,
                                                                  float scale) {
    attn_flash_body<float>(tab, q, out, (long long)blockIdx.z * t, t, nh, nkv, hd, cap, scale);
}

// A joined prefill call's lanes in one launch: lane L (blockIdx.z) its len[L] rows from row
// start[L] (`RowTab`); grid (ceil(max t / FQ), nh, lanes), the blocks past a lane's rows exit. A lane's
// blocks are those of its own launch (the same FQ tiles from its row 0, the same key limits),
// so its bits too.
extern "C" __global__ void __launch_bounds__(128) attn_flash_rows_bf16(KvTab tab, RowTab rt,
                                                                        const float* __restrict__ q,
                                                                        float* __restrict__ out, int nh,
                                                                        int nkv, int hd, long long cap,
                                                                        float scale) {
    attn_flash_body<bf16_t>(tab, q, out, rt.start[blockIdx.z], rt.len[blockIdx.z], nh, nkv, hd, cap, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_flash_rows_f32(KvTab tab, RowTab rt,
                                                                       const float* __restrict__ q,
                                                                       float* __restrict__ out, int nh,
                                                                       int nkv, int hd, long long cap,
                                                                       float scale) {
    attn_flash_body<float>(tab, q, out, rt.start[blockIdx.z], rt.len[blockIdx.z], nh, nkv, hd, cap, scale);
}

// ---------------------------------------------------------------- split-key decode

#define DG 8     // query heads per kv head, at most
#define DHD 256  // head dim, at most (a multiple of 32)
#define DS 64    // dims staged per pass
#define DLD 68   // staged row stride in floats (DS + 4: conflict-free float4 reads by row)
#define DMAXC 256
#define DV_B 4   // V rows one warp loads at once in the decode kernel

// Keys per block for a lane that sees `keys` keys: 128 (four warps of 32) doubled until at most
// DMAXC chunks cover the keys. It depends on the lane's own length only, so a lane's chunks, and
// its bits, are the same in any batch. The host's kernels::decode_chunk is the same function.
__device__ __forceinline__ long long decode_chunk(long long keys) {
    long long ch = 128;
    while (ch * DMAXC < keys) ch *= 2;
    return ch;
}

// Decode attention, one query row per lane, split over keys (flash-decoding). Lane L sees keys
// [0, tab.len[L]) of its cache (the new row already appended). Grid (nchunks, nkv, lanes), block
// 128: block (c, kvh, L) scores chunk c of the lane's keys against the G = nh / nkv query heads of
// kv head kvh, each warp taking 32-key tiles (one key per lane for the scores, K staged through
// shared memory 64 dims at a time; dims lane + 32e for P.V), online softmax in f32 as
// attn_generic_body. It writes an unnormalised partial (m, l, acc[hd]) per head; the last block of
// (kvh, L) to finish (counted in `count`, which it resets to 0) combines the lane's chunks in chunk
// order, so the result does not depend on which block ends last. part_* hold [lanes * nh][nchunks]
// (times hd for acc). The grid covers a round's capacity (a graph replays it while the lanes
// grow), so a block past the lane's keys returns at once: only the chunks holding keys count
// and combine (an empty chunk added exactly nothing but cost its block and a combine step:
// 32 chunks at a 4096-row capacity, 256 at 262144, for a prompt of a few hundred keys).
// PLANT 1: sees one key past the lane's limit. LOWP: q rounded to bf16.
template <typename T>
__device__ void attn_decode_body(const KvTab& tab, const float* __restrict__ q, float* __restrict__ out,
                                 float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc,
                                 int* __restrict__ count, int nh, int nkv, int hd, long long cap, float scale,
                                 int hpb) {
    __shared__ __align__(16) float qs[DG * DHD];
    __shared__ __align__(16) float ks[4][32 * DLD];
    __shared__ float ps[4][32][DG];
    __shared__ float wm[4][DG], wl[4][DG];
    __shared__ int last;
    const int nchunks = gridDim.x, c = blockIdx.x, lane_id = blockIdx.z;
    cap = tab.cap[lane_id];
    // block y takes heads h0 .. h0 + hpb of kv head kvh (hpb divides the group): a head's bits
    // do not depend on how many heads share its block
    const int G = hpb, per_kv = (nh / nkv) / hpb;
    const int kvh = blockIdx.y / per_kv, h0 = (blockIdx.y % per_kv) * hpb;
    const int ne = hd >> 5;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long keys = tab_len(tab, lane_id);
    long long limit = keys;
#if PLANT == 1
    limit += 1;
#endif
    if (limit > cap) limit = cap;
    const long long chunk = decode_chunk(keys);
    const long long k0 = (long long)c * chunk;
    const long long k1 = k0 + chunk < limit ? k0 + chunk : limit;
    // chunks holding keys (at least one: a decode row sees itself)
    const long long used_ll = (limit + chunk - 1) / chunk;
    const int used = (int)(used_ll < nchunks ? used_ll : nchunks);
    if (c >= used) return;  // uniform across the block, before any barrier
    const long long row0 = (long long)lane_id * nh + (long long)kvh * (nh / nkv) + h0;  // head hh: row0 + hh
    float m[DG], l[DG], acc[DG][DHD / 32];
#pragma unroll
    for (int hh = 0; hh < DG; ++hh) {
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < DHD / 32; ++e) acc[hh][e] = 0.0f;
    }
    if (k0 < k1) {
        for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = lowp(q[row0 * hd + i]);
        __syncthreads();
        const T* kb = (const T*)tab.k[lane_id] + (long long)kvh * cap * hd;
        const T* vb = (const T*)tab.v[lane_id] + (long long)kvh * cap * hd;
        float* kw = ks[warp];
        for (long long tile = k0 + 32LL * warp; tile < k1; tile += 128) {
            const bool valid = tile + lane < k1;
            float s[DG];
#pragma unroll
            for (int hh = 0; hh < DG; ++hh) s[hh] = 0.0f;
            for (int d0 = 0; d0 < hd; d0 += DS) {
                // 32 keys x 64 dims: 16 lanes per key row, two rows per step; all 16 loads are
                // issued before any is stored (one memory round trip per 64 dims, not four)
                float4 val[16];
#pragma unroll
                for (int rr = 0; rr < 16; ++rr) {
                    int row = rr * 2 + (lane >> 4);
                    int dd = d0 + (lane & 15) * 4;
                    long long kk = tile + row;
                    val[rr] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (kk < k1 && dd < hd) val[rr] = kv_load4(kb, kk * hd + dd);
                }
#pragma unroll
                for (int rr = 0; rr < 16; ++rr) {
                    int row = rr * 2 + (lane >> 4);
                    *(float4*)(kw + row * DLD + (lane & 15) * 4) = val[rr];
                }
                __syncwarp();
                const int dn = hd - d0 < DS ? hd - d0 : DS;
                for (int j = 0; j < dn; j += 4) {
                    float4 kv = *(const float4*)(kw + lane * DLD + j);
#pragma unroll
                    for (int hh = 0; hh < DG; ++hh) {
                        if (hh < G) {
                            float4 qa = *(const float4*)(qs + hh * hd + d0 + j);
                            float a = s[hh];
                            a = fmaf(qa.x, kv.x, a); a = fmaf(qa.y, kv.y, a);
                            a = fmaf(qa.z, kv.z, a); a = fmaf(qa.w, kv.w, a);
                            s[hh] = a;
                        }
                    }
                }
                __syncwarp();
            }
#pragma unroll
            for (int hh = 0; hh < DG; ++hh) {
                if (hh < G) {
                    float sv = valid ? s[hh] * scale : -INFINITY;
                    float mn = fmaxf(m[hh], warp_max(sv));  // finite: the tile's first key is valid
                    float corr = m[hh] == -INFINITY ? 0.0f : expf(m[hh] - mn);
                    float p = valid ? expf(sv - mn) : 0.0f;
                    l[hh] = l[hh] * corr + warp_sum(p);
                    m[hh] = mn;
#pragma unroll
                    for (int e = 0; e < DHD / 32; ++e) acc[hh][e] *= corr;
                    ps[warp][lane][hh] = p;
                }
            }
            __syncwarp();
            const int nvalid = (int)(k1 - tile < 32 ? k1 - tile : 32);
            // V rows DV_B keys at a time, all loaded before any is used (the same FMAs in the
            // same key order)
            for (int j0 = 0; j0 < nvalid; j0 += DV_B) {
                float vv[DV_B][DHD / 32];
#pragma unroll
                for (int jj = 0; jj < DV_B; ++jj) {
                    const T* vr = vb + (tile + j0 + jj) * hd;
#pragma unroll
                    for (int e = 0; e < DHD / 32; ++e)
                        vv[jj][e] = (e < ne && j0 + jj < nvalid) ? kv_load(vr, lane + 32 * e) : 0.0f;
                }
#pragma unroll
                for (int jj = 0; jj < DV_B; ++jj) {
                    if (j0 + jj >= nvalid) break;  // uniform across the warp
#pragma unroll
                    for (int hh = 0; hh < DG; ++hh) {
                        if (hh < G) {
                            float p = ps[warp][j0 + jj][hh];
#pragma unroll
                            for (int e = 0; e < DHD / 32; ++e) acc[hh][e] = fmaf(p, vv[jj][e], acc[hh][e]);
                        }
                    }
                }
            }
            __syncwarp();
        }
    }
    // the block's four warps into one partial per head (the staging area holds the accumulators)
    if (lane == 0) {
#pragma unroll
        for (int hh = 0; hh < DG; ++hh) {
            wm[warp][hh] = m[hh];
            wl[warp][hh] = l[hh];
        }
    }
    __syncthreads();
    float* red = &ks[0][0];  // [4][G][hd] floats: at most 32 KiB of the 34 KiB
#pragma unroll
    for (int hh = 0; hh < DG; ++hh)
        if (hh < G)
#pragma unroll
            for (int e = 0; e < DHD / 32; ++e)
                if (e < ne) red[(warp * G + hh) * hd + lane + 32 * e] = acc[hh][e];
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        int hh = i / hd, dd = i % hd;
        float M = fmaxf(fmaxf(wm[0][hh], wm[1][hh]), fmaxf(wm[2][hh], wm[3][hh]));
        float a = 0.0f, L = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float f = wm[w][hh] == -INFINITY ? 0.0f : expf(wm[w][hh] - M);
            a = fmaf(f, red[(w * G + hh) * hd + dd], a);
            L = fmaf(f, wl[w][hh], L);
        }
        long long pr = (row0 + hh) * nchunks + c;
        pacc[pr * hd + dd] = a;
        if (dd == 0) {
            pm[pr] = M;
            pl[pr] = L;
        }
    }
    // the last block of (kvh, lane) combines the lane's chunks in chunk order
    __threadfence();
    __syncthreads();
    int* ctr = count + (long long)lane_id * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) last = atomicAdd(ctr, 1) == used - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        int hh = i / hd, dd = i % hd;
        long long pr = (row0 + hh) * nchunks;
        float M = -INFINITY;
        for (int cc = 0; cc < used; ++cc) M = fmaxf(M, __ldcg(pm + pr + cc));
        float a = 0.0f, L = 0.0f;
        for (int cc = 0; cc < used; ++cc) {
            float mc = __ldcg(pm + pr + cc);
            float f = mc == -INFINITY ? 0.0f : expf(mc - M);
            L = fmaf(f, __ldcg(pl + pr + cc), L);
            a = fmaf(f, __ldcg(pacc + (pr + cc) * hd + dd), a);
        }
        out[(row0 + hh) * hd + dd] = a / L;
    }
    if (threadIdx.x == 0) *ctr = 0;
}

extern "C" __global__ void __launch_bounds__(128) attn_decode_f32(KvTab tab, const float* __restrict__ q,
                                                                   float* __restrict__ out, float* __restrict__ pm,
                                                                   float* __restrict__ pl, float* __restrict__ pacc,
                                                                   int* __restrict__ count, int nh, int nkv, int hd,
                                                                   long long cap, float scale, int hpb) {
    attn_decode_body<float>(tab, q, out, pm, pl, pacc, count, nh, nkv, hd, cap, scale, hpb);
}

extern "C" __global__ void __launch_bounds__(128) attn_decode_bf16(KvTab tab, const float* __restrict__ q,
                                                                    float* __restrict__ out, float* __restrict__ pm,
                                                                    float* __restrict__ pl, float* __restrict__ pacc,
                                                                    int* __restrict__ count, int nh, int nkv, int hd,
                                                                    long long cap, float scale, int hpb) {
    attn_decode_body<bf16_t>(tab, q, out, pm, pl, pacc, count, nh, nkv, hd, cap, scale, hpb);
}

// ---------------------------------------------------------------- Gated DeltaNet

// Causal depthwise conv + SiLU over each lane's rows (rt: lane i's rows of x and u); the lane's
// history [(K-1), C] (oldest first) precedes its rows. w [C, K], tap K-1 on the current row.
// Grid (tmax * cblocks, lanes), block 128, tmax the most rows of a lane. PLANT 1: taps reversed.
// LOWP: output rounded to bf16.
extern "C" __global__ void gdn_conv_rows(PtrTab st, RowTab rt, const float* __restrict__ x,
                                         const float* __restrict__ w, float* __restrict__ u, int C, int K) {
    int cblocks = (C + blockDim.x - 1) / blockDim.x;
    int r = blockIdx.x / cblocks;
    int c = (blockIdx.x % cblocks) * blockDim.x + threadIdx.x;
    int lane = blockIdx.y;
    if (c >= C || r >= rt.len[lane]) return;
    const float* hist = (const float*)st.p[lane];
    long long base = rt.start[lane];
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
        int idx = r + j - (K - 1);
        float val = idx < 0 ? hist[(long long)(K - 1 + idx) * C + c] : x[(base + idx) * C + c];
#if PLANT == 1
        float wj = w[(long long)c * K + (K - 1 - j)];
#else
        float wj = w[(long long)c * K + j];
#endif
        acc = fmaf(wj, val, acc);
    }
    u[(base + r) * C + c] = lowp(silu(acc));
}

// gdn_conv_rows then gdn_conv_shift for one row per lane, in one launch: each thread reads its
// channel's history and row, writes the output (the same fmaf chain), then shifts the history
// (its own channel only, so no other thread reads what it overwrites). Grid (cblocks, lanes).
// PLANT 1: taps reversed. LOWP: output rounded to bf16.
extern "C" __global__ void gdn_conv_one(PtrTab st, const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ u, int C, int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = blockIdx.y;
    if (c >= C) return;
    float* hist = (float*)st.p[lane];
    const float xv = x[(long long)lane * C + c];
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
        float val = j < K - 1 ? hist[(long long)j * C + c] : xv;
#if PLANT == 1
        float wj = w[(long long)c * K + (K - 1 - j)];
#else
        float wj = w[(long long)c * K + j];
#endif
        acc = fmaf(wj, val, acc);
    }
    u[(long long)lane * C + c] = lowp(silu(acc));
    for (int i = 0; i < K - 1; ++i) hist[(long long)i * C + c] = i + 1 < K - 1 ? hist[(long long)(i + 1) * C + c] : xv;
}

// History after each lane's rows: the last K-1 rows of [history; x]. Grid (cblocks, lanes).
// PLANT 1: keeps the history one row short of the newest.
extern "C" __global__ void gdn_conv_shift(PtrTab st, RowTab rt, const float* __restrict__ x, int C, int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = blockIdx.y;
    if (c >= C) return;
    float* hist = (float*)st.p[lane];
    const int t = rt.len[lane];
    long long base = rt.start[lane];
    int shift = t;
#if PLANT == 1
    shift = t - 1;
#endif
    for (int i = 0; i < K - 1; ++i) {
        int src = shift + i;
        float val = src < K - 1 ? hist[(long long)src * C + c] : x[(base + src - (K - 1)) * C + c];
        hist[(long long)i * C + c] = val;
    }
}

// Per row R of u [R, C] (conv output, q | k | v): l2-normalised q (times q_scale) and k per key
// head, their dot kq, and per value head beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt).
// One block (128 threads) per row, one warp per key head. PLANT 1: q_scale ignored.
// LOWP: q and k rounded to bf16.
// One warp's part of gdn_prep for key head kh of a row ur: the l2-normalised q (times q_scale)
// and k into qn[i] and kn[i] (i < dk), their dot returned to every lane. Shared by gdn_prep and
// gdn_step_k128_gated, so both make the same bits. LOWP: q and k rounded to bf16.
__device__ __forceinline__ float gdn_prep_head(const float* __restrict__ ur, int kh, int nk, int dk, float q_scale,
                                               float* qn, float* kn) {
    const int lane = threadIdx.x & 31;
    const float* qs = ur + (long long)kh * dk;
    const float* ks = ur + (long long)(nk + kh) * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int i = lane; i < dk; i += 32) {
        sq = fmaf(qs[i], qs[i], sq);
        sk = fmaf(ks[i], ks[i], sk);
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
    float dot = 0.0f;
    for (int i = lane; i < dk; i += 32) {
        float qv = lowp(qs[i] * iq * q_scale), kv = lowp(ks[i] * ik);
        qn[i] = qv;
        kn[i] = kv;
        dot = fmaf(qv, kv, dot);
    }
    return warp_sum(dot);
}

// A value head's gate scalars: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt).
__device__ __forceinline__ void gdn_prep_scalars(float b, float a, float a_log, float dt, float& beta, float& gate) {
    beta = sigmoidf(b);
    float xa = a + dt;
    float sp = xa > 20.0f ? xa : log1pf(expf(xa));
    gate = -expf(a_log) * sp;
}

extern "C" __global__ void gdn_prep(const float* __restrict__ u, const float* __restrict__ b,
                                    const float* __restrict__ a, const float* __restrict__ a_log,
                                    const float* __restrict__ dt_bias, float* __restrict__ qn,
                                    float* __restrict__ kn, float* __restrict__ kq, float* __restrict__ beta,
                                    float* __restrict__ gate, int C, int nk, int dk, int nv, float q_scale) {
    long long R = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* ur = u + R * C;
#if PLANT == 1
    q_scale = 1.0f;
#endif
    for (int kh = warp; kh < nk; kh += nw) {
        const float dot = gdn_prep_head(ur, kh, nk, dk, q_scale, qn + (R * nk + kh) * dk, kn + (R * nk + kh) * dk);
        if (lane == 0) kq[R * nk + kh] = dot;
    }
    for (int h = threadIdx.x; h < nv; h += blockDim.x)
        gdn_prep_scalars(b[R * nv + h], a[R * nv + h], a_log[h], dt_bias[h], beta[R * nv + h], gate[R * nv + h]);
}

// A row of the delta rule for one state column, shared by gdn_recur and gdn_recur_k128 (the
// same operations, so the same bits): from decay alpha, beta bt, the value vj and the column's
// dots with the row's key (Sk) and query (Sq), the rule's delta and the output (kq: the query's
// scale on the new key term); PLANT 1 applies the decay after the update.
__device__ __forceinline__ void gdn_row(float alpha, float bt, float vj, float Sk, float Sq, float kq, float& delta,
                                        float& oj) {
#if PLANT == 1
    delta = bt * (vj - Sk);
    oj = alpha * fmaf(delta, kq, Sq);
#else
    delta = bt * (vj - alpha * Sk);
    oj = fmaf(delta, kq, alpha * Sq);
#endif
}
// A state value after the row, from its old value s and the row's key value k.
__device__ __forceinline__ float gdn_new_s(float alpha, float s, float k, float delta) {
#if PLANT == 1
    return lowp(alpha * fmaf(k, delta, s));
#else
    return lowp(fmaf(alpha, s, k * delta));
#endif
}

// The delta rule over each lane's rows (rt: lane i's rows start[i] .. start[i] + len[i] of qn,
// kn, kq, u, beta, gate and o), value head h (key head h / (nv / nk)): per row
// S <- alpha S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q, computed as
// delta = beta (v - alpha S_old^T k), o = alpha S_old^T q + delta (k . q), S = alpha S_old + k delta^T.
// State [nv, dk, dv] f32 per lane (table); thread j owns column j. Grid (nv, lanes), block >= dv
// (multiple of 32), dynamic shared memory 2 * dk floats. o [rows, nv * dv].
// PLANT 1: decay applied after the update. LOWP: state stored rounded to bf16.
extern "C" __global__ void gdn_recur(PtrTab st, RowTab rt, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const float* __restrict__ kq,
                                     const float* __restrict__ u, const float* __restrict__ beta,
                                     const float* __restrict__ gate, float* __restrict__ o, int C, int nk, int dk,
                                     int nv, int dv) {
    extern __shared__ float sm[];
    float* sk = sm;
    float* sq = sm + dk;
    int h = blockIdx.x, lane = blockIdx.y;
    int kh = h / (nv / nk);
    int j = threadIdx.x;
    float* S = (float*)st.p[lane] + (long long)h * dk * dv;
    const int t = rt.len[lane];
    for (int r = 0; r < t; ++r) {
        long long R = (long long)rt.start[lane] + r;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            sk[i] = kn[(R * nk + kh) * dk + i];
            sq[i] = qn[(R * nk + kh) * dk + i];
        }
        __syncthreads();
        if (j < dv) {
            float alpha = expf(gate[R * nv + h]);
            float bt = beta[R * nv + h];
            float Sk = 0.0f, Sq = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float s = S[(long long)i * dv + j];
                Sk = fmaf(s, sk[i], Sk);
                Sq = fmaf(s, sq[i], Sq);
            }
            float vj = u[R * C + 2LL * nk * dk + (long long)h * dv + j];
            float delta, oj;
            gdn_row(alpha, bt, vj, Sk, Sq, kq[R * nk + kh], delta, oj);
            for (int i = 0; i < dk; ++i) {
                float s = S[(long long)i * dv + j];
                S[(long long)i * dv + j] = gdn_new_s(alpha, s, sk[i], delta);
            }
            o[R * nv * dv + (long long)h * dv + j] = oj;
        }
        __syncthreads();
    }
}

// One decode row per lane (u, b, a, z row L = lane L), key dim 128 and value dim 128: gdn_prep,
// gdn_recur_k128 and rmsnorm_silu_groups (plain w) in one launch, a block (128 threads) per value
// head and lane, thread j owning state column j. Warp 0 makes the key head's normalised q and k
// and their dot as gdn_prep's warp does (lane-strided fmaf, warp_sum), the block the row of the
// delta rule as gdn_recur_k128 does for one row (dots in key order from zero, gdn_row,
// gdn_new_s), then the gated RMSNorm over the head's 128 outputs with rmsnorm_silu_groups' block
// of 128 (a value a thread, block_sum): each step their operations, so their bits. Grid
// (nv, lanes). PLANT 1 / LOWP: the three kernels' plants and roundings.
extern "C" __global__ void __launch_bounds__(128) gdn_step_k128_gated(
    PtrTab st, const float* __restrict__ u, const float* __restrict__ b, const float* __restrict__ a,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, const float* __restrict__ z,
    const float* __restrict__ w, float* __restrict__ out, int C, int nk, int nv, float q_scale, float eps) {
    constexpr int DK = 128, DV = 128;
    __shared__ __align__(16) float qn[DK], kn[DK];
    __shared__ float sc[3];  // kq, beta, gate
    __shared__ float scratch[32];
    const int h = blockIdx.x, lane_id = blockIdx.y, j = threadIdx.x;
    const int kh = h / (nv / nk);
    const long long R = lane_id;
    const float* ur = u + R * C;
#if PLANT == 1
    q_scale = 1.0f;
#endif
    if (threadIdx.x < 32) {
        // gdn_prep's warp for key head kh
        const float dot = gdn_prep_head(ur, kh, nk, DK, q_scale, qn, kn);
        if (threadIdx.x == 0) {
            sc[0] = dot;
            gdn_prep_scalars(b[R * nv + h], a[R * nv + h], a_log[h], dt_bias[h], sc[1], sc[2]);
        }
    }
    float* S = (float*)st.p[lane_id] + (long long)h * DK * DV;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = S[(long long)i * DV + j];
    const float vj = ur[2LL * nk * DK + (long long)h * DV + j];
    __syncthreads();
    float Sk = 0.0f, Sq = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
        Sk = fmaf(s[i], kn[i], Sk);
        Sq = fmaf(s[i], qn[i], Sq);
    }
    const float alpha = expf(sc[2]);
    float delta, oj;
    gdn_row(alpha, sc[1], vj, Sk, Sq, sc[0], delta, oj);
#pragma unroll
    for (int i = 0; i < DK; ++i) S[(long long)i * DV + j] = gdn_new_s(alpha, s[i], kn[i], delta);
    // rmsnorm_silu_groups over the head's outputs (plain w): rms_inv_regs with one value a
    // thread (its only j), spelled out
    const float ss = block_sum(fmaf(oj, oj, 0.0f), scratch);
    // a division, as rms_inv_regs' by its run-time group (a constant divisor could be turned
    // into a product and contracted with the add)
    const float inv = 1.0f / sqrtf(__fdiv_rn(ss, (float)DV) + eps);
    const long long off = (R * nv + h) * DV;
    const float n = lowp(oj * inv * w[j]);
#if PLANT == 1
    out[off + j] = lowp(z[off + j] * silu(n));
#else
    out[off + j] = lowp(silu(z[off + j]) * n);
#endif
}

// gdn_recur with dk = 128 and each thread's state column held in registers: the 128 loads of a
// column are in flight at once (the generic kernel's column walk waits on them a few at a time)
// and the update reuses them instead of reading S again. One warp a block, a head's dv columns
// over ceil(dv / 32) blocks (grid (nv ceil(dv / 32), lanes)): the rows' broadcast reads of k and
// q from shared memory cost each SM one warp's worth, not a whole head's, and four times the
// SMs share a prompt. Row r's update and row r + 1's dots run in one pass over the column: each
// updated value goes straight into the next row's two fmaf chains, so a row costs one walk of
// 128 values, not two, and the chains' latency hides the updates. Rows' k and q take three
// shared buffers (rows r and r + 1 in use, row r + 2 stored at the end of row r); every global
// load is issued a whole row before its use (row r + 3's k and q and row r + 2's scalars at the
// end of row r), so a row waits on no global load, and one barrier a row suffices. At most 168
// registers and 16 bytes spilled (12 blocks a multiprocessor, as before the loads moved ahead;
// 250 registers without the bound).
// Each thread runs the same operations in the same order as gdn_recur (the dots of a row over
// its state before the update, in key order, from zero), so the same bits. Rows per lane from
// rt, as gdn_recur's (at least one: the host never builds an empty lane's table).
extern "C" __global__ void __launch_bounds__(32, 12) gdn_recur_k128(
    PtrTab st, RowTab rt, const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ kq,
    const float* __restrict__ u, const float* __restrict__ beta, const float* __restrict__ gate,
    float* __restrict__ o, int C, int nk, int dk, int nv, int dv) {
    constexpr int DK = 128;
    __shared__ __align__(16) float sk[3][DK], sq[3][DK];
    const int parts = (dv + 31) >> 5;
    const int h = blockIdx.x / parts, lane = blockIdx.y;
    const int kh = h / (nv / nk);
    const int j = (blockIdx.x - h * parts) * 32 + threadIdx.x;
    const bool live = j < dv;
    float* S = (float*)st.p[lane] + (long long)h * DK * dv;
    float s[DK];
    if (live) {
#pragma unroll
        for (int i = 0; i < DK; ++i) s[i] = S[(long long)i * dv + j];
    }
    const int t = rt.len[lane];
    const long long R0 = rt.start[lane];
    // row R's k and q (4 of each per thread)
    const float4* kp = (const float4*)(kn + kh * DK) + threadIdx.x;
    const float4* qp = (const float4*)(qn + kh * DK) + threadIdx.x;
    const long long kstride = (long long)nk * DK / 4;
    // a row's scalars: gate, beta, kq and this thread's v
    struct Sc {
        float gate, beta, kq, v;
    };
    auto scalars = [&](long long R) {
        Sc c{gate[R * nv + h], beta[R * nv + h], kq[R * nk + kh], 0.0f};
        if (live) c.v = u[R * C + 2LL * nk * DK + (long long)h * dv + j];
        return c;
    };
    // rows r and r + 1's scalars, and row r + 2's k and q, in registers
    Sc sc0{0.0f, 0.0f, 0.0f, 0.0f}, sc1 = sc0;
    float4 pk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), pq = pk;
    if (t > 0) {
        ((float4*)sk[0])[threadIdx.x] = kp[R0 * kstride];
        ((float4*)sq[0])[threadIdx.x] = qp[R0 * kstride];
        sc0 = scalars(R0);
    }
    if (t > 1) {
        ((float4*)sk[1])[threadIdx.x] = kp[(R0 + 1) * kstride];
        ((float4*)sq[1])[threadIdx.x] = qp[(R0 + 1) * kstride];
        sc1 = scalars(R0 + 1);
    }
    if (t > 2) {
        pk = kp[(R0 + 2) * kstride];
        pq = qp[(R0 + 2) * kstride];
    }
    __syncthreads();
    // row 0's dots
    float Sk = 0.0f, Sq = 0.0f;
    if (live && t > 0) {
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            Sk = fmaf(s[i], sk[0][i], Sk);
            Sq = fmaf(s[i], sq[0][i], Sq);
        }
    }
    for (int r = 0; r < t; ++r) {
        const long long R = R0 + r;
        const int cur = r % 3, nxt = (r + 1) % 3, far = (r + 2) % 3;
        const float g_r = sc0.gate, b_r = sc0.beta, v_r = sc0.v, kq_r = sc0.kq;
        if (live) {
            float alpha = expf(g_r);
            float bt = b_r;
            float vj = v_r;
            float delta, oj;
            gdn_row(alpha, bt, vj, Sk, Sq, kq_r, delta, oj);
            if (r + 1 < t) {
                // row r's update, each new value into row r + 1's dots
                float Sk2 = 0.0f, Sq2 = 0.0f;
#pragma unroll
                for (int i = 0; i < DK; ++i) {
                    s[i] = gdn_new_s(alpha, s[i], sk[cur][i], delta);
                    Sk2 = fmaf(s[i], sk[nxt][i], Sk2);
                    Sq2 = fmaf(s[i], sq[nxt][i], Sq2);
                }
                Sk = Sk2;
                Sq = Sq2;
            } else {
#pragma unroll
                for (int i = 0; i < DK; ++i) s[i] = gdn_new_s(alpha, s[i], sk[cur][i], delta);
            }
            o[R * nv * dv + (long long)h * dv + j] = oj;
        }
        // row r + 2 into the buffer row r - 1 used (its readers passed the previous barrier),
        // then the loads a row ahead: row r + 3's k and q, row r + 2's scalars
        if (r + 2 < t) {
            ((float4*)sk[far])[threadIdx.x] = pk;
            ((float4*)sq[far])[threadIdx.x] = pq;
        }
        if (r + 3 < t) {
            pk = kp[(R + 3) * kstride];
            pq = qp[(R + 3) * kstride];
        }
        sc0 = sc1;
        if (r + 2 < t) sc1 = scalars(R + 2);
        __syncthreads();
    }
    if (live) {
#pragma unroll
        for (int i = 0; i < DK; ++i) S[(long long)i * dv + j] = s[i];
    }
}

// ---------------------------------------------------------------- the chunked delta rule
// The delta rule over each lane's rows in chunks of GC_L = 64 rows (DRAMA3.md §4.3, the CPU
// backend's chunked_head), dk = dv = 128. Within a chunk of l rows, with cumulative gates
// G_i = g_0 + .. + g_i:
//   M_ij = beta_i (k_i . k_j) e^{G_i - G_j} (j < i), P_ij = (q_i . k_j) e^{G_i - G_j} (j <= i);
//   U = (I + M)^-1 beta V and W = (I + M)^-1 (beta K e^G), by forward substitution (row i from
//   rows j < i, in j order); V' = U - W S; O_i = e^{G_i} q_i S + sum_{j <= i} P_ij v'_j;
//   S <- e^{G_l} S + sum_j e^{G_l - G_j} k_j v'_j^T.
// Every exponent is <= 0 (g <= 0). A block takes value head h's state columns c0 .. c0 + 31 (W
// depends on no column, so each of a head's four blocks makes it): grid (nv dv / 32, lanes),
// 256 threads, GC_SMEM floats of dynamic shared memory (the host's kernels::GDN_CHUNK_SMEM).
// Rows per lane from rt, at least one. The same sums as the recurrence in another order, so
// not its bits: the host runs it only for the lanes it is asked to (CudaOptions::gdn_chunk_min).
// PLANT 1: the state's decay over a chunk (e^{G_l}) dropped. LOWP: the state rounded to bf16
// at each chunk's end (and gdn_prep's q and k).
#define GC_L 64
#define GC_D 128
#define GC_CW 32
#define GC_KS 129  // row stride of the k, q and w tiles: odd, so 32 rows at one key hit 32 banks
#define GC_VS 33   // row stride of the v / v' tile and the state slice
#define GC_MS 65   // row stride of M and P
#define GC_SMEM (3 * GC_L * GC_KS + GC_L * GC_VS + 2 * GC_L * GC_MS + GC_D * GC_VS + 4 * GC_L)
// lower-triangular 4 x 4 tiles of a 64 x 64 matrix: 16 * 17 / 2
#define GC_TRI 136
extern "C" __global__ void __launch_bounds__(256) gdn_chunk(PtrTab st, RowTab rt, const float* __restrict__ qn,
                                                            const float* __restrict__ kn, const float* __restrict__ u,
                                                            const float* __restrict__ beta,
                                                            const float* __restrict__ gate, float* __restrict__ o,
                                                            int C, int nk, int nv) {
    extern __shared__ float sm[];
    float* ks = sm;                   // [GC_L][GC_KS] the chunk's keys
    float* qs = ks + GC_L * GC_KS;    // [GC_L][GC_KS] queries
    float* ws = qs + GC_L * GC_KS;    // [GC_L][GC_KS] W, then k_j e^{G_l - G_j}
    float* vs = ws + GC_L * GC_KS;    // [GC_L][GC_VS] v, then U, then V'
    float* ms = vs + GC_L * GC_VS;    // [GC_L][GC_MS] M
    float* ps = ms + GC_L * GC_MS;    // [GC_L][GC_MS] P
    float* ss = ps + GC_L * GC_MS;    // [GC_D][GC_VS] the state's columns c0 ..
    float* gc = ss + GC_D * GC_VS;    // [GC_L] G
    float* bt = gc + GC_L;            // [GC_L] beta
    float* eg = bt + GC_L;            // [GC_L] e^{G_i}
    float* fl = eg + GC_L;            // [GC_L] e^{G_l - G_j}
    constexpr int parts = GC_D / GC_CW;
    const int h = blockIdx.x / parts, c0 = (blockIdx.x - h * parts) * GC_CW, lane = blockIdx.y;
    const int kh = h / (nv / nk);
    const int tid = threadIdx.x, cl = tid & 31, wp = tid >> 5;
    float* S = (float*)st.p[lane] + (long long)h * GC_D * GC_D + c0;
    for (int i = tid; i < GC_D * GC_CW; i += 256) ss[(i >> 5) * GC_VS + (i & 31)] = S[(long long)(i >> 5) * GC_D + (i & 31)];
    // this thread's 4 x 4 tile of M and P (threads past GC_TRI have none)
    int ib = 0;
    while (ib < 15 && (ib + 1) * (ib + 2) / 2 <= tid) ++ib;
    const int jb = tid - ib * (ib + 1) / 2;
    const int t = rt.len[lane];
    const long long R0 = rt.start[lane];
    for (int r0 = 0; r0 < t; r0 += GC_L) {
        const int l = min(GC_L, t - r0);
        // the chunk's k and q rows, v columns and scalars; rows past l are zeros
        for (int i = tid; i < GC_L * GC_D; i += 256) {
            const int r = i >> 7, a = i & 127;
            float kv = 0.0f, qv = 0.0f;
            if (r < l) {
                const long long R = R0 + r0 + r;
                kv = kn[(R * nk + kh) * GC_D + a];
                qv = qn[(R * nk + kh) * GC_D + a];
            }
            ks[r * GC_KS + a] = kv;
            qs[r * GC_KS + a] = qv;
        }
        for (int i = tid; i < GC_L * GC_CW; i += 256) {
            const int r = i >> 5, c = i & 31;
            vs[r * GC_VS + c] = r < l ? u[(R0 + r0 + r) * C + 2LL * nk * GC_D + (long long)h * GC_D + c0 + c] : 0.0f;
        }
        if (tid < GC_L) {
            const long long R = R0 + r0 + tid;
            gc[tid] = tid < l ? gate[R * nv + h] : 0.0f;
            bt[tid] = tid < l ? beta[R * nv + h] : 0.0f;
        }
        __syncthreads();
        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < GC_L; ++i) {
                acc += gc[i];  // rows past l add zeros
                gc[i] = acc;
            }
        }
        __syncthreads();
        if (tid < GC_L) {
            eg[tid] = expf(gc[tid]);
            fl[tid] = expf(gc[l - 1] - gc[tid]);
        }
        // M and P, a lower 4 x 4 tile a thread: k . k and q . k over the 128 keys
        if (tid < GC_TRI) {
            float kk[4][4], qk[4][4];
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) kk[x][y] = qk[x][y] = 0.0f;
#pragma unroll 4
            for (int a = 0; a < GC_D; ++a) {
                float ki[4], qi[4], kj[4];
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    ki[x] = ks[(4 * ib + x) * GC_KS + a];
                    qi[x] = qs[(4 * ib + x) * GC_KS + a];
                    kj[x] = ks[(4 * jb + x) * GC_KS + a];
                }
#pragma unroll
                for (int x = 0; x < 4; ++x)
#pragma unroll
                    for (int y = 0; y < 4; ++y) {
                        kk[x][y] = fmaf(ki[x], kj[y], kk[x][y]);
                        qk[x][y] = fmaf(qi[x], kj[y], qk[x][y]);
                    }
            }
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    const int i = 4 * ib + x, j = 4 * jb + y;
                    const bool in = i < l && j <= i;
                    const float d = in ? expf(gc[i] - gc[j]) : 0.0f;
                    ms[i * GC_MS + j] = in && j < i ? bt[i] * kk[x][y] * d : 0.0f;
                    ps[i * GC_MS + j] = in ? qk[x][y] * d : 0.0f;
                }
        }
        __syncthreads();
        // U (threads 128 .. 159, a value column each) and W (threads 0 .. 127, a key each) by
        // forward substitution; a column's rows depend on that column alone
        if (tid < GC_D + GC_CW) {
            const bool isw = tid < GC_D;
            float* col = isw ? ws + tid : vs + (tid - GC_D);
            const int stride = isw ? GC_KS : GC_VS;
            for (int i = 0; i < l; ++i) {
                float x = isw ? bt[i] * ks[i * GC_KS + tid] * eg[i] : bt[i] * col[i * stride];
#pragma unroll 8
                for (int j = 0; j < i; ++j) x = fmaf(-ms[i * GC_MS + j], col[j * stride], x);
                col[i * stride] = x;
            }
        }
        __syncthreads();
        // V' = U - W S (rows wp, wp + 8, ..; column cl)
        for (int i = wp; i < l; i += 8) {
            float x = 0.0f;
#pragma unroll 8
            for (int a = 0; a < GC_D; ++a) x = fmaf(ws[i * GC_KS + a], ss[a * GC_VS + cl], x);
            vs[i * GC_VS + cl] -= x;
        }
        __syncthreads();
        // O from the chunk's starting state and V'
        for (int i = wp; i < l; i += 8) {
            float x = 0.0f;
#pragma unroll 8
            for (int a = 0; a < GC_D; ++a) x = fmaf(qs[i * GC_KS + a], ss[a * GC_VS + cl], x);
            float y = x * eg[i];
            for (int j = 0; j <= i; ++j) y = fmaf(ps[i * GC_MS + j], vs[j * GC_VS + cl], y);
            o[(R0 + r0 + i) * nv * GC_D + (long long)h * GC_D + c0 + cl] = y;
        }
        // k_j e^{G_l - G_j} into W's place (W is done with)
        for (int i = tid; i < l * GC_D; i += 256) {
            const int j = i >> 7, a = i & 127;
            ws[j * GC_KS + a] = ks[j * GC_KS + a] * fl[j];
        }
        __syncthreads();
        // S <- e^{G_l} S + sum_j (k_j e^{G_l - G_j}) v'_j^T (keys wp, wp + 8, ..; column cl)
        const float el = eg[l - 1];
        for (int a = wp; a < GC_D; a += 8) {
#if PLANT == 1
            float x = ss[a * GC_VS + cl];
#else
            float x = ss[a * GC_VS + cl] * el;
#endif
#pragma unroll 8
            for (int j = 0; j < l; ++j) x = fmaf(ws[j * GC_KS + a], vs[j * GC_VS + cl], x);
            ss[a * GC_VS + cl] = lowp(x);
        }
        __syncthreads();
    }
    for (int i = tid; i < GC_D * GC_CW; i += 256) S[(long long)(i >> 5) * GC_D + (i & 31)] = ss[(i >> 5) * GC_VS + (i & 31)];
}
