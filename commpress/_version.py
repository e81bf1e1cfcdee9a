"""The package version (one place; the package face and ``info`` read it)."""

__version__ = "0.1.0"
