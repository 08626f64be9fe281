//! Validation shared by the op families: input counts, types, shapes, device alignment and
//! the kernels' `int` range. A family's own rules stay in its module; what two families
//! both need lives here, so no family reaches into another for a helper.
//!
//! Two pairs differ only in the wording of their error (kept as they were when they lived in
//! separate families): [`arity`] / [`expect_inputs`] and [`as_i32`] / [`dim_i32`].

use crate::OpError;
use crate::gpu::DeviceTensor;
use crate::tensor::{DType, HostTensor, TensorMeta};

/// The number of inputs, or a shape error naming the op.
pub(crate) fn arity(op: &'static str, inputs: &[&TensorMeta], n: usize) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::shape(
            op,
            format!("expects {n} inputs, got {}", inputs.len()),
        ));
    }
    Ok(())
}

/// Refuses an input whose type is not `want`.
pub(crate) fn want_dtype(
    op: &'static str,
    what: &str,
    meta: &TensorMeta,
    want: DType,
) -> Result<(), OpError> {
    if meta.dtype != want {
        return Err(OpError::shape(
            op,
            format!("{what} must be {want}, found {meta}"),
        ));
    }
    Ok(())
}

pub(crate) fn expect_inputs(
    op: &'static str,
    inputs: &[&TensorMeta],
    n: usize,
) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::shape(
            op,
            format!("takes {n} inputs, got {}", inputs.len()),
        ));
    }
    Ok(())
}

pub(crate) fn expect(
    op: &'static str,
    what: &str,
    m: &TensorMeta,
    dtype: DType,
    shape: &[usize],
) -> Result<(), OpError> {
    if m.dtype != dtype || m.shape != shape {
        return Err(OpError::shape(
            op,
            format!(
                "{what} must be {}, found {m}",
                TensorMeta::new(shape, dtype)
            ),
        ));
    }
    Ok(())
}

pub(crate) fn nonzero(op: &'static str, params: &[(&str, usize)]) -> Result<(), OpError> {
    for (name, v) in params {
        if *v == 0 {
            return Err(OpError::shape(op, format!("{name} must be > 0")));
        }
    }
    Ok(())
}

/// A weight of `shape` in any stored type whose rows are whole blocks.
pub(crate) fn expect_weight(
    op: &'static str,
    what: &str,
    m: &TensorMeta,
    shape: &[usize],
) -> Result<(), OpError> {
    if m.shape != shape || m.dtype == DType::I32 || m.bytes().is_none() {
        return Err(OpError::shape(
            op,
            format!("{what} must be a weight of shape {shape:?} with whole-block rows, found {m}"),
        ));
    }
    Ok(())
}

/// Refuses a device address the kernel's 16-byte vector accesses cannot use.
pub(crate) fn aligned16(op: &'static str, what: &str, t: &DeviceTensor<'_>) -> Result<(), OpError> {
    if !t.ptr.is_multiple_of(16) {
        return Err(OpError::Type(format!(
            "{op}: {what} at device address {:#x} is not 16-byte aligned",
            t.ptr
        )));
    }
    Ok(())
}

/// A dimension as the `int` the kernels take (the MLA and MoE ops' wording of [`as_i32`]).
pub(crate) fn dim_i32(op: &'static str, what: &str, v: usize) -> Result<i32, OpError> {
    i32::try_from(v).map_err(|_| OpError::shape(op, format!("{what} {v} does not fit an i32")))
}

/// The stored bytes of a weight view, checked against its metadata.
pub(crate) fn weight_bytes<'a>(t: &HostTensor<'a>) -> Result<&'a [u8], OpError> {
    let need = t
        .meta
        .bytes()
        .ok_or_else(|| OpError::Type(format!("{} rows are not whole blocks", t.meta)))?;
    t.data.get(..need).ok_or_else(|| {
        OpError::Type(format!(
            "{} needs {need} bytes, buffer has {}",
            t.meta,
            t.data.len()
        ))
    })
}

/// A launch dimension or size as the kernels' `int`, or a shape error naming it.
pub(crate) fn as_i32(op: &'static str, what: &str, v: usize) -> Result<i32, OpError> {
    i32::try_from(v)
        .map_err(|_| OpError::shape(op, format!("{what} = {v} exceeds the kernels' i32 range")))
}

/// The refusal of an op whose CUDA kernel was never chosen.
pub(crate) fn unlowered(op: &'static str) -> OpError {
    OpError::shape(
        op,
        "no CUDA kernel chosen: plans for a GPU are lowered first (graph::lower)",
    )
}
