//! A hash for fingerprints that must not change between builds or daemon upgrades (scratch
//! shards are found again by them), unlike the standard library's `DefaultHasher`.

/// Stable 64-bit FNV-1a, for fingerprints that survive daemon upgrades.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
