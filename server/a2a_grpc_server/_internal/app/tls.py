"""Transport security: TLS and mTLS for the gRPC and HTTP ports, with certificate rotation.

``TlsFiles`` names the PEM files (``serve --tls-cert --tls-key [--tls-client-ca]``).
``TlsFiles.grpc_credentials()`` gives grpcio *dynamic* server credentials:
at each new connection's handshake grpcio asks ``CertificateWatch.fetch``
whether the files changed (one ``stat`` each), and a rotated certificate is
served from the next connection on, without a restart (meshes rotate them
hourly). With a client CA, clients must present a certificate it signed.
``CertificateWatch.http_context()`` gives the HTTP port (agent card,
metrics) the same certificate, checked for changes in each handshake.

Who runs what: ``fetch`` runs on grpcio's threads and the HTTP handshake
check on the event loop; both read the files only when their modification
time or size changed.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

logger = logging.getLogger(__name__.replace("._internal", ""))


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_mtime_ns, status.st_size


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of this server's certificate (and, for mTLS, its clients' CA).

    Attributes:
        cert: The certificate chain.
        key: Its private key.
        client_ca: CA certificates that sign client certificates; when set,
            clients must present one (mTLS).
    """

    cert: Path
    key: Path
    client_ca: Path | None = None

    def check(self) -> None:
        """Read every file once and load them into a TLS context.

        Raises:
            ValueError: A file is missing or is not what it should be, saying which.
        """
        for path in (self.cert, self.key, *([self.client_ca] if self.client_ca else [])):
            if not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        try:
            self.http_context()
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"TLS files {self.cert} / {self.key} cannot be used: {exc}") from exc

    def http_context(self) -> ssl.SSLContext:
        """A server TLS context for the HTTP port."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass
class CertificateWatch:
    """Serves ``files`` and picks up new versions of them (see the module docstring)."""

    files: TlsFiles
    _stamps: tuple[tuple[int, int], ...] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _http: ssl.SSLContext | None = None
    _http_stamps: tuple[tuple[int, int], ...] = ()
    reloads: int = 0
    """Times a changed certificate was picked up."""

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Dynamic gRPC server credentials over ``files``."""
        self._stamps = self._read_stamps()
        credentials: grpc.ServerCredentials = grpc.dynamic_ssl_server_credentials(  # type: ignore[no-untyped-call]
            self._configuration(),
            self.fetch,
            require_client_authentication=self.files.client_ca is not None,
        )
        return credentials

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new certificate configuration if the files changed since, else None."""
        try:
            with self._lock:
                stamps = self._read_stamps()
                if stamps == self._stamps:
                    return None
                configuration = self._configuration()
                self._stamps = stamps
                self.reloads += 1
        except (OSError, ValueError) as exc:  # half-written during a rotation: next time
            logger.warning("TLS files could not be read (%s); serving the previous ones", exc)
            return None
        logger.info("TLS certificate changed: new connections get the new one")
        return configuration

    def http_context(self) -> ssl.SSLContext:
        """The HTTP port's TLS context: each handshake gets the current certificate.

        Its SNI callback (which runs in every handshake, before the
        certificate is chosen) swaps in a context made from the files as they
        are when they changed.
        """
        if self._http is None:
            self._http = self._new_http_context()
            self._http_stamps = self._read_stamps()
        return self._http

    def _new_http_context(self) -> ssl.SSLContext:
        context = self.files.http_context()
        context.sni_callback = self._handshake
        return context

    def _handshake(
        self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        try:
            stamps = self._read_stamps()
            if stamps != self._http_stamps:
                self._http = self._new_http_context()
                self._http_stamps = stamps
        except (OSError, ssl.SSLError) as exc:  # half-written during a rotation: next time
            logger.warning("TLS files could not be reloaded for HTTP (%s)", exc)
        if self._http is not None and self._http is not context:
            connection.context = self._http

    def _read_stamps(self) -> tuple[tuple[int, int], ...]:
        files = self.files
        paths = [files.cert, files.key, *([files.client_ca] if files.client_ca else [])]
        return tuple(_stamp(path) for path in paths)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        files = self.files
        key, cert = files.key.read_bytes(), files.cert.read_bytes()
        if not key.strip() or not cert.strip():
            raise ValueError("an empty certificate or key file")
        roots = files.client_ca.read_bytes() if files.client_ca is not None else None
        configuration: grpc.ServerCertificateConfiguration = (
            grpc.ssl_server_certificate_configuration([(key, cert)], roots)  # type: ignore[no-untyped-call]
        )
        return configuration


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind) is reachable only from this machine."""
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
