// Routed experts for prefill chunks: one grouped IQ4_NL GEMM over the CSR route table on the
// tensor cores (mma.sync m16n8k16, f16 operands, f32 accumulation). Same contract as
// moe.cu's expert_gemm: SwiGLU mode (Wb != 0) writes y[route][c] = silu(gate_c·x) * (up_c·x)
// with x = the route's token row; down mode (Wb == 0) writes y[route][c] = W_c·x[route].
// Every output element has one writer and a fixed summation order, so runs repeat bit for bit.
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

// The 8 weights of one block a lane holds: qs bytes 4t..4t+3 (q) and the f16 scale (dh).
// w[i] = (16·d·v[4t+i], 16·d·v[4t+i+16]) as an f16 pair. The codebook lives in four
// registers as code+128 bytes: entries 0-7 and 8-15 are looked up by a nibble's low 3 bits,
// then its bit 3 picks between them (as moe.cu's iq4_codes). Placing a byte under the
// exponent of 2^14 gives the f16 16384 + 16·byte exactly.
__device__ __forceinline__ void tc_decode(unsigned q, unsigned dh, unsigned w[4]) {
    const unsigned t0 = 0x3f2d1801u, t1 = 0x766a5d4fu, t2 = 0xa6998d81u, t3 = 0xf1d9c5b5u;
    const unsigned d2 = __byte_perm(dh, 0u, 0x1010u);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const unsigned h = hf ? q >> 16 : q;
        const unsigned lo = __byte_perm(t0, t1, h & 0x7777u);
        const unsigned hi = __byte_perm(t2, t3, h & 0x7777u);
        // Bytes: low and high nibble of qs byte 2hf, then of qs byte 2hf+1.
        const unsigned r = __byte_perm(lo, hi, 0x3210u | ((h >> 1) & 0x4444u));
        w[2 * hf] = tc_scale_codes(__byte_perm(r, 0x74747474u, 0x4140u), d2);
        w[2 * hf + 1] = tc_scale_codes(__byte_perm(r, 0x74747474u, 0x4342u), d2);
    }
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

    // This block's expert and route tile: per-expert tile counts scanned 32 experts a step.
    if (warp == 0) {
        int q = blockIdx.y, found = -1, tile = 0;
        for (int e0 = 0; e0 < n_expert; e0 += 32) {
            const int e = e0 + lane;
            int tiles = 0;
            if (e < n_expert) {
                const int c = offsets[e + 1] - offsets[e];
                tiles = c > 0 ? (c + TC_BM - 1) / TC_BM : 0;
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
                tile = q - (__shfl_sync(0xffffffffu, incl, src) -
                            __shfl_sync(0xffffffffu, tiles, src));
                break;
            }
            q -= total;
        }
        if (lane == 0) {
            s_expert = found;
            s_tile = tile;
        }
    }
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
                unsigned q;
                if (b & 1) {
                    q = *reinterpret_cast<const unsigned*>(rp + 2 + 4 * t);
                } else {
                    const unsigned* p = reinterpret_cast<const unsigned*>(rp + 4 * t);
                    q = __byte_perm(p[0], p[1], 0x5432u);
                }
                tc_decode(q, dh, bf[j]);
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
