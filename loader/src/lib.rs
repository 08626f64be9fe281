//! Reading and writing checkpoints: the GGUF container, block formats and
//! quantizers, per-architecture schemas, the release directory
//! (`config.json`, tokenizer, chat template) and checkpoint path resolution.

pub mod dtype;
pub mod gguf;
pub mod quant;

pub use dtype::GgmlType;
