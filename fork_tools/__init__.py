"""Maintainer tools for the patch-series fork of PyTorch Lightning 1.6.5 (run as ``python -m fork_tools``)."""
