//! Streaming GGUF writer: the header and tensor infos are written up front (all sizes are known
//! from the declared shapes), then tensor data is appended in declared order, in one piece or in
//! chunks. Memory use is the header plus a fixed write buffer, whatever the file size.
//!
//! The layout is the one llama.cpp's writers (C `gguf_write_*` and Python `GGUFWriter`) produce:
//! tensors packed in declaration order, each starting at a multiple of the alignment, with zero
//! padding after every tensor, the last one included.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::reader::alignment_of;
use super::{
    GGUF_MAGIC, GGUF_VERSION, GgufError, MAX_DIMS, Metadata, Value, align_up, tensor_n_bytes,
};
use crate::GgmlType;

const WRITE_BUFFER: usize = 1 << 20;

/// A tensor to be written: the data size follows from `ne` and `ty`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    /// Dimensions, `ne0` first.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, ne: Vec<u64>, ty: GgmlType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            ne,
            ty,
        }
    }

    /// Bytes of the tensor's data, or `None` when `ne0` is not a whole number of blocks.
    pub fn n_bytes(&self) -> Option<u64> {
        tensor_n_bytes(self.ty, &self.ne)
    }
}

struct Planned {
    name: String,
    n_bytes: u64,
}

/// Writes a GGUF file front to back. Tensors must be written in the order they were declared:
/// [`GgufWriter::write_tensor`] takes a whole tensor, [`GgufWriter::write_tensor_chunk`] takes it
/// in consecutive pieces and completes it when the declared byte count has arrived.
/// [`GgufWriter::finish`] must be called; a writer dropped early leaves an incomplete file.
pub struct GgufWriter {
    path: PathBuf,
    out: BufWriter<File>,
    tensors: Vec<Planned>,
    alignment: u64,
    /// Index of the tensor being written.
    next: usize,
    /// Bytes of `tensors[next]` written so far.
    written: u64,
}

impl GgufWriter {
    /// Creates `path` and writes the header, metadata, tensor infos and the padding before the data
    /// section. The alignment is `general.alignment` (a u32 power of two) if present, else 32.
    pub fn create(
        path: &Path,
        metadata: &Metadata,
        tensors: Vec<TensorSpec>,
    ) -> Result<GgufWriter, GgufError> {
        let alignment = alignment_of(path, metadata)?;
        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC);
        head.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata.iter() {
            put_string(&mut head, key);
            head.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut head, value).map_err(|problem| {
                GgufError::malformed(path, format!("metadata key `{key}`"), problem)
            })?;
        }

        let mut planned = Vec::with_capacity(tensors.len());
        let mut names = HashSet::new();
        let mut offset = 0u64;
        for t in tensors {
            let bad = |problem: String| {
                GgufError::malformed(path, format!("tensor `{}`", t.name), problem)
            };
            if !names.insert(t.name.clone()) {
                return Err(bad("is declared more than once".into()));
            }
            if t.ne.len() > MAX_DIMS {
                return Err(bad(format!(
                    "has {} dimensions, at most {MAX_DIMS} are allowed",
                    t.ne.len()
                )));
            }
            let ne0 = t.ne.first().copied().unwrap_or(1);
            if ne0 % t.ty.block_size() as u64 != 0 {
                return Err(GgufError::NotWholeBlocks {
                    path: path.to_path_buf(),
                    tensor: t.name,
                    ty: t.ty,
                    ne0,
                    block_size: t.ty.block_size(),
                });
            }
            let n_bytes = t
                .n_bytes()
                .ok_or_else(|| bad(format!("dimensions {:?} overflow the byte count", t.ne)))?;
            put_string(&mut head, &t.name);
            head.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for &n in &t.ne {
                head.extend_from_slice(&n.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = offset
                .checked_add(n_bytes)
                .and_then(|end| align_up(end, alignment))
                .ok_or_else(|| bad("the data section would exceed 2^64 bytes".into()))?;
            planned.push(Planned {
                name: t.name,
                n_bytes,
            });
        }
        let padded = align_up(head.len() as u64, alignment).unwrap_or(head.len() as u64);

        let file = File::create(path).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            action: "cannot create",
            source,
        })?;
        let mut writer = GgufWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(WRITE_BUFFER, file),
            tensors: planned,
            alignment,
            next: 0,
            written: 0,
        };
        writer.put(&head)?;
        writer.put_zeros(padded - head.len() as u64)?;
        Ok(writer)
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Writes the whole data of the next declared tensor, which must be `name` and exactly its
    /// declared byte size.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), GgufError> {
        if let Some(t) = self.tensors.get(self.next)
            && t.name == name
            && data.len() as u64 != t.n_bytes
        {
            return Err(self.wrong_size(self.written + data.len() as u64));
        }
        self.write_tensor_chunk(name, data)
    }

    /// Appends `chunk` to the data of the next declared tensor, `name`. The tensor is complete (and
    /// padded) once its declared byte count has been written; a chunk that would go past it is an
    /// error, as is starting another tensor before it is complete. A tensor of zero bytes is
    /// completed by an empty chunk.
    pub fn write_tensor_chunk(&mut self, name: &str, chunk: &[u8]) -> Result<(), GgufError> {
        let Some(t) = self.tensors.get(self.next) else {
            return Err(GgufError::malformed(
                &self.path,
                format!("tensor `{name}`"),
                "every declared tensor has already been written",
            ));
        };
        if t.name != name {
            if self.written > 0 {
                return Err(self.wrong_size(self.written));
            }
            return Err(GgufError::OutOfOrder {
                path: self.path.clone(),
                expected: t.name.clone(),
                found: name.to_string(),
            });
        }
        let total = self.written + chunk.len() as u64;
        if total > t.n_bytes {
            return Err(self.wrong_size(total));
        }
        let n_bytes = t.n_bytes;
        self.put(chunk)?;
        self.written = total;
        if total == n_bytes {
            let pad = align_up(n_bytes, self.alignment).unwrap_or(n_bytes) - n_bytes;
            self.put_zeros(pad)?;
            self.next += 1;
            self.written = 0;
        }
        Ok(())
    }

    /// Checks that every declared tensor was written and flushes the file.
    pub fn finish(mut self) -> Result<(), GgufError> {
        if self.next < self.tensors.len() {
            return Err(GgufError::MissingTensorData {
                path: self.path.clone(),
                missing: self.tensors[self.next..]
                    .iter()
                    .map(|t| t.name.clone())
                    .collect(),
            });
        }
        self.out.flush().map_err(|source| GgufError::Io {
            path: self.path.clone(),
            action: "cannot write",
            source,
        })
    }

    fn wrong_size(&self, found: u64) -> GgufError {
        let t = &self.tensors[self.next];
        GgufError::WrongDataSize {
            path: self.path.clone(),
            tensor: t.name.clone(),
            expected: t.n_bytes,
            found,
        }
    }

    /// Padding; written in pieces because the alignment may be large.
    fn put_zeros(&mut self, mut n: u64) -> Result<(), GgufError> {
        const ZEROS: [u8; 4096] = [0; 4096];
        while n > 0 {
            let k = n.min(ZEROS.len() as u64);
            self.put(&ZEROS[..k as usize])?;
            n -= k;
        }
        Ok(())
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), GgufError> {
        self.out.write_all(bytes).map_err(|source| GgufError::Io {
            path: self.path.clone(),
            action: "cannot write",
            source,
        })
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Encodes a value's payload (its type tag is the caller's). Fails on an array whose items are
/// not all of its declared element type.
fn put_value(out: &mut Vec<u8>, value: &Value) -> Result<(), String> {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Array(elem, items) => {
            out.extend_from_slice(&(*elem as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for (i, item) in items.iter().enumerate() {
                if item.value_type() != *elem {
                    return Err(format!(
                        "array of {elem} holds {} at index {i}",
                        item.describe()
                    ));
                }
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}
