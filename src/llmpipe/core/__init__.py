"""What every layer uses and nothing heavy: user errors, atomic file writes, content hashes (no torch or HF imports)."""
