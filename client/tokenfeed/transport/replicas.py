"""Several servers behind one job: which replica a client tries, and in what order.

Every ``get`` is a pure function of its fields and the store, and the job id is a hash
of the plan inputs, the dataset build and the tenant, so any server over the same store
answers any request of a job identically. Replicas therefore need no coordination: a
client only has to pick one, and pick another when it stops answering.

Endpoints are given as a list, as one comma-separated string, or as a host name that
resolves to several addresses (a Kubernetes headless Service, a compose service scaled
to N). libzmq would connect a name to one of its addresses, so :class:`Replicas`
resolves every address itself with :func:`socket.getaddrinfo`, again before each
attempt, so that a restarted replica is found at its new address and one that came back
is used again.

Spread and failover are one rule, with no shared state: attempt ``i`` of the client in
slot ``s`` goes to address ``(s + i) mod n`` of the list resolved at that moment. The
slot is ``rank * num_workers + worker``, so the workers of a job start evenly over the
replicas, and each failover moves to the next one.

Address ``s mod n`` is the client's own replica (:meth:`Replicas.home`). A client that
failed over away from it asks it again every ``return_after`` seconds, on a socket of its
own while the stream goes on elsewhere; once it answers, the client goes back to it at a
request boundary (:mod:`tokenfeed.transport.homing`), so a replica that was paused or
restarted gets its workers back and the load is spread again.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from tokenfeed.errors import ConfigError
from tokenfeed.transport.endpoint import FORM, check_endpoint, split_tcp

__all__ = ["Replicas", "Resolved", "parse_endpoints", "resolve_host"]


def resolve_host(host: str, port: int) -> list[str]:
    """Every TCP address of ``host`` (IPv4 ones if it has any, else IPv6), in any order.

    IPv4 first, as libzmq does with its default ``IPV6=0``: ``localhost`` has both
    ``127.0.0.1`` and ``::1``, and a server listening on one of them must not look like
    a second, dead replica. Tests replace this function to resolve a made-up name.

    Raises:
        OSError: the name does not resolve (``socket.gaierror``).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    by_family: dict[int, set[str]] = {}
    for family, _, _, _, sockaddr in infos:
        by_family.setdefault(int(family), set()).add(str(sockaddr[0]))
    found = by_family.get(socket.AF_INET) or by_family.get(socket.AF_INET6) or set()
    return sorted(found)


def parse_endpoints(endpoints: str | Sequence[str]) -> tuple[str, ...]:
    """The endpoints named by a list or a comma-separated string, each checked.

    Raises:
        ConfigError: none given, a malformed one (naming it), or one given twice.
    """
    if isinstance(endpoints, str):
        items = [part.strip() for part in endpoints.split(",")] if "," in endpoints else [endpoints]
    elif isinstance(endpoints, list | tuple):
        items = list(endpoints)  # each item is checked below, whatever its type
    else:
        raise ConfigError(
            f"endpoint must be a string of the form {FORM}, a comma-separated string of "
            f"them or a list of them, got {type(endpoints).__name__}"
        )
    if not items:
        raise ConfigError(f"no endpoint given; expected {FORM} or a list of them")
    checked = tuple(check_endpoint(item) for item in items)
    seen: set[str] = set()
    for item in checked:
        if item in seen:
            raise ConfigError(f"endpoint {item!r} is given twice; name each replica once")
        seen.add(item)
    return checked


@dataclass(frozen=True)
class Resolved:
    """One resolution of every endpoint: the addresses in spread order, and failures."""

    addresses: tuple[str, ...]
    #: endpoint -> the addresses it resolved to
    found: dict[str, tuple[str, ...]]
    #: endpoint -> why it gave no address (its resolver error)
    failures: dict[str, str]


class Replicas:
    """The replicas of one client and which one to try next.

    Args:
        endpoints: as for :func:`parse_endpoints`.
        slot: this client's place among the job's clients (``rank * num_workers +
            worker``); attempt ``i`` goes to address ``(slot + i) mod n``.
    """

    def __init__(self, endpoints: str | Sequence[str], *, slot: int = 0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        if slot < 0:
            raise ConfigError(f"slot must be >= 0, got {slot}")
        self._slot = slot
        self._turn = slot
        #: the latest resolution (empty until :meth:`pick` or :meth:`resolve` ran)
        self.last = Resolved((), {}, {})
        #: times this client moved on to another replica (the one tried last failed);
        #: the client's side of failover counting (``FeedClient.replicas.failovers``)
        self.failovers = 0
        #: times this client went back to its own replica after a failover
        self.returns = 0

    def resolve(self) -> Resolved:
        """Resolve every endpoint now: addresses in the given order of the endpoints,
        each name's addresses sorted (so every process agrees on the order), no repeats.
        """
        addresses: list[str] = []
        by_endpoint: dict[str, tuple[str, ...]] = {}
        failures: dict[str, str] = {}
        for endpoint in self.endpoints:
            try:
                found = _addresses_of(endpoint)
            except OSError as exc:
                failures[endpoint] = f"can not resolve: {exc.strerror or exc}"
                continue
            if not found:
                failures[endpoint] = "resolves to no address"
            by_endpoint[endpoint] = tuple(found)
            addresses.extend(a for a in found if a not in addresses)
        self.last = Resolved(tuple(addresses), by_endpoint, failures)
        return self.last

    def pick(self, *, advance: bool) -> str | None:
        """The address to try now (resolved afresh), or None when nothing resolves.

        ``advance``: move on from the replica tried last (it failed); else try the same
        turn again (the first attempt, or a replica that answered but asked us to retry).
        """
        if advance:
            self._turn += 1
        addresses = self.resolve().addresses
        if advance and len(addresses) > 1:  # one replica: a reconnect, not a failover
            self.failovers += 1
        return addresses[self._turn % len(addresses)] if addresses else None

    @property
    def away(self) -> bool:
        """True when this client's turn is not its own replica (it failed over), as of
        the latest resolution."""
        n = len(self.last.addresses)
        return n > 1 and self._turn % n != self._slot % n

    def home(self) -> str | None:
        """This client's own replica, address ``slot mod n`` resolved now (None: nothing
        resolves). Resolving does not move the turn: :meth:`pick` goes on as before."""
        addresses = self.resolve().addresses
        return addresses[self._slot % len(addresses)] if addresses else None

    def went_home(self) -> None:
        """The client moved back to its own replica: the turn is that replica's again
        (failover goes on from there), and the return is counted."""
        n = len(self.last.addresses)
        if n:
            self._turn += (self._slot - self._turn) % n
        self.returns += 1

    @property
    def several(self) -> bool:
        """True when more than one replica is named or was last resolved."""
        return len(self.endpoints) > 1 or len(self.last.addresses) > 1

    def describe(self) -> str:
        """Every endpoint with what it resolved to, for an error message."""
        parts = []
        for endpoint in self.endpoints:
            failure = self.last.failures.get(endpoint)
            found = self.last.found.get(endpoint, ())
            if failure is not None:
                parts.append(f"{endpoint} ({failure})")
            elif found and found != (endpoint,):
                parts.append(f"{endpoint} (= {', '.join(found)})")
            else:
                parts.append(endpoint)
        return ", ".join(parts)


def _addresses_of(endpoint: str) -> list[str]:
    """The connectable addresses of one endpoint (a literal address is itself)."""
    if endpoint.startswith("ipc://"):
        return [endpoint]
    host, port = split_tcp(endpoint)
    literal = host[1:-1] if host.startswith("[") else host
    try:
        ipaddress.ip_address(literal.split("%", 1)[0])
    except ValueError:
        pass
    else:
        return [endpoint]
    # sorted: DNS answers rotate, and every client must see the same order
    return [_tcp(address, port) for address in sorted(set(resolve_host(host, port)))]


def _tcp(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"
