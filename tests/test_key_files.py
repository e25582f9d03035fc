"""CURVE key files are created with their mode from the start and never through a
link: ``KeyPair.save`` and ``xcosd keys`` against a planted symlink (to a file
that exists and to one that does not) and a pre-existing file, under a umask that
would leave a file written the ordinary way readable by everyone."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from xcosd.cli import main
from xcosd.transport import KeyPair
from xcosd.transport.curve import KeyFileExists


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask of 0: whatever mode a file gets, its creation chose."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_secret_key_file_is_0600_from_its_creation(tmp_path: Path, open_umask: None) -> None:
    pub, sec = KeyPair.generate().save(tmp_path / "new", "dev")
    assert sec is not None
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pub).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700
    assert KeyPair.load(sec).secret is not None


@pytest.mark.parametrize("victim_exists", [True, False])
@pytest.mark.parametrize("which", ["key", "key_secret"])
def test_a_planted_link_is_never_followed(tmp_path: Path, open_umask: None,
                                         victim_exists: bool, which: str) -> None:
    victim = tmp_path / "victim"
    if victim_exists:
        victim.write_text("precious\n")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / f"dev.{which}").symlink_to(victim)
    with pytest.raises(KeyFileExists, match="exists"):
        KeyPair.generate().save(keys, "dev")
    assert (victim.read_text() == "precious\n") if victim_exists else not victim.exists()
    assert sorted(p.name for p in keys.iterdir()) == [f"dev.{which}"]  # nothing else written
    # asked to overwrite, the link itself is replaced by a new file
    pub, sec = KeyPair.generate().save(keys, "dev", overwrite=True)
    assert sec is not None and not sec.is_symlink() and not pub.is_symlink()
    assert stat.S_IMODE(os.lstat(sec).st_mode) == 0o600
    assert (victim.read_text() == "precious\n") if victim_exists else not victim.exists()
    assert sorted(p.name for p in keys.iterdir()) == ["dev.key", "dev.key_secret"]


def test_a_pre_existing_file_is_refused_and_kept(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    first_pub, first_sec = KeyPair.generate().save(tmp_path, "dev")
    assert first_sec is not None
    before = first_sec.read_bytes()
    assert main(["keys", "generate", str(tmp_path), "--name", "dev"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err
    assert first_sec.read_bytes() == before
    assert main(["keys", "generate", str(tmp_path), "--name", "dev", "--force"]) == 0
    assert first_sec.read_bytes() != before
    assert stat.S_IMODE(os.stat(first_sec).st_mode) == 0o600
    # an allowlist entry of that name is refused the same way
    allow = tmp_path / "allow"
    assert main(["keys", "allow", str(allow), str(first_pub)]) == 0
    assert main(["keys", "allow", str(allow), str(first_pub)]) == 2
    assert main(["keys", "allow", str(allow), str(first_pub), "--force"]) == 0
