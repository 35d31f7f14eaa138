"""The catalogue of published policy versions: every WeightUpdate on a run's control topic, which of
them still have their weights in the store (the newest few, and those the trainer never deletes:
``<store>/pins/``, the best by held-out eval, ``pipeline.best``), and ``find_update`` (one version,
or the newest), which ``rlstream export`` and ``rlstream eval --version`` / ``--latest`` use. A
version that is not there is refused with ``UnknownVersion``, one line listing those there are.
Read-only.
"""

from __future__ import annotations

from pipeline import codec
from pipeline.errors import ConfigError, DecodeError, UnknownVersion
from pipeline.kafka import Consumer, client_conf
from pipeline.notice_auth import verified


def published(cfg) -> dict[int, dict]:
    """Every WeightUpdate on the run's control topic that its trainer wrote (signed with the job's
    notice key, ``pipeline.notice_auth``), by version. ConfigError (one line) when the
    topic is not there: the command was not given the run's config."""
    from pipeline.admin import Admin

    topic = cfg.topics.name("control")
    admin = Admin(client_conf(cfg, "export"), cfg.kafka.request_timeout_s)
    try:
        there = topic in admin.list_topics()
    finally:
        admin.close()
    if not there:
        raise ConfigError(
            f"no topic {topic} on {cfg.kafka.bootstrap_servers}: give the run's config "
            f"(rlstream -c runs/<job>/config.toml ...) or its prefix (-s topics.prefix=<job>.)"
        )
    with Consumer(client_conf(cfg, "export", kind="consumer")) as c:
        msgs = c.read_to_end(topic, timeout=cfg.liveness.startup_timeout_s)
    notices = []
    for m in msgs:
        try:
            name, rec = codec.decode(m.value())
        except DecodeError:
            continue  # the control topic is rlstream's own; a stray record is not a version
        if name == "WeightUpdate":
            notices.append(rec)
    # a notice not signed by the job's trainer (pipeline.notice_auth) announces no version
    return {rec["version"]: rec for rec in verified(cfg.store, notices)}


def in_store(updates: dict[int, dict], store: str | None = None) -> list[int]:
    """The versions whose weights are still in the store, newest first. The trainer deletes the
    oldest (``trainer.keep_weight_versions``), so the walk stops at the first one missing; the
    versions it never deletes (``<store>/pins/``: the best by held-out eval) are added when
    ``store`` is given and their weights are there."""
    from pipeline.checkpoint import exists, pinned_versions

    there = []
    for v in sorted(updates, reverse=True):
        if not exists(updates[v]["uri"]):
            break
        there.append(v)
    if store is not None:
        pinned = [v for v in pinned_versions(store) if v in updates and v not in there]
        there += [v for v in pinned if exists(updates[v]["uri"])]
    return sorted(there, reverse=True)


def spans(versions: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``1-3, 5``."""
    out: list[str] = []
    for v in sorted(versions):
        if out and int(out[-1].rsplit("-", 1)[-1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def find_update(cfg, version: int | None, base: bool = False) -> dict | None:
    """The WeightUpdate of ``version`` (None: the newest whose weights are in the store). ``base``:
    version 0, the base model, may be asked for (returns None), and is the newest when nothing was
    published. UnknownVersion (one line, listing the versions there are) otherwise."""
    from pipeline.checkpoint import exists

    updates = published(cfg)
    if base and (version == 0 or (version is None and not updates)):
        return None
    if version in updates and exists(updates[version]["uri"]):
        return updates[version]
    there = in_store(updates, cfg.store)
    if version is None and there:
        return updates[there[0]]
    zero = "0 (the base model), " if base else ""
    if not updates:
        raise UnknownVersion(
            f"{cfg.topics.name('control')} announces no weights yet: the only version is 0, the base model (model.path)"
        )
    gone = sorted(set(updates) - set(there))
    asked = f"version {version} does not exist" if version is not None else "no published version is in the store"
    raise UnknownVersion(
        f"{asked}: the versions there are {zero}{spans(there) or 'none'}"
        + (f" (newest {there[0]})" if there else "")
        + (f"; {spans(gone)} were deleted from the store (trainer.keep_weight_versions)" if gone else "")
        + ("" if base else "; 0 is the base model (model.path)")
    )
