"""fcir backends: ``reference`` (the oracle), ``xla`` and ``production``.

Imported as ``fcir.interpreters.*``; the core (``fcir``) never imports a backend.
"""
