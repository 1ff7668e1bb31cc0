"""What the bytes mean: safetensors files, block checksums, the ``reshard.index.json``
manifest, foreign sources (HF, torch DCP), inspection and verification, and the collection
of what interrupted runs left. Modules are imported by name (this package re-exports
nothing, so importing one does not import torch through another)."""
