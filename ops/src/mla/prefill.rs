//! MLA attention for prefill chunks on the tensor cores (`mla/mla_prefill.cu`).
//!
//! The same function as [`crate::mla::MlaAttention`] (absorbed form, causal over the latent
//! cache, the value the first `kv_lora` columns of each row), computed flash-attention style
//! with f16 operands and f32 accumulation: Q·Kᵀ and P·V on `mma.m16n8k16`, the online softmax
//! in f32. One block takes 64 (token, head) query rows and stops at the largest position among
//! them, so a causal chunk does about half the work of the full square.
//!
//! Precision: Q, the cache rows and the softmax weights are rounded to f16 (11 significant
//! bits), as llama.cpp's default f16 KV cache does; the error is a few f16 units of the value
//! scale (see the parity tests for the bound used).

use super::DevicePages;
use crate::gpu::{GpuCtx, Scratch, dev_err};
use crate::{DType, OpError};

pub(crate) const MLA_PREFILL_CU: &str = include_str!("mla_prefill.cu");

const OP: &str = "mla_prefill";
/// Query rows (token, head pairs) a block of `mla_prefill_attn` takes.
const ROWS: usize = 64;
/// Key rows a tile; widest row; the rope part the kernel expects after the latent.
const KEYS: usize = 64;
const MAX_W: usize = 576;
const ROPE: usize = 64;
/// Cache rows a block of `mla_prefill_convert` narrows.
const CONVERT_ROWS: usize = 16;

/// Dynamic shared memory of `mla_prefill_attn`: Q, two key tiles (f16, `MAX_W` wide), P, then
/// the per-row tile maxima (2 key halves), rescale factors, sums (2 halves) and key counts.
const ATTN_SMEM: usize = ROWS * MAX_W * 2 + 2 * KEYS * MAX_W * 2 + ROWS * KEYS * 2 + 6 * ROWS * 4;
// An H200 block may opt in to 227 KiB.
const _: () = assert!(ATTN_SMEM <= 227 * 1024);

/// Blocks the attention's grid aims to fill: an H200's multiprocessors, one block each (its
/// shared memory). A constant, not the device's count, so a plan's scratch and its launches
/// agree and a step computes the same sums on any card.
const SPLIT_TARGET_BLOCKS: usize = 132;
/// Key tiles a split takes at least, and the most splits.
const MIN_TILES_PER_SPLIT: usize = 4;
const MAX_SPLITS: usize = 32;

/// Splits of the key range each block of the attention takes (`gridDim.y`): one when its
/// query rows fill the chip, else as many as keep the grid within one block a multiprocessor
/// and every split at least [`MIN_TILES_PER_SPLIT`] tiles of the table's rows. A mixed step's
/// 64-token chunk is 32 blocks of 64 query rows: alone they walked a 16k context on a quarter
/// of the chip (774 µs a layer on the H200).
pub fn flash_kv_splits(n_tok: usize, n_head: usize, ctx_rows: usize) -> usize {
    let blocks = (n_tok * n_head).div_ceil(ROWS);
    if blocks == 0 || blocks >= SPLIT_TARGET_BLOCKS {
        return 1;
    }
    let by_grid = SPLIT_TARGET_BLOCKS / blocks;
    let by_ctx = ctx_rows.div_ceil(KEYS) / MIN_TILES_PER_SPLIT;
    by_grid.min(by_ctx).clamp(1, MAX_SPLITS)
}

/// Bytes of the split partials after the f16 cache: each split's unnormalised rows
/// (`kv_lora` f32 each) and its (max, sum) pair a row, over the grid's padded rows.
fn partial_bytes(n_tok: usize, n_head: usize, kv_lora: usize, splits: usize) -> (usize, usize) {
    if splits <= 1 {
        return (0, 0);
    }
    let rows = (n_tok * n_head).div_ceil(ROWS) * ROWS;
    (splits * rows * kv_lora * 4, splits * rows * 8)
}

/// Scratch that covers [`launch_mla_prefill`] for any `n_tok` up to `max_tok` (a mixed step's
/// chunk is fewer tokens than the step's): a split grid holds at most
/// `SPLIT_TARGET_BLOCKS` blocks, so its partials are at most that many blocks' rows.
pub fn mla_prefill_scratch_bound(
    max_tok: usize,
    n_head: usize,
    ctx_rows: usize,
    w: usize,
    kv_lora: usize,
) -> usize {
    let exact = mla_prefill_scratch_bytes(max_tok, n_head, ctx_rows, w, kv_lora);
    if max_tok == 0 || flash_kv_splits(1, n_head, ctx_rows) <= 1 {
        return exact;
    }
    exact.max(
        (ctx_rows * w * 2).next_multiple_of(16) + SPLIT_TARGET_BLOCKS * ROWS * (kv_lora * 4 + 8),
    )
}

/// Scratch [`launch_mla_prefill`] needs: the cache narrowed to f16 (`ctx_rows × w`), rounded
/// up to 16 bytes, then the split partials when [`flash_kv_splits`] splits the keys.
pub fn mla_prefill_scratch_bytes(
    n_tok: usize,
    n_head: usize,
    ctx_rows: usize,
    w: usize,
    kv_lora: usize,
) -> usize {
    let (o, ml) = partial_bytes(
        n_tok,
        n_head,
        kv_lora,
        flash_kv_splits(n_tok, n_head, ctx_rows),
    );
    (ctx_rows * w * 2).next_multiple_of(16) + o + ml
}

/// Refuses the shapes the kernels do not cover.
fn check_shapes(
    n_tok: usize,
    n_head: usize,
    w: usize,
    kv_lora: usize,
    ctx_rows: usize,
) -> Result<(), OpError> {
    if n_head == 0 || kv_lora == 0 || !kv_lora.is_multiple_of(64) || kv_lora + ROPE > MAX_W {
        return Err(OpError::shape(
            OP,
            format!(
                "the kernel needs n_head > 0 (found {n_head}) and kv_lora a multiple of 64 up \
                 to {} (found {kv_lora})",
                MAX_W - ROPE
            ),
        ));
    }
    if w != kv_lora + ROPE {
        return Err(OpError::shape(
            OP,
            format!(
                "the kernel needs rows of kv_lora + {ROPE} = {} values, found w {w}",
                kv_lora + ROPE
            ),
        ));
    }
    // The kernel indexes rows and blocks as i32 (byte offsets are 64-bit).
    let fits = n_tok
        .checked_mul(n_head)
        .and_then(|r| r.checked_add(ROWS))
        .is_some_and(|r| i32::try_from(r).is_ok())
        && i32::try_from(ctx_rows).is_ok();
    if !fits {
        return Err(OpError::shape(
            OP,
            format!("{n_tok} tokens × {n_head} heads or {ctx_rows} cache rows exceed an i32"),
        ));
    }
    Ok(())
}

/// Enqueues the prefill attention: `out[t][h] = Σ_j softmax_j(kq_scale·q[t][h]·K[j])·
/// K[j][..kv_lora]` over positions `j ≤ positions[t]`, `K[j]` the pool row of position `j` of
/// the chunk's sequence (`pages`, the sequence of row 0; `ctx_rows` is its table's positions); a token whose position is outside
/// `[0, ctx_rows)` gets zeros. Two launches (narrow the cache rows up to the largest valid
/// position to f16 into `scratch`, then the attention); no host synchronization, so it can be
/// captured into a graph: the grids depend on `n_tok`, `n_head` and `ctx_rows` only.
///
/// Shapes: `w = kv_lora + 64`, `kv_lora` a multiple of 64 up to 512; other shapes are a
/// [`OpError::Shape`]. `q`, `cache` and `out` must be 16-byte aligned, `scratch` 16-byte aligned
/// with at least [`mla_prefill_scratch_bytes`]`(ctx_rows, w)` bytes ([`OpError::Type`] if not).
///
/// Rows a token's mask hides but its block reads (up to the largest position of the 64 query
/// rows' tokens) get weight exactly 0; their values are clamped to ±65504 when narrowed (a NaN
/// becomes finite), so they cannot turn an output into NaN. Rows past the largest valid
/// position are not read.
///
/// # Safety
/// Every address must be a live device allocation on `ctx`'s device, unchanged until the
/// kernels have run: `q` F32 `[n_tok, n_head, w]`, `cache` of `cache_dtype` (F32 or F16)
/// `[pool rows, w]` holding every
/// block `pages` names, `positions` I32 `[n_tok]`, `out` F32 `[n_tok, n_head, kv_lora]`, `scratch` as above. `out` and `scratch`
/// must not overlap each other or any input.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_mla_prefill(
    ctx: &GpuCtx,
    q: u64,
    cache: u64,
    cache_dtype: DType,
    positions: u64,
    pages: DevicePages,
    out: u64,
    n_tok: usize,
    n_head: usize,
    w: usize,
    kv_lora: usize,
    ctx_rows: usize,
    kq_scale: f32,
    scratch: Scratch,
) -> Result<(), OpError> {
    check_shapes(n_tok, n_head, w, kv_lora, ctx_rows)?;
    if n_tok == 0 {
        return Ok(());
    }
    let bshift = pages.block_shift(OP)?;
    for (what, ptr) in [
        ("q", q),
        ("cache", cache),
        ("out", out),
        ("scratch", scratch.ptr),
    ] {
        if !ptr.is_multiple_of(16) {
            return Err(OpError::Type(format!(
                "{OP}: {what} at device address {ptr:#x} is not 16-byte aligned"
            )));
        }
    }
    let need = mla_prefill_scratch_bytes(n_tok, n_head, ctx_rows, w, kv_lora);
    if scratch.bytes < need {
        return Err(OpError::Type(format!(
            "{OP}: scratch of {} bytes, {need} needed for {ctx_rows} rows of {w}",
            scratch.bytes
        )));
    }
    let (n_tok_i, n_head_i, w_i, lora_i, ctx_i) = (
        n_tok as i32,
        n_head as i32,
        w as i32,
        kv_lora as i32,
        ctx_rows as i32,
    );
    let convert_name = match cache_dtype {
        DType::F32 => "mla_prefill_convert",
        DType::F16 => "mla_prefill_convert_h",
        other => {
            return Err(OpError::shape(
                OP,
                format!("the latent cache is F32 or F16, found {other}"),
            ));
        }
    };
    if ctx_rows > 0 {
        let convert = ctx.kernel("mla_prefill.cu", MLA_PREFILL_CU, convert_name)?;
        // SAFETY: argument list matches mla_prefill_convert; it reads rows below the largest
        // position in [0, ctx_rows) of `cache` and writes the same rows of the scratch, whose
        // size was checked above; the caller guarantees the allocations.
        unsafe {
            ctx.device
                .launch(&convert)
                .grid(ctx_rows.div_ceil(CONVERT_ROWS) as u32)
                .block(256)
                .arg(cache)
                .arg(positions)
                .arg(pages.block_table)
                .arg(pages.row_seq)
                .arg(i32::try_from(pages.table_width).unwrap_or(i32::MAX))
                .arg(bshift)
                .arg(scratch.ptr)
                .arg(n_tok_i)
                .arg(w_i)
                .arg(ctx_i)
                .enqueue()
                .map_err(dev_err)?;
        }
    }
    let attn = ctx.kernel("mla_prefill.cu", MLA_PREFILL_CU, "mla_prefill_attn")?;
    let blocks = (n_tok * n_head).div_ceil(ROWS);
    let splits = flash_kv_splits(n_tok, n_head, ctx_rows);
    let (o_bytes, _) = partial_bytes(n_tok, n_head, kv_lora, splits);
    let part_o = scratch.ptr + (ctx_rows * w * 2).next_multiple_of(16) as u64;
    let part_ml = part_o + o_bytes as u64;
    // SAFETY: argument list matches mla_prefill_attn; it reads the scratch rows the convert
    // launch wrote (below each block's largest valid position), Q rows below n_tok·n_head and
    // writes exactly the n_tok·n_head·kv_lora outputs (one split) or that many rows of each
    // split's partials after the f16 cache (the scratch size checked above covers them).
    unsafe {
        ctx.device
            .launch(&attn)
            .grid((blocks as u32, splits as u32))
            .block(256)
            .shared_mem(ATTN_SMEM as u32)
            .arg(q)
            .arg(scratch.ptr)
            .arg(positions)
            .arg(out)
            .arg(n_tok_i)
            .arg(n_head_i)
            .arg(w_i)
            .arg(lora_i)
            .arg(ctx_i)
            .arg(kq_scale * std::f32::consts::LOG2_E)
            .arg(part_o)
            .arg(part_ml)
            .enqueue()
            .map_err(dev_err)?;
    }
    if splits == 1 {
        return Ok(());
    }
    let combine = ctx.kernel("mla_prefill.cu", MLA_PREFILL_CU, "mla_prefill_combine")?;
    // SAFETY: argument list matches mla_prefill_combine; it reads the partials the attention
    // wrote for rows below n_tok·n_head of every split and writes those rows of `out`.
    unsafe {
        ctx.device
            .launch(&combine)
            .grid((n_tok * n_head) as u32)
            .block(kv_lora.div_ceil(4) as u32)
            .arg(part_o)
            .arg(part_ml)
            .arg(out)
            .arg((blocks * ROWS) as i32)
            .arg(lora_i)
            .arg(splits as i32)
            .enqueue()
            .map_err(dev_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_kernel_does_not_cover_are_shape_errors() {
        assert!(check_shapes(4, 32, 576, 512, 4096).is_ok());
        assert!(check_shapes(1, 1, 128, 64, 1).is_ok());
        for (n, nh, w, lora, rows) in [
            (4, 32, 576, 500, 4096),    // kv_lora not a multiple of 64
            (4, 32, 640, 576, 4096),    // kv_lora past 512
            (4, 32, 560, 512, 4096),    // rope not 64
            (4, 0, 576, 512, 4096),     // no heads
            (1 << 26, 64, 576, 512, 1), // rows overflow an i32
        ] {
            let e = check_shapes(n, nh, w, lora, rows).unwrap_err();
            assert!(
                matches!(
                    e,
                    OpError::Shape {
                        op: "mla_prefill",
                        ..
                    }
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn the_scratch_holds_the_f16_cache_rounded_to_16_bytes() {
        // 512 tokens of 32 heads fill the chip: no partials.
        assert_eq!(
            mla_prefill_scratch_bytes(512, 32, 4096, 576, 512),
            4096 * 576 * 2
        );
        assert_eq!(mla_prefill_scratch_bytes(1, 1, 1, 128, 64), 256);
        assert_eq!(mla_prefill_scratch_bytes(0, 32, 0, 576, 512), 0);
    }

    #[test]
    fn a_short_chunk_over_a_long_context_splits_its_keys_to_fill_the_chip() {
        // 64 tokens × 32 heads = 32 blocks: four splits of a 16k context fill 128 of 132.
        assert_eq!(flash_kv_splits(64, 32, 16384), 4);
        assert_eq!(flash_kv_splits(128, 32, 16384), 2);
        // Enough blocks already, or too few keys to share out.
        assert_eq!(flash_kv_splits(512, 32, 16384), 1);
        assert_eq!(flash_kv_splits(64, 32, 256), 1);
        assert_eq!(flash_kv_splits(64, 32, 512), 2);
        // One token's 32 heads, a long context: capped.
        assert_eq!(flash_kv_splits(1, 32, 1 << 20), MAX_SPLITS);
        // The partials sit after the f16 cache, padded rows for every split.
        let rows = 32 * 64;
        assert_eq!(
            mla_prefill_scratch_bytes(64, 32, 16384, 576, 512),
            16384 * 576 * 2 + 4 * rows * 512 * 4 + 4 * rows * 8
        );
        // The bound for a step of up to 600 tokens covers every chunk length inside it.
        let bound = mla_prefill_scratch_bound(600, 32, 16384, 576, 512);
        for t in 1..=600 {
            assert!(
                mla_prefill_scratch_bytes(t, 32, 16384, 576, 512) <= bound,
                "t={t}"
            );
        }
    }
}
