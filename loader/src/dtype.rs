//! Storage types of GGUF tensors (ggml type ids) and their block geometry.

use std::fmt;

/// A ggml tensor storage type that this runtime can read.
///
/// The discriminant is the ggml type id written in a GGUF tensor info.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q8_0 = 8,
    Q6_K = 14,
    IQ4_NL = 20,
    BF16 = 30,
}

impl GgmlType {
    pub const ALL: [GgmlType; 6] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::BF16,
    ];

    /// The type for a ggml type id, or `None` for ids this runtime does not read.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| *t as u32 == id)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// Values per block (1 for plain float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 | GgmlType::IQ4_NL => 32,
            GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::IQ4_NL => 18,
            GgmlType::Q6_K => 210,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of a row of `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        Some(n / self.block_size() * self.block_bytes())
    }

    /// The name ggml prints for this type.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::IQ4_NL => "IQ4_NL",
            GgmlType::BF16 => "BF16",
        }
    }

    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip_and_unknown_ids_are_refused() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(2), None);
    }

    #[test]
    fn row_bytes_match_the_spec_sizes() {
        assert_eq!(GgmlType::IQ4_NL.row_bytes(3584), Some(2016));
        assert_eq!(GgmlType::Q6_K.row_bytes(3584), Some(14 * 210));
        assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
    }
}
