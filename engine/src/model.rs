//! A loaded checkpoint: the memory-mapped GGUF, its hyper-parameters and the
//! architecture's declaration.

use std::collections::HashMap;

use graph::{HostWeights, ModelDecl, WeightSource};
use loader::gguf::GgufFile;
use loader::hparams::HParams;
use ops::{DType, TensorMeta};

pub struct Model {
    pub gguf: GgufFile,
    pub hparams: HParams,
    pub decl: Box<dyn ModelDecl>,
    /// Name → (metadata in outer-first shape, byte range in the file).
    tensors: HashMap<String, (TensorMeta, usize)>,
}

impl Model {
    /// Wraps a checkpoint that has passed its schema, with the declaration of its architecture.
    pub fn new(gguf: GgufFile, hparams: HParams, decl: Box<dyn ModelDecl>) -> Model {
        let tensors = gguf
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let meta = TensorMeta::new(t.shape(), DType::from_ggml(t.ty));
                (t.name.clone(), (meta, i))
            })
            .collect();
        Model {
            gguf,
            hparams,
            decl,
            tensors,
        }
    }

    /// Bytes of every tensor the checkpoint holds.
    pub fn total_weight_bytes(&self) -> u64 {
        self.gguf.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

impl WeightSource for Model {
    fn weight_meta(&self, name: &str) -> Option<TensorMeta> {
        self.tensors.get(name).map(|(m, _)| m.clone())
    }
}

impl HostWeights for Model {
    fn weight_bytes(&self, name: &str) -> Option<&[u8]> {
        let &(_, i) = self.tensors.get(name)?;
        Some(self.gguf.tensor_data(&self.gguf.tensors[i]))
    }
}
