//! The one deterministic generator of the op tests: the GPU tests (`ops/tests/`), this crate's
//! unit tests and the parity registry's cases all draw from it, so a seed names the same values
//! everywhere and no test needs a random-number dependency.

/// Marsaglia's xorshift64 (shifts 13, 7, 17). A zero state would stay zero, so build it with
/// [`Rng::new`] (which sets the low bit) or from an odd seed.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The generator for `seed` (low bit set, so every seed is a valid state).
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The high 32 bits of the next value.
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in [lo, hi): 24 random bits.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }

    /// `n` values of [`Rng::uniform`].
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Uniform in [-1, 1), computed as `bits/2²³ − 1` (the same values as `uniform(-1.0, 1.0)`).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values of [`Rng::unit`].
    pub fn unit_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }

    /// `n` values uniform in [-mag, mag), computed as `(bits/2²⁴·2 − 1)·mag`.
    pub fn signed_vec(&mut self, n: usize, mag: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * mag)
            .collect()
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// `k` distinct ids below `n`, as a router picks them (`k ≤ n`).
    pub fn distinct(&mut self, k: usize, n: usize) -> Vec<i32> {
        assert!(k <= n, "{k} distinct ids below {n}");
        let mut v: Vec<i32> = Vec::with_capacity(k);
        while v.len() < k {
            let e = self.below(n) as i32;
            if !v.contains(&e) {
                v.push(e);
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn unit_and_uniform_draw_the_same_values() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        for _ in 0..1000 {
            assert_eq!(a.unit().to_bits(), b.uniform(-1.0, 1.0).to_bits());
        }
    }

    #[test]
    fn a_seed_names_one_sequence() {
        let mut r = Rng::new(1);
        assert_eq!(r.next_u64(), 1082269761);
        let v = Rng::new(9).vec(100, -2.0, 3.0);
        assert!(v.iter().all(|x| (-2.0..3.0).contains(x)));
        assert_eq!(v, Rng::new(9).vec(100, -2.0, 3.0));
    }
}
