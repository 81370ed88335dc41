//! Fingerprints that must not change between builds or daemon upgrades (scratch shards are
//! found again by them) and that no user can make collide: 128 bits of SHA-256. A user controls
//! much of what is hashed (file names, sizes, times); with a short, non-cryptographic hash they
//! could craft a dataset whose fingerprint is another's and be served its scratch records.

use sha2::{Digest, Sha256};

/// A fingerprint: the first 128 bits of SHA-256.
pub type Fingerprint = u128;

/// The fingerprint of `parts`, each length-prefixed (so ["a", "bc"] and ["ab", "c"] differ).
pub fn fingerprint(parts: &[&[u8]]) -> Fingerprint {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let digest = h.finalize();
    u128::from_le_bytes(digest[..16].try_into().expect("SHA-256 has 32 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_stable_and_unambiguous() {
        assert_eq!(fingerprint(&[b"a", b"bc"]), fingerprint(&[b"a", b"bc"]));
        assert_ne!(fingerprint(&[b"a", b"bc"]), fingerprint(&[b"ab", b"c"]));
        assert_ne!(fingerprint(&[b"", b"a"]), fingerprint(&[b"a"]));
        // Fixed across builds and upgrades: scratch folders are named by it.
        assert_eq!(
            format!("{:032x}", fingerprint(&[b"larder"])),
            "58cc4ac4da59e28f7b4ee66555e51806"
        );
    }
}
