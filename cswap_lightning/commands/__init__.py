"""The `cswap` commands: tools built on the library; nothing in the core imports them."""
