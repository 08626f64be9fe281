//! Lowering: the graph a model file declares (spec-level ops only) rewritten for one step
//! shape and one device. This is the one place that decides
//!
//! * **fusions** — hc_post + hc_pre + the sub-layer's RMSNorm as one op, a norm into the
//!   BF16 GEMV after it, two products of one input as a pair, a dense SwiGLU's gate, up and
//!   combination as one op, the cache row formed at its position, the shared expert's add as
//!   the top-k sum's last step, the top-k sum formed inside the hc boundary after it, a few
//!   tokens' router and route plan as one launch, the cache rows written beside the absorbed
//!   query's GEMV;
//! * **the latent cache's storage type** — F16 where every attention kernel the options allow
//!   rounds keys and values to f16 as it reads them (the same values, half the bytes);
//! * **the kernel variant of every node** — GEMV or tensor-core tiles, split-K or the rows
//!   pass, the router's and top-k sum's kernels, the attention kernel, from the rows the step
//!   shape gives each node.
//!
//! Everything it decides comes from [`LoweringOptions`] and the [`Target`]; no op reads the
//! environment or a static, so a plan's text (which prints each node's variant) is all there
//! is to know about what runs. The CPU runs the declaration as written: its reference ops
//! have no variants and the fused ops' references are the chains they replace.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use ops::elementwise::{Add, SwiGlu};
use ops::hc::{HcPost, HcPostPreNorm, HcPre, HcPreKernel, HcPreNorm, HcRoutedPostPreNorm};
use ops::linear::{GEMV_ROWS_LIMIT, Linear, LinearKernel, LinearPair, NormLinear};
use ops::mla::{
    AttentionPath, HEAD_GEMV_ROWS_LIMIT, HeadKernel, KvCacheWrite, MlaAttention, MlaKv,
    MlaKvCacheWrite, MlaQuery, MlaQueryKv, MlaValueOut,
};
use ops::moe::{
    ExpertDown, ExpertKernel, ExpertSwiGlu, GEMV_ROUTES_LIMIT, GateUpSwiGlu, RoutePlan, Router,
    RouterKernel, RouterRoutes, TopKKernel, TopKSum,
};
use ops::moe_prefill::TcKernel;
use ops::norm::RmsNorm;
use ops::{DType, Op, TensorMeta};

use crate::GraphError;
use crate::builder::{Graph, Node, ValueId, ValueInfo, ValueKind};

/// The device a plan is lowered for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// The reference backend: the declaration runs as written.
    Cpu,
    /// An NVIDIA GPU of this compute capability (9.0 takes the Hopper-only kernels).
    Cuda { compute_capability: (u32, u32) },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cpu => f.write_str("cpu"),
            Target::Cuda {
                compute_capability: (major, minor),
            } => write!(f, "cuda sm_{major}{minor}"),
        }
    }
}

/// Every choice the lowering makes for a GPU, in one value. The defaults are what the
/// H200 measurements chose (bench/RESULTS.md); the binaries build it from their flags, and
/// the A/B environment switches documented in the README may change single fields.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LoweringOptions {
    /// hc_post, the next hc_pre and the sub-layer's norm as one op (`hc_post_pre_norm`),
    /// and an hc_pre with its norm where no hc_post precedes it (`hc_pre_norm`).
    pub fuse_hc: bool,
    /// An RMSNorm whose only reader is a BF16 product, inside that product (`norm_linear`).
    pub fuse_norm_linear: bool,
    /// Two products of the same input as one op (`linear_pair`: q_a with kv_a).
    pub pair_linears: bool,
    /// A dense SwiGLU's gate and up products and their combination as one op.
    pub fuse_gate_up: bool,
    /// The cache row (`mla_kv`) formed at its position in the cache.
    pub fuse_kv_cache_write: bool,
    /// The add of the shared expert as the top-k sum's last step.
    pub fold_shared_add: bool,
    /// The MoE's top-k sum (with the shared expert folded in) formed inside the hc boundary
    /// that reads it, where that boundary runs its pair kernel (one launch fewer a MoE layer).
    pub fuse_routed_hc: bool,
    /// The step's cache rows (the fused kv_row + kv_to_cache) and the absorbed query as one
    /// node: one launch where the query takes the per-head GEMV.
    pub fuse_query_kv: bool,
    /// The shared expert's gate+up and down ride the routed experts' launches (as more route
    /// tiles of the same grid) where those take the skinny kernel: two launches a layer fewer,
    /// and the shared expert's few tiles fill the routed grid's tail instead of a grid of
    /// their own.
    pub fuse_shared_expert: bool,
    /// Rows up to which products (and their fusions) take the weight-streaming GEMV; more
    /// take the tensor cores. At most [`GEMV_ROWS_LIMIT`].
    pub gemv_max_rows: usize,
    /// Rows up to which products over weight types no skinny kernel takes (Q6_K, Q8_0, F16,
    /// F32: the release's lm head is Q6_K) take the GEMV rather than the tensor-core tiles.
    /// At most [`GEMV_ROWS_LIMIT`].
    pub other_gemv_max_rows: usize,
    /// Rows up to which Q6_K products (the release's lm head) take the GEMV, the integer-MMA
    /// product where it takes the width, rather than the tensor-core tiles, whatever
    /// [`Self::other_gemv_max_rows`] says. At most [`GEMV_ROWS_LIMIT`]. The lm head at 8 rows:
    /// 205 µs on an H100 against the tiles' 442 on an H200 (bench/RESULTS.md 2026-12-07 (d)).
    pub q6k_gemv_max_rows: usize,
    /// Tokens up to which MLA's per-head products are a GEMV. At most [`HEAD_GEMV_ROWS_LIMIT`].
    pub head_gemv_max_rows: usize,
    /// Routes up to which the routed experts take the GEMV on integer dot products (with the
    /// shared expert beside them); more take the f32 GEMV up to
    /// [`Self::expert_gemv_max_routes`], then the skinny kernel. At most [`GEMV_ROUTES_LIMIT`].
    pub expert_int_gemv_max_routes: usize,
    /// The integer GEMV on persistent warps with a weight chunk a lane
    /// ([`ExpertKernel::IntLanes`]) where the input width allows; off: the shared-memory tiles.
    /// H100 (bench/RESULTS.md 2026-12-07 (e), run 3): one sequence 231.7 → 243.9 t/s, tg128
    /// at d65536 180.9 → 188.9.
    pub expert_int_lanes: bool,
    /// Routes up to which the routed experts take the GEMV; more take the grouped GEMM.
    /// At most [`GEMV_ROUTES_LIMIT`].
    pub expert_gemv_max_routes: usize,
    /// Rows up to which IQ4_NL products past the GEMV take the skinny kernel (the weight read
    /// once for 8 or 16 rows); more take the tensor-core tiles. H100, 128 sequences
    /// (bench/RESULTS.md 2026-12-06 (k)): the dense FFN blocks' gate+up 183.6 → 162.8 µs and
    /// down 100.4 → 60.2 µs a layer on the tiles (128 rows on the skinny kernel are eight
    /// 16-row tiles, each reading the weight again), 6,243 → 6,287 t/s.
    pub skinny_max_rows: usize,
    /// Rows up to which BF16 products past the GEMV take the skinny BF16 kernel (the weight
    /// read once for all rows, K split over the chip); more take cuBLAS. On the H200 at the
    /// release's shapes (bench/RESULTS.md 2026-12-02 (o)) the skinny kernel wins at 8 and 16
    /// rows (q_a+kv_a, attn.out and q_b: 41 and 48 µs a layer against cuBLAS's 52 and 53) and
    /// loses from 32 on (56 against 54 at 32, 91 against 55 at 64). Timed alone, outside a
    /// decode step, cuBLAS is the faster even at 8 rows, but in the decode graph (where the
    /// skinny launches load weights before their predecessor ends) all-cuBLAS decoded 8
    /// sequences at 801 / 803 t/s against 833 / 825 (2026-12-04 (x), run 5).
    pub bf16_skinny_max_rows: usize,
    /// Rows up to which a BF16 weight of at most [`BF16_SKINNY_NARROW_OUTS`] outputs (q_a and
    /// kv_a) takes the skinny BF16 kernel past [`Self::bf16_skinny_max_rows`]: cuBLAS's tiles
    /// of so few outputs leave most of the chip idle. H200, 32 rows (bench/RESULTS.md
    /// 2026-12-03 (t)): the q_a+kv_a pair 15.5 µs a layer on the skinny kernel against 21.5 on
    /// cuBLAS, where the attention output (3,584 outputs) and q_b (6,144) took 26.5 and 17.1
    /// against cuBLAS's 18.3 and 12.3.
    pub bf16_skinny_narrow_max_rows: usize,
    /// Routes up to which the routed experts past the GEMV take the skinny grouped kernel
    /// (a decode step's few routes an expert); more take the grouped GEMM.
    pub expert_skinny_max_routes: usize,
    /// Routes an expert averages up to which the skinny products take the integer path
    /// (`ExpertKernel::SkinnyInt`: inputs quantized to 16 bits a row, codes as signed bytes,
    /// 8-route tiles of integer MMAs; 0: never). A tile of at most four routes costs a k-tile
    /// 839 instructions a warp there against the f16 path's 1,063 (SASS, NVRTC 13.0), eight
    /// routes about the same; past five an expert the f16 path's 16-route tiles decode fewer
    /// weights twice.
    pub expert_skinny_int_routes_an_expert: usize,
    /// Routes an expert averages up to which, past one, the routed gate+up products on the
    /// integer path take its deep ring (`ExpertKernel::SkinnyIntDeep`: three stages at four
    /// blocks a multiprocessor, where the default takes two at five; 0: never). With more
    /// routes than experts nearly every expert is touched, so the launcher gives each warp
    /// the whole input width (14 k-tiles) on one n8 tile: its copies' latency, not its
    /// neighbours, holds it. H100 (bench/RESULTS.md 2026-12-06 (h)), gate+up a layer, deep
    /// against default ring: 32 sequences (2 routes an expert) 139.2 against 148.3 µs; 64 (4,
    /// half the experts on two n8 tiles) 176.2 against 164.4; 8 (0.5, K split over two
    /// warps) 78.6 against 76.7. Chosen so, 32 sequences decoded 2,163 t/s against 2,112 with
    /// the default ring (2026-12-06 (i), one build).
    pub expert_int_deep_ring_routes_an_expert: usize,
    /// Routes an expert averages up to which the integer path's routed gate+up products that
    /// do not take the deep ring copy their tiles' first four routes' inputs through each
    /// warp's weight ring a k-tile ahead (`ExpertKernel::SkinnyIntStaged`, four blocks a
    /// multiprocessor) rather than load them from global memory a few blocks ahead (0: never).
    /// H100 (bench/RESULTS.md 2026-12-07 (c)), gate+up a layer, staged against the default:
    /// 8 sequences (0.5 routes an expert) 71.1 against 77.7 µs; 64 (4) 170.2 against 167.1.
    /// With both thresholds as set here an H200 decoded 8 sequences at 941.0 t/s against
    /// 929.3 (the same call's means of two).
    pub expert_int_staged_gate_up_routes_an_expert: usize,
    /// The same for the down products (down's four k-tiles a route leave the global loads'
    /// latency less to hide behind): 8, 32 and 64 sequences 42.3 / 73.5 / 87.3 µs a layer
    /// against 43.0 / 77.0 / 94.1.
    pub expert_int_staged_down_routes_an_expert: usize,
    /// Routes from which the skinny expert products (integer or f16 path alike) take the
    /// streamed integer kernel (`ExpertKernel::SkinnyIntStream`) on compute capability 9.0 and
    /// later (0: never): persistent blocks two a multiprocessor, whole weight rows in flight
    /// through a two-slot ring, up to 16 routes an expert decoded at once. Off: on an H100 its
    /// products took 1.4–2.2× the integer skinny kernel's time at 8 to 128 tokens, its inputs'
    /// loads missing L1 (bench/RESULTS.md 2026-12-07 (i)).
    pub expert_int_stream_min_routes: usize,
    /// The streamed kernel moves a weight row by one bulk copy (`true`; 1.1–1.6× faster than
    /// the other form on an H100, bench/RESULTS.md 2026-12-07 (i)) rather than by a warp's
    /// 16-byte copies.
    pub expert_int_stream_bulk: bool,
    /// Tokens from which the router's logits are a tiled GEMM (64-token tiles over 256-input
    /// slices: 14 blocks for 64 tokens of the release's width, 25 µs of a decode step where
    /// the slice kernel's 4-token blocks spread over the chip).
    pub router_tiled_min_rows: usize,
    /// Tokens up to which the router's selection and the route plan run as one block (one
    /// launch fewer a MoE layer; 0: never).
    pub router_routes_max_rows: usize,
    /// Tokens from which the top-k sum builds an inverse route table first.
    pub topk_inverse_min_rows: usize,
    /// Tokens from which hc_pre's partial dots run as the tensor-core rows pass. H200
    /// (bench/RESULTS.md 2026-12-03 (t)): at 32 rows the two hc boundaries a layer took 15.9 +
    /// 15.8 µs on the rows pass against 19.6 + 19.4 on the split-K dots; at 64, 17.7 + 17.0
    /// against 30.4 + 29.8.
    pub hc_rows_min_rows: usize,
    /// 32-column chunks a warp of the rows pass takes; 0 turns the rows pass off.
    pub hc_rows_chunks_per_warp: usize,
    /// Tokens from which attention takes the f16 flash kernel (where its shape allows).
    pub attention_flash_min_rows: usize,
    /// Rows of a chunk from which it takes the flash kernel anyway when its context bucket
    /// holds at least [`FLASH_DEEP_KV`] positions (0: never): the split kernel reads the whole
    /// context once a row, the flash kernel once a 64-row tile (a 192-token chunk beside 64
    /// decode rows at 16k positions took 120 ms a step on the split kernel).
    pub attention_flash_deep_min_rows: usize,
    /// The split-K attention (decode steps, short chunks) multiplies f16 operands with f32
    /// sums, as the flash kernel does, rather than f32-class split operands (3 tensor
    /// instructions a product, which bound long-context decode on the H200).
    pub attention_f16_split: bool,
    /// With `attention_f16_split`, the latent cache is stored as F16 (what those kernels and
    /// the flash kernel round every key and value to as they read them): half the bytes a
    /// decode step reads, twice the positions a pool holds. Every plan of an engine shares the
    /// cache, so this follows the options alone, never a step's shape.
    pub f16_latent_cache: bool,
    /// Decode steps over an F16 cache take the Hopper warpgroup split kernel (tensor-memory
    /// copies of whole 64-row pages, warpgroup MMAs) on compute capability 9.0 where the
    /// attention's shape allows it ([`MlaAttention::wg_supports`]); the decode rows beside a
    /// chunk on the flash kernel keep the other split kernel. H100, full checkpoint
    /// (bench/RESULTS.md 2026-12-06 (d)): tg128 @ d131072 136.0 → 148.6 tok/s, @ d65536
    /// 164.7 → 176.0, batches of 8 to 128 +0.7 to +1.5%.
    pub attention_wg: bool,
    /// The one-token BF16 GEMVs issue their weight loads before waiting for their predecessor.
    pub pdl_weights_first: bool,
}

impl Default for LoweringOptions {
    fn default() -> Self {
        LoweringOptions {
            fuse_hc: true,
            fuse_norm_linear: true,
            pair_linears: true,
            fuse_gate_up: true,
            fuse_kv_cache_write: true,
            fold_shared_add: true,
            fuse_routed_hc: true,
            fuse_query_kv: true,
            fuse_shared_expert: true,
            gemv_max_rows: 1,
            other_gemv_max_rows: 1,
            q6k_gemv_max_rows: GEMV_ROWS_LIMIT,
            head_gemv_max_rows: HEAD_GEMV_ROWS_LIMIT,
            expert_int_gemv_max_routes: 8,
            expert_int_lanes: true,
            expert_gemv_max_routes: 0,
            skinny_max_rows: 64,
            bf16_skinny_max_rows: 16,
            bf16_skinny_narrow_max_rows: 32,
            expert_skinny_max_routes: 512,
            expert_skinny_int_routes_an_expert: 5,
            expert_int_deep_ring_routes_an_expert: 3,
            expert_int_staged_gate_up_routes_an_expert: 1,
            expert_int_staged_down_routes_an_expert: 5,
            expert_int_stream_min_routes: 0,
            expert_int_stream_bulk: true,
            router_tiled_min_rows: 512,
            router_routes_max_rows: 8,
            topk_inverse_min_rows: 132,
            hc_rows_min_rows: 32,
            hc_rows_chunks_per_warp: 1,
            attention_flash_min_rows: 256,
            attention_flash_deep_min_rows: 16,
            attention_f16_split: true,
            f16_latent_cache: true,
            attention_wg: true,
            pdl_weights_first: true,
        }
    }
}

/// Outputs up to which a BF16 weight counts as narrow for
/// [`LoweringOptions::bf16_skinny_narrow_max_rows`] (64 of the skinny kernel's 32-row tiles).
pub const BF16_SKINNY_NARROW_OUTS: usize = 2048;

/// The context bucket from which [`LoweringOptions::attention_flash_deep_min_rows`] applies.
pub const FLASH_DEEP_KV: usize = 2048;

impl fmt::Display for LoweringOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = |b: bool| if b { "on" } else { "off" };
        write!(
            f,
            "fuse hc={} norm_linear={} pair={} gate_up={} kv_write={} shared_add={} routed_hc={} query_kv={} shared_expert={}; \
             gemv<={} (other types <={}, q6_k <={}) head_gemv<={} expert_int_gemv<={}{} expert_gemv<={} routes; skinny<={} rows (bf16 <={}, narrow <={}), \
             <={} routes (int <={} an expert, deep ring <={}, staged inputs gate+up <={} down <={}, stream>={}{}); \
             router tiled>={} router+routes<={} topk inverse>={} \
             hc rows>={} (cpw {}) flash>={} (>={} from kv {}) split-k products={}{} cache={}; weights first={}",
            on(self.fuse_hc),
            on(self.fuse_norm_linear),
            on(self.pair_linears),
            on(self.fuse_gate_up),
            on(self.fuse_kv_cache_write),
            on(self.fold_shared_add),
            on(self.fuse_routed_hc),
            on(self.fuse_query_kv),
            on(self.fuse_shared_expert),
            self.gemv_max_rows,
            self.other_gemv_max_rows,
            self.q6k_gemv_max_rows,
            self.head_gemv_max_rows,
            self.expert_int_gemv_max_routes,
            if self.expert_int_lanes { " lanes" } else { "" },
            self.expert_gemv_max_routes,
            self.skinny_max_rows,
            self.bf16_skinny_max_rows,
            self.bf16_skinny_narrow_max_rows,
            self.expert_skinny_max_routes,
            self.expert_skinny_int_routes_an_expert,
            self.expert_int_deep_ring_routes_an_expert,
            self.expert_int_staged_gate_up_routes_an_expert,
            self.expert_int_staged_down_routes_an_expert,
            self.expert_int_stream_min_routes,
            if self.expert_int_stream_bulk {
                " bulk"
            } else {
                ""
            },
            self.router_tiled_min_rows,
            self.router_routes_max_rows,
            self.topk_inverse_min_rows,
            self.hc_rows_min_rows,
            self.hc_rows_chunks_per_warp,
            self.attention_flash_min_rows,
            self.attention_flash_deep_min_rows,
            FLASH_DEEP_KV,
            if self.attention_f16_split {
                "f16"
            } else {
                "f32"
            },
            if self.attention_wg { " wg" } else { "" },
            if self.latent_cache_is_f16() {
                "f16"
            } else {
                "f32"
            },
            on(self.pdl_weights_first)
        )
    }
}

impl LoweringOptions {
    /// Whether a GPU plan stores the latent cache as F16: only where every attention kernel
    /// the options allow reads f16 operands.
    pub fn latent_cache_is_f16(&self) -> bool {
        self.f16_latent_cache && self.attention_f16_split
    }

    /// Refuses thresholds past what the kernels take, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        let limits = [
            ("gemv_max_rows", self.gemv_max_rows, GEMV_ROWS_LIMIT),
            (
                "other_gemv_max_rows",
                self.other_gemv_max_rows,
                GEMV_ROWS_LIMIT,
            ),
            ("q6k_gemv_max_rows", self.q6k_gemv_max_rows, GEMV_ROWS_LIMIT),
            (
                "head_gemv_max_rows",
                self.head_gemv_max_rows,
                HEAD_GEMV_ROWS_LIMIT,
            ),
            (
                "expert_gemv_max_routes",
                self.expert_gemv_max_routes,
                GEMV_ROUTES_LIMIT,
            ),
            (
                "expert_int_gemv_max_routes",
                self.expert_int_gemv_max_routes,
                GEMV_ROUTES_LIMIT,
            ),
            (
                "hc_rows_chunks_per_warp",
                self.hc_rows_chunks_per_warp,
                ops::hc::ROWS_CHUNKS_PER_WARP_LIMIT,
            ),
        ];
        for (name, v, limit) in limits {
            if v > limit {
                return Err(format!("{name} = {v}: the kernels take at most {limit}"));
            }
        }
        Ok(())
    }

    fn linear(&self, rows: usize) -> LinearKernel {
        if rows <= self.gemv_max_rows.min(GEMV_ROWS_LIMIT) {
            LinearKernel::Gemv {
                weights_first: self.pdl_weights_first,
            }
        } else {
            LinearKernel::TensorCore
        }
    }

    /// [`Self::linear`], with the skinny kernel for a few rows over a weight it takes.
    fn linear_for(&self, rows: usize, w: Option<&TensorMeta>) -> LinearKernel {
        let base = self.linear(rows);
        let takes =
            w.is_some_and(|w| w.shape.len() == 2 && ops::linear::skinny_takes(w.dtype, w.shape[1]));
        let limit = if let Some(w) = w.filter(|w| w.dtype == DType::BF16) {
            let narrow = w
                .shape
                .first()
                .is_some_and(|&o| o <= BF16_SKINNY_NARROW_OUTS);
            if narrow {
                self.bf16_skinny_max_rows
                    .max(self.bf16_skinny_narrow_max_rows)
            } else {
                self.bf16_skinny_max_rows
            }
        } else {
            self.skinny_max_rows
        };
        let other_gemv = rows <= self.other_gemv_max_rows.min(GEMV_ROWS_LIMIT)
            && w.is_some_and(|w| !matches!(w.dtype, DType::BF16 | DType::IQ4_NL));
        let q6k_gemv = rows <= self.q6k_gemv_max_rows.min(GEMV_ROWS_LIMIT)
            && w.is_some_and(|w| {
                w.dtype == DType::Q6_K
                    && w.shape.len() == 2
                    && ops::linear::q6_k_gemv_takes(rows, w.shape[1])
            });
        if base == LinearKernel::TensorCore && rows <= limit && takes {
            LinearKernel::Skinny
        } else if base == LinearKernel::TensorCore && (other_gemv || q6k_gemv) {
            LinearKernel::Gemv {
                weights_first: self.pdl_weights_first,
            }
        } else {
            base
        }
    }

    fn head(&self, rows: usize, w: Option<&TensorMeta>) -> HeadKernel {
        // The tuned kernels read BF16 weights (the release's) of bounded input width.
        if w.is_some_and(|w| !ops::mla::tuned_head_takes(w)) {
            HeadKernel::Generic
        } else if rows <= self.head_gemv_max_rows.min(HEAD_GEMV_ROWS_LIMIT) {
            HeadKernel::Gemv
        } else {
            HeadKernel::TensorCore
        }
    }

    /// The routed experts' kernel for `routes` routes of `n_in` inputs (`swiglu`: the gate+up
    /// product, else the down projection) over the stacked weight `w`.
    fn experts(
        &self,
        routes: usize,
        n_in: usize,
        swiglu: bool,
        w: Option<&TensorMeta>,
        target: Target,
    ) -> ExpertKernel {
        // The fast kernels take IQ4_NL weights (the release's) in whole 256-value chunks of the
        // input width (a DeepSeek-V2-Lite expert's 1,408 is 5.5 of them).
        if !n_in.is_multiple_of(256) || w.is_some_and(|w| w.dtype != DType::IQ4_NL) {
            return ExpertKernel::Generic;
        }
        if routes <= self.expert_int_gemv_max_routes.min(GEMV_ROUTES_LIMIT) {
            let n_expert = w
                .and_then(|w| w.shape.first().copied())
                .unwrap_or(usize::MAX);
            return if self.expert_int_lanes && ops::moe::int_lanes_takes(n_in, swiglu, n_expert) {
                ExpertKernel::IntLanes {
                    weights_first: self.pdl_weights_first,
                }
            } else {
                ExpertKernel::IntGemv
            };
        }
        if routes <= self.expert_gemv_max_routes.min(GEMV_ROUTES_LIMIT) {
            return ExpertKernel::Gemv;
        }
        if routes <= self.expert_skinny_max_routes && ops::moe_prefill::skinny_supports(n_in) {
            // The stacked weight's first dimension: its experts.
            let n_expert = w.and_then(|w| w.shape.first().copied()).unwrap_or(0);
            let bulk_copies =
                matches!(target, Target::Cuda { compute_capability: (m, _) } if m >= 9);
            if bulk_copies
                && self.expert_int_stream_min_routes > 0
                && routes >= self.expert_int_stream_min_routes
                && n_expert <= ops::moe_prefill::STREAM_MAX_EXPERTS
                && ops::moe_prefill::stream_supports(n_in)
            {
                return ExpertKernel::SkinnyIntStream {
                    bulk: self.expert_int_stream_bulk,
                };
            }
            if routes <= self.expert_skinny_int_routes_an_expert * n_expert {
                let deep = swiglu
                    && routes > n_expert
                    && routes <= self.expert_int_deep_ring_routes_an_expert * n_expert;
                let staged = if swiglu {
                    self.expert_int_staged_gate_up_routes_an_expert
                } else {
                    self.expert_int_staged_down_routes_an_expert
                };
                return if deep {
                    ExpertKernel::SkinnyIntDeep
                } else if routes <= staged * n_expert {
                    ExpertKernel::SkinnyIntStaged
                } else {
                    ExpertKernel::SkinnyInt
                };
            }
            return ExpertKernel::Skinny;
        }
        ExpertKernel::Grouped(match target {
            Target::Cuda { compute_capability } => TcKernel::fastest_on(compute_capability),
            Target::Cpu => TcKernel::MmaSync,
        })
    }

    fn hc_pre(&self, pre: &HcPre, rows: usize, d: usize, fn_dtype: DType) -> HcPreKernel {
        if self.hc_rows_chunks_per_warp > 0
            && rows >= self.hc_rows_min_rows
            && pre.rows_supports(d, fn_dtype)
        {
            HcPreKernel::Rows {
                chunks_per_warp: self.hc_rows_chunks_per_warp,
            }
        } else {
            HcPreKernel::SplitK
        }
    }
}

/// `graph` rewritten for `target`: on a GPU, fused as `opts` says and every node's kernel
/// variant chosen from its rows; on the CPU, unchanged.
pub fn lower(graph: Graph, target: Target, opts: &LoweringOptions) -> Result<Graph, GraphError> {
    if target == Target::Cpu {
        return Ok(graph);
    }
    opts.validate().map_err(GraphError::Lowering)?;
    let mut f = Fusions::new(graph);
    if opts.fuse_hc {
        f.hc_boundaries();
    }
    if opts.fuse_gate_up {
        f.gate_up();
    }
    if opts.pair_linears {
        f.linear_pairs();
    }
    if opts.fuse_norm_linear {
        f.norm_linear();
    }
    if opts.fuse_kv_cache_write {
        f.kv_cache_write();
    }
    if opts.fold_shared_add {
        f.shared_add();
    }
    if opts.fuse_routed_hc && opts.fuse_hc && opts.fold_shared_add {
        f.routed_boundaries();
    }
    if opts.fuse_query_kv && opts.fuse_kv_cache_write {
        f.query_kv();
    }
    if opts.fuse_shared_expert && opts.fuse_gate_up {
        f.shared_expert(opts, target);
    }
    f.router_routes(opts.router_routes_max_rows);
    let mut g = f.finish();
    if opts.latent_cache_is_f16() {
        narrow_latent_caches(&mut g);
    }
    for n in 0..g.nodes.len() {
        if let Some(op) = choose_kernel(&g, &g.nodes[n], target, opts) {
            g.nodes[n].op = op;
        }
        refuse_unsupported(&g, &g.nodes[n])?;
    }
    Ok(g)
}

/// Every state an attention node reads as its cache, and every write's view of it, stored as
/// F16 (the writers round and saturate as the f16 kernels did on read); rows of a width the
/// f16 split kernel does not stage (not whole groups of 8) stay F32.
fn narrow_latent_caches(g: &mut Graph) {
    let root = |g: &Graph, mut v: ValueId| {
        while let Some(a) = g.values[v.0].alias_of {
            v = a;
        }
        v
    };
    let caches: Vec<ValueId> = g
        .nodes
        .iter()
        .filter(|n| op_as::<MlaAttention>(n).is_some())
        .filter_map(|n| n.inputs.get(1).copied())
        .map(|v| root(g, v))
        .filter(|v| {
            let m = &g.values[v.0].meta;
            // The f16 split kernel stages rows in 16-byte chunks: whole groups of 8 values.
            g.values[v.0].kind == ValueKind::State
                && m.dtype == DType::F32
                && m.shape.get(1).is_some_and(|w| w.is_multiple_of(8))
        })
        .collect();
    for i in 0..g.values.len() {
        if caches.contains(&root(g, ValueId(i))) {
            g.values[i].meta.dtype = DType::F16;
        }
    }
}

/// Shapes no CUDA kernel of the node covers, refused when the plan is made (at load) with the
/// node, its inputs and the rule, rather than when a step first launches it.
fn refuse_unsupported(g: &Graph, node: &Node) -> Result<(), GraphError> {
    if let Some(op) = op_as::<MlaAttention>(node) {
        let width = meta(g, node, 1)
            .and_then(|m| m.shape.get(1).copied())
            .unwrap_or(0);
        op.split_k_supports(width)
            .map_err(|source| GraphError::Op {
                node: node.name.clone(),
                describe: op.describe(),
                inputs: node
                    .inputs
                    .iter()
                    .map(|v| g.values[v.0].name.clone())
                    .collect(),
                source,
            })?;
    }
    Ok(())
}

fn op_as<T: 'static>(node: &Node) -> Option<&T> {
    let any: &dyn Any = node.op.as_ref();
    any.downcast_ref::<T>()
}

/// Leading dimension of a node's input `i` (its rows).
fn rows(g: &Graph, node: &Node, i: usize) -> usize {
    node.inputs
        .get(i)
        .and_then(|v| g.value(*v).meta.shape.first().copied())
        .unwrap_or(0)
}

fn meta<'g>(g: &'g Graph, node: &Node, i: usize) -> Option<&'g TensorMeta> {
    node.inputs.get(i).map(|v| &g.value(*v).meta)
}

/// The node's op with its kernel variant set, or None for ops without variants.
fn choose_kernel(
    g: &Graph,
    node: &Node,
    target: Target,
    o: &LoweringOptions,
) -> Option<Arc<dyn Op>> {
    let r0 = rows(g, node, 0);
    let width = |i: usize| {
        meta(g, node, i)
            .and_then(|m| m.shape.last().copied())
            .unwrap_or(0)
    };
    let hc_kernel = |pre: &HcPre, streams: usize, fn_at: usize| {
        let d = meta(g, node, streams)
            .and_then(|m| m.shape.last().copied())
            .unwrap_or(0);
        let fn_dtype = meta(g, node, fn_at).map_or(DType::F32, |m| m.dtype);
        o.hc_pre(pre, r0, d, fn_dtype)
    };
    if op_as::<Linear>(node).is_some() {
        return Some(Arc::new(Linear::with(o.linear_for(r0, meta(g, node, 1)))));
    }
    if op_as::<LinearPair>(node).is_some() {
        // The pair is skinny when both weights are (q_a and kv_a share their type).
        let (w1, w2) = (meta(g, node, 1), meta(g, node, 2));
        let kernel = match (o.linear_for(r0, w1), o.linear_for(r0, w2)) {
            (a, b) if a == b => a,
            _ => o.linear(r0),
        };
        return Some(Arc::new(LinearPair { kernel }));
    }
    if let Some(op) = op_as::<NormLinear>(node) {
        return Some(Arc::new(NormLinear {
            kernel: o.linear_for(r0, meta(g, node, 2)),
            ..op.clone()
        }));
    }
    if op_as::<GateUpSwiGlu>(node).is_some() {
        // Gate and up share their type and shape (GateUpSwiGlu::infer).
        return Some(Arc::new(GateUpSwiGlu {
            kernel: o.linear_for(r0, meta(g, node, 1)),
        }));
    }
    if let Some(op) = op_as::<MlaQuery>(node) {
        return Some(Arc::new(MlaQuery {
            kernel: o.head(rows(g, node, 2), meta(g, node, 1)),
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<MlaQueryKv>(node) {
        let mut op = op.clone();
        op.query.kernel = o.head(rows(g, node, 3), meta(g, node, 6));
        return Some(Arc::new(op));
    }
    if let Some(op) = op_as::<MlaValueOut>(node) {
        return Some(Arc::new(MlaValueOut {
            kernel: o.head(r0, meta(g, node, 1)),
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<MlaAttention>(node) {
        let width = meta(g, node, 1)
            .and_then(|m| m.shape.get(1).copied())
            .unwrap_or(0);
        // The flash kernel stages one sequence's positions for the whole chunk. A step's rows
        // lead with one sequence's chunk (plan::Bucket): a prefill chunk is all of them, a
        // mixed step's is followed by one decode row for each other sequence of the table.
        let seqs = meta(g, node, 3)
            .and_then(|m| m.shape.first().copied())
            .unwrap_or(1);
        let n = rows(g, node, 2);
        let lead = (n + 1).saturating_sub(seqs.max(1));
        let kv = meta(g, node, 3)
            .and_then(|m| m.shape.get(1).copied())
            .unwrap_or(0)
            * op.block_size;
        let deep = o.attention_flash_deep_min_rows > 0
            && lead >= o.attention_flash_deep_min_rows
            && kv >= FLASH_DEEP_KV;
        let flash = (lead >= o.attention_flash_min_rows || deep) && op.flash_supports(width);
        let hopper = matches!(
            target,
            Target::Cuda {
                compute_capability: (9, 0)
            }
        );
        let split = if o.attention_wg && hopper && o.latent_cache_is_f16() && op.wg_supports(width)
        {
            AttentionPath::SplitKWg
        } else if o.attention_f16_split {
            AttentionPath::SplitKF16
        } else {
            AttentionPath::SplitK
        };
        return Some(Arc::new(MlaAttention {
            kernel: match (flash, seqs) {
                (true, 1) => AttentionPath::Flash,
                (true, _) => AttentionPath::FlashThenSplit {
                    lead,
                    f16: o.attention_f16_split,
                },
                (false, _) => split,
            },
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<Router>(node) {
        return Some(Arc::new(Router {
            kernel: if r0 >= o.router_tiled_min_rows {
                RouterKernel::Tiled
            } else {
                RouterKernel::Slices
            },
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<RouterRoutes>(node) {
        let mut op = op.clone();
        op.router.kernel = if r0 >= o.router_tiled_min_rows {
            RouterKernel::Tiled
        } else {
            RouterKernel::Slices
        };
        return Some(Arc::new(op));
    }
    if let Some(op) = op_as::<TopKSum>(node) {
        return Some(Arc::new(TopKSum {
            kernel: if rows(g, node, 2) >= o.topk_inverse_min_rows {
                TopKKernel::InverseTable
            } else {
                TopKKernel::Scan
            },
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<ExpertSwiGlu>(node) {
        return Some(Arc::new(ExpertSwiGlu {
            kernel: o.experts(rows(g, node, 4), width(0), true, meta(g, node, 1), target),
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<ExpertDown>(node) {
        return Some(Arc::new(ExpertDown {
            kernel: o.experts(r0, width(0), false, meta(g, node, 1), target),
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<HcPre>(node) {
        return Some(Arc::new(HcPre {
            kernel: hc_kernel(op, 0, 1),
            ..op.clone()
        }));
    }
    if let Some(op) = op_as::<HcPreNorm>(node) {
        let mut op = op.clone();
        op.pre.kernel = hc_kernel(&op.pre, 0, 1);
        return Some(Arc::new(op));
    }
    if let Some(op) = op_as::<HcPostPreNorm>(node) {
        let mut op = op.clone();
        op.pre_norm.pre.kernel = hc_kernel(&op.pre_norm.pre, 1, 4);
        return Some(Arc::new(op));
    }
    if let Some(op) = op_as::<HcRoutedPostPreNorm>(node) {
        // Input 0 holds the routes (top_k a token); the tokens are H's rows (input 4).
        let mut op = op.clone();
        let n = rows(g, node, 4);
        op.sum.kernel = if n >= o.topk_inverse_min_rows {
            TopKKernel::InverseTable
        } else {
            TopKKernel::Scan
        };
        let d = meta(g, node, 4)
            .and_then(|m| m.shape.last().copied())
            .unwrap_or(0);
        let fn_dtype = meta(g, node, 7).map_or(DType::F32, |m| m.dtype);
        let pre = &op.boundary.pre_norm.pre;
        op.boundary.pre_norm.pre.kernel = o.hc_pre(pre, n, d, fn_dtype);
        return Some(Arc::new(op));
    }
    None
}

/// The rewrites, over a graph whose nodes may be retired (None) until [`Fusions::finish`].
struct Fusions {
    values: Vec<ValueInfo>,
    nodes: Vec<Option<Node>>,
    outputs: Vec<(String, ValueId)>,
}

/// Who produces and who reads each value, at the start of a pass.
struct Uses {
    producer: Vec<Option<usize>>,
    readers: Vec<Vec<usize>>,
    is_output: Vec<bool>,
}

impl Uses {
    /// The one node that reads `v`, when exactly one does and `v` is not a step output.
    fn sole_reader(&self, v: ValueId) -> Option<usize> {
        match self.readers[v.0].as_slice() {
            [one] if !self.is_output[v.0] => Some(*one),
            _ => None,
        }
    }
}

/// `a+b+c` with the scope each shares with the one before it left out: readable names for
/// fused nodes (`blk.3.attn.q_a_norm+q_b`).
fn joined(names: &[&str]) -> String {
    let mut out = names[0].to_string();
    for w in names.windows(2) {
        let scope = |s: &str| s.rfind('.').map_or(String::new(), |i| s[..=i].to_string());
        let (prev, next) = (w[0], w[1]);
        let tail = match next.strip_prefix(&scope(prev)) {
            Some(t) if !scope(prev).is_empty() => t,
            _ => next,
        };
        out.push('+');
        out.push_str(tail);
    }
    out
}

impl Fusions {
    fn new(g: Graph) -> Fusions {
        Fusions {
            values: g.values,
            nodes: g.nodes.into_iter().map(Some).collect(),
            outputs: g.outputs,
        }
    }

    fn uses(&self) -> Uses {
        let mut producer = vec![None; self.values.len()];
        let mut readers = vec![Vec::new(); self.values.len()];
        for (n, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            for o in &node.outputs {
                producer[o.0] = Some(n);
            }
            for i in &node.inputs {
                if !readers[i.0].contains(&n) {
                    readers[i.0].push(n);
                }
            }
        }
        let mut is_output = vec![false; self.values.len()];
        for (_, v) in &self.outputs {
            is_output[v.0] = true;
        }
        Uses {
            producer,
            readers,
            is_output,
        }
    }

    fn node(&self, n: usize) -> Option<&Node> {
        self.nodes[n].as_ref()
    }

    fn as_op<T: 'static>(&self, n: usize) -> Option<&T> {
        self.node(n).and_then(op_as::<T>)
    }

    /// Replaces nodes `gone` by one node at index `at` (one of them).
    fn fuse(
        &mut self,
        at: usize,
        gone: &[usize],
        op: impl Op + 'static,
        inputs: Vec<ValueId>,
        outputs: Vec<ValueId>,
    ) {
        let names: Vec<String> = gone
            .iter()
            .filter_map(|&n| self.node(n).map(|x| x.name.clone()))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let name = joined(&refs);
        for &n in gone {
            self.nodes[n] = None;
        }
        self.nodes[at] = Some(Node {
            name,
            op: Arc::new(op),
            inputs,
            outputs,
        });
    }

    /// `hc_post → hc_pre → rms_norm` (the norm the only reader of hc_pre's x) as one
    /// `hc_post_pre_norm`; an `hc_pre → rms_norm` with no hc_post before it as `hc_pre_norm`.
    fn hc_boundaries(&mut self) {
        let u = self.uses();
        for q in 0..self.nodes.len() {
            let Some(pre) = self.as_op::<HcPre>(q).cloned() else {
                continue;
            };
            let qn = self.nodes[q].clone().expect("live");
            let x = qn.outputs[0];
            let Some(r) = u.sole_reader(x) else { continue };
            let Some(norm) = self.as_op::<RmsNorm>(r).cloned() else {
                continue;
            };
            let rn = self.nodes[r].clone().expect("live");
            if rn.inputs.first() != Some(&x) || rn.inputs.len() != 2 {
                continue;
            }
            let pre_norm = HcPreNorm {
                pre,
                norm_eps: norm.eps,
            };
            let post = u.producer[qn.inputs[0].0].filter(|&p| self.as_op::<HcPost>(p).is_some());
            match post {
                Some(p) => {
                    let pn = self.nodes[p].clone().expect("live");
                    let hc_post = self.as_op::<HcPost>(p).cloned().expect("checked");
                    let mut inputs = pn.inputs.clone();
                    inputs.extend_from_slice(&qn.inputs[1..]);
                    inputs.push(rn.inputs[1]);
                    let outputs = vec![pn.outputs[0], rn.outputs[0], qn.outputs[1], qn.outputs[2]];
                    let op = HcPostPreNorm {
                        post: hc_post,
                        pre_norm,
                    };
                    self.fuse(p, &[p, q, r], op, inputs, outputs);
                }
                None => {
                    let mut inputs = qn.inputs.clone();
                    inputs.push(rn.inputs[1]);
                    let outputs = vec![rn.outputs[0], qn.outputs[1], qn.outputs[2]];
                    self.fuse(q, &[q, r], pre_norm, inputs, outputs);
                }
            }
        }
    }

    /// `swiglu(linear(z, Wg), linear(z, Wu))`, the products read by nothing else, as one
    /// `gate_up_swiglu`.
    fn gate_up(&mut self) {
        let u = self.uses();
        for s in 0..self.nodes.len() {
            if self.as_op::<SwiGlu>(s).is_none() {
                continue;
            }
            let sn = self.nodes[s].clone().expect("live");
            let [g, up] = sn.inputs[..] else { continue };
            let (Some(gp), Some(upp)) = (u.producer[g.0], u.producer[up.0]) else {
                continue;
            };
            if gp == upp
                || self.as_op::<Linear>(gp).is_none()
                || self.as_op::<Linear>(upp).is_none()
                || u.sole_reader(g) != Some(s)
                || u.sole_reader(up) != Some(s)
            {
                continue;
            }
            let (gn, un) = (
                self.nodes[gp].clone().expect("live"),
                self.nodes[upp].clone().expect("live"),
            );
            if gn.inputs[0] != un.inputs[0] {
                continue;
            }
            let inputs = vec![gn.inputs[0], gn.inputs[1], un.inputs[1]];
            let at = gp.min(upp);
            let op = GateUpSwiGlu::default();
            self.fuse(at, &[gp, upp, s], op, inputs, sn.outputs.clone());
        }
    }

    /// The first two products of one input as a `linear_pair`.
    fn linear_pairs(&mut self) {
        let mut first_of: HashMap<ValueId, usize> = HashMap::new();
        for n in 0..self.nodes.len() {
            if self.as_op::<Linear>(n).is_none() {
                continue;
            }
            let x = self.nodes[n].as_ref().expect("live").inputs[0];
            let Some(a) = first_of.remove(&x) else {
                first_of.insert(x, n);
                continue;
            };
            let (an, bn) = (
                self.nodes[a].clone().expect("live"),
                self.nodes[n].clone().expect("live"),
            );
            let inputs = vec![x, an.inputs[1], bn.inputs[1]];
            let outputs = vec![an.outputs[0], bn.outputs[0]];
            self.fuse(a, &[a, n], LinearPair::default(), inputs, outputs);
            // A third product of `x` pairs with a fourth, not with this pair.
        }
    }

    /// `linear(rms_norm(x, w), W)` with a BF16 W and the product the norm's only reader, as
    /// one `norm_linear` (the norm inside the one-token BF16 GEMV).
    fn norm_linear(&mut self) {
        let u = self.uses();
        for r in 0..self.nodes.len() {
            let Some(norm) = self.as_op::<RmsNorm>(r).cloned() else {
                continue;
            };
            let rn = self.nodes[r].clone().expect("live");
            let Some(l) = u.sole_reader(rn.outputs[0]) else {
                continue;
            };
            if self.as_op::<Linear>(l).is_none() || rn.inputs.len() != 2 {
                continue;
            }
            let ln = self.nodes[l].clone().expect("live");
            if ln.inputs[0] != rn.outputs[0]
                || self.values[ln.inputs[1].0].meta.dtype != DType::BF16
            {
                continue;
            }
            let op = NormLinear {
                eps: norm.eps,
                kernel: LinearKernel::Unlowered,
            };
            let inputs = vec![rn.inputs[0], rn.inputs[1], ln.inputs[1]];
            self.fuse(r, &[r, l], op, inputs, ln.outputs.clone());
        }
    }

    /// `kv_cache_write(cache, mla_kv(kv, w, pos), slots)`, the row read by nothing else, as
    /// one `mla_kv_cache_write`.
    fn kv_cache_write(&mut self) {
        let u = self.uses();
        for w in 0..self.nodes.len() {
            if self.as_op::<KvCacheWrite>(w).is_none() {
                continue;
            }
            let wn = self.nodes[w].clone().expect("live");
            let [cache, row, slots] = wn.inputs[..] else {
                continue;
            };
            let Some(k) = u.producer[row.0] else { continue };
            let Some(kv) = self.as_op::<MlaKv>(k).cloned() else {
                continue;
            };
            let kn = self.nodes[k].clone().expect("live");
            if u.sole_reader(row) != Some(w) {
                continue;
            }
            let inputs = vec![cache, kn.inputs[0], kn.inputs[1], kn.inputs[2], slots];
            self.fuse(
                k,
                &[k, w],
                MlaKvCacheWrite { kv },
                inputs,
                wn.outputs.clone(),
            );
        }
    }

    /// `add(topk_sum(...), shared)` (either order), the sum read by nothing else, as a
    /// `topk_sum` with the addend (the same bits: the add is its last step).
    fn shared_add(&mut self) {
        let u = self.uses();
        for a in 0..self.nodes.len() {
            if self.as_op::<Add>(a).is_none() {
                continue;
            }
            let an = self.nodes[a].clone().expect("live");
            let [l, r] = an.inputs[..] else { continue };
            let sum_of = |v: ValueId| {
                u.producer[v.0].filter(|&t| {
                    self.as_op::<TopKSum>(t).is_some()
                        && self.nodes[t].as_ref().is_some_and(|n| n.inputs.len() == 3)
                        && u.sole_reader(v) == Some(a)
                })
            };
            let (t, addend) = match (sum_of(l), sum_of(r)) {
                (Some(t), _) => (t, r),
                (None, Some(t)) => (t, l),
                _ => continue,
            };
            let tn = self.nodes[t].clone().expect("live");
            let op = self.as_op::<TopKSum>(t).cloned().expect("checked");
            let mut inputs = tn.inputs.clone();
            inputs.push(addend);
            self.fuse(a, &[t, a], op, inputs, an.outputs.clone());
        }
    }

    /// `hc_post_pre_norm(topk_sum(rows, slots, weights, shared), H, …)`, the sum read by
    /// nothing else, as one `hc_routed_post_pre_norm`.
    fn routed_boundaries(&mut self) {
        let u = self.uses();
        for q in 0..self.nodes.len() {
            let Some(boundary) = self.as_op::<HcPostPreNorm>(q).cloned() else {
                continue;
            };
            let qn = self.nodes[q].clone().expect("live");
            let y = qn.inputs[0];
            let Some(t) = u.producer[y.0] else { continue };
            let Some(sum) = self.as_op::<TopKSum>(t).cloned() else {
                continue;
            };
            let tn = self.nodes[t].clone().expect("live");
            if tn.inputs.len() != 4 || u.sole_reader(y) != Some(q) {
                continue;
            }
            let mut inputs = tn.inputs.clone();
            inputs.extend_from_slice(&qn.inputs[1..]);
            let op = HcRoutedPostPreNorm { sum, boundary };
            self.fuse(q, &[t, q], op, inputs, qn.outputs.clone());
        }
    }

    /// The `mla_query` and `mla_kv_cache_write` an attention node reads (its query and its
    /// cache), over the same positions, the query read by nothing else, as one `mla_query_kv`.
    fn query_kv(&mut self) {
        let u = self.uses();
        for a in 0..self.nodes.len() {
            if self.as_op::<MlaAttention>(a).is_none() {
                continue;
            }
            let an = self.nodes[a].clone().expect("live");
            let (Some(q), Some(w)) = (u.producer[an.inputs[0].0], u.producer[an.inputs[1].0])
            else {
                continue;
            };
            let (Some(query), Some(write)) = (
                self.as_op::<MlaQuery>(q).cloned(),
                self.as_op::<MlaKvCacheWrite>(w).cloned(),
            ) else {
                continue;
            };
            let (qn, wn) = (
                self.nodes[q].clone().expect("live"),
                self.nodes[w].clone().expect("live"),
            );
            if qn.inputs[2] != wn.inputs[3] || u.sole_reader(an.inputs[0]) != Some(a) {
                continue;
            }
            let mut inputs = wn.inputs.clone();
            inputs.extend_from_slice(&qn.inputs[..2]);
            let outputs = vec![wn.outputs[0], qn.outputs[0]];
            let op = MlaQueryKv {
                query,
                kv: write.kv,
            };
            self.fuse(q.max(w), &[q, w], op, inputs, outputs);
        }
    }

    /// The shared expert (`gate_up_swiglu(z)` then its down `linear`, IQ4_NL of the routed
    /// experts' widths) carried by the routed `expert_swiglu(z, …)` and `expert_down` where both
    /// take the skinny kernel at this step's routes: each pair one node with two outputs, at
    /// the later of its two places, so long as everything that reads the down products comes
    /// after it (the routed sum, folded into its boundary, does).
    fn shared_expert(&mut self, o: &LoweringOptions, target: Target) {
        let u = self.uses();
        for e in 0..self.nodes.len() {
            let Some(experts) = self.as_op::<ExpertSwiGlu>(e).cloned() else {
                continue;
            };
            let en = self.nodes[e].clone().expect("live");
            let [z, w_gate, _, _, route_token] = en.inputs[..] else {
                continue;
            };
            let act = en.outputs[0];
            let Some(dn) = u.sole_reader(act) else {
                continue;
            };
            let Some(down) = self.as_op::<ExpertDown>(dn).cloned() else {
                continue;
            };
            let dnn = self.nodes[dn].clone().expect("live");
            let Some(&g) = u.readers[z.0]
                .iter()
                .find(|&&r| self.as_op::<GateUpSwiGlu>(r).is_some())
            else {
                continue;
            };
            let gn = self.nodes[g].clone().expect("live");
            let act_sh = gn.outputs[0];
            let Some(l) = u.sole_reader(act_sh) else {
                continue;
            };
            if self.as_op::<Linear>(l).is_none() || dnn.inputs.len() != 3 {
                continue;
            }
            let ln = self.nodes[l].clone().expect("live");
            let meta = |v: ValueId| &self.values[v.0].meta;
            let d = meta(z).shape.last().copied().unwrap_or(0);
            let nf = experts.n_ff;
            let iq4 = |v: ValueId, shape: &[usize]| {
                meta(v).dtype == DType::IQ4_NL && meta(v).shape.as_slice() == shape
            };
            if ln.inputs[0] != act_sh
                || !iq4(gn.inputs[1], &[nf, d])
                || !iq4(gn.inputs[2], &[nf, d])
                || !iq4(ln.inputs[1], &[down.n_embd, nf])
            {
                continue;
            }
            let routes = meta(route_token).shape.first().copied().unwrap_or(0);
            let skinny = |n_in: usize, swiglu: bool, w: ValueId| {
                let k = o.experts(routes, n_in, swiglu, Some(meta(w)), target);
                k.is_skinny() || matches!(k, ExpertKernel::IntGemv | ExpertKernel::IntLanes { .. })
            };
            if !skinny(d, true, w_gate) || !skinny(nf, false, dnn.inputs[1]) {
                continue;
            }
            let (at_act, at_down) = (e.max(g), dn.max(l));
            let read_late = [dnn.outputs[0], ln.outputs[0]]
                .iter()
                .all(|v| u.readers[v.0].iter().all(|&r| r > at_down));
            if !read_late {
                continue;
            }
            let mut inputs = en.inputs.clone();
            inputs.extend_from_slice(&gn.inputs[1..]);
            self.fuse(at_act, &[e, g], experts, inputs, vec![act, act_sh]);
            let mut inputs = dnn.inputs.clone();
            inputs.extend_from_slice(&[act_sh, ln.inputs[1]]);
            let outputs = vec![dnn.outputs[0], ln.outputs[0]];
            self.fuse(at_down, &[dn, l], down, inputs, outputs);
        }
    }

    /// `route_plan(router(z, W[, bias]).ids)` over at most `max_rows` tokens as one
    /// `router_routes`. The ids stay an output: the plan reads them back in the same launch.
    fn router_routes(&mut self, max_rows: usize) {
        let u = self.uses();
        for p in 0..self.nodes.len() {
            let Some(plan) = self.as_op::<RoutePlan>(p).cloned() else {
                continue;
            };
            let pn = self.nodes[p].clone().expect("live");
            let Some(r) = u.producer[pn.inputs[0].0] else {
                continue;
            };
            let Some(router) = self.as_op::<Router>(r).cloned() else {
                continue;
            };
            let rn = self.nodes[r].clone().expect("live");
            let tokens = self.values[rn.inputs[0].0]
                .meta
                .shape
                .first()
                .copied()
                .unwrap_or(0);
            if rn.outputs[0] != pn.inputs[0] || tokens > max_rows {
                continue;
            }
            let mut outputs = rn.outputs.clone();
            outputs.extend_from_slice(&pn.outputs);
            let op = RouterRoutes { router, plan };
            self.fuse(r, &[r, p], op, rn.inputs.clone(), outputs);
        }
    }

    /// The live nodes, and only the values they (or the step's outputs, or the engine as
    /// inputs) still use, renumbered.
    fn finish(self) -> Graph {
        let nodes: Vec<Node> = self.nodes.into_iter().flatten().collect();
        let mut used = vec![false; self.values.len()];
        for node in &nodes {
            for v in node.inputs.iter().chain(&node.outputs) {
                used[v.0] = true;
            }
        }
        for (_, v) in &self.outputs {
            used[v.0] = true;
        }
        for (i, v) in self.values.iter().enumerate() {
            if v.kind == ValueKind::Input {
                used[i] = true;
            }
        }
        let mut new_id = vec![None; self.values.len()];
        let mut values = Vec::new();
        for (i, v) in self.values.into_iter().enumerate() {
            if used[i] {
                new_id[i] = Some(ValueId(values.len()));
                values.push(v);
            }
        }
        let map = |v: ValueId| new_id[v.0].expect("a used value");
        for v in &mut values {
            v.alias_of = v.alias_of.map(map);
        }
        let nodes = nodes
            .into_iter()
            .map(|n| Node {
                inputs: n.inputs.into_iter().map(map).collect(),
                outputs: n.outputs.into_iter().map(map).collect(),
                ..n
            })
            .collect();
        let outputs = self
            .outputs
            .into_iter()
            .map(|(name, v)| (name, map(v)))
            .collect();
        Graph {
            values,
            nodes,
            outputs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_names_drop_the_scope_they_share() {
        assert_eq!(
            joined(&["blk.3.attn.q_a_norm", "blk.3.attn.q_b"]),
            "blk.3.attn.q_a_norm+q_b"
        );
        assert_eq!(
            joined(&["blk.0.hc_ffn_post", "blk.1.hc_attn_pre", "blk.1.attn_norm"]),
            "blk.0.hc_ffn_post+blk.1.hc_attn_pre+attn_norm"
        );
    }

    #[test]
    fn thresholds_past_the_kernels_are_refused_by_name() {
        let o = LoweringOptions {
            gemv_max_rows: 9,
            ..LoweringOptions::default()
        };
        assert!(o.validate().unwrap_err().contains("gemv_max_rows = 9"));
        assert!(LoweringOptions::default().validate().is_ok());
    }

    #[test]
    fn the_q6_k_lm_head_takes_the_gemv_up_to_eight_rows_and_the_tiles_past() {
        let o = LoweringOptions::default();
        let head = TensorMeta::new([131_072, 3584], DType::Q6_K);
        let gemv = LinearKernel::Gemv {
            weights_first: o.pdl_weights_first,
        };
        for rows in 1..=8 {
            assert_eq!(o.linear_for(rows, Some(&head)), gemv, "{rows} rows");
        }
        assert_eq!(o.linear_for(9, Some(&head)), LinearKernel::TensorCore);
        // A row too long for the integer-MMA product's shared memory stays on the tiles past
        // one row (the generic GEMV was 3.4× slower than them at 8), as does a Q8_0 weight.
        let long = TensorMeta::new([4096, 65_536], DType::Q6_K);
        assert_eq!(o.linear_for(2, Some(&long)), LinearKernel::TensorCore);
        let q8 = TensorMeta::new([4096, 3584], DType::Q8_0);
        assert_eq!(o.linear_for(2, Some(&q8)), LinearKernel::TensorCore);
        // Turned off, the tiles from two rows.
        let off = LoweringOptions {
            q6k_gemv_max_rows: 1,
            ..o
        };
        assert_eq!(off.linear_for(2, Some(&head)), LinearKernel::TensorCore);
    }

    #[test]
    fn the_lane_chunk_expert_gemv_takes_what_a_warp_covers_unless_turned_off() {
        let h100 = Target::Cuda {
            compute_capability: (9, 0),
        };
        let gate = TensorMeta::new([64, 1024, 3584], DType::IQ4_NL);
        let down = TensorMeta::new([64, 3584, 1024], DType::IQ4_NL);
        let on = LoweringOptions::default();
        let off = LoweringOptions {
            expert_int_lanes: false,
            ..on
        };
        assert_eq!(
            off.experts(4, 3584, true, Some(&gate), h100),
            ExpertKernel::IntGemv
        );
        let lanes = ExpertKernel::IntLanes {
            weights_first: on.pdl_weights_first,
        };
        assert_eq!(on.experts(4, 3584, true, Some(&gate), h100), lanes);
        assert_eq!(on.experts(8, 1024, false, Some(&down), h100), lanes);
        // A gate and an up row of 4,352 inputs are 34 chunks, more than a warp's lanes; 300
        // experts overflow the kernel's list; 9 routes are past the integer GEMV.
        let wide = TensorMeta::new([64, 1024, 4352], DType::IQ4_NL);
        assert_eq!(
            on.experts(4, 4352, true, Some(&wide), h100),
            ExpertKernel::IntGemv
        );
        let many = TensorMeta::new([300, 1024, 3584], DType::IQ4_NL);
        assert_eq!(
            on.experts(4, 3584, true, Some(&many), h100),
            ExpertKernel::IntGemv
        );
        assert_ne!(on.experts(9, 3584, true, Some(&gate), h100), lanes);
    }
}
