"""Membership of a swarm by a shared secret, the swarm key (issue 35; docs/design/trust.md, section 2).

Whoever holds the key is a member. The key never goes over the wire: each use gets its own sub-key
``HMAC(key, label)`` (:meth:`SwarmKey.derive`), so that no proof made for one use passes for another, and two
kinds of proof are built from them:

* :class:`MemberToken`: ``(peer_id, expires, HMAC(k_member, run_id, peer_id, expires))``, checked against the
  caller's authenticated libp2p peer id (:func:`member_token_refusal`): worthless to any other peer, and to the same
  peer once expired.
* :class:`SwarmKeyAuthorizer`: hivemind's DHT authorizer interface, signing every DHT request and response with an
  HMAC, a time and a nonce. It cannot see who sends a request, so a nonce and a time window refuse replays.

Where a key comes from: the ``swarm_key`` option, else the ``COLLABOPT_SWARM_KEY`` environment variable
(:func:`swarm_key_from`), or ``--swarm-key-file`` of the ``collabopt`` commands (:func:`read_swarm_key_file`). A DHT
started with :class:`SwarmKeyAuthorizer` carries the key to every averager built on it (:func:`swarm_key_of`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import os
import re
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import get_dht_time

from collabopt.errors import ConfigurationError

logger = get_logger(__name__)

KEY_BYTES = 32  # 256 bits: new_swarm_key's size, and the least a key may hold
# how long a member token lasts (its holder renews it before then): what a leaked token is worth
TOKEN_LIFETIME = 600.0
# a request signed this many seconds away from the receiver's clock is refused (hivemind's token authorizer: 60 s)
WINDOW = 60.0
NONCE_BYTES = 16
# the sub-keys' labels, one a use (docs/design/trust.md, section 2)
DHT_REQUEST, DHT_RESPONSE, MEMBER, DIALBACK = "dht-request", "dht-response", "member", "dialback"
_KEY_TEXT = re.compile(r"[A-Za-z0-9_-]+")  # (URL-safe base64, padding stripped)
SWARM_KEY_ENV = "COLLABOPT_SWARM_KEY"
ENV_PARAMETER = f"the {SWARM_KEY_ENV} environment variable"  # (what an error names when the variable is wrong)


OPEN_SWARM = ("open swarm: anyone with an initial peer's address and the run_id can join, read the model and "
              "count progress; members only: swarm_key= (collabopt keygen), the same on every peer")
MEMBERS_ONLY = f"members only: peers need this swarm's key (swarm_key= or ${SWARM_KEY_ENV})"


def membership_line(members_only: bool) -> str:
    """One line saying whether the swarm admits members only (a swarm key) or anyone."""
    return MEMBERS_ONLY if members_only else OPEN_SWARM


def new_swarm_key() -> str:
    """A new random swarm key: 256 bits as text (URL-safe base64, no padding), for ``collabopt keygen``."""
    return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).rstrip(b"=").decode()


class SwarmKey:
    """The swarm's secret, parsed from its text. Its ``repr`` hides it, so that a log or a traceback does not show it.

    Refuses (:class:`~collabopt.errors.ConfigurationError`, a ValueError naming ``parameter``) text that is not
    URL-safe base64 of at least :data:`KEY_BYTES` bytes: a key file holding something else (a path, a truncated
    key) is a mistake to report, not a weak key to use."""

    def __init__(self, text: str, parameter: str = "swarm_key"):
        secret = _secret_of(text)
        if secret is None:
            raise _bad_key(text, parameter)
        self._secret = secret

    def derive(self, label: str) -> bytes:
        """The sub-key of one use: ``HMAC-SHA256(key, "collabopt/" + label)``."""
        return hmac.new(self._secret, f"collabopt/{label}".encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "SwarmKey(<hidden>)"


def _secret_of(text: Any) -> bytes | None:
    """The secret of a key's text; None where the text is no key."""
    stripped = text.strip().rstrip("=") if isinstance(text, str) else ""
    try:
        secret = base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except (binascii.Error, ValueError):
        return None
    return secret if len(secret) >= KEY_BYTES and _KEY_TEXT.fullmatch(stripped) else None


def _bad_key(text: Any, parameter: str) -> ConfigurationError:
    """The error for text that is no key. Where it names a file holding a key (a path passed for the key itself),
    the fix passes that key: ``swarm_key=`` as data, the environment variable in words."""
    path = text.strip() if isinstance(text, str) else ""
    given = f"the one given is {len(path)} characters long" if isinstance(text, str) else f"got {type(text).__name__}"
    problem = f"must be a key from `collabopt keygen` (URL-safe base64 of at least {KEY_BYTES} bytes); {given}"
    fix = ("copy the whole key that `collabopt keygen` printed, the same on every member (for a new swarm, run "
           "`collabopt keygen` and give its key to every member)")
    try:
        held = Path(path).read_text() if path and os.path.isfile(path) else None
    except OSError:
        held = None
    if held is None or _secret_of(held) is None or parameter not in ("swarm_key", ENV_PARAMETER):
        return ConfigurationError(parameter, problem, fix)
    problem = f"{problem}: it names a file holding a key"
    if parameter == "swarm_key":
        return ConfigurationError(parameter, problem, f"pass the key the file holds: swarm_key=open({path!r}).read()",
                                  fixes=[{"swarm_key": SwarmKey(held)}])
    return ConfigurationError(parameter, problem, f"set {SWARM_KEY_ENV} to the key the file holds: "
                                                  f"{SWARM_KEY_ENV}=\"$(cat {path})\"")


def swarm_key_from(value: str | SwarmKey | None, *, environment: bool = True) -> SwarmKey | None:
    """The swarm key of the ``swarm_key`` option: ``value`` parsed, else (``environment``) that of the
    ``COLLABOPT_SWARM_KEY`` environment variable; None where neither is set (an open swarm)."""
    if isinstance(value, SwarmKey):
        return value
    if value is not None:
        return SwarmKey(value)
    text = os.environ.get(SWARM_KEY_ENV, "").strip() if environment else ""
    return SwarmKey(text, ENV_PARAMETER) if text else None


def read_swarm_key_file(path: str | os.PathLike) -> SwarmKey:
    """The key in the file at ``path`` (``--swarm-key-file``; written e.g. by ``collabopt keygen > swarm.key``)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigurationError("--swarm-key-file", f"cannot read {str(path)!r}: {e.strerror or e}",
                                 "pass the file `collabopt keygen > swarm.key` wrote") from None
    return SwarmKey(text, f"--swarm-key-file {path}")


def swarm_key_of(dht: Any) -> SwarmKey | None:
    """The key of a ``hivemind.DHT`` started with a :class:`SwarmKeyAuthorizer` (the averagers built on it check
    their members with it); None for an open swarm's DHT."""
    authorizer = (getattr(dht, "kwargs", None) or {}).get("authorizer")
    return authorizer.key if isinstance(authorizer, SwarmKeyAuthorizer) else None


def _framed(*fields: bytes) -> bytes:
    """The fields, each prefixed with its length: no two field lists give the same bytes."""
    return b"".join(struct.pack(">I", len(field)) + field for field in fields)


@dataclass(frozen=True)
class MemberToken:
    """A member's proof, bound to its libp2p peer id and to the run, valid until ``expires`` (DHT time, seconds)."""

    peer_id: bytes
    expires: float
    mac: bytes

    _HEAD = struct.Struct(">d32s")

    @classmethod
    def issue(cls, key: SwarmKey, run_id: str, peer_id: bytes, *, lifetime: float = TOKEN_LIFETIME,
              now: float | None = None) -> MemberToken:
        """A token for ``peer_id`` (``PeerID.to_bytes()``), valid for ``lifetime`` seconds from ``now``."""
        expires = (get_dht_time() if now is None else now) + lifetime
        return cls(peer_id, expires, _token_mac(key, run_id, peer_id, expires))

    def to_bytes(self) -> bytes:
        """For a gather or a record: expires and the MAC, then the peer id."""
        return self._HEAD.pack(self.expires, self.mac) + self.peer_id

    @classmethod
    def from_bytes(cls, data: Any) -> MemberToken:
        """The token; ValueError where ``data`` is not one (another member's data may be anything)."""
        if not isinstance(data, bytes) or len(data) <= cls._HEAD.size:
            raise ValueError("not a member token")
        expires, mac = cls._HEAD.unpack_from(data)
        return cls(data[cls._HEAD.size:], expires, mac)


def _token_mac(key: SwarmKey, run_id: str, peer_id: bytes, expires: float) -> bytes:
    message = _framed(run_id.encode(), peer_id, struct.pack(">d", expires))
    return hmac.new(key.derive(MEMBER), message, hashlib.sha256).digest()


def member_token_refusal(key: SwarmKey, run_id: str, token: MemberToken, caller: bytes, *,
                         now: float | None = None) -> str | None:
    """Why ``token`` does not make ``caller`` (the authenticated peer id of whoever presents it, ``to_bytes()``)
    a member of ``run_id``; None where it does. A token is the caller's only: one copied from another member's
    gather is refused."""
    if not hmac.compare_digest(token.mac, _token_mac(key, run_id, token.peer_id, token.expires)):
        return "its token was not made with this swarm's key for this run"
    if not hmac.compare_digest(token.peer_id, caller):
        return "its token is another peer's"
    now = get_dht_time() if now is None else now
    if not (math.isfinite(token.expires) and now < token.expires):
        return f"its token expired {now - token.expires:.0f} s ago"
    return None


def _message_mac(key: bytes, message: Any) -> bytes:
    """The HMAC of a DHT request or response serialized with an empty ``auth.signature`` (the message itself is
    left as it is)."""
    unsigned = type(message)()
    unsigned.CopyFrom(message)
    unsigned.auth.signature = b""
    return hmac.new(key, unsigned.SerializeToString(deterministic=True), hashlib.sha256).digest()


class SwarmKeyAuthorizer(AuthorizerBase):
    """hivemind's DHT authorizer for a swarm key: pass ``authorizer=SwarmKeyAuthorizer(key)`` to ``hivemind.DHT``.

    A request carries ``auth.time``, a random ``auth.nonce`` and ``auth.signature = HMAC(k_dht_request, request)``;
    a node refuses one whose HMAC does not match (another key, or none), whose time is more than :data:`WINDOW`
    seconds from its clock, or whose nonce it has accepted already (nonces are kept while their request could still
    pass the window). A response carries the request's nonce and ``HMAC(k_dht_response, response)``, so a member also
    refuses the answers of a node that does not hold the key, and answers to another request. hivemind's servicer
    answers a refused request with nothing, which its caller gets as an error; this covers reads as well as writes.

    Not covered: hivemind does not tell the authorizer which node a request is for, so a request's proof is not
    bound to its recipient (another node, which has not seen its nonce, would accept it within the window; the
    requests travel encrypted between libp2p peers). Clocks more than ``WINDOW`` apart are refused."""

    def __init__(self, key: SwarmKey, *, window: float = WINDOW, clock: Callable[[], float] = get_dht_time):
        self.key = key
        self._request_key = key.derive(DHT_REQUEST)
        self._response_key = key.derive(DHT_RESPONSE)
        self._window = window
        self._clock = clock
        self._nonces: OrderedDict[bytes, float] = OrderedDict()  # accepted nonces, until when a replay could pass

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = self._clock()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = _message_mac(self._request_key, request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        if not hmac.compare_digest(auth.signature, _message_mac(self._request_key, request)):
            logger.debug("A DHT request not signed with this swarm's key was refused")
            return False
        now = self._clock()
        if not abs(auth.time - now) <= self._window:
            logger.debug(f"A DHT request signed {now - auth.time:.0f} s ago was refused (clocks apart, or a replay)")
            return False
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
        if len(auth.nonce) != NONCE_BYTES or auth.nonce in self._nonces:
            logger.debug("A DHT request was replayed and refused")
            return False
        # (a request signed at t passes the window until t + window <= now + 2 window)
        self._nonces[auth.nonce] = now + 2 * self._window
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = _message_mac(self._response_key, response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        if not hmac.compare_digest(auth.signature, _message_mac(self._response_key, response)):
            logger.debug("A DHT response not signed with this swarm's key was refused")
            return False
        if not hmac.compare_digest(auth.nonce, request.auth.nonce):
            logger.debug("A DHT response to another request was refused")
            return False
        return True
