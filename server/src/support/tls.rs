//! TLS with rustls (the `ring` provider): the server's certificate and key for
//! `crowdgrad serve --tls-cert C --tls-key K`, and the native worker's client configuration
//! (webpki roots, or `--ca FILE` for a self-signed test server).
//!
//! A public deployment may instead terminate TLS in a reverse proxy (docs/deploy.md).

use crate::error::{Error, Result};
use clap::Args;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// TLS flags of `crowdgrad serve`.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// PEM certificate chain: serve https/wss directly (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// Where the server's certificate and key are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

impl TlsArgs {
    /// Both files or neither.
    ///
    /// # Errors
    /// When only one of the two flags is given.
    pub fn check(&self) -> Result<Option<TlsFiles>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            })),
            (None, None) => Ok(None),
            _ => Err(Error::Config("--tls-cert and --tls-key go together".into())),
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let bad = |m: String| Error::Config(format!("TLS certificate {}: {m}", path.display()));
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in the file".into()));
    }
    Ok(certs)
}

/// The server's TLS configuration from `files` (HTTP/1.1 only: WebSockets upgrade over it).
///
/// # Errors
/// [`Error::Config`] when a file is missing, holds no PEM certificate or key, or the key does
/// not fit the certificate.
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>> {
    let chain = certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| Error::Config(format!("TLS key {}: {e}", files.key.display())))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| Error::Config(format!("TLS certificate and key: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The worker's TLS configuration: the webpki roots, or only the certificates in `ca` when
/// given (a self-signed server's own certificate, or a private CA).
///
/// # Errors
/// [`Error::Config`] when `ca` cannot be read or holds no usable certificate.
pub fn client_config(ca: Option<&Path>) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(ca) => {
            for c in certs(ca)? {
                roots
                    .add(c)
                    .map_err(|e| Error::Config(format!("--ca {}: {e}", ca.display())))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}
