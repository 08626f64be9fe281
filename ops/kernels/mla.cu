// Multi-head latent attention (absorbed form) and its rope, spec §3.5 / §5.
//
// Numerics follow the CPU references in ops/src/{rope,mla}.rs: everything is f32 (the RMS
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

// Rotates (src[2i], src[2i+1]) into dst for pairs i < n_rot/2, one thread a pair.
__device__ __forceinline__ void rope_pairs(const float* src, float* dst, int pos, int n_rot,
                                           int tid, int nthreads, float theta_scale,
                                           float freq_scale, float ext_factor, float corr_low,
                                           float corr_high, float mscale) {
    for (int i = tid; i < n_rot / 2; i += nthreads) {
        float c, s;
        rope_cos_sin(pos, i, theta_scale, freq_scale, ext_factor, corr_low, corr_high, mscale,
                     &c, &s);
        const float x0 = src[2 * i], x1 = src[2 * i + 1];
        dst[2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        dst[2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
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

extern "C" __global__ void __launch_bounds__(256)
head_gemv_bf16(const unsigned short* __restrict__ W, const float* __restrict__ x,
               long long x_tok, long long x_head, float* __restrict__ y, long long y_tok,
               long long y_head, int n_tok, int n_out, int n_in, int lpr_log2, int passes,
               int row_blocks, int tok_tile, const int* __restrict__ positions, int rope_n,
               int rope_src, int rope_dst, float theta_scale, float freq_scale,
               float ext_factor, float corr_low, float corr_high, float mscale) {
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

    for (int t0 = 0; t0 < n_tok; t0 += tok_tile) {
        const int tn = min(tok_tile, n_tok - t0);
        __syncthreads();
        for (int idx = tid; idx < tn * n_in; idx += blockDim.x) {
            const int t = idx / n_in, i = idx - t * n_in;
            xs[idx] = x[(t0 + t) * x_tok + h * x_head + i];
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
            for (int t = 0; t < tn; ++t) {
                float acc = 0.0f;
#pragma unroll
                for (int s = 0; s < HG_SEGS; ++s) {
                    const int seg = li + s * lpr;
                    if (seg < nseg) {
                        const float4 a = *reinterpret_cast<const float4*>(xs + t * n_in + seg * 8);
                        const float4 b =
                            *reinterpret_cast<const float4*>(xs + t * n_in + seg * 8 + 4);
                        acc = fmaf(w[s][0], a.x, acc);
                        acc = fmaf(w[s][1], a.y, acc);
                        acc = fmaf(w[s][2], a.z, acc);
                        acc = fmaf(w[s][3], a.w, acc);
                        acc = fmaf(w[s][4], b.x, acc);
                        acc = fmaf(w[s][5], b.y, acc);
                        acc = fmaf(w[s][6], b.z, acc);
                        acc = fmaf(w[s][7], b.w, acc);
                    }
                }
                for (int off = lpr >> 1; off > 0; off >>= 1)
                    acc += __shfl_xor_sync(0xffffffffu, acc, off);
                if (rv && li == 0) y[(t0 + t) * y_tok + h * y_head + row] = acc;
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

// ---- MlaKv: rms(latent)*w || rope(k_pe) ------------------------------------------------

extern "C" __global__ void __launch_bounds__(256)
mla_kv(const float* __restrict__ kv, const float* __restrict__ norm_w,
       const int* __restrict__ positions, float* __restrict__ out, int kv_lora, int qk_rope,
       float eps, float theta_scale, float freq_scale, float ext_factor, float corr_low,
       float corr_high, float mscale) {
    __shared__ double red[8];
    __shared__ float scale_s;
    const int t = blockIdx.x, tid = threadIdx.x;
    const int w = kv_lora + qk_rope;
    const float* src = kv + (long long)t * w;
    float* dst = out + (long long)t * w;
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
    for (int i = tid; i < kv_lora; i += blockDim.x)
        dst[i] = __fmul_rn(__fmul_rn(src[i], scale), norm_w[i]);
    rope_pairs(src + kv_lora, dst + kv_lora, positions[t], qk_rope, tid, blockDim.x,
               theta_scale, freq_scale, ext_factor, corr_low, corr_high, mscale);
}

// ---- KvCacheWrite ----------------------------------------------------------------------

// cache[positions[i]] = k[i]. A position outside [0, ctx) is skipped (the engine refuses it
// on the host); when two tokens name one row the later one writes it, as the CPU's loop.
extern "C" __global__ void __launch_bounds__(256)
kv_cache_write(float* __restrict__ cache, const float* __restrict__ k,
               const int* __restrict__ positions, int n, int w, int ctx) {
    const int i = blockIdx.x;
    const int p = positions[i];
    if (p < 0 || p >= ctx) return;
    for (int j = i + 1; j < n; ++j)
        if (positions[j] == p) return;
    const float* src = k + (long long)i * w;
    float* dst = cache + (long long)p * w;
    for (int c = threadIdx.x; c < w; c += blockDim.x) dst[c] = src[c];
}

// ---- MlaAttention: split-K flash decoding over the shared latent rows --------------------
//
// Block (chunk, token, head group of 32). Rows 0..=pos are split into n_chunks chunks (whole
// ATT_T-row tiles) at run time from the position, so a fixed grid serves every position of
// the bucket; chunks past the position exit. Per tile of ATT_T rows (cp.async, three tiles
// in flight) the scores S[32 heads][ATT_T] are a register-blocked product: warp w takes the
// query dims [72w, 72w+72), each lane 4 heads x 4 rows; the 8 warps' partials are summed in
// warp order. Softmax bookkeeping (running max, per-thread partial sums) is one thread per
// (head, 2 rows). The value product keeps O[32 heads][kv_lora] in registers: warp w owns
// columns [64w, 64w+64), each lane 4 heads x 16 columns. With n_chunks == 1 the block writes
// the normalised output, otherwise (m, l, o) per head for mla_attn_combine.
// W <= 576 and kv_lora <= 512 (8 warps x 72 / x 64), both multiples of 4.

#define ATT_T 16
#define ATT_QD 72
#define ATT_OD 64

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows per chunk for `nrows` valid rows over `n_chunks` chunks (whole tiles).
__device__ __forceinline__ int att_rows_per_chunk(int nrows, int n_chunks) {
    const int per = (nrows + n_chunks - 1) / n_chunks;
    return (per + ATT_T - 1) / ATT_T * ATT_T;
}

// Shared-memory row stride: >= w and = 4 (mod 32) floats, so rows 1 apart start 4 banks
// apart and the lanes' 16-byte loads of 8 different rows hit distinct banks.
__device__ __forceinline__ int att_stride(int w) { return w + ((36 - (w & 31)) & 31); }

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

extern "C" __global__ void __launch_bounds__(256, 1)
mla_attn_split(const float* __restrict__ q, const float* __restrict__ cache,
               const int* __restrict__ positions, float* __restrict__ out,
               float* __restrict__ part_o, float* __restrict__ part_ml, int n_tok, int n_head,
               int w, int lora, int ctx, int n_chunks, float kq_scale) {
    extern __shared__ float4 att_smem4[];
    const int ws = att_stride(w);
    float* qs = reinterpret_cast<float*>(att_smem4);  // [32][ws]
    float* ks = qs + 32 * ws;                         // [3][ATT_T][ws]
    float* sp = ks + 3 * ATT_T * ws;                  // [8][ATT_T][32] score partials
    float* sc = sp + 8 * ATT_T * 32;                  // [ATT_T][32] scores
    float* pr = sc + ATT_T * 32;                      // [ATT_T][8][4] weights, (head&7, head>>3)
    float* corr_s = pr + ATT_T * 32;                  // [32]
    float* m_s = corr_s + 32;                         // [32]
    float* lsum = m_s + 32;                           // [8][32]

    const int chunk = blockIdx.x, t = blockIdx.y, hg = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int pos = positions[t];
    const int nrows = pos < 0 ? 0 : min(pos, ctx - 1) + 1;
    const int per = att_rows_per_chunk(nrows, n_chunks);
    const int r0 = chunk * per, r1 = min(r0 + per, nrows);
    // Value-product roles: heads hq + 8i, columns c0 .. c0+16.
    const int hq = lane & 7, cq = lane >> 3;
    const int c0 = warp * ATT_OD + 16 * cq;
    const int n4 = max(0, min(4, (lora - c0) / 4));
    if (r0 >= r1) {
        // Only a position outside the cache leaves the single chunk empty: write zeros.
        if (n_chunks == 1)
            for (int i = 0; i < 4; ++i) {
                const int h = hg * 32 + hq + 8 * i;
                if (h < n_head)
                    for (int c = 0; c < 4 * n4; ++c)
                        out[((long long)t * n_head + h) * lora + c0 + c] = 0.0f;
            }
        return;
    }

    const int w4 = w >> 2;
    const int ntiles = (r1 - r0 + ATT_T - 1) / ATT_T;
    auto issue = [&](int it) {
        const int jr = r0 + it * ATT_T;
        const int jn = min(ATT_T, r1 - jr);
        float* dst = ks + (it % 3) * ATT_T * ws;
        for (int idx = tid; idx < jn * w4; idx += blockDim.x) {
            const int j = idx / w4, c = idx - j * w4;
            cp_async16(dst + j * ws + 4 * c, cache + (long long)(jr + j) * w + 4 * c);
        }
        cp_async_commit();
    };
    issue(0);
    if (ntiles > 1) issue(1);
    // Q of the head group (zero for heads past n_head).
    for (int idx = tid; idx < 32 * w4; idx += blockDim.x) {
        const int hh = idx / w4, c = idx - hh * w4;
        const int h = hg * 32 + hh;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (h < n_head)
            v = *reinterpret_cast<const float4*>(q + ((long long)t * n_head + h) * w + 4 * c);
        *reinterpret_cast<float4*>(qs + hh * ws + 4 * c) = v;
    }

    // Score roles: heads hq + 8i, rows kq + 4j of the tile, dims of this warp.
    const int kq = lane >> 3;
    const int nd4 = max(0, min(ATT_QD / 4, (w - warp * ATT_QD) / 4));
    // Softmax roles: head sh, rows 2*sg and 2*sg+1.
    const int sh = tid & 31, sg = tid >> 5;
    float m_run = NEG_INF, l_run = 0.0f;

    float o[4][16];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int c = 0; c < 16; ++c) o[i][c] = 0.0f;

    for (int it = 0; it < ntiles; ++it) {
        // Buffer (it+2)%3 was last read in iteration it-1, which ended with a barrier.
        if (it + 2 < ntiles) {
            issue(it + 2);
            cp_async_wait<2>();
        } else if (it + 1 < ntiles) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const float* kt = ks + (it % 3) * ATT_T * ws;
        const int jn = min(ATT_T, r1 - (r0 + it * ATT_T));

        {
            float acc[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
            const float* qw = qs + warp * ATT_QD;
            const float* kw = kt + warp * ATT_QD;
#pragma unroll
            for (int d4 = 0; d4 < ATT_QD / 4; ++d4) {
                if (d4 < nd4) {
                    float4 qv[4], kv[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        qv[i] = *reinterpret_cast<const float4*>(qw + (hq + 8 * i) * ws + 4 * d4);
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        kv[j] = *reinterpret_cast<const float4*>(kw + (kq + 4 * j) * ws + 4 * d4);
#pragma unroll
                    for (int i = 0; i < 4; ++i)
#pragma unroll
                        for (int j = 0; j < 4; ++j) acc[i][j] = dot4(qv[i], kv[j], acc[i][j]);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    sp[(warp * ATT_T + kq + 4 * j) * 32 + hq + 8 * i] = acc[i][j];
        }
        __syncthreads();

        // Full scores of head sh, rows 2sg and 2sg+1 (warp partials summed in warp order).
        float s2[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = 2 * sg + u;
            s2[u] = NEG_INF;
            if (j < jn) {
                float v = sp[j * 32 + sh];
#pragma unroll
                for (int k = 1; k < 8; ++k) v += sp[(k * ATT_T + j) * 32 + sh];
                s2[u] = kq_scale * v;
            }
            sc[j * 32 + sh] = s2[u];
        }
        __syncthreads();
        {
            float tmax = NEG_INF;
            for (int j = 0; j < jn; ++j) tmax = fmaxf(tmax, sc[j * 32 + sh]);
            const float m_new = fmaxf(m_run, tmax);
            const float corr = expf(m_run - m_new);
            float psum = 0.0f;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = 2 * sg + u;
                const float p = j < jn ? expf(s2[u] - m_new) : 0.0f;
                psum += p;
                pr[j * 32 + (sh & 7) * 4 + (sh >> 3)] = p;
            }
            l_run = l_run * corr + psum;
            m_run = m_new;
            if (sg == 0) corr_s[sh] = corr;
        }
        __syncthreads();

        // O = O*corr + P V over this tile.
        if (n4 > 0) {
            float cr[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) cr[i] = corr_s[hq + 8 * i];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 16; ++c) o[i][c] *= cr[i];
            const float* kv0 = kt + c0;
            for (int j = 0; j < jn; ++j) {
                const float4 p4 = *reinterpret_cast<const float4*>(pr + j * 32 + hq * 4);
                const float pv[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    if (m < n4) {
                        const float4 v = *reinterpret_cast<const float4*>(kv0 + j * ws + 4 * m);
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            o[i][4 * m] = fmaf(pv[i], v.x, o[i][4 * m]);
                            o[i][4 * m + 1] = fmaf(pv[i], v.y, o[i][4 * m + 1]);
                            o[i][4 * m + 2] = fmaf(pv[i], v.z, o[i][4 * m + 2]);
                            o[i][4 * m + 3] = fmaf(pv[i], v.w, o[i][4 * m + 3]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    lsum[sg * 32 + sh] = l_run;
    if (sg == 0) m_s[sh] = m_run;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int hh = hq + 8 * i;
        const int h = hg * 32 + hh;
        if (h >= n_head) continue;
        float l = lsum[hh];
#pragma unroll
        for (int k = 1; k < 8; ++k) l += lsum[k * 32 + hh];
        const long long slot = ((long long)t * n_chunks + chunk) * n_head + h;
        if (n_chunks == 1) {
            const float inv = 1.0f / l;
            float* dst = out + ((long long)t * n_head + h) * lora + c0;
#pragma unroll
            for (int m = 0; m < 4; ++m)
                if (m < n4)
                    *reinterpret_cast<float4*>(dst + 4 * m) =
                        make_float4(o[i][4 * m] * inv, o[i][4 * m + 1] * inv,
                                    o[i][4 * m + 2] * inv, o[i][4 * m + 3] * inv);
        } else {
            float* dst = part_o + slot * lora + c0;
#pragma unroll
            for (int m = 0; m < 4; ++m)
                if (m < n4)
                    *reinterpret_cast<float4*>(dst + 4 * m) =
                        make_float4(o[i][4 * m], o[i][4 * m + 1], o[i][4 * m + 2], o[i][4 * m + 3]);
            if (warp == 0 && cq == 0) {
                part_ml[2 * slot] = m_s[hh];
                part_ml[2 * slot + 1] = l;
            }
        }
    }
}

// Merges the chunk partials of one (token, head, 128 columns): every sum in a fixed order
// (chunk c to warp c % 8, lanes then warps), so the result is the same on every run.
extern "C" __global__ void __launch_bounds__(256)
mla_attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                 const int* __restrict__ positions, float* __restrict__ out, int n_head,
                 int lora, int ctx, int n_chunks) {
    extern __shared__ float cb_smem[];
    float* red = cb_smem;        // [8][128]
    float* wts = red + 8 * 128;  // [n_chunks]
    __shared__ float wred[8];
    __shared__ float stat[2];
    const int h = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int pos = positions[t];
    const int nrows = pos < 0 ? 0 : min(pos, ctx - 1) + 1;
    const int per = att_rows_per_chunk(nrows, n_chunks);
    const int nvalid = nrows == 0 ? 0 : (nrows + per - 1) / per;
    const long long base = (long long)t * n_chunks * n_head + h;

    float mx = NEG_INF;
    for (int c = tid; c < nvalid; c += blockDim.x)
        mx = fmaxf(mx, part_ml[2 * (base + (long long)c * n_head)]);
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) wred[warp] = mx;
    __syncthreads();
    if (tid == 0) {
        float m = wred[0];
        for (int k = 1; k < 8; ++k) m = fmaxf(m, wred[k]);
        stat[0] = m;
    }
    __syncthreads();
    const float M = stat[0];
    float ls = 0.0f;
    for (int c = tid; c < nvalid; c += blockDim.x) {
        const long long slot = base + (long long)c * n_head;
        const float e = expf(part_ml[2 * slot] - M);
        wts[c] = e;
        ls = fmaf(part_ml[2 * slot + 1], e, ls);
    }
    for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
    __syncthreads();
    if (lane == 0) wred[warp] = ls;
    __syncthreads();
    if (tid == 0) {
        float l = wred[0];
        for (int k = 1; k < 8; ++k) l += wred[k];
        stat[1] = l;
    }
    const int col = blockIdx.x * 128 + 4 * lane;
    const bool cv = col < lora;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (cv)
        for (int c = warp; c < nvalid; c += 8) {
            const float e = wts[c];
            const float4 v = *reinterpret_cast<const float4*>(
                part_o + (base + (long long)c * n_head) * lora + col);
            acc.x = fmaf(v.x, e, acc.x);
            acc.y = fmaf(v.y, e, acc.y);
            acc.z = fmaf(v.z, e, acc.z);
            acc.w = fmaf(v.w, e, acc.w);
        }
    *reinterpret_cast<float4*>(red + warp * 128 + 4 * lane) = acc;
    __syncthreads();
    if (warp == 0 && cv) {
        float4 s = *reinterpret_cast<const float4*>(red + 4 * lane);
        for (int k = 1; k < 8; ++k) {
            const float4 v = *reinterpret_cast<const float4*>(red + k * 128 + 4 * lane);
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
        }
        const float inv = nvalid == 0 ? 0.0f : 1.0f / stat[1];
        *reinterpret_cast<float4*>(out + ((long long)t * n_head + h) * lora + col) =
            make_float4(s.x * inv, s.y * inv, s.z * inv, s.w * inv);
    }
}
