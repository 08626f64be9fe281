//! Deterministic random numbers without a dependency: splitmix64 and Box–Muller.

/// splitmix64 (Steele, Lea, Flood 2014): tiny state, passes BigCrush, and any seed is fine,
/// which lets every tensor row own an independent stream derived from (seed, tensor, row).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// A stream for `(seed, key, index)`: the key/index are mixed through the output function
    /// so neighbouring rows do not get overlapping sequences.
    pub fn derive(seed: u64, key: u64, index: u64) -> Self {
        let mut a = SplitMix64(seed ^ key.rotate_left(17));
        let s = a.next_u64() ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut b = SplitMix64(s);
        SplitMix64(b.next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1): never 0, so `ln` is finite.
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `[0, n)` (n > 0); the modulo bias is irrelevant for synthetic data.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Fills `out` with standard normal values (Box–Muller, both outputs of each pair used).
    pub fn fill_normal(&mut self, out: &mut [f32]) {
        let mut pairs = out.chunks_exact_mut(2);
        for p in &mut pairs {
            let (c, s) = self.normal_pair();
            p[0] = c;
            p[1] = s;
        }
        if let [last] = pairs.into_remainder() {
            *last = self.normal_pair().0;
        }
    }

    fn normal_pair(&mut self) -> (f32, f32) {
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * self.uniform()).sin_cos();
        (r * c, r * s)
    }
}

/// FNV-1a: a stable 64-bit key for a tensor name.
pub fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_values_have_unit_variance_and_zero_mean() {
        let mut v = vec![0f32; 100_001];
        SplitMix64::new(42).fill_normal(&mut v);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }

    #[test]
    fn derived_streams_differ_by_row_and_key() {
        let a = SplitMix64::derive(1, 2, 3).next_u64();
        assert_ne!(a, SplitMix64::derive(1, 2, 4).next_u64());
        assert_ne!(a, SplitMix64::derive(1, 3, 3).next_u64());
        assert_ne!(a, SplitMix64::derive(2, 2, 3).next_u64());
        assert_eq!(a, SplitMix64::derive(1, 2, 3).next_u64());
    }
}
