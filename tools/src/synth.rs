//! Synthetic checkpoints (make-model): (in progress)
