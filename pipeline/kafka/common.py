"""What every Kafka client of rlstream shares: client settings (librdkafka's own log routed to the
``librdkafka`` Python logger, so it lands in a role's log and never as raw lines on a terminal), the
error classification (transient, authentication, authorization), start-up retries, the bounded
reachability check of commands run by hand (``check_reachable``), bounded calls for librdkafka
calls that can block forever, and small helpers on messages. Part of the sealed Kafka wrapper
(``pipeline.kafka``)."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from pipeline import codec
from pipeline.errors import BrokerUnreachable, DecodeError, KafkaClientError, TopicError
from pipeline.log import kv

log = logging.getLogger(__name__)
RDKAFKA_LOG = logging.getLogger("librdkafka")
"""librdkafka's own log lines (confluent-kafka's ``logger`` setting, served by the client's
poll/consume/flush), instead of its raw ``%3|...`` lines on stderr."""
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
ASSIGN_ONLY_GROUP_PREFIX = "rlstream-nogroup-"
"""Group id prefix of assign-only consumers (never committed to; librdkafka still looks it up, so a
secured cluster grants Describe on this prefix: docs/how-to/security.md)."""
TP = tuple[str, int]
_WEDGED: list = []
"""Clients whose librdkafka call never returned (see ``WedgedClient``): kept referenced for the
life of the process, since destroying one would block too."""
_auth_error: list = []
"""The newest authentication/TLS failure librdkafka reported (its error callback), if any."""
HANDSHAKE_DROPS = (3, 60.0)
"""A connection the broker drops during the SASL handshake ("mechanism handshake failed: Local:
Broker transport failure") reaches the error callback as an authentication failure, though no
credential was checked: librdkafka reconnects. More than 3 such drops within 60 s (a listener that
never completes a handshake: a wrong ``security.protocol``) count as an authentication failure."""
_handshake_drops: list[float] = []


_AFTER_MS = re.compile(r"\s*\(after \d+ms in state \w+\)")


class _RdkafkaLog:
    """The ``logger`` of every client: librdkafka's lines go to ``RDKAFKA_LOG``. A line that repeats
    (a failed reconnect every few milliseconds while a broker is away) is written once per
    ``window_s``, with the count of the ones left out; rlstream says "waiting for Kafka" itself."""

    window_s = 10.0

    def __init__(self):
        self._seen: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()
        self.to: logging.Handler | None = None
        """Set by ``client_log_to``: the lines go there, not to ``RDKAFKA_LOG``."""

    def log(self, level: int, fmt: str, *args) -> None:
        text = fmt % args
        key = _AFTER_MS.sub("", text)
        now = time.monotonic()
        with self._lock:
            first, repeats = self._seen.get(key, (-self.window_s, 0))
            if now - first < self.window_s:
                self._seen[key] = (first, repeats + 1)
                return
            if len(self._seen) > 1000:
                self._seen.clear()
            self._seen[key] = (now, 0)
        args = (text, f" ({repeats} more like it since the last one)" if repeats else "")
        if self.to is not None:  # a terminal's process: its file (``client_log_to``)
            self.to.handle(RDKAFKA_LOG.makeRecord(RDKAFKA_LOG.name, level, __file__, 0, "%s%s", args, None))
        else:
            RDKAFKA_LOG.log(level, "%s%s", *args)


_RDKAFKA = _RdkafkaLog()


class _ClientLogFile(logging.Handler):
    """Where ``_RDKAFKA`` writes in a process whose stderr is a user's terminal: a file."""

    def __init__(self, path: Path):
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(self.format(record) + "\n")
        except Exception:  # logging must never break a client's callback
            self.handleError(record)


def client_log_to(path: Path) -> None:
    """Keep this process's librdkafka lines off its stderr, which is a user's terminal (the
    launcher of ``rlstream run``/``demo``): they go to ``path`` instead. A child forked from this
    process logs them to ``RDKAFKA_LOG`` again (its own log)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if _RDKAFKA.to is None:
        os.register_at_fork(after_in_child=_client_log_in_child)
    _RDKAFKA.to = _ClientLogFile(Path(path))


def _client_log_in_child() -> None:
    _RDKAFKA.to = None


def _on_client_error(err: KafkaError) -> None:
    """librdkafka's error callback: remember authentication and TLS failures (librdkafka itself only
    retries them, so start-up would wait out its deadline on a wrong password) and log the rest."""
    if err.code() in _AUTH_CODES:
        if "transport failure" in err.str():
            now, (most, window_s) = time.monotonic(), HANDSHAKE_DROPS
            _handshake_drops[:] = [t for t in _handshake_drops if now - t < window_s] + [now]
            if len(_handshake_drops) <= most:
                log.warning("kafka connection dropped during authentication; reconnecting %s", kv(error=err))
                return
        _auth_error[:] = [err]
        log.error("kafka authentication failed %s", kv(error=err))
    elif err.fatal():
        log.error("kafka client error %s", kv(error=err))


def raise_if_auth_failed(what: str = "") -> None:
    """Raise KafkaClientError if a client of this process failed to authenticate."""
    if _auth_error:
        err = _auth_error[0]
        raise KafkaClientError(f"{what + ': ' if what else ''}authentication failed: {err} (check kafka.common: "
                               "security.protocol, sasl.*, ssl.ca.location; docs/how-to/security.md)", err)  # fmt: skip


def client_conf(cfg, role: str, worker_id: str | None = None, kind: str = "common") -> dict:
    """librdkafka settings for one client of ``role``. ``cfg`` is the root config; its
    ``kafka.bootstrap_servers`` was resolved at start-up by the application layer."""
    wid = worker_id or f"{socket.gethostname()}-{os.getpid()}"
    conf: dict = {
        "bootstrap.servers": cfg.kafka.bootstrap_servers or DEFAULT_BOOTSTRAP,
        "client.id": f"{cfg.kafka.client_id_prefix}-{role}-{wid}",
        "log_level": 5,  # librdkafka: notice and above (info is chatty about internal queues)
        "logger": _RDKAFKA,
        "error_cb": _on_client_error,
    }
    conf.update(cfg.kafka.common)
    if kind == "producer":
        conf.update(cfg.kafka.producer)
    elif kind == "consumer":
        conf.update(cfg.kafka.consumer)
    return conf


# ---- errors --------------------------------------------------------------------------------
_TRANSIENT_CODES = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._RESOLVE,
    KafkaError._WAIT_COORD,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
    # a broker handle dropped with its node (a rolling restart or a killed node of a cluster): a
    # restarted rollout worker's start-up watermarks read failed with it and the role exited
    KafkaError._DESTROY_BROKER,
}
_UNKNOWN_TOPIC_CODES = {KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION}
_AUTH_CODES = {KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED}
_AUTHZ_CODES = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
}


def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    err = getattr(exc, "kafka_error", None)
    return err if isinstance(err, KafkaError) else None


def is_transient(exc: BaseException) -> bool:
    """True for errors that go away by themselves: retriable ones, leader elections, a broker that
    is unreachable for now, metadata or a coordinator not ready yet."""
    err = _kafka_error(exc)
    if err is None:
        return False
    return not err.fatal() and (err.retriable() or err.code() in _TRANSIENT_CODES)


def retry_transient(fn: Callable, timeout: float = 30.0, what: str = "", interval: float = 0.2):
    """Call ``fn()`` until it returns, retrying transient Kafka errors with exponential backoff
    (``interval`` doubling up to 5 s) until ``timeout``; then the last error is raised."""
    deadline = time.monotonic() + timeout
    delay, last_note = interval, 0.0
    while True:
        try:
            return fn()
        except (KafkaException, KafkaClientError) as exc:
            raise_if_auth_failed(what)
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            now = time.monotonic()
            if now - last_note > 10:
                err = _kafka_error(exc)
                hint = (
                    " (run `rlstream topics create`?)" if err is not None and err.code() in _UNKNOWN_TOPIC_CODES else ""
                )
                log.warning("waiting for Kafka%s %s", hint, kv(what=what or getattr(fn, "__name__", "call"), error=err))
                last_note = now
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


class _Quiet:
    """A librdkafka ``logger`` that keeps a probe's connection noise at debug level: the outcome is
    ``check_reachable``'s to say, in one line."""

    @staticmethod
    def log(level: int, fmt: str, *args) -> None:
        RDKAFKA_LOG.debug(fmt, *args)


def _reason(err: KafkaError) -> str:
    """The useful tail of a librdkafka connection error: ``Connection refused``, ``Name or service
    not known``, ..."""
    text = _AFTER_MS.sub("", err.str()).strip()
    return text.rsplit(": ", 1)[-1] or err.str()


def check_reachable(conf: dict, timeout: float, hint: str = "") -> None:
    """One bounded metadata round trip to the cluster of ``conf`` (``client_conf``). Raises
    BrokerUnreachable when no broker of ``bootstrap.servers`` answers within ``timeout`` seconds
    (with librdkafka's reason: connection refused, name not resolved, ...), KafkaClientError when
    one answers but authentication fails. librdkafka's log lines of the attempt go to the
    ``librdkafka`` logger at debug level; ``hint`` (what to do) ends the message. For commands run
    by hand, before any work; roles under a supervisor retry instead (``retry_transient``)."""
    from confluent_kafka.admin import AdminClient

    errors: list[KafkaError] = []
    bootstrap = str(conf.get("bootstrap.servers", DEFAULT_BOOTSTRAP))
    client = AdminClient({**conf, "logger": _Quiet(), "error_cb": errors.append})
    try:
        client.list_topics(timeout=timeout)
        return
    except KafkaException as exc:
        first = _kafka_error(exc)
    client.poll(0)  # serve the error callbacks of the attempt
    auth = [e for e in errors if e.code() in _AUTH_CODES]
    if auth:
        raise KafkaClientError(
            f"authentication with {bootstrap} failed: {auth[-1].str()} (check kafka.common: security.protocol, "
            "sasl.*, ssl.ca.location; docs/how-to/security.md)",
            auth[-1],
        )
    detail = [e for e in errors if e.code() != KafkaError._ALL_BROKERS_DOWN]
    reason = _reason(detail[-1]) if detail else (first.str() if first is not None else "no answer")
    log.debug("broker check failed %s", kv(bootstrap=bootstrap, errors=[e.str() for e in errors[-5:]]))
    raise BrokerUnreachable(
        f"no Kafka broker answers at {bootstrap} ({reason}; waited {timeout:g} s){'; ' + hint if hint else ''}",
        bootstrap,
        first,
    )


class WedgedClient(KafkaClientError):
    """A librdkafka call did not return within its bound: the client is stuck for good (librdkafka
    #5456/#5511: ``send_offsets_to_transaction`` after a broker restart). The caller replaces it;
    the stuck one is parked in ``_WEDGED``."""


def wedged_clients() -> int:
    """How many clients this process had to abandon (the process should then end with ``os._exit``:
    destroying them at interpreter exit could block)."""
    return len(_WEDGED)


_TIMEOUT_CODES = frozenset({KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT})


def uncertain(exc: BaseException) -> bool:
    """``exc`` leaves the outcome of a transaction unknown: a transaction call that timed out or
    never returned (``WedgedClient``). The only safe way on is a new producer epoch (module docstring)."""
    if isinstance(exc, WedgedClient):
        return True
    ke = getattr(exc, "kafka_error", None)
    return ke is not None and ke.code() in _TIMEOUT_CODES and not ke.fatal() and not ke.txn_requires_abort()


_FENCED_CODES = frozenset({KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH, KafkaError._FENCED})


def fenced_member(exc: BaseException) -> bool:
    """A transaction failed because its offsets carried a static membership that another consumer
    with the same ``group.instance.id`` has taken (FENCED_INSTANCE_ID): the consumer is fenced as
    well, and only its replacement can read on."""
    err = _kafka_error(exc)
    return err is not None and err.code() == KafkaError.FENCED_INSTANCE_ID


def recoverable_fatal(exc: BaseException) -> bool:
    """``exc`` is a fatal error of a transactional producer that a new producer with the same
    transactional id recovers from, in-process (what a restart would do): not a fencing (another
    live instance owns the id: this one must exit) and not a refusal of the principal. Seen after a
    transaction coordinator moved (a broker of a cluster killed): an abort answered with a fatal
    INVALID_TXN_STATE."""
    ke = getattr(exc, "kafka_error", None)
    if ke is None or not ke.fatal():
        return False
    codes = {ke.code()}
    if "fenced" in (ke.str() or "").lower():
        codes.add(KafkaError._FENCED)
    return not codes & (_FENCED_CODES | _AUTHZ_CODES)


def _bounded(fn, args: tuple, timeout: float, what: str):
    """``fn(*args)`` in a daemon thread; WedgedClient if it has not returned after ``timeout``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    t = threading.Thread(target=target, name=f"kafka-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise WedgedClient(f"{what} did not return within {timeout:.0f} s: the client is stuck (librdkafka #5456)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _raise_kafka(exc: KafkaException, what: str, cls=KafkaClientError):
    err = _kafka_error(exc)
    raise cls(f"{what}: {err or exc}", err) from exc


def _tp(t) -> TopicPartition:
    return t if isinstance(t, TopicPartition) else TopicPartition(t[0], t[1], *t[2:])


def _partitions_of(client, topic: str, timeout: float) -> list[int]:
    try:
        meta = client.list_topics(topic, timeout=timeout).topics.get(topic)
    except KafkaException as exc:
        _raise_kafka(exc, f"metadata of {topic}")
    if meta is None or meta.error is not None or not meta.partitions:
        code = meta.error if meta is not None and meta.error is not None else KafkaError(KafkaError._UNKNOWN_TOPIC)
        if code.code() in _AUTHZ_CODES:
            raise TopicError(
                f"not authorized for topic {topic} ({code}): grant this principal ACLs (docs/how-to/security.md)", code
            )
        raise TopicError(f"topic {topic} is not available ({code}); run `rlstream topics create`", code)
    return sorted(meta.partitions)


# ---- producer ------------------------------------------------------------------------------


def decode_message(msg: Message, expected: str | None = None) -> dict:
    """Decode a consumed message's value; DecodeError names topic, partition and offset."""
    try:
        return codec.decode(msg.value(), expected)[1]
    except DecodeError as exc:
        raise exc.located(msg.topic(), msg.partition(), msg.offset()) from exc


def next_offsets(messages: Iterable[Message]) -> list[TopicPartition]:
    """Offsets to commit after ``messages``: last offset + 1 per topic/partition."""
    last: dict[tuple[str, int], int] = {}
    for m in messages:
        key = (m.topic(), m.partition())
        last[key] = max(last.get(key, -1), m.offset())
    return [TopicPartition(t, p, o + 1) for (t, p), o in sorted(last.items())]


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
