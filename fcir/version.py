"""fcir's release number, which serialized modules record as their producer."""

__version__ = "0.1.0"
