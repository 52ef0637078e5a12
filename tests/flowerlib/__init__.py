"""Support for the Flower tests: corpus rounds on 3 clients, their node data files, and
the local deployment fixture's helpers."""
