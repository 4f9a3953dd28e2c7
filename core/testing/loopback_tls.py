"""TLS on loopback for benchmarks and tests: a private CA and a server certificate, made at run time.

Uses ``cryptography`` (no certificate leaves the temporary directory). The server gets
``certfile``/``keyfile`` (uvicorn's ``ssl_certfile``/``ssl_keyfile``); clients verify it
with :attr:`LoopbackTLS.client_context`, which trusts only that CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoopbackTLS", "make_loopback_tls"]


@dataclass(frozen=True)
class LoopbackTLS:
    certfile: Path
    keyfile: Path
    cafile: Path

    @property
    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts only this CA (hostname checking on)."""
        return ssl.create_default_context(cafile=str(self.cafile))


def make_loopback_tls(directory: Path) -> LoopbackTLS:
    """Write a CA and a certificate for ``127.0.0.1``/``localhost`` (valid one day) into ``directory``.

    Raises:
        ImportError: ``cryptography`` is not installed.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loopstack loopback CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(names, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    tls = LoopbackTLS(directory / "server.pem", directory / "server.key", directory / "ca.pem")
    tls.certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tls.keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    tls.cafile.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return tls
