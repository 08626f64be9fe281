//! The routed experts' grouped IQ4_NL GEMM for prefill chunks, on the tensor cores.
//!
//! The same contract as the grouped expert products of [`crate::moe`] (`ExpertSwiGlu`,
//! `ExpertDown`): one output row per route, one writer per element, a fixed summation order
//! (the same bits on every run), a grid sized from static shapes only. The kernels
//! (`moe/moe_prefill.cu`) narrow weights and inputs to f16 for the tensor cores with f32
//! accumulation; the file's header says how f16's range is kept (exact power-of-two scalings)
//! and why f16 rather than bf16. Parity against the f32 CPU reference is therefore at f16
//! tolerance. Two kernels compute the same function: `mma.sync` (any sm_80+ card, 64-route
//! tiles) and, on Hopper, warpgroup MMAs with tiles of up to 128 routes, so an expert's
//! weights are decoded once for up to 128 of its routes ([`TcKernel`]).

use crate::OpError;
use crate::gpu::{GpuCtx, dev_err};

pub(crate) const MOE_PREFILL_CU: &str = include_str!("moe_prefill.cu");

const OP: &str = "expert_gemm_tc";
/// Routes a block of the `mma.sync` kernel covers (`TC_BM`).
const BM: usize = 64;
/// Routes a block of the warpgroup kernel covers at most (`WG_TM`).
const WG_TM: usize = 128;
/// Weight rows a block covers (`TC_BN`, `WG_ROWS`): in SwiGLU mode half are gate rows, half up
/// rows.
const BN: usize = 256;
/// Inputs a k-tile covers (`TC_KT`): `n_in` must be a multiple.
pub const K_TILE: usize = 128;
/// Dynamic shared memory of an `mma.sync` block (`TC_SMEM`): four weight stages of 256 rows ×
/// 80 bytes and two A tiles of 64 routes × 272 bytes.
const SMEM: usize = 4 * BN * 80 + 2 * BM * 272;
/// Dynamic shared memory of a warpgroup block (`WG_SMEM`): four weight stages and three input
/// tiles of 128 routes × 128 f16.
const WG_SMEM: usize = 4 * BN * 80 + 3 * WG_TM * K_TILE * 2;
/// Inputs are narrowed to f16 after these exact scalings (weights are decoded times 16): the
/// SwiGLU inputs are normalised activations, the down projection's are `silu(g)·u`, which
/// crosses 65504 on loud experts (seed §2).
const SWIGLU_X_SCALE: f32 = 1.0 / 16.0;
const DOWN_X_SCALE: f32 = 1.0 / 256.0;

/// Which kernel computes the grouped product; both give the contract's results, each
/// bit-reproducible on its own (their bits need not match each other).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TcKernel {
    /// `mma.sync` m16n8k16, tiles of 64 routes × 256 weight rows: any sm_80+ device.
    MmaSync,
    /// `wgmma` (sm_90a), tiles of up to 128 routes × 256 weight rows, the instruction's width
    /// fitted to the tile's routes in steps of 16.
    Wgmma,
}

impl TcKernel {
    /// The kernel for `ctx`'s device: warpgroup MMAs on Hopper (compute capability 9.0, where
    /// the kernel cache builds for sm_90a), `mma.sync` elsewhere.
    pub fn for_device(ctx: &GpuCtx) -> TcKernel {
        TcKernel::fastest_on(ctx.device.compute_capability())
    }

    /// The fastest kernel a device of this compute capability runs: `wgmma` exists on sm_90a
    /// only. The one statement of that fact (the lowering asks it too).
    pub fn fastest_on(compute_capability: (u32, u32)) -> TcKernel {
        if compute_capability == (9, 0) {
            TcKernel::Wgmma
        } else {
            TcKernel::MmaSync
        }
    }
}

fn i32_of(what: &str, v: usize) -> Result<i32, OpError> {
    i32::try_from(v).map_err(|_| OpError::shape(OP, format!("{what} {v} does not fit an i32")))
}

fn aligned(what: &str, ptr: u64, to: u64) -> Result<(), OpError> {
    if ptr == 0 || !ptr.is_multiple_of(to) {
        return Err(OpError::Type(format!(
            "{OP}: {what} at device address {ptr:#x} is not a {to}-byte aligned allocation"
        )));
    }
    Ok(())
}

/// Enqueues the grouped expert product for every route of every expert, on the kernel
/// [`TcKernel::for_device`] picks.
///
/// SwiGLU mode (`wb` is the up stack, `wa` the gate stack): `y[r][c] = silu(gate_c·x[t]) ·
/// (up_c·x[t])` for `c < n_out` (= n_ff), `t = route_token[r]`. Down mode (`wb` None):
/// `y[r][c] = W_c·x[r]` (x rows are routes; `route_token` is not read). Routes of expert `e`
/// are `offsets[e]..offsets[e+1]`. A route whose token lies outside `[0, x_rows)` reads zeros.
/// Only rows `0..offsets[n_expert]` of `y` are written.
///
/// Requirements, checked here as typed errors: `n_in` a positive multiple of [`K_TILE`];
/// `wa`, `wb` and `x` non-null and 16-byte aligned; sizes that fit the kernel's i32 indices
/// (on the warpgroup kernel, an expert's weight slice and `x` each under 2^31 bytes and
/// values) and the grid (`⌈routes/64⌉ + min(n_expert, routes) ≤ 65535`, 128 for the
/// warpgroup kernel).
///
/// # Safety
/// Every address is a live device allocation on `ctx`'s device that stays valid until the
/// kernel has run: `wa` (and `wb`) hold `n_expert · n_out` IQ4_NL rows of `n_in` values
/// (`n_in/32 · 18` bytes each, expert-major), `x` holds `x_rows × n_in` f32, `offsets` holds
/// `n_expert + 1` i32 rising from 0 to at most `routes`, `route_token` (SwiGLU mode) `routes`
/// i32, and `y` has room for `routes × n_out` f32 and overlaps none of the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_expert_gemm_tc(
    ctx: &GpuCtx,
    wa: u64,
    wb: Option<u64>,
    x: u64,
    offsets: u64,
    route_token: u64,
    y: u64,
    n_in: usize,
    n_out: usize,
    n_expert: usize,
    x_rows: usize,
    routes: usize,
) -> Result<(), OpError> {
    // SAFETY: the caller's guarantees are passed on unchanged.
    unsafe {
        launch_expert_gemm_tc_with(
            ctx,
            TcKernel::for_device(ctx),
            wa,
            wb,
            x,
            offsets,
            route_token,
            y,
            n_in,
            n_out,
            n_expert,
            x_rows,
            routes,
        )
    }
}

/// [`launch_expert_gemm_tc`] on a chosen kernel; [`TcKernel::Wgmma`] on a device other than
/// compute capability 9.0 is an error.
///
/// # Safety
/// As [`launch_expert_gemm_tc`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_expert_gemm_tc_with(
    ctx: &GpuCtx,
    kernel: TcKernel,
    wa: u64,
    wb: Option<u64>,
    x: u64,
    offsets: u64,
    route_token: u64,
    y: u64,
    n_in: usize,
    n_out: usize,
    n_expert: usize,
    x_rows: usize,
    routes: usize,
) -> Result<(), OpError> {
    if routes == 0 || n_out == 0 {
        return Ok(());
    }
    if n_in == 0 || !n_in.is_multiple_of(K_TILE) {
        return Err(OpError::shape(
            OP,
            format!(
                "the input width must be a positive multiple of {K_TILE} (whole k-tiles of four \
                 IQ4_NL blocks), found {n_in}"
            ),
        ));
    }
    if n_expert == 0 {
        return Err(OpError::shape(OP, "n_expert must be positive"));
    }
    aligned("expert weight", wa, 16)?;
    if let Some(b) = wb {
        aligned("up weight", b, 16)?;
        aligned("route_token", route_token, 4)?;
    }
    aligned("input", x, 16)?;
    aligned("offsets", offsets, 4)?;
    aligned("output", y, 4)?;
    let swiglu = wb.is_some();
    let wg = kernel == TcKernel::Wgmma;
    if wg {
        let cc = ctx.device.compute_capability();
        if cc != (9, 0) {
            return Err(OpError::Type(format!(
                "{OP}: the warpgroup kernel needs compute capability 9.0 (sm_90a), the device \
                 has {}.{}",
                cc.0, cc.1
            )));
        }
        // The kernel's 32-bit offsets: rows of one expert's slice (with a tile's overhang)
        // and input values.
        let slice = (n_out + BN) * (n_in / 32 * 18);
        if slice > i32::MAX as usize || x_rows.saturating_mul(n_in) > i32::MAX as usize {
            return Err(OpError::shape(
                OP,
                format!(
                    "an expert slice of {n_out} rows × {n_in} inputs or {x_rows} input rows \
                     exceed the warpgroup kernel's 32-bit offsets"
                ),
            ));
        }
    }
    let tm = if wg { WG_TM } else { BM };
    let tiles = routes.div_ceil(tm) + n_expert.min(routes);
    if tiles > 65535 {
        return Err(OpError::shape(
            OP,
            format!(
                "{routes} routes of {n_expert} experts exceed the grid's {tiles} > 65535 route tiles"
            ),
        ));
    }
    let out_cols = if swiglu { BN / 2 } else { BN };
    let col_tiles = i32_of("column tiles", n_out.div_ceil(out_cols))?;
    let pair = n_out.is_multiple_of(2) && y.is_multiple_of(8);
    let (x_scale, y_scale) = if swiglu {
        (SWIGLU_X_SCALE, 1.0f32)
    } else {
        (DOWN_X_SCALE, 16.0f32)
    };
    let (name, smem) = if wg {
        ("expert_gemm_wg_iq4", WG_SMEM)
    } else {
        ("expert_gemm_tc_iq4", SMEM)
    };
    let kern = ctx.kernel("moe_prefill.cu", MOE_PREFILL_CU, name)?;
    let launch = ctx
        .device
        .launch(&kern)
        .grid((col_tiles as u32, tiles as u32))
        .block(256)
        .shared_mem(smem as u32)
        .arg(wa)
        .arg(wb.unwrap_or(0))
        .arg(x)
        .arg(offsets)
        .arg(route_token)
        .arg(y)
        .arg(i32_of("input width", n_in)?)
        .arg(i32_of("rows", n_out)?)
        .arg(i32_of("n_expert", n_expert)?)
        .arg(i32_of("input rows", x_rows)?)
        .arg(i32_of("routes", routes)?)
        .arg(x_scale)
        .arg(y_scale);
    // SAFETY: the argument lists match expert_gemm_tc_iq4 (with `pair`) and
    // expert_gemm_wg_iq4; the caller guarantees the buffers (see launch_expert_gemm_tc), the
    // kernels bound every route and row index by the sizes passed.
    unsafe {
        if wg {
            launch.enqueue()
        } else {
            launch.arg(i32::from(pair)).enqueue()
        }
        .map_err(dev_err)
    }
}

// ---- Skinny products (decode steps) ---------------------------------------------------------

/// Inputs a k-tile of the skinny kernel covers (`SK_KT`): its `n_in` must be a multiple.
pub const SKINNY_K_TILE: usize = 256;
/// Weight rows a skinny block covers (`SK_ROWS`): 16 outputs in SwiGLU mode, 32 in down mode.
const SK_ROWS: usize = 32;
/// One stage of a warp's weight ring (`SK_WSTAGE`): 32 rows × 144 bytes (a 256-input k-tile).
const SK_WSTAGE: usize = SK_ROWS * 144;
/// How the skinny kernel takes its inputs, and so which of its kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SkinnyPath {
    /// Inputs narrowed to f16 (`expert_x_f16`), `expert_skinny_iq4_<NT>`: 8- or 16-route
    /// tiles of f16 MMAs, three stages.
    F16,
    /// Inputs quantized to 16 bits a row (`expert_x_q16`), `expert_skinny_iq4_q`: 8-route
    /// tiles of integer MMAs, two stages at five blocks a multiprocessor.
    Int,
    /// The integer path on three stages at four blocks (`expert_skinny_iq4_q3`).
    IntDeep,
    /// The integer path with the first four routes' inputs copied through the weight ring
    /// (`expert_skinny_iq4_qs`, four blocks a multiprocessor).
    IntStaged,
    /// The integer path's arithmetic streamed (`expert_stream_iq4_q`, compute capability 9.0
    /// and later): persistent blocks moving whole weight rows into a ring (`_bulk`: by bulk
    /// copies, else by 16-byte copies of a warp's lanes), the warps taking K slices of up to 16
    /// routes a pass.
    IntStream { bulk: bool },
}

impl SkinnyPath {
    fn int_inputs(self) -> bool {
        self != SkinnyPath::F16
    }

    /// The kernel (for `nt` n8 tiles a route tile on the f16 path) and the stages of each
    /// warp's weight ring it was compiled for (`STAGES` of its `EXPERT_SKINNY` line).
    fn kernel(self, nt: usize) -> (String, usize) {
        match self {
            SkinnyPath::F16 => (format!("expert_skinny_iq4_{nt}"), 3),
            SkinnyPath::Int => ("expert_skinny_iq4_q".to_string(), 2),
            SkinnyPath::IntDeep => ("expert_skinny_iq4_q3".to_string(), 3),
            SkinnyPath::IntStaged => ("expert_skinny_iq4_qs".to_string(), 2),
            SkinnyPath::IntStream { bulk: false } => ("expert_stream_iq4_q".to_string(), ST_SLOTS),
            SkinnyPath::IntStream { bulk: true } => {
                ("expert_stream_iq4_q_bulk".to_string(), ST_SLOTS)
            }
        }
    }

    /// Bytes of one stage of a warp's ring: the weights' k-tile, with staged inputs their
    /// routes' k-tile too (`SKX_ROUTE` bytes a route).
    fn stage_bytes(self) -> usize {
        match self {
            SkinnyPath::IntStaged => SK_WSTAGE + 4 * 576,
            _ => SK_WSTAGE,
        }
    }
}
/// Warps a skinny block has: `kw` of them share a row tile's K, so a block covers 4/kw tiles.
const SK_WARPS: usize = 4;

/// The streamed kernel's warps (`ST_WARPS`), its ring's slots, the floats of a use of a
/// slot's partial sums (`ST_RED`, two areas a slot) and the entries of its expert list (`ST_ENTRIES`: the routed
/// experts a launch may have, plus the shared one).
const ST_WARPS: usize = 8;
const ST_SLOTS: usize = 2;
const ST_RED: usize = ST_WARPS * 4 * 2 * 32;
const ST_ENTRIES: usize = 257;
/// The most experts a stacked weight may have for the streamed kernel.
pub const STREAM_MAX_EXPERTS: usize = ST_ENTRIES - 1;
/// Blocks of the streamed kernel a multiprocessor (its launch bounds).
const ST_BLOCKS_PER_SM: usize = 2;

/// Shared memory a block may take on compute capability 9.0 (227 KiB), and what each of two
/// blocks a multiprocessor may (228 KiB less 1 KiB a block the system keeps, halved).
const ST_SMEM_LIMIT: usize = 227 * 1024;
const ST_SMEM_TWO_BLOCKS: usize = 113 * 1024;

/// Bytes a staged row takes: a row of `n_in / 32` blocks padded by 16 bytes where its 4-byte
/// words number an even multiple of 4 modulo 32, so that the eight rows of a fragment's loads
/// start on eight distinct 4-bank groups.
fn stream_pitch(n_in: usize) -> usize {
    let row_bytes = n_in / 32 * 18;
    if (row_bytes / 16).is_multiple_of(2) {
        row_bytes + 16
    } else {
        row_bytes
    }
}

fn stream_smem_with(mt: usize, pitch: usize) -> usize {
    ST_SLOTS * 16 * mt * pitch
        + 2 * ST_SLOTS * ST_RED * 4
        + ST_SLOTS * (8 + 4)
        + (4 * ST_ENTRIES + 2) * 4
}

/// The streamed kernel's m16 tiles a unit and staged row bytes: SwiGLU one (8 outputs' gate
/// and up rows), down four (64 output rows) where two blocks a multiprocessor still fit, else
/// two or one. None where even one tile a slot exceeds a block's shared memory.
pub(crate) fn stream_unit(n_in: usize, swiglu: bool) -> Option<(usize, usize)> {
    let pitch = stream_pitch(n_in);
    let tiles: &[usize] = if swiglu { &[1] } else { &[4, 2, 1] };
    tiles
        .iter()
        .copied()
        .find(|&mt| stream_smem_with(mt, pitch) <= ST_SMEM_TWO_BLOCKS)
        .or_else(|| (stream_smem_with(1, pitch) <= ST_SMEM_LIMIT).then_some(1))
        .map(|mt| (mt, pitch))
}

/// Dynamic shared memory of one streamed block: the ring, two areas of partial sums, a barrier
/// and a counter a slot, the expert list.
#[cfg(test)]
pub(crate) fn stream_smem_bytes(n_in: usize, swiglu: bool) -> Option<usize> {
    stream_unit(n_in, swiglu).map(|(mt, pitch)| stream_smem_with(mt, pitch))
}

/// Whether the streamed kernel takes products of this input width (whole 256-value k-tiles
/// whose rows fit its ring).
pub fn stream_supports(n_in: usize) -> bool {
    skinny_supports(n_in) && stream_unit(n_in, true).is_some() && stream_unit(n_in, false).is_some()
}

/// Warps that share a row tile's `k_tiles` k-tiles: as few as keep one and a half waves of
/// warps on an H200 (132 multiprocessors × 16 resident warps) for `tiles` (row tile, expert)
/// pairs, since a block's route lookup, reduction and epilogue are fixed costs that fewer,
/// longer warps pay less often. H200, 32 tokens (56 experts), one / two / four warps a row
/// tile: gate+up 141 / 141 / 156 µs, down 75 / 82 / 98 µs.
fn skinny_k_warps(k_tiles: usize, tiles: usize) -> usize {
    [1, 2, 4]
        .into_iter()
        .find(|&kw| kw >= k_tiles.min(SK_WARPS) || 2 * tiles * kw >= 3 * 132 * 16)
        .unwrap_or(SK_WARPS)
}

/// Routes an expert averages up to which grouped products take 8-route tiles
/// (`expert_skinny_iq4_1`): with top-4 of 64 that is up to 80 tokens. Past it 16-route tiles
/// decode fewer weights twice; below it the 8-route kernel's fewer registers (111 against
/// 130) keep 16 warps a multiprocessor resident instead of 12, and 4 routes an expert (64
/// tokens) rarely overflow 8. H200 profile, gate+up / down a layer: 32 tokens 138.3 / 69.5
/// µs (147.7 / 72.7 on 16-route tiles), 64 tokens 155.0 / 81.6 (163.8 / 82.7).
pub(crate) const SKINNY_NT1_ROUTES_AN_EXPERT: usize = 5;

/// The skinny kernel's n8 tiles a route tile (`NT`) for `routes` routes, grouped over
/// `experts` experts or dense (None): one for at most 8 routes or for experts that average
/// at most [`SKINNY_NT1_ROUTES_AN_EXPERT`], else two.
pub(crate) fn skinny_route_tile(routes: usize, experts: Option<usize>) -> usize {
    let few_an_expert = experts.is_some_and(|e| routes <= SKINNY_NT1_ROUTES_AN_EXPERT * e);
    if routes <= 8 || few_an_expert { 1 } else { 2 }
}

/// Whether the skinny kernel takes inputs of this width (whole 256-value k-tiles).
pub fn skinny_supports(n_in: usize) -> bool {
    n_in > 0 && n_in.is_multiple_of(SKINNY_K_TILE)
}

/// Scratch the skinny kernel needs: `x_rows × n_in` f16 inputs (narrowed in the kernel's
/// K order) at a 256-byte boundary, or on the integer path as many 16-bit inputs (two bytes
/// each) and a scale a row after them.
pub fn skinny_scratch_bytes(x_rows: usize, n_in: usize) -> usize {
    256 + (x_rows * n_in * 2).next_multiple_of(256) + (x_rows * 4).next_multiple_of(256)
}

/// Where the rows a skinny product reads come from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SkinnyRoutes {
    /// Routed experts: the CSR table (`offsets`, `n_expert + 1` i32) and, in SwiGLU mode, the
    /// token of each route (`route_token`).
    Grouped {
        offsets: u64,
        route_token: u64,
        n_expert: usize,
    },
    /// One dense weight: row `r` of the output is row `r` of the input.
    Dense,
}

/// The shared expert a grouped skinny launch carries beside the routed ones: every token one
/// route of it, on tiles after the routed ones.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SkinnyShared {
    /// Its weight (`[n_out, n_in]`, IQ4_NL) and, in SwiGLU mode, its up weight.
    pub wa: u64,
    pub wb: Option<u64>,
    /// Down mode: its `rows × n_in` f32 activations (SwiGLU mode reads the tokens' own rows).
    pub x: u64,
    /// Its rows: the step's tokens.
    pub rows: usize,
    /// Its `rows × n_out` f32 output.
    pub y: u64,
}

impl SkinnyShared {
    /// Refuses a shared expert that cannot ride a grouped launch of this mode (`swiglu`) over
    /// `x_rows` tokens: another mode, other rows than the step's tokens (SwiGLU), or weights
    /// and output a kernel cannot read as it does the routed ones.
    pub(crate) fn check(
        &self,
        op: &'static str,
        swiglu: bool,
        x_rows: usize,
    ) -> Result<(), OpError> {
        if self.wb.is_some() != swiglu {
            return Err(OpError::shape(
                op,
                "the shared expert rides only a grouped launch of its own mode".to_string(),
            ));
        }
        if swiglu && self.rows != x_rows {
            return Err(OpError::shape(
                op,
                format!(
                    "the shared expert's {} rows are not the step's {x_rows} tokens",
                    self.rows
                ),
            ));
        }
        aligned("shared weight", self.wa, 16)?;
        if let Some(b) = self.wb {
            aligned("shared up weight", b, 16)?;
        }
        aligned("shared output", self.y, 4)
    }
}

/// A streamed launch's route table and its unit: m16 tiles and staged row bytes.
struct StreamShape {
    offsets: u64,
    route_token: u64,
    n_expert: usize,
    mt: usize,
    pitch: usize,
}

/// The streamed kernel's shape for a launch, or why it cannot take it: dense routes, a card
/// without bulk copies, more experts than its list holds, rows its ring cannot hold.
fn stream_shape(
    ctx: &GpuCtx,
    op: &'static str,
    routes_from: SkinnyRoutes,
    n_in: usize,
    swiglu: bool,
) -> Result<StreamShape, OpError> {
    let SkinnyRoutes::Grouped {
        offsets,
        route_token,
        n_expert,
    } = routes_from
    else {
        return Err(OpError::shape(
            op,
            "the streamed kernel takes grouped routes only".to_string(),
        ));
    };
    aligned("offsets", offsets, 4)?;
    let cc = ctx.device.compute_capability();
    if cc.0 < 9 {
        return Err(OpError::Type(format!(
            "{op}: the streamed expert kernel needs compute capability 9.0 or later (bulk \
             copies), the device has {}.{}",
            cc.0, cc.1
        )));
    }
    if n_expert > STREAM_MAX_EXPERTS {
        return Err(OpError::shape(
            op,
            format!(
                "the streamed kernel lists at most {STREAM_MAX_EXPERTS} experts, found {n_expert}"
            ),
        ));
    }
    let (mt, pitch) = stream_unit(n_in, swiglu).ok_or_else(|| {
        OpError::shape(
            op,
            format!("the streamed kernel's ring cannot hold rows of {n_in} inputs"),
        )
    })?;
    Ok(StreamShape {
        offsets,
        route_token,
        n_expert,
        mt,
        pitch,
    })
}

/// The grouped (or dense) product of [`launch_expert_gemm_tc`]'s contract for a decode step's
/// few routes an expert: the inputs narrowed to f16 into the scratch (`expert_x_f16`), then
/// `expert_skinny_iq4_<NT>` (weights as the MMA's A operand, routes in tiles of 8·NT). With
/// an integer `path` the inputs are quantized to 16 bits a row (`expert_x_q16`) and multiplied on
/// integer MMAs in 8-route tiles (`expert_skinny_iq4_q` or, on the deep ring,
/// `expert_skinny_iq4_q3`), whatever the routes an expert.
///
/// # Safety
/// As [`launch_expert_gemm_tc`], with `x` holding `x_rows × n_in` f32 (SwiGLU mode with a
/// route table: one row a token; otherwise one row a route, `x_rows = routes`) and `scratch`
/// a live device allocation of `scratch_bytes` bytes overlapping nothing else. `shared`
/// (grouped mode only) holds live buffers of the shapes its fields name: the same mode's
/// weights (both or neither of `wb`), in SwiGLU mode `rows = x_rows`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_expert_skinny(
    ctx: &GpuCtx,
    op: &'static str,
    wa: u64,
    wb: Option<u64>,
    x: u64,
    x_rows: usize,
    routes_from: SkinnyRoutes,
    y: u64,
    n_in: usize,
    n_out: usize,
    routes: usize,
    shared: Option<SkinnyShared>,
    path: SkinnyPath,
    scratch: crate::gpu::Scratch,
) -> Result<(), OpError> {
    let shared = shared.filter(|s| s.rows > 0);
    if (routes == 0 && shared.is_none()) || n_out == 0 {
        return Ok(());
    }
    if let Some(s) = shared {
        if matches!(routes_from, SkinnyRoutes::Dense) {
            return Err(OpError::shape(
                op,
                "the shared expert rides only a grouped launch".to_string(),
            ));
        }
        s.check(op, wb.is_some(), x_rows)?;
    }
    if !skinny_supports(n_in) {
        return Err(OpError::shape(
            op,
            format!(
                "the skinny kernel needs an input width that is a positive multiple of \
                 {SKINNY_K_TILE}, found {n_in}"
            ),
        ));
    }
    let i = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| OpError::shape(op, format!("{what} {v} does not fit an i32")))
    };
    // The kernel addresses a weight matrix's rows by 32-bit offsets.
    let matrix_bytes = n_out * (n_in / 32) * 18;
    if u32::try_from(matrix_bytes).is_err() {
        return Err(OpError::shape(
            op,
            format!(
                "an expert weight of {n_out} × {n_in} is {matrix_bytes} bytes; the skinny \
                 kernel takes at most 4 GiB a matrix"
            ),
        ));
    }
    aligned("expert weight", wa, 16)?;
    if let Some(b) = wb {
        aligned("up weight", b, 16)?;
    }
    aligned("input", x, 4)?;
    aligned("output", y, 4)?;
    // Down mode: the shared expert's activation rows follow the routes' in the f16 copy.
    let (x2, x2_rows) = match shared {
        Some(s) if wb.is_none() => {
            aligned("shared input", s.x, 4)?;
            (s.x, s.rows)
        }
        _ => (0, 0),
    };
    // The streamed kernel's shape, refused before anything is launched.
    let stream = match path {
        SkinnyPath::IntStream { .. } => {
            Some(stream_shape(ctx, op, routes_from, n_in, wb.is_some())?)
        }
        _ => None,
    };
    let need = skinny_scratch_bytes(x_rows + x2_rows, n_in);
    scratch.require(op, need)?;
    let xh = scratch.ptr.next_multiple_of(256);
    // The integer path's row scales, after the inputs.
    let sx = xh + ((x_rows + x2_rows) * n_in * 2).next_multiple_of(256) as u64;
    let y_scale = if wb.is_some() { 1.0f32 } else { 16.0 };
    let int_inputs = path.int_inputs();
    if int_inputs {
        let quantize = ctx.kernel("moe_prefill.cu", MOE_PREFILL_CU, "expert_x_q16")?;
        // SAFETY: reads x_rows·n_in f32 of x (and x2_rows·n_in of x2), writes two bytes a value
        // at xh and a float a row at sx, inside the scratch checked above.
        unsafe {
            ctx.device
                .launch(&quantize)
                .grid(i("input rows", x_rows + x2_rows)? as u32)
                .block(128)
                .arg(x)
                .arg(xh)
                .arg(sx)
                .arg(i("input rows", x_rows)?)
                .arg(i("input width", n_in)?)
                .arg(x2)
                .arg(i("shared input rows", x2_rows)?)
                .enqueue()
                .map_err(dev_err)?;
        }
    } else {
        let words = (x_rows * n_in / 2) as i64;
        let words2 = (x2_rows * n_in / 2) as i64;
        let narrow = ctx.kernel("moe_prefill.cu", MOE_PREFILL_CU, "expert_x_f16")?;
        let x_scale = if wb.is_some() {
            SWIGLU_X_SCALE
        } else {
            DOWN_X_SCALE
        };
        // SAFETY: reads x_rows·n_in f32 of x (and x2_rows·n_in of x2), writes as many f16 at
        // xh, inside the scratch checked above (xh is its first 256-byte boundary).
        unsafe {
            ctx.device
                .launch(&narrow)
                .grid(((words + words2) as usize).div_ceil(256).clamp(1, 4096) as u32)
                .block(256)
                .arg(x)
                .arg(xh)
                .arg(words)
                .arg(x_scale)
                .arg(x2)
                .arg(words2)
                .enqueue()
                .map_err(dev_err)?;
        }
    }
    if let Some(StreamShape {
        offsets,
        route_token,
        n_expert,
        mt,
        pitch,
    }) = stream
    {
        let swiglu = wb.is_some();
        let smem = stream_smem_with(mt, pitch);
        let outs = if swiglu { 8 } else { 16 * mt };
        let units = n_out.div_ceil(outs);
        let entries = n_expert.min(routes) + usize::from(shared.is_some());
        let grid = (ST_BLOCKS_PER_SM * ctx.device.sm_count() as usize)
            .min(units * entries)
            .max(1);
        let (name, _) = path.kernel(1);
        let kern = ctx.kernel("moe_prefill.cu", MOE_PREFILL_CU, &name)?;
        kern.prefer_most_shared_memory().map_err(dev_err)?;
        // SAFETY: the argument list matches expert_stream_iq4_q; the caller guarantees the
        // buffers, xh and sx were written above, and the kernel bounds every route, token and
        // row index by the sizes passed.
        return unsafe {
            ctx.device
                .launch(&kern)
                .grid(grid as u32)
                .block((32 * ST_WARPS) as u32)
                .shared_mem(smem as u32)
                .arg(wa)
                .arg(wb.unwrap_or(0))
                .arg(xh)
                .arg(sx)
                .arg(offsets)
                .arg(route_token)
                .arg(y)
                .arg(i("input width", n_in)?)
                .arg(i("rows", n_out)?)
                .arg(i("n_expert", n_expert)?)
                .arg(i("input rows", x_rows + x2_rows)?)
                .arg(i("routes", routes)?)
                .arg(shared.map_or(0, |s| s.wa))
                .arg(shared.and_then(|s| s.wb).unwrap_or(0))
                .arg(shared.map_or(0, |s| s.y))
                .arg(i("shared rows", shared.map_or(0, |s| s.rows))?)
                .arg(i("routes", if swiglu { 0 } else { x_rows })?)
                .arg(mt as i32)
                .arg(i("staged row bytes", pitch)?)
                .arg(ST_SLOTS as i32)
                .enqueue()
                .map_err(dev_err)
        };
    }
    let (offsets, route_token, n_expert) = match routes_from {
        SkinnyRoutes::Grouped {
            offsets,
            route_token,
            n_expert,
        } => {
            aligned("offsets", offsets, 4)?;
            (offsets, route_token, n_expert)
        }
        SkinnyRoutes::Dense => (0, 0, 1),
    };
    let nt = if int_inputs {
        1
    } else {
        skinny_route_tile(routes, (offsets != 0).then_some(n_expert))
    };
    let tm = 8 * nt;
    let routed_tiles = if offsets != 0 {
        routes.div_ceil(tm) + n_expert.min(routes)
    } else {
        routes.div_ceil(tm)
    };
    let shared_tiles = shared.map_or(0, |s| s.rows.div_ceil(tm));
    let tiles = routed_tiles + shared_tiles;
    if tiles > 65535 {
        return Err(OpError::shape(
            op,
            format!("{routes} routes of {n_expert} experts exceed the grid's 65535 route tiles"),
        ));
    }
    let outs = if wb.is_some() { SK_ROWS / 2 } else { SK_ROWS };
    let row_tiles = n_out.div_ceil(outs);
    let pairs = if offsets != 0 {
        n_expert.min(routes) + shared_tiles
    } else {
        tiles
    };
    let kw = skinny_k_warps(n_in / SKINNY_K_TILE, row_tiles * pairs);
    let subtiles = SK_WARPS / kw;
    let (name, stages) = path.kernel(nt);
    // The K split's partials go through the rings (the kernel's epilogue): no more.
    let smem = SK_WARPS * stages * path.stage_bytes();
    let kern = ctx.kernel("moe_prefill.cu", MOE_PREFILL_CU, &name)?;
    // SAFETY: the argument list matches expert_skinny_iq4_<NT>; the caller guarantees the
    // buffers, xh was written above, and the kernel bounds every route, token and row index
    // by the sizes passed.
    unsafe {
        ctx.device
            .launch(&kern)
            .grid((
                i("row tiles", row_tiles.div_ceil(subtiles))? as u32,
                tiles as u32,
            ))
            .block((32 * SK_WARPS) as u32)
            .shared_mem(smem as u32)
            .arg(wa)
            .arg(wb.unwrap_or(0))
            .arg(xh)
            .arg(if int_inputs { sx } else { 0 })
            .arg(offsets)
            .arg(route_token)
            .arg(y)
            .arg(i("input width", n_in)?)
            .arg(i("rows", n_out)?)
            .arg(i("n_expert", n_expert)?)
            .arg(i("input rows", x_rows + x2_rows)?)
            .arg(i("routes", routes)?)
            .arg(y_scale)
            .arg(kw as i32)
            .arg(shared.map_or(0, |s| s.wa))
            .arg(shared.and_then(|s| s.wb).unwrap_or(0))
            .arg(shared.map_or(0, |s| s.y))
            .arg(i("route tiles", routed_tiles)?)
            .arg(i("shared rows", shared.map_or(0, |s| s.rows))?)
            .arg(i("routes", if wb.is_some() { 0 } else { x_rows })?)
            .enqueue()
            .map_err(dev_err)
    }
}
