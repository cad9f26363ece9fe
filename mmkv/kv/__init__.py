"""Pure KV and position math: chunks and their re-rotation."""
