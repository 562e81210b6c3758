"""Ed25519 signatures over the exact bytes of clusterctl's own files.

A signed file is the payload's pretty JSON with one last member added:

    ...payload members...,
      "signature": {"alg": "ed25519", "key_id": "<16 hex>", "value": "<base64>"}
    }

The signed message is ``b"clusterctl-signed/1\\0" + type + b"\\0" + payload bytes`` where the payload bytes are the
file with that last member removed. So: verification needs no JSON parsing (the signature is cut off the tail by
exact bytes), any edited byte fails it, and a file of one type (a cancel request) can never pass as another
(a deployment) because the type is part of what is signed. Nodes get only the public key: they can verify, not sign.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from clusterctl.atomic import atomic_write_bytes, fsync_dir, open_regular, private_dirs, stage_bytes
from clusterctl.errors import CannotWrite, ConfigError, IntegrityError, MissingInput

DOMAIN = b"clusterctl-signed/1\0"
_TAIL = re.compile(
    rb',\n  "signature": \{"alg": "ed25519", "key_id": "([0-9a-f]{16})", "value": "([A-Za-z0-9+/]{86}==)"\}\n\}\n\Z'
)
# A type, optionally bound to one node: "rank-contract/<node>" verifies only where that node name is expected.
_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]{0,40}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,62})?$")


def _crypto():
    # cryptography is imported lazily: `status` and `reap` must start fast.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return serialization, ed25519


def key_id_of(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


@dataclass(frozen=True)
class PublicKey:
    raw: bytes

    @property
    def key_id(self) -> str:
        return key_id_of(self.raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        _, ed25519 = _crypto()
        from cryptography.exceptions import InvalidSignature

        try:
            ed25519.Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
            return True
        except InvalidSignature:
            return False

    def to_text(self) -> str:
        return f"clusterctl-ed25519 {base64.b64encode(self.raw).decode()} {self.key_id}\n"

    @classmethod
    def from_text(cls, text: str, *, source: str = "public key") -> "PublicKey":
        parts = text.strip().split()
        try:
            if parts[0] != "clusterctl-ed25519":
                raise ValueError
            raw = base64.b64decode(parts[1], validate=True)
            if len(raw) != 32:
                raise ValueError
        except (IndexError, ValueError):
            raise IntegrityError(f"{source} is not a clusterctl public key") from None
        return cls(raw)


class SigningKey:
    def __init__(self, private_raw: bytes):
        _, ed25519 = _crypto()
        self._key = ed25519.Ed25519PrivateKey.from_private_bytes(private_raw)
        serialization, _ = _crypto()
        self.public = PublicKey(self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def __repr__(self) -> str:  # never show key material
        return f"SigningKey(key_id={self.public.key_id})"

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def _message(kind: str, payload: bytes) -> bytes:
    if not _TYPE_RE.match(kind):
        raise ValueError(f"bad signed type {kind!r}")
    return DOMAIN + kind.encode() + b"\0" + payload


def sign_payload(payload: bytes, kind: str, key: SigningKey) -> bytes:
    """Append the signature member to a payload produced by ``clusterctl.atomic.dumps`` (ends with ``}\\n``)."""
    if not payload.endswith(b"\n}\n") or not payload.startswith(b"{\n"):
        raise ValueError("payload must be a non-empty pretty JSON object")
    sig = base64.b64encode(key.sign(_message(kind, payload))).decode()
    tail = f',\n  "signature": {{"alg": "ed25519", "key_id": "{key.public.key_id}", "value": "{sig}"}}\n}}\n'
    return payload[: -len(b"\n}\n")] + tail.encode()


def verify_signed(data: bytes, kind: str, trusted: list[PublicKey], *, source: str = "file") -> bytes:
    """Return the payload bytes if ``data`` carries a valid signature of type ``kind`` by a trusted key.

    Raises IntegrityError (exit 65) otherwise. Call this BEFORE parsing the payload.
    """
    m = _TAIL.search(data)
    if not m:
        if b'"signature"' not in data:
            raise IntegrityError(f"{source} is not signed", damaged=True)
        raise IntegrityError(f"{source} has a malformed signature block", damaged=True)
    key_id = m.group(1).decode()
    payload = data[: m.start()] + b"\n}\n"
    key = next((k for k in trusted if k.key_id == key_id), None)
    if key is None:
        if not trusted:
            raise IntegrityError(f"{source}: no trusted public key to verify it with")
        raise IntegrityError(f"{source} is signed by an unknown key {key_id}")
    sig = base64.b64decode(m.group(2))
    if not key.verify(sig, _message(kind, payload)):
        raise IntegrityError(f"{source}: signature does not match (the file was changed, or it is not a {kind})")
    return payload


class Keyring:
    """The operator's key pair in ``<state>/keys``: created on first use, private key 0600."""

    def __init__(self, keys_dir: str | os.PathLike):
        self.dir = Path(keys_dir)
        self.private_path = self.dir / "deploy.key"
        self.public_path = self.dir / "deploy.pub"

    def public_keys(self) -> list[PublicKey]:
        try:
            text = self.public_path.read_text()
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as e:
            raise IntegrityError(f"cannot read {self.public_path}: {e}") from None
        return [PublicKey.from_text(text, source=str(self.public_path))]

    def signing_key(self, *, create: bool = True) -> SigningKey:
        serialization, ed25519 = _crypto()
        try:
            data = self._read_private()
        except FileNotFoundError:
            if not create:
                raise IntegrityError(f"no signing key at {self.private_path}") from None
            return self._create()
        if not data and create and not self._has_public():
            # an empty key with no public half never signed anything: what a crash or a full disk left behind
            # before key creation was atomic. Replace it.
            return self._create(replace_empty=True)
        try:
            key = serialization.load_pem_private_key(data, password=None)
            if not isinstance(key, ed25519.Ed25519PrivateKey):
                raise ValueError
        except ValueError:
            raise IntegrityError(f"{self.private_path} is not an Ed25519 private key") from None
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
        sk = SigningKey(raw)
        if self.public_path.exists() and self.public_keys()[0].raw != sk.public.raw:
            raise IntegrityError(f"{self.public_path} does not belong to {self.private_path}")
        if not self.public_path.exists():
            atomic_write_bytes(self.public_path, sk.public.to_text().encode(), mode=0o600)
        return sk

    def _has_public(self) -> bool:
        try:
            return self.public_path.stat().st_size > 0
        except OSError:
            return False

    def _read_private(self) -> bytes:
        """The private key's bytes, refusing what ssh refuses too: a symlink (someone else decides which key signs),
        a file of another user, or one that others may read (the key may have leaked: make a new one)."""
        import stat

        st = os.lstat(self.private_path)  # FileNotFoundError: no key yet
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"signing key {self.private_path} is a symlink; refusing to use it",
                              hint="put the key file itself there (0600)")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"signing key {self.private_path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ConfigError(f"signing key {self.private_path} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise ConfigError(f"signing key {self.private_path} is readable by others "
                              f"(mode {st.st_mode & 0o777:04o}); refusing to use it",
                              hint=f"chmod 600 {self.private_path} if it never left this account")
        try:
            fd, _ = open_regular(self.private_path, what="signing key")
        except MissingInput:
            raise FileNotFoundError(self.private_path) from None  # removed since the lstat: no key yet
        with os.fdopen(fd, "rb") as f:
            return f.read(64 * 1024)

    def _create(self, *, replace_empty: bool = False) -> SigningKey:
        """A new key pair, all or nothing: the private key is written and fsynced under a temp name, then linked
        into place (a link never replaces a key another process made meanwhile: theirs is used). A full disk
        leaves no key file behind (exit 73), never an empty one."""

        serialization, ed25519 = _crypto()
        try:
            private_dirs(self.dir)
        except OSError as e:
            raise CannotWrite(f"cannot create {self.dir}: {e.strerror or e}") from None
        key = ed25519.Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        staged = stage_bytes(self.private_path, pem, mode=0o600)  # CannotWrite (73) on a full disk, nothing left
        try:
            if replace_empty:
                staged.commit()  # rename over the empty file
            else:
                try:
                    os.link(staged.tmp, self.private_path)
                except FileExistsError:
                    return self.signing_key(create=False)
                except OSError as e:
                    raise CannotWrite(f"cannot create {self.private_path}: {e.strerror or e}") from None
                fsync_dir(self.dir)
        finally:
            staged.discard()
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
        sk = SigningKey(raw)
        atomic_write_bytes(self.public_path, sk.public.to_text().encode(), mode=0o600)
        return sk
