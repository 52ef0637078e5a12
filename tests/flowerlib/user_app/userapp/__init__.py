"""A Flower user's own app with fcir's round as its strategy."""
