//! Mutual shared-secret authentication of a handshake: HMAC-SHA256 over a
//! running hash of every frame exchanged, with fresh nonces from both sides.
//!
//! Each side proves it holds the key by a MAC of the transcript so far under
//! its own label, so a proof cannot be reflected back, replayed into another
//! handshake (the other side's nonce differs), or spliced onto altered
//! frames (the final `Ready` MACs cover the QP numbers and region
//! descriptors too).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce and of a MAC.
pub const PROOF_LEN: usize = 32;

/// Shortest key accepted: 32 bytes. Keys are meant to be random bytes (say
/// `head -c 32 /dev/urandom > key`), not passwords: a peer that gets one
/// proof (a rogue server a client connects to, say) can try guesses offline.
pub const MIN_KEY_LEN: usize = 32;

/// Largest key file read.
const MAX_KEY_FILE: u64 = 4096;

/// The environment variable the tools read a key from when no
/// `--auth-key-file` is given.
pub const AUTH_KEY_ENV: &str = "RDMA_COMM_AUTH_KEY";

/// A shared secret both sides of a session must hold. Cheap to clone; the
/// bytes never appear in `Debug` output.
#[derive(Clone)]
pub struct AuthKey(Arc<[u8]>);

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AuthKey({} bytes)", self.0.len())
    }
}

impl AuthKey {
    /// A key of at least [`MIN_KEY_LEN`] bytes.
    pub fn new(bytes: &[u8]) -> Result<Self> {
        if bytes.len() < MIN_KEY_LEN {
            return Err(Error::InvalidArgument(
                "an authentication key needs at least 32 bytes (one trailing newline of a key file or variable does not count)",
            ));
        }
        Ok(Self(bytes.into()))
    }

    /// A fresh random key of [`MIN_KEY_LEN`] bytes: for a server and its
    /// clients in one process, or to write a key file from.
    pub fn random() -> Result<Self> {
        let mut bytes = [0; MIN_KEY_LEN];
        getrandom::fill(&mut bytes).map_err(|err| Error::Os {
            what: "reading random bytes for a key",
            source: std::io::Error::other(err.to_string()),
        })?;
        Self::new(&bytes)
    }

    /// Reads a key file: its bytes, without one trailing newline. The file
    /// must not be readable or writable by group or others (`chmod 600`),
    /// and at most 4 KiB.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let path = path.as_ref();
        let refused = |what, source| Error::KeyFile {
            path: path.to_path_buf(),
            what,
            source,
        };
        let unreadable = |source| refused("cannot be read", Some(source));
        let file = std::fs::File::open(path).map_err(unreadable)?;
        let mode = file.metadata().map_err(unreadable)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(refused(
                "accessible to group or others (chmod 600 it)",
                None,
            ));
        }
        let mut bytes = Vec::new();
        file.take(MAX_KEY_FILE + 1)
            .read_to_end(&mut bytes)
            .map_err(unreadable)?;
        if bytes.len() as u64 > MAX_KEY_FILE {
            return Err(refused("larger than 4 KiB", None));
        }
        Self::new(strip_newline(&bytes)).map_err(|err| match err {
            Error::InvalidArgument(what) => refused(what, None),
            other => other,
        })
    }

    /// Reads a key from the environment variable `name`: `None` when it is
    /// not set.
    pub fn from_env(name: &str) -> Result<Option<Self>> {
        match std::env::var_os(name) {
            None => Ok(None),
            Some(value) => Self::new(strip_newline(value.as_encoded_bytes())).map(Some),
        }
    }

    /// What the tools do: the file when one is given, otherwise
    /// [`AUTH_KEY_ENV`] when set, otherwise no key.
    pub fn from_file_or_env(path: Option<&Path>) -> Result<Option<Self>> {
        match path {
            Some(path) => Self::from_file(path).map(Some),
            None => Self::from_env(AUTH_KEY_ENV),
        }
    }

    fn mac(&self, label: &[u8], transcript: &[u8; PROOF_LEN]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(label);
        mac.update(transcript);
        mac
    }

    /// The proof `label` gives over `transcript`.
    pub(crate) fn prove(&self, label: &[u8], transcript: &[u8; PROOF_LEN]) -> [u8; PROOF_LEN] {
        self.mac(label, transcript).finalize().into_bytes().into()
    }

    /// Checks a proof in constant time.
    pub(crate) fn verify(
        &self,
        label: &[u8],
        transcript: &[u8; PROOF_LEN],
        proof: &[u8; PROOF_LEN],
    ) -> bool {
        self.mac(label, transcript).verify_slice(proof).is_ok()
    }
}

fn strip_newline(bytes: &[u8]) -> &[u8] {
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    bytes.strip_suffix(b"\r").unwrap_or(bytes)
}

/// A running SHA-256 of every frame of one handshake, in order, both ways.
#[derive(Clone, Default)]
pub(crate) struct Transcript(Sha256);

impl Transcript {
    pub(crate) fn add(&mut self, frame: &[u8]) {
        // Length-prefixed, so frame boundaries are part of what is hashed.
        self.0.update((frame.len() as u64).to_le_bytes());
        self.0.update(frame);
    }

    pub(crate) fn digest(&self) -> [u8; PROOF_LEN] {
        self.0.clone().finalize().into()
    }
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Result<[u8; PROOF_LEN]> {
    let mut nonce = [0; PROOF_LEN];
    getrandom::fill(&mut nonce).map_err(|err| Error::Os {
        what: "reading random bytes for a handshake nonce",
        source: std::io::Error::other(err.to_string()),
    })?;
    Ok(nonce)
}

/// Labels of the proofs: who proves, and at which step.
pub(crate) mod label {
    pub(crate) const CLIENT: &[u8] = b"rdma-comm-core v2 client proof";
    pub(crate) const SERVER: &[u8] = b"rdma-comm-core v2 server proof";
    pub(crate) const CLIENT_OFFER: &[u8] = b"rdma-comm-core v2 client offer";
    pub(crate) const SERVER_ACCEPT: &[u8] = b"rdma-comm-core v2 server accept";
    pub(crate) const CLIENT_READY: &[u8] = b"rdma-comm-core v2 client ready";
    pub(crate) const SERVER_READY: &[u8] = b"rdma-comm-core v2 server ready";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rcc-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        std::fs::write(&path, [7u8; 32]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let refusal = AuthKey::from_file(&path).expect_err("a world-readable key file");
        assert!(
            refusal.to_string().contains(&path.display().to_string()),
            "{refusal}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(AuthKey::from_file(&path).is_ok());
        std::fs::write(&path, [7u8; 20]).unwrap();
        let short = AuthKey::from_file(&path).expect_err("a 20-byte key");
        assert!(
            matches!(&short, Error::KeyFile { source: None, .. }),
            "{short:?}"
        );
        assert!(
            short.to_string().contains(&path.display().to_string()),
            "{short}"
        );
        let missing = dir.join("missing");
        let unreadable = AuthKey::from_file(&missing).expect_err("no such file");
        assert_eq!(unreadable.errno(), Some(libc::ENOENT));
        assert!(unreadable.to_string().contains("missing"), "{unreadable}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn proofs_depend_on_key_label_and_transcript() {
        let key = AuthKey::new(&[7; 32]).unwrap();
        let other = AuthKey::new(&[8; 32]).unwrap();
        let mut transcript = Transcript::default();
        transcript.add(b"hello");
        let digest = transcript.digest();
        let proof = key.prove(label::CLIENT, &digest);
        assert!(key.verify(label::CLIENT, &digest, &proof));
        assert!(!other.verify(label::CLIENT, &digest, &proof));
        assert!(!key.verify(label::SERVER, &digest, &proof), "reflected");
        transcript.add(b"more");
        assert!(!key.verify(label::CLIENT, &transcript.digest(), &proof));
    }

    #[test]
    fn frame_boundaries_are_hashed() {
        let mut a = Transcript::default();
        a.add(b"ab");
        a.add(b"c");
        let mut b = Transcript::default();
        b.add(b"a");
        b.add(b"bc");
        assert_ne!(a.digest(), b.digest());
    }

    #[test]
    fn short_keys_are_refused_and_debug_hides_the_bytes() {
        assert!(AuthKey::new(&[1; 31]).is_err());
        let key = AuthKey::new(&[1; 33]).unwrap();
        assert_eq!(format!("{key:?}"), "AuthKey(33 bytes)");
        assert_eq!(strip_newline(b"0123456789abcdef\n"), b"0123456789abcdef");
    }
}
