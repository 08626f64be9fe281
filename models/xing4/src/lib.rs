//! Xing4.0 (`xing4_0`): the DeepSeek-V2 trunk with four residual streams mixed by
//! manifold-constrained hyper-connections (spec §3). Reads like the spec's §3.0:
//!
//! ```text
//! H = repeat(E[token], 4)
//! per layer: x, post, C = hc_pre(H); H = hc_post(attn(rms(x)), H, post, C)
//!            x, post, C = hc_pre(H); H = hc_post(ffn(rms(x)),  H, post, C)
//!
//! Each hc_post is declared together with the hc_pre after it (and each hc_pre with its rms),
//! as one op: nothing else reads the values between them.
//! logits = W_out · rms(mean(H))
//! ```
//!
//! Declarations only: no kernels, no loops over data.

use deepseek2::Trunk;
use graph::{GraphBuilder, GraphError, ModelDecl, StepShape, ValueId};
use loader::hparams::HParams;
use ops::hc::{HcExpand, HcPost, HcPostPreNorm, HcPre, HcPreNorm, StreamMean};

/// Spec §1.2: the comb-logit clamp comes from config.json; ±30 when it is absent.
pub const DEFAULT_COMB_CLAMP: f32 = 30.0;

#[derive(Clone, Debug)]
pub struct Xing4 {
    pub trunk: Trunk,
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub clamp: f32,
}

impl Xing4 {
    /// `None` when the header has no hyper-connection keys (not a xing4_0 file).
    pub fn new(h: HParams, clamp: f32) -> Option<Self> {
        let hc = h.hc?;
        Some(Xing4 {
            trunk: Trunk::new(h),
            hc: hc.count,
            sinkhorn_iters: hc.sinkhorn_iters,
            hc_eps: hc.eps,
            clamp,
        })
    }

    /// A sub-layer's entry with HC set `set` (`hc_attn` / `hc_ffn`) and norm `norm`
    /// (`attn_norm` / `ffn_norm`): `x = rms(hc_pre(H))`, after first applying the previous
    /// sub-layer's exit `H = hc_post(y, H, post, comb)` when `exit` holds one. Updates `streams`
    /// and returns the normalised x, the post gates and the comb matrix. One op either way:
    /// the collapsed x and the exit's streams have no other reader before the next hc_pre.
    fn enter(
        &self,
        b: &mut GraphBuilder<'_>,
        layer: usize,
        (set, norm): (&str, &str),
        streams: &mut ValueId,
        exit: Option<[ValueId; 3]>,
    ) -> Result<[ValueId; 3], GraphError> {
        let f = b.weight(&format!("blk.{layer}.{set}_fn.weight"))?;
        let base = b.weight(&format!("blk.{layer}.{set}_base.weight"))?;
        let scale = b.weight(&format!("blk.{layer}.{set}_scale.weight"))?;
        let w_norm = b.weight(&format!("blk.{layer}.{norm}.weight"))?;
        let pre_norm = HcPreNorm {
            pre: HcPre {
                hc: self.hc,
                sinkhorn_iters: self.sinkhorn_iters,
                rms_eps: self.trunk.h.rms_eps,
                hc_eps: self.hc_eps,
                clamp: self.clamp,
            },
            norm_eps: self.trunk.h.rms_eps,
        };
        let Some([y, post, comb]) = exit else {
            return b.opn(
                &format!("{set}_pre_{norm}"),
                pre_norm,
                &[*streams, f, base, scale, w_norm],
            );
        };
        let op = HcPostPreNorm {
            post: HcPost { hc: self.hc },
            pre_norm,
        };
        let [h, x, post, comb] = b.opn(
            &format!("hc_post_{set}_pre_{norm}"),
            op,
            &[y, *streams, post, comb, f, base, scale, w_norm],
        )?;
        *streams = h;
        Ok([x, post, comb])
    }
}

impl ModelDecl for Xing4 {
    fn arch(&self) -> &str {
        "xing4_0"
    }

    fn declare(&self, b: &mut GraphBuilder<'_>, shape: &StepShape) -> Result<(), GraphError> {
        let t = &self.trunk;
        let (tokens, positions) = t.inputs(b, shape);
        let e = t.embed(b, tokens)?;
        let mut streams = b.op1("hc_expand", HcExpand { hc: self.hc }, &[e])?;
        // The last sub-layer's exit (y, post, comb), applied by the next entry.
        let mut exit = None;
        for layer in 0..t.h.n_layer {
            exit = Some(b.scope(
                &format!("blk.{layer}"),
                |b| -> Result<[ValueId; 3], GraphError> {
                    let attn = ("hc_attn", "attn_norm");
                    let [a, post, comb] = self.enter(b, layer, attn, &mut streams, exit)?;
                    let y = t.attention(b, layer, a, positions, shape)?;

                    let ffn = ("hc_ffn", "ffn_norm");
                    let exit = Some([y, post, comb]);
                    let [z, post, comb] = self.enter(b, layer, ffn, &mut streams, exit)?;
                    let y = t.ffn(b, layer, z)?;
                    Ok([y, post, comb])
                },
            )?);
        }
        if let Some([y, post, comb]) = exit {
            let last = t.h.n_layer - 1;
            streams = b.op1(
                &format!("blk.{last}.hc_ffn_post"),
                HcPost { hc: self.hc },
                &[y, streams, post, comb],
            )?;
        }
        let h = b.op1("stream_mean", StreamMean { hc: self.hc }, &[streams])?;
        t.head(b, h, shape)?;
        Ok(())
    }

    fn n_vocab(&self) -> usize {
        self.trunk.h.n_vocab
    }

    fn state_bytes_per_position(&self) -> usize {
        self.trunk.h.n_layer * self.trunk.kv_width() * 4
    }
}
