"""Test doubles that speak E2B's real wire formats, for loopback tests of the relay.

- ``fake_envd.FakeEnvd``: envd (port 49983): Connect RPC (process, filesystem), /files, /health,
  control paths; optional access token; records every request; ``break_streams()``.
- ``fake_app.FakeApp``: an application port: HTTP echo, timed chunked stream, WebSocket echo.
- ``fake_api.FakeApi``: the control-plane calls the SDK makes to get a sandbox handle.
- ``connect``: envelope helpers and a raw asyncio Connect client (per-frame arrival times).
- ``sdk_scenario``: the driver run with the real ``e2b`` SDK (2.25, 2.52, 2.64) in its own
  virtualenv (``sdk_venv`` creates and caches those); one JSON line per check. Its checks are in
  the ``sdk_scenario_*`` modules, which import only the standard library and ``e2b``.
- ``sdk_matrix``: one run of the SDK matrix (a relay process, the fakes, the driver);
  ``compat_table`` renders the results as README.md's compatibility table.
- ``tunnel_proxy.TunnelProxy``: a loopback CONNECT proxy that maps only ``*.<test domain>:443``
  to one address, so that an SDK process reaches relay's TLS listener by name.
"""
