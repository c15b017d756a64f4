"""HMAC-SHA256 tags on what the Batch API stores: File records, batch
records and line results, so that a process that can write to the shared
store (Redis, or the directory) but does not hold the deployment's internal
secret cannot forge or alter a batch, a result or a file.

One home for both stores (gateway/batch/store.py): a store seals each record
with `RecordSigner.seal` before it writes it and opens what it reads with
`RecordSigner.open`, which answers None (the record is treated as absent)
when the tag does not verify.

- The key is derived from the internal secret (`batch_mac_key`): its own key,
  so a tag made for batch records is worth nothing anywhere else.
- The tag covers the record's *name* as well as its bytes: a logical name that
  holds the tenant and the id ("file:alice:file-..."), or the batch id and line
  index for a result. A valid record copied under another tenant's or another
  batch's name does not verify.
- A File record also carries the SHA-256 of the file's bytes inside what is
  signed (`Sealed.content_sha256`), so bytes swapped under a valid record are
  caught on read (`content_matches`).
- Without a key (a store opened with ``mac_key=None``) records are written and
  read as plain JSON, exactly as before signing existed.

What a tag does not stop (docs/batch.md): deleting records, putting back an
older signed version of the same record, and the unsigned marks (a batch's
cancel mark and lease). Those are denial, not forgery.

Signed layout: ``hmac-sha256:<64 hex>:<JSON>`` where JSON is
``{"record": {...}, "content_sha256": "<hex>"|null}``. An unsigned record is
the record's JSON itself, which always starts with ``{``: the two cannot be
mistaken for one another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass

from tessera.internal_secret import InternalSecret

logger = logging.getLogger(__name__)

_PREFIX = b"hmac-sha256:"
_TAG_HEX_CHARS = 64
# Names already logged as not verifying: each is logged once, not on every poll of the runner.
# Bounded, so a store full of forged records cannot grow this set for ever (past the bound a
# refusal is logged every time: too many is better than none).
_MAX_LOGGED_NAMES = 10_000


def batch_mac_key(secret: InternalSecret | None) -> bytes | None:
    """The batch records' key, derived from the deployment's internal secret; None without one."""
    if secret is None:
        return None
    return secret.derive("batch-records")


def content_sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


@dataclass(frozen=True)
class Sealed:
    """A record read back and verified (or read without a key)."""

    record: dict
    content_sha256: str | None = None
    """The SHA-256 of the file's bytes the record was signed with (File records; None unsigned)."""


class RecordSigner:
    """Seals records before a store writes them and opens what it reads.
    `key` None: plain JSON, nothing checked (as before signing)."""

    def __init__(self, key: bytes | None) -> None:
        if key is not None and len(key) < 32:
            raise ValueError("batch record key: at least 32 bytes")
        self._key = key
        self._logged: set[str] = set()

    @property
    def signs(self) -> bool:
        return self._key is not None

    def seal(self, name: str, record: dict, content: bytes | None = None) -> bytes:
        """The bytes to store for `record` under `name`; `content`: the file's bytes, for a File record."""
        if self._key is None:
            return dump_json(record)
        payload = dump_json({"record": record, "content_sha256": None if content is None else content_sha256(content)})
        return _PREFIX + self._tag(name, payload).encode() + b":" + payload

    def open(self, name: str, raw: bytes | None) -> Sealed | None:
        """The record stored under `name`, or None: absent, or (with a key) unsigned, signed with
        another key, for another name, or altered. A refusal is logged once per name."""
        if raw is None:
            return None
        if self._key is None:
            return _unverified(raw)
        sealed = self._verified(name, raw)
        if sealed is None:
            self._refused(name)
        return sealed

    def content_matches(self, name: str, sealed: Sealed, content: bytes | None) -> bool:
        """Whether `content` is the file's bytes `sealed` was signed with (always true without a key)."""
        if self._key is None or content is None:
            return content is not None
        if sealed.content_sha256 is not None and hmac.compare_digest(sealed.content_sha256,
                                                                      content_sha256(content)):
            return True
        self._refused(name + " (content)")
        return False

    def _tag(self, name: str, payload: bytes) -> str:
        assert self._key is not None
        encoded = name.encode()
        # The name's length first: no (name, payload) pair can be read as another.
        message = len(encoded).to_bytes(4, "big") + encoded + payload
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def _verified(self, name: str, raw: bytes) -> Sealed | None:
        if not raw.startswith(_PREFIX):
            return None  # unsigned: written by someone without the key
        body = raw[len(_PREFIX):]
        tag, sep, payload = body[:_TAG_HEX_CHARS], body[_TAG_HEX_CHARS:_TAG_HEX_CHARS + 1], \
            body[_TAG_HEX_CHARS + 1:]
        if sep != b":" or not hmac.compare_digest(tag, self._tag(name, payload).encode()):
            return None
        wrapped = json.loads(payload)  # ours: the tag verified
        return Sealed(wrapped["record"], wrapped.get("content_sha256"))

    def _refused(self, name: str) -> None:
        # The name only (tenant and id), never the record's content: it is not ours to show.
        if name in self._logged:
            return
        if len(self._logged) < _MAX_LOGGED_NAMES:
            self._logged.add(name)
        logger.warning("batch store: the record %s does not verify (altered, or written without this "
                       "deployment's key); treated as absent", name)


def _unverified(raw: bytes) -> Sealed:
    """Without a key: the record as stored, plain or (written by a keyed gateway) unwrapped unchecked."""
    if raw.startswith(_PREFIX):
        wrapped = json.loads(raw[len(_PREFIX) + _TAG_HEX_CHARS + 1:])
        return Sealed(wrapped["record"], wrapped.get("content_sha256"))
    return Sealed(json.loads(raw))


def dump_json(record: dict) -> bytes:
    """A record's compact JSON, as the stores keep it."""
    return json.dumps(record, separators=(",", ":")).encode()
