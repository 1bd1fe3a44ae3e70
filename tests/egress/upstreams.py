"""Recording upstreams for the egress tests: HTTP and HTTPS servers on 127.0.0.1 that keep what
they received, and a throwaway CA whose certificate the proxy trusts for them."""

from __future__ import annotations

import datetime
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    scheme: str
    port: int
    server: ThreadingHTTPServer
    received: list[Received] = field(default_factory=list)

    def raw(self) -> bytes:
        """Everything received, as one blob: what a leak check searches."""
        out = b""
        for r in self.received:
            out += f"{r.method} {r.path}\n".encode()
            out += "".join(f"{k}: {v}\n" for k, v in r.headers.items()).encode()
            out += r.body + b"\n"
        return out


def _handler(up: Upstream) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            up.received.append(Received(self.command, self.path, dict(self.headers), body))
            if self.path.startswith("/big/"):
                size = int(self.path.split("/")[2])
                payload = b"x" * size
            else:
                payload = f"{up.scheme} upstream ok: {self.command} {self.path}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Set-Cookie", "session=upstream-cookie")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _serve

        def log_message(self, *args: object) -> None:
            pass

    return H


def start_upstream(scheme: str, tls_ctx: ssl.SSLContext | None = None) -> Upstream:
    up = Upstream(scheme, 0, None)  # type: ignore[arg-type]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(up))
    srv.daemon_threads = True
    if tls_ctx is not None:
        srv.socket = tls_ctx.wrap_socket(srv.socket, server_side=True)
    up.server, up.port = srv, srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return up


@dataclass
class TestCA:
    ca_pem: Path
    server_ctx: ssl.SSLContext


def make_ca(directory: Path, names: list[str]) -> TestCA:
    """A CA and one server certificate for `names`, valid for a day."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "codedojo egress test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
        )  # fmt: skip
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .add_extension(x509.ExtendedKeyUsage([x509.OID_SERVER_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_pem = directory / "upstream-ca.pem"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = directory / "upstream-cert.pem"
    chain.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(chain)
    return TestCA(ca_pem, ctx)
