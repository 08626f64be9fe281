//! The tensors of a synthetic checkpoint, each in its release type, and their random values.
//! Which tensors, and how each one's values are drawn, is the architecture's tensor table
//! ([`crate::tensors`]), the same one the schema check reads.

use loader::GgmlType;
use loader::hparams::HParams;
pub use loader::schema::Init;
use loader::schema::TensorRule;

use super::rng::{SplitMix64, name_key};

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

impl From<TensorRule> for PlannedTensor {
    fn from(r: TensorRule) -> PlannedTensor {
        PlannedTensor {
            name: r.name,
            ne: r.ne,
            ty: r.release,
            init: r.init,
        }
    }
}

impl PlannedTensor {
    pub fn row_len(&self) -> usize {
        self.ne.first().copied().unwrap_or(1) as usize
    }

    pub fn n_rows(&self) -> usize {
        self.ne.iter().skip(1).product::<u64>() as usize
    }

    /// Values of rows `rows` (each from its own stream, so any split of the rows across threads
    /// yields the same tensor).
    pub fn generate_rows(&self, seed: u64, rows: std::ops::Range<usize>, out: &mut [f32]) {
        let n = self.row_len();
        let key = name_key(&self.name);
        for (r, o) in rows.zip(out.chunks_exact_mut(n)) {
            let mut rng = SplitMix64::derive(seed, key, r as u64);
            rng.fill_normal(o);
            let (mean, std) = match self.init {
                Init::Normal { std } => (0.0, std),
                Init::Around { mean, std } => (mean, std),
            };
            for v in o.iter_mut() {
                *v = mean + std * *v;
            }
        }
    }
}

/// Every tensor of the checkpoint, in file order, NextN blocks included.
pub fn plan(h: &HParams) -> Vec<PlannedTensor> {
    crate::tensors(h)
        .into_iter()
        .map(PlannedTensor::from)
        .collect()
}
