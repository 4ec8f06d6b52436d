"""cachefs: a read-through caching FUSE file system for ML training data in S3."""

__version__ = "0.1.0"
