"""One module per CLI verb; each exposes ``register(subparsers)`` which adds its parser and
sets ``func`` to a callable ``(args) -> int`` (the exit status)."""
