// Routed experts, spec §3.7 / seed §4: router, the device-side route plan, the grouped
// IQ4_NL expert products and the slot-order top-k sum. Every output element has one writer
// and every sum a fixed order, so two runs give the same bits. The CPU references in
// ops/src/moe/cpu.rs are the spec; where their rounding can be reproduced exactly (sigmoid,
// weight normalisation, the top-k sum) the explicit-rounding intrinsics keep NVRTC from
// contracting a*b+c into an fma. Prepended with dequant.cuh, whose iq4g_tile is the decode
// GEMV the expert products share with the linear op.

#define NEG_INF (-__int_as_float(0x7f800000))

// ---- router ----------------------------------------------------------------------------

// part[t][s][e] = sum_{k in slice s} W[e][k] * z[t][k], slices of RL_SLICE values. Block =
// 8 warps = 8 experts of one slice over a tile of up to RL_TOKENS tokens; lane = 4
// consecutive k. The tile's loads are issued together and its reductions interleaved: a block
// walking 64 tokens one after another (a load, a five-step shuffle chain, a store each) took
// 25 µs of a 64-sequence decode step.
#define RL_SLICE 128
#define RL_TOKENS 4

extern "C" __global__ void __launch_bounds__(256)
router_logits(const float* __restrict__ z, const float* __restrict__ W, float* __restrict__ part,
              int n, int d, int n_expert, int n_slices, int tok_tile) {
    PDL_ENTER();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * 8 + warp;
    const int s = blockIdx.y;
    const int k = s * RL_SLICE + 4 * lane;
    const bool kv = k < d;
    float4 wv = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e < n_expert && kv) wv = *reinterpret_cast<const float4*>(W + (long long)e * d + k);
    const int t1 = min(n, (blockIdx.z + 1) * tok_tile);
    for (int t0 = blockIdx.z * tok_tile; t0 < t1; t0 += RL_TOKENS) {
        float acc[RL_TOKENS];
#pragma unroll
        for (int i = 0; i < RL_TOKENS; ++i) {
            float4 zv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (kv && t0 + i < t1) zv = *reinterpret_cast<const float4*>(z + (long long)(t0 + i) * d + k);
            float a = wv.x * zv.x;
            a = fmaf(wv.y, zv.y, a);
            a = fmaf(wv.z, zv.z, a);
            acc[i] = fmaf(wv.w, zv.w, a);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
#pragma unroll
            for (int i = 0; i < RL_TOKENS; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
        if (lane == 0 && e < n_expert) {
#pragma unroll
            for (int i = 0; i < RL_TOKENS; ++i)
                if (t0 + i < t1) part[((long long)(t0 + i) * n_slices + s) * n_expert + e] = acc[i];
        }
    }
}

// The same partials for a prefill chunk: part[t][s][e] over slices of `slice` values, as a
// tiled f32 GEMM. Block = 64 tokens × 64 experts of one slice; k steps of 32 staged in shared
// memory; each thread 4 tokens × 4 experts in registers, summed in k order. (The warp-per-
// expert kernel above reduces across lanes for every token, which costs more than the dot.)
#define RT_T 64
#define RT_K 32
#define RT_S (RT_T + 4)

extern "C" __global__ void __launch_bounds__(256)
router_logits_tiled(const float* __restrict__ z, const float* __restrict__ W, float* __restrict__ part,
                    int n, int d, int n_expert, int n_slices, int slice) {
    PDL_ENTER();
    __shared__ __align__(16) float zs[RT_K * RT_S];
    __shared__ __align__(16) float ws[RT_K * RT_S];
    const int tid = threadIdx.x;
    const int e0 = blockIdx.x * RT_T, s = blockIdx.y, t0 = blockIdx.z * RT_T;
    const int k_begin = s * slice, k_end = min(d, k_begin + slice);
    // Loader roles: 8 consecutive k (two float4) of one token row and of one expert row.
    const int lr = tid >> 2, lk = 8 * (tid & 3);
    const bool zrow = t0 + lr < n, wrow = e0 + lr < n_expert;
    const float* zr = z + (long long)(t0 + lr) * d;
    const float* wr = W + (long long)(e0 + lr) * d;
    // Compute roles: tokens 4ty.., experts 4tx...
    const int ty = tid >> 4, tx = tid & 15;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = k_begin; k0 < k_end; k0 += RT_K) {
        float zv[8], wv[8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = k0 + lk + 4 * h;
            const bool kv = k < k_end;  // d % 4 == 0: a float4 is wholly in or out
            const float4 a = zrow && kv ? __ldg(reinterpret_cast<const float4*>(zr + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
            const float4 b = wrow && kv ? __ldg(reinterpret_cast<const float4*>(wr + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
            zv[4 * h] = a.x; zv[4 * h + 1] = a.y; zv[4 * h + 2] = a.z; zv[4 * h + 3] = a.w;
            wv[4 * h] = b.x; wv[4 * h + 1] = b.y; wv[4 * h + 2] = b.z; wv[4 * h + 3] = b.w;
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            zs[(lk + e) * RT_S + lr] = zv[e];
            ws[(lk + e) * RT_S + lr] = wv[e];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < RT_K; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(zs + k * RT_S + 4 * ty);
            const float4 b = *reinterpret_cast<const float4*>(ws + k * RT_S + 4 * tx);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(bv[j], av[i], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = t0 + 4 * ty + i;
        if (t >= n) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int e = e0 + 4 * tx + j;
            if (e < n_expert) part[((long long)t * n_slices + s) * n_expert + e] = acc[i][j];
        }
    }
}

// Rust's f32::total_cmp as a signed-integer key.
__device__ __forceinline__ int total_key(float x) {
    int b = __float_as_int(x);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

// One warp, one token: p holds its n_expert logits (shared memory; key and taken are the
// warp's scratch beside it). Gating, top-k by the biased score (ties: lower id), weights
// from the unbiased scores, normalised and scaled as the CPU does.
__device__ __forceinline__ void route_select_warp(float* p, int* key, int* taken,
                                                  const float* __restrict__ bias,
                                                  int* __restrict__ it, float* __restrict__ wt,
                                                  int n_expert, int top_k, int softmax,
                                                  int norm_topk, float scale, float guard) {
    const int lane = threadIdx.x & 31;
    float lmax = NEG_INF;
    for (int e = lane; e < n_expert; e += 32) {
        lmax = fmaxf(lmax, p[e]);
        taken[e] = 0;
    }
    __syncwarp();
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
            it[j] = be;
            if (be >= 0) taken[be] = 1;
        }
        __syncwarp();
    }
    if (lane == 0) {
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

// One warp, token t: logits = the slices' partials summed in order, then the selection. The
// warp first copies its token's n_slices × n_expert partials into shared memory with
// contiguous 16-byte loads, all in flight together: summed straight from L2, each lane's
// expert after expert and slice batch after slice batch made a chain of dependent loads, most
// of this kernel's 6.5 µs. `stage` is the warp's (n_slices + 3) · n_expert words.
__device__ __forceinline__ void router_select_token(const float* __restrict__ part,
                                                    const float* __restrict__ bias, int* ids,
                                                    float* __restrict__ weights, int t,
                                                    int n_expert, int n_slices, int top_k,
                                                    int softmax, int norm_topk, float scale,
                                                    float guard, float* stage) {
    const int lane = threadIdx.x & 31;
    const int total = n_slices * n_expert;
    float* p = stage + total;
    int* key = reinterpret_cast<int*>(p + n_expert);
    int* taken = key + n_expert;
    const float* pt = part + (long long)t * total;
    if ((total & 3) == 0 && ((reinterpret_cast<unsigned long long>(pt) |
                              reinterpret_cast<unsigned long long>(stage)) & 15) == 0) {
        const float4* src = reinterpret_cast<const float4*>(pt);
        float4* dst = reinterpret_cast<float4*>(stage);
#pragma unroll 8
        for (int i = lane; i < (total >> 2); i += 32) dst[i] = src[i];
    } else {
#pragma unroll 8
        for (int i = lane; i < total; i += 32) stage[i] = pt[i];
    }
    __syncwarp();
    for (int e = lane; e < n_expert; e += 32) {
        float v = stage[e];
        for (int s = 1; s < n_slices; ++s) v += stage[s * n_expert + e];
        p[e] = v;
    }
    __syncwarp();
    route_select_warp(p, key, taken, bias, ids + (long long)t * top_k,
                      weights + (long long)t * top_k, n_expert, top_k, softmax, norm_topk, scale,
                      guard);
}

// One warp a token. Shared memory a warp: (n_slices + 3) · n_expert words.
extern "C" __global__ void __launch_bounds__(256)
router_select(const float* __restrict__ part, const float* __restrict__ bias,
              int* __restrict__ ids, float* __restrict__ weights, int n, int n_expert,
              int n_slices, int top_k, int softmax, int norm_topk, float scale, float guard) {
    PDL_ENTER();
    extern __shared__ __align__(16) int rs_smem[];
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= n) return;
    float* stage = reinterpret_cast<float*>(rs_smem) +
                   (long long)warp * (n_slices * n_expert + 3 * n_expert);
    router_select_token(part, bias, ids, weights, t, n_expert, n_slices, top_k, softmax,
                        norm_topk, scale, guard, stage);
}

// ---- route plan ------------------------------------------------------------------------

// A stable counting sort of the slots by expert, in one block: per-expert counts, their
// exclusive scan (the CSR offsets), then the slots in chunks of blockDim: ranks inside a
// warp from __match_any_sync, across warps from a per-(warp, expert) table scanned in warp
// order, across chunks from a running cursor. Ids outside [0, E) are skipped and the rows
// they leave at the end are marked -1 (the engine validates ids; this only bounds writes).
// `ids` is not __restrict__: the fused router writes it earlier in the same launch, and a
// read-only (non-coherent) load could miss those writes. Shared memory: (2 + warps) ·
// n_expert words at `rp_smem`.
__device__ __forceinline__ void route_plan_block(const int* ids, int* __restrict__ offsets,
                                                 int* __restrict__ route_token,
                                                 int* __restrict__ route_slot, int n_routes,
                                                 int n_expert, int top_k, int* rp_smem) {
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

extern "C" __global__ void __launch_bounds__(1024)
route_plan(const int* __restrict__ ids, int* __restrict__ offsets, int* __restrict__ route_token,
           int* __restrict__ route_slot, int n_routes, int n_expert, int top_k) {
    PDL_ENTER();
    extern __shared__ int rp_smem[];
    route_plan_block(ids, offsets, route_token, route_slot, n_routes, n_expert, top_k, rp_smem);
}

// The router's selection and the route plan in one block (a decode step's few tokens): each
// warp selects its tokens in turn, then the block sorts the routes by expert. One launch
// instead of two a MoE layer, where either alone is mostly launch latency. Shared memory:
// the larger of warps · (n_slices + 3) · n_expert and (2 + warps) · n_expert words. The
// launch is one block, so the bounds let it have the registers (at the default it spilled).
extern "C" __global__ void __launch_bounds__(256, 1)
router_select_routes(const float* __restrict__ part, const float* __restrict__ bias, int* ids,
                     float* __restrict__ weights, int* __restrict__ offsets,
                     int* __restrict__ route_token, int* __restrict__ route_slot, int n,
                     int n_expert, int n_slices, int top_k, int softmax, int norm_topk,
                     float scale, float guard) {
    PDL_ENTER();
    extern __shared__ __align__(16) int rsr_smem[];
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float* stage = reinterpret_cast<float*>(rsr_smem) +
                   (long long)warp * (n_slices * n_expert + 3 * n_expert);
#pragma unroll 1
    for (int t = warp; t < n; t += nwarps) {
        router_select_token(part, bias, ids, weights, t, n_expert, n_slices, top_k, softmax,
                            norm_topk, scale, guard, stage);
        // Lane 0 may still read this token's scores while the others stage the next.
        __syncwarp();
    }
    // Every token's ids are written (global writes of this block are visible past the
    // barrier) and the staging area is free for the plan's tables.
    __syncthreads();
    route_plan_block(ids, offsets, route_token, route_slot, n * top_k, n_expert, top_k,
                     rsr_smem);
}

// ---- IQ4_NL block decoding --------------------------------------------------------------

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

// The blockIdx.y-th expert with routes and its routes [r0, r_end) within [0, n_routes), or -1
// when there is none or the range is empty (block-uniform).
__device__ __forceinline__ int block_expert_routes(const int* offsets, int n_expert, int n_routes,
                                                   int* r0, int* r_end) {
    int lo = 0, hi = 0;
    const int e = nth_active_expert(offsets, n_expert, blockIdx.y, &lo, &hi);
    if (e < 0) return -1;
    *r0 = min(max(lo, 0), n_routes);
    *r_end = min(max(hi, *r0), n_routes);
    return *r0 < *r_end ? e : -1;
}

__device__ __forceinline__ float silu_times(float g, float u) {
    return __fmul_rn(u, __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
}
// ---- decode path: grouped GEMV --------------------------------------------------------------
//
// blockIdx.y = the y-th expert with routes (the grid is sized for the worst case, min(E, R);
// the rest exit), blockIdx.x = a tile of weight rows: iq4g_tile (dequant.cuh) with the
// expert's rows and routes, NR routes' sums held at once. For SwiGLU a tile's first RT/2
// slots are gate rows and the rest the same up rows, combined in the epilogue.
template <int NR>
__device__ __forceinline__ void expert_rows(const unsigned char* __restrict__ Wa,
                                            const unsigned char* __restrict__ Wb,
                                            const float* __restrict__ x,
                                            const int* __restrict__ offsets,
                                            const int* __restrict__ route_token,
                                            float* __restrict__ y, int n_in, int n_out,
                                            int n_expert, int n_x_rows, int n_routes, int RT,
                                            int KP) {
    int r0, r_end;
    const int e = block_expert_routes(offsets, n_expert, n_routes, &r0, &r_end);
    if (e < 0) return;  // block-uniform: no barrier is skipped by part of the block
    const long long mat = (long long)n_out * ((n_in >> 5) * 18);
    const bool swiglu = Wb != nullptr;
    iq4g_tile<NR>(Wa + e * mat, swiglu ? Wb + e * mat : nullptr, x,
                  swiglu ? route_token : nullptr, y, n_in, n_out, n_x_rows, r0, r_end,
                  blockIdx.x * (swiglu ? RT >> 1 : RT), RT, KP);
}

#define EXPERT_ROWS(NR)                                                                           \
    extern "C" __global__ void __launch_bounds__(256, 1) expert_rows_iq4_##NR(                   \
        const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,              \
        const float* __restrict__ x, const int* __restrict__ offsets,                            \
        const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,         \
        int n_expert, int n_x_rows, int n_routes, int RT, int KP) {                              \
        PDL_ENTER();                                                                              \
        expert_rows<NR>(Wa, Wb, x, offsets, route_token, y, n_in, n_out, n_expert, n_x_rows,     \
                        n_routes, RT, KP);                                                        \
    }
EXPERT_ROWS(1)
EXPERT_ROWS(2)
EXPERT_ROWS(4)
EXPERT_ROWS(8)

// ---- decode path: the GEMV on integer dot products ---------------------------------------------
//
// The same tiles as expert_rows, with each 32-value block's dot taken on dp4a: a block's codes
// are the codebook's signed bytes (byte permutes, no conversion to float), and each input row
// is quantized per 32-value block to 16-bit integers q = round(x/s), s = amax/32512, held as
// two signed bytes, q = 256·hi + lo. The block's dot is then d·s·(256·Σ c·hi + Σ c·lo): two
// integer sums of 32 byte products (|c|, |hi| ≤ 127, so |Σ c·hi| ≤ 516,128 and the pair fits
// an int32 exactly), four products an instruction, about half the f32 path's instructions a
// weight. An input value is off by at most s/2 = amax/65024 of its block's largest (the
// tensor-core kernels' f16 inputs: 2^-11 of each value). A block quantizes the rows of its
// round's routes into shared memory itself, while its weight copies are in flight.
#define IQX_Q 32512.0f

// The codebook as signed bytes in four words (entries 0-3, 4-7, 8-11, 12-15), opaque so they
// stay in registers.
__device__ __forceinline__ Iq4gTable iq4q_table() {
    Iq4gTable t;
    asm("mov.b32 %0, 0xbfad9881;" : "=r"(t.t0));
    asm("mov.b32 %0, 0xf6eaddcf;" : "=r"(t.t1));
    asm("mov.b32 %0, 0x26190d01;" : "=r"(t.t2));
    asm("mov.b32 %0, 0x71594535;" : "=r"(t.t3));
    return t;
}

// The 32 codes of a block (qs as 4 words) as 8 words of signed bytes: word 2m + h holds the
// codes of values 4m+2h, 4m+2h+16, 4m+2h+1, 4m+2h+17 (the permutes' natural order; the
// quantized inputs are stored in the same order).
__device__ __forceinline__ void iq4q_codes(const Iq4gTable& T, const unsigned q[4], unsigned c[8]) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned mm = q[m] & 0x77777777u;
        const unsigned sl = ((q[m] >> 1) & 0x44444444u) | 0x32103210u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned s = h ? mm >> 16 : mm, t = h ? sl >> 16 : sl;
            c[2 * m + h] = iq4g_prmt(iq4g_prmt(T.t0, T.t1, s), iq4g_prmt(T.t2, T.t3, s), t);
        }
    }
}

// Input block b of row xr (null: zeros) quantized: 16 words at qx (8 of hi bytes, 8 of lo
// bytes, in iq4q_codes' value order) and its scale at *sx. A NaN or infinity in the block makes
// the scale NaN, so the outputs it reaches are NaN as the f32 path's would be.
__device__ __forceinline__ void iqx_quantize_block(const float* __restrict__ xr, int b,
                                                   uint4* __restrict__ qx, float* __restrict__ sx) {
    float v[32];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (xr) a = __ldg(reinterpret_cast<const float4*>(xr + 32 * b + 4 * m));
        v[4 * m] = a.x;
        v[4 * m + 1] = a.y;
        v[4 * m + 2] = a.z;
        v[4 * m + 3] = a.w;
    }
    float amax = 0.0f, poison = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        amax = fmaxf(amax, fabsf(v[i]));
        poison += v[i] * 0.0f;  // NaN for a NaN or an infinity, else 0
    }
    const float inv = amax > 0.0f ? __fdiv_rn(IQX_Q, amax) : 0.0f;
    unsigned hw[8], lw[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        const int a = 4 * (w >> 1) + 2 * (w & 1);
        const int idx[4] = {a, a + 16, a + 1, a + 17};
        unsigned hv = 0u, lv = 0u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int q = max(-32512, min(32512, __float2int_rn(v[idx[k]] * inv)));
            const int hi = (q + 128) >> 8, lo = q - hi * 256;
            hv |= ((unsigned)hi & 0xffu) << (8 * k);
            lv |= ((unsigned)lo & 0xffu) << (8 * k);
        }
        hw[w] = hv;
        lw[w] = lv;
    }
    qx[0] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    qx[1] = make_uint4(hw[4], hw[5], hw[6], hw[7]);
    qx[2] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    qx[3] = make_uint4(lw[4], lw[5], lw[6], lw[7]);
    *sx = __fdiv_rn(amax, IQX_Q) + poison;
}

// A block's 32 codes (iq4q_codes) against its quantized inputs (iqx_quantize_block's 16
// words at xq): 256·Σ c·hi + Σ c·lo, exact in int32.
__device__ __forceinline__ int iq4q_dot(const unsigned c[8], const uint4* xq) {
    const uint4 h0 = xq[0], h1 = xq[1], l0 = xq[2], l1 = xq[3];
    int sh = __dp4a((int)c[0], (int)h0.x, 0), sl = __dp4a((int)c[0], (int)l0.x, 0);
    sh = __dp4a((int)c[1], (int)h0.y, sh);
    sl = __dp4a((int)c[1], (int)l0.y, sl);
    sh = __dp4a((int)c[2], (int)h0.z, sh);
    sl = __dp4a((int)c[2], (int)l0.z, sl);
    sh = __dp4a((int)c[3], (int)h0.w, sh);
    sl = __dp4a((int)c[3], (int)l0.w, sl);
    sh = __dp4a((int)c[4], (int)h1.x, sh);
    sl = __dp4a((int)c[4], (int)l1.x, sl);
    sh = __dp4a((int)c[5], (int)h1.y, sh);
    sl = __dp4a((int)c[5], (int)l1.y, sl);
    sh = __dp4a((int)c[6], (int)h1.z, sh);
    sl = __dp4a((int)c[6], (int)l1.z, sl);
    sh = __dp4a((int)c[7], (int)h1.w, sh);
    sl = __dp4a((int)c[7], (int)l1.w, sl);
    return sh * 256 + sl;
}

// iq4g_tile's contract on integer dot products. Dynamic shared memory: the RowsPlan's
// (threads · (segment + NR·4 bytes)), then NR·(n_in/32)·68 bytes for the quantized inputs.
template <int NR>
__device__ __forceinline__ void iq4q_tile(const unsigned char* __restrict__ Wa,
                                          const unsigned char* __restrict__ Wb,
                                          const float* __restrict__ x, const int* __restrict__ tok,
                                          float* __restrict__ y, int n_in, int n_out, int n_x_rows,
                                          int r_begin, int r_end, int o0, int RT, int KP) {
    extern __shared__ float4 iq4g_smem4[];
    const bool swiglu = Wb != nullptr;
    unsigned char* smem = reinterpret_cast<unsigned char*>(iq4g_smem4);
    const Iq4gPart P = iq4g_part(Wa, Wb, n_in, n_out, o0, RT, KP, smem);
    float* red = reinterpret_cast<float*>(smem + (long long)blockDim.x * P.seg * 16);
    const int nb = n_in >> 5;
    uint4* qx = reinterpret_cast<uint4*>(red + blockDim.x * NR);  // [NR][nb][4]
    float* sx = reinterpret_cast<float*>(qx + NR * nb * 4);        // [NR][nb]
    const Iq4gTable T = iq4q_table();
    for (int rg = r_begin; rg < r_end; rg += NR) {  // block-uniform
        const int cnt = min(NR, r_end - rg);
        // The round's input rows, quantized by the whole block (the previous round's readers
        // passed iq4g_finish's closing barrier).
        for (int p = threadIdx.x; p < cnt * nb; p += blockDim.x) {
            const int j = p / nb, b = p - j * nb;
            const int s = tok ? tok[rg + j] : rg + j;
            const float* xr = (s >= 0 && s < n_x_rows) ? x + (long long)s * n_in : nullptr;
            iqx_quantize_block(xr, b, qx + 4 * (j * nb + b), sx + j * nb + b);
        }
        __syncthreads();
        float acc[NR];
#pragma unroll
        for (int j = 0; j < NR; ++j) acc[j] = 0.0f;
        for (int j = 0; j < P.cwmax; ++j) {
            if (rg == r_begin) {
                iq4g_wait(P.cwmax - 1 - j);
                __syncwarp();
            }
            if (j >= P.mycw) continue;
            unsigned w[36];
            iq4g_chunk(P.mine, j, w);
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                float d;
                unsigned q[4], c[8];
                iq4g_block(w, b, &d, q);
                iq4q_codes(T, q, c);
                const int gb = 8 * (P.c0 + j) + b;
#pragma unroll
                for (int jr = 0; jr < NR; ++jr) {
                    if (jr >= cnt) break;
                    const uint4* xq = qx + 4 * (jr * nb + gb);
                    acc[jr] = fmaf(d * sx[jr * nb + gb], (float)iq4q_dot(c, xq), acc[jr]);
                }
            }
        }
        iq4g_finish<NR>(acc, P.live, red, y, rg, cnt, o0, n_out, RT, KP, swiglu);
    }
}

// grid (row tiles, route slots + 1 with a shared expert), block a RowsPlan's threads.
// blockIdx.y < sh_slot: the y-th expert with routes, as expert_rows. With Sa, blocks y ≥ sh_slot
// take the shared expert (Sa, Sb: its gate and up, or Sa its down): every token one route,
// inputs from x (SwiGLU: the tokens' own rows) or xs (down: its n_sh activation rows), outputs
// to y_sh.
template <int NR>
__device__ __forceinline__ void expert_int_rows(
    const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
    const float* __restrict__ x, const int* __restrict__ offsets,
    const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,
    int n_expert, int n_x_rows, int n_routes, int RT, int KP,
    const unsigned char* __restrict__ Sa, const unsigned char* __restrict__ Sb,
    const float* __restrict__ xs, float* __restrict__ y_sh, int n_sh, int sh_slot) {
    const bool swiglu = Wb != nullptr;
    const int o0 = blockIdx.x * (swiglu ? RT >> 1 : RT);
    if (Sa != nullptr && (int)blockIdx.y >= sh_slot) {  // block-uniform
        iq4q_tile<NR>(Sa, swiglu ? Sb : nullptr, swiglu ? x : xs, nullptr, y_sh, n_in, n_out,
                      n_sh, 0, n_sh, o0, RT, KP);
        return;
    }
    int r0, r_end;
    const int e = block_expert_routes(offsets, n_expert, n_routes, &r0, &r_end);
    if (e < 0) return;  // block-uniform: no barrier is skipped by part of the block
    const long long mat = (long long)n_out * ((n_in >> 5) * 18);
    iq4q_tile<NR>(Wa + e * mat, swiglu ? Wb + e * mat : nullptr, x,
                  swiglu ? route_token : nullptr, y, n_in, n_out, n_x_rows, r0, r_end, o0, RT, KP);
}

#define EXPERT_INT_ROWS(NR)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) expert_int_rows_iq4_##NR(               \
        const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,              \
        const float* __restrict__ x, const int* __restrict__ offsets,                            \
        const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,         \
        int n_expert, int n_x_rows, int n_routes, int RT, int KP,                                \
        const unsigned char* __restrict__ Sa, const unsigned char* __restrict__ Sb,              \
        const float* __restrict__ xs, float* __restrict__ y_sh, int n_sh, int sh_slot) {         \
        PDL_ENTER();                                                                              \
        expert_int_rows<NR>(Wa, Wb, x, offsets, route_token, y, n_in, n_out, n_expert, n_x_rows, \
                            n_routes, RT, KP, Sa, Sb, xs, y_sh, n_sh, sh_slot);                  \
    }
EXPERT_INT_ROWS(1)
EXPERT_INT_ROWS(2)
EXPERT_INT_ROWS(4)
EXPERT_INT_ROWS(8)

// ---- decode path: the integer GEMV with a chunk a lane, on persistent warps --------------
//
// expert_int_rows' arithmetic on another layout. A warp's work item is a few outputs of one
// expert: lane l owns one 144-byte chunk (256 inputs) of one weight row, chunk l % nch of
// row slot l / nch (nch = n_in / 256). SwiGLU takes `outs` = 32 / (2·nch) outputs an item as
// gate slots 0..outs-1 and up slots outs..2·outs-1 (n_in ≤ 4096), the down projection
// 32 / nch outputs (n_in ≤ 8192); lanes past them idle. The grid is a wave of blocks, each
// warp walking items warp, warp + all warps, ...: an item's rows are copied into the warp's
// two-stage ring (consecutive lanes take consecutive 16-byte pieces, so an instruction copies
// 512 contiguous bytes) while the previous item is computed, so every warp keeps a tile in
// flight from its first instruction to its last. Each block first lists the experts with
// routes, issues its warps' first copies, then quantizes every input row the launch reads
// (iqx_quantize_block, a thread a 32-value block, rows padded chunk by chunk against bank
// conflicts) and reads both from shared memory only: no barrier after that. (expert_int_rows
// quantizes its routes' rows per round behind a barrier, and its per-block cost model left a
// fifth of the chip's warps resident at one token, each with one chunk in flight: 13.7 µs for
// 16.5 MB of gate+up.) Each lane sums its chunk's 8 blocks in K order, as expert_int_rows
// does; a row's chunks are added over its lanes by a fixed shuffle tree.
//
// The shared expert's items come first, so with `weights_first` a warp whose first item is
// one copies its weights before waiting for the predecessor (they depend on no kernel).
#define IQL_WARPS 4
#define IQL_STAGE 4608  // 32 chunks of 144 bytes
#define IQL_EXPERTS 256  // the most experts a launch may have (the launcher checks)
#define IQL_QCHUNK 33    // 16-byte units of a chunk's quantized inputs (8 blocks of 4, padded)

template <int NR>
__device__ __forceinline__ void expert_int_lanes(
    const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
    const float* __restrict__ x, const int* __restrict__ offsets,
    const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,
    int n_expert, int n_x_rows, int n_routes, int outs, const unsigned char* __restrict__ Sa,
    const unsigned char* __restrict__ Sb, const float* __restrict__ xs, float* __restrict__ y_sh,
    int n_sh, int slots, int weights_first) {
    // All of it dynamic (the launcher opts in past 48 KiB for the whole): the rings, the active
    // experts (id, first route, end of routes) and their count, the quantized rows.
    extern __shared__ __align__(16) unsigned char iql_smem[];
    int* act = reinterpret_cast<int*>(iql_smem + IQL_WARPS * 2 * IQL_STAGE);
    int& n_act = act[3 * IQL_EXPERTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool swiglu = Wb != nullptr;
    const bool has_sh = Sa != nullptr && n_sh > 0;
    const int nb = n_in >> 5, nch = n_in >> 8;
    const long long row_bytes = (long long)nb * 18;
    const int rows = swiglu ? 2 * outs : outs;  // row slots an item
    const int groups = (n_out + outs - 1) / outs;
    const int sh_items = has_sh ? groups : 0;
    const int n_items = sh_items + slots * groups;
    // Quantized input rows: SwiGLU the tokens' rows (routes and the shared expert read them
    // by token), down the routes' rows then the shared expert's.
    const int q_rows = swiglu ? n_x_rows : n_routes + (has_sh ? n_sh : 0);
    unsigned char* ring = iql_smem + warp * 2 * IQL_STAGE;
    uint4* qx = reinterpret_cast<uint4*>(iql_smem + IQL_WARPS * 2 * IQL_STAGE + 3 * IQL_EXPERTS * 4 + 16);
    float* sx = reinterpret_cast<float*>(qx + (long long)q_rows * nch * IQL_QCHUNK);
    // Block b of a row, chunk by chunk: a chunk's 8 blocks take IQL_QCHUNK 16-byte units (one
    // of padding) and 9 scales (one of padding), so the lanes of a warp, each on its own chunk,
    // read distinct banks (unpadded, chunks 512 bytes apart hit the same bank 8 lanes deep).
    auto qx_at = [&](int row, int b) { return qx + (row * nch + (b >> 3)) * IQL_QCHUNK + 4 * (b & 7); };
    auto sx_at = [&](int row, int b) { return sx + (row * nch + (b >> 3)) * 9 + (b & 7); };

    // This lane's nine pieces of an item's copy: piece p = lane + 32·i is 16 bytes of lane-chunk
    // p / 9, whose row slot and chunk fix its source: the byte offset from its matrix's row
    // o0 (bits 4-26, under 2^18 for 32 rows of 8,192 inputs), the row it is past o0 (bits
    // 27-31), bit 1 for the up weight's, bit 0 for a live piece.
    unsigned poff[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) {
        const int p = lane + 32 * i;
        const int L = p / 9, sub = p - 9 * L;
        const int slot = L / nch, c = L - slot * nch;
        const bool live = slot < rows;
        const bool up = swiglu && slot >= outs;
        const int r = up ? slot - outs : slot;
        poff[i] = live ? (unsigned)(r * row_bytes + 144 * c + 16 * sub) | ((unsigned)r << 27) |
                             (up ? 2u : 0u) | 1u
                       : 0u;
    }
    // Issue item it's copy into stage st (a commit group either way).
    auto issue = [&](int it, int st, const unsigned char* ga, const unsigned char* gb) {
        const int o0 = (it % groups) * outs;
        const unsigned dst = (unsigned)__cvta_generic_to_shared(ring + st * IQL_STAGE) + 16 * lane;
#pragma unroll
        for (int i = 0; i < 9; ++i) {
            unsigned o;
            // Opaque, so the offsets stay one register each rather than being rebuilt.
            asm volatile("mov.b32 %0, %1;" : "=r"(o) : "r"(poff[i]));
            const bool live = (o & 1u) && o0 + (int)(o >> 27) < n_out;
            const unsigned char* src =
                (o & 2u ? gb : ga) + (long long)o0 * row_bytes + (o & 0x07fffff0u);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + 512 * i),
                         "l"(live ? src : ga), "r"(live ? 16 : 0)
                         : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    const long long mat = (long long)n_out * row_bytes;
    // Item it's weights (null: a routed slot without an expert) and routes [r0, r1).
    auto item_of = [&](int it, const unsigned char** ga, const unsigned char** gb, int* r0,
                       int* r1) {
        const int y = it / groups;
        if (has_sh && y == 0) {
            *ga = Sa;
            *gb = swiglu ? Sb : Sa;
            *r0 = 0;
            *r1 = n_sh;
            return;
        }
        const int k = y - (has_sh ? 1 : 0);
        if (k >= n_act) {
            *ga = nullptr;
            return;
        }
        const int e = act[k];
        *ga = Wa + e * mat;
        *gb = swiglu ? Wb + e * mat : *ga;
        *r0 = act[IQL_EXPERTS + k];
        *r1 = act[2 * IQL_EXPERTS + k];
    };

    const int gw = blockIdx.x * IQL_WARPS + warp, nw = gridDim.x * IQL_WARPS;
    // The first item's copy before the wait when it is the shared expert's.
    const bool early = weights_first && gw < sh_items;
    if (early) issue(gw, 0, Sa, swiglu ? Sb : Sa);
    PDL_WAIT();
    if (warp == 0) {
        int base = 0;
        for (int e0 = 0; e0 < n_expert; e0 += 32) {
            const int e = e0 + lane;
            const int lo = e < n_expert ? min(max(offsets[e], 0), n_routes) : 0;
            const int hi = e < n_expert ? min(max(offsets[e + 1], lo), n_routes) : 0;
            const bool a = e < n_expert && hi > lo;
            const unsigned m = __ballot_sync(0xffffffffu, a);
            if (a) {
                const int k = base + __popc(m & ((1u << lane) - 1u));
                act[k] = e;
                act[IQL_EXPERTS + k] = lo;
                act[2 * IQL_EXPERTS + k] = hi;
            }
            base += __popc(m);
        }
        if (lane == 0) n_act = base;
    }
    __syncthreads();
    // The first item's copy goes out before the inputs are quantized, so that latency hides
    // the quantization's.
    const unsigned char *ga = nullptr, *gb = nullptr;
    int r0 = 0, r1 = 0;
    if (gw < n_items) {
        item_of(gw, &ga, &gb, &r0, &r1);
        if (!early && ga) issue(gw, 0, ga, gb);
        if (!early && !ga) asm volatile("cp.async.commit_group;" ::: "memory");
    }
    // A thread a 32-value block, its loads together (a warp a block, a block after another,
    // left each block's load latency exposed).
    for (int p = threadIdx.x; p < q_rows * nb; p += blockDim.x) {
        const int j = p / nb, b = p - j * nb;
        const float* xr;
        if (swiglu || j < n_routes)
            xr = j < n_x_rows ? x + (long long)j * n_in : nullptr;
        else
            xr = xs + (long long)(j - n_routes) * n_in;
        iqx_quantize_block(xr, b, qx_at(j, b), sx_at(j, b));
    }
    __syncthreads();

    const Iq4gTable T = iq4q_table();
    const int c0 = lane % nch;
    const bool lane_live = lane < rows * nch;
    int st = 0;
    for (int it = gw; it < n_items; it += nw) {
        // The next item's copy goes out before this one's wait.
        const int nx = it + nw;
        const unsigned char *na = nullptr, *nbp = nullptr;
        int n0 = 0, n1 = 0;
        if (nx < n_items) item_of(nx, &na, &nbp, &n0, &n1);
        __syncwarp();  // every lane has read the stage the next copy overwrites
        if (na)
            issue(nx, st ^ 1, na, nbp);
        else
            asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        if (ga) {
            const bool shared = has_sh && it < sh_items;
            const int o0 = (it % groups) * outs;
            unsigned w[36];
            {
                const uint4* mine =
                    reinterpret_cast<const uint4*>(ring + st * IQL_STAGE + 144 * lane);
#pragma unroll
                for (int i = 0; i < 9; ++i) {
                    const uint4 v = lane_live ? mine[i] : make_uint4(0u, 0u, 0u, 0u);
                    w[4 * i] = v.x;
                    w[4 * i + 1] = v.y;
                    w[4 * i + 2] = v.z;
                    w[4 * i + 3] = v.w;
                }
            }
            for (int rg = r0; rg < r1; rg += NR) {
                const int cnt = min(NR, r1 - rg);
                // Each route's quantized row.
                int qrow[NR];
#pragma unroll
                for (int jr = 0; jr < NR; ++jr) {
                    int q = -1;
                    if (jr < cnt) {
                        const int r = rg + jr;
                        if (swiglu)
                            q = shared ? r : route_token[r];
                        else
                            q = shared ? n_routes + r : r;
                    }
                    qrow[jr] = (q >= 0 && q < q_rows) ? q : -1;
                }
                float acc[NR];
#pragma unroll
                for (int j = 0; j < NR; ++j) acc[j] = 0.0f;
                if (lane_live) {
#pragma unroll
                    for (int b = 0; b < 8; ++b) {
                        float d;
                        unsigned q[4], c[8];
                        iq4g_block(w, b, &d, q);
                        iq4q_codes(T, q, c);
                        const int gbk = 8 * c0 + b;
#pragma unroll
                        for (int jr = 0; jr < NR; ++jr) {
                            if (jr >= cnt) break;
                            if (qrow[jr] < 0) continue;
                            const uint4* xq = qx_at(qrow[jr], gbk);
                            acc[jr] = fmaf(d * *sx_at(qrow[jr], gbk), (float)iq4q_dot(c, xq), acc[jr]);
                        }
                    }
                }
                // A row's chunks summed over its lanes by a fixed tree (lane k of the row
                // adds lane k + off's for off = 16, 8, 4, 2, 1 where that lane is the row's).
                const int kin = lane % nch;
                float* yo = shared ? y_sh : y;
#pragma unroll
                for (int j = 0; j < NR; ++j) {
                    float v = acc[j];
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1) {
                        const float o = __shfl_down_sync(0xffffffffu, v, off);
                        if (kin + off < nch) v += o;
                    }
                    // Lane o·nch holds output o's gate (or down) sum, lane (outs + o)·nch its up.
                    const float u = __shfl_down_sync(0xffffffffu, v, swiglu ? outs * nch : 0);
                    const int o = lane / nch;
                    if (j < cnt && kin == 0 && o < outs && o0 + o < n_out)
                        yo[(long long)(rg + j) * n_out + o0 + o] = swiglu ? iq4g_silu_times(v, u) : v;
                }
            }
        }
        ga = na;
        gb = nbp;
        r0 = n0;
        r1 = n1;
        st ^= 1;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// grid: a wave of blocks of 32·IQL_WARPS threads; arguments as expert_int_rows (`slots`: the
// routed slots, min(E, routes)). Dynamic shared memory: IQL_WARPS·2·IQL_STAGE bytes of rings,
// 3·IQL_EXPERTS·4 + 16 of the expert list, then every quantized
// input row: 564 bytes a 256-value chunk (IQL_QCHUNK units of inputs, 9 scales).
#define EXPERT_INT_LANES(NR)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * IQL_WARPS, 4) expert_int_lanes_iq4_##NR(   \
        const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,              \
        const float* __restrict__ x, const int* __restrict__ offsets,                            \
        const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,         \
        int n_expert, int n_x_rows, int n_routes, int outs,                                      \
        const unsigned char* __restrict__ Sa, const unsigned char* __restrict__ Sb,              \
        const float* __restrict__ xs, float* __restrict__ y_sh, int n_sh, int slots,             \
        int weights_first) {                                                                      \
        PDL_WEIGHTS_FIRST();                                                                      \
        expert_int_lanes<NR>(Wa, Wb, x, offsets, route_token, y, n_in, n_out, n_expert,          \
                             n_x_rows, n_routes, outs, Sa, Sb, xs, y_sh, n_sh, slots,             \
                             weights_first);                                                      \
    }
EXPERT_INT_LANES(1)
EXPERT_INT_LANES(2)
EXPERT_INT_LANES(4)
EXPERT_INT_LANES(8)

// One dense SwiGLU (the shared expert, the leading dense FFNs) for a decode step's few tokens:
// the same tiles with token r as route r, gate and up rows side by side in one launch.
#define DENSE_SWIGLU_ROWS(NR)                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1) dense_swiglu_iq4_##NR(                  \
        const unsigned char* __restrict__ Wg, const unsigned char* __restrict__ Wu,              \
        const float* __restrict__ x, float* __restrict__ y, int n_in, int n_out, int n_tok,      \
        int RT, int KP) {                                                                         \
        PDL_ENTER();                                                                              \
        iq4g_tile<NR>(Wg, Wu, x, nullptr, y, n_in, n_out, n_tok, 0, n_tok, blockIdx.x * (RT >> 1), \
                      RT, KP);                                                                    \
    }
DENSE_SWIGLU_ROWS(1)
DENSE_SWIGLU_ROWS(2)
DENSE_SWIGLU_ROWS(4)
DENSE_SWIGLU_ROWS(8)

// ---- any width, any weight type: one route a block ------------------------------------------
//
// For what the kernels above cannot take: input widths that are not whole 256-value chunks
// (DeepSeek-V2-Lite's 1,408) and expert weights stored in another type than IQ4_NL (wt, a
// dequant.cuh code; row_bytes a row's size). blockIdx.y = route r, whose expert is found by a
// binary search of the CSR offsets (routes past the last expert's end are unused and
// skipped); warps take output rows, lanes take storage blocks (IQ4_NL) or values (the other
// types) lane, lane+32, ... in order and the warp sums in a fixed tree, so two runs give the
// same bits. It reads an expert's rows once a route, not once a step: correct for every legal
// shape, fast for none.
__device__ __forceinline__ float iq4_block_dot(const unsigned char* __restrict__ b,
                                               const float* __restrict__ x) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = b[2 + j];
        s = fmaf((float)iq4_code(q & 15), x[j], s);
        s = fmaf((float)iq4_code(q >> 4), x[j + 16], s);
    }
    return h2f(ld_u16(b)) * s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// One lane's part of a row's dot with x, then the warp's total.
__device__ __forceinline__ float generic_row_dot(const unsigned char* __restrict__ w,
                                                 const float* __restrict__ x, int n_in, int wt,
                                                 int lane) {
    float s = 0.0f;
    if (wt == WT_IQ4_NL) {
        for (int b = lane; b < (n_in >> 5); b += 32) s += iq4_block_dot(w + b * 18, x + b * 32);
    } else {
        for (int k = lane; k < n_in; k += 32) s = fmaf(deq_elem(w, wt, k), x[k], s);
    }
    return warp_sum(s);
}

extern "C" __global__ void __launch_bounds__(256)
expert_generic(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
               const float* __restrict__ x, const int* __restrict__ offsets,
               const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out,
               int n_expert, int n_x_rows, int n_routes, int wt, long long row_bytes) {
    PDL_ENTER();
    const int r = blockIdx.y;
    if (r >= n_routes || r < offsets[0] || r >= offsets[n_expert]) return;
    int lo = 0, hi = n_expert;  // offsets[lo] <= r < offsets[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (offsets[mid] <= r) lo = mid; else hi = mid;
    }
    const int e = lo;
    const bool swiglu = Wb != nullptr;
    const int xrow = swiglu ? route_token[r] : r;
    if (xrow < 0 || xrow >= n_x_rows) return;
    const float* xr = x + (long long)xrow * n_in;
    const long long mat = (long long)n_out * row_bytes;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int o = blockIdx.x * 8 + warp; o < n_out; o += gridDim.x * 8) {
        // Wa's row: the gate (SwiGLU) or the down projection; Wb's: the up projection.
        const float sa = generic_row_dot(Wa + e * mat + o * row_bytes, xr, n_in, wt, lane);
        const float sb =
            swiglu ? generic_row_dot(Wb + e * mat + o * row_bytes, xr, n_in, wt, lane) : 0.0f;
        if (lane == 0) y[(long long)r * n_out + o] = swiglu ? silu_times(sa, sb) : sa;
    }
}

// ---- prefill path: the grouped GEMM over the CSR table runs on the tensor cores
// (moe_prefill.cu, launched by `expert_launch` above GEMV_MAX_ROUTES routes).

// ---- top-k sum -----------------------------------------------------------------------------

// out[t] = w[t][0]*x[route of slot tk] + w[t][1]*x[...] + ... in slot order, each product
// rounded before its add, as the CPU's loop; then + addend[t] (the shared expert) when given.
// The block finds its token's routes by scanning route_slot (the inverse permutation, one
// writer a slot), or, for many tokens, in the inverse table topk_slot_routes wrote.
extern "C" __global__ void __launch_bounds__(256)
topk_slot_routes(const int* __restrict__ route_slot, int* __restrict__ slot_route, int n_routes) {
    PDL_ENTER();
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n_routes; r += gridDim.x * blockDim.x) {
        const int s = route_slot[r];
        if (s >= 0 && s < n_routes) slot_route[s] = r;
    }
}

extern "C" __global__ void __launch_bounds__(256)
topk_sum(const float* __restrict__ route_out, const int* __restrict__ route_slot,
         const int* __restrict__ slot_route, const float* __restrict__ weights,
         const float* __restrict__ addend, float* __restrict__ out, int n_routes, int d,
         int top_k) {
    PDL_ENTER();
    extern __shared__ int ts_inv[];
    const int t = blockIdx.x, tid = threadIdx.x;
    const long long s0 = (long long)t * top_k;
    if (slot_route) {
        // The inverse table from topk_slot_routes: an entry counts only if the route it
        // names does name this slot (entries of slots no route took are stale, not -1).
        for (int j = tid; j < top_k; j += blockDim.x) {
            const int r = slot_route[s0 + j];
            ts_inv[j] = (r >= 0 && r < n_routes && route_slot[r] == s0 + j) ? r : -1;
        }
    } else {
        for (int j = tid; j < top_k; j += blockDim.x) ts_inv[j] = -1;
        __syncthreads();
        for (int r = tid; r < n_routes; r += blockDim.x) {
            const long long s = route_slot[r];
            if (s >= s0 && s < s0 + top_k) ts_inv[s - s0] = r;
        }
    }
    __syncthreads();
    const float* add = addend ? addend + (long long)t * d : nullptr;
    for (int c = blockIdx.y * blockDim.x + tid; c < d; c += gridDim.y * blockDim.x)
        out[(long long)t * d + c] = topk_routed_elem(route_out, ts_inv, weights + s0, add, top_k, c, d);
}
