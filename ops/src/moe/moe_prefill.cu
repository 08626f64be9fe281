// Routed experts for prefill chunks: one grouped IQ4_NL GEMM over the CSR route table on the
// tensor cores (mma.sync m16n8k16, f16 operands, f32 accumulation). Same contract as
// moe.cu's expert_gemm: SwiGLU mode (Wb != 0) writes y[route][c] = silu(gate_c·x) * (up_c·x)
// with x = the route's token row; down mode (Wb == 0) writes y[route][c] = W_c·x[route].
// Every output element has one writer and a fixed summation order, so runs repeat bit for bit.
// This header describes expert_gemm_tc_iq4; on sm_90a the launcher runs expert_gemm_wg_iq4
// (warpgroup MMAs, tiles of up to 128 routes: see its section at the end), which shares the
// weight staging, the decode and the numerics below.
//
// Tiling. blockIdx.y = an (expert, tile of up to TC_BM = 64 routes) pair, found from the
// offsets on the device (the grid is sized for the worst case, ceil(R/64) + min(E, R); the
// rest exit). blockIdx.x = a tile of TC_BN = 256 weight rows: in SwiGLU mode 128 gate rows and
// the 128 up rows of the same outputs, in down mode 256 rows. Each of the 8 warps owns 32 rows
// (four n8 tiles) for all of the tile's routes, so every weight is decoded exactly once per
// block; only the m16 tiles that hold routes are multiplied (an expert with 33 routes costs
// three, not four).
//
// Per k-tile of TC_KT = 128 inputs (four IQ4_NL blocks, 72 bytes a row) the raw weight bytes
// arrive in shared memory by cp.async, TC_STAGES deep; the routes' inputs are read from global
// memory one k-tile ahead into registers and narrowed to f16 into a double-buffered A tile.
// Weights are decoded in registers straight into mma B fragments, so shared memory holds
// 4.5 bits a weight, not 16.
//
// Numerics. A weight is d * code with d the block's f16 scale: the code comes exact out of a
// byte-permute lookup as an f16 integer, and one f16 multiply rounds the exact product once,
// which is the f32 dequantization narrowed to f16. f16 over bf16 for its three extra mantissa
// bits; its range is kept by exact power-of-two scalings: weights are decoded times 16 (so
// scales down to ~4e-6 stay normal), SwiGLU inputs are narrowed times 2^-4 and down-projection
// inputs times 2^-8 (silu(g)*u is the quantity that crosses f16's 65504 on loud experts, seed
// §2; this leaves room to ~1.6e7), and the f32 accumulator is scaled back exactly.
//
// K order. A k16 MMA step may sum its 16 products in any order of k as long as A and B agree.
// Byte i of a block's nibbles holds values i (low nibble) and i+16 (high nibble), so each f16
// pair of a fragment is (value j, value j+16) of the block; the A tile is stored permuted the
// same way (word 4i + t of a block's 16 words holds inputs 4t+i and 4t+i+16).

#define TC_BM 64
#define TC_BN 256
#define TC_KT 128
#define TC_STAGES 4
#define TC_WROW 80                        // bytes a weight row takes in a stage (72 + 8 pad)
#define TC_WSTAGE (TC_BN * TC_WROW)       // 20480
#define TC_AROW 272                       // bytes a route row of the A tile (128 f16 + 16 pad)
#define TC_ABUF (TC_BM * TC_AROW)         // 17408
#define TC_SMEM (TC_STAGES * TC_WSTAGE + 2 * TC_ABUF)

__device__ __forceinline__ void tc_cp8(unsigned dst, const unsigned char* src, int bytes) {
    // bytes = 0 zero-fills the destination (rows past n_out) without reading src.
    asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 8, %2;" ::"r"(dst), "l"(src),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void tc_wait_stages() {
    asm volatile("cp.async.wait_group %0;" ::"n"(TC_STAGES - 2) : "memory");
}

// Two f32 as an f16 pair (lo in the low half), rounded to nearest.
__device__ __forceinline__ unsigned tc_pack_f16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The pair of 16·codes held as f16 (16384 + 16·(code+128)) times the scale pair, each
// product rounded once.
__device__ __forceinline__ unsigned tc_scale_codes(unsigned biased, unsigned d2) {
    unsigned c, w;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(c) : "r"(biased), "r"(0x74807480u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(w) : "r"(c), "r"(d2));
    return w;
}

// Half hf of one block's 8 weights a lane holds, from qs bytes 4t..4t+3 (q) and the scale pair
// d2: w0 = (16·d·v[4t+2hf], 16·d·v[4t+2hf+16]) and w1 the same for 4t+2hf+1, each an f16 pair.
// The codebook lives in four registers as code+128 bytes: entries 0-7 and 8-15 are looked up by
// a nibble's low 3 bits, then its bit 3 picks between them (as moe.cu's iq4_codes). Placing a
// byte under the exponent of 2^14 gives the f16 16384 + 16·byte exactly.
__device__ __forceinline__ void tc_decode_half(unsigned q, unsigned d2, int hf, unsigned& w0,
                                               unsigned& w1) {
    const unsigned t0 = 0x3f2d1801u, t1 = 0x766a5d4fu, t2 = 0xa6998d81u, t3 = 0xf1d9c5b5u;
    const unsigned h = hf ? q >> 16 : q;
    const unsigned lo = __byte_perm(t0, t1, h & 0x7777u);
    const unsigned hi = __byte_perm(t2, t3, h & 0x7777u);
    // Bytes: low and high nibble of qs byte 2hf, then of qs byte 2hf+1.
    const unsigned r = __byte_perm(lo, hi, 0x3210u | ((h >> 1) & 0x4444u));
    w0 = tc_scale_codes(__byte_perm(r, 0x74747474u, 0x4140u), d2);
    w1 = tc_scale_codes(__byte_perm(r, 0x74747474u, 0x4342u), d2);
}

// The scale of a block (its f16 bits in dh) as an f16 pair.
__device__ __forceinline__ unsigned tc_scale_pair(unsigned dh) { return __byte_perm(dh, 0u, 0x1010u); }

// All 8 weights of one block a lane holds: w[i] = (16·d·v[4t+i], 16·d·v[4t+i+16]).
__device__ __forceinline__ void tc_decode(unsigned q, unsigned dh, unsigned w[4]) {
    const unsigned d2 = tc_scale_pair(dh);
    tc_decode_half(q, d2, 0, w[0], w[1]);
    tc_decode_half(q, d2, 1, w[2], w[3]);
}

// qs bytes 4t..4t+3 of block b of a weight row staged at rp (18 bytes a block, rows 8-byte
// aligned): odd blocks' qs start 4-byte aligned, even blocks' 2 bytes off.
__device__ __forceinline__ unsigned tc_load_qs(const unsigned char* rp, int b, int t) {
    if (b & 1) return *reinterpret_cast<const unsigned*>(rp + 2 + 4 * t);
    const unsigned* p = reinterpret_cast<const unsigned*>(rp + 4 * t);
    return __byte_perm(p[0], p[1], 0x5432u);
}

__device__ __forceinline__ void tc_ldmatrix_x4(unsigned a[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}

__device__ __forceinline__ void tc_mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// As the CPU's `*a *= silu(g)`: u * (g / (1 + exp(-g))), each step rounded on its own.
__device__ __forceinline__ float tc_silu_times(float g, float u) {
    return __fmul_rn(u, __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
}

__device__ __forceinline__ void tc_store2(float* yr, int col, int n_out, int pair, float a,
                                          float b) {
    if (pair) {
        if (col < n_out) *reinterpret_cast<float2*>(yr + col) = make_float2(a, b);
    } else {
        if (col < n_out) yr[col] = a;
        if (col + 1 < n_out) yr[col + 1] = b;
    }
}

// Warp 0 finds this block's expert and route tile (tiles of up to tm routes, blockIdx.y counts
// them expert by expert): per-expert tile counts scanned 32 experts a step. Lane 0 writes the
// expert (-1 past the last tile) and the tile's index within it.
__device__ __forceinline__ void tc_find_tile(const int* __restrict__ offsets, int n_expert, int tm,
                                             int lane, int* s_expert, int* s_tile) {
    int q = blockIdx.y, found = -1, tile = 0;
    for (int e0 = 0; e0 < n_expert; e0 += 32) {
        const int e = e0 + lane;
        int tiles = 0;
        if (e < n_expert) {
            const int c = offsets[e + 1] - offsets[e];
            tiles = c > 0 ? (c + tm - 1) / tm : 0;
        }
        int incl = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 31);
        if (q < total) {
            const int src = __ffs(__ballot_sync(0xffffffffu, q < incl)) - 1;
            found = e0 + src;
            tile = q - (__shfl_sync(0xffffffffu, incl, src) - __shfl_sync(0xffffffffu, tiles, src));
            break;
        }
        q -= total;
    }
    if (lane == 0) {
        *s_expert = found;
        *s_tile = tile;
    }
}

// grid (ceil(n_out / (Wb ? 128 : 256)), ceil(R/64) + min(E, R)), block 256, TC_SMEM bytes of
// dynamic shared memory. n_in % 128 == 0; Wa, Wb and x 16-byte aligned; pair (float2 stores)
// only when n_out is even and y 8-byte aligned.
extern "C" __global__ void __launch_bounds__(256, 1)
expert_gemm_tc_iq4(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                   const float* __restrict__ x, const int* __restrict__ offsets,
                   const int* __restrict__ route_token, float* __restrict__ y, int n_in,
                   int n_out, int n_expert, int n_x_rows, int n_routes, float x_scale,
                   float y_scale, int pair) {
    PDL_ENTER();
    extern __shared__ __align__(16) unsigned char tc_smem[];
    __shared__ int s_expert, s_tile;
    __shared__ int s_src[TC_BM];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    if (warp == 0) tc_find_tile(offsets, n_expert, TC_BM, lane, &s_expert, &s_tile);
    __syncthreads();
    const int e = s_expert;
    if (e < 0) return;  // block-uniform, as below
    const int rb = min(max(offsets[e] + s_tile * TC_BM, 0), n_routes);
    const int rn = max(0, min(min(TC_BM, offsets[e + 1] - rb), n_routes - rb));
    if (rn <= 0) return;
    const bool swiglu = Wb != nullptr;
    if (tid < TC_BM) {
        int src = -1;
        if (tid < rn) src = swiglu ? route_token[rb + tid] : rb + tid;
        s_src[tid] = (src >= 0 && src < n_x_rows) ? src : -1;
    }
    const int m_active = (rn + 15) >> 4;
    const long long row_bytes = (long long)(n_in >> 5) * 18;
    const int nk = n_in / TC_KT;
    const int c0 = blockIdx.x * (swiglu ? TC_BN / 2 : TC_BN);
    const int g = lane >> 2, t = lane & 3;

    // Copy role: the warp copies its own 32 rows. Pieces 0-7 (64 bytes) of rows 4v + lane/8
    // for v = 0..7, so a copy instruction reads 4 rows' contiguous bytes, then piece 8 of row
    // `lane`. Row r of warp w: SwiGLU, n8 tile j = r/8 (0, 1 gate; 2, 3 up) of outputs
    // c0 + 16w + 8(j&1) + r%8; down, row c0 + 32w + r.
    const unsigned char* expert_a = Wa + (long long)e * n_out * row_bytes;
    const unsigned char* expert_b = swiglu ? Wb + (long long)e * n_out * row_bytes : expert_a;
    const int r0 = lane >> 3;
    const int out0 = c0 + (swiglu ? 16 : 32) * warp + r0;  // row 4v + r0 is out0 + 4(v&3) (+16 down, v≥4)
    const int hi_rows = swiglu ? 0 : 16;
    const unsigned char* p_lo = expert_a + (long long)out0 * row_bytes;
    const unsigned char* p_hi = expert_b + (long long)(out0 + hi_rows) * row_bytes;
    const long long rb4 = 4 * row_bytes;
    const int out8 = c0 + (swiglu ? 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7) : 32 * warp + lane);
    const bool ok8 = out8 < n_out;
    const unsigned char* p8 =
        ok8 ? ((swiglu && lane >= 16) ? expert_b : expert_a) + (long long)out8 * row_bytes + 64
            : expert_a;
    const unsigned ws_addr = (unsigned)__cvta_generic_to_shared(tc_smem);
    const unsigned as_addr = ws_addr + TC_STAGES * TC_WSTAGE;
    const unsigned wdst = ws_addr + (32 * warp) * TC_WROW;

    auto issue_w = [&](int kt) {
        const unsigned dst = wdst + (kt % TC_STAGES) * TC_WSTAGE;
        const long long koff = (long long)kt * 72 + 8 * (lane & 7);
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            const bool ok = out0 + 4 * (v & 3) + (v >= 4 ? hi_rows : 0) < n_out;
            const unsigned char* src = (v >= 4 ? p_hi : p_lo) + (v & 3) * rb4 + koff;
            tc_cp8(dst + (4 * v + r0) * TC_WROW + 8 * (lane & 7), ok ? src : expert_a, ok ? 8 : 0);
        }
        tc_cp8(dst + lane * TC_WROW + 64, ok8 ? p8 + (long long)kt * 72 : expert_a, ok8 ? 8 : 0);
    };

    // Input role: items (route row r, block b, lane-quad t) of a k-tile, r = tid/16 + 16u.
    const int xr = tid >> 4, xb = (tid >> 2) & 3, xt = tid & 3;
    float4 xv[4][2];
    auto load_x = [&](int kt) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (u < m_active) {
                const int src = s_src[xr + 16 * u];
                if (src >= 0) {
                    const float4* p = reinterpret_cast<const float4*>(
                        x + (long long)src * n_in + kt * TC_KT + 32 * xb + 4 * xt);
                    xv[u][0] = __ldg(p);
                    xv[u][1] = __ldg(p + 4);
                } else {
                    xv[u][0] = make_float4(0.f, 0.f, 0.f, 0.f);
                    xv[u][1] = xv[u][0];
                }
            }
        }
    };
    auto store_x = [&](int buf) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (u < m_active) {
                unsigned* row = reinterpret_cast<unsigned*>(tc_smem + TC_STAGES * TC_WSTAGE +
                                                            buf * TC_ABUF +
                                                            (xr + 16 * u) * TC_AROW) +
                                16 * xb + xt;
                const float4 a = xv[u][0], b = xv[u][1];
                row[0] = tc_pack_f16(__fmul_rn(a.x, x_scale), __fmul_rn(b.x, x_scale));
                row[4] = tc_pack_f16(__fmul_rn(a.y, x_scale), __fmul_rn(b.y, x_scale));
                row[8] = tc_pack_f16(__fmul_rn(a.z, x_scale), __fmul_rn(b.z, x_scale));
                row[12] = tc_pack_f16(__fmul_rn(a.w, x_scale), __fmul_rn(b.w, x_scale));
            }
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.0f;

    __syncthreads();  // s_src
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < nk) issue_w(s);
        tc_commit();
    }
    load_x(0);
    store_x(0);

    // ldmatrix x4 lane addressing: lanes 0-15 rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8.
    const unsigned a_lane = (unsigned)(((lane & 15) * TC_AROW) + (lane >> 4) * 16);
    for (int kt = 0; kt < nk; ++kt) {
        tc_wait_stages();
        __syncthreads();  // stage kt and A[kt&1] are complete; stage kt-1 and A[(kt+1)&1] are free
        if (kt + TC_STAGES - 1 < nk) issue_w(kt + TC_STAGES - 1);
        tc_commit();
        if (kt + 1 < nk) load_x(kt + 1);

        const unsigned char* wst =
            tc_smem + (kt % TC_STAGES) * TC_WSTAGE + (32 * warp + g) * TC_WROW;
        const unsigned abuf = as_addr + (kt & 1) * TC_ABUF + a_lane;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            unsigned bf[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned char* rp = wst + 8 * j * TC_WROW + 18 * b;
                const unsigned dh = *reinterpret_cast<const unsigned short*>(rp);
                tc_decode(tc_load_qs(rp, b, t), dh, bf[j]);
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    if (mt < m_active) {
                        unsigned a[4];
                        tc_ldmatrix_x4(a, abuf + mt * 16 * TC_AROW + (32 * b + 16 * s) * 2);
#pragma unroll
                        for (int j = 0; j < 4; ++j) tc_mma(acc[mt][j], a, bf[j][2 * s], bf[j][2 * s + 1]);
                    }
                }
            }
        }
        if (kt + 1 < nk) store_x((kt + 1) & 1);
    }

    // Accumulator (mt, j): c0, c1 = route 16mt+g, n 2t and 2t+1 of tile j; c2, c3 = route +8.
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
        if (mt >= m_active) continue;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = 16 * mt + g + 8 * hr;
            if (r >= rn) continue;
            float* yr = y + (long long)(rb + r) * n_out;
            if (swiglu) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int col = c0 + 16 * warp + 8 * j + 2 * t;
                    const float g0 = __fmul_rn(acc[mt][j][2 * hr], y_scale);
                    const float g1 = __fmul_rn(acc[mt][j][2 * hr + 1], y_scale);
                    const float u0 = __fmul_rn(acc[mt][j + 2][2 * hr], y_scale);
                    const float u1 = __fmul_rn(acc[mt][j + 2][2 * hr + 1], y_scale);
                    tc_store2(yr, col, n_out, pair, tc_silu_times(g0, u0), tc_silu_times(g1, u1));
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int col = c0 + 32 * warp + 8 * j + 2 * t;
                    tc_store2(yr, col, n_out, pair, __fmul_rn(acc[mt][j][2 * hr], y_scale),
                              __fmul_rn(acc[mt][j][2 * hr + 1], y_scale));
                }
            }
        }
    }
}

// ---- sm_90a: the same product on warpgroup MMAs ---------------------------------------------
//
// wgmma.m64nNk16 takes A from registers, so the decoded weights stay A fragments (64 weight rows
// a warpgroup instruction, 16 a warp, laid out as mma.m16n8k16's A) and the routes' inputs are
// B, read by the tensor cores from shared memory once a warpgroup rather than once a warp.
// blockIdx.y = an (expert, tile of up to WG_TM = 128 routes) pair; N = the tile's routes rounded
// up to 16 picks the instruction (wg_run<N>), so a 70-route expert costs one tile of N = 80,
// decoded once. blockIdx.x = 256 weight rows as before (SwiGLU: 128 gate + 128 up rows). Warp
// w = 4·wg + wq owns rows 16wq.. of two m64 tiles of its warpgroup wg: SwiGLU, tile 0 = gate
// and tile 1 = up rows of outputs c0 + 64wg + 16wq + (0..15), so one lane holds both halves of
// an output; down, tile i = rows c0 + 128wg + 64i + 16wq + (0..15). Weights arrive as in the
// mma.sync kernel (cp.async, TC_STAGES deep, each warp its own 32 rows).
//
// The input tile of k-tile kt is buffer kt % 3 of WG_XBUFS: k-group G = 4b + i (8 inputs, 16
// bytes) of route n at G·WG_XG + 16n, in the permuted order of the header (word t of group G
// holds inputs 32b + 4t + i and +16), which is wgmma's K-major core-matrix layout with no
// swizzle (8 routes × 16 bytes contiguous; LBO = WG_XG between k-groups, SBO = 128 between
// route octets). Three buffers: the one written during k-tile kt was last read by k-tile kt-2,
// whose wgmma groups every warpgroup waited for before the barrier that opened k-tile kt.
// Each k16 step is one commit group (both tiles); waiting for all but the newest before
// decoding the next step keeps a step's A registers alive exactly while its wgmma reads them.

#define WG_TM 128
#define WG_ROWS 256
#define WG_WSTAGE (WG_ROWS * TC_WROW)       // 20480
#define WG_XG (WG_TM * 16)                  // 2048
#define WG_XBUF (16 * WG_XG)                // 32768
#define WG_XBUFS 3
#define WG_SMEM (TC_STAGES * WG_WSTAGE + WG_XBUFS * WG_XBUF)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int N>
__device__ void wg_mma(float* d, const unsigned* a, unsigned long long desc);

template <>
__device__ __forceinline__ void wg_mma<16>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7"
                 "}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<32>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
                 "}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<48>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
                 "%18, %19, %20, %21, %22, %23"
                 "}, {%24, %25, %26, %27}, %28, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<64>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
                 "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<80>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
                 "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33,"
                 "%34, %35, %36, %37, %38, %39"
                 "}, {%40, %41, %42, %43}, %44, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<96>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
                 "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33,"
                 "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
                 "}, {%48, %49, %50, %51}, %52, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<112>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n112k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
                 "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33,"
                 "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49,"
                 "%50, %51, %52, %53, %54, %55"
                 "}, {%56, %57, %58, %59}, %60, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wg_mma<128>(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
                 "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33,"
                 "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49,"
                 "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int K>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(K) : "memory");
}

// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
template <int R>
__device__ __forceinline__ void wg_pin(float* d) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory descriptor of one k16 step of an input buffer: start (16-byte units), LBO =
// WG_XG (next k-group of 8), SBO = 128 (next 8 routes), no swizzle.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    return (unsigned long long)((addr >> 4) & 0x3fffu) |
           ((unsigned long long)(WG_XG >> 4) << 16) | ((unsigned long long)(128 >> 4) << 32);
}

template <int N>
__device__ __forceinline__ void wg_run(const unsigned char* __restrict__ Wa,
                                       const unsigned char* __restrict__ Wb,
                                       const float* __restrict__ x, float* __restrict__ y,
                                       const int* s_src, unsigned char* smem, int e, int rb,
                                       int rn, int n_in, int n_out, float x_scale, float y_scale) {
    const bool swiglu = Wb != nullptr;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = warp >> 2, wq = warp & 3, g = lane >> 2, t = lane & 3;
    const long long row_bytes = (long long)(n_in >> 5) * 18;
    const int nk = n_in / TC_KT;
    const int c0 = blockIdx.x * (swiglu ? WG_ROWS / 2 : WG_ROWS);

    // Copy role, as in expert_gemm_tc_iq4: pieces 0-7 of local rows 4v + lane/8 (v = 0..7),
    // then piece 8 of local row `lane`. Local row 16i + r of warp w is row r of its tile i.
    // Offsets within an expert's slice are 32-bit (the launcher checks the slice size), so
    // few registers hold the copy's addresses through the loop.
    const int rbi = (int)row_bytes;
    const unsigned char* expert_a = Wa + (long long)e * n_out * row_bytes;
    const unsigned char* expert_b = swiglu ? Wb + (long long)e * n_out * row_bytes : expert_a;
    const int r0 = lane >> 3;
    const int out0 = c0 + (swiglu ? 64 : 128) * wg + 16 * wq + r0;
    const int hi_rows = swiglu ? 0 : 64;
    const int out8 = c0 + (swiglu ? 64 * wg : 128 * wg + 64 * (lane >> 4)) + 16 * wq + (lane & 15);
    const unsigned char* base8 = (swiglu && lane >= 16) ? expert_b : expert_a;
    const unsigned ws_addr = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned xs_addr = ws_addr + TC_STAGES * WG_WSTAGE;
    const unsigned wdst = ws_addr + (32 * warp) * TC_WROW;

    auto issue_w = [&](int kt) {
        const unsigned dst = wdst + (kt % TC_STAGES) * WG_WSTAGE;
        const int koff = kt * 72 + 8 * (lane & 7);
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            const int row = out0 + 4 * (v & 3) + (v >= 4 ? hi_rows : 0);
            const bool ok = row < n_out;
            const unsigned char* src = (v >= 4 ? expert_b : expert_a) + (row * rbi + koff);
            tc_cp8(dst + (4 * v + r0) * TC_WROW + 8 * (lane & 7), ok ? src : expert_a, ok ? 8 : 0);
        }
        const bool ok8 = out8 < n_out;
        tc_cp8(dst + lane * TC_WROW + 64, ok8 ? base8 + (out8 * rbi + kt * 72 + 64) : expert_a,
               ok8 ? 8 : 0);
    };

    // Input role: item u of a thread is (route n, block b, lane-quad t) with (tid/4 + 64u) =
    // N·b + n, so a warp's items are 8 consecutive routes of one block: 8 × 64 contiguous bytes
    // read, 128 contiguous bytes written per word. The next k-tile's items are read in two
    // halves, [0, XA) over blocks 0-1 and [XA, XI) over blocks 2-3, to halve the registers
    // they hold. xo: the item's first input (x has fewer than 2^31 values), or -1 for zeros.
    constexpr int XI = N / 16, XA = (XI + 1) / 2;
    float4 xv[XI][2];
    int xo[XI];
#pragma unroll
    for (int u = 0; u < XI; ++u) {
        const int q4 = (tid >> 2) + 64 * u, n = q4 % N, b = q4 / N;
        const int src = s_src[n];
        xo[u] = src >= 0 ? src * n_in + 32 * b + 4 * t : -1;
    }
    auto load_x = [&](int kt, int u0, int u1) {
#pragma unroll
        for (int u = 0; u < XI; ++u) {
            if (u < u0 || u >= u1) continue;
            if (xo[u] >= 0) {
                const float4* p = reinterpret_cast<const float4*>(x + xo[u] + kt * TC_KT);
                xv[u][0] = __ldg(p);
                xv[u][1] = __ldg(p + 4);
            } else {
                xv[u][0] = make_float4(0.f, 0.f, 0.f, 0.f);
                xv[u][1] = xv[u][0];
            }
        }
    };
    auto store_x = [&](int buf, int u0, int u1) {
#pragma unroll
        for (int u = 0; u < XI; ++u) {
            if (u < u0 || u >= u1) continue;
            const int q4 = (tid >> 2) + 64 * u, n = q4 % N, b = q4 / N;
            unsigned char* base = smem + TC_STAGES * WG_WSTAGE + buf * WG_XBUF + 16 * n + 4 * t;
            const float4 a = xv[u][0], c = xv[u][1];
            *reinterpret_cast<unsigned*>(base + (4 * b + 0) * WG_XG) =
                tc_pack_f16(__fmul_rn(a.x, x_scale), __fmul_rn(c.x, x_scale));
            *reinterpret_cast<unsigned*>(base + (4 * b + 1) * WG_XG) =
                tc_pack_f16(__fmul_rn(a.y, x_scale), __fmul_rn(c.y, x_scale));
            *reinterpret_cast<unsigned*>(base + (4 * b + 2) * WG_XG) =
                tc_pack_f16(__fmul_rn(a.z, x_scale), __fmul_rn(c.z, x_scale));
            *reinterpret_cast<unsigned*>(base + (4 * b + 3) * WG_XG) =
                tc_pack_f16(__fmul_rn(a.w, x_scale), __fmul_rn(c.w, x_scale));
        }
    };
    // The tensor cores read the tile through the async proxy.
    auto fence_x = [] { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); };

    float acc0[N / 2], acc1[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        acc0[i] = 0.0f;
        acc1[i] = 0.0f;
    }
    wg_pin<N / 2>(acc0);
    wg_pin<N / 2>(acc1);

#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < nk) issue_w(s);
        tc_commit();
    }
    load_x(0, 0, XI);
    store_x(0, 0, XI);
    fence_x();

    for (int kt = 0; kt < nk; ++kt) {
        tc_wait_stages();
        __syncthreads();  // stage kt and input buffer kt % 3 are complete; stage kt-1 is free
        if (kt + TC_STAGES - 1 < nk) issue_w(kt + TC_STAGES - 1);
        tc_commit();
        const bool next = kt + 1 < nk;
        const int xnext = (kt + 1) % WG_XBUFS;
        if (next) load_x(kt + 1, 0, XA);

        const unsigned char* wst =
            smem + (kt % TC_STAGES) * WG_WSTAGE + (32 * warp + g) * TC_WROW;
        const unsigned xbuf = xs_addr + (kt % WG_XBUFS) * WG_XBUF;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            // Rows g and g+8 (h) of tiles 0 and 1 (i).
            unsigned q[2][2], d2[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned char* rp = wst + (16 * i + 8 * h) * TC_WROW + 18 * b;
                    d2[i][h] = tc_scale_pair(*reinterpret_cast<const unsigned short*>(rp));
                    q[i][h] = tc_load_qs(rp, b, t);
                }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                // A fragment: rows g, g+8 at k pair 2t (words 2s) and 2t+8 (words 2s+1).
                unsigned a[2][4];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    tc_decode_half(q[i][0], d2[i][0], s, a[i][0], a[i][2]);
                    tc_decode_half(q[i][1], d2[i][1], s, a[i][1], a[i][3]);
                }
                const unsigned long long desc = wg_desc(xbuf + (4 * b + 2 * s) * WG_XG);
                wg_fence();
                wg_mma<N>(acc0, a[0], desc);
                wg_mma<N>(acc1, a[1], desc);
                wg_commit();
                wg_wait<1>();
            }
            if (b == 1 && next) {
                store_x(xnext, 0, XA);
                load_x(kt + 1, XA, XI);
            }
        }
        if (next) {
            store_x(xnext, XA, XI);
            fence_x();
        }
    }
    wg_wait<0>();
    wg_pin<N / 2>(acc0);
    wg_pin<N / 2>(acc1);

    // Accumulator element 4j + 2h + c: weight row 16wq + g + 8h of the tile, route 8j + 2t + c.
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int r = 8 * j + 2 * t + c;
            if (r >= rn) continue;
            float* yr = y + (long long)(rb + r) * n_out;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = 16 * wq + g + 8 * h, k = 4 * j + 2 * h + c;
                if (swiglu) {
                    const int col = c0 + 64 * wg + row;
                    if (col < n_out)
                        yr[col] = tc_silu_times(__fmul_rn(acc0[k], y_scale),
                                                __fmul_rn(acc1[k], y_scale));
                } else {
                    const int col = c0 + 128 * wg + row;
                    if (col < n_out) yr[col] = __fmul_rn(acc0[k], y_scale);
                    if (col + 64 < n_out) yr[col + 64] = __fmul_rn(acc1[k], y_scale);
                }
            }
        }
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// As expert_gemm_tc_iq4 (same arguments but `pair`, same grid x), on warpgroup MMAs: grid y
// = ceil(R/128) + min(E, R), WG_SMEM bytes of dynamic shared memory. Built for sm_90a only;
// elsewhere the kernel does nothing and the launcher picks expert_gemm_tc_iq4.
extern "C" __global__ void __launch_bounds__(256, 1)
expert_gemm_wg_iq4(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                   const float* __restrict__ x, const int* __restrict__ offsets,
                   const int* __restrict__ route_token, float* __restrict__ y, int n_in,
                   int n_out, int n_expert, int n_x_rows, int n_routes, float x_scale,
                   float y_scale) {
    PDL_ENTER();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char wg_smem[];
    __shared__ int s_expert, s_tile;
    __shared__ int s_src[WG_TM];
    const int tid = threadIdx.x;
    if (tid < 32) tc_find_tile(offsets, n_expert, WG_TM, tid, &s_expert, &s_tile);
    __syncthreads();
    const int e = s_expert;
    if (e < 0) return;  // block-uniform, as below
    const int rb = min(max(offsets[e] + s_tile * WG_TM, 0), n_routes);
    const int rn = max(0, min(min(WG_TM, offsets[e + 1] - rb), n_routes - rb));
    if (rn <= 0) return;
    if (tid < WG_TM) {
        int src = -1;
        if (tid < rn) src = Wb != nullptr ? route_token[rb + tid] : rb + tid;
        s_src[tid] = (src >= 0 && src < n_x_rows) ? src : -1;
    }
    __syncthreads();
    switch ((rn + 15) >> 4) {
#define WG_CASE(m)                                                                            \
    case m:                                                                                   \
        wg_run<16 * m>(Wa, Wb, x, y, s_src, wg_smem, e, rb, rn, n_in, n_out, x_scale, y_scale); \
        break;
        WG_CASE(1)
        WG_CASE(2)
        WG_CASE(3)
        WG_CASE(4)
        WG_CASE(5)
        WG_CASE(6)
        WG_CASE(7)
        WG_CASE(8)
#undef WG_CASE
    }
#endif
}

// ---- Skinny products: a decode step's few routes an expert ---------------------------------
//
// At a decode step an expert has a handful of routes, so the tiles above (64 or 128 routes,
// 256 weight rows, one block a multiprocessor) multiply mostly padding and leave the chip
// waiting on a few long blocks. Here the weights are mma.m16n8k16's A operand (16 weight rows
// an instruction) and the routes its B operand (8 routes), so an expert's tile is padded to 8
// routes, not 64; and a block is small (16 outputs and all of K split over its warps), so a
// step's blocks are many and each multiprocessor keeps several in flight.
//
// Tiling. blockIdx.y = an (expert, tile of up to 8·NT routes) pair as in expert_gemm_tc_iq4
// (tc_find_tile; with offsets == nullptr the whole input is one expert and blockIdx.y counts
// its tiles, which is how the dense shared-expert and FFN products run). A row tile is SK_ROWS
// weight rows: SwiGLU, m16 tile mt holds gate rows c0 + 8mt + (0..7) then the up rows of the
// same outputs, so one lane's accumulator holds both halves of an output; down, rows c0 + 16mt
// + (0..15). A block's four warps cover 4/kw row tiles, kw warps a tile (the launcher picks kw:
// as few as still fill the chip, since a block's route lookup and epilogue are fixed costs).
// Warp phase p of a tile takes k-tiles p, p + kw, ... of SK_KT = 256 inputs (8 IQ4_NL blocks,
// 144 bytes a row, so a row's k-tile is whole 16-byte words): its own ring of STAGES weight
// stages filled by cp.async, no block barrier in the loop. At the end a tile's partial sums
// meet in shared memory and its phase-0 warp adds them in phase order: one writer an element
// and a fixed order, so a step repeats bit for bit. (H200, 32 tokens at the real shapes: the
// loop was bound by decoding the weights, 115 µs of gate+up with no weight traffic against
// 70 µs of weight traffic with no decoding, 141 µs both; a k-tile then took 1,433
// instructions a warp, now 1,229 (NT=1): the scale after the MMA, the codebook in
// registers, the copies' addresses stepped rather than divided.)
//
// Inputs. expert_x_f16 first narrows the input rows to f16 (times x_scale, as above) in the
// order the B fragments want: word 4t + m of a 32-value block holds inputs (4t + m, 4t + m +
// 16), so lane t's four pairs of a block are one 16-byte load, and they meet the weights'
// decode (sk_codes: lane t holds values 4t + i and 4t + i + 16 of a block) in the same K
// order.
//
// Numerics. The weights enter the MMA as 16·code, exact in f16; a block's two MMAs sum
// 16·code·x in f32 (products exact), and that sum is scaled by the block's d in f32 and added
// to the route's total (one fma a block, in K order). The inputs are rounded to f16 once, as
// in the tiles above; the weights are not rounded at all (the tiles round d·code to f16), and
// the decode is two instructions a weight pair shorter (no per-weight scale multiply).

#define SK_KT 256
#define SK_ROWB 144
#define SK_MT 2
#define SK_ROWS (16 * SK_MT)
#define SK_WSTAGE (SK_ROWS * SK_ROWB)             // 4608
// Staged inputs (XR = 4 routes): a stage also holds the first four routes' 512 bytes of the
// k-tile, each padded to 576 so that a warp's B-fragment loads take two wavefronts.
#define SKX_ROUTE 576

// xh[row][block][4t + m] = f16 pair (x[32 block + 4t + m], x[.. + 16]) · scale. n_in % 32 == 0.
// The rows of x2 (words2 words of xh) follow those of x: the shared expert's activations
// after the routes' in a down product that carries both (none: words2 = 0).
extern "C" __global__ void __launch_bounds__(256)
expert_x_f16(const float* __restrict__ x, unsigned* __restrict__ xh, long long words, float scale,
             const float* __restrict__ x2, long long words2) {
    PDL_ENTER();
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < words + words2;
         w += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(w & 15), t = j >> 2, m = j & 3;
        const float* xb = w < words ? x + (w >> 4) * 32 : x2 + ((w - words) >> 4) * 32;
        xh[w] = tc_pack_f16(__fmul_rn(xb[4 * t + m], scale), __fmul_rn(xb[4 * t + m + 16], scale));
    }
}

// The codebook's first halves, the placing byte and the selectors' base, read from memory
// once a thread: as compile-time constants ptxas kept them in uniform registers and copied
// them into vector registers before every lookup (a byte permute takes its table from vector
// registers), 133 copies in a k-tile of 1,430 instructions.
__device__ unsigned sk_consts[4] = {0x3f2d1801u, 0xa6998d81u, 0x74747474u, 0x32103210u};

// prmt.b32 as written: __byte_perm's selector is masked to the bits the mode reads, an
// instruction a permute that the selectors built here do not need.
__device__ __forceinline__ unsigned sk_prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// a >> (32 - log2 p) for a power of two p, as a multiply's high half: the integer multiply
// issues to the FMA pipe, a shift to the ALU pipe, which the decode's permutes and logic ops
// already keep busy at half rate.
__device__ __forceinline__ unsigned sk_shr(unsigned a, unsigned p) {
    unsigned r;
    asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(p));
    return r;
}

// 16·code of the 8 weights a lane holds of one block, exact f16 pairs: w[i] = (16·v[4t+i],
// 16·v[4t+i+16]) from qs bytes 4t..4t+3 (q). The lookup of tc_decode_half for both halves
// at once (the masks taken over 32 bits, the high half's selectors shifted down: a permute
// reads its selector's low 16 bits), without the scale: the skinny kernel multiplies by d
// after the MMA, in f32.
__device__ __forceinline__ void sk_codes(unsigned q, const unsigned k[4], unsigned w[4]) {
    const unsigned m = q & 0x77777777u;
    const unsigned s = (sk_shr(q, 0x80000000u) & 0x44444444u) | k[3];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const unsigned mh = hf ? sk_shr(m, 0x10000u) : m;
        const unsigned sh = hf ? sk_shr(s, 0x10000u) : s;
        const unsigned r = sk_prmt(sk_prmt(k[0], 0x766a5d4fu, mh), sk_prmt(k[1], 0xf1d9c5b5u, mh), sh);
        unsigned c0, c1;
        asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(c0) : "r"(sk_prmt(r, k[2], 0x4140u)), "r"(0x74807480u));
        asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(c1) : "r"(sk_prmt(r, k[2], 0x4342u)), "r"(0x74807480u));
        w[2 * hf] = c0;
        w[2 * hf + 1] = c1;
    }
}

__device__ __forceinline__ float sk_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// ---- The skinny kernel on integer MMAs (8-route tiles) ----------------------------------------
//
// The f16 path above spends ~19 instructions decoding a lane's 8 weights of a block, 12 of
// them on the half-rate ALU pipe (ten byte permutes and the masks), and the pipe bounds the
// loop. Here the codes stay the codebook's signed bytes (three permutes for four, no f16
// placement or subtraction) and enter mma.m16n8k32.s8 as the A operand; the inputs are
// quantized per row to 16 bits held as two signed bytes, q = 256·hi + lo with |q| ≤ 32512
// and s = amax/32512 (as moe.cu's integer GEMV, but one scale a row, so a block's sum needs
// no scale of its own), and a route's hi and lo bytes are two B columns: an n8 tile takes four
// routes, an 8-route tile two n8 tiles. The MMA's accumulator input is 1.5·2^23's bits, so a
// column's exact integer sum c (|c| ≤ 32·127·128 < 2^22) comes out as the f32 1.5·2^23 + c,
// one exact subtraction from c: no integer-to-float conversion. A block's 256·c_hi + c_lo is
// then scaled by its d in f32 and added in K order, as the f16 path does; the row's scale s is
// applied once at the end. An input value is off by at most s/2 = amax/65024 of its row's
// largest, against f16's 2^-12 of each value.
#define SKQ_Q 32512.0f
#define SKQ_MAGIC 0x4B400000
#define SKQ_MAGIC_F 12582912.0f

// xq (uint2 a lane's pair) of row r: n_in/32 blocks of 64 bytes, the hi bytes' 32 then the lo
// bytes'; in each, word 2t is lane t's b0 (values 4t, 4t+16, 4t+1, 4t+17 of the block: the
// order the codes' permutes give) and word 2t+1 its b1 (4t+2, 4t+18, 4t+3, 4t+19). sx[r] = s,
// NaN where the row holds a NaN or an infinity so that every output it reaches is NaN, as the
// f32 path's would be. Rows of x2 (rows2 of them) follow those of x. One block a row.
extern "C" __global__ void __launch_bounds__(128)
expert_x_q16(const float* __restrict__ x, uint2* __restrict__ xq, float* __restrict__ sx, int rows,
             int n_in, const float* __restrict__ x2, int rows2) {
    PDL_ENTER();
    __shared__ float s_max[4], s_poison[4];
    const int row = blockIdx.x, tid = threadIdx.x;
    if (row >= rows + rows2) return;
    const float* xr = row < rows ? x + (long long)row * n_in : x2 + (long long)(row - rows) * n_in;
    float amax = 0.0f, poison = 0.0f;
    for (int i = tid; i < n_in; i += blockDim.x) {
        const float v = xr[i];
        amax = fmaxf(amax, fabsf(v));
        poison += v * 0.0f;  // NaN for a NaN or an infinity, else 0
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        poison += __shfl_xor_sync(0xffffffffu, poison, o);
    }
    if ((tid & 31) == 0) {
        s_max[tid >> 5] = amax;
        s_poison[tid >> 5] = poison;
    }
    __syncthreads();
    amax = fmaxf(fmaxf(s_max[0], s_max[1]), fmaxf(s_max[2], s_max[3]));
    poison = s_poison[0] + s_poison[1] + s_poison[2] + s_poison[3];
    if (tid == 0) sx[row] = __fdiv_rn(amax, SKQ_Q) + poison;
    const float inv = amax > 0.0f ? __fdiv_rn(SKQ_Q, amax) : 0.0f;
    uint2* out = xq + (long long)row * (n_in >> 2);
    // One thread a (block, lane t) pair: its b0 and b1 of both parts.
    for (int p = tid; p < (n_in >> 3); p += blockDim.x) {
        const int b = p >> 2, t = p & 3;
        const float* xb = xr + 32 * b + 4 * t;
        unsigned hw[2] = {0u, 0u}, lw[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            // Word k/4, byte k%4: values 4t + 2(k/4) + (k%4)/2, plus 16 for odd k.
            const int off = 2 * (k >> 2) + ((k & 3) >> 1) + 16 * (k & 1);
            const int q = max(-32512, min(32512, __float2int_rn(__fmul_rn(xb[off], inv))));
            const int hi = (q + 128) >> 8, lo = q - hi * 256;
            hw[k >> 2] |= ((unsigned)hi & 0xffu) << (8 * (k & 3));
            lw[k >> 2] |= ((unsigned)lo & 0xffu) << (8 * (k & 3));
        }
        out[8 * b + t] = make_uint2(hw[0], hw[1]);
        out[8 * b + 4 + t] = make_uint2(lw[0], lw[1]);
    }
}

// The codebook as signed bytes (entries 0-3, 4-7, 8-11, 12-15), read from memory once a
// thread, as sk_consts.
__device__ unsigned skq_consts[4] = {0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u};

// The 8 codes of qs bytes 4t..4t+3 (q) as signed bytes: c[0] = values 4t, 4t+16, 4t+1, 4t+17
// (the low 16 bits' nibbles in order), c[1] = 4t+2, 4t+18, 4t+3, 4t+19. Entries 0-7 and 8-15
// by a nibble's low 3 bits, then its bit 3 picks between them.
__device__ __forceinline__ void skq_codes(unsigned q, const unsigned k[4], unsigned c[2]) {
    const unsigned mm = q & 0x77777777u;
    const unsigned sl = (sk_shr(q, 0x80000000u) & 0x44444444u) | 0x32103210u;
    c[0] = sk_prmt(sk_prmt(k[0], k[1], mm), sk_prmt(k[2], k[3], mm), sl);
    const unsigned mh = sk_shr(mm, 0x10000u), sh = sk_shr(sl, 0x10000u);
    c[1] = sk_prmt(sk_prmt(k[0], k[1], mh), sk_prmt(k[2], k[3], mh), sh);
}

template <bool B, class T, class F>
struct sk_pick {
    using type = T;
};
template <class T, class F>
struct sk_pick<false, T, F> {
    using type = F;
};

// d = a·b + (magic in every element): four column sums as 1.5·2^23 + c in f32 bits.
__device__ __forceinline__ void skq_mma(unsigned d[4], const unsigned a[4], unsigned b0,
                                        unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(SKQ_MAGIC));
}

// 256·c_hi + c_lo of a column pair the MMA gave as magic-biased f32 bits.
__device__ __forceinline__ float skq_pair(unsigned hi, unsigned lo) {
    return __fmaf_rn(256.0f, __fsub_rn(__uint_as_float(hi), SKQ_MAGIC_F),
                     __fsub_rn(__uint_as_float(lo), SKQ_MAGIC_F));
}

// The A fragment of block b of rows rp and rq (8 rows apart: m16 rows g and g + 8) for lane
// t of its quad, and the two rows' block scales.
__device__ __forceinline__ void skq_a_rows(const unsigned char* rp, const unsigned char* rq, int b,
                                           int t, const unsigned kc[4], unsigned a[4], float* dl,
                                           float* dh) {
    unsigned cl[2], ch[2];
    skq_codes(tc_load_qs(rp, b, t), kc, cl);
    skq_codes(tc_load_qs(rq, b, t), kc, ch);
    *dl = sk_h2f(*reinterpret_cast<const unsigned short*>(rp));
    *dh = sk_h2f(*reinterpret_cast<const unsigned short*>(rq));
    a[0] = cl[0];
    a[1] = ch[0];
    a[2] = cl[1];
    a[3] = ch[1];
}

__device__ __forceinline__ void sk_cp16(unsigned dst, const unsigned char* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}

template <int STAGES>
__device__ __forceinline__ void sk_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
}

// grid (ceil(row tiles / (4/kw)), route tiles), block 128, dynamic shared memory
// 4·STAGES·SK_WSTAGE + (4/kw)·(kw-1)·SK_MT·NT·4·32·4. n_in % 256 == 0; Wa, Wb 16-byte
// aligned; xh as expert_x_f16 wrote it (SwiGLU: one row a token, route r reads row
// route_token[r], or r without a table; down: one row a route).
//
// The shared expert beside the routed ones (Sa non-null; grouped mode): blocks y >= sh_tile0
// take its n_sh rows in tiles of TM, every token one route of it, weights Sa (Sb: up), inputs
// from xh row sh_x0 + r (SwiGLU: the token's own row, sh_x0 = 0; down: its activation row
// after the routes'), outputs to y_sh. Its tiles are the dense product's, so one launch reads
// the routed and the shared weights and no launch of its own waits for the routed one.
//
// Q8: the integer path (NT = 1: an 8-route tile as two n8 tiles of four routes' hi and lo
// columns), xh holding expert_x_q16's rows and sx their scales; y_scale is unused.
template <int NT, bool Q8, int STAGES, int XW, int XR = 0>
__device__ __forceinline__ void expert_skinny_body(
    const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
    const uint4* __restrict__ xh, const float* __restrict__ sx, const int* __restrict__ offsets,
    const int* __restrict__ route_token, float* __restrict__ y, int n_in, int n_out, int n_expert,
    int n_x_rows, int n_routes, float y_scale, int kw, const unsigned char* __restrict__ Sa,
    const unsigned char* __restrict__ Sb, float* __restrict__ y_sh, int sh_tile0, int n_sh,
    int sh_x0) {
    extern __shared__ __align__(16) unsigned char sk_smem[];
    __shared__ int s_expert, s_tile;
    constexpr int TM = 8 * NT;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // Warp w takes row sub-tile w / kw and k-phase w % kw: kw warps share each sub-tile's K.
    const int kp = warp % kw, rs = warp / kw, subtiles = (blockDim.x >> 5) / kw;
    int e = 0, rb, rn;
    const bool shared = Sa != nullptr && (int)blockIdx.y >= sh_tile0;  // block-uniform
    if (shared) {
        rb = ((int)blockIdx.y - sh_tile0) * TM;
        rn = min(TM, n_sh - rb);
    } else if (offsets != nullptr) {
        if (warp == 0) tc_find_tile(offsets, n_expert, TM, lane, &s_expert, &s_tile);
        __syncthreads();
        e = s_expert;
        if (e < 0) return;  // block-uniform, as below
        rb = min(max(offsets[e] + s_tile * TM, 0), n_routes);
        rn = max(0, min(min(TM, offsets[e + 1] - rb), n_routes - rb));
    } else {
        rb = blockIdx.y * TM;
        rn = min(TM, n_routes - rb);
    }
    if (rn <= 0) return;
    const bool swiglu = Wb != nullptr;
    const long long row_bytes = (long long)(n_in >> 5) * 18;
    const int nk = n_in / SK_KT;
    const int xw = n_in >> 3;  // 16-byte words of an xh row
    const int c0 = (blockIdx.x * subtiles + rs) * (swiglu ? 8 * SK_MT : 16 * SK_MT);
    const int g = lane >> 2, t = lane & 3;
    const unsigned char* ea = shared ? Sa : Wa + (long long)e * n_out * row_bytes;
    const unsigned char* eb =
        swiglu ? (shared ? Sb : Wb + (long long)e * n_out * row_bytes) : ea;
    float* __restrict__ yo = shared ? y_sh : y;
    static_assert(!Q8 || NT == 1, "the integer path takes 8-route tiles");
    // n8 tiles with routes: 8 routes each, or on the integer path 4 (hi and lo columns).
    const int n_active = Q8 ? (rn + 3) >> 2 : (rn + 7) >> 3;

    static_assert(XR == 0 || (Q8 && XR == 4), "the integer path stages four routes");
    constexpr bool XS = XR > 0;
    // XS: the first XR routes' inputs ride the weight ring (cp.async, a stage ahead) instead
    // of global loads a few blocks ahead, which held 29% of the integer kernel's stall
    // samples at 8 sequences (bench/RESULTS.md 2026-12-07 (b)).
    constexpr int XROUTE = SKX_ROUTE;
    constexpr int STAGE_B = SK_WSTAGE + XR * XROUTE;
    constexpr int WARP_SMEM = STAGES * STAGE_B;
    const unsigned wbase = (unsigned)__cvta_generic_to_shared(sk_smem) + warp * WARP_SMEM;
    // Stage row i's 16-byte word p is chunk 9i + p of the stage; lane takes chunks lane + 32j
    // (j < 9), so a warp's copy is 512 contiguous stage bytes (~3.5 weight rows) and its
    // requests fill whole sectors. Chunk lane + 32(j+1) is 3 rows and 5 words past chunk
    // lane + 32j: the rows and words step without a division. (A stage row a lane, 16 bytes
    // from 32 rows an instruction, asked L2 for every sector twice, 16 bytes each, and wrote
    // shared memory a lane at a time: 44% excess sectors and 68% excess wavefronts, which cost
    // what its shorter addressing saved.)
    static_assert(SK_ROWS * 9 == 32 * 9, "nine chunks a lane");
    // A lane's nine copies keep their sources from k-tile to k-tile: the byte offset of copy j
    // in its matrix (a multiple of 16: row_bytes is a multiple of 144), with bit 0 set where
    // the row is live (below n_out; past it the copy zero-fills) and bit 1 where it is the up
    // weight's. Worked out once here, a k-tile's copies are a select and an add each; derived
    // per copy round they were 324 of a k-tile's 1,310 instructions (SASS, NT=1). One word a
    // copy: with the flags in masks beside the offsets the kernel spilled under NVRTC 13.0.
    // The launcher keeps n_out · row_bytes within 32 bits.
    unsigned goff[9];
    {
        int i = lane / 9, p = lane - 9 * (lane / 9);
#pragma unroll
        for (int j = 0; j < 9; ++j) {
            if (j > 0) {
                i += 3;
                p += 5;
                if (p >= 9) {
                    p -= 9;
                    ++i;
                }
            }
            const int out = swiglu ? c0 + 8 * (i >> 4) + (i & 7) : c0 + i;
            const bool up = swiglu && (i & 8);
            goff[j] = out < n_out ? ((unsigned)out * (unsigned)row_bytes + 16u * (unsigned)p) | 1u
                                  : 0u;
            goff[j] |= up ? 2u : 0u;
        }
    }
    // The xh row of route r of the tile, -1 for none.
    auto x_row = [&](int r) {
        int src = -1;
        if (r < rn)
            src = shared ? sh_x0 + rb + r
                         : (swiglu && route_token != nullptr) ? route_token[rb + r] : rb + r;
        return (src >= 0 && src < n_x_rows) ? src : -1;
    };
    // XS: lane l copies 16-byte chunk l of each staged route's 512 bytes a k-tile: its byte
    // offsets into xh (under 4 GiB), ~0u for a route the tile lacks (zero-filled). Set after
    // the first weight copies are issued (they need no route table).
    unsigned xsrc[XS ? XR : 1];
    const unsigned char* xbytes = reinterpret_cast<const unsigned char*>(xh);
    const unsigned my_dst = wbase + 16 * lane;
    auto issue_w = [&](int kt, int stage) {
        const unsigned dst = my_dst + stage * STAGE_B;
        const unsigned char* ak = ea + kt * SK_ROWB;
        const unsigned char* bk = eb + kt * SK_ROWB;
#pragma unroll
        for (int j = 0; j < 9; ++j) {
            // Opaque, so the compiler adds the offset here rather than holding nine 64-bit
            // sources across the loop.
            unsigned o;
            asm volatile("mov.b32 %0, %1;" : "=r"(o) : "r"(goff[j]));
            sk_cp16(dst + 512 * j, (o & 2u ? bk : ak) + (o & ~15u), o & 1u ? 16 : 0);
        }
    };
    auto issue_x = [&](int kt, int stage) {
        const unsigned dst = my_dst + stage * STAGE_B;
        if constexpr (XS) {
#pragma unroll
            for (int j = 0; j < XR; ++j) {
                unsigned o;
                asm volatile("mov.b32 %0, %1;" : "=r"(o) : "r"(xsrc[j]));
                const bool live = o != ~0u;
                sk_cp16(dst + SK_WSTAGE + XROUTE * j, xbytes + (live ? o + 512u * kt : 0u),
                        live ? 16 : 0);
            }
        }
    };
    auto issue = [&](int kt, int stage) {
        issue_w(kt, stage);
        issue_x(kt, stage);
    };

    // The weights first: they depend on the expert alone, the inputs on the route table too.
    // With XS the first copy group also holds the later prologue stages' weights (the waits
    // only ever wait for more).
    const int mine = (kp < nk && c0 < n_out) ? (nk - kp + kw - 1) / kw : 0;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < mine) issue_w(kp + kw * s, s);
        if constexpr (!XS) tc_commit();
    }
    if constexpr (XS) {
#pragma unroll
        for (int j = 0; j < XR; ++j) {
            const int r = x_row(j);
            xsrc[j] = r >= 0 ? (unsigned)r * (unsigned)(2 * n_in) + 16u * lane : ~0u;
        }
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < mine) issue_x(kp + kw * s, s);
            tc_commit();
        }
    }

    // This lane's route of each n8 tile (B column g) as an xh row, -1 for none; on the integer
    // path column g is route g/2's hi (even g) or lo bytes.
    constexpr int NB = Q8 ? 2 : NT;
    int xrow[NB];
#pragma unroll
    for (int nt = 0; nt < NB; ++nt) xrow[nt] = x_row(Q8 ? 4 * nt + (g >> 1) : 8 * nt + g);
    // B fragments of block b of k-tile kt: XW blocks are in flight while one is multiplied
    // (window slot b % XW), so an input's L2 latency hides behind XW - 1 blocks of decoding.
    using XFrag = typename sk_pick<Q8, uint2, uint4>::type;
    XFrag xq[XW][NB];
    // The integer path's lane offsets into xh in uint2 (the scratch stays under 4 GiB), ~0u
    // for none: addressed once here, a load is one add.
    const uint2* __restrict__ xq2 = reinterpret_cast<const uint2*>(xh);
    unsigned xoff[NB];
#pragma unroll
    for (int nt = 0; nt < NB; ++nt)
        xoff[nt] = xrow[nt] >= 0 ? (unsigned)xrow[nt] * (unsigned)(n_in >> 2) + (g & 1) * 4 + t : ~0u;
    // The integer path's inputs of the next k-tile, prefetched into L1 a k-tile ahead: loaded
    // from L2 only a few blocks ahead, they waited behind the weight copies' traffic (H100, 64
    // tokens: a sixth of the kernel's stall samples were its MMAs waiting for them). A route's
    // 512 bytes a k-tile are four lines; lane (nt = lane / 16, route 4·nt + (lane / 4) % 4, line
    // lane % 4) takes one, ~0u for none (uint2 units).
    unsigned pf_off = ~0u;
    if constexpr (Q8 && !XS) {
        const int pr = x_row(4 * (lane >> 4) + ((lane >> 2) & 3));
        if (pr >= 0) pf_off = (unsigned)pr * (unsigned)(n_in >> 2) + 16u * (lane & 3);
    }
    // TA: the n8 tiles a loop multiplies (the integer path's loop is built for one or two, so
    // that a tile of at most four routes skips the second's MMAs without a branch a block).
    auto load_x = [&](int ta, int kt, int b, int q) {
#pragma unroll
        for (int nt = XS ? 1 : 0; nt < NB; ++nt) {
            if (nt >= ta) continue;
            XFrag v{};
            if constexpr (Q8) {
                if (xoff[nt] != ~0u) v = __ldg(xq2 + xoff[nt] + (kt * 8 + b) * 8);
            } else {
                if (nt < n_active && xrow[nt] >= 0)
                    v = __ldg(xh + (long long)xrow[nt] * xw + (kt * 8 + b) * 4 + t);
            }
#pragma unroll
            for (int q2 = 0; q2 < XW; ++q2)
                if (q2 == q) xq[q2][nt] = v;
        }
    };

    float acc[SK_MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < SK_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[mt][nt][k] = 0.0f;
    unsigned kc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) kc[i] = Q8 ? skq_consts[i] : sk_consts[i];

    // Called with a constant ta, so each call inlines a loop of its own.
    auto k_loop = [&](int ta) {
        if (mine > 0) {
#pragma unroll
            for (int b = 0; b < XW; ++b) load_x(ta, kp, b, b);
        }
        for (int it = 0; it < mine; ++it) {
            const int kt = kp + kw * it;
            const bool more = it + 1 < mine;
            sk_wait<STAGES>();
            __syncwarp();  // every lane's copies of stage `it` landed; stage it-1 is read by all
            if (it + STAGES - 1 < mine) issue(kt + kw * (STAGES - 1), (it + STAGES - 1) % STAGES);
            tc_commit();
            if constexpr (Q8 && !XS) {
                if (more && pf_off != ~0u && (lane >> 4) < ta)
                    asm volatile("prefetch.global.L1 [%0];" ::"l"(xq2 + pf_off + (kt + kw) * 64));
            }

            const unsigned char* wst = sk_smem + warp * WARP_SMEM + (it % STAGES) * STAGE_B + g * SK_ROWB;
            // XS: lane (g, t)'s B fragment of route g/2's hi (even g) or lo bytes, block 0.
            const unsigned char* xst = sk_smem + warp * WARP_SMEM + (it % STAGES) * STAGE_B +
                                       SK_WSTAGE + ((g >> 1) % (XS ? XR : 1)) * XROUTE +
                                       (g & 1) * 32 + t * 8;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
#pragma unroll
                for (int mt = 0; mt < SK_MT; ++mt) {
                    const unsigned char* rp = wst + 16 * mt * SK_ROWB + 18 * b;
                    const unsigned char* rq = rp + 8 * SK_ROWB;
                    if constexpr (Q8) {
                        unsigned a[4];
                        float dl, dh;
                        skq_a_rows(rp, rq, b, t, kc, a, &dl, &dh);
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            if (j >= ta) continue;
                            // Lane (g, t) gets route 4j + t's hi and lo sums of rows g, g + 8.
                            unsigned d[4];
                            // XS: the first n8 tile's four routes are all in the ring.
                            const uint2 xv = XS && j == 0
                                                 ? *reinterpret_cast<const uint2*>(xst + 64 * b)
                                                 : xq[b % XW][j];
                            skq_mma(d, a, xv.x, xv.y);
                            acc[mt][0][2 * j] = __fmaf_rn(dl, skq_pair(d[0], d[1]), acc[mt][0][2 * j]);
                            acc[mt][0][2 * j + 1] =
                                __fmaf_rn(dh, skq_pair(d[2], d[3]), acc[mt][0][2 * j + 1]);
                        }
                    } else {
                        unsigned wl[4], wh[4];
                        sk_codes(tc_load_qs(rp, b, t), kc, wl);
                        sk_codes(tc_load_qs(rq, b, t), kc, wh);
                        const float dl = sk_h2f(*reinterpret_cast<const unsigned short*>(rp));
                        const float dh = sk_h2f(*reinterpret_cast<const unsigned short*>(rq));
                        const unsigned a0[4] = {wl[0], wh[0], wl[1], wh[1]};
                        const unsigned a1[4] = {wl[2], wh[2], wl[3], wh[3]};
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            if (nt < n_active) {
                                // The block's sum of 16·code·x, exact products in f32, then its scale.
                                float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                                tc_mma(p, a0, xq[b % XW][nt].x, xq[b % XW][nt].y);
                                tc_mma(p, a1, xq[b % XW][nt].z, xq[b % XW][nt].w);
                                acc[mt][nt][0] = fmaf(dl, p[0], acc[mt][nt][0]);
                                acc[mt][nt][1] = fmaf(dl, p[1], acc[mt][nt][1]);
                                acc[mt][nt][2] = fmaf(dh, p[2], acc[mt][nt][2]);
                                acc[mt][nt][3] = fmaf(dh, p[3], acc[mt][nt][3]);
                            }
                        }
                    }
                }
                if (b + XW < 8) {
                    load_x(ta, kt, b + XW, b % XW);
                } else if (more) {
                    load_x(ta, kt + kw, b + XW - 8, b % XW);
                }
            }
        }
    };
    if constexpr (Q8) {
        if (n_active > 1)
            k_loop(2);
        else
            k_loop(1);
    } else {
        k_loop(NT);
    }

    // A sub-tile's partials, added in k-phase order by its phase-0 warp. Each later phase's
    // warp leaves them in its own weight ring, which it has finished with (no shared memory
    // beyond the rings: the staged kernel's four blocks fill the multiprocessor with them).
    if (kw > 1) {
        constexpr int PER = SK_MT * NT * 4;
        static_assert(PER * 32 * 4 <= WARP_SMEM, "a warp's partials fit its ring");
        if (kp > 0) {
            asm volatile("cp.async.wait_all;" ::: "memory");
            __syncwarp();  // every lane is past its last read of the ring
            float* red = reinterpret_cast<float*>(sk_smem + warp * WARP_SMEM);
#pragma unroll
            for (int mt = 0; mt < SK_MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int k = 0; k < 4; ++k) red[((mt * NT + nt) * 4 + k) * 32 + lane] = acc[mt][nt][k];
        }
        __syncthreads();
        if (kp != 0) return;
        for (int w = 1; w < kw; ++w) {
            const float* red = reinterpret_cast<const float*>(sk_smem + (warp + w) * WARP_SMEM);
#pragma unroll
            for (int mt = 0; mt < SK_MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        acc[mt][nt][k] = __fadd_rn(acc[mt][nt][k], red[((mt * NT + nt) * 4 + k) * 32 + lane]);
        }
    }

    if constexpr (Q8) {
        // acc[mt][0][2j + h]: route 4j + t, m-row g + 8h, in units of its row's scale.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = 4 * j + t;
            if (j >= n_active || r >= rn) continue;
            const int src = x_row(r);
            const float s = src >= 0 ? sx[src] : 0.0f;
            float* yr = yo + (long long)(rb + r) * n_out;
#pragma unroll
            for (int mt = 0; mt < SK_MT; ++mt) {
                const float v0 = __fmul_rn(acc[mt][0][2 * j], s);
                const float v1 = __fmul_rn(acc[mt][0][2 * j + 1], s);
                if (swiglu) {
                    const int o = c0 + 8 * mt + g;
                    if (o < n_out) yr[o] = tc_silu_times(v0, v1);
                } else {
                    const int o = c0 + 16 * mt + g;
                    if (o < n_out) yr[o] = v0;
                    if (o + 8 < n_out) yr[o + 8] = v1;
                }
            }
        }
        return;
    }
    // Accumulator (mt, nt): c0, c1 = m-row g, routes 8nt + 2t and +1; c2, c3 = m-row g + 8.
#pragma unroll
    for (int mt = 0; mt < SK_MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (nt >= n_active) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 8 * nt + 2 * t + h;
                if (r >= rn) continue;
                float* yr = yo + (long long)(rb + r) * n_out;
                if (swiglu) {
                    const int o = c0 + 8 * mt + g;
                    if (o < n_out)
                        yr[o] = tc_silu_times(__fmul_rn(acc[mt][nt][h], y_scale),
                                              __fmul_rn(acc[mt][nt][2 + h], y_scale));
                } else {
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const int o = c0 + 16 * mt + g + 8 * hr;
                        if (o < n_out) yr[o] = __fmul_rn(acc[mt][nt][2 * hr + h], y_scale);
                    }
                }
            }
        }
    }
}

// MINB blocks a multiprocessor: the registers' bound; the launcher's shared memory (STAGES
// stages a warp) lets as many in.
#define EXPERT_SKINNY_X(NAME, NT, Q8, STAGES, XW, MINB, XR)                                     \
    extern "C" __global__ void __launch_bounds__(128, MINB) NAME(                               \
        const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,             \
        const uint4* __restrict__ xh, const float* __restrict__ sx,                             \
        const int* __restrict__ offsets, const int* __restrict__ route_token,                   \
        float* __restrict__ y, int n_in, int n_out, int n_expert, int n_x_rows, int n_routes,   \
        float y_scale, int kw, const unsigned char* __restrict__ Sa,                            \
        const unsigned char* __restrict__ Sb, float* __restrict__ y_sh, int sh_tile0, int n_sh, \
        int sh_x0) {                                                                            \
        PDL_ENTER();                                                                            \
        expert_skinny_body<NT, Q8, STAGES, XW, XR>(Wa, Wb, xh, sx, offsets, route_token, y,     \
                                                   n_in, n_out, n_expert, n_x_rows, n_routes,   \
                                                   y_scale, kw, Sa, Sb, y_sh, sh_tile0, n_sh,   \
                                                   sh_x0);                                      \
    }
#define EXPERT_SKINNY(NAME, NT, Q8, STAGES, XW, MINB) \
    EXPERT_SKINNY_X(NAME, NT, Q8, STAGES, XW, MINB, 0)
EXPERT_SKINNY(expert_skinny_iq4_1, 1, false, 3, 4, 4)
EXPERT_SKINNY(expert_skinny_iq4_2, 2, false, 3, 4, 3)
// The integer path trades a stage of its ring and half its input window for a fifth block a
// multiprocessor (92 registers): 20 warps hide more of each other's waits than three stages do.
EXPERT_SKINNY(expert_skinny_iq4_q, 1, true, 2, 4, 5)
// The deep ring (three stages, a four-block window, four blocks): where every expert has a
// route or two, each warp walks all of gate+up's 14 k-tiles alone on one n8 tile and waits on
// its copies more than on its neighbours (H100, 32 sequences: 139 µs a layer against 148).
EXPERT_SKINNY(expert_skinny_iq4_q3, 1, true, 3, 4, 4)
// The first four routes' inputs through the weight ring (2.3 KB more a stage: four blocks a
// multiprocessor); the other four's from global memory in a four-block window.
EXPERT_SKINNY_X(expert_skinny_iq4_qs, 1, true, 2, 4, 4, 4)
#undef EXPERT_SKINNY
#undef EXPERT_SKINNY_X

// ---- The integer expert products streamed through a block's ring (sm_90) ----------------------
//
// expert_skinny_iq4_q's arithmetic (codes as signed bytes, 16-bit inputs as hi and lo MMA
// columns, a block's 256·c_hi + c_lo scaled by its d in f32) on another schedule. There each
// warp copies its own k-tiles into a two-stage ring and waits on them: at 4 routes an expert
// (64 sequences) a fifth of its stall samples were those waits and a third its MMAs waiting for
// inputs loaded from L2, and the kernel read 39% of the copy ceiling. Here a persistent block
// of ST_WARPS warps walks a contiguous share of the step's (expert, unit) work, expert by
// expert:
// - A unit is 16·MT whole weight rows (SwiGLU: 8 outputs' gate rows then their up rows, MT = 1;
//   down: 64 output rows, MT = 4). A unit moves into a slot of the block's ring (rows padded so
//   that the fragments' loads meet no bank twice) as soon as every warp is done with the
//   slot's previous unit, by 16-byte cp.async copies whose completion each lane of the issuing
//   warp counts on the slot's full barrier, or (_bulk) one bulk copy a row counted in bytes.
// - Every warp takes one m16 tile and one K slice of the unit (ST_WARPS / MT slices):
//   it decodes each weight of its slice once for up to 16 routes (a pass; experts with more
//   routes take more passes over the same rows, which L2 then holds).
// - The warps' partial sums go to the slot's reduction area; the last warp to finish (a shared
//   counter) refills the slot, then adds them in slice order, scales them by the routes' input
//   scales and writes the outputs. Every output has one writer and a fixed order, so a run
//   repeats bit for bit; the sums differ from expert_skinny_iq4_q's only in being added in
//   slices, not end to end.
// - Blocks split the work by a cost of 4 a pass plus 1 an n8 tile of routes a unit, so the
//   shared expert's many routes weigh as they cost; a block's units are consecutive, so it
//   reads the same routes' inputs unit after unit (from L1).
// The inputs are expert_x_q16's rows (xh, sx); route and row rules are expert_skinny_iq4_q's.
#define ST_WARPS 8
#define ST_TILES 4                                // n8 tiles a pass: 16 routes
#define ST_PASS (4 * ST_TILES)
#define ST_RED (ST_WARPS * ST_TILES * 2 * 32)     // floats of a use of a slot's partial sums
#define ST_ENTRIES 257                            // routed experts a launch may have, + shared

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ST_BULK 1
#else
#define ST_BULK 0
#endif

__device__ __forceinline__ void st_mbar_init(unsigned bar, unsigned count) {
#if ST_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void st_mbar_expect(unsigned bar, unsigned bytes) {
#if ST_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void st_mbar_wait(unsigned bar, unsigned parity) {
#if ST_BULK
    asm volatile(
        "{\n .reg .pred done;\n ST_WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra ST_WAIT_%=;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}
__device__ __forceinline__ void st_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if ST_BULK
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
}

// The block's list of experts with routes (the shared expert first), their routes and the
// cost of the work before each, and the walk over its share of (entry, unit, pass) items.
struct StList {
    const int* e;       // expert, -1 for the shared one
    const int* r0;      // first route (the shared one: 0)
    const int* r1;      // end of routes
    const int* prefix;  // cost of the units of the entries before (n + 1)
    int n;
};

__device__ __forceinline__ int st_unit_cost(int routes) {
    return 4 * ((routes + ST_PASS - 1) / ST_PASS) + (routes + 3) / 4;
}

struct StWalk {
    int k, unit, pass;  // k == n: done
};

// The first item of the block's share: units whose cost starts in [lo, hi).
__device__ __forceinline__ StWalk st_first(const StList& L, int units, long long lo) {
    StWalk w{L.n, 0, 0};
    for (int k = 0; k < L.n; ++k) {
        if (L.prefix[k + 1] <= lo) continue;
        const int c = st_unit_cost(L.r1[k] - L.r0[k]);
        const long long into = lo - L.prefix[k];
        const int j = into <= 0 ? 0 : (int)((into + c - 1) / c);
        if (j < units) return StWalk{k, j, 0};
    }
    return w;
}

__device__ __forceinline__ bool st_live(const StList& L, const StWalk& w, int units, long long hi) {
    if (w.k >= L.n) return false;
    const int c = st_unit_cost(L.r1[w.k] - L.r0[w.k]);
    return L.prefix[w.k] + (long long)w.unit * c < hi;
}

__device__ __forceinline__ void st_next(const StList& L, StWalk& w, int units) {
    const int passes = (L.r1[w.k] - L.r0[w.k] + ST_PASS - 1) / ST_PASS;
    if (++w.pass < passes) return;
    w.pass = 0;
    if (++w.unit < units) return;
    w.unit = 0;
    ++w.k;
}

// One consumer warp's K slice [b0, b1) of m-tile rows (wt: the slot's tile base) for TA n8
// tiles of routes: acc[j][h] = route 4j + t's sum of row g + 8h, in units of its input scale.
template <int TA>
__device__ __forceinline__ void st_slice(const unsigned char* wt, int pitch, int b0, int b1,
                                         const uint2* __restrict__ xq2, const unsigned xoff[ST_TILES],
                                         int n_tiles, const unsigned kc[4], float acc[ST_TILES][2]) {
    constexpr int XW = TA >= 4 ? 2 : 4;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint2 xq[XW][TA];
    auto load_x = [&](int b, int slot) {
#pragma unroll
        for (int j = 0; j < TA; ++j) {
            uint2 v = make_uint2(0u, 0u);
            if (j < n_tiles && xoff[j] != ~0u) v = __ldg(xq2 + xoff[j] + b * 8);
#pragma unroll
            for (int q = 0; q < XW; ++q)
                if (q == slot) xq[q][j] = v;
        }
    };
#pragma unroll
    for (int q = 0; q < XW; ++q)
        if (b0 + q < b1) load_x(b0 + q, q);
    const unsigned char* rp0 = wt + g * pitch;
    const unsigned char* rq0 = rp0 + 8 * pitch;
    for (int bb = b0; bb < b1; bb += XW) {
#pragma unroll
        for (int q = 0; q < XW; ++q) {
            const int b = bb + q;
            if (b >= b1) break;
            const unsigned char* rp = rp0 + 18 * b;
            const unsigned char* rq = rq0 + 18 * b;
            unsigned a[4];
            float dl, dh;
            skq_a_rows(rp, rq, b, t, kc, a, &dl, &dh);
#pragma unroll
            for (int j = 0; j < TA; ++j) {
                if (TA > 1 && j >= n_tiles) continue;
                unsigned d[4];
                skq_mma(d, a, xq[q][j].x, xq[q][j].y);
                acc[j][0] = __fmaf_rn(dl, skq_pair(d[0], d[1]), acc[j][0]);
                acc[j][1] = __fmaf_rn(dh, skq_pair(d[2], d[3]), acc[j][1]);
            }
            if (b + XW < b1) load_x(b + XW, q);
        }
    }
}

// A unit's rows into a slot (dst0), by the whole calling warp: one bulk copy a row counted in
// bytes on the slot's full barrier (lane 0 expects them), or 16-byte cp.async copies along each
// row whose completion every lane counts on it (the barrier's count is then 32).
template <bool BULK>
__device__ __forceinline__ void st_issue(const StList& L, const StWalk& w,
                                         const unsigned char* __restrict__ Wa,
                                         const unsigned char* __restrict__ Wb,
                                         const unsigned char* __restrict__ Sa,
                                         const unsigned char* __restrict__ Sb, bool swiglu,
                                         long long mat, long long row_bytes, int outs,
                                         int unit_rows, int n_out, int pitch, unsigned dst0,
                                         unsigned full) {
    const int lane = threadIdx.x & 31;
    const int e = L.e[w.k];
    const unsigned char* ga = e < 0 ? Sa : Wa + e * mat;
    const unsigned char* gb = swiglu ? (e < 0 ? Sb : Wb + e * mat) : ga;
    const int o0 = w.unit * outs;
    const int live = min(outs, n_out - o0);
    // The slot's readers were done before this warp learned that it is free: their generic
    // reads come before the async proxy's writes.
#if ST_BULK
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    if constexpr (BULK) {
        const unsigned bytes = (unsigned)((swiglu ? 2 * live : live) * row_bytes);
        if (lane == 0) st_mbar_expect(full, bytes);
        __syncwarp();
        for (int i = lane; i < unit_rows; i += 32) {
            const int o = swiglu ? (i & 7) : i;
            if (o >= live) continue;
            const unsigned char* src = (swiglu && (i & 8) ? gb : ga) + (o0 + o) * row_bytes;
            st_bulk(dst0 + i * pitch, src, (unsigned)row_bytes, full);
        }
    } else {
        const int chunks = (int)(row_bytes >> 4);
        for (int i = 0; i < unit_rows; ++i) {
            const int o = swiglu ? (i & 7) : i;
            if (o >= live) continue;
            const unsigned char* src = (swiglu && (i & 8) ? gb : ga) + (o0 + o) * row_bytes;
            for (int c = lane; c < chunks; c += 32) sk_cp16(dst0 + i * pitch + 16 * c, src + 16 * c, 16);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
    }
}

// grid: a wave of persistent blocks, two a multiprocessor, block 32·ST_WARPS. Arguments as
// expert_skinny_iq4_q's grouped mode (xh, sx from expert_x_q16; the shared expert Sa/Sb with
// n_sh routes, inputs from row sh_x0 + r), plus mt (m16 tiles a unit: 1 in SwiGLU mode), pitch
// (bytes a staged row: row bytes, padded) and slots (the ring's). Dynamic shared memory:
// slots·16·mt·pitch of ring, 2·slots·ST_RED floats, slots barriers and slots counters, then
// the list (4·ST_ENTRIES + 2 ints).
//
// No warp only copies: a ninth warp made 288 threads, whose registers (110 each) a
// multiprocessor's four register files hold for one block only, and the persistent grid ran
// as two waves of one block each (Nsight Compute, H100: block limit by registers 1). Warp 0
// fills the ring first; after that the last warp to finish a unit refills its slot with the
// unit `slots` ahead before it adds the partial sums (the sums of consecutive uses of a slot
// alternate between two areas, so the refill need not wait for them).
template <bool BULK>
__device__ __forceinline__ void expert_stream_body(const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,
                    const uint4* __restrict__ xh, const float* __restrict__ sx,
                    const int* __restrict__ offsets, const int* __restrict__ route_token,
                    float* __restrict__ y, int n_in, int n_out, int n_expert, int n_x_rows,
                    int n_routes, const unsigned char* __restrict__ Sa,
                    const unsigned char* __restrict__ Sb, float* __restrict__ y_sh, int n_sh,
                    int sh_x0, int mt_n, int pitch, int slots) {
    extern __shared__ __align__(16) unsigned char st_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bool swiglu = Wb != nullptr;
    const bool has_sh = Sa != nullptr && n_sh > 0;
    const int unit_rows = 16 * mt_n;
    const long long slot_bytes = (long long)unit_rows * pitch;
    float* red = reinterpret_cast<float*>(st_smem + slots * slot_bytes);
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(red + 2 * slots * ST_RED);
    int* cnt = reinterpret_cast<int*>(bars + slots);
    int* le = cnt + slots;
    int* lr0 = le + ST_ENTRIES;
    int* lr1 = lr0 + ST_ENTRIES;
    int* lpre = lr1 + ST_ENTRIES;  // ST_ENTRIES + 1
    int* ln = lpre + ST_ENTRIES + 1;
    const int outs = swiglu ? 8 : unit_rows;
    const int units = (n_out + outs - 1) / outs;
    const long long row_bytes = (long long)(n_in >> 5) * 18;
    const long long mat = (long long)n_out * row_bytes;

    if (warp == 0) {
        // The list: the shared expert, then every expert with routes, and the prefix of costs.
        int base = 0, run = 0;
        if (has_sh) {
            if (lane == 0) {
                le[0] = -1;
                lr0[0] = 0;
                lr1[0] = n_sh;
                lpre[0] = 0;
            }
            base = 1;
            run = units * st_unit_cost(n_sh);
        } else if (lane == 0) {
            lpre[0] = 0;
        }
        for (int e0 = 0; e0 < n_expert; e0 += 32) {
            const int e = e0 + lane;
            const int lo = e < n_expert ? min(max(offsets[e], 0), n_routes) : 0;
            const int hi = e < n_expert ? min(max(offsets[e + 1], lo), n_routes) : 0;
            const bool a = e < n_expert && hi > lo;
            const unsigned m = __ballot_sync(0xffffffffu, a);
            int c = a ? units * st_unit_cost(hi - lo) : 0;
            // Inclusive scan of the costs over the lanes.
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, c, o);
                if (lane >= o) c += v;
            }
            if (a) {
                const int k = base + __popc(m & ((1u << lane) - 1u));
                le[k] = e;
                lr0[k] = lo;
                lr1[k] = hi;
                lpre[k + 1] = run + c;
            }
            base += __popc(m);
            run += __shfl_sync(0xffffffffu, c, 31);
        }
        if (lane == 0) {
            *ln = base;
            if (has_sh) lpre[1] = units * st_unit_cost(n_sh);
        }
    }
    if (tid < slots) {
        st_mbar_init((unsigned)__cvta_generic_to_shared(bars + tid), BULK ? 1 : 32);
        cnt[tid] = 0;
    }
#if ST_BULK
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
    __syncthreads();
    const StList L{le, lr0, lr1, lpre, *ln};
    const long long total = L.prefix[L.n];
    const long long lo = (total * blockIdx.x + gridDim.x - 1) / gridDim.x;
    const long long hi = (total * (blockIdx.x + 1) + gridDim.x - 1) / gridDim.x;
    StWalk w = st_first(L, units, lo);
    const unsigned ring = (unsigned)__cvta_generic_to_shared(st_smem);
    const unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars);
    // ahead: the item `slots` after w's, which the last warp of w's unit copies next.
    StWalk ahead = w;
    for (int s = 0; s < slots && st_live(L, ahead, units, hi); ++s, st_next(L, ahead, units)) {
        if (warp == 0)
            st_issue<BULK>(L, ahead, Wa, Wb, Sa, Sb, swiglu, mat, row_bytes, outs, unit_rows, n_out,
                           pitch, ring + s * (unsigned)slot_bytes, bar0 + 8 * s);
    }

    // Every warp: m16 tile mt, K slice ks.
    const int kslices = ST_WARPS / mt_n;
    const int mt = warp % mt_n, ks = warp / mt_n;
    const int nb = n_in >> 5;
    const int b0 = ks * nb / kslices, b1 = (ks + 1) * nb / kslices;
    const int g = lane >> 2, t = lane & 3;
    const uint2* __restrict__ xq2 = reinterpret_cast<const uint2*>(xh);
    unsigned kc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) kc[i] = skq_consts[i];
    for (int li = 0; st_live(L, w, units, hi); ++li, st_next(L, w, units)) {
        const int slot = li % slots;
        const unsigned full = bar0 + 8 * slot;
        const int e = L.e[w.k];
        const int rbase = L.r0[w.k] + w.pass * ST_PASS;
        const int rn = min(ST_PASS, L.r1[w.k] - rbase);
        const int n_tiles = (rn + 3) >> 2;
        // The input row of route q of the pass, -1 for none.
        auto x_row = [&](int q) {
            int src = -1;
            if (q < rn) {
                const int r = rbase + q;
                src = e < 0 ? (swiglu ? r : sh_x0 + r) : (swiglu ? route_token[r] : r);
            }
            return (src >= 0 && src < n_x_rows) ? src : -1;
        };
        unsigned xoff[ST_TILES];
#pragma unroll
        for (int j = 0; j < ST_TILES; ++j) {
            const int src = x_row(4 * j + (g >> 1));
            xoff[j] = src >= 0 ? (unsigned)src * (unsigned)(n_in >> 2) + (g & 1) * 4 + t : ~0u;
        }
        float acc[ST_TILES][2];
#pragma unroll
        for (int j = 0; j < ST_TILES; ++j) acc[j][0] = acc[j][1] = 0.0f;
        st_mbar_wait(full, (li / slots) & 1);
        const unsigned char* wt = st_smem + slot * slot_bytes + 16 * mt * pitch;
        if (n_tiles <= 1)
            st_slice<1>(wt, pitch, b0, b1, xq2, xoff, n_tiles, kc, acc);
        else if (n_tiles == 2)
            st_slice<2>(wt, pitch, b0, b1, xq2, xoff, n_tiles, kc, acc);
        else
            st_slice<4>(wt, pitch, b0, b1, xq2, xoff, n_tiles, kc, acc);
        float* sred = red + (li % (2 * slots)) * ST_RED;
#pragma unroll
        for (int j = 0; j < ST_TILES; ++j) {
            if (j >= n_tiles) continue;
            sred[((warp * ST_TILES + j) * 2) * 32 + lane] = acc[j][0];
            sred[((warp * ST_TILES + j) * 2 + 1) * 32 + lane] = acc[j][1];
        }
        __syncwarp();
        int last = 0;
        if (lane == 0) {
            __threadfence_block();
            // A count that only grows: the slot's uses need no reset between them.
            last = (atomicAdd(cnt + slot, 1) + 1) % ST_WARPS == 0;
            __threadfence_block();
        }
        last = __shfl_sync(0xffffffffu, last, 0);
        __syncwarp();  // orders lane 0's acquire before the other lanes' reads of the partials
        if (last) {
            if (st_live(L, ahead, units, hi))
                st_issue<BULK>(L, ahead, Wa, Wb, Sa, Sb, swiglu, mat, row_bytes, outs, unit_rows,
                               n_out, pitch, ring + slot * (unsigned)slot_bytes, full);
            const int o0 = w.unit * outs;
            float* yo = e < 0 ? y_sh : y;
            for (int m = 0; m < mt_n; ++m) {
#pragma unroll
                for (int j = 0; j < ST_TILES; ++j) {
                    if (j >= n_tiles) continue;
                    const int q = 4 * j + t;
                    float v[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float s = sred[((m * ST_TILES + j) * 2 + h) * 32 + lane];
                        for (int k = 1; k < kslices; ++k)
                            s = __fadd_rn(s, sred[(((k * mt_n + m) * ST_TILES + j) * 2 + h) * 32 + lane]);
                        v[h] = s;
                    }
                    if (q >= rn) continue;
                    const int src = x_row(q);
                    const float s = src >= 0 ? sx[src] : 0.0f;
                    float* yr = yo + (long long)(rbase + q) * n_out;
                    if (swiglu) {
                        const int o = o0 + g;
                        if (o < n_out) yr[o] = tc_silu_times(__fmul_rn(v[0], s), __fmul_rn(v[1], s));
                    } else {
                        const int o = o0 + 16 * m + g;
                        if (o < n_out) yr[o] = __fmul_rn(v[0], s);
                        if (o + 8 < n_out) yr[o + 8] = __fmul_rn(v[1], s);
                    }
                }
            }
        }
        if (st_live(L, ahead, units, hi)) st_next(L, ahead, units);
    }
    // A block's cp.async copies all complete before it exits (each was waited for).
}

// Two a multiprocessor (256 threads of at most 128 registers: ptxas needs ~110).
// _bulk: one bulk copy a weight row (compute capability 9.0); the other: 16-byte cp.async
// copies by the issuing warp's lanes.
#define EXPERT_STREAM(NAME, BULK)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * ST_WARPS, 2) NAME(                          \
        const unsigned char* __restrict__ Wa, const unsigned char* __restrict__ Wb,               \
        const uint4* __restrict__ xh, const float* __restrict__ sx,                               \
        const int* __restrict__ offsets, const int* __restrict__ route_token,                     \
        float* __restrict__ y, int n_in, int n_out, int n_expert, int n_x_rows, int n_routes,     \
        const unsigned char* __restrict__ Sa, const unsigned char* __restrict__ Sb,               \
        float* __restrict__ y_sh, int n_sh, int sh_x0, int mt_n, int pitch, int slots) {          \
        PDL_ENTER();                                                                              \
        expert_stream_body<BULK>(Wa, Wb, xh, sx, offsets, route_token, y, n_in, n_out, n_expert,  \
                                 n_x_rows, n_routes, Sa, Sb, y_sh, n_sh, sh_x0, mt_n, pitch,      \
                                 slots);                                                          \
    }
EXPERT_STREAM(expert_stream_iq4_q, false)
EXPERT_STREAM(expert_stream_iq4_q_bulk, true)
#undef EXPERT_STREAM
