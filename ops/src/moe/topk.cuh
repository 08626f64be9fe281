// The MoE's routed sum of one output element, shared by `topk_sum` (moe.cu) and the hc
// boundary that forms it in place (hc.cu): out = Σ_j weights[j]·rows[route_j][c] in slot order
// j = 0..top_k (each product and sum rounded on its own; a slot no route took adds a zero
// row), then + addend[c]. `route[j]` is slot j's route, -1 for none.
__device__ __forceinline__ float topk_routed_elem(const float* __restrict__ rows, const int* route,
                                                  const float* __restrict__ weights,
                                                  const float* __restrict__ addend, int top_k,
                                                  int c, int d) {
    float o = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        const int r = route[j];
        const float x = r >= 0 ? rows[(long long)r * d + c] : 0.0f;
        const float wx = __fmul_rn(weights[j], x);
        o = j == 0 ? wx : __fadd_rn(o, wx);
    }
    if (addend) o = __fadd_rn(o, addend[c]);
    return o;
}
