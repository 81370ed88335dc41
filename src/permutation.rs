//! A seeded permutation of `0..n` that is never materialised: a Feistel network over the
//! smallest power of four at least `n`, cycle-walked back into `0..n` (Black and Rogaway,
//! "Ciphers with Arbitrary Finite Domains", 2002). Both directions cost a few rounds of
//! arithmetic: `at(p)` is the sample at position p of an epoch's order, `position(s)` where
//! sample s comes in it. It holds 32 bytes whatever `n` is.

/// Rounds of the network: Luby-Rackoff needs 4 for a pseudo-random permutation; more mix the
/// small domains (a few hundred samples) the tests look at as well as the large ones.
const ROUNDS: u64 = 8;

/// A bijection of `0..n` keyed by a 64-bit key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permutation {
    n: u64,
    key: u64,
    /// Bits of each half of the network's domain (2 * half bits in all).
    half: u32,
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Permutation {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Permutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        Permutation {
            n,
            key: mix(key ^ 0x2545_F491_4F6C_DD1D),
            half: bits.div_ceil(2).max(1),
        }
    }

    pub fn len(&self) -> u64 {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    #[inline]
    fn round(&self, r: u64, x: u64) -> u64 {
        mix(self.key
            ^ r.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ x.wrapping_mul(0xD6E8_FEB8_6659_FD93))
            & self.mask()
    }

    #[inline]
    fn mask(&self) -> u64 {
        (1u64 << self.half) - 1
    }

    /// One pass of the network over the whole domain (0..4^half).
    #[inline]
    fn forward(&self, x: u64) -> u64 {
        let (mut l, mut r) = (x >> self.half, x & self.mask());
        for k in 0..ROUNDS {
            (l, r) = (r, l ^ self.round(k, r));
        }
        (l << self.half) | r
    }

    /// `forward`'s inverse.
    #[inline]
    fn backward(&self, y: u64) -> u64 {
        let (mut l, mut r) = (y >> self.half, y & self.mask());
        for k in (0..ROUNDS).rev() {
            (l, r) = (r ^ self.round(k, l), l);
        }
        (l << self.half) | r
    }

    /// The sample at position `p` (p < n). The domain is under 4n, so the walk takes fewer
    /// than four steps on average.
    #[inline]
    pub fn at(&self, p: u64) -> u64 {
        debug_assert!(p < self.n);
        let mut y = self.forward(p);
        while y >= self.n {
            y = self.forward(y);
        }
        y
    }

    /// Where sample `s` comes (s < n): `at`'s inverse.
    #[inline]
    pub fn position(&self, s: u64) -> u64 {
        debug_assert!(s < self.n);
        let mut x = self.backward(s);
        while x >= self.n {
            x = self.backward(x);
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_is_a_bijection_with_its_inverse() {
        for n in (1..300).chain([1023, 1024, 1025, 4097, 65_536, 100_003]) {
            let p = Permutation::new(n, n * 7 + 1);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let s = p.at(i);
                assert!(
                    s < n && !seen[s as usize],
                    "n {n}: {s} twice or out of range"
                );
                seen[s as usize] = true;
                assert_eq!(p.position(s), i, "n {n}");
            }
        }
    }

    #[test]
    fn keys_give_different_orders() {
        let n = 10_000;
        let (a, b) = (Permutation::new(n, 1), Permutation::new(n, 2));
        let same = (0..n).filter(|&i| a.at(i) == b.at(i)).count();
        // Two independent permutations agree at about one position.
        assert!(same < 10, "{same} positions agree");
    }

    /// Where each sample lands is uniform: over many keys, a chi-square test of the position of
    /// a few samples in 16 buckets, and of neighbours staying neighbours.
    #[test]
    fn positions_are_uniform_over_keys() {
        let n = 1000u64;
        let keys = 4000u64;
        for s in [0, 1, 499, 998, 999] {
            let mut buckets = [0u64; 16];
            for key in 0..keys {
                buckets[(Permutation::new(n, key).position(s) * 16 / n) as usize] += 1;
            }
            let expect = keys as f64 / 16.0;
            let chi2: f64 = buckets
                .iter()
                .map(|&c| (c as f64 - expect).powi(2) / expect)
                .sum();
            // 15 degrees of freedom: p = 0.001 at 37.7.
            assert!(chi2 < 37.7, "sample {s}: chi2 {chi2:.1}, {buckets:?}");
        }
        // Consecutive positions hold samples that were not consecutive.
        let p = Permutation::new(100_000, 9);
        let adjacent = (1..100_000)
            .filter(|&i| p.at(i).abs_diff(p.at(i - 1)) == 1)
            .count();
        assert!(adjacent < 20, "{adjacent} neighbours kept");
    }

    #[test]
    fn sizes_up_to_two_to_the_64_work() {
        for n in [u32::MAX as u64 + 3, 1 << 40, u64::MAX] {
            let p = Permutation::new(n, 5);
            for i in [0, 1, n / 2, n - 1] {
                assert_eq!(p.position(p.at(i)), i);
            }
        }
    }
}
