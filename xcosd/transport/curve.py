"""CURVE security for the ZeroMQ transport: key pairs, allowlists, key files.

The cloud holds a server key pair and an allowlist of device public keys; a
device holds its own key pair and the server's public key. ZeroMQ's CURVE
handshake encrypts and authenticates the link; the ZAP handler
(:class:`zmq.auth.asyncio.AsyncioAuthenticator`) admits only allowlisted device
keys, and a server with CURVE on speaks to no plaintext peer at all.

Key files use ZeroMQ's certificate format (``NAME.key`` holds the public key,
``NAME.key_secret`` both), so ``zmq.auth`` tools read them too. A key file is
created with its final mode from the start (0600 for a secret: no moment where
another user can read it) and never through a link someone planted at its path:
a file already there is refused, or, asked to overwrite, replaced by a new file
renamed over the path (the link itself goes, not what it points to).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from ..errors import TransportError

#: ZAP domain the cloud's ROUTER announces; the allowlist applies to it
ZAP_DOMAIN = "xcosd"
#: ZAP domain of a broker's back end: its own allowlist, of replica keys, so a
#: device key never admits a replica nor a replica key a device
REPLICA_ZAP_DOMAIN = "xcosd-replicas"


class KeyFileExists(TransportError):
    """A key file would be written where a file (or a link) already is."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="curve")


def _z85(key: bytes | str) -> bytes:
    k = key.encode() if isinstance(key, str) else bytes(key)
    if len(k) != 40:
        raise TransportError(f"a CURVE key is 40 Z85 characters, got {len(k)}", code="curve")
    try:
        zmq.utils.z85.decode(k)
    except Exception as e:
        raise TransportError(f"not a Z85 CURVE key: {e}", code="curve") from None
    return k


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as Z85 text (40 bytes each); ``secret`` may be absent for
    a peer's public key."""

    public: bytes
    secret: bytes | None = None

    @classmethod
    def generate(cls) -> KeyPair:
        pub, sec = zmq.curve_keypair()
        return cls(pub, sec)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyPair:
        """From a ``.key`` (public only) or ``.key_secret`` file."""
        p = Path(path)
        if not p.is_file():
            raise TransportError(f"no key file {p}", code="curve")
        try:
            pub, sec = zmq.auth.load_certificate(p)
        except Exception as e:
            raise TransportError(f"cannot read key file {p}: {e}", code="curve") from None
        if not pub:
            raise TransportError(f"key file {p} holds no public key", code="curve")
        return cls(_z85(pub), _z85(sec) if sec else None)

    def save(self, directory: str | os.PathLike[str], name: str, *,
             overwrite: bool = False) -> tuple[Path, Path | None]:
        """Write ``NAME.key`` (and ``NAME.key_secret`` when the secret is known,
        readable by the owner only). A file already at either path is refused
        (:class:`TransportError`, code ``curve``) unless ``overwrite``; a link at
        either path is never followed."""
        d = Path(directory)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        pub_path = d / f"{name}.key"
        sec_path = d / f"{name}.key_secret" if self.secret is not None else None
        if not overwrite:  # neither is written if either is there
            for p in (pub_path, sec_path):
                if p is not None and os.path.lexists(p):
                    raise KeyFileExists(f"{p} exists; refusing to overwrite it")
        _write_cert(pub_path, self.public, None, overwrite)
        if sec_path is not None:
            _write_cert(sec_path, self.public, self.secret, overwrite)
        return pub_path, sec_path

    def require_secret(self) -> bytes:
        if self.secret is None:
            raise TransportError("this CURVE key pair has no secret key", code="curve")
        return self.secret


#: how a key file is opened: a new file only, never through a link
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _write_cert(path: Path, public: bytes, secret: bytes | None, overwrite: bool) -> None:
    """Write a certificate at ``path``, created with its mode (0600 with a secret,
    0644 without); with ``overwrite``, written beside it and renamed over it."""
    lines = ["#   ZeroMQ CURVE certificate (xcosd)", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    data = ("\n".join(lines) + "\n").encode()
    mode = 0o600 if secret is not None else 0o644
    target = path.with_name(f".{path.name}.{secrets.token_hex(8)}") if overwrite else path
    try:
        fd = os.open(target, _CREATE, mode)
    except FileExistsError:
        raise KeyFileExists(f"{path} exists; refusing to overwrite it") from None
    except OSError as e:
        raise TransportError(f"cannot create key file {path}: {e.strerror}", code="curve") from None
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits a public key file needs
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(target, path)  # replaces a link at path, never what it points to
    except BaseException:
        if overwrite:
            with contextlib.suppress(OSError):
                os.unlink(target)
        raise


def load_allowlist(directory: str | os.PathLike[str]) -> set[bytes]:
    """The public keys of every ``*.key`` file in ``directory``."""
    d = Path(directory)
    if not d.is_dir():
        raise TransportError(f"no allowlist directory {d}", code="curve")
    return {KeyPair.load(p).public for p in sorted(d.glob("*.key"))}


@dataclass
class CurveServer:
    """The cloud's CURVE settings: its key pair and the device keys it admits.

    ``allow`` may change while serving: :meth:`admit` a key, :meth:`revoke` one,
    or :meth:`reload` the allow directory. A revocation takes effect at once, not
    only at the next handshake: every listener watching this server
    (:meth:`watch`; a CURVE :class:`~xcosd.transport.zeromq.ZmqListener` does) is
    told the keys that left, ends their peers' connections and refuses whatever
    they send after (docs/THREATS.md). ``allow_any=True`` encrypts without
    authenticating devices.
    """

    keys: KeyPair
    allow: set[bytes] = field(default_factory=set)
    allow_any: bool = False
    _watchers: list[Callable[[frozenset[bytes]], None]] = field(
        default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.keys.require_secret()
        self.allow = {_z85(k) for k in self.allow}

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str],
                   allow: str | os.PathLike[str] | Iterable[bytes | str]) -> CurveServer:
        keys = KeyPair.load(secret_file)
        if isinstance(allow, (str, os.PathLike)):
            return cls(keys, load_allowlist(allow))
        return cls(keys, {_z85(k) for k in allow})

    def admit(self, key: bytes | str) -> None:
        self.allow.add(_z85(key))

    def revoke(self, key: bytes | str) -> None:
        """Admit ``key`` no more, and end its peers' live connections."""
        k = _z85(key)
        self.allow.discard(k)
        self._tell(frozenset({k}))

    def reload(self, directory: str | os.PathLike[str]) -> tuple[int, int]:
        """Admit exactly the keys of the ``*.key`` files in ``directory`` now (the
        allow directory, read again: ``xcosd serve`` does on SIGHUP and when the
        directory changes); the keys that left are revoked as :meth:`revoke`
        does. Returns how many keys were added and removed. An unreadable
        directory or key file raises and changes nothing."""
        new = load_allowlist(directory)
        gone = frozenset(self.allow - new)
        added = len(new - self.allow)
        self.allow = new
        self._tell(gone)
        return added, len(gone)

    def admitted(self, key: bytes | str) -> bool:
        """Whether a peer holding ``key`` (Z85) may still speak."""
        k = key.encode() if isinstance(key, str) else key
        return self.allow_any or k in self.allow

    def watch(self, on_revoked: Callable[[frozenset[bytes]], None]) -> None:
        """Call ``on_revoked(keys)`` whenever keys stop being admitted."""
        self._watchers.append(on_revoked)

    def unwatch(self, on_revoked: Callable[[frozenset[bytes]], None]) -> None:
        with contextlib.suppress(ValueError):
            self._watchers.remove(on_revoked)

    def _tell(self, gone: frozenset[bytes]) -> None:
        if gone and not self.allow_any:
            for w in list(self._watchers):
                w(gone)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials check (called by pyzmq's authenticator)."""
        return self.allow_any or key in self.allow


@dataclass(frozen=True)
class CurveClient:
    """A device's CURVE settings: its key pair and the server's public key."""

    keys: KeyPair
    server_public: bytes

    def __post_init__(self) -> None:
        self.keys.require_secret()
        object.__setattr__(self, "server_public", _z85(self.server_public))

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str],
                   server_key_file: str | os.PathLike[str]) -> CurveClient:
        return cls(KeyPair.load(secret_file), KeyPair.load(server_key_file).public)


def apply_server(sock: zmq.Socket, curve: CurveServer, domain: str = ZAP_DOMAIN) -> None:
    sock.curve_secretkey = curve.keys.require_secret()
    sock.curve_publickey = curve.keys.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()


def apply_client(sock: zmq.Socket, curve: CurveClient) -> None:
    sock.curve_secretkey = curve.keys.require_secret()
    sock.curve_publickey = curve.keys.public
    sock.curve_serverkey = curve.server_public
