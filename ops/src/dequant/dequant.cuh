// Stored-weight decoding shared by the embedding and linear kernels (spec §6.2).
// Weight type codes match `wt_code` in ops/src/dequant/mod.rs.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q8_0 3
#define WT_Q6_K 4
#define WT_IQ4_NL 5

__device__ __forceinline__ float h2f(unsigned short b) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }

// Two little-endian bytes from a 2-byte-aligned address.
__device__ __forceinline__ unsigned short ld_u16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

// The IQ4_NL codebook packed into two words (a runtime-indexed array would live in local memory).
__device__ __forceinline__ int iq4_code(int i) {
    const unsigned long long t = (i & 8) ? 0x7159453526190d01ull : 0xf6eaddcfbfad9881ull;
    return (int)(signed char)(unsigned char)(t >> ((i & 7) * 8));
}

// Value k of a row stored as `wt` (row start at least 4-byte aligned for F32, 2 otherwise).
// The products are formed in the CPU reference's order, so the value is bit-identical.
__device__ float deq_elem(const unsigned char* row, int wt, long long k) {
    switch (wt) {
        case WT_F32:
            return reinterpret_cast<const float*>(row)[k];
        case WT_F16:
            return h2f(reinterpret_cast<const unsigned short*>(row)[k]);
        case WT_BF16:
            return bf2f(reinterpret_cast<const unsigned short*>(row)[k]);
        case WT_Q8_0: {
            const unsigned char* b = row + (k >> 5) * 34;
            return h2f(ld_u16(b)) * (float)(signed char)b[2 + (k & 31)];
        }
        case WT_IQ4_NL: {
            const unsigned char* b = row + (k >> 5) * 18;
            const int j = (int)(k & 31);
            const int q = b[2 + (j & 15)];
            return h2f(ld_u16(b)) * (float)iq4_code(j < 16 ? (q & 15) : (q >> 4));
        }
        case WT_Q6_K: {
            const unsigned char* b = row + (k >> 8) * 210;
            const int o = (int)(k & 255), hf = o >> 7, r = o & 127, q = r >> 5, l = r & 31;
            const int ql = b[64 * hf + l + 32 * (q & 1)];
            const int lo = (q >> 1) ? (ql >> 4) : (ql & 15);
            const int hb = (b[128 + 32 * hf + l] >> (2 * q)) & 3;
            const float sc = (float)(signed char)b[192 + 8 * hf + (l >> 4) + 2 * q];
            return h2f(ld_u16(b + 208)) * sc * (float)((lo | (hb << 4)) - 32);
        }
    }
    return __int_as_float(0x7fffffff);
}

// ---------------------------------------------------------------------------------------------
// Decode-time IQ4_NL GEMV over whole rows, shared by the linear and routed-expert kernels.
//
// A block computes a tile of RT weight rows for a few input rows (routes), K in 256-value
// chunks (8 blocks = 144 bytes, 16-byte aligned when the row is). Thread t owns row slot
// t % RT and K part t / RT (KP parts, each a contiguous run of chunks), so a lane holds one
// row's running sums and every lane of a warp is busy on its own row; x is the same for all
// of them and comes through L1 as broadcast loads. A warp first copies its lanes' chunks
// into shared memory with 16-byte cp.async, consecutive lanes taking consecutive pieces (a
// warp instruction reads a few whole lines instead of 32 scattered ones), one commit group
// a chunk so decoding starts when the first chunk lands; each lane then reads its own
// chunk back in nine 16-byte loads (segments an odd number of 16-byte units apart, so a
// quarter-warp hits distinct banks). The K parts' sums meet in shared memory and are added
// in part order, so results do not depend on scheduling.
//
// The codebook lookup runs on byte permutes: entries 0-7 and 8-15 are picked by a nibble's
// low 3 bits, bit 3 picks between them; the entries are stored plus 128 and a byte u becomes
// the f16 1024 + u by placing 0x64 above it, two at once, so one half2 subtraction gives two
// exact codes. (On the H200 this decode, the same lookup with f32 exponent tricks and a
// shared-memory f32 table timed within 12% of one another: the loop is latency-bound, each
// block's x loads and dot sitting in its own branch region behind `if (xc[jr])`.)

__device__ __forceinline__ void iq4g_cp16(unsigned dst, const unsigned char* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// Wait until at most n of this thread's commit groups are pending (a smaller n is stricter).
__device__ __forceinline__ void iq4g_wait(int n) {
    if (n <= 0)
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    else if (n == 1)
        asm volatile("cp.async.wait_group 1;" ::: "memory");
    else if (n == 2)
        asm volatile("cp.async.wait_group 2;" ::: "memory");
    else
        asm volatile("cp.async.wait_group 3;" ::: "memory");
}

// prmt.b32 as PTX defines it: each selector nibble's bit 3 replicates the picked byte's sign,
// so callers pass nibbles below 8 (__byte_perm would mask every selector again).
__device__ __forceinline__ unsigned iq4g_prmt(unsigned a, unsigned b, unsigned s) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

// The codebook plus 128 as four words (entries 0-3, 4-7, 8-11, 12-15), made opaque so they
// stay in registers across the loop instead of being rebuilt before every permute.
struct Iq4gTable {
    unsigned t0, t1, t2, t3;
};

__device__ __forceinline__ Iq4gTable iq4g_table() {
    Iq4gTable t;
    asm("mov.b32 %0, 0x3f2d1801;" : "=r"(t.t0));
    asm("mov.b32 %0, 0x766a5d4f;" : "=r"(t.t1));
    asm("mov.b32 %0, 0xa6998d81;" : "=r"(t.t2));
    asm("mov.b32 %0, 0xf1d9c5b5;" : "=r"(t.t3));
    return t;
}

// The 32 codes of a block (16 qs bytes as 4 words) as f32, in value order.
__device__ __forceinline__ void iq4g_codes(const Iq4gTable& T, const unsigned q[4], float c[32]) {
    const __half2 bias = __halves2half2(__ushort_as_half((unsigned short)0xe480u),
                                        __ushort_as_half((unsigned short)0xe480u));  // -1152
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned mm = q[m] & 0x77777777u;
        const unsigned sl = ((q[m] >> 1) & 0x44444444u) | 0x32103210u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned s = h ? mm >> 16 : mm, t = h ? sl >> 16 : sl;
            const unsigned lo = iq4g_prmt(T.t0, T.t1, s), hi = iq4g_prmt(T.t2, T.t3, s);
            // Bytes: low, high nibble of qs[4m+2h], then of qs[4m+2h+1] (values v, v+16,
            // v+1, v+17 with v = 4m+2h), each the code plus 128.
            const unsigned r = iq4g_prmt(lo, hi, t);
            unsigned p0 = iq4g_prmt(r, 0x64646464u, 0x4140u), p1 = iq4g_prmt(r, 0x64646464u, 0x4342u);
            const __half2 c0 = __hadd2(*reinterpret_cast<const __half2*>(&p0), bias);
            const __half2 c1 = __hadd2(*reinterpret_cast<const __half2*>(&p1), bias);
            const int v = 4 * m + 2 * h;
            c[v] = __low2float(c0);
            c[v + 16] = __high2float(c0);
            c[v + 1] = __low2float(c1);
            c[v + 17] = __high2float(c1);
        }
    }
}

// Σ_{i<32} c[i]·x[i] for one block of x (16-byte aligned), four chains in a fixed order.
__device__ __forceinline__ float iq4g_dot32(const float c[32], const float* __restrict__ xb) {
    float s[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(xb + 4 * m));
        const float4 b = __ldg(reinterpret_cast<const float4*>(xb + 16 + 4 * m));
        float v = c[4 * m] * a.x;
        v = fmaf(c[4 * m + 1], a.y, v);
        v = fmaf(c[4 * m + 2], a.z, v);
        v = fmaf(c[4 * m + 3], a.w, v);
        v = fmaf(c[16 + 4 * m], b.x, v);
        v = fmaf(c[16 + 4 * m + 1], b.y, v);
        v = fmaf(c[16 + 4 * m + 2], b.z, v);
        v = fmaf(c[16 + 4 * m + 3], b.w, v);
        s[m] = v;
    }
    return (s[0] + s[1]) + (s[2] + s[3]);
}

// Block b (0..7) of a 144-byte chunk held as 36 words: its scale and its 16 qs bytes. Blocks
// 2p and 2p+1 are words 9p..9p+8: the even one's d is the low half of the first word and its
// bytes straddle the next five; the odd one's d is the high half of the fifth word and its
// bytes are the last four.
__device__ __forceinline__ void iq4g_block(const unsigned w[36], int b, float* d, unsigned q[4]) {
    const unsigned* pw = w + 9 * (b >> 1);
    if (!(b & 1)) {
        *d = __half2float(__ushort_as_half((unsigned short)(pw[0] & 0xffffu)));
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = __funnelshift_r(pw[i], pw[i + 1], 16);
    } else {
        *d = __half2float(__ushort_as_half((unsigned short)(pw[4] >> 16)));
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = pw[5 + i];
    }
}

// The warp's lanes' chunks into shared memory (lane L's segment at wbase + 16·L·seg, each
// lane `mycw` chunks of 144 bytes from `src`): chunk j of every lane, 32 x 9 pieces, piece p =
// lane L's piece p % 9, one commit group a chunk.
__device__ __forceinline__ void iq4g_stage(const unsigned char* src, int mycw, int cwmax, int seg,
                                           unsigned wbase, int lane) {
    for (int j = 0; j < cwmax; ++j) {
#pragma unroll
        for (int i = 0; i < 9; ++i) {
            const int p = lane + 32 * i;
            const int L = p / 9, sub = p - 9 * L;
            const unsigned long long sL = __shfl_sync(0xffffffffu, (unsigned long long)src, L);
            const int cwL = __shfl_sync(0xffffffffu, mycw, L);
            if (j < cwL)
                iq4g_cp16(wbase + (unsigned)((L * seg + 9 * j + sub) * 16),
                          reinterpret_cast<const unsigned char*>(sL) + 144 * j + 16 * sub);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
}

__device__ __forceinline__ float iq4g_silu_times(float g, float u) {
    return __fmul_rn(u, __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
}

// Chunk j of a thread's segment as 36 words.
__device__ __forceinline__ void iq4g_chunk(const uint4* mine, int j, unsigned w[36]) {
#pragma unroll
    for (int i = 0; i < 9; ++i) {
        const uint4 v = mine[9 * j + i];
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
    }
}

// A thread's share of a tile (see iq4g_tile): its row slot's weight row and its K part's
// chunks, staged into its shared-memory segment (copies issued, not waited for).
struct Iq4gPart {
    bool live;         // the thread has a K part (kp < KP)
    int c0;            // its first chunk
    int mycw;          // its chunks (0 for a row past n_out)
    int cwmax;         // the most chunks any part has
    int seg;           // 16-byte units a thread's segment
    const uint4* mine; // its segment
};

__device__ __forceinline__ Iq4gPart iq4g_part(const unsigned char* __restrict__ Wa,
                                              const unsigned char* __restrict__ Wb, int n_in,
                                              int n_out, int o0, int RT, int KP,
                                              unsigned char* smem) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int nch = n_in >> 8;
    const long long row_bytes = (long long)(n_in >> 5) * 18;
    const int half = RT >> 1;
    const int rs = tid % RT, kp = tid / RT;
    Iq4gPart P;
    P.live = kp < KP;
    P.c0 = P.live ? kp * nch / KP : 0;
    const int cw = P.live ? (kp + 1) * nch / KP - P.c0 : 0;
    P.cwmax = (nch + KP - 1) / KP;
    P.seg = 9 * P.cwmax + ((P.cwmax & 1) ? 0 : 1);
    int row;
    const unsigned char* mat;
    if (Wb != nullptr) {
        row = o0 + (rs < half ? rs : rs - half);
        mat = rs < half ? Wa : Wb;
    } else {
        row = o0 + rs;
        mat = Wa;
    }
    const bool rv = P.live && row < n_out;
    P.mycw = rv ? cw : 0;
    const unsigned char* src = mat + (long long)(rv ? row : 0) * row_bytes + (long long)P.c0 * 144;
    const unsigned wbase =
        (unsigned)__cvta_generic_to_shared(smem + (long long)(tid & ~31) * P.seg * 16);
    iq4g_stage(src, P.mycw, P.cwmax, P.seg, wbase, lane);
    P.mine = reinterpret_cast<const uint4*>(smem + (long long)tid * P.seg * 16);
    return P;
}

// A round's end: every live thread's NR sums meet in `red` (blockDim·NR floats), the K parts
// of an output are added in part order, and y[(rg + j)·n_out + o0 + o] gets the dot or, for
// SwiGLU (slots RT/2.. are the up rows), silu(gate)·up. Leaves `red` free for the next round.
template <int NR>
__device__ __forceinline__ void iq4g_finish(const float acc[NR], bool live, float* red,
                                            float* __restrict__ y, int rg, int cnt, int o0,
                                            int n_out, int RT, int KP, bool swiglu) {
    const int tid = threadIdx.x, half = RT >> 1;
    if (live) {
#pragma unroll
        for (int j = 0; j < NR; ++j) red[tid * NR + j] = acc[j];
    }
    __syncthreads();
    const int outs = swiglu ? half : RT;
    for (int idx = tid; idx < outs * cnt; idx += blockDim.x) {
        const int o = idx % outs, j = idx / outs;
        if (o0 + o >= n_out) continue;
        float a = 0.0f, u = 0.0f;
        for (int p = 0; p < KP; ++p) {
            a += red[(p * RT + o) * NR + j];
            if (swiglu) u += red[(p * RT + half + o) * NR + j];
        }
        y[(long long)(rg + j) * n_out + o0 + o] = swiglu ? iq4g_silu_times(a, u) : a;
    }
    __syncthreads();
}

// One tile: rows o0.. of Wa (and, for SwiGLU, the same rows of Wb: slots RT/2.. are Wb's),
// input rows x[src(r)] for routes r in [r_begin, r_end) (src(r) = tok[r] when tok is given,
// else r; a source outside [0, n_x_rows) reads as zeros), outputs y[r·n_out + o]: the dot
// for a plain product, silu(gate)·up for SwiGLU. Block-uniform arguments; blockDim a
// multiple of 32 with RT·KP ≤ blockDim (the rest only help copy).
template <int NR>
__device__ __forceinline__ void iq4g_tile(const unsigned char* __restrict__ Wa,
                                          const unsigned char* __restrict__ Wb,
                                          const float* __restrict__ x, const int* __restrict__ tok,
                                          float* __restrict__ y, int n_in, int n_out, int n_x_rows,
                                          int r_begin, int r_end, int o0, int RT, int KP) {
    extern __shared__ float4 iq4g_smem4[];
    const bool swiglu = Wb != nullptr;
    unsigned char* smem = reinterpret_cast<unsigned char*>(iq4g_smem4);
    const Iq4gPart P = iq4g_part(Wa, Wb, n_in, n_out, o0, RT, KP, smem);
    const bool live = P.live;
    const int c0 = P.c0, mycw = P.mycw, cwmax = P.cwmax;
    const uint4* mine = P.mine;
    float* red = reinterpret_cast<float*>(smem + (long long)blockDim.x * P.seg * 16);
    const Iq4gTable T = iq4g_table();
    for (int rg = r_begin; rg < r_end; rg += NR) {  // block-uniform
        const int cnt = min(NR, r_end - rg);
        const float* xr[NR];
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            int s = -1;
            if (j < cnt) s = tok ? tok[rg + j] : rg + j;
            xr[j] = (s >= 0 && s < n_x_rows) ? x + (long long)s * n_in : nullptr;
        }
        float acc[NR];
#pragma unroll
        for (int j = 0; j < NR; ++j) acc[j] = 0.0f;
        for (int j = 0; j < cwmax; ++j) {
            if (rg == r_begin) {
                iq4g_wait(cwmax - 1 - j);
                __syncwarp();
            }
            if (j >= mycw) continue;
            unsigned w[36];
            iq4g_chunk(mine, j, w);
            const float* xc[NR];
#pragma unroll
            for (int jr = 0; jr < NR; ++jr) xc[jr] = xr[jr] ? xr[jr] + (c0 + j) * 256 : nullptr;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                float d;
                unsigned q[4];
                iq4g_block(w, b, &d, q);
                float c[32];
                iq4g_codes(T, q, c);
#pragma unroll
                for (int jr = 0; jr < NR; ++jr)
                    if (xc[jr]) acc[jr] = fmaf(d, iq4g_dot32(c, xc[jr] + 32 * b), acc[jr]);
            }
        }
        iq4g_finish<NR>(acc, live, red, y, rg, cnt, o0, n_out, RT, KP, swiglu);
    }
}
