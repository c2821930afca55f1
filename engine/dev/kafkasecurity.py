"""The secured mode of the local broker (`refold.dev.localkafka`): SASL_SSL, SCRAM, ACLs.

Opt-in: `localkafka.start(..., security=Security(...))`. The client listener is
SASL_SSL with SCRAM-SHA-512, TLS from a PKCS12 keystore (`refold.dev.tlsgen` makes one);
the broker uses the same listener between brokers (as the admin user) and a
mutual-TLS controller listener on 127.0.0.1 (its certificate is its principal). The
`StandardAuthorizer` checks ACLs with `allow.everyone.if.no.acl.found=false`; the
admin user and the broker's certificate are super users. SCRAM users are written at
format time, so a secured broker needs a fresh home. server.properties then holds
the keystore and admin passwords and is readable by its owner only.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from refold.dev.localproc import HOST
from refold.dev.tlsgen import TlsFiles

SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_ITERATIONS = 4096


@dataclass(frozen=True, slots=True)
class Security:
    """The secured mode of the local broker: SASL_SSL + SCRAM-SHA-512 + ACLs.

    `admin` is a super user (the broker talks to itself as this user too); `users`
    are further SCRAM users, written with the admin at format time. Passwords stay
    out of reprs and logs; they are hashed (salted, as SCRAM stores them) before they
    reach the format command's arguments.
    """

    tls: TlsFiles
    admin_password: str = field(repr=False)
    admin: str = "admin"
    users: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name, password in self._passwords().items():
            for text in (name, password):
                if not text or any(c in text for c in '"\\\n,=[]'):
                    raise ValueError(f"SCRAM user {name!r}: names and passwords must not be empty "
                                     "nor contain quotes, backslashes, newlines, ',', '=' or brackets")

    @property
    def super_users(self) -> list[str]:
        return [f"User:{self.admin}", self.tls.broker_principal]

    def client_settings(self, user: str | None = None, password: str | None = None) -> dict[str, Any]:
        """librdkafka settings for `user` (default: the admin) on the SASL_SSL listener."""
        name = user or self.admin
        if password is None:
            password = self.admin_password if name == self.admin else self.users[name]
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": name,
            "sasl.password": password,
            "ssl.ca.location": str(self.tls.ca),
        }

    def scram_arguments(self) -> list[str]:
        """The storage format command's `--add-scram` arguments for the admin and every
        user: salted and hashed here, never the passwords."""
        arguments = []
        for name, password in self._passwords().items():
            arguments += ["--add-scram", _scram_credential(name, password)]
        return arguments

    def broker_properties(self, port: int, controller_port: int) -> dict[str, str]:
        """The server.properties settings of the secured listeners, over the plain ones."""
        tls = self.tls
        login = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{self.admin}" password="{self.admin_password}";'
        )
        return {
            "listeners": f"SASL_SSL://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
            "advertised.listeners": f"SASL_SSL://{HOST}:{port}",
            "inter.broker.listener.name": "SASL_SSL",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": login,
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(tls.keystore),
            "ssl.keystore.password": tls.keystore_password,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(tls.ca),
            "ssl.endpoint.identification.algorithm": "https",
            # The controller link: mutual TLS, the broker's certificate is its principal.
            "listener.name.controller.ssl.client.auth": "required",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": ";".join(self.super_users),
        }

    def _passwords(self) -> dict[str, str]:
        return {self.admin: self.admin_password, **self.users}


def _scram_credential(name: str, password: str) -> str:
    """A `--add-scram` argument with the salted password (RFC 5802 Hi()), not the password."""
    salt = os.urandom(24)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _SCRAM_ITERATIONS)
    return (
        f"{SCRAM_MECHANISM}=[name={name},iterations={_SCRAM_ITERATIONS},"
        f'salt="{base64.b64encode(salt).decode()}",'
        f'saltedpassword="{base64.b64encode(salted).decode()}"]'
    )
