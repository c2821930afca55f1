"""Webhook (HTTP POST): pattern push-only delta updates, at-least-once (stdlib `urllib`).

- Writers (`WebhookWriter`, on Spark executors) encode each part of a
  transaction's delta rows as one JSON body: nothing is sent yet.
- The committer (`WebhookCommitter`, on the Spark driver) POSTs each body with
  the header `Idempotency-Key: <pipeline>-<writer>-<batch>-<part>`, retrying
  connection errors, 429 and 5xx with exponential backoff; a part that still
  fails is returned to the runtime, which retries it a bounded number of times.
- There is no `Load` (no view binding) and no driver checkpoint. A batch that
  is replayed after a crash between the POSTs and the Kafka commit is POSTed
  again with the same idempotency key, when Spark replays the same batch: a
  receiver that remembers keys drops the copy; others see it twice
  (at-least-once).

The body: `{"materialization", "pipeline", "writer", "batch", "part", "binding",
"rows": [delta rows]}`. Settings: `url`, `headers` (secret values, e.g.
`Authorization`; never logged), `timeout`, `attempts`, `backoff`.

    outputs:
      materialize:
        - {driver: webhook, url: "https://example.com/hook", delta: scores}
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit

import orjson

from refold.connectors.protocol import (
    CommitInfo,
    Driver,
    Open,
    Opened,
    Pattern,
    Sink,
    SinkCommitter,
    SinkWriter,
    StartCommit,
    StartedCommit,
    Store,
    TxnInfo,
)
from refold.connectors.settings import WebhookSettings

log = logging.getLogger(__name__)


class WebhookWriter(SinkWriter):
    """Encodes one part's rows as one request body."""

    def prepare(self, txn: TxnInfo, part: int, stores: Sequence[Store]) -> CommitInfo:
        body = orjson.dumps(
            {
                "materialization": txn.materialization,
                "pipeline": txn.pipeline,
                "writer": txn.writer,
                "batch": txn.batch,
                "part": part,
                "binding": txn.bindings[stores[0].binding].target if stores else None,
                "rows": [s.doc for s in stores],
            }
        )
        return CommitInfo(part, len(stores), (f"{txn.pipeline}-{txn.writer}-{txn.batch}-{part}", body))


class WebhookCommitter(SinkCommitter):
    """POSTs each part; returns the parts that failed after every attempt."""

    def __init__(self, settings: WebhookSettings) -> None:
        self.settings = settings
        self.posts = 0  # requests sent, retries included

    def commit(self, infos: Sequence[CommitInfo]) -> list[CommitInfo]:
        return [info for info in infos if not self._post(*info.data)]

    def _post(self, key: str, body: bytes) -> bool:
        settings = self.settings
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        headers.update({name: value.get_secret_value() for name, value in settings.headers.items()})
        delay = settings.backoff
        for attempt in range(1, settings.attempts + 1):
            request = urllib.request.Request(settings.url, data=body, headers=headers, method="POST")
            self.posts += 1
            try:
                with urllib.request.urlopen(request, timeout=settings.timeout) as response:
                    response.read()
                return True
            except urllib.error.HTTPError as exc:
                if exc.code != 429 and exc.code < 500:
                    log.error("webhook: POST %s answered %d; not retried", key, exc.code)
                    return False
                reason = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                reason = type(exc).__name__
            if attempt < settings.attempts:
                log.warning("webhook: POST %s failed (%s), attempt %d; retrying in %.1fs", key, reason, attempt, delay)
                time.sleep(delay)
                delay *= 2
        return False


class WebhookDriver(Driver[WebhookSettings]):
    """No Load (no view binding), no store() (its Sink pushes), nothing to acknowledge."""

    pattern: ClassVar[Pattern] = "push_only_delta"
    store_errors: ClassVar[tuple[type[Exception], ...]] = (OSError,)

    def sink(self) -> Sink:
        return Sink(WebhookWriter(), WebhookCommitter(self.settings))

    def open(self, request: Open) -> Opened:
        """Checks that the URL's host answers (a TCP connection, and TLS for https)."""
        parts = urlsplit(self.settings.url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((host, port), timeout=self.settings.timeout) as sock:
                if parts.scheme == "https":
                    ssl.create_default_context().wrap_socket(sock, server_hostname=host).close()
        except (OSError, ssl.SSLError) as exc:
            raise self.config_error("url", f"cannot reach {host}:{port}: {exc}") from exc
        return Opened(None)

    def start_commit(self, request: StartCommit) -> StartedCommit:
        return StartedCommit(b"")  # pushed already (at-least-once): nothing to reference
