//! Trained weights for a checkpoint: a safetensors file (what `train/train.py` writes) whose
//! tensors carry the GGUF names and the PyTorch shape (the GGUF `ne` reversed), in F32. The
//! writer quantizes them to each tensor's release type in place of random draws.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value as Json;

use super::weights::PlannedTensor;

pub struct TrainedWeights {
    path: PathBuf,
    bytes: Vec<u8>,
    /// name -> (PyTorch shape, byte range in `bytes`)
    tensors: HashMap<String, (Vec<u64>, std::ops::Range<usize>)>,
}

impl TrainedWeights {
    /// Reads `path` and checks its header: F32 tensors whose byte ranges lie in the file.
    pub fn open(path: &Path) -> Result<TrainedWeights> {
        let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let at = |what: &str| format!("{}: {what}", path.display());
        ensure!(bytes.len() >= 8, at("shorter than a safetensors header"));
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()) as usize;
        ensure!(
            n <= bytes.len() - 8,
            at(&format!("header of {n} bytes runs past the end"))
        );
        let header: serde_json::Map<String, Json> = serde_json::from_slice(&bytes[8..8 + n])
            .with_context(|| at("the header is not a JSON object"))?;
        let base = 8 + n;
        let mut tensors = HashMap::new();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let dtype = info.get("dtype").and_then(Json::as_str).unwrap_or("");
            ensure!(
                dtype == "F32",
                at(&format!("tensor `{name}` is {dtype:?}; expected F32"))
            );
            let nums = |k: &str| -> Option<Vec<u64>> {
                info.get(k)?.as_array()?.iter().map(Json::as_u64).collect()
            };
            let (Some(shape), Some(offs)) = (nums("shape"), nums("data_offsets")) else {
                bail!(at(&format!("tensor `{name}` lacks shape or data_offsets")));
            };
            ensure!(
                offs.len() == 2 && offs[0] <= offs[1],
                at(&format!("tensor `{name}`: bad data_offsets"))
            );
            let (s, e) = (base + offs[0] as usize, base + offs[1] as usize);
            let want = shape.iter().product::<u64>() as usize * 4;
            ensure!(
                e <= bytes.len() && e - s == want,
                at(&format!(
                    "tensor `{name}`: {} bytes for shape {shape:?} (needs {want}) or past the end",
                    e - s
                ))
            );
            tensors.insert(name, (shape, s..e));
        }
        Ok(TrainedWeights {
            path: path.to_path_buf(),
            bytes,
            tensors,
        })
    }

    /// Every planned tensor is present with its shape, and nothing else is.
    pub fn check(&self, plan: &[PlannedTensor]) -> Result<()> {
        let mut missing = Vec::new();
        for t in plan {
            match self.tensors.get(&t.name) {
                None => missing.push(t.name.as_str()),
                Some((shape, _)) => {
                    let want: Vec<u64> = t.ne.iter().rev().copied().collect();
                    ensure!(
                        *shape == want,
                        "{}: tensor `{}` has shape {shape:?}; the checkpoint's dimensions need {want:?}",
                        self.path.display(),
                        t.name
                    );
                }
            }
        }
        ensure!(
            missing.is_empty(),
            "{}: missing {} tensors: {}",
            self.path.display(),
            missing.len(),
            missing.join(", ")
        );
        let planned: std::collections::HashSet<&str> =
            plan.iter().map(|t| t.name.as_str()).collect();
        let mut extra: Vec<&str> = self
            .tensors
            .keys()
            .map(String::as_str)
            .filter(|n| !planned.contains(n))
            .collect();
        extra.sort_unstable();
        ensure!(
            extra.is_empty(),
            "{}: tensors the checkpoint has no place for: {}",
            self.path.display(),
            extra.join(", ")
        );
        Ok(())
    }

    /// Rows `rows` of `t` (rows of `ne0` values), after [`check`](Self::check).
    pub fn rows(&self, t: &PlannedTensor, rows: std::ops::Range<usize>, out: &mut [f32]) {
        let n = t.row_len();
        let Some((_, range)) = self.tensors.get(&t.name) else {
            return;
        };
        let src = &self.bytes[range.start + rows.start * n * 4..range.start + rows.end * n * 4];
        for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}
