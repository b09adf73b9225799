"""`tc top`: a live view of a cluster, built on the SDK only."""
