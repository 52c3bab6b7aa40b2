//! The control plane's certificates, generated in-process: one CA that signs the apiserver's
//! serving certificate and every client certificate, plus the service-account signing key.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// What can go wrong creating or writing certificates.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// rcgen refused the parameters (a bug in this module).
    #[error("generating {what}: {source}")]
    Generate {
        /// Which certificate or key.
        what: String,
        /// rcgen's reason.
        source: rcgen::Error,
    },
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A PEM certificate with its PEM private key.
#[derive(Clone, Debug)]
pub struct CertifiedKey {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM (PKCS#8).
    pub key_pem: String,
}

/// The control plane's certificate authority and service-account key.
pub struct Pki {
    ca_key: KeyPair,
    ca_params: CertificateParams,
    ca_pem: String,
    service_account_key: KeyPair,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

fn generate(what: &str) -> impl Fn(rcgen::Error) -> PkiError + '_ {
    move |source| PkiError::Generate {
        what: what.to_string(),
        source,
    }
}

impl Pki {
    /// Creates a fresh CA and service-account key.
    pub fn new() -> Result<Self, PkiError> {
        let ca_key = KeyPair::generate().map_err(generate("CA key"))?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(generate("CA"))?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "pmem-csi testenv CA");
        ca_params.distinguished_name = dn;
        let ca_pem = ca_params
            .self_signed(&ca_key)
            .map_err(generate("CA"))?
            .pem();
        let service_account_key = KeyPair::generate().map_err(generate("service-account key"))?;
        Ok(Self {
            ca_key,
            ca_params,
            ca_pem,
            service_account_key,
        })
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A serving certificate for 127.0.0.1 and localhost, plus `extra_dns` names.
    pub fn serving(&self, name: &str, extra_dns: &[&str]) -> Result<CertifiedKey, PkiError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(generate(name))?;
        let mut sans = vec![
            SanType::IpAddress([127, 0, 0, 1].into()),
            SanType::DnsName("localhost".try_into().map_err(generate(name))?),
        ];
        for dns in extra_dns {
            sans.push(SanType::DnsName((*dns).try_into().map_err(generate(name))?));
        }
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(name, params, &[])
    }

    /// A client certificate for user `user` in `groups` (at most one group: rcgen keeps one
    /// value per subject attribute, and every identity here needs at most one).
    pub fn client(&self, user: &str, group: Option<&str>) -> Result<CertifiedKey, PkiError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(generate(user))?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let mut subject = vec![(DnType::CommonName, user)];
        if let Some(group) = group {
            subject.push((DnType::OrganizationName, group));
        }
        self.sign(user, params, &subject)
    }

    fn sign(
        &self,
        what: &str,
        mut params: CertificateParams,
        subject: &[(DnType, &str)],
    ) -> Result<CertifiedKey, PkiError> {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, what);
        for (ty, value) in subject {
            dn.push(ty.clone(), *value);
        }
        params.distinguished_name = dn;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let key = KeyPair::generate().map_err(generate(what))?;
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer).map_err(generate(what))?;
        Ok(CertifiedKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes the CA, the service-account key pair and the apiserver's serving pair into `dir`
    /// and returns their paths.
    pub fn write_control_plane_files(&self, dir: &Path) -> Result<ControlPlaneFiles, PkiError> {
        let serving = self.serving("kube-apiserver", &["kubernetes", "kubernetes.default"])?;
        let files = ControlPlaneFiles {
            ca: dir.join("ca.crt"),
            apiserver_cert: dir.join("apiserver.crt"),
            apiserver_key: dir.join("apiserver.key"),
            service_account_public: dir.join("sa.pub"),
            service_account_private: dir.join("sa.key"),
        };
        for (path, contents) in [
            (&files.ca, self.ca_pem.clone()),
            (&files.apiserver_cert, serving.cert_pem),
            (&files.apiserver_key, serving.key_pem),
            (
                &files.service_account_public,
                self.service_account_key.public_key_pem(),
            ),
            (
                &files.service_account_private,
                self.service_account_key.serialize_pem(),
            ),
        ] {
            std::fs::write(path, contents).map_err(|source| PkiError::Write {
                path: path.clone(),
                source,
            })?;
        }
        Ok(files)
    }
}

/// Paths of the files [`Pki::write_control_plane_files`] wrote.
#[derive(Clone, Debug)]
pub struct ControlPlaneFiles {
    /// CA certificate.
    pub ca: PathBuf,
    /// kube-apiserver serving certificate.
    pub apiserver_cert: PathBuf,
    /// kube-apiserver serving key.
    pub apiserver_key: PathBuf,
    /// Service-account verification key.
    pub service_account_public: PathBuf,
    /// Service-account signing key.
    pub service_account_private: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_certificate_carries_user_and_group() {
        let pki = Pki::new().expect("pki");
        let admin = pki.client("admin", Some("system:masters")).expect("client");
        assert!(admin.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(admin.key_pem.contains("PRIVATE KEY"));
        // The subject's strings appear verbatim in the DER.
        let der = pem_body(&admin.cert_pem);
        assert!(contains(&der, b"admin"));
        assert!(contains(&der, b"system:masters"));
    }

    #[test]
    fn serving_certificate_has_loopback_san() {
        let pki = Pki::new().expect("pki");
        let serving = pki.serving("x", &["extra.example"]).expect("serving");
        let der = pem_body(&serving.cert_pem);
        assert!(contains(&der, &[127, 0, 0, 1]));
        assert!(contains(&der, b"localhost"));
        assert!(contains(&der, b"extra.example"));
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    fn pem_body(text: &str) -> Vec<u8> {
        pem::parse(text).expect("valid PEM").into_contents()
    }
}
