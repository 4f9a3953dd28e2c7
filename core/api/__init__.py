"""The API server layer: the Responses API over HTTP/SSE and WebSocket, its response store and its auth.

`store` keeps stored responses (``store=true``) in SQLite so a restart loses no conversation; `auth`
turns bearer API keys into a `Principal` (key fingerprint + tenant) and refuses unsafe binds.
"""

from __future__ import annotations
