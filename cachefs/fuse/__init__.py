"""The FUSE kernel protocol, the device and the request server (see each module)."""
