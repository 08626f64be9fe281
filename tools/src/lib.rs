//! Shared plumbing for the command-line tools.

pub mod load;
pub mod synth;

use std::path::PathBuf;

/// Where generated checkpoints and compiled kernels are cached:
/// `$XING4_CACHE_DIR`, else `$XDG_CACHE_HOME/xing4-rt`, else `~/.cache/xing4-rt`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XING4_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("xing4-rt");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/xing4-rt"),
        None => std::env::temp_dir().join("xing4-rt"),
    }
}

/// Bump when the synthetic generator changes what it writes, so cached checkpoints are remade.
const DEFAULT_CHECKPOINT_VERSION: u32 = 1;

/// The embedded default: the `small` synthetic Xing4.0 checkpoint, made on first use
/// and cached. Its weights are random.
pub fn default_checkpoint() -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join(format!(
        "models/xing4_0-small-v{DEFAULT_CHECKPOINT_VERSION}"
    ));
    if synth::FILES.iter().all(|f| dir.join(f).is_file()) {
        return Ok(dir);
    }
    eprintln!(
        "making the small synthetic checkpoint once, in {}",
        dir.display()
    );
    let opts = synth::SynthOptions {
        arch: loader::hparams::Arch::Xing4_0,
        dims: synth::Dims::preset(synth::Preset::Small),
        seed: 0,
        out: dir.clone(),
        force: true,
        progress: true,
    };
    synth::write_checkpoint(&opts)?;
    Ok(dir)
}
