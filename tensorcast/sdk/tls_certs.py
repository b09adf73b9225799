"""A local certificate authority for `tc up --tls`: one CA, and one certificate (server and client
use) for every process of the local cluster, `tc` commands included, valid for this host's
names. Written to STATE_DIR/tls as ca.pem, cert.pem and key.pem (the keys mode 0600)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from pathlib import Path

from tensorcast.config import TLS_DIR, TLSFiles

VALID_DAYS = 825


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def issue(
    folder: Path,
    ca_files: tuple[Path, Path] | None = None,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
    hosts: tuple[str, ...] = ("127.0.0.1", "::1", "localhost"),
) -> TLSFiles:
    """Write cert.pem/key.pem signed by the CA in `ca_files` (ca.pem, ca-key.pem), or by a new CA
    written to `folder` as well. Validity defaults to now .. VALID_DAYS from now."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start = not_before or now - datetime.timedelta(minutes=5)
    end = not_after or now + datetime.timedelta(days=VALID_DAYS)
    if ca_files is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tensorcast local CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        _write(folder / "ca.pem", ca_pem)
        _write(
            folder / "ca-key.pem",
            ca_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            private=True,
        )
        ca_files = (folder / "ca.pem", folder / "ca-key.pem")
    else:
        ca_cert = x509.load_pem_x509_certificate(ca_files[0].read_bytes())
        ca_key = serialization.load_pem_private_key(ca_files[1].read_bytes(), None)  # type: ignore[assignment]
    names: list[x509.GeneralName] = [x509.DNSName(socket.gethostname())]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tensorcast")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    _write(folder / "cert.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(
        folder / "key.pem",
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    if ca_files[0] != folder / "ca.pem":
        _write(folder / "ca.pem", Path(ca_files[0]).read_bytes())
    return TLSFiles(str(folder / "ca.pem"), str(folder / "cert.pem"), str(folder / "key.pem"))


def local_cluster_tls(state_dir: Path) -> TLSFiles:
    """STATE_DIR/tls, created on first use (a CA and a certificate for this host)."""
    folder = state_dir / TLS_DIR
    if (folder / "ca.pem").exists() and (folder / "cert.pem").exists():
        return TLSFiles(str(folder / "ca.pem"), str(folder / "cert.pem"), str(folder / "key.pem"))
    return issue(folder)
