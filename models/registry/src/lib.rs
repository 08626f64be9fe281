//! The architecture registry: the only place that maps a GGUF `general.architecture` to its
//! declaration and its tensor table. Adding an architecture adds a line to [`declaration`] and
//! [`tensors`] and a crate under `models/`. It also holds what every architecture gets through
//! it: opening a checkpoint ([`load`]) and writing a synthetic one ([`synth`]).

mod load;
pub mod synth;

pub use load::{Loaded, load, resolve};

use anyhow::{Context, Result, bail};
use graph::ModelDecl;
use loader::gguf::{Metadata, TensorInfo};
use loader::hparams::{Arch, HParams};
use loader::release::Release;
use loader::schema::{SchemaError, TensorRule};

/// The declaration of `h`'s architecture.
pub fn declaration(h: &HParams, release: Option<&Release>) -> Result<Box<dyn ModelDecl>> {
    Ok(match h.arch {
        Arch::Deepseek2 => Box::new(deepseek2::Deepseek2::new(h.clone())),
        Arch::Xing4_0 => {
            let clamp = match release.and_then(|r| r.config.as_ref()) {
                Some(cfg) => cfg.hc_clamp(),
                None => loader::release::HcClamp::DEFAULT,
            };
            if clamp.defaulted {
                eprintln!(
                    "note: config.json gives no mhc_h_res_clamp_min/max; using ±{} as llama.cpp does",
                    xing4::DEFAULT_COMB_CLAMP
                );
            }
            if clamp.min != -clamp.max {
                bail!(
                    "config.json: mhc_h_res_clamp_min {} and mhc_h_res_clamp_max {} are not symmetric; this runtime implements the symmetric clamp of the released model",
                    clamp.min,
                    clamp.max
                );
            }
            Box::new(
                xing4::Xing4::new(h.clone(), clamp.max as f32)
                    .context("a xing4_0 header without hyper_connection keys")?,
            )
        }
    })
}

/// The tensor table of `h`'s architecture, in file order: what the schema check requires and
/// what `make-model` writes.
pub fn tensors(h: &HParams) -> Vec<TensorRule> {
    match h.arch {
        Arch::Deepseek2 => deepseek2::tensors(h),
        Arch::Xing4_0 => xing4::tensors(h),
    }
}

/// Checks a checkpoint's metadata and tensors against its architecture's schema and returns
/// its hyper-parameters ([`loader::schema::check`] with the registered tensor table).
pub fn check_schema(meta: &Metadata, tensors: &[TensorInfo]) -> Result<HParams, SchemaError> {
    loader::schema::check(meta, tensors, self::tensors)
}
