//! Reading a GGUF file over a memory map. Every length, count and offset in the file is checked
//! against the bytes that are really there before it is used, so corrupt input is an error, never a
//! panic or a huge allocation.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, GgufError, MAX_DIMS, Metadata,
    TensorInfo, Value, ValueType, align_up, tensor_n_bytes,
};
use crate::GgmlType;
use crate::quant;

/// Nested arrays are legal GGUF but nobody writes deep ones; the cap keeps a hostile file from
/// recursing the reader off its stack.
const MAX_ARRAY_NESTING: u32 = 8;

enum Storage {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Map(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file whose tensor data stays in the memory map.
pub struct GgufFile {
    pub version: u32,
    pub metadata: Metadata,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    path: PathBuf,
    storage: Storage,
    index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates `path`: header, every metadata value, every tensor info (type, block
    /// geometry, alignment, bounds, overlaps).
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |action, source| GgufError::Io {
            path: path.to_path_buf(),
            action,
            source,
        };
        let file = File::open(path).map_err(|e| io("cannot open", e))?;
        let len = file.metadata().map_err(|e| io("cannot stat", e))?.len();
        // Mapping zero bytes is an error on Linux; an empty file is simply truncated.
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only. Like every mmap-based loader we rely on the file not
            // being truncated or rewritten by another process while it is open.
            Storage::Map(unsafe { Mmap::map(&file) }.map_err(|e| io("cannot memory-map", e))?)
        };
        Self::parse(path.to_path_buf(), storage)
    }

    /// Parses a file held in memory; `path` only labels errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::parse(path.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<GgufFile, GgufError> {
        let header = parse_header(&path, storage.bytes())?;
        let mut index = HashMap::with_capacity(header.tensors.len());
        for (i, t) in header.tensors.iter().enumerate() {
            index.insert(t.name.clone(), i);
        }
        Ok(GgufFile {
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
            path,
            storage,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_size(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index
            .get(name)
            .and_then(|&i| self.tensors.get(i))
            .filter(|t| t.name == name)
            .or_else(|| self.tensors.iter().find(|t| t.name == name))
    }

    /// The bytes of a tensor of this file (empty for an info that does not fit this file).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let range = self
            .data_offset
            .checked_add(info.offset)
            .and_then(|s| Some(s..s.checked_add(info.n_bytes)?))
            .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
        range
            .and_then(|r| self.storage.bytes().get(r))
            .unwrap_or(&[])
    }

    pub fn data(&self, name: &str) -> Result<&[u8], GgufError> {
        Ok(self.tensor_data(self.need(name)?))
    }

    /// The whole tensor as f32 (allocates; for tests and tools).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self.need(name)?;
        let n = usize::try_from(info.n_elements()).map_err(|_| {
            GgufError::malformed(
                &self.path,
                format!("tensor `{name}`"),
                "too many elements for this machine",
            )
        })?;
        let mut out = vec![0f32; n];
        quant::dequantize(info.ty, self.tensor_data(info), &mut out).map_err(|source| {
            GgufError::Dequantize {
                path: self.path.clone(),
                tensor: name.to_string(),
                source,
            }
        })?;
        Ok(out)
    }

    fn need(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })
    }
}

struct Header {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// Where the parser is, for truncation and length errors.
#[derive(Clone, Copy)]
enum Ctx<'a> {
    Header,
    KeyName(u64),
    Value(&'a str),
    TensorName(u64),
    TensorInfo(&'a str),
}

impl fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ctx::Header => f.write_str("the header"),
            Ctx::KeyName(i) => write!(f, "the name of metadata key #{i}"),
            Ctx::Value(k) => write!(f, "the value of metadata key `{k}`"),
            Ctx::TensorName(i) => write!(f, "the name of tensor info #{i}"),
            Ctx::TensorInfo(n) => write!(f, "the tensor info of `{n}`"),
        }
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    /// A declared length: larger than the whole file is absurd, larger than what is left is a
    /// truncation. Checked before anything is allocated for it.
    fn check_len(&self, ctx: Ctx, what: &str, needed: Option<u64>) -> Result<(), GgufError> {
        let needed = needed.unwrap_or(u64::MAX);
        if needed > self.buf.len() as u64 {
            return Err(GgufError::LengthTooLarge {
                path: self.path.to_path_buf(),
                what: format!("{what} in {ctx}"),
                length: needed,
                remaining: self.remaining(),
            });
        }
        if needed > self.remaining() {
            return Err(self.truncated(ctx, needed));
        }
        Ok(())
    }

    fn truncated(&self, ctx: Ctx, expected: u64) -> GgufError {
        GgufError::Truncated {
            path: self.path.to_path_buf(),
            section: ctx.to_string(),
            offset: self.pos as u64,
            expected,
            available: self.remaining(),
        }
    }

    fn take(&mut self, n: u64, ctx: Ctx) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(ctx, n));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, ctx: Ctx) -> Result<[u8; N], GgufError> {
        let b = self.take(N as u64, ctx)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, ctx: Ctx) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(ctx)?))
    }

    fn u64(&mut self, ctx: Ctx) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(ctx)?))
    }

    fn string(&mut self, ctx: Ctx) -> Result<String, GgufError> {
        let len = self.u64(ctx)?;
        self.check_len(ctx, "a string length", Some(len))?;
        let bytes = self.take(len, ctx)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            path: self.path.to_path_buf(),
            what: match ctx {
                Ctx::Value(_) => format!("a string in {ctx}"),
                _ => ctx.to_string(),
            },
        })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<Value, GgufError> {
        let ctx = Ctx::Value(key);
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(ctx)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(ctx)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(ctx)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(ctx)?)),
            ValueType::U32 => Value::U32(self.u32(ctx)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(ctx)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(ctx)?)),
            ValueType::U64 => Value::U64(self.u64(ctx)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(ctx)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(ctx)?)),
            ValueType::Bool => match self.array::<1>(ctx)? {
                [0] => Value::Bool(false),
                [1] => Value::Bool(true),
                [b] => {
                    return Err(GgufError::malformed(
                        self.path,
                        format!("metadata key `{key}`"),
                        format!("bool byte is {b}, expected 0 or 1"),
                    ));
                }
            },
            ValueType::String => Value::String(self.string(ctx)?),
            ValueType::Array => {
                let id = self.u32(ctx)?;
                let elem = ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
                    path: self.path.to_path_buf(),
                    key: key.to_string(),
                    id,
                })?;
                if elem == ValueType::Array && depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::malformed(
                        self.path,
                        format!("metadata key `{key}`"),
                        format!("arrays nested deeper than {MAX_ARRAY_NESTING} levels"),
                    ));
                }
                let count = self.u64(ctx)?;
                self.check_len(
                    ctx,
                    "an array element count",
                    count.checked_mul(min_encoded_size(elem)),
                )?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// The fewest bytes one value of type `ty` takes on disk.
fn min_encoded_size(ty: ValueType) -> u64 {
    match ty {
        ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
        ValueType::U16 | ValueType::I16 => 2,
        ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
        ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
        ValueType::Array => 12,
    }
}

/// The alignment a metadata section asks for: `general.alignment` must be a u32 power of two
/// (llama.cpp refuses anything else).
pub(super) fn alignment_of(path: &Path, metadata: &Metadata) -> Result<u64, GgufError> {
    match metadata.get(ALIGNMENT_KEY) {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) if a.is_power_of_two() => Ok(*a as u64),
        Some(v) => Err(GgufError::malformed(
            path,
            format!("metadata key `{ALIGNMENT_KEY}`"),
            format!("expected a u32 power of two, found {}", v.describe()),
        )),
    }
}

fn parse_header(path: &Path, buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic: [u8; 4] = c.array(Ctx::Header)?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    let version = c.u32(Ctx::Header)?;
    if version != GGUF_VERSION {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let n_tensors = c.u64(Ctx::Header)?;
    let n_kv = c.u64(Ctx::Header)?;

    // Each loop iteration consumes bytes, so a huge count ends in a truncation error.
    let mut metadata = Metadata::new();
    for i in 0..n_kv {
        let key = c.string(Ctx::KeyName(i))?;
        if metadata.contains(&key) {
            return Err(GgufError::malformed(
                path,
                format!("metadata key `{key}`"),
                "appears more than once",
            ));
        }
        let id = c.u32(Ctx::Value(&key))?;
        let ty = ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            path: path.to_path_buf(),
            key: key.clone(),
            id,
        })?;
        let value = c.value(ty, &key, 0)?;
        metadata.insert(key, value);
    }
    let alignment = alignment_of(path, &metadata)?;

    // name length + n_dims + type + offset
    const MIN_INFO: u64 = 8 + 4 + 4 + 8;
    let mut tensors = Vec::with_capacity(n_tensors.min(c.remaining() / MIN_INFO) as usize);
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(Ctx::TensorName(i))?;
        let ctx = Ctx::TensorInfo(&name);
        let n_dims = c.u32(ctx)?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::malformed(
                path,
                format!("tensor `{name}`"),
                format!("has {n_dims} dimensions, at most {MAX_DIMS} are allowed"),
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(ctx)?);
        }
        let id = c.u32(ctx)?;
        let ty = GgmlType::from_id(id).ok_or_else(|| GgufError::UnknownGgmlType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            id,
        })?;
        let offset = c.u64(ctx)?;

        let ne0 = ne.first().copied().unwrap_or(1);
        if ne0 % ty.block_size() as u64 != 0 {
            return Err(GgufError::NotWholeBlocks {
                path: path.to_path_buf(),
                tensor: name,
                ty,
                ne0,
                block_size: ty.block_size(),
            });
        }
        let n_bytes = tensor_n_bytes(ty, &ne).ok_or_else(|| {
            GgufError::malformed(
                path,
                format!("tensor `{name}`"),
                format!("dimensions {ne:?} overflow the element or byte count"),
            )
        })?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedOffset {
                path: path.to_path_buf(),
                tensor: name,
                offset,
                alignment,
            });
        }
        if !names.insert(name.clone()) {
            return Err(GgufError::malformed(
                path,
                format!("tensor `{name}`"),
                "appears more than once",
            ));
        }
        tensors.push(TensorInfo {
            name,
            ne,
            ty,
            offset,
            n_bytes,
        });
    }

    // c.pos <= buf.len(), so this cannot overflow for any real alignment.
    let data_offset = align_up(c.pos as u64, alignment).unwrap_or(u64::MAX);
    let file_size = buf.len() as u64;
    for t in &tensors {
        let start = data_offset.saturating_add(t.offset);
        let end = start.saturating_add(t.n_bytes);
        if end > file_size || end == u64::MAX {
            return Err(GgufError::DataPastEnd {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                start,
                end,
                file_size,
            });
        }
    }
    check_overlaps(path, &tensors)?;

    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn check_overlaps(path: &Path, tensors: &[TensorInfo]) -> Result<(), GgufError> {
    // Empty tensors occupy no bytes, so they cannot collide with anything.
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Both ranges lie inside the file (checked above), so the sum cannot overflow.
        let a_end = a.offset + a.n_bytes;
        if b.offset < a_end {
            return Err(GgufError::OverlappingTensors {
                path: path.to_path_buf(),
                first: a.name.clone(),
                first_start: a.offset,
                first_end: a_end,
                second: b.name.clone(),
                second_start: b.offset,
            });
        }
    }
    Ok(())
}
