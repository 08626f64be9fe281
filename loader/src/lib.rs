//! Reading and writing checkpoints: the GGUF container, block formats and
//! quantizers, per-architecture schemas, the release directory
//! (`config.json`, tokenizer, chat template) and checkpoint path resolution.

pub mod chat;
pub mod dtype;
pub mod gguf;
pub mod hparams;
pub mod quant;
pub mod release;
pub mod schema;
pub mod tokenizer;
pub mod toolcall;

pub use dtype::GgmlType;
