//! Multi-head latent attention in the absorbed form over a latent cache (spec §3.5, §5).
//!
//! Per token the cache holds one `W = kv_lora + qk_rope` row: the normalised latent ‖ the
//! roped shared key. Queries are mapped into the latent (`Kb`) so every head scores against
//! the same rows, and the value is the latent part of those rows, mapped out by `Vb`.

use rayon::prelude::*;

use crate::cpu::{dot, matmul};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::mla_prefill::{launch_mla_prefill, mla_prefill_scratch_bytes};
use crate::op::{check_device, check_host};
use crate::rope::{RopeConsts, RopeParams, rope_norm_cached};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

// ---- validation shared with the MoE ops ---------------------------------------------

pub(crate) fn expect_inputs(
    op: &'static str,
    inputs: &[&TensorMeta],
    n: usize,
) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::shape(
            op,
            format!("takes {n} inputs, got {}", inputs.len()),
        ));
    }
    Ok(())
}

pub(crate) fn expect(
    op: &'static str,
    what: &str,
    m: &TensorMeta,
    dtype: DType,
    shape: &[usize],
) -> Result<(), OpError> {
    if m.dtype != dtype || m.shape != shape {
        return Err(OpError::shape(
            op,
            format!(
                "{what} must be {}, found {m}",
                TensorMeta::new(shape, dtype)
            ),
        ));
    }
    Ok(())
}

pub(crate) fn nonzero(op: &'static str, params: &[(&str, usize)]) -> Result<(), OpError> {
    for (name, v) in params {
        if *v == 0 {
            return Err(OpError::shape(op, format!("{name} must be > 0")));
        }
    }
    Ok(())
}

/// A weight of `shape` in any stored type whose rows are whole blocks.
pub(crate) fn expect_weight(
    op: &'static str,
    what: &str,
    m: &TensorMeta,
    shape: &[usize],
) -> Result<(), OpError> {
    if m.shape != shape || m.dtype == DType::I32 || m.bytes().is_none() {
        return Err(OpError::shape(
            op,
            format!("{what} must be a weight of shape {shape:?} with whole-block rows, found {m}"),
        ));
    }
    Ok(())
}

/// Refuses a device address the kernel's 16-byte vector accesses cannot use.
pub(crate) fn aligned16(op: &'static str, what: &str, t: &DeviceTensor<'_>) -> Result<(), OpError> {
    if !t.ptr.is_multiple_of(16) {
        return Err(OpError::Type(format!(
            "{op}: {what} at device address {:#x} is not 16-byte aligned",
            t.ptr
        )));
    }
    Ok(())
}

/// A dimension as the `int` the kernels take.
pub(crate) fn as_i32(op: &'static str, what: &str, v: usize) -> Result<i32, OpError> {
    i32::try_from(v).map_err(|_| OpError::shape(op, format!("{what} {v} does not fit an i32")))
}

/// The stored bytes of a weight view, checked against its metadata.
pub(crate) fn weight_bytes<'a>(t: &HostTensor<'a>) -> Result<&'a [u8], OpError> {
    let need = t
        .meta
        .bytes()
        .ok_or_else(|| OpError::Type(format!("{} rows are not whole blocks", t.meta)))?;
    t.data.get(..need).ok_or_else(|| {
        OpError::Type(format!(
            "{} needs {need} bytes, buffer has {}",
            t.meta,
            t.data.len()
        ))
    })
}

fn check_positions(op: &'static str, positions: &[i32], ctx: usize) -> Result<(), OpError> {
    for (i, &p) in positions.iter().enumerate() {
        if p < 0 || p as usize >= ctx {
            return Err(OpError::data(
                op,
                format!("position {p} of token {i} is outside the cache [0, {ctx})"),
            ));
        }
    }
    Ok(())
}

/// `y_h = W_h · x_h` for every head `h`, where `W_h` is head `h`'s `[n_out, n_in]` slice of a
/// `[n_head, n_out, n_in]` weight and `x_h[t] = x[(t·n_head + h)·stride ..][..n_in]`.
/// Returns one `[n_tok, n_out]` buffer per head.
#[allow(clippy::too_many_arguments)]
fn per_head_matmul(
    w: &[u8],
    dtype: DType,
    n_head: usize,
    n_out: usize,
    n_in: usize,
    x: &[f32],
    stride: usize,
    n_tok: usize,
) -> Result<Vec<Vec<f32>>, OpError> {
    let head_bytes = dtype
        .row_bytes(n_in)
        .ok_or_else(|| OpError::Type(format!("{dtype} rows of {n_in} are not whole blocks")))?
        * n_out;
    if n_in > stride || w.len() < n_head * head_bytes || x.len() < n_tok * n_head * stride {
        return Err(OpError::Type(format!(
            "per-head weight has {} bytes (need {}), input {} values (need {})",
            w.len(),
            n_head * head_bytes,
            x.len(),
            n_tok * n_head * stride
        )));
    }
    (0..n_head)
        .into_par_iter()
        .map(|h| {
            let mut xh = Vec::with_capacity(n_tok * n_in);
            for t in 0..n_tok {
                let s = (t * n_head + h) * stride;
                xh.extend_from_slice(&x[s..s + n_in]);
            }
            let mut y = vec![0f32; n_tok * n_out];
            matmul(
                &w[h * head_bytes..(h + 1) * head_bytes],
                dtype,
                n_out,
                n_in,
                &xh,
                n_tok,
                &mut y,
            )?;
            Ok(y)
        })
        .collect()
}

// ---- MlaQuery ------------------------------------------------------------------------

/// `Q[t][h] = Kb[h]·q_nope[t][h] ‖ rope(q_pe[t][h], pos[t])`.
///
/// Inputs: q F32 `[n, n_head·(qk_nope+qk_rope)]` (per head nope then rope), k_b
/// `[n_head, kv_lora, qk_nope]` (any weight type), positions I32 `[n]`.
/// Output: F32 `[n, n_head, kv_lora+qk_rope]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaQuery {
    pub n_head: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub kv_lora: usize,
    pub rope: RopeParams,
    pub kernel: HeadKernel,
}

impl MlaQuery {
    /// Slice-level form of the op; `out` is `n × n_head × (kv_lora+qk_rope)`.
    pub fn compute(
        &self,
        q: &[f32],
        k_b: &[u8],
        k_b_dtype: DType,
        positions: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let qk = self.qk_nope + self.qk_rope;
        let w = self.kv_lora + self.qk_rope;
        if q.len() < n * self.n_head * qk || out.len() < n * self.n_head * w {
            return Err(OpError::Type(format!(
                "mla_query buffers too small for {n} tokens: q {}, out {}",
                q.len(),
                out.len()
            )));
        }
        let lat = per_head_matmul(
            k_b,
            k_b_dtype,
            self.n_head,
            self.kv_lora,
            self.qk_nope,
            q,
            qk,
            n,
        )?;
        out[..n * self.n_head * w]
            .par_chunks_mut(self.n_head * w)
            .zip(positions.par_iter())
            .enumerate()
            .for_each(|(t, (row, &pos))| {
                let mut cache = vec![0f32; self.rope.n_rot];
                self.rope.cos_sin(pos, &mut cache);
                for (h, dst) in row.chunks_exact_mut(w).enumerate() {
                    let (dl, dr) = dst.split_at_mut(self.kv_lora);
                    dl.copy_from_slice(&lat[h][t * self.kv_lora..(t + 1) * self.kv_lora]);
                    let s = (t * self.n_head + h) * qk + self.qk_nope;
                    dr.copy_from_slice(&q[s..s + self.qk_rope]);
                    rope_norm_cached(dr, &cache);
                }
            });
        Ok(())
    }
}

impl Op for MlaQuery {
    fn name(&self) -> &'static str {
        "mla_query"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(
            op,
            &[
                ("n_head", self.n_head),
                ("qk_nope", self.qk_nope),
                ("qk_rope", self.qk_rope),
                ("kv_lora", self.kv_lora),
            ],
        )?;
        if self.rope.n_rot != self.qk_rope || !self.qk_rope.is_multiple_of(2) {
            return Err(OpError::shape(
                op,
                format!(
                    "rope n_rot {} must equal qk_rope {} and be even",
                    self.rope.n_rot, self.qk_rope
                ),
            ));
        }
        expect_inputs(op, inputs, 3)?;
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        let qk = self.qk_nope + self.qk_rope;
        expect(op, "q", inputs[0], DType::F32, &[n, self.n_head * qk])?;
        expect_weight(
            op,
            "k_b",
            inputs[1],
            &[self.n_head, self.kv_lora, self.qk_nope],
        )?;
        Ok(vec![TensorMeta::f32([
            n,
            self.n_head,
            self.kv_lora + self.qk_rope,
        ])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let q = inputs[0].f32()?;
        let k_b = weight_bytes(&inputs[1])?;
        let pos = inputs[2].i32()?;
        self.compute(q, k_b, inputs[1].meta.dtype, pos, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_query n_head={} qk_nope={} qk_rope={} kv_lora={} {}{}",
            self.n_head,
            self.qk_nope,
            self.qk_rope,
            self.kv_lora,
            self.rope,
            self.kernel.label()
        )
    }

    /// One launch: the `Kb` product per head plus one extra column of blocks that ropes `q_pe`
    /// from the device positions. Up to 8 tokens a GEMV (BF16 weight rows in registers, tokens
    /// staged in shared memory); more, bf16 tensor-core tiles with x split into two bf16 parts
    /// (f32-class products, see `head_gemv`).
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let n = inputs[2].meta.shape[0];
        let (qk, w, nh) = (
            self.qk_nope + self.qk_rope,
            self.kv_lora + self.qk_rope,
            self.n_head,
        );
        head_gemv(
            ctx,
            self.name(),
            self.kernel,
            &HeadGemv {
                w: &inputs[1],
                n_head: nh,
                n_out: self.kv_lora,
                n_in: self.qk_nope,
                x: inputs[0].ptr,
                x_tok: nh * qk,
                x_head: qk,
                y: outputs[0].ptr,
                y_tok: nh * w,
                y_head: w,
                n_tok: n,
                rope: Some(HeadRope {
                    positions: inputs[2].ptr,
                    n_rot: self.qk_rope,
                    src: self.qk_nope,
                    dst: self.kv_lora,
                    k: self.rope.consts(),
                }),
            },
        )
    }
}

pub(crate) const MLA_CU: &str = include_str!("../kernels/mla.cu");

/// Weight segments of 8 BF16 values one lane of `head_gemv_bf16` holds (`HG_SEGS` there).
const HG_SEGS: usize = 4;
/// The most tokens the per-head GEMV (`head_gemv_bf16`) stages at once.
pub const HEAD_GEMV_ROWS_LIMIT: usize = 8;

/// How the per-head products of [`MlaQuery`] and [`MlaValueOut`] run on the GPU (chosen by the
/// graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HeadKernel {
    #[default]
    Unlowered,
    /// Weight rows in registers, one group of lanes a row, at most [`HEAD_GEMV_ROWS_LIMIT`]
    /// tokens: f32 products.
    Gemv,
    /// The bf16 tensor-core `head_mma_bf16_*` tiles with x split into two bf16 parts.
    TensorCore,
}

impl HeadKernel {
    fn label(self) -> &'static str {
        match self {
            HeadKernel::Unlowered => "",
            HeadKernel::Gemv => " [gemv]",
            HeadKernel::TensorCore => " [tensor cores]",
        }
    }
}
/// `head_mma`'s k slice and pipeline depth (`HT_BK`, `HT_STAGES` in mla.cu), and its shared
/// memory rows' padding in elements.
const HT_BK: usize = 32;
const HT_STAGES: usize = 3;
const HT_PAD: usize = 8;
/// Tokens beyond which `head_mma` takes its 128-token tile.
const HT_LARGE_TILE_FROM: usize = 512;
/// `head_mma` blocks resident on an SM (its `__launch_bounds__`; shared memory allows it).
const HT_BLOCKS_PER_SM: usize = 2;

/// The rope part of a [`head_gemv`] launch.
struct HeadRope {
    positions: u64,
    n_rot: usize,
    /// Offset of the pairs in each (token, head) input row, and of their output.
    src: usize,
    dst: usize,
    k: RopeConsts,
}

/// `y[t][h][o] = Σ_i W[h][o][i]·x[t][h][i]` with `x` and `y` addressed by strides (in f32
/// elements) per token and per head.
struct HeadGemv<'a> {
    w: &'a DeviceTensor<'a>,
    n_head: usize,
    n_out: usize,
    n_in: usize,
    x: u64,
    x_tok: usize,
    x_head: usize,
    y: u64,
    y_tok: usize,
    y_head: usize,
    n_tok: usize,
    rope: Option<HeadRope>,
}

fn head_gemv(
    ctx: &GpuCtx,
    op: &'static str,
    kernel: HeadKernel,
    a: &HeadGemv<'_>,
) -> Result<(), OpError> {
    if a.n_tok == 0 {
        return Ok(());
    }
    let tiles = match kernel {
        HeadKernel::Unlowered => return Err(crate::linear::unlowered(op)),
        HeadKernel::Gemv if a.n_tok > HEAD_GEMV_ROWS_LIMIT => {
            return Err(OpError::shape(
                op,
                format!(
                    "the per-head GEMV takes at most {HEAD_GEMV_ROWS_LIMIT} tokens, found {}",
                    a.n_tok
                ),
            ));
        }
        HeadKernel::Gemv => false,
        HeadKernel::TensorCore => true,
    };
    if a.w.meta.dtype != DType::BF16 {
        return Err(OpError::shape(
            op,
            format!(
                "the CUDA kernel reads the per-head weight as BF16, found {}",
                a.w.meta
            ),
        ));
    }
    let nseg = a.n_in / 8;
    if !a.n_in.is_multiple_of(8) || nseg > 32 * HG_SEGS {
        return Err(OpError::shape(
            op,
            format!(
                "the CUDA kernel needs a per-head input width that is a multiple of 8 and at \
                 most {}, found {}",
                8 * 32 * HG_SEGS,
                a.n_in
            ),
        ));
    }
    aligned16(op, "the per-head weight", a.w)?;
    if a.n_head > 65535 {
        return Err(OpError::shape(
            op,
            format!("{} heads exceed a grid dimension", a.n_head),
        ));
    }
    let (pos, rope_n, src, dst, k) = match &a.rope {
        Some(r) => (r.positions, r.n_rot, r.src, r.dst, r.k),
        None => (
            0,
            0,
            0,
            0,
            RopeConsts {
                theta_scale: 0.0,
                freq_scale: 0.0,
                ext_factor: 0.0,
                corr: [0.0; 2],
                mscale: 0.0,
            },
        ),
    };
    let i = |what, v| as_i32(op, what, v);
    let rope_col = usize::from(rope_n > 0);
    if tiles {
        // Tile (tokens, outputs), the larger one where there are enough tokens to fill the
        // card (on the H200 64x128 is faster up to 256 tokens, 128x128 from 1024; at 512
        // they are within 10%).
        let (name, bm, bn) = if a.n_tok > HT_LARGE_TILE_FROM {
            ("head_mma_bf16_128x128", 128, 128)
        } else {
            ("head_mma_bf16_64x128", 64, 128)
        };
        let col_tiles = a.n_out.div_ceil(bn);
        let tok_tiles = a.n_tok.div_ceil(bm);
        if tok_tiles > 65535 {
            return Err(OpError::shape(
                op,
                format!("{} tokens exceed the grid", a.n_tok),
            ));
        }
        // Each block runs a group of column tiles in one pipeline: as few groups as still
        // make two waves of HT_BLOCKS_PER_SM blocks an SM (on the H200, 2 groups of the
        // query's 4 tiles from 512 tokens on beat 1 and 4 by 5-15%; every grouping gives
        // the same bits).
        let rows = a.n_head * tok_tiles;
        let slots = 2 * HT_BLOCKS_PER_SM * ctx.device.sm_count() as usize;
        let groups = slots.div_ceil(rows).clamp(1, col_tiles);
        let col_per_block = col_tiles.div_ceil(groups);
        let groups = col_tiles.div_ceil(col_per_block);
        let x_vec =
            a.x.is_multiple_of(16) && a.x_tok.is_multiple_of(4) && a.x_head.is_multiple_of(4);
        let y_vec =
            a.y.is_multiple_of(8) && a.y_tok.is_multiple_of(2) && a.y_head.is_multiple_of(2);
        let smem = HT_STAGES * (bm * (HT_BK + HT_PAD) * 4 + bn * (HT_BK + HT_PAD) * 2);
        let kern = ctx.kernel("mla.cu", MLA_CU, name)?;
        // SAFETY: argument list matches HEAD_MMA_KERNEL's; as for head_gemv_bf16 below (the
        // 16-byte copies and 8-byte stores only where x_vec / y_vec say they are aligned).
        return unsafe {
            ctx.device
                .launch(&kern)
                .grid((
                    i("column groups", groups + rope_col)? as u32,
                    a.n_head as u32,
                    tok_tiles as u32,
                ))
                .block(256)
                .shared_mem(smem as u32)
                .arg(a.w.ptr)
                .arg(a.x)
                .arg(a.x_tok as i64)
                .arg(a.x_head as i64)
                .arg(a.y)
                .arg(a.y_tok as i64)
                .arg(a.y_head as i64)
                .arg(i("tokens", a.n_tok)?)
                .arg(i("rows", a.n_out)?)
                .arg(i("input width", a.n_in)?)
                .arg(col_tiles as i32)
                .arg(col_per_block as i32)
                .arg(i32::from(x_vec))
                .arg(i32::from(y_vec))
                .arg(pos)
                .arg(i("rope width", rope_n)?)
                .arg(i("rope source", src)?)
                .arg(i("rope destination", dst)?)
                .arg(k.theta_scale)
                .arg(k.freq_scale)
                .arg(k.ext_factor)
                .arg(k.corr[0])
                .arg(k.corr[1])
                .arg(k.mscale)
                .enqueue()
                .map_err(dev_err)
        };
    }
    // A group of `lpr` lanes owns a row: as many as its 16-byte segments, up to a warp; one
    // row per group, so a decode token's 4 MB weight is spread over many blocks.
    let lpr = nseg.next_power_of_two().min(32);
    let groups = 32 / lpr;
    let passes = 1;
    let row_blocks = a.n_out.div_ceil(passes * 8 * groups);
    let tok_tile = (8192 / a.n_in).clamp(1, a.n_tok);
    let grid_x = row_blocks + rope_col;
    let kern = ctx.kernel("mla.cu", MLA_CU, "head_gemv_bf16")?;
    // SAFETY: argument list matches head_gemv_bf16; the shape rule (checked by the caller)
    // makes every strided access fall inside the views, whose sizes check_device verified.
    unsafe {
        ctx.device
            .launch(&kern)
            .grid((as_i32(op, "row blocks", grid_x)? as u32, a.n_head as u32))
            .block(256)
            .shared_mem((tok_tile * a.n_in * 4) as u32)
            .arg(a.w.ptr)
            .arg(a.x)
            .arg(a.x_tok as i64)
            .arg(a.x_head as i64)
            .arg(a.y)
            .arg(a.y_tok as i64)
            .arg(a.y_head as i64)
            .arg(i("tokens", a.n_tok)?)
            .arg(i("rows", a.n_out)?)
            .arg(i("input width", a.n_in)?)
            .arg(lpr.trailing_zeros() as i32)
            .arg(passes as i32)
            .arg(row_blocks as i32)
            .arg(tok_tile as i32)
            .arg(pos)
            .arg(i("rope width", rope_n)?)
            .arg(i("rope source", src)?)
            .arg(i("rope destination", dst)?)
            .arg(k.theta_scale)
            .arg(k.freq_scale)
            .arg(k.ext_factor)
            .arg(k.corr[0])
            .arg(k.corr[1])
            .arg(k.mscale)
            .enqueue()
            .map_err(dev_err)
    }
}

// ---- MlaKv ---------------------------------------------------------------------------

/// The cache row of each token: `rms(kv[..kv_lora]; w, eps) ‖ rope(kv[kv_lora..], pos)`.
/// The rope part is not normalised.
///
/// Inputs: kv F32 `[n, kv_lora+qk_rope]`, norm_w F32 `[kv_lora]`, positions I32 `[n]`.
/// Output: F32 `[n, kv_lora+qk_rope]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaKv {
    pub kv_lora: usize,
    pub qk_rope: usize,
    pub eps: f32,
    pub rope: RopeParams,
}

impl MlaKv {
    /// Slice-level form of the op.
    pub fn compute(
        &self,
        kv: &[f32],
        norm_w: &[f32],
        positions: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let w = self.kv_lora + self.qk_rope;
        if kv.len() < n * w || out.len() < n * w || norm_w.len() < self.kv_lora {
            return Err(OpError::Type(format!(
                "mla_kv buffers too small for {n} tokens: kv {}, norm_w {}, out {}",
                kv.len(),
                norm_w.len(),
                out.len()
            )));
        }
        out[..n * w]
            .par_chunks_mut(w)
            .zip(kv[..n * w].par_chunks(w))
            .zip(positions.par_iter())
            .for_each(|((dst, src), &pos)| {
                let (dl, dr) = dst.split_at_mut(self.kv_lora);
                let (sl, sr) = src.split_at(self.kv_lora);
                // As ggml's rms_norm: squares in f32, their sum in f64, the scale in f32.
                let sum: f64 = sl.iter().map(|&x| (x * x) as f64).sum();
                let mean = (sum / self.kv_lora as f64) as f32;
                let scale = 1.0 / (mean + self.eps).sqrt();
                for ((d, &x), &g) in dl.iter_mut().zip(sl).zip(norm_w) {
                    *d = (x * scale) * g;
                }
                dr.copy_from_slice(sr);
                let mut cache = vec![0f32; self.rope.n_rot];
                self.rope.cos_sin(pos, &mut cache);
                rope_norm_cached(dr, &cache);
            });
        Ok(())
    }
}

impl Op for MlaKv {
    fn name(&self) -> &'static str {
        "mla_kv"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("kv_lora", self.kv_lora), ("qk_rope", self.qk_rope)])?;
        if self.rope.n_rot != self.qk_rope || !self.qk_rope.is_multiple_of(2) {
            return Err(OpError::shape(
                op,
                format!(
                    "rope n_rot {} must equal qk_rope {} and be even",
                    self.rope.n_rot, self.qk_rope
                ),
            ));
        }
        expect_inputs(op, inputs, 3)?;
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        let w = self.kv_lora + self.qk_rope;
        expect(op, "kv", inputs[0], DType::F32, &[n, w])?;
        expect(op, "norm_w", inputs[1], DType::F32, &[self.kv_lora])?;
        Ok(vec![TensorMeta::f32([n, w])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let kv = inputs[0].f32()?;
        let w = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        self.compute(kv, w, pos, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_kv kv_lora={} qk_rope={} eps={:?} {}",
            self.kv_lora, self.qk_rope, self.eps, self.rope
        )
    }

    /// One block a token: the f64 sum of squares, then the scaled latent and the roped key.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[2].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        // SAFETY: check_device verified kv (n×W), norm_w, positions and the n×W output.
        unsafe {
            self.launch(
                ctx,
                op,
                [inputs[0].ptr, inputs[1].ptr, inputs[2].ptr],
                outputs[0].ptr,
                n,
                None,
            )
        }
    }
}

impl MlaKv {
    /// The `mla_kv` kernel over `[kv, norm_w, positions]` of n tokens: rows to `out[t]`, or with
    /// `cache_rows` to `out[positions[t]]` of a cache of that many rows (skipping positions
    /// outside it and all but the last token naming a row).
    ///
    /// # Safety
    /// The buffers hold what [`MlaKv::infer`] describes for n tokens; `out` holds n rows, or
    /// `cache_rows` rows, of `kv_lora + qk_rope` f32.
    unsafe fn launch(
        &self,
        ctx: &GpuCtx,
        op: &'static str,
        [kv, norm_w, positions]: [u64; 3],
        out: u64,
        n: usize,
        cache_rows: Option<usize>,
    ) -> Result<(), OpError> {
        let k = self.rope.consts();
        let kern = ctx.kernel("mla.cu", MLA_CU, "mla_kv")?;
        // SAFETY: argument list matches mla_kv; the caller vouches for the buffers.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(as_i32(op, "tokens", n)? as u32)
                .block(256)
                .arg(kv)
                .arg(norm_w)
                .arg(positions)
                .arg(out)
                .arg(as_i32(op, "kv_lora", self.kv_lora)?)
                .arg(as_i32(op, "qk_rope", self.qk_rope)?)
                .arg(self.eps)
                .arg(k.theta_scale)
                .arg(k.freq_scale)
                .arg(k.ext_factor)
                .arg(k.corr[0])
                .arg(k.corr[1])
                .arg(k.mscale)
                .arg(i32::from(cache_rows.is_some()))
                .arg(n as i32)
                .arg(as_i32(op, "cache rows", cache_rows.unwrap_or(0))?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

/// [`MlaKv`] straight into the cache ([`KvCacheWrite`] of its rows): the cache row of each
/// token is formed where it is stored, so a step has one launch and no `[n, W]` intermediate
/// for it. Same rows, same bits, same rules (a later token wins a shared position).
///
/// Inputs: cache F32 `[ctx, W]` (aliased by output 0), then kv, norm_w, positions as
/// [`MlaKv`]. Output: the cache.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaKvCacheWrite {
    pub kv: MlaKv,
}

impl Op for MlaKvCacheWrite {
    fn name(&self) -> &'static str {
        "mla_kv_cache_write"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 4)?;
        let rows = self.kv.infer(&inputs[1..])?;
        KvCacheWrite.infer(&[inputs[0], &rows[0], inputs[3]])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let pos = inputs[3].i32()?;
        let mut rows = vec![0f32; pos.len() * (self.kv.kv_lora + self.kv.qk_rope)];
        self.kv
            .compute(inputs[1].f32()?, inputs[2].f32()?, pos, &mut rows)?;
        let w = outputs[0].meta.inner();
        KvCacheWrite::compute(outputs[0].f32_mut()?, w, &rows, pos)
    }

    fn describe(&self) -> String {
        format!("{} into the cache", self.kv.describe())
    }

    /// `mla_kv`'s kernel with the cache as its output: one block a token writes its row at
    /// its position.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[3].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        let rows = outputs[0].meta.shape[0];
        let ins = [inputs[1].ptr, inputs[2].ptr, inputs[3].ptr];
        // SAFETY: check_device verified the token inputs and the rows×W cache.
        unsafe { self.kv.launch(ctx, op, ins, outputs[0].ptr, n, Some(rows)) }
    }

    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

// ---- KvCacheWrite --------------------------------------------------------------------

/// Writes `cache[positions[i]] = k[i]` in place.
///
/// Inputs: cache F32 `[ctx, W]` (persistent; aliased by output 0), k F32 `[n, W]`,
/// positions I32 `[n]`. Output: the cache. A position outside `[0, ctx)` is an
/// `OpError::Data` and nothing is written.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct KvCacheWrite;

impl KvCacheWrite {
    /// Slice-level form: `cache` is `ctx × w`.
    pub fn compute(
        cache: &mut [f32],
        w: usize,
        k: &[f32],
        positions: &[i32],
    ) -> Result<(), OpError> {
        let ctx = cache.len().checked_div(w).unwrap_or(0);
        check_positions("kv_cache_write", positions, ctx)?;
        if k.len() < positions.len() * w {
            return Err(OpError::Type(format!(
                "kv_cache_write: k has {} values, {} rows of {w} needed",
                k.len(),
                positions.len()
            )));
        }
        for (i, &p) in positions.iter().enumerate() {
            let p = p as usize;
            cache[p * w..(p + 1) * w].copy_from_slice(&k[i * w..(i + 1) * w]);
        }
        Ok(())
    }
}

impl Op for KvCacheWrite {
    fn name(&self) -> &'static str {
        "kv_cache_write"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 3)?;
        let cache = inputs[0];
        if cache.dtype != DType::F32 || cache.shape.len() != 2 || cache.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("cache must be F32[ctx, W] with W > 0, found {cache}"),
            ));
        }
        let w = cache.shape[1];
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        expect(op, "k", inputs[1], DType::F32, &[n, w])?;
        Ok(vec![cache.clone()])
    }

    /// Reads only inputs 1 and 2: input 0 is the same storage as the output.
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let w = outputs[0].meta.inner();
        let k = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        Self::compute(outputs[0].f32_mut()?, w, k, pos)
    }

    fn describe(&self) -> String {
        "kv_cache_write".to_string()
    }

    /// One block a token. The kernel skips a position outside the cache instead of
    /// failing (it cannot report); the engine refuses such positions on the host.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[2].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        let (rows, w) = (outputs[0].meta.shape[0], outputs[0].meta.shape[1]);
        let kern = ctx.kernel("mla.cu", MLA_CU, "kv_cache_write")?;
        // SAFETY: argument list matches kv_cache_write; the kernel writes only rows in [0, rows).
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(as_i32(op, "tokens", n)? as u32)
                .block(256)
                .arg(outputs[0].ptr)
                .arg(inputs[1].ptr)
                .arg(inputs[2].ptr)
                .arg(n as i32)
                .arg(as_i32(op, "W", w)?)
                .arg(as_i32(op, "cache rows", rows)?)
                .enqueue()
                .map_err(dev_err)
        }
    }

    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

// ---- MlaAttention --------------------------------------------------------------------

/// Causal attention of every head over the shared latent cache.
///
/// Inputs: Q F32 `[n, n_head, W]`, cache F32 `[ctx, W]`, positions I32 `[n]`.
/// Output: o_lat F32 `[n, n_head, kv_lora]`. Query `i` reads rows `0..=positions[i]`; rows
/// past it are never read, so `ctx` may be any bucket larger than the last position.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaAttention {
    pub n_head: usize,
    pub kv_lora: usize,
    pub kq_scale: f32,
    pub kernel: AttentionPath,
}

/// Which attention kernel runs on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionPath {
    #[default]
    Unlowered,
    /// Split-K flash attention with f32-class corrections: each token's rows in chunks over the
    /// chip, then a combine (decode and short chunks).
    SplitK,
    /// The f16 tensor-core flash kernel of [`crate::mla_prefill`] (long prefill chunks; needs
    /// a rope width of 64 and `kv_lora` a multiple of 64 up to 512, see
    /// [`MlaAttention::flash_supports`]).
    Flash,
}

impl AttentionPath {
    fn label(self) -> &'static str {
        match self {
            AttentionPath::Unlowered => "",
            AttentionPath::SplitK => " [split-k]",
            AttentionPath::Flash => " [flash f16]",
        }
    }
}

impl MlaAttention {
    /// Slice-level form: `q` is `n × n_head × w`, `cache` is `ctx × w`, `out` is
    /// `n × n_head × kv_lora`, with `w = cache.len() / ctx`.
    pub fn compute(
        &self,
        q: &[f32],
        cache: &[f32],
        w: usize,
        positions: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let (nh, lora) = (self.n_head, self.kv_lora);
        if w < lora || lora == 0 || q.len() < n * nh * w || out.len() < n * nh * lora {
            return Err(OpError::Type(format!(
                "mla_attention buffers do not fit {n} tokens × {nh} heads of width {w} \
                 (kv_lora {lora}): q {}, out {}",
                q.len(),
                out.len()
            )));
        }
        let ctx = cache.len() / w;
        check_positions("mla_attention", positions, ctx)?;
        out[..n * nh * lora]
            .par_chunks_mut(lora)
            .enumerate()
            .for_each(|(ih, o)| {
                let qv = &q[ih * w..(ih + 1) * w];
                let rows = positions[ih / nh] as usize + 1;
                let mut p: Vec<f32> = cache[..rows * w]
                    .chunks_exact(w)
                    .map(|k| self.kq_scale * dot(qv, k))
                    .collect();
                let max = p.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                // The denominator is summed in f64, as ggml's soft_max does: at long contexts
                // a sequential f32 sum of ~1e5 terms would drift by far more than f32 rounding.
                let mut sum = 0f64;
                for s in p.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s as f64;
                }
                let inv = (1.0 / sum) as f32;
                o.fill(0.0);
                for (pt, k) in p.iter().zip(cache.chunks_exact(w)) {
                    let pt = pt * inv;
                    for (a, &v) in o.iter_mut().zip(&k[..lora]) {
                        *a += pt * v;
                    }
                }
            });
        Ok(())
    }
}

impl Op for MlaAttention {
    fn name(&self) -> &'static str {
        "mla_attention"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_head", self.n_head), ("kv_lora", self.kv_lora)])?;
        expect_inputs(op, inputs, 3)?;
        let cache = inputs[1];
        if cache.dtype != DType::F32 || cache.shape.len() != 2 || cache.shape[1] < self.kv_lora {
            return Err(OpError::shape(
                op,
                format!(
                    "cache must be F32[ctx, W] with W >= kv_lora {}, found {cache}",
                    self.kv_lora
                ),
            ));
        }
        let w = cache.shape[1];
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        expect(op, "Q", inputs[0], DType::F32, &[n, self.n_head, w])?;
        Ok(vec![TensorMeta::f32([n, self.n_head, self.kv_lora])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let w = inputs[1].meta.inner();
        let q = inputs[0].f32()?;
        let cache = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        self.compute(q, cache, w, pos, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_attention n_head={} kv_lora={} kq_scale={:?}{}",
            self.n_head,
            self.kv_lora,
            self.kq_scale,
            self.kernel.label()
        )
    }

    /// [`AttentionPath::Flash`]: the f16 tensor-core flash kernel of [`crate::mla_prefill`].
    /// [`AttentionPath::SplitK`]: split-K flash attention on the tensor cores with
    /// f32-class corrections (`mla_attn_split_t*`, then `mla_attn_combine` when a token's rows
    /// are split over several chunks); see [`attention_chunks`] for the split and
    /// [`attention_tile`] for the tile. A position at or past the cache end (which the CPU
    /// reference and the engine refuse) gets zeros from the prefill kernel and all rows from
    /// the split kernel.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        let rows = inputs
            .get(1)
            .map_or(0, |c| c.meta.shape.first().copied().unwrap_or(0));
        let n = inputs
            .get(2)
            .map_or(0, |p| p.meta.shape.first().copied().unwrap_or(0));
        let w = inputs
            .get(1)
            .map_or(0, |c| c.meta.shape.get(1).copied().unwrap_or(0));
        let flash = match self.kernel {
            AttentionPath::Unlowered => return Err(crate::linear::unlowered(self.name())),
            AttentionPath::SplitK => false,
            AttentionPath::Flash if !self.flash_supports(w) => {
                return Err(OpError::shape(
                    self.name(),
                    format!(
                        "the flash kernel needs rows of kv_lora + 64 with kv_lora a multiple \
                         of 64 up to 512, found rows of {w} with kv_lora {}",
                        self.kv_lora
                    ),
                ));
            }
            AttentionPath::Flash => true,
        };
        if flash {
            check_device(self, inputs, outputs)?;
            let need = mla_prefill_scratch_bytes(rows, w);
            scratch.require("mla_attention", need)?;
            // SAFETY: check_device checked q (n×heads×W), the cache (rows×W), positions (n)
            // and out (n×heads×kv_lora); the scratch holds the f16 copy of the cache.
            return unsafe {
                launch_mla_prefill(
                    ctx,
                    inputs[0].ptr,
                    inputs[1].ptr,
                    inputs[2].ptr,
                    outputs[0].ptr,
                    n,
                    self.n_head,
                    w,
                    self.kv_lora,
                    rows,
                    self.kq_scale,
                    scratch,
                )
            };
        }
        let kernel = AttentionKernel {
            tile: attention_tile(n, rows, self.n_head),
            bf16_corrections: ATT_BF16_CORRECTIONS,
        };
        self.cuda_with(ctx, inputs, outputs, scratch, kernel)
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (inputs.get(1), inputs.get(2)) {
            (Some(cache), Some(pos)) => {
                let (n, rows) = (
                    pos.shape.first().copied().unwrap_or(0),
                    cache.shape.first().copied().unwrap_or(0),
                );
                let w = cache.shape.get(1).copied().unwrap_or(0);
                let split = attention_scratch(n, rows, self.n_head, self.kv_lora);
                if self.kernel == AttentionPath::Flash && self.flash_supports(w) {
                    split.max(mla_prefill_scratch_bytes(rows, w))
                } else {
                    split
                }
            }
            _ => 0,
        }
    }
}

impl MlaAttention {
    /// Whether the flash kernel takes cache rows of width `w`.
    pub fn flash_supports(&self, w: usize) -> bool {
        w == self.kv_lora + 64 && self.kv_lora.is_multiple_of(64) && self.kv_lora <= 512
    }

    /// [`Op::cuda`] with the split kernel chosen by the caller, so tests can check and time
    /// every variant; the scratch is the same for all.
    #[doc(hidden)]
    pub fn cuda_with(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
        kernel: AttentionKernel,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (q, cache, pos, out) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let n = pos.meta.shape[0];
        let (rows, w) = (cache.meta.shape[0], cache.meta.shape[1]);
        let (nh, lora) = (self.n_head, self.kv_lora);
        if n == 0 {
            return Ok(());
        }
        if !w.is_multiple_of(4) || !lora.is_multiple_of(4) || w > ATT_MAX_W || lora > ATT_MAX_LORA {
            return Err(OpError::shape(
                op,
                format!(
                    "the CUDA kernel needs W (found {w}) and kv_lora (found {lora}) to be \
                     multiples of 4, at most {ATT_MAX_W} and {ATT_MAX_LORA}"
                ),
            ));
        }
        let tile = kernel.tile;
        let name = match (tile, kernel.bf16_corrections) {
            (16, false) => "mla_attn_split_t16",
            (32, false) => "mla_attn_split_t32",
            (16, true) => "mla_attn_split_t16_bf",
            (32, true) => "mla_attn_split_t32_bf",
            _ => {
                return Err(OpError::shape(
                    op,
                    format!("the CUDA kernel has tiles of 16 or 32 rows, not {tile}"),
                ));
            }
        };
        for (what, t) in [("Q", q), ("cache", cache), ("o_lat", out)] {
            aligned16(op, what, t)?;
        }
        let groups = nh.div_ceil(32);
        if n > 65535 || groups > 65535 {
            return Err(OpError::shape(
                op,
                format!("{n} tokens × {groups} head groups exceed the grid"),
            ));
        }
        let chunks = attention_chunks(n, rows, nh);
        if chunks > ATT_MAX_CHUNKS {
            return Err(OpError::shape(
                op,
                format!("{chunks} chunks exceed the merge kernel's {ATT_MAX_CHUNKS}"),
            ));
        }
        let need = attention_scratch(n, rows, nh, lora);
        if scratch.bytes < need || (need > 0 && !scratch.ptr.is_multiple_of(16)) {
            return Err(OpError::Type(format!(
                "{op}: scratch of {} bytes at {:#x}, {need} 16-byte aligned bytes needed",
                scratch.bytes, scratch.ptr
            )));
        }
        let part_o = scratch.ptr;
        let part_ml = scratch.ptr + (n * chunks * nh * lora * 4) as u64;
        let split = ctx.kernel("mla.cu", MLA_CU, name)?;
        let i = |what, v| as_i32(op, what, v);
        // SAFETY: argument list matches mla_attn_split_t*; rows read are clamped to the
        // cache, partials written only when chunks > 1, into the scratch checked above.
        unsafe {
            ctx.device
                .launch(&split)
                .grid((chunks as u32, n as u32, groups as u32))
                .block(256)
                .shared_mem(attention_smem(tile) as u32)
                .arg(q.ptr)
                .arg(cache.ptr)
                .arg(pos.ptr)
                .arg(out.ptr)
                .arg(part_o)
                .arg(part_ml)
                .arg(i("n_head", nh)?)
                .arg(w as i32)
                .arg(lora as i32)
                .arg(i("cache rows", rows)?)
                .arg(chunks as i32)
                .arg(self.kq_scale)
                .enqueue()
                .map_err(dev_err)?;
        }
        if chunks == 1 {
            return Ok(());
        }
        let combine = ctx.kernel("mla.cu", MLA_CU, "mla_attn_combine")?;
        // SAFETY: argument list matches mla_attn_combine; it reads the partials the split
        // kernel wrote for the chunks the position makes valid (same tile, same division).
        unsafe {
            ctx.device
                .launch(&combine)
                .grid((blocks_for(lora, 128), nh as u32, n as u32))
                .block(256)
                .arg(part_o)
                .arg(part_ml)
                .arg(pos.ptr)
                .arg(out.ptr)
                .arg(nh as i32)
                .arg(lora as i32)
                .arg(rows as i32)
                .arg(chunks as i32)
                .arg(tile as i32)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

/// Widest cache row and latent the kernel covers (8 warps × 72 query dims / × 64 columns).
const ATT_MAX_W: usize = 576;
const ATT_MAX_LORA: usize = 512;
/// Shared-memory row stride of a staged key row (`ATT_WS` there): 576 floats + 8.
const ATT_WS: usize = 584;
/// Blocks the attention launch aims for: one per SM of an H200 (the kernel holds one block
/// an SM), so a single decode token still spreads over the whole chip.
const ATT_TARGET_BLOCKS: usize = 132;
/// Chunks `mla_attn_combine` merges at most (`ATT_MAX_CHUNKS` there: 17 a warp).
const ATT_MAX_CHUNKS: usize = 136;

/// Chunks each token's rows are split into. Fixed by the plan's shapes (tokens, cache rows,
/// heads), never by the position, so one captured graph serves a whole bucket: the kernel
/// divides rows `0..=pos` among the chunks at run time (whole tiles each) and chunks past the
/// end do nothing. Prefill (many tokens) gets one chunk a token and no combine.
pub fn attention_chunks(n: usize, rows: usize, n_head: usize) -> usize {
    let per_token = ATT_TARGET_BLOCKS.div_ceil(n.max(1) * n_head.div_ceil(32).max(1));
    per_token.clamp(1, rows.div_ceil(16).max(1))
}

/// Which `mla_attn_split` variant runs: its tile rows (16 or 32) and whether the two
/// correction products of the operand split are one BF16 mma (`true`) or two TF32 ones.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionKernel {
    pub tile: usize,
    pub bf16_corrections: bool,
}

/// The corrections in one BF16 mma: two tensor instructions per k-step instead of three,
/// at ~2^-20 instead of ~2^-21 relative error per product (H200: 38.0 vs 42.2 µs at 16448
/// rows; worst |Δ| against the CPU 1.5e-6 vs 7e-7 on values in [-1, 1]).
const ATT_BF16_CORRECTIONS: bool = true;

/// Key rows a tile of the split kernel stages: 32 once every position of the bucket (the
/// upper half of `rows`) fills whole 32-row chunks (fewer barriers and softmax passes a row),
/// 16 below, where a half-empty 32-row tile would cost a full one (H200, tile 16 vs 32:
/// 21.8 vs 20.9 µs at 4224 rows of an 8192 bucket, 12.5 vs 14.5 at 512 rows).
pub fn attention_tile(n: usize, rows: usize, n_head: usize) -> usize {
    let per_chunk = rows.div_ceil(attention_chunks(n, rows, n_head));
    if per_chunk >= 48 { 32 } else { 16 }
}

/// Dynamic shared memory of `mla_attn_split_t{tile}`: the key buffers (four of 16 rows or two
/// of 32), the 8 warps' score partials, the weights' A fragments (big and small) and the
/// per-head correction, max and sum.
fn attention_smem(tile: usize) -> usize {
    let bufs = if tile == 16 { 4 } else { 2 };
    (bufs * tile * ATT_WS + 8 * tile * 32 + 2 * tile * 32 + 3 * 32) * 4
}

/// Scratch for the chunk partials: `o[kv_lora]` then `(m, l)` per (token, chunk, head).
fn attention_scratch(n: usize, rows: usize, n_head: usize, kv_lora: usize) -> usize {
    let chunks = attention_chunks(n, rows, n_head);
    if chunks == 1 {
        0
    } else {
        n * chunks * n_head * (kv_lora + 2) * 4
    }
}

// ---- MlaValueOut ---------------------------------------------------------------------

/// `o[t][h] = Vb[h] · o_lat[t][h]`, heads concatenated.
///
/// Inputs: o_lat F32 `[n, n_head, kv_lora]`, v_b `[n_head, v_head, kv_lora]` (any weight type).
/// Output: F32 `[n, n_head·v_head]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlaValueOut {
    pub n_head: usize,
    pub kv_lora: usize,
    pub v_head: usize,
    pub kernel: HeadKernel,
}

impl MlaValueOut {
    /// Slice-level form of the op.
    pub fn compute(
        &self,
        o_lat: &[f32],
        v_b: &[u8],
        v_b_dtype: DType,
        n: usize,
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let (nh, lora, vh) = (self.n_head, self.kv_lora, self.v_head);
        if o_lat.len() < n * nh * lora || out.len() < n * nh * vh {
            return Err(OpError::Type(format!(
                "mla_value_out buffers too small for {n} tokens: o_lat {}, out {}",
                o_lat.len(),
                out.len()
            )));
        }
        let heads = per_head_matmul(v_b, v_b_dtype, nh, vh, lora, o_lat, lora, n)?;
        out[..n * nh * vh]
            .par_chunks_mut(nh * vh)
            .enumerate()
            .for_each(|(t, row)| {
                for (h, dst) in row.chunks_exact_mut(vh).enumerate() {
                    dst.copy_from_slice(&heads[h][t * vh..(t + 1) * vh]);
                }
            });
        Ok(())
    }
}

impl Op for MlaValueOut {
    fn name(&self) -> &'static str {
        "mla_value_out"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(
            op,
            &[
                ("n_head", self.n_head),
                ("kv_lora", self.kv_lora),
                ("v_head", self.v_head),
            ],
        )?;
        expect_inputs(op, inputs, 2)?;
        let n = inputs[0].shape.first().copied().unwrap_or(0);
        expect(
            op,
            "o_lat",
            inputs[0],
            DType::F32,
            &[n, self.n_head, self.kv_lora],
        )?;
        expect_weight(
            op,
            "v_b",
            inputs[1],
            &[self.n_head, self.v_head, self.kv_lora],
        )?;
        Ok(vec![TensorMeta::f32([n, self.n_head * self.v_head])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let n = inputs[0].meta.shape[0];
        let o_lat = inputs[0].f32()?;
        let v_b = weight_bytes(&inputs[1])?;
        self.compute(o_lat, v_b, inputs[1].meta.dtype, n, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_value_out n_head={} kv_lora={} v_head={}{}",
            self.n_head,
            self.kv_lora,
            self.v_head,
            self.kernel.label()
        )
    }

    /// The same per-head BF16 product as `MlaQuery`'s, without the rope.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (nh, lora, vh) = (self.n_head, self.kv_lora, self.v_head);
        head_gemv(
            ctx,
            self.name(),
            self.kernel,
            &HeadGemv {
                w: &inputs[1],
                n_head: nh,
                n_out: vh,
                n_in: lora,
                x: inputs[0].ptr,
                x_tok: nh * lora,
                x_head: lora,
                y: outputs[0].ptr,
                y_tok: nh * vh,
                y_head: vh,
                n_tok: inputs[0].meta.shape[0],
                rope: None,
            },
        )
    }
}
