"""Wire and API models shared by ``api``, ``broker`` and ``workers``.

Wire messages between processes are ``msgspec`` structs (``schemas.wire``); the HTTP edge uses
pydantic models (``schemas.openai``). Closed vocabularies live in ``schemas.vocab``.
"""
