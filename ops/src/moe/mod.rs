//! Routed experts (spec §3.7) with reproducible sums (seed §4).
//!
//! `Router` picks each token's experts, `RoutePlan` sorts the `n·top_k` routes by expert into
//! a static-size CSR table, `ExpertSwiGlu` and `ExpertDown` run every route of an expert
//! together (its weight rows are read once per chunk) and write one row per route, and
//! `TopKSum` adds each token's routes in slot order. No output element has two writers and
//! no sum depends on scheduling, so a chunk gives the same bits on every run and thread count.
//!
//! The ops and their shape rules are here, the CPU references in `cpu.rs`, the CUDA launches
//! in `cuda.rs` (`moe.cu`, compiled after `dequant/dequant.cuh`), and the tensor-core expert
//! GEMMs for prefill in `prefill.rs` (`moe_prefill.cu`, also `ops::moe_prefill`).

pub mod cases;
mod cpu;
mod cuda;
pub mod prefill;

use crate::check::{expect, expect_inputs, expect_weight, nonzero};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::linear::{Linear, LinearKernel};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub use cpu::ExpertStack;
pub(crate) use cuda::MOE_CU;
use prefill::TcKernel;

/// Input values one `router_logits` block column sums (`RL_SLICE` there).
const ROUTER_SLICE: usize = 128;

/// The most routes the expert GEMV kernels take in one launch.
pub const GEMV_ROUTES_LIMIT: usize = 32;

/// The most experts [`ExpertKernel::IntLanes`] lists (`IQL_EXPERTS` in moe.cu).
pub const INT_LANES_EXPERTS: usize = 256;

/// Whether [`ExpertKernel::IntLanes`] takes an expert product of `n_in` inputs over
/// `n_expert` experts: whole 256-value chunks, one a lane, a warp's 32 lanes covering at least
/// one output (a gate and an up row for SwiGLU: up to 4,096 inputs; the down projection's one
/// row: up to 8,192), at most [`INT_LANES_EXPERTS`] experts.
pub fn int_lanes_takes(n_in: usize, swiglu: bool, n_expert: usize) -> bool {
    let rows = if swiglu { 2 } else { 1 };
    n_in > 0
        && n_in.is_multiple_of(256)
        && rows * (n_in / 256) <= 32
        && n_expert <= INT_LANES_EXPERTS
}

/// Most routes a GEMV block sums at once (the largest `expert_rows_iq4_<NR>`).
const GEMV_MAXR: usize = 8;

/// llama.cpp's floor for the sum the top-k weights are normalised by: 6.103515625e-5 = 2⁻¹⁴,
/// the smallest normal f16.
pub const NORM_GUARD: f32 = 1.0 / 16384.0;

fn too_big(op: &'static str, what: &str, v: usize) -> Result<(), OpError> {
    if v > i32::MAX as usize {
        return Err(OpError::shape(
            op,
            format!("{what} {v} does not fit an I32 index"),
        ));
    }
    Ok(())
}

// ---- Router --------------------------------------------------------------------------

/// How router logits become expert scores: the loader's reading of `expert_gating_func`.
pub use loader::hparams::ExpertGating as Gating;

/// Top-k expert selection (spec §3.7, llama.cpp `build_moe_ffn`).
///
/// Scores `p = gating(W·z)` in f32; the `top_k` largest `p + bias` are chosen in descending
/// order (ties: lower expert id first); the weights are the *unbiased* `p` of those experts,
/// divided by `max(Σ, 6.103515625e-5)` when `norm_topk`, then multiplied by `scale`.
///
/// Inputs: z F32 `[n, D]`, W F32 `[n_expert, D]`, optional bias F32 `[n_expert]`.
/// Outputs: ids I32 `[n, top_k]`, weights F32 `[n, top_k]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Router {
    pub n_expert: usize,
    pub top_k: usize,
    pub gating: Gating,
    pub norm_topk: bool,
    pub scale: f32,
    pub kernel: RouterKernel,
}

/// How the router's logits are computed on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RouterKernel {
    #[default]
    Unlowered,
    /// Split-K over 128-input slices (8 experts a block): fills the chip for a few tokens.
    Slices,
    /// A tiled f32 GEMM, 64 tokens × 64 experts a block (prefill chunks).
    Tiled,
}

impl RouterKernel {
    fn label(self) -> &'static str {
        match self {
            RouterKernel::Unlowered => "",
            RouterKernel::Slices => " [split-k]",
            RouterKernel::Tiled => " [tiled]",
        }
    }
}

/// How `topk_sum` finds each token's routes on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TopKKernel {
    #[default]
    Unlowered,
    /// Blocks split over tokens and columns, each scanning the route table (few tokens).
    Scan,
    /// A slot → route inverse table first (one scatter), then a block a token (many tokens).
    InverseTable,
}

impl TopKKernel {
    fn label(self) -> &'static str {
        match self {
            TopKKernel::Unlowered => "",
            TopKKernel::Scan => " [scan]",
            TopKKernel::InverseTable => " [inverse table]",
        }
    }
}

/// How the routed expert products run on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ExpertKernel {
    #[default]
    Unlowered,
    /// IQ4_NL row GEMVs reading each touched expert's rows once for all of its routes (at
    /// most [`GEMV_ROUTES_LIMIT`] routes).
    Gemv,
    /// The GEMV's tiles on integer dot products (`expert_int_rows_iq4_*`): codes as signed
    /// bytes, each input row quantized per 32-value block to 16 bits in two bytes, dp4a sums;
    /// carries the shared expert beside the routed ones as the skinny kernel does. At most
    /// [`GEMV_ROUTES_LIMIT`] routes.
    IntGemv,
    /// `IntGemv`'s arithmetic with one 144-byte chunk of a weight row in each lane's registers
    /// (`expert_int_lanes_iq4_*`): a block's whole tile of weights in flight at once, where
    /// [`int_lanes_takes`] allows. With `weights_first` the shared expert's blocks read their
    /// weights before waiting for the predecessor.
    IntLanes { weights_first: bool },
    /// The grouped GEMM on the tensor cores, on the given kernel.
    Grouped(TcKernel),
    /// The skinny grouped product for a decode step's few routes an expert (weights as the
    /// MMA's A operand, routes padded to 8 or 16, the input width split over warps).
    Skinny,
    /// The skinny kernel on integer MMAs (`expert_skinny_iq4_q`): codes as signed bytes, each
    /// input row quantized to 16 bits a value in two bytes (one scale a row), a route's two
    /// bytes as two MMA columns, 8-route tiles; carries the shared expert as `Skinny` does.
    SkinnyInt,
    /// `SkinnyInt` on a three-stage weight ring at four blocks a multiprocessor
    /// (`expert_skinny_iq4_q3`) where its default takes two stages at five: a step whose every
    /// expert has a route or two, where each warp walks the whole input width alone.
    SkinnyIntDeep,
    /// `SkinnyInt` with the first 4-route tile's inputs copied through each warp's weight
    /// ring a k-tile ahead (`expert_skinny_iq4_qs`, four blocks a multiprocessor) where the
    /// default loads them from global memory a few blocks ahead.
    SkinnyIntStaged,
    /// `SkinnyInt`'s arithmetic streamed (`expert_stream_iq4_q`, compute capability 9.0 and
    /// later): persistent blocks over the step's (expert, 8-output or 64-row unit) work, whole
    /// weight rows moved into the block's ring, the warps taking K slices of up to 16 routes a
    /// pass; the last warp done with a unit refills its slot and adds the slices' sums in order.
    /// With `bulk` a row moves by one bulk copy, else by a warp's lanes' 16-byte copies.
    SkinnyIntStream { bulk: bool },
    /// Any input width of whole IQ4_NL blocks (32 values), where the others need whole
    /// 256-value chunks: one route a block, its expert's rows read once a route.
    Generic,
}

impl ExpertKernel {
    /// One of the skinny grouped kernels: the f16 path or the integer one, on either ring.
    pub fn is_skinny(self) -> bool {
        matches!(
            self,
            ExpertKernel::Skinny
                | ExpertKernel::SkinnyInt
                | ExpertKernel::SkinnyIntDeep
                | ExpertKernel::SkinnyIntStaged
                | ExpertKernel::SkinnyIntStream { .. }
        )
    }

    fn label(self) -> &'static str {
        match self {
            ExpertKernel::Unlowered => "",
            ExpertKernel::Gemv => " [gemv]",
            ExpertKernel::IntGemv => " [int gemv]",
            ExpertKernel::IntLanes { .. } => " [int lanes]",
            ExpertKernel::Grouped(TcKernel::MmaSync) => " [grouped mma.sync]",
            ExpertKernel::Grouped(TcKernel::Wgmma) => " [grouped wgmma]",
            ExpertKernel::Skinny => " [skinny]",
            ExpertKernel::SkinnyInt => " [skinny int]",
            ExpertKernel::SkinnyIntDeep => " [skinny int deep]",
            ExpertKernel::SkinnyIntStaged => " [skinny int staged]",
            ExpertKernel::SkinnyIntStream { bulk: false } => " [skinny int stream]",
            ExpertKernel::SkinnyIntStream { bulk: true } => " [skinny int stream bulk]",
            ExpertKernel::Generic => " [generic]",
        }
    }
}

impl Op for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("top_k", self.top_k)])?;
        if self.top_k > self.n_expert {
            return Err(OpError::shape(
                op,
                format!("top_k {} exceeds n_expert {}", self.top_k, self.n_expert),
            ));
        }
        if !(2..=3).contains(&inputs.len()) {
            return Err(OpError::shape(
                op,
                format!("takes 2 or 3 inputs (z, W, bias), got {}", inputs.len()),
            ));
        }
        let z = inputs[0];
        if z.dtype != DType::F32 || z.shape.len() != 2 || z.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("z must be F32[n, D] with D > 0, found {z}"),
            ));
        }
        let (n, d) = (z.shape[0], z.shape[1]);
        expect(op, "W", inputs[1], DType::F32, &[self.n_expert, d])?;
        if let Some(b) = inputs.get(2) {
            expect(op, "bias", b, DType::F32, &[self.n_expert])?;
        }
        Ok(vec![
            TensorMeta::i32([n, self.top_k]),
            TensorMeta::f32([n, self.top_k]),
        ])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "router n_expert={} top_k={} gating={} norm_topk={} scale={:?}{}",
            self.n_expert,
            self.top_k,
            self.gating,
            self.norm_topk,
            self.scale,
            self.kernel.label()
        )
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match inputs.first().map(|z| z.shape.as_slice()) {
            Some(&[n, d]) => router_scratch(n, d, self.n_expert),
            _ => 0,
        }
    }
}

/// The router's per-slice logit partials: `[n, ⌈D/128⌉, n_expert]` f32.
fn router_scratch(n: usize, d: usize, n_expert: usize) -> usize {
    n * d.div_ceil(ROUTER_SLICE) * n_expert * 4
}

// ---- RoutePlan -----------------------------------------------------------------------

/// Sorts the routes by expert (ties in slot order, slot = `t·top_k + j`) into a CSR table.
///
/// Input: ids I32 `[n, top_k]`. Outputs: offsets I32 `[n_expert+1]` (expert `e`'s routes are
/// `offsets[e]..offsets[e+1]`), route_token I32 `[n·top_k]`, route_slot I32 `[n·top_k]`.
/// Every size is static; an id outside `[0, n_expert)` is an `OpError::Data`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePlan {
    pub n_expert: usize,
    pub top_k: usize,
}

impl Op for RoutePlan {
    fn name(&self) -> &'static str {
        "route_plan"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("top_k", self.top_k)])?;
        expect_inputs(op, inputs, 1)?;
        let n = inputs[0].shape.first().copied().unwrap_or(0);
        expect(op, "ids", inputs[0], DType::I32, &[n, self.top_k])?;
        let r = n * self.top_k;
        too_big(op, "route count", r)?;
        too_big(op, "n_expert", self.n_expert)?;
        Ok(vec![
            TensorMeta::i32([self.n_expert + 1]),
            TensorMeta::i32([r]),
            TensorMeta::i32([r]),
        ])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("route_plan n_expert={} top_k={}", self.n_expert, self.top_k)
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

// ---- RouterRoutes --------------------------------------------------------------------

/// [`Router`] then [`RoutePlan`] of its ids, as one node: a decode step's few tokens select
/// and sort their routes in one block, one launch fewer a MoE layer. Same outputs, same bits.
///
/// Inputs: as [`Router`]. Outputs: ids, weights (as [`Router`]), then offsets, route_token,
/// route_slot (as [`RoutePlan`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterRoutes {
    pub router: Router,
    pub plan: RoutePlan,
}

impl Op for RouterRoutes {
    fn name(&self) -> &'static str {
        "router_routes"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let mut out = self.router.infer(inputs)?;
        if self.plan.n_expert != self.router.n_expert || self.plan.top_k != self.router.top_k {
            return Err(OpError::shape(
                self.name(),
                format!(
                    "the plan's {} experts, top {} differ from the router's {}, top {}",
                    self.plan.n_expert, self.plan.top_k, self.router.n_expert, self.router.top_k
                ),
            ));
        }
        out.extend(self.plan.infer(&[&out[0]])?);
        Ok(out)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("{} with its route plan", self.router.describe())
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        self.router.cuda_scratch_bytes(inputs)
    }
}

/// `act[r] = silu(Wg_e·z[tok_r]) ⊙ (Wu_e·z[tok_r])` for every route `r` of every expert `e`,
/// in sorted route order, kept f32 (this product is what overflows f16; seed §2).
///
/// Inputs: z F32 `[n, D]`, gate_exps and up_exps `[n_expert, n_ff, D]` (any weight type),
/// offsets I32 `[n_expert+1]`, route_token I32 `[R]`. Output: act F32 `[R, n_ff]`.
///
/// With two more inputs, the shared expert's gate and up `[n_ff, D]` IQ4_NL, a second output
/// is its `gate_up_swiglu` of z, F32 `[n, n_ff]` (the lowering's shared-expert fusion: one
/// skinny launch reads the routed and the shared weights; its CPU reference is the two ops').
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSwiGlu {
    pub n_expert: usize,
    pub n_ff: usize,
    pub kernel: ExpertKernel,
}

impl Op for ExpertSwiGlu {
    fn name(&self) -> &'static str {
        "expert_swiglu"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("n_ff", self.n_ff)])?;
        if inputs.len() != 7 {
            expect_inputs(op, inputs, 5)?;
        }
        let z = inputs[0];
        if z.dtype != DType::F32 || z.shape.len() != 2 || z.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("z must be F32[n, D] with D > 0, found {z}"),
            ));
        }
        let d = z.shape[1];
        let shape = [self.n_expert, self.n_ff, d];
        expect_weight(op, "gate_exps", inputs[1], &shape)?;
        expect_weight(op, "up_exps", inputs[2], &shape)?;
        expect(op, "offsets", inputs[3], DType::I32, &[self.n_expert + 1])?;
        let r = inputs[4].shape.first().copied().unwrap_or(0);
        expect(op, "route_token", inputs[4], DType::I32, &[r])?;
        let act = TensorMeta::f32([r, self.n_ff]);
        if inputs.len() == 7 {
            let shape = [self.n_ff, d];
            expect(op, "gate_shexp", inputs[5], DType::IQ4_NL, &shape)?;
            expect(op, "up_shexp", inputs[6], DType::IQ4_NL, &shape)?;
            return Ok(vec![act, TensorMeta::f32([z.shape[0], self.n_ff])]);
        }
        Ok(vec![act])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn routed_weights(&self) -> Option<crate::RoutedWeights> {
        Some(crate::RoutedWeights {
            offsets: 3,
            weights: &[1, 2],
        })
    }

    fn describe(&self) -> String {
        format!(
            "expert_swiglu n_expert={} n_ff={}{}",
            self.n_expert,
            self.n_ff,
            self.kernel.label()
        )
    }

    /// The skinny kernel's f16 copy of z (the shared expert reads the same rows).
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (self.kernel, inputs.first().map(|z| z.shape.as_slice())) {
            (kernel, Some(&[n, d])) if kernel.is_skinny() => prefill::skinny_scratch_bytes(n, d),
            _ => 0,
        }
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

/// `out[r] = Wd_e · act[r]` for every route `r` of every expert `e`: one row per route.
///
/// Inputs: act F32 `[R, n_ff]`, down_exps `[n_expert, n_embd, n_ff]` (any weight type),
/// offsets I32 `[n_expert+1]`. Output: F32 `[R, n_embd]`.
///
/// With two more inputs, the shared expert's activation F32 `[n, n_ff]` and its down weight
/// `[n_embd, n_ff]` IQ4_NL, a second output is its `linear`, F32 `[n, n_embd]` (the
/// shared-expert fusion's second half).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertDown {
    pub n_expert: usize,
    pub n_embd: usize,
    pub kernel: ExpertKernel,
}

impl Op for ExpertDown {
    fn name(&self) -> &'static str {
        "expert_down"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("n_embd", self.n_embd)])?;
        if inputs.len() != 5 {
            expect_inputs(op, inputs, 3)?;
        }
        let act = inputs[0];
        if act.dtype != DType::F32 || act.shape.len() != 2 || act.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("act must be F32[R, n_ff] with n_ff > 0, found {act}"),
            ));
        }
        let (r, nf) = (act.shape[0], act.shape[1]);
        expect_weight(
            op,
            "down_exps",
            inputs[1],
            &[self.n_expert, self.n_embd, nf],
        )?;
        expect(op, "offsets", inputs[2], DType::I32, &[self.n_expert + 1])?;
        let out = TensorMeta::f32([r, self.n_embd]);
        if inputs.len() == 5 {
            let act_sh = inputs[3];
            if act_sh.dtype != DType::F32 || act_sh.shape.len() != 2 || act_sh.shape[1] != nf {
                return Err(OpError::shape(
                    op,
                    format!("the shared activation must be F32[n, {nf}], found {act_sh}"),
                ));
            }
            expect(
                op,
                "down_shexp",
                inputs[4],
                DType::IQ4_NL,
                &[self.n_embd, nf],
            )?;
            return Ok(vec![out, TensorMeta::f32([act_sh.shape[0], self.n_embd])]);
        }
        Ok(vec![out])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "expert_down n_expert={} n_embd={}{}",
            self.n_expert,
            self.n_embd,
            self.kernel.label()
        )
    }

    fn routed_weights(&self) -> Option<crate::RoutedWeights> {
        Some(crate::RoutedWeights {
            offsets: 2,
            weights: &[1],
        })
    }

    /// The skinny kernel's f16 copy of act (and of the shared activation after it).
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        let shared_rows = match inputs.get(3) {
            Some(a) if inputs.len() == 5 => a.shape.first().copied().unwrap_or(0),
            _ => 0,
        };
        match (self.kernel, inputs.first().map(|a| a.shape.as_slice())) {
            (kernel, Some(&[r, nf])) if kernel.is_skinny() => {
                prefill::skinny_scratch_bytes(r + shared_rows, nf)
            }
            _ => 0,
        }
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

// ---- GateUpSwiGlu ---------------------------------------------------------------------

/// `silu(x·W_gateᵀ) · (x·W_upᵀ)`: the first half of a dense SwiGLU FFN (the shared expert and
/// the leading dense blocks), the two products and their combination as one op. Its CPU
/// reference is the `linear`, `linear`, `swiglu` chain it replaces (same bits); on the GPU a
/// decode step's few tokens over IQ4_NL weights take one launch (`dense_swiglu_iq4_*`, the
/// routed experts' tiles with token r as route r), and larger ones the chain's own kernels.
///
/// Inputs: x F32 `[n, in]`, W_gate and W_up `[ff, in]` (any `linear` weight type).
/// Output: F32 `[n, ff]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateUpSwiGlu {
    /// The GEMV kernel family takes the one-launch kernel where it can; the chain's products
    /// run on this family either way.
    pub kernel: LinearKernel,
}

impl GateUpSwiGlu {
    /// Whether the one-launch decode kernel takes these inputs.
    fn fused(&self, x: &TensorMeta, wg: &TensorMeta, wu: &TensorMeta) -> bool {
        matches!(self.kernel, LinearKernel::Gemv { .. })
            && x.shape[0] <= GEMV_MAXR
            && wg.dtype == DType::IQ4_NL
            && wu.dtype == DType::IQ4_NL
            && x.shape[1].is_multiple_of(256)
    }

    /// Whether the skinny product takes gate and up in one launch (SwiGLU in its epilogue).
    fn skinny(&self, x: &TensorMeta, wg: &TensorMeta, wu: &TensorMeta) -> bool {
        self.kernel == LinearKernel::Skinny
            && wg.dtype == DType::IQ4_NL
            && wu.dtype == DType::IQ4_NL
            && prefill::skinny_supports(x.shape[1])
    }

    /// Scratch of the unfused chain: gate and up `[n, ff]` each, then what `linear` needs.
    fn chain_scratch(&self, inputs: &[&TensorMeta]) -> (usize, usize) {
        let (n, ff) = (inputs[0].shape[0], inputs[1].shape[0]);
        let half = (n * ff * 4).next_multiple_of(256);
        let one = Linear::with(self.kernel);
        let lin = one
            .cuda_scratch_bytes(&inputs[..2])
            .max(one.cuda_scratch_bytes(&[inputs[0], inputs[2]]));
        (half, 2 * half + lin)
    }
}

impl Op for GateUpSwiGlu {
    fn name(&self) -> &'static str {
        "gate_up_swiglu"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 3)?;
        let gate = Linear::default().infer(&inputs[..2])?;
        let up = Linear::default().infer(&[inputs[0], inputs[2]])?;
        if gate != up {
            return Err(OpError::shape(
                op,
                format!(
                    "gate weight {} and up weight {} give different outputs",
                    inputs[1], inputs[2]
                ),
            ));
        }
        Ok(gate)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("gate_up_swiglu{}", self.kernel.label())
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        if inputs.len() != 3 || self.infer(inputs).is_err() {
            return 0;
        }
        if self.fused(inputs[0], inputs[1], inputs[2]) {
            0
        } else if self.skinny(inputs[0], inputs[1], inputs[2]) {
            prefill::skinny_scratch_bytes(inputs[0].shape[0], inputs[0].shape[1])
        } else {
            self.chain_scratch(inputs).1
        }
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

// ---- TopKSum -------------------------------------------------------------------------

/// `out[t] = Σ_{j=0..top_k} weights[t][j] · route_out[route of slot t·top_k+j]`, summed in
/// slot order starting from the first term (as llama.cpp's chain of adds).
///
/// Inputs: route_out F32 `[R, D]`, route_slot I32 `[R]` (a permutation of `0..R`), weights
/// F32 `[n, top_k]` with `R = n·top_k`, and optionally an addend F32 `[n, D]` (the shared
/// expert's output) added last, as a separate `add` after the sum would. Output: F32 `[n, D]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopKSum {
    pub top_k: usize,
    pub kernel: TopKKernel,
}

impl Op for TopKSum {
    fn name(&self) -> &'static str {
        "topk_sum"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("top_k", self.top_k)])?;
        if inputs.len() != 4 {
            expect_inputs(op, inputs, 3)?;
        }
        let ro = inputs[0];
        if ro.dtype != DType::F32 || ro.shape.len() != 2 || ro.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("route_out must be F32[R, D] with D > 0, found {ro}"),
            ));
        }
        let (r, d) = (ro.shape[0], ro.shape[1]);
        expect(op, "route_slot", inputs[1], DType::I32, &[r])?;
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "weights", inputs[2], DType::F32, &[n, self.top_k])?;
        if n * self.top_k != r {
            return Err(OpError::shape(
                op,
                format!(
                    "route_out has {r} routes, weights {n} tokens × top_k {}",
                    self.top_k
                ),
            ));
        }
        if let Some(a) = inputs.get(3) {
            expect(op, "addend", a, DType::F32, &[n, d])?;
        }
        Ok(vec![TensorMeta::f32([n, d])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("topk_sum top_k={}{}", self.top_k, self.kernel.label())
    }

    /// With the inverse table, the slot → route table (R i32).
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (self.kernel, inputs.first()) {
            (TopKKernel::InverseTable, Some(ro)) => ro.shape.first().copied().unwrap_or(0) * 4,
            _ => 0,
        }
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}
