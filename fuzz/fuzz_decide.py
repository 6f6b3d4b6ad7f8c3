"""atheris: random bytes as request heads, framed by llhttp, into relay.core.decide.decide.

Also feeds the parts of each head to the pure helpers (target splitting, host parsing,
query parsing and signature stripping). A crash is an exception other than llhttp refusing
the bytes, or a broken invariant (fuzz/invariants.py).

    fuzz/.venv/bin/python fuzz/fuzz_decide.py -max_total_time=30 fuzz/corpus/decide
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["relay"]):
    from relay.core import auth, policy, target
    from relay.core.decide import decide
    from relay.core.model import Forward, Reject, RequestHead

import httptools

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from invariants import FORWARD_MODE, SETTINGS, TABLE, check_forward


class Heads:
    """Collects every complete request head llhttp frames from the input."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.heads: list[RequestHead] = []

    def on_message_begin(self) -> None:
        self.url, self.fields = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.heads.append(
            RequestHead(
                method=self.parser.get_method(),
                target=self.url,
                version=self.parser.get_http_version(),
                headers=tuple(self.fields),
                peer="192.0.2.7",
                upgrade=self.parser.should_upgrade(),
            )
        )


def test_one_input(data: bytes) -> None:
    heads = Heads()
    try:
        heads.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        pass
    except httptools.HttpParserError:
        pass  # llhttp refused the rest; the heads before it are still decided
    for head in heads.heads:
        for settings in (SETTINGS, FORWARD_MODE):
            result = decide(head, TABLE, settings, now=1_700_000_000, inflight={"sbx1": 0})
            assert isinstance(result, (Forward, Reject))
            if isinstance(result, Forward):
                assert head.method != b"CONNECT"
                # llhttp parses nothing after a head it stopped at as an upgrade: only a
                # WebSocket handshake may go on (a plain request's body would never follow).
                assert result.websocket or not head.upgrade, head
                check_forward(result, settings)
        split = policy.split_target(head.target)
        if not isinstance(split, Reject):
            assert split.clean_path == policy.clean_path(split.clean_path)
            query = split.raw_query or b""
            stripped = auth.strip_signature_params(query)
            assert auth.strip_signature_params(stripped) == stripped
            auth.go_parse_query(query)
        for name, value in head.headers:
            if name.lower() == b"host":
                target.normalise_host(value)
    # The pure helpers on raw input too, not only on what llhttp let through.
    policy.split_target(data)
    policy.percent_decode_path(data)
    auth.go_parse_query(data)
    target.normalise_host(data)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
