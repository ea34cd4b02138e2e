"""The package version (its own leaf module: ops/compiler/compile.py keys the disk cache on it without importing
the package above it). Keep equal to pyproject.toml's."""

__version__ = "0.1.0"
