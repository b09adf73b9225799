"""Worker: holds a slice of the tensor pool in shared memory and serves callers and peers."""
