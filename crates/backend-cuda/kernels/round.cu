// Frame-round kernels: the draws and the embeddings of a frame round kept on the device, so a
// round needs no host round trip (model::generate's kept rounds). The draw is
// model::sampling::sample bit for bit: the same Philox4x32-10 counters, the same f32 scaling,
// the same total order of the sort keys, and f64 exps and sums by exp_det and sum_det, whose
// every multiply and add is rounded once (explicit __d*_rn: no contraction into FMAs).
// PLANT 1: draws from the next step's counter; embeddings drop their last term.
// LOWP: exps and their sums in f32, which moves the draws that land near a cumulative
// boundary (a few in a hundred on flat distributions over thousands of tokens).

struct Tables {
    unsigned long long p[8];
};
#ifdef LOWP
typedef float real_t;
#define RADD __fadd_rn
#define RMUL __fmul_rn
#define RDIV __fdiv_rn
#define REXP(x) expf((float)(x))
#else
typedef double real_t;
#define RADD __dadd_rn
#define RMUL __dmul_rn
#define RDIV __ddiv_rn
#define REXP(x) exp_det(x)
#endif
#define ROW_W 11
#define RAS_W 16
// model::backend::RoundLane as the device reads it (backend.rs `LaneIn`, 280 bytes). follow:
// an unconditional branch's drawing lane (else -1); guide: a guided lane's unconditional
// branch, whose main logits it mixes in with gamma (else -1).
struct LaneIn {
    long long rows, tower_rows;
    unsigned long long seed, step;
    float temperature;
    int top_k;
    float top_p;
    int ras;
    int n_recent;
    int follow;
    int guide;
    float gamma;
    long long last[ROW_W];
    long long recent[RAS_W];
};

__device__ __forceinline__ void philox(unsigned int c[4], unsigned int k0, unsigned int k1) {
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned long long p0 = 0xD2511F53ull * (unsigned long long)c[0];
        unsigned long long p1 = 0xCD9E8D57ull * (unsigned long long)c[2];
        unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
        unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
        unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// sampling::uniform: 53 bits of Philox(step, stream) under the seed, in [0, 1).
__device__ double uniform01(unsigned long long seed, unsigned int stream, unsigned long long step) {
    unsigned int c[4] = {(unsigned int)step, (unsigned int)(step >> 32), stream, 0u};
    philox(c, (unsigned int)seed, (unsigned int)(seed >> 32));
    unsigned long long bits = (((unsigned long long)c[0] << 32) | c[1]) >> 11;
    return (double)bits * __longlong_as_double(0x3CA0000000000000ll);  // 2^-53
}

__device__ __forceinline__ double pow2i(long long k) { return __longlong_as_double((k + 1023) << 52); }

// sampling::exp_det.
__device__ double exp_det(double x) {
    if (isnan(x)) return x;
    if (x > 709.0) return __longlong_as_double(0x7FF0000000000000ll);
    if (x < -745.0) return 0.0;
    const double LOG2E = __longlong_as_double(0x3ff71547652b82fell);
    const double LN2_HI = __longlong_as_double(0x3fe62e42fee00000ll);
    const double LN2_LO = __longlong_as_double(0x3dea39ef35793c76ll);
    const long long T[14] = {0x3de6124613a86d09ll, 0x3e21eed8eff8d898ll, 0x3e5ae64567f544e4ll,
                             0x3e927e4fb7789f5cll, 0x3ec71de3a556c734ll, 0x3efa01a01a01a01all,
                             0x3f2a01a01a01a01all, 0x3f56c16c16c16c17ll, 0x3f81111111111111ll,
                             0x3fa5555555555555ll, 0x3fc5555555555555ll, 0x3fe0000000000000ll,
                             0x3ff0000000000000ll, 0x3ff0000000000000ll};
    double k = floor(__dadd_rn(__dmul_rn(x, LOG2E), 0.5));
    double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, LN2_HI)), __dmul_rn(k, LN2_LO));
    double p = __longlong_as_double(T[0]);
#pragma unroll
    for (int i = 1; i < 14; ++i) p = __dadd_rn(__dmul_rn(p, r), __longlong_as_double(T[i]));
    long long ki = (long long)k;
    long long k1 = ki / 2, k2 = ki - ki / 2;
    return __dmul_rn(__dmul_rn(p, pow2i(k1)), pow2i(k2));
}

// The draw's scaled logit: l / max(T, 1e-5) in f32, as the CPU.
__device__ __forceinline__ float scaled(const float* row, int i, float t) { return __fdiv_rn(row[i], t); }

// sampling::argmax over the block: index 0 if row[0] is NaN (a scan never leaves it), else the
// first index of the largest non-NaN value.
__device__ int block_argmax(const float* row, int n, float* sv, int* si) {
    float best = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (isnan(v)) continue;
        if (bi < 0 || v > best) {
            best = v;
            bi = i;
        }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = sv[threadIdx.x + s];
            int oi = si[threadIdx.x + s];
            float v = sv[threadIdx.x];
            int i = si[threadIdx.x];
            bool take = oi >= 0 && (i < 0 || ov > v || (!(v > ov) && oi < i));
            if (take) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    int r = isnan(row[0]) ? 0 : (si[0] < 0 ? 0 : si[0]);
    __syncthreads();
    return r;
}

// The block's keys [n] sorted ascending: a stable least-significant-digit radix sort of their
// high 32 bits (the value's order key), 4 bits a pass, through tmp [n] and back (8 passes).
// Keys are unique (the index is in the low bits) and come in index order, so a stable sort of
// the high bits is the full keys' ascending order: the bitonic network's order before it
// (session 11's ncu: that network was ~40 of a head draw's 51 us, every stage reading and
// writing every key in shared memory). Element e = r * 1024 + thread (round r of `rounds`);
// within a round a warp's equal digits are ranked by __match_any_sync, and the counts are
// scanned in (digit, round, warp) order, which is element order within each digit: stable.
// cnt: 16 * rounds * 32 ints. Needs blockDim.x == 1024 and rounds <= RADIX_MAX_ROUNDS.
#define RADIX_MAX_ROUNDS 16
__device__ void block_radix_sort(unsigned long long* keys, unsigned long long* tmp, int* cnt, int n, int rounds) {
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int m = 16 * rounds * 32;
    const int per = (m + 1023) >> 10;  // scan entries a thread
    __shared__ int wsum[32];
    unsigned long long* src = keys;
    unsigned long long* dst = tmp;
    for (int shift = 32; shift < 64; shift += 4) {
        for (int i = tid; i < m; i += 1024) cnt[i] = 0;
        __syncthreads();
        unsigned int slot[RADIX_MAX_ROUNDS];  // digit << 8 | rank in the warp
#pragma unroll
        for (int r = 0; r < RADIX_MAX_ROUNDS; ++r) {
            slot[r] = 0;
            if (r >= rounds) break;
            const int e = r * 1024 + tid;
            const bool valid = e < n;
            const unsigned int act = __ballot_sync(0xffffffffu, valid);
            if (valid) {
                const unsigned int d = (unsigned int)(src[e] >> shift) & 15u;
                const unsigned int peers = __match_any_sync(act, d);
                const unsigned int rank = __popc(peers & ((1u << lane) - 1u));
                if (rank == 0) cnt[((int)d * rounds + r) * 32 + w] = __popc(peers);
                slot[r] = d << 8 | rank;
            }
        }
        __syncthreads();
        // exclusive scan of cnt in place: a thread's run of `per` entries, then the runs' sums
        int run = 0;
        for (int j = 0; j < per; ++j) {
            const int i = tid * per + j;
            if (i < m) run += cnt[i];
        }
        int inc = run;
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += v;
        }
        if (lane == 31) wsum[w] = inc;
        __syncthreads();
        if (w == 0) {
            int x = wsum[lane];
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, x, o);
                if (lane >= o) x += v;
            }
            wsum[lane] = x;
        }
        __syncthreads();
        int base = inc - run + (w > 0 ? wsum[w - 1] : 0);
        for (int j = 0; j < per; ++j) {
            const int i = tid * per + j;
            if (i < m) {
                const int c = cnt[i];
                cnt[i] = base;
                base += c;
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RADIX_MAX_ROUNDS; ++r) {
            if (r >= rounds) break;
            const int e = r * 1024 + tid;
            if (e < n) {
                const int d = (int)(slot[r] >> 8);
                dst[cnt[(d * rounds + r) * 32 + w] + (int)(slot[r] & 255u)] = src[e];
            }
        }
        __syncthreads();
        unsigned long long* t = src;
        src = dst;
        dst = t;
    }
    // 8 passes: the sorted keys are back in `keys`
}

// The k (< n) smallest of the block's unique keys [n], in ascending order, their indices (low
// 32 bits) into order[0, k): a radix select from the top byte down (a 256-bin histogram a pass
// of the keys still in play, shared atomics: counts, so order-free), stopping at the first bin
// that holds exactly the keys still needed; then the k keys gathered into cand (any order) and
// each placed by counting the candidates below it. Needs k <= SELECT_MAX and cand for k u64.
#define SELECT_MAX 64
__device__ void block_select(const unsigned long long* keys, int n, int k, unsigned long long* cand, int* order) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long sel_prefix, sel_mask;
    __shared__ int sel_rem, sel_done, sel_n;
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        sel_prefix = 0ull;
        sel_mask = 0ull;
        sel_rem = k;
        sel_done = 0;
        sel_n = 0;
    }
    __syncthreads();
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        const unsigned long long prefix = sel_prefix, mask = sel_mask;
        // a warp's keys of one bin add once (most keys share the first passes' bins)
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + tid;
            const unsigned long long key = i < n ? keys[i] : 0ull;
            const bool in_play = i < n && (key & mask) == prefix;
            const unsigned int act = __ballot_sync(0xffffffffu, in_play);
            if (in_play) {
                const unsigned int bin = (unsigned int)(key >> shift) & 255u;
                const unsigned int peers = __match_any_sync(act, bin);
                if ((peers & ((1u << lane) - 1u)) == 0u) atomicAdd(&hist[bin], (unsigned int)__popc(peers));
            }
        }
        __syncthreads();
        if (tid < 32) {
            // lane j holds bins 8 j .. 8 j + 7: its sum, the exclusive scan across lanes, then
            // the lane whose bins cross the keys still needed finds the bin
            unsigned int c[8], sum = 0;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                c[b] = hist[8 * lane + b];
                sum += c[b];
            }
            unsigned int inc = sum;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += v;
            }
            const unsigned int rem = (unsigned int)sel_rem;
            unsigned int before = inc - sum;
            if (before < rem && rem <= inc) {
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    if (before + c[b] >= rem) {
                        const unsigned int d = 8u * lane + b;
                        sel_rem = (int)(rem - before);
                        sel_prefix = prefix | ((unsigned long long)d << shift);
                        sel_mask = mask | (255ull << shift);
                        sel_done = c[b] == rem - before;
                        break;
                    }
                    before += c[b];
                }
            }
        }
        __syncthreads();
        if (sel_done) break;
    }
    // the keys whose fixed top bits are below the prefix come first; with the prefix's own bin
    // (exactly the rest) they are the k smallest
    const unsigned long long prefix = sel_prefix, mask = sel_mask;
    for (int i = tid; i < n; i += blockDim.x) {
        const unsigned long long key = keys[i];
        if ((key & mask) <= prefix) {
            const int at = atomicAdd(&sel_n, 1);
            if (at < k) cand[at] = key;
        }
    }
    __syncthreads();
    if (tid < k) {
        const unsigned long long key = cand[tid];
        int r = 0;
        for (int j = 0; j < k; ++j) r += cand[j] < key;
        order[r] = (int)(key & 0xffffffffull);
    }
    __syncthreads();
}

// sampling::sample with uniform u, for the whole block (every thread returns the index).
// keys: n u64 (then the f64 exps in index order), tmp: n u64 (the sort's second buffer, then
// the ranks' indices as ints), cnt: the sort's counts (or the selection's candidates). Only
// the ranks the draw can keep are ordered: the top_k (<= SELECT_MAX) by the selection, else
// all by the sort; the total (sampling::sum_det over every exp) is in index order.
__device__ int block_draw(const float* row, int n, int rounds, float temperature, int top_k, float top_p,
                          bool keep_crossing, double u, unsigned long long* keys, unsigned long long* tmp, int* cnt,
                          float* sv, int* si, int* result) {
    if (temperature <= 0.0f || n <= 1) return block_argmax(row, n, sv, si);
    const float t = fmaxf(temperature, 1e-5f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned int b = __float_as_uint(scaled(row, i, t));
        unsigned int ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
        keys[i] = ((unsigned long long)(~ord) << 32) | (unsigned int)i;
    }
    __syncthreads();
    int* order = (int*)tmp;
    int ranks = n;
    if (top_k > 0 && top_k <= SELECT_MAX && top_k < n) {
        block_select(keys, n, top_k, (unsigned long long*)cnt, order);
        ranks = top_k;
    } else {
        block_radix_sort(keys, tmp, cnt, n, rounds);
        for (int i = threadIdx.x; i < n; i += blockDim.x) order[i] = (int)(keys[i] & 0xffffffffull);
        __syncthreads();
    }
    real_t* exps = (real_t*)keys;
    const double mx = (double)scaled(row, order[0], t);
    // four of a thread's exps at a time: independent chains the scheduler can interleave (each
    // is the same operations as alone)
    for (int i = threadIdx.x; i < n; i += 4 * blockDim.x) {
        double x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int e = i + j * (int)blockDim.x;
            x[j] = e < n ? __dsub_rn((double)scaled(row, e, t), mx) : 0.0;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int e = i + j * (int)blockDim.x;
            const real_t v = REXP(x[j]);
            if (e < n) exps[e] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        // sampling::sum_det in index order: strided partials, then the xor butterfly (every
        // lane has the total)
        real_t acc = 0.0;
        for (int i = lane; i < n; i += 32) acc = RADD(acc, exps[i]);
        for (int s = 16; s > 0; s >>= 1) acc = RADD(acc, __shfl_xor_sync(0xffffffffu, acc, s));
        const real_t total = acc, tp = (real_t)top_p;
        // The cut (top-k, top-p) and the kept mass, 32 ranks at a time: lane j divides rank
        // base + j's exp by the total, then lane 0 runs the dependent sums in rank order as
        // sampling::sample does, and overwrites each kept rank's exp with the mass up to it.
        // (Lane 0 alone used to divide too: 52 us a head draw in session 10's ncu.)
        __shared__ real_t pbuf[32];
        int kept = 0;
        real_t cum = 0.0, mass = 0.0;
        for (int base = 0; base < ranks; base += 32) {
            pbuf[lane] = base + lane < ranks ? RDIV(exps[order[base + lane]], total) : (real_t)0.0;
            __syncwarp();
            int done = 0;
            if (lane == 0) {
                const int m = ranks - base < 32 ? ranks - base : 32;
                for (int j = 0; j < m; ++j) {
                    const int rank = base + j;
                    const real_t before = cum;
                    cum = RADD(cum, pbuf[j]);
                    if (rank > 0) {
                        if (top_k > 0 && rank >= top_k) {
                            done = 1;
                            break;
                        }
                        const bool over = keep_crossing ? before > tp : cum > tp;
                        if (over) {
                            done = 1;
                            break;
                        }
                    }
                    kept = rank + 1;
                    // rank's exp, then the kept mass up to it, at its index
                    mass = RADD(mass, exps[order[rank]]);
                    exps[order[rank]] = mass;
                }
            }
            // every lane waits here for lane 0's pass over pbuf (the shuffle carries its verdict,
            // the barrier orders its reads before the next chunk's writes)
            done = __shfl_sync(0xffffffffu, done, 0);
            __syncwarp();
            if (done) break;
        }
        kept = __shfl_sync(0xffffffffu, kept, 0);
        mass = __shfl_sync(0xffffffffu, mass, 0);
        __syncwarp();
        // the pick: the first kept rank whose mass prefix passes u * mass (the sequential scan's
        // answer), else the last kept rank
        const real_t target = RMUL((real_t)u, mass);
        int first = 0x7fffffff;
        for (int r = lane; r < kept; r += 32)
            if (target < exps[order[r]]) {
                first = r;
                break;
            }
        for (int s = 16; s > 0; s >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, s));
        if (lane == 0) *result = first < kept ? order[first] : order[kept - 1];
    }
    __syncthreads();
    int r = *result;
    __syncthreads();
    return r;
}

// One block per covered lane: a draw from logits [rows, n] into the lane's frame (frames
// [lanes, 11]). slot < 0: the main token (candidate ids `cands`, RAS against the lane's recent
// tokens), columns 0 and 1, rows = every lane: an unconditional branch draws nothing, and a
// guided lane first rewrites its row as l + gamma (l - l_u) (sampling::cfg_mix, each step
// rounded once) from its branch's row, which no block writes. slot r >= 0: residual head r,
// column 2 + r, rows = the drawing lanes. rounds = ceil(n / 1024) (at most RADIX_MAX_ROUNDS).
// Dynamic shared memory: n u64 keys, n u64 for the sort's second buffer, 16 * rounds * 32 ints.
extern "C" __global__ void __launch_bounds__(1024) round_sample(float* __restrict__ logits, int n, int rounds,
                                                                const LaneIn* __restrict__ lanes,
                                                                long long* __restrict__ frames,
                                                                const unsigned int* __restrict__ cands, int slot,
                                                                unsigned int sem_start, unsigned int sem_end) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned long long* keys = (unsigned long long*)smem;
    unsigned long long* tmp = keys + n;
    int* cnt = (int*)(tmp + n);
    __shared__ float sv[1024];
    __shared__ int si[1024];
    __shared__ int result;
    const int lane = blockIdx.x;
    const LaneIn& L = lanes[lane];
    if (L.follow >= 0) return;
    float* row = logits + (long long)lane * n;
    if (slot < 0 && L.guide >= 0 && L.gamma != 0.0f) {
        const float* u = logits + (long long)L.guide * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            row[i] = __fadd_rn(row[i], __fmul_rn(L.gamma, __fsub_rn(row[i], u[i])));
        __syncthreads();
    }
    unsigned long long step = L.step;
#if PLANT == 1
    step += 1;
#endif
    long long* f = frames + (long long)lane * ROW_W;
    if (slot < 0) {
        int c = block_draw(row, n, rounds, L.temperature, L.top_k, L.top_p, true, uniform01(L.seed, 0u, step), keys,
                           tmp, cnt, sv, si, &result);
        long long tok = cands[c];
        bool sem = tok >= (long long)sem_start && tok <= (long long)sem_end;
        bool seen = false;
        for (int i = 0; i < L.n_recent && i < RAS_W; ++i) seen = seen || L.recent[i] == tok;
        if (L.ras && sem && seen) {
            c = block_draw(row, n, rounds, 1.0f, 30, 0.95f, true, uniform01(L.seed, 1u, step), keys, tmp, cnt, sv,
                           si, &result);
            tok = cands[c];
        }
        if (threadIdx.x == 0) {
            f[0] = tok;
            f[1] = tok - (long long)sem_start;
        }
    } else {
        int c = block_draw(row, n, rounds, L.temperature, L.top_k, L.top_p, false,
                           uniform01(L.seed, 2u + (unsigned int)slot, step), keys, tmp, cnt, sv, si, &result);
        if (threadIdx.x == 0) f[2 + slot] = c;
    }
}

#define MAX_TERMS 16
struct Terms {
    long long table_rows[8];
    int n;
    int table[MAX_TERMS];
    int last[MAX_TERMS];
    int col[MAX_TERMS];
    unsigned int offset[MAX_TERMS];
    int guarded[MAX_TERMS];
};

// Grid (covered lanes, column blocks): out[lane, c] = s * sum over included terms of
// tables[t][offset + frame[col], c] (bf16 tables [*, cols]), summed in term order from 0 as
// gather_sum; s = scale when the current frame's main token is semantic, else 1. An
// unconditional branch's current frame is its drawing lane's. A code outside its table adds
// nothing and sets error bit 2 (reported at the next download). The block's first threads find
// each term's table row once; each thread then takes one column, every term's load issued
// before the sum (it was one block a lane walking the columns, two dependent loads a term:
// 21 us a call in session 10's ncu). A column's sum is the same chain as before.
extern "C" __global__ void round_embed(Tables tabs, Terms terms, const LaneIn* __restrict__ lanes,
                                       const long long* __restrict__ frames, float* __restrict__ out, int cols,
                                       float scale, unsigned int sem_start, unsigned int sem_end, int* err) {
    __shared__ long long row_s[MAX_TERMS];  // the term's table row, or -1: it adds nothing
    const int lane = blockIdx.x;
    const int src = lanes[lane].follow >= 0 ? lanes[lane].follow : lane;
    const long long* cur = frames + (long long)src * ROW_W;
    const long long* last = lanes[lane].last;
    int nt = terms.n < MAX_TERMS ? terms.n : MAX_TERMS;
#if PLANT == 1
    if (nt > 0) nt -= 1;
#endif
    if (threadIdx.x < nt) {
        const int t = threadIdx.x;
        const long long* f = terms.last[t] ? last : cur;
        long long r = -1;
        if (!terms.guarded[t] || (f[0] >= (long long)sem_start && f[0] <= (long long)sem_end)) {
            r = (long long)terms.offset[t] + f[terms.col[t]];
            if (r < 0 || r >= terms.table_rows[terms.table[t]]) {
                if (blockIdx.y == 0) atomicOr(err, 4);
                r = -1;
            }
        }
        row_s[t] = r;
    }
    __syncthreads();
    const bool cur_sem = cur[0] >= (long long)sem_start && cur[0] <= (long long)sem_end;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float v[MAX_TERMS];
#pragma unroll
    for (int t = 0; t < MAX_TERMS; ++t) {
        v[t] = 0.0f;
        if (t < nt && row_s[t] >= 0) v[t] = bf16_to_f32(((const bf16_t*)tabs.p[terms.table[t]])[row_s[t] * cols + c]);
    }
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < MAX_TERMS; ++t)
        if (t < nt && row_s[t] >= 0) acc = lowp(acc + v[t]);
    out[(long long)lane * cols + c] = acc * (cur_sem ? scale : 1.0f);
}
