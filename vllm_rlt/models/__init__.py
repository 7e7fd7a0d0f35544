"""Model families (one file each), the checkpoint loader, the registry and the built-in toy."""
