"""Delivers the webhook outbox: claim due rows, POST signed JSON, retry with backoff, give up.

Rows are written by the ledger in the same transaction as the job event they announce (see
migration 0002), so a notification is never lost and never sent for a rolled-back change. Each
replica runs this loop; claims use SKIP LOCKED and a claim timeout, so a delivery is attempted by
one replica at a time and a crashed replica's claims come back.

Whoever can submit a job names a URL the scheduler will POST to, so a webhook must not become a
way into the scheduler's own network. Targets are public addresses only (`AddressPolicy`), unless
the operator allows more networks (`webhook_allowed_networks`). A name is resolved once, by
`PublicResolver`, and the connection goes to the addresses it vetted (no second lookup for a DNS
rebinding to answer differently); the Host header and TLS (SNI, certificate) still use the name.
Redirects are not followed. The delivery log shows users an outcome ("refused: not a public
address", "unreachable", "timeout", "HTTP 500"), never an exception's text: that would tell them
which internal hosts and ports answer. The details go to the scheduler's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from lorafleet.core.errors import InvalidArgument, is_retryable
from lorafleet.core.retry import backoff_delay
from lorafleet.core.webhooks import signed_headers
from lorafleet.ledger.ledger import Ledger, WebhookDelivery
from lorafleet.scheduler import metrics
from lorafleet.scheduler.notifications import WEBHOOK, Notifications

log = structlog.get_logger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# getaddrinfo's signature, narrowed to what the resolver passes (tests inject their own).
Lookup = Callable[..., Awaitable[list[tuple[Any, Any, Any, Any, Any]]]]

# What users read in the delivery log (ListWebhookDeliveries, `lorafleet webhooks`).
REFUSED = "refused: not a public address"
UNREACHABLE = "unreachable"
TIMEOUT = "timeout"
TLS_FAILED = "TLS handshake failed"
BAD_RESPONSE = "invalid response"
INVALID_URL = "invalid URL"

_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """`"127.0.0.0/8, 10.1.0.0/16"` as networks; ValueError names an entry that is not a CIDR
    (or has host bits set: `10.0.0.1/8` is more likely a typo than a wish)."""
    networks = []
    for entry in (e.strip() for e in text.split(",")):
        if entry:
            try:
                networks.append(ipaddress.ip_network(entry, strict=True))
            except ValueError as exc:
                raise ValueError(f"{entry!r} is not a network in CIDR form: {exc}") from None
    return tuple(networks)


def canonical_networks(text: str) -> str:
    """`text` checked by `parse_networks` and written canonically (`127.0.0.0/8,::1/128`)."""
    return ",".join(str(n) for n in parse_networks(text))


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, NAT64), which is where it leads."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private (incl. fc00::/7), link-local (incl. the
    cloud metadata address), CGNAT, multicast, unspecified, reserved or documentation ranges,
    nor an IPv6 address that embeds one of those."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return is_public(embedded)
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return False
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
        or address in _CGNAT
    )


@dataclass(frozen=True, kw_only=True)
class AddressPolicy:
    """Where webhooks may go: public addresses, and the networks the operator allows."""

    allowed_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_text(cls, networks: str) -> AddressPolicy:
        return cls(allowed_networks=parse_networks(networks))

    def permits(self, address: IPAddress) -> bool:
        candidates = [address]
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            candidates.append(embedded)
        if any(a in n for a in candidates for n in self.allowed_networks):
            return True
        return is_public(address)

    def check_url(self, url: str, field: str) -> None:
        """At submit: refuses a URL whose host is a literal address this policy forbids (names
        are vetted when delivering, since what they resolve to may change)."""
        address = _literal_address(url)
        if address is not None and not self.permits(address):
            raise InvalidArgument(
                field, "must not point at a loopback, private or reserved address"
            )


def _literal_address(url: str) -> IPAddress | None:
    try:
        host = URL(url).host
    except ValueError:
        return None
    if host is None:
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class NotPublicAddress(Exception):
    """A webhook host is, or resolves only to, addresses the policy forbids."""

    def __init__(self, host: str, addresses: Iterable[str]) -> None:
        self.addresses = list(addresses)
        super().__init__(f"{host} -> {', '.join(self.addresses) or 'no address'}")


class PublicResolver(AbstractResolver):
    """aiohttp's resolver that returns only addresses the policy permits.

    The connector connects to exactly these (they are numeric: no further lookup), and keeps the
    name for TLS. Addresses the policy forbids are dropped; a name with none left is refused.
    """

    def __init__(self, policy: AddressPolicy, *, lookup: Lookup | None = None) -> None:
        self._policy = policy
        self._lookup = lookup

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        lookup = self._lookup or asyncio.get_running_loop().getaddrinfo
        infos = await lookup(host, port, type=socket.SOCK_STREAM, family=family)
        vetted: list[ResolveResult] = []
        refused: list[str] = []
        for info_family, _, proto, _, sockaddr in infos:
            text = str(sockaddr[0])
            try:
                address = ipaddress.ip_address(text)
            except ValueError:
                refused.append(text)
                continue
            if not self._policy.permits(address):
                refused.append(text)
                continue
            vetted.append(
                ResolveResult(
                    hostname=host,
                    host=str(address),
                    port=int(sockaddr[1]),
                    family=info_family,
                    proto=proto,
                    flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                )
            )
        if not vetted:
            raise NotPublicAddress(host, refused)
        if refused:
            log.warning("webhook host has forbidden addresses; skipped", host=host, refused=refused)
        return vetted

    async def close(self) -> None:
        pass


def webhook_session(
    policy: AddressPolicy, *, timeout_s: float, lookup: Lookup | None = None
) -> aiohttp.ClientSession:
    """The HTTP client for deliveries: names resolve through the policy, and no proxy from the
    environment (it would connect on our behalf to addresses nobody vetted)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(resolver=PublicResolver(policy, lookup=lookup)),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        trust_env=False,
    )


def outcome(exc: BaseException) -> str:
    """What the delivery log says about a failed attempt: a word, never the exception's text."""
    if isinstance(exc, NotPublicAddress):
        return REFUSED
    if isinstance(exc, TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
        return TIMEOUT
    if isinstance(exc, aiohttp.InvalidURL):
        return INVALID_URL
    if isinstance(exc, aiohttp.ClientSSLError):
        return TLS_FAILED
    if isinstance(exc, aiohttp.ClientConnectionError):  # refused, reset, DNS, disconnected
        return UNREACHABLE
    return BAD_RESPONSE


class WebhookSender:
    def __init__(
        self,
        *,
        ledger: Ledger,
        notifications: Notifications,
        policy: AddressPolicy | None = None,
        lookup: Lookup | None = None,
        max_attempts: int = 8,
        backoff_s: float = 2.0,
        max_backoff_s: float = 600.0,
        timeout_s: float = 10.0,
        poll_s: float = 5.0,
    ) -> None:
        self._ledger = ledger
        self._policy = policy or AddressPolicy()
        self._lookup = lookup
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._wake = asyncio.Event()
        notifications.subscribe(WEBHOOK, lambda _payload: self._wake.set())

    def retry_delay(self, attempts: int) -> float | None:
        """Seconds before the next try after `attempts` failures, or None to give up."""
        if attempts >= self._max_attempts:
            return None
        # Full jitter: a receiver recovering from an outage sees its retries spread out.
        return backoff_delay(attempts - 1, initial_s=self._backoff_s, max_s=self._max_backoff_s)

    async def run(self) -> None:
        async with webhook_session(
            self._policy, timeout_s=self._timeout_s, lookup=self._lookup
        ) as http:
            while True:
                wait_s = self._poll_s
                try:
                    while await self.deliver_due(http):
                        pass
                    due = await self._ledger.next_webhook_due()
                    if due is not None:
                        # Sleep until the next retry is due (a NOTIFY for new work cuts it short).
                        wait_s = min(self._poll_s, max(0.0, due))
                except Exception as exc:
                    if not is_retryable(exc):
                        raise
                    log.warning("webhook round failed; the ledger is unavailable", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await self._wake.wait()
                self._wake.clear()

    async def deliver_due(self, http: aiohttp.ClientSession) -> int:
        """One batch of due deliveries; returns how many were attempted."""
        batch = await self._ledger.claim_webhook_deliveries(20, self._timeout_s * 3)
        await asyncio.gather(*(self._deliver(http, d) for d in batch))
        return len(batch)

    async def _deliver(self, http: aiohttp.ClientSession, delivery: WebhookDelivery) -> None:
        body = json.dumps(
            {"delivery_id": delivery.delivery_id, **delivery.payload}, sort_keys=True
        ).encode()
        headers = signed_headers(
            delivery.secret, body, event=delivery.event, delivery_id=delivery.delivery_id
        )
        status: int | None = None
        detail = ""
        try:
            # aiohttp connects to a literal address without asking the resolver: vet it here.
            literal = _literal_address(delivery.url)
            if literal is not None and not self._policy.permits(literal):
                raise NotPublicAddress(str(literal), [str(literal)])
            async with http.post(
                delivery.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                status = response.status
                if 200 <= status < 300:
                    await self._ledger.webhook_delivered(delivery.delivery_id, status)
                    metrics.WEBHOOK_DELIVERIES.inc()
                    log.info(
                        "webhook delivered", job_id=delivery.job_id, webhook_event=delivery.event
                    )
                    return
                error = f"HTTP {status}"
                if 300 <= status < 400:
                    error += " (redirects are not followed)"
                # For the operator's log; a bounded read (the receiver chooses the body's size).
                detail = (await response.content.read(200)).decode(errors="replace")
        except (NotPublicAddress, aiohttp.ClientError, TimeoutError) as exc:
            error = outcome(exc)
            detail = f"{type(exc).__name__}: {exc}"
        # A refusal is the URL's doing, not the receiver's: trying again cannot help.
        retry_in = None if error == REFUSED else self.retry_delay(delivery.attempts)
        await self._ledger.webhook_failed(delivery.delivery_id, status, error, retry_in)
        metrics.WEBHOOK_FAILURES.labels("retry" if retry_in is not None else "given_up").inc()
        log.warning(
            "webhook attempt failed" if retry_in is not None else "webhook given up",
            job_id=delivery.job_id,
            webhook_event=delivery.event,
            attempts=delivery.attempts,
            url=delivery.url,
            error=error,
            detail=detail,
        )
