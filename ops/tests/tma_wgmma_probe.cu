// Probes for a warp-specialised split attention (not used by any op yet): one 64-row tile of an
// F16 latent cache (576 values a row) staged by TMA in nine boxes of 64 columns × 64 rows with
// the 128-byte swizzle, then multiplied on warpgroup MMAs straight from shared memory.
//
// Shared layout of a box (8 KB, 1024-byte aligned): row r at 128·r, its 16-byte chunk c at
// chunk c ^ (r % 8). That is wgmma's K-major layout with the 128-byte swizzle for a 64-row A
// (8-row core groups 1024 bytes apart: SBO = 1024; LBO unused) and, read across rows, an
// MN-major A whose K index is the row (the values product, V^T·P^T).

struct __align__(64) TmaMap {
    unsigned long long v[16];
};

__device__ __forceinline__ unsigned pr_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void pr_bar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(pr_smem(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void pr_bar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(pr_smem(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void pr_bar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n PR_WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra PR_WAIT_%=;\n}" ::"r"(pr_smem(bar)),
        "r"(parity)
        : "memory");
}

// Box (c0 = first column, c1 = first row) of `map` into shared `dst`, counted on `bar`.
__device__ __forceinline__ void pr_tma_2d(void* dst, const TmaMap* map, int c0, int c1,
                                          unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3}], [%4];" ::"r"(pr_smem(dst)),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(pr_smem(bar))
        : "memory");
}

// A 1024-byte aligned region of the dynamic shared memory (the launch adds 1024 bytes).
__device__ __forceinline__ unsigned char* pr_align1024(unsigned char* p) {
    const unsigned a = pr_smem(p);
    return p + ((1024u - (a & 1023u)) & 1023u);
}

// Rows row0..row0+63, all nine boxes, into `tile` (72 KB); thread 0 issues, all wait.
__device__ __forceinline__ void pr_stage_tile(const TmaMap* map, int row0, unsigned char* tile,
                                              unsigned long long* bar) {
    if (threadIdx.x == 0) {
        pr_bar_init(bar);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        pr_bar_expect(bar, 9u * 8192u);
        for (int b = 0; b < 9; ++b) pr_tma_2d(tile + 8192 * b, map, 64 * b, row0, bar);
    }
    pr_bar_wait(bar, 0);
}

extern "C" __global__ void __launch_bounds__(128, 1)
probe_tma_tile(const __grid_constant__ TmaMap map, int row0, uint4* __restrict__ out) {
    extern __shared__ unsigned char pr_dyn[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* tile = pr_align1024(pr_dyn);
    pr_stage_tile(&map, row0, tile, &bar);
    for (int i = threadIdx.x; i < 9 * 8192 / 16; i += blockDim.x)
        out[i] = reinterpret_cast<const uint4*>(tile)[i];
}

// Matrix descriptor: start address, leading and stride byte offsets (16-byte units), swizzle
// mode (1 = 128 bytes).
__device__ __forceinline__ unsigned long long pr_desc(const void* p, unsigned lbo, unsigned sbo,
                                                      unsigned swizzle) {
    return (unsigned long long)((pr_smem(p) >> 4) & 0x3fffu) |
           ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32) |
           ((unsigned long long)swizzle << 62);
}

__device__ __forceinline__ void pr_wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void pr_wg_commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// d += A·B, m64n32k16, f32 accumulators, both operands from shared memory; TA: A transposed
// (MN-major).
template <int TA>
__device__ __forceinline__ void pr_mma_ss(float* d, unsigned long long da, unsigned long long db,
                                          int accumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, "
        "%19, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA));
}

// The m64n32 accumulators to out[64][32] (row-major): lane (g, t) of warp w holds rows 16w + g
// and +8, columns 8j + 2t and +1.
__device__ __forceinline__ void pr_store_acc(const float* d, float* __restrict__ out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int r = 16 * warp + g, c = 8 * j + 2 * t;
        out[r * 32 + c] = d[4 * j];
        out[r * 32 + c + 1] = d[4 * j + 1];
        out[(r + 8) * 32 + c] = d[4 * j + 2];
        out[(r + 8) * 32 + c + 1] = d[4 * j + 3];
    }
}

// b[32][k_cols] f16 (row-major) into shared memory as a K-major 128-byte-swizzled B of 32 rows:
// k-block kb (64 columns) at 4096·kb, row n at 128·n, chunk c at c ^ (n % 8).
__device__ __forceinline__ void pr_stage_b(const unsigned short* __restrict__ b, int k_cols,
                                           unsigned char* dst) {
    for (int i = threadIdx.x; i < 32 * k_cols / 8; i += blockDim.x) {
        const int n = i / (k_cols / 8), c = i - n * (k_cols / 8);
        const int kb = c >> 3, cc = c & 7;
        *reinterpret_cast<uint4*>(dst + 4096 * kb + 128 * n + 16 * (cc ^ (n & 7))) =
            *reinterpret_cast<const uint4*>(b + n * k_cols + 8 * c);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}

// Both products' frame: the tile staged by TMA, B (`b`, [32][k_cols] f16) staged K-major with
// the 128-byte swizzle after it, `steps` wgmma.m64n32k16 with the descriptors a_at(tile, k) and
// b_at(B, k), the accumulators to out[64][32].
template <int TA, class ADesc, class BDesc>
__device__ __forceinline__ void pr_product(const TmaMap* map, int row0,
                                           const unsigned short* __restrict__ b, int k_cols,
                                           int steps, ADesc a_at, BDesc b_at,
                                           float* __restrict__ out) {
    extern __shared__ unsigned char pr_dyn[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* tile = pr_align1024(pr_dyn);
    unsigned char* bs = tile + 9 * 8192;
    pr_stage_b(b, k_cols, bs);
    pr_stage_tile(map, row0, tile, &bar);
    float d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = 0.0f;
    pr_wg_fence();
#pragma unroll 1
    for (int k = 0; k < steps; ++k) pr_mma_ss<TA>(d, a_at(tile, k), b_at(bs, k), k > 0);
    pr_wg_commit_wait();
    pr_store_acc(d, out);
}

// S^T[64 rows][32 heads] = K·Q^T over the tile's 576 columns: A = the tile (K-major, 128-byte
// swizzle, SBO 1024), B = Q [32][576] staged the same way; 36 k16 steps, 32 bytes apart inside
// a box and a box (8 KB of A, 4 KB of B) apart across boxes.
extern "C" __global__ void __launch_bounds__(128, 1)
probe_wgmma_scores(const __grid_constant__ TmaMap map, int row0,
                   const unsigned short* __restrict__ q, float* __restrict__ s) {
    pr_product<0>(
        &map, row0, q, 576, 36,
        [](unsigned char* t, int k) {
            return pr_desc(t + 8192 * (k >> 2) + 32 * (k & 3), 16, 1024, 1);
        },
        [](unsigned char* qs, int k) {
            return pr_desc(qs + 4096 * (k >> 2) + 32 * (k & 3), 16, 1024, 1);
        },
        s);
}

// O^T[64 columns][32 heads] = V^T·P^T over the tile's first box (columns 0..63, the tile's 64
// rows as K): A = the box read MN-major (transposed), B = P [32 heads][64 rows] staged K-major
// with the 128-byte swizzle. A's descriptor takes (lbo, sbo) from the caller, the fields this
// probe exists to pin; a k16 step is 16 rows, 2048 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
probe_wgmma_values(const __grid_constant__ TmaMap map, int row0,
                   const unsigned short* __restrict__ p, float* __restrict__ o, int lbo, int sbo) {
    pr_product<1>(
        &map, row0, p, 64, 4,
        [=](unsigned char* t, int k) {
            return pr_desc(t + 2048 * k, (unsigned)lbo, (unsigned)sbo, 1);
        },
        [](unsigned char* ps, int k) { return pr_desc(ps + 32 * k, 16, 1024, 1); }, o);
}
