//! CUDA launches of the hyper-connection ops.

use super::{
    HcExpand, HcPost, HcPostPreNorm, HcPre, HcPreKernel, HcPreNorm, HcRoutedPostPreNorm,
    ROWS_CHUNKS_PER_WARP_LIMIT, StreamMean, pre_dims, pre_segment, routed_y_offset,
};
use crate::check::{as_i32, unlowered};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::norm::launch_rms_norm;
use crate::op::check_device;
use crate::tensor::{DType, TensorMeta};
use crate::{Op, OpError};

/// hc.cu after the MoE's routed-sum element (the routed hc boundary forms the sum in place).
pub(crate) const HC_CU: &str = concat!(include_str!("../moe/topk.cuh"), include_str!("hc.cu"));

/// Suffix of the kernels specialised on the stream count (loops over streams unrolled,
/// so a thread's stream loads are in flight together); 0 is the run-time-hc variant.
pub(super) fn hc_variant(hc: usize) -> usize {
    if matches!(hc, 1 | 2 | 4) { hc } else { 0 }
}

/// Grid of a grid-stride element-wise kernel over `total` items.
pub(super) fn stride_grid(total: usize) -> u32 {
    blocks_for(total, 256).min(32768)
}

/// Threads of an `hc_pre_finish` block (its `__launch_bounds__`): a warp per mix total.
pub(super) const PRE_FINISH_THREADS: usize = 1024;

impl HcExpand {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let total = outputs[0].meta.numel();
        if total == 0 {
            return Ok(());
        }
        let k = ctx.kernel("hc.cu", HC_CU, "hc_expand")?;
        // SAFETY: hc_expand(x, out, hc, D, total); check_device checked x is n×D and out
        // n×hc×D f32 = total elements.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(stride_grid(total))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "hc", self.hc)?)
                .arg(as_i32(op, "D", inputs[0].meta.shape[1])?)
                .arg(total as i64)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl HcPre {
    /// Two launches: ~128 blocks each take a column segment of `fn` (and up to 8
    /// tokens) and write partial dots and sums of squares to scratch; then per token
    /// one block runs the gates and the Sinkhorn chain (one warp, fast reciprocal
    /// divisions) while another collapses D with 16-byte loads. Partials are summed in
    /// a fixed order (deterministic). The mixes are `(Σ fn·f)·r` rather than the
    /// reference's `Σ fn·(f·r)`, and the dot order differs, so this is the reference up
    /// to f32 rounding (not bit-identical).
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let [x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 3 outputs"));
        };
        // SAFETY: check_device checked every input and output against the op's shapes.
        unsafe {
            self.enqueue(
                ctx,
                inputs,
                [x.ptr, post.ptr, comb.ptr],
                scratch,
                None,
                None,
            )
        }
    }
}

/// hc_post's inputs for a fused boundary: y, H, post, comb, and optionally y formed in place
/// from the MoE's routes instead of read (y's pointer then unused).
#[derive(Clone, Copy, Debug)]
pub(super) struct PostInputs {
    pub ptrs: [u64; 4],
    pub routed: Option<RoutedY>,
}

/// The top-k sum's inputs (`topk_sum`'s order): route rows, route_slot, weights, addend (0 for
/// none), the route count and top_k.
#[derive(Clone, Copy, Debug)]
pub(super) struct RoutedY {
    pub rows: u64,
    pub route_slot: u64,
    pub weights: u64,
    pub addend: u64,
    pub n_routes: usize,
    pub top_k: usize,
}

/// How `HcPre::enqueue` runs its partial pass for a step.
struct PassChoice {
    /// Tokens a pair block takes.
    tb: usize,
    seg: usize,
    /// Whole aligned groups of 8 columns (16-byte loads).
    vec: bool,
    /// The tensor-core rows pass.
    rows: bool,
    /// The pair kernel (else the plain partial kernel), and its shared memory without and
    /// with hc_post's segment of H' (and a routed y's route table).
    pairs: bool,
    pair_smem: usize,
    fused_smem: usize,
}

impl HcPre {
    fn pass_choice(
        &self,
        n: usize,
        w: usize,
        k: usize,
        h: u64,
        f: &DeviceTensor<'_>,
        routed_top_k: usize,
    ) -> PassChoice {
        let tb = if n >= 8 { 8 } else { 1 };
        let vec = w.is_multiple_of(8) && f.ptr.is_multiple_of(16) && h.is_multiple_of(16);
        let seg = pre_segment(w);
        let pair_smem = tb * (k + 1) * (seg / 8) * 4;
        let fused_smem = pair_smem.next_multiple_of(16) + tb * seg * 4 + tb * routed_top_k * 4;
        let cpw = match self.kernel {
            HcPreKernel::Rows { chunks_per_warp } => {
                chunks_per_warp.clamp(1, ROWS_CHUNKS_PER_WARP_LIMIT)
            }
            _ => 0,
        };
        let rows = cpw > 0
            && self.rows_supports(w / self.hc, f.meta.dtype)
            && [h, f.ptr].iter().all(|p| p.is_multiple_of(16));
        PassChoice {
            tb,
            seg,
            vec,
            rows,
            pairs: vec && fused_smem <= 48 << 10,
            pair_smem,
            fused_smem,
        }
    }

    /// Whether hc_post with a routed y fuses into this step's partial pass (the pair kernel):
    /// otherwise the caller forms y first.
    pub(super) fn routed_post_fuses(
        &self,
        inputs: &[DeviceTensor<'_>],
        routed_top_k: usize,
    ) -> bool {
        let metas: Vec<&TensorMeta> = inputs.iter().take(4).map(|t| t.meta).collect();
        let Some((n, w, k, _)) = pre_dims(self, &metas) else {
            return false;
        };
        let c = self.pass_choice(n, w, k, inputs[0].ptr, &inputs[1], routed_top_k);
        !c.rows && c.pairs
    }
}

impl HcPre {
    /// The two launches of `hc_pre` over `inputs` (H, fn, base, scale), writing x, post and
    /// comb at `outs`. With `norm = Some((w, eps))` the collapse block also applies the
    /// sub-layer's RMSNorm to x (only when [`HcPre::norm_fuses`] said so).
    ///
    /// # Safety
    /// `inputs` must be checked against [`Op::infer`] and `outs` must address buffers of the
    /// inferred output sizes; `norm`'s weight must hold D f32.
    pub(super) unsafe fn enqueue(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outs: [u64; 3],
        scratch: Scratch,
        norm: Option<(u64, f32)>,
        post: Option<PostInputs>,
    ) -> Result<(), OpError> {
        let op = self.name();
        let metas: Vec<&TensorMeta> = inputs.iter().take(4).map(|t| t.meta).collect();
        let (n, w, k, splits) =
            pre_dims(self, &metas).ok_or_else(|| OpError::shape(op, "inputs refused"))?;
        if n == 0 {
            return Ok(());
        }
        let need = self.cuda_scratch_bytes(&metas);
        scratch.require("hc_pre", need)?;
        let (h, f) = (&inputs[0], &inputs[1]);
        let d = w / self.hc;
        let routed = post.and_then(|p| p.routed);
        // The pair kernel keeps every (mix, 8-column) product of its tokens in shared memory;
        // fused with hc_post, also the segment of H' it forms.
        let PassChoice {
            tb,
            seg,
            vec,
            rows,
            pairs,
            pair_smem,
            fused_smem,
        } = self.pass_choice(n, w, k, h.ptr, f, routed.map_or(0, |r| r.top_k));
        let cpw = match self.kernel {
            HcPreKernel::Unlowered => return Err(unlowered(op)),
            HcPreKernel::SplitK => 0,
            HcPreKernel::Rows { chunks_per_warp } => {
                chunks_per_warp.clamp(1, ROWS_CHUNKS_PER_WARP_LIMIT)
            }
        };
        let groups = n.div_ceil(tb);
        if groups > 65535 {
            return Err(OpError::shape(op, format!("{n} tokens in one launch")));
        }
        let fn_ty = if f.meta.dtype == DType::BF16 {
            "bf16"
        } else {
            "f32"
        };
        let part = scratch.ptr;
        let (wi, ki) = (as_i32(op, "hc·D", w)?, as_i32(op, "mixes", k)?);
        if routed.is_some() && (rows || !pairs) {
            return Err(OpError::shape(
                op,
                "a routed y fuses only into the pair kernel (the caller forms it otherwise)",
            ));
        }
        let mut post = post;
        if let Some(p) = post {
            let fuses = if rows {
                p.ptrs[..2].iter().all(|a| a.is_multiple_of(16))
            } else {
                pairs
            };
            if !fuses {
                // SAFETY: the caller's hc_post inputs and H' (inputs[0]) are n×… as checked.
                unsafe { launch_hc_post(ctx, self.hc, p.ptrs, h.ptr, n, d)? };
                post = None;
            }
        }
        if rows {
            let splits = (d / 32).div_ceil(8 * cpw);
            let tiles = n.div_ceil(16);
            if tiles > 65535 {
                return Err(OpError::shape(op, format!("{n} tokens in one launch")));
            }
            let (ni, di, ci) = (
                as_i32(op, "n", n)?,
                as_i32(op, "D", d)?,
                as_i32(op, "chunks", cpw)?,
            );
            let grid = (splits as u32, tiles as u32);
            // SAFETY: the row kernels read H (or hc_post's y, H, post, comb) for n tokens of
            // W = 4·D f32 and fn (24×W bf16), write H' (with hc_post) and part[n][25][splits],
            // splits ≤ pre_dims' count, inside the scratch checked above.
            unsafe {
                if let Some(PostInputs { ptrs: p, .. }) = post {
                    let kp = ctx.kernel("hc.cu", HC_CU, "hc_post_pre_rows")?;
                    ctx.device
                        .launch(&kp)
                        .grid(grid)
                        .block(256)
                        .arg(p[0])
                        .arg(p[1])
                        .arg(p[2])
                        .arg(p[3])
                        .arg(h.ptr)
                        .arg(f.ptr)
                        .arg(part)
                        .arg(ni)
                        .arg(di)
                        .arg(ci)
                        .enqueue()
                        .map_err(dev_err)?;
                } else {
                    let kp = ctx.kernel("hc.cu", HC_CU, "hc_pre_rows")?;
                    ctx.device
                        .launch(&kp)
                        .grid(grid)
                        .block(256)
                        .arg(h.ptr)
                        .arg(f.ptr)
                        .arg(part)
                        .arg(ni)
                        .arg(di)
                        .arg(ci)
                        .enqueue()
                        .map_err(dev_err)?;
                }
                return self.enqueue_finish(ctx, inputs, outs, scratch, norm, splits);
            }
        }
        if let Some(p) = post {
            // A routed y's kernel opens with the top-k sum's inputs instead of y.
            let name = if routed.is_some() {
                format!("hc_post_pre_pairs_routed_{fn_ty}_{tb}")
            } else {
                format!("hc_post_pre_pairs_{fn_ty}_{tb}")
            };
            let kp = ctx.kernel("hc.cu", HC_CU, &name)?;
            // SAFETY: the fused partial kernel reads y (or, routed, forms it from the caller's
            // route rows R×D, route_slot (range-checked in the kernel), weights n×top_k and
            // addend n×D or null), H, post, comb (the caller's hc_post inputs), writes H' (n×W)
            // at inputs[0] and part[n][K+1][splits] in scratch.
            unsafe {
                let l = ctx
                    .device
                    .launch(&kp)
                    .grid((splits as u32, groups as u32))
                    .block(256)
                    .shared_mem(fused_smem as u32);
                let l = match routed {
                    Some(r) => l
                        .arg(r.rows)
                        .arg(r.route_slot)
                        .arg(r.weights)
                        .arg(r.addend)
                        .arg(as_i32(op, "routes", r.n_routes)?)
                        .arg(as_i32(op, "top_k", r.top_k)?),
                    None => l.arg(p.ptrs[0]),
                };
                l.arg(p.ptrs[1])
                    .arg(p.ptrs[2])
                    .arg(p.ptrs[3])
                    .arg(h.ptr)
                    .arg(f.ptr)
                    .arg(part)
                    .arg(as_i32(op, "n", n)?)
                    .arg(wi)
                    .arg(ki)
                    .arg(as_i32(op, "segment", seg)?)
                    .arg(as_i32(op, "hc", self.hc)?)
                    .arg(as_i32(op, "D", d)?)
                    .enqueue()
                    .map_err(dev_err)?;
            }
            // SAFETY: as for the partial kernel below.
            return unsafe { self.enqueue_finish(ctx, inputs, outs, scratch, norm, splits) };
        }
        let (name, smem) = if vec && pair_smem <= 48 << 10 {
            (format!("hc_pre_pairs_{fn_ty}_{tb}"), pair_smem as u32)
        } else {
            let v = if vec { "vec" } else { "any" };
            (format!("hc_pre_partial_{fn_ty}_{v}_{tb}"), 0)
        };
        let kp = ctx.kernel("hc.cu", HC_CU, &name)?;
        // SAFETY: the partial kernel reads H (n×W f32) and fn (K×W) and writes
        // part[n][K+1][splits] inside the scratch checked above.
        unsafe {
            ctx.device
                .launch(&kp)
                .grid((splits as u32, groups as u32))
                .block(256)
                .shared_mem(smem)
                .arg(h.ptr)
                .arg(f.ptr)
                .arg(part)
                .arg(as_i32(op, "n", n)?)
                .arg(wi)
                .arg(ki)
                .arg(as_i32(op, "segment", seg)?)
                .enqueue()
                .map_err(dev_err)?;
        }
        // SAFETY: the partials are in scratch; the caller's contract covers the rest.
        unsafe { self.enqueue_finish(ctx, inputs, outs, scratch, norm, splits) }
    }

    /// The finishing launch of `hc_pre` (totals, gates, Sinkhorn, collapse and the optional
    /// fused norm), once the partials are in `scratch`.
    ///
    /// # Safety
    /// As [`HcPre::enqueue`], with the partial pass already enqueued.
    pub(super) unsafe fn enqueue_finish(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outs: [u64; 3],
        scratch: Scratch,
        norm: Option<(u64, f32)>,
        splits: usize,
    ) -> Result<(), OpError> {
        let op = self.name();
        let metas: Vec<&TensorMeta> = inputs.iter().take(4).map(|t| t.meta).collect();
        let (n, w, k, _) =
            pre_dims(self, &metas).ok_or_else(|| OpError::shape(op, "inputs refused"))?;
        let (h, d, part) = (&inputs[0], w / self.hc, scratch.ptr);
        let ki = as_i32(op, "mixes", k)?;
        // Four collapse columns per thread (one 16-byte load a stream), all in flight at once.
        let cb = d.div_ceil(4 * PRE_FINISH_THREADS).max(1);
        let smem = (k + 1 + self.hc * self.hc) * 4;
        if smem > 48 << 10 {
            return Err(OpError::shape(
                op,
                format!(
                    "hc = {}: the finishing kernel's {smem} bytes of totals exceed shared memory",
                    self.hc
                ),
            ));
        }
        let kf = ctx.kernel(
            "hc.cu",
            HC_CU,
            &format!("hc_pre_finish_{}", hc_variant(self.hc)),
        )?;
        let n32 = u32::try_from(n).map_err(|_| OpError::shape(op, format!("{n} tokens")))?;
        // SAFETY: hc_pre_finish reads the partials written above, base (K) and scale (3),
        // and writes x (n×D), post (n×hc) and comb (n×hc×hc), all checked by check_device.
        unsafe {
            ctx.device
                .launch(&kf)
                .grid((n32, (cb + 1) as u32))
                .block(PRE_FINISH_THREADS as u32)
                .shared_mem(smem as u32)
                .arg(h.ptr)
                .arg(part)
                .arg(inputs[2].ptr)
                .arg(inputs[3].ptr)
                .arg(outs[0])
                .arg(outs[1])
                .arg(outs[2])
                .arg(as_i32(op, "hc", self.hc)?)
                .arg(as_i32(op, "D", d)?)
                .arg(ki)
                .arg(as_i32(op, "splits", splits)?)
                .arg(self.rms_eps)
                .arg(self.hc_eps)
                .arg(self.clamp)
                .arg(as_i32(op, "iters", self.sinkhorn_iters)?)
                .arg(cb as i32)
                .arg(norm.map_or(0, |(w, _)| w))
                .arg(norm.map_or(0.0, |(_, eps)| eps))
                .enqueue()
                .map_err(dev_err)
        }
    }

    /// Whether the finishing kernel can apply the RMSNorm itself: one collapse block holding
    /// all of x, one float4 a thread, 16-byte aligned streams, output and weight.
    pub(super) fn norm_fuses(d: usize, ptrs: &[u64]) -> bool {
        d.is_multiple_of(4)
            && d / 4 <= PRE_FINISH_THREADS
            && ptrs.iter().all(|p| p.is_multiple_of(16))
    }
}

impl HcPreNorm {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let [x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 3 outputs"));
        };
        // SAFETY: check_device checked every input and output.
        unsafe { self.enqueue(ctx, inputs, [x.ptr, post.ptr, comb.ptr], scratch, None) }
    }
}

impl HcPreNorm {
    /// `inputs`: H (or, with `hc_post`, the H' it is to write), fn, base, scale, norm weight.
    ///
    /// # Safety
    /// `inputs` checked against [`Op::infer`], `outs` addressing the outputs' sizes, and
    /// `hc_post`'s y, H, post and comb (when given) of the shapes `HcPost` checks.
    pub(super) unsafe fn enqueue(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        [x, post, comb]: [u64; 3],
        scratch: Scratch,
        hc_post: Option<PostInputs>,
    ) -> Result<(), OpError> {
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[2]);
        if n == 0 {
            return Ok(());
        }
        let w = inputs[4].ptr;
        if HcPre::norm_fuses(d, &[inputs[0].ptr, x, w]) {
            // SAFETY: the caller's contract; w holds D f32.
            return unsafe {
                self.pre.enqueue(
                    ctx,
                    inputs,
                    [x, post, comb],
                    scratch,
                    Some((w, self.norm_eps)),
                    hc_post,
                )
            };
        }
        let metas: Vec<&TensorMeta> = inputs.iter().take(5).map(|t| t.meta).collect();
        let need = self.cuda_scratch_bytes(&metas);
        scratch.require("hc_pre_norm", need)?;
        let partials = self
            .pre
            .cuda_scratch_bytes(&metas[..4])
            .next_multiple_of(16);
        let collapsed = scratch.ptr + partials as u64;
        // SAFETY: as above; the collapsed x goes to the scratch past the partials (n·D f32,
        // checked against `need`), then the norm reads it into the output.
        unsafe {
            self.pre
                .enqueue(ctx, inputs, [collapsed, post, comb], scratch, None, hc_post)?;
            launch_rms_norm(ctx, collapsed, Some(w), x, n, d, self.norm_eps)
        }
    }
}

impl HcPostPreNorm {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let [streams, x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 4 outputs"));
        };
        let pre_inputs: Vec<DeviceTensor<'_>> = std::iter::once(*streams)
            .chain(inputs[4..].iter().copied())
            .collect();
        let hc_post = [inputs[0].ptr, inputs[1].ptr, inputs[2].ptr, inputs[3].ptr];
        // SAFETY: check_device checked all eight inputs and four outputs; H' is an output.
        unsafe {
            self.pre_norm.enqueue(
                ctx,
                &pre_inputs,
                [x.ptr, post.ptr, comb.ptr],
                scratch,
                Some(PostInputs {
                    ptrs: hc_post,
                    routed: None,
                }),
            )
        }
    }
}

impl HcRoutedPostPreNorm {
    /// One launch fewer than the top-k sum and the boundary: the pair kernel forms y itself.
    /// Where the step takes another pass, the top-k sum writes y into scratch first.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let [streams, x, post, comb] = outputs else {
            return Err(OpError::shape(op, "expects 4 outputs"));
        };
        let metas: Vec<&TensorMeta> = inputs.iter().map(|t| t.meta).collect();
        let y_meta = self.sum.infer(&metas[..4])?.remove(0);
        // The boundary's partial pass reads H' (the streams output) and fn, base, scale, norm.
        let pre_inputs: Vec<DeviceTensor<'_>> = std::iter::once(*streams)
            .chain(inputs[7..].iter().copied())
            .collect();
        let (h, post_w, comb_w) = (inputs[4].ptr, inputs[5].ptr, inputs[6].ptr);
        let pre_norm = &self.boundary.pre_norm;
        let outs = [x.ptr, post.ptr, comb.ptr];
        if pre_norm
            .pre
            .routed_post_fuses(&pre_inputs[..4], self.sum.top_k)
        {
            let routed = RoutedY {
                rows: inputs[0].ptr,
                route_slot: inputs[1].ptr,
                weights: inputs[2].ptr,
                addend: inputs[3].ptr,
                n_routes: inputs[0].meta.shape[0],
                top_k: self.sum.top_k,
            };
            // SAFETY: check_device checked all eleven inputs and four outputs; y is formed in
            // the kernel from the routes, so its pointer is not read.
            return unsafe {
                pre_norm.enqueue(
                    ctx,
                    &pre_inputs,
                    outs,
                    scratch,
                    Some(PostInputs {
                        ptrs: [0, h, post_w, comb_w],
                        routed: Some(routed),
                    }),
                )
            };
        }
        let mut boundary_metas = vec![&y_meta];
        boundary_metas.extend_from_slice(&metas[4..]);
        let at = routed_y_offset(&self.boundary, &boundary_metas);
        let y_bytes = y_meta.bytes().unwrap_or(0);
        let need = self.cuda_scratch_bytes(&metas);
        scratch.require(op, need)?;
        let y = DeviceTensor {
            meta: &y_meta,
            ptr: scratch.ptr + at as u64,
            bytes: y_bytes,
        };
        let past_y = at + y_bytes.next_multiple_of(256);
        self.sum.cuda(
            ctx,
            &inputs[..4],
            &[y],
            Scratch {
                ptr: scratch.ptr + past_y as u64,
                bytes: need - past_y,
            },
        )?;
        // SAFETY: as above, with y (n×D f32) in the scratch past the boundary's own.
        unsafe {
            pre_norm.enqueue(
                ctx,
                &pre_inputs,
                outs,
                Scratch {
                    ptr: scratch.ptr,
                    bytes: at,
                },
                Some(PostInputs {
                    ptrs: [y.ptr, h, post_w, comb_w],
                    routed: None,
                }),
            )
        }
    }
}

impl HcPost {
    /// One thread per (token, column) writing all hc destinations; bit-identical to
    /// the reference (separately rounded products and sums, in its order).
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        // SAFETY: check_device checked every view against the shape rule (y n×D, H and out
        // n×hc×D, post n×hc, comb n×hc×hc).
        unsafe {
            launch_hc_post(
                ctx,
                self.hc,
                [inputs[0].ptr, inputs[1].ptr, inputs[2].ptr, inputs[3].ptr],
                outputs[0].ptr,
                n,
                d,
            )
        }
    }
}

/// Enqueues `hc_post` over `[y, H, post, comb]` into `out` for n tokens of width D.
///
/// # Safety
/// The addresses must hold y n×D, H n×hc×D, post n×hc, comb n×hc×hc and out n×hc×D f32,
/// alive until the kernel has run.
pub(super) unsafe fn launch_hc_post(
    ctx: &GpuCtx,
    hc: usize,
    [y, h, post, comb]: [u64; 4],
    out: u64,
    n: usize,
    d: usize,
) -> Result<(), OpError> {
    let op = "hc_post";
    let total = n * d;
    if total == 0 {
        return Ok(());
    }
    let k = ctx.kernel("hc.cu", HC_CU, &format!("hc_post_{}", hc_variant(hc)))?;
    // SAFETY: hc_post(y, h, post, comb, out, hc, D, n·D) over the caller's buffers.
    unsafe {
        ctx.device
            .launch(&k)
            .grid(stride_grid(total))
            .block(256)
            .arg(y)
            .arg(h)
            .arg(post)
            .arg(comb)
            .arg(out)
            .arg(as_i32(op, "hc", hc)?)
            .arg(as_i32(op, "D", d)?)
            .arg(total as i64)
            .enqueue()
            .map_err(dev_err)
    }
}

impl StreamMean {
    /// Bit-identical to the reference: adds in stream order, then the 1/hc scale.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let total = outputs[0].meta.numel();
        if total == 0 {
            return Ok(());
        }
        let k = ctx.kernel(
            "hc.cu",
            HC_CU,
            &format!("stream_mean_{}", hc_variant(self.hc)),
        )?;
        // SAFETY: stream_mean(h, out, hc, D, n·D); check_device checked H is n×hc×D and
        // out n×D f32.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(stride_grid(total))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "hc", self.hc)?)
                .arg(as_i32(op, "D", inputs[0].meta.shape[2])?)
                .arg(total as i64)
                .enqueue()
                .map_err(dev_err)
        }
    }
}
