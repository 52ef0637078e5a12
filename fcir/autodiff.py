"""Automatic differentiation rules for the federated primitives (JVP, transpose,
partial evaluation, DCE). Importing ``fcir`` registers them."""
