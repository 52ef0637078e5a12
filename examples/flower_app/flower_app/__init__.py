"""Flower's JAX app with an fcir round as its strategy (docs/flower_app.md)."""
