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

// grid n rows, block a multiple of 32 (up to 1024; the launcher gives about one float4 a
// thread at the model's widths, so a row costs one memory round trip, not one a value). VEC:
// D % 4 == 0 and 16-byte aligned rows. w may be null (unweighted).
template <bool VEC>
__device__ __forceinline__ void rms_norm_body(const float* __restrict__ x,
                                              const float* __restrict__ w,
                                              float* __restrict__ y, int D, float eps) {
    __shared__ float part[32];
    const float* xr = x + (long long)blockIdx.x * D;
    float* yr = y + (long long)blockIdx.x * D;
    float s = 0.f;
    if (VEC) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (int i = threadIdx.x; i < D / 4; i += blockDim.x) {
            const float4 v = x4[i];
            s += __fmul_rn(v.x, v.x);
            s += __fmul_rn(v.y, v.y);
            s += __fmul_rn(v.z, v.z);
            s += __fmul_rn(v.w, v.w);
        }
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            const float v = xr[i];
            s += __fmul_rn(v, v);
        }
    }
    s = warp_sum(s);
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) part[warp] = s;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < nwarps; ++i) tot += part[i];
    const float scale = 1.0f / sqrtf(tot / (float)D + eps);
    if (VEC) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* y4 = reinterpret_cast<float4*>(yr);
        for (int i = threadIdx.x; i < D / 4; i += blockDim.x) {
            const float4 v = x4[i];
            float4 o = make_float4(__fmul_rn(v.x, scale), __fmul_rn(v.y, scale),
                                   __fmul_rn(v.z, scale), __fmul_rn(v.w, scale));
            if (w) {
                const float4 g = w4[i];
                o = make_float4(__fmul_rn(o.x, g.x), __fmul_rn(o.y, g.y), __fmul_rn(o.z, g.z),
                                __fmul_rn(o.w, g.w));
            }
            y4[i] = o;
        }
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            const float v = __fmul_rn(xr[i], scale);
            yr[i] = w ? __fmul_rn(v, w[i]) : v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024)
rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
             int D, float eps) {
    PDL_ENTER();
    rms_norm_body<false>(x, w, y, D, eps);
}

extern "C" __global__ void __launch_bounds__(1024)
rms_norm_f32_vec(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                 int D, float eps) {
    PDL_ENTER();
    rms_norm_body<true>(x, w, y, D, eps);
}
