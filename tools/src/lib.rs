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
