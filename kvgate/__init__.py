"""The composition root: the ``kvgate`` command and ``kvgate up``. The one package that may
import both ``api`` (the front door) and ``workers``; nothing imports it back
(``tests/test_layers.py`` walks the imports).

``kvgate.client`` is the exception that rides along: the client for agents, which imports
nothing of the server, so that an agent imports it without the server's dependencies."""
