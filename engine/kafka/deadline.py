"""A client call under a deadline, given up early once a broker it may wait on has left
the cluster.

librdkafka's `send_offsets_to_transaction` may block past its own timeout (librdkafka#5456)
when the group coordinator it cached went away: a broker that drops out of the cluster's
metadata (the controllers fence a broker whose heartbeats stop) loses its broker thread
in the client, and the call, waiting for that thread to change state, waits until some
other broker does (librdkafka#5511). A new producer looks the coordinator up afresh and
finds the new one at once. So the call runs in a thread of its own, under a deadline;
and while it is still waiting after `GRACE` seconds, the client's metadata is asked once
a second for the brokers it lists: when one the client knew is gone, waiting longer is
waiting for the bug, and the call is given up (the caller then retries on a new
producer; a call given up wrongly costs one transaction done again, never a result).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException

GRACE = 1.0  # seconds a call may take before the brokers are asked about
_POLL = 1.0
_METADATA_SECONDS = 2.0
# a small metadata request: a response lists every broker whatever topics it was asked about
_PROBE_TOPIC = "__consumer_offsets"


def brokers_of(client: Any, timeout: float = _METADATA_SECONDS) -> set[int] | None:
    """The ids of the brokers the cluster's metadata lists now (a fenced or dead broker is
    not listed), asked through `client`; None when the client cannot say."""
    try:
        return set(client.list_topics(_PROBE_TOPIC, timeout=timeout).brokers)
    except (KafkaException, RuntimeError):
        return None


def gone_from(client: Any, known: set[int]) -> Callable[[], str | None]:
    """A check for `bounded`: which of the brokers `known` the metadata no longer lists,
    in words, or None while every one is there (or the metadata cannot be had)."""

    def check() -> str | None:
        now = brokers_of(client)
        if now is None or not known:
            return None
        missing = sorted(known - now)
        if not missing:
            return None
        return "broker " + ", ".join(map(str, missing)) + " left the cluster's metadata"

    return check


def bounded(seconds: float, call: Callable[[], None], gone: Callable[[], str | None] | None = None) -> str | None:
    """Run `call` in a thread of its own for at most `seconds`; with `gone`, give it up
    once it has waited `GRACE` seconds and `gone()` says why waiting is pointless. None
    when the call returned (its exception raised here as it came); else why it was given
    up, with the thread still waiting in it (the caller must keep the client alive)."""
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=_call_into, args=(call, outcome), name="refold-bounded-call", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(min(seconds, GRACE) if gone is not None else seconds)
    while thread.is_alive():
        waited = time.monotonic() - started
        if waited >= seconds:
            return f"did not return within {seconds:.0f}s (librdkafka#5456)"
        reason = gone() if gone is not None else None
        if reason is not None:
            return f"gave up after {time.monotonic() - started:.1f}s: {reason} (librdkafka#5511)"
        thread.join(max(0.0, min(_POLL, seconds - (time.monotonic() - started))))
    error = outcome[0] if outcome else None
    if error is not None:
        raise error
    return None


def _call_into(call: Callable[[], None], outcome: list[BaseException | None]) -> None:
    try:
        call()
    except BaseException as exc:  # handed to the waiting thread
        outcome.append(exc)
    else:
        outcome.append(None)
