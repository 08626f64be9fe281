//! Workspace-level end-to-end and parity tests live in `tests/`.
