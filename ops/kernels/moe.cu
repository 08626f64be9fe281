// Routed experts, spec §3.7 / seed §4: router, the device-side route plan, the grouped
// IQ4_NL expert products and the slot-order top-k sum. Every output element has one writer
// and every sum a fixed order, so two runs give the same bits. The CPU references in
// ops/src/moe.rs are the spec; where their rounding can be reproduced exactly (sigmoid,
// weight normalisation, the top-k sum) the explicit-rounding intrinsics keep NVRTC from
// contracting a*b+c into an fma.

#include <cuda_fp16.h>

#define NEG_INF (-__int_as_float(0x7f800000))

// ---- router ----------------------------------------------------------------------------

// part[t][s][e] = sum_{k in slice s} W[e][k] * z[t][k], slices of RL_SLICE values. Block =
// 8 warps = 8 experts of one slice over a tile of tokens; lane = 4 consecutive k.
#define RL_SLICE 128

extern "C" __global__ void __launch_bounds__(256)
router_logits(const float* __restrict__ z, const float* __restrict__ W, float* __restrict__ part,
              int n, int d, int n_expert, int n_slices, int tok_tile) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * 8 + warp;
    const int s = blockIdx.y;
    const int k = s * RL_SLICE + 4 * lane;
    const bool kv = k < d;
    float4 wv = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e < n_expert && kv) wv = *reinterpret_cast<const float4*>(W + (long long)e * d + k);
    const int t0 = blockIdx.z * tok_tile, t1 = min(n, t0 + tok_tile);
    for (int t = t0; t < t1; ++t) {
        float4 zv = make_float4(0.f, 0.f, 0.f, 0.f);
        if (kv) zv = *reinterpret_cast<const float4*>(z + (long long)t * d + k);
        float acc = wv.x * zv.x;
        acc = fmaf(wv.y, zv.y, acc);
        acc = fmaf(wv.z, zv.z, acc);
        acc = fmaf(wv.w, zv.w, acc);
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0 && e < n_expert) part[((long long)t * n_slices + s) * n_expert + e] = acc;
    }
}

// Rust's f32::total_cmp as a signed-integer key.
__device__ __forceinline__ int total_key(float x) {
    int b = __float_as_int(x);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

// One warp a token: logits (slices summed in order), gating, top-k by the biased score
// (ties: lower id), weights from the unbiased scores, normalised and scaled as the CPU does.
extern "C" __global__ void __launch_bounds__(256)
router_select(const float* __restrict__ part, const float* __restrict__ bias,
              int* __restrict__ ids, float* __restrict__ weights, int n, int n_expert,
              int n_slices, int top_k, int softmax, int norm_topk, float scale, float guard) {
    extern __shared__ int rs_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 8 + warp;
    if (t >= n) return;
    float* p = reinterpret_cast<float*>(rs_smem) + warp * 3 * n_expert;
    int* key = reinterpret_cast<int*>(p + n_expert);
    int* taken = key + n_expert;
    const float* pt = part + (long long)t * n_slices * n_expert;

    float lmax = NEG_INF;
    for (int e = lane; e < n_expert; e += 32) {
        // The same left-to-right sum, but 16 slices' loads in flight at once: the partials
        // come from L2 and a serial chain of loads dominated the decode step's router.
        float v = pt[e];
        for (int s = 1; s < n_slices; s += 16) {
            float t[16];
#pragma unroll
            for (int i = 0; i < 16; ++i)
                t[i] = s + i < n_slices ? pt[(long long)(s + i) * n_expert + e] : 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i)
                if (s + i < n_slices) v += t[i];
        }
        p[e] = v;
        lmax = fmaxf(lmax, v);
        taken[e] = 0;
    }
    if (softmax) {
        for (int off = 16; off > 0; off >>= 1)
            lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffffu, lmax, off));
        for (int e = lane; e < n_expert; e += 32) p[e] = expf(__fsub_rn(p[e], lmax));
        __syncwarp();
        float sum = 0.0f;
        if (lane == 0)
            for (int e = 0; e < n_expert; ++e) sum = __fadd_rn(sum, p[e]);
        const float inv = __fdiv_rn(1.0f, __shfl_sync(0xffffffffu, sum, 0));
        __syncwarp();
        for (int e = lane; e < n_expert; e += 32) p[e] = __fmul_rn(p[e], inv);
    } else {
        for (int e = lane; e < n_expert; e += 32)
            p[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-p[e])));
    }
    for (int e = lane; e < n_expert; e += 32)
        key[e] = total_key(bias ? __fadd_rn(p[e], bias[e]) : p[e]);
    __syncwarp();

    for (int j = 0; j < top_k; ++j) {
        int bk = 0, be = -1;
        for (int e = lane; e < n_expert; e += 32)
            if (!taken[e] && (be < 0 || key[e] > bk)) {
                bk = key[e];
                be = e;
            }
        for (int off = 16; off > 0; off >>= 1) {
            const int ok = __shfl_xor_sync(0xffffffffu, bk, off);
            const int oe = __shfl_xor_sync(0xffffffffu, be, off);
            if (oe >= 0 && (be < 0 || ok > bk || (ok == bk && oe < be))) {
                bk = ok;
                be = oe;
            }
        }
        if (lane == 0) {
            ids[(long long)t * top_k + j] = be;
            if (be >= 0) taken[be] = 1;
        }
        __syncwarp();
    }
    if (lane == 0) {
        int* it = ids + (long long)t * top_k;
        float* wt = weights + (long long)t * top_k;
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            wt[j] = it[j] >= 0 ? p[it[j]] : 0.0f;
            sum = __fadd_rn(sum, wt[j]);
        }
        sum = fmaxf(sum, guard);
        for (int j = 0; j < top_k; ++j) {
            float w = wt[j];
            if (norm_topk) w = __fdiv_rn(w, sum);
            wt[j] = __fmul_rn(w, scale);
        }
    }
}

// ---- route plan ------------------------------------------------------------------------

// A stable counting sort of the slots by expert, in one block: per-expert counts, their
// exclusive scan (the CSR offsets), then the slots in chunks of blockDim: ranks inside a
// warp from __match_any_sync, across warps from a per-(warp, expert) table scanned in warp
// order, across chunks from a running cursor. Ids outside [0, E) are skipped and the rows
// they leave at the end are marked -1 (the engine validates ids; this only bounds writes).
extern "C" __global__ void __launch_bounds__(1024)
route_plan(const int* __restrict__ ids, int* __restrict__ offsets, int* __restrict__ route_token,
           int* __restrict__ route_slot, int n_routes, int n_expert, int top_k) {
    extern __shared__ int rp_smem[];
    int* counts = rp_smem;
    int* cursor = counts + n_expert;
    int* table = cursor + n_expert;  // [nwarps][n_expert]
    __shared__ int total;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    const unsigned lt = (1u << lane) - 1u;

    for (int e = tid; e < n_expert; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int s = tid; s < n_routes; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < n_expert) atomicAdd(&counts[e], 1);
    }
    __syncthreads();
    if (warp == 0) {
        // Exclusive scan of the counts, 32 experts a step.
        int run = 0;
        for (int e0 = 0; e0 < n_expert; e0 += 32) {
            const int e = e0 + lane;
            const int c = e < n_expert ? counts[e] : 0;
            int incl = c;
            for (int off = 1; off < 32; off <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += v;
            }
            if (e < n_expert) {
                cursor[e] = run + incl - c;
                offsets[e] = run + incl - c;
            }
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) {
            offsets[n_expert] = run;
            total = run;
        }
    }
    __syncthreads();
    for (int base = 0; base < n_routes; base += blockDim.x) {
        for (int i = tid; i < nwarps * n_expert; i += blockDim.x) table[i] = 0;
        __syncthreads();
        const int s = base + tid;
        const int e = s < n_routes ? ids[s] : -1;
        const bool valid = e >= 0 && e < n_expert;
        const unsigned mask = __match_any_sync(0xffffffffu, valid ? e : n_expert + lane);
        const int rank = __popc(mask & lt);
        if (valid && rank == 0) table[warp * n_expert + e] = __popc(mask);
        __syncthreads();
        for (int x = tid; x < n_expert; x += blockDim.x) {
            int run = cursor[x];
            for (int w = 0; w < nwarps; ++w) {
                const int c = table[w * n_expert + x];
                table[w * n_expert + x] = run;
                run += c;
            }
            cursor[x] = run;
        }
        __syncthreads();
        if (valid) {
            const int dst = table[warp * n_expert + e] + rank;
            route_token[dst] = s / top_k;
            route_slot[dst] = s;
        }
        __syncthreads();
    }
    for (int d = total + tid; d < n_routes; d += blockDim.x) {
        route_token[d] = -1;
        route_slot[d] = -1;
    }
}

// ---- IQ4_NL block decoding --------------------------------------------------------------
//
// Eight 18-byte blocks are 144 bytes = 9 aligned 16-byte words (rows are whole multiples of
// 8 blocks). In a pair of blocks held as 9 u32 (w0..w8): the even block's d is w0's low half
// and its 16 nibble bytes straddle w0..w4; the odd block's d is w4's high half and its bytes
// are exactly w5..w8.

__device__ __forceinline__ void iq4_pair_block(const unsigned* w, int odd, float* d,
                                               unsigned q[4]) {
    if (!odd) {
        *d = __half2float(__ushort_as_half((unsigned short)(w[0] & 0xffffu)));
        q[0] = __byte_perm(w[0], w[1], 0x5432);
        q[1] = __byte_perm(w[1], w[2], 0x5432);
        q[2] = __byte_perm(w[2], w[3], 0x5432);
        q[3] = __byte_perm(w[3], w[4], 0x5432);
    } else {
        *d = __half2float(__ushort_as_half((unsigned short)(w[4] >> 16)));
        q[0] = w[5];
        q[1] = w[6];
        q[2] = w[7];
        q[3] = w[8];
    }
}

// Value j of the block is the low nibble of byte j (j < 16), value j+16 its high nibble. The
// codebook lives in four registers and byte permutes look up four nibbles at once: entries
// 0-7 and 8-15 by the nibbles' low 3 bits, then bit 3 picks between the two, so no
// shared-memory table is read. The entries are stored plus 128 (0..255): a byte k placed
// under the exponent of 2^23 is the float 2^23 + k exactly, and one exact subtraction gives
// the code, which avoids the quarter-rate integer-to-float conversion on every value.
__device__ __forceinline__ float iq4_byte(unsigned r, unsigned sel) {
    return __fsub_rn(__int_as_float((int)__byte_perm(r, 0x4b000000u, sel)), 8388736.0f);
}

__device__ __forceinline__ void iq4_codes(const unsigned q[4], float v[32]) {
    const unsigned t0 = 0x3f2d1801u, t1 = 0x766a5d4fu, t2 = 0xa6998d81u, t3 = 0xf1d9c5b5u;
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned h = (q[m] >> (16 * half)) & 0xffffu;
            const unsigned lo = __byte_perm(t0, t1, h & 0x7777u);
            const unsigned hi = __byte_perm(t2, t3, h & 0x7777u);
            // Bytes: low and high nibble of qs byte 2*half, then of qs byte 2*half+1.
            const unsigned r = __byte_perm(lo, hi, 0x3210u | ((h & 0x8888u) >> 1));
            const int b = 4 * m + 2 * half;
            v[b] = iq4_byte(r, 0x7650u);
            v[16 + b] = iq4_byte(r, 0x7651u);
            v[b + 1] = iq4_byte(r, 0x7652u);
            v[16 + b + 1] = iq4_byte(r, 0x7653u);
        }
}

// The q-th expert (in id order) that has routes, or -1, and its offsets pair, for every lane
// of a full warp: 32 experts a step by ballot instead of a serial walk over the offsets.
__device__ __forceinline__ int nth_active_expert(const int* off, int n_expert, int q, int* lo,
                                                 int* hi) {
    const int lane = threadIdx.x & 31;
    for (int e0 = 0; e0 < n_expert; e0 += 32) {
        const int e = e0 + lane;
        const int a = e < n_expert ? off[e] : 0;
        const int b = e < n_expert ? off[e + 1] : 0;
        const bool act = b > a;
        const unsigned m = __ballot_sync(0xffffffffu, act);
        const int c = __popc(m);
        if (q < c) {
            const bool hit = act && __popc(m & ((1u << lane) - 1u)) == q;
            const int src = __ffs(__ballot_sync(0xffffffffu, hit)) - 1;
            *lo = __shfl_sync(0xffffffffu, a, src);
            *hi = __shfl_sync(0xffffffffu, b, src);
            return e0 + src;
        }
        q -= c;
    }
    return -1;
}

__device__ __forceinline__ float silu_times(float g, float u) {
    return __fmul_rn(u, __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
}

// ---- decode path: grouped GEMV ------------------------------------------------------------
//
// blockIdx.y = the y-th expert with routes (the grid is sized for the worst case, min(E, R);
// the rest exit), blockIdx.x = a tile of output rows. The expert's routes' inputs are staged
// in shared memory (padded by 4 floats every 256 so the lanes of a row read distinct banks),
// up to `maxr` at a time; each weight row is read once per such group, 144 bytes a lane in
// 16-byte loads, decoded once and dotted with every staged route. A group of lpr lanes owns a
// row; for SwiGLU (Wb != 0) group pairs take the gate and up rows of one output and combine.
// Decode is latency-bound, so a pass issues its first weight loads before the inputs are
// staged and the rows of later passes are prefetched into L2 at the start.
#define EG_MAXR 8

// A lane's 144 bytes as nine 16-byte read-only loads. The lanes of a row read 144 bytes
// apart, so each load touches many sectors; the 256-byte L2 fetch hint turns those into
// fewer, larger DRAM requests (the neighbouring rows are read by neighbouring warps). The
// asm is volatile so the loads stay ahead of the input staging and its barriers.
__device__ __forceinline__ void eg_load_chunk(const unsigned char* wrow, int c, unsigned wd[36]) {
    const unsigned char* src = wrow + (long long)c * 144;
#pragma unroll
    for (int i = 0; i < 9; ++i)
        asm volatile("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(wd[4 * i]), "=r"(wd[4 * i + 1]), "=r"(wd[4 * i + 2]),
                       "=r"(wd[4 * i + 3])
                     : "l"(src + 16 * i));
}

extern "C" __global__ void __launch_bounds__(256)
expert_gemv_iq4(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                const float* __restrict__ x, const int* __restrict__ offsets,
                const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,
                int n_expert, int n_x_rows, int n_routes, int lpr_log2, int passes, int maxr) {
    extern __shared__ float4 eg_smem4[];
    float* xs = reinterpret_cast<float*>(eg_smem4);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int lo = 0, hi = 0;
    const int e = nth_active_expert(offsets, n_expert, blockIdx.y, &lo, &hi);
    if (e < 0) return;
    const int r0 = min(max(lo, 0), n_routes);
    const int r_end = min(max(hi, r0), n_routes);
    const bool swiglu = Wb != nullptr;
    const int lpr = 1 << lpr_log2, groups = 32 >> lpr_log2;
    const int g = lane >> lpr_log2, li = lane & (lpr - 1);
    const int rpw = swiglu ? groups / 2 : groups;
    const int row_in_warp = swiglu ? g >> 1 : g;
    const int which = swiglu ? g & 1 : 0;
    const unsigned char* mat = which ? Wb : Wa;
    const int xw = n_in + n_in / 64;
    const int nchunks = n_in >> 8;
    const long long row_bytes = (long long)(n_in >> 5) * 18;
    const int in4 = n_in >> 2;

    if (r0 < r_end) {
        // One prefetch a 32-byte sector (the row is not line-aligned), the last at the
        // row's final byte so every address stays inside the row.
        const int sectors = (int)(row_bytes >> 5) + 1;
        for (int p = 1; p < passes; ++p) {
            const int row = blockIdx.x * (passes * 8 * rpw) + (p * 8 + warp) * rpw + row_in_warp;
            if (row < n_out) {
                const unsigned char* wr = mat + ((long long)e * n_out + row) * row_bytes;
                for (int l = li; l < sectors; l += lpr)
                    asm volatile("prefetch.L2 [%0];" ::"l"(wr + min((long long)l << 5,
                                                                     row_bytes - 1)));
            }
        }
    }

    for (int rg = r0; rg < r_end; rg += maxr) {
        const int cnt = min(maxr, r_end - rg);
        for (int p = 0; p < passes; ++p) {
            const int row = blockIdx.x * (passes * 8 * rpw) + (p * 8 + warp) * rpw + row_in_warp;
            const bool rv = row < n_out;
            float acc[EG_MAXR];
#pragma unroll
            for (int j = 0; j < EG_MAXR; ++j) acc[j] = 0.0f;
            const unsigned char* wrow = mat + ((long long)e * n_out + (rv ? row : 0)) * row_bytes;
            unsigned wd[36];
            int c = li;
            if (rv && c < nchunks) eg_load_chunk(wrow, c, wd);
            if (p == 0) {
                // p and rg are block-uniform, so every thread reaches both barriers.
                __syncthreads();
                for (int idx = tid; idx < cnt * in4; idx += blockDim.x) {
                    const int j = idx / in4, k = 4 * (idx - j * in4);
                    const int src = swiglu ? route_token[rg + j] : rg + j;
                    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (src >= 0 && src < n_x_rows)
                        v = *reinterpret_cast<const float4*>(x + (long long)src * n_in + k);
                    *reinterpret_cast<float4*>(xs + j * xw + k + 4 * (k >> 8)) = v;
                }
                __syncthreads();
            }
            while (rv && c < nchunks) {
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    float dv;
                    unsigned q[4];
                    iq4_pair_block(wd + 9 * (b >> 1), b & 1, &dv, q);
                    float wv[32];
                    iq4_codes(q, wv);
                    const float* xb = xs + c * 260 + 32 * b;
#pragma unroll
                    for (int j = 0; j < EG_MAXR; ++j) {
                        if (j < cnt) {
                            float s = 0.0f;
#pragma unroll
                            for (int i = 0; i < 32; i += 4) {
                                const float4 xv = *reinterpret_cast<const float4*>(xb + j * xw + i);
                                s = fmaf(wv[i], xv.x, s);
                                s = fmaf(wv[i + 1], xv.y, s);
                                s = fmaf(wv[i + 2], xv.z, s);
                                s = fmaf(wv[i + 3], xv.w, s);
                            }
                            acc[j] = fmaf(dv, s, acc[j]);
                        }
                    }
                }
                c += lpr;
                if (c < nchunks) eg_load_chunk(wrow, c, wd);
            }
#pragma unroll
            for (int j = 0; j < EG_MAXR; ++j) {
                if (j < cnt) {
                    float v = acc[j];
                    for (int off = lpr >> 1; off > 0; off >>= 1)
                        v += __shfl_xor_sync(0xffffffffu, v, off);
                    if (swiglu) {
                        const float u = __shfl_xor_sync(0xffffffffu, v, lpr);
                        if (which == 0 && li == 0 && rv)
                            y[(long long)(rg + j) * n_out + row] = silu_times(v, u);
                    } else if (li == 0 && rv) {
                        y[(long long)(rg + j) * n_out + row] = v;
                    }
                }
            }
        }
    }
}

// The same GEMV with the weights staged through shared memory: each warp copies its rows
// with cp.async, consecutive lanes taking consecutive 16-byte pieces (a warp instruction
// reads 512 contiguous bytes instead of 32 pieces 144 bytes apart), every pass's rows are in
// flight before the inputs are staged, and they hold no registers while in flight. The
// rows are copied once and serve every group of staged routes. Lanes then read their
// 144-byte chunks from shared memory: lanes a chunk apart (36 words) start in distinct
// 16-byte bank groups, so the 16-byte reads of a quarter-warp do not conflict. Shared
// memory: the staged inputs, then passes*8*groups rows (each a multiple of 144 bytes, so
// every row stays 16-byte aligned).
__device__ __forceinline__ void eg_cp16(unsigned dst, const unsigned char* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src)
                 : "memory");
}

extern "C" __global__ void __launch_bounds__(256)
expert_gemv_iq4_smem(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                     const float* __restrict__ x, const int* __restrict__ offsets,
                     const int* __restrict__ route_token, float* __restrict__ y, int n_in,
                     int n_out, int n_expert, int n_x_rows, int n_routes, int lpr_log2,
                     int passes, int maxr) {
    extern __shared__ float4 es_smem4[];
    float* xs = reinterpret_cast<float*>(es_smem4);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int lo = 0, hi = 0;
    const int e = nth_active_expert(offsets, n_expert, blockIdx.y, &lo, &hi);
    if (e < 0) return;
    const int r0 = min(max(lo, 0), n_routes);
    const int r_end = min(max(hi, r0), n_routes);
    if (r0 >= r_end) return;  // block-uniform: no barrier is skipped by part of the block
    const bool swiglu = Wb != nullptr;
    const int lpr = 1 << lpr_log2, groups = 32 >> lpr_log2;
    const int g = lane >> lpr_log2, li = lane & (lpr - 1);
    const int rpw = swiglu ? groups / 2 : groups;
    const int xw = n_in + n_in / 64;
    const int nchunks = n_in >> 8;
    const int row_bytes = (n_in >> 5) * 18;
    const int pieces = row_bytes >> 4;
    const int in4 = n_in >> 2;
    unsigned char* ws = reinterpret_cast<unsigned char*>(xs + (long long)maxr * xw);
    const int row_base = blockIdx.x * (passes * 8 * rpw);

    // Each pass's rows of this warp, one cp.async group a pass.
    for (int p = 0; p < passes; ++p) {
        unsigned char* wp = ws + (long long)((p * 8 + warp) * groups) * row_bytes;
        for (int gi = 0; gi < groups; ++gi) {
            const int row = row_base + (p * 8 + warp) * rpw + (swiglu ? gi >> 1 : gi);
            if (row >= n_out) continue;  // warp-uniform
            const unsigned char* src =
                ((swiglu && (gi & 1)) ? Wb : Wa) + ((long long)e * n_out + row) * row_bytes;
            const unsigned dst =
                (unsigned)__cvta_generic_to_shared(wp + (long long)gi * row_bytes);
            for (int i = lane; i < pieces; i += 32) eg_cp16(dst + 16 * i, src + 16 * i);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }

    const int row_in_warp = swiglu ? g >> 1 : g;
    const int which = swiglu ? g & 1 : 0;
    for (int rg = r0; rg < r_end; rg += maxr) {
        const int cnt = min(maxr, r_end - rg);
        // rg is block-uniform, so every thread reaches both barriers.
        __syncthreads();
        for (int idx = tid; idx < cnt * in4; idx += blockDim.x) {
            const int j = idx / in4, k = 4 * (idx - j * in4);
            const int src = swiglu ? route_token[rg + j] : rg + j;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (src >= 0 && src < n_x_rows)
                v = *reinterpret_cast<const float4*>(x + (long long)src * n_in + k);
            *reinterpret_cast<float4*>(xs + j * xw + k + 4 * (k >> 8)) = v;
        }
        __syncthreads();
        for (int p = 0; p < passes; ++p) {
            // Pass p's group is complete once at most passes-1-p groups are pending; waiting
            // for at most one (or none) is the same or stricter. Every lane waits for its own
            // copies, then the warp barrier makes all lanes' copies visible to the warp.
            if (passes - 1 - p >= 1)
                asm volatile("cp.async.wait_group 1;" ::: "memory");
            else
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncwarp();
            const int row = row_base + (p * 8 + warp) * rpw + row_in_warp;
            const bool rv = row < n_out;
            const unsigned char* wrow = ws + (long long)((p * 8 + warp) * groups + g) * row_bytes;
            float acc[EG_MAXR];
#pragma unroll
            for (int j = 0; j < EG_MAXR; ++j) acc[j] = 0.0f;
            for (int c = li; rv && c < nchunks; c += lpr) {
                unsigned wd[36];
                const uint4* src = reinterpret_cast<const uint4*>(wrow + c * 144);
#pragma unroll
                for (int i = 0; i < 9; ++i) {
                    const uint4 v = src[i];
                    wd[4 * i] = v.x;
                    wd[4 * i + 1] = v.y;
                    wd[4 * i + 2] = v.z;
                    wd[4 * i + 3] = v.w;
                }
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    float dv;
                    unsigned q[4];
                    iq4_pair_block(wd + 9 * (b >> 1), b & 1, &dv, q);
                    float wv[32];
                    iq4_codes(q, wv);
                    const float* xb = xs + c * 260 + 32 * b;
#pragma unroll
                    for (int j = 0; j < EG_MAXR; ++j) {
                        if (j < cnt) {
                            float s = 0.0f;
#pragma unroll
                            for (int i = 0; i < 32; i += 4) {
                                const float4 xv = *reinterpret_cast<const float4*>(xb + j * xw + i);
                                s = fmaf(wv[i], xv.x, s);
                                s = fmaf(wv[i + 1], xv.y, s);
                                s = fmaf(wv[i + 2], xv.z, s);
                                s = fmaf(wv[i + 3], xv.w, s);
                            }
                            acc[j] = fmaf(dv, s, acc[j]);
                        }
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < EG_MAXR; ++j) {
                if (j < cnt) {
                    float v = acc[j];
                    for (int off = lpr >> 1; off > 0; off >>= 1)
                        v += __shfl_xor_sync(0xffffffffu, v, off);
                    if (swiglu) {
                        const float u = __shfl_xor_sync(0xffffffffu, v, lpr);
                        if (which == 0 && li == 0 && rv)
                            y[(long long)(rg + j) * n_out + row] = silu_times(v, u);
                    } else if (li == 0 && rv) {
                        y[(long long)(rg + j) * n_out + row] = v;
                    }
                }
            }
        }
    }
}

// ---- prefill path: grouped GEMM over the CSR table -------------------------------------
//
// blockIdx.y = an (expert, tile of TM routes) pair, found by walking the offsets (the grid
// is sized for the worst case, ceil(R/TM) + min(E, R); the rest exit). blockIdx.x = a
// tile of GM_TR weight rows: SwiGLU takes 64 gate rows and the 64 up rows of the same
// outputs, the down projection 128 rows. Per GM_TK = 64 inputs (two IQ4_NL blocks) the
// weight tile is dequantized into shared memory once (d * code, as the CPU does) and the
// route inputs are gathered; each of the 4*TM threads then holds 4 routes x 8 rows in
// registers. TM = 32 suits ~32 routes an expert (a 512-token chunk of 64 experts, top-4).
#define GM_TR 128
#define GM_TK 64

template <int TM>
__device__ __forceinline__ void expert_gemm(const unsigned char* __restrict__ Wa,
                                            const unsigned char* __restrict__ Wb,
                                            const float* __restrict__ x,
                                            const int* __restrict__ offsets,
                                            const int* __restrict__ route_token,
                                            float* __restrict__ y, int n_in, int n_out,
                                            int n_expert, int n_x_rows, int n_routes) {
    constexpr int NT = 4 * TM;
    constexpr int XS = TM + 4;
    extern __shared__ float4 gm_smem4[];
    float* ws = reinterpret_cast<float*>(gm_smem4);  // [GM_TK][GM_TR]
    float* xs = ws + GM_TK * GM_TR;                  // [GM_TK][XS]
    __shared__ int srcs[TM];
    const int tid = threadIdx.x;
    const bool swiglu = Wb != nullptr;

    int q = blockIdx.y, e = -1;
    for (int ee = 0; ee < n_expert; ++ee) {
        const int c = offsets[ee + 1] - offsets[ee];
        const int tiles = c > 0 ? (c + TM - 1) / TM : 0;
        if (q < tiles) {
            e = ee;
            break;
        }
        q -= tiles;
    }
    if (e < 0) return;
    const int rb = min(max(offsets[e] + q * TM, 0), n_routes);
    const int rn = max(0, min(min(TM, offsets[e + 1] - rb), n_routes - rb));
    if (tid < TM) {
        int src = -1;
        if (tid < rn) src = swiglu ? route_token[rb + tid] : rb + tid;
        srcs[tid] = (src >= 0 && src < n_x_rows) ? src : -1;
    }
    const int out_cols = swiglu ? GM_TR / 2 : GM_TR;
    const int c0 = blockIdx.x * out_cols;
    const long long row_bytes = (long long)(n_in >> 5) * 18;

    // Weight loader role: row wq; blocks sub of each k-tile from the threads' count.
    const int wq = tid & (GM_TR - 1);
    int wrow_i;
    const unsigned char* wmat;
    if (swiglu) {
        wrow_i = c0 + (wq & 63);
        wmat = wq < 64 ? Wa : Wb;
    } else {
        wrow_i = c0 + wq;
        wmat = Wa;
    }
    const bool wvalid = wrow_i < n_out;
    const unsigned* wrow = reinterpret_cast<const unsigned*>(
        wmat + ((long long)e * n_out + (wvalid ? wrow_i : 0)) * row_bytes);
    // Input loader role: route xr, k quarter xq.
    const int xr = tid % TM, xq = tid / TM;

    const int ty = tid >> 4, tx = tid & 15;
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    __syncthreads();
    for (int k0 = 0; k0 < n_in; k0 += GM_TK) {
        for (int sub = tid / GM_TR; sub < 2; sub += NT / GM_TR) {
            float v[32];
            if (wvalid) {
                // Words 4*sub .. 4*sub+4 of the pair hold block `sub` (see iq4_pair_block).
                const unsigned* w = wrow + (k0 / GM_TK) * 9 + 4 * sub;
                const unsigned a0 = w[0], a1 = w[1], a2 = w[2], a3 = w[3], a4 = w[4];
                float d;
                unsigned qq[4];
                if (sub == 0) {
                    d = __half2float(__ushort_as_half((unsigned short)(a0 & 0xffffu)));
                    qq[0] = __byte_perm(a0, a1, 0x5432);
                    qq[1] = __byte_perm(a1, a2, 0x5432);
                    qq[2] = __byte_perm(a2, a3, 0x5432);
                    qq[3] = __byte_perm(a3, a4, 0x5432);
                } else {
                    d = __half2float(__ushort_as_half((unsigned short)(a0 >> 16)));
                    qq[0] = a1;
                    qq[1] = a2;
                    qq[2] = a3;
                    qq[3] = a4;
                }
                iq4_codes(qq, v);
#pragma unroll
                for (int i = 0; i < 32; ++i) v[i] = __fmul_rn(d, v[i]);
            } else {
#pragma unroll
                for (int i = 0; i < 32; ++i) v[i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 32; ++i) ws[(32 * sub + i) * GM_TR + wq] = v[i];
        }
        {
            const int src = srcs[xr];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (src >= 0)
                    v = *reinterpret_cast<const float4*>(x + (long long)src * n_in + k0 +
                                                         16 * xq + 4 * i);
                const int k = 16 * xq + 4 * i;
                xs[k * XS + xr] = v.x;
                xs[(k + 1) * XS + xr] = v.y;
                xs[(k + 2) * XS + xr] = v.z;
                xs[(k + 3) * XS + xr] = v.w;
            }
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < GM_TK; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(xs + k * XS + 4 * ty);
            const float4 b0 = *reinterpret_cast<const float4*>(ws + k * GM_TR + 4 * tx);
            const float4 b1 = *reinterpret_cast<const float4*>(ws + k * GM_TR + 64 + 4 * tx);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = 4 * ty + i;
        if (r >= rn) continue;
        float* yr = y + (long long)(rb + r) * n_out;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (swiglu) {
                const int col = c0 + 4 * tx + j;
                if (col < n_out) yr[col] = silu_times(acc[i][j], acc[i][4 + j]);
            } else {
                const int r0 = c0 + 4 * tx + j, r1 = c0 + 64 + 4 * tx + j;
                if (r0 < n_out) yr[r0] = acc[i][j];
                if (r1 < n_out) yr[r1] = acc[i][4 + j];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
expert_gemm_iq4_m32(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                    const float* __restrict__ x, const int* __restrict__ offsets,
                    const int* __restrict__ route_token, float* __restrict__ y, int n_in,
                    int n_out, int n_expert, int n_x_rows, int n_routes) {
    expert_gemm<32>(Wa, Wb, x, offsets, route_token, y, n_in, n_out, n_expert, n_x_rows,
                    n_routes);
}

extern "C" __global__ void __launch_bounds__(256)
expert_gemm_iq4_m64(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                    const float* __restrict__ x, const int* __restrict__ offsets,
                    const int* __restrict__ route_token, float* __restrict__ y, int n_in,
                    int n_out, int n_expert, int n_x_rows, int n_routes) {
    expert_gemm<64>(Wa, Wb, x, offsets, route_token, y, n_in, n_out, n_expert, n_x_rows,
                    n_routes);
}

// ---- top-k sum -----------------------------------------------------------------------------

// out[t] = w[t][0]*x[route of slot tk] + w[t][1]*x[...] + ... in slot order, each product
// rounded before its add, as the CPU's loop. The block finds its token's routes by scanning
// route_slot (the inverse permutation, one writer a slot).
extern "C" __global__ void __launch_bounds__(256)
topk_sum(const float* __restrict__ route_out, const int* __restrict__ route_slot,
         const float* __restrict__ weights, float* __restrict__ out, int n_routes, int d,
         int top_k) {
    extern __shared__ int ts_inv[];
    const int t = blockIdx.x, tid = threadIdx.x;
    const long long s0 = (long long)t * top_k;
    for (int j = tid; j < top_k; j += blockDim.x) ts_inv[j] = -1;
    __syncthreads();
    for (int r = tid; r < n_routes; r += blockDim.x) {
        const long long s = route_slot[r];
        if (s >= s0 && s < s0 + top_k) ts_inv[s - s0] = r;
    }
    __syncthreads();
    for (int c = blockIdx.y * blockDim.x + tid; c < d; c += gridDim.y * blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const int r = ts_inv[j];
            const float x = r >= 0 ? route_out[(long long)r * d + c] : 0.0f;
            const float wx = __fmul_rn(weights[s0 + j], x);
            o = j == 0 ? wx : __fadd_rn(o, wx);
        }
        out[(long long)t * d + c] = o;
    }
}
