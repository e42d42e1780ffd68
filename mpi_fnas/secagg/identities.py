"""Party identities (``privacy.party_identities``): long-lived Ed25519 keys that authenticate secure aggregation's
key relay, so a server that substitutes a party's X25519 key, or runs an impostor at a party's rank, is caught.

* **The roster** (the file ``privacy.party_identities`` names, public; format ``mpi_fnas-party-identities/v1``):
  every party's Ed25519 public key by rank, exchanged out of band. A party refuses a roster that does not name
  exactly the ranks 1..K of its job, with distinct keys, its own among them.
* **A party's private key**: ``identity.key`` in its own directory (``RUN_DIR/parties/rank<k>/``), PKCS#8 PEM, mode
  0600 (a key readable by others is refused); read by that party alone, never sent, it only signs
  (:meth:`PartyIdentity.sign_key`).
* **What is signed**: the party's rank, its fresh X25519 public key of this launch and the digest of the key set it
  was shown (:func:`~mpi_fnas.secagg.keyset.key_set_digest`), so no signature is valid in another launch; each
  party checks every other party's signature (:func:`~mpi_fnas.secagg.keyset.check_confirmations`).

:func:`make_identities` (``python -m mpi_fnas.identities``) makes the keys (from the OS's CSPRNG, through
``cryptography``, the only package that touches them) and the roster; the threat: docs/privacy.md §8.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ROSTER_FORMAT = "mpi_fnas-party-identities/v1"
IDENTITY_KEY_NAME = "identity.key"  # in the party's own directory
SIGNATURE_BYTES = 64
IDENTITY_KEY_BYTES = 32
_SIGNED_LABEL = b"mpi_fnas/secagg/keyset-signature/v1"
_PRIVATE_FILE_MODE = 0o600  # as mpi_fnas.checkpoint's; not imported from there, which loads torch
_PRIVATE_DIR_MODE = 0o700


class IdentityError(ValueError):
    """A roster or an identity key that cannot be used (one line)."""


@dataclass(frozen=True)
class PartyIdentity:
    """One party's identity: its own Ed25519 private key and every party's public key (the roster), by rank."""

    rank: int
    private: Ed25519PrivateKey
    roster: dict[int, Ed25519PublicKey]

    def __repr__(self) -> str:  # never the private key
        return f"PartyIdentity(rank={self.rank}, parties={sorted(self.roster)})"

    def sign_key(self, rank: int, public_key: bytes, digest: bytes) -> bytes:
        """64 bytes: this party's signature of its X25519 `public_key` at `rank` in the key set named `digest`."""
        return self.private.sign(signed_message(rank, public_key, digest))


def signed_message(rank: int, public_key: bytes, digest: bytes) -> bytes:
    """The bytes a party signs: a label, its rank, its X25519 public key and the key set's digest."""
    return _SIGNED_LABEL + int(rank).to_bytes(4, "big") + public_key + digest


def verify_key_signature(identity: Ed25519PublicKey, rank: int, public_key: bytes, digest: bytes,
                         signature: bytes) -> bool:
    """Whether `signature` is party `rank`'s (`identity`) signature of `public_key` in the key set `digest`."""
    try:
        identity.verify(signature, signed_message(rank, public_key, digest))
    except InvalidSignature:
        return False
    return True


# -- files -----------------------------------------------------------------------------------------------------------
def identity_key_path(party_directory: Path) -> Path:
    """Where a party keeps its Ed25519 private key: ``identity.key`` in its own directory."""
    return Path(party_directory) / IDENTITY_KEY_NAME


def read_roster(path: Path, parties: int) -> dict[int, Ed25519PublicKey]:
    """The roster at `path` for a job of `parties` parties; IdentityError unless it names exactly ranks 1..K with
    distinct 32-byte keys."""
    where = f"privacy.party_identities: {path}"
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise IdentityError(f"{where}: cannot read it ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != ROSTER_FORMAT or not isinstance(data.get("parties"), dict):
        raise IdentityError(f"{where}: not a roster (format: {ROSTER_FORMAT} with a parties: mapping)")
    entries = data["parties"]
    if set(entries) != set(range(1, parties + 1)):
        raise IdentityError(f"{where}: it names ranks {sorted(map(str, entries))}, this job's parties are ranks "
                            f"1..{parties}")
    raw = {rank: _hex_key(entries[rank], where, rank) for rank in entries}
    if len(set(raw.values())) != parties:
        raise IdentityError(f"{where}: several ranks share one key")
    return {rank: Ed25519PublicKey.from_public_bytes(key) for rank, key in sorted(raw.items())}


def read_identity_key(party_directory: Path) -> Ed25519PrivateKey:
    """This party's private key from its own directory; IdentityError if missing, unreadable or readable by others."""
    path = identity_key_path(party_directory)
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(f"{path}: an identity key must be readable by its owner only (chmod 600)")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        if isinstance(exc, IdentityError):
            raise
        raise IdentityError(f"{path}: no usable identity key ({type(exc).__name__}); make one with python -m "
                            "mpi_fnas.identities") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path}: not an Ed25519 private key")
    return key


def load_party_identity(roster_path: Path, party_directory: Path, rank: int, parties: int) -> PartyIdentity:
    """Party `rank`'s identity: its private key and the roster, which must hold that key's public half at `rank`."""
    roster = read_roster(roster_path, parties)
    private = read_identity_key(party_directory)
    if _raw(private.public_key()) != _raw(roster[rank]):
        raise IdentityError(f"privacy.party_identities: {roster_path} holds another key at rank {rank} than this "
                            f"party's {identity_key_path(party_directory)}")
    return PartyIdentity(rank, private, roster)


def make_identities(run_dir: Path, parties: int, roster_path: Path) -> Path:
    """A fresh Ed25519 key for each party 1..`parties` of `run_dir` (``RUN_DIR/parties/rank<k>/identity.key``,
    0600 in a 0700 directory) and their roster at `roster_path`; returns the roster's path. Refuses to overwrite an
    existing key or roster (an identity is meant to last)."""
    directories = {rank: Path(run_dir) / "parties" / f"rank{rank}" for rank in range(1, parties + 1)}
    for path in [roster_path, *(identity_key_path(d) for d in directories.values())]:
        if Path(path).exists():
            raise IdentityError(f"{path} exists; identities are never overwritten (remove it to start over)")
    public = {rank: _write_identity_key(directory) for rank, directory in directories.items()}
    write_roster(roster_path, public)
    return Path(roster_path)


def write_roster(path: Path, public_keys: dict[int, Ed25519PublicKey]) -> None:
    """Write the roster of `public_keys` (rank: Ed25519 public key) to `path`."""
    text = ("# mpi_fnas party identities (privacy.party_identities): each party's Ed25519 public key by rank.\n"
            + yaml.safe_dump({"format": ROSTER_FORMAT,
                              "parties": {rank: _raw(key).hex() for rank, key in sorted(public_keys.items())}},
                             sort_keys=False))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")


def _write_identity_key(party_directory: Path) -> Ed25519PublicKey:
    """A fresh private key in `party_directory` (created 0700), written 0600 from the start; its public half."""
    party_directory.mkdir(parents=True, exist_ok=True, mode=_PRIVATE_DIR_MODE)
    os.chmod(party_directory, _PRIVATE_DIR_MODE)
    key = Ed25519PrivateKey.generate()  # from the OS's CSPRNG
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(identity_key_path(party_directory), os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE_FILE_MODE)
    os.fchmod(fd, _PRIVATE_FILE_MODE)  # whatever the umask
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key.public_key()


def _hex_key(value: object, where: str, rank: int) -> bytes:
    try:
        key = bytes.fromhex(str(value))
    except ValueError:
        key = b""
    if len(key) != IDENTITY_KEY_BYTES:
        raise IdentityError(f"{where}: party {rank}'s key is not {2 * IDENTITY_KEY_BYTES} hex digits")
    return key


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
