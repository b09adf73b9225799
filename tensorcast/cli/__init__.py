"""`tc`: thin commands over the SDK, one module per command."""
