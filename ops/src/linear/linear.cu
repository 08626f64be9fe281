// y[n, O] = x[n, K] · W[O, K]ᵀ, W stored as F32/F16/BF16/Q8_0/Q6_K/IQ4_NL, x and y f32.
// Prepended with dequant.cuh.
//
// Three paths, chosen on the host (ops/src/linear/plan.rs), plus two decode kernels described
// where they are defined (gemv_iq4_nl_rows_* for IQ4_NL, gemv_bf16_dec_* for one BF16 token):
// * gemv_<type>_<NT> (n ≤ 8): each warp owns whole weight rows (grid-strided over the
//   rows so a small matrix still covers the chip and a large one pipelines). A row is
//   streamed in chunks of whole blocks, staged into the warp's shared memory with
//   16-byte cp.async (the chunk's aligned cover; blocks of 18/34/210 bytes are not
//   16-byte aligned themselves), double-buffered so the next chunk is in flight while
//   this one is decoded. Weights are decoded in registers and dotted with all n tokens
//   in f32; the lanes' partial sums meet in a fixed butterfly, so results are
//   deterministic.
// * n > 8, K % 32 == 0: linear_x_bf16 narrows x to bf16 once (BF16 tolerance; x is an
//   O(1)-scaled sub-layer operand and bf16 keeps f32's range), then BF16 weights go to cuBLAS
//   and the other types to linear_tq_<type>_<fit>, bf16 tensor-core tiles that decode the
//   stored weight in place (described at its definition).
// * linear_generic (anything else: odd widths, misaligned views): a warp per row,
//   element-wise decode. Correct for every shape, not fast.
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

// Activations are written by the step's previous kernel, which under programmatic launch may
// still be running when this one starts. __ldg (the read-only path) is undefined for such data,
// and the compiler did move those loads above griddepcontrol.wait: one-token BF16 products of
// K = 640..1,024 returned wrong sums in captured decode steps on the H200 (bench/RESULTS.md
// 2026-12-02 (j)). __ldcg put them after the wait but as strong L2 loads, and cost 1.07 ms a
// decode step of the full checkpoint (tg128 212 -> 172 t/s, (m)). A volatile asm load with a
// memory clobber keeps its place after the wait (itself volatile, with a clobber) and is an
// ordinary L1-cached load.
__device__ __forceinline__ float4 ldx4(const float* p) {
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

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

// The four codes of `v` (one a byte, 0..63) as the floats code - 32: each byte placed under
// the exponent of 2^23 (a permute), then 2^23 + 32 taken away, both exact. (Shifting each
// code out and converting it cost ~14 integer instructions a weight and bound the one-token
// lm head: 273 µs for 385 MB on the H200, a third of the copy rate.)
__device__ __forceinline__ void q6_codes(unsigned v, float* w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned r;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x4b000000u), "r"(0x7540u | i));
        w[i] = __fsub_rn(__uint_as_float(r), 8388640.0f);
    }
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
            for (int j = 0; j < 2; ++j) {
                // Four 6-bit codes a word, each in its own byte: the nibble of ql with its two
                // bits of qh moved to bits 4-5 (the masks drop what a shift carries across bytes).
                const unsigned a = qa[j], c = qb[j], h = qh[j];
                const unsigned v0 = (a & 0x0f0f0f0fu) | ((h << 4) & 0x30303030u);
                const unsigned v1 = (c & 0x0f0f0f0fu) | ((h << 2) & 0x30303030u);
                const unsigned v2 = ((a >> 4) & 0x0f0f0f0fu) | (h & 0x30303030u);
                const unsigned v3 = ((c >> 4) & 0x0f0f0f0fu) | ((h >> 2) & 0x30303030u);
                q6_codes(v0, w + 4 * j);
                q6_codes(v1, w + 8 + 4 * j);
                q6_codes(v2, w + 16 + 4 * j);
                q6_codes(v3, w + 24 + 4 * j);
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
// Decode Q6_K products (n ≤ 8, K a multiple of 256) on integer MMAs: the lm head's 131,072 rows.
// The generic GEMV above read x once a weight row from L1 in half-used lines and spent ~5.5
// instructions a weight; the one-token lm head ran at 42% of the copy rate, 8 tokens at 21%.
//
// Here x is read once a block: each token becomes a 32-bit fixed-point value in four signed
// bytes, q = round(x·2^(30-E)) with 2^E above the token's largest |x| (|q| ≤ 2^30, limbs in
// [-128, 127], q = Σ limb_i·2^(8i)), an error of at most 2^-31 of that largest value, below
// the f32 rounding of the products it replaces. The limbs are the B columns of
// mma.m16n8k16.s8 (token t's limb i is column 4t + i: an n8 tile takes two tokens) and the
// codes, code - 32 as signed bytes, the A rows; MMA k slot 4·(lane%4) + j holds value
// 16·lh + 4·(lane%4) + j of a 16-value scale group, so a lane's four bytes of ql and qh are
// its A bytes with no shuffling. One MMA a scale group gives exact integer sums, scaled by the
// group's int8 scale in integer (|Σ| < 2^28 over a block), then the block's sum times d in f32
// in K order; the limbs meet at the end, times 2^(E-30). A NaN or an infinity in a token's x
// makes its outputs NaN, as the f32 GEMV's would be.
//
// Each warp owns 16-row tiles (grid-strided) and streams them a Q6_K block (16 × 210 bytes)
// at a time through its own cp.async ring of Q6M_STAGES slots; one block a multiprocessor of
// Q6M_WARPS warps, x's fragments in shared memory beside the rings. Weight loads are issued
// before waiting for the predecessor when `early` (constant data), x read after.
#define Q6M_WARPS 8
// A row's staged Q6_K block: the 16-byte cover of its 210 bytes (at most 224), padded to 240
// so the 8 rows a fragment reads start in different banks.
#define Q6M_SLOT 240
#define Q6M_STAGE (16 * Q6M_SLOT)

// Word `i` of a staged row realigned by `odd` (the row's block starts 2 bytes into a word).
__device__ __forceinline__ unsigned q6m_word(const unsigned* w, int i, bool odd) {
    unsigned v = w[i];
    if (odd) v = __funnelshift_r(v, w[i + 1], 16);
    return v;
}

// code - 32 of four 6-bit codes (a byte each) as signed bytes: with bit 7 set first no byte
// borrows from the next, and the flip of bit 7 restores the two's complement.
__device__ __forceinline__ unsigned q6m_signed(unsigned c) {
    return ((c | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

__device__ __forceinline__ void q6m_mma(int (&d)[4], unsigned a0, unsigned a1, unsigned b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// The four signed codes (q = 0..3) of a lane's 4 values at (hf, lh) of one staged row.
__device__ __forceinline__ void q6m_codes(const unsigned* w, int a, int hf, int lh, int t, unsigned (&c)[4]) {
    const bool odd = a & 2;
    const int i = ((a & ~3) >> 2) + 16 * hf + 4 * lh + t, ih = ((a & ~3) >> 2) + 32 + 8 * hf + 4 * lh + t;
    const unsigned lo = q6m_word(w, i, odd), hi = q6m_word(w, i + 8, odd), h = q6m_word(w, ih, odd);
    c[0] = q6m_signed((lo & 0x0f0f0f0fu) | ((h << 4) & 0x30303030u));
    c[1] = q6m_signed((hi & 0x0f0f0f0fu) | ((h << 2) & 0x30303030u));
    c[2] = q6m_signed(((lo >> 4) & 0x0f0f0f0fu) | (h & 0x30303030u));
    c[3] = q6m_signed(((hi >> 4) & 0x0f0f0f0fu) | ((h >> 2) & 0x30303030u));
}

// NCT n8 column tiles (2·NCT tokens), S ring slots a warp.
template <int NCT, int S>
__device__ __forceinline__ void q6m_body(const unsigned char* __restrict__ W, const float* __restrict__ x,
                                         float* __restrict__ y, int n, int K, int O, long long RB,
                                         int early) {
    extern __shared__ __align__(16) unsigned char q6m_smem[];
    __shared__ int tok_e[8];
    __shared__ float tok_poison[8];
    const int nb = K >> 8, groups = K >> 4;
    unsigned* xf = reinterpret_cast<unsigned*>(q6m_smem);  // [group][tile][lane]
    unsigned char* ring = q6m_smem + (size_t)groups * NCT * 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    unsigned char* myring = ring + warp * S * Q6M_STAGE;
    const int tiles = (O + 15) >> 4;
    const int gw = blockIdx.x * Q6M_WARPS + warp, tw = gridDim.x * Q6M_WARPS;
    const int items = gw < tiles ? ((tiles - 1 - gw) / tw + 1) * nb : 0;
    const unsigned char* wend = W + (long long)O * RB;

    // Staging: row i of a tile (clamped to the last row) lands in slot i, the 16-byte cover of
    // its block's 210 bytes in 14 pieces; 16 rows × 14 pieces are 7 a lane, fixed per lane.
    int poff[7], ppiece[7];  // each of the lane's pieces: its slot offset, its offset in the cover
    const unsigned char* prow[7];  // their rows in the tile being staged
    int st_tile = gw, st_b = 0, st_slot = 0;
    auto rows_of = [&](int tile) {
#pragma unroll
        for (int j = 0; j < 7; ++j) {
            const int p = lane + 32 * j, i = p / 14;
            ppiece[j] = 16 * (p - 14 * i);
            poff[j] = Q6M_SLOT * i + ppiece[j];
            prow[j] = W + (long long)min(tile * 16 + i, O - 1) * RB;
        }
    };
    rows_of(st_tile);
    auto stage_next = [&]() {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(myring + st_slot * Q6M_STAGE);
        const long long boff = 210ll * st_b;
        if (st_tile * 16 + 16 < O || st_b < nb - 1) {
#pragma unroll
            for (int j = 0; j < 7; ++j) {
                const unsigned long long c = ((unsigned long long)(prow[j] + boff) & ~15ull) + ppiece[j];
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + poff[j]), "l"(c) : "memory");
            }
        } else {
            // The last row's last block: its cover may run past the weight (zero-filled).
#pragma unroll
            for (int j = 0; j < 7; ++j) {
                const unsigned char* c = reinterpret_cast<const unsigned char*>(
                                             (unsigned long long)(prow[j] + boff) & ~15ull) + ppiece[j];
                const long long left = wend - c;
                const int bytes = left >= 16 ? 16 : (left > 0 ? (int)left : 0);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + poff[j]),
                             "l"(bytes ? c : W), "r"(bytes)
                             : "memory");
            }
        }
        if (++st_b == nb) {
            st_b = 0;
            st_tile += tw;
            rows_of(st_tile);
        }
        st_slot = st_slot == S - 1 ? 0 : st_slot + 1;
    };

    if (!early) PDL_WAIT();
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < items) stage_next();
        cp_async_commit();
    }
    PDL_WAIT();

    // x's fragments. Warp w finds token w's largest |x| (and whether it holds a NaN or an
    // infinity); then every (token, 4 values) chunk becomes its four limbs' words.
    if (warp < n) {
        const float* xr = x + (long long)warp * K;
        float amax = 0.f, poison = 0.f;
        for (int i = lane; i < (K >> 2); i += 32) {
            const float4 v = ldx4(xr + 4 * i);
            amax = fmaxf(fmaxf(amax, fabsf(v.x)), fmaxf(fabsf(v.y), fmaxf(fabsf(v.z), fabsf(v.w))));
            poison += v.x * 0.f + v.y * 0.f + v.z * 0.f + v.w * 0.f;  // NaN for a NaN or an infinity
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            poison += __shfl_xor_sync(0xffffffffu, poison, o);
        }
        int e = 0;
        if (amax > 0.f && amax <= 3.4e38f) frexpf(amax, &e);
        if (lane == 0) {
            tok_e[warp] = e;
            tok_poison[warp] = poison;
        }
    }
    __syncthreads();
    const int chunks = 2 * NCT * (K >> 2);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int tok = c / (K >> 2), k = 4 * (c - tok * (K >> 2));
        int lim[4][4];  // [value][limb]
        if (tok < n) {
            const float4 v = ldx4(x + (long long)tok * K + k);
            const float xv[4] = {v.x, v.y, v.z, v.w};
            const int sh = 30 - tok_e[tok];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int q = __float2int_rn(ldexpf(xv[j], sh));
                q = max(-(1 << 30), min(1 << 30, q));
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int l = i < 3 ? (int)(signed char)(q & 0xff) : q;
                    lim[j][i] = l;
                    q = (q - l) >> 8;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) lim[j][i] = 0;
        }
        const int b = k >> 8, r = k & 255, hf = r >> 7, q = (r >> 5) & 3, lh = (r >> 4) & 1, tt = (r >> 2) & 3;
        const int gi = ((b * 2 + hf) * 2 + lh) * 4 + q;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = 4 * tok + i;
            const unsigned w = ((unsigned)lim[0][i] & 0xffu) | (((unsigned)lim[1][i] & 0xffu) << 8) |
                               (((unsigned)lim[2][i] & 0xffu) << 16) | ((unsigned)lim[3][i] << 24);
            xf[(gi * NCT + (col >> 3)) * 32 + (col & 7) * 4 + tt] = w;
        }
    }
    __syncthreads();

    float acc[NCT][4];
#pragma unroll
    for (int ct = 0; ct < NCT; ++ct)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[ct][i] = 0.f;
    int tile = gw, b = 0, slot = 0;
    // Where rows g and g+8 of the tile start within their 16 bytes (210·b adds 2b).
    int a0r = 0, a1r = 0;
    for (int it = 0; it < items; ++it) {
        if (it + S - 1 < items) stage_next();
        cp_async_commit();
        asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1));
        __syncwarp();
        if (b == 0) {
            const int r0 = min(tile * 16 + g, O - 1), r1 = min(tile * 16 + g + 8, O - 1);
            a0r = (int)((unsigned long long)(W + (long long)r0 * RB) & 15);
            a1r = (int)((unsigned long long)(W + (long long)r1 * RB) & 15);
        }
        const int a0 = (a0r + 2 * b) & 15, a1 = (a1r + 2 * b) & 15;
        const unsigned char* sb0 = myring + slot * Q6M_STAGE + Q6M_SLOT * g;
        const unsigned char* sb1 = sb0 + 8 * Q6M_SLOT;
        const unsigned* w0 = reinterpret_cast<const unsigned*>(sb0);
        const unsigned* w1 = reinterpret_cast<const unsigned*>(sb1);
        const unsigned* xb = xf + (size_t)b * 16 * NCT * 32 + lane;
        int iacc[NCT][4];
#pragma unroll
        for (int ct = 0; ct < NCT; ++ct)
#pragma unroll
            for (int i = 0; i < 4; ++i) iacc[ct][i] = 0;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
            for (int lh = 0; lh < 2; ++lh) {
                unsigned c0[4], c1[4];
                q6m_codes(w0, a0, hf, lh, t, c0);
                q6m_codes(w1, a1, hf, lh, t, c1);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int si = 192 + 8 * hf + lh + 2 * q;
                    const int sc0 = (signed char)sb0[a0 + si], sc1 = (signed char)sb1[a1 + si];
                    const int gl = (hf * 2 + lh) * 4 + q;
#pragma unroll
                    for (int ct = 0; ct < NCT; ++ct) {
                        int d[4];
                        q6m_mma(d, c0[q], c1[q], xb[(gl * NCT + ct) * 32]);
                        iacc[ct][0] += sc0 * d[0];
                        iacc[ct][1] += sc0 * d[1];
                        iacc[ct][2] += sc1 * d[2];
                        iacc[ct][3] += sc1 * d[3];
                    }
                }
            }
        }
        const float d0 = h2f(*reinterpret_cast<const unsigned short*>(sb0 + a0 + 208));
        const float d1 = h2f(*reinterpret_cast<const unsigned short*>(sb1 + a1 + 208));
#pragma unroll
        for (int ct = 0; ct < NCT; ++ct) {
            acc[ct][0] = fmaf(d0, (float)iacc[ct][0], acc[ct][0]);
            acc[ct][1] = fmaf(d0, (float)iacc[ct][1], acc[ct][1]);
            acc[ct][2] = fmaf(d1, (float)iacc[ct][2], acc[ct][2]);
            acc[ct][3] = fmaf(d1, (float)iacc[ct][3], acc[ct][3]);
        }
        __syncwarp();
        if (b == nb - 1) {
            // Lane t holds limbs 2(t%2), 2(t%2)+1 of token 2·ct + t/2; lane t^1 the other two.
            const float w0f = (t & 1) ? 65536.f : 1.f, w1f = w0f * 256.f;
#pragma unroll
            for (int ct = 0; ct < NCT; ++ct) {
                float v0 = fmaf(w1f, acc[ct][1], w0f * acc[ct][0]);
                float v1 = fmaf(w1f, acc[ct][3], w0f * acc[ct][2]);
                // The low limbs' pair first, then the high ones', in every lane.
                const float o0 = __shfl_xor_sync(0xffffffffu, v0, 1), o1 = __shfl_xor_sync(0xffffffffu, v1, 1);
                v0 = (t & 1) ? o0 + v0 : v0 + o0;
                v1 = (t & 1) ? o1 + v1 : v1 + o1;
                const int tok = 2 * ct + (t >> 1);
                if (!(t & 1) && tok < n) {
                    const int e = tok_e[tok] - 30;
                    const float p = tok_poison[tok];
                    const int r0 = tile * 16 + g, r1 = r0 + 8;
                    if (r0 < O) y[(long long)tok * O + r0] = ldexpf(v0, e) + p;
                    if (r1 < O) y[(long long)tok * O + r1] = ldexpf(v1, e) + p;
                }
                acc[ct][0] = acc[ct][1] = acc[ct][2] = acc[ct][3] = 0.f;
            }
        }
        if (++b == nb) {
            b = 0;
            tile += tw;
        }
        slot = slot == S - 1 ? 0 : slot + 1;
    }
}

// n ≤ 2, 4, 8 tokens: 1, 2, 4 column tiles. One ring slot fewer past one tile keeps the 8
// warps' rings and x's fragments in a multiprocessor's shared memory at K = 3,584.
#define GEMV_Q6M(NCT, S)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 1) gemv_q6_k_mma_##NCT(                      \
        const unsigned char* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,   \
        int n, int K, int O, long long RB, int early) {                                            \
        PDL_WEIGHTS_FIRST();                                                                       \
        q6m_body<NCT, S>(W, x, y, n, K, O, RB, early);                                             \
    }
GEMV_Q6M(1, 4)
GEMV_Q6M(2, 3)
GEMV_Q6M(4, 3)

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
// NORM (q_b after q_a's RMSNorm): x is normalised on the fly, x·scale·norm_w with each
// product rounded as the RMSNorm kernel does; every block sums the squares itself (K is
// small) in a fixed order, then the weight loads already in flight meet the scaled x.
//
// The kernels open with PDL_WEIGHTS_FIRST(): with `early` the weight loads (constant data) are
// issued before PDL_WAIT(), so under programmatic launches they overlap the predecessor's
// tail; everything the predecessor writes (x) is read after it. early = 0 waits first.
template <int JU, int R, bool NORM = false>
__device__ __forceinline__ void gemv_bf16_dec_body(const unsigned char* __restrict__ W,
                                                   const float* __restrict__ x, float* __restrict__ y,
                                                   int K, int O, long long RB, int block, int early,
                                                   const float* __restrict__ norm_w = nullptr,
                                                   float eps = 0.f) {
    __shared__ float red[8 * R];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, S = blockDim.x >> 5;
    const int u = K >> 3;
    const long long r0 = (long long)block * R;
    if (!early) PDL_WAIT();
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
    PDL_WAIT();
    float scale = 1.f;
    if constexpr (NORM) {
        __shared__ float nred[8];
        float ss = 0.f;
        for (int i = threadIdx.x; i < (K >> 2); i += blockDim.x) {
            const float4 v = ldx4(x + 4 * i);
            ss += __fmul_rn(v.x, v.x);
            ss += __fmul_rn(v.y, v.y);
            ss += __fmul_rn(v.z, v.z);
            ss += __fmul_rn(v.w, v.w);
        }
        ss = warp_sum(ss);
        if (lane == 0) nred[warp] = ss;
        __syncthreads();
        float tot = 0.f;
        for (int w = 0; w < S; ++w) tot += nred[w];
        scale = 1.0f / sqrtf(tot / (float)K + eps);
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
        float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if constexpr (NORM) {
            const float4 ga = i < u ? ldx4(norm_w + 8 * i) : z4;
            const float4 gb = i < u ? ldx4(norm_w + 8 * i + 4) : z4;
            const float g[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) xv[e] = __fmul_rn(__fmul_rn(xv[e], scale), g[e]);
        }
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
        int n, int K, int O, long long RB, int early) {                                           \
        PDL_WEIGHTS_FIRST();                                                                      \
        (void)n;                                                                                  \
        gemv_bf16_dec_body<JU, R>(W, x, y, K, O, RB, blockIdx.x, early);                          \
    }                                                                                             \
    /* Two weights over the same x (q_a and kv_a): the first ceil(O/R) blocks take W, the */      \
    /* rest W2; one launch for both products. */                                                  \
    extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_dec2_##JU##_##R(               \
        const unsigned char* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,  \
        int n, int K, int O, long long RB, const unsigned char* __restrict__ W2,                  \
        float* __restrict__ y2, int O2, int early) {                                              \
        PDL_WEIGHTS_FIRST();                                                                      \
        (void)n;                                                                                  \
        const int first = (O + R - 1) / R;                                                        \
        if ((int)blockIdx.x < first)                                                              \
            gemv_bf16_dec_body<JU, R>(W, x, y, K, O, RB, blockIdx.x, early);                      \
        else                                                                                      \
            gemv_bf16_dec_body<JU, R>(W2, x, y2, K, O2, RB, blockIdx.x - first, early);           \
    }                                                                                             \
    /* The product of RMSNorm(x)·norm_w (q_a's norm before q_b). */                               \
    extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_dec_norm_##JU##_##R(           \
        const unsigned char* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,  \
        int n, int K, int O, long long RB, const float* __restrict__ norm_w, float eps,           \
        int early) {                                                                              \
        PDL_WEIGHTS_FIRST();                                                                      \
        (void)n;                                                                                  \
        gemv_bf16_dec_body<JU, R, true>(W, x, y, K, O, RB, blockIdx.x, early, norm_w, eps);       \
    }
GEMV_BF16_DEC(16, 1)
GEMV_BF16_DEC(8, 1)
GEMV_BF16_DEC(4, 1)
GEMV_BF16_DEC(4, 4)
GEMV_BF16_DEC(2, 4)
GEMV_BF16_DEC(1, 4)

// ---------------------------------------------------------------------------------------------
// Prefill (n > 8, K % 32 == 0). linear_x_bf16 first narrows x to bf16 once, into the op's
// scratch; BF16 weights then go to cuBLAS (ops/src/linear/cuda.rs), every other type to
// linear_tq_<type>_<fit> below.
//
// linear_tq: BM tokens × BN weight rows a block (128 × 128 as instantiated), 8 warps of
// mma.sync m16n8k16 (bf16 operands, f32 accumulators), K slices of 64. Per slice:
// * x: the bf16 rows arrive by 16-byte cp.async, three stages deep (two slices in flight
//   while one is multiplied); rows past n and columns past K are zero-filled.
// * W: each thread owns one 32-value group of one weight row (one IQ4_NL/Q8_0 block, an
//   eighth of a Q6_K block). Its raw bytes for slice s+2 are loaded into registers right after
//   slice s+1's were decoded, so they have a whole slice of MMAs to land; decoding (f32
//   products exactly as the CPU dequantizes, then one rounding to bf16) writes a double-
//   buffered shared tile, so one barrier a slice orders everything. (Decoding in halves
//   between the MMA steps instead, so the tensor cores had queued work while it issued,
//   measured the same or 1-2% slower on the H200: the decode is not what limits this loop.)
// * ldmatrix feeds the fragments; shared rows are padded by 16 bytes, so the 8 rows of an
//   8×8 matrix fall in distinct bank groups.
// Each output has one thread and a fixed k order: runs repeat bit for bit.

extern "C" __global__ void __launch_bounds__(256)
    linear_x_bf16(const float* __restrict__ x, unsigned* __restrict__ xb, long long total) {
    PDL_ENTER();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, k = 8 * i;
    if (k + 8 <= total) {
        const float4 a = ldx4(x + k), b = ldx4(x + k + 4);
        unsigned r[4];
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r[0]) : "f"(a.y), "f"(a.x));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r[1]) : "f"(a.w), "f"(a.z));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r[2]) : "f"(b.y), "f"(b.x));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r[3]) : "f"(b.w), "f"(b.z));
        reinterpret_cast<uint4*>(xb)[i] = make_uint4(r[0], r[1], r[2], r[3]);
    } else {
        __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(xb);
        for (long long j = k; j < total; ++j) o[j] = __float2bfloat16_rn(x[j]);
    }
}

// Two f32 as a bf16 pair (lo in the low half), each rounded to nearest.
__device__ __forceinline__ unsigned tq_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// bytes = 0 zero-fills the 16 destination bytes without reading src.
__device__ __forceinline__ void tq_cp16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void tq_ldsm4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void tq_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The aligned words covering bytes from a 2-byte-aligned address on (blocks of 18, 34 and 210
// bytes are only 2-byte aligned); every word holds at least one byte of the field, so no
// read leaves the weight. The field starts `sh` = 0 or 16 bits into w[0].
template <int NW>
__device__ __forceinline__ unsigned tq_words(const unsigned char* p, unsigned (&w)[NW]) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    const unsigned* q = reinterpret_cast<const unsigned*>(a & ~3ull);
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = __ldg(q + i);
    return (unsigned)(a & 2) * 8;
}

// One thread's 32 weight values of a slice, as loaded (before decoding).
template <int WT> struct TqRaw;
template <> struct TqRaw<WT_F32> { float4 v[8]; };
template <> struct TqRaw<WT_F16> { uint4 v[4]; };
template <> struct TqRaw<WT_Q8_0> { unsigned w[9]; unsigned sh; };
template <> struct TqRaw<WT_IQ4_NL> { unsigned w[5]; unsigned sh; };
template <> struct TqRaw<WT_Q6_K> { unsigned ql[9], qh[9]; unsigned sh, sc, d; };

// Values k..k+31 of a row (k a multiple of 32).
template <int WT>
__device__ __forceinline__ void tq_load(TqRaw<WT>& r, const unsigned char* __restrict__ row, int k) {
    if constexpr (WT == WT_F32) {
        const float4* p = reinterpret_cast<const float4*>(row + 4ll * k);
#pragma unroll
        for (int i = 0; i < 8; ++i) r.v[i] = __ldg(p + i);
    } else if constexpr (WT == WT_F16) {
        const uint4* p = reinterpret_cast<const uint4*>(row + 2ll * k);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = __ldg(p + i);
    } else if constexpr (WT == WT_Q8_0) {
        r.sh = tq_words(row + (long long)(k >> 5) * 34, r.w);
    } else if constexpr (WT == WT_IQ4_NL) {
        r.sh = tq_words(row + (long long)(k >> 5) * 18, r.w);
    } else {
        // Values 32q..32q+31 of half hf: low (q < 2) or high nibbles of ql[64hf + 32(q&1) ..],
        // bits 2q of qh[32hf ..], scales 8hf + 2q (first 16 values) and the next one.
        const unsigned char* b = row + (long long)(k >> 8) * 210;
        const int o = k & 255, hf = o >> 7, q = (o >> 5) & 3;
        r.sh = tq_words(b + 64 * hf + 32 * (q & 1), r.ql);
        tq_words(b + 128 + 32 * hf, r.qh);
        r.sc = __ldg(reinterpret_cast<const unsigned short*>(b + 192 + 8 * hf + 2 * q));
        r.d = __ldg(reinterpret_cast<const unsigned short*>(b + 208));
    }
}

template <int WT>
__device__ __forceinline__ void tq_zero(TqRaw<WT>& r) {
    if constexpr (WT == WT_F32) {
#pragma unroll
        for (int i = 0; i < 8; ++i) r.v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else if constexpr (WT == WT_F16) {
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = make_uint4(0u, 0u, 0u, 0u);
    } else if constexpr (WT == WT_Q6_K) {
#pragma unroll
        for (int i = 0; i < 9; ++i) r.ql[i] = r.qh[i] = 0u;
        r.sh = r.sc = r.d = 0u;
    } else {
#pragma unroll
        for (int i = 0; i < (int)(sizeof(r.w) / 4); ++i) r.w[i] = 0u;
        r.sh = 0u;
    }
}

// Half h (0 or 1) of the 32 values as 8 bf16 pairs, each value first formed in f32 as the CPU
// reference forms it (d·code is exact in f32 for every block type), then rounded once. A half
// is values 16h..16h+15, except for IQ4_NL, whose qs words 2h and 2h+1 hold values 8h..8h+7
// (low nibbles) and 16+8h..16+8h+7 (high nibbles). p[0..3] and p[4..7] go to the thread's
// 64-byte row segment at byte tq_half_at<WT>(h, 0) and (h, 1).
template <int WT>
__device__ __forceinline__ int tq_half_at(int h, int j) {
    return WT == WT_IQ4_NL ? 16 * h + 32 * j : 32 * h + 16 * j;
}

template <int WT>
__device__ __forceinline__ void tq_decode_half(const TqRaw<WT>& r, int k, const Iq4gTable& T, int h,
                                               unsigned (&p)[8]) {
    if constexpr (WT == WT_F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 v = r.v[4 * h + i];
            p[2 * i] = tq_pack(v.x, v.y);
            p[2 * i + 1] = tq_pack(v.z, v.w);
        }
    } else if constexpr (WT == WT_F16) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const uint4 v = r.v[2 * h + i];
            const unsigned q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j)
                p[4 * i + j] = tq_pack(h2f((unsigned short)(q[j] & 0xffffu)), h2f((unsigned short)(q[j] >> 16)));
        }
    } else if constexpr (WT == WT_Q8_0) {
        const float d = h2f((unsigned short)(__funnelshift_rc(r.w[0], r.w[1], r.sh) & 0xffffu));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned q = __funnelshift_rc(r.w[4 * h + i], r.w[4 * h + i + 1], r.sh + 16);
            p[2 * i] = tq_pack(d * (float)(signed char)(q & 0xffu), d * (float)(signed char)((q >> 8) & 0xffu));
            p[2 * i + 1] = tq_pack(d * (float)(signed char)((q >> 16) & 0xffu), d * (float)(signed char)(q >> 24));
        }
    } else if constexpr (WT == WT_IQ4_NL) {
        const float d = h2f((unsigned short)(__funnelshift_rc(r.w[0], r.w[1], r.sh) & 0xffffu));
        // Codes of words 2h, 2h+1 land in c[0..7] (low nibbles) and c[16..23] (high); the
        // zero words' codes are never used, so the compiler drops them.
        const unsigned q[4] = {__funnelshift_rc(r.w[2 * h], r.w[2 * h + 1], r.sh + 16),
                               __funnelshift_rc(r.w[2 * h + 1], r.w[2 * h + 2], r.sh + 16), 0u, 0u};
        float c[32];
        iq4g_codes(T, q, c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            p[i] = tq_pack(d * c[2 * i], d * c[2 * i + 1]);
            p[4 + i] = tq_pack(d * c[16 + 2 * i], d * c[16 + 2 * i + 1]);
        }
    } else {
        const int q = (k >> 5) & 3, nsh = (q >> 1) * 4, hsh = 2 * q;
        const unsigned s8 = h ? r.sc >> 8 : r.sc & 0xffu;  // scale 8hf + 2q + h
        const float ds = h2f((unsigned short)r.d) * (float)(signed char)s8;
        float w[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned a = __funnelshift_rc(r.ql[4 * h + i], r.ql[4 * h + i + 1], r.sh);
            const unsigned hb = __funnelshift_rc(r.qh[4 * h + i], r.qh[4 * h + i + 1], r.sh);
            // Four 6-bit codes, a byte each (as the GEMV's q6_codes takes them).
            const unsigned v = ((a >> nsh) & 0x0f0f0f0fu) | (((hb >> hsh) & 0x03030303u) << 4);
            float c[4];
            q6_codes(v, c);
#pragma unroll
            for (int j = 0; j < 4; ++j) w[4 * i + j] = ds * c[j];
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) p[i] = tq_pack(w[2 * i], w[2 * i + 1]);
    }
}

// grid (ceil(O/BN), ceil(n/BM), splits), block 32·WM·WN (one 32-value weight group a thread a
// slice), dynamic shared memory (3·BM + 2·BN)·(BK + 8)·2 bytes. xb: x as bf16 [n, K], 16-byte
// aligned; pair: y's rows are 8-byte aligned (O even), so two outputs go in one store. Split z
// takes the BK-slices [z·per, (z+1)·per): with one split it writes y, with more its partial
// sums to part[z][n][O] (256-byte aligned), which linear_skinny_reduce adds in split order (a
// grid of few tiles, the shared expert's 1,024 rows at a 256-token step, left most of the chip
// idle over the whole K).
template <int WT, int BM, int BN, int BK, int WM, int WN, bool SPLIT>
__device__ __forceinline__ void tq_body(const unsigned char* __restrict__ W, const __nv_bfloat16* __restrict__ xb,
                                        float* __restrict__ y, int n, int K, int O, long long RB, int pair,
                                        float* __restrict__ part, int per) {
    constexpr int THREADS = 32 * WM * WN, GPR = BK / 32;
    static_assert(THREADS == BN * GPR, "one weight group a thread");
    constexpr int LDS = BK + 8, STAGES = 3;
    constexpr int A_STAGE = BM * LDS, B_BUF = BN * LDS;  // bf16 elements
    constexpr int TM = BM / WM, TN = BN / WN, MT = TM / 16, NT = TN / 8;
    static_assert(MT >= 1 && NT % 2 == 0, "warp tile of whole m16 tiles and n8 pairs");
    constexpr int CPR = BK / 8, ACH = BM * CPR / THREADS;
    static_assert(ACH * THREADS == BM * CPR, "whole 16-byte copies a thread");
    extern __shared__ __align__(16) unsigned char tq_smem[];
    const unsigned as_base = (unsigned)__cvta_generic_to_shared(tq_smem);
    const unsigned bs_base = as_base + 2u * STAGES * A_STAGE;
    unsigned char* bs_ptr = tq_smem + 2 * STAGES * A_STAGE;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    // kt below counts this split's slices; kb is its first slice's input.
    const int kt0 = SPLIT ? blockIdx.z * per : 0, kb = kt0 * BK;
    const int KT = SPLIT ? min((K + BK - 1) / BK - kt0, per) : (K + BK - 1) / BK;
    if (SPLIT && KT <= 0) return;
    if (SPLIT && gridDim.z > 1) y = part + (long long)blockIdx.z * n * O;

    auto issue_a = [&](int kt, int stage) {
#pragma unroll
        for (int i = 0; i < ACH; ++i) {
            const int c = tid + i * THREADS, r = c / CPR, cc = c % CPR;
            const int m = m0 + r, k = kb + kt * BK + cc * 8;
            const bool ok = m < n && k < K;
            tq_cp16(as_base + 2u * (stage * A_STAGE + r * LDS + cc * 8), ok ? xb + (long long)m * K + k : xb,
                    ok ? 16 : 0);
        }
    };

    const int wr = tid / GPR, wg = tid % GPR;
    const bool wok = n0 + wr < O;
    const unsigned char* wrow = W + (long long)(wok ? n0 + wr : 0) * RB;
    const Iq4gTable T = iq4g_table();
    TqRaw<WT> raw;
    auto load_w = [&](int kt) {
        const int k = kb + kt * BK + 32 * wg;
        if (wok && k < K)
            tq_load<WT>(raw, wrow, k);
        else
            tq_zero<WT>(raw);
    };
    auto store_half = [&](int kt, int buf, int h) {
        unsigned p[8];
        tq_decode_half<WT>(raw, kb + kt * BK + 32 * wg, T, h, p);
        unsigned char* seg = bs_ptr + 2 * (buf * B_BUF + wr * LDS + 32 * wg);
        *reinterpret_cast<uint4*>(seg + tq_half_at<WT>(h, 0)) = make_uint4(p[0], p[1], p[2], p[3]);
        *reinterpret_cast<uint4*>(seg + tq_half_at<WT>(h, 1)) = make_uint4(p[4], p[5], p[6], p[7]);
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // ldmatrix lanes: A rows 0-15 at k 0 then k 8; B n rows 0-7 at k 0, k 8, then rows 8-15.
    const int wm0 = (warp / WN) * TM, wn0 = (warp % WN) * TN;
    const unsigned a_lane = 2u * ((wm0 + (lane & 15)) * LDS + (lane >> 4) * 8);
    const unsigned b_lane = 2u * ((wn0 + (lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8);

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) issue_a(s, s);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    load_w(0);
    store_half(0, 0, 0);
    store_half(0, 0, 1);
    if (KT > 1) load_w(1);
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
    __syncthreads();

    int stage = 0;
    for (int kt = 0; kt < KT; ++kt) {
        // The stage slice kt+2 goes to was last read by slice kt-1 (barrier since).
        const int next = stage == 0 ? STAGES - 1 : stage - 1;
        if (kt + STAGES - 1 < KT) issue_a(kt + STAGES - 1, next);
        asm volatile("cp.async.commit_group;" ::: "memory");

        const unsigned a_st = as_base + 2u * stage * A_STAGE + a_lane;
        const unsigned b_st = bs_base + 2u * (kt & 1) * B_BUF + b_lane;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned a[MT][4], b[NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) tq_ldsm4(a[mt], a_st + 2u * (mt * 16 * LDS + kk));
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned t[4];
                tq_ldsm4(t, b_st + 2u * (np * 16 * LDS + kk));
                b[2 * np][0] = t[0];
                b[2 * np][1] = t[1];
                b[2 * np + 1][0] = t[2];
                b[2 * np + 1][1] = t[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) tq_mma(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
        }

        // Buffer (kt+1)&1 was last read by slice kt-1.
        if (kt + 1 < KT) {
            store_half(kt + 1, (kt + 1) & 1, 0);
            store_half(kt + 1, (kt + 1) & 1, 1);
            if (kt + 2 < KT) load_w(kt + 2);
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
        __syncthreads();
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }

    // Accumulator (mt, nt): c0, c1 = token g, rows 2t and 2t+1 of the n8 tile; c2, c3 = token g+8.
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int m = m0 + wm0 + 16 * mt + g + 8 * hr;
            if (m >= n) continue;
            float* yr = y + (long long)m * O;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = n0 + wn0 + 8 * nt + 2 * t4;
                const float v0 = acc[mt][nt][2 * hr], v1 = acc[mt][nt][2 * hr + 1];
                if (pair) {
                    if (col < O) *reinterpret_cast<float2*>(yr + col) = make_float2(v0, v1);
                } else {
                    if (col < O) yr[col] = v0;
                    if (col + 1 < O) yr[col + 1] = v1;
                }
            }
        }
    }
}

// 128 tokens × 128 rows a block (warps 2×4 of 64×32). x2: two blocks a multiprocessor (128
// registers a thread, no K split: it spilled with one), for grids of more blocks than
// multiprocessors, which never split; x1: one block a
// multiprocessor without the register cap, faster where each would be alone anyway (chosen in
// ops/src/linear/plan.rs `TqFit`).
#define TQ(NAME, WT, FIT, MINB, SPLIT)                                                             \
    extern "C" __global__ void __launch_bounds__(256, MINB) linear_tq_##NAME##_##FIT(             \
        const unsigned char* W, const float* x, float* y, int n, int K, int O, long long RB,     \
        const __nv_bfloat16* xb, int pair, float* part, int per) {                                \
        PDL_ENTER();                                                                              \
        (void)x;                                                                                  \
        tq_body<WT, 128, 128, 64, 2, 4, SPLIT>(W, xb, y, n, K, O, RB, pair, part, per);           \
    }
// The same 128 weight rows a block over 32 or 64 tokens: a decode step of 2..=64 sequences
// (the lm head: 131,072 Q6_K rows) multiplied 128-token tiles of mostly padding (680 µs at 8
// and at 64 rows on the H200, against 273 µs for one row on the GEMV).
#define TQ_SHORT(NAME, WT, BM, WM, WN)                                                             \
    extern "C" __global__ void __launch_bounds__(256, 2) linear_tq_##NAME##_m##BM(                \
        const unsigned char* W, const float* x, float* y, int n, int K, int O, long long RB,     \
        const __nv_bfloat16* xb, int pair, float* part, int per) {                                \
        PDL_ENTER();                                                                              \
        (void)x;                                                                                  \
        tq_body<WT, BM, 128, 64, WM, WN, true>(W, xb, y, n, K, O, RB, pair, part, per);           \
    }
#define TQ_ALL(NAME, WT) \
    TQ(NAME, WT, x2, 2, false) TQ(NAME, WT, x1, 1, true) TQ_SHORT(NAME, WT, 32, 2, 4) TQ_SHORT(NAME, WT, 64, 2, 4)
TQ_ALL(f16, WT_F16)
TQ_ALL(q8_0, WT_Q8_0)
TQ_ALL(q6_k, WT_Q6_K)
TQ_ALL(iq4_nl, WT_IQ4_NL)
// F32's 32 raw registers a thread do not fit x2's 128 (it spilled): x1 only.
TQ(f32, WT_F32, x1, 1, true)

// ---------------------------------------------------------------------------------------------
// Skinny BF16 products (a batched decode step's 2..=128 rows): y = x·Wᵀ with the weight read
// once for up to 8·NT tokens, on mma.m16n8k16 with the tensor-core path's numerics (x and W as
// bf16, f32 sums). cuBLAS tiles these shapes for prefill: q_a with kv_a (1,344 rows) at 8 rows
// is a handful of tiles on a 132-multiprocessor chip.
//
// x arrives narrowed to bf16 (linear_x_bf16, into the op's scratch). A warp owns 32 weight
// rows (two m16 tiles, the A operand); the block streams its K split through a ring of
// SKB_STAGES cp.async stages in shared memory, a stage one 32-value chunk of every warp's rows
// and of the block's 8·NT x rows (shared by the warps), so three chunks are in flight while
// one is multiplied, with one barrier a chunk. (Staging the block's whole x split up front
// delayed every block's first product by that copy: half the weight's bytes again at 64
// rows.) Both operands reach the MMA by ldmatrix from 64-byte rows, swizzled so that a
// phase's eight rows hit distinct banks (and a fragment needs no register moves: loaded as
// 16-byte words, rows g and g+8 took ~100 moves a chunk at NT = 8 to pair up), k in order as
// in the tensor-core tiles. (The previous form read x as
// f32 from shared memory and narrowed it in every warp, and held the weights in a register
// ring three chunks deep straight from global memory: at 64 rows the attention output took
// 47.5 µs on an H200 against cuBLAS's 17.4, each block's few chunks a few memory latencies in
// a row.)
//
// A matrix of few row tiles (q_a with kv_a: 42) cannot fill the chip with one warp a tile, so K
// is split `splits` ways (linear/plan.rs `Bf16SkinnyPlan`); each warp then writes its partial
// sums to part[split][n][O + O2] and linear_skinny_reduce adds them in split order, so a step
// repeats bit for bit. With splits == 1 the warp writes y itself.
// grid (splits·ceil(tiles / SKB_WARPS), ceil(n / 8NT)), block 32·SKB_WARPS, dynamic shared
// memory SKB_STAGES·(SKB_WARPS·SKB_WSTAGE + 8NT·64) bytes; with O2 > 0 the tiles of W2
// (into y2) follow those of W (one launch for q_a and kv_a). K % 32 == 0, W, W2 and xb 16-byte
// aligned.
#define SKB_WARPS 4
#define SKB_STAGES 4
#define SKB_WSTAGE 2048

template <int NT>
__device__ __forceinline__ void skinny_bf16_body(const unsigned char* __restrict__ W,
                                                 const unsigned char* __restrict__ xb, float* y,
                                                 int n, int K, int O,
                                                 const unsigned char* __restrict__ W2, float* y2,
                                                 int O2, float* part, int splits, int per) {
    constexpr int TOK = 8 * NT;
    // A stage: each warp's 32 weight rows, then the block's TOK x rows, of one chunk.
    constexpr int STAGE = SKB_WARPS * SKB_WSTAGE + TOK * 64;
    extern __shared__ __align__(16) unsigned char skb_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles1 = (O + 31) >> 5, tiles = tiles1 + ((O2 + 31) >> 5);
    const int groups = (tiles + SKB_WARPS - 1) / SKB_WARPS;
    const int split = blockIdx.x / groups;
    const int tile = (blockIdx.x - split * groups) * SKB_WARPS + warp;
    if (split >= splits) return;  // block-uniform
    // A warp past the last tile still copies x and meets the barriers; it multiplies nothing.
    const bool live = tile < tiles;
    const bool second = live && tile >= tiles1;
    const unsigned char* Wm = second ? W2 : W;
    const int Om = second ? O2 : O;
    const int r0 = (second ? tile - tiles1 : tile) * 32;
    const int c0 = split * per, nc = max(0, min(K >> 5, c0 + per) - c0);
    const int tb = blockIdx.y * TOK;
    const long long rb = 2ll * K;

    // Row r's 16-byte word q sits at word q ^ ((r >> 1) & 3) of its 64 bytes, so the eight
    // rows an ldmatrix phase reads (two to a 128-byte line) hit distinct banks. Weight copy j
    // of a lane writes row 8j + g, word t: the same swizzle for every j.
    const unsigned smem0 = (unsigned)__cvta_generic_to_shared(skb_smem);
    const unsigned wdst = smem0 + warp * SKB_WSTAGE + 64 * g + 16 * (t ^ ((g >> 1) & 3));
    const unsigned char* wrow = Wm + (live ? r0 + g : 0) * rb + 64ll * c0 + 16 * t;
    unsigned wok = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) wok |= (live && r0 + g + 8 * j < Om) ? 1u << j : 0u;
    auto issue_w = [&](int c, int stage) {
        if (live && c < nc) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                tq_cp16(wdst + stage * STAGE + 512 * j,
                        (wok >> j & 1u) ? wrow + j * 8 * rb + 64ll * c : Wm, (wok >> j & 1u) ? 16 : 0);
        }
    };
    // x of chunk c: item i (< 4·TOK) copies word i % 4 of token i / 4 (four consecutive
    // threads read a token's 64 contiguous bytes); tokens past n as zeros.
    const unsigned xdst = smem0 + SKB_WARPS * SKB_WSTAGE;
    auto issue_x = [&](int c, int stage) {
        if (c < nc) {
            for (int i = threadIdx.x; i < 4 * TOK; i += 32 * SKB_WARPS) {
                const int q = i & 3, tok = i >> 2;
                const bool ok = tb + tok < n;
                const unsigned char* src =
                    ok ? xb + ((long long)(tb + tok) * K + 32ll * (c0 + c)) * 2 + 16 * q : xb;
                tq_cp16(xdst + stage * STAGE + 64 * tok + 16 * (q ^ ((tok >> 1) & 3)), src, ok ? 16 : 0);
            }
        }
    };
    // The weights of the first stages before the wait (they do not depend on the
    // predecessor), x after it; one group a stage either way.
#pragma unroll
    for (int s = 0; s < SKB_STAGES - 1; ++s) issue_w(s, s);
    PDL_WAIT();
#pragma unroll
    for (int s = 0; s < SKB_STAGES - 1; ++s) {
        issue_x(s, s);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }

    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    // ldmatrix rows of this lane: A (weights) row l % 16 of an m16 tile, at word
    // 2·step + l / 16 of the chunk (x4: rows 0-7 and 8-15 at k 0, then at k 8); B (x) token
    // l % 8 of an n8 tile at word l / 8 (x4: k 0, 8, 16, 24, i.e. b0 b1 of both k16 steps).
    const int ar = lane & 15, bt = lane & 7;
    const unsigned wsm = smem0 + warp * SKB_WSTAGE + 64 * ar;
    const unsigned aw0 = 16 * ((0 + (lane >> 4)) ^ ((ar >> 1) & 3));
    const unsigned aw1 = 16 * ((2 + (lane >> 4)) ^ ((ar >> 1) & 3));
    const unsigned xsm = xdst + 64 * bt + 16 * ((lane >> 3) ^ ((bt >> 1) & 3));
    for (int c = 0; c < nc; ++c) {
        // Stage c landed for every thread (the SKB_STAGES - 2 groups after it may still be
        // in flight), and every warp is done with stage c - 1, whose slot takes chunk
        // c + SKB_STAGES - 1.
        asm volatile("cp.async.wait_group %0;" ::"n"(SKB_STAGES - 2) : "memory");
        __syncthreads();
        const int nxt = c + SKB_STAGES - 1, slot = nxt % SKB_STAGES;
        issue_w(nxt, slot);
        issue_x(nxt, slot);
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (!live) continue;
        const unsigned st = (c % SKB_STAGES) * STAGE;
        unsigned a[2][2][4];  // [m tile][k16 step]
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            tq_ldsm4(a[mt][0], wsm + st + mt * 16 * 64 + aw0);
            tq_ldsm4(a[mt][1], wsm + st + mt * 16 * 64 + aw1);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (tb + 8 * nt < n) {  // warp-uniform
                unsigned b[4];
                tq_ldsm4(b, xsm + st + nt * 8 * 64);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    tq_mma(acc[mt][nt], a[mt][0], b[0], b[1]);
                    tq_mma(acc[mt][nt], a[mt][1], b[2], b[3]);
                }
            }
        }
    }
    if (!live) return;

    // Accumulator (mt, nt): c0, c1 = row 16mt + g, tokens 8nt + 2t and +1; c2, c3 = row + 8.
    const int ot = O + O2, col0 = second ? O : 0;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + 16 * mt + g + 8 * (i >> 1), tok = tb + 8 * nt + 2 * t + (i & 1);
                if (r >= Om || tok >= n) continue;
                if (splits == 1)
                    (second ? y2 : y)[(long long)tok * Om + r] = acc[mt][nt][i];
                else
                    part[((long long)split * n + tok) * ot + col0 + r] = acc[mt][nt][i];
            }
}

#define LINEAR_SKINNY_BF16(NT)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * SKB_WARPS, 2) linear_skinny_bf16_##NT(      \
        const unsigned char* __restrict__ W, const unsigned char* __restrict__ xb, float* y,      \
        int n, int K, int O, const unsigned char* __restrict__ W2, float* y2, int O2,             \
        float* part, int splits, int per) {                                                       \
        PDL_WEIGHTS_FIRST();                                                                      \
        skinny_bf16_body<NT>(W, xb, y, n, K, O, W2, y2, O2, part, splits, per);                   \
    }
LINEAR_SKINNY_BF16(1)
LINEAR_SKINNY_BF16(2)
LINEAR_SKINNY_BF16(4)
LINEAR_SKINNY_BF16(8)
#undef LINEAR_SKINNY_BF16

// y (and y2 past column O) = Σ_split part[split], in split order. One thread an output; a
// batch of SKB_RED partials is loaded before any is added, so a thread waits on L2 once a
// batch rather than once a split.
#define SKB_RED 8
extern "C" __global__ void __launch_bounds__(256)
    linear_skinny_reduce(const float* part, float* y, float* y2, int n, int O, int O2, int splits) {
    PDL_ENTER();
    const int ot = O + O2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, all = (long long)n * ot;
    if (i >= all) return;
    float v = part[i];
    for (int s0 = 1; s0 < splits; s0 += SKB_RED) {
        float b[SKB_RED];
#pragma unroll
        for (int u = 0; u < SKB_RED; ++u) b[u] = s0 + u < splits ? part[(s0 + u) * all + i] : 0.0f;
#pragma unroll
        for (int u = 0; u < SKB_RED; ++u)
            if (s0 + u < splits) v += b[u];
    }
    const int tok = (int)(i / ot), col = (int)(i - (long long)tok * ot);
    if (col < O)
        y[(long long)tok * O + col] = v;
    else
        y2[(long long)tok * O2 + col - O] = v;
}

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
