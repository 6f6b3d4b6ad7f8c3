"""relay's pure decision core: no asyncio, sockets, clock, OS or logging imports.

Everything here takes plain data (``relay.core.model``) and returns plain data, so that the
rules of SPEC §1-§5 are testable as tables without a socket. ``tests/core/test_purity.py``
fails the build when a module here imports anything that does I/O.
"""
