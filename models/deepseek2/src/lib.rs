//! DeepSeek-V2/V3 (`deepseek2` in GGUF): the trunk (`models/trunk`) on an ordinary residual.
//! It proves a new architecture is a declaration, and lets llama.cpp serve as an external oracle.
//!
//! Declarations only: no kernels, no loops over data.

use graph::{GraphBuilder, GraphError, ModelDecl, StepShape, ValueId};
use loader::hparams::HParams;
use loader::schema::TensorRule;
use ops::elementwise::Add;
use trunk::Trunk;

/// `deepseek2`: the trunk on an ordinary residual.
#[derive(Clone, Debug)]
pub struct Deepseek2 {
    pub trunk: Trunk,
}

impl Deepseek2 {
    pub fn new(h: HParams) -> Self {
        Deepseek2 {
            trunk: Trunk::new(h),
        }
    }
}

impl ModelDecl for Deepseek2 {
    fn arch(&self) -> &str {
        "deepseek2"
    }

    fn declare(&self, b: &mut GraphBuilder<'_>, shape: &StepShape) -> Result<(), GraphError> {
        let t = &self.trunk;
        let step = t.inputs(b, shape);
        let tokens = step.tokens;
        let mut x = t.embed(b, tokens)?;
        for layer in 0..t.h.n_layer {
            x = b.scope(
                &format!("blk.{layer}"),
                |b| -> Result<ValueId, GraphError> {
                    let w_attn_norm = t.w(b, layer, "attn_norm")?;
                    let w_ffn_norm = t.w(b, layer, "ffn_norm")?;
                    let a = t.rms(b, "attn_norm", x, w_attn_norm)?;
                    let y = t.attention(b, layer, a, &step, shape)?;
                    let x = b.op1("attn_residual", Add, &[x, y])?;
                    let z = t.rms(b, "ffn_norm", x, w_ffn_norm)?;
                    let y = t.ffn(b, layer, z)?;
                    b.op1("ffn_residual", Add, &[x, y])
                },
            )?;
        }
        t.head(b, x, shape)?;
        Ok(())
    }

    fn n_vocab(&self) -> usize {
        self.trunk.h.n_vocab
    }

    fn state_bytes_per_position(&self) -> usize {
        self.trunk.h.n_layer * self.trunk.kv_width() * 4
    }
}

/// The tensors of a `deepseek2` checkpoint, in file order: the trunk's alone.
pub fn tensors(h: &HParams) -> Vec<TensorRule> {
    trunk::tensors(h, |_| Vec::new())
}
