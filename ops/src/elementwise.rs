//! Element-wise ops on f32 activations (`swiglu`, `add`), and the input/output
//! check the CPU references of this crate's ops share.

use rayon::prelude::*;

use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::op::check_host;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

/// Chunk of elements handed to one rayon task by the element-wise ops.
const ELEMS_PER_TASK: usize = 1 << 14;

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

/// `out = silu(gate) · up` with `silu(z) = z / (1 + e^{−z})` (ggml's form; a
/// very negative gate gives −0, never NaN).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(gate.par_chunks(ELEMS_PER_TASK))
        .zip(up.par_chunks(ELEMS_PER_TASK))
        .for_each(|((o, g), u)| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
}

/// `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(a.par_chunks(ELEMS_PER_TASK))
        .zip(b.par_chunks(ELEMS_PER_TASK))
        .for_each(|((o, a), b)| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

/// Shape rule shared by the two binary element-wise ops: two F32 tensors of one shape.
fn same_shape_f32(op: &'static str, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
    arity(op, inputs, 2)?;
    let (a, b) = (inputs[0], inputs[1]);
    want_dtype(op, "first input", a, DType::F32)?;
    want_dtype(op, "second input", b, DType::F32)?;
    if a.shape.is_empty() {
        return Err(OpError::shape(
            op,
            "inputs must have at least one dimension",
        ));
    }
    if a.shape != b.shape {
        return Err(OpError::shape(
            op,
            format!("inputs must have one shape, found {a} and {b}"),
        ));
    }
    Ok(vec![TensorMeta::f32(a.shape.clone())])
}

/// `silu(gate) · up`, both F32 of one shape (`[n, F]`); the product stays f32
/// because it is what grows past f16 in a loud expert (seed §2).
#[derive(Debug, Clone, PartialEq)]
pub struct SwiGlu;

impl Op for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        same_shape_f32(self.name(), inputs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (g, u) = (inputs[0].f32()?, inputs[1].f32()?);
        swiglu(g, u, outputs[0].f32_mut()?);
        Ok(())
    }

    fn describe(&self) -> String {
        "swiglu".to_string()
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        launch_binary(ctx, "swiglu_f32", inputs, outputs)
    }
}

pub(crate) const ELEMENTWISE_CU: &str = include_str!("../kernels/elementwise.cu");

/// One thread an element over two f32 inputs of one shape.
fn launch_binary(
    ctx: &GpuCtx,
    kernel: &str,
    inputs: &[DeviceTensor<'_>],
    outputs: &[DeviceTensor<'_>],
) -> Result<(), OpError> {
    let (a, b, out) = match (inputs, outputs) {
        ([a, b], [out]) => (a, b, out),
        _ => return Err(OpError::shape("elementwise", "two inputs and one output")),
    };
    let n = out.meta.numel();
    let k = ctx.kernel("elementwise.cu", ELEMENTWISE_CU, kernel)?;
    // SAFETY: three f32 buffers of n elements (shapes checked by infer); the kernel is
    // grid-stride over n and the executor keeps the buffers alive until it runs.
    unsafe {
        ctx.device
            .launch(&k)
            .grid(blocks_for(n, 256).min(4096))
            .block(256)
            .arg(a.ptr)
            .arg(b.ptr)
            .arg(out.ptr)
            .arg(n as i64)
            .enqueue()
            .map_err(dev_err)
    }
}

/// `a + b`, both F32 of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Add;

impl Op for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        same_shape_f32(self.name(), inputs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (a, b) = (inputs[0].f32()?, inputs[1].f32()?);
        add(a, b, outputs[0].f32_mut()?);
        Ok(())
    }

    fn describe(&self) -> String {
        "add".to_string()
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        launch_binary(ctx, "add_f32", inputs, outputs)
    }
}

/// Owned, 4-byte-aligned tensor storage for this crate's unit tests.
#[cfg(test)]
pub(crate) mod testkit {
    use super::*;

    #[derive(Debug)]
    pub(crate) struct Owned {
        pub meta: TensorMeta,
        words: Vec<u32>,
        len: usize,
    }

    impl Owned {
        pub fn from_bytes(meta: TensorMeta, bytes: &[u8]) -> Self {
            let mut words = vec![0u32; bytes.len().div_ceil(4)];
            for (w, c) in words.iter_mut().zip(bytes.chunks(4)) {
                let mut b = [0u8; 4];
                b[..c.len()].copy_from_slice(c);
                *w = u32::from_le_bytes(b);
            }
            Owned {
                meta,
                words,
                len: bytes.len(),
            }
        }

        pub fn f32(shape: impl Into<Vec<usize>>, v: &[f32]) -> Self {
            let meta = TensorMeta::f32(shape);
            assert_eq!(meta.numel(), v.len(), "test data does not fill {meta}");
            Owned {
                meta,
                words: v.iter().map(|x| x.to_bits()).collect(),
                len: v.len() * 4,
            }
        }

        pub fn i32(shape: impl Into<Vec<usize>>, v: &[i32]) -> Self {
            let meta = TensorMeta::i32(shape);
            assert_eq!(meta.numel(), v.len(), "test data does not fill {meta}");
            Owned {
                meta,
                words: v.iter().map(|x| *x as u32).collect(),
                len: v.len() * 4,
            }
        }

        /// Output storage poisoned with NaN (f32) or i32::MIN, so an element the
        /// op forgets to write shows.
        pub fn poisoned(meta: TensorMeta) -> Self {
            let bytes = meta.bytes().expect("test output of whole blocks");
            let fill = if meta.dtype == DType::I32 {
                i32::MIN as u32
            } else {
                f32::NAN.to_bits()
            };
            Owned {
                meta,
                words: vec![fill; bytes.div_ceil(4)],
                len: bytes,
            }
        }

        fn bytes(&self) -> &[u8] {
            // SAFETY: u32 storage viewed as its own bytes; `len` never exceeds them.
            unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
        }

        pub fn view(&self) -> HostTensor<'_> {
            HostTensor::new(&self.meta, self.bytes())
        }

        pub fn view_mut(&mut self) -> HostTensorMut<'_> {
            // SAFETY: as in `bytes`, through an exclusive borrow of the words.
            let data = unsafe {
                std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len)
            };
            HostTensorMut::new(&self.meta, data)
        }

        pub fn to_f32(&self) -> Vec<f32> {
            self.view().f32().expect("an F32 tensor").to_vec()
        }

        pub fn to_i32(&self) -> Vec<i32> {
            self.view().i32().expect("an I32 tensor").to_vec()
        }
    }

    /// Infers the outputs, poisons them and runs the CPU reference.
    pub(crate) fn run(op: &dyn Op, inputs: &[&Owned]) -> Result<Vec<Owned>, OpError> {
        let metas: Vec<&TensorMeta> = inputs.iter().map(|t| &t.meta).collect();
        let mut outs: Vec<Owned> = op.infer(&metas)?.into_iter().map(Owned::poisoned).collect();
        let views: Vec<HostTensor<'_>> = inputs.iter().map(|t| t.view()).collect();
        let mut out_views: Vec<HostTensorMut<'_>> = outs.iter_mut().map(|o| o.view_mut()).collect();
        op.cpu(&views, &mut out_views)?;
        drop(out_views);
        Ok(outs)
    }

    /// Metadata-only shape check, for refusal tests.
    pub(crate) fn infer(op: &dyn Op, metas: &[TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        op.infer(&refs)
    }

    /// A small deterministic generator, so tests need no extra dependency.
    pub(crate) struct Lcg(pub u64);

    impl Lcg {
        pub fn next_u32(&mut self) -> u32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) as u32
        }

        /// Uniform in [lo, hi).
        pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
            lo + (hi - lo) * (self.next_u32() as f32 / (1u64 << 31) as f32)
        }

        pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
            (0..n).map(|_| self.uniform(lo, hi)).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;

    #[test]
    fn swiglu_is_silu_of_the_gate_times_up_against_f64() {
        let mut r = Lcg(1);
        let (n, f) = (3, 37);
        let g = r.vec(n * f, -20.0, 20.0);
        let u = r.vec(n * f, -5.0, 5.0);
        let out = run(&SwiGlu, &[&Owned::f32([n, f], &g), &Owned::f32([n, f], &u)]).unwrap();
        for ((o, &g), &u) in out[0].to_f32().iter().zip(&g).zip(&u) {
            let (g, u) = (g as f64, u as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (*o as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
                "{o} vs {want}"
            );
        }
    }

    #[test]
    fn swiglu_of_a_very_negative_gate_is_zero_not_nan() {
        let out = run(
            &SwiGlu,
            &[
                &Owned::f32([1, 2], &[-1e4, -200.0]),
                &Owned::f32([1, 2], &[3.0, 3.0]),
            ],
        )
        .unwrap();
        assert_eq!(out[0].to_f32(), vec![0.0, 0.0]);
    }

    #[test]
    fn swiglu_keeps_a_product_beyond_the_f16_range() {
        // silu(300)·300 = 9e4 > 65504: the seed's overflow, which must stay finite here.
        let out = run(
            &SwiGlu,
            &[&Owned::f32([1, 1], &[300.0]), &Owned::f32([1, 1], &[300.0])],
        )
        .unwrap();
        assert_eq!(out[0].to_f32(), vec![90000.0]);
    }

    #[test]
    fn add_sums_elementwise() {
        let out = run(
            &Add,
            &[
                &Owned::f32([2, 2], &[1.0, 2.0, 3.0, 1e30]),
                &Owned::f32([2, 2], &[0.5, -2.0, 1e5, 1e30]),
            ],
        )
        .unwrap();
        assert_eq!(out[0].to_f32(), vec![1.5, 0.0, 100003.0, 2e30]);
    }

    #[test]
    fn binary_ops_refuse_mismatched_shapes_and_non_f32_inputs() {
        for op in [&SwiGlu as &dyn Op, &Add] {
            let e = infer(op, &[TensorMeta::f32([2, 3]), TensorMeta::f32([2, 4])]).unwrap_err();
            assert!(matches!(e, OpError::Shape { .. }), "{e}");
            let e = infer(
                op,
                &[
                    TensorMeta::f32([2, 3]),
                    TensorMeta::new([2, 3], DType::BF16),
                ],
            )
            .unwrap_err();
            assert!(
                matches!(e, OpError::Shape { .. }) && e.to_string().contains("BF16"),
                "{e}"
            );
            let e = infer(op, &[TensorMeta::f32([2, 3])]).unwrap_err();
            assert!(matches!(e, OpError::Shape { .. }), "{e}");
        }
    }

    #[test]
    fn cpu_refuses_an_output_of_the_wrong_shape() {
        let a = Owned::f32([2], &[1.0, 2.0]);
        let mut o = Owned::poisoned(TensorMeta::f32([3]));
        let e = Add
            .cpu(&[a.view(), a.view()], &mut [o.view_mut()])
            .unwrap_err();
        assert!(matches!(e, OpError::Shape { op: "add", .. }), "{e}");
    }
}
