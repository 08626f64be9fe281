//! GGUF metadata values and typed access to them.

use std::collections::BTreeMap;
use std::fmt;

/// The on-disk type tag of a metadata value (GGUF `gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        [
            U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64,
        ]
        .into_iter()
        .find(|t| *t as u32 == id)
    }

    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Elements all of `elem_type` (nested arrays are allowed by the format).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A short description of the value for error messages: `u32 7`, `array<string>[131072]`.
    pub fn describe(&self) -> String {
        match self {
            Value::Array(t, v) => format!("array<{t}>[{}]", v.len()),
            Value::String(s) if s.len() > 40 => format!("string of {} bytes", s.len()),
            Value::String(s) => format!("string {s:?}"),
            other => format!("{} {}", other.value_type(), other.scalar_text()),
        }
    }

    fn scalar_text(&self) -> String {
        match self {
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::F32(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            Value::String(s) => s.clone(),
            Value::Array(..) => String::new(),
        }
    }

    /// Any integer value that is non-negative, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value, as i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v as i64),
            Value::U16(v) => Some(v as i64),
            Value::U32(v) => Some(v as i64),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any float value, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// A metadata key that is missing or holds the wrong type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MetadataError {
    #[error("metadata key `{key}` is missing (expected {expected})")]
    Missing { key: String, expected: &'static str },
    #[error("metadata key `{key}`: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
}

/// The key/value section of a GGUF file, in file order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: BTreeMap<String, usize>,
}

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key`, replacing an earlier value in place (file order is kept).
    pub fn insert(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        if let Some(&i) = self.index.get(&key) {
            self.entries[i].1 = value;
        } else {
            self.index.insert(key.clone(), self.entries.len());
            self.entries.push((key, value));
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    fn need(&self, key: &str, expected: &'static str) -> Result<&Value, MetadataError> {
        self.get(key).ok_or_else(|| MetadataError::Missing {
            key: key.to_string(),
            expected,
        })
    }

    fn wrong(key: &str, expected: &'static str, found: &Value) -> MetadataError {
        MetadataError::WrongType {
            key: key.to_string(),
            expected,
            found: found.describe(),
        }
    }

    /// An unsigned integer of any width that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, MetadataError> {
        const E: &str = "an unsigned integer (u32)";
        let v = self.need(key, E)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| Self::wrong(key, E, v))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, MetadataError> {
        const E: &str = "an unsigned integer (u64)";
        let v = self.need(key, E)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, E, v))
    }

    pub fn get_i64(&self, key: &str) -> Result<i64, MetadataError> {
        const E: &str = "an integer";
        let v = self.need(key, E)?;
        v.as_i64().ok_or_else(|| Self::wrong(key, E, v))
    }

    /// An f32 or f64 value.
    pub fn get_f32(&self, key: &str) -> Result<f32, MetadataError> {
        const E: &str = "a float (f32)";
        let v = self.need(key, E)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| Self::wrong(key, E, v))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, MetadataError> {
        const E: &str = "a float";
        let v = self.need(key, E)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, E, v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, MetadataError> {
        const E: &str = "a bool";
        match self.need(key, E)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong(key, E, v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, MetadataError> {
        const E: &str = "a string";
        match self.need(key, E)? {
            Value::String(s) => Ok(s),
            v => Err(Self::wrong(key, E, v)),
        }
    }

    /// An array (of any element type): its element type and items.
    pub fn get_array(&self, key: &str) -> Result<(ValueType, &[Value]), MetadataError> {
        const E: &str = "an array";
        match self.need(key, E)? {
            Value::Array(t, items) => Ok((*t, items)),
            v => Err(Self::wrong(key, E, v)),
        }
    }

    pub fn get_string_array(&self, key: &str) -> Result<Vec<&str>, MetadataError> {
        const E: &str = "an array of strings";
        let v = self.need(key, E)?;
        match v {
            Value::Array(ValueType::String, items) => items
                .iter()
                .map(|i| match i {
                    Value::String(s) => Ok(s.as_str()),
                    _ => Err(Self::wrong(key, E, v)),
                })
                .collect(),
            _ => Err(Self::wrong(key, E, v)),
        }
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, MetadataError> {
        const E: &str = "an array of floats";
        let v = self.need(key, E)?;
        match v {
            Value::Array(_, items) => items
                .iter()
                .map(|i| {
                    i.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| Self::wrong(key, E, v))
                })
                .collect(),
            _ => Err(Self::wrong(key, E, v)),
        }
    }

    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>, MetadataError> {
        const E: &str = "an array of integers";
        let v = self.need(key, E)?;
        match v {
            Value::Array(_, items) => items
                .iter()
                .map(|i| i.as_i64().ok_or_else(|| Self::wrong(key, E, v)))
                .collect(),
            _ => Err(Self::wrong(key, E, v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_type_error_names_key_expectation_and_finding() {
        let mut m = Metadata::new();
        m.insert("xing4_0.block_count", Value::String("forty".into()));
        let e = m.get_u32("xing4_0.block_count").unwrap_err().to_string();
        assert!(e.contains("xing4_0.block_count"), "{e}");
        assert!(e.contains("u32"), "{e}");
        assert!(e.contains("\"forty\""), "{e}");
        let e = m.get_f32("nope").unwrap_err().to_string();
        assert!(e.contains("`nope` is missing"), "{e}");
    }

    #[test]
    fn integer_getters_accept_any_width_that_fits() {
        let mut m = Metadata::new();
        m.insert("a", Value::U8(7));
        m.insert("b", Value::I32(-1));
        assert_eq!(m.get_u32("a").unwrap(), 7);
        assert!(m.get_u32("b").is_err());
        assert_eq!(m.get_i64("b").unwrap(), -1);
    }
}
