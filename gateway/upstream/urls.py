"""The one check of an upstream base URL, whatever way it came in (``--upstream-url``, its
environment variable, a ``--config`` table, the admin API and the WebUI, a row in the store),
and the secrets an upstream's URL and headers carry.

A URL httpx cannot send (CR/LF, no host, a bad port) must be refused where it enters, not
found at the first request as a 500. A link-local or cloud-metadata address
(169.254.169.254, fd00:ec2::254, metadata.google.internal) is where an instance's cloud
credentials live: whoever may add an upstream could make the gateway fetch them and relay
the answer, so those are refused unless ``--allow-upstream-host`` names the host. Only the
URL's literal host is judged: a DNS name that resolves to such an address is for the
network's egress policy (docs/operations.md, threat model).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

#: Host names of cloud metadata services (compared lower-case, without a trailing dot).
METADATA_HOSTS = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "metadata.azure.internal",
    "instance-data", "instance-data.ec2.internal",
})
#: Metadata addresses that are not link-local (AWS IPv6, Alibaba Cloud, Oracle's legacy).
METADATA_ADDRESSES = frozenset({
    ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200"),
    ipaddress.ip_address("192.0.0.192"),
})
#: Header names whose values are no secret (they are not added to the masked set: masking
#: a date such as ``api-version = 2024-10-21`` would mangle answers that mention it).
PUBLIC_HEADERS = frozenset({
    "api-version", "anthropic-version", "openai-beta", "user-agent", "accept", "accept-encoding",
    "content-type", "x-title", "http-referer", "referer",
})


class UpstreamURLError(ValueError):
    """Why a base URL is refused (one sentence naming the URL)."""


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` spells, including the legacy forms a resolver accepts
    (``2852039166``, ``0xa9.0xfe.0xa9.0xfe``, ``0251.0376.0251.0376``); None for a name."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        if not host or any(c not in "0123456789abcdefxABCDEFX." for c in host):
            return None
        try:
            address = ipaddress.ip_address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def refused_host(host: str) -> str | None:
    """Why ``host`` (a URL's host name, lower-case) may not be an upstream, or None."""
    name = host.rstrip(".").lower()
    if name in METADATA_HOSTS:
        return "is a cloud metadata service"
    address = _address(name)
    if address is None:
        return None
    if address in METADATA_ADDRESSES:
        return "is a cloud metadata address"
    if address.is_link_local:
        return "is a link-local address (cloud metadata services live there)"
    if address.is_unspecified:
        return "is the unspecified address"
    return None


def check_upstream_url(url: object, allowed_hosts: Iterable[str] | None = (), require_v1: bool = False) -> str:
    """``url`` if it can be an upstream base URL, else :class:`UpstreamURLError`.

    http or https, a host, a valid port, no control character or space, no fragment, a URL
    httpx can send; with ``require_v1`` its path ends in ``/v1``. ``allowed_hosts``: the
    hosts ``--allow-upstream-host`` lets through the link-local/metadata refusal; None
    skips that refusal (syntax only: the ``--config`` model, checked again at start-up).
    """
    if not isinstance(url, str) or not url:
        raise UpstreamURLError("an upstream URL must be a non-empty string")
    shown = without_userinfo(url).encode("unicode_escape").decode("ascii")[:200]  # a password is never echoed
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UpstreamURLError(f"{shown!r} holds a space or a control character (CR, LF, tab, ...)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        raise UpstreamURLError(f"{shown!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamURLError(f"{shown!r} is not an http:// or https:// URL with a host, e.g. http://my-vllm:8000/v1")
    if "#" in url:
        raise UpstreamURLError(f"{shown!r} has a fragment (#...): a base URL has none")
    if require_v1 and not parts.path.rstrip("/").endswith("/v1"):
        raise UpstreamURLError(f"{shown!r} must end in /v1 (requests go to <base URL>/chat/completions)")
    try:
        httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise UpstreamURLError(f"{shown!r} cannot be sent: {exc}") from None
    if allowed_hosts is not None:
        host = parts.hostname.rstrip(".").lower()
        reason = refused_host(host)
        if reason and host not in {h.strip().rstrip(".").lower().strip("[]") for h in allowed_hosts}:
            raise UpstreamURLError(f"{shown!r}: {parts.hostname} {reason}; refused unless --allow-upstream-host {parts.hostname}")
    return url


def without_userinfo(url: str) -> str:
    """``url`` without ``user:password@`` (what the admin API and the WebUI may show)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def url_secrets(url: str) -> list[str]:
    """The user name and password a URL carries, as written and decoded."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    if "@" not in parts.netloc:
        return []
    userinfo = parts.netloc.rsplit("@", 1)[0]
    found = [piece for piece in userinfo.split(":", 1) if piece]
    return found + [unquote(piece) for piece in found if unquote(piece) != piece]


def header_secrets(headers: dict[str, str]) -> list[str]:
    """The values of an upstream's configured headers (``api-key`` of Azure and the like),
    but for the few names that never carry a secret (:data:`PUBLIC_HEADERS`)."""
    out: list[str] = []
    for name, value in headers.items():
        if name.lower() in PUBLIC_HEADERS or not value:
            continue
        out.append(value)
        scheme, _, credential = value.partition(" ")  # "Bearer <token>", "Basic <b64>"
        if credential and scheme.isalpha():
            out.append(credential.strip())
    return out
