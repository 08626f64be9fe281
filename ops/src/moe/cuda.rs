//! CUDA launches of the MoE ops.

use super::prefill::{
    SkinnyPath, SkinnyRoutes, SkinnyShared, launch_expert_gemm_tc_with, launch_expert_skinny,
};
use super::*;
use crate::check::{aligned16, dim_i32, unlowered};
use crate::dequant::weight_rows;
use crate::elementwise::SwiGlu;
use crate::gpu::{blocks_for, dev_err};
use crate::linear::RowsPlan;
use crate::op::check_device;

pub(crate) const MOE_CU: &str = concat!(
    include_str!("../dequant/dequant.cuh"),
    include_str!("topk.cuh"),
    include_str!("moe.cu")
);

/// The tiled router GEMM's slice of D (`router_logits_tiled`): a multiple of 128 (so the
/// partials fit the scratch sized for ROUTER_SLICE) that gives a 1024-token chunk ~200 blocks.
pub(super) const ROUTER_TILED_SLICE: usize = 256;

/// Warps a block of `router_select` (one token each) and its dynamic shared memory: each
/// warp stages its token's `slices × n_expert` partials beside its logits, keys and flags
/// (`3 × n_expert` words). Eight warps when they fit, fewer for wide routers; `None` when not
/// even one does.
pub(super) fn select_block(slices: usize, n_expert: usize) -> Option<(u32, usize)> {
    let per_warp = (slices + 3) * n_expert * 4;
    [8u32, 4, 2, 1]
        .into_iter()
        .map(|w| (w, w as usize * per_warp))
        .find(|&(_, bytes)| bytes <= SMEM_LIMIT)
}

/// Tokens a block of the slice router takes at once (`RL_TOKENS`).
const ROUTER_TOKENS_PER_BLOCK: usize = 4;

/// Tokens a block of the slice router covers (a multiple of [`ROUTER_TOKENS_PER_BLOCK`], or
/// all `n`): as few as keep the grid within one wave of 8 blocks a multiprocessor, since a
/// block's cost is mostly latency (its weight slice, then each 4-token round's loads and
/// reductions). H200, 64 tokens, the kernel alone (Nsight Compute): 16 a block (896 blocks)
/// 10.5 µs against the tiled GEMM's 15.7 (14 blocks); the profiled router node (this and the
/// select kernel, eager) stayed at 27 µs whether 64, 16 or 4 tokens a block.
pub(super) fn router_token_tile(n: usize, blocks_per_tile: usize, sms: usize) -> usize {
    let tiles = (sms * 8 / blocks_per_tile.max(1)).clamp(1, 65535);
    let per = n.div_ceil(tiles).next_multiple_of(ROUTER_TOKENS_PER_BLOCK);
    per.min(n.next_multiple_of(ROUTER_TOKENS_PER_BLOCK)).max(1)
}

/// Shared memory a block may use on the target (227 KiB opt-in on an H200).
pub(super) const SMEM_LIMIT: usize = 227 * 1024;

impl Router {
    /// Two launches: `router_logits` spreads the f32 product over (8 experts × 128 inputs)
    /// blocks into per-slice partials (scratch), `router_select` (a warp a token) sums them
    /// in slice order and selects. (A one-launch variant, a cluster of 8 blocks meeting in
    /// distributed shared memory, measured 7.3 µs against these two's 6.1 µs at one token:
    /// eight multiprocessors cannot pull the 0.9 MB of weights as fast as all of them.)
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[0].meta.shape[0];
        let ne = self.n_expert;
        let Some(s) = self.launch_logits(op, ctx, inputs, scratch)? else {
            return Ok(());
        };
        let select = ctx.kernel("moe.cu", MOE_CU, "router_select")?;
        let bias = inputs.get(2).map_or(0, |b| b.ptr);
        // SAFETY: argument list matches router_select; it reads the partials written above.
        unsafe {
            ctx.device
                .launch(&select)
                .grid(blocks_for(n, s.warps as usize))
                .block(32 * s.warps)
                .shared_mem(s.smem as u32)
                .arg(scratch.ptr)
                .arg(bias)
                .arg(outputs[0].ptr)
                .arg(outputs[1].ptr)
                .arg(n as i32)
                .arg(ne as i32)
                .arg(s.slices as i32)
                .arg(self.top_k as i32)
                .arg(i32::from(self.gating == Gating::Softmax))
                .arg(i32::from(self.norm_topk))
                .arg(self.scale)
                .arg(NORM_GUARD)
                .enqueue()
                .map_err(dev_err)
        }
    }

    /// The logits' per-slice partials into `scratch` (on the kernel the lowering chose), and
    /// the select block that sums them; None for no tokens. `op` names the node in errors.
    fn launch_logits(
        &self,
        op: &'static str,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<Option<SelectBlock>, OpError> {
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let ne = self.n_expert;
        if n == 0 {
            return Ok(None);
        }
        if !d.is_multiple_of(4) {
            return Err(OpError::shape(
                op,
                format!("the CUDA kernel needs D to be a multiple of 4, found {d}"),
            ));
        }
        aligned16(op, "z", &inputs[0])?;
        aligned16(op, "W", &inputs[1])?;
        let tiled = match self.kernel {
            RouterKernel::Unlowered => return Err(unlowered(op)),
            RouterKernel::Slices => false,
            RouterKernel::Tiled => true,
        };
        let slices = d.div_ceil(if tiled {
            ROUTER_TILED_SLICE
        } else {
            ROUTER_SLICE
        });
        let Some((select_warps, select_smem)) = select_block(slices, ne) else {
            return Err(OpError::shape(
                op,
                format!(
                    "{ne} experts over {slices} slices of D exceed the select kernel's shared \
                     memory"
                ),
            ));
        };
        let need = router_scratch(n, d, ne);
        scratch.require(op, need)?;
        if tiled {
            let token_tiles = n.div_ceil(64);
            if token_tiles > 65535 || slices > 65535 {
                return Err(OpError::shape(
                    op,
                    format!("{n} tokens of {d} exceed the grid"),
                ));
            }
            let logits = ctx.kernel("moe.cu", MOE_CU, "router_logits_tiled")?;
            // SAFETY: argument list matches router_logits_tiled; it writes n × slices × E
            // partials, slices ≤ ⌈D/128⌉ (the scratch checked above).
            unsafe {
                ctx.device
                    .launch(&logits)
                    .grid((blocks_for(ne, 64), slices as u32, token_tiles as u32))
                    .block(256)
                    .arg(inputs[0].ptr)
                    .arg(inputs[1].ptr)
                    .arg(scratch.ptr)
                    .arg(dim_i32(op, "tokens", n)?)
                    .arg(dim_i32(op, "D", d)?)
                    .arg(dim_i32(op, "n_expert", ne)?)
                    .arg(slices as i32)
                    .arg(ROUTER_TILED_SLICE as i32)
                    .enqueue()
                    .map_err(dev_err)?;
            }
        } else {
            let tok_tile = router_token_tile(
                n,
                blocks_for(ne, 8) as usize * slices,
                ctx.device.sm_count() as usize,
            );
            let logits = ctx.kernel("moe.cu", MOE_CU, "router_logits")?;
            // SAFETY: argument list matches router_logits; it writes n × slices × E partials.
            unsafe {
                ctx.device
                    .launch(&logits)
                    .grid((
                        blocks_for(ne, 8),
                        dim_i32(op, "slices", slices)? as u32,
                        n.div_ceil(tok_tile) as u32,
                    ))
                    .block(256)
                    .arg(inputs[0].ptr)
                    .arg(inputs[1].ptr)
                    .arg(scratch.ptr)
                    .arg(dim_i32(op, "tokens", n)?)
                    .arg(dim_i32(op, "D", d)?)
                    .arg(dim_i32(op, "n_expert", ne)?)
                    .arg(slices as i32)
                    .arg(dim_i32(op, "token tile", tok_tile)?)
                    .enqueue()
                    .map_err(dev_err)?;
            }
        }
        Ok(Some(SelectBlock {
            warps: select_warps,
            smem: select_smem,
            slices,
        }))
    }
}

/// The select launch's block: warps (a token each at a time), dynamic shared memory, and the
/// slices of D whose partials it sums.
struct SelectBlock {
    warps: u32,
    smem: usize,
    slices: usize,
}

impl RouterRoutes {
    /// The router's logits launch, then `router_select_routes`: one block selects every
    /// token's experts (its warps taking the tokens in turn) and sorts the routes, so the
    /// lowering fuses only a few tokens.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[0].meta.shape[0];
        let (ne, k) = (self.router.n_expert, self.router.top_k);
        let Some(s) = self.router.launch_logits(op, ctx, inputs, scratch)? else {
            return Ok(());
        };
        let smem = s.smem.max((2 + s.warps as usize) * ne * 4);
        if smem > SMEM_LIMIT {
            return Err(OpError::shape(
                op,
                format!("{ne} experts exceed the plan's shared memory"),
            ));
        }
        let kern = ctx.kernel("moe.cu", MOE_CU, "router_select_routes")?;
        let bias = inputs.get(2).map_or(0, |b| b.ptr);
        // SAFETY: argument list matches router_select_routes; it reads the partials written
        // above, writes n·top_k ids and weights, E+1 offsets and n·top_k plan rows.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(1)
                .block(32 * s.warps)
                .shared_mem(smem as u32)
                .arg(scratch.ptr)
                .arg(bias)
                .arg(outputs[0].ptr)
                .arg(outputs[1].ptr)
                .arg(outputs[2].ptr)
                .arg(outputs[3].ptr)
                .arg(outputs[4].ptr)
                .arg(dim_i32(op, "tokens", n)?)
                .arg(dim_i32(op, "n_expert", ne)?)
                .arg(s.slices as i32)
                .arg(dim_i32(op, "top_k", k)?)
                .arg(i32::from(self.router.gating == Gating::Softmax))
                .arg(i32::from(self.router.norm_topk))
                .arg(self.router.scale)
                .arg(NORM_GUARD)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl RoutePlan {
    /// One block (up to 1024 threads) sorts on the device (no read-back, so it can be captured).
    /// An id outside `[0, n_expert)` is skipped and the rows it leaves are marked -1; the
    /// engine refuses such ids before they reach the device.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let r = inputs[0].meta.numel();
        let ne = self.n_expert;
        // As many warps as the routes need (a decode step's 4 routes: one warp), up to 32.
        let threads = r.div_ceil(32).clamp(1, 32) * 32;
        let smem = (2 + threads / 32) * ne * 4;
        if smem > SMEM_LIMIT {
            return Err(OpError::shape(
                op,
                format!("{ne} experts exceed the plan kernel's shared memory"),
            ));
        }
        let kern = ctx.kernel("moe.cu", MOE_CU, "route_plan")?;
        // SAFETY: argument list matches route_plan; it writes E+1 offsets and R rows.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(1)
                .block(threads as u32)
                .shared_mem(smem as u32)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(outputs[1].ptr)
                .arg(outputs[2].ptr)
                .arg(dim_i32(op, "routes", r)?)
                .arg(dim_i32(op, "n_expert", ne)?)
                .arg(dim_i32(op, "top_k", self.top_k)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl ExpertSwiGlu {
    /// Gate and up rows of an expert in one pass, SwiGLU in the epilogue, f32 out, on the
    /// kernel the lowering chose: the GEMV for a few routes, the grouped GEMM beyond.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        // The shared expert's gate and up (inputs 5, 6) into output 1: the tokens' own rows.
        let shared = (inputs.len() == 7).then(|| SkinnyShared {
            wa: inputs[5].ptr,
            wb: Some(inputs[6].ptr),
            x: inputs[0].ptr,
            rows: n,
            y: outputs[1].ptr,
        });
        expert_launch(
            scratch,
            ctx,
            self.name(),
            self.kernel,
            &Experts {
                wa: &inputs[1],
                wb: Some(&inputs[2]),
                x: &inputs[0],
                offsets: inputs[3].ptr,
                route_token: inputs[4].ptr,
                y: outputs[0].ptr,
                n_in: d,
                n_out: self.n_ff,
                n_expert: self.n_expert,
                x_rows: n,
                routes: inputs[4].meta.shape[0],
                nr: n.clamp(1, GEMV_MAXR).next_power_of_two(),
                shared,
            },
        )
    }
}

/// One grouped expert product on the device (see `expert_rows_iq4_*` in moe.cu and
/// `expert_gemm_tc_iq4` in moe_prefill.cu).
pub(super) struct Experts<'a> {
    wa: &'a DeviceTensor<'a>,
    /// The up projection for SwiGLU (`wa` is then the gate); `None` for the down projection.
    wb: Option<&'a DeviceTensor<'a>>,
    x: &'a DeviceTensor<'a>,
    offsets: u64,
    /// Token of each route (SwiGLU); the down projection reads route rows directly.
    route_token: u64,
    y: u64,
    n_in: usize,
    n_out: usize,
    n_expert: usize,
    x_rows: usize,
    routes: usize,
    /// Routes a GEMV block sums at once (1, 2, 4 or 8): about the most an expert has; more
    /// are taken in further rounds over the same staged weights.
    nr: usize,
    /// The shared expert carried beside the routed ones (the skinny kernel only).
    shared: Option<SkinnyShared>,
}

pub(super) fn expert_launch(
    scratch: Scratch,
    ctx: &GpuCtx,
    op: &'static str,
    kernel: ExpertKernel,
    a: &Experts<'_>,
) -> Result<(), OpError> {
    let int_gemv = matches!(
        kernel,
        ExpertKernel::IntGemv | ExpertKernel::IntLanes { .. }
    );
    if a.shared.is_some() && !(kernel.is_skinny() || int_gemv) {
        return Err(OpError::shape(
            op,
            format!(
                "the shared expert rides only the skinny kernel, not{}",
                kernel.label()
            ),
        ));
    }
    if a.routes == 0 {
        return Ok(());
    }
    let tc = match kernel {
        ExpertKernel::Unlowered => return Err(unlowered(op)),
        ExpertKernel::Gemv | ExpertKernel::IntGemv | ExpertKernel::IntLanes { .. }
            if a.routes > GEMV_ROUTES_LIMIT =>
        {
            return Err(OpError::shape(
                op,
                format!(
                    "the expert GEMV takes at most {GEMV_ROUTES_LIMIT} routes, found {}",
                    a.routes
                ),
            ));
        }
        ExpertKernel::Gemv | ExpertKernel::IntGemv | ExpertKernel::IntLanes { .. } => None,
        ExpertKernel::Grouped(tc) => Some(tc),
        ExpertKernel::Skinny
        | ExpertKernel::SkinnyInt
        | ExpertKernel::SkinnyIntDeep
        | ExpertKernel::SkinnyIntStaged
        | ExpertKernel::SkinnyIntStream { .. } => None,
        ExpertKernel::Generic => return launch_expert_generic(ctx, op, a),
    };
    iq4_expert_weights(op, a)?;
    for w in std::iter::once(a.wa).chain(a.wb) {
        aligned16(op, "expert weight", w)?;
    }
    if !a.n_in.is_multiple_of(256) {
        return Err(OpError::shape(
            op,
            format!(
                "the CUDA kernels need the expert input width to be a multiple of 256 \
                 (whole 16-byte groups of 8 IQ4_NL blocks), found {}",
                a.n_in
            ),
        ));
    }
    aligned16(op, "expert input", a.x)?;
    let swiglu = a.wb.is_some();
    let wb = a.wb.map_or(0, |w| w.ptr);
    let slots = a.n_expert.min(a.routes);
    let i = |what, v| dim_i32(op, what, v);
    if kernel.is_skinny() {
        // SAFETY: the weights, inputs, route table and output were checked by check_device
        // against the op's shapes, the scratch is the op's own (cuda_scratch_bytes).
        return unsafe {
            launch_expert_skinny(
                ctx,
                op,
                a.wa.ptr,
                a.wb.map(|w| w.ptr),
                a.x.ptr,
                a.x_rows,
                SkinnyRoutes::Grouped {
                    offsets: a.offsets,
                    route_token: a.route_token,
                    n_expert: a.n_expert,
                },
                a.y,
                a.n_in,
                a.n_out,
                a.routes,
                a.shared,
                match kernel {
                    ExpertKernel::SkinnyInt => SkinnyPath::Int,
                    ExpertKernel::SkinnyIntDeep => SkinnyPath::IntDeep,
                    ExpertKernel::SkinnyIntStaged => SkinnyPath::IntStaged,
                    ExpertKernel::SkinnyIntStream { bulk } => SkinnyPath::IntStream { bulk },
                    _ => SkinnyPath::F16,
                },
                scratch,
            )
        };
    }
    if kernel == ExpertKernel::IntGemv {
        return launch_expert_int_rows(ctx, op, a, slots);
    }
    if let ExpertKernel::IntLanes { weights_first } = kernel {
        return launch_expert_int_lanes(ctx, op, a, slots, weights_first);
    }
    let Some(tc) = tc else {
        let sms = ctx.device.sm_count() as usize;
        let plan =
            RowsPlan::choose(a.n_in / 256, a.n_out, slots, swiglu, sms).ok_or_else(|| {
                OpError::shape(
                    op,
                    format!(
                        "an input width of {} is more than one GEMV block can split",
                        a.n_in
                    ),
                )
            })?;
        let outs = if swiglu { plan.rt / 2 } else { plan.rt };
        let kern = ctx.kernel("moe.cu", MOE_CU, &format!("expert_rows_iq4_{}", a.nr))?;
        // SAFETY: argument list matches expert_rows_iq4_<NR>; weight rows, inputs and outputs
        // are indexed within the shapes check_device verified, route ids are bounds-checked.
        return unsafe {
            ctx.device
                .launch(&kern)
                .grid((
                    i("row tiles", a.n_out.div_ceil(outs))? as u32,
                    i("experts", slots)? as u32,
                ))
                .block(plan.threads as u32)
                .shared_mem(plan.smem_bytes(a.nr) as u32)
                .arg(a.wa.ptr)
                .arg(wb)
                .arg(a.x.ptr)
                .arg(a.offsets)
                .arg(a.route_token)
                .arg(a.y)
                .arg(i("input width", a.n_in)?)
                .arg(i("rows", a.n_out)?)
                .arg(i("n_expert", a.n_expert)?)
                .arg(i("input rows", a.x_rows)?)
                .arg(i("routes", a.routes)?)
                .arg(plan.rt as i32)
                .arg(plan.kp as i32)
                .enqueue()
                .map_err(dev_err)
        };
    };
    // A chunk's routes: the grouped GEMM on the tensor cores (f16 operands, f32 sums).
    // SAFETY: the weights, inputs, route table and output were checked by check_device
    // against the op's shapes; route ids are bounds-checked by the kernel.
    unsafe {
        launch_expert_gemm_tc_with(
            ctx,
            tc,
            a.wa.ptr,
            a.wb.map(|w| w.ptr),
            a.x.ptr,
            a.offsets,
            a.route_token,
            a.y,
            a.n_in,
            a.n_out,
            a.n_expert,
            a.x_rows,
            a.routes,
        )
    }
}

/// `expert_int_rows_iq4_<NR>` (moe.cu): the GEMV's tiles on integer dot products, the shared
/// expert (when carried) on one more row of blocks after the routed slots.
fn launch_expert_int_rows(
    ctx: &GpuCtx,
    op: &'static str,
    a: &Experts<'_>,
    slots: usize,
) -> Result<(), OpError> {
    let i = |what, v| dim_i32(op, what, v);
    let swiglu = a.wb.is_some();
    let shared = a.shared.filter(|s| s.rows > 0);
    if let Some(s) = shared {
        s.check(op, swiglu, a.x_rows)?;
    }
    let sms = ctx.device.sm_count() as usize;
    let plan = RowsPlan::choose(
        a.n_in / 256,
        a.n_out,
        slots + usize::from(shared.is_some()),
        swiglu,
        sms,
    )
    .ok_or_else(|| {
        OpError::shape(
            op,
            format!(
                "an input width of {} is more than one GEMV block can split",
                a.n_in
            ),
        )
    })?;
    let outs = if swiglu { plan.rt / 2 } else { plan.rt };
    // The quantized inputs of a round's routes: 64 bytes and a scale a 32-value block.
    let smem = plan.smem_bytes(a.nr) + a.nr * (a.n_in / 32) * 68;
    let kern = ctx.kernel("moe.cu", MOE_CU, &format!("expert_int_rows_iq4_{}", a.nr))?;
    let rows_y = i("experts", slots)? as u32 + u32::from(shared.is_some());
    // SAFETY: argument list matches expert_int_rows_iq4_<NR>; weight rows, inputs and outputs
    // are indexed within the shapes check_device verified (the shared expert's buffers are the
    // op's own inputs and outputs), route ids and tokens are bounds-checked by the kernel.
    unsafe {
        ctx.device
            .launch(&kern)
            .grid((i("row tiles", a.n_out.div_ceil(outs))? as u32, rows_y))
            .block(plan.threads as u32)
            .shared_mem(smem as u32)
            .arg(a.wa.ptr)
            .arg(a.wb.map_or(0, |w| w.ptr))
            .arg(a.x.ptr)
            .arg(a.offsets)
            .arg(a.route_token)
            .arg(a.y)
            .arg(i("input width", a.n_in)?)
            .arg(i("rows", a.n_out)?)
            .arg(i("n_expert", a.n_expert)?)
            .arg(i("input rows", a.x_rows)?)
            .arg(i("routes", a.routes)?)
            .arg(plan.rt as i32)
            .arg(plan.kp as i32)
            .arg(shared.map_or(0, |s| s.wa))
            .arg(shared.and_then(|s| s.wb).unwrap_or(0))
            .arg(shared.map_or(0, |s| if swiglu { 0 } else { s.x }))
            .arg(shared.map_or(0, |s| s.y))
            .arg(i("shared rows", shared.map_or(0, |s| s.rows))?)
            .arg(i("route slots", slots)?)
            .enqueue()
            .map_err(dev_err)
    }
}

/// Warps a block of `expert_int_lanes_iq4_<NR>` (`IQL_WARPS` in moe.cu), each with a
/// two-stage ring of 4,608 bytes a stage (`IQL_STAGE`).
const INT_LANES_WARPS: usize = 4;
const INT_LANES_STAGE: usize = 4608;
/// Blocks a multiprocessor the kernel's registers allow (`__launch_bounds__(128, 4)`).
const INT_LANES_BLOCKS_PER_SM: usize = 4;
/// Shared memory a block may use on the target (227 KiB opt-in on an H200), all of it dynamic.
const INT_LANES_SMEM: usize = 227 * 1024;

/// `expert_int_lanes_iq4_<NR>` (moe.cu): `expert_int_rows`' arithmetic with a weight chunk a
/// lane on persistent warps (one wave of blocks walking the work items), the shared expert's
/// items (when carried) first.
fn launch_expert_int_lanes(
    ctx: &GpuCtx,
    op: &'static str,
    a: &Experts<'_>,
    slots: usize,
    weights_first: bool,
) -> Result<(), OpError> {
    let i = |what, v| dim_i32(op, what, v);
    let swiglu = a.wb.is_some();
    if !int_lanes_takes(a.n_in, swiglu, a.n_expert) {
        return Err(OpError::shape(
            op,
            format!(
                "the lane-chunk expert GEMV takes whole 256-value chunks, at most {} inputs \
                 here and {INT_LANES_EXPERTS} experts; found {} inputs and {} experts",
                if swiglu { 4096 } else { 8192 },
                a.n_in,
                a.n_expert
            ),
        ));
    }
    let shared = a.shared.filter(|s| s.rows > 0);
    if let Some(s) = shared {
        s.check(op, swiglu, a.x_rows)?;
    }
    let nch = a.n_in / 256;
    // Outputs an item: its 32 lanes' chunks cover this many rows (gate and up rows in pairs).
    let outs = if swiglu { 32 / (2 * nch) } else { 32 / nch };
    let items = (slots + usize::from(shared.is_some())) * a.n_out.div_ceil(outs);
    // Every input row the launch reads, quantized: 528 bytes and 9 scales a 256-value chunk
    // (`IQL_QCHUNK`, padded against bank conflicts).
    let q_rows = if swiglu {
        a.x_rows
    } else {
        a.routes + shared.map_or(0, |s| s.rows)
    };
    let smem = INT_LANES_WARPS * 2 * INT_LANES_STAGE
        + 3 * INT_LANES_EXPERTS * 4
        + 16
        + q_rows * (a.n_in / 256) * (33 * 16 + 9 * 4);
    if smem > INT_LANES_SMEM {
        return Err(OpError::shape(
            op,
            format!(
                "{q_rows} input rows of {} values exceed the lane-chunk expert GEMV's shared \
                 memory ({smem} bytes)",
                a.n_in
            ),
        ));
    }
    let per_sm = (INT_LANES_SMEM / smem).clamp(1, INT_LANES_BLOCKS_PER_SM);
    let sms = ctx.device.sm_count() as usize;
    let blocks = items.div_ceil(INT_LANES_WARPS).clamp(1, sms * per_sm);
    let kern = ctx.kernel("moe.cu", MOE_CU, &format!("expert_int_lanes_iq4_{}", a.nr))?;
    // SAFETY: argument list matches expert_int_lanes_iq4_<NR>; weight rows, inputs and outputs
    // are indexed within the shapes check_device verified (the shared expert's buffers are the
    // op's own inputs and outputs), route ids and tokens are bounds-checked by the kernel, and
    // the shared memory holds the rings and every quantized row (checked above).
    unsafe {
        ctx.device
            .launch(&kern)
            .grid(blocks as u32)
            .block((32 * INT_LANES_WARPS) as u32)
            .shared_mem(smem as u32)
            .arg(a.wa.ptr)
            .arg(a.wb.map_or(0, |w| w.ptr))
            .arg(a.x.ptr)
            .arg(a.offsets)
            .arg(a.route_token)
            .arg(a.y)
            .arg(i("input width", a.n_in)?)
            .arg(i("rows", a.n_out)?)
            .arg(i("n_expert", a.n_expert)?)
            .arg(i("input rows", a.x_rows)?)
            .arg(i("routes", a.routes)?)
            .arg(outs as i32)
            .arg(shared.map_or(0, |s| s.wa))
            .arg(shared.and_then(|s| s.wb).unwrap_or(0))
            .arg(shared.map_or(0, |s| if swiglu { 0 } else { s.x }))
            .arg(shared.map_or(0, |s| s.y))
            .arg(i("shared rows", shared.map_or(0, |s| s.rows))?)
            .arg(i("route slots", slots)?)
            .arg(i32::from(weights_first))
            .enqueue()
            .map_err(dev_err)
    }
}

fn iq4_expert_weights(op: &'static str, a: &Experts<'_>) -> Result<(), OpError> {
    for w in std::iter::once(a.wa).chain(a.wb) {
        if w.meta.dtype != DType::IQ4_NL {
            return Err(OpError::shape(
                op,
                format!(
                    "the CUDA kernels read expert weights as IQ4_NL, found {}",
                    w.meta
                ),
            ));
        }
    }
    Ok(())
}

/// `expert_generic` (moe.cu): any input width of whole storage blocks, any weight type the
/// CPU reference reads.
fn launch_expert_generic(ctx: &GpuCtx, op: &'static str, a: &Experts<'_>) -> Result<(), OpError> {
    let dtype = a.wa.meta.dtype;
    if let Some(wb) = a.wb
        && wb.meta.dtype != dtype
    {
        return Err(OpError::shape(
            op,
            format!(
                "the gate and up expert weights must share a type, found {} and {}",
                a.wa.meta, wb.meta
            ),
        ));
    }
    let (wt, row_bytes) = weight_rows(op, "expert weights", a.wa.meta, a.n_in)?;
    let i = |what, v| dim_i32(op, what, v);
    // Eight warps a block, a warp an output row at a time; enough row tiles to fill the card
    // when routes are few.
    let row_tiles = a.n_out.div_ceil(8).min(64);
    let kern = ctx.kernel("moe.cu", MOE_CU, "expert_generic")?;
    // SAFETY: argument list matches expert_generic; weights, inputs and outputs were checked
    // by check_device against the op's shapes (row_bytes is the weight type's row of n_in
    // values); the kernel bounds-checks route ids, tokens and experts.
    unsafe {
        ctx.device
            .launch(&kern)
            .grid((
                i("row tiles", row_tiles)? as u32,
                i("routes", a.routes)? as u32,
            ))
            .block(256)
            .arg(a.wa.ptr)
            .arg(a.wb.map_or(0, |w| w.ptr))
            .arg(a.x.ptr)
            .arg(a.offsets)
            .arg(a.route_token)
            .arg(a.y)
            .arg(i("input width", a.n_in)?)
            .arg(i("rows", a.n_out)?)
            .arg(i("n_expert", a.n_expert)?)
            .arg(i("input rows", a.x_rows)?)
            .arg(i("routes", a.routes)?)
            .arg(wt)
            .arg(row_bytes as i64)
            .enqueue()
            .map_err(dev_err)
    }
}

impl ExpertDown {
    /// One output row per route (one writer an element); GEMV or grouped GEMM by route count.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (r, nf) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        // The shared expert's activations (input 3) through its down weight (input 4) into
        // output 1.
        let shared = (inputs.len() == 5).then(|| SkinnyShared {
            wa: inputs[4].ptr,
            wb: None,
            x: inputs[3].ptr,
            rows: inputs[3].meta.shape[0],
            y: outputs[1].ptr,
        });
        expert_launch(
            scratch,
            ctx,
            self.name(),
            self.kernel,
            &Experts {
                wa: &inputs[1],
                wb: None,
                x: &inputs[0],
                offsets: inputs[2].ptr,
                route_token: 0,
                y: outputs[0].ptr,
                n_in: nf,
                n_out: self.n_embd,
                n_expert: self.n_expert,
                x_rows: r,
                routes: r,
                // The down projection does not know the tokens; at top-k ≥ 4 an expert has
                // at most R/4 of the R routes unless ids repeat (then more rounds).
                nr: r.div_ceil(4).clamp(1, GEMV_MAXR).next_power_of_two(),
                shared,
            },
        )
    }
}

impl GateUpSwiGlu {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (x, wg, wu, y) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let (n, k, ff) = (x.meta.shape[0], x.meta.shape[1], wg.meta.shape[0]);
        if n == 0 || ff == 0 {
            return Ok(());
        }
        let kernel = self.kernel.chosen(op, n)?;
        if self.skinny(x.meta, wg.meta, wu.meta) {
            // SAFETY: gate and up hold ff IQ4_NL rows of k values, x n×k f32, y n×ff f32
            // (check_device), the scratch is this op's (cuda_scratch_bytes).
            return unsafe {
                launch_expert_skinny(
                    ctx,
                    op,
                    wg.ptr,
                    Some(wu.ptr),
                    x.ptr,
                    n,
                    SkinnyRoutes::Dense,
                    y.ptr,
                    k,
                    ff,
                    n,
                    None,
                    SkinnyPath::F16,
                    scratch,
                )
            };
        }
        if self.fused(x.meta, wg.meta, wu.meta) {
            aligned16(op, "x", x)?;
            aligned16(op, "gate weight", wg)?;
            aligned16(op, "up weight", wu)?;
            let sms = ctx.device.sm_count() as usize;
            let plan = RowsPlan::choose(k / 256, ff, 1, true, sms).ok_or_else(|| {
                OpError::shape(
                    op,
                    format!("an input width of {k} is more than one GEMV block can split"),
                )
            })?;
            let nr = n.next_power_of_two();
            let kern = ctx.kernel("moe.cu", MOE_CU, &format!("dense_swiglu_iq4_{nr}"))?;
            // SAFETY: argument list matches dense_swiglu_iq4_<NR>; rows, inputs and outputs
            // are indexed within the shapes check_device verified.
            return unsafe {
                ctx.device
                    .launch(&kern)
                    .grid(dim_i32(op, "row tiles", ff.div_ceil(plan.rt / 2))? as u32)
                    .block(plan.threads as u32)
                    .shared_mem(plan.smem_bytes(nr) as u32)
                    .arg(wg.ptr)
                    .arg(wu.ptr)
                    .arg(x.ptr)
                    .arg(y.ptr)
                    .arg(dim_i32(op, "input width", k)?)
                    .arg(dim_i32(op, "rows", ff)?)
                    .arg(dim_i32(op, "tokens", n)?)
                    .arg(plan.rt as i32)
                    .arg(plan.kp as i32)
                    .enqueue()
                    .map_err(dev_err)
            };
        }
        let metas = [x.meta, wg.meta, wu.meta];
        let (half, need) = self.chain_scratch(&metas);
        scratch.require(op, need)?;
        let out_meta = TensorMeta::f32([n, ff]);
        let part = |i: u64| DeviceTensor {
            meta: &out_meta,
            ptr: scratch.ptr + i * half as u64,
            bytes: n * ff * 4,
        };
        let (gate, up) = (part(0), part(1));
        let lin_scratch = Scratch {
            ptr: scratch.ptr + 2 * half as u64,
            bytes: need - 2 * half,
        };
        let one = Linear::with(kernel);
        one.cuda(ctx, &[*x, *wg], &[gate], lin_scratch)?;
        one.cuda(ctx, &[*x, *wu], &[up], lin_scratch)?;
        SwiGlu.cuda(ctx, &[gate, up], &[*y], Scratch::default())
    }
}

impl TopKSum {
    /// A block per token (split over columns when tokens are few) finds its routes by
    /// scanning `route_slot`, then sums in slot order with the CPU's roundings (same bits).
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (r, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let n = inputs[2].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        // Many tokens fill the chip by themselves: a block a token, which finds its routes in
        // an inverse table made first (scanning the whole route table in every block cost a
        // 4096-token chunk 164 µs a layer); few tokens split the columns too and scan.
        let many = match self.kernel {
            TopKKernel::Unlowered => return Err(unlowered(op)),
            TopKKernel::Scan => false,
            TopKKernel::InverseTable => true,
        };
        let col_blocks = if many { 1 } else { blocks_for(d, 256) };
        let slot_route = if many {
            scratch.require(op, r * 4)?;
            let inv = ctx.kernel("moe.cu", MOE_CU, "topk_slot_routes")?;
            // SAFETY: reads the R-entry route_slot, writes R ints of scratch (checked above).
            unsafe {
                ctx.device
                    .launch(&inv)
                    .grid(blocks_for(r, 256).min(1024))
                    .block(256)
                    .arg(inputs[1].ptr)
                    .arg(scratch.ptr)
                    .arg(dim_i32(op, "routes", r)?)
                    .enqueue()
                    .map_err(dev_err)?;
            }
            scratch.ptr
        } else {
            0
        };
        let kern = ctx.kernel("moe.cu", MOE_CU, "topk_sum")?;
        // SAFETY: argument list matches topk_sum; route indices come from the table's own
        // positions (< R), slots are range-checked in the kernel.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid((dim_i32(op, "tokens", n)? as u32, col_blocks))
                .block(256)
                .shared_mem((self.top_k * 4) as u32)
                .arg(inputs[0].ptr)
                .arg(inputs[1].ptr)
                .arg(slot_route)
                .arg(inputs[2].ptr)
                .arg(inputs.get(3).map_or(0, |a| a.ptr))
                .arg(outputs[0].ptr)
                .arg(dim_i32(op, "routes", r)?)
                .arg(dim_i32(op, "D", d)?)
                .arg(dim_i32(op, "top_k", self.top_k)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::prefill::{skinny_route_tile, stream_smem_bytes, stream_unit};
    use super::{SMEM_LIMIT, router_token_tile, select_block};

    #[test]
    fn a_decode_steps_experts_take_eight_route_tiles_until_they_average_five_routes() {
        // Top-4 of 64: 8, 32 and 64 tokens' routes in 8-route tiles, 128 tokens' in 16.
        assert_eq!(skinny_route_tile(32, Some(64)), 1);
        assert_eq!(skinny_route_tile(256, Some(64)), 1);
        assert_eq!(skinny_route_tile(320, Some(64)), 1);
        assert_eq!(skinny_route_tile(321, Some(64)), 2);
        assert_eq!(skinny_route_tile(512, Some(64)), 2);
        // A dense product's rows are all one weight's: 16-row tiles past 8 rows.
        assert_eq!(skinny_route_tile(8, None), 1);
        assert_eq!(skinny_route_tile(9, None), 2);
        assert_eq!(skinny_route_tile(64, None), 2);
        // Few routes take one tile however they are grouped.
        assert_eq!(skinny_route_tile(8, Some(1)), 1);
        assert_eq!(skinny_route_tile(9, Some(1)), 2);
    }

    #[test]
    fn the_streamed_kernels_rows_meet_no_bank_twice_and_two_blocks_fit_a_multiprocessor() {
        for n_in in (256..=4096).step_by(256) {
            for swiglu in [true, false] {
                let (mt, pitch) = stream_unit(n_in, swiglu).expect("rows fit");
                assert!(
                    pitch >= n_in / 32 * 18 && pitch.is_multiple_of(16),
                    "n_in={n_in}"
                );
                // Lane (g, t) reads word t of its block in row g: the eight rows' first words
                // fall in eight distinct groups of four banks.
                let mut groups: Vec<usize> = (0..8).map(|g| (g * pitch / 4) % 32 / 4).collect();
                groups.sort_unstable();
                groups.dedup();
                assert_eq!(groups.len(), 8, "n_in={n_in}: pitch {pitch}");
                assert!(
                    swiglu && mt == 1 || !swiglu && (1..=4).contains(&mt),
                    "n_in={n_in}"
                );
            }
        }
        // The release's gate+up (3,584 inputs) and down (1,024, four m16 tiles a unit): two
        // blocks a multiprocessor within an H200's 228 KiB.
        assert_eq!(stream_unit(1024, false).map(|u| u.0), Some(4));
        for (n_in, swiglu) in [(3584, true), (1024, false)] {
            assert!(2 * (stream_smem_bytes(n_in, swiglu).unwrap() + 1024) <= 228 * 1024);
        }
        // Wide rows take fewer tiles a unit, then one block a multiprocessor, then none.
        assert_eq!(stream_unit(4096, false).map(|u| u.0), Some(1));
        assert!(stream_smem_bytes(8192, true).unwrap() <= 227 * 1024);
        assert_eq!(stream_unit(16384, true), None);
    }

    #[test]
    fn the_select_kernel_stages_a_tokens_partials_in_eight_warps_or_fewer_when_wide() {
        // The release: 64 experts, 28 slices (3584 inputs of 128) or 14 tiled.
        assert_eq!(select_block(28, 64), Some((8, 8 * 31 * 64 * 4)));
        assert_eq!(select_block(14, 64), Some((8, 8 * 17 * 64 * 4)));
        // 256 experts over 56 slices: 59 KiB a warp, three warps' worth fit: two.
        assert_eq!(select_block(56, 256), Some((2, 2 * 59 * 256 * 4)));
        for (slices, ne) in [(1, 1), (28, 160), (56, 256), (100, 64)] {
            let (w, bytes) = select_block(slices, ne).expect("fits");
            assert!(bytes <= SMEM_LIMIT && bytes == w as usize * (slices + 3) * ne * 4);
        }
        assert_eq!(select_block(400, 256), None);
    }

    #[test]
    fn the_slice_router_spreads_a_decode_steps_tokens_over_one_wave_of_blocks() {
        // The release: 64 experts in blocks of 8, 3584 inputs in slices of 128: 224 blocks a
        // token tile; an H200 holds 132 × 8 of them.
        let tile = |n| router_token_tile(n, 8 * 28, 132);
        assert_eq!(tile(1), 4);
        assert_eq!(tile(8), 4);
        assert_eq!(tile(64), 16);
        assert_eq!(tile(128), 32);
        for n in [1, 3, 8, 17, 64, 100, 128, 511] {
            let t = tile(n);
            assert_eq!(t % 4, 0, "n={n}");
            assert!(
                n.div_ceil(t) * 224 <= 132 * 8,
                "n={n}: {} tiles",
                n.div_ceil(t)
            );
        }
        // More blocks a tile than one wave holds: one tile of every token.
        assert_eq!(router_token_tile(50, 5000, 132), 52);
    }
}
