"""OpenAI's Batch API, and the Files API its SDK flow uploads the input with.

- ``request``   a submission (a JSON body or a JSONL file) into validated lines, or a 400
                naming the line and the field.
- ``store``     batches, their lines and results in the database (``broker.db``).
- ``files``     uploaded files in the same database.
- ``runner``    in the background of every front door: claim batches, admit their sessions
                through the same admission as interactive traffic, publish their lines.
- ``collector`` write the workers' durable results to their lines.

The routes are ``api/routes/batches.py`` and ``api/routes/files.py``; the design is
``docs/batches.md``.
"""
