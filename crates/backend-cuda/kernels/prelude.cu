// Shared helpers for every dramatis kernel. No CUDA headers: bf16 and fp8 are raw bits,
// converted by bit manipulation or PTX `cvt`, so users need no toolkit install.
typedef unsigned short bf16_t;
typedef unsigned char fp8_t;
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
// The LOWP builds (the contract's precision-discriminating twins) round a stage to bf16 here.
__device__ __forceinline__ float lowp(float v) {
#ifdef LOWP
    return round_bf16(v);
#else
    return v;
#endif
}
// Low half first, as stored in memory.
__device__ __forceinline__ float2 bf16x2_to_f32(unsigned int v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
// Two e4m3fn bytes (low byte first) to two floats, through the sm_89+ hardware conversion.
__device__ __forceinline__ float2 fp8x2_to_f32(unsigned short v) {
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    float lo, hi;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(lo), "=f"(hi) : "r"(h2));
    return make_float2(lo, hi);
}
// Weights are read once per step: stream them past L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
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
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
// Block-wide sum for blockDim.x a multiple of 32, at most 1024; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(t);
}
// TF32 of f32 (round to nearest, ties away), as the bits mma.sync takes.
__device__ __forceinline__ unsigned int to_tf32(float f) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

// to_tf32 for a split's hi (x = hi + lo), made on the bits: for every finite f the same value
// in 2 instructions, where ptxas's cvt.rna takes 4 (its select for inf and NaN). The lo that
// follows keeps to_tf32, so a non-finite f still gives a NaN product (inf - inf; a NaN whose
// sum wraps to -0 here leaves lo = f itself).
__device__ __forceinline__ unsigned int tf32_hi(float f) { return (__float_as_uint(f) + 0x1000u) & 0xffffe000u; }

// D = A B + D on tensor cores, m16n8k8, TF32 in, f32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The expert of tile `b` (tiles[e] <= b < tiles[e+1]), or -1 past the last tile.
__device__ __forceinline__ int tile_expert(const int* __restrict__ tiles, int E, int b) {
    if (b >= tiles[E]) return -1;
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tiles[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The expert of this block's tile (blockIdx.y) of a grouped expert launch with TM-slot tiles,
// its first slot in `order` and its slot count (at most TM); -1 past the last tile. Every
// thread of the block must call it (one barrier).
template <int TM>
__device__ __forceinline__ int group_tile(const int* __restrict__ offsets, const int* __restrict__ tiles, int E,
                                          int& first, int& count) {
    __shared__ int e_sh;
    if (threadIdx.x == 0) e_sh = tile_expert(tiles, E, blockIdx.y);
    __syncthreads();
    const int e = e_sh;
    first = 0;
    count = 0;
    if (e < 0) return e;
    first = offsets[e] + (blockIdx.y - tiles[e]) * TM;
    count = offsets[e + 1] - first;
    if (count > TM) count = TM;
    return e;
}

#ifndef PLANT
#define PLANT 0
#endif

// Opens every kernel (runtime.rs inserts it): with programmatic dependent launch the grid may
// start before the one ahead of it has finished and waits here, before any memory access,
// until that grid has completed and its writes are visible; then it lets the next grid be
// scheduled (that one waits in turn), so launching it overlaps this grid's work. Without
// DRAMATIS_PDL it is nothing.
#ifdef DRAMATIS_PDL
#define PDL_WAIT() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT()
#endif

// Blocks a multiprocessor must hold for the streaming kernels (the BF16 decode GEMVs and the
// per-row FP8 experts), in their __launch_bounds__: the build's -DOCC=N (DRAMATIS_CUDA_OCC).
// Session 10's ncu: at OCC 1 they sit at 88-128 registers, two 256-thread blocks a
// multiprocessor (25% occupancy), issuing 0.4 instructions a cycle while their warps wait on
// loads. OCC 2 caps them at 64 registers for twice the warps. Register allocation does not
// change the arithmetic.
// OCC 0 names no minimum at all: ptxas reads an explicit minimum of one block as leave to use
// 128 registers (session 10: gemv_tc2 went from 81-88 registers to 128 with spills at OCC 1,
// moe_gate_up_tab4 from 101 to 109), so OCC 0 is the build before eedfd09, kept for the A/B.
#ifndef OCC
#define OCC 1
#endif
#if OCC == 0
#define LB_GEMV __launch_bounds__(512)
#define LB_MOE __launch_bounds__(256)
#else
#define LB_GEMV __launch_bounds__(512, OCC)
#define LB_MOE __launch_bounds__(256, 2 * OCC)
#endif
