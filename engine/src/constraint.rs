//! Constrained decoding's hook: a per-sequence [`TokenConstraint`] says which tokens may come
//! next (a grammar, a JSON schema); the scheduler masks the sequence's logits row with it before
//! sampling and tells it the chosen token. The engine knows no grammar: the server implements
//! the trait (with llguidance). The mask of a step is computed on the host while the device runs
//! that step.

/// The tokens a sequence may take next: bit `id % 32` of `words[id / 32]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
}

impl TokenMask {
    /// A mask allowing exactly `ids` in a vocabulary of `vocab` tokens.
    pub fn of(vocab: usize, ids: &[u32]) -> TokenMask {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for &id in ids {
            if let Some(w) = words.get_mut(id as usize / 32) {
                *w |= 1 << (id % 32);
            }
        }
        TokenMask { words }
    }

    pub fn allows(&self, id: u32) -> bool {
        self.words
            .get(id as usize / 32)
            .is_some_and(|w| w & (1 << (id % 32)) != 0)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Sets every logit the mask does not allow to -inf. Fails when nothing allowed is left
    /// (every allowed id outside the row, or its logit not a number).
    pub fn apply(&self, row: &mut [f32]) -> Result<(), String> {
        let mut left = 0usize;
        for (i, v) in row.iter_mut().enumerate() {
            if self.allows(i as u32) && !v.is_nan() {
                left += 1;
            } else {
                *v = f32::NEG_INFINITY;
            }
        }
        if left == 0 {
            return Err(format!(
                "the constraint allows no token of the {}-wide logits row ({} allowed in its vocabulary)",
                row.len(),
                self.count()
            ));
        }
        Ok(())
    }
}

/// A sequence's constraint. Its state follows the tokens committed to it; the scheduler asks
/// for a mask exactly once before each token it samples for the sequence, and commits that token.
pub trait TokenConstraint: Send {
    /// The tokens allowed next; `None` when any token is (e.g. while the model reasons and the
    /// constraint applies to the answer only).
    fn next_mask(&mut self) -> Result<Option<TokenMask>, String>;

    /// The token the sequence took.
    fn commit(&mut self, token: u32) -> Result<(), String>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_leaves_only_its_tokens_finite() {
        let m = TokenMask::of(70, &[3, 33, 69]);
        let mut row = vec![1.0f32; 70];
        m.apply(&mut row).unwrap();
        let finite: Vec<usize> = (0..70).filter(|&i| row[i].is_finite()).collect();
        assert_eq!(finite, vec![3, 33, 69]);
        assert_eq!(m.count(), 3);
    }

    #[test]
    fn a_mask_that_leaves_nothing_is_an_error_not_a_token() {
        let m = TokenMask::of(100, &[80]);
        let mut row = vec![0.0f32; 64];
        assert!(m.apply(&mut row).unwrap_err().contains("allows no token"));
    }
}
