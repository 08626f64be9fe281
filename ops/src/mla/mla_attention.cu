// ---- MlaAttention: split-K flash decoding over the shared latent rows --------------------
//
// Block (chunk, token, head group of 32), 8 warps. Rows 0..=pos are split into n_chunks chunks
// (whole T-row tiles) at run time from the position, so a fixed grid serves every position of
// the bucket; chunks past the position exit. Tiles of T rows stream through NBUF shared-memory
// buffers (cp.async, zero-filled past the chunk's rows and past W).
//
// MODE 0 and 1: both products run on the tensor cores with split operands: x = big + small,
// big = tf32(x), and a·b ≈ a_big·b_big + (a_big·b_small + a_small·b_big), f32 accumulators.
// The corrections are two more TF32 mma (MODE 0, 3xTF32, ~2^-21 of each product) or one bf16
// m16n8k16 mma over (x, small) pairs (MODE 1, the `_bf` kernels, ~2^-20): f32-class either
// way. mma.sync TF32 runs at ~1/4 of an SM's wgmma rate on the H200 (measured: ~0.25 m16n8k8
// a clock an SM), so the instruction count is what those kernels' time follows.
//
// MODE 3 (the `_hc` kernels): MODE 2 over an F16 cache. The rows are staged as they are stored
// (ATT_WSH = 584 halves a row), so a tile is half the bytes; the values are the ones MODE 2
// narrows to on read (the cache holds them rounded and saturated the same way). Score pairs are
// one 4-byte load (words 4g + tq: distinct banks); a value lane's four columns one 8-byte load,
// two rows' halves paired by a byte permute.
//
// MODE 2 (the `_h` kernels): f16 operands, one m16n8k16 mma for two of the k8 steps above,
// f32 accumulators: the numerics of the prefill flash kernel (mla_prefill.cu), a quarter of
// MODE 1's tensor instructions and no operand splitting. Q is narrowed once, times kq_scale
// (the scores come out scaled, and Q's f16 range is kept by the small scale); keys, the
// softmax weights and the values are rounded to f16 as they are read. A k16 pair of k-steps
// (k, k+1) puts step k's k-pair in fragment register group 0 and step k+1's in group 1, on the
// A and the B side alike, so the sums run over the same elements as the k8 steps'.
//
// Scores, S^T[row][head] = K·Q^T: warp w owns the query dims [72w, 72w+72) (9 k-steps of 8),
// all T rows and 32 heads; its slice of Q lives in registers for the whole block. The k index
// t of a step is dim 2t and t+4 is dim 2t+1, so each A fragment half is one 8-byte load. The
// 8 warps' partials go through shared memory and are summed in warp order by warps 0..3
// (warp = head octet), which also run the online softmax in f32: one lane holds 2 heads x
// 2·(T/16) rows, the head's tile max is an xor-shuffle over the 8 lanes sharing its heads.
// Weights go to shared memory pre-split, in the A-fragment order of the value product.
//
// Values, O[head][col] += P·V: warp w owns columns [64w, 64w+64), both 16-head halves, all
// rows (T/8 k-steps). The n index g of its n-tile j within 32-column group G is column
// 64w + 32G + 4g + j, so one 16-byte load feeds 4 n-tiles; O stays in 64 registers a lane.
//
// Row stride ATT_WS = 8 (mod 32) floats: the score loads (lanes g x t: rows x 8-byte pairs)
// and the value loads (lanes t x g: rows x 16-byte quads) both hit distinct banks.
// W <= 576 and kv_lora <= 512, both multiples of 4; columns past W read as zero.

#define ATT_W 576
#define ATT_WS 584
#define ATT_WSH 584
#define ATT_LORA 512

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Bulk row copies (sm_90): one instruction a staged row, completion counted in bytes on an
// mbarrier a buffer, instead of 16-byte cp.async chunks whose addresses every thread works out
// (~40 instructions a chunk, nine chunks a thread a 32-row tile, on the path from the barrier
// to the tile's first product).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ATT_BULK 1
#else
#define ATT_BULK 0
#endif
__device__ __forceinline__ unsigned att_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void att_mbar_init(unsigned long long* bar) {
#if ATT_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(att_smem_addr(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Arms `bar`'s phase for `bytes` and arrives: the phase completes once they have landed.
__device__ __forceinline__ void att_mbar_expect(unsigned long long* bar, unsigned bytes) {
#if ATT_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(att_smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
#endif
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) from global `src` to shared `dst`,
// counted on `bar`. The fence orders this thread's earlier generic writes to `dst` before the
// copy's: only a chunk's last tile zeroes rows and nothing is staged after it, so today it is
// a safeguard for a ring that would outlive a chunk.
__device__ __forceinline__ void att_bulk_row(void* dst, const void* src, unsigned bytes,
                                             unsigned long long* bar) {
#if ATT_BULK
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            att_smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(att_smem_addr(bar))
        : "memory");
#endif
}
__device__ __forceinline__ void att_mbar_wait(unsigned long long* bar, unsigned parity) {
#if ATT_BULK
    asm volatile(
        "{\n .reg .pred done;\n ATT_WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra ATT_WAIT_%=;\n}" ::"r"(att_smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}

// cvt.rna.tf32.f32; VOLATILE for a value that does not change over the tile loop (Q), so the
// compiler cannot hoist its split out of the loop and hold 144 registers of Q instead of 72.
template <bool VOLATILE>
__device__ __forceinline__ unsigned tf32_rna(float x) {
    unsigned r;
    if (VOLATILE)
        asm volatile("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    else
        asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
// Two f32 as bf16x2: `hi` in the upper half, `lo` in the lower.
template <bool VOLATILE>
__device__ __forceinline__ unsigned pack_bf16x2(float hi, float lo) {
    unsigned r;
    if (VOLATILE)
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// An operand of a product split for the tensor cores: big = tf32(x), and x - big is exact
// (Sterbenz), so big + small carries 22 of x's 24 significant bits. `corr` feeds the two
// correction products a_big·b_small + a_small·b_big: with BF16 false it is tf32(small) for
// two more TF32 mma; with BF16 true it is a bf16 pair for ONE m16n8k16 bf16 mma whose k-pair
// (2t, 2t+1) stands for the same element: the A side packs (x, small), the B side
// (small, x), so the halves meet as x·small_b + small_a·x. bf16 keeps f32's exponent range;
// its 8 bits on terms 2^-11 of the product leave ~2^-20 of it.
template <bool BF16, bool B_SIDE, bool VOLATILE>
__device__ __forceinline__ void split_op(float x, unsigned& big, unsigned& corr) {
    big = tf32_rna<VOLATILE>(x);
    const float small = x - __uint_as_float(big);
    if (!BF16)
        corr = tf32_rna<VOLATILE>(small);
    else if (B_SIDE)
        corr = pack_bf16x2<VOLATILE>(small, x);
    else
        corr = pack_bf16x2<VOLATILE>(x, small);
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The m16n8k16 bf16 fragments line up with m16n8k8 tf32's: A register r holds k-pair t of
// k-group r>>1 where tf32 has k t (+4 for r>=2), B register r k-group r; C is the same.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Rows per chunk for `nrows` valid rows over `n_chunks` chunks (whole tiles of `tile`).
__device__ __forceinline__ int att_rows_per_chunk(int nrows, int n_chunks, int tile) {
    const int per = (nrows + n_chunks - 1) / n_chunks;
    return (per + tile - 1) / tile * tile;
}

// The pool row of position r of a sequence whose block table is `tbl` (blocks of
// 1 << bshift positions).
__device__ __forceinline__ long long att_pool_row(const int* __restrict__ tbl, int r, int bshift) {
    return ((long long)tbl[r >> bshift] << bshift) | (r & ((1 << bshift) - 1));
}

// att_pack_f16 (narrowing an f32 pair to f16) is in mla.cu, which the cache writers share.
__device__ __forceinline__ void mma_f16_k16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                            unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16_k8(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

template <int T, int NBUF, int MODE>
__device__ __forceinline__ void attn_split(const float* __restrict__ q,
                                           const void* __restrict__ cache_v,
                                           const int* __restrict__ positions,
                                           const int* __restrict__ block_table,
                                           const int* __restrict__ row_seq, int table_width,
                                           int bshift, float* __restrict__ out,
                                           float* __restrict__ part_o,
                                           float* __restrict__ part_ml, int n_head, int w,
                                           int lora, int ctx, int n_chunks, float kq_scale) {
    constexpr int MT = T / 16;  // m16 row tiles of the score product
    constexpr int KS = T / 8;   // k8 row steps of the value product
    extern __shared__ float4 att_smem4[];
    // MODE 3 stages f16 rows: a buffer is T rows of ATT_WSH halves.
    constexpr bool CACHE_H = MODE == 3;
    constexpr int ROW_BYTES = CACHE_H ? ATT_WSH * 2 : ATT_WS * 4;
    float* kbuf = reinterpret_cast<float*>(att_smem4);           // [NBUF][T][ATT_WS]
    unsigned short* kbh = reinterpret_cast<unsigned short*>(att_smem4);  // [NBUF][T][ATT_WSH]
    // The score partials: [2 halves][8 warps][MT*4][32 lanes] float2, half i holding a lane's
    // accumulators i and 2+i (its head 8nt+2tq+i at rows g and g+8), so the softmax warp of
    // half i reads 8 bytes a lane (two wavefronts, no bank conflict).
    float4* sp = att_smem4 + NBUF * T * ROW_BYTES / 16;
    float2* sp2 = reinterpret_cast<float2*>(sp);
    const float* cache = reinterpret_cast<const float*>(cache_v);
    const unsigned short* cache_h = reinterpret_cast<const unsigned short*>(cache_v);
    float4* pbig = sp + 8 * MT * 4 * 32;                         // [KS][2][32] A fragments
    float4* psmall = pbig + KS * 2 * 32;                         // [KS][2][32] corrections
    float* corr_s = reinterpret_cast<float*>(psmall + KS * 2 * 32);  // [32]
    float* m_s = corr_s + 32;                                    // [32]
    float* l_s = m_s + 32;                                       // [32]

    const int chunk = blockIdx.x, t = blockIdx.y, hg = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int pos = positions[t];
    const int nrows = pos < 0 ? 0 : min(pos, ctx - 1) + 1;
    const int per = att_rows_per_chunk(nrows, n_chunks, T);
    const int r0 = chunk * per, r1 = min(r0 + per, nrows);
    const int* tbl = block_table + (long long)row_seq[t] * table_width;
    if (r0 >= r1) {
        // Only a position outside the cache leaves the single chunk empty: write zeros.
        if (n_chunks == 1)
            for (int idx = tid; idx < 32 * lora; idx += blockDim.x) {
                const int h = hg * 32 + idx / lora;
                if (h < n_head) out[((long long)t * n_head + h) * lora + idx % lora] = 0.0f;
            }
        return;
    }

    const int ntiles = (r1 - r0 + T - 1) / T;
    // MODE 3 on sm_90: a tile's rows are staged by bulk copies, a row each, counted on the
    // buffer's mbarrier (phase parity (tile / NBUF) & 1); rows past the chunk are zeroed
    // instead (a weight of 0 times stale bits could be NaN), and so, once, are the columns
    // past w.
    constexpr bool BULK = CACHE_H && ATT_BULK;
    __shared__ unsigned long long att_mbar[BULK ? NBUF : 1];
    if (BULK) {
        if (tid < NBUF) att_mbar_init(&att_mbar[tid]);
        if (w < ATT_W)
            for (int i = tid; i < NBUF * T * (ATT_W - w) / 8; i += blockDim.x) {
                const int row = i / ((ATT_W - w) / 8), c = i - row * ((ATT_W - w) / 8);
                *reinterpret_cast<uint4*>(kbh + row * ATT_WSH + w + 8 * c) = make_uint4(0, 0, 0, 0);
            }
        __syncthreads();
    }
    // One commit group per call, empty past the last tile, so the wait counts stay fixed.
    // Thread tid copies 16-byte chunks tid, tid+256, ... of the tile's T x CPR; (j, c) is
    // stepped rather than divided, and the loop kept rolled, so no per-chunk addresses stay
    // live across the tile loop.
    // 16-byte chunks a row: 144 of f32, 72 of f16.
    constexpr int CPR = CACHE_H ? ATT_W / 8 : ATT_W / 4;
    const int wc = CACHE_H ? w >> 3 : w >> 2;
    const int cj0 = tid / CPR, cc0 = tid - cj0 * CPR;
    auto issue = [&](int it) {
        if (BULK) {
            // Each warp stages T/8 rows: a bulk copy takes uniform operands, so a warp issues
            // its lanes' copies one after another. The tile's bytes are armed by thread 0; a
            // copy landing first leaves the count below zero for a while, which the mbarrier
            // allows (its phase waits for thread 0's arrival too).
            if (it >= ntiles) return;
            const int jr = r0 + it * T, valid = min(T, r1 - jr), b = it % NBUF;
            unsigned short* dsth = kbh + b * T * ATT_WSH;
            if (tid == 0) att_mbar_expect(&att_mbar[b], (unsigned)(valid * w * 2));
            constexpr int RPW = T / 8;
            const int j = warp * RPW + lane;
            if (lane < RPW && j < valid) {
                const long long row = att_pool_row(tbl, jr + j, bshift);
                att_bulk_row(dsth + j * ATT_WSH, cache_h + row * w, (unsigned)(w * 2), &att_mbar[b]);
            } else if (lane < RPW) {
                uint4* d = reinterpret_cast<uint4*>(dsth + j * ATT_WSH);
#pragma unroll 1
                for (int k = 0; k < ATT_W / 8; ++k) d[k] = make_uint4(0, 0, 0, 0);
            }
            return;
        }
        if (it < ntiles) {
            const int jr = r0 + it * T;
            float* dst = kbuf + (it % NBUF) * T * ATT_WS;
            unsigned short* dsth = kbh + (it % NBUF) * T * ATT_WSH;
            // A tile starts at a multiple of T; when a block holds whole tiles (the engine's
            // 64 positions), the tile is one run of pool rows: one table read for all of it.
            const bool one_run = (1 << bshift) >= T;
            const long long run0 = one_run ? att_pool_row(tbl, jr, bshift) : 0;
            int j = cj0, c = cc0;
#pragma unroll 1
            for (int k = 0; k < (T * CPR + 255) / 256; ++k) {
                // T·72 is not a multiple of 256 at T = 16: the last round's tail is past T.
                if (j < T) {
                    const bool v = jr + j < r1 && c < wc;
                    // Rows past the chunk are not looked up: their table entries may not exist.
                    const long long row =
                        !v ? 0 : (one_run ? run0 + j : att_pool_row(tbl, jr + j, bshift));
                    if (CACHE_H) {
                        const unsigned short* src = v ? cache_h + row * w + 8 * c : cache_h;
                        cp_async16_zfill(dsth + j * ATT_WSH + 8 * c, src, v ? 16 : 0);
                    } else {
                        const float* src = v ? cache + row * w + 4 * c : cache;
                        cp_async16_zfill(dst + j * ATT_WS + 4 * c, src, v ? 16 : 0);
                    }
                }
                j += 256 / CPR;
                c += 256 % CPR;
                if (c >= CPR) {
                    c -= CPR;
                    ++j;
                }
            }
        }
        cp_async_commit();
    };
    // The first 32 rows go out alone, so they are not queued behind the rest of the ring
    // (every block starts at once); the other buffers fill once tile 0 has landed.
    constexpr int PRE = 32 / T;
#pragma unroll
    for (int s = 0; s < PRE; ++s) issue(s);

    // This lane's B fragments of Q: head 8nt+g, dims 72·warp + 8k + 2tq + {0, 1} (MODE 2:
    // one f16 pair of Q·kq_scale, qr unused).
    constexpr bool BF16 = MODE == 1;
    constexpr bool HALF = MODE >= 2;
    float qr[4][9][2];
    unsigned qh2[4][9];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const int h = hg * 32 + 8 * nt + g;
        const bool hv = h < n_head;
        const float* qh = q + ((long long)t * n_head + (hv ? h : 0)) * w;
#pragma unroll
        for (int k = 0; k < 9; ++k) {
            const int d = warp * 72 + 8 * k + 2 * tq;
            float2 v = make_float2(0.0f, 0.0f);
            if (hv && d < w) v = *reinterpret_cast<const float2*>(qh + d);
            if (HALF) {
                qh2[nt][k] = att_pack_f16(v.x * kq_scale, v.y * kq_scale);
            } else {
                qr[nt][k][0] = v.x;
                qr[nt][k][1] = v.y;
            }
        }
    }

    // Softmax state of warp w: head 8·(w&3) + 2tq + (w>>2) (all eight warps run the softmax,
    // each over one of a lane's two heads: half the sums and exponentials of four warps
    // doing both, on the path between every tile's products).
    const int sm_nt = warp & 3, sm_i = warp >> 2;
    float m_run = NEG_INF, l_run = 0.0f;
    // o[mt][G][j][c]: head 16mt + g + 8(c>>1), column 64·warp + 32G + 8tq + 4(c&1) + j.
    float o[2][2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) o[a][b][j][c] = 0.0f;
    const bool pv_warp = 64 * warp < lora;

    // The value product of tile `tile`: its weights and the corrections are in pbig and
    // corr_s (the softmax pass of that tile wrote them).
    auto pv = [&](int tile) {
        const float* kt = kbuf + (tile % NBUF) * T * ATT_WS;
        const unsigned short* kth = kbh + (tile % NBUF) * T * ATT_WSH;
        if (pv_warp) {
            float cr[2][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) cr[mt][r] = corr_s[16 * mt + g + 8 * r];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int G = 0; G < 2; ++G)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) o[mt][G][j][c] *= cr[mt][c >> 1];
            if (HALF) {
                // Steps (2j, 2j+1) as one k16 mma: step 2j's TF32 fragment registers (k tq,
                // k tq+4) become group 0's f16 pair, step 2j+1's group 1's.
#pragma unroll
                for (int j = 0; j < KS / 2; ++j) {
                    unsigned a[2][4];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        const float4 p0 = pbig[(2 * j * 2 + mt) * 32 + lane];
                        const float4 p1 = pbig[((2 * j + 1) * 2 + mt) * 32 + lane];
                        a[mt][0] = att_pack_f16(p0.x, p0.z);
                        a[mt][1] = att_pack_f16(p0.y, p0.w);
                        a[mt][2] = att_pack_f16(p1.x, p1.z);
                        a[mt][3] = att_pack_f16(p1.y, p1.w);
                    }
#pragma unroll
                    for (int G = 0; G < 2; ++G) {
                        unsigned b0[4], b1[4];
                        if (CACHE_H) {
                            // Four columns of a row in one 8-byte load; rows r and r+4 paired.
                            const unsigned short* vp =
                                kth + (16 * j + tq) * ATT_WSH + 64 * warp + 32 * G + 4 * g;
                            const uint2 v0 = *reinterpret_cast<const uint2*>(vp);
                            const uint2 v1 = *reinterpret_cast<const uint2*>(vp + 4 * ATT_WSH);
                            const uint2 v2 = *reinterpret_cast<const uint2*>(vp + 8 * ATT_WSH);
                            const uint2 v3 = *reinterpret_cast<const uint2*>(vp + 12 * ATT_WSH);
                            b0[0] = __byte_perm(v0.x, v1.x, 0x5410);
                            b0[1] = __byte_perm(v0.x, v1.x, 0x7632);
                            b0[2] = __byte_perm(v0.y, v1.y, 0x5410);
                            b0[3] = __byte_perm(v0.y, v1.y, 0x7632);
                            b1[0] = __byte_perm(v2.x, v3.x, 0x5410);
                            b1[1] = __byte_perm(v2.x, v3.x, 0x7632);
                            b1[2] = __byte_perm(v2.y, v3.y, 0x5410);
                            b1[3] = __byte_perm(v2.y, v3.y, 0x7632);
                        } else {
                            const float* vp = kt + (16 * j + tq) * ATT_WS + 64 * warp + 32 * G + 4 * g;
                            const float4 v0 = *reinterpret_cast<const float4*>(vp);
                            const float4 v1 = *reinterpret_cast<const float4*>(vp + 4 * ATT_WS);
                            const float4 v2 = *reinterpret_cast<const float4*>(vp + 8 * ATT_WS);
                            const float4 v3 = *reinterpret_cast<const float4*>(vp + 12 * ATT_WS);
                            b0[0] = att_pack_f16(v0.x, v1.x);
                            b0[1] = att_pack_f16(v0.y, v1.y);
                            b0[2] = att_pack_f16(v0.z, v1.z);
                            b0[3] = att_pack_f16(v0.w, v1.w);
                            b1[0] = att_pack_f16(v2.x, v3.x);
                            b1[1] = att_pack_f16(v2.y, v3.y);
                            b1[2] = att_pack_f16(v2.z, v3.z);
                            b1[3] = att_pack_f16(v2.w, v3.w);
                        }
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                            for (int mt = 0; mt < 2; ++mt)
                                mma_f16_k16(o[mt][G][jj], a[mt], b0[jj], b1[jj]);
                    }
                }
            } else
#pragma unroll
            for (int k = 0; k < KS; ++k) {
                unsigned ab[2][4], as[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const float4 b4 = pbig[(k * 2 + mt) * 32 + lane];
                    const float4 s4 = psmall[(k * 2 + mt) * 32 + lane];
                    ab[mt][0] = __float_as_uint(b4.x);
                    ab[mt][1] = __float_as_uint(b4.y);
                    ab[mt][2] = __float_as_uint(b4.z);
                    ab[mt][3] = __float_as_uint(b4.w);
                    as[mt][0] = __float_as_uint(s4.x);
                    as[mt][1] = __float_as_uint(s4.y);
                    as[mt][2] = __float_as_uint(s4.z);
                    as[mt][3] = __float_as_uint(s4.w);
                }
#pragma unroll
                for (int G = 0; G < 2; ++G) {
                    const float* vp = kt + (8 * k + tq) * ATT_WS + 64 * warp + 32 * G + 4 * g;
                    const float4 v0 = *reinterpret_cast<const float4*>(vp);
                    const float4 v1 = *reinterpret_cast<const float4*>(vp + 4 * ATT_WS);
                    const float x0[4] = {v0.x, v0.y, v0.z, v0.w};
                    const float x1[4] = {v1.x, v1.y, v1.z, v1.w};
                    unsigned bb[4][2], bs[4][2];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        split_op<BF16, true, false>(x0[j], bb[j][0], bs[j][0]);
                        split_op<BF16, true, false>(x1[j], bb[j][1], bs[j][1]);
                    }
                    if (BF16) {
#pragma unroll
                        for (int j = 0; j < 4; ++j)
#pragma unroll
                            for (int mt = 0; mt < 2; ++mt)
                                mma_bf16(o[mt][G][j], as[mt], bs[j][0], bs[j][1]);
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; ++j)
#pragma unroll
                            for (int mt = 0; mt < 2; ++mt)
                                mma_tf32(o[mt][G][j], as[mt], bb[j][0], bb[j][1]);
#pragma unroll
                        for (int j = 0; j < 4; ++j)
#pragma unroll
                            for (int mt = 0; mt < 2; ++mt)
                                mma_tf32(o[mt][G][j], ab[mt], bs[j][0], bs[j][1]);
                    }
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt)
                            mma_tf32(o[mt][G][j], ab[mt], bb[j][0], bb[j][1]);
                }
            }
        }
    };

    // Pipelined (bulk copies): tile it-1's value product runs in the same phase as tile it's
    // scores, two barriers a tile instead of three (scores | softmax | values), and tile
    // it+NBUF-1 is staged once tile it-1's values are done (after the scores' barrier), so
    // the ring holds one tile fewer in flight than NBUF.
    constexpr bool PIPE = BULK;
    // The rows a bulk issue zeroed are plain stores: visible to the other warps after a barrier.
    if (PIPE) __syncthreads();
    for (int it = 0; it < ntiles; ++it) {
        // Bulk: tile `it` is phase it / NBUF of its buffer's mbarrier. Otherwise groups are
        // committed in tile order: PRE, then NBUF - PRE at it = 0, then one an iteration, so
        // tile `it` is done when at most these many are pending.
        if (BULK)
            att_mbar_wait(&att_mbar[it % NBUF], (unsigned)((it / NBUF) & 1));
        else if (it == 0)
            cp_async_wait<PRE - 1>();
        else
            cp_async_wait<NBUF - 2>();
        if (!PIPE) {
            // Tile `it` is visible and every warp is done with tile it-1: its buffer, the
            // weights and the corrections may be overwritten.
            __syncthreads();
            if (it == 0) {
#pragma unroll
                for (int s = PRE; s < NBUF; ++s) issue(s);
            } else {
                issue(it + NBUF - 1);
            }
        } else if (it == 0) {
            // Buffers no tile has used yet; the last one is staged after the scores' barrier.
#pragma unroll
            for (int s = PRE; s < NBUF - 1; ++s) issue(s);
        }
        const float* kt = kbuf + (it % NBUF) * T * ATT_WS;
        const unsigned short* kth = kbh + (it % NBUF) * T * ATT_WSH;
        const int jn = min(T, r1 - (r0 + it * T));
        // The previous tile's values, while its weights are still in pbig (the softmax pass
        // of this tile writes them after the next barrier).
        if (PIPE && it > 0) pv(it - 1);

        {
            float sacc[MT][4][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) sacc[mt][nt][c] = 0.0f;
            if (HALF) {
                // Steps (2j, 2j+1) as one k16 mma, step 8 as a k8 one.
#pragma unroll
                for (int j = 0; j < 5; ++j) {
                    unsigned a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                        for (int s2 = 0; s2 < 2; ++s2) {
                            if (j == 4 && s2 == 1) continue;
                            const int d = warp * 72 + 8 * (2 * j + s2) + 2 * tq;
                            if (CACHE_H) {
                                a[mt][2 * s2] = *reinterpret_cast<const unsigned*>(
                                    kth + (16 * mt + g) * ATT_WSH + d);
                                a[mt][2 * s2 + 1] = *reinterpret_cast<const unsigned*>(
                                    kth + (16 * mt + g + 8) * ATT_WSH + d);
                                continue;
                            }
                            const float2 lo = *reinterpret_cast<const float2*>(kt + (16 * mt + g) * ATT_WS + d);
                            const float2 hi =
                                *reinterpret_cast<const float2*>(kt + (16 * mt + g + 8) * ATT_WS + d);
                            a[mt][2 * s2] = att_pack_f16(lo.x, lo.y);
                            a[mt][2 * s2 + 1] = att_pack_f16(hi.x, hi.y);
                        }
                    }
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            if (j < 4)
                                mma_f16_k16(sacc[mt][nt], a[mt], qh2[nt][2 * j], qh2[nt][2 * j + 1]);
                            else
                                mma_f16_k8(sacc[mt][nt], a[mt][0], a[mt][1], qh2[nt][8]);
                        }
                }
            } else
#pragma unroll
            for (int k = 0; k < 9; ++k) {
                const int d = warp * 72 + 8 * k + 2 * tq;
                unsigned ab[MT][4], as[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const float2 lo = *reinterpret_cast<const float2*>(kt + (16 * mt + g) * ATT_WS + d);
                    const float2 hi =
                        *reinterpret_cast<const float2*>(kt + (16 * mt + g + 8) * ATT_WS + d);
                    split_op<BF16, false, false>(lo.x, ab[mt][0], as[mt][0]);
                    split_op<BF16, false, false>(hi.x, ab[mt][1], as[mt][1]);
                    split_op<BF16, false, false>(lo.y, ab[mt][2], as[mt][2]);
                    split_op<BF16, false, false>(hi.y, ab[mt][3], as[mt][3]);
                }
                unsigned bb[4][2], bs[4][2];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    split_op<BF16, true, true>(qr[nt][k][0], bb[nt][0], bs[nt][0]);
                    split_op<BF16, true, true>(qr[nt][k][1], bb[nt][1], bs[nt][1]);
                }
                if (BF16) {
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
                            mma_bf16(sacc[mt][nt], as[mt], bs[nt][0], bs[nt][1]);
                } else {
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
                            mma_tf32(sacc[mt][nt], as[mt], bb[nt][0], bb[nt][1]);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
                            mma_tf32(sacc[mt][nt], ab[mt], bs[nt][0], bs[nt][1]);
                }
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma_tf32(sacc[mt][nt], ab[mt], bb[nt][0], bb[nt][1]);
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        sp2[((i * 8 + warp) * MT * 4 + mt * 4 + nt) * 32 + lane] =
                            make_float2(sacc[mt][nt][i], sacc[mt][nt][2 + i]);
        }
        __syncthreads();
        // Every warp is done with tile it-1 (its values above): its buffer takes tile
        // it+NBUF-1.
        if (PIPE) issue(it + NBUF - 1);

        {
            // Lane (g, tq): s[mt][r] is row 16mt+g+8r, head hh = 8nt+2tq+i (nt, i: this
            // warp's), the 8 warps' partials summed in warp order.
            const int nt = sm_nt, i = sm_i;
            float s[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float2 v = sp2[((i * 8) * MT * 4 + mt * 4 + nt) * 32 + lane];
#pragma unroll
                for (int k = 1; k < 8; ++k) {
                    const float2 u = sp2[((i * 8 + k) * MT * 4 + mt * 4 + nt) * 32 + lane];
                    v.x += u.x;
                    v.y += u.y;
                }
                s[mt][0] = v.x;
                s[mt][1] = v.y;
            }
            {
                const int hh = 8 * nt + 2 * tq + i;
                float sc[MT][2];
                float tmax = NEG_INF;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = 16 * mt + g + 8 * r;
                        sc[mt][r] = row < jn ? (HALF ? s[mt][r] : kq_scale * s[mt][r]) : NEG_INF;
                        tmax = fmaxf(tmax, sc[mt][r]);
                    }
#pragma unroll
                for (int off = 4; off < 32; off <<= 1)
                    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
                const float m_new = fmaxf(m_run, tmax);
                const float corr = expf(m_run - m_new);
                float psum = 0.0f;
                // The value product's A fragment: head hh is row (hh&7) + 8((hh>>3)&1) of
                // m-tile hh>>4; tile row `row` is k index (row&3) + 4((row>>2)&1) of step row>>3.
                const int hbase = (hh >> 4) * 32 * 4 + (hh & 7) * 16 + ((hh >> 3) & 1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = 16 * mt + g + 8 * r;
                        const float p = row < jn ? expf(sc[mt][r] - m_new) : 0.0f;
                        psum += p;
                        const int idx = (row >> 3) * 2 * 32 * 4 + hbase + (row & 3) * 4 +
                                        2 * ((row >> 2) & 1);
                        if (HALF) {
                            // The f32 weight, in the TF32 fragment order; narrowed when read.
                            reinterpret_cast<float*>(pbig)[idx] = p;
                        } else {
                            unsigned pb, ps;
                            split_op<BF16, false, false>(p, pb, ps);
                            reinterpret_cast<float*>(pbig)[idx] = __uint_as_float(pb);
                            reinterpret_cast<float*>(psmall)[idx] = __uint_as_float(ps);
                        }
                    }
                l_run = l_run * corr + psum;
                m_run = m_new;
                if (g == 0) corr_s[hh] = corr;
            }
        }
        __syncthreads();
        if (!PIPE) pv(it);
    }
    if (PIPE) pv(ntiles - 1);

    {
        float l = l_run;
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        if (g == 0) {
            const int hh = 8 * sm_nt + 2 * tq + sm_i;
            m_s[hh] = m_run;
            l_s[hh] = l;
        }
    }
    __syncthreads();
    if (!pv_warp) return;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int hh = 16 * mt + g + 8 * r;
            const int h = hg * 32 + hh;
            if (h >= n_head) continue;
            const float inv = 1.0f / l_s[hh];
            const long long slot = ((long long)t * n_chunks + chunk) * n_head + h;
            float* dst = n_chunks == 1 ? out + ((long long)t * n_head + h) * lora
                                       : part_o + slot * lora;
            const float f = n_chunks == 1 ? inv : 1.0f;
#pragma unroll
            for (int G = 0; G < 2; ++G)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int col = 64 * warp + 32 * G + 8 * tq + 4 * hf;
                    const int c = 2 * r + hf;
                    if (col < lora)
                        *reinterpret_cast<float4*>(dst + col) =
                            make_float4(o[mt][G][0][c] * f, o[mt][G][1][c] * f,
                                        o[mt][G][2][c] * f, o[mt][G][3][c] * f);
                }
        }
    if (n_chunks > 1 && tid < 32 && hg * 32 + tid < n_head) {
        const long long slot = ((long long)t * n_chunks + chunk) * n_head + hg * 32 + tid;
        part_ml[2 * slot] = m_s[tid];
        part_ml[2 * slot + 1] = l_s[tid];
    }
}

// Tiles of 32 rows in two buffers (the fewest barriers and softmax passes a row: long
// contexts) or 16 rows in four (the first rows arrive sooner: chunks of one or two tiles);
// corrections in two TF32 or one BF16 mma (`_bf`), or f16 operands and no corrections (`_h`).
#define ATT_SPLIT_KERNEL(NAME, T, NBUF, MODE)                                                  \
    extern "C" __global__ void __launch_bounds__(256, 1)                                       \
        NAME(const float* __restrict__ q, const void* __restrict__ cache,                      \
             const int* __restrict__ positions, const int* __restrict__ block_table,           \
             const int* __restrict__ row_seq, int table_width, int bshift,                     \
             float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, \
             int n_head, int w, int lora, int ctx, int n_chunks, float kq_scale) {             \
        PDL_ENTER();                                                                           \
        attn_split<T, NBUF, MODE>(q, cache, positions, block_table, row_seq, table_width,      \
                                  bshift, out, part_o, part_ml, n_head, w, lora, ctx,          \
                                  n_chunks, kq_scale);                                         \
    }
ATT_SPLIT_KERNEL(mla_attn_split_t32, 32, 2, 0)
ATT_SPLIT_KERNEL(mla_attn_split_t16, 16, 4, 0)
ATT_SPLIT_KERNEL(mla_attn_split_t32_bf, 32, 2, 1)
ATT_SPLIT_KERNEL(mla_attn_split_t16_bf, 16, 4, 1)
ATT_SPLIT_KERNEL(mla_attn_split_t32_h, 32, 2, 2)
ATT_SPLIT_KERNEL(mla_attn_split_t16_h, 16, 4, 2)
ATT_SPLIT_KERNEL(mla_attn_split_t32_hc, 32, 4, 3)
ATT_SPLIT_KERNEL(mla_attn_split_t16_hc, 16, 4, 3)

// Merges the chunk partials of one (token, head, 128 columns): every sum in a fixed order
// (chunk c to warp c % 8, lanes then warps), so the result is the same on every run. `tile`
// is the split kernel's, which fixes how rows were divided among the chunks. Every load (a
// warp's up to ATT_MAX_CHUNKS / 8 partial rows, a thread's chunk statistics) is issued before
// the first is used: the kernel is a few L2 round trips, not one per chunk.
#define ATT_MAX_CHUNKS 136
extern "C" __global__ void __launch_bounds__(256)
mla_attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                 const int* __restrict__ positions, float* __restrict__ out, int n_head,
                 int lora, int ctx, int n_chunks, int tile) {
    PDL_ENTER();
    __shared__ float wts[256];
    __shared__ float4 red[8][32];
    __shared__ float wred[8];
    __shared__ float stat[2];
    const int h = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int pos = positions[t];
    const int nrows = pos < 0 ? 0 : min(pos, ctx - 1) + 1;
    const int per = att_rows_per_chunk(nrows, n_chunks, tile);
    const int nvalid = nrows == 0 ? 0 : min((nrows + per - 1) / per, ATT_MAX_CHUNKS);
    const long long base = (long long)t * n_chunks * n_head + h;
    const int col = blockIdx.x * 128 + 4 * lane;
    const bool cv = col < lora;

    float4 v[ATT_MAX_CHUNKS / 8];
#pragma unroll
    for (int u = 0; u < ATT_MAX_CHUNKS / 8; ++u) {
        const int c = warp + 8 * u;
        v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (cv && c < nvalid)
            v[u] = *reinterpret_cast<const float4*>(part_o + (base + (long long)c * n_head) * lora +
                                                    col);
    }
    float mc = NEG_INF, lc = 0.0f;
    if (tid < nvalid) {
        const long long slot = base + (long long)tid * n_head;
        mc = part_ml[2 * slot];
        lc = part_ml[2 * slot + 1];
    }

    float mx = mc;
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) wred[warp] = mx;
    __syncthreads();
    if (tid == 0) {
        float m = wred[0];
        for (int k = 1; k < 8; ++k) m = fmaxf(m, wred[k]);
        stat[0] = m;
    }
    __syncthreads();
    const float e = tid < nvalid ? expf(mc - stat[0]) : 0.0f;
    wts[tid] = e;
    float ls = lc * e;
    for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
    __syncthreads();
    if (lane == 0) wred[warp] = ls;
    __syncthreads();
    if (tid == 0) {
        float l = wred[0];
        for (int k = 1; k < 8; ++k) l += wred[k];
        stat[1] = l;
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < ATT_MAX_CHUNKS / 8; ++u) {
        const int c = warp + 8 * u;
        if (c < nvalid) {
            const float w = wts[c];
            acc.x = fmaf(v[u].x, w, acc.x);
            acc.y = fmaf(v[u].y, w, acc.y);
            acc.z = fmaf(v[u].z, w, acc.z);
            acc.w = fmaf(v[u].w, w, acc.w);
        }
    }
    red[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && cv) {
        float4 s = red[0][lane];
        for (int k = 1; k < 8; ++k) {
            const float4 u = red[k][lane];
            s.x += u.x;
            s.y += u.y;
            s.z += u.z;
            s.w += u.w;
        }
        const float inv = nvalid == 0 ? 0.0f : 1.0f / stat[1];
        *reinterpret_cast<float4*>(out + ((long long)t * n_head + h) * lora + col) =
            make_float4(s.x * inv, s.y * inv, s.z * inv, s.w * inv);
    }
}

// Merges the partials of a split into few chunks (at most ATT_FEW_CHUNKS, a batched decode
// step's): one 128-thread block a (token, head), four columns a thread, the chunks added in
// chunk order, no shared memory. mla_attn_combine, built for up to 136 chunks (one token over
// a long context), spends a batched step on its fixed costs: 256 threads and four barriers per
// 128 columns (H200: 34.5 of the attention's 64.8 µs for 32 tokens of 4 chunks). Sixteen
// covers 8 sequences' split (16 chunks each near 768 positions), which took the wide merge
// while the bound was 8; a thread's 16 loads of 16 bytes stay in flight together.
#define ATT_FEW_CHUNKS 16
extern "C" __global__ void __launch_bounds__(128)
mla_attn_combine_few(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                     const int* __restrict__ positions, float* __restrict__ out, int n_head,
                     int lora, int ctx, int n_chunks, int tile) {
    PDL_ENTER();
    const int h = blockIdx.x, t = blockIdx.y;
    const int pos = positions[t];
    const int nrows = pos < 0 ? 0 : min(pos, ctx - 1) + 1;
    const int per = att_rows_per_chunk(nrows, n_chunks, tile);
    const int nvalid = nrows == 0 ? 0 : min((nrows + per - 1) / per, ATT_FEW_CHUNKS);
    const long long base = (long long)t * n_chunks * n_head + h;
    float m[ATT_FEW_CHUNKS], l[ATT_FEW_CHUNKS];
    float mx = NEG_INF;
#pragma unroll
    for (int c = 0; c < ATT_FEW_CHUNKS; ++c) {
        m[c] = NEG_INF;
        l[c] = 0.0f;
        if (c < nvalid) {
            const long long slot = base + (long long)c * n_head;
            m[c] = part_ml[2 * slot];
            l[c] = part_ml[2 * slot + 1];
            mx = fmaxf(mx, m[c]);
        }
    }
    float e[ATT_FEW_CHUNKS], sum = 0.0f;
#pragma unroll
    for (int c = 0; c < ATT_FEW_CHUNKS; ++c) {
        e[c] = c < nvalid ? expf(m[c] - mx) : 0.0f;
        sum = fmaf(l[c], e[c], sum);
    }
    const float inv = nvalid == 0 ? 0.0f : 1.0f / sum;
    for (int col = 4 * threadIdx.x; col < lora; col += 4 * blockDim.x) {
        float4 v[ATT_FEW_CHUNKS];
#pragma unroll
        for (int c = 0; c < ATT_FEW_CHUNKS; ++c)
            v[c] = c < nvalid ? *reinterpret_cast<const float4*>(
                                    part_o + (base + (long long)c * n_head) * lora + col)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < ATT_FEW_CHUNKS; ++c) {
            acc.x = fmaf(v[c].x, e[c], acc.x);
            acc.y = fmaf(v[c].y, e[c], acc.y);
            acc.z = fmaf(v[c].z, e[c], acc.z);
            acc.w = fmaf(v[c].w, e[c], acc.w);
        }
        *reinterpret_cast<float4*>(out + ((long long)t * n_head + h) * lora + col) =
            make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    }
}

// ---- The warpgroup split kernel (sm_90a): the F16 cache, the model's shape ----------------
//
// Block (chunk, token), 160 threads: warps 0..3 are one consumer warpgroup, warp 4 copies.
// Chunks are whole 64-row pages (the engine's cache blocks), each one run of pool rows that
// the tensor memory accelerator stages as nine boxes of 64 columns × 64 rows with the
// 128-byte swizzle (row r of a box at 128·r, its 16-byte chunk c at c ^ (r % 8)). The copy
// warp fills two page buffers one page ahead (a full and an empty mbarrier each), so the
// consumers never issue a copy or work out an address of the cache.
//
// Per page the consumers run two warpgroup MMAs straight from shared memory, f16 operands
// and f32 accumulators (the `_hc` kernel's numerics):
//   S^T[64 rows][32 heads] = K·(Q·kq_scale)^T: 36 wgmma.m64n32k16, A the page (K-major),
//     B Q staged once as f16 the same way;
//   O^T[512 columns][32 heads] += V^T·P^T: 8 column tiles × 4 k16 steps, A a box read
//     transposed (its rows are the K index: the 8-row groups 1024 bytes apart), B the weights
//     P^T[32 heads][64 rows] as f16 (K-major, swizzled).
// A lane's accumulators of both products hold the same heads (8j + 2t and +1, j = 0..3), so
// the online softmax's rescale of O is in registers and only the tile max crosses the four
// warps (one named barrier); the row sums stay per lane until the end.
//
// Rows past the chunk's end inside its last page are zeroed in shared memory after they land
// (their pool rows hold whatever the pool held: a weight of 0 times NaN bits is NaN).

#define ATT_WG_THREADS 160
#define ATT_WG_TILE_BYTES (9 * 8192)
#define ATT_WG_Q_BYTES (9 * 4096)
#define ATT_WG_P_BYTES 4096

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATT_WG 1
#else
#define ATT_WG 0
#endif

// An encoded CUtensorMap, passed by value.
struct __align__(64) AttTensorMap {
    unsigned long long v[16];
};

__device__ __forceinline__ void att_wg_mbar_init(unsigned long long* bar, unsigned count) {
#if ATT_WG
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(att_smem_addr(bar)), "r"(count)
                 : "memory");
#endif
}
__device__ __forceinline__ void att_wg_mbar_arrive(unsigned long long* bar) {
#if ATT_WG
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(att_smem_addr(bar)) : "memory");
#endif
}
// Box (first column c0, first row c1) of `map` into shared `dst`, counted on `bar`.
__device__ __forceinline__ void att_wg_tma(void* dst, const AttTensorMap* map, int c0, int c1,
                                           unsigned long long* bar) {
#if ATT_WG
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3}], [%4];" ::"r"(att_smem_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(att_smem_addr(bar))
        : "memory");
#endif
}
// A shared-memory matrix descriptor with the 128-byte swizzle: 8-row groups 1024 bytes apart
// (SBO); LBO is not read by these layouts.
__device__ __forceinline__ unsigned long long att_wg_desc(unsigned addr) {
    return (unsigned long long)((addr >> 4) & 0x3fffu) | (1ull << 16) | (64ull << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void att_wg_fence() {
#if ATT_WG
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void att_wg_commit_wait() {
#if ATT_WG
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}
// The four consumer warps' barrier (warp 4 never joins it).
__device__ __forceinline__ void att_wg_bar() { asm volatile("bar.sync 1, 128;" ::: "memory"); }
// Generic-proxy writes to shared memory before asynchronous-proxy reads (wgmma) of them.
__device__ __forceinline__ void att_wg_proxy_fence() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// d (+)= A·B, m64n32k16, f16 operands from shared memory, f32 accumulators; TA: A transposed.
template <int TA>
__device__ __forceinline__ void att_wg_mma(float (&d)[16], unsigned long long da,
                                           unsigned long long db, int accumulate) {
#if ATT_WG
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, "
        "%19, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA));
#endif
}

extern "C" __global__ void __launch_bounds__(ATT_WG_THREADS, 1)
mla_attn_split_wg(const __grid_constant__ AttTensorMap map, const float* __restrict__ q,
                  const int* __restrict__ positions, const int* __restrict__ block_table,
                  const int* __restrict__ row_seq, int table_width, int bshift,
                  float* __restrict__ out, float* __restrict__ part_o,
                  float* __restrict__ part_ml, int ctx, int n_chunks, float kq_scale) {
    PDL_ENTER();
#if ATT_WG
    constexpr int NH = 32, LORA = ATT_LORA, W = ATT_W;
    extern __shared__ unsigned char att_wg_dyn[];
    __shared__ __align__(8) unsigned long long full[2], empty[2];
    __shared__ float red_max[2][4][NH];
    __shared__ float red_sum[4][NH];
    // The swizzled layouts repeat every 1024 bytes: the launch adds 1024 to align them.
    unsigned char* base =
        att_wg_dyn + ((1024u - (att_smem_addr(att_wg_dyn) & 1023u)) & 1023u);
    unsigned char* pages = base;                          // [2][9 boxes][64 rows][128 B]
    unsigned char* qs = base + 2 * ATT_WG_TILE_BYTES;     // [9 k-blocks][32 heads][128 B]
    unsigned char* ps = qs + ATT_WG_Q_BYTES;              // [32 heads][64 rows as 128 B]

    const int chunk = blockIdx.x, t = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int pos = positions[t];
    const int nrows = pos < 0 ? 0 : min(pos, ctx - 1) + 1;
    const int per = att_rows_per_chunk(nrows, n_chunks, 64);
    const int r0 = chunk * per, r1 = min(r0 + per, nrows);
    if (r0 >= r1) {
        // Only a position outside the cache leaves the single chunk empty: write zeros.
        if (n_chunks == 1)
            for (int idx = tid; idx < NH * LORA; idx += ATT_WG_THREADS)
                out[(long long)t * NH * LORA + idx] = 0.0f;
        return;
    }
    const int ntiles = (r1 - r0 + 63) >> 6;
    const int* tbl = block_table + (long long)row_seq[t] * table_width;
    if (tid == 0) {
        att_wg_mbar_init(&full[0], 1);
        att_wg_mbar_init(&full[1], 1);
        att_wg_mbar_init(&empty[0], 4);
        att_wg_mbar_init(&empty[1], 4);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == 4) {
        // The copy warp: page `it` into buffer it % 2 once the consumers have released it.
        if (lane == 0)
            for (int it = 0; it < ntiles; ++it) {
                const int b = it & 1;
                if (it >= 2) att_mbar_wait(&empty[b], ((it >> 1) - 1) & 1);
                att_mbar_expect(&full[b], ATT_WG_TILE_BYTES);
                const int prow = (int)att_pool_row(tbl, r0 + 64 * it, bshift);
#pragma unroll
                for (int x = 0; x < 9; ++x)
                    att_wg_tma(pages + b * ATT_WG_TILE_BYTES + 8192 * x, &map, 64 * x, prow,
                               &full[b]);
            }
        return;
    }

    // Q·kq_scale as f16, K-major with the 128-byte swizzle (head n at 128·n of each 4 KB
    // k-block): the score product's B operand for every page. A thread's 18 chunks of 8 values
    // in two rounds of 9, every load of a round issued before the first is used: one rolled
    // chunk at a time waited out 18 L2 round trips before the first product.
    {
        constexpr int CHUNKS = NH * (W / 8) / 128, ROUND = 9;
        static_assert(CHUNKS % ROUND == 0, "whole rounds");
        const float* qt = q + (long long)t * NH * W;
#pragma unroll
        for (int r = 0; r < CHUNKS; r += ROUND) {
            float4 a[ROUND], b[ROUND];
#pragma unroll
            for (int k = 0; k < ROUND; ++k) {
                const int i = tid + 128 * (r + k);
                const float* src = qt + 8 * i;  // head i / 72, columns 8 (i % 72) on
                a[k] = *reinterpret_cast<const float4*>(src);
                b[k] = *reinterpret_cast<const float4*>(src + 4);
            }
#pragma unroll
            for (int k = 0; k < ROUND; ++k) {
                const int i = tid + 128 * (r + k);
                const int n = i / (W / 8), c = i - n * (W / 8);
                *reinterpret_cast<uint4*>(qs + 4096 * (c >> 3) + 128 * n +
                                          16 * ((c & 7) ^ (n & 7))) =
                    make_uint4(att_pack_f16(a[k].x * kq_scale, a[k].y * kq_scale),
                               att_pack_f16(a[k].z * kq_scale, a[k].w * kq_scale),
                               att_pack_f16(b[k].x * kq_scale, b[k].y * kq_scale),
                               att_pack_f16(b[k].z * kq_scale, b[k].w * kq_scale));
            }
        }
    }
    att_wg_proxy_fence();
    att_wg_bar();

    // Head e of this lane: 8(e >> 1) + 2tq + (e & 1); its scores are s[4j + c] (row
    // 16·warp + g) and s[4j + 2 + c] (row + 8), j = e >> 1, c = e & 1; o[i] likewise with
    // columns 64i + 16·warp + g and + 8 for rows.
    float o[8][16];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 16; ++k) o[i][k] = 0.0f;
    float m_run[8], l_part[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        m_run[e] = NEG_INF;
        l_part[e] = 0.0f;
    }
    const unsigned qs_a = att_smem_addr(qs), ps_a = att_smem_addr(ps);
    const int ra = 16 * warp + g, rb = ra + 8;

#pragma unroll 1
    for (int it = 0; it < ntiles; ++it) {
        const int b = it & 1;
        unsigned char* tile = pages + b * ATT_WG_TILE_BYTES;
        const unsigned tile_a = att_smem_addr(tile);
        att_mbar_wait(&full[b], (it >> 1) & 1);
        const int valid = min(64, r1 - (r0 + 64 * it));
        if (valid < 64) {
            for (int i = tid; i < (64 - valid) * 72; i += 128) {
                const int row = valid + i / 72, rem = i - (i / 72) * 72;
                *reinterpret_cast<uint4*>(tile + 8192 * (rem >> 3) + 128 * row + 16 * (rem & 7)) =
                    make_uint4(0, 0, 0, 0);
            }
            att_wg_proxy_fence();
            att_wg_bar();
        }

        float s[16];
        att_wg_fence();
#pragma unroll
        for (int k = 0; k < 36; ++k) {
            const unsigned off_a = 8192 * (k >> 2) + 32 * (k & 3);
            const unsigned off_b = 4096 * (k >> 2) + 32 * (k & 3);
            att_wg_mma<0>(s, att_wg_desc(tile_a + off_a), att_wg_desc(qs_a + off_b), k > 0);
        }
        att_wg_commit_wait();

        const bool va = ra < valid, vb = rb < valid;
        float mx[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int j = e >> 1, c = e & 1;
            mx[e] = fmaxf(va ? s[4 * j + c] : NEG_INF, vb ? s[4 * j + 2 + c] : NEG_INF);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1)
                mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], off));
        }
        float(*rm)[NH] = red_max[b];
        if (g == 0)
#pragma unroll
            for (int e = 0; e < 8; ++e) rm[warp][8 * (e >> 1) + 2 * tq + (e & 1)] = mx[e];
        att_wg_bar();
        float corr[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int j = e >> 1, c = e & 1, h = 8 * j + 2 * tq + c;
            const float tmax = fmaxf(fmaxf(rm[0][h], rm[1][h]), fmaxf(rm[2][h], rm[3][h]));
            const float m_new = fmaxf(m_run[e], tmax);
            corr[e] = expf(m_run[e] - m_new);
            m_run[e] = m_new;
            const float pa = va ? expf(s[4 * j + c] - m_new) : 0.0f;
            const float pb = vb ? expf(s[4 * j + 2 + c] - m_new) : 0.0f;
            l_part[e] = l_part[e] * corr[e] + pa + pb;
            // P^T[h][row]: row k of head h at 128h + 16((k >> 3) ^ (h % 8)) + 2(k % 8).
            unsigned short* prow = reinterpret_cast<unsigned short*>(ps + 128 * h);
            prow[8 * ((ra >> 3) ^ (h & 7)) + (ra & 7)] = __half_as_ushort(__float2half_rn(pa));
            prow[8 * ((rb >> 3) ^ (h & 7)) + (rb & 7)] = __half_as_ushort(__float2half_rn(pb));
        }
        att_wg_proxy_fence();
        att_wg_bar();
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                o[i][4 * (e >> 1) + (e & 1)] *= corr[e];
                o[i][4 * (e >> 1) + 2 + (e & 1)] *= corr[e];
            }
        att_wg_fence();
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                att_wg_mma<1>(o[i], att_wg_desc(tile_a + 8192 * i + 2048 * k),
                              att_wg_desc(ps_a + 32 * k), 1);
        att_wg_commit_wait();
        // This warp is done with the page (and with P^T, which the next page's weights
        // overwrite only after the next tile-max barrier).
        __syncwarp();
        if (lane == 0) att_wg_mbar_arrive(&empty[b]);
    }

    // The row sums: lanes of a head (g), then the four warps in order.
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        float l = l_part[e];
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        if (g == 0) red_sum[warp][8 * (e >> 1) + 2 * tq + (e & 1)] = l;
    }
    att_wg_bar();
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int h = 8 * (e >> 1) + 2 * tq + (e & 1);
        const float l = ((red_sum[0][h] + red_sum[1][h]) + red_sum[2][h]) + red_sum[3][h];
        const long long slot = ((long long)t * n_chunks + chunk) * NH + h;
        float* dst = n_chunks == 1 ? out + ((long long)t * NH + h) * LORA : part_o + slot * LORA;
        const float f = n_chunks == 1 ? 1.0f / l : 1.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int col = 64 * i + 16 * warp + g;
            dst[col] = o[i][4 * (e >> 1) + (e & 1)] * f;
            dst[col + 8] = o[i][4 * (e >> 1) + 2 + (e & 1)] * f;
        }
        if (n_chunks > 1 && warp == 0 && g == 0) {
            part_ml[2 * slot] = m_run[e];
            part_ml[2 * slot + 1] = l;
        }
    }
#endif
}
