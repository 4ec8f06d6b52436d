"""cachefs: a read-through caching FUSE file system for ML training data in S3."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version, stamped from git at build time (setuptools-scm).
    __version__ = version("cachefs")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"
