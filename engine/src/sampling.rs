//! Token sampling on the host: greedy, temperature, top-k, top-p, min-p and a
//! repetition penalty, reproducible from a seed. The draw itself is `ops::head::sample_row`,
//! the reference of the op a step runs to choose tokens where it ran: the host takes the rows
//! that need their logits rewritten first (a penalty, a bias, a grammar's mask).

use ops::head::{RowSampling, sample_row};

/// How the next token is chosen from a logits row.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// 0.0 means no min-p cut.
    pub min_p: f32,
    /// 1.0 means no penalty (llama.cpp / HF semantics: positive logits divided, negative multiplied).
    pub repetition_penalty: f32,
    pub seed: u64,
    /// Added to the logit of each id before anything else (OpenAI's `logit_bias`): -100 all
    /// but bans a token, +100 all but forces it. Ids must be in the vocabulary (the caller
    /// checks); values in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// The argmax of the raw logits.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.on_device()
    }

    /// Whether a step can choose the token where it ran (`ops::head::PenalizeRows` over the
    /// ids seen so far, then `ops::head::SampleRows`): everything but a logit bias.
    pub fn on_device(&self) -> bool {
        self.logit_bias.is_empty()
    }

    /// A field outside its range, named as an API request would name it.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b)))
        {
            return Err(format!(
                "logit_bias values must be in [-100, 100], got {b} for token {id}"
            ));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// The distinct ids of a sequence's tokens in the order first seen: what the repetition
/// penalty applies to, kept as tokens are added instead of sorted again every step.
#[derive(Clone, Debug, Default)]
pub struct SeenTokens {
    set: std::collections::HashSet<u32>,
    ids: Vec<u32>,
}

impl SeenTokens {
    pub fn new(tokens: &[u32]) -> SeenTokens {
        let mut s = SeenTokens::default();
        s.extend(tokens);
        s
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            if self.set.insert(t) {
                self.ids.push(t);
            }
        }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// splitmix64: small, fast, and the same sequence on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// First index of the largest value; NaN never wins.
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}

/// Stateful sampler: holds the RNG so a seeded generation is reproducible.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token's row parameters for a step that chooses it where it runs, drawing its
    /// uniform as [`Self::sample`] would (one draw a sampled token, none a greedy one), so a
    /// seed gives the same tokens whichever side chooses.
    pub fn device_row(&mut self) -> RowSampling {
        let p = &self.params;
        if p.temperature <= 0.0 {
            return RowSampling::GREEDY;
        }
        RowSampling {
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            ..RowSampling::at_temperature(p.temperature, self.rng.next_f64() as f32)
        }
    }

    /// Chooses a token from `logits`, penalising ids in `history`.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut row: Vec<f32> = logits.to_vec();
        for &(id, b) in &p.logit_bias {
            if let Some(v) = row.get_mut(id as usize) {
                *v += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(v) = row.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
        }
        let rp = self.device_row();
        if rp.scale <= 0.0 {
            return argmax(&row) as u32;
        }
        // No finite candidate (a mask or bias that left none): the argmax, as greedy would.
        sample_row(&row, &rp).map_or_else(|| argmax(&row) as u32, |t| t as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.0, 2.0, 2.0, f32::NAN], &[]), 1);
    }

    #[test]
    fn the_repetition_penalty_can_move_the_argmax() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(p);
        assert_eq!(s.sample(&[1.0, 1.5, -3.0], &[1]), 0);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens_and_cuts_are_respected() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            seed: 7,
            ..SamplingParams::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..100).map(|_| s.sample(&logits, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..100).map(|_| s.sample(&logits, &[])).collect()
        };
        assert_eq!(a, b);
        let mut sorted: Vec<usize> = (0..50).collect();
        sorted.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        let top5 = &sorted[..5];
        assert!(a.iter().all(|t| top5.contains(&(*t as usize))));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
    }

    #[test]
    fn min_p_and_top_p_keep_only_the_head() {
        let logits = [10.0f32, 9.9, 0.0, -1.0];
        for p in [
            SamplingParams {
                temperature: 1.0,
                min_p: 0.5,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(p);
            for _ in 0..200 {
                assert!(s.sample(&logits, &[]) < 2);
            }
        }
    }

    #[test]
    fn a_top_p_head_longer_than_the_first_sorted_block_is_found_whole() {
        // 1,000 near-equal candidates and a long tail of weak ones: top_p 0.9 keeps about 900
        // of the strong ones, more than the first sorted block of 64.
        let mut logits = vec![-30.0f32; 131_072];
        for (i, v) in logits.iter_mut().take(1000).enumerate() {
            *v = 5.0 + (i as f32) * 1e-4;
        }
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let seen: std::collections::HashSet<u32> =
            (0..1500).map(|_| s.sample(&logits, &[])).collect();
        assert!(
            seen.iter().all(|&t| (90..1000).contains(&t)),
            "a cut token was drawn"
        );
        assert!(seen.len() > 500, "only {} distinct tokens", seen.len());
    }

    #[test]
    fn without_cuts_tokens_are_drawn_in_proportion_to_their_probability() {
        let logits = [2.0f32.ln(), 1.0f32.ln(), f32::NEG_INFINITY, 1.0f32.ln()];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..Default::default()
        });
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        // Expected 10,000 / 5,000 / 5,000; the bounds are > 6 standard deviations wide.
        assert!((9_550..10_450).contains(&counts[0]), "{counts:?}");
        assert!((4_600..5_400).contains(&counts[1]), "{counts:?}");
        assert!((4_600..5_400).contains(&counts[3]), "{counts:?}");
    }

    #[test]
    fn a_logit_bias_moves_the_argmax_and_out_of_range_values_are_refused() {
        let p = SamplingParams {
            logit_bias: vec![(2, 5.0)],
            ..SamplingParams::greedy()
        };
        assert!(!p.is_plain_greedy());
        assert_eq!(Sampler::new(p).sample(&[1.0, 3.0, -1.0], &[]), 2);
        let bad = SamplingParams {
            logit_bias: vec![(0, 101.0)],
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("logit_bias"));
    }

    #[test]
    fn out_of_range_values_are_refused_by_name() {
        let p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("top_p"));
    }
}
