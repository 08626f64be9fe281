// RMSNorm over the innermost dimension (spec §0): one block per row.
//
// The sum of squares is f32 in a fixed order (per-thread strided partials, a
// butterfly within each warp, the warps' sums added in warp order), so every run
// gives the same bits. The products are rounded separately (__fmul_rn) because
// the CPU reference's norm and weight multiply are separate roundings.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// grid n rows, block 256. w may be null (unweighted).
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int D, float eps) {
    __shared__ float part[32];
    const float* xr = x + (long long)blockIdx.x * D;
    float* yr = y + (long long)blockIdx.x * D;
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = xr[i];
        s += __fmul_rn(v, v);
    }
    s = warp_sum(s);
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) part[warp] = s;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < nwarps; ++i) tot += part[i];
    const float scale = 1.0f / sqrtf(tot / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = __fmul_rn(xr[i], scale);
        yr[i] = w ? __fmul_rn(v, w[i]) : v;
    }
}
