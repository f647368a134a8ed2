"""reverify: a published output scored again with another verifier, chunk by chunk, with no backend."""
