// Embedding gather (spec §3.1). Prepended with dequant.cuh.
//
// A kernel cannot return an error, and clamping would silently pick another
// token: a row whose id is outside [0, V) is written as NaN and nothing of the
// table is read for it. The engine validates ids on the host before upload; the
// NaN makes a miss visible to the parity harness and to anything downstream.

// grid (column blocks, n), block 256: out[t][k] = table[tokens[t]][k].
extern "C" __global__ void embedding_rows(const unsigned char* __restrict__ table,
                                          const int* __restrict__ tokens,
                                          float* __restrict__ out, int V, int D,
                                          long long row_bytes, int wt) {
    PDL_ENTER();
    const int t = blockIdx.y;
    const int id = tokens[t];
    const bool ok = id >= 0 && id < V;
    const unsigned char* row = table + (long long)(ok ? id : 0) * row_bytes;
    float* o = out + (long long)t * D;
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < D; k += gridDim.x * blockDim.x) {
        o[k] = ok ? deq_elem(row, wt, k) : __int_as_float(0x7fffffff);
    }
}
