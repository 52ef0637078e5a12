"""The Flower app an exported round runs as (copied into APPDIR/fcir_app/ by the export).

Imports only jax, numpy and flwr: a device installs those, never fcir.
"""
