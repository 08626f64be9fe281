// Hyper-connection kernels (spec §3.1–3.4, §3.6, §3.8). Streams are [n, hc, D] f32.
//
// Element-wise arithmetic uses __fmul_rn/__fadd_rn: the CPU reference rounds every
// product and sum separately, and these are never contracted into an FMA, so the
// element-wise kernels give the reference's bits.
#include <cuda_bf16.h>

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out[t][s][i] = x[t][i].
extern "C" __global__ void hc_expand(const float* __restrict__ x, float* __restrict__ out, int hc, int D,
                                     long long total) {
    PDL_ENTER();
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long ts = e / D, i = e % D, t = ts / hc;
        out[e] = x[t * D + i];
    }
}

// Kernels that loop over the streams come in HC = 1, 2, 4 (the loops unroll, so a thread's
// stream loads are all in flight at once) and HC = 0 (hc at run time).
#define HC_VARIANTS(M) M(1) M(2) M(4) M(0)

// out[t][i] = (((H0 + H1) + H2) + …) · (1/hc).
template <int HCT>
__device__ __forceinline__ void stream_mean_body(const float* __restrict__ h, float* __restrict__ out, int hc_rt,
                                                 int D, long long total) {
    const int hc = HCT ? HCT : hc_rt;
    const float inv = 1.0f / (float)hc;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long t = e / D, i = e % D;
        const float* p = h + t * hc * D + i;
        float v = p[0];
#pragma unroll
        for (int s = 1; s < hc; ++s) v = __fadd_rn(v, p[(long long)s * D]);
        out[e] = __fmul_rn(v, inv);
    }
}
#define STREAM_MEAN(HCT)                                                                          \
    extern "C" __global__ void stream_mean_##HCT(const float* h, float* out, int hc, int D,       \
                                                 long long total) { PDL_ENTER();                  \
        stream_mean_body<HCT>(h, out, hc, D, total);                                              \
    }
HC_VARIANTS(STREAM_MEAN)

// One destination stream's element of hc_post, post_d·yv + Σ_s comb_row[s]·H[s] (H at stride D),
// each product and sum rounded on its own in the reference's order. hc_post and the fused
// partial pass of hc_pre both use it, so H' has the same bits either way.
__device__ __forceinline__ float hc_post_elem(float post_d, float yv, const float* __restrict__ comb_row,
                                              const float* __restrict__ hp, int hc, long long D) {
    float o = __fmul_rn(post_d, yv);
#pragma unroll
    for (int s = 0; s < hc; ++s) o = __fadd_rn(o, __fmul_rn(comb_row[s], hp[s * D]));
    return o;
}

// One thread per (t, i): out[t][d][i] = post[t][d]·y[t][i] + Σ_s comb[t][d][s]·H[t][s][i].
template <int HCT>
__device__ __forceinline__ void hc_post_body(const float* __restrict__ y, const float* __restrict__ h,
                                             const float* __restrict__ post, const float* __restrict__ comb,
                                             float* __restrict__ out, int hc_rt, int D, long long total) {
    const int hc = HCT ? HCT : hc_rt;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long t = e / D, i = e % D;
        const float yv = y[e];
        const float* hp = h + t * hc * D + i;
        const float* cp = comb + t * hc * hc;
#pragma unroll
        for (int d = 0; d < hc; ++d)
            out[(t * hc + d) * D + i] = hc_post_elem(post[t * hc + d], yv, cp + d * hc, hp, hc, D);
    }
}
#define HC_POST(HCT)                                                                              \
    extern "C" __global__ void hc_post_##HCT(const float* y, const float* h, const float* post,  \
                                             const float* comb, float* out, int hc, int D,        \
                                             long long total) { PDL_ENTER();                      \
        hc_post_body<HCT>(y, h, post, comb, out, hc, D, total);                                   \
    }
HC_VARIANTS(HC_POST)

// ---------------------------------------------------------------------------------------------
// hc_pre, split across the chip (DESIGN §6): the 2hc+hc² mixes of a token are dots over its
// hc·D values. Kernel 1 gives every block one column segment of `fn` and up to TB tokens and
// writes partial dots and a partial sum of squares to scratch as part[t][K+1][splits] (row
// K: the sums of squares), so a quantity's partials are contiguous; kernel 2 finishes (RMS
// scale, gates, Sinkhorn, collapse). Partials are summed in a fixed order: no atomics, same
// bits on every run. The mixes are (Σ fn·f)·r rather than Σ fn·(f·r): one pass over the streams.

// Eight fn values of row k from column j (j a multiple of 8, 16-byte aligned).
template <bool BF>
__device__ __forceinline__ void fn8(const void* fn, long long off, float (&w)[8]) {
    if constexpr (BF) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(fn) + off));
        const unsigned q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = __uint_as_float(q[i] << 16);
            w[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
        }
    } else {
        const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(fn) + off);
        const float4 a = __ldg(p), b = __ldg(p + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
}

template <bool BF>
__device__ __forceinline__ float fn1(const void* fn, long long off) {
    if constexpr (BF) {
        return __uint_as_float(((unsigned)reinterpret_cast<const unsigned short*>(fn)[off]) << 16);
    } else {
        return reinterpret_cast<const float*>(fn)[off];
    }
}

// grid (splits, ceil(n/TB)), block 256. part: [n][K+1][splits].
template <bool BF, bool VEC, int TB>
__device__ __forceinline__ void pre_partial(const float* __restrict__ h, const void* __restrict__ fn,
                                            float* __restrict__ part, int n, int W, int K, int L) {
    __shared__ float red[8][TB];
    const int sp = blockIdx.x, splits = gridDim.x, t0 = blockIdx.y * TB;
    const int s0 = sp * L, s1 = min(W, s0 + L);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    float q[TB];
#pragma unroll
    for (int t = 0; t < TB; ++t) q[t] = 0.f;
    for (int j = s0 + threadIdx.x; j < s1; j += 256) {
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            if (t0 + t < n) {
                const float v = h[(long long)(t0 + t) * W + j];
                q[t] = fmaf(v, v, q[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        const float v = warp_sum(q[t]);
        if (lane == 0) red[warp][t] = v;
    }
    __syncthreads();
    if (threadIdx.x < TB && t0 + threadIdx.x < n) {
        float v = 0.f;
        for (int w = 0; w < 8; ++w) v += red[w][threadIdx.x];
        part[((long long)(t0 + threadIdx.x) * (K + 1) + K) * splits + sp] = v;
    }

    for (int k = warp; k < K; k += 8) {
        float a[TB];
#pragma unroll
        for (int t = 0; t < TB; ++t) a[t] = 0.f;
        const long long row = (long long)k * W;
        if constexpr (VEC) {
            for (int j = s0 + 8 * lane; j < s1; j += 256) {
                float w[8];
                fn8<BF>(fn, row + j, w);
#pragma unroll
                for (int t = 0; t < TB; ++t) {
                    if (t0 + t < n) {
                        const float4* hp = reinterpret_cast<const float4*>(h + (long long)(t0 + t) * W + j);
                        const float4 x0 = __ldg(hp), x1 = __ldg(hp + 1);
                        float r = a[t];
                        r = fmaf(w[0], x0.x, r); r = fmaf(w[1], x0.y, r); r = fmaf(w[2], x0.z, r); r = fmaf(w[3], x0.w, r);
                        r = fmaf(w[4], x1.x, r); r = fmaf(w[5], x1.y, r); r = fmaf(w[6], x1.z, r); r = fmaf(w[7], x1.w, r);
                        a[t] = r;
                    }
                }
            }
        } else {
            for (int j = s0 + lane; j < s1; j += 32) {
                const float w = fn1<BF>(fn, row + j);
#pragma unroll
                for (int t = 0; t < TB; ++t)
                    if (t0 + t < n) a[t] = fmaf(w, h[(long long)(t0 + t) * W + j], a[t]);
            }
        }
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            const float v = warp_sum(a[t]);
            if (lane == 0 && t0 + t < n) part[((long long)(t0 + t) * (K + 1) + k) * splits + sp] = v;
        }
    }
}

#define PRE_PARTIAL(NAME, BF, VEC, TB)                                                            \
    extern "C" __global__ void __launch_bounds__(256) hc_pre_partial_##NAME(                      \
        const float* h, const void* fn, float* part, int n, int W, int K, int L) { PDL_ENTER();   \
        pre_partial<BF, VEC, TB>(h, fn, part, n, W, K, L);                                         \
    }
PRE_PARTIAL(bf16_vec_1, true, true, 1)
PRE_PARTIAL(bf16_vec_8, true, true, 8)
PRE_PARTIAL(bf16_any_1, true, false, 1)
PRE_PARTIAL(bf16_any_8, true, false, 8)
PRE_PARTIAL(f32_vec_1, false, true, 1)
PRE_PARTIAL(f32_vec_8, false, true, 8)
PRE_PARTIAL(f32_any_1, false, false, 1)
PRE_PARTIAL(f32_any_8, false, false, 8)

// The fast partial pass (hc·D a multiple of 8, aligned views, small K): every thread of
// the block takes (mix k, 8-column unit u) pairs of the segment, so all of the segment's
// fn bytes are requested at once (one memory latency); the per-unit products meet in
// shared memory and are summed in unit order. Dynamic shared: TB·(K+1)·U floats.
//
// POST: the block first forms its segment of H' = hc_post(y, H, post, comb) for its tokens,
// element by element in hc_post's rounding order (so H' has hc_post's bits), writes it to h
// (the new residual streams) and keeps it in shared memory for the dots: hc_post's own launch
// and its round trip through memory disappear. Dynamic shared then adds TB·8U floats (after
// rounding the partial products up to a 16-byte boundary).
template <bool G>
__device__ __forceinline__ float4 ld4(const float4* p) {
    if constexpr (G) return __ldg(p);
    else return *p;
}

// ROUTED (with POST): y is not read but formed, each element as the MoE's top-k sum forms it
// (topk_routed_elem, the routes of the block's tokens found by one scan of route_slot into
// shared memory after H'), so the top-k sum has no launch of its own either.
struct PairsRouted {
    const float* rows;       // [R][D] the routes' outputs
    const int* route_slot;   // [R]
    const float* weights;    // [n][top_k]
    const float* addend;     // [n][D] or null
    int n_routes, top_k;
};

template <bool BF, int TB, bool POST, bool ROUTED = false>
__device__ __forceinline__ void pre_pairs(float* __restrict__ h, const void* __restrict__ fn,
                                          float* __restrict__ part, int n, int W, int K, int L,
                                          const float* __restrict__ y, const float* __restrict__ hin,
                                          const float* __restrict__ post, const float* __restrict__ comb,
                                          int hc, int D, PairsRouted rt = PairsRouted{}) {
    extern __shared__ float pair_smem[];
    const int sp = blockIdx.x, splits = gridDim.x, t0 = blockIdx.y * TB;
    const int s0 = sp * L, U = (min(W, s0 + L) - s0) >> 3;
    float* dots = pair_smem;              // [TB][K][U]
    float* sq = pair_smem + TB * K * U;   // [TB][U]
    // POST: [TB][8U], this segment of H', 16-byte aligned for its float4 reads.
    float* hs = pair_smem + ((TB * (K + 1) * U + 3) & ~3);
    if constexpr (POST) {
        // ROUTED: [TB][top_k] the route of each of the block's slots (-1: none), after H'.
        int* inv = reinterpret_cast<int*>(hs + TB * 8 * U);
        if constexpr (ROUTED) {
            for (int j = threadIdx.x; j < TB * rt.top_k; j += blockDim.x) inv[j] = -1;
            __syncthreads();
            const long long lo = (long long)t0 * rt.top_k, hi = lo + (long long)TB * rt.top_k;
            for (int r = threadIdx.x; r < rt.n_routes; r += blockDim.x) {
                const long long sl = rt.route_slot[r];
                if (sl >= lo && sl < hi) inv[sl - lo] = r;
            }
            __syncthreads();
        }
        for (int p = threadIdx.x; p < TB * 8 * U; p += blockDim.x) {
            const int t = p / (8 * U), c = p - t * 8 * U;
            if (t0 + t >= n) continue;
            const long long tt = t0 + t;
            const int col = s0 + c, d = col / D, i = col - d * D;
            float yv;
            if constexpr (ROUTED)
                yv = topk_routed_elem(rt.rows, inv + t * rt.top_k, rt.weights + tt * rt.top_k,
                                      rt.addend ? rt.addend + tt * D : nullptr, rt.top_k, i, D);
            else
                yv = y[tt * D + i];
            const float o = hc_post_elem(post[tt * hc + d], yv, comb + tt * hc * hc + d * hc,
                                         hin + tt * W + i, hc, D);
            hs[p] = o;
            h[tt * W + col] = o;
        }
        __syncthreads();
    }
    // Where a token's segment of the streams is read from: shared memory (POST) or global.
    auto seg = [&](int t) -> const float* {
        if constexpr (POST) return hs + t * 8 * U;
        else return h + (long long)(t0 + t) * W + s0;
    };
    const int pairs = K * U;
    for (int p0 = threadIdx.x; p0 < pairs; p0 += 2 * blockDim.x) {
        const int p1 = p0 + blockDim.x;
        const bool two = p1 < pairs;
        float w0[8], w1[8];
        const int k0 = p0 / U, u0 = p0 % U, k1 = p1 / U, u1 = p1 % U;
        fn8<BF>(fn, (long long)k0 * W + s0 + 8 * u0, w0);
        if (two) fn8<BF>(fn, (long long)k1 * W + s0 + 8 * u1, w1);
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            if (t0 + t < n) {
                const float* ht = seg(t);
                const float4* a = reinterpret_cast<const float4*>(ht + 8 * u0);
                const float4 x0 = ld4<!POST>(a), x1 = ld4<!POST>(a + 1);
                float r = w0[0] * x0.x;
                r = fmaf(w0[1], x0.y, r); r = fmaf(w0[2], x0.z, r); r = fmaf(w0[3], x0.w, r);
                r = fmaf(w0[4], x1.x, r); r = fmaf(w0[5], x1.y, r); r = fmaf(w0[6], x1.z, r); r = fmaf(w0[7], x1.w, r);
                dots[(t * K + k0) * U + u0] = r;
                if (two) {
                    const float4* c = reinterpret_cast<const float4*>(ht + 8 * u1);
                    const float4 y0 = ld4<!POST>(c), y1 = ld4<!POST>(c + 1);
                    float z = w1[0] * y0.x;
                    z = fmaf(w1[1], y0.y, z); z = fmaf(w1[2], y0.z, z); z = fmaf(w1[3], y0.w, z);
                    z = fmaf(w1[4], y1.x, z); z = fmaf(w1[5], y1.y, z); z = fmaf(w1[6], y1.z, z); z = fmaf(w1[7], y1.w, z);
                    dots[(t * K + k1) * U + u1] = z;
                }
            }
        }
    }
    for (int p = threadIdx.x; p < TB * U; p += blockDim.x) {
        const int t = p / U, u = p % U;
        float q = 0.f;
        if (t0 + t < n) {
            const float4* a = reinterpret_cast<const float4*>(seg(t) + 8 * u);
            const float4 x0 = ld4<!POST>(a), x1 = ld4<!POST>(a + 1);
            q = x0.x * x0.x;
            q = fmaf(x0.y, x0.y, q); q = fmaf(x0.z, x0.z, q); q = fmaf(x0.w, x0.w, q);
            q = fmaf(x1.x, x1.x, q); q = fmaf(x1.y, x1.y, q); q = fmaf(x1.z, x1.z, q); q = fmaf(x1.w, x1.w, q);
        }
        sq[p] = q;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < TB * (K + 1); p += blockDim.x) {
        const int t = p / (K + 1), k = p % (K + 1);
        if (t0 + t >= n) continue;
        const float* src = k < K ? dots + (t * K + k) * U : sq + t * U;
        float v = 0.f;
        for (int u = 0; u < U; ++u) v += src[u];
        part[((long long)(t0 + t) * (K + 1) + k) * splits + sp] = v;
    }
}

#define PRE_PAIRS(NAME, BF, TB)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) hc_pre_pairs_##NAME(                        \
        const float* h, const void* fn, float* part, int n, int W, int K, int L) { PDL_ENTER();   \
        pre_pairs<BF, TB, false>(const_cast<float*>(h), fn, part, n, W, K, L, nullptr, nullptr,   \
                                 nullptr, nullptr, 0, 1);                                         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) hc_post_pre_pairs_##NAME(                   \
        const float* y, const float* hin, const float* post, const float* comb, float* h,         \
        const void* fn, float* part, int n, int W, int K, int L, int hc, int D) {                 \
        PDL_ENTER();                                                                              \
        pre_pairs<BF, TB, true>(h, fn, part, n, W, K, L, y, hin, post, comb, hc, D);              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) hc_post_pre_pairs_routed_##NAME(            \
        const float* rows, const int* route_slot, const float* weights, const float* addend,      \
        int n_routes, int top_k, const float* hin, const float* post, const float* comb,          \
        float* h, const void* fn, float* part, int n, int W, int K, int L, int hc, int D) {       \
        PDL_ENTER();                                                                              \
        pre_pairs<BF, TB, true, true>(h, fn, part, n, W, K, L, nullptr, hin, post, comb, hc, D,   \
                                      PairsRouted{rows, route_slot, weights, addend, n_routes,    \
                                                  top_k});                                        \
    }
PRE_PAIRS(bf16_1, true, 1)
PRE_PAIRS(bf16_8, true, 8)
PRE_PAIRS(f32_1, false, 1)
PRE_PAIRS(f32_8, false, 8)

// ---------------------------------------------------------------------------------------------
// The partial pass for many tokens (hc = 4, 24 mixes, bf16 fn, D a multiple of 32): the mixes
// of 16 tokens are a 16×24 product over the W = 4D columns, run on the tensor cores.
// grid (splits, ceil(n/16)), block 256: every warp takes 32-column chunks i0..i0+31 of all four
// streams for the block's 16 tokens; lane (g, q) holds columns 8q..8q+7 of tokens g and g+8.
// A dot does not care in which order its columns meet, so k-step j of an m16n8k8 mma pairs
// A's column q with the lane's column 8q+j and q+4 with 8q+4+j; B's rows follow the same map,
// which makes a lane's B fragment of mix row 8·nt+g one 16-byte load of fn. fn is bf16, exact
// in tf32; H is split as tf32(H) + tf32(H − tf32(H)) (22 of its 24 bits), two mma each, f32
// sums: f32-class mixes. POST forms H' = hc_post(y, H, post, comb) element by element in
// hc_post's order first (its bits), writes it, and uses it for the dots.
#define ROWS_HC 4
#define ROWS_K 24
#define ROWS_TT 16

__device__ __forceinline__ unsigned rows_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void rows_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Element e (0..7) of eight bf16 packed in a uint4, as f32 bits (exact as tf32).
__device__ __forceinline__ unsigned bf16_bits(const uint4& v, int e) {
    const unsigned w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
    return (e & 1) ? (w & 0xffff0000u) : (w << 16);
}

__device__ __forceinline__ void ld8(const float* p, float (&v)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void st8(float* p, const float (&v)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <bool POST>
__device__ __forceinline__ void pre_rows(float* __restrict__ h, const unsigned short* __restrict__ fn,
                                         float* __restrict__ part, int n, int D, int cpw,
                                         const float* __restrict__ y, const float* __restrict__ hin,
                                         const float* __restrict__ post, const float* __restrict__ comb) {
    __shared__ float pc[ROWS_TT][ROWS_HC + ROWS_HC * ROWS_HC];  // POST: a token's post, then comb
    __shared__ float red[8][ROWS_TT][ROWS_K + 1];               // per warp: mixes, sum of squares
    const int sp = blockIdx.x, splits = gridDim.x, t0 = blockIdx.y * ROWS_TT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const long long W = (long long)ROWS_HC * D;
    const int nchunks = D >> 5;
    const int rows[2] = {t0 + g, t0 + g + 8};
    const bool live[2] = {rows[0] < n, rows[1] < n};
    if constexpr (POST) {
        constexpr int E = ROWS_HC + ROWS_HC * ROWS_HC;
        for (int p = threadIdx.x; p < ROWS_TT * E; p += blockDim.x) {
            const int tok = p / E, e = p % E, tt = t0 + tok;
            pc[tok][e] = tt < n ? (e < ROWS_HC ? post[(long long)tt * ROWS_HC + e]
                                               : comb[(long long)tt * ROWS_HC * ROWS_HC + e - ROWS_HC])
                                : 0.f;
        }
        __syncthreads();
    }
    float acc[3][4];
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
    float ss[2] = {0.f, 0.f};

    for (int c = 0; c < cpw; ++c) {
        const int chunk = (sp * cpw + c) * 8 + warp;
        if (chunk >= nchunks) break;
        const int i = chunk * 32 + 8 * q;
        // src[r][s]: stream s of token r at columns i..i+7 (H, or the H that H' is formed from).
        float src[2][ROWS_HC][8];
        float yv[2][8];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float* base = (POST ? hin : h) + rows[r] * W + i;
#pragma unroll
            for (int s = 0; s < ROWS_HC; ++s) {
                if (live[r]) ld8(base + (long long)s * D, src[r][s]);
                else
#pragma unroll
                    for (int e = 0; e < 8; ++e) src[r][s][e] = 0.f;
            }
            if constexpr (POST) {
                if (live[r]) ld8(y + (long long)rows[r] * D + i, yv[r]);
                else
#pragma unroll
                    for (int e = 0; e < 8; ++e) yv[r][e] = 0.f;
            }
        }
#pragma unroll
        for (int d = 0; d < ROWS_HC; ++d) {
            uint4 f[3];
#pragma unroll
            for (int nt = 0; nt < 3; ++nt)
                f[nt] = __ldg(reinterpret_cast<const uint4*>(fn + (long long)(8 * nt + g) * W + (long long)d * D + i));
            // x[r]: stream d of token r, the values the dots read.
            float x[2][8];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if constexpr (POST) {
                    const float* pr = pc[g + 8 * r];
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        float o = __fmul_rn(pr[d], yv[r][e]);
#pragma unroll
                        for (int s = 0; s < ROWS_HC; ++s)
                            o = __fadd_rn(o, __fmul_rn(pr[ROWS_HC + d * ROWS_HC + s], src[r][s][e]));
                        x[r][e] = o;
                    }
                    if (live[r]) st8(h + rows[r] * W + (long long)d * D + i, x[r]);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) x[r][e] = src[r][d][e];
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) ss[r] = fmaf(x[r][e], x[r][e], ss[r]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned hi[4], lo[4];
                const float av[4] = {x[0][j], x[1][j], x[0][4 + j], x[1][4 + j]};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    hi[e] = rows_tf32(av[e]);
                    lo[e] = rows_tf32(av[e] - __uint_as_float(hi[e]));
                }
#pragma unroll
                for (int nt = 0; nt < 3; ++nt) {
                    const unsigned b0 = bf16_bits(f[nt], j), b1 = bf16_bits(f[nt], 4 + j);
                    rows_mma(acc[nt], hi[0], hi[1], hi[2], hi[3], b0, b1);
                    rows_mma(acc[nt], lo[0], lo[1], lo[2], lo[3], b0, b1);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 1);
        ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 2);
    }
#pragma unroll
    for (int nt = 0; nt < 3; ++nt) {
        red[warp][g][8 * nt + 2 * q] = acc[nt][0];
        red[warp][g][8 * nt + 2 * q + 1] = acc[nt][1];
        red[warp][g + 8][8 * nt + 2 * q] = acc[nt][2];
        red[warp][g + 8][8 * nt + 2 * q + 1] = acc[nt][3];
    }
    if (q == 0) {
        red[warp][g][ROWS_K] = ss[0];
        red[warp][g + 8][ROWS_K] = ss[1];
    }
    __syncthreads();
    for (int p = threadIdx.x; p < ROWS_TT * (ROWS_K + 1); p += blockDim.x) {
        const int tok = p / (ROWS_K + 1), k = p % (ROWS_K + 1);
        if (t0 + tok >= n) continue;
        float v = red[0][tok][k];
#pragma unroll
        for (int w = 1; w < 8; ++w) v += red[w][tok][k];
        part[((long long)(t0 + tok) * (ROWS_K + 1) + k) * splits + sp] = v;
    }
}

extern "C" __global__ void __launch_bounds__(256) hc_pre_rows(const float* h, const unsigned short* fn, float* part,
                                                              int n, int D, int cpw) {
    PDL_ENTER();
    pre_rows<false>(const_cast<float*>(h), fn, part, n, D, cpw, nullptr, nullptr, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) hc_post_pre_rows(const float* y, const float* hin, const float* post,
                                                                   const float* comb, float* h,
                                                                   const unsigned short* fn, float* part, int n,
                                                                   int D, int cpw) {
    PDL_ENTER();
    pre_rows<true>(h, fn, part, n, D, cpw, y, hin, post, comb);
}

__device__ __forceinline__ float sigmoid_ref(float z) { return 1.0f / (1.0f + expf(-z)); }

// Total of quantity k (row k of the token's partials, K = the sum of squares): each lane
// adds its splits lane, lane+32, … in order, then a fixed butterfly. Every block that needs
// a total computes it the same way, so the RMS scale has the same bits everywhere.
__device__ __forceinline__ float pre_total(const float* __restrict__ p, int splits, int lane) {
    float a = 0.f;
    for (int sp0 = 0; sp0 < splits; sp0 += 128) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // all four loads in flight together
            const int sp = sp0 + lane + 32 * j;
            v[j] = sp < splits ? p[sp] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) a += v[j];
    }
    return warp_sum(a);
}

// grid (n, cb + 1), block 1024, dynamic shared (K + 1 + hc²) floats. Blocks y < cb collapse
// a slice of D; block y == cb computes post and comb. Every warp of a block totals the
// quantities it needs straight from the partials (one memory latency, one barrier), and
// the Sinkhorn chain runs on one warp in registers while the collapse blocks work.
template <int HCT>
__device__ __forceinline__ void finish_body(const float* __restrict__ h, const float* __restrict__ part,
                                            const float* __restrict__ base, const float* __restrict__ scale,
                                            float* __restrict__ x, float* __restrict__ post,
                                            float* __restrict__ comb, int hc_rt, int D, int K, int splits,
                                            float rms_eps, float hc_eps, float clamp, int iters, int cb,
                                            const float* __restrict__ norm_w, float norm_eps) {
    extern __shared__ float fin_smem[];
    const int hc = HCT ? HCT : hc_rt;
    float* tot = fin_smem;   // K+1 totals (K: the sum of squares)
    float* M = tot + K + 1;  // hc² Sinkhorn matrix, or hc pre gates
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    const bool gates = blockIdx.y == cb;
    const long long W = (long long)hc * D;

    const float* pt = part + (long long)t * (K + 1) * splits;
    // The collapse needs the pre mixes (0..hc) and the sum of squares; the gates the rest.
    const int kneed = gates ? K + 1 : hc + 1;
    for (int q = warp; q < kneed; q += nwarps) {
        const int k = gates ? q : (q == hc ? K : q);
        const float a = pre_total(pt + (long long)k * splits, splits, lane);
        if (lane == 0) tot[k] = a;
    }
    __syncthreads();
    const float r = 1.0f / sqrtf(tot[K] / (float)W + rms_eps);
    const float s0 = scale[0], s1 = scale[1], s2 = scale[2];

    if (!gates) {
        if (threadIdx.x < hc)
            M[threadIdx.x] = sigmoid_ref(__fadd_rn(__fmul_rn(tot[threadIdx.x] * r, s0), base[threadIdx.x]));
        __syncthreads();
        const float* hp = h + (long long)t * W;
        float* xt = x + (long long)t * D;
        const int nthr = cb * blockDim.x;
        const int i0 = blockIdx.y * blockDim.x + threadIdx.x;
        // 16-byte loads when every stream row and the output row are 16-byte aligned.
        const bool vec = (D & 3) == 0 && ((unsigned long long)hp & 15) == 0 && ((unsigned long long)xt & 15) == 0;
        if (norm_w) {
            // The sub-layer's RMSNorm fused in (the host launches this only with 16-byte
            // views, cb == 1 and D/4 <= blockDim): one float4 of x a thread, its sum of
            // squares in the RmsNorm kernel's per-thread order, warps added in warp order.
            __shared__ float red[32];
            const int i = threadIdx.x, D4 = D >> 2;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < D4) {
                const float4 a = __ldg(reinterpret_cast<const float4*>(hp) + i);
                v = make_float4(__fmul_rn(M[0], a.x), __fmul_rn(M[0], a.y), __fmul_rn(M[0], a.z),
                                __fmul_rn(M[0], a.w));
                for (int s = 1; s < hc; ++s) {
                    const float4 b = __ldg(reinterpret_cast<const float4*>(hp + (long long)s * D) + i);
                    v.x = __fadd_rn(v.x, __fmul_rn(M[s], b.x));
                    v.y = __fadd_rn(v.y, __fmul_rn(M[s], b.y));
                    v.z = __fadd_rn(v.z, __fmul_rn(M[s], b.z));
                    v.w = __fadd_rn(v.w, __fmul_rn(M[s], b.w));
                }
            }
            float ss = 0.f;
            ss += __fmul_rn(v.x, v.x);
            ss += __fmul_rn(v.y, v.y);
            ss += __fmul_rn(v.z, v.z);
            ss += __fmul_rn(v.w, v.w);
            ss = warp_sum(ss);
            if (lane == 0) red[warp] = ss;
            __syncthreads();
            float all = 0.f;
            for (int w = 0; w < nwarps; ++w) all += red[w];
            const float ns = 1.0f / sqrtf(all / (float)D + norm_eps);
            if (i < D4) {
                const float4 g = __ldg(reinterpret_cast<const float4*>(norm_w) + i);
                reinterpret_cast<float4*>(xt)[i] =
                    make_float4(__fmul_rn(__fmul_rn(v.x, ns), g.x), __fmul_rn(__fmul_rn(v.y, ns), g.y),
                                __fmul_rn(__fmul_rn(v.z, ns), g.z), __fmul_rn(__fmul_rn(v.w, ns), g.w));
            }
            return;
        }
        if (vec) {
            const int D4 = D >> 2;
            for (int i = i0; i < D4; i += nthr) {
                float4 hv[HCT ? HCT : 1];
                float4 v;
                if constexpr (HCT > 0) {
#pragma unroll
                    for (int s = 0; s < HCT; ++s) hv[s] = __ldg(reinterpret_cast<const float4*>(hp + (long long)s * D) + i);
                    v = make_float4(__fmul_rn(M[0], hv[0].x), __fmul_rn(M[0], hv[0].y), __fmul_rn(M[0], hv[0].z),
                                    __fmul_rn(M[0], hv[0].w));
#pragma unroll
                    for (int s = 1; s < HCT; ++s) {
                        v.x = __fadd_rn(v.x, __fmul_rn(M[s], hv[s].x));
                        v.y = __fadd_rn(v.y, __fmul_rn(M[s], hv[s].y));
                        v.z = __fadd_rn(v.z, __fmul_rn(M[s], hv[s].z));
                        v.w = __fadd_rn(v.w, __fmul_rn(M[s], hv[s].w));
                    }
                } else {
                    const float4 a = __ldg(reinterpret_cast<const float4*>(hp) + i);
                    v = make_float4(__fmul_rn(M[0], a.x), __fmul_rn(M[0], a.y), __fmul_rn(M[0], a.z),
                                    __fmul_rn(M[0], a.w));
                    for (int s = 1; s < hc; ++s) {
                        const float4 b = __ldg(reinterpret_cast<const float4*>(hp + (long long)s * D) + i);
                        v.x = __fadd_rn(v.x, __fmul_rn(M[s], b.x));
                        v.y = __fadd_rn(v.y, __fmul_rn(M[s], b.y));
                        v.z = __fadd_rn(v.z, __fmul_rn(M[s], b.z));
                        v.w = __fadd_rn(v.w, __fmul_rn(M[s], b.w));
                    }
                }
                reinterpret_cast<float4*>(xt)[i] = v;
            }
        } else {
            for (int i = i0; i < D; i += nthr) {
                float v = __fmul_rn(M[0], hp[i]);
#pragma unroll
                for (int s = 1; s < hc; ++s) v = __fadd_rn(v, __fmul_rn(M[s], hp[(long long)s * D + i]));
                xt[i] = v;
            }
        }
        return;
    }

    if (threadIdx.x < hc) {
        const int d = threadIdx.x;
        post[(long long)t * hc + d] = 2.0f * sigmoid_ref(__fadd_rn(__fmul_rn(tot[hc + d] * r, s1), base[hc + d]));
    }
    if (hc * hc <= 32) {
        // One warp, lane e = hc·d + s holding M[d][s]: sums gather the row or column by
        // shuffles, in the reference's order, with no block barrier in the 40-step chain.
        // The divisions are the reciprocal-multiply form (≤ 2 ulp, about half the latency
        // of a rounded division on this serial chain); Sinkhorn steps do not amplify such
        // errors, so comb stays within a few ulp·iterations of the reference.
        if (warp != 0) return;
        const int e = lane, d = e / hc, s = e % hc;
        const bool live = e < hc * hc;
        float l = 0.f;
        if (live) {
            const int k = 2 * hc + e;
            l = __fadd_rn(__fmul_rn(tot[k] * r, s2), base[k]);
            l = l > clamp ? clamp : (l < -clamp ? -clamp : l);  // NaN passes, as in the reference
        }
        float mx = __int_as_float(0xff800000);
#pragma unroll
        for (int j = 0; j < hc; ++j) mx = fmaxf(mx, __shfl_sync(0xffffffffu, l, (d * hc + j) & 31));
        float v = expf(l - mx);
        for (int it = 0; it < iters; ++it) {
            float g[HCT ? HCT : 1];
            float den = 0.f;
            if constexpr (HCT > 0) {
                // All hc shuffles issued before the adds, which then run in source order.
#pragma unroll
                for (int j = 0; j < HCT; ++j) g[j] = __shfl_sync(0xffffffffu, v, (d * HCT + j) & 31);
#pragma unroll
                for (int j = 0; j < HCT; ++j) den = __fadd_rn(den, g[j]);
            } else {
                for (int j = 0; j < hc; ++j) den = __fadd_rn(den, __shfl_sync(0xffffffffu, v, (d * hc + j) & 31));
            }
            v = __fdividef(v, __fadd_rn(den, hc_eps));
            den = 0.f;
            if constexpr (HCT > 0) {
#pragma unroll
                for (int j = 0; j < HCT; ++j) g[j] = __shfl_sync(0xffffffffu, v, (j * HCT + s) & 31);
#pragma unroll
                for (int j = 0; j < HCT; ++j) den = __fadd_rn(den, g[j]);
            } else {
                for (int j = 0; j < hc; ++j) den = __fadd_rn(den, __shfl_sync(0xffffffffu, v, (j * hc + s) & 31));
            }
            v = __fdividef(v, __fadd_rn(den, hc_eps));
        }
        if (live) comb[(long long)t * hc * hc + e] = v;
        return;
    }
    const int d = threadIdx.x;
    if (d < hc) {
        float* row = M + d * hc;
        float mx = __int_as_float(0xff800000);
        for (int s = 0; s < hc; ++s) {
            const int k = 2 * hc + hc * d + s;
            float l = __fadd_rn(__fmul_rn(tot[k] * r, s2), base[k]);
            l = l > clamp ? clamp : (l < -clamp ? -clamp : l);
            row[s] = l;
            mx = fmaxf(mx, l);
        }
        for (int s = 0; s < hc; ++s) row[s] = expf(row[s] - mx);
    }
    __syncthreads();
    for (int it = 0; it < iters; ++it) {
        if (d < hc) {  // normalise destination row d over its sources
            float* row = M + d * hc;
            float den = 0.f;
            for (int s = 0; s < hc; ++s) den = __fadd_rn(den, row[s]);
            den = __fadd_rn(den, hc_eps);
            for (int s = 0; s < hc; ++s) row[s] = row[s] / den;
        }
        __syncthreads();
        if (d < hc) {  // normalise source column d over its destinations
            float den = 0.f;
            for (int e = 0; e < hc; ++e) den = __fadd_rn(den, M[e * hc + d]);
            den = __fadd_rn(den, hc_eps);
            for (int e = 0; e < hc; ++e) M[e * hc + d] = M[e * hc + d] / den;
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < hc * hc; e += blockDim.x) comb[(long long)t * hc * hc + e] = M[e];
}

#define PRE_FINISH(HCT)                                                                           \
    extern "C" __global__ void __launch_bounds__(1024) hc_pre_finish_##HCT(                       \
        const float* h, const float* part, const float* base, const float* scale,                 \
        float* x, float* post, float* comb, int hc, int D, int K, int splits, float rms_eps,       \
        float hc_eps, float clamp, int iters, int cb, const float* norm_w, float norm_eps) {      \
        PDL_ENTER();                                                                              \
        finish_body<HCT>(h, part, base, scale, x, post, comb, hc, D, K, splits, rms_eps,           \
                         hc_eps, clamp, iters, cb, norm_w, norm_eps);                             \
    }
HC_VARIANTS(PRE_FINISH)
