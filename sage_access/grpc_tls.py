"""Mutual TLS for the ledger's ML Metadata gRPC service: who may write the ledger over a network.

Anyone who can call the service can rewrite every balance (set a block's `spent` back to 0 and
it pays again), so off the loopback interface the server (grpc_server.py) accepts only clients
holding a certificate signed by the ledger's own certificate authority, and clients accept only
a server holding one. ML Metadata's standard client supports exactly this in its config
(`MetadataStoreClientConfig.ssl_config`: `custom_ca` = the CA to check the server with,
`client_key` and `server_cert` = the client's own key and certificate chain, all PEM text; it
has no way to send a token), so a plain MLMD client connects with `client_config` below.

    python -m sage_tfx.sage_access.grpc_tls DIR --name ledger.example.org [--name 10.0.0.5]

writes DIR/server (ca.pem, server.pem, server.key: for `grpc_server --tls DIR/server`) and
DIR/client (ca.pem, client.pem, client.key: for `grpc://HOST:PORT?tls=DIR/client`), private
(0600 files in 0700 directories). Each --name is a DNS name or IP address clients use to reach
the server (the server certificate's subject alternative names; TLS checks the one connected to).
The CA's private key is not kept: to admit another client, or to revoke one, make a new set.
Certificates are valid for VALIDITY_DAYS.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from typing import Sequence

from sage_tfx.private_files import open_private, private_directory

CA_FILE = "ca.pem"
SERVER_FILES = (CA_FILE, "server.pem", "server.key")
CLIENT_FILES = (CA_FILE, "client.pem", "client.key")
VALIDITY_DAYS = 365


def _read(directory: str, names: Sequence[str], what: str) -> list[bytes]:
    missing = [name for name in names if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise ValueError(f"{what} {directory!r} lacks {', '.join(missing)}: it must hold "
                         f"{', '.join(names)} (made by `python -m sage_tfx.sage_access.grpc_tls`)")
    contents = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as handle:
            contents.append(handle.read())
    return contents


def server_credentials(directory: str):
    """gRPC server credentials from a server directory: its certificate, and every client must
    present one signed by the CA (require_client_auth)."""
    import grpc

    ca, certificate, key = _read(directory, SERVER_FILES, "TLS server directory")
    return grpc.ssl_server_credentials([(key, certificate)], root_certificates=ca,
                                       require_client_auth=True)


def client_config(host: str, port: int, directory: str, timeout_seconds: int):
    """ML Metadata's standard client config for a server behind mutual TLS, from a client
    directory (`MetadataStore(client_config(...))` is a plain MLMD client)."""
    from ml_metadata.proto import metadata_store_pb2

    ca, certificate, key = _read(directory, CLIENT_FILES, "TLS client directory")
    config = metadata_store_pb2.MetadataStoreClientConfig(
        host=host, port=port, client_timeout_sec=timeout_seconds)
    # MLMD's names: server_cert is the certificate chain the client presents.
    config.ssl_config.custom_ca = ca.decode("ascii")
    config.ssl_config.client_key = key.decode("ascii")
    config.ssl_config.server_cert = certificate.decode("ascii")
    return config


def make_certificates(directory: str, names: Sequence[str]) -> tuple[str, str]:
    """A new CA, a server certificate for `names` and a client certificate, written under
    `directory` (see the module's docstring); returns (server directory, client directory).
    FileExistsError if either holds a file of the set already."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not names:
        raise ValueError("give at least one --name: the host name or address clients connect to")
    alternative = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(subject: str, key, issuer_name, issuer_key, extensions):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS)))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sage-tfx ledger CA")])
    ca = issue("sage-tfx ledger CA", ca_key, ca_name, ca_key,
               [(x509.BasicConstraints(ca=True, path_length=0), True),
                (x509.KeyUsage(digital_signature=False, content_commitment=False,
                               key_encipherment=False, data_encipherment=False,
                               key_agreement=False, key_cert_sign=True, crl_sign=True,
                               encipher_only=False, decipher_only=False), True)])
    leaves = {}
    for role, usage, extra in (
            ("server", ExtendedKeyUsageOID.SERVER_AUTH,
             [(x509.SubjectAlternativeName(alternative), False)]),
            ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [])):
        key = ec.generate_private_key(ec.SECP256R1())
        leaves[role] = (issue(f"sage-tfx ledger {role}", key, ca_name, ca_key,
                              [(x509.BasicConstraints(ca=False, path_length=None), True),
                               (x509.ExtendedKeyUsage([usage]), False), *extra]), key)

    def pem(certificate) -> bytes:
        return certificate.public_bytes(serialization.Encoding.PEM)

    written = []
    for role, files in (("server", SERVER_FILES), ("client", CLIENT_FILES)):
        target = private_directory(os.path.join(directory, role))
        certificate, key = leaves[role]
        contents = (pem(ca), pem(certificate), key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        for name, content in zip(files, contents):
            with open_private(os.path.join(target, name), exclusive=True) as out:
                out.write(content)
        written.append(target)
    return written[0], written[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write server/ and client/")
    parser.add_argument("--name", action="append", default=[], required=True,
                        help="a DNS name or IP address clients reach the server by (repeat)")
    args = parser.parse_args(argv)
    try:
        server, client = make_certificates(args.directory, args.name)
    except (ValueError, FileExistsError) as error:
        print(f"grpc_tls: {error}", file=sys.stderr)
        return 2
    print(f"server: {server}\nclient: {client}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
