// Stored-weight decoding shared by the embedding and linear kernels (spec §6.2).
// Weight type codes match `wt_code` in ops/src/linear.rs.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q8_0 3
#define WT_Q6_K 4
#define WT_IQ4_NL 5

__device__ __forceinline__ float h2f(unsigned short b) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }

// Two little-endian bytes from a 2-byte-aligned address.
__device__ __forceinline__ unsigned short ld_u16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

// The IQ4_NL codebook packed into two words (a runtime-indexed array would live in local memory).
__device__ __forceinline__ int iq4_code(int i) {
    const unsigned long long t = (i & 8) ? 0x7159453526190d01ull : 0xf6eaddcfbfad9881ull;
    return (int)(signed char)(unsigned char)(t >> ((i & 7) * 8));
}

// Value k of a row stored as `wt` (row start at least 4-byte aligned for F32, 2 otherwise).
// The products are formed in the CPU reference's order, so the value is bit-identical.
__device__ float deq_elem(const unsigned char* row, int wt, long long k) {
    switch (wt) {
        case WT_F32:
            return reinterpret_cast<const float*>(row)[k];
        case WT_F16:
            return h2f(reinterpret_cast<const unsigned short*>(row)[k]);
        case WT_BF16:
            return bf2f(reinterpret_cast<const unsigned short*>(row)[k]);
        case WT_Q8_0: {
            const unsigned char* b = row + (k >> 5) * 34;
            return h2f(ld_u16(b)) * (float)(signed char)b[2 + (k & 31)];
        }
        case WT_IQ4_NL: {
            const unsigned char* b = row + (k >> 5) * 18;
            const int j = (int)(k & 31);
            const int q = b[2 + (j & 15)];
            return h2f(ld_u16(b)) * (float)iq4_code(j < 16 ? (q & 15) : (q >> 4));
        }
        case WT_Q6_K: {
            const unsigned char* b = row + (k >> 8) * 210;
            const int o = (int)(k & 255), hf = o >> 7, r = o & 127, q = r >> 5, l = r & 31;
            const int ql = b[64 * hf + l + 32 * (q & 1)];
            const int lo = (q >> 1) ? (ql >> 4) : (ql & 15);
            const int hb = (b[128 + 32 * hf + l] >> (2 * q)) & 3;
            const float sc = (float)(signed char)b[192 + 8 * hf + (l >> 4) + 2 * q];
            return h2f(ld_u16(b + 208)) * sc * (float)((lo | (hb << 4)) - 32);
        }
    }
    return __int_as_float(0x7fffffff);
}
