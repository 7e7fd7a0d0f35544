"""The engine-core process, its clients and the wire between them."""
