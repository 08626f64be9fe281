// Multi-head latent attention (absorbed form) and its rope, spec §3.5 / §5.
//
// Numerics follow the CPU references in ops/src/rope.rs and ops/src/mla/cpu.rs: everything is f32 (the RMS
// statistic f64 as ggml), and wherever the reference's rounding can be reproduced exactly
// (rope angles and rotation, the norm scale) the explicit-rounding intrinsics keep NVRTC from
// contracting a*b+c into one fma, which would change the bits.

#include <cuda_bf16.h>

#define NEG_INF (-__int_as_float(0x7f800000))

// ---- rope helper (ggml NORM mode, YaRN) ------------------------------------------------

// cos/sin of pair `pair` at `pos`, exactly as RopeParams::cos_sin: the angle is built by
// `pair` repeated f32 multiplications, then ramp-mixed, then scaled by the magnitude.
__device__ __forceinline__ void rope_cos_sin(int pos, int pair, float theta_scale,
                                             float freq_scale, float ext_factor,
                                             float corr_low, float corr_high, float mscale,
                                             float* c, float* s) {
    float theta_extrap = (float)pos;
    for (int k = 0; k < pair; ++k) theta_extrap = __fmul_rn(theta_extrap, theta_scale);
    const float theta_interp = __fmul_rn(freq_scale, theta_extrap);
    float theta = theta_interp;
    if (ext_factor != 0.0f) {
        float y = __fdiv_rn(__fsub_rn((float)pair, corr_low),
                            fmaxf(__fsub_rn(corr_high, corr_low), 0.001f));
        y = fminf(fmaxf(y, 0.0f), 1.0f);
        const float ramp_mix = __fmul_rn(__fsub_rn(1.0f, y), ext_factor);
        theta = __fadd_rn(__fmul_rn(theta_interp, __fsub_rn(1.0f, ramp_mix)),
                          __fmul_rn(theta_extrap, ramp_mix));
    }
    *c = __fmul_rn(cosf(theta), mscale);
    *s = __fmul_rn(sinf(theta), mscale);
}

// (lo, hi) as an f16 pair, lo in the low half, rounded to nearest and saturated to ±65504 (a
// NaN stays NaN): how an F16 latent cache stores its values, and how the f16 attention kernels
// narrow f32 ones (a weight of 0 times a clamped value stays 0, where inf would give NaN).
__device__ __forceinline__ unsigned att_pack_f16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Rotates (src[2i], src[2i+1]) into dst for pairs i < n_rot/2, one thread a pair; HALF: dst
// is an f16 row (att_pack_f16 of the same f32 results).
template <bool HALF = false>
__device__ __forceinline__ void rope_pairs(const float* src, void* dst, int pos, int n_rot,
                                           int tid, int nthreads, float theta_scale,
                                           float freq_scale, float ext_factor, float corr_low,
                                           float corr_high, float mscale) {
    for (int i = tid; i < n_rot / 2; i += nthreads) {
        float c, s;
        rope_cos_sin(pos, i, theta_scale, freq_scale, ext_factor, corr_low, corr_high, mscale,
                     &c, &s);
        const float x0 = src[2 * i], x1 = src[2 * i + 1];
        const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        if (HALF) {
            reinterpret_cast<unsigned*>(dst)[i] = att_pack_f16(y0, y1);
        } else {
            reinterpret_cast<float*>(dst)[2 * i] = y0;
            reinterpret_cast<float*>(dst)[2 * i + 1] = y1;
        }
    }
}

// ---- MlaKv's row (the mla_kv kernel and the fused query launch) ---------------------

// Token t's cache row: rms(latent)·w ‖ rope(k_pe), to out[t], or (to_cache) to the cache row
// of its slot. A whole block, every thread (its barriers are block-wide; every early return
// is block-uniform).
__device__ __forceinline__ void mla_kv_row(const float* __restrict__ kv,
                                           const float* __restrict__ norm_w,
                                           const int* __restrict__ positions,
                                           const int* __restrict__ slots, float* __restrict__ out,
                                           int kv_lora, int qk_rope, float eps,
                                           float theta_scale, float freq_scale, float ext_factor,
                                           float corr_low, float corr_high, float mscale,
                                           int to_cache, int cache_f16, int n, int ctx, int t) {
    __shared__ double red[8];
    __shared__ float scale_s;
    const int tid = threadIdx.x;
    const int w = kv_lora + qk_rope;
    const float* src = kv + (long long)t * w;
    // to_cache: `out` is the cache pool and the row goes to the token's slot, as
    // kv_cache_write would put it (skipped for a padding row's negative slot, outside the
    // pool, or when a later token of the step names the same slot).
    long long row = t;
    if (to_cache) {
        const int p = slots[t];
        if (p < 0 || p >= ctx) return;
        int later = 0;
        for (int j = t + 1 + tid; j < n; j += blockDim.x) later |= slots[j] == p;
        if (__syncthreads_or(later)) return;
        row = p;
    }
    // cache_f16 (with to_cache): the row is stored as f16 pairs (W even).
    float* dst = out + row * w;
    unsigned* dst2 = reinterpret_cast<unsigned*>(reinterpret_cast<unsigned short*>(out) + row * w);
    // As ggml's rms_norm: squares in f32, their sum in f64, the scale in f32.
    double ss = 0.0;
    for (int i = tid; i < kv_lora; i += blockDim.x) {
        const float v = src[i];
        ss += (double)__fmul_rn(v, v);
    }
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
    __syncthreads();
    if (tid == 0) {
        double sum = 0.0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) sum += red[k];
        const float mean = (float)(sum / (double)kv_lora);
        scale_s = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    }
    __syncthreads();
    const float scale = scale_s;
    if (to_cache && cache_f16) {
        for (int i = tid; i < kv_lora / 2; i += blockDim.x)
            dst2[i] = att_pack_f16(__fmul_rn(__fmul_rn(src[2 * i], scale), norm_w[2 * i]),
                                   __fmul_rn(__fmul_rn(src[2 * i + 1], scale), norm_w[2 * i + 1]));
        rope_pairs<true>(src + kv_lora, dst2 + kv_lora / 2, positions[t], qk_rope, tid,
                         blockDim.x, theta_scale, freq_scale, ext_factor, corr_low, corr_high,
                         mscale);
        return;
    }
    for (int i = tid; i < kv_lora; i += blockDim.x)
        dst[i] = __fmul_rn(__fmul_rn(src[i], scale), norm_w[i]);
    rope_pairs(src + kv_lora, dst + kv_lora, positions[t], qk_rope, tid, blockDim.x,
               theta_scale, freq_scale, ext_factor, corr_low, corr_high, mscale);
}


// ---- per-head BF16 matrix times f32 vectors (MlaQuery's Kb, MlaValueOut's Vb) ----------
//
// y[t][h][o] = sum_i W[h][o][i] * x[t][h][i]. A group of LPR = 1 << lpr_log2 lanes owns one
// weight row: each lane holds up to HG_SEGS 16-byte segments (8 bf16) of it in registers,
// converted to f32 once, and dots them with every token of the block's token tile (staged in
// shared memory), then the group reduces with xor-shuffles. Block = 8 warps; each warp runs
// `passes` rows per group. blockIdx.y is the head. With rope_n > 0 the extra column of blocks
// (blockIdx.x == row_blocks) applies the rope to x[t][h][rope_src..] -> y[t][h][rope_dst..].

#define HG_SEGS 4
// Loads a thread has in flight while staging x.
#define HG_STAGE_UNROLL 4
// Tokens whose dot products a lane group runs together.
#define HG_TOKENS 4

// The rope job of head blockIdx.y for tokens [t0, t1): every (token, pair) a thread.
__device__ __forceinline__ void head_rope(const float* x, long long x_tok, long long x_head,
                                          float* y, long long y_tok, long long y_head, int t0,
                                          int t1, const int* positions, int rope_n, int rope_src,
                                          int rope_dst, float theta_scale, float freq_scale,
                                          float ext_factor, float corr_low, float corr_high,
                                          float mscale) {
    const int h = blockIdx.y;
    const int half = rope_n / 2;
    for (int idx = threadIdx.x; idx < (t1 - t0) * half; idx += blockDim.x) {
        const int t = t0 + idx / half, i = idx % half;
        const float* src = x + t * x_tok + h * x_head + rope_src + 2 * i;
        float* dst = y + t * y_tok + h * y_head + rope_dst + 2 * i;
        float c, s;
        rope_cos_sin(positions[t], i, theta_scale, freq_scale, ext_factor, corr_low, corr_high,
                     mscale, &c, &s);
        const float x0 = src[0], x1 = src[1];
        dst[0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        dst[1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

// Per-head weights stored in another type than BF16 (wt, a dequant.cuh code; row_bytes a row's
// size): grid (row_tiles [+ 1 for the rope], n_head, n_tok); warps take output rows, lanes the
// values lane, lane+32, ... in order, the warp sums in a fixed tree. Correct for every type the
// CPU reads, fast for none.
extern "C" __global__ void __launch_bounds__(256)
head_generic(const unsigned char* __restrict__ W, const float* __restrict__ x, long long x_tok,
             long long x_head, float* __restrict__ y, long long y_tok, long long y_head, int n_tok,
             int n_out, int n_in, int row_tiles, int wt, long long row_bytes,
             const int* __restrict__ positions, int rope_n, int rope_src, int rope_dst,
             float theta_scale, float freq_scale, float ext_factor, float corr_low,
             float corr_high, float mscale) {
    PDL_ENTER();
    const int h = blockIdx.y, t = blockIdx.z;
    if (t >= n_tok) return;
    if ((int)blockIdx.x == row_tiles) {
        head_rope(x, x_tok, x_head, y, y_tok, y_head, t, t + 1, positions, rope_n, rope_src,
                  rope_dst, theta_scale, freq_scale, ext_factor, corr_low, corr_high, mscale);
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* xr = x + t * x_tok + h * x_head;
    for (int o = blockIdx.x * 8 + warp; o < n_out; o += row_tiles * 8) {
        const unsigned char* row = W + ((long long)h * n_out + o) * row_bytes;
        float s = 0.0f;
        for (int k = lane; k < n_in; k += 32) s = fmaf(deq_elem(row, wt, k), xr[k], s);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) y[t * y_tok + h * y_head + o] = s;
    }
}

#define HEAD_GEMV_BF16_PARAMS                                                                    \
    const unsigned short *__restrict__ W, const float *__restrict__ x, long long x_tok,          \
        long long x_head, float *__restrict__ y, long long y_tok, long long y_head, int n_tok,   \
        int n_out, int n_in, int lpr_log2, int passes, int row_blocks, int tok_tile,             \
        const int *__restrict__ positions, int rope_n, int rope_src, int rope_dst,               \
        float theta_scale, float freq_scale, float ext_factor, float corr_low, float corr_high,  \
        float mscale
#define HEAD_GEMV_BF16_ARGS                                                                      \
    W, x, x_tok, x_head, y, y_tok, y_head, n_tok, n_out, n_in, lpr_log2, passes, row_blocks,     \
        tok_tile, positions, rope_n, rope_src, rope_dst, theta_scale, freq_scale, ext_factor,    \
        corr_low, corr_high, mscale

__device__ __forceinline__ void head_gemv_bf16_body(HEAD_GEMV_BF16_PARAMS);

extern "C" __global__ void __launch_bounds__(256) head_gemv_bf16(HEAD_GEMV_BF16_PARAMS) {
    PDL_ENTER();
    head_gemv_bf16_body(HEAD_GEMV_BF16_ARGS);
}

// The query's product with the step's cache rows beside it (MlaQueryKv): the column of blocks
// after the rope's (blockIdx.x == row_blocks + 1) writes token t's cache row for t =
// blockIdx.y, blockIdx.y + n_head, ... with mla_kv's arithmetic and the rope's constants (the
// query and the shared key rotate alike), so the cache write has no launch of its own.
extern "C" __global__ void __launch_bounds__(256)
head_gemv_bf16_kv(HEAD_GEMV_BF16_PARAMS, const float* __restrict__ kv,
                  const float* __restrict__ norm_w, const int* __restrict__ slots,
                  float* __restrict__ cache, int kv_lora, int qk_rope, float eps, int cache_rows,
                  int cache_f16) {
    PDL_ENTER();
    if ((int)blockIdx.x == row_blocks + 1) {
        for (int t = blockIdx.y; t < n_tok; t += gridDim.y)
            mla_kv_row(kv, norm_w, positions, slots, cache, kv_lora, qk_rope, eps, theta_scale,
                       freq_scale, ext_factor, corr_low, corr_high, mscale, 1, cache_f16, n_tok,
                       cache_rows, t);
        return;
    }
    head_gemv_bf16_body(HEAD_GEMV_BF16_ARGS);
}

__device__ __forceinline__ void head_gemv_bf16_body(HEAD_GEMV_BF16_PARAMS) {
    extern __shared__ float4 hg_smem4[];
    float* xs = reinterpret_cast<float*>(hg_smem4);
    const int h = blockIdx.y;
    const int tid = threadIdx.x;

    if ((int)blockIdx.x == row_blocks) {
        head_rope(x, x_tok, x_head, y, y_tok, y_head, 0, n_tok, positions, rope_n, rope_src,
                  rope_dst, theta_scale, freq_scale, ext_factor, corr_low, corr_high, mscale);
        return;
    }

    const int warp = tid >> 5, lane = tid & 31;
    const int lpr = 1 << lpr_log2;
    const int groups = 32 >> lpr_log2;  // rows a warp serves per pass
    const int g = lane >> lpr_log2, li = lane & (lpr - 1);
    const int nseg = n_in >> 3;
    const unsigned short* Wh = W + (long long)h * n_out * n_in;

    // x's rows as 16-byte pieces where they are 16-byte aligned (the engine's always are).
    const bool x_vec = (reinterpret_cast<unsigned long long>(x) & 15) == 0 &&
                       ((x_tok | x_head) & 3) == 0 && (n_in & 3) == 0;
    for (int t0 = 0; t0 < n_tok; t0 += tok_tile) {
        const int tn = min(tok_tile, n_tok - t0);
        __syncthreads();
        // Each thread issues HG_STAGE_UNROLL loads before its first store, so staging the
        // token tile is one trip to L2 a round rather than one an element (8 tokens of v_out's
        // 512 inputs were 16 dependent trips a thread).
        if (x_vec) {
            const int n4 = n_in >> 2, total = tn * n4;
            for (int base = 0; base < total; base += HG_STAGE_UNROLL * blockDim.x) {
                float4 v[HG_STAGE_UNROLL];
#pragma unroll
                for (int u = 0; u < HG_STAGE_UNROLL; ++u) {
                    const int idx = base + u * blockDim.x + tid;
                    v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (idx < total) {
                        const int t = idx / n4, i = idx - t * n4;
                        v[u] = *reinterpret_cast<const float4*>(x + (t0 + t) * x_tok + h * x_head +
                                                                4 * i);
                    }
                }
#pragma unroll
                for (int u = 0; u < HG_STAGE_UNROLL; ++u) {
                    const int idx = base + u * blockDim.x + tid;
                    if (idx < total) reinterpret_cast<float4*>(xs)[idx] = v[u];
                }
            }
        } else {
            const int total = tn * n_in;
            for (int base = 0; base < total; base += HG_STAGE_UNROLL * blockDim.x) {
                float v[HG_STAGE_UNROLL];
#pragma unroll
                for (int u = 0; u < HG_STAGE_UNROLL; ++u) {
                    const int idx = base + u * blockDim.x + tid;
                    v[u] = 0.0f;
                    if (idx < total) {
                        const int t = idx / n_in, i = idx - t * n_in;
                        v[u] = x[(t0 + t) * x_tok + h * x_head + i];
                    }
                }
#pragma unroll
                for (int u = 0; u < HG_STAGE_UNROLL; ++u) {
                    const int idx = base + u * blockDim.x + tid;
                    if (idx < total) xs[idx] = v[u];
                }
            }
        }
        __syncthreads();
        for (int p = 0; p < passes; ++p) {
            const int row = blockIdx.x * (passes * 8 * groups) + (p * 8 + warp) * groups + g;
            const bool rv = row < n_out;
            float w[HG_SEGS][8];
#pragma unroll
            for (int s = 0; s < HG_SEGS; ++s) {
                const int seg = li + s * lpr;
                uint4 u = make_uint4(0, 0, 0, 0);
                if (rv && seg < nseg)
                    u = *reinterpret_cast<const uint4*>(Wh + (long long)row * n_in + seg * 8);
                const unsigned int uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    w[s][2 * k] = __uint_as_float(uw[k] << 16);
                    w[s][2 * k + 1] = __uint_as_float(uw[k] & 0xffff0000u);
                }
            }
            // HG_TOKENS tokens at a time, so their shuffle reductions interleave instead of
            // each waiting on the last (every token's sums in the same order as one at a time).
            for (int tb = 0; tb < tn; tb += HG_TOKENS) {
                float acc[HG_TOKENS];
#pragma unroll
                for (int j = 0; j < HG_TOKENS; ++j) acc[j] = 0.0f;
#pragma unroll
                for (int s = 0; s < HG_SEGS; ++s) {
                    const int seg = li + s * lpr;
                    if (seg < nseg) {
#pragma unroll
                        for (int j = 0; j < HG_TOKENS; ++j) {
                            if (tb + j < tn) {
                                const float* xt = xs + (tb + j) * n_in + seg * 8;
                                const float4 a = *reinterpret_cast<const float4*>(xt);
                                const float4 b = *reinterpret_cast<const float4*>(xt + 4);
                                acc[j] = fmaf(w[s][0], a.x, acc[j]);
                                acc[j] = fmaf(w[s][1], a.y, acc[j]);
                                acc[j] = fmaf(w[s][2], a.z, acc[j]);
                                acc[j] = fmaf(w[s][3], a.w, acc[j]);
                                acc[j] = fmaf(w[s][4], b.x, acc[j]);
                                acc[j] = fmaf(w[s][5], b.y, acc[j]);
                                acc[j] = fmaf(w[s][6], b.z, acc[j]);
                                acc[j] = fmaf(w[s][7], b.w, acc[j]);
                            }
                        }
                    }
                }
                // Only the tile's live tokens reduce (tn is block-uniform): a one-token step
                // ran four tokens' shuffle chains, +1 µs a layer on the query product at B=1.
                for (int off = lpr >> 1; off > 0; off >>= 1) {
#pragma unroll
                    for (int j = 0; j < HG_TOKENS; ++j)
                        if (tb + j < tn) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
                }
                if (rv && li == 0) {
#pragma unroll
                    for (int j = 0; j < HG_TOKENS; ++j)
                        if (tb + j < tn) y[(t0 + tb + j) * y_tok + h * y_head + row] = acc[j];
                }
            }
        }
    }
}

// The same product for many tokens, as a tiled GEMM: block (64 rows, 64 tokens, head), k
// steps of 32 staged in shared memory as f32 (weights converted from BF16 once per token
// tile), each thread 4 tokens x 4 rows in registers, summed in index order. blockIdx.x ==
// row_tiles is the rope job for the token tile.
#define HM_T 64
#define HM_K 32
#define HM_S (HM_T + 4)

extern "C" __global__ void __launch_bounds__(256)
head_gemm_bf16(const unsigned short* __restrict__ W, const float* __restrict__ x,
               long long x_tok, long long x_head, float* __restrict__ y, long long y_tok,
               long long y_head, int n_tok, int n_out, int n_in, int row_tiles,
               const int* __restrict__ positions, int rope_n, int rope_src, int rope_dst,
               float theta_scale, float freq_scale, float ext_factor, float corr_low,
               float corr_high, float mscale) {
    PDL_ENTER();
    __shared__ __align__(16) float wsm[HM_K * HM_S];
    __shared__ __align__(16) float xsm[HM_K * HM_S];
    const int h = blockIdx.y, tid = threadIdx.x;
    const int t0 = blockIdx.z * HM_T;
    if ((int)blockIdx.x == row_tiles) {
        head_rope(x, x_tok, x_head, y, y_tok, y_head, t0, min(n_tok, t0 + HM_T), positions,
                  rope_n, rope_src, rope_dst, theta_scale, freq_scale, ext_factor, corr_low,
                  corr_high, mscale);
        return;
    }
    const int r0 = blockIdx.x * HM_T;
    const unsigned short* Wh = W + (long long)h * n_out * n_in;
    // Loader roles: 8 consecutive k of one row / one token.
    const int lr = tid >> 2, lk = 8 * (tid & 3);
    const bool wrow = r0 + lr < n_out, xtok = t0 + lr < n_tok;
    const float* xrow = x + (long long)(t0 + lr) * x_tok + h * x_head;
    // Compute roles: tokens 4ty.., rows 4tx...
    const int ty = tid >> 4, tx = tid & 15;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < n_in; k0 += HM_K) {
        const bool kv = k0 + lk < n_in;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (wrow && kv)
            u = *reinterpret_cast<const uint4*>(Wh + (long long)(r0 + lr) * n_in + k0 + lk);
        const unsigned uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            wsm[(lk + 2 * e) * HM_S + lr] = __uint_as_float(uw[e] << 16);
            wsm[(lk + 2 * e + 1) * HM_S + lr] = __uint_as_float(uw[e] & 0xffff0000u);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
            xsm[(lk + e) * HM_S + lr] = (xtok && kv) ? xrow[k0 + lk + e] : 0.0f;
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < HM_K; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(xsm + k * HM_S + 4 * ty);
            const float4 b = *reinterpret_cast<const float4*>(wsm + k * HM_S + 4 * tx);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(bv[j], av[i], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = t0 + 4 * ty + i;
        if (t >= n_tok) continue;
        float* yr = y + (long long)t * y_tok + h * y_head;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + 4 * tx + j;
            if (r < n_out) yr[r] = acc[i][j];
        }
    }
}

// The same product on the tensor cores, for many tokens. Block (group of col_per_block
// column tiles of BN outputs, head, BM tokens), 8 warps of (BM/WM) tokens x (BN/WN) outputs.
// The block's (column tile, k slice) steps, HT_BK of k each, stream through HT_STAGES
// shared-memory buffers by cp.async (zero-filled past the tokens, the rows and n_in), so the
// next steps' loads are in flight while one is multiplied, across column tiles too: a short
// k (MlaQuery's 128) does not leave the pipeline to fill and drain per tile, and one tile's
// stores drain while the next is multiplied. blockIdx.x == the group count is the rope job
// for the token tile, as in head_gemm_bf16. Every output's sum runs in the same order for any
// tile shape or grouping.
//
// W is exact BF16 and x f32: x = hi + lo with hi = bf16(x) and lo = bf16(x - hi) (x - hi is
// exact), and two m16n8k16 bf16 mma (x as A, tokens as m; W as B, read from its rows by
// ldmatrix) add hi·W and lo·W into one f32 accumulator. |x - hi - lo| <= 2^-16 |x|, so each
// product is within 2^-16 of itself. The split is made in registers as each A fragment is
// read from the f32 slice: shared memory holds x as it came.
//
// Banks: x rows of HT_XS = HT_BK + 8 floats (= 8 mod 32), so a fragment's float2 reads (8 rows
// x 4 pairs) hit distinct banks; W rows of HT_BK + 8 bf16 (80 bytes), so ldmatrix's 8 rows of
// 16 bytes do too.
#define HT_BK 32
#define HT_STAGES 3
#define HT_XS (HT_BK + 8)
#define HT_WS (HT_BK + 8)

__device__ __forceinline__ unsigned ht_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void ht_cp16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void ht_cp4(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void ht_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void ht_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ht_ldsm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ht_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// (v.x, v.y) as bf16x2 hi (v.x in the low half: the lower k) and the remainders as lo.
__device__ __forceinline__ void ht_split(float2 v, unsigned& hi, unsigned& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(hi) : "f"(v.y), "f"(v.x));
    const float r0 = __fsub_rn(v.x, __uint_as_float(hi << 16));
    const float r1 = __fsub_rn(v.y, __uint_as_float(hi & 0xffff0000u));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(lo) : "f"(r1), "f"(r0));
}

// x_vec: x 16-byte aligned with strides in whole float4 (16-byte copies, else 4-byte);
// y_vec: y 8-byte aligned with even strides (float2 stores). ksplit > 1: block column
// (group, kp) takes K slices [kp·per, (kp+1)·per) (per = ⌈slices / ksplit⌉) and writes its
// partial sums to part[kp][n_tok][n_head][n_out] (8-byte aligned), which head_split_sum adds
// in kp order: v_out's one column tile a head is 32 blocks over the whole K otherwise.
template <int BM, int BN, int WM, int WN>
__device__ __forceinline__ void head_mma(
    const unsigned short* __restrict__ W, const float* __restrict__ x, long long x_tok,
    long long x_head, float* __restrict__ y, long long y_tok, long long y_head, int n_tok,
    int n_out, int n_in, int col_tiles, int col_per_block, int x_vec, int y_vec,
    const int* __restrict__ positions, int rope_n, int rope_src, int rope_dst,
    float theta_scale, float freq_scale, float ext_factor, float corr_low, float corr_high,
    float mscale, int ksplit, float* __restrict__ part) {
    constexpr int WTM = BM / WM, WTN = BN / WN, MT = WTM / 16, NT = WTN / 8;
    static_assert(WM * WN == 8 && MT * 16 == WTM && NT % 2 == 0 && NT * 8 == WTN, "tile");
    extern __shared__ float4 ht_smem4[];
    float* xs = reinterpret_cast<float*>(ht_smem4);  // [HT_STAGES][BM][HT_XS]
    unsigned short* ws =
        reinterpret_cast<unsigned short*>(xs + HT_STAGES * BM * HT_XS);  // [..][BN][HT_WS]
    const int h = blockIdx.y, tid = threadIdx.x;
    const int t0 = blockIdx.z * BM;
    if ((int)blockIdx.x == (col_tiles + col_per_block - 1) / col_per_block * ksplit) {
        head_rope(x, x_tok, x_head, y, y_tok, y_head, t0, min(n_tok, t0 + BM), positions,
                  rope_n, rope_src, rope_dst, theta_scale, freq_scale, ext_factor, corr_low,
                  corr_high, mscale);
        return;
    }
    const int grp = blockIdx.x / ksplit, kp = blockIdx.x - grp * ksplit;
    const int j0 = grp * col_per_block;
    const int slices = (n_in + HT_BK - 1) / HT_BK, per = (slices + ksplit - 1) / ksplit;
    const int kb0 = kp * per;
    const int nk = min(per, slices - kb0);  // this block's K slices a column tile
    if (nk <= 0) return;
    const int steps = min(col_per_block, col_tiles - j0) * nk;
    const unsigned short* Wh = W + (long long)h * n_out * n_in;
    const float* xh = x + (long long)h * x_head;

    // Loader roles, fixed per thread: x as 16-byte chunks (4 floats) of rows tid/8 + 32i,
    // or single floats of rows tid/32 + 8i; W as 16-byte chunks (8 bf16) of rows tid/4 + 64i.
    static_assert(BM % 32 == 0 && BN % 64 == 0 && HT_BK == 32, "loader roles");
    const int xq = x_vec ? 4 * (tid & 7) : (tid & 31), xr = x_vec ? tid >> 3 : tid >> 5;
    const float* xsrc = xh + (long long)(t0 + xr) * x_tok + xq;
    const int wq = 8 * (tid & 3), wr = tid >> 2;
    const unsigned short* wsrc = Wh + (long long)wr * n_in + wq;

    auto load = [&](int step, int buf) {
        const int j = step / nk;
        const int k0 = (kb0 + step - j * nk) * HT_BK, n0 = (j0 + j) * BN;
        const unsigned xb = ht_smem(xs + (buf * BM + xr) * HT_XS + xq);
        if (x_vec) {
            const bool kv = k0 + xq < n_in;
#pragma unroll
            for (int i = 0; i < BM / 32; ++i) {
                const bool v = kv && t0 + xr + 32 * i < n_tok;
                ht_cp16(xb + 4 * 32 * i * HT_XS, v ? xsrc + 32 * i * x_tok + k0 : x, v ? 16 : 0);
            }
        } else {
            const bool kv = k0 + xq < n_in;
#pragma unroll
            for (int i = 0; i < BM / 8; ++i) {
                const bool v = kv && t0 + xr + 8 * i < n_tok;
                ht_cp4(xb + 4 * 8 * i * HT_XS, v ? xsrc + 8 * i * x_tok + k0 : x, v ? 4 : 0);
            }
        }
        const unsigned wb = ht_smem(ws + (buf * BN + wr) * HT_WS + wq);
        const bool kv = k0 + wq < n_in;
#pragma unroll
        for (int i = 0; i < BN / 64; ++i) {
            const bool v = kv && n0 + wr + 64 * i < n_out;
            ht_cp16(wb + 2 * 64 * i * HT_WS,
                    v ? wsrc + (long long)(n0 + 64 * i) * n_in + k0 : W, v ? 16 : 0);
        }
    };

    const int warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WN, wn = warp % WN;
    const int g = lane >> 2, tq = lane & 3;
    // ldmatrix.x4 over 16 rows x 16 k: matrices (rows 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7),
    // (8-15, 8-15) = b0, b1 of n-tile 0, b0, b1 of n-tile 1.
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_k = ((lane >> 3) & 1) * 8;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < HT_STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        ht_commit();
    }
    int kb = 0, n0 = j0 * BN;  // the step being multiplied: k slice, first output
    for (int step = 0; step < steps; ++step) {
        ht_wait<HT_STAGES - 2>();
        __syncthreads();
        // The buffer refilled here was read in step - 1, which every warp has left.
        if (step + HT_STAGES - 1 < steps)
            load(step + HT_STAGES - 1, (step + HT_STAGES - 1) % HT_STAGES);
        ht_commit();
        const int buf = step % HT_STAGES;
        const float* xb = xs + (buf * BM + wm * WTM + g) * HT_XS + 2 * tq;
        const unsigned wb = ht_smem(ws + (buf * BN + wn * WTN + b_row) * HT_WS + b_k);
#pragma unroll
        for (int kk = 0; kk < HT_BK; kk += 16) {
            unsigned ah[MT][4], al[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float* p = xb + mt * 16 * HT_XS + kk;
                ht_split(*reinterpret_cast<const float2*>(p), ah[mt][0], al[mt][0]);
                ht_split(*reinterpret_cast<const float2*>(p + 8 * HT_XS), ah[mt][1], al[mt][1]);
                ht_split(*reinterpret_cast<const float2*>(p + 8), ah[mt][2], al[mt][2]);
                ht_split(*reinterpret_cast<const float2*>(p + 8 * HT_XS + 8), ah[mt][3],
                         al[mt][3]);
            }
            // One n-tile pair at a time (4 registers of W); the hi products of all m-tiles
            // come between an accumulator's hi and lo mma.
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned b[4];
                ht_ldsm_x4(wb + 2 * (np * 16 * HT_WS + kk), b);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    ht_mma(acc[mt][2 * np], ah[mt], b[0], b[1]);
                    ht_mma(acc[mt][2 * np + 1], ah[mt], b[2], b[3]);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    ht_mma(acc[mt][2 * np], al[mt], b[0], b[1]);
                    ht_mma(acc[mt][2 * np + 1], al[mt], b[2], b[3]);
                }
            }
        }
        if (++kb < nk) continue;
        // The column tile is complete: store it and start the next one from zero.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = t0 + wm * WTM + mt * 16 + g + 8 * half;
                const bool to_part = ksplit > 1;
                float* yr = to_part
                                ? part + (((long long)kp * n_tok + t) * gridDim.y + h) * n_out
                                : y + (long long)t * y_tok + (long long)h * y_head;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int o = n0 + wn * WTN + nt * 8 + 2 * tq;
                    float* v = acc[mt][nt] + 2 * half;
                    if (t < n_tok) {
                        if ((to_part ? (n_out & 1) == 0 : y_vec) && o + 1 < n_out) {
                            *reinterpret_cast<float2*>(yr + o) = make_float2(v[0], v[1]);
                        } else {
                            if (o < n_out) yr[o] = v[0];
                            if (o + 1 < n_out) yr[o + 1] = v[1];
                        }
                    }
                    v[0] = 0.0f;
                    v[1] = 0.0f;
                }
            }
        kb = 0;
        n0 += BN;
    }
    ht_wait<0>();
}

// One kernel per tile shape: NAME(BM tokens, BN outputs, WM x WN warps, MINB blocks an SM).
// 32 x 64 warp tiles split each x fragment for 8 n-tiles (64x128's 32 x 32 for 4): the larger
// tile for many tokens, the smaller one fills the card below ~512.
#define HEAD_MMA_KERNEL(NAME, BM, BN, WM, WN, MINB)                                            \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                    \
        NAME(const unsigned short* __restrict__ W, const float* __restrict__ x,                \
             long long x_tok, long long x_head, float* __restrict__ y, long long y_tok,        \
             long long y_head, int n_tok, int n_out, int n_in, int col_tiles,                  \
             int col_per_block, int x_vec, int y_vec, const int* __restrict__ positions,       \
             int rope_n, int rope_src, int rope_dst, float theta_scale, float freq_scale,      \
             float ext_factor, float corr_low, float corr_high, float mscale, int ksplit,      \
             float* __restrict__ part) {                                                       \
        PDL_ENTER();                                                                           \
        head_mma<BM, BN, WM, WN>(W, x, x_tok, x_head, y, y_tok, y_head, n_tok, n_out, n_in,    \
                                 col_tiles, col_per_block, x_vec, y_vec, positions, rope_n,    \
                                 rope_src, rope_dst, theta_scale, freq_scale, ext_factor,      \
                                 corr_low, corr_high, mscale, ksplit, part);                   \
    }
HEAD_MMA_KERNEL(head_mma_bf16_128x128, 128, 128, 4, 2, 2)
HEAD_MMA_KERNEL(head_mma_bf16_64x128, 64, 128, 2, 4, 2)

// y[t][h][o] (strided) = Σ_kp part[kp][t][h][o], in kp order: head_mma's K split partial
// sums, all of a thread's loaded before the first is added. ksplit ≤ HT_MAX_SPLITS.
#define HT_MAX_SPLITS 8
extern "C" __global__ void __launch_bounds__(256)
    head_split_sum(const float* __restrict__ part, float* __restrict__ y, long long y_tok,
                   long long y_head, int n_tok, int n_head, int n_out, int ksplit) {
    PDL_ENTER();
    const long long all = (long long)n_tok * n_head * n_out;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= all) return;
    float v[HT_MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < HT_MAX_SPLITS; ++s) v[s] = s < ksplit ? part[s * all + i] : 0.0f;
    float sum = v[0];
#pragma unroll
    for (int s = 1; s < HT_MAX_SPLITS; ++s)
        if (s < ksplit) sum += v[s];
    const int o = (int)(i % n_out);
    const long long th = i / n_out;
    const int h = (int)(th % n_head), t = (int)(th / n_head);
    y[(long long)t * y_tok + (long long)h * y_head + o] = sum;
}

// ---- MlaKv: rms(latent)*w || rope(k_pe) ------------------------------------------------

extern "C" __global__ void __launch_bounds__(256)
mla_kv(const float* __restrict__ kv, const float* __restrict__ norm_w,
       const int* __restrict__ positions, const int* __restrict__ slots,
       float* __restrict__ out, int kv_lora, int qk_rope, float eps, float theta_scale,
       float freq_scale, float ext_factor, float corr_low, float corr_high, float mscale,
       int to_cache, int n, int ctx, int cache_f16) {
    PDL_ENTER();
    mla_kv_row(kv, norm_w, positions, slots, out, kv_lora, qk_rope, eps, theta_scale, freq_scale,
               ext_factor, corr_low, corr_high, mscale, to_cache, cache_f16, n, ctx, blockIdx.x);
}

// ---- KvCacheWrite ----------------------------------------------------------------------

// cache[slots[i]] = k[i]. A negative slot (a padding row) or one outside [0, ctx) is
// skipped (the CPU refuses the latter, the engine never makes one); when two tokens name one
// row the later one writes it, as the CPU's loop.
extern "C" __global__ void __launch_bounds__(256)
kv_cache_write(float* __restrict__ cache, const float* __restrict__ k,
               const int* __restrict__ slots, int n, int w, int ctx, int cache_f16) {
    PDL_ENTER();
    const int i = blockIdx.x;
    const int p = slots[i];
    if (p < 0 || p >= ctx) return;
    // The last token with this slot writes the row; the block's threads split the scan
    // (one thread walking every later position made a 1024-token chunk's write take 62 µs).
    int later = 0;
    for (int j = i + 1 + threadIdx.x; j < n; j += blockDim.x) later |= slots[j] == p;
    if (__syncthreads_or(later)) return;
    const float* src = k + (long long)i * w;
    if (cache_f16) {
        // f16 pairs (W even), rounded and saturated as the f16 attention kernels narrow.
        unsigned* dst2 =
            reinterpret_cast<unsigned*>(reinterpret_cast<unsigned short*>(cache) + (long long)p * w);
        for (int c = threadIdx.x; c < w / 2; c += blockDim.x)
            dst2[c] = att_pack_f16(src[2 * c], src[2 * c + 1]);
        return;
    }
    float* dst = cache + (long long)p * w;
    for (int c = threadIdx.x; c < w; c += blockDim.x) dst[c] = src[c];
}

