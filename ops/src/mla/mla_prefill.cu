// MLA attention (absorbed form) for prefill chunks on the tensor cores: f16 operands, f32
// accumulation and f32 online softmax, flash-attention-2 style. Contract as MlaAttention's
// (ops/src/mla/cpu.rs): q f32 [n_tok][n_head][w], cache f32 [ctx][w] with w = lora + 64, token t
// attends rows 0..=positions[t], the value is the first `lora` columns of the same row; a
// position outside [0, ctx) gives zeros.
//
// Two launches. `mla_prefill_convert` narrows the cache rows up to the chunk's largest valid
// position to f16 once (scratch [ctx][w]), so the attention streams half the bytes with
// cp.async and converts nothing per tile. `mla_prefill_attn` then takes 64 query rows per block:
// (token, head) pairs flattened as r = t·n_head + h, so all heads of a token share the key tiles
// and the causal mask is per row; the block's tiles stop at the largest position among its rows.
//
// Block = 8 warps, one block an SM (Q, two key tiles and P fill 225 KiB of shared memory).
//   S = Q·K^T for a tile of 64 keys: warp w owns rows 16(w&3).. and keys 32(w>>2).., over all
//     w dims (mma.m16n8k16, Q as A and K as B straight from the smem rows via ldmatrix).
//   Softmax: the two warps sharing a row exchange their tile max through smem and then run the
//     same online update (identical inputs, identical m); each keeps its own partial row sum, the
//     two added in a fixed order at the end. P is rounded to f16 into smem; the sums add the
//     rounded weights, so the normalisation matches the weights the product uses.
//   O += P·V: warp w owns value columns [64w, 64w+64) for all 64 rows (128 f32 registers a
//     lane); V is the same key tile read transposed (ldmatrix.trans).
// Every smem row is a run of 16-byte chunks stored at chunk ^ (row & 7), so the 8 rows one
// ldmatrix phase reads fall in distinct banks without padding (the 1152-byte rows would
// otherwise all start in bank 0).
//
// Narrowing saturates (fminf/fmaxf clamp to ±65504): a row a token's mask hides gets weight
// exactly 0, and a clamped value keeps 0·v = 0 where inf or NaN would poison the sum. Rows at
// or past the block's key count are zero-filled by the copy and never read from memory.

#define MLAP_ROWS 64                 // query rows a block
#define MLAP_KEYS 64                 // key rows a tile
#define MLAP_WMAX 576                // widest cache row (lora 512 + rope 64)
#define MLAP_ROWB (MLAP_WMAX * 2)    // bytes of a Q or K row in smem
#define MLAP_TILEB (MLAP_KEYS * MLAP_ROWB)
#define MLAP_PROWB (MLAP_KEYS * 2)   // bytes of a P row in smem
#define MLAP_F16_MAX 65504.0f
#define MLAP_NEG_INF (-__int_as_float(0x7f800000))

// ---- device primitives ----------------------------------------------------------------------

__device__ __forceinline__ unsigned mlap_smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mlap_cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void mlap_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void mlap_cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void mlap_ldsm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mlap_ldsm_x4_trans(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mlap_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) rounded to nearest f16, lo in the low half (the lower column / key).
__device__ __forceinline__ unsigned mlap_pack(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ float2 mlap_unpack(unsigned v) {
    float2 f;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\t"
        "cvt.f32.f16 %1, hi;\n\t}\n"
        : "=f"(f.x), "=f"(f.y)
        : "r"(v));
    return f;
}

// ---- end of device primitives ---------------------------------------------------------------

__device__ __forceinline__ float mlap_sat(float x) {
    return fminf(fmaxf(x, -MLAP_F16_MAX), MLAP_F16_MAX);
}

// kh[r] = f16(cache[pool row of position r]) for positions r below (largest valid position
// + 1) of the chunk's sequence (row_seq[0]'s block table, blocks of 1 << bshift positions); 16
// rows a block. Rows past it are left alone: the attention zero-fills instead of reading them.
// CACHE_H: the cache is F16 already (rounded and saturated as this narrowing does, a NaN kept):
// the rows are gathered, and a NaN still becomes finite as it does from f32.
template <bool CACHE_H>
__device__ __forceinline__ void prefill_convert(const void* __restrict__ cache_v,
                                                const int* __restrict__ positions,
                                                const int* __restrict__ block_table,
                                                const int* __restrict__ row_seq,
                                                int table_width, int bshift,
                                                unsigned short* __restrict__ kh, int n_tok,
                                                int w, int ctx) {
    __shared__ int red[8];
    const int tid = threadIdx.x;
    int mx = -1;
    for (int i = tid; i < n_tok; i += 256) {
        const int p = positions[i];
        if (p >= 0 && p < ctx) mx = max(mx, p);
    }
    for (int off = 16; off > 0; off >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if ((tid & 31) == 0) red[tid >> 5] = mx;
    __syncthreads();
    int rows = 0;
    for (int k = 0; k < 8; ++k) rows = max(rows, red[k] + 1);
    const int r0 = blockIdx.x * 16;
    const int w4 = w >> 2;
    const int n = (min(rows, r0 + 16) - r0) * w4;
    const int* tbl = block_table + (long long)row_seq[0] * table_width;
    for (int idx = tid; idx < n; idx += 256) {
        const int i = idx / w4, c = idx - i * w4;
        const int r = r0 + i;
        const long long off = (long long)r * w + 4 * c;
        const long long prow =
            ((long long)tbl[r >> bshift] << bshift) | (r & ((1 << bshift) - 1));
        float4 v;
        if (CACHE_H) {
            const uint2 u = *reinterpret_cast<const uint2*>(
                reinterpret_cast<const unsigned short*>(cache_v) + prow * w + 4 * c);
            const float2 a = mlap_unpack(u.x), b = mlap_unpack(u.y);
            v = make_float4(a.x, a.y, b.x, b.y);
        } else {
            v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(cache_v) +
                                                 prow * w + 4 * c);
        }
        uint2 h;
        h.x = mlap_pack(mlap_sat(v.x), mlap_sat(v.y));
        h.y = mlap_pack(mlap_sat(v.z), mlap_sat(v.w));
        *reinterpret_cast<uint2*>(kh + off) = h;
    }
}

extern "C" __global__ void __launch_bounds__(256)
mla_prefill_convert(const float* __restrict__ cache, const int* __restrict__ positions,
                    const int* __restrict__ block_table, const int* __restrict__ row_seq,
                    int table_width, int bshift, unsigned short* __restrict__ kh, int n_tok,
                    int w, int ctx) {
    PDL_ENTER();
    prefill_convert<false>(cache, positions, block_table, row_seq, table_width, bshift, kh,
                           n_tok, w, ctx);
}

extern "C" __global__ void __launch_bounds__(256)
mla_prefill_convert_h(const unsigned short* __restrict__ cache, const int* __restrict__ positions,
                      const int* __restrict__ block_table, const int* __restrict__ row_seq,
                      int table_width, int bshift, unsigned short* __restrict__ kh, int n_tok,
                      int w, int ctx) {
    PDL_ENTER();
    prefill_convert<true>(cache, positions, block_table, row_seq, table_width, bshift, kh,
                          n_tok, w, ctx);
}

// Dynamic smem: Q [64][576] f16, K [2][64][576] f16, P [64][64] f16, then the tile max of each
// row per key half [2][64], the rescale factor [64], the row sums per key half [2][64] and the
// key counts [64].
extern "C" __global__ void __launch_bounds__(256, 1)
mla_prefill_attn(const float* __restrict__ q, const unsigned short* __restrict__ kh,
                 const int* __restrict__ positions, float* __restrict__ out, int n_tok,
                 int n_head, int w, int lora, int ctx, float scale_log2,
                 float* __restrict__ part_o, float2* __restrict__ part_ml) {
    PDL_ENTER();
    extern __shared__ uint4 mlap_smem[];
    unsigned char* q_s = reinterpret_cast<unsigned char*>(mlap_smem);
    unsigned char* k_s = q_s + MLAP_ROWS * MLAP_ROWB;
    unsigned char* p_s = k_s + 2 * MLAP_TILEB;
    float* max_s = reinterpret_cast<float*>(p_s + MLAP_ROWS * MLAP_PROWB);
    float* corr_s = max_s + 2 * MLAP_ROWS;
    float* sum_s = corr_s + MLAP_ROWS;
    int* nk_s = reinterpret_cast<int*>(sum_s + 2 * MLAP_ROWS);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int nrows = n_tok * n_head;
    // Later tokens attend more rows (as a prefill chunk's positions run): their blocks start first.
    const int r0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * MLAP_ROWS;

    if (tid < MLAP_ROWS) {
        const int r = r0 + tid;
        int nk = 0;
        if (r < nrows) {
            const int p = positions[r / n_head];
            if (p >= 0 && p < ctx) nk = p + 1;
        }
        nk_s[tid] = nk;
    }
    __syncthreads();
    int maxk = 0;
    for (int i = 0; i < MLAP_ROWS; ++i) maxk = max(maxk, nk_s[i]);
    // Split blockIdx.y of gridDim.y takes its share of this block's key tiles (a chunk of few
    // rows over a long context leaves most multiprocessors idle otherwise); with more than one
    // split the block writes its unnormalised rows, their max and their sum for
    // mla_prefill_combine.
    const int splits = (int)gridDim.y;
    const int all_tiles = (maxk + MLAP_KEYS - 1) / MLAP_KEYS;
    const int per_split = (all_tiles + splits - 1) / splits;
    const int tile0 = min(all_tiles, (int)blockIdx.y * per_split);
    const int ntiles = min(all_tiles, tile0 + per_split) - tile0;

    const unsigned q_u = mlap_smem_u32(q_s), k_u = mlap_smem_u32(k_s), p_u = mlap_smem_u32(p_s);
    const int chunks = w >> 3;  // 16-byte chunks of a key row
    // This thread copies chunks tid, tid + 256, ... of a tile: (key, chunk) stepped, not divided.
    const int cj0 = tid / chunks, cc0 = tid - cj0 * chunks;
    const int cdj = 256 / chunks, cdc = 256 - cdj * chunks;
    auto issue = [&](int it) {
        const int j0 = (tile0 + it) * MLAP_KEYS;
        const unsigned dst = k_u + (it & 1) * MLAP_TILEB;
        int j = cj0, c = cc0;
#pragma unroll 1
        for (int idx = tid; idx < MLAP_KEYS * chunks; idx += 256) {
            const bool v = j0 + j < maxk;
            const unsigned short* src = v ? kh + (long long)(j0 + j) * w + 8 * c : kh;
            mlap_cp_async16(dst + j * MLAP_ROWB + ((c ^ (j & 7)) << 4), src, v ? 16 : 0);
            j += cdj;
            c += cdc;
            if (c >= chunks) {
                c -= chunks;
                ++j;
            }
        }
        mlap_cp_async_commit();
    };
    if (ntiles > 0) issue(0);

    // Q rows to f16 while the first tile is in flight (rows past the chunk are zeros).
    {
        const int w4 = w >> 2;
        for (int idx = tid; idx < MLAP_ROWS * w4; idx += 256) {
            const int i = idx / w4, c4 = idx - i * w4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r0 + i < nrows)
                v = *reinterpret_cast<const float4*>(q + (long long)(r0 + i) * w + 4 * c4);
            uint2 h;
            h.x = mlap_pack(mlap_sat(v.x), mlap_sat(v.y));
            h.y = mlap_pack(mlap_sat(v.z), mlap_sat(v.w));
            *reinterpret_cast<uint2*>(q_s + i * MLAP_ROWB + (((c4 >> 1) ^ (i & 7)) << 4) +
                                      ((c4 & 1) << 3)) = h;
        }
    }

    // Score roles: rows 16·mrow + g (+8), keys 32·kgrp + 8nt + 2tq (+1) of the tile.
    const int mrow = warp & 3, kgrp = warp >> 2;
    const int row_a = 16 * mrow + g, row_b = row_a + 8;
    const int nk_a = nk_s[row_a], nk_b = nk_s[row_b];
    // ldmatrix address roles. A (Q and P): lane gives row lane & 15 of the m-tile, k half
    // lane >> 4. B of the scores (K rows as [n][k]): key (lane & 7) + 8(lane >> 4), k half
    // (lane >> 3) & 1. B of the values (V rows as [k][n], transposed): key (lane & 7) +
    // 8((lane >> 3) & 1), column half lane >> 4. Every row offset added later is a multiple
    // of 8, so the swizzle of a lane's rows is fixed.
    const int lrow = lane & 15, lhi = lane >> 4;
    const int qa_row = 16 * mrow + lrow;
    const unsigned qa_base = q_u + qa_row * MLAP_ROWB;
    const int kb_key = 32 * kgrp + (lane & 7) + 8 * lhi;
    const int kb_half = (lane >> 3) & 1;
    const int v_key = (lane & 7) + 8 * ((lane >> 3) & 1);
    // Chunk offsets (bytes) of k-step u of each group of 4 (chunks 2u + half, swizzled).
    unsigned qa_off[4], kb_off[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        qa_off[u] = ((2 * u + lhi) ^ (qa_row & 7)) << 4;
        kb_off[u] = ((2 * u + kb_half) ^ (kb_key & 7)) << 4;
    }
    const unsigned pa_base = p_u + lrow * MLAP_PROWB;

    const bool pv = 64 * warp < lora;
    float o[4][8][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[mt][nt][c] = 0.0f;
    float m_run[2] = {MLAP_NEG_INF, MLAP_NEG_INF}, l_run[2] = {0.0f, 0.0f};
    const int ksteps = w >> 4;  // a multiple of 4: w = lora + 64 with lora % 64 == 0

    for (int it = 0; it < ntiles; ++it) {
        mlap_cp_async_wait_all();
        // Tile `it` (and at it == 0 the Q rows) visible to all; every warp is done with tile
        // it-1, so its buffer, P and the rescale factors may be overwritten.
        __syncthreads();
        if (it + 1 < ntiles) issue(it + 1);
        const unsigned kt = k_u + (it & 1) * MLAP_TILEB;

        float s[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[nt][c] = 0.0f;
        const unsigned kb_base0 = kt + kb_key * MLAP_ROWB;
        const unsigned kb_base1 = kb_base0 + 16 * MLAP_ROWB;
#pragma unroll 1
        for (int kk0 = 0; kk0 < ksteps; kk0 += 4) {
            const unsigned step = kk0 * 32;  // 4 k-steps of 16 halves = 128 bytes
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                unsigned a[4], b0[4], b1[4];
                mlap_ldsm_x4(qa_base + step + qa_off[u], a);
                mlap_ldsm_x4(kb_base0 + step + kb_off[u], b0);
                mlap_ldsm_x4(kb_base1 + step + kb_off[u], b1);
                mlap_mma(s[0], a, b0[0], b0[1]);
                mlap_mma(s[1], a, b0[2], b0[3]);
                mlap_mma(s[2], a, b1[0], b1[1]);
                mlap_mma(s[3], a, b1[2], b1[3]);
            }
        }

        // Scale into the exp2 domain and mask keys at or past each row's count.
        const int jb = (tile0 + it) * MLAP_KEYS + 32 * kgrp + 2 * tq;
        float mx_a = MLAP_NEG_INF, mx_b = MLAP_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = jb + 8 * nt + e;
                s[nt][e] = j < nk_a ? s[nt][e] * scale_log2 : MLAP_NEG_INF;
                s[nt][2 + e] = j < nk_b ? s[nt][2 + e] * scale_log2 : MLAP_NEG_INF;
                mx_a = fmaxf(mx_a, s[nt][e]);
                mx_b = fmaxf(mx_b, s[nt][2 + e]);
            }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
        }
        if (tq == 0) {
            max_s[kgrp * MLAP_ROWS + row_a] = mx_a;
            max_s[kgrp * MLAP_ROWS + row_b] = mx_b;
        }
        __syncthreads();

        const float mn_a = fmaxf(m_run[0], fmaxf(max_s[row_a], max_s[MLAP_ROWS + row_a]));
        const float mn_b = fmaxf(m_run[1], fmaxf(max_s[row_b], max_s[MLAP_ROWS + row_b]));
        // A row with no key yet keeps m = -inf; subtracting 0 then gives weights exp2(-inf) = 0.
        const float mu_a = mn_a == MLAP_NEG_INF ? 0.0f : mn_a;
        const float mu_b = mn_b == MLAP_NEG_INF ? 0.0f : mn_b;
        const float corr_a = exp2f(m_run[0] - mu_a), corr_b = exp2f(m_run[1] - mu_b);
        m_run[0] = mn_a;
        m_run[1] = mn_b;
        float sum_a = 0.0f, sum_b = 0.0f;
        unsigned char* pr_a = p_s + row_a * MLAP_PROWB + 4 * tq;
        unsigned char* pr_b = p_s + row_b * MLAP_PROWB + 4 * tq;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const unsigned pa = mlap_pack(exp2f(s[nt][0] - mu_a), exp2f(s[nt][1] - mu_a));
            const unsigned pb = mlap_pack(exp2f(s[nt][2] - mu_b), exp2f(s[nt][3] - mu_b));
            const float2 fa = mlap_unpack(pa), fb = mlap_unpack(pb);
            sum_a += fa.x + fa.y;
            sum_b += fb.x + fb.y;
            const int chunk = 4 * kgrp + nt;
            *reinterpret_cast<unsigned*>(pr_a + ((chunk ^ (row_a & 7)) << 4)) = pa;
            *reinterpret_cast<unsigned*>(pr_b + ((chunk ^ (row_b & 7)) << 4)) = pb;
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            sum_a += __shfl_xor_sync(0xffffffffu, sum_a, off);
            sum_b += __shfl_xor_sync(0xffffffffu, sum_b, off);
        }
        l_run[0] = l_run[0] * corr_a + sum_a;
        l_run[1] = l_run[1] * corr_b + sum_b;
        if (kgrp == 0 && tq == 0) {
            corr_s[row_a] = corr_a;
            corr_s[row_b] = corr_b;
        }
        __syncthreads();

        if (pv) {
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const float c0 = corr_s[16 * mt + g], c1 = corr_s[16 * mt + g + 8];
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    o[mt][nt][0] *= c0;
                    o[mt][nt][1] *= c0;
                    o[mt][nt][2] *= c1;
                    o[mt][nt][3] *= c1;
                }
            }
            const unsigned vb_base = kt + v_key * MLAP_ROWB;
            const int v_sw = v_key & 7;
#pragma unroll
            for (int ks = 0; ks < MLAP_KEYS / 16; ++ks) {
                unsigned a[4][4];
#pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                    mlap_ldsm_x4(pa_base + 16 * mt * MLAP_PROWB + (((2 * ks + lhi) ^ (lrow & 7)) << 4),
                                 a[mt]);
#pragma unroll
                for (int jp = 0; jp < 4; ++jp) {
                    unsigned b[4];
                    mlap_ldsm_x4_trans(vb_base + 16 * ks * MLAP_ROWB +
                                           (((8 * warp + 2 * jp + lhi) ^ v_sw) << 4),
                                       b);
#pragma unroll
                    for (int mt = 0; mt < 4; ++mt) {
                        mlap_mma(o[mt][2 * jp], a[mt], b[0], b[1]);
                        mlap_mma(o[mt][2 * jp + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
    }

    if (tq == 0) {
        sum_s[kgrp * MLAP_ROWS + row_a] = l_run[0];
        sum_s[kgrp * MLAP_ROWS + row_b] = l_run[1];
        if (kgrp == 0) {
            max_s[row_a] = m_run[0];
            max_s[row_b] = m_run[1];
        }
    }
    __syncthreads();
    if (splits > 1) {
        const long long base = (long long)blockIdx.y * gridDim.x * MLAP_ROWS;
        if (tid < MLAP_ROWS && r0 + tid < nrows)
            part_ml[base + r0 + tid] = make_float2(max_s[tid], sum_s[tid] + sum_s[MLAP_ROWS + tid]);
        if (!pv) return;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = 16 * mt + g + 8 * h;
                if (r0 + row >= nrows) continue;
                float* dst = part_o + (base + r0 + row) * lora + 64 * warp + 2 * tq;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
                    *reinterpret_cast<float2*>(dst + 8 * nt) =
                        make_float2(o[mt][nt][2 * h], o[mt][nt][2 * h + 1]);
            }
        return;
    }
    if (!pv) return;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * mt + g + 8 * h;
            if (r0 + row >= nrows) continue;
            const float l = sum_s[row] + sum_s[MLAP_ROWS + row];
            // No key at all (a position outside the cache): O is 0 and so is the output.
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            float* dst = out + (long long)(r0 + row) * lora + 64 * warp + 2 * tq;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
                *reinterpret_cast<float2*>(dst + 8 * nt) =
                    make_float2(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
        }
}

// out[r] = the splits' rows merged: each split's rows scaled by 2^(its max - the largest
// max), added in split order, over the same merge of their sums (zeros where no split saw a
// key). grid = rows, block = lora / 4 threads; part_o [splits][rows_pad][lora], part_ml
// [splits][rows_pad] as mla_prefill_attn wrote them (rows_pad = its grid's rows).
extern "C" __global__ void __launch_bounds__(128)
mla_prefill_combine(const float* __restrict__ part_o, const float2* __restrict__ part_ml,
                    float* __restrict__ out, int rows_pad, int lora, int splits) {
    PDL_ENTER();
    const int r = blockIdx.x, c = 4 * threadIdx.x;
    float mx = MLAP_NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[(long long)s * rows_pad + r].x);
    float l = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < splits; ++s) {
        const float2 ml = part_ml[(long long)s * rows_pad + r];
        // A split with no key for this row has m = -inf, l = 0 and zero rows: weight 0.
        const float a = ml.x == MLAP_NEG_INF ? 0.0f : exp2f(ml.x - mx);
        l = fmaf(a, ml.y, l);
        if (c < lora) {
            const float4 v = *reinterpret_cast<const float4*>(part_o + ((long long)s * rows_pad + r) * lora + c);
            acc.x = fmaf(a, v.x, acc.x);
            acc.y = fmaf(a, v.y, acc.y);
            acc.z = fmaf(a, v.z, acc.z);
            acc.w = fmaf(a, v.w, acc.w);
        }
    }
    if (c >= lora) return;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    *reinterpret_cast<float4*>(out + (long long)r * lora + c) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
}
