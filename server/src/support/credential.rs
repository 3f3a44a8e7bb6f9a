//! Session credentials and secrets.
//!
//! A join hands the worker a credential, `issue(secret, worker)`: the HMAC-SHA256 of its worker
//! id under the run's secret (32 random bytes drawn when the server starts), in hex. The worker
//! puts it in every Hello, and a shard admits the Hello only if `verify` says it is that
//! worker's: a connection cannot speak as another worker, and the server keeps no table of
//! credentials. Comparisons run in constant time (`hmac`'s `verify_slice`, [`token_eq`]).
//!
//! [`Secret`] holds a secret string (the join token) and never prints it.

/// Shortest run secret accepted (bytes), for `--run-secret` of `serve` and `shard`.
pub const MIN_SECRET: usize = 16;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// The credential of `worker` under `secret`: 64 lowercase hex digits.
pub fn issue(secret: &[u8], worker: u64) -> String {
    let tag = mac(secret, worker).finalize().into_bytes();
    tag.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `cred` is the credential of `worker` under `secret` (constant time in the tag).
pub fn verify(secret: &[u8], worker: u64, cred: &str) -> bool {
    let Some(tag) = unhex(cred) else {
        return false;
    };
    mac(secret, worker).verify_slice(&tag).is_ok()
}

/// The token a coordinator shows its shard processes (`Authorization: Bearer`, on their
/// `GET /api/feed`): the HMAC-SHA256 under the run secret of a label no worker id can
/// produce, in hex. Only holders of the run secret can take a shard's feed.
pub fn coordinator_token(secret: &[u8]) -> String {
    let mut m = keyed(secret);
    m.update(b"crowdgrad coordinator");
    let tag = m.finalize().into_bytes();
    tag.iter().map(|b| format!("{b:02x}")).collect()
}

fn keyed(secret: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    <HmacSha256 as Mac>::new_from_slice(secret).unwrap_or_else(|_| {
        <HmacSha256 as Mac>::new_from_slice(&[0u8; 32]).expect("HMAC accepts 32-byte keys")
    })
}

fn mac(secret: &[u8], worker: u64) -> HmacSha256 {
    let mut m = keyed(secret);
    m.update(b"crowdgrad worker ");
    m.update(&worker.to_le_bytes());
    m
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// A fresh run secret: 32 bytes from the operating system's random source.
///
/// # Errors
/// When the OS has no randomness to give (the server must not run with a guessable secret).
pub fn run_secret() -> std::io::Result<[u8; 32]> {
    let mut s = [0u8; 32];
    getrandom::fill(&mut s).map_err(|e| std::io::Error::other(format!("no OS randomness: {e}")))?;
    Ok(s)
}

/// A run's secret (32 random bytes; `Debug` prints `<redacted>`).
#[derive(Clone)]
pub struct RunSecret([u8; 32]);

impl RunSecret {
    /// A fresh secret from the OS ([`run_secret`]).
    ///
    /// # Errors
    /// When the OS has no randomness to give.
    pub fn generate() -> std::io::Result<Self> {
        run_secret().map(Self)
    }

    /// The secret shared by a coordinator and its shard processes (`--run-secret`): the
    /// SHA-256 of the text, so every process given the same text derives the same secret.
    pub fn shared(text: &str) -> Self {
        Self(Sha256::digest(text.as_bytes()).into())
    }

    /// The secret's bytes (to hand to [`crate::shard::Shard::require_credential`]).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The credential of `worker` ([`issue`]).
    pub fn issue(&self, worker: u64) -> String {
        issue(&self.0, worker)
    }

    /// Whether `cred` is `worker`'s ([`verify`]).
    pub fn verify(&self, worker: u64, cred: &str) -> bool {
        verify(&self.0, worker, cred)
    }
}

impl std::fmt::Debug for RunSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Whether two tokens are equal, in time independent of where they differ. Both are hashed
/// first, so the time does not depend on the expected token's length either.
pub fn token_eq(given: &str, expected: &str) -> bool {
    let (a, b) = (Sha256::digest(given), Sha256::digest(expected));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// A secret string (a join token): `Debug` prints `<redacted>`, so configs can derive `Debug`
/// and be logged without leaking it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `s`.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// Whether `given` is this secret (constant time, [`token_eq`]).
    pub fn matches(&self, given: &str) -> bool {
        token_eq(given, &self.0)
    }

    /// The secret itself (to send it, never to print it).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_is_its_workers_only() {
        let secret = [7u8; 32];
        let c = issue(&secret, 3);
        assert_eq!(c.len(), 64);
        assert!(verify(&secret, 3, &c));
        assert!(!verify(&secret, 4, &c), "another worker's id");
        assert!(!verify(&[8u8; 32], 3, &c), "another run's secret");
        assert!(!verify(&secret, 3, &c[..62]), "truncated");
        assert!(!verify(&secret, 3, ""), "empty");
        assert!(!verify(&secret, 3, &"zz".repeat(32)), "not hex");
        let mut flipped = c.clone().into_bytes();
        flipped[10] = if flipped[10] == b'0' { b'1' } else { b'0' };
        assert!(!verify(&secret, 3, &String::from_utf8(flipped).unwrap()));
        assert!(verify(&secret, 3, &c.to_uppercase()), "hex in either case");
        assert_ne!(issue(&secret, 3), issue(&secret, 4));
    }

    #[test]
    fn tokens_compare_and_never_print() {
        assert!(token_eq("s3cret", "s3cret"));
        assert!(!token_eq("s3cret", "s3creT"));
        assert!(!token_eq("", "s3cret"));
        let s = Secret::new("hunter2");
        assert!(s.matches("hunter2") && !s.matches("hunter3"));
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_ne!(run_secret().unwrap(), run_secret().unwrap());
    }
}
