"""Checkpoints: save, load, the manifest, optimizer state, conversion, and opening
whatever a path is (a checkpoint, a run folder, a full file, a Hugging Face folder)."""
