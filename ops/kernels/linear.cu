// y[n, O] = x[n, K] · W[O, K]ᵀ, W stored as F32/F16/BF16/Q8_0/Q6_K/IQ4_NL, x and y f32.
// Prepended with dequant.cuh.
//
// Three paths, chosen on the host (ops/src/linear.rs), plus two decode kernels described
// where they are defined (gemv_iq4_nl_rows_* for IQ4_NL, gemv_bf16_dec_* for one BF16 token):
// * gemv_<type>_<NT> (n ≤ 8): each warp owns whole weight rows (grid-strided over the
//   rows so a small matrix still covers the chip and a large one pipelines). A row is
//   streamed in chunks of whole blocks, staged into the warp's shared memory with
//   16-byte cp.async (the chunk's aligned cover; blocks of 18/34/210 bytes are not
//   16-byte aligned themselves), double-buffered so the next chunk is in flight while
//   this one is decoded. Weights are decoded in registers and dotted with all n tokens
//   in f32; the lanes' partial sums meet in a fixed butterfly, so results are
//   deterministic.
// * linear_tc_<type> (n > 8, K % 32 == 0): 64×64 output tiles on the tensor cores. A
//   32-wide K slice of the weight tile is decoded once into shared memory as bf16 and
//   reused by 64 tokens; x is narrowed to bf16 (BF16 tolerance; both are O(1)-scaled
//   sub-layer operands and bf16 keeps f32's range). The next slice's global loads are
//   issued before this slice's MMAs.
// * linear_generic (anything else: odd widths, misaligned views): a warp per row,
//   element-wise decode. Correct for every shape, not fast.
#include <mma.h>

#define GEMV_WARPS 4
#define GEMV_STAGE 4096
#define GEMV_SBUF (GEMV_STAGE + 32)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Unaligned reads from shared memory at a 2-byte-aligned address: whole aligned words,
// realigned by a funnel shift (the word past the end is read but its bits are shifted out
// when the address is 4-aligned).
template <int NW>
__device__ __forceinline__ void ld_words_a2(const unsigned char* p, unsigned (&out)[NW]) {
    const unsigned long long a = (unsigned long long)p;
    const unsigned* w = reinterpret_cast<const unsigned*>(a & ~3ull);
    const int sh = (int)(a & 3) * 8;
    unsigned cur = w[0];
#pragma unroll
    for (int i = 0; i < NW; ++i) {
        const unsigned nxt = w[i + 1];
        out[i] = __funnelshift_r(cur, nxt, sh);
        cur = nxt;
    }
}

__device__ __forceinline__ float4 ldx4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// acc[t] += Σ_{i<8} w[i] · x[t][k+i] for the n ≤ NT live tokens.
template <int NT>
__device__ __forceinline__ void dot8(float (&acc)[NT], const float (&w)[8], const float* __restrict__ x,
                                     int K, int n, int k) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n) {
            const float4 a = ldx4(x + (long long)t * K + k), b = ldx4(x + (long long)t * K + k + 4);
            float s = acc[t];
            s = fmaf(w[0], a.x, s); s = fmaf(w[1], a.y, s); s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
            s = fmaf(w[4], b.x, s); s = fmaf(w[5], b.y, s); s = fmaf(w[6], b.z, s); s = fmaf(w[7], b.w, s);
            acc[t] = s;
        }
    }
}

// Bytes and values of a block (the float types count one value a "block").
template <int WT> struct Tr;
template <> struct Tr<WT_F32> { static constexpr int BB = 4, BS = 1; };
template <> struct Tr<WT_F16> { static constexpr int BB = 2, BS = 1; };
template <> struct Tr<WT_BF16> { static constexpr int BB = 2, BS = 1; };
template <> struct Tr<WT_Q8_0> { static constexpr int BB = 34, BS = 32; };
template <> struct Tr<WT_IQ4_NL> { static constexpr int BB = 18, BS = 32; };
template <> struct Tr<WT_Q6_K> { static constexpr int BB = 210, BS = 256; };

// Σ_{i<8} w[i] · xp[i] (a block's partial, scaled by the caller).
__device__ __forceinline__ float part8(const float* w, const float* xp) {
    const float4 a = ldx4(xp), b = ldx4(xp + 4);
    float s = w[0] * a.x;
    s = fmaf(w[1], a.y, s); s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
    s = fmaf(w[4], b.x, s); s = fmaf(w[5], b.y, s); s = fmaf(w[6], b.z, s); s = fmaf(w[7], b.w, s);
    return s;
}

// One staged chunk: `nblk` blocks starting at column k0, bytes at `s` (shared memory).
// (Batching four units per lane before decoding was measured slower on the H200: IQ4_NL
// dense up 24 → 32 µs, q_a 5.3 → 6.1 µs; one unit at a time it is.)
template <int WT, int NT>
__device__ __forceinline__ void gemv_chunk(const unsigned char* s, int nblk, int k0, const float* __restrict__ x,
                                           int K, int n, int lane, const float* kq, float (&acc)[NT]) {
    if constexpr (WT == WT_F32) {
        const int nu = nblk / 4;
        for (int u = lane; u < nu; u += 32) {
            const float4 v = *reinterpret_cast<const float4*>(s + 16 * u);
            const int k = k0 + 4 * u;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n) {
                    const float4 a = ldx4(x + (long long)t * K + k);
                    float r = acc[t];
                    r = fmaf(v.x, a.x, r); r = fmaf(v.y, a.y, r); r = fmaf(v.z, a.z, r); r = fmaf(v.w, a.w, r);
                    acc[t] = r;
                }
            }
        }
    } else if constexpr (WT == WT_F16 || WT == WT_BF16) {
        const int nu = nblk / 8;
        for (int u = lane; u < nu; u += 32) {
            const uint4 v = *reinterpret_cast<const uint4*>(s + 16 * u);
            const unsigned q[4] = {v.x, v.y, v.z, v.w};
            float w[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if constexpr (WT == WT_BF16) {
                    w[2 * i] = __uint_as_float(q[i] << 16);
                    w[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
                } else {
                    w[2 * i] = h2f((unsigned short)(q[i] & 0xffffu));
                    w[2 * i + 1] = h2f((unsigned short)(q[i] >> 16));
                }
            }
            dot8<NT>(acc, w, x, K, n, k0 + 8 * u);
        }
    } else if constexpr (WT == WT_Q8_0 || WT == WT_IQ4_NL) {
        // Unit: 4 values of a block (eighths: Q8_0 bytes 4e..4e+3; IQ4_NL low nibbles of
        // bytes 4e.. for e < 4, high nibbles of bytes 4(e-4).. for e ≥ 4 — values 4e..4e+3
        // either way), so 8 lanes read one block's 128 bytes of x in one coalesced load.
        constexpr int BB = Tr<WT>::BB;
        const int nu = nblk * 8;
        for (int u = lane; u < nu; u += 32) {
            const int b = u >> 3, e = u & 7;
            const unsigned char* p = s + BB * b;
            const float d = h2f(ld_u16(p));
            unsigned q[1];
            float w[4];
            if constexpr (WT == WT_Q8_0) {
                ld_words_a2<1>(p + 2 + 4 * e, q);
#pragma unroll
                for (int i = 0; i < 4; ++i) w[i] = (float)(signed char)((q[0] >> (8 * i)) & 0xff);
            } else {
                ld_words_a2<1>(p + 2 + 4 * (e & 3), q);
                const int sh = (e >> 2) * 4;
#pragma unroll
                for (int i = 0; i < 4; ++i) w[i] = kq[(q[0] >> (8 * i + sh)) & 15];
            }
            const int k = k0 + 32 * b + 4 * e;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n) {
                    const float4 a = ldx4(x + (long long)t * K + k);
                    float r = w[0] * a.x;
                    r = fmaf(w[1], a.y, r); r = fmaf(w[2], a.z, r); r = fmaf(w[3], a.w, r);
                    acc[t] = fmaf(d, r, acc[t]);
                }
            }
        }
    } else {  // Q6_K: unit (block, half hf, 8-column group l0) covers values 128hf + 32q + l0 + i
        const int nu = nblk * 8;
        for (int u = lane; u < nu; u += 32) {
            const int b = u >> 3, v = u & 7, hf = v >> 2, l0 = (v & 3) * 8;
            const unsigned char* p = s + 210 * b;
            unsigned qa[2], qb[2], qh[2];
            ld_words_a2<2>(p + 64 * hf + l0, qa);
            ld_words_a2<2>(p + 64 * hf + 32 + l0, qb);
            ld_words_a2<2>(p + 128 + 32 * hf + l0, qh);
            const float d = h2f(ld_u16(p + 208));
            const unsigned char* sc = p + 192 + 8 * hf + (l0 >> 4);
            float w[32];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned a = (qa[i >> 2] >> (8 * (i & 3))) & 0xffu;
                const unsigned c = (qb[i >> 2] >> (8 * (i & 3))) & 0xffu;
                const unsigned h = (qh[i >> 2] >> (8 * (i & 3))) & 0xffu;
                w[i] = (float)((int)((a & 15) | ((h & 3) << 4)) - 32);
                w[8 + i] = (float)((int)((c & 15) | (((h >> 2) & 3) << 4)) - 32);
                w[16 + i] = (float)((int)((a >> 4) | (((h >> 4) & 3) << 4)) - 32);
                w[24 + i] = (float)((int)((c >> 4) | (((h >> 6) & 3) << 4)) - 32);
            }
            float ds[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) ds[q] = d * (float)(signed char)sc[2 * q];
            const int k = k0 + 256 * b + 128 * hf + l0;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n) {
                    const float* xp = x + (long long)t * K + k;
                    float r = acc[t];
                    r = fmaf(ds[0], part8(w, xp), r);
                    r = fmaf(ds[1], part8(w + 8, xp + 32), r);
                    r = fmaf(ds[2], part8(w + 16, xp + 64), r);
                    r = fmaf(ds[3], part8(w + 24, xp + 96), r);
                    acc[t] = r;
                }
            }
        }
    }
}

template <int WT, int NT>
__device__ __forceinline__ void gemv_body(const unsigned char* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int K, int O, long long RB) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    __shared__ float kq[16];
    if (threadIdx.x < 16) kq[threadIdx.x] = (float)iq4_code(threadIdx.x);
    __syncthreads();
    constexpr int BB = Tr<WT>::BB, BS = Tr<WT>::BS;
    constexpr int BPC = GEMV_STAGE / BB;  // blocks per chunk (a multiple of 8 for the float types)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned char* buf = gemv_smem + warp * 2 * GEMV_SBUF;
    const int nb = K / BS, nch = (nb + BPC - 1) / BPC;
    const int gw = blockIdx.x * GEMV_WARPS + warp, tw = gridDim.x * GEMV_WARPS;
    if (gw >= O) return;
    const int items = ((O - 1 - gw) / tw + 1) * nch;
    const unsigned char* wend = W + (long long)O * RB;

    auto chunk_src = [&](int it, int& nblk) -> const unsigned char* {
        const int row = gw + (it / nch) * tw, c = it % nch;
        nblk = min(BPC, nb - c * BPC);
        return W + (long long)row * RB + (long long)c * BPC * BB;
    };
    auto stage = [&](int it) {
        int nblk;
        const unsigned char* g = chunk_src(it, nblk);
        const unsigned char* a0 = reinterpret_cast<const unsigned char*>((unsigned long long)g & ~15ull);
        const int pieces = ((int)(g - a0) + nblk * BB + 15) >> 4;
        unsigned char* dst = buf + (it & 1) * GEMV_SBUF;
        for (int p = lane; p < pieces; p += 32) {
            const unsigned char* src = a0 + 16 * p;
            if (src + 16 <= wend) {
                cp_async16(dst + 16 * p, src);
            } else {
                for (int q = 0; q < 16; ++q) dst[16 * p + q] = src + q < wend ? src[q] : 0;
            }
        }
    };

    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
    stage(0);
    cp_async_commit();
    for (int it = 0; it < items; ++it) {
        if (it + 1 < items) stage(it + 1);
        cp_async_commit();
        cp_async_wait1();
        __syncwarp();
        int nblk;
        const unsigned char* g = chunk_src(it, nblk);
        const int c = it % nch;
        const unsigned char* s = buf + (it & 1) * GEMV_SBUF + ((unsigned long long)g & 15ull);
        gemv_chunk<WT, NT>(s, nblk, c * BPC * BS, x, K, n, lane, kq, acc);
        if (c == nch - 1) {
            const int row = gw + (it / nch) * tw;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const float v = warp_sum(acc[t]);
                if (lane == 0 && t < n) y[(long long)t * O + row] = v;
                acc[t] = 0.f;
            }
        }
        __syncwarp();
    }
}

// Eight token rows need more than the 80 registers six resident blocks leave (Q6_K spilled).
#define GEMV(NAME, WT, NT)                                                                         \
    extern "C" __global__ void __launch_bounds__(128, (NT) >= 8 ? 4 : 6)                          \
        gemv_##NAME##_##NT(const unsigned char* W, const float* x, float* y, int n, int K, int O, \
                           long long RB) {                                                        \
        PDL_ENTER();                                                                              \
        gemv_body<WT, NT>(W, x, y, n, K, O, RB);                                                  \
    }
#define GEMV_ALL(NAME, WT) GEMV(NAME, WT, 1) GEMV(NAME, WT, 2) GEMV(NAME, WT, 4) GEMV(NAME, WT, 8)
GEMV_ALL(f32, WT_F32)
GEMV_ALL(f16, WT_F16)
GEMV_ALL(bf16, WT_BF16)
GEMV_ALL(q8_0, WT_Q8_0)
GEMV_ALL(q6_k, WT_Q6_K)
GEMV_ALL(iq4_nl, WT_IQ4_NL)

// ---------------------------------------------------------------------------------------------
// Decode IQ4_NL GEMV (n ≤ 8, K a multiple of 256): iq4g_tile (dequant.cuh), one tile of RT
// rows a block, NR tokens' sums at once. Shared with the routed experts.
#define GEMV_IQ4_ROWS(NR)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) gemv_iq4_nl_rows_##NR(                   \
        const unsigned char* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,  \
        int n, int K, int O, long long RB, int RT, int KP) {                                      \
        PDL_ENTER();                                                                              \
        (void)RB;                                                                                 \
        iq4g_tile<NR>(W, nullptr, x, nullptr, y, K, O, n, 0, n, blockIdx.x * RT, RT, KP);         \
    }
GEMV_IQ4_ROWS(1)
GEMV_IQ4_ROWS(2)
GEMV_IQ4_ROWS(4)
GEMV_IQ4_ROWS(8)

// ---------------------------------------------------------------------------------------------
// Decode (n = 1) BF16 GEMV, K a multiple of 8 (whole 16-byte units). A block of S warps takes
// R rows, each warp the units u ≡ lane + 32·warp (mod 32·S) of every row, so its lanes read
// 512 contiguous bytes an instruction. Every lane issues all of its R·JU 16-byte weight loads
// before its first FMA (a whole row in flight at once: the small projections are latency-
// bound), and each x unit is loaded once (L1) for the R rows. Lane sums meet in a fixed
// butterfly and the warps' sums in shared memory in warp order, so results are deterministic.
template <int JU, int R>
__device__ __forceinline__ void gemv_bf16_dec_body(const unsigned char* __restrict__ W,
                                                   const float* __restrict__ x, float* __restrict__ y,
                                                   int K, int O, long long RB) {
    __shared__ float red[8 * R];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, S = blockDim.x >> 5;
    const int u = K >> 3;
    const long long r0 = (long long)blockIdx.x * R;
    uint4 w[R][JU];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < JU; ++j) {
            const int i = lane + 32 * (warp + S * j);
            w[r][j] = (i < u && r0 + r < O)
                          ? __ldg(reinterpret_cast<const uint4*>(W + (r0 + r) * RB) + i)
                          : make_uint4(0u, 0u, 0u, 0u);
        }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
    for (int j = 0; j < JU; ++j) {
        // Past the row's end the weights are zero and x reads as zero (no branch, so the
        // weight loads above stay ahead of everything).
        const int i = lane + 32 * (warp + S * j);
        const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 a = i < u ? ldx4(x + 8 * i) : z4, b = i < u ? ldx4(x + 8 * i + 4) : z4;
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const unsigned q[4] = {w[r][j].x, w[r][j].y, w[r][j].z, w[r][j].w};
            float s = acc[r];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                s = fmaf(__uint_as_float(q[k] << 16), xv[2 * k], s);
                s = fmaf(__uint_as_float(q[k] & 0xffff0000u), xv[2 * k + 1], s);
            }
            acc[r] = s;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) red[warp * R + r] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < R && r0 + threadIdx.x < O) {
        float v = red[threadIdx.x];
        for (int s = 1; s < S; ++s) v += red[s * R + threadIdx.x];
        y[r0 + threadIdx.x] = v;
    }
}

#define GEMV_BF16_DEC(JU, R)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_dec_##JU##_##R(                \
        const unsigned char* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,  \
        int n, int K, int O, long long RB) {                                                      \
        PDL_ENTER();                                                                              \
        (void)n;                                                                                  \
        gemv_bf16_dec_body<JU, R>(W, x, y, K, O, RB);                                             \
    }
GEMV_BF16_DEC(16, 1)
GEMV_BF16_DEC(8, 1)
GEMV_BF16_DEC(4, 1)
GEMV_BF16_DEC(4, 4)
GEMV_BF16_DEC(2, 4)
GEMV_BF16_DEC(1, 4)

// ---------------------------------------------------------------------------------------------
// Prefill: tensor-core tiles.

#define TC_M 64
#define TC_N 64
#define TC_K 32
#define TC_LD 40  // bf16 elements a shared row (32 + 8 padding against bank conflicts)

// The global bytes of 16 consecutive weight values (row `row`, columns k..k+15), before decoding.
template <int WT> struct Raw;
template <> struct Raw<WT_F32> { float4 v[4]; };
template <> struct Raw<WT_F16> { uint4 v[2]; };
template <> struct Raw<WT_BF16> { uint4 v[2]; };
template <> struct Raw<WT_Q8_0> { unsigned short d; unsigned short q[8]; };
template <> struct Raw<WT_IQ4_NL> { unsigned short d; unsigned short q[8]; };
template <> struct Raw<WT_Q6_K> { unsigned short d; signed char sc; unsigned short ql[8]; unsigned short qh[8]; };

__device__ __forceinline__ unsigned short ldg_u16(const unsigned char* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
}

template <int WT>
__device__ __forceinline__ void raw_load(Raw<WT>& r, const unsigned char* __restrict__ row, int k) {
    if constexpr (WT == WT_F32) {
        const float4* p = reinterpret_cast<const float4*>(row + 4ll * k);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = __ldg(p + i);
    } else if constexpr (WT == WT_F16 || WT == WT_BF16) {
        const uint4* p = reinterpret_cast<const uint4*>(row + 2ll * k);
        r.v[0] = __ldg(p);
        r.v[1] = __ldg(p + 1);
    } else if constexpr (WT == WT_Q8_0) {
        const unsigned char* b = row + (long long)(k >> 5) * 34;
        r.d = ldg_u16(b);
        const unsigned char* q = b + 2 + (k & 31);
#pragma unroll
        for (int i = 0; i < 8; ++i) r.q[i] = ldg_u16(q + 2 * i);
    } else if constexpr (WT == WT_IQ4_NL) {
        const unsigned char* b = row + (long long)(k >> 5) * 18;
        r.d = ldg_u16(b);
#pragma unroll
        for (int i = 0; i < 8; ++i) r.q[i] = ldg_u16(b + 2 + 2 * i);
    } else {
        const unsigned char* b = row + (long long)(k >> 8) * 210;
        const int o = k & 255, hf = o >> 7, q = (o >> 5) & 3, l = o & 31;
        r.d = ldg_u16(b + 208);
        r.sc = (signed char)__ldg(b + 192 + 8 * hf + (l >> 4) + 2 * q);
        const unsigned char* ql = b + 64 * hf + 32 * (q & 1) + l;
        const unsigned char* qh = b + 128 + 32 * hf + l;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            r.ql[i] = ldg_u16(ql + 2 * i);
            r.qh[i] = ldg_u16(qh + 2 * i);
        }
    }
}

template <int WT>
__device__ __forceinline__ void raw_zero(Raw<WT>& r) {
    if constexpr (WT == WT_F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else if constexpr (WT == WT_F16 || WT == WT_BF16) {
        r.v[0] = make_uint4(0, 0, 0, 0);
        r.v[1] = make_uint4(0, 0, 0, 0);
    } else if constexpr (WT == WT_Q6_K) {
        r.d = 0;
        r.sc = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) r.ql[i] = r.qh[i] = 0;
    } else {
        r.d = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) r.q[i] = 0;
    }
}

// The 16 values as f32, in the CPU reference's rounding (then narrowed to bf16 by the caller).
template <int WT>
__device__ __forceinline__ void raw_decode(const Raw<WT>& r, int k, float (&w)[16]) {
    if constexpr (WT == WT_F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[4 * i] = r.v[i].x; w[4 * i + 1] = r.v[i].y; w[4 * i + 2] = r.v[i].z; w[4 * i + 3] = r.v[i].w;
        }
    } else if constexpr (WT == WT_F16 || WT == WT_BF16) {
        const unsigned q[8] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w, r.v[1].x, r.v[1].y, r.v[1].z, r.v[1].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if constexpr (WT == WT_BF16) {
                w[2 * i] = __uint_as_float(q[i] << 16);
                w[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
            } else {
                w[2 * i] = h2f((unsigned short)(q[i] & 0xffffu));
                w[2 * i + 1] = h2f((unsigned short)(q[i] >> 16));
            }
        }
    } else if constexpr (WT == WT_Q8_0) {
        const float d = h2f(r.d);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w[2 * i] = d * (float)(signed char)(r.q[i] & 0xff);
            w[2 * i + 1] = d * (float)(signed char)(r.q[i] >> 8);
        }
    } else if constexpr (WT == WT_IQ4_NL) {
        // Values 0..15 are the low nibbles of the 16 bytes, 16..31 the high ones.
        const float d = h2f(r.d);
        const int sh = (k & 16) ? 4 : 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w[2 * i] = d * (float)iq4_code((r.q[i] & 0xff) >> sh);
            w[2 * i + 1] = d * (float)iq4_code((r.q[i] >> 8) >> sh);
        }
    } else {
        const int q = (k >> 5) & 3;
        const float dsc = h2f(r.d) * (float)r.sc;
        const int nsh = (q >> 1) * 4, hsh = 2 * q;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int a = (r.ql[i >> 1] >> (8 * (i & 1))) & 0xff;
            const int h = (r.qh[i >> 1] >> (8 * (i & 1))) & 0xff;
            const int v = ((a >> nsh) & 15) | (((h >> hsh) & 3) << 4);
            w[i] = dsc * (float)(v - 32);
        }
    }
}

__device__ __forceinline__ void store_bf16x16(__nv_bfloat16* dst, const float (&v)[16]) {
    __nv_bfloat162 p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = *reinterpret_cast<const uint4*>(&p[0]);
    d[1] = *reinterpret_cast<const uint4*>(&p[4]);
}

// grid (ceil(O/64), ceil(n/64)), block 128 (4 warps, each a 32×32 corner of the tile).
template <int WT>
__device__ __forceinline__ void tc_body(const unsigned char* __restrict__ W, const float* __restrict__ x,
                                        float* __restrict__ y, int n, int K, int O, long long RB) {
    using namespace nvcuda;
    __shared__ __align__(32) __nv_bfloat16 As[TC_M * TC_LD];
    __shared__ __align__(32) __nv_bfloat16 Bs[TC_N * TC_LD];
    __shared__ __align__(32) float Cs[4][256];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * TC_N, m0 = blockIdx.y * TC_M;
    // Each thread moves 16 values of one token row and 16 of one weight row per K slice.
    const int lr = tid >> 1, lh = (tid & 1) * 16;
    const bool xok = m0 + lr < n, wok = n0 + lr < O;
    const float* xrow = x + (long long)(m0 + lr) * K + lh;
    const unsigned char* wrow = W + (long long)(n0 + lr) * RB;

    float4 xr[4];
    Raw<WT> wr;
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) xr[i] = xok ? ldx4(xrow + k0 + 4 * i) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (wok) raw_load<WT>(wr, wrow, k0 + lh); else raw_zero<WT>(wr);
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;

    load(0);
    for (int k0 = 0; k0 < K; k0 += TC_K) {
        {
            float v[16];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[4 * i] = xr[i].x; v[4 * i + 1] = xr[i].y; v[4 * i + 2] = xr[i].z; v[4 * i + 3] = xr[i].w;
            }
            store_bf16x16(As + lr * TC_LD + lh, v);
            float w[16];
            raw_decode<WT>(wr, k0 + lh, w);
            store_bf16x16(Bs + lr * TC_LD + lh, w);
        }
        __syncthreads();
        if (k0 + TC_K < K) load(k0 + TC_K);
#pragma unroll
        for (int kk = 0; kk < TC_K; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], As + (wm + 16 * i) * TC_LD + kk, TC_LD);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], Bs + (wn + 16 * j) * TC_LD + kk, TC_LD);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            wmma::store_matrix_sync(Cs[warp], acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int t = m0 + wm + 16 * i + (e >> 4), o = n0 + wn + 16 * j + (e & 15);
                if (t < n && o < O) y[(long long)t * O + o] = Cs[warp][e];
            }
            __syncwarp();
        }
    }
}

#define TC(NAME, WT)                                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                             \
        linear_tc_##NAME(const unsigned char* W, const float* x, float* y, int n, int K, int O,  \
                         long long RB) {                                                          \
        PDL_ENTER();                                                                              \
        tc_body<WT>(W, x, y, n, K, O, RB);                                                        \
    }
TC(f32, WT_F32)
TC(f16, WT_F16)
TC(bf16, WT_BF16)
TC(q8_0, WT_Q8_0)
TC(q6_k, WT_Q6_K)
TC(iq4_nl, WT_IQ4_NL)

// ---------------------------------------------------------------------------------------------
// Fallback: grid (ceil(O/4), ceil(n/8)), block 128; a warp per row, 8 tokens per grid row.
extern "C" __global__ void __launch_bounds__(128)
    linear_generic(const unsigned char* W, const float* x, float* y, int n, int K, int O, long long RB, int wt) {
    PDL_ENTER();
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int t0 = blockIdx.y * 8;
    if (row >= O) return;
    const unsigned char* wr = W + (long long)row * RB;
    float acc[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] = 0.f;
    for (int k = lane; k < K; k += 32) {
        const float w = deq_elem(wr, wt, k);
#pragma unroll
        for (int t = 0; t < 8; ++t)
            if (t0 + t < n) acc[t] = fmaf(w, x[(long long)(t0 + t) * K + k], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        const float v = warp_sum(acc[t]);
        if (lane == 0 && t0 + t < n) y[(long long)(t0 + t) * O + row] = v;
    }
}
