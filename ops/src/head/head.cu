// The head's plumbing: greedy argmax over logits rows, and a row slice.

#define ARGMAX_NONE 0x7fffffff

// (value, index) pairs: the larger value wins, a tie goes to the lower index, so the
// reduction returns the first maximum whatever order it meets the pairs in.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (oi == ARGMAX_NONE) return;
    if (i == ARGMAX_NONE || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// grid n rows, block 1024. A row holding a NaN has no choice: it is written as -1
// (the CPU reference reports it as a data error; a kernel cannot, and -1 is never a token).
// VEC (V % 4 == 0, 16-byte aligned rows): each thread has ARGMAX_U float4 loads in flight at
// a time, so a 131072-wide row takes four memory round trips rather than one a value.
#define ARGMAX_U 8
__device__ __forceinline__ void take(float v, int i, float& bv, int& bi, int& nan) {
    if (v != v)
        nan = 1;
    else
        better(bv, bi, v, i);
}

template <bool VEC>
__device__ __forceinline__ void argmax_body(const float* __restrict__ x, int* __restrict__ out,
                                            int V) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = x + (long long)blockIdx.x * V;
    float bv = __int_as_float(0xff800000);
    int bi = ARGMAX_NONE;
    int nan = 0;
    if (VEC) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int V4 = V / 4, step = blockDim.x;
        for (int base = threadIdx.x; base < V4; base += ARGMAX_U * step) {
            float4 v[ARGMAX_U];
#pragma unroll
            for (int u = 0; u < ARGMAX_U; ++u) {
                const int j = base + u * step;
                v[u] = j < V4 ? r4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < ARGMAX_U; ++u) {
                const int j = base + u * step;
                if (j < V4) {
                    take(v[u].x, 4 * j, bv, bi, nan);
                    take(v[u].y, 4 * j + 1, bv, bi, nan);
                    take(v[u].z, 4 * j + 2, bv, bi, nan);
                    take(v[u].w, 4 * j + 3, bv, bi, nan);
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) take(row[i], i, bv, bi, nan);
    }
    nan = __syncthreads_or(nan);
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        better(bv, bi, ov, oi);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = sv[0];
        int i = si[0];
        for (int w = 1; w < nw; ++w) better(v, i, sv[w], si[w]);
        out[blockIdx.x] = nan ? -1 : i;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float* __restrict__ x, int* __restrict__ out, int V) {
    PDL_ENTER();
    argmax_body<false>(x, out, V);
}

extern "C" __global__ void __launch_bounds__(1024)
argmax_rows_vec(const float* __restrict__ x, int* __restrict__ out, int V) {
    PDL_ENTER();
    argmax_body<true>(x, out, V);
}

// out = x[start*row .. (start+len)*row), as whole 32-bit words.
extern "C" __global__ void slice_rows(const float* __restrict__ x, float* __restrict__ out, long long offset,
                                      long long total) {
    PDL_ENTER();
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x)
        out[e] = x[offset + e];
}
