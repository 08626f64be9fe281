//! Xing4.0 (`xing4_0`): the DeepSeek-V2 trunk (`models/trunk`) with four residual streams mixed by
//! manifold-constrained hyper-connections (spec §3). Reads like the spec's §3.0:
//!
//! ```text
//! H = repeat(E[token], 4)
//! per layer: x, post, C = hc_pre(H); H = hc_post(attn(rms(x)), H, post, C)
//!            x, post, C = hc_pre(H); H = hc_post(ffn(rms(x)),  H, post, C)
//! logits = W_out · rms(mean(H))
//! ```
//!
//! Declarations only: no kernels, no loops over data, no fusions (the graph's lowering joins
//! each hc_post with the hc_pre and norm after it where a device gains from it).

mod tensors;

pub use tensors::tensors;

use graph::{GraphBuilder, GraphError, ModelDecl, StepShape, ValueId};
use loader::hparams::HParams;
use ops::hc::{HcExpand, HcPost, HcPre, StreamMean};
use ops::norm::RmsNorm;
use trunk::Trunk;

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

    /// A sub-layer's entry (spec §3.2–3.4) with HC set `set` (`hc_attn` / `hc_ffn`):
    /// `x, post, C = hc_pre(H)`, then the sub-layer's own norm `norm` (`attn_norm` /
    /// `ffn_norm`). Returns `rms(x)`, `post` and `C`.
    fn enter(
        &self,
        b: &mut GraphBuilder<'_>,
        layer: usize,
        (set, norm): (&str, &str),
        streams: ValueId,
    ) -> Result<[ValueId; 3], GraphError> {
        let f = b.weight(&format!("blk.{layer}.{set}_fn.weight"))?;
        let base = b.weight(&format!("blk.{layer}.{set}_base.weight"))?;
        let scale = b.weight(&format!("blk.{layer}.{set}_scale.weight"))?;
        let w_norm = b.weight(&format!("blk.{layer}.{norm}.weight"))?;
        let pre = HcPre {
            hc: self.hc,
            sinkhorn_iters: self.sinkhorn_iters,
            rms_eps: self.trunk.h.rms_eps,
            hc_eps: self.hc_eps,
            clamp: self.clamp,
            kernel: Default::default(),
        };
        let [x, post, comb] = b.opn(&format!("{set}_pre"), pre, &[streams, f, base, scale])?;
        let eps = self.trunk.h.rms_eps;
        let x = b.op1(norm, RmsNorm { eps }, &[x, w_norm])?;
        Ok([x, post, comb])
    }

    /// A sub-layer's exit (spec §3.6): `H' = hc_post(y, H, post, C)`.
    fn exit(
        &self,
        b: &mut GraphBuilder<'_>,
        set: &str,
        [y, streams, post, comb]: [ValueId; 4],
    ) -> Result<ValueId, GraphError> {
        let post_op = HcPost { hc: self.hc };
        b.op1(&format!("{set}_post"), post_op, &[y, streams, post, comb])
    }
}

impl ModelDecl for Xing4 {
    fn arch(&self) -> &str {
        "xing4_0"
    }

    fn declare(&self, b: &mut GraphBuilder<'_>, shape: &StepShape) -> Result<(), GraphError> {
        let t = &self.trunk;
        let step = t.inputs(b, shape);
        let tokens = step.tokens;
        let e = t.embed(b, tokens)?;
        let mut streams = b.op1("hc_expand", HcExpand { hc: self.hc }, &[e])?;
        for layer in 0..t.h.n_layer {
            streams = b.scope(&format!("blk.{layer}"), |b| -> Result<_, GraphError> {
                let attn = ("hc_attn", "attn_norm");
                let [a, post, comb] = self.enter(b, layer, attn, streams)?;
                let y = t.attention(b, layer, a, &step, shape)?;
                let streams = self.exit(b, "hc_attn", [y, streams, post, comb])?;

                let ffn = ("hc_ffn", "ffn_norm");
                let [z, post, comb] = self.enter(b, layer, ffn, streams)?;
                let y = t.ffn(b, layer, z)?;
                self.exit(b, "hc_ffn", [y, streams, post, comb])
            })?;
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
