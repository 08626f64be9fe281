// Elementwise f32 kernels. One thread per element, grid-stride so any n works.

extern "C" __global__ void swiglu_f32(const float* __restrict__ gate,
                                      const float* __restrict__ up,
                                      float* __restrict__ out, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float g = gate[i];
        // silu(g) = g / (1 + e^-g); a very negative gate gives 0, not NaN.
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" __global__ void add_f32(const float* __restrict__ a,
                                   const float* __restrict__ b,
                                   float* __restrict__ out, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = a[i] + b[i];
    }
}
