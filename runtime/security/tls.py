"""TLS where traffic leaves the host: the deployment's own CA, its certificates, and SSL contexts.

`ito-training certs` (and `secrets`, `up --tls`, which call `Certs.ensure`) write, under
`<secrets dir>/tls/` (0700):
- `ca.pem` / `ca.key`: the deployment's CA (ECDSA P-256, CA_VALID_DAYS). `ca.pem` is what clients
  verify the servers with (`ecc ito login --ca`, ITO_NATS_CA, a scraper's `ca_file`);
- `server.pem` / `server.key`: the servers' certificate (NATS client and route listeners, the
  desk, every `/metrics`), signed by the CA, for the names in `server_names` (the compose service
  names, localhost, 127.0.0.1, ::1, and any `--san`). It is good for clientAuth too: NATS routes
  present it to each other (mutual TLS, `verify: true`);
- `metrics.pem` / `metrics.key`: the services' `/metrics` listeners' certificate (serverAuth only),
  for loopback and the services' own names (`metrics_names`): a service container holds it instead
  of the server key, so a service that leaks its files cannot pose as NATS or the desk;
- `client.pem` / `client.key`: a client certificate signed by the CA, for a scraper or a proxy that
  should authenticate with mutual TLS (none requires it by default: NATS clients authenticate
  with their NKey, HTTP clients with a bearer token).

Every file is written 0600 (O_EXCL; replaced atomically on rotation). `rotate` keeps the CA and
issues new server and client certificates: clients that trust `ca.pem` need nothing new.
"""

import datetime
import ipaddress
import os
import pathlib
import ssl
from dataclasses import dataclass

from runtime.security.secrets import read_private, write_once

TLS_DIR = "tls"
CA_CERT, CA_KEY = "ca.pem", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client.key"
METRICS_CERT, METRICS_KEY = "metrics.pem", "metrics.key"
CA_VALID_DAYS = 3650  # the CA outlives many rotations of the leaves; replacing it means re-login
LEAF_VALID_DAYS = 397  # a year and a month: rotate yearly (`certs --rotate`) with time to spare
CONTAINER_DIR = "/run/secrets/tls"  # where compose mounts them (compose.yaml's `tls/...` targets)
CA_NAME = "ito-training CA"
CLUSTER_NODES = 3  # the compose profile's nats-1..3 and service instances -1, -2
INSTANCES = 2

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class CertError(Exception):
    """A certificate file is missing, unreadable or not what it should be (the path, no content)."""


def server_names(extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The names the server certificate is valid for: loopback, every name compose.yaml gives a
    server (nats, nats-1..3, desk, each service and its cluster instances), then `extra` (the
    public host name clients dial). Order kept, duplicates dropped."""
    from contracts.subjects import SERVICES

    names = [*LOOPBACK_NAMES, "nats", *(f"nats-{i + 1}" for i in range(CLUSTER_NODES)), "desk"]
    for service in SERVICES:
        names += [service, *(f"{service}-{i + 1}" for i in range(INSTANCES))]
    names += [n.strip() for n in extra if n.strip()]
    return list(dict.fromkeys(names))


def metrics_names() -> list[str]:
    """The names the metrics certificate is valid for: loopback and every service and cluster
    instance compose.yaml names (what Prometheus and the healthchecks dial); not NATS, not the desk."""
    from contracts.subjects import SERVICES

    names = list(LOOPBACK_NAMES)
    for service in SERVICES:
        names += [service, *(f"{service}-{i + 1}" for i in range(INSTANCES))]
    return list(dict.fromkeys(names))


def _general_names(names: list[str]) -> list:
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _builder(subject: str, issuer, public_key, days: int):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(
            issuer
            if isinstance(issuer, x509.Name)
            else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])
        )
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer's clock a little behind
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def new_ca() -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(CA_NAME, CA_NAME, key.public_key(), CA_VALID_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(
    ca_pem: bytes,
    ca_key_pem: bytes,
    common_name: str,
    names: list[str],
    server: bool,
    server_only: bool = False,
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by the CA: for `names` (SANs); a server certificate is
    good for serverAuth and clientAuth (NATS routes dial each other with it) unless `server_only`,
    a client one for clientAuth only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH]
        if server_only
        else [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        _builder(common_name, ca.subject, key.public_key(), LEAF_VALID_DAYS)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_general_names(names)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _replace(path: pathlib.Path, data: bytes) -> None:
    """`path` atomically replaced by a new 0600 file holding `data`."""
    tmp = path.with_suffix(path.suffix + ".new")
    tmp.unlink(missing_ok=True)
    write_once(tmp, data)
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class Certs:
    """The certificate files under one directory (`<secrets dir>/tls`)."""

    root: pathlib.Path

    @property
    def ca(self) -> pathlib.Path:
        return self.root / CA_CERT

    @property
    def ca_key(self) -> pathlib.Path:
        return self.root / CA_KEY

    @property
    def server_cert(self) -> pathlib.Path:
        return self.root / SERVER_CERT

    @property
    def server_key(self) -> pathlib.Path:
        return self.root / SERVER_KEY

    @property
    def client_cert(self) -> pathlib.Path:
        return self.root / CLIENT_CERT

    @property
    def client_key(self) -> pathlib.Path:
        return self.root / CLIENT_KEY

    @property
    def metrics_cert(self) -> pathlib.Path:
        return self.root / METRICS_CERT

    @property
    def metrics_key(self) -> pathlib.Path:
        return self.root / METRICS_KEY

    def files(self) -> list[pathlib.Path]:
        return [
            self.ca,
            self.ca_key,
            self.server_cert,
            self.server_key,
            self.client_cert,
            self.client_key,
            self.metrics_cert,
            self.metrics_key,
        ]

    def ensure(self, extra_names: tuple[str, ...] | list[str] = ()) -> list[pathlib.Path]:
        """Whatever is missing: the CA, then certificates signed by it. Existing files are kept
        (rotation is explicit); returns what it wrote."""
        written: list[pathlib.Path] = []
        if not self.ca.exists():
            if self.ca_key.exists():
                raise CertError(f"{self.ca_key} exists without {self.ca}: remove it or restore the CA")
            cert, key = new_ca()
            write_once(self.ca_key, key)
            write_once(self.ca, cert)
            written += [self.ca, self.ca_key]
        if not (self.server_cert.exists() and self.server_key.exists()):
            written += self._issue_server(extra_names)
        if not (self.client_cert.exists() and self.client_key.exists()):
            written += self._issue_client()
        if not (self.metrics_cert.exists() and self.metrics_key.exists()):
            written += self._issue_metrics()
        return written

    def rotate(self, extra_names: tuple[str, ...] | list[str] = ()) -> list[pathlib.Path]:
        """New server and client certificates (new keys) from the same CA; the CA is kept."""
        if not self.ca.exists():
            raise CertError(f"no CA in {self.root}: run `ito-training certs` first")
        return self._issue_server(extra_names) + self._issue_client() + self._issue_metrics()

    def _ca_pair(self) -> tuple[bytes, bytes]:
        return self.ca.read_bytes(), read_private(self.ca_key)

    def _issue_server(self, extra_names: tuple[str, ...] | list[str]) -> list[pathlib.Path]:
        cert, key = issue(*self._ca_pair(), "ito-training server", server_names(extra_names), server=True)
        _replace(self.server_key, key)  # the key first: a reader never pairs a new cert with an old key
        _replace(self.server_cert, cert)
        return [self.server_cert, self.server_key]

    def _issue_client(self) -> list[pathlib.Path]:
        cert, key = issue(*self._ca_pair(), "ito-training client", [], server=False)
        _replace(self.client_key, key)
        _replace(self.client_cert, cert)
        return [self.client_cert, self.client_key]

    def _issue_metrics(self) -> list[pathlib.Path]:
        cert, key = issue(
            *self._ca_pair(), "ito-training metrics", metrics_names(), server=True, server_only=True
        )
        _replace(self.metrics_key, key)
        _replace(self.metrics_cert, cert)
        return [self.metrics_cert, self.metrics_key]

    def metrics_files(self) -> tuple[str, str]:
        """(certificate, key) paths for a service's HTTPS `/metrics`; refused when missing or unsafe
        (`ito-training certs` writes what is missing)."""
        for path in (self.metrics_cert, self.metrics_key):
            read_private(path)
        return str(self.metrics_cert), str(self.metrics_key)

    def server_files(self) -> tuple[str, str]:
        """(certificate, key) paths for a TLS listener; refused when either is missing or unsafe."""
        for path in (self.server_cert, self.server_key):
            read_private(path)  # raises SecretError naming the file
        return str(self.server_cert), str(self.server_key)


def client_context(cafile: str | pathlib.Path) -> ssl.SSLContext:
    """A client context that trusts only `cafile` and checks the server's name (TLS 1.2 at least)."""
    try:
        context = ssl.create_default_context(cafile=str(cafile))
    except (OSError, ssl.SSLError) as exc:
        raise CertError(
            f"the CA file {cafile} cannot be read as a PEM certificate ({type(exc).__name__})"
        ) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def names_in(cert_pem: bytes) -> list[str]:
    """The SANs of a certificate, as strings (DNS names and IP addresses)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [
        *sans.get_values_for_type(x509.DNSName),
        *(str(ip) for ip in sans.get_values_for_type(x509.IPAddress)),
    ]
