"""The Python SDK: `Runtime` (a connection to a cluster) and `Artifact` handles."""
