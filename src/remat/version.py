"""The package version (one definition, read by the CLI and the package)."""

__version__ = "0.1.0"
