//! The GGUF v3 container: metadata values, reading over a memory map, streaming writing.

mod value;

pub use value::{Metadata, MetadataError, Value, ValueType};
