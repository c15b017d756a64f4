"""Test certificates for mutual TLS between the gateway and engine pods, and between pods."""

from __future__ import annotations

from datetime import datetime, timedelta, UTC
from pathlib import Path


def write_test_certs(folder: Path, server_name: str) -> dict[str, str]:
    """A CA; an engine pod's certificate for ``server_name`` (for serving and,
    as the operator's single internal certificate is, for dialling peer pods);
    a client certificate; and a client certificate of another CA. PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(UTC)

    def issue(cn, issuer=None, *, usage=None, dns=None):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (name, key)
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
        if issuer is None:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False), critical=True)
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if dns is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256()), key

    def write(stem, pair):
        cert, key = pair
        (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca, rogue_ca = issue("tessera-test-ca"), issue("rogue-ca")
    write("ca", ca)
    write("server", issue("engine", ca, usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                          dns=server_name))
    write("client", issue("gateway", ca, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]))
    write("rogue", issue("rogue", rogue_ca, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]))
    return {name: str(folder / name) for name in ("ca.crt", "server.crt", "server.key", "client.crt",
                                                    "client.key", "rogue.crt", "rogue.key")}
