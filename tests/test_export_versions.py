"""Which version ``rlstream export`` / ``eval --version`` takes, and the one line that lists the versions
there are when the one asked for is not. The control topic's notices are stubbed; the
store is a real directory (the trainer deletes the oldest versions: trainer.keep_weight_versions)."""

from __future__ import annotations

import pytest


@pytest.fixture
def announced(tmp_path, monkeypatch):
    """Versions 1-5 announced; the store still holds 3-5."""
    import pipeline.versions
    from rlstream.config import load_config

    updates = {}
    for v in range(1, 6):
        uri = tmp_path / f"v{v:08d}" / "model.safetensors"
        if v >= 3:
            uri.parent.mkdir()
            uri.write_bytes(b"x")
        updates[v] = {"version": v, "uri": str(uri), "sha256": "", "step": v}
    monkeypatch.setattr(pipeline.versions, "published", lambda cfg: updates)
    return load_config(None, [f"run_dir={tmp_path}"], environ={})


def test_the_newest_version_in_the_store_is_the_default_and_a_listed_one_is_found(announced):
    from pipeline.versions import find_update

    assert find_update(announced, None)["version"] == 5
    assert find_update(announced, 4)["version"] == 4
    assert find_update(announced, 0, base=True) is None  # eval: version 0 is the base model


@pytest.mark.parametrize(
    ("version", "base", "said"),
    [
        (7, False, "version 7 does not exist: the versions there are 3-5 (newest 5); 1-2 were deleted from the "
                   "store (trainer.keep_weight_versions); 0 is the base model (model.path)"),
        (1, False, "version 1 does not exist: the versions there are 3-5 (newest 5); 1-2 were deleted"),
        (0, False, "version 0 does not exist: the versions there are 3-5"),
        (9, True, "version 9 does not exist: the versions there are 0 (the base model), 3-5 (newest 5); 1-2 were"),
    ],
)  # fmt: skip
def test_a_version_that_is_not_there_is_one_line_listing_those_that_are(announced, version, base, said):
    from pipeline.errors import UnknownVersion
    from pipeline.versions import find_update

    with pytest.raises(UnknownVersion) as exc:
        find_update(announced, version, base=base)
    assert str(exc.value).startswith(said) and "\n" not in str(exc.value)


def test_nothing_published_yet(tmp_path, monkeypatch):
    import pipeline.versions
    from pipeline.errors import UnknownVersion
    from pipeline.versions import find_update
    from rlstream.config import load_config

    monkeypatch.setattr(pipeline.versions, "published", lambda cfg: {})
    cfg = load_config(None, [], environ={})
    assert find_update(cfg, None, base=True) is None  # eval --latest: the base model
    with pytest.raises(UnknownVersion, match=r"rl\.control announces no weights yet: the only version is 0"):
        find_update(cfg, None)
