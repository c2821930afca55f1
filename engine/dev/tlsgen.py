"""Throw-away TLS material for a local secured broker (tests, `make chaos`, docs).

`generate(folder)` makes, with the `openssl` command line:

    ca.pem / ca.key          a self-signed certificate authority (PEM)
    broker.pem / broker.key  a certificate for 127.0.0.1 and localhost, signed by the CA,
                             good for TLS servers and clients (the broker uses it for
                             both: its client listener and its mutual-TLS controller link)
    broker.p12               the broker's PKCS12 keystore: its key and chain

Clients trust `ca.pem` (librdkafka `ssl.ca.location`; Java `ssl.truststore.type=PEM`).
The keystore password is random; it is passed to openssl through the environment,
never on a command line, and returned in `TlsFiles` (keep it out of logs). Private
keys are written with mode 0600. Nothing here is fit for production: the CA key
sits next to the certificates.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from refold.errors import PrerequisiteError

BROKER_SUBJECT = "/CN=refold-broker"
DAYS = 30


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The files `generate` wrote, and the keystore's password."""

    folder: Path
    keystore_password: str = field(repr=False)

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def keystore(self) -> Path:
        return self.folder / "broker.p12"

    @property
    def certificate(self) -> Path:
        return self.folder / "broker.pem"

    @property
    def key(self) -> Path:
        return self.folder / "broker.key"

    @property
    def broker_principal(self) -> str:
        """The principal the broker's certificate gets on a mutual-TLS listener."""
        return "User:" + BROKER_SUBJECT.lstrip("/")


def generate(folder: Path, *, ca_name: str = "refold-test-ca") -> TlsFiles:
    """Write a CA, a broker certificate for 127.0.0.1/localhost and its PKCS12 keystore.

    Each call makes a new CA: certificates of two calls do not trust each other (tests
    use that for "untrusted certificate"). Raises PrerequisiteError without openssl.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PrerequisiteError("openssl is needed to generate test certificates (apt-get install openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(18)
    files = TlsFiles(folder.resolve(), password)
    extensions = folder / "broker.ext"
    extensions.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    env = {**os.environ, "REFOLD_TLS_PASS": password}

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise PrerequisiteError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")

    ca_key, broker_key = folder / "ca.key", files.key
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(files.ca),
        "-days", str(DAYS), "-subj", f"/CN={ca_name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(broker_key),
        "-out", str(folder / "broker.csr"), "-subj", BROKER_SUBJECT)  # fmt: skip
    run("x509", "-req", "-in", str(folder / "broker.csr"), "-CA", str(files.ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(files.certificate), "-days", str(DAYS),
        "-extfile", str(extensions))  # fmt: skip
    run("pkcs12", "-export", "-in", str(files.certificate), "-inkey", str(broker_key),
        "-certfile", str(files.ca), "-name", "broker", "-out", str(files.keystore),
        "-passout", "env:REFOLD_TLS_PASS")  # fmt: skip
    for secret in (ca_key, broker_key, files.keystore):
        secret.chmod(0o600)
    return files
