//! The routed experts' grouped IQ4_NL GEMM for prefill chunks, on the tensor cores.
//!
//! The same contract as the grouped expert products of [`crate::moe`] (`ExpertSwiGlu`,
//! `ExpertDown`): one output row per route, one writer per element, a fixed summation order
//! (the same bits on every run), a grid sized from static shapes only. The kernel
//! (`kernels/moe_prefill.cu`) narrows weights and inputs to f16 for `mma.sync` with f32
//! accumulation; its header says how f16's range is kept (exact power-of-two scalings) and why
//! f16 rather than bf16. Parity against the f32 CPU reference is therefore at f16 tolerance.

use crate::OpError;
use crate::gpu::{GpuCtx, dev_err};

pub(crate) const MOE_PREFILL_CU: &str = include_str!("../kernels/moe_prefill.cu");

const OP: &str = "expert_gemm_tc";
/// Routes a block covers (`TC_BM`).
const BM: usize = 64;
/// Weight rows a block covers (`TC_BN`): in SwiGLU mode half are gate rows, half up rows.
const BN: usize = 256;
/// Inputs a k-tile covers (`TC_KT`): `n_in` must be a multiple.
pub const K_TILE: usize = 128;
/// Dynamic shared memory of a block (`TC_SMEM`): four weight stages of 256 rows × 80 bytes
/// and two A tiles of 64 routes × 272 bytes.
const SMEM: usize = 4 * BN * 80 + 2 * BM * 272;
/// Inputs are narrowed to f16 after these exact scalings (weights are decoded times 16): the
/// SwiGLU inputs are normalised activations, the down projection's are `silu(g)·u`, which
/// crosses 65504 on loud experts (seed §2).
const SWIGLU_X_SCALE: f32 = 1.0 / 16.0;
const DOWN_X_SCALE: f32 = 1.0 / 256.0;

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

/// Enqueues the grouped expert product for every route of every expert.
///
/// SwiGLU mode (`wb` is the up stack, `wa` the gate stack): `y[r][c] = silu(gate_c·x[t]) ·
/// (up_c·x[t])` for `c < n_out` (= n_ff), `t = route_token[r]`. Down mode (`wb` None):
/// `y[r][c] = W_c·x[r]` (x rows are routes; `route_token` is not read). Routes of expert `e`
/// are `offsets[e]..offsets[e+1]`. A route whose token lies outside `[0, x_rows)` reads zeros.
/// Only rows `0..offsets[n_expert]` of `y` are written.
///
/// Requirements, checked here as typed errors: `n_in` a positive multiple of [`K_TILE`];
/// `wa`, `wb` and `x` non-null and 16-byte aligned; sizes that fit the kernel's i32 indices
/// and the grid (`⌈routes/64⌉ + min(n_expert, routes) ≤ 65535`).
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
    let tiles = routes.div_ceil(BM) + n_expert.min(routes);
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
    let kern = ctx.kernel("moe_prefill.cu", MOE_PREFILL_CU, "expert_gemm_tc_iq4")?;
    // SAFETY: the argument list matches expert_gemm_tc_iq4; the caller guarantees the buffers
    // (see above), the kernel bounds every route and row index by the sizes passed.
    unsafe {
        ctx.device
            .launch(&kern)
            .grid((col_tiles as u32, tiles as u32))
            .block(256)
            .shared_mem(SMEM as u32)
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
            .arg(y_scale)
            .arg(i32::from(pair))
            .enqueue()
            .map_err(dev_err)
    }
}
