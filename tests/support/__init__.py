"""Test doubles that speak E2B's real wire formats, for loopback tests of the relay.

- ``fake_envd.FakeEnvd``: envd (port 49983): Connect RPC (process, filesystem), /files, /health,
  control paths; optional access token; records every request; ``break_streams()``.
- ``fake_app.FakeApp``: an application port: HTTP echo, timed chunked stream, WebSocket echo.
- ``fake_api.FakeApi``: the control-plane calls the SDK makes to get a sandbox handle.
- ``connect``: envelope helpers and a raw asyncio Connect client (per-frame arrival times).
- ``sdk_scenario``: a script run with the real ``e2b`` SDK in its own virtualenv.
"""
