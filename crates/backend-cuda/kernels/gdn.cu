// Gated DeltaNet decode: causal depthwise conv step + SiLU, l2-norm of q/k, the recurrent
// delta-rule step with f32 state [dk, dv] per value head, gated RMSNorm with silu(z).

// u[c] = silu(sum_j w[c, j] * x_{t-3+j}[c]); w[c, 3] hits the current row. state [3, C] holds
// rows t-3, t-2, t-1 and is shifted in place. PLANT 1: taps reversed. LOWP: u rounded to bf16.
extern "C" __global__ void gdn_conv_step(const float* __restrict__ x, float* __restrict__ state,
                                         const bf16_t* __restrict__ w, float* __restrict__ u, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s0 = state[c], s1 = state[C + c], s2 = state[2 * C + c], xc = x[c];
    const bf16_t* wc = w + 4 * (size_t)c;
    float w0 = bf16_to_f32(wc[0]), w1 = bf16_to_f32(wc[1]), w2 = bf16_to_f32(wc[2]), w3 = bf16_to_f32(wc[3]);
#if PLANT == 1
    float acc = fmaf(w3, s0, fmaf(w2, s1, fmaf(w1, s2, w0 * xc)));
#else
    float acc = fmaf(w3, xc, fmaf(w2, s2, fmaf(w1, s1, w0 * s0)));
#endif
    float o = silu(acc);
#ifdef LOWP
    o = round_bf16(o);
#endif
    u[c] = o;
    state[c] = s1;
    state[C + c] = s2;
    state[2 * C + c] = xc;
}

// In place over qk = [q (nk*dk) ; k (nk*dk)]: q <- q / sqrt(sum q^2 + 1e-6) * q_scale,
// k <- k / sqrt(sum k^2 + 1e-6). One warp per head. PLANT 1: q_scale ignored.
extern "C" __global__ void gdn_l2norm(float* __restrict__ qk, int nk, int dk, float q_scale) {
    int lane = threadIdx.x & 31;
    int head = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (head >= 2 * nk) return;
    float* p = qk + (size_t)head * dk;
    float ss = 0.0f;
    for (int i = lane; i < dk; i += 32) ss = fmaf(p[i], p[i], ss);
    ss = warp_sum(ss);
    float r = rsqrtf(ss + 1e-6f);
#if PLANT != 1
    if (head < nk) r *= q_scale;
#endif
    for (int i = lane; i < dk; i += 32) {
        float o = p[i] * r;
#ifdef LOWP
        o = round_bf16(o);
#endif
        p[i] = o;
    }
}

// One decode step per value head h (key head h / (nv/nk)), dk = dv = 128:
// S <- a S; d = b (v - S^T k); S <- S + k d^T; o = S^T q, with b = sigmoid(b_raw),
// a = exp(-exp(A_log) * softplus(a_raw + dt_bias)). Block of 512: 4 row groups x 128 columns;
// each thread holds 32 entries of S, read once and written once.
// PLANT 1: decay applied after the update. LOWP: state stored rounded to bf16.
#define GDN_D 128
extern "C" __global__ void __launch_bounds__(512) gdn_recurrent_step(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ b_raw, const float* __restrict__ a_raw, const bf16_t* __restrict__ A_log,
    const bf16_t* __restrict__ dt_bias, float* __restrict__ state, float* __restrict__ o, int nk, int nv) {
    __shared__ float sk[GDN_D], sq[GDN_D], psk[4][GDN_D], psq[4][GDN_D];
    int h = blockIdx.x;
    int kh = h / (nv / nk);
    int j = threadIdx.x & (GDN_D - 1), g = threadIdx.x >> 7;
    if (threadIdx.x < GDN_D) sk[j] = k[(size_t)kh * GDN_D + j];
    else if (threadIdx.x < 2 * GDN_D) sq[j] = q[(size_t)kh * GDN_D + j];
    float beta = sigmoidf(b_raw[h]);
    float xa = a_raw[h] + bf16_to_f32(dt_bias[h]);
    float sp = xa > 20.0f ? xa : log1pf(expf(xa));
    float alpha = expf(-expf(bf16_to_f32(A_log[h])) * sp);
    __syncthreads();
    float* S = state + ((size_t)h * GDN_D + g * 32) * GDN_D + j;
    float s[32];
    float pk = 0.0f, pq = 0.0f;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
        s[r] = S[(size_t)r * GDN_D];
        pk = fmaf(s[r], sk[g * 32 + r], pk);
        pq = fmaf(s[r], sq[g * 32 + r], pq);
    }
    psk[g][j] = pk;
    psq[g][j] = pq;
    float kq = 0.0f;
    for (int i = 0; i < GDN_D; ++i) kq = fmaf(sk[i], sq[i], kq);
    __syncthreads();
    float Sk = (psk[0][j] + psk[1][j]) + (psk[2][j] + psk[3][j]);
    float Sq = (psq[0][j] + psq[1][j]) + (psq[2][j] + psq[3][j]);
    float vj = v[(size_t)h * GDN_D + j];
#if PLANT == 1
    float delta = beta * (vj - Sk);
    float oj = alpha * fmaf(delta, kq, Sq);
#else
    float delta = beta * (vj - alpha * Sk);
    float oj = fmaf(delta, kq, alpha * Sq);
#endif
    if (g == 0) o[(size_t)h * GDN_D + j] = oj;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
#if PLANT == 1
        float ns = alpha * fmaf(sk[g * 32 + r], delta, s[r]);
#else
        float ns = fmaf(alpha, s[r], sk[g * 32 + r] * delta);
#endif
#ifdef LOWP
        ns = round_bf16(ns);
#endif
        S[(size_t)r * GDN_D] = ns;
    }
}

// out[h, :] = o[h, :] / sqrt(mean(o[h]^2) + eps) * w * silu(z[h, :]); plain w. One warp per head.
// PLANT 1: uses 1 + w. LOWP: output rounded to bf16.
extern "C" __global__ void gdn_gated_norm(const float* __restrict__ o, const float* __restrict__ z,
                                          const bf16_t* __restrict__ w, float* __restrict__ out,
                                          int nv, int dv, float eps) {
    int lane = threadIdx.x & 31;
    int h = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (h >= nv) return;
    const float* oh = o + (size_t)h * dv;
    float ss = 0.0f;
    for (int i = lane; i < dv; i += 32) ss = fmaf(oh[i], oh[i], ss);
    ss = warp_sum(ss);
    float r = rsqrtf(ss / (float)dv + eps);
    for (int i = lane; i < dv; i += 32) {
        float wv = bf16_to_f32(w[i]);
#if PLANT == 1
        wv += 1.0f;
#endif
        float val = oh[i] * r * wv * silu(z[(size_t)h * dv + i]);
#ifdef LOWP
        val = round_bf16(val);
#endif
        out[(size_t)h * dv + i] = val;
    }
}
