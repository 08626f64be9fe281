//! CPU references of the linear ops.

use super::{Linear, LinearPair, NormLinear};
use crate::cpu::matmul;
use crate::op::check_host;
use crate::tensor::{HostTensor, HostTensorMut};
use crate::{Op, OpError};

impl Linear {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (x, w) = (&inputs[0], &inputs[1]);
        let (n, n_in, n_out) = (x.meta.shape[0], x.meta.shape[1], w.meta.shape[0]);
        matmul(
            w.data,
            w.meta.dtype,
            n_out,
            n_in,
            x.f32()?,
            n,
            outputs[0].f32_mut()?,
        )
    }
}

impl LinearPair {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (first, second) = outputs.split_at_mut(1);
        Linear::default().cpu(&inputs[..2], first)?;
        Linear::default().cpu(&[inputs[0], inputs[2]], second)
    }
}

impl NormLinear {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let meta = inputs[0].meta.clone();
        let mut normed = crate::AlignedBuf::zeroed(meta.numel() * 4);
        crate::norm::rms_norm_rows(
            inputs[0].f32()?,
            Some(inputs[1].f32()?),
            meta.shape[1],
            self.eps,
            normed.f32s_mut(),
        );
        Linear::default().cpu(
            &[HostTensor::new(&meta, normed.bytes()), inputs[2]],
            outputs,
        )
    }
}
