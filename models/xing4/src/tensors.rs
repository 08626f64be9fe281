//! Xing4.0's tensor table: the trunk's, with each trunk block led by its two hyper-connection
//! sets (spec §2).
//!
//! The projection is small (its 24 mixes have std ≈ 0.5 for a normalised input) so the sigmoid
//! gates `make-model` draws are not saturated.

use loader::GgmlType::{BF16, F32};
use loader::hparams::HParams;
use loader::schema::{ANY, F32_ONLY, Init, TensorRule};

/// The tensors of a `xing4_0` checkpoint, in file order.
pub fn tensors(h: &HParams) -> Vec<TensorRule> {
    trunk::tensors(h, |layer| hyper_connections(h, layer))
}

fn hyper_connections(h: &HParams, layer: usize) -> Vec<TensorRule> {
    let Some(hc) = h.hc else {
        return Vec::new();
    };
    let (n, width) = (hc.count, hc.count * h.n_embd);
    let mix = (2 + n) * n;
    // m = Fn·f̂ with f̂ of unit RMS over `width` values: std 0.5.
    let projection = Init::Normal {
        std: 0.5 / (width as f32).sqrt(),
    };
    let base = Init::Normal { std: 0.5 };
    let scale = Init::Around {
        mean: 1.0,
        std: 0.2,
    };
    let mut out = Vec::new();
    for set in ["hc_attn", "hc_ffn"] {
        let name = |s: &str| format!("blk.{layer}.{set}_{s}.weight");
        out.push(TensorRule::new(
            name("fn"),
            &[width, mix],
            ANY,
            BF16,
            projection,
        ));
        out.push(TensorRule::new(name("base"), &[mix], F32_ONLY, F32, base));
        out.push(TensorRule::new(name("scale"), &[3], F32_ONLY, F32, scale));
    }
    out
}
