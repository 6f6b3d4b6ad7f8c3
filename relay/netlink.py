"""The source address of upstream connections, checked over netlink at start (SPEC §4, §6).

envd runs without a token in "gateway auth" mode and trusts only the relay's address, so
relay must dial guests from exactly that address: ``upstream.source_address`` must be
assigned to a local interface, or ``upstream.source_interface`` names the interface whose
address to use. Either problem stops relay at start with exit 2 and a message naming the key,
rather than failing every upstream connect later with ``EADDRNOTAVAIL``.

``source_interface`` picks the interface's *first primary IPv4 address* in the kernel's order
(the one ``ip -4 addr show dev IF`` lists first; secondary addresses are skipped): guest
bridges are IPv4 in E2B's network layout. Set ``source_address`` to use anything else.

:func:`pick_source` is pure (a list of addresses in, an address or an error out). Reading the
addresses (:func:`read_addresses`) uses pyroute2, which runs its own asyncio loop; uvloop
cannot open ``AF_NETLINK`` datagram endpoints, so the dump runs in a short-lived thread on a
plain selector loop, whatever loop the caller runs. Reading addresses needs no capability.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from relay.config import ConfigError, Upstream

IFA_F_SECONDARY = 0x01  # linux/if_addr.h


@dataclass(frozen=True, slots=True)
class InterfaceAddress:
    interface: str
    family: int  # socket.AF_INET or socket.AF_INET6
    address: str
    prefixlen: int
    secondary: bool = False


def pick_source(
    addresses: Sequence[InterfaceAddress],
    interfaces: Sequence[str],
    *,
    source_address: str = "",
    source_interface: str = "",
) -> str | None:
    """The address to bind, or None when neither key is set; raises ConfigError naming it."""
    if source_address:
        wanted = ipaddress.ip_address(source_address)
        for item in addresses:
            if ipaddress.ip_address(item.address) == wanted:
                return str(wanted)
        raise ConfigError(
            f"upstream.source_address: {source_address} is not assigned to any local "
            f"interface (assigned: {_summary(addresses)})"
        )
    if source_interface:
        if source_interface not in interfaces:
            raise ConfigError(
                f"upstream.source_interface: no interface named {source_interface!r} "
                f"(interfaces: {', '.join(interfaces) or 'none'})"
            )
        for item in addresses:
            if (
                item.interface == source_interface
                and item.family == socket.AF_INET
                and not item.secondary
            ):
                return item.address
        raise ConfigError(
            f"upstream.source_interface: {source_interface} has no primary IPv4 address"
        )
    return None


def _summary(addresses: Sequence[InterfaceAddress]) -> str:
    return ", ".join(f"{a.address} on {a.interface}" for a in addresses) or "none"


def _dump() -> tuple[list[InterfaceAddress], list[str]]:
    from pyroute2 import IPRoute  # noqa: PLC0415 - heavy import, needed only at start

    loop = asyncio.SelectorEventLoop()
    try:
        with IPRoute(use_event_loop=loop) as ipr:
            names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
            out = []
            for msg in ipr.get_addr():
                address = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
                if not address:
                    continue
                flags = msg.get_attr("IFA_FLAGS")
                if flags is None:
                    flags = msg["flags"]
                out.append(
                    InterfaceAddress(
                        interface=str(names.get(msg["index"], msg["index"])),
                        family=int(msg["family"]),
                        address=str(address),
                        prefixlen=int(msg["prefixlen"]),
                        secondary=bool(int(flags) & IFA_F_SECONDARY),
                    )
                )
            return out, [str(n) for n in names.values()]
    finally:
        loop.run_until_complete(asyncio.sleep(0))  # let closed transports finish closing
        loop.close()


def read_addresses() -> tuple[list[InterfaceAddress], list[str]]:
    """All local addresses and interface names (netlink ``RTM_GETADDR``/``RTM_GETLINK``)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="netlink") as pool:
        return pool.submit(_dump).result()


def resolve_source(upstream: Upstream) -> str | None:
    """The checked source address for ``upstream``; raises ConfigError. Blocks briefly."""
    if not upstream.source_address and not upstream.source_interface:
        return None
    try:
        addresses, interfaces = read_addresses()
    except OSError as exc:
        key = "source_address" if upstream.source_address else "source_interface"
        raise ConfigError(f"upstream.{key}: cannot read local addresses: {exc}") from None
    return pick_source(
        addresses,
        interfaces,
        source_address=upstream.source_address,
        source_interface=upstream.source_interface,
    )


async def resolve_source_async(upstream: Upstream) -> str | None:
    if not upstream.source_address and not upstream.source_interface:
        return None
    return await asyncio.to_thread(resolve_source, upstream)
