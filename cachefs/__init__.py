"""cachefs: a read-through caching FUSE file system for ML training data in S3."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version, stamped from git at build time (setuptools-scm).
    #: (None when the metadata found first names no version: a build writing its
    #: ``cachefs.egg-info`` beside the source tree on the path, caught half-written.)
    __version__ = version("cachefs") or "0.0.0+unknown"
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"
