//! Shared plumbing for the command-line tools.

pub mod synth;
