//! Shared plumbing for the command-line tools.
