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

// ---------------------------------------------------------------------------------------------
// sample_rows: per row, a token drawn from softmax(logits / temperature) after the top-k,
// top-p and min-p cuts, with the row's uniform u (drawn on the host, so a seed gives the same
// tokens whichever side chooses). params[row] = (1 / temperature, top_k, top_p, min_p, u); a
// scale that is not positive is the argmax. The semantics are the CPU reference's (cpu.rs,
// `sample_row`): candidates are the finite x = logit * scale, ordered by x descending
// then id ascending; top-k keeps the first k, top-p the shortest head of those whose weight
// exp(x - max) reaches top_p of theirs, min-p drops weights below min_p; the draw walks the
// kept ids in ascending order until the running weight passes u times the kept weight.
//
// No sort: each cut is a prefix of the order, found as a threshold on an order-preserving
// 32-bit key, four bits a pass (15 candidate thresholds counted or weighed at once); ties at
// the threshold are kept lowest id first through per-warp tie counts. One block of 512
// threads a row (1024 would cap registers at 64 and spill the 15 f64 sums); warp w walks the
// ids [w*seg, (w+1)*seg) in ascending order, so a walk in (step, lane) order is id order and a
// ballot gives ranks.
#define SAMPLE_FIELDS 5
#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

__device__ __forceinline__ unsigned sample_key(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A prefix of the candidate order: keys above `key` and the first `ties` ids whose key
// equals it (ranked in id order); tie_base[w] holds the ties of the warps before w.
struct SampleCut {
    unsigned key;
    unsigned ties;
    bool partial;  // fewer ties kept than there are: ranks needed
};

// Weights are summed in f64: a 131,072-wide row's f32 running sum drifts by more than one
// token's share, and the CPU reference sums in f64.
__device__ __forceinline__ double sample_block_sum(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double s = 0.0;
    // Every thread sums the warps' partials in the same order: one value, block-wide.
    for (int w = 0; w < SAMPLE_WARPS; ++w) s += red[w];
    return s;
}

__device__ __forceinline__ unsigned sample_block_count(unsigned v, unsigned* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    unsigned s = 0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) s += red[w];
    return s;
}

// Whether candidate (key, finite) at the walk's current position is inside `cut`. `rank` is
// this warp's running count of ties at cut.key before this step; the step's own ties are
// ranked by ballot (every lane of the warp calls it).
__device__ __forceinline__ bool sample_in_cut(const SampleCut& c, unsigned key, bool finite,
                                              unsigned base, unsigned& rank) {
    const bool tie = finite && key == c.key;
    const unsigned ballot = __ballot_sync(0xffffffffu, tie);
    const unsigned lane = threadIdx.x & 31;
    const unsigned before = __popc(ballot & ((1u << lane) - 1u));
    const bool in =
        finite && (key > c.key || (tie && (!c.partial || base + rank + before < c.ties)));
    rank += __popc(ballot);
    return in;
}

// Adds `v` to sums[d - 1] for every digit d = 1..dk (an element counts toward each threshold
// at or below its digit); the loop is unrolled here, outside the walk's macro.
template <typename T>
__device__ __forceinline__ void sample_add_digit(T (&sums)[15], unsigned dk, T v) {
#pragma unroll
    for (int d = 0; d < 15; ++d) sums[d] += dk >= (unsigned)(d + 1) ? v : T(0);
}

// The largest digit d (0 if none) whose block-wide sum of `sums[d - 1]` reaches `goal`: the
// next four bits of a threshold (the warps' partials go through `dig`). Every thread of the
// block returns the same digit.
template <typename T>
__device__ __forceinline__ unsigned sample_best_digit(const T (&sums)[15], T (*dig)[16], T goal) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 0; d < 15; ++d) {
        T v = sums[d];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) dig[warp][d] = v;
    }
    __syncthreads();
    unsigned best = 0;
    for (int d = 0; d < 15; ++d) {
        T sum = 0;
        for (int w = 0; w < SAMPLE_WARPS; ++w) sum += dig[w][d];
        if (sum >= goal) best = d + 1;
    }
    __syncthreads();
    return best;
}

// The walk over a row's ids inside `sample_rows` (names row, inv_t, beg, end, lane in
// scope): every lane of a warp runs the same number of steps, as a ballot needs them all.
#define SAMPLE_WALK(...)                                                    \
    for (int i0 = beg; i0 < end; i0 += 32) {                                \
        const int i = i0 + lane;                                            \
        const bool inside = i < end;                                        \
        const float xv = inside ? row[i] * inv_t : 0.f;     \
        const bool finite = inside && isfinite(xv);                         \
        const unsigned key = sample_key(xv);                                \
        __VA_ARGS__                                                         \
    }

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_rows(const float* __restrict__ x, const float* __restrict__ params,
                int* __restrict__ out, int V) {
    PDL_ENTER();
    __shared__ float redf[SAMPLE_WARPS];
    __shared__ double redd[SAMPLE_WARPS];
    __shared__ unsigned redu[SAMPLE_WARPS];
    __shared__ unsigned digu[SAMPLE_WARPS][16];
    __shared__ double digd[SAMPLE_WARPS][16];
    __shared__ unsigned tie_base[SAMPLE_WARPS];
    __shared__ double warp_mass[SAMPLE_WARPS];
    __shared__ int chosen;

    const float* p = params + (long long)blockIdx.x * SAMPLE_FIELDS;
    // The reciprocal comes from the host: a division here is a call whose slow path spills.
    const float inv_t = p[0];
    if (!(inv_t > 0.f)) {
        // The argmax kernel's body, with its vector loads where the rows allow them.
        if ((V & 3) == 0 && (reinterpret_cast<unsigned long long>(x) & 15) == 0)
            argmax_body<true>(x, out, V);
        else
            argmax_body<false>(x, out, V);
        return;
    }
    const float top_k_f = p[1], top_p = p[2], u = p[4];
    const float min_p = p[3] > 0.f ? fminf(p[3], 1.f) : 0.f;
    const float* row = x + (long long)blockIdx.x * V;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = (V + SAMPLE_WARPS - 1) / SAMPLE_WARPS;
    const int beg = min(V, warp * seg), end = min(V, beg + seg);

    // Pass 1: the largest candidate and how many there are.
    float mx = __int_as_float(0xff800000);
    unsigned n_fin = 0;
    SAMPLE_WALK(
        if (finite) {
            mx = fmaxf(mx, xv);
            ++n_fin;
        }
    )
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) redf[warp] = mx;
    __syncthreads();
    mx = redf[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) mx = fmaxf(mx, redf[w]);
    n_fin = sample_block_count(n_fin, redu);
    if (n_fin == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = -1;
        return;
    }

    // The cut so far: every candidate.
    SampleCut cut = {0u, 0u, false};

    // Ties at `at` inside the current cut per warp (exclusive prefix into tie_base), and how many
    // in all.
    // (a macro: a lambda is a host function to NVRTC)
#define SAMPLE_RANK_TIES(AT, GE, GT)                                                          \
    do {                                                                                      \
        unsigned t = 0, a = 0, g = 0;                                                         \
        unsigned rank = 0;                                                                    \
        SAMPLE_WALK(const bool in = sample_in_cut(cut, key, finite, tie_base[warp], rank);    \
                    if (in && key == (AT)) ++t; if (in && key > (AT)) ++g;                    \
                    if (in && key >= (AT)) ++a;)                                              \
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);            \
        GE = sample_block_count(a, redu);                                                     \
        GT = sample_block_count(g, redu);                                                     \
        __syncthreads();                                                                      \
        if (lane == 0) redu[warp] = t;                                                        \
        __syncthreads();                                                                      \
        if (threadIdx.x == 0) {                                                               \
            unsigned acc = 0;                                                                 \
            for (int w = 0; w < SAMPLE_WARPS; ++w) {                                          \
                const unsigned n = redu[w];                                                   \
                tie_base[w] = acc;                                                            \
                acc += n;                                                                     \
            }                                                                                 \
        }                                                                                     \
        __syncthreads();                                                                      \
    } while (0)
    for (int w = threadIdx.x; w < SAMPLE_WARPS; w += blockDim.x) tie_base[w] = 0;
    __syncthreads();

    // Top-k: the largest key with at least k candidates at or above it, four bits a pass.
    const unsigned top_k = top_k_f >= 4294967295.f ? 0xffffffffu : (unsigned)fmaxf(top_k_f, 0.f);
    if (top_k > 0 && top_k < n_fin) {
        unsigned prefix = 0;
        for (int shift = 28; shift >= 0; shift -= 4) {
            unsigned cnt[15];
#pragma unroll
            for (int d = 0; d < 15; ++d) cnt[d] = 0;
            SAMPLE_WALK(
                if (finite && key >= prefix) {
                    const unsigned dk = min(15u, (key - prefix) >> shift);
                    sample_add_digit(cnt, dk, 1u);
                }
            )
            prefix += sample_best_digit(cnt, digu, top_k) << shift;
        }
        unsigned ge, gt;
        SAMPLE_RANK_TIES(prefix, ge, gt);
        cut = SampleCut{prefix, top_k - gt, top_k - gt < ge - gt};
    }

    // The weight of the candidates inside the top-k cut.
    double total = 0.0;
    {
        unsigned rank = 0;
        SAMPLE_WALK(
            if (sample_in_cut(cut, key, finite, tie_base[warp], rank)) total += expf(xv - mx);
        )
        total = sample_block_sum(total, redd);
    }

    // Top-p: the largest key whose candidates at or above it weigh at least top_p of total.
    if (top_p < 1.f) {
        const double target = (double)top_p * total;
        unsigned prefix = 0;
        for (int shift = 28; shift >= 0; shift -= 4) {
            double mass[15];
#pragma unroll
            for (int d = 0; d < 15; ++d) mass[d] = 0.0;
            unsigned rank = 0;
            SAMPLE_WALK(
                const bool in = sample_in_cut(cut, key, finite, tie_base[warp], rank);
                if (in && key >= prefix) {
                    const unsigned dk = min(15u, (key - prefix) >> shift);
                    const float wv = expf(xv - mx);
                    sample_add_digit(mass, dk, (double)wv);
                }
            )
            prefix += sample_best_digit(mass, digd, target) << shift;
        }
        // Summed in another order than `total`, the search may land below the top-k cut
        // when top_p is within a rounding of 1 (the cut stands there), and a top_p of 0
        // finds no key too high: the reference keeps the first candidate.
        prefix = min(max(prefix, cut.key), sample_key(mx));
        // The ties at the threshold, in id order, while the weight before each is short of
        // the target (the reference's walk keeps the candidate that reaches it).
        double above = 0.0;
        float tie_w = 0.f;
        {
            unsigned rank = 0;
            SAMPLE_WALK(
                const bool in = sample_in_cut(cut, key, finite, tie_base[warp], rank);
                if (in && key > prefix) above += expf(xv - mx);
                if (in && key == prefix) tie_w = expf(xv - mx);
            )
        }
        above = sample_block_sum(above, redd);
        for (int o = 16; o > 0; o >>= 1)
            tie_w = fmaxf(tie_w, __shfl_xor_sync(0xffffffffu, tie_w, o));
        __syncthreads();
        if (lane == 0) redf[warp] = tie_w;
        __syncthreads();
        for (int w = 0; w < SAMPLE_WARPS; ++w) tie_w = fmaxf(tie_w, redf[w]);
        // At the top-k cut's own key with its ties rationed, the ranks stand and only its
        // kept ties can be kept; otherwise every tie at the new key is inside the cut.
        const bool same = cut.partial && prefix == cut.key;
        unsigned n_tie = cut.ties;
        if (!same) {
            unsigned ge, gt;
            SAMPLE_RANK_TIES(prefix, ge, gt);
            n_tie = ge - gt;
        }
        unsigned keep = 0;
        while (keep < n_tie && above + (double)keep * tie_w < target) ++keep;
        keep = max(keep, 1u);
        cut = SampleCut{prefix, keep, same || keep < n_tie};
    }

    // The draw: per warp the kept weight, then the warp holding u times the total walks its ids.
    double kept = 0.0;
    int last = -1;
    {
        unsigned rank = 0;
        SAMPLE_WALK(
            const bool in = sample_in_cut(cut, key, finite, tie_base[warp], rank);
            const float wv = in ? expf(xv - mx) : 0.f;
            if (in && wv >= min_p) {
                kept += wv;
                last = i;
            }
        )
    }
    for (int o = 16; o > 0; o >>= 1) {
        kept += __shfl_xor_sync(0xffffffffu, kept, o);
        last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    }
    __syncthreads();
    if (lane == 0) {
        warp_mass[warp] = kept;
        redu[warp] = (unsigned)(last + 1);
    }
    if (threadIdx.x == 0) chosen = -1;
    __syncthreads();
    double all = 0.0;
    int last_all = -1;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        all += warp_mass[w];
        last_all = max(last_all, (int)redu[w] - 1);
    }
    const double goal = (double)u * all;
    double before = 0.0;
    int home = -1;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        if (home < 0 && warp_mass[w] > 0.0 && before + warp_mass[w] > goal) home = w;
        if (home < 0) before += warp_mass[w];
    }
    if (warp == home) {
        double acc = before;
        unsigned rank = 0;
        bool done = false;
        int last_here = -1;
        SAMPLE_WALK(
            const bool in = sample_in_cut(cut, key, finite, tie_base[warp], rank);
            float wv = in ? expf(xv - mx) : 0.f;
            if (!(in && wv >= min_p)) wv = 0.f;
            double incl = wv;
            for (int o = 1; o < 32; o <<= 1) {
                const double n = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += n;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, !done && wv > 0.f && acc + incl > goal);
            const unsigned any = __ballot_sync(0xffffffffu, wv > 0.f);
            if (!done && any) last_here = i - lane + 31 - __clz(any);
            if (hit && !done) {
                if (lane == __ffs(hit) - 1) chosen = i;
                done = true;
            }
            acc += __shfl_sync(0xffffffffu, incl, 31);
        )
        // The home warp's sums met the goal where its own walk, summed in another order,
        // fell short by a rounding: its last kept id.
        if (!done && lane == 0) chosen = last_here;
    }
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = chosen >= 0 ? chosen : last_all;
#undef SAMPLE_RANK_TIES
}

// The repetition penalty over each row's listed ids (after slice_rows copied the rows):
// out[r, id] = x[r, id] / p where positive, * p where not. An id listed twice writes the same
// value twice (each write reads x); ids outside 0..V are the padding.
extern "C" __global__ void penalize_rows(const float* __restrict__ x, const int* __restrict__ ids,
                                         const float* __restrict__ penalty, float* __restrict__ out,
                                         int V, int W, int total) {
    PDL_ENTER();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const int r = e / W, id = ids[e];
    if (id < 0 || id >= V) return;
    const long long at = (long long)r * V + id;
    const float v = x[at], p = penalty[r];
    out[at] = v > 0.f ? v / p : v * p;
}
