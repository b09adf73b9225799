"""Moving bytes: the native core (hashing, parallel file reads, copies) and local socket framing.

`tensorcast.transport.native` is the only importer of `tensorcast._native`.
"""
